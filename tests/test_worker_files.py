"""What the agent's workers hold: shards indexed as soon as they are published, and no
evicted shard kept open (a descriptor or mapping would keep its disk space in use).

A real agent (started through the CLI) downloads from the loopback server; the
loader reads over real sockets; the workers are looked at through /proc.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.procs import files_held, rss_kib, worker_pids
from tests.helpers.streaming import reference
from tests.helpers.waits import wait_for
from tests.helpers.workers import as_written, read_from_worker, worker_socket
from wdscache import CachedMultiLoader, ShardClient
from wdscache.agent.growing import WALK_STEP
from wdscache.shared.layout import CacheLayout


def deleted_files_held(pid: int, under: Path) -> list[str]:
    """Files under ``under`` that process ``pid`` holds open or mapped after they were deleted."""
    fds, maps = files_held(pid, under)
    return [path for path in fds + maps if path.endswith(" (deleted)")]


@pytest.mark.slow
def test_workers_index_published_shards_before_anyone_reads_them(tmp_path, shard_server, dataset, start_agent):
    data = dataset(4, samples=20, payload=2000)
    shard_server.ttfb = 1.0  # the workers are up before any shard is published
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "4", "--workers", "2")
    # Each worker reports how many shards it has indexed, every second.
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 4 and all(w.get("indexed") == 4 for w in s["agent"]["workers"]),
        20,
        "both workers indexing the 4 shards",
    )
    # Each shard was walked by one worker; the other took its table, passed on by the agent.
    workers = s["agent"]["workers"]
    assert sum(w["walked"] for w in workers) == 4 and sum(w["adopted"] for w in workers) == 4, workers
    assert all(w["walked"] >= 1 for w in workers), workers  # the walks are shared out
    # Both serve every shard from the tables they hold, byte for byte, without a walk more.
    with CachedMultiLoader(cache_dir=agent.cache_dir, shuffle=False, timeout=30, request_size=3) as loader:
        got = {
            (x["__url__"], x["__key__"]): {
                k: hashlib.sha256(v).hexdigest() for k, v in x.items() if not k.startswith("__")
            }
            for x in loader
        }
    assert len(got) == 80 and got == reference(data.paths, data.urls)
    after = agent.wait_stats(
        lambda s: all(w.get("requests", 0) > 0 for w in s["agent"]["workers"]), 10, "both workers serving reads"
    )["agent"]["workers"]
    assert sum(w["walked"] for w in after) == 4, after
    assert "not taken" not in agent.stderr_text(), agent.stderr_tail()


@pytest.mark.slow
def test_shards_longer_than_a_walk_step_are_indexed_ahead_and_served_byte_for_byte(
    tmp_path, shard_server, dataset, start_agent
):
    data = dataset(3, samples=WALK_STEP * 2 + 30, payload=100)
    shard_server.ttfb = 1.0  # the workers are up before any shard is published
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "3", "--workers", "2")
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 3 and all(w.get("indexed") == 3 for w in s["agent"]["workers"]),
        30,
        "both workers indexing the 3 shards",
    )
    # Each walked by the worker a loader asks for it (list position modulo the workers).
    assert [w["walked"] for w in s["agent"]["workers"]] == [2, 1], s["agent"]["workers"]
    with CachedMultiLoader(cache_dir=agent.cache_dir, shuffle=False, timeout=30) as loader:
        got = {
            (x["__url__"], x["__key__"]): {
                k: hashlib.sha256(v).hexdigest() for k, v in x.items() if not k.startswith("__")
            }
            for x in loader
        }
    assert got == reference(data.paths, data.urls)
    assert sum(w["walked"] for w in agent.stats()["agent"]["workers"]) == 3


@pytest.mark.slow
def test_a_restarted_agent_walks_the_cached_shards_readers_want_next_before_any_read(
    tmp_path, shard_server, dataset, start_agent
):
    """A cache found at the start holds shards whose tables no worker has and none was kept
    (the budget had no room for them, say): the ones readers want next (the start-up window,
    while nobody reads) are walked ahead, each once, as a shard just downloaded is, so that a
    first read does not wait for its walk."""
    data = dataset(6, samples=20, payload=2000)
    cache = tmp_path / "cache"
    first = start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "6", "--workers", "2")
    first.wait_stats(lambda s: s["shards"]["cached"] == 6, 20, "the 6 shards cached")
    assert first.stop() == 0, first.stderr_tail()
    shutil.rmtree(CacheLayout.of(cache).tables_dir)
    again = start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "4", "--workers", "2")
    s = again.wait_stats(
        lambda s: all(w.get("indexed") == 4 for w in s["agent"]["workers"]),
        20,
        "both workers holding the tables of the start-up window's 4 cached shards",
    )
    workers = s["agent"]["workers"]
    assert s["shards"]["cached"] == 6 and s["shards"]["downloading"] == 0, s["shards"]
    # Walked once each, by the worker a loader asks for it, and passed on; nothing read yet.
    assert [w["walked"] for w in workers] == [2, 2] and sum(w["adopted"] for w in workers) == 4, workers
    assert all(w["requests"] == 0 for w in workers), workers

    def digest(x: dict) -> dict[str, str]:
        return {k: hashlib.sha256(v).hexdigest() for k, v in x.items() if not k.startswith("__")}

    # A loader that asked for no sample past its third shard (one read of 5 at a time): the
    # cached shard that came into its window (its first open's, shards 1 to 4) is walked ahead
    # of its reads; the last one as the window moves on; each once.
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30, request_size=5, inflight=1) as loader:
        it = iter(loader)
        got = {(x["__url__"], x["__key__"]): digest(x) for x in itertools.islice(it, 50)}
        s = again.wait_stats(
            lambda s: sum(w.get("walked", 0) for w in s["agent"]["workers"]) >= 5, 20, "the fifth shard walked ahead"
        )
        got.update({(x["__url__"], x["__key__"]): digest(x) for x in it})
    assert got == reference(data.paths, data.urls)
    s = again.wait_stats(lambda s: all(w.get("indexed") == 6 for w in s["agent"]["workers"]), 20, "all 6 tables held")
    assert sum(w["walked"] for w in s["agent"]["workers"]) == 6, s["agent"]["workers"]
    assert again.running(), again.stderr_tail()


@pytest.mark.slow
def test_workers_hold_their_walks_ahead_while_a_reader_waits_for_a_shard(tmp_path, shard_server, dataset, start_agent):
    """Walks ahead are speculative: a shard published while a reader waits for another one's
    download is walked (its table kept) only once that wait ends; one that a reader holds as
    it is published is walked at once, wait or not."""
    data = dataset(3, samples=20, payload=2000)
    unheld, held, waited = data.urls
    # The downloads go on when the test says (each stall is also bounded): first the two shards
    # published while the wait is on, then the one the reader waits for.
    publish, end_wait = threading.Event(), threading.Event()
    shard_server.fail(data.paths[2].name, "stall", after=1000, seconds=60, until=end_wait)
    for path in data.paths[:2]:
        shard_server.fail(path.name, "stall", after=0, seconds=60, until=publish)
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "1", "--workers", "2")
    tables = CacheLayout.of(agent.cache_dir)
    opened: list[str] = []
    try:
        with ShardClient(agent.cache_dir, timeout=30) as waiting, ShardClient(agent.cache_dir, timeout=30) as holding:
            reader = threading.Thread(target=lambda: opened.append(waiting.open(waited)), daemon=True)
            reader.start()
            agent.wait_stats(lambda s: s["agent"]["demanded"] >= 1, 20, "the reader's wait registered")
            publish.set()
            holding.open(held)  # the start-up plan publishes the unheld one meanwhile
            wait_for(lambda: tables.table_path(held).exists() or opened, 10, "the shard a reader holds walked")
            assert not opened, "the shard a reader holds was walked only once the other reader's wait ended"
            agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "the start-up shard published")
            # While the reader still waits, the shard nobody holds is not walked ahead.
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                assert not tables.table_path(unheld).exists(), "walked ahead while a reader waited"
                time.sleep(0.05)
            assert reader.is_alive() and not opened
            end_wait.set()
            reader.join(30)
            assert opened and not reader.is_alive()
            # Once it ends, the others are walked too, one walk each.
            wait_for(
                lambda: tables.table_path(unheld).exists() and tables.table_path(waited).exists(),
                20,
                "the other shards walked once the reader has its shard",
            )
    finally:
        publish.set()
        end_wait.set()
    s = agent.wait_stats(lambda s: sum(w.get("walked", 0) for w in s["agent"]["workers"]) == 3, 10, "3 walks")
    assert sum(w["walked"] for w in s["agent"]["workers"]) == 3, s["agent"]["workers"]


@contextmanager
def published_while_a_reader_waits(
    tmp_path: Path, shard_server: Any, dataset: Any, start_agent: Any, payload: int
) -> Iterator[tuple[Any, Any]]:
    """An agent with one worker whose first shard is published while a reader waits for the
    second one's download, which goes on when the block ends: walks ahead are held meanwhile.
    Yields the agent and the dataset (``urls``: the published shard's, the awaited one's)."""
    data = dataset(2, samples=20, payload=payload)
    waited = data.urls[1]
    publish, end_wait = threading.Event(), threading.Event()
    shard_server.fail(data.paths[0].name, "stall", after=0, seconds=60, until=publish)
    shard_server.fail(data.paths[1].name, "stall", after=1000, seconds=60, until=end_wait)
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "1", "--workers", "1")
    try:
        with ShardClient(agent.cache_dir, timeout=30) as waiting:
            reader = threading.Thread(target=lambda: waiting.open(waited), daemon=True)
            reader.start()
            agent.wait_stats(lambda s: s["agent"]["demanded"] >= 1, 20, "the reader's wait registered")
            publish.set()
            agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the other shard published")
            yield agent, data
            assert reader.is_alive(), "the wait ended too soon: the test shows nothing"
            end_wait.set()
            reader.join(30)
    finally:
        publish.set()
        end_wait.set()


@pytest.mark.slow
def test_a_worker_restarted_while_a_reader_waits_holds_its_walks_ahead_too(
    tmp_path, shard_server, dataset, start_agent
):
    """A worker that registers while the others hold their walks ahead (one restarted after a
    crash) is told to hold before it is told of the shards published meanwhile: it does not
    walk them ahead of what the reader waits for."""
    with published_while_a_reader_waits(tmp_path, shard_server, dataset, start_agent, 2000) as (agent, data):
        unheld, waited = data.urls
        tables = CacheLayout.of(agent.cache_dir)
        (old,) = worker_pids(agent.pid)
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: worker_pids(agent.pid) not in ([], [old]), 20, "the worker never restarted")
        # Once it answers a read (of the shard still downloading: "pending"), it has sent its
        # first report, which registers it; the agent then tells it of the published shard.
        header, _ = read_from_worker(agent.cache_dir, [waited], [(0, 0)])
        assert header.get("kind") == "pending", header
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            assert not tables.table_path(unheld).exists(), "the restarted worker walked ahead while a reader waited"
            time.sleep(0.05)
    wait_for(lambda: tables.table_path(unheld).exists(), 20, "the shard walked once the wait ended")


# The workers' hold of walks ahead lasts a second, renewed by the agent's loop every quarter of it:
# on a machine loaded enough to leave the agent unscheduled for longer, a walk may come first
# (speculative work done early, nothing wrong), and the test then sets the scene again.
HOLD_TRIES = 3


def test_a_published_shard_read_before_it_is_walked_is_served_from_its_file_not_copied(
    tmp_path, shard_server, dataset, start_agent
):
    """A shard read between its publication and its walk (here: walks held while a reader
    waits for another shard) is served as a walked one is: a consumer that sees the cache
    reads its payloads from the file itself, the worker copies none of them (a worker once
    copied up to a read's 32 samples, 320 MB of 10 MB samples, into its own memory)."""
    for attempt in range(HOLD_TRIES):
        where = tmp_path / f"try{attempt}"
        where.mkdir()
        with published_while_a_reader_waits(where, shard_server, dataset, start_agent, 20_000) as (agent, data):
            unheld = data.urls[0]
            layout = CacheLayout.of(agent.cache_dir)
            header, frames = read_from_worker(agent.cache_dir, [unheld], [(0, j) for j in range(20)], direct=True)
            walked_first = layout.table_path(unheld).exists()
        if not walked_first:
            break
    else:
        pytest.fail(f"walked before the read in {HOLD_TRIES} tries: the test shows nothing", pytrace=False)
    assert header.get("ok") and len(header["keys"]) == 20, header
    assert sum(len(f) for f in frames) < 20 * 20_000 // 10, "the worker sent payloads it copied"
    cache_file = layout.shard_path(unheld).read_bytes()
    ranges = header["files"]
    got = {}
    for key, exts, span in zip(header["keys"], header["exts"], header["spans"]):
        frame, places = span[0], span[1:]
        assert frame >= len(frames), f"{key}: its payloads came in a frame"
        _, start, size, *_ = ranges[frame - len(frames)]
        assert all(offset + n <= size for offset, n in zip(places[0::2], places[1::2]))
        got[(unheld, key)] = {
            ext: hashlib.sha256(cache_file[start + offset : start + offset + n]).hexdigest()
            for ext, offset, n in zip(exts, places[0::2], places[1::2])
        }
    assert got == reference(data.paths[:1], [unheld])


def test_workers_let_go_of_evicted_shards(tmp_path, shard_server, dataset, start_agent):
    data = dataset(8, samples=20, payload=2500)
    size = max(p.stat().st_size for p in data.paths)
    cache = tmp_path / "cache"
    agent = start_agent(
        cache,
        data.list_file,
        "--no-shuffle",
        "--prefetch",
        "2",
        "--workers",
        "2",
        "--cache-size",
        str(4 * size),
        "--min-free",
        "0",
    )
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        assert len(list(loader)) == 8 * 20
    # The budget holds 4 of the 8 shards: the others were evicted while the workers had read them.
    agent.wait_stats(lambda s: s["shards"]["cached"] <= 4, 20, "evictions")
    workers = worker_pids(agent.proc.pid)
    assert len(workers) == 2
    wait_for(
        lambda: not any(deleted_files_held(p, cache) for p in workers),
        10,
        lambda: f"workers still hold evicted shards: {[deleted_files_held(p, cache) for p in workers]}",
    )


def test_a_worker_imports_only_what_serving_needs() -> None:
    # The package's names resolve on first use, so a worker process does not carry the
    # loader, the agent or the command line (memory the agent's budget counts).
    code = "import json, sys, wdscache.agent.worker; print(json.dumps([m for m in sys.modules if m.startswith('wdscache')]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert not {"wdscache.training.loader", "wdscache.agent.core", "wdscache.cli", "wdscache.shared.stats"} & set(
        loaded
    ), loaded


