"""Fixtures for the agent's integration tests: a real shard server, real shards, real agents.

Nothing here is mocked.  Agents run as separate processes started through the
installed ``wdscache`` console script, talk HTTP to a :class:`ShardServer` on
127.0.0.1, and are stopped (SIGTERM, then SIGKILL) and reaped by the fixtures
whatever the test did.  Every wait is bounded: a hang is a failure with a
message, never a stuck suite.  The helpers the fixtures are built on are in
:mod:`tests.helpers` (tests import them from there, never from this file).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.shard_maker import make_dataset, write_url_list
from scripts.shard_server import ShardServer
from tests.helpers.agents import AgentProc, Dataset, run_wdscache, wdscache_exe
from tests.helpers.streaming import Consumer

# -- the shard server and datasets ---------------------------------------------------


@pytest.fixture
def shard_server(tmp_path: Path) -> Iterator[ShardServer]:
    """A started :class:`ShardServer` serving ``tmp_path/srv``; stopped at teardown."""
    server = ShardServer(tmp_path / "srv")
    (tmp_path / "srv").mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def dataset(shard_server: ShardServer, tmp_path: Path) -> Callable[..., Dataset]:
    """Factory: ``dataset(n, samples=.., payload=.., tool=.., prefix=..)`` -> :class:`Dataset`.

    Shards are written into the server's root and listed, by their HTTP URLs,
    in ``tmp_path/lists/<list_name>`` (a folder of its own, as the agent watches it).
    """

    def make(
        n: int,
        *,
        samples: int = 10,
        payload: int = 2000,
        tool: str = "tarfile",
        prefix: str = "shard",
        list_name: str = "urls.txt",
        seed: int = 0,
    ) -> Dataset:
        paths = make_dataset(shard_server.root, n, samples, payload=payload, tool=tool, prefix=prefix, seed=seed)
        urls = [shard_server.url(p.name) for p in paths]
        list_file = write_url_list(tmp_path / "lists" / list_name, urls)
        return Dataset(urls, paths, list_file)

    return make


# -- agents ----------------------------------------------------------------------------


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    """Factory ``start_agent(cache_dir, urls_file, *extra_args, env=None, wait=True, cwd=None, exe=None) -> AgentProc``.

    Runs ``wdscache agent --cache-dir DIR --urls FILE --min-free 1M --workers 1 -v EXTRA...``
    (later options win, so EXTRA may override the defaults) with stderr in
    ``tmp_path/agent-N.log``; with ``wait`` it returns once stats shows the agent. ``exe``: the
    command run in place of ``wdscache`` (a wrapper that runs the CLI, as tests/helpers/clock_shift.py).
    Every agent started is stopped and reaped at teardown.
    """
    started: list[AgentProc] = []

    def start(
        cache_dir: str | os.PathLike[str],
        urls_file: str | os.PathLike[str],
        *extra: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
        cwd: str | os.PathLike[str] | None = None,
        exe: list[str] | None = None,
    ) -> AgentProc:
        n = len(started)
        log_path = tmp_path / f"agent-{n}.log"
        args = [
            *(exe or [wdscache_exe()]),
            "agent",
            "--cache-dir",
            os.fspath(cache_dir),
            "--urls",
            os.fspath(urls_file),
            "--min-free",
            "1M",
            "--workers",
            "1",
            "-v",
            *extra,
        ]
        full_env = dict(os.environ)
        full_env.update(env or {})
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
            )
        agent = AgentProc(proc, Path(cache_dir), log_path, args)
        started.append(agent)
        if wait:
            agent.wait_up()
        return agent

    yield start
    for agent in started:
        agent.stop()


@pytest.fixture
def agent(start_agent: Callable[..., AgentProc]) -> Callable[..., AgentProc]:
    """Alias of :func:`start_agent` (the factory named as in the test plan)."""
    return start_agent


@pytest.fixture
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_cli(*args, timeout=30, env=None) -> CompletedProcess`` of the ``wdscache`` command."""
    return run_wdscache


@pytest.fixture
def consumers(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory ``consumers(cache_dir, name, *consumer_args) -> streaming.Consumer``; all killed at teardown."""
    started: list[Consumer] = []

    def start(cache_dir: Path, name: str, *args: str) -> Consumer:
        c = Consumer(tmp_path, cache_dir, name, *args)
        started.append(c)
        return c

    yield start
    for c in started:
        if c.proc.poll() is None:
            c.kill()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Factory ``tmpfs("40m") -> Path``: a tmpfs of that size (mode 0700); all unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=20).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)
