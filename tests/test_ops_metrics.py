"""Prometheus metrics: the agent's /metrics scraped over real HTTP, and
``wdscache stats --prometheus``, both parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from wdscache.shared.client import AgentConnection
from wdscache.shared.messages import Requests
from wdscache.shared.metrics import exposition


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _changes(values: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """``values`` without repeats of the one before."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


@pytest.mark.slow
def test_metrics_endpoint_and_stats_prometheus_give_the_agents_numbers(tmp_path, dataset, start_agent, run_cli):
    data = dataset(3, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "3", "--metrics-port", "0")
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "three shards cached")
    state = json.loads((cache / "agent.json").read_text())
    url = state["metrics"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), state
    conn = AgentConnection(state["endpoint"], timeout=10, cache_dir=cache)
    try:
        assert conn.request(Requests("r1").hello("train", 1, 2))["ok"]
        assert conn.request(
            {
                "op": "report",
                "reader": "r1",
                "samples": 12,
                "bytes": 3456,
                "rate": 6.0,
                "wait_s": 1.25,
                "epoch": 0,
                "position": 12,
            }
        )["ok"]

        def scraped() -> dict:
            with urllib.request.urlopen(url, timeout=5) as reply:
                assert reply.status == 200
                return _samples(reply.read().decode())

        from tests.helpers.waits import wait_for

        got = wait_for(
            lambda: (m := scraped()).get(("wdscache_consumer_samples_total", (("job", "train"), ("rank", "1")))) and m,
            10,
            "the rank's report never reached /metrics",
        )
        printed = _samples(run_cli("stats", "--cache-dir", cache, "--prometheus").stdout)
    finally:
        conn.close()
    size = sum(p.stat().st_size for p in data.paths)
    rank = (("job", "train"), ("rank", "1"))
    for metrics in (got, printed):
        assert metrics[("wdscache_agent_up", ())] == metrics[("wdscache_agent_answering", ())] == 1
        assert metrics[("wdscache_cache_bytes", ())] - metrics[("wdscache_cache_table_bytes", ())] == size
        assert metrics[("wdscache_cache_limit_bytes", ())] == s["bytes_limit"]
        assert metrics[("wdscache_download_bytes_total", ())] == size
        assert metrics[("wdscache_downloads_total", ())] == 3
        assert metrics[("wdscache_shards", (("state", "cached"),))] == 3
        assert metrics[("wdscache_shards", (("state", "failed"),))] == 0
        assert metrics[("wdscache_consumer_samples_total", rank)] == 12
        assert metrics[("wdscache_consumer_bytes_total", rank)] == 3456
        assert metrics[("wdscache_consumer_wait_seconds_total", rank)] == 1.25
        assert metrics[("wdscache_consumers", ())] == 1
        assert metrics[("wdscache_worker_samples_total", (("worker", "0"),))] == 0
        assert {k[1] for k in metrics if k[0] == "wdscache_job_starved"} == {
            (("job", "train"), ("reason", r))
            for r in (
                "budget",
                "disk",
                "files",
                "failing_source",
                "silent_source",
                "downloads",
                "slow_source",
                "workers",
                "latency",
            )
        }
    assert set(got) == set(printed)
    assert agent.stop() == 0
    # Without an agent, the cache's numbers are still there, and the agent is down.
    down = _samples(run_cli("stats", "--cache-dir", cache, "--prometheus").stdout)
    assert down[("wdscache_agent_up", ())] == down[("wdscache_agent_answering", ())] == 0
    assert down[("wdscache_cache_bytes", ())] - down[("wdscache_cache_table_bytes", ())] == size


