"""The ``ipc://`` socket files of the agent and its sample workers: bound only where no process
listens, removed only while still the file bound.

An ``--endpoint ipc://PATH`` may name any file, another agent's socket (or its workers') included:
the cache directory's lock guards only the default socket, the one inside that directory. So:

- A path where a process accepts a connection is refused (:class:`ConfigError` naming the endpoint,
  and the process where the system tells it); so are a file that is not a socket and a socket this
  user may not connect to. A socket file nobody listens on (its process was killed) is replaced.
- The socket is bound here, by ``bind(2)``, which fails on any file at the path, and handed to
  ZeroMQ as a listening descriptor (``ZMQ_USE_FD``): ZeroMQ's own bind would first unlink
  whatever is there, a live socket included.
- :meth:`BoundFile.remove` unlinks the path only if it still holds the file bound (device and
  inode), and is called while the socket still listens: meanwhile no process that checks as
  above replaces it, so the file checked is the file removed.

One window is left: between ``bind(2)`` and ``listen(2)`` (a ``chmod`` apart) a new socket file
refuses connections, so a process that looks at that very moment takes it for stale.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import socket
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ..shared.errors import ConfigError
from ..shared.logs import get_logger
from ..shared.redact import redact_urls

log = get_logger(__name__)

PREFIX = "ipc://"
CONNECT_TIMEOUT = 1.0  # seconds: a listener whose backlog is full counts as listening
BACKLOG = 100  # ZeroMQ's own default (ZMQ_BACKLOG)

FileId = tuple[int, int]  # (st_dev, st_ino)


class Found(enum.Enum):
    """What is at a socket's path."""

    NOTHING = "nothing"
    STALE = "stale"  # a socket file no process listens on
    LISTENING = "listening"
    NOT_A_SOCKET = "not a socket"
    FORBIDDEN = "forbidden"  # a socket this user may not connect to (another user's)


@dataclass(frozen=True, slots=True)
class Probe:
    """What :func:`probe` found at ``path``: the file's identity if any, the listener's pid if known."""

    path: str
    found: Found
    file: FileId | None = None
    pid: int | None = None


def ipc_path(endpoint: str) -> str | None:
    """The socket file an ``ipc://`` endpoint names; None for another transport."""
    return endpoint[len(PREFIX) :] if endpoint.startswith(PREFIX) else None


def _file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino


def probe(path: str) -> Probe:
    """Look at ``path`` and, if it is a socket, connect to it (and let go at once)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Probe(path, Found.NOTHING)
    if not stat.S_ISSOCK(st.st_mode):
        return Probe(path, Found.NOT_A_SOCKET, _file_id(st))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT)
        try:
            _unix_call(s.connect, path)
        except ConnectionRefusedError:
            return Probe(path, Found.STALE, _file_id(st))
        except FileNotFoundError:  # removed meanwhile
            return Probe(path, Found.NOTHING)
        except PermissionError:
            return Probe(path, Found.FORBIDDEN, _file_id(st))
        except (BlockingIOError, TimeoutError):  # its backlog is full: a process that listens, busy or stopped
            return Probe(path, Found.LISTENING, _file_id(st))
        return Probe(path, Found.LISTENING, _file_id(st), _listener_pid(s))


def _unix_call(call: Callable[[str], None], path: str) -> None:
    """``call(path)`` (a socket's bind or connect); Python's own error for a path too long for a
    Unix socket carries no errno: raised here with ENAMETOOLONG, as ZeroMQ's is."""
    try:
        call(path)
    except OSError as exc:
        if exc.errno is None:
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), path) from None
        raise


