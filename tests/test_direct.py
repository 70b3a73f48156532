"""Direct reads: consumers copy payloads from the agent's cache files themselves.

Real agents (started through the CLI) download from the loopback server; the loader
runs in this process, so its mappings can be looked at in /proc/self/maps. What is
checked: the same bytes as webdataset's reader with direct reads on and off, on
shards others made; the worker names file ranges only to a consumer that asks; a file
replaced since the worker read it is refused; a consumer that cannot read the cache
falls back to the workers' bytes; no open file outlives its pin, and none is mapped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.shard_maker import write_url_list
from tests.helpers.procs import files_held
from tests.helpers.streaming import reference
from tests.helpers.testdata import NEEDS_TESTDATA, REAL_SHARDS, TESTDATA
from tests.helpers.workers import read_from_worker
from wdscache import CachedMultiLoader
from wdscache.shared.errors import ProtocolError
from wdscache.shared.layout import CacheLayout, file_identity
from wdscache.training import direct as direct_reads
from wdscache.training.direct import CacheFiles, FileRange, StaleFile


def digests(samples: list[dict]) -> dict[tuple[str, str], dict[str, str]]:
    return {
        (s["__url__"], s["__key__"]): {k: hashlib.sha256(v).hexdigest() for k, v in s.items() if not k.startswith("__")}
        for s in samples
    }


def cache_files_held(cache: Path) -> tuple[list[str], list[str]]:
    """Cache files this process holds open, and those it maps."""
    return files_held("self", cache / "shards")


@NEEDS_TESTDATA
def test_real_shards_stream_like_webdataset_with_direct_reads_on_and_off(
    tmp_path, shard_server, start_agent, monkeypatch
):
    for name in REAL_SHARDS:
        shutil.copy(TESTDATA / name, shard_server.root / name)
    paths = [shard_server.root / name for name in REAL_SHARDS]
    urls = [shard_server.url(name) for name in REAL_SHARDS]
    cache = tmp_path / "cache"
    agent = start_agent(cache, write_url_list(tmp_path / "lists" / "real.txt", urls), "--workers", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == len(urls), 20, "every shard cached")
    ref = reference(paths, urls)
    real_range, ranges = CacheFiles.range, []

    def counted(self, url, *args):  # a spy: the real method, counted
        ranges.append(url)
        return real_range(self, url, *args)

    monkeypatch.setattr(CacheFiles, "range", counted)
    for direct in (True, False):
        ranges.clear()
        with CachedMultiLoader(cache_dir=cache, shuffle=False, direct_reads=direct, timeout=30) as loader:
            got = list(loader)
        # read from the files: every shard with direct reads (sample.tgz is cached as its tar) but
        # compressed.tar, whose three samples are too few bytes for a pread, none without
        assert set(ranges) == (set(urls[1:]) if direct else set()), direct
        assert [(s["__url__"], s["__key__"]) for s in got] == list(ref), direct
        assert digests(got) == ref, direct
        assert all(isinstance(v, bytes) for s in got for k, v in s.items() if not k.startswith("__"))


def test_a_worker_names_file_ranges_only_to_a_consumer_that_asks(tmp_path, dataset, start_agent):
    data = dataset(2, samples=6, payload=30_000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    ref = list(reference(data.paths, data.urls).values())
    items = [(0, 1), (0, 2), (0, 3), (1, 0)]  # a run of three samples, and one sample of the other shard
    paths = [CacheLayout.of(cache).shard_path(u) for u in data.urls]
    identity = [list(file_identity(os.stat(p))) for p in paths]

    plain, frames = read_from_worker(cache, data.urls, items)
    assert "files" not in plain and sum(map(len, frames)) >= 4 * 30_000 * 0.9  # every byte sent

    header, frames = read_from_worker(cache, data.urls, items, direct=True)
    assert header["ok"] and frames == []  # not a payload byte sent
    assert [(k, ident) for k, _, _, *ident in header["files"]] == [(0, identity[0]), (1, identity[1])]
    assert [span[0] for span in header["spans"]] == [0, 0, 0, 1]
    runs = []
    for k, start, size, *_ in header["files"]:
        with open(paths[k], "rb") as f:
            f.seek(start)
            runs.append(f.read(size))
    for (shard, j), span in zip(items, header["spans"]):
        got = [hashlib.sha256(runs[span[0]][off : off + n]).hexdigest() for off, n in zip(span[1::2], span[2::2])]
        assert got == list(ref[6 * shard + j].values()), (shard, j)


def test_a_cache_file_replaced_or_gone_is_refused(tmp_path):
    cache = tmp_path / "cache"
    url = "http://example.invalid/a.tar"
    path = CacheLayout.of(cache).shard_path(url)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"first" * 1000)
    identity = file_identity(os.stat(path))
    files = CacheFiles(str(cache))
    assert files.range(url, identity, 5, 10).read(0, 10) == b"firstfirst"
    with pytest.raises(ProtocolError, match="past the end"):
        files.range(url, identity, 4990, 11)
    # A new download is a new file, published by rename: its bytes are never taken for the old one's.
    new = path.with_name("new")
    new.write_bytes(b"other" * 1000)
    os.replace(new, path)
    # the descriptor held is of the file the worker read: still the right bytes
    assert files.range(url, identity, 0, 5).read(0, 5) == b"first"
    # the worker names the new file: the old descriptor goes, the new file is read
    assert files.range(url, file_identity(os.stat(path)), 0, 5).read(0, 5) == b"other"
    with pytest.raises(StaleFile, match="replaced"):
        files.range(url, identity, 0, 5)  # the old one, again: gone from the path
    assert files.fds == {}
    path.unlink()
    with pytest.raises(StaleFile, match="no longer"):
        files.range(url, identity, 0, 5)
    files.close()


def test_a_consumer_that_cannot_read_the_cache_gets_the_bytes_from_the_workers(
    tmp_path, dataset, start_agent, monkeypatch, caplog
):
    # Injected: tests run as root, whom no file mode stops.
    import wdscache.training.direct

    real_open = os.open

    def denied(path, flags, *args):
        if str(path).startswith(str(cache / "shards")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    data = dataset(3, samples=8, payload=20_000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--workers", "2", "--prefetch", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "every shard cached")  # else some are streamed
    monkeypatch.setattr(wdscache.training.direct.os, "open", denied)
    with caplog.at_level(logging.WARNING, logger="wdscache.training.stream"):
        # requests of 4: several in flight when direct reads are turned off, each sent again
        with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30, request_size=4) as loader:
            got = list(loader)
            again = list(loader)  # the next epoch does not try again
    assert digests(got) == digests(again) == reference(data.paths, data.urls)
    assert len(got) == 24
    warnings = [r.getMessage() for r in caplog.records if "cannot read the cache files" in r.getMessage()]
    assert len(warnings) == 1 and "Permission denied" in warnings[0], warnings


def test_a_file_replaced_under_one_read_costs_that_read_only(tmp_path, dataset, start_agent, monkeypatch, caplog):
    # Injected: a file replaced between a worker's read and ours needs an agent restart to happen for real.
    import errno

    from wdscache.training.direct import FileRange

    # payloads large enough to be read one by one (see replies.read_dense), so each is a call
    data = dataset(3, samples=8, payload=40_000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--workers", "2", "--prefetch", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "every shard cached")  # else some are streamed
    real_read, calls = FileRange.read, []

    def once_stale(self, offset, size):
        calls.append(offset)
        if len(calls) == 1:
            raise StaleFile(errno.ESTALE, "replaced since the worker read it")
        return real_read(self, offset, size)

    monkeypatch.setattr(FileRange, "read", once_stale)
    with caplog.at_level(logging.WARNING, logger="wdscache.training.stream"):
        with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30, request_size=4) as loader:
            got = list(loader)
    assert digests(got) == reference(data.paths, data.urls) and len(got) == 24
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    # one read of 4 samples came over the socket; every other payload was read from the files
    assert len(calls) == 1 + 3 * (24 - 4), len(calls)


def test_a_consumer_holds_cache_files_open_only_while_pinned_and_never_maps_them(
    tmp_path, dataset, start_agent, monkeypatch
):
    data = dataset(3, samples=40, payload=30_000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--workers", "2", "--prefetch", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "every shard cached")
    layout = CacheLayout.of(cache)
    opened: list[str] = []
    real_open = CacheFiles._open

    def counted(self, url, identity):  # a spy: the real method, counted
        opened.append(url)
        return real_open(self, url, identity)

    monkeypatch.setattr(CacheFiles, "_open", counted)
    seen: list[tuple[list[str], list[str]]] = []
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30, request_size=4) as loader:
        for _ in loader:
            seen.append(cache_files_held(cache))
            pinned = {str(layout.shard_path(data.urls[shard])) for shard in loader._current.pins.opened}
            assert set(seen[-1][0]) <= pinned, (seen[-1][0], pinned)  # open only while pinned
        assert cache_files_held(cache) == ([], [])  # the epoch is over: every pin and file let go
    # Each shard pinned and its file opened once: its reads (10 of 4 samples) go out a few at
    # a time, and the pin outlasts them until the last of its samples is asked for.
    assert opened == data.urls, opened
    assert max(len(fds) for fds, _ in seen) <= 2, seen  # the shard read, and the next one at a boundary
    assert not any(maps for _, maps in seen), seen  # read, never mapped: a damaged disk cannot SIGBUS us


def test_requests_ask_for_about_four_mib_of_payload_once_the_sample_size_is_known(tmp_path, dataset, start_agent):
    from wdscache.training.read_batches import REQUEST_BYTES

    big = dataset(1, samples=60, payload=300_000, prefix="big")
    small = dataset(1, samples=300, payload=500, prefix="small", list_name="small.txt")
    cache = tmp_path / "cache"
    both = write_url_list(tmp_path / "lists" / "both.txt", big.urls + small.urls)
    start_agent(cache, both, "--prefetch", "2")
    # payloads vary by up to 10% around the size asked for
    for urls, request_size, want in (
        (big.urls, 128, (REQUEST_BYTES // 330_000, REQUEST_BYTES // 270_000)),
        (small.urls, 128, (128, 128)),
        (small.urls, 50, (50, 50)),
    ):
        with CachedMultiLoader(urls, cache_dir=cache, shuffle=False, timeout=30, request_size=request_size) as loader:
            got = list(loader)
            limit = loader._current.batches.request_limit  # what the next request would ask for
        assert len(got) in (60, 300)
        assert want[0] <= limit <= want[1], (urls, limit)


# A consumer's peak memory growth (VmHWM, reset first) until its first sample, in MB, on stdout.
FIRST_SAMPLE_MEMORY = """
import sys
from wdscache import CachedMultiLoader

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

