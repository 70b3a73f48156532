"""The error hierarchy: one base, a few subclasses that carry their context.

Every message says what went wrong *and* what to do about it, so that a user
reading a traceback from a training job can act without opening our source.

What survives a trip to another process: the class and the message, always, so that
``except wdscache.FetchError`` works around a torch DataLoader as around the loader itself.

- Pickling (multiprocessing, a worker pool) keeps the class, ``str(exc)`` and every context
  attribute (``url``, ``endpoint``, ...).
- Every class is also constructible from its message alone, ``cls(message)``, as torch's
  DataLoader re-raises a worker's exception (``ExceptionWrapper.reraise`` calls
  ``exc_type(msg)`` with the worker's traceback as the message, and makes a
  ``RuntimeError`` of any class that refuses it). ``str(exc)`` is then that message and the
  context attributes are None (or their constructor default, ``permanent=False`` say).

Messages show URLs through :func:`wdscache.shared.redact.redact_urls` (every message, whatever
built it: a reason quoting a library's error included): no user info, no signature or token. So
does a ``reason`` attribute, which is prose (it may quote a server's or a library's text). The
``url`` (and ``line``, ``path``) attributes keep the full URL, for the code that handles the error.

Hence the rules for subclasses (:class:`WdsCacheError` wraps each one's ``__init__`` to
follow them): a call with one positional argument and no keywords is the message form, so
a context of a single value is a keyword (``NoCacheError(cache_dir=...)``); and each
``__init__`` parameter is stored as the attribute of its name.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import resource
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import zmq

from .redact import redact_urls


class WdsCacheError(Exception):
    """Base of every error wdscache raises on purpose."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*(redact_urls(a) if isinstance(a, str) else a for a in args))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _or_message(cls.__dict__["__init__"])  # type: ignore[method-assign]

    def __reduce__(self) -> tuple[Any, ...]:
        # The message form and then the attributes: no constructor's arguments need to be kept.
        return type(self), (str(self),), self.__dict__


def _or_message(init: Callable[..., None]) -> Callable[..., None]:
    """``init``, or with a lone positional argument the message form: that message, and
    each of ``init``'s parameters as an attribute set to its default (None without one)."""
    defaults = {
        name: None if p.default is p.empty else p.default
        for name, p in list(inspect.signature(init).parameters.items())[1:]
    }

    @functools.wraps(init)
    def __init__(self: WdsCacheError, *args: Any, **kwargs: Any) -> None:
        if len(args) == 1 and not kwargs:
            self.__dict__.update(defaults)
            WdsCacheError.__init__(self, args[0])
        else:
            init(self, *args, **kwargs)

    return __init__


class ConfigError(WdsCacheError):
    """An option or an input file is invalid; nothing was started."""


class UrlListError(ConfigError):
    """A line of a URL list cannot be used.

    Carries the list's ``path``, the 1-based ``lineno`` and the ``line`` itself.
    """

    def __init__(self, path: str, lineno: int, line: str, reason: str) -> None:
        self.path, self.lineno, self.line, self.reason = path, lineno, line, redact_urls(reason)
        shown = redact_urls(line)  # before it is cut, so that no part of a secret is left
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        super().__init__(f"{path}:{lineno}: {reason}: {shown!r}")


class ShardIndexError(ConfigError):
    """A shard index (wids JSON) cannot be used.

    Carries the index's ``path``, the 0-based ``entry`` of its ``shardlist`` at fault (None
    for the file as a whole) and that entry's ``url`` when it has one.
    """

    def __init__(self, path: str, entry: int | None, reason: str, *, url: str | None = None) -> None:
        self.path, self.entry, self.url, self.reason = path, entry, url, redact_urls(reason)
        where = "" if entry is None else f" shardlist[{entry}]" + (f" ({redact_urls(url)[:200]!r})" if url else "")
        super().__init__(f"{path}:{where}: {reason}" if where else f"{path}: {reason}")


class FetchError(WdsCacheError, OSError):
    """A shard could not be downloaded (or read from its source).

    Also an ``OSError``, as the errors of webdataset's readers are: a script that catches
    ``OSError`` (or ``IOError``) around a loop over samples catches it too. ``errno`` is None.

    ``permanent`` is true when retrying cannot help (404, 403, not a tar file);
    ``status`` is the HTTP status when there was one.
    """

    def __init__(self, url: str, reason: str, *, status: int | None = None, permanent: bool = False) -> None:
        self.url, self.reason, self.status, self.permanent = url, redact_urls(reason), status, permanent
        super().__init__(f"cannot fetch {url}: {reason}")


class ShardError(WdsCacheError):
    """A cached shard cannot be read as a WebDataset tar (corrupt, truncated, bad member).

    Carries the shard's ``url`` and the byte ``offset`` where reading failed, if known.
    """

    def __init__(self, url: str, reason: str, *, offset: int | None = None) -> None:
        self.url, self.reason, self.offset = url, redact_urls(reason), offset
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"bad shard {url}{where}: {reason}")


class AgentRunningError(WdsCacheError):
    """Another agent already owns this cache directory."""

    def __init__(self, cache_dir: str, pid: int | None) -> None:
        self.cache_dir, self.pid = cache_dir, pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"an agent ({who}) is already running on {cache_dir}; stop it first or use another --cache-dir"
        )


