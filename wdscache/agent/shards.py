"""The shards the agent is busy with: one :class:`Shard` record each, in one table by URL.

A shard has a record while something refers to it: a reader holds it pinned, waits for it
or asked for it, it downloads or is being revalidated, a read found its copy damaged (until
a copy of it reads fine), or it failed. A cached shard nobody holds, with nothing pending,
has no record (what is on disk is the index's, :class:`~wdscache.shared.index.ShardState`), so a
million listed shards cost nothing here: :meth:`Shards.settle` drops a record as soon as
nothing refers to it.

A record's :class:`Phase` says what the agent is doing about the shard. It changes only
through :meth:`Shards.move`, by these transitions (any other raises
:class:`IllegalTransition`: a bug in the agent, never a client's doing):

============  ==============================================================  ============
from          on                                                              to
============  ==============================================================  ============
IDLE          opened, not cached: its download is wanted                      WANTED
IDLE          opened, or in a reader's window, cached by an earlier run       REVALIDATING
              (``--revalidate``): its source is asked whether it is current
IDLE          a read found its cached copy damaged                            SUSPECT
IDLE          its download failed, or its copy was damaged again after it     FAILED
              was downloaded once more
REVALIDATING  found current: its waiters get it                               IDLE
REVALIDATING  changed on its source, cannot be told, or gone: downloaded      WANTED
REVALIDATING  a read found its cached copy damaged                            SUSPECT
REVALIDATING  its copy was damaged again after it was downloaded once more    FAILED
REVALIDATING  downloaded anew (its copy vanished and it was downloaded)       IDLE
WANTED        downloaded: its waiters get it                                  IDLE
WANTED        left every list: its waiters are told                           IDLE
WANTED        its download failed for good: its waiters are told why          FAILED
SUSPECT       nobody holds it: its copy removed, downloaded once more         WANTED
SUSPECT       downloaded anew (its damaged copy was evicted meanwhile)        IDLE
SUSPECT       a download of it failed (its damaged copy evicted meanwhile)    FAILED
FAILED        asked for once ``FAILED_RETRY_AFTER`` passed: downloaded again  WANTED
FAILED        downloaded after all (a prefetch retried it)                    IDLE
============  ==============================================================  ============

A record also holds the shard's download (or revalidation) in flight, with what the download
policy notes of it and its wait for space: a :class:`Slot`, from the moment its task is queued
until the main loop has recorded its end (:class:`~wdscache.agent.downloads.Downloads` starts and
ends them, through :meth:`Shards.start_download` and :meth:`Shards.end_download`). A prefetch of
a shard nobody asked for has a record for as long as it runs.

One fact about a shard is kept beside its record, not in it:
:attr:`ShardCache.pins <wdscache.agent.cache.ShardCache.pins>` counts every pin of a shard in
one number per URL, the readers' (counted here too, by reader) and a revalidation's, which is no
reader's: eviction, the ``evict`` op and stats read that number, and the cache commands run on a
cache with no agent, so with no records.

Guarantees (main loop only):

- A record in WANTED has ``asked_at`` (when a reader first asked for it); waiters wait
  only in REVALIDATING, WANTED and SUSPECT: every move out of these answers them.
- A shard has at most one download in flight: :meth:`Shards.start_download` refuses a second.
- Pins by reader are counted here and in the cache alike (the caller pins both), and
  :meth:`Shards.held_by` names every shard a reader holds, so letting go of a reader
  gives back every pin it took.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .control import Request
from .grants import SpaceWait
from .shard_download import Download


class IllegalTransition(RuntimeError):
    """A shard's record was asked to move by a transition not in the table: a bug in the agent."""


class Phase(enum.Enum):
    """What the agent is doing about a shard (transitions in the module docstring)."""

    IDLE = "idle"  # nothing pending: cached and served, or nobody asked
    REVALIDATING = "revalidating"  # cached by an earlier run, its source being asked
    WANTED = "wanted"  # a reader asked for it: downloading, or to download
    SUSPECT = "suspect"  # its cached copy was found damaged: downloaded once more when nobody holds it
    FAILED = "failed"  # its download (or its copies) failed


TRANSITIONS: frozenset[tuple[Phase, Phase]] = frozenset(
    {
        (Phase.IDLE, Phase.WANTED),
        (Phase.IDLE, Phase.REVALIDATING),
        (Phase.IDLE, Phase.SUSPECT),
        (Phase.IDLE, Phase.FAILED),
        (Phase.REVALIDATING, Phase.IDLE),
        (Phase.REVALIDATING, Phase.WANTED),
        (Phase.REVALIDATING, Phase.SUSPECT),
        (Phase.REVALIDATING, Phase.FAILED),
        (Phase.WANTED, Phase.IDLE),
        (Phase.WANTED, Phase.FAILED),
        (Phase.SUSPECT, Phase.WANTED),
        (Phase.SUSPECT, Phase.IDLE),
        (Phase.SUSPECT, Phase.FAILED),
        (Phase.FAILED, Phase.WANTED),
        (Phase.FAILED, Phase.IDLE),
    }
)


@dataclass(slots=True)
class Waiter:
    """A request for a shard held until it is cached (or, with ``while_downloading``, readable as it downloads)."""

    request: Request
    reader: str
    while_downloading: bool = False


@dataclass(slots=True, eq=False)
class Slot:
    """A shard's download (or revalidation) in flight, and what the download policy notes of it."""

    download: Download
    unwanted_since: float | None = None  # when its shard left every window (see Downloads.schedule)
    space: SpaceWait = field(default_factory=SpaceWait)  # why it waits for space, if it does
    counted: int | None = None  # samples a worker counted in it once published, before its end was recorded


