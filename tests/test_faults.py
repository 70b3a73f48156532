"""Fault injection: a flaky server, killed processes, a full disk, damaged files, hostile peers.

Everything is real: agents started through the ``wdscache`` console script, a
:class:`ShardServer` on 127.0.0.1 told to misbehave, consumer processes
(tests/consumer.py), signals sent to real pids, a real tmpfs that fills up, raw
ZeroMQ sockets speaking garbage. Nothing is mocked. Every wait has a deadline
and a message; every process started here is stopped and reaped by a fixture.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from scripts.shard_maker import make_shard, synth_samples, write_url_list
from tests.helpers.agents import FIRST_PART, AgentProc
from tests.helpers.disks import fill
from tests.helpers.procs import alive, children_of, cmdline, worker_pids
from tests.helpers.streaming import (
    assert_epoch_exact,
    consumer_log,
    exactly_once,
    reference,
    samples_of,
    state_of,
    wait_exit,
)
from tests.helpers.versions import another_version
from tests.helpers.waits import wait_for
from wdscache import AgentUnavailableError, CachedMultiLoader, FetchError, ShardClient, ShardError, WdsCacheError
from wdscache.agent.job_lists import LIST_GRACE
from wdscache.agent.pool import worker_endpoints
from wdscache.shared import errors as wds_errors
from wdscache.shared.client import AgentConnection
from wdscache.shared.layout import CacheLayout, shard_name
from wdscache.shared.protocol import PROTOCOL, agent_key, pack_numbers, reply_proof, request_proof
from wdscache.shared.tarwalk import tar_problem

SHARD_100K = {"samples": 12, "payload": 8000}  # ~100 KB shards
SHARD_200K = {"samples": 20, "payload": 7500}  # 215,040-byte shards
SHARD_300K = {"samples": 30, "payload": 7500}  # 317,440-byte shards
SHARD_1M = {"samples": 10, "payload": 100_000}  # ~1.0-1.06 MB shards
PROC_DEADLINE = 60.0


# -- helpers ------------------------------------------------------------------------------


def shard_files(cache: Path) -> dict[str, Path]:
    """Files under CACHE/shards by name."""
    root = CacheLayout.of(cache).shards_dir
    return {p.name: p for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def partial_files(cache: Path) -> list[Path]:
    root = CacheLayout.of(cache).partial_dir
    return sorted(root.iterdir()) if root.exists() else []


def cached_urls(cache: Path, urls: list[str]) -> set[str]:
    names = set(shard_files(cache))
    return {u for u in urls if shard_name(u) in names}


def assert_identical(cache: Path, urls: list[str], sources: list[Path], agent: AgentProc | None = None) -> None:
    layout = CacheLayout.of(cache)
    where = f"\n{agent.stderr_tail()}" if agent is not None else ""
    for url, src in zip(urls, sources):
        path = layout.shard_path(url)
        assert path.is_file(), f"{url} is not cached at {path}{where}"
        assert path.read_bytes() == src.read_bytes(), f"cached {url} differs from {src}{where}"


def size_or_0(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def gets(server, name: str) -> list:
    return [r for r in server.requests if r.path == name and r.method == "GET"]


def range_start(value: str | None) -> int | None:
    m = re.fullmatch(r"bytes=(\d+)-\d*", value or "")
    return int(m.group(1)) if m else None


class ShardWatcher(threading.Thread):
    """Checks CACHE/shards every few ms: each file there must be a whole, byte-identical shard.

    Sizes are checked on every pass; the content of each new file (by inode) once.
    """

    def __init__(self, cache: Path, sources: dict[str, Path]) -> None:
        super().__init__(daemon=True)
        self.root = CacheLayout.of(cache).shards_dir
        self.sources = {name: (p.stat().st_size, p.read_bytes()) for name, p in sources.items()}
        self.problems: list[str] = []
        self.checked: set[int] = set()
        self.passes = 0
        self.done = threading.Event()

    def _check(self) -> None:
        if not self.root.exists():
            return
        for folder, _dirs, files in os.walk(self.root):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                src = self.sources.get(name)
                if src is None:
                    self.problems.append(f"unknown file {path}")
                    continue
                if st.st_size != src[0]:
                    self.problems.append(f"{name}: {st.st_size} bytes under shards/, source has {src[0]}")
                    continue
                if st.st_ino not in self.checked:
                    try:
                        data = Path(path).read_bytes()
                    except FileNotFoundError:
                        continue
                    if data != src[1]:
                        self.problems.append(f"{name}: content differs from its source")
                    self.checked.add(st.st_ino)

    def run(self) -> None:
        while not self.done.is_set():
            self._check()
            self.passes += 1
            self.done.wait(0.005)

    def finish(self) -> None:
        self.done.set()
        self.join(5)


@pytest.fixture
def watchers():
    started: list[ShardWatcher] = []

    def start(cache: Path, sources: dict[str, Path]) -> ShardWatcher:
        w = ShardWatcher(cache, sources)
        w.start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.finish()


def in_process_loader(cache: Path, job: str, **kw: Any) -> CachedMultiLoader:
    return CachedMultiLoader(cache_dir=cache, job=job, rank=0, world_size=1, timeout=20, **kw)


# -- 1. server faults during downloads ---------------------------------------------------


@pytest.mark.slow
def test_stall_longer_than_read_timeout_is_retried_and_cached_identical(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(1, **SHARD_300K)
    name = ds.paths[0].name
    shard_server.fail(name, "stall", after=100_000, seconds=30)  # far beyond the agent's patience
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--read-timeout", "1", "--prefetch", "1", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 25, "the stalled shard was never cached")
    assert_identical(cache, ds.urls, ds.paths, agent)
    reqs = gets(shard_server, name)
    assert reqs[0].fault == "stall" and reqs[0].range == FIRST_PART, reqs
    gap = reqs[1].at - reqs[0].sent_at  # from the stall's start to the retry, by the server's clock
    assert gap < 15, f"the retry came {gap:.1f}s into the stall: the agent waited out the 30 s stall"
    assert len(reqs) == 2 and reqs[1].fault is None, reqs
    start = range_start(reqs[1].range)
    assert start is not None and 0 < start <= 100_000, f"no resume from what arrived before the stall: {reqs}"
    log = agent.stderr_text()
    assert "retrying" in log and "timed out" in log, agent.stderr_tail()
    s = agent.stats()
    assert s["failed"] == [] and s["shards"]["failed"] == 0
    assert partial_files(cache) == []


def test_short_body_is_resumed_and_never_enters_the_cache_truncated(
    shard_server, dataset, start_agent, watchers, tmp_path
):
    ds = dataset(1, **SHARD_300K)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    shard_server.fail(name, "short", after=150_000, times=2)  # the first resume is cut short too
    cache = tmp_path / "cache"
    watcher = watchers(cache, {shard_name(u): p for u, p in zip(ds.urls, ds.paths)})
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the shard served short was never cached")
    watcher.finish()
    assert watcher.problems == [], watcher.problems[:5]
    assert watcher.passes > 10
    assert_identical(cache, ds.urls, ds.paths, agent)
    reqs = gets(shard_server, name)
    assert [r.fault for r in reqs] == ["short", "short", None], reqs
    starts = [range_start(r.range) for r in reqs]
    assert starts[0] == 0 and starts[1] is not None and starts[2] is not None, reqs
    assert 0 < starts[1] <= 150_000 < starts[2] < size, f"resumes did not follow the bytes received: {starts}"
    assert sum(r.bytes_sent for r in reqs) < 2 * size
    s = agent.stats()
    assert s["shards"]["failed"] == 0 and s["bytes_used"] - s["table_bytes"] == size
    assert partial_files(cache) == []


@pytest.mark.parametrize("ranges", [True, False], ids=["resumed", "from-the-start"])
def test_a_body_without_its_length_cut_at_a_members_end_is_fetched_again_never_cached_short(
    shard_server, dataset, start_agent, tmp_path, ranges
):
    # A 200 without Content-Length ends with the connection: a close after a whole member looks
    # like a smaller shard to any tar reader. The body must reach the tar's end-of-archive marker.
    ds = dataset(1, **SHARD_300K)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    with tarfile.open(ds.paths[0]) as tf:
        cut = tf.getmembers()[20].offset  # a clean close there: 10 whole samples before it
    shard_server.lengths = False
    shard_server.accept_ranges = ranges
    # The first answer is the whole body (200), without its length, closed after `cut` bytes.
    shard_server.fail(name, "no_range" if ranges else "short", after=cut)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the shard cut short was never cached")
    assert_identical(cache, ds.urls, ds.paths, agent)
    reqs = gets(shard_server, name)
    assert (reqs[0].status, reqs[0].bytes_sent) == (200, cut), reqs
    assert len(reqs) == 2 and reqs[1].fault is None, reqs
    if ranges:  # the rest, asked for from where the body ended
        assert (reqs[1].status, range_start(reqs[1].range), reqs[1].bytes_sent) == (206, cut, size - cut), reqs
    else:
        assert (reqs[1].status, reqs[1].bytes_sent) == (200, size), reqs
    log = agent.stderr_text()
    assert f"may be cut short: no end-of-archive marker after its last member ({cut} bytes)" in log, agent.stderr_tail()
    assert agent.stats()["shards"]["failed"] == 0 and partial_files(cache) == []


def test_a_tar_without_its_end_of_archive_marker_sent_without_its_length_is_cached_once_it_comes_again_as_long(
    shard_server, dataset, start_agent, tmp_path
):
    # A writer may leave out the zero blocks: with neither a length nor Range (each request gets
    # the whole body again), the only tell of a cut is a second body of another length.
    ds = dataset(1, **SHARD_300K)
    name = ds.paths[0].name
    with tarfile.open(ds.paths[0]) as tf:
        last = tf.getmembers()[-1]
    ends = last.offset_data + -(-last.size // 512) * 512
    ds.paths[0].write_bytes(ds.paths[0].read_bytes()[:ends])  # webdataset reads it all the same
    shard_server.lengths = False
    shard_server.accept_ranges = False
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the shard was never cached")
    assert_identical(cache, ds.urls, ds.paths, agent)
    assert [(r.status, r.bytes_sent) for r in gets(shard_server, name)] == [(200, ends), (200, ends)]


def test_pipe_sources_without_an_end_of_archive_marker_and_failing_commands(tmp_path, dataset, start_agent):
    ds = dataset(2, **SHARD_300K)
    with tarfile.open(ds.paths[0]) as tf:
        last = tf.getmembers()[-1]
    ends = last.offset_data + -(-last.size // 512) * 512
    unended = tmp_path / "unended.tar"
    unended.write_bytes(ds.paths[0].read_bytes()[:ends])
    # Part of a tar, then the command fails: its exit status is the error, not the tar cut short.
    failing = f"pipe:head -c 50000 {ds.paths[1]}; echo 'curl: (18) transfer closed' >&2; exit 18"
    lines = [f"pipe:cat {unended}", failing]
    urls_file = tmp_path / "lists" / "pipes.txt"
    urls_file.parent.mkdir(exist_ok=True)
    urls_file.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    start_agent(cache, urls_file, "--allow-pipe", "--cache-size", "10M", "--retries", "1", "--no-shuffle")
    with ShardClient(cache, timeout=30) as client:
        assert client.open(lines[0], timeout=30).read_bytes() == unended.read_bytes()
        with pytest.raises(FetchError) as info:
            client.open(lines[1], timeout=30)
    assert "exited with status 18" in str(info.value) and "curl: (18)" in str(info.value), info.value


def _commands_running(marker: str) -> list[int]:
    """Pids of processes whose command line holds ``marker``."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and marker in cmdline(int(p))]


