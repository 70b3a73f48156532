"""Downloads out of open files: the agent's fault, never a shard's. A real agent (started through
the CLI) downloads from the loopback server; once a consumer reads, the agent's own limit on open
files (not its workers') is lowered to leave fewer free than it keeps for connections, so that no
download starts; later it is raised again. (Lowered to none free, the next connection a client
made would abort the agent: ZeroMQ's ipc listener cannot accept it.) Downloads in many parts at
once, from a bandwidth-capped server, leave the agent's last files to connections, its free files
sampled through /proc meanwhile. An agent started under a low limit downloads in fewer parts;
one left too few files for even one part says its limit is too low.
"""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
from typing import Any

import pytest

from tests.helpers.agents import wdscache_exe
from tests.helpers.streaming import assert_epoch_exact, reference
from wdscache import CachedMultiLoader, FetchError, ShardClient, Tuning, WdsCacheError
from wdscache.agent.downloads import files_per_download, files_reserve

SHARDS, SAMPLES = 24, 4
CONNECTIONS = 30  # made one after another while the agent is starved
SPARE = 4  # files left free to the starved agent: fewer than it keeps for connections
HELD_BACK = "are kept for connections"  # what the agent says of downloads it holds back
# Downloads at once in many parts: the agent is left this many files free, fewer than 8 downloads
# of 8 parts open (a connection and a file each); the reserve of a quarter of its limit kept.
PARTED_SHARDS, PARTED_FREE = 16, 112
MARGIN = 4  # files the agent may open besides downloads (its index, a log) while they run
# An agent started under a low limit, read by RANKS consumers: their connections, its own files and
# those kept for connections leave room for downloads of fewer parts than --download-parts only.
LOW_LIMIT, RANKS, LOW_SHARDS = 52, 3, 12
ONE_PART = files_per_download(1)
TOO_LOW = "too low for even one download"  # what the agent says when not even one part fits


def starve(pid: int) -> tuple[int, int]:
    """Lower ``pid``'s limit on open files to leave SPARE free (fewer than the agent keeps for
    connections: no download starts); the limits it had."""
    was = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held = [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")]
    limit = next(n for n in range(len(held), was[0]) if n - sum(fd < n for fd in held) == SPARE)
    assert SPARE < files_reserve(limit), (limit, len(held))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, was[1]))
    return was


def starve_all(pid: int) -> tuple[int, int]:
    """Lower ``pid``'s limit on open files to leave fewer free, beside those it keeps for
    connections, than a download of one part needs; the limits it had."""
    was = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held = [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")]
    limit = next(
        n for n in range(len(held), was[0]) if n - sum(fd < n for fd in held) - files_reserve(n) == ONE_PART - 1
    )
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, was[1]))
    return was


def watch_until(client: ShardClient, seen: dict[str, Any], deadline: float) -> None:
    """Stats (over ``client``'s connection, made before the agent ran out) until they say the
    agent is out of open files or some shard failed, kept in ``seen``."""
    while time.monotonic() < deadline:
        s = client.stats(timeout=5)
        if s["agent"].get("out_of_files") or s["shards"].get("failed"):
            seen["stats"] = s
            return
        time.sleep(0.1)


@pytest.mark.slow
def test_an_agent_out_of_files_fails_no_shard_and_the_epoch_completes(tmp_path, dataset, start_agent):
    """Downloads that could not open a file were failed attempts of their shard's: after the
    retries the shard FAILED (in the index too, so later epochs skipped it), and a consumer with
    on_error="skip" dropped its samples. Now the downloads wait, the stats say why, and once the
    limit is raised again the epoch is whole."""
    data = dataset(SHARDS, samples=SAMPLES, payload=200)
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "2", "--retries", "1")
    seen: dict[str, Any] = {}
    got: list[tuple[str, str]] = []
    with ShardClient(agent.cache_dir, timeout=10) as client:
        client.stats()  # connected now, the files it takes in the agent held before it is starved
        raised = threading.Event()
        with CachedMultiLoader(
            cache_dir=agent.cache_dir, shuffle=False, on_error="skip", timeout=60, tuning=Tuning(request_size=2)
        ) as loader:
            for sample in loader:
                got.append((sample["__url__"], sample["__key__"]))
                if len(got) == 4 and not raised.is_set():
                    was = starve(agent.pid)

                    def relieve(was: tuple[int, int] = was) -> None:
                        try:
                            watch_until(client, seen, time.monotonic() + 30)
                        finally:
                            resource.prlimit(agent.pid, resource.RLIMIT_NOFILE, was)
                            raised.set()

                    threading.Thread(target=relieve, daemon=True).start()
        assert raised.wait(30)
        final = client.stats(timeout=10)
    assert "stats" in seen, "the agent never said it was out of open files"
    # Held back from the last files (or, for an attempt under way, out of them: "too many open files").
    fault = seen["stats"]["agent"]["out_of_files"]
    assert fault and (HELD_BACK in fault or "too many open files" in fault), seen["stats"]["agent"]
    assert "ulimit -n" in fault, seen["stats"]["agent"]
    assert not seen["stats"]["shards"].get("failed"), seen["stats"]["failed"]
    # No shard skipped: every sample of every shard, once.
    assert len(got) == SHARDS * SAMPLES and set(got) == set(reference(data.paths, data.urls))
    assert final["shards"].get("failed", 0) == 0 and not final["failed"], final["failed"]
    assert final["shards"]["cached"] == SHARDS
    assert final["agent"]["out_of_files"] is None
    text = agent.stderr_text()
    assert HELD_BACK in text or "too many open files" in text, agent.stderr_tail()
    assert "skipping" not in text, agent.stderr_tail()


