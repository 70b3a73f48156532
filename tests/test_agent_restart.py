"""A loader across its agent's restart: it proves the new run, says hello again and goes on
exactly; with no agent back within its timeout it fails saying the agent died or restarted.

Real agents through the CLI, real consumer processes (tests/consumer.py), the real shard server;
the kill comes once the consumer has written samples (an event), never after a sleep.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.shard_maker import make_shard, synth_samples
from tests.helpers.agents import kill_agent
from tests.helpers.net import free_port_range
from tests.helpers.procs import children_of, worker_pids
from tests.helpers.streaming import Consumer, assert_epoch_exact, consumer_log, reference, samples_of, wait_exit
from tests.helpers.waits import wait_for
from wdscache import FetchError, ShardClient
from wdscache.agent.cache_commands import evict, verify
from wdscache.shared.index import Index, ShardRecord, ShardState
from wdscache.shared.layout import CacheLayout

DEADLINE = 60.0
IN_FLIGHT = 256 << 10  # bytes a killed agent may leave unread in the kernel's buffers (sent, never written)
# One connection per shard (no parts): the resume is one Range request from where the partial ends.
JOB_SHARD_ARGS = ("--prefetch", "1", "--cache-size", "10M", "--download-parts", "1")


def stop_workers(agent: Any) -> list[int]:
    """Stop the agent's 2 sample workers (SIGSTOP): reads sent to them stay unanswered."""
    workers = wait_for(
        lambda: (lambda w: w if len(w) == 2 else None)(worker_pids(agent.pid)),
        10,
        lambda: f"2 workers not found among {children_of(agent.pid)}",
    )
    for w in workers:
        os.kill(w, signal.SIGSTOP)
    return workers


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


def test_a_loader_started_before_its_agent_waits_for_it_and_reads_the_epoch_exactly(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    """A job and its node's agent started together, the job first: the loader waits for the
    agent's token and socket (an empty cache directory), then reads its epoch exactly."""
    ds = dataset(4, samples=10, payload=500)
    cache = tmp_path / "cache"
    cache.mkdir()
    c = consumers(cache, "early", "--job", "early", "--timeout", "60")

    def waiting() -> bool:  # it has imported the library (ZeroMQ is mapped) and has no agent to talk to
        assert c.proc.poll() is None, f"the consumer ended without an agent\n{consumer_log(c)}"
        return "libzmq" in Path(f"/proc/{c.proc.pid}/maps").read_text()

    wait_for(waiting, DEADLINE, lambda: f"the consumer never started\n{consumer_log(c)}", interval=0.02)
    assert not any(cache.iterdir())
    start_agent(cache, ds.list_file)
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))


@pytest.mark.slow
@pytest.mark.parametrize("moved", [False, True], ids=["same-endpoint", "another-endpoint"])
def test_loader_goes_on_exactly_across_a_sigkilled_and_restarted_agent(
    shard_server, dataset, start_agent, consumers, tmp_path, moved
):
    # another-endpoint: the loader, given only the cache directory, follows the agent to the TCP
    # port it restarts on (it stayed on the directory's socket, and failed at its timeout).
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
    elsewhere = ("--endpoint", f"tcp://127.0.0.1:{free_port_range(3)}") if moved else ()
    again = start_agent(cache, ds.list_file, *args, *elsewhere)
    lines = c.wait(DEADLINE)
    print(f"consumer finished {time.monotonic() - t0:.1f}s after the restart")
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    text = c.log.read_text(errors="replace")
    assert "without the worker's proof" not in text, text[-3000:]
    assert re.search(r"agent .*restarted", text), text[-3000:]
    assert again.running()


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(1, 1), (3, 1)])
def test_loader_goes_on_exactly_when_its_own_list_and_a_download_span_the_restart(
    shard_server, dataset, start_agent, consumers, tmp_path, before, after
):
    """A consumer's own list (the new agent is told it again) and shards downloading at the kill;
    the new run may have fewer workers, whose shards the loader asks others about."""
    ds = dataset(8, samples=30, payload=3000)  # ~100 KB shards, served at 400 KB/s: downloads span the kill
    mine = ds.urls[:6]
    ref = reference(ds.paths[:6], mine)
    own = tmp_path / "own.txt"
    own.write_text("\n".join(mine) + "\n")
    shard_server.rate = 400_000
    cache = tmp_path / "cache"
    args = ("--prefetch", "2", "--cache-size", "10M")
    agent = start_agent(cache, ds.list_file, *args, "--workers", str(before))
    c = consumers(cache, "reader", "--job", "own", "--urls", str(own), "--timeout", "15")
    wait_samples(c, 50)
    kill_agent(agent)
    again = start_agent(cache, ds.list_file, *args, "--workers", str(after))
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    assert "restarted" in c.log.read_text(errors="replace"), consumer_log(c)
    assert any(f"downloading {u}" in again.stderr_text() for u in mine), again.stderr_tail()  # spanned the kill
    assert again.running()


