"""Every wait of a consumer is bounded by its ``timeout`` without progress, and ends with
the reason the agent gives; a shard a consumer waits for never queues behind prefetches."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest
import zmq

from tests.helpers.streaming import wait_exit
from tests.helpers.waits import wait_for
from wdscache import CachedMultiLoader, FetchError, ShardClient
from wdscache.shared.client import AgentConnection
from wdscache.shared.plan import shard_order
from wdscache.shared.protocol import PROTOCOL, agent_key, client_key, pack, proof, reply_proof, unpack


@pytest.mark.slow
def test_a_download_that_stops_moving_ends_the_wait_after_timeout_naming_the_shard(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(1, samples=40, payload=20_000)  # about 800 KB
    shard_server.fail(ds.paths[0].name, "stall", after=300_000, seconds=120)  # stuck, connection open
    cache = tmp_path / "cache"
    start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M", wait=True)
    # Unshuffled, so that samples come out as they arrive (a shuffle buffer waits for 100).
    loader = CachedMultiLoader(cache_dir=cache, job="j", rank=0, world_size=1, timeout=3, shuffle=False)
    got = []
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        for sample in loader:
            got.append(sample["__key__"])
    took = time.monotonic() - t0
    assert info.value.url == ds.urls[0]
    assert "no progress for 3s" in str(info.value) and "bytes" in str(info.value), info.value
    assert took < 3 + 6, f"the wait lasted {took:.1f}s with timeout=3"  # a bound on a hang, not a speed
    assert 0 < len(got) < 40  # what had arrived was delivered first


@pytest.mark.slow
def test_a_killed_agent_ends_a_consumer_within_its_timeout(shard_server, dataset, start_agent, consumers, tmp_path):
    ds = dataset(4, samples=50, payload=2000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "4")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 20, "the 4 shards were not cached")
    # Reads of 4 samples: the consumer needs its agent again soon, rather than holding all 200 in flight.
    c = consumers(cache, "slow", "--timeout", "4", "--sleep", "0.05", "--request-size", "4")
    wait_for(lambda: c.out.exists() and len(c.out.read_text().splitlines()) >= 5, 20, "the consumer got no samples")
    agent.stop(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        rc = c.proc.wait(4 + 5)  # the timeout, and a margin for the interpreter to exit
    except Exception:
        pytest.fail(
            f"the consumer still waited {time.monotonic() - t0:.0f}s after its agent died, "
            f"with timeout=4\n{c.log.read_text()[-2000:]}",
            pytrace=False,
        )
    assert rc != 0
    assert "no wdscache agent answered" in c.log.read_text(), c.log.read_text()[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_agent_stopped_while_a_consumer_waits_ends_it_naming_its_timeout(
    shard_server, dataset, start_agent, consumers, tmp_path, sig
):
    ds = dataset(1, samples=20, payload=2000)
    release = threading.Event()  # (set at the end: the stalled response ends with the test)
    shard_server.fail(ds.paths[0].name, "stall", seconds=120, until=release, times=3)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1")
    try:
        c = consumers(cache, "waiter", "--job", "waiter", "--timeout", "6")
        waiting = agent.wait_stats(
            lambda s: (s["agent"] or {}).get("demanded_by_job", {}).get("waiter", 0) == 1,
            20,
            "the consumer never waited for the stalled shard",
        )
        assert waiting["shards"]["cached"] == 0, waiting["shards"]
        # Some of its timeout gone before the agent stops: the request then unanswered waits only
        # what is left of it, a figure the error must not name in place of the timeout.
        since = time.monotonic()
        wait_for(lambda: time.monotonic() - since >= 2, 5, "a clock that does not move")
        agent.stop(sig)
        rc = wait_exit(c.proc, 6 + 10, "a consumer whose agent stopped")
    finally:
        release.set()
    text = c.log.read_text(errors="replace")
    last = text.strip().splitlines()[-1]
    assert rc != 0 and last.startswith("wdscache.AgentUnavailableError: "), text[-3000:]
    assert "within 6s;" in last and "the loader's timeout=6 " in last, last
    assert re.findall(r"\b\d+(?:\.\d+)?s\b", last) == ["6s"], last  # no other figure of seconds
    assert "died or restarted" in last and "a longer timeout=" in last, last
    # The cache directory, in how to start an agent there, or (SIGTERM: an agent stops within
    # seconds, abandoning its downloads) the agent still stopping there.
    assert f"at ipc://{cache}/agent.sock " in last and f" {cache} " in last, last


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_agent_stopped_while_a_mixture_is_counted_ends_it_naming_its_timeout(
    shard_server, dataset, start_agent, tmp_path, sig
):
    # A mixture counts the shards the agent has no count of before its epoch (a stream of their
    # own): an agent that stops then is reported as in the epoch, with the loader's timeout.
    a = dataset(1, samples=10, payload=200, prefix="a", list_name="a.txt")
    b = dataset(1, samples=10, payload=200, prefix="b", list_name="b.txt")
    release = threading.Event()  # (set at the end: the stalled response ends with the test)
    shard_server.fail(b.paths[0].name, "stall", seconds=120, until=release, times=3)
    cache = tmp_path / "cache"
    agent = start_agent(cache, a.list_file, "--prefetch", "1")
    loader = CachedMultiLoader(
        cache_dir=cache, job="mixer", mix={str(a.list_file): 1, str(b.list_file): 1}, epoch_samples=10, timeout=6
    )
    ended: list[BaseException] = []

    def read() -> None:
        try:
            list(loader)
        except BaseException as exc:  # (what the test asserts on)
            ended.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        agent.wait_stats(
            lambda s: (s["agent"] or {}).get("demanded_by_job", {}).get("mixer", 0) == 1,
            20,
            "the counting pass never waited for the stalled shard",
        )
        since = time.monotonic()  # some of the timeout gone: the unanswered request waits the rest
        wait_for(lambda: time.monotonic() - since >= 2, 5, "a clock that does not move")
        agent.stop(sig)
        reader.join(6 + 10)
    finally:
        release.set()
    assert not reader.is_alive() and len(ended) == 1, ended
    last = str(ended[0])
    assert type(ended[0]).__name__ == "AgentUnavailableError", repr(ended[0])
    assert "within 6s;" in last and "the loader's timeout=6 " in last, last
    assert re.findall(r"\b\d+(?:\.\d+)?s\b", last) == ["6s"], last  # no other figure of seconds
    assert "died or restarted" in last and "a longer timeout=" in last, last


@pytest.mark.slow
def test_a_consumer_that_waits_for_cache_space_gives_up_after_timeout_saying_so(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(3, samples=10, payload=40_000)  # ~400 KB each
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "900K")
    with ShardClient(cache, timeout=20, name="holder") as holder:
        for url in ds.urls[:2]:  # two pinned shards fill the budget: the third cannot come in
            holder.open(url)
        loader = CachedMultiLoader(ds.urls[2:], cache_dir=cache, job="j", rank=0, world_size=1, timeout=3)
        t0 = time.monotonic()
        with pytest.raises(FetchError) as info:
            list(loader)
        took = time.monotonic() - t0
    assert info.value.url == ds.urls[2]
    assert "no progress for 3s" in str(info.value) and "space" in str(info.value), info.value
    assert took < 3 + 6, f"the wait lasted {took:.1f}s with timeout=3"
    assert agent.running()


def test_a_reply_the_agent_marks_retry_is_asked_again_within_the_timeout(tmp_path):
    """The agent answers "retry" when its index could not be written for a moment (a full
    disk): the client asks again, and a later answer counts. (A peer that answers so on
    purpose stands in for the full disk, which the index's own tests make for real.)"""
    endpoint = f"ipc://{tmp_path}/retry.sock"
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.bind(endpoint)
    answers = iter(
        [{"ok": False, "retry": True, "error": "cannot write the index: disk full; try again shortly"}] * 3
        + [{"ok": True, "pong": 1}]
    )
    token, run = "t" * 32, "r" * 32
    asked = []

    def serve() -> None:
        while len(asked) < 4 and server.poll(5000):
            ident, *frames = server.recv_multipart()
            header, _ = unpack(frames)
            if header["op"] == "auth":  # the agent proves it holds the token first
                body = {"run": run, "endpoint": endpoint, "proof": proof(token, header["nonce"], run, endpoint)}
                body["protocol"] = PROTOCOL
            else:
                assert header["key"] == client_key(token, run)
                asked.append(header["op"])
                body = {**next(answers), "proof": reply_proof(agent_key(token, run), header["id"])}
            server.send_multipart([ident, *pack({"op": "reply", "id": header["id"], **body})])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    conn = AgentConnection(endpoint, timeout=5, token=token)
    try:
        reply = conn.request({"op": "ping"})
        assert reply["ok"] is True and reply["pong"] == 1, reply
    finally:
        conn.close()
        t.join(5)
        server.close(0)
        ctx.term()
    assert asked == ["ping"] * 4


def test_the_first_sample_of_another_order_does_not_wait_behind_prefetches(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(8, samples=20, payload=50_000)  # ~1 MB each
    shard_server.rate = 500_000  # 2 s a shard per connection
    cache = tmp_path / "cache"
    # Defaults: 4 download workers, prefetch 8, the start-up plan in seeded shuffle order.
    start_agent(cache, ds.list_file, "--cache-size", "100M")
    prefetched = {ds.paths[i].name for i in shard_order(8, seed=0, epoch=0, shuffle=True)[:4]}
    wait_for(
        lambda: {r.path for r in shard_server.requests if r.method == "GET"} >= prefetched,
        10,
        "the agent did not start its first four prefetches",
    )
    first = ds.paths[0].name  # an unshuffled reader reads shard 0 first
    assert first not in prefetched, "pick a dataset whose first shard is not prefetched first"
    loader = CachedMultiLoader(cache_dir=cache, job="other", rank=0, world_size=1, shuffle=False, timeout=30)
    it = iter(loader)
    sample = next(it)
    requests = shard_server.requests
    assert sample["__url__"] == ds.urls[0]
    sizes = {p.name: p.stat().st_size for p in ds.paths}
    done = [r.path for r in requests if r.method == "GET" and r.path in prefetched and r.bytes_sent >= sizes[r.path]]
    assert not done, f"the first sample came only after prefetches {done} were complete"
    assert any(r.path == first and r.method == "GET" for r in requests)
    del it
    loader.close()
