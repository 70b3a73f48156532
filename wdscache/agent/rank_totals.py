"""What each rank of each job received over the agent's life, all its epochs and readers together:
the ``rank_totals`` of stats, and the ``wdscache_consumer_*_total`` counters of its metrics.

Each epoch of a rank is a new consumer (a new session with the agent) whose reports count from
zero, and a rank's DataLoader workers are consumers of their own: their reports alone would
make counters that go down at each epoch. Here each report adds what it grew by since that
consumer's previous one, so what a consumer delivered stays counted once it ends or is
replaced (a hello again under its name starts its counts again).

Guarantees:

- Main loop only.
- A rank's totals never decrease while it is kept: a report lower than its consumer's
  previous one (a misbehaving client) adds nothing.
- Bounded: a rank is dropped ``RANK_TOTALS_KEPT`` (an hour) after its last report or hello
  once no consumer of it is connected (its series then leaves the metrics, and Prometheus
  takes a return from zero as a counter reset, as for a new agent); beyond ``MAX_RANK_TOTALS``
  ranks, those silent longest go first, never one a consumer reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

TOTALS = ("samples", "bytes", "wait_s")  # the report fields that are counters
RANK_TOTALS_KEPT = 3600.0  # seconds a rank no consumer reads keeps its totals after its last report
MAX_RANK_TOTALS = 4096  # ranks kept at most (but those being read)

Rank = tuple[str, str]  # (job, rank), as stats names them


@dataclass(slots=True)
class _Totals:
    figures: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOTALS, 0))
    touched: float = 0.0  # time.monotonic() of its last report or hello


class RankTotals:
    """Each rank's totals, by (job, rank)."""

    def __init__(self) -> None:
        # Least recently touched first, so that expiry looks at the front only.
        self._ranks: OrderedDict[Rank, _Totals] = OrderedDict()

    def add(self, rank: Rank, counted: dict[str, float], figures: dict[str, float]) -> None:
        """A report (``figures``; none: a hello) of a consumer of ``rank``, of which ``counted`` holds
        what its earlier reports were counted at (kept by the caller with the consumer, updated here)."""
        totals = self._ranks.pop(rank, None) or _Totals()
        self._ranks[rank] = totals  # (at the end: touched last)
        totals.touched = time.monotonic()
        for name in TOTALS:
            value = figures.get(name)
            if value is not None and value > counted.get(name, 0):
                totals.figures[name] += value - counted.get(name, 0)
                counted[name] = value

    def expire(self, reading: Callable[[], set[Rank]]) -> None:
        """Drop the ranks silent too long, or too many; ``reading()``: the ranks consumers read now."""
        now, live = time.monotonic(), None
        for _ in range(len(self._ranks)):  # (each rank looked at once at most)
            rank, totals = next(iter(self._ranks.items()))
            if now - totals.touched < RANK_TOTALS_KEPT and len(self._ranks) <= MAX_RANK_TOTALS:
                return
            live = reading() if live is None else live
            if rank in live:  # a consumer that reads but has not reported for long: kept
                totals.touched = now
                self._ranks.move_to_end(rank)
            else:
                del self._ranks[rank]

    def view(self) -> dict[str, dict[str, dict[str, float]]]:
        """{job: {rank: {samples, bytes, wait_s}}}, for stats."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (job, rank), totals in self._ranks.items():
            figures = dict(totals.figures)
            figures["wait_s"] = round(figures["wait_s"], 3)
            out.setdefault(job, {})[rank] = figures
        return out
