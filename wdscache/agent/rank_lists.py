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
- Only lists that share a shard are a mismatch (:func:`relation`): lists with none in common are
  another loader's of the job (a validation set), however the ranks numbered their loaders
  (one that only rank 0 makes, say); unless both are the loaders' own, as long (give or take a
  URL) and interleaved in URL order: then they are one list split by rank before the loader
  (``urls[rank::world_size]``, as webdataset's ``split_by_node`` does), which the loader splits
  again, so each rank reads a part of its part; that is warned about too (lists of two URLs or
  more; a split of an unsorted list, or into runs, is not recognised).
- Bounded: a reader's record goes when it goes; at most MAX_WARNED pairs of lists are remembered.
"""

from __future__ import annotations

import enum
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


class Relation(enum.Enum):
    """How two ranks' lists stand to each other."""

    SHARE = "share"  # some shard in both: they must be one list
    SPLIT = "split"  # none in common, as long, interleaved: one list split by rank before the loader
    APART = "apart"  # none in common: another loader's list (a validation set)


def relation(a: Urls, b: Urls, *, own: bool) -> Relation:
    """How lists ``a`` and ``b`` stand (``own``: both are loaders' ``urls=``): a bounded look in the
    main loop, at OVERLAP_SAMPLED URLs spread over the shorter (a list in another order, or a part
    of the other, shares a shard)."""
    short, long = sorted((a, b), key=len)
    step = max(1, len(short) // OVERLAP_SAMPLED)
    if any(long.position(short[i]) >= 0 for i in range(0, len(short), step)):
        return Relation.SHARE
    if own and len(long) - len(short) <= 1 and _interleaved(a, b, step):
        return Relation.SPLIT
    return Relation.APART


def _interleaved(a: Urls, b: Urls, step: int) -> bool:
    """Whether ``a`` and ``b`` alternate in URL order as they stand (``a``'s i-th before ``b``'s
    before ``a``'s next, or the other way round), looked at every ``step``: what taking every other
    URL of a sorted list gives."""
    if min(len(a), len(b)) < 2:
        return False  # (any two disjoint lists of one URL "alternate": a train and a validation list)
    first, second = (a, b) if a[0] < b[0] else (b, a)
    n = min(len(first), len(second))
    return all(first[i] < second[i] and (i + 1 >= len(first) or second[i] < first[i + 1]) for i in range(0, n, step))


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
        urls_of: Callable[[str], Urls],
    ) -> str | None:
        """Warn if reader ``name``, to read ``mine``, reads another list than a live reader of another
        rank of its job's epoch (``consumers``: their hellos and last reports, by name), one that
        shares a shard with it or is another part of one list split by rank (:func:`relation` of
        the lists ``urls_of`` gives for their ids): once for each two lists. Returns the
        warning (None: none), which the hello's reply carries to the rank's process too."""
        for other, theirs in self._readers.items():
            pair = frozenset((theirs.listed.list_id, mine.listed.list_id))
            if not (
                other != name
                and (theirs.job, theirs.loader, theirs.epoch) == (mine.job, mine.loader, mine.epoch)
                and theirs.rank != mine.rank
                and theirs.listed.list_id != mine.listed.list_id
                and other in consumers
                and live(consumers[other])
                and pair not in self._warned
            ):
                continue
            how = relation(
                urls_of(theirs.listed.list_id), urls_of(mine.listed.list_id), own=theirs.listed.own and mine.listed.own
            )
            if how is Relation.APART:
                continue
            if len(self._warned) >= MAX_WARNED:
                self._warned.clear()
            self._warned.add(pair)
            said = (
                "ranks of one job reading different lists get repeated and missing samples and unequal counts. "
                "Give every rank the same urls= (or none, for the agent's list), or give each launch its own job name"
                if how is Relation.SHARE
                else "they share no shard and interleave, as one list split by rank before the loader makes them "
                "(urls[rank::world_size]); the loader splits each epoch by rank itself, so each rank would read a "
                "part of its part. Give every rank the whole list"
            )
            text = (
                f"job {mine.job!r}, epoch {mine.epoch}: rank {mine.rank} reads {mine.listed}, "
                f"but rank {theirs.rank} reads {theirs.listed}; {said}"
            )
            event(
                log,
                "rank_lists_differ",
                "%s",
                text,
                level=logging.WARNING,
                job=mine.job,
                epoch=mine.epoch,
                split=how is Relation.SPLIT,
            )
            return text
        return None

    def join(self, name: str, reading: Reading) -> None:
        self._readers[name] = reading

    def leave(self, name: str) -> None:
        self._readers.pop(name, None)
