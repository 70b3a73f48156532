"""Streaming samples from the agent to real consumer processes.

Every consumer is a real process running tests/consumer.py against a real agent
started through the CLI; samples are compared with webdataset's own reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest
import webdataset as wds

from tests.helpers.streaming import CONSUMER, delivered, reference, samples_of, state_of
from tests.helpers.waits import wait_for


@pytest.mark.slow
def test_ranks_of_two_jobs_get_exact_shares_byte_identical_to_webdataset(tmp_path, dataset, start_agent, consumers):
    data = dataset(6, samples=7, payload=3000)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--workers", "2", "--prefetch", "6")
    ranks = [consumers(cache, f"a{r}", "--job", "a", "--rank", str(r), "--world-size", "3") for r in range(3)]
    other = consumers(cache, "b0", "--job", "b", "--seed", "5")
    results = [samples_of(c.wait()) for c in ranks]
    single = samples_of(other.wait())
    ref = reference(data.paths, data.urls)
    total = len(ref)  # 42 samples: 14 per rank, no padding

    assert [len(r) for r in results] == [total // 3] * 3
    got = Counter((s["url"], s["key"]) for r in results for s in r)
    assert set(got) == set(ref) and all(n == 1 for n in got.values())
    for r in results:
        for s in r:
            assert s["fields"] == ref[(s["url"], s["key"])]
    assert sorted((s["url"], s["key"]) for s in single) == sorted(ref)
    for s in single:
        assert s["fields"] == ref[(s["url"], s["key"])]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.slow
def test_equal_counts_per_rank_with_padding_or_drop_last(tmp_path, dataset, start_agent, consumers, drop_last):
    data = dataset(5, samples=5, payload=500)  # 25 samples over 4 ranks
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "5")
    extra = ["--drop-last"] if drop_last else []
    runs = [consumers(cache, f"r{r}", "--rank", str(r), "--world-size", "4", *extra) for r in range(4)]
    results = [samples_of(c.wait()) for c in runs]
    counts = [len(r) for r in results]
    keys = Counter((s["url"], s["key"]) for r in results for s in r)
    if drop_last:
        assert counts == [6] * 4
        assert len(keys) == 24 and all(n == 1 for n in keys.values())
    else:
        assert counts == [7] * 4
        assert len(keys) == 25  # every sample once ...
        assert sum(keys.values()) == 28  # ... plus W-1 = 3 wrapped repeats
        assert sum(n - 1 for n in keys.values()) == 3


@pytest.mark.slow
def test_sequence_does_not_depend_on_agent_workers(tmp_path, dataset, start_agent, consumers):
    data = dataset(4, samples=9, payload=800)
    seqs = []
    for workers in ("1", "3"):
        cache = tmp_path / f"cache{workers}"
        agent = start_agent(cache, data.list_file, "--workers", workers, "--prefetch", "4")
        runs = [
            consumers(cache, f"w{workers}r{r}", "--rank", str(r), "--world-size", "2", "--seed", "3") for r in range(2)
        ]
        seqs.append([[(s["url"], s["key"]) for s in samples_of(c.wait())] for c in runs])
        agent.stop()
    assert seqs[0] == seqs[1]
    assert seqs[0][0] != seqs[0][1]


@pytest.mark.slow
@pytest.mark.parametrize("world_before,world_after", [(3, 3), (3, 1), (2, 3)])
def test_resume_mid_epoch_on_same_or_other_world_size(
    tmp_path, dataset, start_agent, consumers, world_before, world_after
):
    data = dataset(6, samples=6, payload=600)  # 36 samples
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "6")
    first = [
        consumers(cache, f"p{r}", "--rank", str(r), "--world-size", str(world_before), "--stop-after", "5")
        for r in range(world_before)
    ]
    before = [c.wait() for c in first]
    state = state_of(before[0])
    # 5 of each rank's first block of 8: a prefix of 5, plus 5 positions of each other block
    assert state["epoch"] == 0 and state["position"] == 5
    assert state["done"] == [[8 * r, 8 * r + 5] for r in range(1, world_before)]
    assert all(state_of(b) == state for b in before)
    second = [
        consumers(
            cache,
            f"q{r}",
            "--job",
            "resumed",
            "--rank",
            str(r),
            "--world-size",
            str(world_after),
            "--resume",
            json.dumps(state),
        )
        for r in range(world_after)
    ]
    after = [samples_of(c.wait()) for c in second]
    delivered = Counter((s["url"], s["key"]) for b in before for s in samples_of(b))
    assert all(n == 1 for n in delivered.values())
    resumed = Counter((s["url"], s["key"]) for a in after for s in a)
    assert set(resumed) | set(delivered) == set(reference(data.paths, data.urls))  # nothing is missed
    remaining = 36 - 5 * world_before
    padding = -remaining % world_after  # wrapped repeats that even out the last row
    assert sum(resumed.values()) == remaining + padding
    repeats = sum(resumed.values()) - len(set(resumed) - set(delivered))
    assert repeats == padding  # every remaining sample once; only the padding repeats
    assert len({len(a) for a in after}) == 1  # equal counts


@pytest.mark.slow
def test_killed_consumer_does_not_disturb_other_job(tmp_path, dataset, start_agent, consumers):
    data = dataset(6, samples=8, payload=2000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "6")
    victim = consumers(cache, "victim", "--job", "v", "--sleep", "0.2")
    wait_for(
        lambda: victim.out.exists() and victim.out.read_text().count("\n") >= 2,
        30,
        "victim consumer never started reading",
    )
    victim.kill()
    survivor = consumers(cache, "survivor", "--job", "s")
    got = samples_of(survivor.wait())
    assert len(got) == 48
    assert agent.running()


def test_absent_agent_is_a_clear_error_not_a_hang(tmp_path):
    cache = tmp_path / "nothing"
    cache.mkdir()
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(CONSUMER), "--cache-dir", str(cache), "--out", str(tmp_path / "o"), "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "no wdscache agent answered" in proc.stderr
    assert "wdscache agent --cache-dir" in proc.stderr
    assert time.monotonic() - t0 < 30


def test_webdataset_decoder_on_delivered_samples(tmp_path, dataset, start_agent):
    from wdscache import CachedMultiLoader

    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "2")
    loader = CachedMultiLoader(cache_dir=cache, job="dec", rank=0, world_size=1, timeout=20)
    decoded = [wds.autodecode.Decoder([])(s) for s in loader]
    assert len(decoded) == 8
    assert all(isinstance(s["cls"], int) and isinstance(s["json"], (dict, list)) for s in decoded)


@pytest.mark.slow
def test_loader_without_agent_starts_a_private_one_and_stops_it(tmp_path, dataset):
    from wdscache import CachedMultiLoader, collect_stats

    data = dataset(3, samples=4, payload=500)
    cache = tmp_path / "cache"
    with CachedMultiLoader(data.urls, cache_dir=cache, job="nb", rank=0, world_size=1, timeout=30) as loader:
        keys = sorted((s["__url__"], s["__key__"]) for s in loader)
        agent_pid = loader._private_agent.proc.pid
        assert collect_stats(cache)["agent"]["pid"] == agent_pid
    assert keys == sorted(reference(data.paths, data.urls))
    wait_for(lambda: collect_stats(cache)["agent"] is None, 15, "the private agent kept running after close()")
    assert collect_stats(cache)["shards"]["cached"] == 3  # the cache stays for the next run


def test_lists_too_big_for_one_message_travel_in_pages(tmp_path, dataset, start_agent):
    from wdscache.shared.client import AgentConnection
    from wdscache.shared.urls import read_url_list
    from wdscache.training.loader import CachedMultiLoader

    data = dataset(2, samples=2, payload=100)
    many = [f"http://127.0.0.1:9/never-{i:06d}.tar" for i in range(40_000)]  # 1.5 MB: over one message
    big = tmp_path / "lists" / "big.txt"
    big.write_text("\n".join(data.urls + many) + "\n")
    cache = tmp_path / "cache"
    start_agent(cache, big, "--no-shuffle", "--prefetch", "2")
    for urls in (None, data.urls + many[::-1]):  # the agent's list, and a consumer's own
        loader = CachedMultiLoader(urls, cache_dir=cache, job="big", rank=0, world_size=1, timeout=20)
        conn = AgentConnection(loader.endpoint, timeout=20, cache_dir=cache)
        try:
            hello, got = loader._session(conn, "pages")
        finally:
            conn.close()
        assert hello["ok"]
        assert list(got) == (list(read_url_list(big).urls) if urls is None else data.urls + many[::-1])


@pytest.mark.slow
def test_elastic_restart_with_another_world_size_is_accepted_once_old_ranks_are_gone(
    tmp_path, dataset, start_agent, consumers
):
    data = dataset(3, samples=10, payload=500)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "3")  # --reader-timeout stays 60 s
    old = consumers(cache, "old", "--job", "elastic", "--world-size", "2", "--sleep", "0.5")
    wait_for(lambda: agent.stats()["jobs"].get("elastic"), 30, "the first launch never reported")
    old.kill()
    time.sleep(6)  # past the liveness window (5 s), far before the reader timeout
    new = consumers(cache, "new", "--job", "elastic", "--world-size", "1")
    assert len(samples_of(new.wait())) == 30


@pytest.mark.slow
def test_the_ranks_of_a_large_job_pin_cached_shards_several_an_open_and_hold_none_at_the_end(
    tmp_path, dataset, start_agent, monkeypatch
):
    # Eight ranks over twelve cached shards: each rank reads a few samples of every shard, so an
    # open pins the next shards too (those cached), and every pin is let go by the epoch's end.
    from wdscache import CachedMultiLoader
    from wdscache.shared.client import AgentConnection
    from wdscache.training.epoch_shards import OPEN_TOGETHER

    data = dataset(12, samples=16, payload=100)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "12")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 12, 30, "the 12 shards were not cached")
    opens = Counter()
    request = AgentConnection.request

    def counted(self, header, **kw):
        opens[header["op"]] += header["op"] == "open"
        return request(self, header, **kw)

    monkeypatch.setattr(AgentConnection, "request", counted)
    got = []
    for rank in range(8):
        before = opens["open"]
        with CachedMultiLoader(cache_dir=cache, job="big", rank=rank, world_size=8, shuffle=False, timeout=30) as ld:
            got += list(ld)
        # at most one open for each 1 + OPEN_TOGETHER shards (fewer where the rank's share skips some)
        assert opens["open"] - before <= -(-12 // (1 + OPEN_TOGETHER)), f"rank {rank}: {opens['open'] - before} opens"
        assert agent.stats()["agent"]["pinned"] == 0
    assert delivered(got) == reference(data.paths, data.urls)


def test_a_consumer_held_at_a_sample_holds_no_pin_it_let_go_of(tmp_path, dataset, start_agent):
    # Three small shards, one read: once it is answered every shard is let go, and the pins must
    # be given back before the sample is handed out, though no open follows to carry them: a
    # training loop may stay at that sample as long as it likes (a collective, a full queue).
    from wdscache import CachedMultiLoader

    data = dataset(3, samples=8, payload=100)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 30, "the 3 shards were not cached")
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        samples = iter(loader)
        first = next(samples)
        agent.wait_stats(lambda s: s["agent"]["pinned"] == 0, 10, "pins let go still held while the consumer waits")
        rest = list(samples)
    assert len(rest) == 23 and delivered([first, *rest]) == reference(data.paths, data.urls)
