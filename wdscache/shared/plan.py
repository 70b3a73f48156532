"""Prefetch planning: the order in which shards will be read, and what to keep ready.

A *reader* walks a sequence of shards (a job's epochs, in their seeded order).
Its *window* is the next ``prefetch`` shards of that sequence from its current
position, running on into the next epoch. The agent downloads exactly the union
of all windows (demanded shards first); only a shard a reader is waiting for
may evict a shard inside a window (the farthest ahead first).
"""

from __future__ import annotations

import functools
import hashlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


def epoch_rng(seed: int, epoch: int, purpose: str) -> random.Random:
    """A random generator that depends only on its arguments (stable across Python versions)."""
    digest = hashlib.sha256(f"wdscache:{purpose}:{seed}:{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


@functools.lru_cache(maxsize=8)
def shard_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    """The order in which an epoch reads ``n`` shards: seeded per epoch, or as listed.

    Cached (several parts of a consumer ask for the same epoch), hence a tuple.
    """
    order = list(range(n))
    if shuffle:
        epoch_rng(seed, epoch, "shards").shuffle(order)
    return tuple(order)


@dataclass
class Reader:
    """Something that reads shards in a known order: a consumer, a client, or the start-up plan.

    Either the reader tells its next shards (``ahead``: a consumer computes its
    own epoch order), or the agent derives them from ``position`` in the seeded
    order of ``epoch`` over the agent's list.
    """

    name: str
    n_shards: int = 0
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    # Set by readers that know their own order (consumers): the URLs they read next.
    ahead: list[str] | None = None
    list_id: str | None = None  # the list a consumer reads (said in hello); None: the agent's current one
    pidfd: int = -1  # the consumer's process, watched to notice at once that it ended (-1: not watched)
    shards: tuple[int, ...] | None = None  # the shards read (a node's part): None, all ``n_shards``

    def order(self, epoch: int) -> tuple[int, ...]:
        if self.shards is None:
            return shard_order(self.n_shards, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        mine = self.shards  # in the order a consumer of this node reads them (EpochSpec.order)
        return tuple(mine[i] for i in shard_order(len(mine), seed=self.seed, epoch=epoch, shuffle=self.shuffle))

    def window(self, prefetch: int) -> list[int]:
        """The next ``prefetch`` shards to read, current one first, across the epoch end."""
        if self.n_shards == 0:
            return []
        out: list[int] = []
        epoch, pos = self.epoch, self.position
        while len(out) < min(prefetch, len(self.order(epoch))):
            order = self.order(epoch)
            take = order[pos : pos + prefetch - len(out)]
            out.extend(take)
            epoch, pos = epoch + 1, 0
        return out

    def advance_to(self, shard: int) -> None:
        """Move the position to ``shard`` (the reader opened it): this epoch, or the next."""
        for epoch in (self.epoch, self.epoch + 1):
            order = self.order(epoch)
            start = self.position if epoch == self.epoch else 0
            try:
                pos = order.index(shard, start) if epoch == self.epoch else order.index(shard)
            except ValueError:
                continue
            self.epoch, self.position = epoch, pos
            return
        # Not ahead of us: the reader jumped back (a new epoch from the start, a resume).
        self.position = self.order(self.epoch).index(shard)


def wanted(windows: Sequence[Sequence[T]], prefetch: int) -> list[T]:
    """Shards to have on disk, by priority: each reader's next shard, then the one after, ..."""
    seen: set[T] = set()
    out: list[T] = []
    for rank in range(prefetch):
        for w in windows:
            if rank < len(w) and w[rank] not in seen:
                seen.add(w[rank])
                out.append(w[rank])
    return out