def kill_mid_jobs_own_shard(
    shard_server, dataset, start_agent, consumers, tmp_path
) -> tuple[Consumer, Path, int, Path]:
    """An agent SIGKILLed a third of the way into a shard only a job's own list names (the
    agent's list names another), the job reading it; the job (its consumer), the shard's
    file on the server, the bytes its partial file holds, and the agent's list. The server is
    uncapped again."""
    ds = dataset(2, samples=40, payload=20_000)  # ~800 KB shards, at 200 KB/s: the kill comes mid-body
    ds.list_file.write_text(ds.urls[0] + "\n")  # the agent's own list does not name the job's shard
    url, path = ds.urls[1], ds.paths[1]
    own = tmp_path / "own.txt"
    own.write_text(url + "\n")
    cache = tmp_path / "cache"
    partial = CacheLayout.of(cache).partial_path(url)
    shard_server.rate = 200_000
    agent = start_agent(cache, ds.list_file, *JOB_SHARD_ARGS)
    c = consumers(cache, "reader", "--job", "own", "--urls", str(own), "--timeout", "30")
    wait_for(
        lambda: partial.exists() and partial.stat().st_size >= path.stat().st_size // 3,
        DEADLINE,
        lambda: f"the job's shard never got a third of the way\n{consumer_log(c)}\n{agent.stderr_tail()}",
        interval=0.02,
    )
    kill_agent(agent)
    kept = partial.stat().st_size
    assert kept < path.stat().st_size, "the shard was whole before the kill: nothing to resume"
    shard_server.rate = None
    return c, path, kept, ds.list_file


def the_two_gets(shard_server, path: Path) -> tuple[Any, Any]:
    """The GETs of ``path``: the killed agent's and the restarted one's; asserts there were two."""
    gets = [r for r in shard_server.requests if r.method == "GET" and r.path == path.name]
    assert len(gets) == 2, gets
    return gets[0], gets[1]


def range_start(request: Any) -> int:
    m = re.fullmatch(r"bytes=(\d+)-\d*", request.range or "")
    return int(m.group(1)) if m else 0


@pytest.mark.slow
def test_a_shard_only_a_jobs_own_list_names_half_downloaded_at_a_kill_is_resumed_from_its_partial(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    """The agent is SIGKILLed mid-body of a shard that only the job's own list names: the new
    run keeps the partial (the job's list died with the old run), and when the job names the
    shard again its download goes on with a Range from where the partial ends. The shard's
    bytes cross the network once (but what was in flight at the kill), and the job gets them all."""
    c, path, kept, listed = kill_mid_jobs_own_shard(shard_server, dataset, start_agent, consumers, tmp_path)
    url, size, cache = shard_server.url(path.name), path.stat().st_size, tmp_path / "cache"
    again = start_agent(cache, listed, *JOB_SHARD_ARGS)
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, reference([path], [url]))
    assert len(samples_of(lines)) == len(reference([path], [url]))
    shard = CacheLayout.of(cache).shard_path(url)
    wait_for(shard.exists, DEADLINE, lambda: f"the job's shard was never cached\n{again.stderr_tail()}")
    assert shard.read_bytes() == path.read_bytes()
    first, resumed = the_two_gets(shard_server, path)
    assert (range_start(first), range_start(resumed)) == (0, kept), f"not resumed from {kept}: {first}, {resumed}"
    assert resumed.status == 206 and resumed.if_range, resumed
    # (the server counts a slice once sent: the agent may have had it a moment before)
    wait_for(lambda: resumed.bytes_sent == size - kept, 10, lambda: f"the rest was not sent once: {resumed}")
    assert kept <= first.bytes_sent <= kept + IN_FLIGHT, (first, kept)  # sent in all: the shard, and what was in flight


