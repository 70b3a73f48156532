"""Where things live inside a cache directory.

::

    CACHE_DIR/                  0700, owned by the user running the agent
      index/                    the diskcache index (SQLite); the only record of what is cached
      shards/ab/<hash>-<name>   complete shards; a file here is always a whole, checked shard
      partial/<hash>-<name>     downloads in progress; never read by anyone
      tables/ab/<hash>-<name>   the sample table of the shard of the same name, as its workers
                                found it (wdscache.agent.sampletable); counted in the budget
      partial/<hash>-<name>~tar a gzip'd download's tar, being decompressed
      partial/<hash>-<name>~part-<start>-<end>  a part of a download in parallel parts
      agent.lock                flock held by the running agent; holds its pid (read_pid)
      agent.json                the running agent's pid, start time (and its process's identity) and endpoint;
                                while it starts, what it is doing (``starting``): written once it holds the lock
      token                     0600: the secret a client must hold to talk to the agent and its
                                workers (see wdscache.shared.protocol); made once, kept across restarts
      agent.sock                the agent's private IPC socket (moved to /tmp when the path is too long)
      aside/<time>/...          what was found where the cache keeps its own files and is none (a directory
                                where a shard's file belongs, say), under its path in the cache: moved here
                                as found, never read or deleted (wdscache.agent.recovery.clear_way)

A cache directory that cannot be written (a file system mounted read-only, say) is refused by
every command that changes it, with :meth:`CacheLayout.check_writable`'s one-line error;
``ls``, ``stats`` and ``verify`` still read it (see :mod:`wdscache.shared.index`). An agent
start that fails removes what it made there (:meth:`CacheLayout.undo_start`).

A shard's file name is derived from its whole URL (a hash plus a readable tail),
so two ``shard-000000.tar`` in different folders never collide, and the name of
any URL's file is known without looking at the disk. The tail is the last segment of the
URL's path as :func:`~wdscache.shared.redact.redact_urls` shows it, without an http(s) query
or fragment; a ``pipe:`` command's is that of the first URL in it (without query or fragment),
or ``pipe`` when it has none, never the command's other words (a header it sends, say): no
user info, query value or token reaches a file name.

Names of caches written by earlier versions (:func:`former_shard_names`): a tail cut from the
URL as written, query included, or a ``pipe:`` command's cut after its last "/", whatever came
there; the cache renames such files when it opens (:meth:`wdscache.agent.cache.ShardCache`),
and only those URLs' names differ.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import OUT_OF_FILES, ConfigError, short_of_files
from .redact import redact_urls


class WriteFault(enum.Enum):
    """Why a cache's file system refuses writes, when it is not for want of space."""

    READ_ONLY = "read-only"  # mounted read-only, or turned so after an error (ext4's errors=remount-ro)
    IO_ERROR = "I/O error"  # the device fails

    def describe(self, root: Path) -> str:
        """The fault as the first words of a message."""
        if self is WriteFault.READ_ONLY:
            return f"the file system of {root} became read-only"
        return f"an I/O error on the file system of {root}"


