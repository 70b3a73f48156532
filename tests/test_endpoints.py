"""``--endpoint`` as a user gives it: consumers given only the cache directory find an agent on a
TCP port (or an IPC socket of its own) through agent.json; an IPv6 loopback address works; a
relative socket path is made absolute; a TCP port in use is refused before the slow steps of a
start. Real agents through the CLI, real loaders, clients and cache commands."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.helpers.agents import AgentProc
from tests.helpers.net import free_port_range
from tests.helpers.streaming import delivered, reference
from wdscache import AgentUnavailableError, CachedMultiLoader, ShardClient, ShardListDataset
from wdscache.shared.client import RUN_CHECK
from wdscache.shared.layout import CacheLayout

TIMEOUT = 10.0  # seconds a consumer waits for the agent (on the code before: its whole wait, then an error)


@pytest.fixture(autouse=True)
def _no_endpoint_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WDSCACHE_ENDPOINT", raising=False)
    monkeypatch.delenv("WDSCACHE_CACHE_DIR", raising=False)


def _sha(data: bytes | io.BytesIO) -> str:
    """The SHA-256 of a payload (a ShardListDataset's, left undecoded, is a BytesIO)."""
    return hashlib.sha256(data.getvalue() if isinstance(data, io.BytesIO) else data).hexdigest()


def _assert_consumers_find(agent: AgentProc, ds) -> None:
    """A loader, a ShardClient and a ShardListDataset given only ``agent``'s cache directory get
    every sample (every shard's bytes) of ``ds`` from it."""
    with CachedMultiLoader(cache_dir=agent.cache_dir, shuffle=False, timeout=TIMEOUT) as loader:
        assert delivered(list(loader)) == reference(ds.paths, ds.urls), agent.stderr_tail()
    with ShardClient(agent.cache_dir, timeout=TIMEOUT) as client:
        path = client.open(ds.urls[0])
        assert path.read_bytes() == ds.paths[0].read_bytes()
        client.release(ds.urls[0])
    want = reference(ds.paths, ds.urls)
    shards = [{"url": url, "nsamples": sum(1 for u, _ in want if u == url)} for url in ds.urls]
    with ShardListDataset(shards, cache_dir=agent.cache_dir, transformations=[], timeout=TIMEOUT) as sds:
        got = {}
        for i in range(len(sds)):
            sample = sds[i]
            fields = {k.lstrip("."): _sha(v) for k, v in sample.items() if not k.startswith("__")}
            got[(sample["__shard__"], sample["__key__"])] = fields
    assert got == want


@pytest.mark.slow
def test_consumers_given_only_the_cache_dir_find_an_agent_on_a_tcp_port(dataset, start_agent, tmp_path):
    # They waited their whole timeout at the directory's own socket, then said to start an agent,
    # which failed: one ran there already (the cache commands found it through agent.json).
    ds = dataset(2)
    endpoint = f"tcp://127.0.0.1:{free_port_range(2)}"
    agent = start_agent(tmp_path / "cache", ds.list_file, "--endpoint", endpoint)
    _assert_consumers_find(agent, ds)


@pytest.mark.slow
def test_a_consumer_at_another_endpoint_is_told_where_the_agent_listens(dataset, start_agent, tmp_path):
    ds = dataset(1)
    endpoint = f"tcp://127.0.0.1:{free_port_range(2)}"
    agent = start_agent(tmp_path / "cache", ds.list_file, "--endpoint", endpoint)
    elsewhere = CacheLayout.of(agent.cache_dir).default_endpoint()
    loader = CachedMultiLoader(cache_dir=agent.cache_dir, endpoint=elsewhere, timeout=1)
    with pytest.raises(AgentUnavailableError) as raised:
        list(loader)
    says = str(raised.value)
    assert f"the agent (pid {agent.pid}) on {agent.cache_dir} listens on {endpoint}, not on {elsewhere}" in says
    assert "start one" not in says
    # Stopped (as a busy agent is silent), it is named as running, not to be started again.
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        with pytest.raises(AgentUnavailableError) as raised:
            list(CachedMultiLoader(cache_dir=agent.cache_dir, timeout=1))
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    says = str(raised.value)
    assert f"no wdscache agent answered at {endpoint} within 1s; the agent (pid {agent.pid}) on " in says
    assert "runs there but did not answer: it may be busy" in says and "start one" not in says


@pytest.mark.slow
def test_a_client_given_only_the_cache_dir_follows_its_agent_restarted_on_another_endpoint(
    dataset, start_agent, tmp_path
):
    # It stayed on the endpoint it found first: every request went unanswered for its whole
    # timeout, and the error said "give endpoint=... or neither" to a client that gave neither.
    ds = dataset(3)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--endpoint", f"tcp://127.0.0.1:{free_port_range(2)}")
    client = ShardClient(cache, timeout=TIMEOUT)
    try:
        assert client.open(ds.urls[0]).read_bytes() == ds.paths[0].read_bytes()
        agent.stop(signal.SIGINT)
        moved = f"tcp://127.0.0.1:{free_port_range(2)}"
        agent = start_agent(cache, ds.list_file, "--endpoint", moved)
        # A request too short to look where the agent went (a look every RUN_CHECK) is told where...
        with pytest.raises(AgentUnavailableError) as raised:
            client.stats(timeout=RUN_CHECK / 2)
        says = str(raised.value)
        assert f"the agent (pid {agent.pid}) on {cache} listens on {moved} now" in says
        assert "give endpoint=" not in says
        # ...and the next goes there, once the client has pinned its shard again on the new agent.
        stats = client.stats(timeout=TIMEOUT)
        assert (stats["agent"]["pid"], stats["agent"]["pinned"]) == (agent.pid, 1)
        # A request sent to the endpoint the agent left follows it within a look or two, not at its
        # timeout: a short one, and an open (which waits patiently, probing) of a client holding none.
        other = ShardClient(cache, timeout=TIMEOUT)
        try:
            assert other.stats()["agent"]["pid"] == agent.pid
            agent.stop(signal.SIGINT)
            agent = start_agent(cache, ds.list_file, "--endpoint", f"tcp://127.0.0.1:{free_port_range(2)}")
            began = time.monotonic()
            assert other.open(ds.urls[1]).read_bytes() == ds.paths[1].read_bytes()
            assert client.stats(timeout=TIMEOUT)["agent"]["pid"] == agent.pid
            assert time.monotonic() - began < TIMEOUT / 2
            assert agent.stats()["agent"]["pinned"] == 2  # (the client's shard pinned again)
        finally:
            other.close()
    finally:
        client.close()
    assert agent.stats()["agent"]["pinned"] == 0


@pytest.mark.slow
def test_an_agent_on_an_ipv6_loopback_address_serves(dataset, start_agent, tmp_path):
    # It exited 2: "cannot listen on tcp://[::1]:PORT for a sample worker (No such device)".
    ds = dataset(2)
    endpoint = f"tcp://[::1]:{free_port_range(2, ('127.0.0.1', '::1'))}"
    agent = start_agent(tmp_path / "cache", ds.list_file, "--endpoint", endpoint)
    assert agent.stats()["agent"]["endpoint"] == endpoint
    _assert_consumers_find(agent, ds)


@pytest.mark.slow
def test_a_relative_socket_path_is_the_agents_working_directorys(dataset, start_agent, tmp_path, monkeypatch):
    # Stored as given, it named a socket in each reader's own working directory: 'wdscache stats'
    # from another one said "running but not answering, endpoint ipc://rel.sock".
    ds = dataset(1)
    (tmp_path / "there").mkdir()
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    agent = start_agent(tmp_path / "cache", ds.list_file, "--endpoint", "ipc://rel.sock", cwd=tmp_path / "there")
    assert agent.stats()["agent"]["endpoint"] == f"ipc://{tmp_path / 'there' / 'rel.sock'}"
    with CachedMultiLoader(cache_dir=agent.cache_dir, shuffle=False, timeout=TIMEOUT) as loader:
        assert delivered(list(loader)) == reference(ds.paths, ds.urls), agent.stderr_tail()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_an_endpoint_that_cannot_be_bound_is_refused_before_the_sizes_are_asked(run_cli, tmp_path: Path, transport):
    # It was found only as the control socket bound, after the start-up window's sizes were asked
    # (up to the connect and read timeouts, 70 s), a TCP port in use with advice for a folder ("let
    # the agent write to its folder"). Here the source accepts connections and never answers: a
    # HEAD waits its --read-timeout.
    with socket.socket() as taken, socket.socket() as silent:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        urls = tmp_path / "lists" / "urls.txt"
        urls.parent.mkdir()
        urls.write_text(f"http://127.0.0.1:{silent.getsockname()[1]}/shard-0.tar\n")
        if transport == "tcp":
            endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
            says = (
                f"cannot listen on {endpoint} (Address already in use): choose another --endpoint: "
                "a port no other process listens on, at an address of this machine"
            )
        else:
            endpoint = f"ipc://{tmp_path}/none/agent.sock"
            says = (
                f"cannot listen on {endpoint} (No such file or directory): choose another --endpoint, "
                "or let the agent write to its folder"
            )
        r = run_cli(
            "agent",
            "--cache-dir",
            tmp_path / "cache",
            "--urls",
            urls,
            "--endpoint",
            endpoint,
            "--min-free",
            "1M",
            "--workers",
            "1",
            "--read-timeout",
            "60",
            timeout=30,
        )
    assert r.returncode == 2, r.stderr
    assert f"wdscache: error: {says}\n" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "cache").exists()