def _listener_pid(s: socket.socket) -> int | None:
    """The pid of the process that listens at the other end of ``s`` (Linux tells; else None)."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return None
    try:
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i")))
    except OSError:
        return None
    return pid or None


def refuse_taken(endpoint: str, *, role: str = "", advice: str = "choose another --endpoint") -> Probe:
    """Raise :class:`ConfigError` unless ``endpoint`` (an ``ipc://`` one) may be bound: nothing at
    its path, or a stale socket. ``role`` follows the endpoint in the message (" for a sample
    worker"); ``advice`` says what to do."""
    path = ipc_path(endpoint)
    assert path is not None, endpoint
    where = f"cannot listen on {redact_urls(endpoint)}{role}"
    if path.startswith("@"):  # ZeroMQ's abstract namespace, where no file is: bind(2) would make "./@NAME"
        raise ConfigError(f"{where}: an abstract socket (ipc://@NAME) is not supported: give ipc:// a file's path")
    try:
        found = probe(path)
    except OSError as exc:  # a folder on the way that is not one, or that we may not search; a path too long
        raise ConfigError(f"{where} ({os.strerror(exc.errno or 0)}): {advice}") from None
    if found.found is Found.LISTENING:
        who = "another process" if found.pid is None else f"process {found.pid}"
        raise ConfigError(
            f"{where}: {who} listens there already (another wdscache agent's socket?): {advice}, "
            "or stop that process first"
        )
    if found.found is Found.NOT_A_SOCKET:
        raise ConfigError(f"{where}: a file that is not a socket is there (it is left as it is): {advice}")
    if found.found is Found.FORBIDDEN:
        raise ConfigError(f"{where}: a socket there is another user's (Permission denied): {advice}")
    return found


@dataclass(frozen=True, slots=True)
class BoundFile:
    """The socket file this process bound: its path and identity."""

    path: str
    file: FileId

    def remove(self) -> None:
        """Unlink the path if it still holds this file; call before the socket stops listening.
        A file that cannot be removed (its file system turned read-only) is left, with a warning:
        at a stop, nothing is left to do about it, and the next bind replaces it (stale)."""
        try:
            _unlink_if(self.path, self.file)
        except OSError as exc:
            log.warning("left the socket file %s behind: cannot remove it (%s)", self.path, exc.strerror)


def _unlink_if(path: str, file: FileId) -> None:
    """Unlink ``path`` if it holds ``file``."""
    with contextlib.suppress(FileNotFoundError):
        if _file_id(os.lstat(path)) == file:
            os.unlink(path)


def bind(sock: zmq.Socket, endpoint: str, *, role: str = "", advice: str = "choose another --endpoint") -> BoundFile:
    """Bind ZeroMQ socket ``sock`` to ``endpoint`` (``ipc://PATH``) as the module's docstring says:
    :class:`ConfigError` if a process listens there or the file is not a stale socket; OSError if
    the file cannot be made (a folder not there, or read-only)."""
    found = refuse_taken(endpoint, role=role, advice=advice)
    path = found.path
    if found.found is Found.STALE:
        assert found.file is not None
        # Left by a process that is gone. Removed only if it is still that file (another start
        # may have replaced it since it was looked at); bind() below fails on anything there.
        _unlink_if(path, found.file)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound: BoundFile | None = None
    try:
        _unix_call(listener.bind, path)
        bound = BoundFile(path, _file_id(os.lstat(path)))
        os.chmod(path, 0o600)  # before listen(): no one connects before it is private
        listener.listen(BACKLOG)
        listener.setblocking(False)
        sock.setsockopt(zmq.USE_FD, listener.fileno())
        sock.bind(endpoint)
    except BaseException:
        if bound is not None:
            bound.remove()
        listener.close()
        raise
    listener.detach()  # ZeroMQ owns the descriptor now, and closes it with the socket
    return bound


def remove_stale(endpoint: str) -> None:
    """Unlink ``endpoint``'s socket file if no process listens there (its process is gone); leave
    anything else (another process's socket, a file that is not a socket)."""
    path = ipc_path(endpoint)
    assert path is not None, endpoint
    found = probe(path)
    if found.found is Found.STALE:
        assert found.file is not None
        _unlink_if(path, found.file)
