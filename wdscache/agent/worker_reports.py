"""The agent's side of its sample workers' reports: who they are, what they are told, what they say.

The workers themselves (processes, restarts) are :class:`~wdscache.agent.pool.WorkerPool`'s;
this part keeps the report socket each worker registered from, tells the workers
which shards to walk ahead of their reads (``index`` hints: one worker walks the shard
and its table is passed on to the others): each shard as it is published, and each
cached shard as readers come to want it (a cache the agent found at its start, whose
tables no worker holds yet); tells them to hold those walks while a reader waits for a
shard (``hold`` hints); and keeps their statistics.

Guarantees:

- Main loop only.
- A report that only our workers may send (``worker``, ``counted``, ``corrupt_copy``,
  ``walked``) is refused unless it is as :data:`~wdscache.shared.protocol.MESSAGES` lists it
  and carries the pool's secret (:meth:`check`): from
  anyone else a table or a count could misdirect reads, a registration could take
  a worker's hints.
- Hints are best effort: a worker that cannot take one at once misses it and
  walks the shard itself when asked for it.
"""

from __future__ import annotations

import hmac
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..shared.errors import ProtocolError
from ..shared.messages import Reports
from ..shared.protocol import check as check_message
from ..shared.protocol import field as get_field
from ..shared.protocol import numbers, pack
from ..shared.stats import public, silent_for, with_fraction
from ..shared.verdict import SILENT_AFTER, SUSPECT_AFTER
from .control import ControlSocket
from .pool import WorkerPool
from .worker import HOLD_MAX

INDEX_HINTS = 64  # shards lately hinted that a new worker is told to index
# While a reader waits for a shard, the workers walk nothing ahead: told to hold for this long,
# again every quarter of it while the wait lasts, and let go as soon as it ends. Long, so that
# a main loop slowed by a loaded machine does not let the hold lapse; bounded, so that a worker
# that missed the release walks again soon. The longest a worker takes: one quantity, one home.
HOLD_WALKS = HOLD_MAX
WORKER_FIELDS = ("busy_s", "requests", "samples", "bytes", "indexed", "walked", "adopted", "loaded")


class WorkerReports:
    """The registry of our workers' report sockets, their hints and their statistics."""

    def __init__(self, pool: WorkerPool, socket: ControlSocket) -> None:
        self._pool, self._socket = pool, socket
        self._idents: dict[int, bytes] = {}  # worker number -> its report socket, for hints
        self._published: deque[str] = deque(maxlen=INDEX_HINTS)  # shards lately published
        self._walker = itertools.count()  # which worker walks the next shard published
        self._wanted: set[str] = set()  # what readers wanted when last told (see wanted)
        self._stats: dict[int, dict[str, Any]] = {}  # worker number -> its last report
        self._held_at: float | None = None  # when the workers were last told to hold their walks ahead

    def check(self, header: dict[str, Any]) -> None:
        """Raise :class:`ProtocolError` unless ``header`` is a worker's report, as the protocol's table
        lists it, that carries our workers' secret (taken out of it)."""
        secret = header.get("secret")
        if not isinstance(secret, str) or not secret.isascii() or not hmac.compare_digest(secret, self._pool.secret):
            raise ProtocolError(f"{header['op']!r} is for the agent's own workers")
        check_message(header)
        del header["secret"]

    def op_worker(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        """A worker's periodic report: registers its socket (a restarted worker has a new one)."""
        i = get_field(header, "index", int)
        if not 0 <= i < len(self._pool.endpoints):
            return
        if self._idents.get(i) != ident:
            self._idents[i] = ident
            if self._held_at is not None:  # it missed the hold too, which must come before its hints
                self._socket.send(ident, pack(Reports.hold(HOLD_WALKS)))
            for url in self._published:  # it missed these hints (and the tables of them)
                self._hint(ident, url)
        report = {"index": i, **numbers(header, WORKER_FIELDS)}
        self._stats[i] = with_fraction(self._stats.get(i), report, "busy_s", "busy")

    def published(self, url: str, position: int | None = None, *, now: bool = False) -> None:
        """``url`` was just published: one worker walks it ahead, and its table goes to the others.
        That is the worker a loader asks for the shard at ``position`` of its list (the agent's list
        position, if listed there): the one whose answer its first sample of the shard waits for.
        ``now``: a reader holds it, so its walk is no speculation: first, and never held."""
        if url in self._published:
            self._published.remove(url)  # downloaded again: once is enough
        self._published.append(url)
        n = len(self._pool.endpoints)
        ident = self._idents.get((position if position is not None else next(self._walker)) % n) if n else None
        idents = list(self._idents.values())
        if ident is None and idents:
            ident = idents[next(self._walker) % len(idents)]
        if ident is not None:
            self._hint(ident, url, now=now)

    def wanted(self, urls: list[str], cached: Callable[[str], bool], position: Callable[[str], int | None]) -> None:
        """Readers' windows hold ``urls`` now: those that came into them since the last call
        and are ``cached`` are walked ahead as a shard just published is (one that came in
        while downloading is, when published). The workers' tables live in their memory,
        so a cache found at the agent's start, or shards whose tables a worker let go, would
        otherwise be walked when a read of them waits; a worker told of a shard whose table
        it holds only looks at the file. Nothing is hinted until every worker registered:
        each shard is then walked by the worker a loader asks for it, the walks shared out."""
        if len(self._idents) < len(self._pool.endpoints):
            return
        for url in urls:
            if url not in self._wanted and cached(url):
                self.published(url, position(url))
        self._wanted = set(urls)

    def hold_walks(self, hold: bool) -> None:
        """Whether a reader waits for a shard (its download, or its budget), once per step of the
        agent: while one does, the workers hold their walks ahead (speculative work), so that the
        CPU goes to what it waits for; once none does, they are let go at once."""
        now = time.monotonic()
        if hold:
            if self._held_at is not None and now - self._held_at < HOLD_WALKS / 4:
                return
            self._held_at = now
            seconds = HOLD_WALKS
        elif self._held_at is None:
            return
        else:
            self._held_at, seconds = None, 0.0
        message = pack(Reports.hold(seconds))
        for ident in self._idents.values():
            self._socket.send(ident, message)

    def pass_on(self, sender: bytes, header: dict[str, Any], frames: list[Any]) -> None:
        """A worker's table of a shard it walked (``walked``), to the other workers."""
        self.check(header)
        message = pack(header, *frames)
        for ident in self._idents.values():
            if ident != sender:
                self._socket.send(ident, message)  # one that misses it walks the shard itself

    def _hint(self, ident: bytes, url: str, *, now: bool = False) -> None:
        self._socket.send(ident, pack(Reports.index(url, now=now)))

    def view(self) -> list[dict[str, Any]]:
        """Each worker's last report, for stats (a worker that never reported: its number only); one
        silent for SUSPECT_AFTER is ``quiet_s`` (two reports missed: the verdict names it while a
        rank waits); for SILENT_AFTER (stuck on a request, or stopped), ``silent_s`` and counted busy."""
        now, out = time.monotonic(), []
        for i in range(len(self._pool.endpoints)):
            report = self._stats.get(i, {"index": i})
            view, silent = public(report), silent_for(report, now)
            if silent > SUSPECT_AFTER:
                view["quiet_s"] = round(silent, 1)
            if silent > SILENT_AFTER:
                view.update(busy=1.0, silent_s=round(silent, 1))
            out.append(view)
        return out
