"""Consumers that left: their ranks kept a while for stats (``ended_jobs``), and what a consumer
dropped as silent takes up again when it comes back.

Each epoch of a loader, and each of its DataLoader workers, is a consumer of its own; what stats
shows of a job that ended is per rank: the totals of every consumer of that rank that left (its
epochs and workers), kept :data:`ENDED_KEPT` seconds from the rank's latest exit.

A consumer that said bye, or whose process ended, never comes back under its name. One dropped
as silent (``--reader-timeout``) may: a process stopped (SIGSTOP, ``scontrol suspend``) runs
again and says hello again under the same name (see :mod:`wdscache.training.restarts`).

Guarantees (main loop only; :class:`~wdscache.agent.readers.Readers` owns one):

- a rank's ended totals add up each of its consumers that left once: one dropped as silent
  that comes back is taken out of them again (it leaves again later with all its figures); a
  launch of the job again (a rank coming back, none of its consumers live, from another run of
  the script: its hello's ``launch``) starts them over;
- at most :data:`MAX_ENDED` ranks are kept, and as many consumers dropped as silent, each for
  :data:`ENDED_KEPT` seconds, the oldest going first;
- a consumer dropped as silent keeps, as long as it is kept, what its rank's totals counted of
  its reports, and the agent's list it read (:meth:`EndedConsumers.lists`: the readers keep
  that list meanwhile). Back under its name, it counts on from there (its reports are
  cumulative: nothing is counted twice) and reads that list, not the agent's list as edited
  since (its epoch reads one list from start to end).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..shared.logs import iso_time
from .rank_totals import Rank

ENDED_KEPT = 600.0  # seconds a rank whose consumers left stays in stats with its totals
MAX_ENDED = 256  # ranks that ended kept at most, and consumers dropped as silent (the oldest go first)
_TOTALS = ("samples", "bytes", "wait_s")


@dataclass(frozen=True, slots=True)
class Dropped:
    """What a consumer dropped as silent comes back to: what its rank's totals hold of its
    reports, and the agent's list it read (None: it read a list of its own, which it sends again)."""

    counted: dict[str, float]
    list_id: str | None
    consumer: dict[str, Any] = field(default_factory=dict)  # its stats as it was dropped (in its rank's ended totals)
    at: float = 0.0  # when (monotonic)


