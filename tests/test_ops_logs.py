"""Logs for people and for log shippers: one line per notable event, ISO 8601 dates.

A real agent started through the CLI with ``--log-format json``, a real HTTP server, a
reader that says hello and bye over the real control socket, and a real consumer's short epoch.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import webdataset as wds

from tests.helpers.waits import json_lines, wait_for
from wdscache import CachedMultiLoader, ShardClient
from wdscache.agent.churn_log import LOUD, WINDOW, Churn, ChurnLog
from wdscache.shared.client import AgentConnection
from wdscache.shared.logs import JsonFormatter, TextFormatter, event, get_logger, iso_time
from wdscache.shared.messages import Requests

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?[+-]\d\d:\d\d$")


def _events(text: str) -> list[dict]:
    lines = json_lines(text)
    for line in lines:
        assert ISO.match(line["time"]), line
        assert {"level", "logger", "message"} <= set(line), line
    return [line for line in lines if "event" in line]


@pytest.mark.slow
def test_json_logs_name_each_event_with_its_fields(tmp_path, dataset, start_agent, shard_server, run_cli):
    data = dataset(3, samples=4, payload=300)
    missing = shard_server.url("missing.tar")
    data.list_file.write_text("\n".join([*data.urls, missing]) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(
        cache, data.list_file, "--prefetch", "4", "--retries", "0", "--log-format", "json", "--reader-timeout", "1"
    )
    agent.wait_stats(
        lambda s: s["shards"]["cached"] == 3 and s["shards"]["failed"] == 1, 20, "three shards cached and one failed"
    )
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        hello = conn.request(Requests("r0").hello("train", 0, 1))
        assert hello["ok"], hello
        assert conn.request(
            {
                "op": "report",
                "reader": "r0",
                "samples": 7,
                "bytes": 700,
                "rate": 3.5,
                "wait_s": 0.5,
                "epoch": 0,
                "position": 7,
            }
        )["ok"]
        # A malformed bye is refused as a whole; one without totals leaves the last report's.
        assert not conn.request({"op": "bye", "reader": "r0", "samples": "many"})["ok"]
        assert conn.request({"op": "bye", "reader": "r0"})["ok"]
        assert conn.request(Requests("r1").hello("quiet", 0, 1))["ok"]
    finally:
        conn.close()
    # A real consumer's epoch, over well before its first report: its bye brings its totals.
    with CachedMultiLoader(data.urls, cache_dir=cache, job="short", shuffle=False, timeout=30) as loader:
        assert len(list(loader)) == 12
        assert len(loader) == 12  # after the epoch: its hello and bye neither join nor end the job
    s = agent.wait_stats(
        lambda s: {"train", "quiet", "short"} <= set(s["ended_jobs"]),
        10,
        "the jobs that ended (two said bye, one went silent) are listed",
    )
    short = s["ended_jobs"]["short"]["0"]
    assert (short["samples"], short["epoch"], short["position"]) == (12, 0, 12), short
    assert short["bytes"] == sum(
        len(v)
        for p in data.paths
        for x in wds.WebDataset(str(p), shardshuffle=False)
        for k, v in x.items()
        if not k.startswith("__")
    ), short
    assert s["jobs"] == {}
    # Evicted by hand, then downloaded again for a reader that asks for it.
    assert run_cli("evict", data.urls[0], "--cache-dir", cache).returncode == 0
    with ShardClient(cache, timeout=20) as client:
        assert client.open(data.urls[0]).read_bytes() == data.paths[0].read_bytes()
    agent.wait_stats(lambda s: s["redownloads"] == 1, 10, "the evicted shard downloaded again")
    ended = s["ended_jobs"]["train"]["0"]
    assert (ended["samples"], ended["bytes"], ended["wait_s"], ended["starved"]) == (7, 700, 0.5, None)
    assert ISO.match(ended["ended"]), ended
    assert agent.stop() == 0
    events = _events(agent.stderr_text())
    cached = [e for e in events if e["event"] == "cached"]
    assert sorted(e["url"] for e in cached) == sorted(data.urls)
    assert sorted(e["bytes"] for e in cached) == sorted(p.stat().st_size for p in data.paths)
    failed = [e for e in events if e["event"] == "failed"]
    assert [e["url"] for e in failed] == [missing] and "404" in failed[0]["error"], failed
    joined = [e for e in events if e["event"] == "consumer_joined"]
    assert [(e["job"], e["rank"], e["world_size"]) for e in joined] == [
        ("train", 0, 1),
        ("quiet", 0, 1),
        ("short", 0, 1),
    ]
    left = [e for e in events if e["event"] == "consumer_left"]
    assert [(e["job"], e["rank"], e["samples"], e["why"]) for e in left] == [
        ("train", 0, 7, "said bye"),
        ("short", 0, 12, "said bye"),
    ]
    assert "(job 'short', rank 0, 12 samples)" in left[1]["message"], left[1]
    timed_out = [e for e in events if e["event"] == "consumer_timed_out"]
    assert [(e["reader"], e["job"], e["level"]) for e in timed_out] == [("r1", "quiet", "WARNING")]
    assert timed_out[0]["why"].startswith("silent for ") and timed_out[0]["why"].endswith("(--reader-timeout)")
    evicted = [e for e in events if e["event"] == "evicted"]
    assert [(e["url"], e["bytes"]) for e in evicted] == [(data.urls[0], data.paths[0].stat().st_size)]
    assert ISO.match(evicted[0]["last_read"]), evicted  # read by the consumer
    again = [e for e in events if e["event"] == "redownloaded"]
    assert [(e["url"], e["bytes"]) for e in again] == [(data.urls[0], data.paths[0].stat().st_size)]


def test_text_lines_and_event_dates_are_iso_8601():
    assert iso_time(0) is None and iso_time(None) is None
    assert ISO.match(iso_time(1796144426.89))
    log = logging.getLogger("wdscache.test")
    record = log.makeRecord(
        log.name,
        logging.INFO,
        __file__,
        1,
        "evicted %s (last read %s)",
        ("u", iso_time(1796144426.89)),
        None,
        extra={"wdscache_event": {"event": "evicted", "url": "u"}},
    )
    text = TextFormatter().format(record)
    stamp, level, rest = text.split(" ", 2)
    assert ISO.match(stamp) and level == "INFO", text
    assert not re.search(r"\d{10}\.\d", text), text  # no epoch floats
    line = json.loads(JsonFormatter().format(record))
    assert (line["event"], line["url"], line["message"]) == ("evicted", "u", rest.split(": ", 1)[1])


def test_a_records_urls_are_redacted_for_any_handler_traceback_and_event_fields_included():
    """A training script's own handler gets the records of the package's loggers redacted too."""
    secret = "http://user:PASSWORDSECRET@h/a.tar?X-Amz-Signature=SIGSECRET"
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(JsonFormatter().format(record))
            lines.append(TextFormatter().format(record))

    log = get_logger("wdscache.test.redacted")
    handler = Keep()
    log.addHandler(handler)
    try:
        event(log, "failed", "failed %s: %s", secret, "HTTP 403", level=logging.ERROR, url=secret, error="403")
        try:
            raise OSError(f"Max retries exceeded with url: /a.tar?token=TOKENSECRET ({secret})")
        except OSError:
            log.exception("downloading %s", secret)
    finally:
        log.removeHandler(handler)
    text = "\n".join(lines)
    assert "SECRET" not in text, text
    first = json.loads(lines[0])
    assert first["url"] == "http://***@h/a.tar?X-Amz-Signature=***"
    assert first["message"].startswith("failed http://***@h/a.tar?X-Amz-Signature=***: HTTP 403")
    third = json.loads(lines[2])
    assert "OSError: Max retries exceeded with url: /a.tar?token=*** (http://***@h/" in third["exception"], third
    assert "Traceback" in lines[3]


def test_a_url_list_change_is_one_json_record_with_counts_and_a_redacted_sample(tmp_path, dataset, start_agent):
    data = dataset(8, samples=2, payload=100)
    cache = tmp_path / "cache"
    data.list_file.write_text(f"{data.urls[0]}\n")
    agent = start_agent(cache, data.list_file, "--log-format", "json")
    signed = [f"{u}?X-Amz-Signature=SECRETSIG&v=1" for u in data.urls[1:]]
    data.list_file.write_text("".join(f"{u}\n" for u in signed))  # 7 added, 1 removed
    agent.wait_stats(lambda s: s["agent"]["urls"] == 7, 10, "the changed list taken")
    text = agent.stderr_text()
    assert "SECRETSIG" not in text
    changes = [e for e in _events(text) if e["event"] == "list_changed"]
    assert len(changes) == 1, changes
    change = changes[0]
    redacted = [u.replace("SECRETSIG", "***") for u in signed]
    assert (change["added"], change["removed"], change["shards"]) == (7, 1, 7), change
    assert (change["added_urls"], change["removed_urls"]) == (redacted[:5], [data.urls[0]]), change
    assert change["message"] == (
        f"URL list changed: 7 added, 1 removed (7 shards now); added: "
        f"{', '.join(redacted[:5])} and 2 more; removed: {data.urls[0]}"
    )
    # One record for the change: none per URL.
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert not [r for r in records if r["message"].lstrip().startswith(("+ ", "- "))], records


@pytest.mark.slow
def test_an_agent_that_cannot_start_says_why_in_one_json_record(tmp_path, dataset, start_agent, run_cli):
    data = dataset(1, samples=2)
    cache = tmp_path / "cache"
    running = start_agent(cache, data.list_file)
    for args, code, says in (
        (("--cache-dir", str(cache), "--urls", str(data.list_file)), 1, f"pid {running.pid}"),
        (("--cache-dir", str(tmp_path / "other"), "--urls", str(tmp_path / "none.txt")), 2, "none.txt"),
    ):
        done = run_cli("agent", *args, "--log-format", "json")
        assert done.returncode == code, done.stderr
        (record,) = (json.loads(line) for line in done.stderr.splitlines())
        assert record["level"] == "ERROR" and says in record["message"] and ISO.match(record["time"]), record
    # An option's value click refuses, the format asked on the command line or in the environment.
    bad = ("--cache-dir", str(tmp_path / "other"), "--urls", str(data.list_file), "--prefetch", "abc")
    for args, env in (((*bad, "--log-format=json"), None), (bad, {**os.environ, "WDSCACHE_LOG_FORMAT": "json"})):
        done = run_cli("agent", *args, env=env)
        assert done.returncode == 2, done.stderr
        (record,) = (json.loads(line) for line in done.stderr.splitlines())
        assert record["level"] == "ERROR" and "--prefetch" in record["message"] and "abc" in record["message"], record


@pytest.mark.slow
def test_a_thrashing_cache_logs_a_few_lines_a_minute_and_a_summary_that_counts_them_all(
    tmp_path, dataset, start_agent, consumers
):
    # A shuffled job whose buffer spans 8 shards of 130K, on a budget of 3: shards still in the
    # buffer are evicted and downloaded again, hundreds a minute. Each was an INFO line, a pair a
    # shard (~500 lines a minute in a soak), burying the rest of the log.
    data = dataset(8, samples=12, payload=8000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--cache-size", "420K", "--prefetch", "2", "--log-format", "json")
    job = consumers(cache, "thrash", "--epochs", "100000", "--timeout", "60")

    def info(kind: str) -> list[dict]:
        return [e for e in _events(agent.stderr_text()) if e["event"] == kind and e["level"] == "INFO"]

    def made_room() -> list[dict]:
        return [e for e in info("evicted") if e["why"] == "evicted to make room for a shard readers need"]

    started = agent.wait_stats(lambda s: s["redownloads"] > 3 * LOUD, 60, "the cache thrashing")
    # Well into the first minute: a few lines of each kind, the rest at DEBUG (-v shows them).
    assert len(info("redownloaded")) == LOUD and len(made_room()) == LOUD, (started, agent.stderr_tail())
    quiet = [e for e in _events(agent.stderr_text()) if e["event"] == "redownloaded" and e["level"] == "DEBUG"]
    assert quiet, agent.stderr_tail()
    # At the minute's end, one INFO line counts them all, with what the readers need and the budget.
    wait_for(lambda: info("churn"), WINDOW + 30, lambda: f"no summary after a minute\n{agent.stderr_tail()}")
    job.kill()
    # No download left in flight: the counts are final.
    final = agent.wait_stats(lambda s: s["shards"]["downloading"] == s["shards"]["queued"] == 0, 30, "downloads over")
    assert agent.stop() == 0
    summaries = info("churn")
    first = summaries[0]
    assert first["message"].startswith("the cache thrashes: "), first
    assert first["budget"] == 420 * 1024 and first["need"] > first["budget"], first
    assert first["redownloaded"] > LOUD and first["quiet_redownloaded"] == first["redownloaded"] - LOUD, first
    assert first["quiet_evicted"] == first["evicted"] - LOUD, first
    assert WINDOW <= first["seconds"] < WINDOW + 10, first
    assert f"{first['redownloaded']} shard(s) downloaded again and {first['evicted']} evicted" in first["message"]
    # Each window has at most LOUD lines of a kind (the last one, cut short by the stop, is
    # summarised only if some of its lines went to DEBUG).
    assert len(info("redownloaded")) <= LOUD * (len(summaries) + 1), summaries
    assert len(made_room()) <= LOUD * (len(summaries) + 1), summaries
    # The INFO lines and the summaries' quiet counts add up to every re-download stats counted.
    quiet_total = sum(e["quiet_redownloaded"] for e in summaries)
    assert len(info("redownloaded")) + quiet_total == final["redownloads"], (summaries, final["redownloads"])


def test_churn_lines_past_a_few_a_minute_go_to_debug_and_a_quiet_minute_is_not_summarised(caplog):
    now = [0.0]
    churn = ChurnLog(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="wdscache")
    # A few a minute: every one at INFO, no summary.
    assert [churn.level(Churn.REDOWNLOADED) for _ in range(LOUD)] == [logging.INFO] * LOUD
    now[0] = WINDOW
    churn.tick(lambda: 0, 1000)
    assert not [r for r in caplog.records if r.name == "wdscache.agent.churn_log"], caplog.text
    # The next minute starts at its first event: past LOUD of a kind, DEBUG; the other kind keeps its own count.
    levels = [churn.level(Churn.EVICTED) for _ in range(LOUD + 2)]
    assert levels == [logging.INFO] * LOUD + [logging.DEBUG] * 2
    assert churn.level(Churn.REDOWNLOADED) == logging.INFO
    now[0] = 2 * WINDOW - 1
    churn.tick(lambda: 0, 1000)  # not a minute since that first event
    assert not [r for r in caplog.records if r.name == "wdscache.agent.churn_log"], caplog.text
    churn.tick(lambda: 5000, 1000, last=True)  # the stop: the minute under way, cut short
    [summary] = [r for r in caplog.records if r.name == "wdscache.agent.churn_log"]
    assert summary.getMessage() == (
        "the cache thrashes: 1 shard(s) downloaded again and 12 evicted to make room for a shard readers need "
        "in the last 59 s (0 and 2 of those lines at DEBUG); readers need 4.9K at once, --cache-size 1000"
    ), summary.getMessage()
