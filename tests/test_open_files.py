"""Open files: an agent under a low ``ulimit -n`` serves many small shards to several consumers
(its workers' files stay few, whatever the shards read), and a worker that runs out anyway says
so, never blaming a shard a skip handler would then drop.

A real agent (started through the CLI, its limit set by a wrapper that execs it) downloads from
the loopback server; consumers read over real sockets; the workers are looked at through /proc.
"""

from __future__ import annotations

import os
import resource
import sys
import threading

import pytest

from scripts.console import wdscache_exe
from tests.helpers.procs import worker_pids
from tests.helpers.streaming import Consumer, reference, samples_of
from wdscache import CachedMultiLoader, ShardError, Tuning, WdsCacheError

LIMIT = 128  # the agent's (and its workers') soft and hard limit on open files
WORKER_FILES = 64  # open files a worker may hold here: its own few dozen and the consumers' connections


def limited(files: int) -> list[str]:
    """The command that runs ``wdscache`` (same pid) with at most ``files`` open files, soft and hard."""
    boot = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (%d, %d)); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", boot % (files, files), wdscache_exe()]


def files_of(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0  # gone


class FileWatch:
    """The most files each of ``pids`` held open, looked at every few milliseconds until stopped."""

    def __init__(self, pids: list[int]) -> None:
        self.most = dict.fromkeys(pids, 0)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.005):
            for pid in self.most:
                self.most[pid] = max(self.most[pid], files_of(pid))

    def stop(self) -> dict[int, int]:
        self.done.set()
        self.thread.join(5)
        return self.most


@pytest.mark.slow
def test_workers_hold_few_files_however_many_shards_consumers_read(tmp_path, shard_server, dataset, start_agent):
    """Reads of 2048 small samples name hundreds of shards: each mapped shard once held a file
    open (Python's mmap keeps a dup of its descriptor), so under ulimit -n 128 every worker ran
    out and each consumer's epoch ended at "bad shard ...: internal error: OSError"."""
    data = dataset(200, samples=4, payload=200)
    agent = start_agent(tmp_path / "cache", data.list_file, "--workers", "2", exe=limited(LIMIT))
    workers = worker_pids(agent.pid)
    assert len(workers) == 2
    watch = FileWatch(workers)
    consumers = [
        Consumer(tmp_path, agent.cache_dir, f"c{i}", "--job", f"j{i}", "--seed", str(i), "--timeout", "60")
        for i in range(4)
    ]
    got = [samples_of(c.wait(120)) for c in consumers]
    most = watch.stop()
    expected = reference(data.paths, data.urls)
    for lines in got:
        assert len(lines) == len(expected) and {(s["url"], s["key"]): s["fields"] for s in lines} == expected
    assert all(0 < n <= WORKER_FILES for n in most.values()), most
    assert "Too many open files" not in agent.stderr_text(), agent.stderr_tail()
    # Said at start: the limit, and how to raise it.
    assert f"the limit on open files is {LIMIT} (ulimit -n; hard limit {LIMIT})" in agent.stderr_text()


def lowest_free_fd(pid: int) -> int:
    held = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(held) + 1) if n not in held)


@pytest.mark.slow
def test_a_worker_out_of_files_raises_what_it_is_and_no_shard_is_skipped(tmp_path, shard_server, dataset, start_agent):
    """A worker that cannot open a shard for lack of files answers a fault of the agent's: the
    loader raises it at once, even with on_error="skip", which drops no healthy shard for it (it
    used to answer "internal error: OSError", which skip took for a bad shard)."""
    data = dataset(40, samples=4, payload=200)
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "40")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 40, 30, "the 40 shards cached")
    (worker,) = worker_pids(agent.pid)
    got = []
    with (
        CachedMultiLoader(
            cache_dir=agent.cache_dir, shuffle=False, on_error="skip", timeout=30, tuning=Tuning(request_size=4)
        ) as loader,
        pytest.raises(WdsCacheError) as raised,
    ):
        for sample in loader:
            got.append(sample["__key__"])
            if len(got) == 8:  # connected, two shards read: from now on the worker can open no file
                free = lowest_free_fd(worker)
                resource.prlimit(worker, resource.RLIMIT_NOFILE, (free, free))
    assert not isinstance(raised.value, ShardError)
    assert "too many open files" in str(raised.value) and "ulimit -n" in str(raised.value), raised.value
    assert len(got) < 160  # it ended there, no shard skipped past it
    assert "too many open files" in agent.stderr_text(), agent.stderr_tail()