class EndedConsumers:
    """The ranks whose consumers left lately, by (job, rank), the latest exit last."""

    def __init__(self) -> None:
        # (job, rank) -> its view: totals, the latest consumer's epoch and position, "ended" (ISO
        # date); "_ended" (monotonic), "_epochs" (the epochs its consumers read), "_consumers" (how many),
        # "_launch" (the script's run of the latest)
        self.ranks: dict[Rank, dict[str, Any]] = {}
        self._dropped: dict[str, Dropped] = {}  # reader name -> what it comes back to, the oldest first

    def left(self, name: str, consumer: dict[str, Any], dropped: Dropped | None) -> None:
        """Consumer ``name`` left, its last stats ``consumer``; ``dropped`` (its counted figures and
        list): as silent."""
        self._dropped.pop(name, None)
        key = (str(consumer.get("job")), str(consumer.get("rank")))
        rank = self.ranks.pop(key, None) or {"_epochs": set(), "_consumers": 0}
        for total in _TOTALS:
            rank[total] = rank.get(total, 0) + consumer.get(total, 0)
        rank["wait_s"] = round(rank["wait_s"], 3)
        if consumer.get("epoch") is not None:  # (one dropped before its first report names none)
            rank["_epochs"].add(consumer["epoch"])
        rank["_consumers"] += 1
        rank["_launch"] = consumer.get("_launch") or rank.get("_launch")  # the script's run (see joined)
        rank.update({k: consumer[k] for k in ("epoch", "position", "world") if consumer.get(k) is not None})
        rank["gone"] = bool(consumer.get("gone"))  # the latest consumer's process ended mid-epoch (no bye)
        # The error a bye said ended its epoch: the first stays (the job's end is what it was).
        if consumer.get("end_error") is not None and rank.get("end_error") is None:
            rank["end_error"] = consumer["end_error"]
        rank.update(
            seen=consumer.get("seen"),
            ended=iso_time(time.time()),
            _ended=time.monotonic(),
        )
        self.ranks[key] = rank  # last: the latest exit
        if dropped is not None:
            self._dropped[name] = Dropped(dropped.counted, dropped.list_id, consumer, time.monotonic())
        while len(self.ranks) > MAX_ENDED:
            del self.ranks[next(iter(self.ranks))]
        while len(self._dropped) > MAX_ENDED:
            del self._dropped[next(iter(self._dropped))]

    def back(self, name: str) -> Dropped | None:
        """Consumer ``name`` said hello again: what it comes back to, if it was dropped as silent
        (and is taken out of its rank's ended totals: it counts as live again)."""
        dropped = self._dropped.pop(name, None)
        if dropped is None:
            return None
        key = (str(dropped.consumer.get("job")), str(dropped.consumer.get("rank")))
        rank = self.ranks.get(key)
        if rank is not None:
            rank["_consumers"] -= 1
            if rank["_consumers"] <= 0:
                del self.ranks[key]
            else:
                for total in _TOTALS:
                    rank[total] = round(rank[total] - dropped.consumer.get(total, 0), 3)
        return dropped

    def joined(self, job: str, rank: int, launch: str | None) -> None:
        """A consumer of the script's run ``launch`` (its hello's: None, not told) joins as ``rank``
        of ``job`` while none of that rank is live. If the rank's ended totals are of another run
        (a script run again under the same name, as every run without torchrun is job
        ``default``), they are let go, and this run's make a record of their own as its consumers
        leave. DataLoader workers of one run, one after another, are one run."""
        key = (job, str(rank))
        kept = self.ranks.get(key)
        if kept is not None and launch is not None and kept.get("_launch") not in (None, launch):
            del self.ranks[key]

    def said_bye(
        self,
        name: str,
        figures: dict[str, float],
        count: Callable[[Rank, dict[str, float], dict[str, float]], None],
        end: dict[str, str],
    ) -> None:
        """Consumer ``name``, dropped as silent, said bye with its final ``figures`` (and ``end``: the
        error that ended its epoch, if one did) without saying hello again (it held all it still had to hand out):
        they ``count`` for its rank (as :meth:`~wdscache.agent.rank_totals.RankTotals.add`), from
        what was counted of it, once."""
        if not figures:  # (a bye without totals leaves it as it was dropped, in its rank's ended totals)
            return
        dropped = self.back(name)
        if dropped is None:
            return
        consumer = {**dropped.consumer, **figures, **end}
        count((str(consumer.get("job")), str(consumer.get("rank"))), dict(dropped.counted), figures)
        self.left(name, consumer, None)

    def expire(self, now: float) -> None:
        """Forget what ended ENDED_KEPT before ``now`` (monotonic): looks at the oldest only."""
        while self.ranks and now - next(iter(self.ranks.values()))["_ended"] >= ENDED_KEPT:
            del self.ranks[next(iter(self.ranks))]
        while self._dropped and now - next(iter(self._dropped.values())).at >= ENDED_KEPT:
            del self._dropped[next(iter(self._dropped))]

    def lists(self) -> set[str]:
        """The agent's lists that consumers dropped as silent read (kept for their return)."""
        return {d.list_id for d in self._dropped.values() if d.list_id is not None}

    def view(self) -> dict[str, dict[str, Any]]:
        """``ended_jobs`` of the stats: {job: {rank: {samples, bytes, wait_s (over its consumers that
        left), epochs (how many they read), epoch, position and world (the latest's), ended, gone
        (the latest's process ended without a bye: mid-epoch), end_error (the first error a bye said
        ended an epoch), ...}}}."""
        jobs: dict[str, dict[str, Any]] = {}
        for (job, rank), kept in self.ranks.items():
            view = {k: v for k, v in kept.items() if not k.startswith("_")}
            jobs.setdefault(job, {})[rank] = {
                **view,
                "rate": 0.0,
                "waiting": 0.0,
                "starved": None,
                "epochs": len(kept["_epochs"]),
            }
        return jobs
