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
  through the shuffle buffer; the epoch takes its first ``s``.
- **Interleaving**: which source each of the ``N`` positions takes its next id from is a
  seeded shuffle of the shares' labels (with ``shuffle=False``, the sources spread evenly).

A source is seeded apart from the others (two sources of the same shards walk them in
different orders). Every id of a mixture is a :class:`SourcedId`: a ``(shard, sample)``
tuple whose class names the source it came from.

The epoch needs every shard's sample count up front (the sources' sizes decide where a
walk stands), and is built whole when it starts (a few bytes per sample).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from array import array
from collections import Counter
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Callable, Iterable, Iterator, Sequence

from .errors import ConfigError
from .plan import epoch_rng, shard_order
from .sequence import SampleId, buffered


class SourcedId(tuple):  # type: ignore[type-arg]
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
        for name, w in zip(self.names, self.weights):
            if not (isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 and w != float("inf")):
                raise ConfigError(f"mix[{name!r}]={w!r}: a weight must be a positive finite number")
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
        shard_of, sample_of, source_of = _built(self)
        classes = [sourced(name) for name in self.mixture.names]
        for shard, j, i in zip(shard_of, sample_of, source_of):
            yield classes[i]((shard, j))

    def order(self) -> tuple[int, ...]:
        """The shards in the order the epoch first reaches them (for the prefetch window)."""
        return tuple(dict.fromkeys(_built(self)[0]))

    def totals(self) -> Counter[int]:
        """How many ids of each shard the epoch gives out."""
        return Counter(_built(self)[0])

    def following(self) -> "MixSpec":
        return replace(self, epoch=self.epoch + 1)


@functools.lru_cache(maxsize=2)
def _built(spec: MixSpec) -> tuple[array, array, array]:  # type: ignore[type-arg]
    """The epoch's ids as arrays: shard, sample and source of each position."""
    mix = spec.mixture
    walks = [_walk(spec, i, share) for i, share in enumerate(mix.shares())]
    shard_of, sample_of, source_of = array("q"), array("q"), array("H")
    for i in _labels(spec):
        shard, j = next(walks[i])
        shard_of.append(shard)
        sample_of.append(j)
        source_of.append(i)
    return shard_of, sample_of, source_of


def _labels(spec: MixSpec) -> list[int]:
    """The source each position takes its next id from."""
    counts = spec.mixture.shares()
    if spec.shuffle:
        labels = [i for i, n in enumerate(counts) for _ in range(n)]
        epoch_rng(spec.seed, spec.epoch, "mix").shuffle(labels)
        return labels
    # Evenly: source i's k-th sample at (k + 1/2) / n_i of the epoch.
    return [i for _, i in sorted(((k + 0.5) / n, i) for i, n in enumerate(counts) for k in range(n))]


def _source_seed(seed: int, source: int) -> int:
    return int.from_bytes(hashlib.sha256(f"wdscache:mix:{seed}:{source}".encode()).digest()[:8], "big")


def _walk(spec: MixSpec, i: int, share: int) -> Iterator[SampleId]:
    """The ``share`` ids source ``i`` gives in ``spec``'s epoch."""
    shards, counts = spec.mixture.shards[i], spec.counts
    seed = _source_seed(spec.seed, i)
    size = spec.shuffle_buffer if spec.shuffle else 0
    if spec.mixture.replacement:
        rng = epoch_rng(seed, spec.epoch, "resample")
        drawable = [s for s in shards if counts[s]]
        drawn = ((s, j) for s in iter(lambda: rng.choice(drawable), None) for j in range(counts[s]))
        if size > 1:
            return itertools.islice(buffered(drawn, epoch_rng(seed, spec.epoch, "samples"), size), share)
        return itertools.islice(drawn, share)
    n = sum(counts[s] for s in shards)
    if not share:
        return iter(())
    start, end = spec.epoch * share, (spec.epoch + 1) * share
    # The cycles of one generation place the samples alike (their pieces are shuffled apart), so that
    # an epoch across cycles takes each sample floor or ceil of share/size times: once at most when
    # the share is at most the size (the end of one cycle and the start of the next do not meet). A
    # generation ends where an epoch and a cycle end together.
    generation = share // math.gcd(n, share)
    pieces = []
    for c in range(start // n, (end - 1) // n + 1):
        a, b = max(start, c * n) - c * n, min(end, (c + 1) * n) - c * n  # the epoch's piece of cycle c
        order = shard_order(len(shards), seed=seed, epoch=c // generation, shuffle=spec.shuffle)
        arc = _arc([shards[k] for k in order], counts, a, b)
        # A piece is one epoch's, so shuffling within it changes no epoch's samples, only their order.
        pieces.append(buffered(arc, epoch_rng(seed, c, f"piece {a}"), size) if size > 1 else arc)
    return itertools.chain.from_iterable(pieces)  # type: ignore[arg-type]


def _arc(shards: Sequence[int], counts: Sequence[int], a: int, b: int) -> Iterator[SampleId]:
    """The samples at places ``a`` to ``b`` of ``shards`` read one after the other."""
    ends = list(itertools.accumulate(counts[s] for s in shards))
    k = bisect.bisect_right(ends, a)
    pos = a
    while pos < b:
        shard, first = shards[k], ends[k] - counts[shards[k]]
        stop = min(b, ends[k])
        for j in range(pos - first, stop - first):
            yield shard, j
        pos = stop
        k += 1


def check_mix_arg(mix: Any) -> list[tuple[str, float]]:
    """The ``mix=`` argument as (source, weight) pairs, in the order given; refused with its reason."""
    if not hasattr(mix, "items"):
        raise ConfigError(f"mix= takes a dict of source -> weight, e.g. {{'laion.txt': 0.7, 'cc12m.txt': 0.3}}; "
                          f"got {type(mix).__name__}")
    pairs = list(mix.items())
    if not pairs:
        raise ConfigError("mix= needs at least one source")
    for key, w in pairs:
        if not isinstance(key, str):
            raise ConfigError(f"mix= keys are what urls= takes as a string (a list file, a pattern, an s3:// "
                              f"prefix, a shard index); got {key!r}")
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w < float("inf")):
            raise ConfigError(f"mix[{key!r}]={w!r}: a weight must be a positive finite number")
    return [(k, float(w)) for k, w in pairs]
