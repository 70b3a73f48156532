"""Readers as the agent sees them: which list each reads, and when one is gone.

Real agents started through the CLI, real consumer processes (tests/consumer.py),
a real HTTP server; samples are compared with webdataset's own reader.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

import pytest

from scripts.shard_maker import write_url_list
from tests.helpers.streaming import reference, samples_of
from tests.helpers.waits import stop_process, wait_for


def _replace_list(path, urls) -> None:
    """Rewrite a URL list the way a careful editor does: a new file renamed over the old."""
    tmp = path.with_name(path.name + ".new")
    write_url_list(tmp, urls)
    os.replace(tmp, path)


def _lines(consumer) -> int:
    try:
        return len(consumer.out.read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_list_edit_mid_epoch_lets_the_epoch_finish_on_its_list_and_the_next_takes_the_new(
    tmp_path, dataset, start_agent, consumers
):
    data = dataset(8, samples=10, payload=500)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2")
    first = consumers(cache, "first", "--job", "edit", "--sleep", "0.1", "--shuffle-buffer", "10")
    wait_for(lambda: _lines(first) >= 5, 30, lambda: f"no samples\n{first.log.read_text()[-2000:]}")
    kept = data.urls[:4]
    _replace_list(data.list_file, kept)
    agent.wait_stats(lambda s: s["agent"]["urls"] == 4, 20, "the agent never took the edited list up")
    got = samples_of(first.wait())
    ref = reference(data.paths, data.urls)
    assert Counter((s["url"], s["key"]) for s in got) == Counter(ref.keys())  # the old list's samples, once each
    for s in got:
        assert s["fields"] == ref[(s["url"], s["key"])]
    nxt = samples_of(consumers(cache, "next", "--job", "edit").wait())
    assert sorted((s["url"], s["key"]) for s in nxt) == sorted(reference(data.paths[:4], kept))


@pytest.mark.slow
def test_sigkilled_consumer_is_dropped_at_once_and_its_job_restarts_with_another_world_size(
    tmp_path, dataset, start_agent, consumers
):
    data = dataset(4, samples=100, payload=200)  # a shard stays pinned while its ids are in the shuffle buffer
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--reader-timeout", "60")
    old = consumers(cache, "old", "--job", "E", "--world-size", "2", "--sleep", "0.1")
    agent.wait_stats(
        lambda s: "E" in s["jobs"] and s["agent"]["pinned"] > 0, 30, "the consumer never reported while holding a shard"
    )
    old.kill()
    agent.wait_stats(
        lambda s: not s["jobs"] and s["agent"]["consumers"] == 0 and s["agent"]["pinned"] == 0,
        5,
        "the killed consumer still counts as live, or still pins shards",
    )
    new = consumers(cache, "new", "--job", "E", "--world-size", "1")
    got = samples_of(new.wait())
    assert sorted((s["url"], s["key"]) for s in got) == sorted(reference(data.paths, data.urls))


@pytest.mark.slow
def test_a_reader_is_watched_only_through_the_very_process_it_names(tmp_path, dataset, start_agent):
    from wdscache.shared.client import AgentConnection
    from wdscache.shared.messages import Requests
    from wdscache.shared.protocol import process_identity

    data = dataset(2, samples=5, payload=200)
    cache = tmp_path / "cache"
    # A silence long enough that the reader of the reused pid outlives the wait for the other's drop.
    agent = start_agent(cache, data.list_file, "--prefetch", "1", "--reader-timeout", "20")
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        for job, proc, shift in (("seen", procs[0], 0), ("reused", procs[1], 1)):
            claimed = process_identity(proc.pid)
            claimed[1] += shift  # another start time: the pid names another process now
            hello = conn.request(Requests(job).hello(job, 0, 1, process=claimed))
            assert hello["ok"], hello
            assert conn.request({"op": "open", "reader": job, "url": data.urls[0]})["ok"]
        agent.wait_stats(
            lambda s: set(s["jobs"]) == {"seen", "reused"} and s["agent"]["pinned"] == 1,
            5,
            "both readers in stats, the shard pinned",
        )
        for proc in procs:
            stop_process(proc)
        agent.wait_stats(lambda s: set(s["jobs"]) == {"reused"}, 15, "the reader of the very process was not dropped")
        # The other claimed a process the agent could not confirm: only its silence ends it.
        agent.wait_stats(
            lambda s: not s["jobs"] and s["agent"]["pinned"] == 0, 30, "the silent reader was not timed out"
        )
    finally:
        conn.close()
        for proc in procs:
            stop_process(proc, timeout=5)
    assert "reader reused silent for" in agent.stderr_text(), agent.stderr_tail()


@pytest.mark.slow
def test_a_jobs_own_list_is_freed_once_the_job_has_left(tmp_path, dataset, start_agent, consumers):
    data = dataset(3, samples=5, payload=500)
    own = dataset(2, samples=5, payload=500, prefix="own", list_name="own.txt")
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2")
    job = consumers(cache, "own", "--job", "own", "--urls", str(own.list_file), "--sleep", "0.2")
    agent.wait_stats(lambda s: s["agent"]["job_lists"] == 1, 30, "the job's list was never taken up")
    assert len(samples_of(job.wait())) == 10
    agent.wait_stats(lambda s: s["agent"]["job_lists"] == 0, 30, "the job's list is still held after it left")


def test_an_html_page_read_while_it_downloads_is_reported_as_html(tmp_path, dataset, start_agent, shard_server):
    """The fetcher refuses a body whose first 64 KiB are not a tar before it is published,
    but a shorter HTML page (a 200 "sign in" page) is in the partial file from its write to
    that check, and a consumer streaming the shard reads it then. The test holds the
    download open (a stalled body) with the page where the download writes, so that the
    moment lasts."""
    from wdscache import CachedMultiLoader
    from wdscache.shared.errors import ShardError
    from wdscache.shared.layout import CacheLayout

    data = dataset(1, samples=10, payload=500)
    shard_server.fail(data.paths[0].name, "stall", seconds=60, then="close")
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "1")
    partial = CacheLayout.of(cache).partial_path(data.urls[0])
    wait_for(partial.exists, 20, "the download never started writing")
    page = b"<!DOCTYPE html>\n<html><body>" + b"<p>Sign in to continue.</p>\n" * 200 + b"</body></html>\n"
    with open(partial, "r+b") as f:
        f.write(page)
    loader = CachedMultiLoader(cache_dir=cache, job="html", timeout=20, on_error="raise")
    with pytest.raises(ShardError) as info:
        list(loader)
    assert "HTML" in str(info.value) and data.urls[0] in str(info.value), str(info.value)