@pytest.mark.slow
def test_a_ranks_counters_add_up_its_epochs_and_never_go_down(tmp_path, dataset, start_agent, consumers, run_cli):
    """Each epoch of a rank is a new consumer, whose own figures start at zero: scraped while the
    rank reads three epochs, its counters only grow, and end at what all three delivered."""
    from tests.helpers.streaming import samples_of
    from tests.helpers.waits import wait_for

    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--metrics-port", "0")
    url = json.loads((cache / "agent.json").read_text())["metrics"]
    rank = (("job", "epochs"), ("rank", "0"))
    names = ("samples", "bytes", "wait_seconds")
    scraped: list[tuple[float, ...]] = []  # the rank's (samples, bytes, wait_seconds), scrape by scrape

    def scrape() -> tuple[float, ...] | None:
        with urllib.request.urlopen(url, timeout=5) as reply:
            metrics = _samples(reply.read().decode())
        if ("wdscache_consumer_samples_total", rank) in metrics:
            scraped.append(tuple(metrics[(f"wdscache_consumer_{n}_total", rank)] for n in names))
        return scraped[-1] if scraped else None

    # Sleeps after each sample spread its epochs over several of the agent's snapshots (one a second).
    consumer = consumers(cache, "c", "--job", "epochs", "--epochs", "3", "--sleep", "0.1")

    def ended() -> bool:
        scrape()  # (while it reads)
        return consumer.proc.poll() is not None

    wait_for(ended, 60, "the consumer did not end")
    delivered = len(samples_of(consumer.wait()))
    assert delivered == 3 * 8
    wait_for(
        lambda: (got := scrape()) is not None and got[0] == delivered,
        10,
        lambda: f"the counter never reached the {delivered} samples of all epochs: {_changes(scraped)}",
    )
    for before, after in zip(scraped, scraped[1:], strict=False):
        assert all(b <= a for b, a in zip(before, after, strict=True)), f"a counter went down: {before} -> {after}"
    # stats --json: the totals over the agent's life, as the epochs that ended add up to.
    s = json.loads(run_cli("stats", "--cache-dir", cache, "--json").stdout)
    totals, ended = s["rank_totals"]["epochs"]["0"], s["ended_jobs"]["epochs"]["0"]
    assert ended["epochs"] == 3 and "epochs" not in s["jobs"]
    assert totals["samples"] == ended["samples"] == delivered
    assert totals["bytes"] == ended["bytes"] == scraped[-1][1] > 0
    assert totals["wait_s"] == pytest.approx(ended["wait_s"], abs=1e-3) == scraped[-1][2]


