"""Reading ``wdscache stats --watch`` on a pipe: its frames come a blank line apart."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

from scripts.console import wdscache_exe
from tests.helpers.waits import stop_process


def read_frames(proc: subprocess.Popen, n: int, timeout: float) -> str:
    """What ``proc`` printed once ``n`` frames are complete (fails the test after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    out = b""
    while out.count(b"\n\n") < n:
        left = deadline - time.monotonic()
        assert left > 0, f"fewer than {n} frames in {timeout:g}s: {out.decode()!r}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"stats --watch ended: {out.decode()!r} {proc.stderr.read().decode()!r}"
            out += chunk
    return out.decode()


def watch_frames(cache: Path, n: int, timeout: float) -> str:
    """What ``wdscache stats --watch`` on ``cache`` printed once ``n`` frames are complete; it
    is then stopped with Ctrl-C, and must exit 0."""
    proc = subprocess.Popen(
        [wdscache_exe(), "stats", "--cache-dir", cache, "--watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        text = read_frames(proc, n, timeout)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0, proc.stderr.read()
    finally:
        stop_process(proc)
    return text
