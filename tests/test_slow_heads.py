"""Sources whose response heads never end, though their connection is never silent (a status line,
then a header byte now and then: a broken server or proxy): a HEAD or a GET gives up once its head
is not whole within --read-timeout, start-up does not wait for ever, and SIGTERM stops the agent.

Real agents through the CLI, against a :class:`ShardServer` on 127.0.0.1 whose ``trickle`` fault
sends such heads.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.agents import FIRST_PART
from tests.helpers.waits import wait_for
from wdscache.shared.layout import CacheLayout

SHARD = {"samples": 12, "payload": 8000}  # ~100 KB: one part, its first GET's Range is FIRST_PART
HEAD_BOUND = 1.5  # the agents' --read-timeout here: a head not whole that long after its request is given up
TIMEOUTS = ("--read-timeout", f"{HEAD_BOUND:g}")
STOP_WITHIN = 5.0  # seconds an agent gets to exit after one SIGTERM


def test_an_agent_whose_sources_trickle_their_heads_comes_up_and_stops_on_one_sigterm(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(2, **SHARD)
    for path in ds.paths:
        shard_server.fail(path.name, "trickle", times=50)  # the HEADs at start-up, and every GET
    agent = start_agent(tmp_path / "cache", ds.list_file, *TIMEOUTS, wait=False)
    agent.wait_up(timeout=30)
    heads = sorted((r.path, r.fault) for r in shard_server.requests if r.method == "HEAD")
    assert heads == [(p.name, "trickle") for p in ds.paths], heads
    # Up once the heads were given up, not at their end (never): timed from the first HEAD, not the start.
    up_after = time.monotonic() - min(r.at for r in shard_server.requests if r.method == "HEAD")
    assert up_after < 15, f"up {up_after:.1f}s after its first HEAD\n{agent.stderr_tail()}"
    # Its downloads are stuck in a head too: the SIGTERM cancels them at once.
    wait_for(lambda: shard_server.count(ds.paths[0].name) >= 1, 10, lambda: agent.stderr_tail())
    t = time.monotonic()
    rc = agent.stop(timeout=STOP_WITHIN)
    assert (rc, agent.killed) == (0, False), agent.stderr_tail()
    assert time.monotonic() - t < STOP_WITHIN
    assert agent.stderr_text().rstrip().endswith("stopped"), agent.stderr_tail()


def test_one_sigterm_during_the_start_up_size_checks_stops_the_agent(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(2, **SHARD)
    for path in ds.paths:
        shard_server.fail(path.name, "trickle")
    # A read timeout far longer than the test: only the SIGTERM can end the start-up's wait.
    agent = start_agent(tmp_path / "cache", ds.list_file, "--read-timeout", "600", wait=False)
    wait_for(
        lambda: all(shard_server.count(p.name, "HEAD") for p in ds.paths),
        15,
        lambda: f"the start-up's HEADs never came\n{agent.stderr_tail()}",
    )
    rc = agent.stop(timeout=STOP_WITHIN)
    assert (rc, agent.killed) == (0, False), agent.stderr_tail()
    assert agent.stderr_text().rstrip().endswith("stopped"), agent.stderr_tail()


@pytest.mark.slow
def test_a_get_whose_head_trickles_is_retried_then_cached_or_failed_naming_its_url(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(2, **SHARD)
    healed, broken = ds.paths
    # GETs only (the start-up's HEADs carry no Range): one trickled answer, then a good one; and
    # only trickled ones, more than the one retry allowed.
    shard_server.fail(healed.name, "trickle", range=FIRST_PART)
    shard_server.fail(broken.name, "trickle", range=FIRST_PART, times=5)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, *TIMEOUTS, "--retries", "1", "--prefetch", "2")
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 1 and s["shards"]["failed"] == 1, 30, "neither cached nor failed"
    )
    assert CacheLayout.of(cache).shard_path(ds.urls[0]).read_bytes() == healed.read_bytes()
    tried = [r for r in shard_server.requests if r.path == healed.name and r.method == "GET"]
    assert [r.fault for r in tried] == ["trickle", None], tried
    # Given up at --read-timeout, not at the trickle's end (never): a busy machine may retry seconds later.
    assert HEAD_BOUND - 0.5 < tried[1].at - tried[0].at < HEAD_BOUND + 10, tried
    why = f"no whole response head within {HEAD_BOUND:g}s of the request (--read-timeout)"
    assert [f["url"] for f in s["failed"]] == [ds.urls[1]], s["failed"]
    assert s["failed"][0]["error"].startswith("gave up after 1 retries: timed out") and why in s["failed"][0]["error"]
    assert [r.fault for r in shard_server.requests if r.path == broken.name and r.method == "GET"] == ["trickle"] * 2
    assert f"retrying {ds.urls[0]}" in agent.stderr_text(), agent.stderr_tail()