@pytest.mark.slow  # a rank is stopped past SILENT_AFTER (5 s)
def test_a_stopped_rank_is_marked_silent_in_the_metrics(tmp_path, dataset, start_agent, consumers, run_cli):
    # A rank stopped (SIGSTOP) was named in stats' text ("rank 1 silent for 6s") but nothing in the
    # metrics marked it: its rate gauge read 0, as for a rank that waits.
    import os
    import signal

    from tests.helpers.waits import wait_for

    data = dataset(2, samples=40, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--metrics-port", "0")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    url = json.loads((cache / "agent.json").read_text())["metrics"]
    ranks = [
        consumers(
            cache, f"r{r}", "--job", "j", "--rank", str(r), "--world-size", "2", "--sleep", "0.1", "--epochs", "50"
        )
        for r in (0, 1)
    ]
    silent = [("wdscache_consumer_silent_seconds", (("job", "j"), ("rank", str(r)))) for r in (0, 1)]

    def scraped() -> dict:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return _samples(reply.read().decode())

    agent.wait_stats(lambda s: all(s["jobs"].get("j", {}).get(r, {}).get("rate", 0) > 0 for r in "01"), 30, "rates")
    both = wait_for(lambda: (m := scraped()).get(silent[1]) is not None and m, 10, "no silent gauge for the ranks")
    assert (both[silent[0]], both[silent[1]]) == (0, 0), both
    os.kill(ranks[1].proc.pid, signal.SIGSTOP)
    try:
        got = wait_for(lambda: (m := scraped()).get(silent[1], 0) > 0 and m, 20, "the stopped rank never silent")
        printed = _samples(run_cli("stats", "--cache-dir", cache, "--prometheus").stdout)
    finally:
        os.kill(ranks[1].proc.pid, signal.SIGCONT)
    assert got[silent[1]] >= 5 and got[silent[0]] == 0, got  # SILENT_AFTER; the other rank reads on
    assert printed[silent[1]] >= got[silent[1]] and printed[silent[0]] == 0, printed
    rank1 = (("job", "j"), ("rank", "1"))
    assert got[("wdscache_consumer_samples_per_second", rank1)] == 0
    for c in ranks:
        c.kill()


def test_a_job_named_by_a_url_shows_in_metrics_redacted(tmp_path, dataset, start_agent, run_cli):
    from tests.helpers.waits import wait_for

    data = dataset(1, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--metrics-port", "0")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the shard cached")
    state = json.loads((cache / "agent.json").read_text())
    job = "http://u:SECRET@h/a?sig=SIGNED"
    conn = AgentConnection(state["endpoint"], timeout=10, cache_dir=cache)
    try:
        assert conn.request(Requests("r1").hello(job, 0, 1))["ok"]
        assert conn.request({"op": "report", "reader": "r1", "samples": 3, "epoch": 0, "position": 3})["ok"]

        def scraped() -> str:
            with urllib.request.urlopen(state["metrics"], timeout=5) as reply:
                return reply.read().decode()

        redacted = (("job", "http://***@h/a?sig=***"), ("rank", "0"))
        # The series shows at the hello, its count once the report is taken into the metrics.
        text = wait_for(
            lambda: _samples(t := scraped()).get(("wdscache_consumer_samples_total", redacted)) == 3 and t,
            10,
            "the rank's 3 samples never on /metrics",
        )
        printed = run_cli("stats", "--cache-dir", cache, "--prometheus").stdout
    finally:
        conn.close()
    for metrics in (text, printed):  # the same text, whoever shows it
        assert "SECRET" not in metrics and "SIGNED" not in metrics, metrics
        assert _samples(metrics)[("wdscache_consumer_samples_total", redacted)] == 3


@pytest.mark.parametrize("host", ["0.0.0.0", "localhost.example.com", "127.example.com"])  # names, not prefixes
def test_metrics_bind_loopback_unless_allow_remote(tmp_path, dataset, run_cli, host):
    data = dataset(1)
    args = ["agent", "--cache-dir", tmp_path / "c", "--urls", data.list_file, "--metrics-port", "0"]
    r = run_cli(*args, "--metrics-host", host)
    assert r.returncode == 2 and f"--metrics-host '{host}' is reachable from other machines" in r.stderr, r.stderr
    assert not (tmp_path / "c").exists()


def test_a_metrics_host_that_does_not_resolve_is_named(tmp_path, dataset, run_cli):
    data = dataset(1)
    args = ["agent", "--cache-dir", tmp_path / "c", "--urls", data.list_file, "--metrics-port", "0"]
    r = run_cli(*args, "--metrics-host", "no-such-host.invalid", "--allow-remote")
    assert r.returncode == 2 and "cannot serve metrics on no-such-host.invalid:0" in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith("choose another --metrics-host"), r.stderr


def test_a_starved_job_is_reported_by_its_reason():
    stats = {
        "bytes_used": 10,
        "bytes_limit": 100,
        "shards": {"cached": 1, "downloading": 0, "queued": 2, "failed": 0},
        "hits": 1,
        "misses": 2,
        "bytes_downloaded": 10,
        "download_rate": 0.0,
        "agent": {
            "pid": 1,
            "answering": True,
            "demanded": 0,
            "need_bytes": 250,
            "workers": [{"index": 0, "busy": 0.1}],
        },
        "jobs": {"j": {"0": {"samples": 5, "bytes": 50, "rate": 1.0, "wait_s": 4.0, "waiting": 0.9}}},
        "ended_jobs": {"old": {"0": {"samples": 9, "wait_s": 0.0, "ended": "2026-12-02T01:00:00+00:00"}}},
        "rank_totals": {
            "j": {"0": {"samples": 15, "bytes": 150, "wait_s": 6.0}},
            "old": {"0": {"samples": 9, "bytes": 90, "wait_s": 0.0}},
        },
    }
    m = _samples(exposition(stats))
    assert m[("wdscache_job_starved", (("job", "j"), ("reason", "budget")))] == 1
    assert m[("wdscache_job_starved", (("job", "j"), ("reason", "downloads")))] == 0
    assert m[("wdscache_need_bytes", ())] == 250
    # Counters are the totals over the agent's life (the live rank's earlier epochs too); a job that
    # ended keeps its counters a while, but is neither rated nor judged.
    assert m[("wdscache_consumer_samples_total", (("job", "j"), ("rank", "0")))] == 15
    assert m[("wdscache_consumer_samples_per_second", (("job", "j"), ("rank", "0")))] == 1.0
    assert {k[0] for k in m if dict(k[1]).get("job") == "old"} == {
        "wdscache_consumer_samples_total",
        "wdscache_consumer_bytes_total",
        "wdscache_consumer_wait_seconds_total",
    }


def test_missing_extra_is_named():
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from wdscache.shared.metrics import require\n"
        "try:\n    require()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
    assert (
        out.strip()
        == "ConfigError metrics need prometheus_client: pip install prometheus_client (the package's metrics extra)"
    )
