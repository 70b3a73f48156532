"""Reading ``wdscache stats --watch`` on a pipe: its frames come a blank line apart."""

from __future__ import annotations

import os
import select
import subprocess
import time


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
