"""Scattered reads, as a shuffled epoch makes: answered by whole columns of the shards' tables.

Shards are made by tarfile and GNU tar. The column builder is called on real cached files
(opened as a worker opens them), and real agents (started through the CLI) answer reads
sent straight to their worker over ZeroMQ, as the loader sends them. What is checked:
every sample of a scattered read carries webdataset's bytes, whether the columns build
the reply (one copied frame) or the general path does (a shard with two layouts, layouts
of different lengths, a sample worth a file range, a run a file range would hold, too
little copy budget); a sample number past a shard's end is the error it always was.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from scripts.shard_maker import make_shard, synth_samples
from tests.helpers.streaming import reference
from tests.helpers.workers import cached_shards, read_from_worker, reply_digests
from wdscache.agent.sampletable import SampleTables
from wdscache.agent.scattered import scattered
from wdscache.agent.shardview import open_shard
from wdscache.agent.worker import DIRECT_GAP, MERGE_GAP
from wdscache.shared.layout import file_identity
from wdscache.shared.protocol import PREAD_BYTES


def opened(paths: list[Path]) -> list[tuple]:
    """Each shard as ``_read`` holds it for a streamed read: view, samples (a table, as a worker's),
    placer, count, and the gap across which its samples make one run."""
    tables = SampleTables(1 << 20)
    out = []
    for path in paths:
        walked = open_shard(path, url=str(path))
        tables.put(str(path), file_identity(path.stat()), walked.samples)
        view = open_shard(path, url=str(path), tables=tables)
        out.append((view, view.samples, view.samples.placed, len(view.samples), MERGE_GAP))
    return out


def digests_of(keys: list[str], table: list[int], layouts: list, frame: bytes) -> list[tuple[str, dict[str, str]]]:
    """Each sample of a column-built reply: its key and {ext: sha256} of its fields in ``frame``."""
    out, at = [], 0
    for key in keys:
        names = layouts[table[at]]
        assert table[at + 1] == 0  # every sample is in the one copied frame
        fields = table[at + 2 : at + 2 + 2 * len(names)]
        out.append(
            (
                key,
                {
                    ext: hashlib.sha256(frame[o : o + n]).hexdigest()
                    for ext, o, n in zip(names, fields[::2], fields[1::2])
                },
            )
        )
        at += 2 + 2 * len(names)
    assert at == len(table)
    return out


def scattered_items(counts: list[int], n: int, seed: int = 0, *, backwards: bool = False) -> list[tuple[int, int]]:
    """``n`` samples drawn across shards of ``counts`` samples, first and last of each among them;
    ``backwards``: each shard's in descending order (none starts just past the end of the one
    before it of its shard: no two of them make a run)."""
    rng = random.Random(seed)
    items = [(k, j) for k, c in enumerate(counts) for j in (0, c - 1)]
    items += [(k, rng.randrange(counts[k])) for k in (rng.randrange(len(counts)) for _ in range(n - len(items)))]
    rng.shuffle(items)
    if backwards:
        each = {k: iter(sorted((j for s, j in items if s == k), reverse=True)) for k in range(len(counts))}
        items = [(k, next(each[k])) for k, _ in items]
    return items


@pytest.mark.parametrize("tool", ["tarfile", "gnutar"])
def test_columns_give_each_sample_of_a_scattered_read_the_bytes_webdataset_reads(tmp_path, tool):
    paths = [make_shard(tmp_path / f"s{i}.tar", synth_samples(i, 30, payload=700), tool=tool) for i in range(3)]
    shards = opened(paths)
    ref = reference(paths, [str(p) for p in paths])
    items = scattered_items([30, 30, 30], 200, backwards=True)
    shard_of, index_of = [k for k, _ in items], [j for _, j in items]
    direct = {view: [k] for k, (view, *_) in enumerate(shards)}
    for files, held in (({}, shards), (direct, [(*shard[:4], DIRECT_GAP) for shard in shards])):  # streamed, direct
        got = scattered(shard_of, index_of, held, files, 8 << 20)
        assert got is not None
        frame = b"".join(got.pieces)
        expected = [list(ref.items())[30 * k + j] for k, j in items]
        assert digests_of(got.keys, got.table, got.layouts, frame) == [(key, fields) for (_, key), fields in expected]
        assert got.nbytes == sum(sum(n for n in got.table[3 + 8 * i : 8 * (i + 1) : 2]) for i in range(len(items)))
        assert set(got.views) == {view for view, *_ in shards}


def test_reads_the_columns_cannot_serve_are_left_to_the_general_path(tmp_path):
    plain = make_shard(tmp_path / "plain.tar", synth_samples(0, 10, payload=700))
    short = synth_samples(1, 10, payload=700)
    for s in short:
        del s["json"]  # two fields: a row of another length
    mixed = synth_samples(2, 10, payload=700)
    del mixed[3]["cls"]  # a shard with two layouts
    big = make_shard(tmp_path / "big.tar", synth_samples(3, 10, payload=PREAD_BYTES + 2000))
    paths = [plain, make_shard(tmp_path / "short.tar", short), make_shard(tmp_path / "mixed.tar", mixed), big]
    shards = opened(paths)
    direct = {view: [k] for k, (view, *_) in enumerate(shards)}
    read_direct = [(*shard[:4], DIRECT_GAP) for shard in shards]  # runs merge as far as a pread saves
    assert scattered([0, 0], [4, 1], shards, {}, 8 << 20) is not None
    assert scattered([0], [4], shards, {}, 8 << 20) is None  # one sample
    assert scattered([0, 1], [4, 1], shards, {}, 8 << 20) is None  # rows of three fields and of two
    assert scattered([2, 2], [4, 1], shards, {}, 8 << 20) is None  # two layouts in one shard
    assert scattered([0, 0], [4, 10], shards, {}, 8 << 20) is None  # past the shard's end
    assert scattered([3, 3], [4, 1], shards, {}, 8 << 20) is not None  # large samples, streamed: copied
    assert scattered([3, 3], [4, 1], read_direct, direct, 8 << 20) is None  # worth a file range each
    assert scattered([0, 0], [4, 1], shards, {}, 1000) is None  # more than the copy budget has room for
    assert scattered([0, 0, 0], [1, 3, 5], shards, {}, 8 << 20) is not None  # every other sample, streamed
    assert scattered([0, 0, 0], [1, 3, 5], read_direct, direct, 8 << 20) is None  # one file range, read directly
    assert scattered([0, 0, 0], [5, 3, 1], read_direct, direct, 8 << 20) is not None  # backwards: no run


def test_a_worker_answers_scattered_reads_with_webdatasets_bytes_whichever_way_it_builds_them(
    tmp_path, shard_server, start_agent
):
    specs = {
        "a.tar": synth_samples(0, 40, payload=600),
        "b.tar": synth_samples(1, 40, payload=600),
        "two-fields.tar": [{k: v for k, v in s.items() if k != "json"} for s in synth_samples(2, 40, payload=600)],
        "large.tar": synth_samples(3, 12, payload=PREAD_BYTES + 3000),
    }
    mixed = synth_samples(4, 40, payload=600)
    del mixed[5]["cls"]
    specs["two-layouts.tar"] = mixed
    tools = ["gnutar" if i % 2 else "tarfile" for i in range(len(specs))]
    paths, urls, cache = cached_shards(shard_server, start_agent, tmp_path, specs, tools)
    ref = list(reference(paths, urls).items())
    counts = [len(s) for s in specs.values()]
    first = [sum(counts[:k]) for k in range(len(counts))]  # each shard's first sample in ref
    reads = {
        "columns": scattered_items(counts[:2], 120, seed=1, backwards=True),
        "rows of two lengths": scattered_items(counts[:3], 120, seed=2),
        "large samples among small": scattered_items(counts[:4], 120, seed=3),
        "a shard of two layouts": scattered_items(counts, 150, seed=4),
    }
    for what, items in reads.items():
        for direct in (False, True):
            header, frames = read_from_worker(cache, urls, items, direct=direct)
            assert header["ok"], (what, header)
            # File ranges only for direct reads (of a large sample, or a run of samples).
            assert direct or "files" not in header, what
            got = reply_digests(cache, urls, items, header, frames)
            assert got == [ref[first[k] + j] for k, j in items], (what, direct)
            if what == "columns" or not direct:  # copied, into one frame
                assert {span[0] for span in header["spans"]} == {0} and len(frames) == 1, (what, direct)
    header, _ = read_from_worker(cache, urls, [(0, 3), (0, 40), (1, 2)])
    assert not header["ok"] and header["kind"] == "protocol" and f"{urls[0]} has no sample 40" in header["error"]