@pytest.mark.slow
def test_pipe_commands_that_fail_without_output_stall_or_close_their_output_early(tmp_path, dataset, start_agent):
    ds = dataset(1, **SHARD_300K)
    shard, tried = ds.paths[0], tmp_path / "tried"
    lines = [
        # No output: its status and stderr are the error, not "too short for a tar archive".
        "pipe:echo 'fatal error: (404) Key \"x.tar\" does not exist' >&2; exit 1",
        # Fails once, then works: the attempt is retried, the command run anew.
        f"pipe:if [ -e {tried} ]; then cat {shard}; else touch {tried}; echo reset >&2; exit 56; fi",
        # Its output ends before it exits: cached, not killed for the moment between.
        f"pipe:cat {shard}; exec 1>&-; sleep 0.3",
        # Silent past --read-timeout: killed, with what it started.
        f"pipe:head -c 20480 {shard}; sleep 61.25",
        # Its shell exits, what it started holds its output open: killed too.
        f"pipe:cat {shard}; sleep 61.75 &",
    ]
    urls_file = tmp_path / "lists" / "pipes.txt"
    urls_file.parent.mkdir(exist_ok=True)
    urls_file.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, urls_file, "--allow-pipe", "--retries", "1", "--read-timeout", "2", "--no-shuffle")
    with ShardClient(cache, timeout=60) as client:
        with pytest.raises(FetchError) as info:
            client.open(lines[0], timeout=60)
        assert str(info.value).endswith('command exited with status 1: fatal error: (404) Key "x.tar" does not exist')
        assert client.open(lines[1], timeout=60).read_bytes() == shard.read_bytes()
        assert client.open(lines[2], timeout=60).read_bytes() == shard.read_bytes()
        with pytest.raises(FetchError) as info:
            client.open(lines[3], timeout=60)
        assert "the command wrote nothing for 2s (--read-timeout)" in str(info.value)
        with pytest.raises(FetchError) as info:
            client.open(lines[4], timeout=60)
        assert "the command wrote nothing for 2s (--read-timeout)" in str(info.value)
    assert _commands_running("sleep 61.25") == [] and _commands_running("sleep 61.75") == []

    assert agent.stop() == 0

    # A command running when the agent stops is killed with what it started: silent, or with its
    # output ended and not exited yet.
    write_url_list(urls_file, [f"pipe:head -c 20480 {shard}; sleep 61.5", f"pipe:cat {shard}; exec 1>&-; sleep 61.6"])
    agent = start_agent(cache, urls_file, "--allow-pipe", "--prefetch", "2", "--read-timeout", "60")
    wait_for(lambda: _commands_running("sleep 61.5") and _commands_running("sleep 61.6"), 15, "the commands started")
    assert agent.stop() == 0
    assert _commands_running("sleep 61.5") == [] and _commands_running("sleep 61.6") == []


@pytest.mark.parametrize("sends, then", [("etag", "etag"), ("date", "date"), ("etag", "date")])
def test_a_resume_answered_for_another_version_starts_over_never_spliced(
    shard_server, dataset, start_agent, tmp_path, sends, then
):
    # A server that ignores If-Range answers the resume with bytes of whatever version it has now.
    ds = dataset(1, **SHARD_300K)
    name, old = ds.paths[0].name, ds.paths[0].read_bytes()
    new = another_version(old)  # the same size: only the validator tells the versions apart
    shard_server.if_range = False
    shard_server.etags = sends == "etag"
    shard_server.fail(name, "change", after=100_000, content=new, etags=then == "etag")
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the changed shard was never cached")
    with ShardClient(cache, timeout=20) as client:
        assert client.open(ds.urls[0]).read_bytes() == new  # one version, whole
    reqs = gets(shard_server, name)
    assert [(r.fault, r.status) for r in reqs] == [("change", 206), (None, 206), (None, 206)], reqs
    assert 0 < range_start(reqs[1].range) <= 100_000 and reqs[1].if_range, reqs  # resumed, its answer refused
    assert reqs[2].range == FIRST_PART and reqs[2].if_range is None, reqs  # then from byte 0
    assert "a resumed answer is for another version" in agent.stderr_text(), agent.stderr_tail()
    assert partial_files(cache) == []


def test_a_redirect_loop_fails_its_shard_at_once_saying_what_to_check(shard_server, dataset, start_agent, tmp_path):
    """A redirect no attempt can follow (a loop) is a permanent failure of its shard, not one
    retried through the whole budget while a reader waits out its timeout."""
    ds = dataset(2, samples=3, payload=1000)
    name = ds.paths[1].name
    shard_server.fail(name, "status", status=302, headers={"Location": shard_server.url(name)}, times=10_000)
    agent = start_agent(tmp_path / "cache", ds.list_file, "--no-shuffle")
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 1 and s["shards"]["failed"] == 1, 20, "the loop failed")
    error = s["failed"][0]["error"]
    assert "TooManyRedirects" in error and "check the URL and where its server redirects it" in error, error
    assert "retrying" not in agent.stderr_text(), agent.stderr_tail()
    with CachedMultiLoader(cache_dir=tmp_path / "cache", shuffle=False, timeout=20) as loader:
        with pytest.raises(FetchError, match="TooManyRedirects") as raised:
            for _ in loader:
                pass
    assert "no progress" not in str(raised.value)  # the shard's own error, not the loader's timeout


