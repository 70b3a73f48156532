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
  (one that only rank 0 makes, say); unless they look like one list split by rank before the
  loader, which the loader splits again, so each rank reads a part of its part: that is warned
  about too. They look so when both are the loaders' own, of two URLs or more, as long (give or
  take a URL), and either interleave in URL order (``urls[rank::world_size]`` of a sorted list, as
  webdataset's ``split_by_node`` does) or are URLs of one pattern, a prefix, a number and a
  suffix, whose numbers (as numbers: ``{1..20}`` unpadded too) are two parts of a split of one
  run of numbers (:func:`_numbers_split`): every d-th; contiguous runs, the lower rank's first
  and as far apart as the ranks between them would fill (``urls[r * k:(r + 1) * k]``,
  numpy.array_split); or, of a shuffled list, mixed within what the world's parts would span.
  Lists as long and apart in rank order also come of a validation and a training list that ranks
  number otherwise: no split is warned of while a live reader of the job's epoch reads either
  list as another rank (rank 1's loader 0 reads the list of rank 0's loader 1).
- Bounded: a reader's record goes when it goes; at most MAX_WARNED pairs of lists are remembered.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import string
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..shared.logs import event, get_logger
from ..shared.stats import silent_for
from ..shared.urls import Urls, list_id
from ..shared.verdict import SILENT_AFTER

log = get_logger(__name__)

MAX_WARNED = 1024  # pairs of lists warned about, kept so as not to warn again
OVERLAP_SAMPLED = 1000  # URLs of a list looked up in another's to tell whether they share shards
_DIGITS = string.digits


class Relation(enum.Enum):
    """How two ranks' lists stand to each other."""

    SHARE = "share"  # some shard in both: they must be one list
    SPLIT = "split"  # none in common, as long, interleaved: one list split by rank before the loader
    APART = "apart"  # none in common: another loader's list (a validation set)


def relation(
    a: Urls, b: Urls, *, own: bool, ranks: tuple[int, int], world: int, numbering: Callable[[Urls], Numbered | None]
) -> Relation:
    """How lists ``a`` and ``b`` of ranks ``ranks`` of ``world`` stand (``own``: both are loaders'
    ``urls=``; ``numbering``: :func:`numbered`, or a memo of it). A bounded look in the main loop
    for a shared shard, at OVERLAP_SAMPLED URLs spread over the shorter (a list in another order,
    or a part of the other, shares one); for a split, one pass over each list's text
    (:func:`numbered`) when the lists are as long (give or take a URL) and their first and last
    URLs one numbering pattern."""
    short, long = sorted((a, b), key=len)
    step = max(1, len(short) // OVERLAP_SAMPLED)
    if any(long.position(short[i]) >= 0 for i in range(0, len(short), step)):
        return Relation.SHARE
    if not own or len(long) - len(short) > 1 or len(short) < 2:
        return Relation.APART  # (any two disjoint lists of one URL look split: a train and a validation list)
    if _interleaved(a, b, step) or (_one_pattern(a, b) and _numbers_split(numbering(a), numbering(b), ranks, world)):
        return Relation.SPLIT
    return Relation.APART


def _interleaved(a: Urls, b: Urls, step: int) -> bool:
    """Whether ``a`` and ``b`` alternate in URL order as they stand (``a``'s i-th before ``b``'s
    before ``a``'s next, or the other way round), looked at every ``step``: what taking every other
    URL of a sorted list gives."""
    first, second = (a, b) if a[0] < b[0] else (b, a)
    n = min(len(first), len(second))
    return all(first[i] < second[i] and (i + 1 >= len(first) or second[i] < first[i + 1]) for i in range(0, n, step))


@dataclass(frozen=True, slots=True)
class Numbered:
    """A list of URLs ``prefix`` + a number + ``suffix``, each number once: how many, the lowest
    and the highest, and ``step``: d when they are every d-th number from the lowest to the
    highest (1: every number, a run), else 0."""

    prefix: str
    suffix: str
    count: int
    low: int
    high: int
    step: int


def _pattern(first: str, last: str) -> tuple[str, str]:
    """The prefix and suffix ``first`` and ``last`` share around the digits where they differ."""
    prefix = os.path.commonprefix([first, last]).rstrip(_DIGITS)
    suffix = os.path.commonprefix([first[::-1], last[::-1]])[::-1].lstrip(_DIGITS)
    return prefix, suffix


def _one_pattern(a: Urls, b: Urls) -> bool:
    """Whether the first and last URLs of ``a`` and ``b`` are one numbering pattern (a cheap look
    before :func:`numbered` reads the lists whole)."""
    return _pattern(a[0], a[-1]) == _pattern(b[0], b[-1]) == _pattern(a[0], b[0])


def numbered(urls: Urls) -> Numbered | None:
    """``urls`` as :class:`Numbered` (None: fewer than two, a URL not of the pattern its first and
    last make, or a number twice). Numbers are compared as numbers, so that ``{1..20}`` (no zero
    padding) or a shuffled list is seen in number order. Work in C over the list's text: a regex
    pass, int() of each number, a set (about 0.3 s for 500,000 URLs on a busy core)."""
    if len(urls) < 2:
        return None
    prefix, suffix = _pattern(urls[0], urls[-1])
    found = re.findall(f"^{re.escape(prefix)}([0-9]+){re.escape(suffix)}$", urls.text(), re.MULTILINE)
    if len(found) != len(urls):
        return None
    numbers = list(map(int, found))
    distinct = set(numbers)
    if len(distinct) != len(numbers):
        return None  # (007 and 7: a pattern of another kind)
    low, high = min(numbers), max(numbers)
    step, off = divmod(high - low, len(numbers) - 1)
    if off or (step > 1 and not distinct.issuperset(range(low, high + 1, step))):
        step = 0  # (distinct numbers of a run's span are the run: only a longer step needs looking at)
    return Numbered(prefix, suffix, len(numbers), low, high, step)


def _numbers_split(a: Numbered | None, b: Numbered | None, ranks: tuple[int, int], world: int) -> bool:
    """Whether numbered lists ``a`` and ``b`` of ranks ``ranks`` of ``world`` are two parts of one
    run of numbers split by rank: contiguous runs in rank order, as ``urls[r * k:(r + 1) * k]`` or
    numpy.array_split make them (each rank between them holding as many); every d-th number,
    from two offsets (``urls[r::d]`` of a list in number order); or, split from a shuffled list,
    numbers mixed within the span the world's parts would cover (with two ranks: together every
    number of their span)."""
    if a is None or b is None or (a.prefix, a.suffix) != (b.prefix, b.suffix):
        return False
    short, long = sorted((a.count, b.count))
    if a.step == b.step == 1 and (a.high < b.low or b.high < a.low):
        (lower, r_lower), (upper, r_upper) = sorted(zip((a, b), ranks, strict=True), key=lambda p: p[0].low)
        between = r_upper - r_lower - 1  # ranks whose runs lie between: as long as these
        gap = upper.low - lower.high - 1
        return between >= 0 and short * between <= gap <= long * between and lower.low >= r_lower * lower.count
    if a.step == b.step > 1:
        return abs(a.low - b.low) < a.step and abs(a.high - b.high) < a.step
    span = max(a.high, b.high) - min(a.low, b.low) + 1
    if world == 2:
        return span == a.count + b.count
    mixed = max(a.low, b.low) < min(a.high, b.high) and 1 not in (a.step, b.step)
    return mixed and span <= world * (long + 1)


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
    """Rank ``rank`` of ``world`` of ``job``, starting ``epoch`` of its loader ``loader``, reads ``listed``."""

    job: str
    loader: int
    epoch: int
    rank: int
    world: int
    listed: Listed


class RankLists:
    """The readers of an epoch by name, with the list each reads."""

    def __init__(self) -> None:
        self._readers: dict[str, Reading] = {}
        self._warned: set[frozenset[str]] = set()  # the two lists of each warning given
        self._numbered: dict[str, Numbered | None] = {}  # numbered() of lists by id: each read once

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
                urls_of(theirs.listed.list_id),
                urls_of(mine.listed.list_id),
                own=theirs.listed.own and mine.listed.own,
                ranks=(theirs.rank, mine.rank),
                world=mine.world,
                numbering=self._numbering,
            )
            if how is Relation.APART or (how is Relation.SPLIT and self._read_whole(mine, theirs, consumers)):
                continue
            if len(self._warned) >= MAX_WARNED:
                self._warned.clear()
            self._warned.add(pair)
            said = (
                "ranks of one job reading different lists get repeated and missing samples and unequal counts. "
                "Give every rank the same urls= (or none, for the agent's list), or give each launch its own job name"
                if how is Relation.SHARE
                else "they share no shard and look like two parts of one list split by rank before the loader "
                "(urls[rank::world_size], or a run of it each); the loader splits each epoch by rank itself, so each "
                "rank would read a part of its part. Give every rank the whole list"
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

    def _numbering(self, urls: Urls) -> Numbered | None:
        """:func:`numbered` of ``urls``, worked out once for each list (while MAX_WARNED others are kept)."""
        key = list_id(urls)
        if key not in self._numbered:
            if len(self._numbered) >= MAX_WARNED:
                self._numbered.clear()
            self._numbered[key] = numbered(urls)
        return self._numbered[key]

    def _read_whole(self, mine: Reading, theirs: Reading, consumers: Mapping[str, dict[str, Any]]) -> bool:
        """Whether a live reader of ``mine``'s job and epoch reads ``mine``'s list or ``theirs``' as
        another rank than the one its part would be: then it is a whole list, which loaders of the
        ranks numbered otherwise (one rank making its validation loader first) read side by side."""
        part_of = {mine.listed.list_id: mine.rank, theirs.listed.list_id: theirs.rank}
        return any(
            (r.job, r.epoch) == (mine.job, mine.epoch)
            and part_of.get(r.listed.list_id, r.rank) != r.rank
            and name in consumers
            and live(consumers[name])
            for name, r in self._readers.items()
        )

    def join(self, name: str, reading: Reading) -> None:
        self._readers[name] = reading

    def leave(self, name: str) -> None:
        self._readers.pop(name, None)
