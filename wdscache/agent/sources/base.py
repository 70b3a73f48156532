"""What every source (HTTP(S), S3, a local file, a ``pipe:`` command) does for the fetcher:
say an object's size and version (:meth:`Source.probe`), and open a byte range of it
(:meth:`Source.open`) as a :class:`SourceResponse`. Everything else (retries, resume, the checks
on each answer, parts, the budget, writes) is the fetcher's, the same for all sources.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ..shard_download import Fetched, Gone, Unknown
from ..validators import Version

CHUNK = 64 << 10  # small reads: bytes received before a connection breaks are kept


@dataclass(frozen=True)
class Settings:
    """What sources are made with (the agent's options)."""

    connect_timeout: float
    read_timeout: float
    s3_endpoint_url: str | None = None

    @property
    def timeout(self) -> tuple[float, float]:
        return self.connect_timeout, self.read_timeout

    @property
    def answer_timeout(self) -> float:
        """Seconds a source's answer may take to begin (an HTTP response's head; a size asked at
        start-up), from its request's start: its connection, then its whole head (HTTP's is bounded
        whole, not only each read of it: :mod:`.http_head`)."""
        return self.connect_timeout + self.read_timeout


@dataclass(frozen=True)
class SourceResponse:
    """What a source said to a request for bytes ``start`` to ``end`` of an object."""

    chunks: Iterator[bytes]  # the body, as stored (a server's Content-Encoding is not undone)
    start: int  # the offset of its first byte
    ranged: bool  # the range asked was honoured; else the body is the whole object, from byte 0
    total: int | None  # the object's size, when the source said it
    version: Version
    let_go: Callable[[], None] = lambda: None  # close the connection (a wait for budget may be long)


class Unsatisfiable(Exception):
    """A range past the object's end (HTTP 416). ``whole()``: whether the object ends exactly
    where the range started and is of the version asked, so the partial file was whole."""

    def __init__(self, whole: Callable[[], bool], last_modified: str | None = None) -> None:
        super().__init__("range not satisfiable")
        self.whole, self.last_modified = whole, last_modified


class Replaced(Exception):
    """The object was replaced since the version the request named (S3's If-Match: HTTP 412), or
    while its body was read (a local file). ``backoff``: start over after the retries' backoff, not
    at once (a file may still be being written), the attempt counted as a failed one either way."""

    def __init__(self, reason: str, *, backoff: bool = False) -> None:
        super().__init__(reason)
        self.backoff = backoff


class Unexpected(Exception):
    """An answer that is neither the object's bytes nor a known failure (an unexpected HTTP status)."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status = reason, status


class Source:
    """One kind of URL. Safe to call from several threads; what a thread holds (connections,
    clients) is its own, made on first use and closed by :meth:`close_thread`."""

    parts = False  # whether a shard may come as several ranged parts at once
    describes = False  # whether probe() can tell an object's size (a pipe's command cannot)

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._local = threading.local()

    def probe(self, url: str) -> Fetched | Gone | Unknown:
        """Size and version of ``url`` now; Gone when the source says it has no such object;
        Unknown (with why) when they cannot be known."""
        return Unknown("its source cannot tell an object's size and version")

    def open(
        self, url: str, start: int, end: int | None, held: str | None, cancel: threading.Event
    ) -> AbstractContextManager[SourceResponse]:
        """Bytes ``start`` to ``end`` (None: to the object's end) of ``url``; from ``start`` > 0,
        only of version ``held`` when the source can ask for that (else it answers from byte 0).
        Raises FetchError (final), Retry, :class:`Unsatisfiable`, :class:`Replaced`,
        :class:`Unexpected`, or a connection's error (retried)."""
        raise NotImplementedError

    def answered(self, url: str) -> bool:
        """Whether ``url``'s host has answered this agent (a host that never did is likelier a mistake)."""
        return False

    def close_thread(self) -> None:
        """Close what the calling thread holds (call before the thread ends)."""