urls, cache, direct = sys.argv[1].split(","), sys.argv[2], sys.argv[3] == "1"
with CachedMultiLoader(urls, cache_dir=cache, shuffle=False, direct_reads=direct, timeout=30) as loader:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from what is in use now
    before = kib("VmRSS")
    it = iter(loader)
    first = next(it)
    grown = (kib("VmHWM") - before) / 1024
    keys = [first["__key__"]] + [s["__key__"] for s in it]
print(round(grown), len(keys), keys[0])
"""


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.slow
def test_a_consumer_of_large_samples_holds_a_few_of_them_before_its_first(tmp_path, dataset, start_agent, direct):
    # 24 samples of about 3 MB: reads are sized by the bytes of the shards opened from the
    # first one on (about 4 MiB a read, a few reads out), not 32 samples whatever their size.
    data = dataset(3, samples=8, payload=3_000_000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 30, "every shard cached")
    out = subprocess.run(
        [sys.executable, "-c", FIRST_SAMPLE_MEMORY, ",".join(data.urls), str(cache), "1" if direct else "0"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    grown, n, first = out.stdout.split()
    assert (int(n), first) == (24, "s00000_00000")
    assert int(grown) < 8 * 3, f"the consumer grew by {grown} MB before its first sample of 3 MB"


def test_malformed_file_ranges_are_protocol_errors_and_a_file_cut_short_is_stale(tmp_path):
    from wdscache.training.replies import file_ranges

    cache = tmp_path / "cache"
    url = "http://example.invalid/a.tar"
    path = CacheLayout.of(cache).shard_path(url)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(range(100)) * 100)
    ident = list(file_identity(os.stat(path)))
    files = CacheFiles(str(cache))
    items = [(0, (0, 0))]
    [whole] = file_ranges([[0, 0, 10_000, *ident]], items, [url], files)
    assert whole.read(10, 3) == bytes([10, 11, 12])
    other = ident[:3] + [ident[3] + 1]
    for bad in (
        [[True, 0, 10, *ident]],
        [[0, -1, 10, *ident]],
        [[1, 0, 10, *ident]],
        [[0, 0, 10, *ident[:3]]],
        [[0, 0, 10_001, *ident]],
        ["0,0,10"],
        {"k": 0},
        [[0, 0, 10, *ident], [0, 10, 10, *other]],
        [[0, 0, 10, *ident], [0, 10, 10, *ident[:3], "1"]],
        [[0, 0, 10, *ident[:3], -1.5]],
        [[0, 0, -10, *ident]],
        [[0, 0, 10, -1, *ident[1:]]],
    ):
        with pytest.raises(ProtocolError):
            file_ranges(bad, items, [url], files)
    os.truncate(path, 5_000)  # behind the agent's back: a short read, never bytes of another offset
    with pytest.raises(StaleFile, match="short read"):
        whole.read(4_990, 20)
    files.close()


def test_a_payload_longer_than_one_pread_is_read_whole_and_a_file_cut_short_is_stale(tmp_path, monkeypatch):
    # Linux returns at most 2,147,479,552 bytes a pread: the bound made small here, the real one below.
    monkeypatch.setattr(direct_reads, "PREAD_MAX", 1 << 20)
    path = tmp_path / "big"
    data = random.Random(1).randbytes(10_000_000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert FileRange(fd, 1_000, 9_999_000).read(3, 9_500_000) == data[1_003:9_501_003]
        assert direct_reads.pread_whole(fd, 3_000_000, 8_000_000) == data[8_000_000:]  # the file ends first
        os.truncate(path, 5_000_000)  # behind the agent's back
        with pytest.raises(StaleFile, match="short read: 4000000 of 9000000 bytes at 1000000"):
            FileRange(fd, 1_000_000, 9_000_000).read(0, 9_000_000)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_payload_of_two_gib_or_more_is_read_whole(tmp_path):
    path = tmp_path / "sparse"  # its holes take no disk
    size = 2_200_000_000
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(size - 10)
        f.write(b"0123456789")
    fd = os.open(path, os.O_RDONLY)
    try:
        data = FileRange(fd, 0, size).read(0, size)
        assert len(data) == size and data[-10:] == b"0123456789" and data[:10] == bytes(10)
    finally:
        os.close(fd)


def test_an_agent_whose_cache_directory_we_do_not_see_is_streamed_from(tmp_path):
    from wdscache.training.stream import same_directory

    root = tmp_path / "cache"
    root.mkdir()
    st = os.stat(root)
    assert same_directory({"cache_dir": str(root), "cache_root": [st.st_dev, st.st_ino]})
    # another container's directory at a path we also have, one we lack, or a hello without it
    assert not same_directory({"cache_dir": str(root), "cache_root": [st.st_dev, st.st_ino + 1]})
    assert not same_directory({"cache_dir": str(tmp_path / "absent"), "cache_root": [st.st_dev, st.st_ino]})
    assert not same_directory({"cache_dir": "cache", "cache_root": [st.st_dev, st.st_ino]})
    assert not same_directory({"cache_dir": str(root) + "\0x", "cache_root": [st.st_dev, st.st_ino]})
    assert not same_directory({"cache_dir": str(root)})
