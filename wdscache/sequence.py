"""The epoch's global sample sequence: a pure function of the list, the counts and the seeds.

Shards are read in :func:`~wdscache.plan.shard_order`; their samples pass
through a seeded shuffle buffer; the output is the epoch's global sequence of
``(shard, sample)`` ids. Nothing here depends on the number of ranks, agent
workers or on timing, which is what makes every rank's share exact and a
checkpoint valid across world sizes.

Rank ``r`` of ``W`` takes global positions ``r, r + W, r + 2W, ...``. With
``drop_last`` the sequence is cut to a multiple of ``W``; otherwise it is padded
by wrapping around to its start, so every rank gets the same count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from .plan import epoch_rng, shard_order

SampleId = tuple[int, int]  # (shard index in the list, sample index in the shard)
INITIAL = 100  # ids in the shuffle buffer before it gives out the first


@dataclass(frozen=True)
class EpochSpec:
    """Everything the sequence of one epoch depends on (besides the per-shard counts)."""

    n_shards: int
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 1000

    def order(self) -> tuple[int, ...]:
        return shard_order(self.n_shards, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)


def global_sequence(spec: EpochSpec, samples: Callable[[int], Iterable[int | None]]) -> Iterator[SampleId | None]:
    """Yield the epoch's sample ids in order; ``samples(shard)`` gives a shard's sample
    indices ``0, 1, ...`` when the sequence reaches it.

    ``samples`` may yield None, meaning "no more yet" (a shard still downloading):
    the None is passed on, so that the caller can do other work and ask again. It
    never changes the sequence, only when its ids come out.

    The shuffle buffer holds at most ``shuffle_buffer`` ids. It starts giving out
    ids once it holds ``INITIAL`` of them (so the first sample does not wait for
    a full buffer), then grows by one id for every two that arrive; once full,
    each new id goes in and a seeded random one comes out. At the end the rest
    come out in seeded random order.
    """
    order = spec.order()
    size = spec.shuffle_buffer if spec.shuffle else 0
    if size <= 1:
        for shard in order:
            for j in samples(shard):
                yield None if j is None else (shard, j)
        return
    rng = epoch_rng(spec.seed, spec.epoch, "samples")
    initial = min(size, INITIAL)
    buf: list[SampleId] = []
    arrived = 0
    for shard in order:
        for j in samples(shard):
            if j is None:
                yield None
                continue
            buf.append((shard, j))
            arrived += 1
            if len(buf) >= size or (len(buf) >= initial and arrived % 2 == 0):
                k = rng.randrange(len(buf))
                buf[k], buf[-1] = buf[-1], buf[k]
                yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def rank_length(total: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank receives in an epoch of ``total`` samples."""
    return total // world_size if drop_last else math.ceil(total / world_size)