@pytest.mark.slow  # (about 3 s: kept out of the default suite's 5 minutes)
def test_a_server_that_negotiates_gzip_describes_the_shards_bytes_to_a_restarted_agent(
    shard_server, dataset, start_agent, tmp_path
):
    """A server that gzips a body for a client that accepts it would describe the gzip'd body
    to a HEAD that accepts it (its size, its ETag): every copy would look changed after a restart
    and be downloaded again. The agent asks for the bytes themselves, HEAD and GET alike."""
    shard_server.gzip = True
    data = dataset(3, samples=4, payload=2000)
    cache = tmp_path / "cache"
    args = ("--prefetch", "3", "--no-shuffle")
    agent = start_agent(cache, data.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "shards never cached")
    assert agent.stop() == 0
    shard_server.reset_log()
    agent = start_agent(cache, data.list_file, *args)
    wait_for(lambda: [shard_server.count(p.name, "HEAD") for p in data.paths] == [1] * 3, 20, "the copies revalidated")
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20) as loader:
        got = sorted((x["__url__"], x["__key__"]) for x in loader)
    assert got == sorted(reference(data.paths, data.urls))
    assert [shard_server.count(p.name) for p in data.paths] == [0] * 3, shard_server.requests
    s = agent.stats()
    assert (s["changed"], s["redownloads"]) == (0, 0), s
    assert "changed on the server" not in agent.stderr_text(), agent.stderr_tail()


@pytest.mark.slow
def test_resets_mid_body_during_a_streaming_epoch_change_nothing_delivered(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(6, **SHARD_100K)
    for p in ds.paths:
        shard_server.fail(p.name, "cut", after=p.stat().st_size // 2)
    shard_server.rate = 1_000_000  # downloads still running while the consumer reads
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--cache-size", "10M")
    c = consumers(cache, "reader", "--job", "cut")
    lines = c.wait(PROC_DEADLINE)
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))
    assert_identical(cache, ds.urls, ds.paths, agent)
    log = agent.stderr_text()
    resumed = 0
    for url, p in zip(ds.urls, ds.paths):
        reqs = gets(shard_server, p.name)
        assert reqs and reqs[0].fault == "cut", (p.name, reqs)
        if any((range_start(r.range) or 0) > 0 for r in reqs[1:]):
            resumed += 1
        else:  # only a download that left every window (and so lost its partial) starts over
            assert f"no longer wanted, abandoning {url}" in log, f"{p.name} not resumed: {reqs}\n{agent.stderr_tail()}"
    assert resumed >= 1, agent.stderr_tail()
    s = agent.stats()
    assert s["shards"]["failed"] == 0 and s["agent"]["corrupt"] == [], s
    assert agent.running()


# -- 2. the agent killed with SIGKILL ------------------------------------------------------


@pytest.mark.slow
def test_agent_sigkilled_during_downloads_restarts_cleanly(shard_server, dataset, start_agent, watchers, tmp_path):
    ds = dataset(6, **SHARD_200K)
    size = {u: p.stat().st_size for u, p in zip(ds.urls, ds.paths)}
    shard_server.rate = 200_000  # ~1 s per shard, three at once
    # The third shard stops a third of the way until the kill: a partial file that stays
    # half-way however slowly this test's polls come (the server's stop ends the stall).
    shard_server.fail(shard_name(ds.urls[2]), "stall", after=80_000, seconds=120)
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    watcher = watchers(cache, {shard_name(u): p for u, p in zip(ds.urls, ds.paths)})
    args = ("--prefetch", "6", "--no-shuffle", "--cache-size", "10M", "--download-workers", "3", "--workers", "2")
    first = start_agent(cache, ds.list_file, *args)

    def mid_download() -> bool:
        half = min(size.values()) // 2
        return bool(cached_urls(cache, ds.urls)) and any(64 << 10 <= size_or_0(p) <= half for p in partial_files(cache))

    wait_for(mid_download, 20, lambda: f"never one shard cached and one half-way\n{first.stderr_tail()}")
    children = wait_for(
        lambda: (lambda c: c if len([p for p in c if "wdscache.agent.worker" in cmdline(p)]) == 2 else None)(
            children_of(first.pid)
        ),
        10,
        lambda: f"the agent's 2 workers not found: {children_of(first.pid)}",
    )
    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(10) == -signal.SIGKILL
    done = cached_urls(cache, ds.urls)
    halfway = [p for p in partial_files(cache) if p.stat().st_size > 0]
    assert done and halfway, (done, halfway)
    wait_for(
        lambda: not any(alive(p, t) for p, t in children.items()),
        10,
        lambda: (
            f"children of the killed agent still alive: {[(p, cmdline(p)) for p, t in children.items() if alive(p, t)]}"
        ),
    )
    assert layout.lock_path.exists(), "no stale lock left to test"

    shard_server.rate = None
    before = len(shard_server.requests)
    second = start_agent(cache, ds.list_file, *args)  # wait_up: the stale lock does not block it
    s = second.wait_stats(lambda s: s["shards"]["cached"] == 6, 20, "the restarted agent did not cache all 6")
    assert s["agent"]["pid"] == second.pid
    watcher.finish()
    assert watcher.problems == [], watcher.problems[:5]
    assert_identical(cache, ds.urls, ds.paths, second)
    assert len(shard_files(cache)) == 6
    assert partial_files(cache) == []
    tables = CacheLayout.of(cache).tables_dir
    second.wait_stats(
        lambda s: (
            s["bytes_used"] == sum(size.values()) + sum(p.stat().st_size for p in tables.rglob("*") if p.is_file())
        ),
        20,
        "the shards and their kept sample tables counted",
    )
    after = [r for r in shard_server.requests[before:] if r.method == "GET"]
    again = {r.path for r in after} & {Path(u).name for u in done}
    assert not again, f"complete shards {sorted(again)} downloaded again\n{second.stderr_tail()}"
    resumed = [r for r in after if (range_start(r.range) or 0) > 0]
    assert resumed, f"no partial download was resumed with a Range: {after}\n{second.stderr_tail()}"
    assert "recovered the cache" in second.stderr_text(), second.stderr_tail()


@pytest.mark.slow
def test_agent_sigkilled_under_a_consumer_fails_it_clearly_and_a_resume_completes(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(12, samples=50, payload=500)  # 600 samples: far more than the victim holds in flight
    ref = reference(ds.paths, ds.urls)
    cache = tmp_path / "cache"
    args = ("--prefetch", "12", "--cache-size", "10M")
    agent = start_agent(cache, ds.list_file, *args)
    first = consumers(cache, "first", "--job", "ckpt", "--stop-after", "25")
    before = first.wait(PROC_DEADLINE)
    state = state_of(before)
    assert state["position"] == 25 and state["epoch"] == 0, state

    # Reads of 16 samples: a few of them in flight, far fewer than the 600 samples.
    victim = consumers(cache, "victim", "--job", "victim", "--sleep", "0.01", "--timeout", "3", "--request-size", "16")
    agent.wait_stats(
        lambda s: s["jobs"].get("victim", {}).get("0", {}).get("samples", 0) >= 20,
        30,
        "the victim consumer never got going",
    )
    assert victim.proc.poll() is None, f"the victim finished too early\n{consumer_log(victim)}"
    agent.proc.send_signal(signal.SIGKILL)
    assert agent.proc.wait(10) == -signal.SIGKILL
    t0 = time.monotonic()
    rc = wait_exit(victim.proc, 30, "a consumer whose agent was SIGKILLed")
    took = time.monotonic() - t0
    text = victim.log.read_text(errors="replace")
    assert rc != 0, f"the consumer exited {rc} without its agent\n{text[-3000:]}"
    last = text.strip().splitlines()[-1]
    m = re.match(r"wdscache\.(\w+): (.*)", last)
    assert m, f"the consumer did not end with a wdscache error: {last!r}\n{text[-3000:]}"
    assert issubclass(getattr(wds_errors, m.group(1)), wds_errors.WdsCacheError), last
    assert "no wdscache agent answered" in m.group(2) and str(cache) in m.group(2), last
    got = samples_of([json.loads(x) for x in victim.out.read_text().splitlines()]) if victim.out.exists() else []
    assert len(got) < len(ref), "the victim was not mid-epoch"
    print(f"consumer exited {rc} {took:.1f}s after its agent was killed: {last}")

    agent2 = start_agent(cache, ds.list_file, *args)
    resumed = consumers(cache, "resumed", "--job", "ckpt2", "--resume", json.dumps(state))
    after = resumed.wait(PROC_DEADLINE)
    total = exactly_once(before, ref) + exactly_once(after, ref)
    assert set(total) == set(ref) and all(n == 1 for n in total.values()), (
        f"{sum(n > 1 for n in total.values())} repeated, {len(set(ref) - set(total))} missing"
    )
    assert len(samples_of(after)) == len(ref) - 25
    assert agent2.running()


# -- 3. a worker killed mid-epoch ----------------------------------------------------------


@pytest.mark.slow
def test_worker_sigkilled_mid_epoch_is_replaced_and_the_epoch_completes(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(12, samples=30, payload=1000)  # 360 samples
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--workers", "2", "--prefetch", "12", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 12, 20, "not all 12 shards cached")
    workers = wait_for(
        lambda: (lambda w: w if len(w) == 2 else None)(worker_pids(agent.pid)),
        10,
        lambda: f"2 workers not found among {children_of(agent.pid)}",
    )
    c = consumers(cache, "reader", "--job", "wk", "--sleep", "0.01", "--timeout", "5")
    agent.wait_stats(
        lambda s: s["jobs"].get("wk", {}).get("0", {}).get("samples", 0) >= 40, 30, "the consumer never got going"
    )
    assert c.proc.poll() is None, f"the epoch ended before the kill\n{consumer_log(c)}"
    victim = workers[0]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    s = agent.wait_stats(lambda s: s["agent"]["worker_restarts"] >= 1, 15, "no replacement worker started")
    assert s["agent"]["worker_restarts"] == 1
    # The replacement got the workers' secret too: the agent takes its reports.
    agent.wait_stats(
        lambda s: any(w["index"] == 0 and w.get("seen", 0) > killed_at + 0.5 for w in s["agent"]["workers"]),
        15,
        "no report from the replacement worker",
    )
    lines = c.wait(PROC_DEADLINE)
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))
    assert len(samples_of(lines)) == 360
    now = wait_for(
        lambda: (lambda w: w if len(w) == 2 else None)(worker_pids(agent.pid)),
        10,
        lambda: f"not 2 workers after the restart: {children_of(agent.pid)}",
    )
    assert victim not in now and workers[1] in now, (workers, now)
    assert re.search(rf"worker 0 \(pid {victim}\) died with exit code -9", agent.stderr_text()), agent.stderr_tail()
    assert agent.running()


