"""A stream's reports to the agent, for its stats: what a rank received and its sample rate.

Guarantees:

- Advisory: a report the agent does not answer within ``REPORT_TIMEOUT`` is skipped, never
  retried; samples never wait for one.
- A loader's rate counts every stream (epoch) of it in this process, each report's the
  samples handed out since the one before by the loader's streams, live or ended: an epoch
  shorter than ``REPORT_EVERY`` still shows (:class:`ReportClock`), and two streams of one
  loader read at once report shares of it that add up to it, as the agent adds a rank's
  readers' rates.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..shared.client import AgentConnection
from ..shared.errors import AgentUnavailableError, NotTrustedError
from ..shared.messages import ReportMessage

REPORT_EVERY = 1.0
REPORT_TIMEOUT = 1.0  # reports are advisory: one the agent does not answer soon is skipped


class ReportClock:
    """When a loader's streams report, and their rate, across its epochs: each epoch is a
    stream, and a consumer of its own at the agent, and one shorter than REPORT_EVERY would
    never report, and show its job idle however fast it reads. So a report is due every
    REPORT_EVERY seconds whatever the epochs' bounds, its rate the samples of all the loader's
    streams since the last one due, shared by the streams live then; and a new stream reports
    at once its share of the latest rate. A process's own: a DataLoader worker (a copy of the
    loader, forked or unpickled) starts it anew. Its streams' reporter threads share it: a lock."""

    def __init__(self) -> None:
        self.pid = 0  # the process it counts for
        self.at = 0.0  # time.monotonic() of the latest report due
        self.samples = 0  # samples the loader's streams had handed out then
        self.done = 0  # samples of the loader's streams that ended
        self.rate: float | None = None  # the latest rate, of all its streams (None: none due yet)
        self._live: dict[int, Callable[[], int]] = {}  # id of a live stream's reporter -> its samples so far
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {}  # (a copy is another process's: it starts anew)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def start(self, reporter: object, samples: Callable[[], int]) -> float:
        """A stream's ``reporter`` starts (``samples()``: what its stream handed out so far);
        seconds until it reports: 0 where a rate is known (the stream is a consumer the agent
        knows nothing of yet), else until the next report is due."""
        if self.pid != os.getpid():  # a copy forked into a DataLoader worker: anew, with a lock of
            # its own (a thread of the parent may have held the parent's as it forked: held for ever here)
            self.__init__()  # type: ignore[misc]
            self.pid, self.at = os.getpid(), time.monotonic()
        with self._lock:
            self._live[id(reporter)] = samples
            return 0.0 if self.rate is not None else self._due()

    def due(self) -> float:
        """Seconds until the next report is due."""
        with self._lock:
            return self._due()

    def _due(self) -> float:
        return max(0.0, self.at + REPORT_EVERY - time.monotonic())

    def tick(self) -> float:
        """The rate a stream reports: its share of the loader's, of every stream since the latest
        report due if this one is due too (it starts the next), else that one's."""
        with self._lock:
            now = time.monotonic()
            if self.rate is None or now - self.at >= REPORT_EVERY:
                total = self.done + sum(samples() for samples in self._live.values())
                self.rate = (total - self.samples) / (now - self.at) if now > self.at else 0.0
                self.at, self.samples = now, total
            return self.rate / max(1, len(self._live))

    def ended(self, reporter: object, samples: int) -> None:
        """A stream's ``reporter`` stopped, its stream having handed out ``samples``."""
        with self._lock:
            if self._live.pop(id(reporter), None) is not None:
                self.done += samples


class Reporter:
    """Tells the agent how a stream goes, for its stats, when ``clock`` (the loader's
    :class:`ReportClock`) says: the report ``report(**figures(), rate=...)`` builds, with the
    sample rate. From a thread of its own with its own connection (ZeroMQ sockets belong to one thread).
    A reply that asks the stream to let go of its pins (``let_go``) gets ``let_go(connection)`` called.

    ``figures`` (a stream's method) is held weakly, and ``connect`` only until the thread has
    connected: a stream nobody holds any more (an ``iter(loader)`` dropped before its first
    sample, whose ``finally`` never runs, once its loader is dropped too or iterated again) is
    collected, and its reports end with it, so the agent lets its reader go."""

    def __init__(
        self,
        connect: Callable[[float], AgentConnection],
        report: Callable[..., ReportMessage],
        figures: Callable[[], dict[str, Any]],
        clock: ReportClock,
        let_go: Callable[[AgentConnection], None],
    ) -> None:
        self.report, self.clock = report, clock
        self._connect: Callable[[float], AgentConnection] | None = connect  # until the thread has connected
        self.figures = weakref.WeakMethod(figures)
        self.let_go = weakref.WeakMethod(let_go)  # when the agent asks (a stream's method, as figures)
        self.run = ""  # the agent run its connection proved last (read by the stream's thread)
        self._handed_out = 0  # samples the stream had handed out when last asked (see _samples)
        self.forgotten = False  # the agent answered need_hello: it dropped the reader (the stream's thread pings)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="wdscache-report", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        connect, self._connect = self._connect, None
        assert connect is not None
        conn = connect(REPORT_TIMEOUT)
        del connect  # (a loader's method: held on, it would hold the loader, and so the stream, alive)
        clock = self.clock
        wait = clock.start(self, self._samples)
        try:
            while not self._stop.wait(wait):
                of = self.figures()
                if of is None:
                    return  # the stream was dropped unclosed
                figures = of()
                del of  # (not held across the wait: the stream may go meanwhile)
                rate = clock.tick()
                wait = clock.due()
                try:
                    reply = conn.request(self.report(**figures, rate=round(rate, 1)))
                except (AgentUnavailableError, NotTrustedError):
                    continue
                else:
                    self.forgotten = self.forgotten or reply.get("need_hello") is True
                    if reply.get("let_go") is True and (let_go := self.let_go()) is not None:
                        let_go(conn)
                        del let_go
                finally:
                    self.run = conn.run
        finally:  # (the stream's close() joins us: its samples are all handed out by then)
            clock.ended(self, self._samples())
            conn.close()

    def _samples(self) -> int:
        """What the stream handed out so far (once it is gone, what it had when last asked)."""
        of = self.figures()
        if of is not None:
            self._handed_out = int(of()["samples"])
        return self._handed_out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(REPORT_EVERY + REPORT_TIMEOUT + 1.0)
