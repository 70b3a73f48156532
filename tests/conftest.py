"""Fixtures for the agent's integration tests: a real shard server, real shards, real agents.

Nothing here is mocked.  Agents run as separate processes started through the
installed ``wdscache`` console script, talk HTTP to a :class:`ShardServer` on
127.0.0.1, and are stopped (SIGTERM, then SIGKILL) and reaped by the fixtures
whatever the test did.  Every wait is bounded: a hang is a failure with a
message, never a stuck suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from server import ShardServer
    from shards import make_dataset, write_url_list
except ImportError:  # tests/ became a package
    from tests.server import ShardServer
    from tests.shards import make_dataset, write_url_list

STOP_TIMEOUT = 10.0  # seconds an agent gets to exit after SIGTERM before SIGKILL
START_TIMEOUT = 20.0  # seconds an agent gets to answer stats after it was started
CLI_TIMEOUT = 30.0
TAIL_LINES = 40


# -- helpers ---------------------------------------------------------------------


def wdscache_exe() -> str:
    """The ``wdscache`` console script of the interpreter running the tests."""
    exe = Path(sys.executable).with_name("wdscache")
    if exe.is_file() and os.access(exe, os.X_OK):
        return str(exe)
    found = shutil.which("wdscache")
    if found is None:
        raise RuntimeError(
            f"no wdscache console script next to {sys.executable} or on PATH; "
            "install the package (pip install -e .)"
        )
    return found


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    message: str | Callable[[], str],
    *,
    interval: float = 0.05,
) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or fail after ``timeout``.

    ``message`` (or its result, if callable) is the failure message; build it
    lazily to include state that is only known at the deadline (a log tail).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            pytest.fail(f"timed out after {timeout:g}s: {text}", pytrace=False)
        time.sleep(interval)


def run_wdscache(*args: str | os.PathLike[str], timeout: float = CLI_TIMEOUT,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion (bounded by ``timeout``) and capture its output."""
    cmd = [wdscache_exe(), *map(os.fspath, args)]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env,
            stdin=subprocess.DEVNULL, check=False,
        )
    except subprocess.TimeoutExpired as exc:  # run() has killed and reaped it
        pytest.fail(
            f"{' '.join(cmd)} did not finish within {timeout:g}s; stderr tail:\n"
            f"{tail(_text(exc.stderr))}",
            pytrace=False,
        )


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> tuple[int, bool]:
    """Signal ``proc``, wait up to ``timeout``, then SIGKILL; returns (returncode, killed)."""
    if proc.poll() is not None:
        return proc.returncode, False
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout), False
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10), True


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


@dataclass
class Dataset:
    urls: list[str]
    paths: list[Path]
    list_file: Path

    def source_of(self, url: str) -> Path:
        return self.paths[self.urls.index(url)]

    def __iter__(self):  # urls, paths, list_file = dataset(3)
        return iter((self.urls, self.paths, self.list_file))


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
        paths = make_dataset(
            shard_server.root, n, samples, payload=payload, tool=tool, prefix=prefix, seed=seed
        )
        urls = [shard_server.url(p.name) for p in paths]
        list_file = write_url_list(tmp_path / "lists" / list_name, urls)
        return Dataset(urls, paths, list_file)

    return make


# -- agents ----------------------------------------------------------------------------


class AgentProc:
    """A ``wdscache agent`` process with its stderr in a file."""

    def __init__(self, proc: subprocess.Popen, cache_dir: Path, log_path: Path, args: list[str]) -> None:
        self.proc = proc
        self.cache_dir = cache_dir
        self.log_path = log_path
        self.args = args
        self.killed = False  # True when stop() had to SIGKILL after the timeout

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stderr_tail(self, lines: int = TAIL_LINES) -> str:
        return f"--- agent {self.pid} stderr (tail) ---\n{tail(self.stderr_text(), lines)}"

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Send ``sig``, wait ``timeout`` s (then SIGKILL); the return code."""
        rc, killed = stop_process(self.proc, sig, timeout)
        self.killed = self.killed or killed
        return rc

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """``wdscache stats --cache-dir DIR --json``, parsed; fails the test if it does not answer."""
        r = run_wdscache("stats", "--cache-dir", self.cache_dir, "--json", timeout=timeout)
        if r.returncode != 0:
            pytest.fail(
                f"wdscache stats exited {r.returncode}: {r.stderr.strip()}\n{self.stderr_tail()}",
                pytrace=False,
            )
        return json.loads(r.stdout)

    def try_stats(self, timeout: float = 10.0) -> dict[str, Any] | None:
        r = run_wdscache("stats", "--cache-dir", self.cache_dir, "--json", timeout=timeout)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def wait_up(self, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        """Wait until the agent answers stats itself; fail at once if it exits."""

        def up() -> dict[str, Any] | None:
            if not self.running():
                pytest.fail(
                    f"agent exited with {self.proc.returncode} before it was up\n{self.stderr_tail()}",
                    pytrace=False,
                )
            s = self.try_stats()
            return s if s is not None and s.get("agent") and s["agent"].get("pid") == self.pid else None

        return wait_for(up, timeout, lambda: f"agent never answered stats\n{self.stderr_tail()}",
                        interval=0.1)

    def wait_stats(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """Poll stats until ``predicate(stats)``; the message names ``what`` and the last stats."""
        last: list[dict[str, Any] | None] = [None]

        def check() -> dict[str, Any] | None:
            if not self.running():
                pytest.fail(
                    f"agent exited with {self.proc.returncode} while waiting for {what}\n{self.stderr_tail()}",
                    pytrace=False,
                )
            s = last[0] = self.try_stats()
            return s if s is not None and predicate(s) else None

        return wait_for(
            check, timeout,
            lambda: f"{what}; last stats: {json.dumps(last[0])}\n{self.stderr_tail()}",
            interval=0.1,
        )


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    """Factory ``start_agent(cache_dir, urls_file, *extra_args, env=None, wait=True, cwd=None) -> AgentProc``.

    Runs ``wdscache agent --cache-dir DIR --urls FILE --min-free 1M --workers 1 -v EXTRA...``
    (later options win, so EXTRA may override the defaults) with stderr in
    ``tmp_path/agent-N.log``; with ``wait`` it returns once stats shows the agent.
    Every agent started is stopped and reaped at teardown.
    """
    started: list[AgentProc] = []

    def start(cache_dir: str | os.PathLike[str], urls_file: str | os.PathLike[str], *extra: str,
              env: dict[str, str] | None = None, wait: bool = True,
              cwd: str | os.PathLike[str] | None = None) -> AgentProc:
        n = len(started)
        log_path = tmp_path / f"agent-{n}.log"
        args = [
            wdscache_exe(), "agent", "--cache-dir", os.fspath(cache_dir), "--urls", os.fspath(urls_file),
            "--min-free", "1M", "--workers", "1", "-v", *extra,
        ]
        full_env = dict(os.environ)
        full_env.update(env or {})
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=full_env,
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
    from streaming import Consumer

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
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=20).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)
