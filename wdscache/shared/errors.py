"""The error hierarchy: one base, a few subclasses that carry their context.

Every message says what went wrong *and* what to do about it, so that a user
reading a traceback from a training job can act without opening our source.
"""

from __future__ import annotations


class WdsCacheError(Exception):
    """Base of every error wdscache raises on purpose."""


class ConfigError(WdsCacheError):
    """An option or an input file is invalid; nothing was started."""


class UrlListError(ConfigError):
    """A line of a URL list cannot be used.

    Carries the list's ``path``, the 1-based ``lineno`` and the ``line`` itself.
    """

    def __init__(self, path: str, lineno: int, line: str, reason: str) -> None:
        self.path, self.lineno, self.line, self.reason = path, lineno, line, reason
        shown = line if len(line) <= 120 else line[:117] + "..."
        super().__init__(f"{path}:{lineno}: {reason}: {shown!r}")


class ShardIndexError(ConfigError):
    """A shard index (wids JSON) cannot be used.

    Carries the index's ``path``, the 0-based ``entry`` of its ``shardlist`` at fault (None
    for the file as a whole) and that entry's ``url`` when it has one.
    """

    def __init__(self, path: str, entry: int | None, reason: str, *, url: str | None = None) -> None:
        self.path, self.entry, self.url, self.reason = path, entry, url, reason
        where = "" if entry is None else f" shardlist[{entry}]" + (f" ({url[:200]!r})" if url else "")
        super().__init__(f"{path}:{where}: {reason}" if where else f"{path}: {reason}")


class FetchError(WdsCacheError):
    """A shard could not be downloaded.

    ``permanent`` is true when retrying cannot help (404, 403, not a tar file);
    ``status`` is the HTTP status when there was one.
    """

    def __init__(
        self, url: str, reason: str, *, status: int | None = None, permanent: bool = False
    ) -> None:
        self.url, self.reason, self.status, self.permanent = url, reason, status, permanent
        super().__init__(f"cannot fetch {url}: {reason}")


class ShardError(WdsCacheError):
    """A cached shard cannot be read as a WebDataset tar (corrupt, truncated, bad member).

    Carries the shard's ``url`` and the byte ``offset`` where reading failed, if known.
    """

    def __init__(self, url: str, reason: str, *, offset: int | None = None) -> None:
        self.url, self.reason, self.offset = url, reason, offset
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"bad shard {url}{where}: {reason}")


class AgentRunningError(WdsCacheError):
    """Another agent already owns this cache directory."""

    def __init__(self, cache_dir: str, pid: int | None) -> None:
        self.cache_dir, self.pid = cache_dir, pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"an agent ({who}) is already running on {cache_dir}; "
            "stop it first or use another --cache-dir"
        )


class AgentUnavailableError(WdsCacheError):
    """No agent answered at an endpoint within the timeout."""

    def __init__(self, endpoint: str, timeout: float, hint: str = "") -> None:
        self.endpoint, self.timeout = endpoint, timeout
        msg = f"no wdscache agent answered at {endpoint} within {timeout:g}s"
        super().__init__(msg + (f"; {hint}" if hint else ""))


class ProtocolError(WdsCacheError):
    """A peer sent a message that does not follow the wire protocol."""


class NotTrustedError(WdsCacheError):
    """A peer does not hold the cache directory's token: it may be another user's process."""


class NoCacheError(WdsCacheError):
    """A directory holds no wdscache cache."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        super().__init__(
            f"{cache_dir} holds no wdscache cache; start one with "
            f"'wdscache agent --cache-dir {cache_dir} --urls FILE'"
        )


# Tracebacks and logs name them as users import them (``wdscache.FetchError``), not by the
# module that defines them; pickle finds them there too (the package resolves them on first use).
for _cls in (WdsCacheError, ConfigError, UrlListError, ShardIndexError, FetchError, ShardError,
             AgentRunningError, AgentUnavailableError, ProtocolError, NotTrustedError, NoCacheError):
    _cls.__module__ = "wdscache"
del _cls