def write_fault(folder: Path) -> WriteFault | None:
    """Whether ``folder``'s file system refuses a write for a reason other than space: read-only
    (mounted so, or turned so after an error: since Linux 6.x ext4 then refuses writes with EROFS
    while its mount still says ``rw``, so a probe file is made and removed to tell), or failing
    with I/O errors. None when the probe file can be made, and for any other refusal (no space
    left, a folder gone, or not ours)."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return WriteFault.READ_ONLY
        probe = folder / f".write-probe-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
    except OSError as exc:
        return {errno.EROFS: WriteFault.READ_ONLY, errno.EIO: WriteFault.IO_ERROR}.get(exc.errno or 0)
    return None


# sun_path holds 108 bytes on Linux (104 on macOS); keep a margin for "ipc://".
_MAX_SOCKET_PATH = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# A URL in a shell command: up to a space, a quote or a shell operator, so none of the command's
# other words is part of it.
_URL_IN_COMMAND = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s'\"`<>;|&()]*")
INDEX_DB = "cache.db"  # the index's SQLite database in index/: diskcache's DBNAME (the index is a diskcache)
NAMES_KEPT = 8192  # shard names remembered (a URL and its name: a few hundred bytes each)


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one file from another at the same path: a new download is a new inode
    (an inode number can be reused after a delete, so size and mtime count too)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def is_file(path: Path, identity: Sequence[int]) -> bool:
    """Whether ``path`` is still the file of ``identity`` (:func:`file_identity`): a worker's
    report names the copy it read, which a new download may have replaced since."""
    try:
        return list(file_identity(os.stat(path))) == list(identity)
    except OSError:  # (gone: evicted)
        return False


def _fanned(name: str) -> Path:
    """Where a file named ``name`` lies in a folder of many: in a subfolder of its first two
    characters (a hash's), so that no folder holds more than a few thousand of a million."""
    return Path(name[:2]) / name


_FAN = re.compile(r"[0-9a-f]{2}")


def is_fan(name: str) -> bool:
    """Whether ``name`` is one of :func:`_fanned`'s subfolders: two hex digits (of a hash)."""
    return _FAN.fullmatch(name) is not None


@functools.lru_cache(maxsize=NAMES_KEPT)
def shard_name(url: str) -> str:
    """The cache file name of ``url``: unique per URL, readable, filesystem-safe, and free of
    its secrets (see the module docstring). The latest are kept: the agent names a shard at
    every open, a consumer at every read of its file."""
    shown = redact_urls(url)
    if shown.startswith("pipe:"):
        found = _URL_IN_COMMAND.search(shown)
        shown = found.group(0).split("#", 1)[0].split("?", 1)[0] if found else "pipe"
    elif shown.startswith(("http://", "https://")):
        shown = shown.split("#", 1)[0].split("?", 1)[0]
    return _name(url, shown)


def former_shard_names(url: str) -> list[str]:
    """The names earlier versions gave the cache file of ``url`` that are not :func:`shard_name`'s
    (none for most URLs): its tail cut from the URL as written, and for a ``pipe:`` command
    also from the command as redacted, each after its last "/"."""
    today = shard_name(url)
    names = [_name(url, url)]
    if url.startswith("pipe:"):
        names.append(_name(url, redact_urls(url)))
    return [n for i, n in enumerate(names) if n != today and n not in names[:i]]


def _name(url: str, shown: str) -> str:
    # surrogatepass: any str (even a lone surrogate from a hostile peer) has a name.
    digest = hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()
    tail = _UNSAFE.sub("_", shown.rstrip("/").rsplit("/", 1)[-1])[-60:]
    return f"{digest[:32]}-{tail}" if tail else digest[:32]


@dataclass(frozen=True)
class CacheLayout:
    """Paths of one cache directory."""

    root: Path

    @classmethod
    def of(cls, cache_dir: str | os.PathLike[str]) -> CacheLayout:
        return cls(Path(os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))))

    @property
    def index_dir(self) -> Path:
        return self.root / "index"

    @property
    def shards_dir(self) -> Path:
        return self.root / "shards"

    @property
    def partial_dir(self) -> Path:
        return self.root / "partial"

    @property
    def lock_path(self) -> Path:
        return self.root / "agent.lock"

    @property
    def state_path(self) -> Path:
        return self.root / "agent.json"

    @property
    def token_path(self) -> Path:
        return self.root / "token"

    def shard_path(self, url: str) -> Path:
        return self.shards_dir / _fanned(shard_name(url))

    def former_shard_paths(self, url: str) -> list[Path]:
        """Where caches written by earlier versions kept the shard of ``url``, when that is not
        :meth:`shard_path` (none for most URLs)."""
        if not url.startswith("pipe:") and not any(c in url for c in "?#@="):
            return []  # its name was never cut otherwise
        return [self.shards_dir / _fanned(name) for name in former_shard_names(url)]

    def partial_path(self, url: str) -> Path:
        return self.partial_dir / shard_name(url)

    @property
    def tables_dir(self) -> Path:
        return self.root / "tables"

    def table_path(self, url: str) -> Path:
        return self.tables_dir / _fanned(shard_name(url))

    def prepare(self) -> list[Path]:
        """Create the cache directory private (0700), or check that an existing one is ours and
        writable; returns the folders it made (outermost first), for :meth:`undo_start`.

        Refused: a symbolic link (the error names its target), a directory owned by another
        user, or writable by group or others (someone else could plant files or links in it),
        or one that cannot be written.
        """
        root = self.root
        if root.is_symlink():  # (refused as any link: give the directory itself)
            real = os.path.realpath(root)
            raise ConfigError(
                f"cache directory {root} is a symbolic link to {real}, not a directory: give the directory "
                f"itself (--cache-dir {real})"
            )
        made: list[Path] = []
        folder = root
        while not os.path.lexists(folder):
            made.insert(0, folder)
            folder = folder.parent
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot make cache directory {root}: {exc.strerror}; use a writable directory") from None
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"cache directory {root} is not a directory; use a directory")
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"cache directory {root} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                "use a directory of your own"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"cache directory {root} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run 'chmod 700 {root}' or use another directory"
            )
        self.check_writable("the agent")
        if st.st_mode & 0o077:
            root.chmod(0o700)
        return made

    def read_only(self) -> str | None:
        """Why the cache directory cannot be written, as a phrase ("is read-only (...)"); None when it can.
        A directory not made yet is judged by the folder it would be made in."""
        folder = self.root
        while not os.path.lexists(folder) and folder != folder.parent:
            folder = folder.parent
        try:
            if os.statvfs(folder).f_flag & os.ST_RDONLY:
                return "is read-only (its file system is mounted read-only)"
        except OSError:
            return None  # not there at all: the command says so itself
        if not os.access(folder, os.W_OK):
            return f"is not writable by you (uid {os.getuid()})"
        return None

    def check_writable(self, who: str) -> None:
        """Raise ConfigError, one line naming the directory, if ``who`` (a command) cannot write it:
        :meth:`read_only`, or a file system that refuses writes while mounted read-write
        (:func:`write_fault`; checked by a probe file, as a command that writes may)."""
        why = self.read_only()
        if why is None and os.path.isdir(self.root):
            fault = write_fault(self.root)
            if fault is WriteFault.READ_ONLY:
                why = "is on a file system that turned read-only (it refuses writes)"
            elif fault is WriteFault.IO_ERROR:
                why = "cannot be written (its file system fails with I/O errors)"
        if why is not None:
            raise ConfigError(
                f"cache directory {self.root} {why}: {who} needs to write to it; make it writable "
                "or use another --cache-dir"
            )

    def undo_start(self, before: set[str], made: list[Path]) -> None:
        """Undo a start that failed (call with the lock held): remove the cache's own entries (this
        module's map) that were added since the directory held the entries ``before``, then the
        folders ``prepare`` ``made``. Anything else (an index moved aside as corrupt) is kept."""
        own = {
            p.name
            for p in (
                self.index_dir,
                self.shards_dir,
                self.partial_dir,
                self.tables_dir,
                self.lock_path,
                self.state_path,
                self.token_path,
                self.root / "agent.sock",
            )
        }
        for name in (own & set(os.listdir(self.root))) - before:
            path = self.root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:  # not empty: another process put something there meanwhile
                break

    def ensure_token(self) -> str:
        """The agent's token, made (atomically, 0600) if there is none yet; call with the lock held."""
        token = self.read_token()
        if token is None:
            token = secrets.token_hex(32)
            write_atomic(self.token_path, token.encode())
        return token

    def check_owner(self) -> None:
        """Refuse a cache directory of another user (a client must not trust its agent or files)."""
        try:
            owner = os.stat(self.root).st_uid
        except FileNotFoundError:
            return  # not made yet (a private agent will make it ours)
        if owner != os.getuid():
            raise ConfigError(
                f"cache directory {self.root} belongs to uid {owner}, not to you (uid {os.getuid()}); "
                "read only a cache of your own user (its agent's samples and files are that user's)"
            )

    def read_token(self) -> str | None:
        """The token in this cache directory, or None when there is none (no agent started yet)."""
        self.check_owner()
        try:
            fd = os.open(self.token_path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in OUT_OF_FILES:  # the process's limit: not a token of another user's
                raise short_of_files(f"to read the agent's token {self.token_path}") from None
            raise ConfigError(
                f"cannot read the agent's token {self.token_path}: {exc.strerror}; "
                "run as the user who owns the cache directory"
            ) from None
        try:
            token = os.read(fd, 256).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        return token or None

    def agent_holds_lock(self, pid: int) -> bool | None:
        """Whether process ``pid`` (the agent agent.json names) holds the directory's lock: the kernel
        drops an flock when its holder dies, however it dies, and the lock file names the holder (any
        other is an agent starting, or a cache command working without one). None: cannot be told
        (no lock file to open). It only looks: a shared lock taken and dropped at once, which an agent
        starting meanwhile waits out (:mod:`wdscache.agent.lock`)."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_pid(self.lock_path) == pid
        except OSError:
            return None
        finally:
            os.close(fd)  # drops our shared lock, if we took it
        return False

    def agent_state(self) -> dict[str, Any] | None:
        """The state file an agent serving this directory wrote (agent.json: pid, started, endpoint,
        process; ``starting`` while it starts), if there is one as an agent writes it; it may be a
        dead agent's (see :meth:`agent_holds_lock`)."""
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict):
            return None
        pid, started, endpoint = state.get("pid"), state.get("started"), state.get("endpoint")
        if type(pid) is not int or not isinstance(started, (int, float)) or not isinstance(endpoint, str):
            return None
        return state

    def running_agent(self) -> dict[str, Any] | None:
        """The state (:meth:`agent_state`) of the agent that runs on this directory now, started or
        starting: the one agent.json names, while it holds the lock; None when none does."""
        state = self.agent_state()
        return state if state is not None and self.agent_holds_lock(state["pid"]) else None

    def starting_agent(self) -> dict[str, Any] | None:
        """The state (:meth:`agent_state`) of the agent starting on this directory now: it holds the
        lock and has not answered yet (its ``starting`` says what it is doing); None when none is."""
        state = self.agent_state()
        if state is None or not isinstance(state.get("starting"), str):
            return None
        return state if self.agent_holds_lock(state["pid"]) else None

    def starting_note(self) -> str | None:
        """``the agent (pid N) on DIR is still starting (what it does, for Ns)``, while one starts
        (:meth:`starting_agent`); None when none does. (Who finds it silent says what to do.)"""
        state = self.starting_agent()
        if state is None:
            return None
        since = max(0.0, time.time() - state["started"])
        return (
            f"the agent (pid {state['pid']}) on {self.root} is still starting ({state['starting']}, for {since:.0f}s)"
        )

    def is_cache(self) -> bool:
        """True when this directory holds a wdscache index."""
        return self.index_db.is_file()

    @property
    def index_db(self) -> Path:
        """The index's SQLite database (diskcache's ``DBNAME`` in :attr:`index_dir`)."""
        return self.index_dir / INDEX_DB

    def agent_endpoint(self) -> str:
        """Where the agent of this directory listens, as seen from here: the endpoint agent.json
        names while its agent runs (:meth:`running_agent`; an ``--endpoint`` of its own, TCP say),
        else the directory's own socket (:meth:`default_endpoint`). An ``ipc://`` socket of the
        agent's that is not to be seen here counts as none: the directory may be mounted at another
        path here (a container), or the agent not listen yet."""
        running = self.running_agent()
        if running is None:
            return self.default_endpoint()
        named: str = running["endpoint"]
        if named.startswith("ipc://") and not os.path.exists(named[len("ipc://") :]):
            return self.default_endpoint()
        return named

    def default_endpoint(self) -> str:
        """The agent's private IPC endpoint, derived from the cache directory alone.

        Unix socket paths are short (108 bytes); a deep cache directory gets a
        socket in a private per-user folder under /tmp instead,
        named by a hash of the cache path so that agent and consumers agree. The
        path is the directory's real one: a symlink to it names the same socket.
        """
        real = Path(os.path.realpath(self.root))
        path = real / "agent.sock"
        if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
            return f"ipc://{path}"
        digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:24]
        return f"ipc://{short_socket_dir()}/{digest}.sock"