def test_scattered_samples_come_in_one_copied_frame_long_runs_in_their_own(
    tmp_path, shard_server, dataset, start_agent
):
    from wdscache.agent.reply_frames import GATHER_BELOW

    small = dataset(1, samples=12, payload=3000, prefix="small")
    # payloads vary by up to 10% around the size asked for: each sample is a long run
    large = dataset(1, samples=6, payload=int(GATHER_BELOW * 1.25), prefix="large", list_name="large.txt")
    cache = tmp_path / "cache"
    both = tmp_path / "lists" / "both.txt"
    both.write_text("\n".join(small.urls + large.urls) + "\n")
    agent = start_agent(cache, both, "--no-shuffle", "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    ref = [list(reference(d.paths, d.urls).items()) for d in (small, large)]
    urls = [small.urls[0], large.urls[0]]
    cases = [
        ([(0, 0), (0, 3), (0, 6), (0, 9)], 1),  # four short runs: copied together
        ([(1, 0), (1, 2), (1, 4)], 3),  # long runs: each zero-copy in a frame of its own
        ([(1, 1), (1, 2), (1, 3)], 1),  # adjacent: one long run
        ([(1, 0), (0, 1), (1, 2), (0, 5), (0, 8)], 3),  # both: the copied frame first, then the long ones
        ([(0, 4), (0, 5)], 1),  # adjacent short ones: one run, sent as it is
    ]
    for items, n_frames in cases:
        header, frames = read_from_worker(cache, urls, items)
        assert header["ok"] and len(frames) == n_frames, (items, header.get("spans"), len(frames))
        for (k, j), key, exts, span in zip(items, header["keys"], header["exts"], header["spans"]):
            (_, want_key), want = ref[k][j]
            frame = frames[span[0]]
            got = {
                ext: hashlib.sha256(frame[off : off + size]).hexdigest()
                for ext, off, size in zip(exts, span[1::2], span[2::2])
            }
            assert (key, got) == (want_key, want), (items, k, j)


def test_a_direct_reply_names_a_range_per_block_of_a_ranks_samples_and_copies_runs_too_short_for_a_pread(
    tmp_path, shard_server, dataset, start_agent
):
    from wdscache.shared.protocol import PREAD_BYTES

    # samples of about 5.5 KB in the tar: two in a row are a run worth a pread, one between two is a gap to read
    large = dataset(1, samples=16, payload=3000, prefix="large")
    small = dataset(1, samples=16, payload=300, prefix="small", list_name="small.txt")  # about 2.8 KB
    urls = large.urls + small.urls
    both = tmp_path / "lists" / "both.txt"
    both.write_text("\n".join(urls) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, both, "--no-shuffle", "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    ref = [list(reference(d.paths, d.urls).items()) for d in (large, small)]
    paths = [CacheLayout.of(cache).shard_path(u) for u in urls]
    cases = [
        ([(0, 0), (0, 2), (0, 4)], 1, 0),  # every other sample (one of two DataLoader workers): one range
        ([(0, 0), (0, 1), (0, 8), (0, 9)], 2, 0),  # two blocks of a rank, others' samples between: two
        ([(1, 3), (1, 9), (1, 0)], 0, 1),  # small samples shuffled: copied into one frame, no range
        ([(1, 5), (0, 6), (0, 7), (1, 12), (1, 13)], 1, 1),  # both in one reply
    ]
    for items, n_ranges, n_frames in cases:
        header, frames = read_from_worker(cache, urls, items, direct=True)
        files = header.get("files", [])
        assert header["ok"] and (len(files), len(frames)) == (n_ranges, n_frames), (items, files, len(frames))
        assert all(size >= PREAD_BYTES for _, _, size, *_ in files), files
        for (k, j), key, exts, span in zip(items, header["keys"], header["exts"], header["spans"]):
            if span[0] < len(frames):
                source, base = frames[span[0]], 0
            else:
                shard, base, _, *_ = files[span[0] - len(frames)]
                assert shard == k, files
                source = paths[k].read_bytes()
            got = {
                ext: hashlib.sha256(source[base + off : base + off + size]).hexdigest()
                for ext, off, size in zip(exts, span[1::2], span[2::2])
            }
            (_, want_key), want = ref[k][j]
            assert (key, got) == (want_key, want), (items, k, j)


def test_any_mix_of_items_gets_each_samples_exact_bytes_and_neighbours_share_a_run(
    tmp_path, shard_server, dataset, start_agent
):
    """A worker serves a stretch of consecutive samples of one tuple of extensions from
    slices of the shard's table, and the others sample by sample: whatever a read mixes
    (stretches, single samples, one sample twice, two shards in turns, a sample with another
    extension, one behind a long PAX header), each sample is its exact bytes, in either mode,
    and neighbours in a shard share one run."""
    import random
    import tarfile

    rng = random.Random(5)
    path = shard_server.root / "mixed.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(24):
            key = "k" * 9000 if i == 11 else f"s{i:03d}"  # its PAX headers: 10 KB before each member
            for ext in ("cls", "jpg", "json", "txt") if i in (7, 15) else ("cls", "jpg", "json"):
                # a sample of 9 KB or more: a file range of its own, however it comes (see the runs below)
                data = rng.randbytes(rng.randint(2500, 3500))
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    other = dataset(1, samples=10, payload=8000, prefix="plain")
    urls = [shard_server.url(path.name), other.urls[0]]
    both = tmp_path / "lists" / "both.txt"
    both.write_text("\n".join(urls) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, both, "--no-shuffle", "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    ref = [list(reference([p], [u]).items()) for p, u in zip([path, other.paths[0]], urls)]
    assert [len(r) for r in ref] == [24, 10]
    paths = [CacheLayout.of(cache).shard_path(u) for u in urls]
    cases = [
        [(0, j) for j in range(24)],  # the whole shard in order
        [*[(0, j) for j in range(7)], *[(1, j) for j in range(5)], (0, 7), (0, 8)],  # in turns
        [(0, 9), (0, 10), (0, 11), (0, 12), (0, 13), (1, 9), (1, 8)],  # a long header among them
        [(0, 20), (0, 2), (0, 2), (1, 3), (0, 13), (0, 12), (0, 14)],  # mostly single samples
        [(1, j) for j in (0, 1, 2, 3, 3, 4, 5, 9)],  # a sample twice in a stretch
    ]
    for direct in (False, True):
        for items in cases:
            header, frames = read_from_worker(cache, urls, items, direct=direct)
            assert header["ok"], (items, header)
            files = header.get("files", [])
            for (k, j), key, exts, span in zip(items, header["keys"], header["exts"], header["spans"]):
                if span[0] < len(frames):
                    source, base = frames[span[0]], 0
                else:  # a range of the cache file, read here as the consumer reads it
                    shard, base, _, *_ = files[span[0] - len(frames)]
                    assert shard == k, (items, files)
                    source = paths[k].read_bytes()
                got = {
                    ext: hashlib.sha256(source[base + off : base + off + size]).hexdigest()
                    for ext, off, size in zip(exts, span[1::2], span[2::2])
                }
                (_, want_key), want = ref[k][j]
                assert (key, got) == (want_key, want), (direct, items, k, j)
    # A range per run: shard 0's samples 0-8 are one however they come (7 has another
    # extension), shard 1's 0-4 another; the long header parts 10 from 11; and a sample
    # asked for before the one asked last starts a run, as a sample asked twice does.
    runs = {
        1: 2,
        2: 4,  # 9-10, 11-13, shard 1's 9, its 8
        3: 7,  # 20, 2, 2 again, shard 1's 3, 13, 12, 14 (13 between them is more than a pread's worth)
    }
    for case, n in runs.items():
        header, _ = read_from_worker(cache, urls, cases[case], direct=True)
        assert len(header["files"]) == n, (cases[case], header["files"])
    # a sample past the end, alone or at the end of a stretch: the read fails, naming it
    for items in ([(0, 24)], [(0, 22), (0, 23), (0, 24)], [(1, 8), (1, 9), (1, 10), (1, 11)]):
        header, _ = read_from_worker(cache, urls, items)
        assert not header["ok"] and header["kind"] == "protocol", header
        assert "has no sample" in header["error"], header


def replied_fields(header: dict, frames: list, urls: list[str]) -> dict[tuple[str, str], dict[str, str]]:
    """(url, key) -> {ext: sha256} of a reply written out (``as_written``) whose payloads all came
    in its frames, the URL of each sample as ``urls`` names it, in order."""
    return {
        (url, key): {
            ext: hashlib.sha256(frames[span[0]][offset : offset + n]).hexdigest()
            for ext, offset, n in zip(exts, span[1::2], span[2::2])
        }
        for url, key, exts, span in zip(urls, header["keys"], header["exts"], header["spans"])
    }


def reads_answered(agent: Any, n: int) -> None:
    """Wait until the agent's one worker reports ``n`` reads answered (counted as each reply is queued)."""
    agent.wait_stats(
        lambda s: s["agent"]["workers"] and s["agent"]["workers"][0].get("requests", 0) >= n,
        20,
        f"the worker answering {n} read(s)",
    )


def download_held_at_20_mb(
    tmp_path: Path, shard_server: Any, dataset: Any, start_agent: Any, until: threading.Event, **stall: Any
) -> tuple[Any, Any, Path]:
    """An agent (one worker, one connection a download) downloading a shard of 12 samples of
    2 MB, held at 20 MB until ``until`` is set (``stall``: more of the fault's parameters):
    the agent, the dataset and the partial file, once it holds those 20 MB."""
    data = dataset(1, samples=12, payload=2_000_000)
    shard_server.fail(data.paths[0].name, "stall", after=20_000_000, seconds=60, until=until, **stall)
    cache = tmp_path / "cache"
    agent = start_agent(
        cache, data.list_file, "--no-shuffle", "--workers", "1", "--prefetch", "1", "--download-parts", "1"
    )
    partial = CacheLayout.of(cache).partial_path(data.urls[0])
    wait_for(lambda: partial.exists() and partial.stat().st_size >= 20_000_000, 20, "the download never got far")
    return agent, data, partial


@pytest.mark.slow
def test_a_shard_read_as_it_downloads_is_sent_from_its_file_not_copied(tmp_path, shard_server, dataset, start_agent):
    """A worker serves a download's complete samples from a mapping of its partial file, as
    it serves a cached shard: a reply its consumer has not taken yet holds no copy of them
    in the worker's own memory (it once held a read's 32 samples, 320 MB of 10 MB ones),
    and the pages it sent leave the worker's memory."""
    from wdscache.shared.protocol import pack, pack_numbers, unpack

    resume = threading.Event()
    try:
        agent, data, _ = download_held_at_20_mb(tmp_path, shard_server, dataset, start_agent, resume)
        ((url,), cache) = data.urls, agent.cache_dir
        worker = worker_pids(agent.pid)[0]
        before, file_pages = rss_kib(worker, "RssAnon"), rss_kib(worker, "RssFile")
        # It takes in little until we read: the reply waits in the worker.
        with worker_socket(cache, "late", RCVHWM=1, RCVBUF=64 << 10) as (sock, proofs):
            request = {"op": "read", "id": "r1", "auth": proofs.request("r1"), "urls": [url]}
            sock.send_multipart(pack(request, pack_numbers([x for j in range(8) for x in (0, j)])))
            reads_answered(agent, 1)  # the reply made and queued; most of it not sent yet
            held = rss_kib(worker, "RssAnon") - before
            assert sock.poll(10_000), "no reply from the worker within 10 s"
            header, frames = as_written(*unpack(sock.recv_multipart()))
        assert header.get("ok") and header["proof"] == proofs.reply("r1"), header
        assert held < 4 * 1024, f"the worker held {held} KiB of its own memory for a 16 MB reply"
        want = reference(data.paths, data.urls)
        assert replied_fields(header, frames, [url] * 8) == {k: want[k] for k in list(want)[:8]}
        wait_for(
            lambda: rss_kib(worker, "RssFile") - file_pages < 2 * 1024,
            5,
            lambda: f"the worker kept {rss_kib(worker, 'RssFile') - file_pages} KiB of file pages it had sent",
        )
    finally:
        resume.set()
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the download never ended")


@pytest.mark.slow
def test_a_download_that_starts_over_under_a_waiting_reply_leaves_it_whole_then_goes(
    tmp_path, shard_server, dataset, start_agent
):
    """A download starts over (its source changed) while a reply sent from its mapped file
    waits for its consumer: the worker goes on, the reply holds the bytes it named (the
    old version's: the new download is a new file), and the deleted file's mapping, so its
    disk space, goes once the reply is taken."""
    from tests.helpers.versions import another_version, replace
    from wdscache.shared.protocol import pack, pack_numbers, unpack

    first, second = threading.Event(), threading.Event()
    try:
        agent, data, partial = download_held_at_20_mb(tmp_path, shard_server, dataset, start_agent, first, then="close")
        ((url,), cache, name) = data.urls, agent.cache_dir, data.paths[0].name
        want = reference(data.paths, data.urls)
        old = partial.stat().st_ino
        (worker,) = worker_pids(agent.pid)
        with worker_socket(cache, "late", RCVHWM=1, RCVBUF=64 << 10) as (sock, proofs):
            # Three replies of 16 MB: the socket takes in the first whole, the others wait in the worker.
            for rid in ("r1", "r2", "r3"):
                request = {"op": "read", "id": rid, "auth": proofs.request(rid), "urls": [url]}
                sock.send_multipart(pack(request, pack_numbers([x for j in range(8) for x in (0, j)])))
            wait_for(
                lambda: any(m.startswith(str(partial)) for m in files_held(worker, cache)[1]),
                10,
                "the worker never mapped the download",
            )
            # The source changes: the resume meets another version and starts over in a new file.
            replace(data.paths[0], another_version(data.paths[0].read_bytes()))
            shard_server.fail(name, "stall", after=1_000_000, seconds=60, until=second)
            first.set()
            wait_for(lambda: partial.exists() and partial.stat().st_ino != old, 20, "the download never started over")
            assert deleted_files_held(worker, cache), "the replies were sent already: the test shows nothing"
            replies = []
            for _ in range(3):
                assert sock.poll(10_000), "no reply from the worker within 10 s"
                replies.append(as_written(*unpack(sock.recv_multipart())))
        for header, frames in replies:
            assert header.get("ok"), header
            assert replied_fields(header, frames, [url] * 8) == {k: want[k] for k in list(want)[:8]}
        assert worker_pids(agent.pid) == [worker], "the worker died"
        wait_for(
            lambda: not deleted_files_held(worker, cache),
            5,
            lambda: f"the worker still holds {deleted_files_held(worker, cache)}",
        )
    finally:
        first.set()
        second.set()
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the download never ended")


def test_a_read_of_more_downloads_than_a_worker_keeps_open_is_served(tmp_path, shard_server, dataset, start_agent):
    """A read may name more shards still downloading than a worker keeps open (a shuffled
    read while many download): the ones it lets go of meanwhile still serve that read."""
    from wdscache.agent.open_shards import OPEN_SHARDS

    n = OPEN_SHARDS + 2
    data = dataset(n, samples=20, payload=2000)
    resume = threading.Event()
    for path in data.paths:
        shard_server.fail(path.name, "stall", after=20_000, seconds=60, until=resume)
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    args = ("--no-shuffle", "--workers", "1", "--prefetch", str(n), "--download-workers", str(n))
    agent = start_agent(cache, data.list_file, *args)
    try:
        wait_for(
            lambda: all(
                layout.partial_path(u).exists() and layout.partial_path(u).stat().st_size >= 20_000 for u in data.urls
            ),
            20,
            "the downloads never got far",
        )
        items = [(k, j) for j in range(3) for k in range(n)]  # shards in turn, as a shuffled read takes them
        header, frames = read_from_worker(cache, data.urls, items)
    finally:
        resume.set()
    assert header.get("ok"), header
    want = reference(data.paths, data.urls)
    got = replied_fields(header, frames, [data.urls[k] for k, _ in items])
    assert len(got) == len(items) and got == {uk: want[uk] for uk in got}
    agent.wait_stats(lambda s: s["shards"]["cached"] == n, 20, "the downloads never ended")


def test_reply_frames_copy_short_runs_within_the_room_left() -> None:
    from wdscache.agent import reply_frames
    from wdscache.shared.protocol import PREAD_BYTES

    class Mapped:
        """A mapped shard's stand-in: its bytes, and pages to drop."""

        def __init__(self, data: bytes) -> None:
            self.data = memoryview(data)

        def drop_pages(self, start: int, end: int) -> None:
            pass

    def run(data: bytes) -> tuple[Mapped, int, int]:
        return Mapped(data), 0, len(data)

    def frames_of(runs: list, room: int = reply_frames.GATHER_MAX) -> tuple[list[bytes], list[tuple[int, int]]]:
        frames, ranges, places = reply_frames.ReplyFrames().make(runs, room, {})
        assert ranges == []
        return [bytes(f) for f in frames], places

    short = reply_frames.GATHER_BELOW - 1
    runs = [run(bytes([i]) * size) for i, size in enumerate([10, reply_frames.GATHER_BELOW, 20, 30])]
    frames, places = frames_of(runs)
    assert [len(f) for f in frames] == [60, reply_frames.GATHER_BELOW]  # the short ones copied together, first
    assert places == [(0, 0), (1, 0), (0, 10), (0, 30)]  # each run's frame, and where in it the run starts
    # past the room (GATHER_MAX, or what the worker's budget leaves), runs go as they are
    many = [run(bytes([i]) * short) for i in range(40)]
    frames, places = frames_of(many)
    copied = reply_frames.GATHER_MAX // short
    assert len(frames[0]) == copied * short and len(frames) == 1 + 40 - copied
    assert all(frames[f][base + 3] == i for i, (f, base) in enumerate(places))
    assert len(frames_of(many[:3], room=0)[0]) == 3
    # one short run alone gains nothing from a copy
    assert frames_of(runs[:1]) == ([bytes(10)], [(0, 0)])

    # runs of a file the consumer reads itself are named, never touched, and numbered after the
    # frames; those too short for a pread are copied with the short runs, while there is room
    mapped = Mapped(bytes(range(256)) * 200)
    files = {mapped: [3, 1, 2, 3, 4]}
    long_run = (mapped, 100, 100 + PREAD_BYTES)
    runs = [long_run, run(b"a" * 10), run(b"b" * 20), (mapped, 7, 9)]
    frames, ranges, places = reply_frames.ReplyFrames().make(runs, reply_frames.GATHER_MAX, files)
    assert [bytes(f) for f in frames] == [b"a" * 10 + b"b" * 20 + bytes([7, 8])]
    assert ranges == [[3, 100, PREAD_BYTES, 1, 2, 3, 4]]
    assert places == [(1, 0), (0, 0), (0, 10), (0, 30)]
    frames, ranges, places = reply_frames.ReplyFrames().make(runs, 30, files)  # no room left for the last
    assert [bytes(f) for f in frames] == [b"a" * 10 + b"b" * 20]
    assert [r[1:3] for r in ranges] == [[100, PREAD_BYTES], [7, 2]]
    assert places == [(1, 0), (0, 0), (0, 10), (2, 0)]


def test_shard_pages_leave_a_workers_memory_once_sent_however_late(tmp_path, shard_server, dataset, start_agent):
    """A worker sends zero-copy from its mapped shards, and ZeroMQ faults those pages into
    its memory as it sends: with a consumer that takes its replies late (a busy machine),
    long after the request. They must leave the worker's memory once sent."""

    from wdscache.shared.protocol import pack, pack_numbers, unpack

    data = dataset(2, samples=12, payload=400_000)  # too large to copy: each reply is one zero-copy run
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle", "--workers", "1", "--prefetch", "2")
    agent.wait_stats(
        lambda s: s["shards"]["cached"] == 2 and s["agent"]["workers"][0].get("indexed") == 2,
        20,
        "the worker indexing both shards",
    )
    worker = worker_pids(agent.pid)[0]
    before = rss_kib(worker, "RssFile")
    # It takes in little until we read: the worker's sends wait.
    with worker_socket(cache, "late", RCVHWM=1, RCVBUF=64 << 10) as (sock, proofs):
        for k in range(2):  # each shard in two reads of 6 samples: 4 replies of 2.4 MB
            for first in (0, 6):
                sock.send_multipart(
                    pack(
                        {
                            "op": "read",
                            "id": f"{k}-{first}",
                            "auth": proofs.request(f"{k}-{first}"),
                            "urls": [data.urls[k]],
                        },
                        pack_numbers([x for j in range(first, first + 6) for x in (0, j)]),
                    )
                )
        reads_answered(agent, 4)  # the replies made and queued; most of them not sent yet
        got = 0
        for _ in range(4):
            assert sock.poll(10_000), "no reply from the worker within 10 s"
            header, frames = unpack(sock.recv_multipart())
            assert header["ok"] and len(header["keys"]) == 6 and header["proof"] == proofs.reply(header["id"]), header
            got += sum(len(f) for f in frames)
        assert got >= 4 * 6 * 400_000 * 0.9
    wait_for(
        lambda: rss_kib(worker, "RssFile") - before < 2 * 1024,
        5,
        lambda: f"the worker kept {rss_kib(worker, 'RssFile') - before} KiB of shard pages it had sent",
    )
