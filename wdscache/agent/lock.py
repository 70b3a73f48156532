"""One agent per cache directory.

The lock is an ``flock`` on ``agent.lock``. The kernel drops it when the holding
process dies, however it dies, so a lock left by a killed agent never blocks the
next one. A failed start removes the file it made (with the lock held): one that
took the lock meanwhile on the removed file sees so and locks the new one. The
file also holds the pid, to name the running agent in errors.
Worker processes are fresh interpreters that inherit no descriptor of the
agent's but their standard streams and ready pipe, never the lock's, so a
lingering worker cannot keep the lock either.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..shared.errors import AgentRunningError, ConfigError


class AgentLock:
    """Holds ``path`` exclusively for the life of this process (or until released)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise ConfigError(
                    f"cannot open the lock file {self.path}: {exc.strerror}; the cache directory must be writable"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = read_pid(self.path)
                os.close(fd)
                raise AgentRunningError(str(self.path.parent), pid) from None
            if _same_file(fd, self.path):
                break
            # Removed (a failed start undone) between our open and our lock: lock the file there now.
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> AgentLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def read_pid(path: Path) -> int | None:
    """The pid written in a lock file, if any."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
