"""Bounded waits: every wait in a test has a deadline, and a hang is a failure with a message."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

STOP_TIMEOUT = 10.0  # seconds a process gets to exit after SIGTERM before SIGKILL
TAIL_LINES = 40


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def json_lines(text: str) -> list[Any]:
    """The JSON records of a log written one a line, read as it is written: only its whole lines
    (it may end in part of one)."""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


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


def read_terminal(primary: int, proc: subprocess.Popen, timeout: float) -> bytes:
    """What ``proc`` wrote to the pseudo-terminal whose primary side is ``primary``, read until the other side
    closes (or ``proc`` has exited and nothing more comes); fails the test after ``timeout``."""
    out, deadline = b"", time.monotonic() + timeout
    while True:
        if time.monotonic() >= deadline:
            pytest.fail(f"the terminal's output did not end within {timeout:g}s: {out[-2000:]!r}", pytrace=False)
        if not select.select([primary], [], [], 0.5)[0]:
            if proc.poll() is not None:
                return out
            continue
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the terminal's other side closed
            return out
        if not chunk:
            return out
        out += chunk
