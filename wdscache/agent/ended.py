"""Consumers that left: kept a while for stats (``ended_jobs``), and what a consumer dropped as
silent takes up again when it comes back.

A consumer that said bye, or whose process ended, never comes back under its name (each epoch
of a loader is a reader of a new name). One dropped as silent (``--reader-timeout``) may: a
process stopped (SIGSTOP, ``scontrol suspend``) runs again and says hello again under the
same name (see :mod:`wdscache.training.restarts`).

Guarantees (main loop only; :class:`~wdscache.agent.readers.Readers` owns one):

- at most :data:`MAX_ENDED` consumers are kept, each for :data:`ENDED_KEPT` seconds, the
  oldest going first;
- a consumer dropped as silent keeps, as long as it is kept, what its rank's totals counted of
  its reports, and the agent's list it read (:meth:`EndedConsumers.lists`: the readers keep
  that list meanwhile). Back under its name, it counts on from there (its reports are
  cumulative: nothing is counted twice) and reads that list, not the agent's list as edited
  since (its epoch reads one list from start to end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..shared.logs import iso_time
from ..shared.stats import ended_jobs_view

ENDED_KEPT = 600.0  # seconds a consumer that left stays in stats with its totals
MAX_ENDED = 256  # consumers that left kept at most (the oldest go first)


@dataclass(frozen=True, slots=True)
class Dropped:
    """What a consumer dropped as silent comes back to: what its rank's totals hold of its
    reports, and the agent's list it read (None: it read a list of its own, which it sends again)."""

    counted: dict[str, float]
    list_id: str | None


class EndedConsumers:
    """The consumers that left lately, by reader name, oldest first."""

    def __init__(self) -> None:
        self.consumers: dict[str, dict[str, Any]] = {}  # name -> its last stats, "ended", "_ended"
        self._dropped: dict[str, Dropped] = {}  # of those, the ones dropped as silent

    def left(self, name: str, consumer: dict[str, Any], dropped: Dropped | None) -> None:
        """Consumer ``name`` left, its last stats ``consumer``; ``dropped``: as silent."""
        self.back(name)
        # Last, so that they stay in the order they left.
        self.consumers[name] = {
            **consumer,
            "waiting": 0.0,
            "rate": 0.0,
            "ended": iso_time(time.time()),
            "_ended": time.monotonic(),
        }
        if dropped is not None:
            self._dropped[name] = dropped
        while len(self.consumers) > MAX_ENDED:
            self._forget(next(iter(self.consumers)))

    def back(self, name: str) -> Dropped | None:
        """Consumer ``name`` said hello again: no longer ended; what it comes back to, if it was
        dropped as silent."""
        self.consumers.pop(name, None)
        return self._dropped.pop(name, None)

    def expire(self, now: float) -> None:
        """Forget those that left ENDED_KEPT before ``now`` (monotonic): a look at the oldest per call."""
        while self.consumers and now - next(iter(self.consumers.values()))["_ended"] >= ENDED_KEPT:
            self._forget(next(iter(self.consumers)))

    def lists(self) -> set[str]:
        """The agent's lists that consumers dropped as silent read (kept for their return)."""
        return {d.list_id for d in self._dropped.values() if d.list_id is not None}

    def view(self) -> dict[str, dict[str, Any]]:
        """``ended_jobs`` of the stats (:func:`~wdscache.shared.stats.ended_jobs_view`)."""
        return ended_jobs_view(self.consumers)

    def _forget(self, name: str) -> None:
        del self.consumers[name]
        self._dropped.pop(name, None)
