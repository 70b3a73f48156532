"""A loader across its agent's restart: it proves the new run, says hello again and goes on
exactly; with no agent back within its timeout it fails saying the agent died or restarted.

Real agents through the CLI, real consumer processes (tests/consumer.py), the real shard server;
the kill comes once the consumer has written samples (an event), never after a sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from tests.helpers.procs import children_of, worker_pids
from tests.helpers.streaming import Consumer, reference, samples_of
from tests.helpers.waits import stop_process, wait_for
from tests.test_faults import assert_epoch_exact, consumer_log, wait_exit

DEADLINE = 60.0


def lines_written(c: Consumer) -> int:
    """Samples the consumer has written so far (it writes line by line)."""
    try:
        return c.out.read_text().count('"key"')
    except FileNotFoundError:
        return 0


def wait_samples(c: Consumer, n: int, timeout: float = 30.0) -> None:
    def enough() -> bool:
        assert c.proc.poll() is None, f"the consumer ended before {n} samples\n{consumer_log(c)}"
        return lines_written(c) >= n
    wait_for(enough, timeout, lambda: f"the consumer never wrote {n} samples\n{consumer_log(c)}", interval=0.02)


def kill_agent(agent: Any) -> None:
    """SIGKILL the agent, and wait until its workers are gone too (they watch it)."""
    workers = worker_pids(agent.pid)
    agent.proc.send_signal(signal.SIGKILL)
    assert agent.proc.wait(10) == -signal.SIGKILL
    wait_for(lambda: not any(os.path.exists(f"/proc/{w}") for w in workers), 10,
             lambda: f"the killed agent's workers still alive: {workers}")


def test_loader_goes_on_exactly_across_a_sigkilled_and_restarted_agent(shard_server, dataset, start_agent,
                                                                       consumers, tmp_path):
    ds = dataset(8, samples=40, payload=1000)  # 320 samples
    ref = reference(ds.paths, ds.urls)
    cache = tmp_path / "cache"
    args = ("--workers", "2", "--prefetch", "8", "--cache-size", "10M")
    agent = start_agent(cache, ds.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 8, 20, "not all 8 shards cached")
    c = consumers(cache, "reader", "--job", "rs", "--sleep", "0.01", "--timeout", "15", "--request-size", "4")
    wait_samples(c, 40)
    kill_agent(agent)
    t0 = time.monotonic()
    again = start_agent(cache, ds.list_file, *args)
    lines = c.wait(DEADLINE)
    print(f"consumer finished {time.monotonic() - t0:.1f}s after the restart")
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    text = c.log.read_text(errors="replace")
    assert "without the worker's proof" not in text, text[-3000:]
    assert re.search(r"agent .*restarted", text), text[-3000:]
    assert again.running()


def test_loader_goes_on_exactly_when_its_own_list_and_a_download_span_the_restart(
        shard_server, dataset, start_agent, consumers, tmp_path):
    """A consumer's own list (the new agent is told it again) and shards downloading at the kill."""
    ds = dataset(8, samples=30, payload=3000)  # ~100 KB shards, served at 400 KB/s: downloads span the kill
    mine = ds.urls[:6]
    ref = reference(ds.paths[:6], mine)
    own = tmp_path / "own.txt"
    own.write_text("\n".join(mine) + "\n")
    shard_server.rate = 400_000
    cache = tmp_path / "cache"
    args = ("--workers", "1", "--prefetch", "2", "--cache-size", "10M")
    agent = start_agent(cache, ds.list_file, *args)
    c = consumers(cache, "reader", "--job", "own", "--urls", str(own), "--timeout", "15")
    wait_samples(c, 50)
    kill_agent(agent)
    again = start_agent(cache, ds.list_file, *args)
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    assert again.running()


def test_loader_whose_agent_does_not_come_back_fails_within_its_timeout_naming_the_death(
        shard_server, dataset, start_agent, consumers, tmp_path):
    ds = dataset(8, samples=40, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "8", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 8, 20, "not all 8 shards cached")
    c = consumers(cache, "reader", "--job", "gone", "--sleep", "0.01", "--timeout", "4", "--request-size", "4")
    wait_samples(c, 40)
    kill_agent(agent)
    t0 = time.monotonic()
    rc = wait_exit(c.proc, 30, "a consumer whose agent died")
    took = time.monotonic() - t0
    text = c.log.read_text(errors="replace")
    assert rc != 0, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("wdscache.AgentUnavailableError: "), last
    assert "died or restarted" in last and str(cache) in last, last
    assert "its workers did not answer" not in last, last
    assert took < 4 + 3, f"the consumer failed {took:.1f}s after the kill, its timeout is 4 s"


def test_loader_goes_on_exactly_when_the_agents_workers_alone_are_killed(shard_server, dataset, start_agent,
                                                                         consumers, tmp_path):
    ds = dataset(8, samples=40, payload=1000)
    ref = reference(ds.paths, ds.urls)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--workers", "2", "--prefetch", "8", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 8, 20, "not all 8 shards cached")
    workers = wait_for(lambda: (lambda w: w if len(w) == 2 else None)(worker_pids(agent.pid)), 10,
                       lambda: f"2 workers not found among {children_of(agent.pid)}")
    c = consumers(cache, "reader", "--job", "wk", "--sleep", "0.01", "--timeout", "15", "--request-size", "4")
    wait_samples(c, 40)
    for w in workers:
        os.kill(w, signal.SIGKILL)
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    assert agent.running()
