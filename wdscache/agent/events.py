"""What crosses from the agent's download threads to its main loop: budget requests and events.

Guarantees (threads):

- A download thread never changes the agent's state. It tells the main loop
  what happened by posting one record of :data:`Event` to the :class:`Mailbox`
  (a queue, plus a pipe whose read end wakes the main loop's poll), and the main
  loop alone acts on it, in the order posted.
- A :class:`Grant` is the one object both sides change: the thread that asked
  withdraws it (timeout, cancel) and the main loop grants or refuses it, each
  under ``Grant.lock``, so a grant is either taken or withdrawn, never both.
- Records are frozen: their fields are what the thread saw when it posted. The
  :class:`~wdscache.agent.shard_download.Download` they name stays the main loop's, which the
  thread only writes into (its ``progress``, its ``budget.reserved``).
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field

from ..shared.errors import FetchError
from .shard_download import DiskFull, Download, Fetched, Gone, Unknown


@dataclass
class Grant:
    """A download thread's request for ``total`` bytes of budget, answered by the main loop."""

    download: Download
    total: int
    event: threading.Event = field(default_factory=threading.Event)  # set once granted (or refused with error)
    lock: threading.Lock = field(default_factory=threading.Lock)
    withdrawn: bool = False  # the thread stopped waiting: the main loop drops it
    error: Exception | None = None  # raised in the thread instead of writing on


@dataclass(frozen=True)
class BudgetAsked:
    """A download needs more budget before it writes on (see :meth:`Downloads.reserve`)."""

    grant: Grant


@dataclass(frozen=True)
class ValidatorFound:
    """The source named the shard's version: recorded so that a restart can resume the partial file."""

    download: Download
    etag: str | None


@dataclass(frozen=True)
class Downloaded:
    """The shard is published under ``shards/``."""

    download: Download
    fetched: Fetched


@dataclass(frozen=True)
class Revalidated:
    """A cached shard's source was asked for its size and version (Gone: it has no such object;
    Unknown: it could not say)."""

    download: Download
    now: Fetched | Gone | Unknown


@dataclass(frozen=True)
class DownloadFailed:
    """The download failed for good (after its retries): the shard is FAILED."""

    download: Download
    error: FetchError


@dataclass(frozen=True)
class OutOfSpace:
    """The file system refused a write (ENOSPC, quota): not the shard's fault, it is tried again."""

    download: Download
    error: DiskFull


@dataclass(frozen=True)
class DownloadCancelled:
    """The download was abandoned (its shard left every window, or its slot was needed)."""

    download: Download


Event = BudgetAsked | ValidatorFound | Downloaded | Revalidated | DownloadFailed | OutOfSpace | DownloadCancelled


class Mailbox:
    """Events from any thread to the main loop; :meth:`fileno` is readable while some wait.

    :meth:`post` is safe from any thread; everything else is the main loop's.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def fileno(self) -> int:
        """The descriptor the main loop polls, so an event is handled at once, not at its next tick."""
        return self._wake_r

    def post(self, event: Event) -> None:
        """From any thread: hand ``event`` to the main loop and wake it."""
        self._queue.put(event)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the main loop is awake already

    def clear(self) -> None:
        """Empty the wake-up pipe (the events themselves stay queued)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def take(self) -> Event | None:
        """The oldest event, or None."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def put_back(self, event: Event) -> None:
        """Queue ``event`` again (its handling failed for now: the index was full)."""
        self._queue.put(event)

    def close(self) -> None:
        """Close the pipe; only once no thread can post any more (its descriptor numbers get reused)."""
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
