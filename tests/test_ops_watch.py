"""The live view: ``wdscache stats --watch`` redraws until Ctrl-C, and the verdict
on each job is a pure function of the stats (wdscache.shared.verdict)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from tests.helpers.procs import worker_pids
from tests.helpers.streaming import samples_of
from tests.helpers.waits import wait_for
from tests.helpers.watch import watch_frames
from wdscache.shared.client import AgentConnection
from wdscache.shared.messages import Requests
from wdscache.shared.verdict import verdicts


def _stats(
    *,
    waiting: float,
    demanded: int = 0,
    need: int = 0,
    busy: float = 0.1,
    queued: int = 0,
    demanded_queued: int = 0,
    retrying: tuple[dict, ...] = (),
    disk: dict | None = None,
) -> dict:
    return {
        "cache_dir": "/scratch/wdscache",
        "bytes_limit": 1000,
        "shards": {"cached": 1, "downloading": 2, "queued": queued, "failed": 0},
        "download_rate": 3 * 1024,
        "agent": {
            "pid": 1,
            "demanded": demanded,
            "demanded_queued": demanded_queued,
            "retrying": list(retrying),
            "need_bytes": need,
            "workers": [{"index": 0, "busy": busy}, {"index": 1, "busy": busy}],
            "disk": disk or {"free_bytes": 1 << 30, "min_free": 1 << 20, "short": None, "error": None},
        },
        "jobs": {"j": {"0": {"waiting": 0.05}, "1": {"waiting": waiting}}},
        "ended_jobs": {
            "j": {"0": {"samples": 1}},
            "old": {
                "0": {"samples": 30, "wait_s": 1.5, "ended": "2026-12-02T01:00:00+00:00"},
                "1": {"samples": 12, "wait_s": 0.5, "ended": "2026-12-02T01:00:05+00:00"},
            },
        },
    }


def test_each_verdict_names_its_cause_and_what_to_do():
    def line(**kw) -> str:
        return verdicts(_stats(**kw))["j"].text

    assert line(waiting=0.1, demanded=3, need=5000, busy=1.0) == "not starved"
    assert (
        line(waiting=0.5, need=2048, demanded=3)
        == "starved by the budget: the cache thrashes, needs 2.0K (--cache-size 2048)"
    )
    error = {"url": "http://h/a.tar", "error": "attempt 3 of 9 failed: HTTP 503 Service Unavailable", "demanded": True}
    prefetch = {**error, "url": "http://h/b.tar", "demanded": False}
    assert line(waiting=0.5, demanded=1, queued=2, retrying=(prefetch, error)) == (
        "starved by a failing source: 1 download(s) waited for fail and are retried "
        "(http://h/a.tar: attempt 3 of 9 failed: HTTP 503 Service Unavailable): check the source"
    )
    # Downloads a reader does not wait for fail: not what it waits for.
    assert line(waiting=0.5, demanded=1, queued=2, demanded_queued=1, retrying=(prefetch,)) == (
        "starved by downloads: shards waited for wait for a download slot: raise --download-workers"
    )
    slow = (
        "starved by a slow source: no shard waited for waits for a download slot, downloads get 3.0K/s in all: "
        "raise --prefetch to download further ahead, or check the source"
    )
    assert line(waiting=0.5, demanded=1, busy=1.0) == slow
    # A full disk stops every download: neither slots nor the source are what the rank waits for.
    full = {"free_bytes": 0, "min_free": 8 << 20, "short": "full", "error": "cannot write the index: disk is full"}
    assert line(waiting=0.5, demanded=1, queued=2, demanded_queued=1, retrying=(error,), disk=full) == (
        "starved by the disk: the file system of /scratch/wdscache has 0 bytes free and refused a write "
        "(cannot write the index: disk is full): no download starts until it has room: "
        "free space on it, or lower --cache-size and raise --min-free (the agent then keeps room free)"
    )
    low = {**full, "free_bytes": 5 << 20, "short": "min_free", "error": "waiting for space: ..."}
    assert line(waiting=0.5, demanded=1, disk=low) == (
        "starved by the disk: the file system of /scratch/wdscache has 5.0M free, less than --min-free 8.0M "
        "(and room for the index): the shards readers wait for wait for space: "
        "free space on it, or lower --min-free"
    )
    assert line(waiting=0.5, need=2048, demanded=1, disk=full).startswith("starved by the budget")
    assert line(waiting=0.5, busy=0.9, disk=full).startswith("starved by workers")  # it waits for no shard
    # Prefetches queued for a slot while the shards waited for download: more slots fetch ahead.
    assert line(waiting=0.5, demanded=1, queued=3, demanded_queued=0) == (
        "starved by a slow source: the shards waited for are downloading, 3 other download(s) wait for a slot, "
        "downloads get 3.0K/s in all: raise --download-workers (or --download-parts) to fetch more at once, "
        "or check the source"
    )
    assert line(waiting=0.5, busy=0.9) == "starved by workers: raise --workers, if the machine has idle cores"
    assert line(waiting=0.5).startswith("waiting for data, but not for downloads, workers or the budget")
    # A job that ended stays with its totals; a live job of that name wins.
    got = verdicts(_stats(waiting=0.0))
    assert (
        got["old"].kind is None
        and got["old"].text == "ended 2026-12-02T01:00:05+00:00: 42 samples, waited 2.0s for data in all"
    )
    assert got["j"].text == "not starved"


@pytest.mark.slow
def test_watch_redraws_until_ctrl_c_with_a_verdict_per_job(tmp_path, dataset, start_agent):
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        for reader, job in (("a", "train"), ("b", "done")):
            assert conn.request(Requests(reader).hello(job, 0, 1))["ok"]
        report = {"op": "report", "reader": "a", "samples": 10, "bytes": 100, "rate": 10.0, "epoch": 0, "position": 10}
        since = time.monotonic()  # (before the agent took the report: the span below is at least its own)
        assert conn.request({**report, "wait_s": 0.0})["ok"]
        assert conn.request(
            {
                "op": "report",
                "reader": "b",
                "samples": 8,
                "bytes": 80,
                "rate": 1.0,
                "wait_s": 0.3,
                "epoch": 0,
                "position": 8,
            }
        )["ok"]
        assert conn.request({"op": "bye", "reader": "b"})["ok"]
        time.sleep(0.5)  # the span rank 0 reports on, however long a busy machine made it
        waited = round(0.8 * (time.monotonic() - since), 1)
        assert conn.request({**report, "wait_s": waited})["ok"]  # waited 80% of the time since its last: starved
        text = watch_frames(cache, 2, 20)
    finally:
        conn.close()
    frames = [f for f in text.split("\n\n") if f]
    assert len(frames) >= 2
    for frame in frames[:2]:
        lines = frame.splitlines()
        assert lines[0].startswith(f"wdscache {cache}  ") and f"agent pid {agent.pid}, up " in lines[0], frame
        # 40.0K of shards, and their sample tables.
        assert re.match(r"cache      4[01]\.\dK of ", lines[1]) and "2 shards, 0 being read" in lines[1], frame
        assert lines[2].startswith("downloads  ") and "0 running, 0 queued, 0 failed" in lines[2], frame
        assert lines[3].startswith("workers    1: ") and "0 restart(s)" in lines[3], frame
        assert lines[4] == (
            "job train: 1 rank(s), 10 samples/s: waiting for data, but not for downloads, workers or "
            "the budget: the consumer's own reads are slow (a machine whose cores are all busy?)"
        ), frame
        assert (
            lines[5].split()
            == [
                "rank",
                "0",
                "10",
                "samples/s",
                "waiting",
                lines[5].split()[5],
                "10",
                "samples,",
                "waited",
                f"{waited:.1f}s",
            ]
            and int(lines[5].split()[5].rstrip("%")) > 20
        ), frame
        assert lines[6].startswith("job done: 1 rank(s), ended ") and lines[6].endswith(
            ": 8 samples, waited 0.3s for data in all"
        ), frame


@pytest.mark.slow
def test_stats_shows_no_download_rate_once_downloads_stop_and_a_jobs_totals_over_its_epochs(
    tmp_path, dataset, start_agent, consumers, run_cli
):
    data = dataset(3, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle")
    # The snapshot that shows the downloads over shows no rate: the figure is of now, not a lingering average.
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 3 and s["shards"]["downloading"] == 0, 20, "the list cached"
    )
    assert s["download_rate"] == 0, s
    assert "now 0/s" in run_cli("stats", "--cache-dir", cache).stdout
    frame = watch_frames(cache, 1, 20)
    assert "\ndownloads  0/s, 0 running" in frame, frame
    # A job of two epochs: its ended line counts the samples of both.
    lines = consumers(cache, "c", "--job", "two", "--no-shuffle", "--epochs", "2").wait()
    assert len(samples_of(lines)) == 24
    s = agent.wait_stats(lambda s: "two" in s["ended_jobs"], 10, "the job listed as ended")
    rank = s["ended_jobs"]["two"]["0"]
    assert (rank["samples"], rank["epochs"], rank["epoch"]) == (24, 2, 1), rank
    text = run_cli("stats", "--cache-dir", cache).stdout
    assert re.search(r"^job two: ended \S+: 24 samples in 2 epochs, waited [\d.]+s for data in all$", text, re.M), text


@pytest.mark.slow
def test_a_job_run_again_under_its_name_shows_its_own_run_as_ended(tmp_path, dataset, start_agent, consumers, run_cli):
    # Both launches of a script (every run without torchrun is job "default") were added up in one
    # record: "16 samples" of one epoch of 8.
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    for run in range(2):
        assert len(samples_of(consumers(cache, f"run{run}", "--job", "default").wait())) == 8
        s = agent.wait_stats(
            lambda s: "default" in s["ended_jobs"] and "default" not in s["jobs"], 10, "the run listed as ended"
        )
        rank = s["ended_jobs"]["default"]["0"]
        assert (rank["samples"], rank["epochs"], rank["epoch"]) == (8, 1, 0), (run, rank)
    assert s["rank_totals"]["default"]["0"]["samples"] == 16, s  # the agent's life: both runs
    text = run_cli("stats", "--cache-dir", cache).stdout
    assert re.search(r"^job default: ended \S+: 8 samples, waited", text, re.M), text


@pytest.mark.slow
def test_an_ended_job_says_whether_an_error_ended_it(tmp_path, shard_server, dataset, start_agent, consumers, run_cli):
    # A consumer that died of an error (on_error="raise": a ShardError, a FetchError) showed in
    # ended_jobs exactly like one that read its epoch: "ended ...: 101 samples". Its bye now says
    # the error; a job that read its epoch, or stopped reading early, ends as before.
    data = dataset(2, samples=4, payload=300)
    secret = "0123456789abcdef0123456789abcdef"
    gone = shard_server.url("gone-000000.tar") + f"?X-Amz-Signature={secret}"
    failing = tmp_path / "failing.txt"
    failing.write_text(f"{data.urls[0]}\n{gone}\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    assert len(samples_of(consumers(cache, "done", "--job", "done").wait())) == 8
    stopped = consumers(cache, "stopped", "--job", "stopped", "--no-shuffle", "--stop-after", "3").wait()
    assert len(samples_of(stopped)) == 3
    raised = consumers(cache, "raised", "--job", "raised", "--no-shuffle", "--urls", str(failing))
    assert raised.proc.wait(60) != 0, raised.log.read_text()
    assert "wdscache.FetchError: cannot fetch" in raised.log.read_text(), raised.log.read_text()
    s = agent.wait_stats(
        lambda s: {"done", "stopped", "raised"} <= set(s["ended_jobs"]), 10, "the three jobs listed as ended"
    )
    ended = s["ended_jobs"]
    assert "end_error" not in ended["done"]["0"] and "end_error" not in ended["stopped"]["0"], ended
    error = ended["raised"]["0"]["end_error"]
    assert error.startswith("FetchError: cannot fetch ") and "gone-000000.tar" in error and secret not in error, error
    text = run_cli("stats", "--cache-dir", cache).stdout
    assert re.search(r"^job done: ended \S+: 8 samples, waited", text, re.M), text
    assert re.search(r"^job stopped: ended \S+: 3 samples, waited", text, re.M), text
    assert re.search(
        r"^job raised: ended \S+ with an error \(rank 0: FetchError: .*gone-000000\.tar.*\): 4 samples", text, re.M
    ), text
    assert secret not in text


@pytest.mark.slow
def test_dataloader_workers_of_one_run_are_one_run_in_ended_jobs(tmp_path, dataset, start_agent):
    # A DataLoader worker that says hello after the rank's other worker left (a slow worker_init_fn)
    # was taken for another run of the job: its rank's ended totals started over (16 of 40 samples).
    data = dataset(1, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)

    def run(reader: str, launch: str | None, samples: int) -> dict:
        requests = Requests(reader)
        assert conn.request(requests.hello("train", 0, 1, epoch=0, launch=launch))["ok"]
        assert conn.request(requests.bye(epoch=0, position=samples, samples=samples, bytes=samples, wait_s=0.0))["ok"]
        return agent.stats()["ended_jobs"]["train"]["0"]

    try:
        assert run("w0", "script-1", 24)["samples"] == 24
        assert run("w1", "script-1", 16)["samples"] == 40  # the same run's other worker
        assert run("w2", None, 2)["samples"] == 42  # a consumer that does not say its run: the same
        assert run("again", "script-2", 40)["samples"] == 40  # the script run again: a record of its own
        assert agent.stats()["rank_totals"]["train"]["0"]["samples"] == 82  # the agent's life: both runs
    finally:
        conn.close()


@pytest.mark.slow
def test_a_ranks_dataloader_workers_are_one_rank_in_stats(tmp_path, dataset, start_agent, run_cli):
    # Each DataLoader worker of a rank is a consumer of that rank: stats showed whichever reported last.
    data = dataset(1, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the shard cached")
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        for reader, samples, waited in (("w0", 10, 0.0), ("w1", 8, 0.25)):
            assert conn.request(Requests(reader).hello("train", 0, 1))["ok"]
            report = {"op": "report", "reader": reader, "samples": samples, "bytes": 10 * samples, "rate": 5.0}
            assert conn.request({**report, "wait_s": waited, "epoch": 0, "position": samples})["ok"]
        rank = agent.stats()["jobs"]["train"]["0"]
        assert (rank["readers"], rank["samples"], rank["bytes"], rank["rate"], rank["wait_s"]) == (
            2,
            18,
            180,
            10.0,
            0.25,
        )
        assert rank["position"] == 18 and rank["epoch"] == 0, rank
        text = run_cli("stats", "--cache-dir", cache).stdout
        assert "  rank 0 (2 readers): 18 samples, 180, 10 samples/s, waited 0.2s" in text, text
    finally:
        conn.close()


@pytest.mark.slow
def test_a_rank_in_one_long_wait_is_starved_while_it_waits(tmp_path, dataset, shard_server, start_agent, consumers):
    # A wait counted only once it ended: a rank blocked opening its shards (the agent asks their
    # server whether its copies are current, and the server takes 4 s to answer) showed 0% waiting,
    # "not starved", until they came (and an alert of "5 minutes" never held).
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    first = start_agent(cache, data.list_file, "--prefetch", "2")
    first.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    first.stop()
    shard_server.ttfb = 4.0
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--download-workers", "1")
    consumer = consumers(cache, "slow", "--no-shuffle", "--job", "slow")

    def starved() -> str | None:
        ranks = agent.stats()["jobs"].get("slow", {})
        return next((r["starved"] for r in ranks.values() if r.get("starved")), None)

    # ...by the source: the agent's checks of its copies (HEAD requests) were blamed on the consumer.
    assert wait_for(starved, 6, lambda: f"never starved while it waited: {agent.stats()['jobs']}") == "slow_source"
    assert len(samples_of(consumer.wait())) == 8


@pytest.mark.slow  # a rank and then a worker are stopped past SILENT_AFTER (5 s)
def test_a_stopped_rank_and_a_stopped_worker_are_shown_silent_not_at_their_last_report(
    tmp_path, dataset, start_agent, consumers, run_cli
):
    # A rank stopped (SIGSTOP) showed its last rate and "not starved" until --reader-timeout; a worker
    # stuck or stopped showed its last "busy", and ranks waiting for it were told their own machine
    # was slow.
    data = dataset(2, samples=40, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    slow = consumers(cache, "slow", "--no-shuffle", "--job", "j", "--sleep", "0.1", "--epochs", "50")
    agent.wait_stats(lambda s: s["jobs"].get("j", {}).get("0", {}).get("rate", 0) > 0, 20, "a rate reported")
    os.kill(slow.proc.pid, signal.SIGSTOP)
    try:
        s = agent.wait_stats(lambda s: s["jobs"]["j"]["0"].get("silent_s"), 20, "the stopped rank never silent")
        assert s["jobs"]["j"]["0"]["rate"] == 0.0 and s["jobs"]["j"]["0"]["starved"] is None, s["jobs"]
        text = run_cli("stats", "--cache-dir", cache).stdout
        assert re.search(r"rank 0: .*, silent for \d+s \(its process stopped or hung\?\)", text), text
        assert re.search(r"rank 0 silent for \d+s", verdicts(s)["j"].text), verdicts(s)["j"].text
    finally:
        os.kill(slow.proc.pid, signal.SIGCONT)
    slow.kill()

    [worker] = worker_pids(agent.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        reader = consumers(cache, "waits", "--no-shuffle", "--job", "w", "--timeout", "120")
        s = agent.wait_stats(
            lambda s: s["agent"]["workers"][0].get("silent_s") and s["jobs"].get("w", {}).get("0", {}).get("starved"),
            30,
            "the stopped worker never silent, or the rank waiting for it never starved",
        )
        assert s["agent"]["workers"][0]["busy"] == 1.0 and s["jobs"]["w"]["0"]["starved"] == "workers", s["agent"]
        assert re.match(r"starved by workers: worker 0 has not reported for \d+s", verdicts(s)["w"].text)
        assert re.search(
            r"workers    1 \(100% busy\), 0 restart\(s\), worker 0 silent for \d+s",
            run_cli("stats", "--cache-dir", cache).stdout,
        )
    finally:
        os.kill(worker, signal.SIGCONT)
    assert len(samples_of(reader.wait())) == 80


@pytest.mark.slow
def test_a_rank_waiting_on_a_failing_source_is_told_so_with_the_retries_and_their_error(
    tmp_path, dataset, shard_server, start_agent, consumers, run_cli
):
    # A source answering 503 to every request: the rank was "starved by downloads: raise
    # --download-workers or --prefetch", and no view showed the retries or the 503s.
    data = dataset(2, samples=4, payload=300)
    urls = [f"{u}?token=TOKENSECRET" for u in data.urls]
    shown = [f"{u}?token=***" for u in data.urls]
    data.list_file.write_text("\n".join(urls) + "\n")
    for p in data.paths:
        shard_server.fail(p.name, "status", status=503, times=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--retries", "50", "--no-shuffle")
    consumers(cache, "c", "--job", "train", "--no-shuffle", "--timeout", "60")
    agent.wait_stats(
        lambda s: s["jobs"].get("train", {}).get("0", {}).get("starved"), 20, "the rank starved while it waited"
    )
    failure = r"attempt \d+ of 51 failed: HTTP 503 Service Unavailable"
    s = json.loads(run_cli("stats", "--cache-dir", cache, "--json").stdout)
    assert s["jobs"]["train"]["0"]["starved"] == "failing_source", s["jobs"]
    retrying = {r["url"]: r for r in s["agent"]["retrying"]}
    assert sorted(retrying) == shown, retrying  # every shard's download, the secret left out
    assert all(re.fullmatch(failure, r["error"]) for r in retrying.values()), retrying
    assert retrying[shown[0]]["demanded"] is True, retrying  # the shard the rank waits for
    text = run_cli("stats", "--cache-dir", cache).stdout
    assert re.search(r"^  rank 0: 0 samples, .*, STARVED by failing source$", text, re.M), text
    for url in shown:
        assert re.search(rf"^retrying   {re.escape(url)}: {failure}$", text, re.M), text
    frame = watch_frames(cache, 1, 20)
    lines = frame.splitlines()
    assert re.match(r"downloads  0/s, 2 running, 0 queued, 0 failed, 2 retrying; ", lines[2]), frame
    assert re.fullmatch(
        r"job train: 1 rank\(s\), 0 samples/s: starved by a failing source: 1 download\(s\) waited for fail "
        rf"and are retried \({re.escape(shown[0])}: {failure}\): check the source",
        lines[4],
    ), frame
    assert "TOKENSECRET" not in text + frame


@pytest.mark.slow
def test_each_job_is_told_what_it_waits_for_not_what_another_job_does(
    tmp_path, dataset, shard_server, start_agent, consumers
):
    # The verdict was the agent's: a job waiting on a slow source was "starved by a failing
    # source" because another job waited on one.
    data = dataset(2, samples=4, payload=300)
    shard_server.fail(data.paths[0].name, "status", status=503, times=1000)
    released = threading.Event()
    shard_server.fail(data.paths[1].name, "stall", seconds=60, until=released)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--retries", "50", "--no-shuffle")
    try:
        for job, url in (("train", data.urls[0]), ("other", data.urls[1])):
            consumers(cache, job, "--job", job, "--urls", url, "--no-shuffle", "--timeout", "60")

        def both_starved(s: dict) -> bool:
            return all(s["jobs"].get(job, {}).get("0", {}).get("starved") for job in ("train", "other"))

        s = agent.wait_stats(both_starved, 20, "both jobs starved")
        assert {job: s["jobs"][job]["0"]["starved"] for job in ("train", "other")} == {
            "train": "failing_source",
            "other": "slow_source",
        }, s["jobs"]
        assert s["agent"]["demanded_by_job"] == {"train": 1, "other": 1}, s["agent"]
        retrying = {r["url"]: r for r in s["agent"]["retrying"]}
        assert retrying[data.urls[0]]["jobs"] == ["train"], retrying
        lines = {job: v.text for job, v in verdicts(s).items()}
        assert lines["train"].startswith("starved by a failing source: 1 download(s)"), lines
        assert lines["other"].startswith("starved by a slow source"), lines
    finally:
        released.set()


def test_a_rank_waiting_for_a_shard_downloading_while_prefetches_queue_is_told_the_source_is_slow(
    tmp_path, dataset, shard_server, start_agent, consumers
):
    # A saturated link: the shard waited for downloads while prefetches wait for a slot. The rank
    # was told "starved by downloads: raise --download-workers", and more downloads sharing the
    # link made the job slower.
    data = dataset(4, samples=4, payload=300)
    released = threading.Event()
    shard_server.fail(data.paths[0].name, "stall", seconds=60, until=released)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--download-workers", "1", "--prefetch", "4", "--no-shuffle")
    try:
        consumers(cache, "c", "--job", "train", "--no-shuffle", "--timeout", "60")
        s = agent.wait_stats(
            lambda s: s["jobs"].get("train", {}).get("0", {}).get("starved") and s["shards"]["queued"],
            20,
            "the rank starved while prefetches queued",
        )
        assert s["jobs"]["train"]["0"]["starved"] == "slow_source", (s["jobs"], s["shards"])
        assert s["agent"]["demanded"] == 1 and s["agent"]["demanded_queued"] == 0, s["agent"]
        assert verdicts(s)["train"].text.startswith("starved by a slow source"), verdicts(s)
    finally:
        released.set()


def test_a_rank_waiting_from_its_first_report_on_is_starved_at_that_report(
    tmp_path, dataset, shard_server, start_agent, consumers
):
    # The first report of an epoch had no earlier one to measure from: the rank showed no share of
    # time waiting, "not starved", for the first second or two of every epoch (all of a short one).
    data = dataset(1, samples=4, payload=300)
    release = threading.Event()
    shard_server.fail(data.paths[0].name, "stall", seconds=30, until=release)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file)
    consumer = consumers(cache, "c", "--job", "train", "--no-shuffle")
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:

        def first_report() -> dict | None:
            rank = conn.request(Requests.stats())["stats"]["jobs"].get("train", {}).get("0", {})
            return rank if "wait_s" in rank else None  # (a rank that said hello and no more has none)

        rank = wait_for(first_report, 20, "the consumer never reported")
    finally:
        conn.close()
        release.set()
    # It waited for the stalled download all along: the share counts from its hello.
    assert rank.get("waiting", 0) > 0.5 and rank["starved"] == "slow_source", rank
    assert len(samples_of(consumer.wait())) == 4


def test_of_many_jobs_that_ended_the_text_shows_the_latest_and_counts_the_rest():
    from wdscache.cli import _live_view
    from wdscache.shared.stats import ENDED_SHOWN, format_stats

    s = _stats(waiting=0.0)
    ended = {f"e{i}": {"0": {"samples": i, "ended": f"2026-12-02T01:00:{i:02d}+00:00"}} for i in range(ENDED_SHOWN + 3)}
    s["ended_jobs"] = {**ended, "j": {"0": {"samples": 1, "ended": "2026-12-02T02:00:00+00:00"}}}  # j is live
    s.update(cache_dir="/c", bytes_used=1, hits=0, misses=0, bytes_downloaded=0, failed=[])
    s["agent"].update(uptime_s=1, worker_restarts=0)
    latest_first = [f"e{i}" for i in range(ENDED_SHOWN + 2, 2, -1)]
    for text in (format_stats(s), _live_view(s)):
        shown = re.findall(r"^job (e\d+): ", text, re.M)
        assert shown == latest_first, text
        assert "\nand 3 more job(s) ended lately (--json lists them)" in text, text
        assert re.search(r"^job j:", text, re.M), text  # a live job is always shown
