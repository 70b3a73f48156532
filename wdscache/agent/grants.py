"""Budget grants: what download threads ask of the budget, answered by the main loop.

A download thread that needs budget posts a :class:`~wdscache.agent.events.Grant` and blocks
on it (:meth:`~wdscache.agent.downloads.Downloads.reserve`); :class:`Grants` keeps the ones not
granted yet and answers them at each schedule, reserving through the
:class:`~wdscache.agent.cache.ShardCache` (which evicts to make room).

Guarantees (main loop only; a grant is shared with its thread under the grant's lock):

- Budget is granted in order of urgency: demanded downloads first, then by window rank.
  A grant is taken or withdrawn, never both; one its thread withdrew is dropped, and a
  cancelled download's gets no budget while its thread withdraws it.
- A download only prefetches want (:class:`PrefetchHold`) never evicts a shard a
  prefetch holds; once it cannot fit beside them and what readers hold (pinned, or in a
  window), it is cancelled before a byte of its body is written and reported
  (:meth:`Grants.no_room`).
- Downloads that hold budget while they ask for more (growing as they go, or resumed: their
  kept partial is held) never wait for each other for ever: when every download in flight
  has waited so for ``GROWTH_GRACE``, the one that wrote least is cancelled, and its space
  goes to the others: it is not started again until another download ends (see
  :meth:`Grants.gave_way`), and the partial it keeps is removed as soon as a reservation
  needs the room (else it goes on from it later).
- A refused download says why it waits for space (:class:`SpaceWait`), for stats and
  status; it is logged once it has waited ``SPACE_LOG_AFTER``, and again only when what
  runs short changes. A granted download waits no more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ..shared.config import format_size
from ..shared.errors import FetchError
from ..shared.index import ShardState
from ..shared.logs import get_logger
from .cache import ShardCache
from .events import Grant

log = get_logger(__name__)

SPACE_LOG_AFTER = 5.0  # a download waiting for space this long is logged (short waits are routine)
GROWTH_GRACE = 1.0  # seconds every download may wait for room the others hold before one is cancelled


@dataclass(frozen=True)
class PrefetchHold:
    """What the prefetches (``wdscache prefetch``) ask of the budget: ``only``, the shards
    only they want (no reader); ``held``, the cached shards they hold (url -> size, in
    all ``held_bytes``), which a download of ``only`` never evicts."""

    only: Collection[str] = ()
    held: Mapping[str, int] = field(default_factory=dict)
    held_bytes: int = 0


NO_HOLD = PrefetchHold()  # no prefetch under way


@dataclass(frozen=True)
class NoRoom:
    """A download only prefetches want, given up: ``need`` bytes do not fit in the budget
    beside the shards prefetches hold and the ``readers`` bytes readers hold (pinned or in a window)."""

    url: str
    need: int
    readers: int


@dataclass(slots=True)
class SpaceWait:
    """Why a download waits for space now (all None while it does not)."""

    reason: str | None = None  # for stats and status
    kind: str | None = None  # what runs short: "budget", or "min-free" (the file system's free space)
    since: float | None = None  # since when it waits
    said: str | None = None  # what ran short when that was last logged

    def clear(self) -> None:
        self.reason = self.kind = self.since = self.said = None


class Grants:
    """The budget requests not granted yet, answered in order of urgency."""

    def __init__(self, cache: ShardCache) -> None:
        self._cache = cache
        self._pending: list[Grant] = []
        self._growth_stuck_since: float | None = None  # since when every download waits for growth room
        self._no_room: list[NoRoom] = []  # prefetches given up since no_room() was last called
        self._gave_way: list[str] = []  # downloads cancelled for a growth deadlock since gave_way() was last called

    def asked(self, grant: Grant) -> None:
        """A thread's budget request (answered at the next :meth:`answer`)."""
        self._pending.append(grant)

    def waiting(self) -> set[str]:
        """The shards whose downloads wait for budget."""
        return {g.download.url for g in self._pending}

    def answer(
        self,
        want: Sequence[str],
        hold: PrefetchHold,
        waits: Mapping[str, SpaceWait],
        readable_while_downloading: Callable[[str], bool],
    ) -> list[str]:
        """Grant what the budget can hold, most urgent first (``want``: the wanted shards by
        urgency; ``hold``: what prefetches ask of it); ``waits``: each download in flight's
        wait for space, updated here. Returns the shards granted that became readable while
        they download (``readable_while_downloading``)."""
        rank = {u: i for i, u in enumerate(want)}
        self._pending.sort(key=lambda g: (not g.download.demanded, rank.get(g.download.url, len(rank))))
        pending, readable = [], []
        waiting: set[str] = set()
        for g in self._pending:
            with g.lock:
                if g.withdrawn:
                    continue
                if g.download.cancel.is_set():  # its thread withdraws it: no budget for it meanwhile
                    pending.append(g)
                    continue
                prefetch_only = g.download.url in hold.only and not g.download.demanded
                try:
                    granted = self._cache.try_reserve(
                        g.download, g.total, wanted=want, prefetched=hold.held, spare_prefetched=prefetch_only
                    )
                except OverflowError as exc:
                    g.error = FetchError(g.download.url, str(exc), permanent=True)
                    granted = True
                if granted:
                    g.event.set()
                    if readable_while_downloading(g.download.url):
                        readable.append(g.download.url)
                else:
                    pending.append(g)
                    no_room = self._never_fits(g, want, hold) if prefetch_only else None
                    if no_room is not None:
                        log.info(
                            "giving up the prefetch of %s: %s do not fit beside the shards prefetches and readers hold",
                            no_room.url,
                            format_size(no_room.need),
                        )
                        g.download.cancel.set()  # before a byte of its body is written
                        self._no_room.append(no_room)
                    elif self._cache.refusal is not None and g.download.url in waits:
                        waiting.add(g.download.url)
                        _note_wait(waits[g.download.url], g.download.url, *self._cache.refusal)
        self._pending = pending
        self._break_growth_deadlock(pending, len(waits))
        for url, wait in waits.items():  # granted downloads wait no more
            if url not in waiting:
                wait.clear()
        return readable

    def _never_fits(self, g: Grant, want: Sequence[str], hold: PrefetchHold) -> NoRoom | None:
        """Why a refused download only prefetches want is to be given up, if it is: it cannot fit in
        the budget beside the shards prefetches hold, those readers hold (pinned, or in their
        windows: a reader's window wins over a prefetch's wish) and the other downloads' reservations.
        None: it waits (the file system's free space runs short, or room is being made)."""
        d, cache = g.download, self._cache
        readers = 0
        for url in set(cache.pins).union(want):
            rec = cache.index.get(url)
            if url not in hold.held and url not in hold.only and rec is not None and rec.state is ShardState.CACHED:
                readers += rec.size
        reserved = sum(o.budget.reserved for u, o in cache.inflight.items() if u != d.url)
        need = max(g.total, d.budget.needed)
        if need <= cache.limit - readers - hold.held_bytes - reserved:
            return None
        return NoRoom(d.url, need, readers)

    def no_room(self) -> list[NoRoom]:
        """The downloads only prefetches wanted given up (cancelled) since the last call (see :meth:`_never_fits`)."""
        out, self._no_room = self._no_room, []
        return out

    def gave_way(self) -> list[str]:
        """The downloads cancelled to break a growth deadlock since the last call: not to be
        started again until another download ends, or the space they let go of would go straight
        back to them (see :meth:`_break_growth_deadlock`)."""
        out, self._gave_way = self._gave_way, []
        return out

    def _break_growth_deadlock(self, pending: list[Grant], in_flight: int) -> None:
        """Downloads that grow their reservation as they go (bodies of unknown size, gzip'd shards
        being decompressed), and resumed ones (their kept partial is held from their start), hold
        budget while they ask for more: two of them can each wait for the other's. When every
        download in flight (``in_flight`` of them) waits so, the one that wrote least is cancelled
        and named by :meth:`gave_way`; the others can go on in the space it held (the partial it
        keeps is the first thing removed when they need room)."""
        growing = [g for g in pending if g.download.budget.reserved > 0 and not g.download.cancel.is_set()]
        if len(growing) < 2 or len(pending) < in_flight:
            self._growth_stuck_since = None
            return  # some download is still moving: it may free space
        now = time.monotonic()
        if self._growth_stuck_since is None:
            self._growth_stuck_since = now
        if now - self._growth_stuck_since < GROWTH_GRACE:
            return  # a reader may let go of a pin meanwhile
        self._growth_stuck_since = None
        victim = min(
            growing, key=lambda g: (g.download.demanded, g.download.progress.written + g.download.progress.expanded)
        )
        log.info(
            "cancelling %s: it and %d other download(s) each wait for space the others hold; "
            "it starts again once another download ends",
            victim.download.url,
            len(growing) - 1,
        )
        victim.download.cancel.set()
        self._gave_way.append(victim.download.url)


def _note_wait(wait: SpaceWait, url: str, kind: str, reason: str) -> None:
    """Note why ``url`` waits for space. Logged once it has waited SPACE_LOG_AFTER, and again
    only when what runs short changes (the budget, or the file system's free space)."""
    wait.reason, wait.kind = f"waiting for space: {reason}", kind
    now = time.monotonic()
    if wait.since is None:
        wait.since = now
    if wait.said != kind and now - wait.since >= SPACE_LOG_AFTER:
        log.warning("%s waits for space: %s", url, reason)
        wait.said = kind
