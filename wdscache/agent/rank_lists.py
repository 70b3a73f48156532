"""The list each rank of a job reads in an epoch: a rank whose list differs from its fellows' is told.

The ranks of a job split each epoch between them, every rank from the list it reads. Ranks
that read different lists (one its ``urls=``, another the agent's list; ``urls=`` in another
order) would each take their share of another sequence: samples repeated and samples never
seen, and unequal counts, on which a data-parallel job hangs. On one node nothing else
compares them (several nodes compare over the process group, see
:mod:`wdscache.training.node_lists`), so the agent does, at hello, and warns: it cannot refuse
them, since two launches of one job name (torchrun's default run id, ``none``, is every
non-standalone launch's) or loaders the ranks make in another order look the same to it.

Guarantees (main loop only; :class:`~wdscache.agent.readers.Readers` owns one):

- A hello of rank R of job J starting epoch E with loader L, to read list X, is warned about
  (once for each two lists; the hello is answered as before) while a live reader (one that
  reported within ``SILENT_AFTER``, as the world-size check counts ranks) of another rank of
  J, E and L reads another list. A job whose ranks ended, were killed or hang is launched anew:
  its next launch may read any list.
- Readers of one rank are not compared: two processes as rank 0 of the same job name (two
  notebooks with the default name) each read their own list.
- ``loader``: the loader's number in its process. A job's ranks make their loaders in the
  same order, so a training and a validation loader of one job read their lists side by side.
- Only lists that share a shard are a mismatch (``overlap``): lists with none in common are
  another loader's of the job (a validation set), however the ranks numbered their loaders
  (one that only rank 0 makes, say).
- Bounded: a reader's record goes when it goes; at most MAX_WARNED pairs of lists are remembered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..shared.logs import event, get_logger
from ..shared.stats import silent_for
from ..shared.urls import Urls
from ..shared.verdict import SILENT_AFTER

log = get_logger(__name__)

MAX_WARNED = 1024  # pairs of lists warned about, kept so as not to warn again
OVERLAP_SAMPLED = 1000  # URLs of a list looked up in another's to tell whether they share shards


def share_a_shard(a: Urls, b: Urls) -> bool:
    """Whether lists ``a`` and ``b`` share a shard: some of OVERLAP_SAMPLED URLs spread over the
    shorter is in the longer (a bounded look, in the main loop; a list in another order, or a part
    of the other, is found)."""
    short, long = sorted((a, b), key=len)
    step = max(1, len(short) // OVERLAP_SAMPLED)
    return any(long.position(short[i]) >= 0 for i in range(0, len(short), step))


def live(consumer: dict[str, Any]) -> bool:
    """Whether ``consumer`` (its hello or last report) reported lately: a killed rank's reader lingers
    until --reader-timeout, and must not block an elastic restart (another world size, another list)."""
    return silent_for(consumer, time.monotonic()) < SILENT_AFTER


def job_live(consumers: Mapping[str, dict[str, Any]], job: str) -> bool:
    """Whether some of ``consumers`` (their hellos and last reports, by name) is a live rank of ``job``."""
    return any(c.get("job") == job and live(c) for c in consumers.values())


@dataclass(frozen=True, slots=True)
class Listed:
    """A list a reader reads: its id, its length, and where it came from (``own``: the loader's
    ``urls=``, else the agent's list)."""

    list_id: str
    n_urls: int
    own: bool

    def __str__(self) -> str:
        where = "its urls=" if self.own else "the agent's list"
        return f"{where} (list {self.list_id}, {self.n_urls} URLs)"


@dataclass(frozen=True, slots=True)
class Reading:
    """Rank ``rank`` of ``job``, starting ``epoch`` of its loader ``loader``, reads ``listed``."""

    job: str
    loader: int
    epoch: int
    rank: int
    listed: Listed


class RankLists:
    """The readers of an epoch by name, with the list each reads."""

    def __init__(self) -> None:
        self._readers: dict[str, Reading] = {}
        self._warned: set[frozenset[str]] = set()  # the two lists of each warning given

    def check(
        self,
        name: str,
        mine: Reading,
        consumers: Mapping[str, dict[str, Any]],
        overlap: Callable[[str, str], bool],
    ) -> None:
        """Warn if reader ``name``, to read ``mine``, reads another list than a live reader of another
        rank of its job's epoch (``consumers``: their hellos and last reports, by name), one that
        shares a shard with it (``overlap`` of two list ids): once for each two lists."""
        for other, theirs in self._readers.items():
            if (
                other != name
                and (theirs.job, theirs.loader, theirs.epoch) == (mine.job, mine.loader, mine.epoch)
                and theirs.rank != mine.rank
                and theirs.listed.list_id != mine.listed.list_id
                and other in consumers
                and live(consumers[other])
                and frozenset((theirs.listed.list_id, mine.listed.list_id)) not in self._warned
                and overlap(theirs.listed.list_id, mine.listed.list_id)
            ):
                if len(self._warned) >= MAX_WARNED:
                    self._warned.clear()
                self._warned.add(frozenset((theirs.listed.list_id, mine.listed.list_id)))
                event(
                    log,
                    "rank_lists_differ",
                    "job %r, epoch %d: rank %d reads %s, but rank %d reads %s; ranks of one job reading different "
                    "lists get repeated and missing samples and unequal counts. Give every rank the same urls= "
                    "(or none, for the agent's list), or give each launch its own job name",
                    mine.job,
                    mine.epoch,
                    mine.rank,
                    mine.listed,
                    theirs.rank,
                    theirs.listed,
                    level=logging.WARNING,
                    job=mine.job,
                    epoch=mine.epoch,
                )
                return

    def join(self, name: str, reading: Reading) -> None:
        self._readers[name] = reading

    def leave(self, name: str) -> None:
        self._readers.pop(name, None)