# -- 4. a consumer killed mid-epoch ----------------------------------------------------------


@pytest.mark.slow
def test_killed_consumer_expires_and_a_concurrent_job_completes(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(6, samples=8, payload=2000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "6", "--reader-timeout", "2", "--cache-size", "10M")
    victim = consumers(cache, "victim", "--job", "v", "--sleep", "0.2")
    survivor = consumers(cache, "survivor", "--job", "s", "--sleep", "0.15")  # ~7 s for 48 samples

    def both_reading(s: dict[str, Any]) -> bool:
        return all(s["jobs"].get(j, {}).get("0", {}).get("samples", 0) >= 2 for j in ("v", "s"))

    s = agent.wait_stats(both_reading, 20, "both consumers reading")
    assert s["agent"]["consumers"] == 2, s["agent"]
    victim.kill()
    t0 = time.monotonic()
    s = agent.wait_stats(lambda s: "v" not in s["jobs"], 10, "the killed consumer's job still in stats")
    print(f"killed consumer gone from stats after {time.monotonic() - t0:.1f}s")
    assert survivor.proc.poll() is None, "the survivor was done before the victim expired: nothing concurrent"
    assert s["agent"]["consumers"] == 1 and list(s["jobs"]) == ["s"], s["jobs"]
    # Seen through its process (a pidfd); a consumer the agent cannot see is timed out instead.
    assert re.search(r"reader v/0/\w+: its process ended; releasing its shards", agent.stderr_text()), (
        agent.stderr_tail()
    )
    lines = survivor.wait(PROC_DEADLINE)
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))
    s = agent.wait_stats(lambda s: s["agent"]["consumers"] == 0, 10, "consumers left after the survivor's bye")
    assert s["jobs"] == {}
    assert agent.running()


@pytest.mark.slow  # waits out --reader-timeout and the 10 s an unread job list is kept
def test_a_consumer_stopped_past_the_reader_timeout_says_hello_again_and_completes(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    # SIGSTOP (Slurm's suspend, a frozen container) past --reader-timeout: the agent drops the reader,
    # its pins, and then its own list. Resumed, it went on as an unknown plain client: its own list's
    # shards were refused as "not in the agent's URL list", and the agent's as a rank of job None.
    agents_list = dataset(2, samples=4, list_name="agent.txt")
    own = dataset(10, samples=3, payload=1500, prefix="own", list_name="own.txt")
    cache = tmp_path / "cache"
    agent = start_agent(cache, agents_list.list_file, "--reader-timeout", "2", "--prefetch", "1")
    victim = consumers(cache, "stopped", "--urls", str(own.list_file), "--job", "own", "--no-shuffle", "--sleep", "0.1")
    wait_for(lambda: victim.out.exists() and len(victim.out.read_text().splitlines()) >= 3, 30, "no samples read")
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        agent.wait_stats(lambda s: "own" not in s["jobs"] and s["agent"]["job_lists"] == 0, 40, "its list kept")
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    lines = victim.wait(PROC_DEADLINE)
    assert_epoch_exact(lines, reference(own.paths, own.urls))
    assert "dropped this reader after its --reader-timeout" in victim.log.read_text(), victim.log.read_text()[-2000:]
    left = [line for line in agent.stderr_text().splitlines() if " said bye; releasing its shards" in line]
    assert len(left) == 1 and "(job 'own', rank 0," in left[0], agent.stderr_tail()


@pytest.mark.slow  # waits out --reader-timeout and the 10 s an unread list is kept
def test_a_consumer_stopped_while_its_open_waits_finishes_on_its_list_and_is_counted_once(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    # Stopped while its open waited for a download: the agent answered that open "reader expired"
    # once the shard came, failing the epoch (or skipping the shard); an edit of the agent's list
    # meanwhile failed it too ("now serves a URL list other than the one this epoch reads"); and the rank's totals counted the
    # reports before the stop twice.
    data = dataset(4, samples=10, payload=500)
    released = threading.Event()
    shard_server.fail(data.paths[1].name, "stall", seconds=60, until=released)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--reader-timeout", "2", "--no-shuffle")
    victim = consumers(cache, "stopped", "--job", "j", "--no-shuffle", "--timeout", "60")
    wait_for(lambda: victim.out.exists() and len(victim.out.read_text().splitlines()) >= 10, 30, "shard 0 unread")
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "silent for" in agent.stderr_text(), 20, lambda: f"never dropped\n{agent.stderr_tail()}")
        extra = dataset(1, samples=3, prefix="extra", list_name="extra.txt")
        data.list_file.write_text(data.list_file.read_text() + extra.urls[0] + "\n")
        agent.wait_stats(lambda s: s["agent"]["urls"] == 5, 20, "the edit not taken")
        time.sleep(LIST_GRACE + 1)  # past the time an unread list is kept
        released.set()
        agent.wait_stats(lambda s: s["shards"]["cached"] == 5, 30, "the stalled shard never cached")  # 4 + extra
    finally:
        released.set()
        os.kill(victim.proc.pid, signal.SIGCONT)
    lines = victim.wait(PROC_DEADLINE)
    assert_epoch_exact(lines, reference(data.paths, data.urls))  # the list it started with, every sample once
    # (It said hello again, or, its open answered while the shard downloaded, read on from the
    # workers to its bye: either way each sample counts once.)
    s = agent.wait_stats(lambda s: "j" in s["ended_jobs"], 10, "the job never ended")
    assert s["rank_totals"]["j"]["0"]["samples"] == s["ended_jobs"]["j"]["0"]["samples"] == 40, s


# -- 5. the disk fills up --------------------------------------------------------------------
# -- 5. the disk fills up --------------------------------------------------------------------


@pytest.fixture
def small_fs(tmpfs):
    """A 6 MB tmpfs (mode 0700); unmounted at teardown."""
    return tmpfs("6m")


@pytest.mark.slow
def test_a_disk_filled_as_parts_are_joined_is_a_full_disk_not_a_failed_shard(
    small_fs, shard_server, dataset, start_agent
):
    # A download in parallel parts joins each part's side file to the partial file (a copy): the file
    # system refusing it was retried as a network error and, its retries spent, failed the shard.
    ds = dataset(1, **SHARD_300K)  # 5 parts of 64 KiB
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    # The first part stops one byte short: the other parts wait in their side files meanwhile.
    shard_server.fail(name, "stall", after=(64 << 10) - 1, seconds=8, range=f"bytes=0-{(64 << 10) - 1}")
    cache = small_fs / "cache"
    agent = start_agent(
        cache,
        ds.list_file,
        "--cache-size",
        "100M",
        "--min-free",
        "0",
        "--prefetch",
        "1",
        "--retries",
        "0",
        "--download-part-size",
        "64K",
        "--download-parts",
        "4",
    )
    partial = CacheLayout.of(cache).partial_dir
    wait_for(lambda: sum(p.stat().st_size for p in partial.iterdir()) >= size - 1, 20, "the parts never came")
    filler = small_fs / "filler"
    assert fill(filler) > 0  # the last byte of the first part fits its page; the joins do not
    wait_for(
        lambda: "cannot write the cache: No space left on device" in agent.stderr_text(),
        20,
        lambda: f"the full disk was never seen as one\n{agent.stderr_tail()}",
    )
    assert agent.stats()["shards"]["failed"] == 0, agent.stderr_tail()
    filler.unlink()  # room again: the shard comes, whole
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 30, "the shard was not cached once there was room")
    assert_identical(cache, ds.urls, ds.paths, agent)


