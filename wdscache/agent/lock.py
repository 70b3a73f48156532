"""One agent per cache directory.

The lock is an ``flock`` on ``agent.lock``. The kernel drops it when the holding
process dies, however it dies, so a lock left by a killed agent never blocks the
next one. The file also holds the pid, to name the running agent in errors.
Worker processes are fresh interpreters that inherit no descriptor of the
agent's but their standard streams and ready pipe, never the lock's, so a
lingering worker cannot keep the lock either.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..shared.errors import AgentRunningError


class AgentLock:
    """Holds ``path`` exclusively for the life of this process (or until released)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = read_pid(self.path)
            os.close(fd)
            raise AgentRunningError(str(self.path.parent), pid) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "AgentLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_pid(path: Path) -> int | None:
    """The pid written in a lock file, if any."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
