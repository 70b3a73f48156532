"""A step of the agent's wall clock (an NTP step, a VM resumed) changes nothing stats tells of
silence or uptime: a stopped rank is shown silent, and a job relaunched with another world
size let in, after a step back; no live rank or worker is shown silent after a step forward;
uptime never goes negative nor jumps. The agent runs through tests/helpers/clock_shift.py,
which moves its time.time() alone; the consumers, its workers and the test keep the real one."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from tests.helpers.agents import run_wdscache
from tests.helpers.clock_shift import ShiftedClock
from tests.helpers.procs import stat_fields
from tests.helpers.streaming import samples_of
from tests.helpers.waits import wait_for
from wdscache.shared.stats import collect

LEEWAY = 1.0  # seconds an uptime may be over the test's count of it (it is rounded; stats reads /proc's ticks)


def _ranks(s: dict[str, Any], job: str) -> dict[str, Any]:
    return s["jobs"].get(job, {})


@pytest.mark.slow  # the ranks are silent only after SILENT_AFTER (5 s); stats waits 5 s for a stopped agent
def test_after_a_step_back_stopped_ranks_show_silent_and_a_smaller_relaunch_is_let_in(
    tmp_path, dataset, start_agent, consumers
):
    data = dataset(4, samples=50, payload=500)
    cache = tmp_path / "cache"
    clock = ShiftedClock(tmp_path / "offset", 3600)  # an hour ahead at its start: back to 0 is a step back
    began = time.monotonic()
    agent = start_agent(cache, data.list_file, exe=clock.exe)
    old = [
        consumers(cache, f"r{r}", "--job", "je", "--rank", str(r), "--world-size", "2", "--sleep", "0.1")
        for r in range(2)
    ]
    agent.wait_stats(
        lambda s: len(_ranks(s, "je")) == 2 and all(r.get("samples") for r in _ranks(s, "je").values()),
        30,
        "both ranks of job je reporting",
    )
    for c in old:  # they hang (or died where the agent cannot see their processes)
        os.kill(c.proc.pid, signal.SIGSTOP)
    clock.step(0)

    s = agent.wait_stats(
        lambda s: len(_ranks(s, "je")) == 2 and all(r.get("silent_s") for r in _ranks(s, "je").values()),
        20,
        "the stopped ranks of je shown silent",
    )
    assert [(r["rate"], r["waiting"]) for r in _ranks(s, "je").values()] == [(0.0, 0.0)] * 2
    assert 0 <= s["agent"]["uptime_s"] <= time.monotonic() - began + LEEWAY
    new = consumers(cache, "new", "--job", "je", "--world-size", "1", "--stop-after", "20")
    assert len(samples_of(new.wait(60))) == 20  # not refused: "runs with world_size 2, but rank 0 says 1"

    # Stopped, the agent gives no answer: stats counts its uptime from its agent.json, which
    # holds the start as its clock told it, an hour ahead of the one we keep.
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stat_fields(agent.pid)[0] == "T", 10, "the agent never stopped")
        r = run_wdscache("stats", "--cache-dir", cache, "--json")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    shown = json.loads(r.stdout)["agent"]
    assert shown["answering"] is False
    assert 0 <= shown["uptime_s"] <= time.monotonic() - began + LEEWAY, shown


@pytest.mark.slow
def test_after_a_step_forward_no_live_rank_or_worker_shows_silent(tmp_path, dataset, start_agent, consumers):
    data = dataset(4, samples=50, payload=500)
    cache = tmp_path / "cache"
    clock = ShiftedClock(tmp_path / "offset")
    began = time.monotonic()
    agent = start_agent(cache, data.list_file, "--workers", "2", exe=clock.exe)
    consumers(cache, "c0", "--job", "live", "--sleep", "0.05")
    agent.wait_stats(
        lambda s: _ranks(s, "live").get("0", {}).get("samples") and all("seen" in w for w in s["agent"]["workers"]),
        30,
        "rank 0 of job live and both workers reporting",
    )
    clock.step(600)
    after = time.time() + 600  # the agent's clock: each report it takes from now on is seen later

    def reported_since() -> dict[str, Any] | None:
        """Stats, once the rank and every worker reported after the step; none shown silent meanwhile."""
        s = collect(cache)
        rank, workers = _ranks(s, "live")["0"], s["agent"]["workers"]
        assert "silent_s" not in rank and [w for w in workers if "silent_s" in w] == [], s
        assert 0 <= s["agent"]["uptime_s"] <= time.monotonic() - began + LEEWAY, s["agent"]
        return s if min(w["seen"] for w in [rank, *workers]) >= after else None

    wait_for(reported_since, 10, "rank 0 and both workers never reported after the step", interval=0.02)