@dataclass(slots=True, eq=False)
class Shard:
    """One shard the agent is busy with."""

    url: str
    phase: Phase = Phase.IDLE
    pins: dict[str, int] = field(default_factory=dict)  # reader -> how many times it holds it open
    waiters: list[Waiter] = field(default_factory=list)
    asked_at: float | None = None  # when a reader first asked for it (time.monotonic()), until answered
    asked_by: set[str] = field(default_factory=set)  # the readers that asked for it, while asked_at is set
    refetched: bool = False  # downloaded once more for damage, and no copy of it read fine since
    outdated: str | None = None  # SUSPECT: how its copy is unlike its index (None: found damaged)
    failed_at: float = 0.0  # FAILED: when (its reason is the index's)
    corrupt: bool = False  # FAILED: the shard is bad (copies found corrupt, or unlike its index), not its download
    download: Slot | None = None  # its download (or revalidation), from queued until its end is recorded

    def idle(self) -> bool:
        """Nothing refers to it: its record can go."""
        return (
            self.phase is Phase.IDLE
            and not self.pins
            and not self.waiters
            and self.asked_at is None
            and not self.refetched
            and self.download is None
        )


class Shards:
    """The records by URL, made on demand and dropped once idle; the shards each reader holds."""

    def __init__(self) -> None:
        self._by_url: dict[str, Shard] = {}
        self._held: dict[str, dict[str, None]] = {}  # reader -> the shards it holds pinned, in the order pinned
        self._downloading: dict[str, Shard] = {}  # the records with a download in flight, in the order started

    def get(self, url: str) -> Shard | None:
        return self._by_url.get(url)

    def record(self, url: str) -> Shard:
        """``url``'s record, made (IDLE) if it has none; :meth:`settle` it once done with it."""
        shard = self._by_url.get(url)
        if shard is None:
            shard = self._by_url[url] = Shard(url)
        return shard

    def settle(self, shard: Shard) -> None:
        """Drop ``shard``'s record if nothing refers to it any more."""
        if shard.idle():
            self._by_url.pop(shard.url, None)

    def __len__(self) -> int:
        return len(self._by_url)

    def __iter__(self) -> Iterator[Shard]:
        return iter(list(self._by_url.values()))

    @staticmethod
    def move(shard: Shard, to: Phase) -> None:
        """Move ``shard`` to ``to`` by a transition of the table (else :class:`IllegalTransition`)."""
        if (shard.phase, to) not in TRANSITIONS:
            raise IllegalTransition(f"{shard.url}: no transition from {shard.phase.name} to {to.name}")
        shard.phase = to
        if to is not Phase.SUSPECT:
            shard.outdated = None  # (a fact of the SUSPECT phase: it goes with it, however it is left)

    def waited_for_by(self, job_of: Callable[[str], str | None]) -> dict[str, set[str]]:
        """The shards readers wait for (asked for, or checked against their source with readers
        waiting), each with the jobs of those readers (``job_of``: a reader's job; None: it said none)."""
        out: dict[str, set[str]] = {}
        for shard in self._by_url.values():
            if shard.asked_at is not None or (shard.phase is Phase.REVALIDATING and shard.waiters):
                readers = shard.asked_by | {w.reader for w in shard.waiters}
                out[shard.url] = {job for job in map(job_of, readers) if job is not None}
        return out

    def demanded(self) -> list[str]:
        """The shards readers asked for and wait for, oldest first."""
        asked = [s for s in self._by_url.values() if s.asked_at is not None]
        return [s.url for s in sorted(asked, key=lambda s: s.asked_at or 0.0)]

    # -- downloads in flight -------------------------------------------------------------

    def start_download(self, download: Download) -> Slot:
        """Record ``download`` as its shard's one download in flight."""
        shard = self.record(download.url)
        if shard.download is not None:
            raise IllegalTransition(f"{download.url}: a second download while one is in flight")
        shard.download = slot = Slot(download)
        self._downloading[download.url] = shard
        return slot

    def end_download(self, url: str) -> Slot | None:
        """The end of ``url``'s download is recorded: its record holds it no more."""
        shard = self._downloading.pop(url, None)
        if shard is None:
            return None
        slot, shard.download = shard.download, None
        self.settle(shard)
        return slot

    def slot(self, url: str) -> Slot | None:
        """``url``'s download in flight, if any."""
        shard = self._downloading.get(url)
        return shard.download if shard is not None else None

    def slots(self) -> list[Slot]:
        """The downloads in flight, in the order they started."""
        return [shard.download for shard in self._downloading.values() if shard.download is not None]

    def downloads(self) -> int:
        """How many downloads are in flight."""
        return len(self._downloading)

    # -- pins -------------------------------------------------------------------------

    def pin(self, shard: Shard, reader: str) -> None:
        shard.pins[reader] = shard.pins.get(reader, 0) + 1
        self._held.setdefault(reader, {})[shard.url] = None

    def unpin(self, shard: Shard, reader: str) -> bool:
        """One pin of ``reader`` on ``shard`` let go; False if it held none."""
        count = shard.pins.get(reader, 0)
        if count <= 0:
            return False
        if count > 1:
            shard.pins[reader] = count - 1
        else:
            del shard.pins[reader]
            held = self._held[reader]
            del held[shard.url]
            if not held:
                del self._held[reader]
        return True

    def held_by(self, reader: str) -> list[Shard]:
        """The shards ``reader`` holds pinned."""
        return [self._by_url[url] for url in self._held.get(reader, ())]

    def holds(self, reader: str) -> int:
        """How many shards ``reader`` holds pinned."""
        return len(self._held.get(reader, ()))
