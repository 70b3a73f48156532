"""``--endpoint ipc://PATH``: an agent takes a socket file only where no process listens, and removes
only the file it bound. Real agents through the CLI, real loaders."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.helpers.agents import AgentProc, kill_agent
from tests.helpers.procs import worker_pids
from tests.helpers.streaming import delivered, reference
from wdscache import CachedMultiLoader
from wdscache.agent.pool import worker_endpoints
from wdscache.shared.layout import CacheLayout

EXIT_TIMEOUT = 30.0  # seconds a refused agent gets to exit


def _path(endpoint: str) -> Path:
    assert endpoint.startswith("ipc://"), endpoint
    return Path(endpoint[len("ipc://") :])


def _file(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def _sockets(endpoint: str, workers: int = 1) -> list[Path]:
    """The socket files of an agent on ``endpoint`` and of its workers."""
    return [_path(ep) for ep in [endpoint, *worker_endpoints(endpoint, workers)]]


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(os.fspath(path))
        except ConnectionRefusedError:
            return False
    return True


def _exit_code(agent: AgentProc) -> int:
    try:
        return agent.proc.wait(EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agent did not exit within {EXIT_TIMEOUT:g}s\n{agent.stderr_tail()}", pytrace=False)


def _assert_serves(agent: AgentProc, ds, endpoint: str | None = None) -> None:
    """``agent`` answers stats and a loader of its cache directory (at ``endpoint``, if not its
    default) gets every sample, byte for byte, through its workers' sockets."""
    s = agent.stats()
    assert s["agent"]["pid"] == agent.pid and s["agent"]["answering"], s
    with CachedMultiLoader(
        cache_dir=agent.cache_dir, endpoint=endpoint, shuffle=False, direct_reads=False, timeout=30
    ) as loader:
        got = list(loader)
    assert delivered(got) == reference(ds.paths, ds.urls), agent.stderr_tail()


@pytest.mark.slow
@pytest.mark.parametrize("whose", ["agent", "worker"])
def test_an_agent_given_another_agents_socket_exits_2_naming_it_and_leaves_that_agent_serving(
    shard_server, dataset, start_agent, tmp_path, whose
):
    # It took the socket over (ZeroMQ unlinks what is there), and removed it as it stopped: the first
    # agent's loaders failed with NotTrustedError, then found nothing to connect to, and it logged nothing.
    ds = dataset(2)
    first = start_agent(tmp_path / "h1", ds.list_file)
    endpoint = CacheLayout.of(first.cache_dir).default_endpoint()
    files = {p: _file(p) for p in _sockets(endpoint)}
    taken = endpoint if whose == "agent" else worker_endpoints(endpoint, 1)[0]
    pid = first.pid if whose == "agent" else worker_pids(first.pid)[0]

    second = start_agent(tmp_path / "h2", ds.list_file, "--endpoint", taken, wait=False)
    rc = _exit_code(second)
    err = second.stderr_text()
    assert rc == 2, err
    assert f"wdscache: error: cannot listen on {taken}: process {pid} listens there already" in err, err
    assert "choose another --endpoint" in err and "Traceback" not in err, err

    assert {p: _file(p) for p in files} == files  # the first agent's very files, still there
    _assert_serves(first, ds)


@pytest.mark.slow
def test_a_socket_file_left_by_a_killed_agent_at_an_explicit_endpoint_is_replaced(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(2)
    endpoint = f"ipc://{tmp_path}/s/a.sock"
    (tmp_path / "s").mkdir()
    cache = tmp_path / "cache"
    first = start_agent(cache, ds.list_file, "--endpoint", endpoint)
    kill_agent(first)
    left = _sockets(endpoint)
    assert all(p.is_socket() and not _listening(p) for p in left), "no stale socket files to test with"

    second = start_agent(cache, ds.list_file, "--endpoint", endpoint)
    _assert_serves(second, ds, endpoint)
    assert second.stop() == 0, second.stderr_tail()
    assert not any(p.exists() for p in left)  # its own files, removed as it stopped


@pytest.mark.slow
def test_an_agent_removes_only_its_own_socket_files_as_it_stops(shard_server, dataset, start_agent, tmp_path):
    # Its files removed (rm) while it ran, and bound again by another agent: it removed that one's.
    ds = dataset(2)
    endpoint = f"ipc://{tmp_path}/s/a.sock"
    (tmp_path / "s").mkdir()
    first = start_agent(tmp_path / "h1", ds.list_file, "--endpoint", endpoint)
    for p in _sockets(endpoint):
        p.unlink()
    second = start_agent(tmp_path / "h2", ds.list_file, "--endpoint", endpoint)
    files = {p: _file(p) for p in _sockets(endpoint)}

    assert first.stop() == 0, first.stderr_tail()
    assert {p: _file(p) for p in files} == files
    _assert_serves(second, ds, endpoint)


def test_a_file_that_is_not_a_socket_at_the_endpoint_is_refused_and_kept(dataset, run_cli, tmp_path):
    ds = dataset(1)
    kept = tmp_path / "notes.sock"
    kept.write_text("mine\n")
    endpoint = f"ipc://{kept}"
    r = run_cli("agent", "--cache-dir", tmp_path / "cache", "--urls", ds.list_file, "--endpoint", endpoint, timeout=30)
    assert r.returncode == 2, r.stderr
    assert f"wdscache: error: cannot listen on {endpoint}: a file that is not a socket is there" in r.stderr, r.stderr
    assert kept.read_text() == "mine\n"


def test_an_abstract_socket_endpoint_is_refused_naming_it(dataset, run_cli, tmp_path):
    # Python's bind() would make a file "@NAME" in the folder the agent runs in, which ZeroMQ's
    # clients never look at (they connect to the abstract name): an agent nobody reaches.
    endpoint = "ipc://@wdscache-test"
    r = run_cli(
        "agent", "--cache-dir", tmp_path / "cache", "--urls", dataset(1).list_file, "--endpoint", endpoint, timeout=30
    )
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on {endpoint}: an abstract socket (ipc://@NAME) is not supported" in r.stderr, r.stderr
