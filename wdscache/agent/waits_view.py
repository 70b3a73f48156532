"""The shards readers wait for, as stats' agent view counts them (in all and by job), and why their
downloads hold them up: waiting for a slot, for room in the budget, or for a source that sends nothing.

Main loop only. What the verdict makes of the counts is :mod:`wdscache.shared.verdict`'s.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

from ..shared.index import Index
from ..shared.verdict import SENDS_NOTHING_AFTER, job_counts
from .shards import Shards


class SourceSilence:
    """Since when each download in flight got no byte from its source (sampled by the main loop
    every step: a download's ``fetched`` only grows while bytes come)."""

    def __init__(self, shards: Shards) -> None:
        self._shards = shards
        self._since: dict[str, tuple[int, float]] = {}  # url -> (bytes fetched, since when that many)

    def sample(self) -> None:
        now, since = time.monotonic(), {}
        for slot in self._shards.slots():
            d = slot.download
            was = self._since.get(d.url)
            since[d.url] = was if was is not None and was[0] == d.progress.fetched else (d.progress.fetched, now)
        self._since = since  # (a download that ended is forgotten with it)

    def sends_nothing(self) -> set[str]:
        """The downloads that got no byte for :data:`SENDS_NOTHING_AFTER` seconds while nothing of the
        agent's holds them (room, open files) and no failed attempt waits out its backoff: their
        source accepted and sends nothing."""
        now, out = time.monotonic(), set()
        for slot in self._shards.slots():
            d, was = slot.download, self._since.get(slot.download.url)
            held = slot.space.reason is not None or d.progress.fault is not None or d.progress.failing is not None
            if was is not None and not held and now - was[1] >= SENDS_NOTHING_AFTER:
                out.add(d.url)
        return out


def waits(
    waited: Mapping[str, Collection[str]], shards: Shards, index: Index, silent: Collection[str]
) -> dict[str, Any]:
    """The shards readers wait for (``waited``: url -> the jobs whose readers do), counted in all and
    by job: those whose download has not started (waiting for a download slot); those the budget
    holds up (``demanded_room``: their download waits for room in it, or this cache held them before
    and they are downloaded again: thrashing); those whose download's source sends nothing (of
    ``silent``, :meth:`SourceSilence.sends_nothing`)."""
    unstarted = {url: jobs for url, jobs in waited.items() if shards.slot(url) is None}
    room = {url: jobs for url, jobs in waited.items() if _budget_holds(url, shards, index)}
    quiet = {url: jobs for url, jobs in waited.items() if url in silent}
    return {
        "demanded": len(waited),
        "demanded_by_job": job_counts(waited),
        "demanded_queued": len(unstarted),
        "demanded_queued_by_job": job_counts(unstarted),
        "demanded_room": len(room),
        "demanded_room_by_job": job_counts(room),
        "demanded_silent": len(quiet),
        "demanded_silent_by_job": job_counts(quiet),
    }


def _budget_holds(url: str, shards: Shards, index: Index) -> bool:
    """Whether the budget holds up ``url`` (waited for): its download waits for room in it, or the
    cache held it before (its samples were counted: it was evicted and is fetched again)."""
    slot = shards.slot(url)
    return (slot is not None and slot.space.kind == "budget") or url in index.counts
