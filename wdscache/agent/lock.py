"""One agent per cache directory.

The lock is an ``flock`` on ``agent.lock``. The kernel drops it when the holding
process dies, however it dies, so a lock left by a killed agent never blocks the
next one. A failed start removes the file it made (with the lock held): one that
took the lock meanwhile on the removed file sees so and locks the new one. The
file also holds the pid, to name the running agent in errors, and for ``wdscache stats`` to
tell whether the agent of agent.json runs (:meth:`CacheLayout.agent_holds_lock`). Stats takes
a shared lock for a moment to look, so a start that finds the lock held tries again for
:data:`LOOK_GRACE` before it says another agent runs.
A cleaner of old files may remove the lock file under the running agent: :meth:`AgentLock.holds`
tells (the agent stops once it finds so, :meth:`wdscache.agent.cache.ShardCache.lost`).
Worker processes are fresh interpreters that inherit no descriptor of the
agent's but their standard streams and ready pipe, never the lock's, so a
lingering worker cannot keep the lock either.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from ..shared.errors import AgentRunningError, ConfigError, WdsCacheError
from ..shared.layout import read_pid

LOOK_GRACE = 0.5  # seconds a start retries a held lock: a look by stats holds it a moment only
LOOK_RETRY = 0.01  # seconds between those tries


class AgentLock:
    """Holds ``path`` exclusively for the life of this process (or until released)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        deadline = time.monotonic() + LOOK_GRACE
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
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(LOOK_RETRY)
                    continue
                raise AgentRunningError(str(self.path.parent), read_pid(self.path)) from None
            if _same_file(fd, self.path):
                break
            # Removed (a failed start undone) between our open and our lock: lock the file there now.
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.fsync(fd)
        except OSError as exc:  # (a full disk, say: its pid is how others name the holder)
            os.close(fd)
            raise WdsCacheError(  # a state of the machine, not of the options: exit 1, as a full index's
                f"cannot write the lock file {self.path}: {exc.strerror}; free space on its file system"
            ) from None
        self._fd = fd

    def holds(self) -> bool:
        """Whether the file at :attr:`path` is still the one this process holds locked: a cleaner
        of old files that removed it lets another agent lock a new one there."""
        return self._fd is not None and _same_file(self._fd, self.path)

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:  # (its file system turned read-only) a pid left in a file nobody locks names no holder
                pass
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
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ESTALE):  # (its directory gone too, on NFS too)
            return False
        raise
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)
