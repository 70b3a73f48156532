"""The verdict of ``wdscache stats`` names each job's own cause, on real processes: an agent short
of open files, a job waiting on a failing source beside one that makes the cache thrash, a rank
killed while its job reads on, a source that accepts and sends nothing, a sample worker stopped
under a reading rank. Each is checked in the text, ``--json`` and the metrics' labels, as people
and alerts read them."""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.console import wdscache_exe
from tests.helpers.procs import worker_pids
from tests.helpers.waits import wait_for
from wdscache.cli import _live_view
from wdscache.shared.verdict import SILENT_AFTER, verdicts

# How long a form of the stats may take to say what the scene makes it say: each `wdscache stats`
# is a new interpreter (2-3 s apart on a loaded 2-core machine), and a verdict is of one moment.
TOLD_WITHIN = 60.0


def _stats_cli(run_cli, cache, *extra: str) -> str:
    got = run_cli("stats", "--cache-dir", cache, *extra)
    assert got.returncode == 0, got.stderr
    return got.stdout


def _samples(run_cli, cache) -> dict[tuple[str, tuple], float]:
    """``wdscache stats --prometheus``'s samples by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(_stats_cli(run_cli, cache, "--prometheus"))
        for s in f.samples
    }


def _told(run_cli, cache, lines: dict[str, str], reasons: dict[str, str]) -> tuple[str, dict[tuple[str, tuple], float]]:
    """The text of ``wdscache stats`` once its line of each job in ``lines`` starts with what it says,
    and the metrics once ``wdscache_job_starved`` names each job's reason in ``reasons``: each form
    waited for by itself (every call collects anew, and a job's verdict is of the moment: a rank
    between two shards is told otherwise for a report), with a deadline."""

    def text_says() -> str | None:
        text = _stats_cli(run_cli, cache)
        shown = {x.split(": ", 1)[0]: x for x in text.splitlines() if x.startswith("job ")}
        said = all(shown.get(f"job {job}", "").startswith(f"job {job}: {start}") for job, start in lines.items())
        return text if said else None

    def metrics_say() -> dict[tuple[str, tuple], float] | None:
        samples = _samples(run_cli, cache)
        return samples if all(_starved(samples, job) == [kind] for job, kind in reasons.items()) else None

    text = wait_for(text_says, TOLD_WITHIN, lambda: f"the text never said {lines}:\n{_stats_cli(run_cli, cache)}")
    samples = wait_for(
        metrics_say, TOLD_WITHIN, lambda: f"the metrics never said {reasons}:\n{_stats_cli(run_cli, cache)}"
    )
    return text, samples


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
    # Downloads last (their files stay held) for some 30 s in all: files stay short while every form
    # of the stats is asked, a few seconds apart on a loaded machine.
    data = dataset(24, samples=20, payload=100_000)
    shard_server.rate = 1_000_000
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

    text, samples = _told(run_cli, cache, {"nofile": "starved by open files: "}, {"nofile": "files"})
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

    s = agent.wait_stats(both, 90, "the hog starved by the budget, the victim by its failing source")
    assert s["agent"]["need_bytes"] > 8 << 20
    assert s["agent"]["demanded_room_by_job"].get("victim", 0) == 0, s["agent"]

    text, _ = _told(
        run_cli,
        cache,
        {"victim": "starved by a failing source: ", "hog": "starved by the budget: "},
        {"victim": "failing_source", "hog": "budget"},
    )
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

    text, js, samples = _stats_cli(run_cli, cache), _stats_cli(run_cli, cache, "--json"), _samples(run_cli, cache)
    line = next(x for x in text.splitlines() if x.startswith("job ddp: "))
    assert f"; rank 1 of 3 gone at {clock} (its process ended mid-epoch)" in line, text
    assert samples[("wdscache_job_ranks_gone", (("job", "ddp"),))] == 1
    assert f"rank 1 of 3 gone at {clock}" in _live_view(json.loads(js))  # --watch's frame of the same stats
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
        text, _ = _told(
            run_cli, cache, {"stall": "starved by a source that sends nothing: "}, {"stall": "silent_source"}
        )
        line = next(x for x in text.splitlines() if x.startswith("job stall: "))
        assert line.startswith("job stall: starved by a source that sends nothing: "), text
        assert "got no byte for 3s or more" in line and "--prefetch" not in line, text
    finally:
        released.set()


@pytest.mark.slow  # a worker stopped past SUSPECT_AFTER (2 s), up to SILENT_AFTER (5 s)
def test_a_worker_stopped_under_a_reading_rank_is_named_before_it_counts_silent(
    tmp_path, dataset, start_agent, consumers, run_cli
):
    # A worker stopped under a rank that reads: for its first 5 s (till it counted silent) the verdict
    # said "the consumer's own reads are slow", as if the rank's machine were the cause.
    # Samples of 500 KB: a consumer holds a few requests of about 4 MiB each, some 1.6 s of its reads
    # at 20 a second, so it waits soon after the worker stops.
    data = dataset(3, samples=100, payload=500_000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--workers", "1")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 60, "every shard cached")
    reader = consumers(
        cache, "r", "--no-shuffle", "--job", "r", "--sleep", "0.01", "--epochs", "50", "--timeout", "120"
    )
    agent.wait_stats(lambda s: s["jobs"].get("r", {}).get("0", {}).get("rate", 0) > 0, 30, "the rank reading")
    [worker] = worker_pids(agent.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        s = agent.wait_stats(lambda s: _rank_starved(s, "r", "workers"), 30, "the rank waiting on the worker")
        stopped = s["agent"]["workers"][0]
        # Named while it has missed two reports, before it counts silent (and busy).
        assert "silent_s" not in stopped and stopped.get("quiet_s", SILENT_AFTER) < SILENT_AFTER, stopped
        assert re.match(r"starved by workers: worker 0 has not reported for \d+s ", verdicts(s)["r"].text), verdicts(s)

        # From then on, while it stays stopped, never the rank's own reads: till it counts silent (or the
        # rank gives up on it: its reads are retried on a worker a few times, then fail).
        def silent(s: dict) -> bool:
            rank = s["jobs"].get("r", {}).get("0")
            assert rank is None or rank["starved"] == "workers", (s["jobs"], s["agent"]["workers"])
            return rank is None or "silent_s" in s["agent"]["workers"][0]

        agent.wait_stats(silent, 30, "the stopped worker counted silent")
    finally:
        os.kill(worker, signal.SIGCONT)
    reader.kill()
