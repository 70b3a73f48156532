"""The verdict of ``wdscache stats`` names each job's own cause, on real processes: an agent short
of open files, a job waiting on a failing source beside one that makes the cache thrash, a rank
killed while its job reads on, a source that accepts and sends nothing. Each is checked in the
text, ``--json`` and the metrics' labels, as people and alerts read them."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.console import wdscache_exe
from tests.helpers.waits import wait_for
from wdscache.cli import _live_view


def _shown(run_cli, cache) -> tuple[str, dict, dict[tuple[str, tuple], float]]:
    """``wdscache stats`` as text, --json and --prometheus (samples by name and labels)."""
    forms = []
    for extra in ((), ("--json",), ("--prometheus",)):
        got = run_cli("stats", "--cache-dir", cache, *extra)
        assert got.returncode == 0, got.stderr
        forms.append(got.stdout)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(forms[2])
        for s in f.samples
    }
    return forms[0], json.loads(forms[1]), samples


def _starved(samples: dict[tuple[str, tuple], float], job: str) -> list[str]:
    """The reasons ``wdscache_job_starved`` says 1 for ``job``."""
    return [
        dict(labels)["reason"]
        for (name, labels), value in samples.items()
        if name == "wdscache_job_starved" and dict(labels)["job"] == job and value == 1
    ]


def _rank_starved(s: dict, job: str, kind: str) -> bool:
    return any(r.get("starved") == kind for r in s["jobs"].get(job, {}).values())


@pytest.mark.slow
def test_an_agent_short_of_open_files_is_named_not_a_slow_source(
    tmp_path, shard_server, dataset, start_agent, consumers, run_cli
):
    data = dataset(12, samples=20, payload=100_000)
    shard_server.rate = 2_000_000  # downloads last: their files stay held
    cache = tmp_path / "cache"
    limited = ["bash", "-c", 'ulimit -Sn 60 && ulimit -Hn 60 && exec "$@"', "limited", wdscache_exe()]
    agent = start_agent(cache, data.list_file, "--prefetch", "8", "--workers", "2", exe=limited)
    for rank in range(3):
        consumers(cache, f"c{rank}", "--job", "nofile", "--rank", str(rank), "--world-size", "3", "--timeout", "120")
    s = agent.wait_stats(
        lambda s: bool(s["agent"].get("out_of_files")) and _rank_starved(s, "nofile", "files"),
        60,
        "the job starved by open files",
    )
    assert "raise ulimit -n" in s["agent"]["out_of_files"], s["agent"]["out_of_files"]

    def seen() -> tuple[str, dict, dict] | None:
        text, js, samples = _shown(run_cli, cache)
        return (text, js, samples) if _starved(samples, "nofile") == ["files"] else None

    text, js, samples = wait_for(seen, 30, lambda: f"never reason=files:\n{_shown(run_cli, cache)[0]}")
    line = next(x for x in text.splitlines() if x.startswith("job nofile: "))
    assert line.startswith("job nofile: starved by open files: downloads of shards waited for wait for files ("), text
    assert line.endswith("): raise ulimit -n for the agent (or LimitNOFILE= in its systemd unit)"), text
    assert "slow source" not in text and "--prefetch" not in line, text
    assert samples[("wdscache_files_short", ())] == 1


@pytest.mark.slow
def test_a_job_waiting_on_a_failing_source_beside_a_thrashing_job_is_told_its_own_cause(
    tmp_path, shard_server, dataset, start_agent, consumers, run_cli
):
    data = dataset(16, samples=40, payload=50_000)  # 2 MB shards: 32 MB read over and over in 8 MB
    failing = dataset(3, samples=4, payload=1000, prefix="other", list_name="other.txt")
    for path in failing.paths:
        shard_server.fail(path.name, "status", times=10_000, status=503)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--cache-size", "8M", "--prefetch", "1", "--retries", "50")
    for rank in range(2):
        consumers(
            cache, f"hog{rank}", "--job", "hog", "--rank", str(rank), "--world-size", "2",
            "--shuffle-buffer", "400", "--epochs", "20", "--timeout", "120",
        )  # fmt: skip
    consumers(cache, "victim", "--job", "victim", "--urls", str(failing.list_file), "--timeout", "120")

    def both(s: dict) -> bool:
        return _rank_starved(s, "hog", "budget") and _rank_starved(s, "victim", "failing_source")

    agent.wait_stats(both, 90, "the hog starved by the budget, the victim by its failing source")
    assert agent.stats()["agent"]["need_bytes"] > 8 << 20

    def seen() -> tuple[str, dict, dict] | None:
        text, js, samples = _shown(run_cli, cache)
        ok = _starved(samples, "victim") == ["failing_source"] and _starved(samples, "hog") == ["budget"]
        return (text, js, samples) if ok else None

    text, _, _ = wait_for(seen, 30, lambda: f"never told apart:\n{_shown(run_cli, cache)[0]}")
    victim = next(x for x in text.splitlines() if x.startswith("job victim: "))
    assert victim.startswith("job victim: starved by a failing source: "), text
    assert "HTTP 503" in victim and victim.endswith("): check the source"), text
    hog = next(x for x in text.splitlines() if x.startswith("job hog: "))
    assert hog.startswith("job hog: starved by the budget: the cache thrashes, needs "), text


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_is_named_gone_while_its_job_reads_on(
    tmp_path, dataset, start_agent, consumers, run_cli
):
    data = dataset(3, samples=400, payload=200)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 30, "every shard cached")
    ranks = [
        consumers(
            cache,
            f"c{rank}",
            "--job",
            "ddp",
            "--rank",
            str(rank),
            "--world-size",
            "3",
            "--no-shuffle",
            "--sleep",
            "0.05",
            "--timeout",
            "120",
        )  # fmt: skip
        for rank in range(3)
    ]
    agent.wait_stats(
        lambda s: sorted(r for r, v in s["jobs"].get("ddp", {}).items() if v.get("samples", 0) > 0) == ["0", "1", "2"],
        60,
        "every rank reading",
    )
    os.kill(ranks[1].proc.pid, signal.SIGKILL)
    ranks[1].proc.wait(10)
    s = agent.wait_stats(lambda s: "1" in s["ended_jobs"].get("ddp", {}), 30, "rank 1 ended")
    assert sorted(s["jobs"]["ddp"]) == ["0", "2"]
    gone = s["ended_jobs"]["ddp"]["1"]
    assert (gone["gone"], gone["world"]) == (True, 3), gone
    clock = gone["ended"][11:19]  # HH:MM:SS of its ISO date

    text, js, samples = _shown(run_cli, cache)
    line = next(x for x in text.splitlines() if x.startswith("job ddp: "))
    assert f"; rank 1 of 3 gone at {clock} (its process ended mid-epoch)" in line, text
    assert samples[("wdscache_job_ranks_gone", (("job", "ddp"),))] == 1
    assert f"rank 1 of 3 gone at {clock}" in _live_view(js)  # --watch's frame of the same stats
    for c in (ranks[0], ranks[2]):  # the others read on to their epochs' ends
        c.wait()


@pytest.mark.slow
def test_a_source_that_accepts_and_sends_nothing_is_named_so(
    tmp_path, shard_server, dataset, start_agent, consumers, run_cli
):
    data = dataset(2, samples=4, payload=1000)
    released = threading.Event()
    for path in data.paths:
        shard_server.fail(path.name, "stall", times=20, seconds=120, until=released)
    cache = tmp_path / "cache"
    try:
        agent = start_agent(cache, data.list_file, "--read-timeout", "60", "--download-parts", "1")
        consumers(cache, "c0", "--job", "stall", "--timeout", "120")
        agent.wait_stats(lambda s: _rank_starved(s, "stall", "silent_source"), 60, "the job starved by silence")

        def seen() -> tuple[str, dict, dict] | None:
            text, js, samples = _shown(run_cli, cache)
            return (text, js, samples) if _starved(samples, "stall") == ["silent_source"] else None

        text, js, _ = wait_for(seen, 30, lambda: f"never reason=silent_source:\n{_shown(run_cli, cache)[0]}")
        line = next(x for x in text.splitlines() if x.startswith("job stall: "))
        assert line.startswith("job stall: starved by a source that sends nothing: "), text
        assert "got no byte for 3s or more" in line and "--prefetch" not in line, text
        assert js["agent"]["demanded_silent_by_job"] == {"stall": 1} or js["agent"]["demanded_silent"] >= 1
    finally:
        released.set()
