"""Prefetches (``wdscache prefetch``) in the agent: each one's shards, where each stands, what changed.

A prefetch is a session the command names: it hands its URLs over in pages (``prefetch``),
polls (``prefetch_status``: counts, bytes, and only the shards whose state changed since
its last poll, so a poll costs what changed, not the length of the list) and ends
(``prefetch_end``, or ``EXPIRE_AFTER`` seconds without a word from it).

Each shard asked has a :class:`Asked` state. Transitions:

- PENDING -> CACHED: downloaded (by this prefetch or for a reader);
- PENDING -> FAILED: its download failed, or the budget cannot take it (below);
- CACHED -> FAILED: removed from the cache meanwhile (a reader's shards needed the room,
  ``wdscache evict``...), with the reason; it is not downloaded again;
- FAILED -> CACHED: cached after all (a reader's download).

Guarantees (main loop only):

- Each shard is downloaded at most once per prefetch: a shard leaves PENDING for good.
- The shards a prefetch holds (its CACHED ones, whether cached before it began or by it)
  are never evicted for another shard only prefetches want (:class:`~wdscache.agent.grants.PrefetchHold`);
  readers still come first: their downloads may evict them (after every other shard they may).
- Once a shard only prefetches want does not fit in the budget beside what the
  prefetches hold and what readers hold (pinned, or in their windows), it fails, and so
  does every shard of its prefetch not downloading yet, with a reason naming the budget.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ..shared.config import format_size
from ..shared.index import ShardState
from ..shared.logs import get_logger
from ..shared.protocol import PAGE_BYTES
from .cache import ShardCache
from .downloads import Downloads
from .grants import NoRoom, PrefetchHold

log = get_logger(__name__)

MAX_PENDING = 1_000_000  # shards waiting to be prefetched at most, over every prefetch
MAX_CHANGES = 4096  # changes in one status reply at most (and at most PAGE_BYTES of them)
EXPIRE_AFTER = 60.0  # seconds a prefetch is kept without a word from its command (it polls every fraction of one)


class Asked(enum.Enum):
    """Where a shard a prefetch asked for stands (transitions in the module docstring)."""

    PENDING = "pending"
    CACHED = "cached"
    FAILED = "failed"


@dataclass
class Prefetch:
    """One prefetch: its shards in the order asked, and what changed since its last poll."""

    name: str
    seen: float  # time.monotonic() of its last request
    states: dict[str, Asked] = field(default_factory=dict)
    pending: dict[str, None] = field(default_factory=dict)  # the PENDING ones, in the order asked
    sizes: dict[str, int] = field(default_factory=dict)  # of the CACHED ones
    errors: dict[str, str] = field(default_factory=dict)  # of the FAILED ones
    changed: dict[str, None] = field(default_factory=dict)  # shards whose state changed since the last poll
    cached_bytes: int = 0

    def set(self, url: str, state: Asked, *, size: int = 0, error: str = "") -> None:
        """Move ``url`` to ``state`` (its size when CACHED, its reason when FAILED)."""
        old = self.states.get(url)
        if old is Asked.CACHED:
            self.cached_bytes -= self.sizes.pop(url)
        self.pending.pop(url, None)
        self.errors.pop(url, None)
        self.states[url] = state
        if state is Asked.PENDING:
            self.pending[url] = None
            return
        if state is Asked.CACHED:
            self.sizes[url] = size
            self.cached_bytes += size
        else:
            self.errors[url] = error
        self.changed[url] = None


class Prefetches:
    """Every prefetch under way: their ops' work, their wishes, and what the cache tells them."""

    def __init__(self, cache: ShardCache, downloads: Downloads) -> None:
        self._cache, self._downloads = cache, downloads
        self._prefetches: dict[str, Prefetch] = {}
        self._asking: dict[str, list[Prefetch]] = {}  # url -> the prefetches that asked for it
        self._held: dict[str, int] = {}  # url -> size, of the shards some prefetch holds (CACHED in it)
        self._held_bytes = 0
        self._pending = 0  # PENDING shards over every prefetch

    # -- ops --------------------------------------------------------------------

    def take(self, name: str, urls: Iterable[str], *, retry: bool) -> int:
        """Add ``urls`` to prefetch ``name`` (made on its first page); ``retry`` forgets earlier
        failures of them. Returns how many shards it asks for in all."""
        p = self._prefetches.get(name)
        if p is None:
            p = self._prefetches[name] = Prefetch(name, time.monotonic())
            log.info("prefetch %s begins", name)
        p.seen = time.monotonic()
        index = self._cache.index
        for url in urls:
            if url in p.states:
                continue
            if retry:
                self._cache.forget_failure(url)
            self._asking.setdefault(url, []).append(p)
            rec = index.get(url)
            if rec is not None and rec.state is ShardState.CACHED:
                p.set(url, Asked.CACHED, size=rec.size)
                self._hold(url, rec.size)
            elif rec is not None and rec.state is ShardState.FAILED:
                p.set(url, Asked.FAILED, error=rec.error or "failed")
            else:
                p.set(url, Asked.PENDING)
                self._pending += 1
        return len(p.states)

    def room_for(self, n: int) -> bool:
        """May ``n`` more shards wait to be prefetched (at most :data:`MAX_PENDING`)."""
        return self._pending + n <= MAX_PENDING

    def status(self, name: str) -> dict[str, Any] | None:
        """Where prefetch ``name`` stands (None: no such prefetch): counts, bytes, why it waits,
        and the shards whose state changed since the last status (``more``: not all fitted)."""
        p = self._prefetches.get(name)
        if p is None:
            return None
        p.seen = time.monotonic()
        changes, size = [], 0
        for url in list(islice(p.changed, MAX_CHANGES)):  # a bounded copy: the rest wait for the next status
            if size >= PAGE_BYTES:
                break
            del p.changed[url]
            change: dict[str, Any] = {"url": url, "state": p.states[url].value}
            if url in p.sizes:
                change["size"] = p.sizes[url]
            else:  # only CACHED and FAILED ones change
                change["error"] = p.errors[url]
            changes.append(change)
            size += len(url) + len(change.get("error", "")) + 64
        written, waiting = 0, None
        total: int | None = 0
        running = [u for u in self._downloads.running() if u in p.pending]
        for url in running:
            progress = self._downloads.progress(url)
            written += progress.get("written", 0)
            total = None if total is None or progress.get("total") is None else total + progress["total"]
            waiting = waiting or self._downloads.space_wait(url)
        n_cached = len(p.sizes)
        return {
            "total": len(p.states),
            "cached": n_cached,
            "failed": len(p.errors),
            "pending": len(p.pending),
            "bytes_cached": p.cached_bytes,
            "bytes_written": written,
            # Known once every shard left is downloading (each one's size is known then).
            "bytes_total": None if total is None or len(running) < len(p.pending) else p.cached_bytes + total,
            "waiting_for_space": waiting,
            "changes": changes,
            "more": bool(p.changed),
        }

    def end(self, name: str) -> bool:
        """Forget prefetch ``name`` (its shards stay cached, held no more); False if unknown."""
        p = self._prefetches.pop(name, None)
        if p is None:
            return False
        for url, state in p.states.items():
            asking = self._asking[url]
            asking.remove(p)
            if not asking:
                del self._asking[url]
            if state is Asked.CACHED and not any(o.states[url] is Asked.CACHED for o in asking):
                self._unhold(url)
        self._pending -= len(p.pending)
        log.info("prefetch %s ends: %d of %d shard(s) cached", name, len(p.sizes), len(p.states))
        return True

    def expire(self) -> None:
        """End the prefetches whose command has not asked anything for :data:`EXPIRE_AFTER` seconds."""
        now = time.monotonic()
        for p in [p for p in self._prefetches.values() if now - p.seen > EXPIRE_AFTER]:
            log.warning("prefetch %s: its command is silent for %.0f s; ending it", p.name, now - p.seen)
            self.end(p.name)

    # -- what they want -----------------------------------------------------------

    def wanted(self, n: int) -> list[str]:
        """The shards to prefetch next: every one downloading, and ``n`` more not started,
        in the order asked (prefetch after prefetch). Costs about ``n``, not the lists' length."""
        running = set(self._downloads.running())
        out: dict[str, None] = {u: None for u in running if u in self._asking and self.asks_for(u)}
        more = 0
        for p in self._prefetches.values():
            for url in p.pending:
                if more >= n:
                    return list(out)
                if url not in running and url not in out:
                    out[url] = None
                    more += 1
        return list(out)

    def hold(self, only: Collection[str]) -> PrefetchHold:
        """What the prefetches ask of the budget, ``only`` being the shards no reader wants."""
        return PrefetchHold(only=only, held=self._held, held_bytes=self._held_bytes)

    def queued(self) -> int:
        """Shards waiting to be prefetched, not downloading yet."""
        return self._pending - sum(1 for u in self._downloads.running() if self.asks_for(u))

    def asks_for(self, url: str) -> bool:
        """True while some prefetch waits for ``url`` (PENDING in it)."""
        return any(p.states[url] is Asked.PENDING for p in self._asking.get(url, ()))

    # -- what happens to their shards ---------------------------------------------------

    def no_room(self, given_up: NoRoom) -> None:
        """A download only prefetches wanted does not fit: it fails, and every shard of its
        prefetches not downloading yet, with a reason naming the budget."""
        running = set(self._downloads.running())
        for p in list(self._asking.get(given_up.url, ())):
            if p.states[given_up.url] is not Asked.PENDING:
                continue
            reason = self._budget_reason(p, given_up)
            self._set(p, given_up.url, Asked.FAILED, error=reason)
            rest = [u for u in p.pending if u not in running]
            for url in rest:
                self._set(p, url, Asked.FAILED, error=reason)
            if rest:
                log.info("prefetch %s: %d shard(s) fail: %s", p.name, len(rest) + 1, reason)

    def _budget_reason(self, p: Prefetch, given_up: NoRoom) -> str:
        cache = self._cache
        # Downloading with their room reserved: cached soon.
        coming = sum(1 for u, d in cache.inflight.items() if u in p.pending and u != given_up.url and d.budget.reserved)
        held = len(p.sizes) + coming
        beside = []
        if given_up.readers:
            beside.append(f"{format_size(given_up.readers)} that readers hold or read next")
        others = self._held_bytes - sum(s for u, s in p.sizes.items() if u in self._held)
        if others > 0:
            beside.append(f"{format_size(others)} that other prefetches hold")
        return (
            f"the cache budget ({format_size(cache.limit)}) holds {held} of the {len(p.states)} shard(s) asked"
            + (f" beside {' and '.join(beside)}" if beside else "")
            + "; raise --cache-size or prefetch fewer"
        )

    def cached(self, url: str, size: int) -> None:
        for p in self._asking.get(url, ()):
            self._set(p, url, Asked.CACHED, size=size)

    def failed(self, url: str, error: str) -> None:
        for p in self._asking.get(url, ()):
            if p.states[url] is not Asked.FAILED:  # told once why
                self._set(p, url, Asked.FAILED, error=error)

    def gone(self, url: str, why: str) -> None:
        for p in self._asking.get(url, ()):
            if p.states[url] is Asked.CACHED:
                self._set(p, url, Asked.FAILED, error=f"cached, then {why}")

    def _set(self, p: Prefetch, url: str, state: Asked, *, size: int = 0, error: str = "") -> None:
        old = p.states[url]
        if old is Asked.PENDING:
            self._pending -= 1
        p.set(url, state, size=size, error=error)
        if state is Asked.CACHED:
            self._hold(url, size)
        elif old is Asked.CACHED and not any(o.states[url] is Asked.CACHED for o in self._asking[url]):
            self._unhold(url)

    def _hold(self, url: str, size: int) -> None:
        self._held_bytes += size - self._held.get(url, 0)
        self._held[url] = size

    def _unhold(self, url: str) -> None:
        self._held_bytes -= self._held.pop(url, 0)
