"""A rank's reads, as an unshuffled epoch makes them: blocks of 8 neighbouring samples every
``W * 8`` positions, which a worker serves a shard's blocks at a time.

Real agents (started through the CLI) answer reads sent straight to their worker over
ZeroMQ, as the loader sends them, on shards made by tarfile and GNU tar. What is checked:
every sample of such a read carries webdataset's bytes, streamed and direct, however the
blocks fall (across a shard's end, single samples among them as the tail of an epoch deals
them, blocks read backwards, a shard of two layouts, samples far apart within a block, which
are no run); a block past a shard's end is the error it always was.
"""

from __future__ import annotations

from scripts.shard_maker import synth_samples
from tests.helpers.streaming import reference
from tests.helpers.workers import cached_shards, read_from_worker, reply_digests
from wdscache.agent.worker import DIRECT_GAP


def blocks(counts: list[int], world: int, rank: int, start: int = 0, n: int = 400) -> list[tuple[int, int]]:
    """Rank ``rank`` of ``world``'s items from position ``start`` of the shards' samples in order:
    the positions whose block of 8 is the rank's modulo ``world``, ``n`` at most."""
    order = [(k, j) for k, c in enumerate(counts) for j in range(c)]
    return [order[p] for p in range(start, len(order)) if (p // 8) % world == rank][:n]


def test_a_worker_answers_a_ranks_blocks_with_webdatasets_bytes(tmp_path, shard_server, start_agent):
    far = synth_samples(3, 60, payload=500)
    for sample in far[20:24]:  # a long key: a header of its own between samples, wider than a run's gaps
        sample["__key__"] = sample["__key__"] + "-" + "k" * (DIRECT_GAP + 1000)
    mixed = synth_samples(2, 60, payload=500)
    del mixed[13]["cls"]
    specs = {"a.tar": synth_samples(0, 100, payload=500), "b.tar": synth_samples(1, 100, payload=500)}
    specs |= {"two-layouts.tar": mixed, "far.tar": far}
    # (GNU tar: names of 255 bytes at most)
    tools = ["gnutar" if name == "b.tar" else "tarfile" for name in specs]
    paths, urls, cache = cached_shards(shard_server, start_agent, tmp_path, specs, tools)
    ref = reference(paths, urls)
    counts = [len(s) for s in specs.values()]
    tail = [(0, 96), (0, 98), (1, 0), (1, 2), (1, 4)]  # single samples, as an epoch's tail deals them
    reads = {
        "a rank of 4": blocks(counts, 4, 1),
        "a rank of 8, across shards": blocks(counts, 8, 7, start=40),
        "blocks then single samples": blocks(counts[:1], 4, 0, n=24) + tail,
        "blocks backwards": [item for k in range(10, 0, -1) for item in blocks(counts[:1], 10, 0)[8 * k - 8 : 8 * k]],
        "a shard of two layouts": blocks(counts, 3, 0, start=180, n=60),
        "samples far apart in a block": blocks(counts, 2, 1, start=260),
    }
    for what, items in reads.items():
        for direct in (False, True):
            header, frames = read_from_worker(cache, urls, items, direct=direct)
            assert header["ok"], (what, header)
            got = reply_digests(cache, urls, items, header, frames)
            assert got == [(key, ref[key]) for key, _ in got], (what, direct)
            assert [key[1] for key, _ in got] == [specs[paths[k].name][j]["__key__"] for k, j in items], (what, direct)
    header, _ = read_from_worker(cache, urls, [(0, 92), (0, 93), (0, 100), (0, 101)])
    assert not header["ok"] and header["kind"] == "protocol" and f"{urls[0]} has no sample 100" in header["error"]