@pytest.mark.slow
def test_a_reader_waiting_past_its_timeout_on_an_agent_out_of_files_hears_the_agents_fault(
    tmp_path, dataset, start_agent
):
    """A shard whose download waits for open files past the reader's timeout is no shard's
    failure: the loader raises a WdsCacheError that names the agent's fault (not a FetchError
    that would blame the shard), and the shard is not failed. Meanwhile the agent keeps files
    for connections: a client connecting then is answered (with no file left, ZeroMQ would abort it)."""
    data = dataset(SHARDS, samples=SAMPLES, payload=200)
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "2", "--retries", "1")
    got = []
    was = None
    try:
        with (
            CachedMultiLoader(
                cache_dir=agent.cache_dir, shuffle=False, on_error="skip", timeout=8, tuning=Tuning(request_size=2)
            ) as loader,
            pytest.raises(WdsCacheError) as raised,
        ):
            for sample in loader:
                got.append(sample["__key__"])
                if len(got) == 4 and was is None:
                    was = starve(agent.pid)
        # Clients that connect now find the agent there, still short of files: its downloads,
        # tried again meanwhile, leave it the files a connection takes.
        for _ in range(CONNECTIONS):
            with ShardClient(agent.cache_dir, timeout=10) as late:
                starved = late.stats()
            assert starved["agent"]["out_of_files"], starved["agent"]
    finally:
        if was is not None:
            resource.prlimit(agent.pid, resource.RLIMIT_NOFILE, was)
    assert not isinstance(raised.value, FetchError), (raised.value, agent.stderr_tail())
    said = str(raised.value)
    assert HELD_BACK in said or "too many open files" in said, (raised.value, agent.stderr_tail())
    assert "ulimit -n" in str(raised.value) and "the agent at" in str(raised.value), raised.value
    s = agent.stats()
    assert s["shards"].get("failed", 0) == 0 and not s["failed"], s["failed"]


class FreeFiles:
    """The fewest files ``pid`` had free under ``limit`` (its open files counted in /proc every few
    milliseconds), until stopped."""

    def __init__(self, pid: int, limit: int) -> None:
        self.pid, self.limit, self.least = pid, limit, limit
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.002):
            try:
                self.least = min(self.least, self.limit - len(os.listdir(f"/proc/{self.pid}/fd")))
            except OSError:
                return  # gone

    def stop(self) -> int:
        self.done.set()
        self.thread.join(5)
        return self.least


