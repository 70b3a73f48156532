"""The per-shard log lines of a cache that churns, rate-limited, and their summary a minute.

A shard downloaded again, or evicted to make room for a shard readers need, is logged at INFO:
useful when rare. Under a budget that thrashes they come by the hundred a minute and bury the
other lines; so past :data:`LOUD` of a kind in a window of :data:`WINDOW` seconds, the rest of
that window's go to DEBUG, and at the window's end one INFO line (event ``churn``) counts them
all, with what the readers need of the budget.

Guarantees (main loop only): every such event is logged, at INFO or at DEBUG; the INFO lines of a
kind plus the ``quiet_`` counts of the summaries add up to every event of that kind (a window cut
short by the agent's stop is summarised then).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..shared.config import format_size
from ..shared.logs import event, get_logger

log = get_logger(__name__)

WINDOW = 60.0  # seconds a window of counts lasts
LOUD = 10  # events of a kind logged at INFO in a window; the rest at DEBUG


class Churn(enum.Enum):
    """A kind of per-shard event that a cache too small for its readers repeats."""

    REDOWNLOADED = "redownloaded"  # a shard this cache held before, downloaded again
    EVICTED = "evicted"  # a shard evicted to make room for a shard readers need


@dataclass
class _Window:
    """The counts of one window, from its first event on."""

    start: float
    seen: dict[Churn, int] = field(default_factory=lambda: dict.fromkeys(Churn, 0))
    quiet: dict[Churn, int] = field(default_factory=lambda: dict.fromkeys(Churn, 0))


class ChurnLog:
    """Decides each churn event's log level, and logs the summary of a window that had quiet ones."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._window: _Window | None = None

    def level(self, kind: Churn) -> int:
        """Count one event of ``kind``: the level to log it at (INFO for the first :data:`LOUD` of a window)."""
        if self._window is None:
            self._window = _Window(self._clock())
        w = self._window
        w.seen[kind] += 1
        if w.seen[kind] <= LOUD:
            return logging.INFO
        w.quiet[kind] += 1
        return logging.DEBUG

    def tick(self, need: Callable[[], int], limit: int, *, last: bool = False) -> None:
        """At a window's end (or the ``last`` call, at the agent's stop) log its summary if some of
        its events went to DEBUG. ``need()``: the bytes readers hold at once (0: not known);
        ``limit``: the budget (--cache-size)."""
        w = self._window
        if w is None:
            return
        took = self._clock() - w.start
        if took < WINDOW and not last:
            return
        self._window = None
        if not any(w.quiet.values()):
            return  # every line was logged at INFO
        again, evicted = w.seen[Churn.REDOWNLOADED], w.seen[Churn.EVICTED]
        readers_need = need()
        needs = f"; readers need {format_size(readers_need)} at once" if readers_need else ""
        event(
            log,
            "churn",
            "%s: %d shard(s) downloaded again and %d evicted to make room for a shard readers need in the last %.0f s "
            "(%d and %d of those lines at DEBUG)%s, --cache-size %s",
            "the cache thrashes" if again else "shards cycle through the cache",
            again,
            evicted,
            took,
            w.quiet[Churn.REDOWNLOADED],
            w.quiet[Churn.EVICTED],
            needs,
            format_size(limit),
            seconds=round(took, 1),
            redownloaded=again,
            evicted=evicted,
            quiet_redownloaded=w.quiet[Churn.REDOWNLOADED],
            quiet_evicted=w.quiet[Churn.EVICTED],
            need=readers_need or None,
            budget=limit,
        )
