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
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

T = TypeVar("T")


def epoch_rng(seed: int, epoch: int, purpose: str) -> random.Random:
    """A random generator that depends only on its arguments (stable across Python versions)."""
    digest = hashlib.sha256(f"wdscache:{purpose}:{seed}:{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


class ShardOrder(Sequence[int]):
    """The order in which an epoch reads shards, held compactly: as listed, a ``range`` (nothing
    held); else an array of shard indices (8 bytes a shard, no object per shard). Slices are
    tuples. :meth:`position` finds a shard through the inverse array, made on its first use."""

    __slots__ = ("_order", "_positions")

    def __init__(self, order: range | array) -> None:
        self._order = order
        self._positions: array | None = None

    @classmethod
    def of(cls, shards: Sequence[int]) -> ShardOrder:
        """``shards`` (distinct shard indices) in their order."""
        if isinstance(shards, ShardOrder):
            return shards
        return cls(array("q", shards))

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        if isinstance(i, slice):
            return tuple(self._order[i])
        return self._order[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __contains__(self, shard: object) -> bool:
        return isinstance(shard, int) and self.position(shard) >= 0

    def position(self, shard: int) -> int:
        """Where ``shard`` comes in the order (-1: not in it)."""
        order = self._order
        if isinstance(order, range):
            return shard - order.start if shard in order else -1
        positions = self._positions
        if positions is None:
            top = max(order, default=-1) + 1
            positions = self._positions = array("q", [-1]) * top
            for at, s in enumerate(order):
                positions[s] = at
        return positions[shard] if 0 <= shard < len(positions) else -1

    def index(self, shard: Any, start: int = 0, stop: int | None = None) -> int:
        at = self.position(shard) if isinstance(shard, int) else -1
        if at < 0 or not start <= at < (len(self) if stop is None else stop):
            raise ValueError(f"shard {shard!r} is not in the order")
        return at

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardOrder):
            other = other._order
        if isinstance(other, (tuple, list, range, array)):
            return len(other) == len(self) and all(a == b for a, b in zip(self._order, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._order))

    def __repr__(self) -> str:
        return f"ShardOrder({self._order!r})"


@functools.lru_cache(maxsize=4)
def shard_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> ShardOrder:
    """The order in which an epoch reads ``n`` shards: seeded per epoch, or as listed.

    Cached (several parts of a consumer ask for the same epoch, and its next); as listed, it
    holds nothing, so a list of any length costs nothing to plan by.
    """
    if not shuffle:
        return ShardOrder(range(n))
    order = list(range(n))
    epoch_rng(seed, epoch, "shards").shuffle(order)
    return ShardOrder(array("q", order))


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
    # A node's part in the order of an epoch, by epoch (this one and the next): made once, not per window.
    _parts: dict[int, tuple[tuple[int, ...], ShardOrder]] = field(default_factory=dict, repr=False, compare=False)

    def order(self, epoch: int) -> ShardOrder:
        if self.shards is None:
            return shard_order(self.n_shards, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        mine = self.shards  # in the order a consumer of this node reads them (EpochSpec.order)
        made = self._parts.get(epoch)
        if made is None or made[0] is not mine:
            if len(self._parts) >= 2:
                self._parts.clear()
            order = shard_order(len(mine), seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            made = self._parts[epoch] = (mine, ShardOrder(array("q", (mine[i] for i in order))))
        return made[1]

    def window(self, prefetch: int) -> list[int]:
        """The next ``prefetch`` shards to read, current one first, across the epoch end."""
        if self.n_shards == 0:
            return []
        want = min(prefetch, len(self.order(self.epoch)))  # every epoch's order is as long
        out: list[int] = []
        epoch, pos = self.epoch, self.position
        while len(out) < want:  # the next epoch's order is made only when the window reaches it
            out.extend(self.order(epoch)[pos : pos + want - len(out)])
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
    for rank in range(min(prefetch, max(map(len, windows), default=0))):
        for w in windows:
            if rank < len(w) and w[rank] not in seen:
                seen.add(w[rank])
                out.append(w[rank])
    return out