def read_pid(path: Path) -> int | None:
    """The pid written in a lock file, if any."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_atomic(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """Publish ``data`` at ``path`` atomically (temp file in its folder, fsync, rename, the
    folder fsynced), ``mode`` (less the umask; private by default): a reader sees the old file
    or the new one, all of it; a failure leaves no temp file and raises an OSError naming ``path``.

    The temp file is created exclusively and links are not followed, so a link
    planted at its name cannot redirect the write. Without ``durable``, no fsync: for a
    file that checks itself when read (a power loss may leave it short or empty), written
    where waiting on the disk would hold up more than the write.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            left = memoryview(data)
            while left:  # (a write may take less than all: a full disk's last blocks, say)
                left = left[os.write(fd, left) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:  # the rename too survives a power loss
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None  # named: the file it was for


def short_socket_dir() -> Path:
    """A per-user 0700 folder for sockets whose natural path is too long."""
    # A fixed base, not $TMPDIR: agent and consumers may run with different
    # environments (a Slurm step sets its own TMPDIR) and must find the same path.
    folder = Path("/tmp") / f"wdscache-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        raise ConfigError(f"cannot make the socket folder {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        # Someone else made it: their sockets, or a link, could stand in for the agent's.
        raise ConfigError(
            f"the socket folder {folder} is not yours alone (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}; it must be a directory of uid {os.getuid()}, mode 700); "
            f"remove it if nobody uses it, or use a shorter --cache-dir path (or --endpoint)"
        )
    return folder