def test_a_disk_filled_by_someone_else_does_not_stop_serving_cached_shards(
    small_fs, shard_server, dataset, start_agent
):
    ds = dataset(2, samples=10, payload=20_000)
    cache = small_fs / "cache"
    agent = start_agent(cache, ds.list_file, "--cache-size", "100M", "--min-free", "256K", "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 15, "the 2 shards were not cached")
    assert fill(small_fs / "filler") > 0  # another program takes every free byte
    try:
        # timeout: how long the client waits for the agent to answer at all (its pings included). An
        # agent blocked on the full disk never answers; a live one on a busy machine may take seconds.
        with ShardClient(cache, timeout=10, name="reader") as client:
            for url, src in zip(ds.urls, ds.paths):
                path = client.open(url)
                assert path.read_bytes() == src.read_bytes()
                client.release(url)
    except AgentUnavailableError as exc:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.proc.wait(2)  # an agent dying of the full disk: its exit status for the message
        state = "still runs" if agent.running() else f"exited {agent.proc.returncode}"
        pytest.fail(
            f"opening a cached shard on a full disk got no answer (the agent {state}): {exc}\n{agent.stderr_tail()}",
            pytrace=False,
        )
    assert agent.running(), f"the agent died on a full disk (exit {agent.proc.returncode})\n{agent.stderr_tail()}"
    s = agent.stats()
    assert s["shards"]["cached"] == 2 and s["hits"] == 2, s


@pytest.mark.slow
def test_disk_full_abandons_the_download_keeps_serving_and_recovers(
    small_fs, shard_server, dataset, start_agent, watchers, tmp_path
):
    # --min-free 0 and a 100M budget: only the file system stops downloads. (Before 0eca1b8 this let the
    # agent fill the disk to the last byte and die on an index write.)
    ds = dataset(8, **SHARD_1M)  # 8 MB of shards for a 6 MB file system
    size = {u: p.stat().st_size for u, p in zip(ds.urls, ds.paths)}
    cache = small_fs / "cache"
    layout = CacheLayout.of(cache)
    watcher = watchers(cache, {shard_name(u): p for u, p in zip(ds.urls, ds.paths)})
    shard_server.rate = 600_000  # ~1.7 s per shard: time to fill the disk under a download
    agent = start_agent(
        cache,
        ds.list_file,
        "--cache-size",
        "100M",
        "--min-free",
        "0",
        "--prefetch",
        "3",
        "--no-shuffle",
        "--download-workers",
        "4",
    )
    agent.wait_stats(lambda s: s["shards"]["cached"] >= 1, 20, "no shard was cached")
    held = sorted(cached_urls(cache, ds.urls), key=ds.urls.index)[0]
    results: dict[str, Any] = {"read": [], "error": None}

    def read_all() -> None:
        try:
            with ShardClient(cache, timeout=30, name="streamer") as client:
                for url, src in zip(ds.urls, ds.paths):
                    path = client.open(url)
                    results["read"].append((url, path.read_bytes() == src.read_bytes()))
                    client.release(url)
        except BaseException as exc:  # reported by the main thread
            results["error"] = exc

    def mid_download() -> bool:
        # Half-way: what abandoning it frees, with the evictable shards, holds a shard again
        # (the filler below stays for good).
        return any(512 << 10 <= size_or_0(layout.partial_path(u)) < size[u] - (128 << 10) for u in ds.urls)

    reader = threading.Thread(target=read_all, daemon=True)
    pinner = ShardClient(cache, timeout=10, name="pinner")
    try:
        assert pinner.open(held).read_bytes() == ds.source_of(held).read_bytes()  # held across the full disk
        reader.start()
        wait_for(mid_download, 30, lambda: f"no download got half-way\n{agent.stderr_tail()}")
        filled = fill(small_fs / "filler")  # something else takes every free byte
        assert filled > 0
        wait_for(
            lambda: "No space left on device" in agent.stderr_text() or not agent.running(),
            15,
            lambda: f"the agent never logged the full disk\n{agent.stderr_tail()}",
        )
        shard_server.rate = None
        assert agent.running(), f"the agent died on a full disk (exit {agent.proc.returncode})\n{agent.stderr_tail()}"
        # Still serving what is cached, on a full disk.
        with ShardClient(cache, timeout=10, name="checker") as client:
            path = client.open(held)
            assert path.read_bytes() == ds.source_of(held).read_bytes()
            client.release(held)
        assert agent.running(), agent.stderr_tail()
    finally:
        try:
            pinner.release(held)
        except WdsCacheError:
            pass  # the agent is gone: the assertions below say so
        pinner.close()

    wait_for(
        lambda: not reader.is_alive() or not agent.running(),
        PROC_DEADLINE,
        lambda: f"the reader did not finish\n{agent.stderr_tail()}",
    )
    assert agent.running(), f"the agent died on a full disk (exit {agent.proc.returncode})\n{agent.stderr_tail()}"
    reader.join(5)
    assert results["error"] is None, f"{results['error']!r}\n{agent.stderr_tail()}"
    assert results["read"] == [(u, True) for u in ds.urls], results["read"]
    assert (small_fs / "filler").stat().st_size == filled  # eviction made the room, not the test
    log = agent.stderr_text()
    urls = "|".join(map(re.escape, ds.urls))
    assert re.search(
        rf"cannot write the cache: No space left on device; abandoned ({urls}), "
        r"will retry after making room",
        log,
    ), agent.stderr_tail()
    assert "Traceback" not in log, agent.stderr_tail()
    s = agent.stats()
    assert s["shards"]["failed"] == 0 and s["failed"] == [], s
    assert s["hits"] + s["misses"] >= len(ds.urls) + 2
    watcher.finish()
    assert watcher.problems == [], watcher.problems[:5]
    assert watcher.passes > 10 and len(watcher.checked) >= 3, "the watcher hardly saw the shards pass"
    wait_for(lambda: partial_files(cache) == [] or None, 10, lambda: f"partial files left: {partial_files(cache)}")


@pytest.mark.slow
def test_a_rank_starved_by_a_full_disk_is_told_so_and_its_epoch_completes_once_there_is_room(
    tmpfs, shard_server, dataset, start_agent, consumers, run_cli
):
    # Another program kept the cache's file system full under a reading rank: downloads were paused,
    # the agent evicted all it could, and `stats` said "starved by downloads: raise
    # --download-workers", with `waiting_for_space`, `retrying` and `failed` all empty; only the log
    # named the full disk.
    fs = tmpfs("8m")
    ds = dataset(10, **SHARD_1M)  # 10 MB of shards for an 8 MB file system
    cache = fs / "cache"
    shard_server.rate = 2_000_000  # ~0.5 s a shard: downloads still run when the disk fills
    agent = start_agent(cache, ds.list_file, "--cache-size", "100M", "--min-free", "1M", "--prefetch", "3")
    consumer = consumers(cache, "c", "--job", "train", "--no-shuffle", "--timeout", "120", "--sleep", "0.01")
    wait_for(
        lambda: consumer.out.exists() and samples_of([json.loads(x) for x in consumer.out.read_text().splitlines()]),
        PROC_DEADLINE,
        lambda: f"the rank got no sample\n{consumer_log(consumer)}\n{agent.stderr_tail()}",
    )
    filler, stop, problems = fs / "filler", threading.Event(), []

    def keep_full() -> None:
        # Something else writes whatever the agent frees: the file system stays full.
        while not stop.is_set():
            try:
                fill(filler)
            except BaseException as exc:  # reported by the main thread
                problems.append(exc)
                return
            stop.wait(0.02)

    filling = threading.Thread(target=keep_full, daemon=True)
    filling.start()
    seen: list[Any] = []  # what stats said last, for a failure's message
    try:

        def starved_by_disk() -> dict | None:
            r = run_cli("stats", "--cache-dir", cache, "--json")
            s = json.loads(r.stdout) if r.returncode == 0 else {}
            seen.append(s)
            return s if s.get("jobs", {}).get("train", {}).get("0", {}).get("starved") == "disk" else None

        s = wait_for(
            starved_by_disk,
            30,
            lambda: f"the rank was never starved by the disk: last stats {seen[-1:]}\n{agent.stderr_tail()}",
            interval=0.2,
        )
        assert not problems, problems
        disk = s["agent"]["disk"]
        assert disk["short"] in ("full", "min_free") and disk["free_bytes"] < (1 << 20) + (1 << 20), disk
        assert disk["min_free"] == 1 << 20, disk
        # The text and the metrics are asked later: the disk must still be the verdict then (a turn of
        # the agent's loop may fall between a pause's end and the next refused write).
        where = rf"the file system of {re.escape(str(cache))} has (\d+ bytes|[\d.]+[KM]) free"
        fix = r": free space on it, or lower (--cache-size and raise --min-free \(the agent then keeps room free\)|--min-free)$"

        def told(args: tuple[str, ...], *patterns: str) -> str | None:
            out = run_cli("stats", "--cache-dir", cache, *args).stdout
            seen.append(out)
            return out if all(re.search(p, out, re.M) for p in patterns) else None

        text = wait_for(
            lambda: told((), rf"^job train: starved by the disk: {where}.*{fix}", rf"^disk       {where}.*{fix}"),
            20,
            lambda: f"stats never named the disk:\n{seen[-1]}",
            interval=0.2,
        )
        assert "--download-workers" not in text, text
        starved = r'^wdscache_job_starved\{job="train",reason="disk"\} 1\.0$'
        wait_for(
            lambda: told(("--prometheus",), starved, r"^wdscache_disk_short 1\.0$", r"^wdscache_disk_free_bytes "),
            20,
            lambda: f"the metrics never named the disk:\n{seen[-1]}",
            interval=0.2,
        )
    finally:
        stop.set()
        filling.join(10)
        filler.unlink(missing_ok=True)
    # Room again: the epoch completes, exactly.
    assert_epoch_exact(consumer.wait(PROC_DEADLINE), reference(ds.paths, ds.urls))
    s = agent.stats()
    assert s["agent"]["disk"]["short"] is None and s["shards"]["failed"] == 0, s["agent"]["disk"]


def test_a_download_is_written_back_as_it_arrives_and_a_failed_write_back_is_never_resumed(
    shard_server, tmp_path, monkeypatch
):
    # Some file systems take the space at write-back, not at write: a sync can be the call
    # that fails. It must say "disk full" for that shard (the agent then makes room or
    # waits), not "internal error". The failing sync is injected: a file system that
    # defers allocation and fills up cannot be made for a test.
    from wdscache.agent.fetch import Fetcher, FetchError
    from wdscache.agent.shard_download import SYNC_EVERY, Budget, DiskFull, Download

    src = make_shard(shard_server.root / "big.tar", synth_samples(0, 10, payload=1 << 20, seed=3))
    url = shard_server.url("big.tar")
    synced: list[int] = []
    real_fdatasync = os.fdatasync

    def counting(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", counting)

    def download(name: str) -> Download:
        return Download(
            url,
            partial=tmp_path / f"{name}.partial",
            final=tmp_path / name,
            budget=Budget(lambda d, total, timeout: True),
        )

    d = download("ok.tar")
    Fetcher().fetch(d)
    assert d.final.read_bytes() == src.read_bytes()
    # Written back every SYNC_EVERY bytes on the way: the fsync at the end has only the rest.
    assert len(synced) == src.stat().st_size // SYNC_EVERY and all(n >= SYNC_EVERY for n in synced), synced

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdatasync", full)
    d = download("full.tar")
    with pytest.raises(DiskFull) as info:
        Fetcher(retries=0).fetch(d)
    assert url in str(info.value) and "No space left" in str(info.value)
    assert not d.final.exists()  # nothing published
    # ... nor resumed from: what was written before a failed write-back may be lost.
    assert d.partial.stat().st_size == 0

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", real_fdatasync)
    monkeypatch.setattr(os, "fsync", failing)  # the sync that ends the download, this time
    d = download("eio.tar")
    with pytest.raises(FetchError) as info:
        Fetcher(retries=1, backoff=0.01).fetch(d)
    assert "gave up after 1 retries" in str(info.value) and "Input/output error" in str(info.value)
    assert not d.final.exists() and d.partial.stat().st_size == 0


# -- 6. files and index damaged behind the agent's back -----------------------------------------


@pytest.mark.slow
def test_shard_files_deleted_behind_the_agents_back_are_downloaded_again(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(4, samples=10, payload=2000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "4", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 15, "not all 4 shards cached")
    layout = CacheLayout.of(cache)
    for url in ds.urls[:2]:
        layout.shard_path(url).unlink()
    lines = consumers(cache, "reader", "--job", "del").wait(PROC_DEADLINE)
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))
    assert [shard_server.count(p.name) for p in ds.paths] == [2, 2, 1, 1]
    assert_identical(cache, ds.urls, ds.paths, agent)
    log = agent.stderr_text()
    for url in ds.urls[:2]:
        assert f"cache file of {url} vanished; downloading it again" in log, agent.stderr_tail()
    s = agent.stats()
    assert s["shards"]["cached"] == 4 and s["shards"]["failed"] == 0
    assert s["bytes_used"] - s["table_bytes"] == sum(p.stat().st_size for p in ds.paths)


@pytest.mark.slow
def test_corrupt_index_is_set_aside_and_cached_shards_are_adopted_not_downloaded(
    shard_server, dataset, start_agent, consumers, run_cli, tmp_path
):
    ds = dataset(4, samples=10, payload=2000)
    cache = tmp_path / "cache"
    args = ("--prefetch", "4", "--cache-size", "10M")
    first = start_agent(cache, ds.list_file, *args)
    first.wait_stats(lambda s: s["shards"]["cached"] == 4, 15, "not all 4 shards cached")
    assert first.stop() == 0, first.stderr_tail()
    db = CacheLayout.of(cache).index_dir / "cache.db"
    assert db.is_file()
    db.write_bytes(b"this is not an SQLite database \x00\xff" * 512)
    requests_before = len(shard_server.requests)
    # Without an agent, the commands that read the index say what is wrong, and what happens next.
    for command in (["stats"], ["stats", "--json"], ["stats", "--prometheus"], ["ls"]):
        r = run_cli(*command, "--cache-dir", cache, timeout=20)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"wdscache: error: cannot read the index in {db.parent} (file is not a database)" in r.stderr, r.stderr
        assert "the agent moves it aside at its next start" in r.stderr, r.stderr

    # An adopted copy's version is unknown (its record went with the index): revalidated, it would
    # be downloaded again; without revalidation it is served as it is.
    second = start_agent(cache, ds.list_file, *args, "--no-revalidate")
    s = second.stats()
    assert s["shards"]["cached"] == 4, f"{s['shards']}\n{second.stderr_tail()}"
    assert s["bytes_used"] - s["table_bytes"] == sum(p.stat().st_size for p in ds.paths)
    log = second.stderr_text()
    assert "the index is unreadable" in log, second.stderr_tail()
    assert "adopted 4" in log, second.stderr_tail()
    aside = list(cache.glob("index.corrupt-*"))
    assert len(aside) == 1 and (aside[0] / "cache.db").read_bytes().startswith(b"this is not"), aside
    lines = consumers(cache, "reader", "--job", "adopted").wait(PROC_DEADLINE)
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))
    new = [r for r in shard_server.requests[requests_before:] if r.method == "GET"]
    assert new == [], f"adopted shards were downloaded again: {new}\n{second.stderr_tail()}"
    assert_identical(cache, ds.urls, ds.paths, second)
    assert second.running()