@pytest.mark.slow
def test_a_jobs_own_shard_replaced_on_its_server_while_the_agent_was_down_starts_over_never_spliced(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    """The same kill, then the job's shard is replaced on its server: the resume names the
    partial's version (If-Range), is answered with the whole new version, and what is cached
    is that version alone; the job gets each sample once, of one version or the other."""
    c, path, kept, listed = kill_mid_jobs_own_shard(shard_server, dataset, start_agent, consumers, tmp_path)
    url, cache = shard_server.url(path.name), tmp_path / "cache"
    old = reference([path], [url])
    make_shard(path, synth_samples(1, 40, payload=20_000, seed=7))  # a new mtime, so a new ETag
    new = reference([path], [url])
    again = start_agent(cache, listed, *JOB_SHARD_ARGS)
    lines = c.wait(DEADLINE)
    got = [((s["url"], s["key"]), s["fields"]) for s in samples_of(lines)]
    assert sorted(k for k, _ in got) == sorted(new), "not each sample once"
    assert all(fields in (old[k], new[k]) for k, fields in got), "a sample of neither version"
    shard = CacheLayout.of(cache).shard_path(url)
    wait_for(shard.exists, DEADLINE, lambda: f"the job's shard was never cached\n{again.stderr_tail()}")
    assert shard.read_bytes() == path.read_bytes()
    _, resumed = the_two_gets(shard_server, path)
    assert range_start(resumed) == kept and resumed.if_range and resumed.status == 200, resumed
    said = f"{url}: the source changed since the partial was written; downloading from the start"
    assert said in again.stderr_text(), again.stderr_tail()


@pytest.mark.slow
def test_loader_reading_its_own_list_goes_on_exactly_when_the_agent_restarts_on_another_list(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    """The agent's own list changed across the restart, the loader's did not: the loader sends
    its list to the new run, which serves it, so the epoch goes on."""
    ds = dataset(8, samples=40, payload=1000)
    mine = ds.urls[:6]
    ref = reference(ds.paths[:6], mine)
    own = tmp_path / "own.txt"
    own.write_text("\n".join(mine) + "\n")
    cache = tmp_path / "cache"
    args = ("--prefetch", "8", "--cache-size", "10M")
    agent = start_agent(cache, ds.list_file, *args)
    c = consumers(
        cache, "reader", "--job", "own", "--urls", str(own), "--sleep", "0.02", "--timeout", "15", "--request-size", "4"
    )
    wait_samples(c, 40)
    kill_agent(agent)
    ds.list_file.write_text("\n".join(ds.urls[:3]) + "\n")
    again = start_agent(cache, ds.list_file, *args)
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    assert "restarted" in c.log.read_text(errors="replace"), consumer_log(c)
    assert again.running()


@pytest.mark.slow
def test_loader_goes_on_exactly_when_the_agent_restarts_twice_while_it_waits_in_one_open(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    """Each new run's refusal of the key before is answered by proving that run and asking it
    again, however many runs come while one request waits."""
    ds = dataset(2, samples=10, payload=2000)
    ref = reference(ds.paths, ds.urls)
    # Sizes untold (so no shard is read while it downloads: the open waits), and no body until go.
    shard_server.accept_ranges = shard_server.lengths = False
    go = threading.Event()
    for path in ds.paths:
        shard_server.fail(path.name, "stall", seconds=2 * DEADLINE, until=go, times=10)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file)
    c = consumers(cache, "reader", "--job", "twice", "--no-shuffle", "--timeout", "30")

    def open_waiting(stats: dict[str, Any]) -> bool:
        assert c.proc.poll() is None, f"the consumer ended\n{consumer_log(c)}"
        return stats["agent"]["demanded"] >= 1

    for n in (1, 2):
        agent.wait_stats(open_waiting, 20, f"the consumer's open waiting at run {n}")
        kill_agent(agent)
        agent = start_agent(cache, ds.list_file)
    agent.wait_stats(open_waiting, 20, "the consumer's open waiting at run 3")
    go.set()
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)


@pytest.mark.slow
def test_loader_fails_at_once_when_the_restarted_agent_serves_another_list(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(8, samples=40, payload=1000)
    other = tmp_path / "other" / "urls.txt"
    other.parent.mkdir()
    other.write_text("\n".join(ds.urls[:4]) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "8", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 8, 20, "not all 8 shards cached")
    c = consumers(cache, "reader", "--job", "moved", "--sleep", "0.01", "--timeout", "15", "--request-size", "4")
    wait_samples(c, 40)
    kill_agent(agent)
    again = start_agent(cache, other, "--prefetch", "4", "--cache-size", "10M")
    t0 = time.monotonic()
    rc = wait_exit(c.proc, 30, "a consumer whose agent restarted on another list")
    took = time.monotonic() - t0
    last = c.log.read_text(errors="replace").strip().splitlines()[-1]
    assert rc != 0 and last.startswith("wdscache.WdsCacheError: "), last
    assert "restarted, and now serves a URL list other than the one this epoch reads" in last, last
    assert took < 15, f"the consumer failed {took:.1f}s after the restart, not at once"
    assert again.running()


@pytest.mark.slow
def test_loader_whose_agent_does_not_come_back_fails_within_its_timeout_naming_the_death(
    shard_server, dataset, start_agent, consumers, tmp_path
):
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


@pytest.mark.slow
def test_loader_goes_on_exactly_when_the_agents_workers_alone_are_killed(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(8, samples=40, payload=1000)
    ref = reference(ds.paths, ds.urls)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--workers", "2", "--prefetch", "8", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 8, 20, "not all 8 shards cached")
    workers = wait_for(
        lambda: (lambda w: w if len(w) == 2 else None)(worker_pids(agent.pid)),
        10,
        lambda: f"2 workers not found among {children_of(agent.pid)}",
    )
    c = consumers(cache, "reader", "--job", "wk", "--sleep", "0.01", "--timeout", "15", "--request-size", "4")
    wait_samples(c, 40)
    for w in workers:
        os.kill(w, signal.SIGKILL)
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    assert agent.running()


@pytest.mark.slow
def test_shard_client_pins_its_open_shards_again_at_a_restarted_agent(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(3, samples=5, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "not all 3 shards cached")
    with ShardClient(cache, timeout=10) as client:
        held = client.open(ds.urls[0])
        released = client.open(ds.urls[1])
        client.release(ds.urls[1])
        assert agent.stats()["agent"]["pinned"] == 1
        kill_agent(agent)
        again = start_agent(cache, ds.list_file, "--prefetch", "3", "--cache-size", "10M")
        # The new run learns of the client's pin from its keepalive (each second) or, sooner, its next open.
        assert client.open(ds.urls[2]) == CacheLayout.of(cache).shard_path(ds.urls[2])  # pins ours first
        assert again.stats()["agent"]["pinned"] == 2
        assert held.read_bytes() == ds.paths[0].read_bytes() and released.exists()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["kept", "gone"])
def test_shard_client_at_a_restarted_agent_that_lost_its_shard_gets_it_back_or_fails_at_once(
    shard_server, dataset, start_agent, tmp_path, source
):
    ds = dataset(2, samples=5, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "not all 2 shards cached")
    with ShardClient(cache, timeout=10) as client:
        path = client.open(ds.urls[0])
        kill_agent(agent)
        path.unlink()  # gone while no agent ran: the new run no longer holds it
        if source == "gone":
            ds.paths[0].unlink()  # and gone at the source: it cannot come back
        start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
        if source == "kept":  # downloaded again before the client's next request is answered
            assert client.stats()["agent"]["pinned"] == 1
            assert path.read_bytes() == ds.paths[0].read_bytes()
        else:
            with pytest.raises(FetchError, match="restarted and cannot pin it again"):
                client.stats()
            assert client.stats()["agent"]["pinned"] == 0  # told once; the client goes on


@pytest.mark.slow
def test_a_resumed_loader_whose_first_iter_fails_delivers_the_resumed_epoch_exactly_once_the_agent_is_back(
    shard_server, dataset, start_agent, tmp_path
):
    from wdscache import AgentUnavailableError, CachedMultiLoader

    ds = dataset(3, samples=20, payload=500)
    cache = tmp_path / "cache"
    args = ("--prefetch", "3", "--cache-size", "10M")
    agent = start_agent(cache, ds.list_file, *args)
    first = CachedMultiLoader(cache_dir=cache, job="resume", timeout=10, seed=5)
    it = iter(first)
    head = [next(it) for _ in range(24)]
    state = first.state_dict()
    it.close()
    whole = list(CachedMultiLoader(cache_dir=cache, job="resume", timeout=10, seed=5))
    agent.stop()
    resumed = CachedMultiLoader(cache_dir=cache, job="resume", timeout=2, seed=5)
    resumed.load_state_dict(state)
    with pytest.raises(AgentUnavailableError):  # after 2 s of no agent
        iter(resumed)
    resumed.timeout = 30  # (read at each iter) the agent back: the resumed epoch gets time on a busy machine
    start_agent(cache, ds.list_file, *args)
    rest = list(resumed)
    key = lambda s: (s["__url__"], s["__key__"])  # noqa: E731
    assert [key(s) for s in head] + [key(s) for s in rest] == [key(s) for s in whole]


@pytest.mark.slow
def test_a_damaged_copy_left_by_a_kill_as_its_shard_failed_is_removed_at_the_next_start(
    shard_server, dataset, start_agent, tmp_path
):
    # ShardCache.fail_cached records FAILED, then removes the file: a kill between the two leaves a
    # file nothing counts (and a later download record of size 0 would have adopted it as whole).
    ds = dataset(2, samples=5, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    agent.stop()
    layout = CacheLayout.of(cache)
    index = Index(layout.index_dir)
    try:
        index.put(ShardRecord(ds.urls[0], ShardState.FAILED, error="its copy was damaged"))
    finally:
        index.close()
    assert layout.shard_path(ds.urls[0]).exists()
    ds.list_file.write_text(ds.urls[1] + "\n")
    again = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    assert not layout.shard_path(ds.urls[0]).exists()
    s = again.stats()
    on_disk = sum(p.stat().st_size for p in (cache / "shards").rglob("*") if p.is_file())
    assert s["shards"]["cached"] == 1 and s["bytes_used"] - s["table_bytes"] == on_disk, s


@pytest.mark.slow
def test_an_index_a_later_version_wrote_keeps_every_cached_shard_after_a_rollback(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    # A record field this version does not know (a later release's, as table_size and
    # last_modified were once added) made the whole index "unreadable": it was moved aside and
    # every shard downloaded again.
    ds = dataset(3, samples=4, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "the shards cached")
    agent.stop()
    index = Index(CacheLayout.of(cache).index_dir)
    try:
        for url in ds.urls:
            later = {**json.loads(index.records[url].to_json()), "a_later_field": [1, "x"]}
            index._db.set("shard:" + url, json.dumps(later))
        # A state this version does not know, a value of another type, and a count of another shape:
        # those entries alone are left out (the first two shards' files are adopted).
        index._db.set("shard:" + ds.urls[0], json.dumps({**later, "url": ds.urls[0], "state": "verifying"}))
        index._db.set("shard:" + ds.urls[1], json.dumps({**later, "url": ds.urls[1], "size": {"bytes": 1}}))
        index._db.set("count:" + ds.urls[2], json.dumps({"samples": 4, "size": 1}))
    finally:
        index.close()
    # Without an agent, verify checks the entries it reads (it took such an index for a lost one).
    assert verify(cache)["checked"] == 1
    shard_server.reset_log()
    again = start_agent(cache, ds.list_file, "--prefetch", "3")
    assert_epoch_exact(consumers(cache, "after", "--no-shuffle").wait(), reference(ds.paths, ds.urls))
    fetched = {r.path for r in shard_server.requests if r.method == "GET"}
    assert fetched <= {p.name for p in ds.paths[:2]}, shard_server.requests  # (those left out, at most)
    assert "unreadable" not in again.stderr_text() and not list(cache.glob("index.corrupt*")), again.stderr_tail()
    assert "3 entries this version cannot read" in again.stderr_text(), again.stderr_tail()


@pytest.mark.slow  # idles past --reader-timeout on purpose
def test_a_shard_client_keeps_its_pins_while_idle_and_takes_them_again_after_a_stop(
    shard_server, dataset, start_agent, tmp_path
):
    # A program that worked on a shard longer than --reader-timeout without a request lost its pin:
    # the shard could be evicted (and downloaded anew) under its path, and release() said nothing.
    ds = dataset(2, samples=4, payload=1000)
    cache = tmp_path / "cache"
    # A stop past it is longer than the keepalive's pings leave unheard (2 of them).
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--reader-timeout", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "the shards cached")
    with ShardClient(cache, timeout=10) as client:
        path = client.open(ds.urls[0])
        time.sleep(7)  # two reader timeouts without a request of ours: the keepalive speaks for us
        assert [r["url"] for r in evict(cache, [ds.urls[0]])["refused"]] == [ds.urls[0]] and path.exists()
        client.release(ds.urls[0])
        # Closed, it holds nothing: used again, it takes none of its old pins.
        client.open(ds.urls[1])
        client.close()
        client.open(ds.urls[0])
        client.release(ds.urls[0])
        assert agent.stats()["agent"]["pinned"] == 0
    # Dropped unclosed, it is collected at once (no cycle keeps its keepalive alive), and its pins go.
    dropped = ShardClient(cache, timeout=10)
    dropped.open(ds.urls[0])
    del dropped
    agent.wait_stats(lambda s: s["agent"]["pinned"] == 0, 15, "the dropped client's pin kept")
    assert pickle.loads(pickle.dumps(ShardClient(cache))).name  # a fresh client still pickles
    # Stopped past the timeout, the client takes its pins again at its next request.
    script = (
        "import os, sys, signal; from wdscache import ShardClient\n"
        "c = ShardClient(sys.argv[1], timeout=20); p = c.open(sys.argv[2]); print(p, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
        "c.open(sys.argv[3]); print(open(p, 'rb').read() == open(sys.argv[4], 'rb').read(), flush=True); c.close()\n"
    )
    silent = agent.stderr_text().count("silent for")  # (the dropped client's went so)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(cache), ds.urls[0], ds.urls[1], str(ds.paths[0])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == str(
            CacheLayout.of(cache).shard_path(ds.urls[0])
        )
        wait_for(lambda: agent.stderr_text().count("silent for") > silent, 20, lambda: agent.stderr_tail())
        assert evict(cache, [ds.urls[0]])["evicted"] == [ds.urls[0]]  # its pin went with it
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 0 and out.strip() == "True", out


@pytest.mark.slow
def test_reads_across_more_shards_than_a_restarted_agents_budget_holds_go_on_a_shard_at_a_time(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    """A read spans the shards pinned together when it was made (here 8 of 4 samples each). An agent
    that comes back with a budget for 3 of them lost those copies: the read cannot have its
    shards pinned again all at once, and each download for one evicted another. It goes in
    parts instead, each waiting for one download at most, and the epoch ends exact."""
    ds = dataset(12, samples=4, payload=1000)
    ref = reference(ds.paths, ds.urls)
    cache = tmp_path / "cache"
    size = max(p.stat().st_size for p in ds.paths)
    agent = start_agent(
        cache, ds.list_file, "--no-shuffle", "--workers", "2", "--prefetch", "12", "--cache-size", "10M"
    )
    agent.wait_stats(lambda s: s["shards"]["cached"] == 12, 20, "not all 12 shards cached")
    first = consumers(cache, "first", "--job", "wide", "--no-shuffle", "--timeout", "20")
    assert_epoch_exact(first.wait(DEADLINE), ref)  # the agent knows each shard's count now
    stop_workers(agent)  # the reads stay unanswered
    c = consumers(cache, "reader", "--job", "wide", "--no-shuffle", "--timeout", "20")
    agent.wait_stats(lambda s: s["agent"]["pinned"] >= 8, 20, "the first read's shards pinned")
    kill_agent(agent)
    got = {p.name: shard_server.count(p.name) for p in ds.paths}
    budget = 3 * size + (16 << 10)  # the least --prefetch 2 takes, and room for tables
    small = ("--no-shuffle", "--workers", "2", "--prefetch", "2", "--cache-size", str(budget), "--min-free", "0")
    start_agent(cache, ds.list_file, *small)
    lines = c.wait(DEADLINE)
    assert_epoch_exact(lines, ref)
    assert len(samples_of(lines)) == len(ref)
    # Each part waits for one download at most, so a shard is downloaded again once (the start-up
    # prefetch of 2 shards aside, which may be evicted before the read reaches them).
    again = {p.name: shard_server.count(p.name) - got[p.name] for p in ds.paths}
    assert sum(again.values()) <= len(ds.paths) + 2, again


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", ["4", "1"])
@pytest.mark.parametrize("on_error", ["raise", "stop"])
def test_a_shard_failing_when_a_read_into_it_is_asked_again_ends_the_epoch_after_every_sample_before_it(
    shard_server, dataset, start_agent, consumers, tmp_path, on_error, prefetch
):
    """Reads of 6 samples over shards of 4: the second read holds shard 1's last 2 samples and
    shard 2's first 4. Its workers stopped, it is out when the agent is killed; shard 2's copy
    goes and its source answers 404, so when the restarted agent has the read asked again, shard
    2 fails then: at once if the new run's start-up prefetch (``prefetch``: 4) failed it already,
    while the read is still out; else (1) the read's shard-1 part comes first (the new workers
    lack shard 2's copy) and shard 2's download fails as it is pinned again. The samples before
    shard 2's first, the read's own 2 of shard 1 among them, are all handed out, then the error
    is raised naming shard 2 (a handler that returns False ends the epoch at the same place)."""
    ds = dataset(4, samples=4, payload=1000)
    order = sorted(reference(ds.paths, ds.urls), key=lambda k: (ds.urls.index(k[0]), k[1]))
    failing = ds.urls[2]
    cache = tmp_path / "cache"
    args = ("--no-shuffle", "--workers", "2", "--prefetch", "4", "--cache-size", "10M")
    agent = start_agent(cache, ds.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 20, "not all 4 shards cached")
    first = consumers(cache, "first", "--job", "cut", "--no-shuffle", "--timeout", "20")
    assert len(samples_of(first.wait(DEADLINE))) == len(order)  # the agent knows each shard's count now
    stop_workers(agent)  # the reads stay unanswered
    c = consumers(
        cache,
        "reader",
        "--job",
        "cut",
        "--no-shuffle",
        "--timeout",
        "20",
        "--request-size",
        "6",
        "--on-error",
        on_error,
    )
    agent.wait_stats(lambda s: s["agent"]["pinned"] >= 4, 20, "the reads' shards pinned")
    kill_agent(agent)
    assert evict(cache, [failing])["evicted"] == [failing]
    shard_server.fail(ds.paths[2].name, "status", status=404, times=1000)
    start_agent(cache, ds.list_file, *args, "--prefetch", prefetch)
    rc = wait_exit(c.proc, DEADLINE, "the consumer")
    log = c.log.read_text(errors="replace")
    assert re.search(r"restarted: said hello to it again; sending [1-9]\d* reads again", log), consumer_log(c)
    lines = [json.loads(line) for line in c.out.read_text().splitlines()]
    keys = [(s["url"], s["key"]) for s in samples_of(lines)]
    assert keys == [k for k in order if k[0] in ds.urls[:2]], consumer_log(c)
    assert f"epoch 0 ends at a shard that cannot be read: cannot fetch {failing}" in log, consumer_log(c)
    if on_error == "raise":
        assert rc == 1 and f"FetchError: cannot fetch {failing}" in log, consumer_log(c)
    else:
        assert rc == 0, consumer_log(c)
