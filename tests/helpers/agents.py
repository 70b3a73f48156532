"""Agents and the CLI as real processes (the installed ``wdscache`` console script), and the datasets they cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts.console import wdscache_exe
from tests.helpers.procs import worker_pids
from tests.helpers.waits import STOP_TIMEOUT, TAIL_LINES, stop_process, tail, wait_for
from wdscache.shared.config import default, parse_size
from wdscache.shared.errors import WdsCacheError
from wdscache.shared.redact import redacted
from wdscache.shared.stats import ANSWER_TIMEOUT, collect

START_TIMEOUT = 20.0  # seconds an agent gets to answer stats after it was started
CLI_TIMEOUT = 30.0
# The Range of a shard's first GET: its first part (--download-part-size), which covers a small shard whole.
FIRST_PART = f"bytes=0-{parse_size(default('download_part_size')) - 1}"


def run_wdscache(
    *args: str | os.PathLike[str], timeout: float = CLI_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion (bounded by ``timeout``) and capture its output."""
    cmd = [wdscache_exe(), *map(os.fspath, args)]
    try:
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # run() has killed and reaped it
        pytest.fail(
            f"{' '.join(cmd)} did not finish within {timeout:g}s; stderr tail:\n{tail(_text(exc.stderr))}",
            pytrace=False,
        )


def stats_json(cache_dir: Path, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    """What ``wdscache stats --cache-dir DIR --json`` prints, parsed: the command's own collection
    and redaction, asked from this process. Tests poll stats thousands of times, and an interpreter
    started for each poll (about 0.2 s of CPU) would take a core from the agents they wait on; the
    command itself is tested where its output is the point (tests/test_ops_stats.py)."""
    return json.loads(json.dumps(redacted(collect(cache_dir, timeout=timeout))))


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


@dataclass
class Dataset:
    urls: list[str]
    paths: list[Path]
    list_file: Path

    def source_of(self, url: str) -> Path:
        return self.paths[self.urls.index(url)]

    def __iter__(self):  # urls, paths, list_file = dataset(3)
        return iter((self.urls, self.paths, self.list_file))


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

    def stats(self, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
        """What ``wdscache stats --cache-dir DIR --json`` prints (:func:`stats_json`); fails the test if
        there is none."""
        try:
            return stats_json(self.cache_dir, timeout)
        except WdsCacheError as exc:
            pytest.fail(f"wdscache stats: {exc}\n{self.stderr_tail()}", pytrace=False)

    def try_stats(self, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any] | None:
        try:
            return stats_json(self.cache_dir, timeout)
        except WdsCacheError:
            return None

    def wait_up(self, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        """Wait until the agent answers stats itself; fail at once if it exits."""

        def up() -> dict[str, Any] | None:
            if not self.running():
                pytest.fail(
                    f"agent exited with {self.proc.returncode} before it was up\n{self.stderr_tail()}",
                    pytrace=False,
                )
            s = self.try_stats()
            agent = (s or {}).get("agent") or {}
            return s if agent.get("pid") == self.pid and agent.get("answering") else None

        return wait_for(up, timeout, lambda: f"agent never answered stats\n{self.stderr_tail()}", interval=0.1)

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
            check,
            timeout,
            lambda: f"{what}; last stats: {json.dumps(last[0])}\n{self.stderr_tail()}",
            interval=0.1,
        )


def kill_agent(agent: Any) -> None:
    """SIGKILL the agent, and wait until its workers are gone too (they watch it)."""
    workers = worker_pids(agent.pid)
    agent.proc.send_signal(signal.SIGKILL)
    assert agent.proc.wait(10) == -signal.SIGKILL
    wait_for(
        lambda: not any(os.path.exists(f"/proc/{w}") for w in workers),
        10,
        lambda: f"the killed agent's workers still alive: {workers}",
    )