# -- 7. corrupt shards --------------------------------------------------------------------------


def _tar_truncated(root: Path) -> tuple[Path, str]:
    path = make_shard(root / "bad-000000.tar", synth_samples(71, 30, payload=7500))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3 + 100])  # cut inside a member, far past the head
    with pytest.raises(tarfile.ReadError):  # the damage is real: tarfile (webdataset's reader) refuses it
        for _ in tarfile.open(path):
            pass
    return path, "truncated"


# (Damaged gzip data fails its download: tests/test_gzip.py.)
@pytest.mark.parametrize("damage", [_tar_truncated], ids=["truncated-tar"])
@pytest.mark.slow
def test_corrupt_shard_raises_shard_error_naming_it_and_shows_in_stats(
    shard_server, dataset, start_agent, tmp_path, damage
):
    ds = dataset(2, samples=6, payload=400)
    bad_path, words = damage(shard_server.root)
    assert tar_problem(bad_path.read_bytes()[: 64 << 10]) is None  # passes the download's head check
    bad_url = shard_server.url(bad_path.name)
    list_file = write_url_list(tmp_path / "lists2" / "urls.txt", [*ds.urls, bad_url])
    cache = tmp_path / "cache"
    agent = start_agent(cache, list_file, "--prefetch", "3", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 15, "the damaged shard did not pass the download check")
    assert CacheLayout.of(cache).shard_path(bad_url).read_bytes() == bad_path.read_bytes()

    with pytest.raises(ShardError) as info:
        list(in_process_loader(cache, "raiser"))
    assert info.value.url == bad_url and bad_url in str(info.value), str(info.value)
    assert words in str(info.value), str(info.value)
    # Damaged at its source: fetched once more, found damaged again, failed with the reason.
    s = agent.wait_stats(lambda s: s["failed"], 10, "the damaged shard was not failed")
    corrupt = s["agent"]["corrupt"]
    assert [c["url"] for c in corrupt] == [bad_url], corrupt
    assert words in corrupt[0]["error"] and bad_url in corrupt[0]["error"], corrupt
    assert s["corrupt"] == 2, s  # the first copy and the one fetched again
    assert [f["url"] for f in s["failed"]] == [bad_url] and words in s["failed"][0]["error"], s["failed"]
    assert s["shards"]["cached"] == 2
    assert agent.running()


