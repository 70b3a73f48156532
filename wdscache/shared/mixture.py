"""A mixture's epoch: several sources read by weight into one global sequence; pure, no I/O.

A mixture has sources (each a list of shards of the job's one combined list, which holds a
shard listed by two sources once), a weight per source and ``N`` samples per epoch. The
epoch is a sequence of ``N`` sample ids like any other (:mod:`wdscache.shared.sequence`):
the ranks and DataLoader workers share it out by position and a checkpoint resumes it by
position, as for one list. What differs is only how the ids are made:

- **Shares** (:func:`shares`): source ``i`` gives ``N * w_i / sum(w)`` samples, rounded by
  largest remainder (each share is that number rounded down; the samples left go one each
  to the sources of the largest fractional parts, ties to the source listed first), so
  the shares sum to ``N``. They are the same every epoch.
- **Walks, without replacement**: each source has one endless walk, its *cycles* one
  after another, each every sample of the source once. Epoch ``e`` takes the walk's places
  ``e * s`` to ``(e + 1) * s`` (``s`` the source's share): successive epochs continue the
  walk, so every sample comes once before any comes twice, and a share of more than the
  source's size gives every sample ``floor`` or ``ceil`` of ``s / size`` times. A cycle
  reads the source's shards in a seeded order, each shard's samples in order; the cycles of
  one *generation* (up to where an epoch and a cycle end together) read the same shard
  order, so that an epoch across two cycles takes the end of one and the start of the
  next, which do not meet. What one epoch takes of one cycle (a *piece*) goes through the
  shuffle buffer with a seed of its own, so every epoch's order differs.
- **Walks, with replacement** (``resampled``): epoch ``e``'s walk draws the source's shards
  at random with replacement (seeded per epoch), every sample of a drawn shard in order,
  until ``s`` samples are drawn (of the last shard, its first ones), through the shuffle buffer.
- **Interleaving**: each source's share is cut in runs of up to 8 (``RUN``) positions, and
  the epoch is a seeded shuffle of all the runs (with ``shuffle=False``, the sources spread
  evenly).

A source is seeded apart from the others (two sources of the same shards walk them in
different orders). Every id of a mixture is a :class:`SourcedId`: a ``(shard, sample)``
tuple whose class names the source it came from.

The epoch needs every shard's sample count up front (the sources' sizes decide where a
walk stands). Which samples of which shards each source gives is worked out per shard when
the epoch starts (how many ids of each shard, for letting go of pins); the ids themselves
are made as they are read.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import numbers
import random
import reprlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, cast

from .errors import ConfigError
from .plan import epoch_rng, shard_order
from .sequence import SampleId, ShardFeed, buffered


class SourcedId(tuple):
    """A sample id ``(shard, sample)`` of a mixture; its class's ``source`` names its source."""

    __slots__ = ()
    source: str = ""


@functools.lru_cache(maxsize=256)
def sourced(name: str) -> type[SourcedId]:
    """The id class of source ``name``."""
    return type("SourcedId", (SourcedId,), {"__slots__": (), "source": name})


def shares(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split by ``weights`` (normalised), rounded by largest remainder: the shares sum
    to ``total``; of equal remainders the source listed first gets the extra sample."""
    # A float as the decimal it shows (0.7 is 7/10, not its binary neighbour): shares as written.
    fractions = [Fraction(repr(w)) if isinstance(w, float) else Fraction(w) for w in weights]
    whole = sum(fractions)
    quotas = [total * f / whole for f in fractions]
    out = [int(q) for q in quotas]  # (floor: quotas are >= 0)
    left = total - sum(out)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - out[i]), i))
    for i in by_remainder[:left]:
        out[i] += 1
    return out


@dataclass(frozen=True)
class Mixture:
    """The sources of a mixture: their names (as the user gave them), weights and shards (indices
    in the combined list); ``epoch_samples`` samples an epoch; ``replacement``: walks draw shards
    with replacement."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    shards: tuple[tuple[int, ...], ...]
    epoch_samples: int
    replacement: bool = False
    labelled: bool = True  # samples say their source (``__source__``)

    def __post_init__(self) -> None:
        if not self.names:
            raise ConfigError("mix= needs at least one source")
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"mix= names a source twice: {self.names}")
        # (frozen: the checked floats stand in for the numbers given, once)
        object.__setattr__(self, "weights", tuple(mix_weight(n, w) for n, w in zip(self.names, self.weights)))
        if type(self.epoch_samples) is not int or self.epoch_samples < 1:
            raise ConfigError(f"epoch_samples={self.epoch_samples!r} must be a whole number >= 1")

    def shares(self) -> list[int]:
        """Each source's samples in an epoch (see :func:`shares`)."""
        return shares(self.epoch_samples, self.weights)