@pytest.mark.slow
def test_downloads_in_many_parts_at_once_leave_the_last_files_to_connections(
    tmp_path, shard_server, dataset, start_agent
):
    """Each download attempt looked at the files free as it started, all of them at once, and
    then opened a connection and a file for each of its parts: 8 downloads of 8 parts took the
    agent from 112 files free to none (a file it then could not open was "too many open files",
    and a client connecting then would have aborted it). Now each claims what it may open before
    it starts: the files free never go below those kept for connections, and the agent says it
    holds downloads back, not that it ran out."""
    data = dataset(PARTED_SHARDS, samples=8, payload=100_000)  # ~800 KB shards: 13 parts of 64K
    shard_server.rate = 200_000  # bytes/s per connection: the downloads overlap
    first = tmp_path / "first.txt"
    first.write_text(data.urls[0] + "\n")
    agent = start_agent(
        tmp_path / "cache",
        first,
        "--prefetch",
        "1",
        "--download-workers",
        "8",
        "--download-parts",
        "8",
        "--download-part-size",
        "64K",
    )
    agent.wait_stats(lambda s: s["shards"].get("cached") == 1, 30, "the first shard cached")
    faults: set[str | None] = set()
    with ShardClient(agent.cache_dir, timeout=10) as client:
        client.stats()  # connected before its files are counted
        was = resource.prlimit(agent.pid, resource.RLIMIT_NOFILE)
        limit = len(os.listdir(f"/proc/{agent.pid}/fd")) + PARTED_FREE
        reserve = files_reserve(limit)
        resource.prlimit(agent.pid, resource.RLIMIT_NOFILE, (limit, was[1]))
        try:
            watch = FreeFiles(agent.pid, limit)
            prefetch = subprocess.Popen(
                [wdscache_exe(), "prefetch", "--cache-dir", str(agent.cache_dir), *data.urls[1:]],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            deadline = time.monotonic() + 120
            while prefetch.poll() is None and time.monotonic() < deadline:
                faults.add(client.stats(timeout=10)["agent"]["out_of_files"])
                time.sleep(0.05)
            if prefetch.poll() is None:
                prefetch.kill()
            said = prefetch.communicate(timeout=10)[0]
            least = watch.stop()
        finally:
            resource.prlimit(agent.pid, resource.RLIMIT_NOFILE, was)
        final = client.stats(timeout=10)
    assert prefetch.returncode == 0, said[-2000:]
    assert final["shards"]["cached"] == PARTED_SHARDS and not final["failed"], final["failed"]
    assert least >= reserve - MARGIN, (least, reserve, limit, agent.stderr_tail())
    held_back = {f for f in faults if f is not None}
    assert held_back and all(HELD_BACK in f and "ulimit -n" in f for f in held_back), held_back
    assert "Too many open files" not in agent.stderr_text(), agent.stderr_tail()


@pytest.mark.slow
def test_an_agent_under_a_low_limit_downloads_in_fewer_parts_and_the_epoch_completes(
    tmp_path, shard_server, dataset, start_agent, consumers
):
    """An agent started under a low ``ulimit -n`` (60 in the review that found it) with 3 consumers
    stalled for good: each download
    claimed the files of all its parts (9 for 4) or waited, the files free less the 15 kept for
    connections left fewer (its download threads' idle connections among the files held), no
    download ran to end and let files go, every rank read 0 samples. Now a download starts with
    as many parts as the files free leave room for, idle download threads close their
    connections, and the epoch is whole; the agent never goes below the files it keeps."""
    data = dataset(LOW_SHARDS, samples=4, payload=100_000)  # ~400 KB shards: parts of 64K
    shard_server.rate = 500_000  # bytes/s per connection: downloads overlap the consumers' reads
    agent = start_agent(
        tmp_path / "cache",
        data.list_file,
        "--download-part-size",
        "64K",
        exe=["prlimit", f"--nofile={LOW_LIMIT}:{LOW_LIMIT}", wdscache_exe()],
    )
    assert resource.prlimit(agent.pid, resource.RLIMIT_NOFILE) == (LOW_LIMIT, LOW_LIMIT)
    watch = FreeFiles(agent.pid, LOW_LIMIT)
    try:
        ranks = [
            consumers(agent.cache_dir, f"rank{r}", "--rank", str(r), "--world-size", str(RANKS), "--timeout", "60")
            for r in range(RANKS)
        ]
        lines = [line for c in ranks for line in c.wait(120)]
    finally:
        least = watch.stop()
    assert_epoch_exact(lines, reference(data.paths, data.urls))
    final = agent.stats()
    assert final["shards"]["cached"] == LOW_SHARDS and not final["failed"], final["failed"]
    assert least >= files_reserve(LOW_LIMIT) - MARGIN, (least, agent.stderr_tail())
    assert "Too many open files" not in agent.stderr_text(), agent.stderr_tail()


@pytest.mark.slow
def test_an_agent_with_too_few_files_for_one_download_says_its_limit_is_too_low(
    tmp_path, dataset, start_agent, consumers
):
    """Not even one part's files free beside those kept for connections, with no download under
    way to let any go: the agent waits, and its stats and log say the limit is too low for even
    one download (not that the source is slow). Raised, the epoch completes. (Files from disk:
    no connection to the source that an idle download thread closes to free a file.)"""
    data = dataset(SHARDS, samples=SAMPLES, payload=200)
    urls = [path.as_uri() for path in data.paths]
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "urls.txt").write_text("\n".join(urls) + "\n")
    agent = start_agent(tmp_path / "cache", tmp_path / "files" / "urls.txt", "--no-shuffle", "--prefetch", "2")
    agent.wait_stats(lambda s: not s["shards"].get("downloading"), 30, "the downloads at start ended")
    with ShardClient(agent.cache_dir, timeout=10) as client:
        client.stats()  # connected now, the files it takes in the agent held before it is starved
        was = starve_all(agent.pid)
        try:
            reader = consumers(agent.cache_dir, "reader", "--no-shuffle", "--timeout", "60")
            deadline = time.monotonic() + 30
            fault = None
            while fault is None and time.monotonic() < deadline and reader.proc.poll() is None:
                fault = client.stats(timeout=5)["agent"]["out_of_files"]
                time.sleep(0.1)
        finally:
            resource.prlimit(agent.pid, resource.RLIMIT_NOFILE, was)
        lines = reader.wait(60)
    assert fault is not None and TOO_LOW in fault and "ulimit -n" in fault, fault
    assert_epoch_exact(lines, reference(data.paths, urls))
    assert TOO_LOW in agent.stderr_text(), agent.stderr_tail()