# -- hostile peers on the agent's and the workers' sockets ------------------------------------


class RawPeer:
    """A raw DEALER socket: send any frames, read replies with a deadline."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def reply(self, timeout: float = 5.0) -> dict[str, Any] | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        frames = self.sock.recv_multipart()
        return json.loads(frames[0])

    def ask(self, *frames: bytes, timeout: float = 5.0) -> dict[str, Any]:
        self.send(*frames)
        r = self.reply(timeout)
        assert r is not None, f"no reply within {timeout}s to {frames[0][:60]!r}"
        return r

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw_peers():
    opened: list[RawPeer] = []

    def make(endpoint: str) -> RawPeer:
        p = RawPeer(endpoint)
        opened.append(p)
        return p

    yield make
    for p in opened:
        p.close()


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def client_key(cache: Path, worker: int | None = None) -> str:
    """The key this agent run's clients send to it (or to ``worker``), as a client holding the
    token gets it: without it a message is refused before anything else looks at it
    (tests/test_trust.py)."""
    endpoint = json.loads((cache / "agent.json").read_text())["endpoint"]
    conn = AgentConnection(endpoint, timeout=10, cache_dir=cache)
    try:
        conn.request({"op": "ping"})
        key = conn.key if worker is None else conn.worker_key(worker)
        assert key is not None
        return key
    finally:
        conn.close()


def _keyed(frame: bytes, key: str) -> bytes:
    """``frame`` with the key added, if it is a JSON object: added to its text, which is not
    parsed (the deeply nested frame would recurse to the limit, 1e999 would come back as
    Infinity)."""
    if not (frame.startswith(b"{") and frame.endswith(b"}")):
        return frame
    return frame[:-1] + b',"key":' + _j(key) + b"}"


def _proved(frame: bytes, key: str) -> bytes:
    """``frame`` with the proof of its id under a worker's ``key`` added, if it is a JSON object."""
    if not frame.startswith(b"{"):  # as _keyed
        return frame
    try:
        obj = json.loads(frame)
    except (ValueError, RecursionError):
        return frame
    return _j({**obj, "auth": request_proof(key, obj.get("id"))}) if isinstance(obj, dict) else frame


@pytest.mark.slow
def test_hostile_messages_get_errors_or_a_dropped_peer_and_service_goes_on(
    shard_server, dataset, start_agent, raw_peers, tmp_path
):
    ds = dataset(3, samples=5, payload=500)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--workers", "2", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 15, "not all 3 shards cached")
    endpoint = json.loads((cache / "agent.json").read_text())["endpoint"]
    workers_before = worker_pids(agent.pid)
    assert len(workers_before) == 2
    key = client_key(cache)

    # The agent's control socket.
    peer = raw_peers(endpoint)
    for anon in ({"op": "stats", "id": 5}, {"op": "stats", "id": 5, "key": 7}, {"op": "stats", "id": 5, "key": "é"}):
        r = peer.ask(_j(anon))  # the same user, but no key: refused on IPC as on TCP (tests/test_trust.py)
        assert r["ok"] is False and r["need_token"] is True and "token" in r["error"] and "stats" not in r, r
        assert "proof" not in r, r  # a refusal proves nothing: its id is the sender's choice
    r = peer.ask(b"\x00\xffgarbage\x80")
    assert r["ok"] is False and "not UTF-8 JSON" in r["error"], r
    r = peer.ask(b"[1, 2, 3]")
    assert r["ok"] is False and "JSON object" in r["error"], r
    run = peer.ask(_j({"op": "auth", "id": 4, "nonce": "n" * 16}))["run"]
    replies = agent_key((cache / "token").read_text().strip(), run)
    r = peer.ask(_j({"op": "frobnicate", "reader": "x", "id": 7, "key": key}))
    proved = reply_proof(replies, 7)  # every reply to a keyed message, errors too
    assert r == {"op": "reply", "id": 7, "ok": False, "error": "unknown op 'frobnicate'", "proof": proved}, r
    r = peer.ask(_j({"op": "frobnicate", "id": 8, "key": key}))
    assert r["ok"] is False and r["id"] == 8 and "frobnicate" in r["error"], r
    # Ids no client sends (a lone surrogate, nested about as deep as the JSON decoder goes, a
    # list, a float, too long): an error, with or without the key, and the agent goes on.
    for depth in range(970, 1000, 3):
        deep = b'{"op": "stats", "id": ' + b"[" * depth + b"]" * depth + b"}"
        r = peer.ask(_keyed(deep, key))
        assert r["ok"] is False and r["id"] is None and "proof" not in r, r
        assert "'id'" in r["error"] or "not UTF-8 JSON" in r["error"], r
    for odd in (_j({"op": "stats", "id": "\ud800", "key": key}), _j({"op": "stats", "id": [1], "key": key})):
        for message in (odd, odd.replace(b'"key"', b'"nokey"')):
            r = peer.ask(message)
            assert r["ok"] is False and r["id"] is None and "'id'" in r["error"] and "proof" not in r, r
    for odd_id in (1.5, True, "x" * 65):
        r = peer.ask(_j({"op": "stats", "id": odd_id, "key": key}))
        assert r["ok"] is False and r["id"] is None and "'id'" in r["error"], r
    for proto in (0, pickle.HIGHEST_PROTOCOL):
        r = peer.ask(pickle.dumps({"op": "stats", "id": 9}, protocol=proto))
        assert r["ok"] is False and "not UTF-8 JSON" in r["error"], r
    peer.send(b"{" + b" " * (2 << 20) + b"}")  # over the 1 MiB limit: the peer is dropped
    assert peer.reply(1.5) is None, "a 2 MiB message was answered"
    fresh = raw_peers(endpoint)
    r = fresh.ask(_j({"op": "stats", "id": 10, "key": key}))
    assert r["ok"] is True and r["stats"]["agent"]["pid"] == agent.pid, r

    # A worker's socket.
    wkey = client_key(cache, worker=0)
    w0 = worker_endpoints(endpoint, 2)[0]
    assert w0.endswith("-w0.sock"), w0
    wpeer = raw_peers(w0)
    first = pack_numbers([0, 0])  # a read's items: sample 0 of its first URL
    r = wpeer.ask(_j({"op": "read", "id": 6, "urls": [ds.urls[0]], "auth": request_proof(key, 6)}), first)
    assert r["ok"] is False and r["kind"] == "refused" and "keys" not in r, r  # the agent's key is not a worker's
    # A refusal proves nothing: its id is the asker's choice (a consumer with the worker's key is
    # never refused; one with a restarted agent's old key could not check a proof anyway).
    assert "proof" not in r, r
    r = wpeer.ask(_j({"op": "read", "id": 6, "urls": [ds.urls[0]], "key": wkey}), first)
    assert r["ok"] is False and r["kind"] == "refused" and "keys" not in r, r  # the key itself never travels
    r = wpeer.ask(b"\x00\xffgarbage\x80")
    assert r["ok"] is False and r["kind"] == "protocol" and "not UTF-8 JSON" in r["error"], r
    r = wpeer.ask(b"[1, 2, 3]")
    assert r["ok"] is False and r["kind"] == "protocol", r
    r = wpeer.ask(_j({"op": "frobnicate", "id": 7, "auth": request_proof(wkey, 7)}))
    assert r == {
        "op": "error",
        "id": 7,
        "ok": False,
        "kind": "protocol",
        "error": "unknown op 'frobnicate'",
        "proof": reply_proof(wkey, 7),
    }, r
    r = wpeer.ask(pickle.dumps({"op": "read", "id": 9, "urls": ds.urls[:1], "items": [[0, 0]]}))
    assert r["ok"] is False and r["kind"] == "protocol", r
    read = {"op": "read", "id": 11, "urls": [ds.urls[0]], "auth": request_proof(wkey, 11)}
    r = wpeer.ask(_j(read), pack_numbers([0, 10**6]))
    assert r["ok"] is False and r["kind"] == "protocol" and "no sample" in r["error"], r
    # Items that are not whole (url index, sample index) pairs of numbers, or name no URL.
    for frames, error in [
        ((), "one frame"),
        ((first, first), "one frame"),
        ((pack_numbers([0, 0, 0]),), "bad read request"),
        ((first[:-1],), "not a whole number"),
        ((pack_numbers([0, 0])[:8] + (-1).to_bytes(8, "little", signed=True),), "negative"),
        ((pack_numbers([1, 0]),), "names no URL"),
    ]:
        r = wpeer.ask(_j(read), *frames)
        assert r["ok"] is False and r["kind"] == "protocol" and error in r["error"], (frames, r)
    r = wpeer.ask(
        _j(
            {
                "op": "read",
                "id": 12,
                "urls": ["http://elsewhere/../../etc/passwd"],
                "auth": request_proof(wkey, 12),
            }
        ),
        first,
    )
    assert r["ok"] is False and r["kind"] == "missing", r
    wpeer.send(b"{" + b" " * (2 << 20) + b"}")
    assert wpeer.reply(1.5) is None, "a 2 MiB message was answered by a worker"
    wfresh = raw_peers(w0)
    r = wfresh.ask(_j({"op": "read", "id": 13, "urls": [ds.urls[0]], "auth": request_proof(wkey, 13)}), first)
    assert r["ok"] is True and r["keys"] == ["s00000_00000"] and r["proof"] == reply_proof(wkey, 13), r

    # Service goes on: same processes, a full epoch.
    got = {
        (s["__url__"], s["__key__"]): {k: hashlib.sha256(v).hexdigest() for k, v in s.items() if not k.startswith("__")}
        for s in in_process_loader(cache, "after-hostile")
    }
    assert got == reference(ds.paths, ds.urls)
    assert agent.running(), agent.stderr_tail()
    s = agent.stats()
    assert s["agent"]["worker_restarts"] == 0 and worker_pids(agent.pid) == workers_before, s["agent"]
    assert "Traceback" not in agent.stderr_text(), agent.stderr_tail()