class AgentUnavailableError(WdsCacheError):
    """No agent answered at an endpoint within the timeout."""

    def __init__(self, endpoint: str, timeout: float, hint: str = "") -> None:
        self.endpoint, self.timeout, self.hint = endpoint, timeout, hint
        msg = f"no wdscache agent answered at {endpoint} within {round(timeout, 1):g}s"
        super().__init__(msg + (f"; {hint}" if hint else ""))


class ProtocolError(WdsCacheError):
    """A peer sent a message that does not follow the wire protocol."""


class NotTrustedError(WdsCacheError):
    """A peer does not hold the cache directory's token: it may be another user's process."""


class NoCacheError(WdsCacheError):
    """A directory holds no wdscache cache: none was made there, or (``removed``) it was removed
    under the agent running on it, the directory itself or (``files``, named in it) the files the
    agent holds there."""

    def __init__(
        self, *, cache_dir: str, read_only: str | None = None, removed: bool = False, files: Sequence[str] = ()
    ) -> None:
        self.cache_dir, self.read_only, self.removed, self.files = cache_dir, read_only, removed, tuple(files)
        if removed and self.files:  # the directory stayed; files the agent holds in it went
            were = "were" if len(self.files) > 1 else "was"
            super().__init__(
                f"{' and '.join(self.files)} in {cache_dir} {were} removed or replaced while the agent ran on it: "
                "the cache directory's files were removed under it, and its cache is gone; start the agent "
                "again to make a new one there (and keep cleaners of old files out of it)"
            )
            return
        if removed:  # while an agent ran on it
            super().__init__(
                f"{cache_dir} was removed or replaced while the agent ran on it: its cache is gone; "
                f"start the agent again to make a new one there (and keep cleaners of old files out of it)"
            )
            return
        if read_only is not None:  # why it cannot be written, as CacheLayout.read_only says it
            super().__init__(
                f"{cache_dir} holds no wdscache cache, and it {read_only}: no agent can make "
                "one there; use a writable --cache-dir"
            )
            return
        super().__init__(
            f"{cache_dir} holds no wdscache cache; start one with 'wdscache agent --cache-dir {cache_dir} --urls FILE'"
        )


# Tracebacks and logs name them as users import them (``wdscache.FetchError``), not by the
# module that defines them; pickle finds them there too (the package resolves them on first use).
for _cls in (
    WdsCacheError,
    ConfigError,
    UrlListError,
    ShardIndexError,
    FetchError,
    ShardError,
    AgentRunningError,
    AgentUnavailableError,
    ProtocolError,
    NotTrustedError,
    NoCacheError,
):
    _cls.__module__ = "wdscache"
del _cls


def failed_shard(url: str, reply: dict[str, Any], *, permanent: bool = False) -> WdsCacheError:
    """The error of a shard the agent failed (its answer to an open, or a status): a
    ShardError when the shard itself is bad (``corrupt``: its copies found damaged, or its
    bytes not what its index says, such as another sample count), else a FetchError (its
    download failed)."""
    error = str(reply.get("error") or "download failed")
    if reply.get("corrupt") is True:
        return ShardError(url, error)
    return FetchError(url, error, permanent=permanent)


OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)  # this process's limit on open files, or the system's


def files_free() -> tuple[int, int] | None:
    """Files this process may still open, and its limit on them (``ulimit -n``); None when no limit
    is set or /proc does not tell (not Linux)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        held = os.listdir("/proc/self/fd")  # (counts the one it reads through: one too many, no harm)
    except OSError as exc:
        return (0, limit) if exc.errno in OUT_OF_FILES else None
    return limit - sum(1 for fd in held if int(fd) < limit), limit


def short_of_files(doing: str, free: tuple[int, int] | None = None) -> WdsCacheError:
    """The error of what this process cannot do for want of open files (``doing``: "to read X"),
    ``free`` the files it has free (:func:`files_free`; looked at when not given)."""
    free = free or files_free()
    had = f"{free[0]} of its {free[1]} open files free" if free is not None else "no open file free"
    return WdsCacheError(
        f"this process has {had}, too few {doing}: raise its limit in the shell that starts it (ulimit -n: a "
        "training job's, or its launcher's), or hold fewer files open (a DataLoader with fewer workers)"
    )


def out_of_files(exc: BaseException) -> str | None:
    """What to say of ``exc`` when it is the agent's fault, not a shard's: out of open files (its
    limit, or the system's). None for any other error.

    The error may be wrapped: a socket a connection could not make is an OSError inside urllib3's
    and requests' errors, so the chain is looked through (:func:`wrapped_errors`). A ZeroMQ
    socket that could not have its descriptors is a ZMQError of the same errno."""
    for e in wrapped_errors(exc):
        if isinstance(e, OSError | zmq.ZMQError) and e.errno in OUT_OF_FILES:
            return f"too many open files ({os.strerror(e.errno or 0)}): raise ulimit -n / LimitNOFILE for the agent"
    return None


def wrapped_errors(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it wraps, each once, nearest first: its cause, context, ``reason``
    (urllib3's) and arguments that are errors (requests wraps urllib3's errors, which wrap the
    socket's)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(
            x for x in (e.__cause__, e.__context__, getattr(e, "reason", None), *e.args) if isinstance(x, BaseException)
        )


def worker_fault(endpoint: str, reply: Mapping[str, Any]) -> WdsCacheError:
    """The error of a worker's answer of kind ``fault`` (a fault of the agent's, such as
    :func:`out_of_files`): raised at once, whatever ``on_error``, as no shard is to blame."""
    return WdsCacheError(f"a sample worker of the agent at {endpoint} cannot serve: {reply.get('error')}")
