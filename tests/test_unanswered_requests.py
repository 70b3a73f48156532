"""A request nobody answers ends within its timeout, however many went unanswered before it:
no send waits for an agent (or sample worker) that is gone or stopped, and a random-access
read's pings while it waits for a worker count against its timeout. A shard a worker cannot read
is a FetchError (an OSError) naming it."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.agents import kill_agent
from tests.helpers.procs import files_held, worker_pids
from tests.helpers.waits import wait_for
from wdscache import AgentUnavailableError, FetchError, ShardListDataset
from wdscache.shared.layout import CacheLayout
from wdscache.training.random_access import PING_EVERY

ROOT = Path(__file__).resolve().parents[1]
# Past the SNDHWM (1000) messages a ZeroMQ socket queues for a peer that is gone: the request
# after those blocked for ever (each queued one request; a 300 s request queued ~300 run checks).
CALLS = 1200
CALL_TIMEOUT = 0.002  # seconds each of those requests waits
RA_TIMEOUT = 3.0  # a random-access dataset's timeout


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line ``proc`` prints, within ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the client's process printed nothing in {timeout:.0f} s: a request blocked"
    line = proc.stdout.readline()
    assert line, f"the client's process exited ({proc.wait(5)})"
    return line.strip()


def _say(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


@pytest.mark.slow  # two agents started, one killed, 1200 requests: about 8 s
def test_requests_in_a_row_to_a_killed_agent_each_end_in_their_timeout_and_go_on_once_it_is_back(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    ds = dataset(1, samples=4, payload=500)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file)
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.dead_agent_job", str(cache), ds.urls[0], str(CALLS), str(CALL_TIMEOUT)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "job.log", "wb"),  # noqa: SIM115 (closed with the process)
        text=True,
    )
    try:
        assert _line(job, 30) == "pinned"
        kill_agent(agent)
        _say(job)
        out = json.loads(_line(job, 30))
        assert out["raised"] == {"AgentUnavailableError": CALLS}, out
        assert out["longest"] < CALL_TIMEOUT + 1.0, out  # a bound on a hang, not a speed
        start_agent(cache, ds.list_file)
        _say(job)
        stats = json.loads(_line(job, 30))
        assert stats["agent"]["pinned"] == 1  # the client's pin, taken again at the new run
        assert job.wait(20) == 0, (tmp_path / "job.log").read_text()[-2000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def _read_in_thread(ds: ShardListDataset, index: int) -> tuple[threading.Thread, dict[str, Any]]:
    """``ds[index]`` in a thread of its own; the dict gets what it raised and how long it took."""
    out: dict[str, Any] = {}

    def read() -> None:
        started = time.monotonic()
        try:
            ds[index]
        except Exception as exc:
            out["error"] = exc
        out["took"] = time.monotonic() - started

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, out


def _pinned_and_open(cache: Path, url: str) -> None:
    """Wait until this process holds the cache file of ``url`` open (pinned: the session asks
    the shard's table of a worker next)."""
    path = str(CacheLayout.of(cache).shard_path(url))
    wait_for(lambda: path in files_held("self", cache)[0], 20, f"{path} never opened")


def _two_cached_shards(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], cache: Path, timeout: float
) -> tuple[Any, list[str], ShardListDataset]:
    """An agent on ``cache`` with two shards of 4 samples cached, their URLs, and a dataset over them."""
    urls, _, list_file = dataset(2, samples=4, payload=300)
    agent = start_agent(cache, list_file)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "the shards were not cached")
    ds = ShardListDataset(
        [{"url": u, "nsamples": 4} for u in urls], cache_dir=cache, transformations=[], timeout=timeout
    )
    return agent, urls, ds


@pytest.mark.slow  # waits out its timeout, the agent started first: about 8 s
def test_a_random_access_read_whose_worker_and_agent_stop_ends_within_its_timeout(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # Each turn of the wait for the worker counted 0.25 s, and its ping waited up to 1 s more for
    # the stopped agent: with timeout=4 it raised after 21 s.
    cache = tmp_path / "cache"
    agent, urls, ds = _two_cached_shards(dataset, start_agent, cache, RA_TIMEOUT)
    workers = worker_pids(agent.pid)
    stopped = [*workers]
    try:
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        thread, out = _read_in_thread(ds, 0)
        _pinned_and_open(cache, urls[0])
        os.kill(agent.pid, signal.SIGSTOP)
        stopped.append(agent.pid)
        thread.join(RA_TIMEOUT + 30)
        assert not thread.is_alive(), f"ds[0] still waited {RA_TIMEOUT + 30:.0f} s later"
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    try:
        # Its timeout, and a second at most for the release of its pin to the stopped agent.
        took = out["took"]
        assert took < RA_TIMEOUT + PING_EVERY + 1.5, f"ds[0] raised after {took:.1f} s with timeout={RA_TIMEOUT:g}"
        assert isinstance(out.get("error"), AgentUnavailableError), out
        assert "sample worker did not answer" in str(out["error"])  # (not the release's own timeout)
    finally:
        ds.close()


def test_a_shard_a_worker_cannot_read_is_a_fetch_error_naming_it(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # It was a ProtocolError: neither an OSError nor naming the shard in its url.
    cache = tmp_path / "cache"
    agent, urls, ds = _two_cached_shards(dataset, start_agent, cache, 20)
    workers = worker_pids(agent.pid)
    try:
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            thread, out = _read_in_thread(ds, 0)
            _pinned_and_open(cache, urls[0])
            # Deleted behind the agent's back once pinned and opened, before the worker reads it.
            CacheLayout.of(cache).shard_path(urls[0]).unlink()
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        thread.join(30)
        assert not thread.is_alive(), "ds[0] still waited 30 s later"
        error = out.get("error")
        assert isinstance(error, FetchError) and isinstance(error, OSError), out
        assert error.url == urls[0]
        assert "a sample worker of the agent could not read its cache file" in str(error)
        assert ds[4]["__key__"] == "s00001_00000"  # the other shard reads on
    finally:
        ds.close()