# Single messages that took the agent or a worker down up to 0eca1b8 (fixed in 01f59c9) instead of
# failing alone, as protocol.py promises ("a malformed message is a ProtocolError for that message only").

_HELLO = _j({"op": "hello", "id": 1, "reader": "r", "job": "j", "rank": 0, "world_size": 1, "protocol": PROTOCOL})
_STATS = _j({"op": "stats", "id": 99})
_DEEP = b"[" * 100_000  # 100 KB, well under the 1 MiB limit; json.loads raises RecursionError


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([_DEEP, _STATS], id="deeply-nested-json"),
        # the 'counts' lookup hashed each element: TypeError, unhashable type 'list'
        pytest.param([_j({"op": "counts", "id": 1, "urls": [[1]]}), _STATS], id="counts-of-a-list"),
        # a report's fields were kept unchecked; the next stats compared 'x' > 0.2 in _jobs_view
        pytest.param(
            [_HELLO, _j({"op": "report", "id": 2, "reader": "r", "waiting": "x"}), _STATS],
            id="report-with-text-waiting",
        ),
        # same for a worker report; the next stats summed 'x' in the agent's _starved_by (now verdict.starved_by)
        pytest.param([_j({"op": "worker", "index": 0, "busy": "x"}), _STATS], id="worker-report-with-text-busy"),
        # JSON's 1e999 is Python's infinity: kept in the stats, every stats reply held Infinity, which no
        # client reads ("agent not running"); a number past 64 bits failed `wdscache stats` in format_size.
        pytest.param(
            [_HELLO, _j({"op": "report", "id": 2, "reader": "r"})[:-1] + b',"rate":1e999}', _STATS],
            id="report-with-an-infinite-rate",
        ),
        pytest.param(
            [_HELLO, _j({"op": "report", "id": 2, "reader": "r", "bytes": 10**400}), _STATS],
            id="report-with-a-number-past-64-bits",
        ),
    ],
)
def test_one_malformed_message_does_not_kill_the_agent(
    shard_server, dataset, start_agent, raw_peers, run_cli, tmp_path, frames
):
    ds = dataset(1, samples=2, payload=100)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    peer = raw_peers(json.loads((cache / "agent.json").read_text())["endpoint"])
    key = client_key(cache)
    for frame in frames:
        peer.send(_keyed(frame, key))

    def stats_reply() -> dict[str, Any] | None:
        if not agent.running():
            pytest.fail(
                f"one message killed the agent (exit {agent.proc.returncode})\n{agent.stderr_tail()}", pytrace=False
            )
        while (r := peer.reply(0.05)) is not None:
            if r.get("id") == 99:
                return r
        return None

    r = wait_for(stats_reply, 5, lambda: f"no stats reply\n{agent.stderr_tail()}")
    assert r["ok"] is True and r["stats"]["agent"]["pid"] == agent.pid
    assert agent.stats()["agent"]["pid"] == agent.pid  # as `wdscache stats` reads it, and shows it
    shown = run_cli("stats", "--cache-dir", cache)
    assert shown.returncode == 0 and f"pid {agent.pid}" in shown.stdout, shown.stdout + shown.stderr
    assert "Traceback" not in agent.stderr_text(), agent.stderr_tail()


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param((_DEEP,), id="deeply-nested-json"),
        # layout.shard_name encoded URLs with 'surrogateescape', which cannot encode a lone surrogate
        pytest.param((_j({"op": "read", "id": 1, "urls": ["\ud800"]}), pack_numbers([0, 0])), id="lone-surrogate-url"),
    ],
)
def test_one_malformed_message_does_not_kill_a_worker(shard_server, dataset, start_agent, raw_peers, tmp_path, frames):
    ds = dataset(1, samples=2, payload=100)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    workers = wait_for(lambda: worker_pids(agent.pid), 10, "no worker process found")
    endpoint = json.loads((cache / "agent.json").read_text())["endpoint"]
    peer = raw_peers(worker_endpoints(endpoint, 1)[0])
    peer.send(_proved(frames[0], client_key(cache, worker=0)), *frames[1:])
    r = peer.reply(3)
    restarts = agent.stats()["agent"]["worker_restarts"]
    assert r is not None and restarts == 0 and worker_pids(agent.pid) == workers, (
        f"no reply, worker restarts {restarts}\n{agent.stderr_tail()}"
    )
    assert r["ok"] is False and r["kind"] in ("protocol", "missing"), r  # refused, or simply not cached


@pytest.mark.slow
def test_a_shard_table_from_anyone_but_our_workers_is_not_passed_on(
    shard_server, dataset, start_agent, raw_peers, tmp_path
):
    """Workers take a walked table from the agent without walking the shard again: one that
    any peer could have sent would make them serve the wrong bytes."""
    from wdscache.agent.sampletable import PackedSamples
    from wdscache.shared.samples import SampleSpan

    ds = dataset(2, samples=5, payload=500)
    cache = tmp_path / "cache"
    shard_server.ttfb = 1.0  # the workers are up before any shard is published
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--workers", "2")
    agent.wait_stats(
        lambda s: s["shards"]["cached"] == 2 and all(w.get("indexed") == 2 for w in s["agent"]["workers"]),
        20,
        "both workers indexing the 2 shards",
    )
    layouts, frames = PackedSamples([SampleSpan("forged", (("jpg", 0, 512),))]).parts()
    peer = raw_peers(json.loads((cache / "agent.json").read_text())["endpoint"])
    key = client_key(cache)  # a client's key, which gets its messages past the door, but no worker's secret
    for secret in ({}, {"secret": "0" * 32}, {"secret": 7}, {"secret": "\u00e9" * 32}):
        header = {
            "op": "walked",
            "id": 1,
            "url": ds.urls[0],
            "identity": [0, 0, 0, 0],
            "layouts": layouts,
            "key": key,
            **secret,
        }
        r = peer.ask(_j(header), *frames)
        assert r["ok"] is False and "own workers" in r["error"], r
        # Nor may anyone else tell a shard's count, or take a worker's place (and its hints).
        for report in (
            {"op": "counted", "id": 2, "url": ds.urls[1], "samples": 1},
            {"op": "worker", "id": 3, "index": 0},
        ):
            r = peer.ask(_j({**report, "key": key, **secret}))
            assert r["ok"] is False and "own workers" in r["error"], r
    workers = agent.stats()["agent"]["workers"]
    assert sum(w["adopted"] for w in workers) == sum(w["walked"] for w in workers) == 2, workers
    assert peer.ask(_j({"op": "counts", "id": 4, "urls": ds.urls, "key": key}))["counts"] == [None, None]  # never read
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        assert len(list(loader)) == 10  # served from the workers' own tables
    assert agent.running(), agent.stderr_tail()
