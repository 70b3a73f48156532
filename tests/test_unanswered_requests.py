"""A request nobody answers ends within its timeout, however many went unanswered before it:
no send waits for an agent (or sample worker) that is gone or stopped."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.agents import kill_agent

ROOT = Path(__file__).resolve().parents[1]
# Past the SNDHWM (1000) messages a ZeroMQ socket queues for a peer that is gone: the request
# after those blocked for ever (each queued one request; a 300 s request queued ~300 run checks).
CALLS = 1200
CALL_TIMEOUT = 0.002  # seconds each of those requests waits


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