@dataclass(frozen=True)
class MixSpec:
    """One epoch of a mixture over a list of ``len(counts)`` shards (``counts``: every shard's
    samples), used as an :class:`~wdscache.shared.sequence.EpochSpec` is (by a rank's stream)."""

    mixture: Mixture
    counts: tuple[int, ...]
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 1000

    def __post_init__(self) -> None:
        for name, share, size in zip(self.mixture.names, self.mixture.shares(), self.sizes()):
            if share and not size:
                raise ConfigError(f"mix source {name!r} has no samples, so it cannot give its share of {share}")

    @property
    def n_shards(self) -> int:
        return len(self.counts)

    def sizes(self) -> list[int]:
        """Each source's samples."""
        return [sum(self.counts[s] for s in shards) for shards in self.mixture.shards]

    def ids(self, samples: Callable[[int], Iterable[int | None]] | None = None) -> Iterator[SampleId | None]:
        """The epoch's ``N`` ids (:class:`SourcedId`). ``samples`` is not asked: the counts are known."""
        return itertools.chain.from_iterable(self.runs())

    def runs(self, feed: ShardFeed | None = None) -> Iterator[list[SampleId]]:
        """The epoch's ids as :meth:`ids` gives them, in lists of about ``LIST`` ids, which a
        rank's share deals by slicing (:meth:`~wdscache.shared.sequence.RankShare.pairs`).
        ``feed`` is not asked: the counts are known."""
        walks = [_walk(p, sourced(name)) for name, p in zip(self.mixture.names, self._plans())]
        whole = [zip(*[walk] * RUN) for walk in walks]  # a source's runs of RUN ids, taken whole (fast)
        out: list[SampleId] = []
        for i, n in self._runs():
            out += next(whole[i]) if n == RUN else itertools.islice(walks[i], n)  # (a share's last run)
            if len(out) >= LIST:
                yield out
                out = []
        if out:
            yield out

    def order(self) -> tuple[int, ...]:
        """The shards about in the order the epoch reaches them (for the prefetch window): each
        source's in its walk's order, the sources spread evenly."""
        keyed = []
        for plan in self._plans():
            mine = list(dict.fromkeys(shard for shard, _, _ in plan))
            keyed += [((k + 0.5) / len(mine), shard) for k, shard in enumerate(mine)]
        return tuple(dict.fromkeys(shard for _, shard in sorted(keyed)))

    def totals(self) -> Counter[int]:
        """How many ids of each shard the epoch gives out."""
        out: Counter[int] = Counter()
        for plan in self._plans():
            for shard, first, end in plan:
                out[shard] += end - first
        return out

    def following(self) -> MixSpec:
        return replace(self, epoch=self.epoch + 1)

    def _runs(self) -> list[tuple[int, int]]:
        """(source, length): which source the epoch's positions take their next ids from, in runs
        of up to RUN (a seeded shuffle of the runs; unshuffled, the sources spread evenly)."""
        shares = self.mixture.shares()
        runs = [(i, min(RUN, n - k)) for i, n in enumerate(shares) for k in range(0, n, RUN)]
        if self.shuffle:
            epoch_rng(self.seed, self.epoch, "mix").shuffle(runs)
            return runs
        at: dict[int, int] = {}
        keys = []
        for i, _n in runs:  # a source's k-th run at (k + 1/2) / its runs
            k = at[i] = at.get(i, -1) + 1
            keys.append((k + 0.5) / -(-shares[i] // RUN))
        return [run for _, _, run in sorted((key, run[0], run) for key, run in zip(keys, runs))]

    def _plans(self) -> list[_Plan]:
        return [_plan(self, i, share) for i, share in enumerate(self.mixture.shares())]


RUN = 8  # positions in a row from one source: the interleaving costs a random draw per run, not per sample
LIST = 512  # ids handed on at once: a rank's share deals them by slicing, not one by one


@dataclass(frozen=True)
class _Plan:
    """What one source gives in an epoch: pieces ``(shard, first, end)`` of shards' samples, in walk
    order, and how each group of pieces is shuffled (``groups``: how many pieces, and the buffer's
    random generator or None)."""

    pieces: tuple[tuple[int, int, int], ...]
    groups: tuple[tuple[int, random.Random | None], ...]
    buffer: int = 0  # the shuffle buffer's size

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return iter(self.pieces)


def _plan(spec: MixSpec, i: int, share: int) -> _Plan:
    """Source ``i``'s pieces in ``spec``'s epoch (its ``share`` samples)."""
    shards, counts = spec.mixture.shards[i], spec.counts
    seed = _source_seed(spec.seed, i)
    shuffled = spec.shuffle and spec.shuffle_buffer > 1
    pieces: list[tuple[int, int, int]] = []
    groups: list[tuple[int, random.Random | None]] = []
    if not share:
        return _Plan((), ())
    if spec.mixture.replacement:
        # Shards drawn with replacement, every sample of each in order, until the share is full.
        rng = epoch_rng(seed, spec.epoch, "resample")
        drawable = [s for s in shards if counts[s]]
        left = share
        while left:
            shard = rng.choice(drawable)
            take = min(left, counts[shard])
            pieces.append((shard, 0, take))
            left -= take
        groups.append((len(pieces), epoch_rng(seed, spec.epoch, "samples") if shuffled else None))
        return _Plan(tuple(pieces), tuple(groups), spec.shuffle_buffer)
    n = sum(counts[s] for s in shards)
    start, end = spec.epoch * share, (spec.epoch + 1) * share
    # The cycles of one generation place the samples alike (their pieces are shuffled apart), so that
    # an epoch across cycles takes each sample floor or ceil of share/size times: once at most when
    # the share is at most the size (the end of one cycle and the start of the next do not meet). A
    # generation ends where an epoch and a cycle end together.
    generation = share // math.gcd(n, share)
    for c in range(start // n, (end - 1) // n + 1):
        a, b = max(start, c * n) - c * n, min(end, (c + 1) * n) - c * n  # the epoch's part of cycle c
        order = shard_order(len(shards), seed=seed, epoch=c // generation, shuffle=spec.shuffle)
        before = len(pieces)
        pos = 0
        for k in order:
            shard = shards[k]
            first, stop = max(a - pos, 0), min(b - pos, counts[shard])
            if first < stop:
                pieces.append((shard, first, stop))
            pos += counts[shard]
            if pos >= b:
                break
        # One epoch's part of a cycle is shuffled on its own: no epoch's samples change, only their order.
        groups.append((len(pieces) - before, epoch_rng(seed, c, f"piece {a}") if shuffled else None))
    return _Plan(tuple(pieces), tuple(groups), spec.shuffle_buffer)


def _walk(plan: _Plan, cls: type[SourcedId]) -> Iterator[SampleId]:
    """The ids of ``plan`` (of class ``cls``), each group of pieces through the shuffle buffer (if it
    has a seed)."""
    pieces = iter(plan.pieces)

    def group(count: int, rng: random.Random | None) -> Iterator[SampleId]:
        # Per id, map, zip and repeat run in C: making an id costs its class's call only.
        runs = [
            map(cls, zip(itertools.repeat(shard), range(first, end)))
            for shard, first, end in [next(pieces) for _ in range(count)]
        ]
        if rng is None:
            return itertools.chain.from_iterable(runs)
        # no None comes in, so none goes out
        return itertools.chain.from_iterable(cast(Iterator[list[SampleId]], buffered(runs, rng, plan.buffer)))

    return itertools.chain.from_iterable(itertools.starmap(group, plan.groups))


def _source_seed(seed: int, source: int) -> int:
    return int.from_bytes(hashlib.sha256(f"wdscache:mix:{seed}:{source}".encode()).digest()[:8], "big")


def mix_weight(name: str, w: Any) -> float:
    """The weight ``w`` of source ``name`` as the float the shares are worked from: any real
    number but a bool (numpy's, a Fraction: its nearest float), positive and finite."""
    real = isinstance(w, numbers.Real) and not isinstance(w, bool)
    if not (real and 0 < w < math.inf):
        raise ConfigError(f"mix[{name!r}]={reprlib.repr(w)}: a weight must be a positive finite number")
    try:
        weight = float(w)
    except OverflowError:
        weight = math.inf
    if not 0 < weight < math.inf:
        raise ConfigError(
            f"mix[{name!r}]={reprlib.repr(w)}: a weight must be within a float's range "
            "(the weights are normalised: scale them all alike)"
        )
    return weight


def check_mix_arg(mix: Any) -> list[tuple[str, float]]:
    """The ``mix=`` argument as (source, weight) pairs, in the order given; refused with its reason."""
    if not hasattr(mix, "items"):
        raise ConfigError(
            f"mix= takes a dict of source -> weight, e.g. {{'laion.txt': 0.7, 'cc12m.txt': 0.3}}; "
            f"got {type(mix).__name__}"
        )
    pairs = list(mix.items())
    if not pairs:
        raise ConfigError("mix= needs at least one source")
    for key, _ in pairs:
        if not isinstance(key, str):
            raise ConfigError(
                f"mix= keys are what urls= takes as a string (a list file, a pattern, an s3:// "
                f"prefix, a shard index); got {key!r}"
            )
    return [(k, mix_weight(k, w)) for k, w in pairs]
