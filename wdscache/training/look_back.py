"""The samples a stream reads again only for its holes' pool (:mod:`wdscache.training.holes`),
when its share ended with more holes than samples read, and fewer than a pool's worth
(:attr:`~wdscache.training.holes.Holes.short`): a resumed rank's rest, a DataLoader worker's
slice. None of them is handed out.

Which: up to :data:`~wdscache.training.holes.POOL_SAMPLES` of the rank's, in at most
:data:`LOOK_BACK_SHARDS` shards (the latest kept: each may have to be downloaded again), none of
a shard known to fail; a resumed rank's latest before its checkpoint (its samples of the epoch
dealt from its start to as many ranks, at the positions the checkpoint delivered; a DataLoader
worker's, the first pairs of its slice its own checkpoint delivered), and for a DataLoader worker
with fewer, its fellow workers' first pairs (they read those too). The epoch is dealt again from
the counts its sequence was fed (ids only, no payload). Nothing on several nodes, whose parts
are dealt anew.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING

from ..shared.mixture import MixSpec
from ..shared.nodes import NodeShare, NodeSpec
from ..shared.sequence import EpochSpec, IdRun, RankShare, SampleId, ShardFeed
from .epoch_shards import EpochShards
from .holes import POOL_SAMPLES
from .reads import Item
from .worker_slices import WorkerSlice

if TYPE_CHECKING:
    from .stream import StreamSettings

# Shards read again at most: each may have to be downloaded again for the few of its samples it
# gives (a shuffled share's latest 64 samples lie in dozens of shards).
LOOK_BACK_SHARDS = 8


class LookBack:
    """The look-back of one stream, in passes: each gives the items (position in the epoch, id)
    to read that no pass gave before. A pass whose reads fail in shards not known to fail when it
    began (a shard that failed before a checkpoint, which the resumed run did not meet) is
    followed by another, which looks past them; after one whose reads failed in none, none."""

    def __init__(
        self,
        spec: EpochSpec | NodeSpec | MixSpec,
        share: RankShare | NodeShare,
        shards: EpochShards,
        settings: StreamSettings,
        worker: WorkerSlice,
    ) -> None:
        self.spec, self.share, self.shards, self.settings, self.worker = spec, share, shards, settings, worker
        self.looked_at: set[SampleId] = set()  # what the passes gave so far...
        self.skipped_at = -1  # ...and how many shards were skipped when the latest began

    @property
    def began(self) -> bool:
        """Whether a pass began: reads from then on only fill the pool."""
        return self.skipped_at >= 0

    def next_pass(self) -> list[Item] | None:
        """The next pass's items (maybe none), or None: no other pass."""
        skipped = len(self.shards.skipped)
        if skipped == self.skipped_at:
            return None
        self.skipped_at = skipped
        s = self.settings
        items = look_back(self.spec, self.share, self.shards, s.world_size, s.rank, s.drop_last, self.worker)
        again = [item for item in items if item[1] not in self.looked_at]
        self.looked_at.update(item[1] for item in again)
        return again


def look_back(
    spec: EpochSpec | NodeSpec | MixSpec,
    share: RankShare | NodeShare,
    shards: EpochShards,
    world_size: int,
    rank: int,
    drop_last: bool,
    worker: WorkerSlice,
) -> list[Item]:
    """The items (position in the epoch, id), in order, to read again for the pool of the stream
    of ``spec`` and ``share`` (see the module docstring)."""
    if isinstance(spec, NodeSpec) or isinstance(share, NodeShare):
        return []
    skipped, resume = shards.skipped, share.resume

    def resumed() -> RankShare:  # (a share records its dealing: one for each pass)
        return RankShare(world_size, rank, resume=resume, drop_last=drop_last, block=share.block)

    latest: deque[Item] = deque(maxlen=POOL_SAMPLES)
    if resume.delivered():
        fresh = RankShare(world_size, rank, drop_last=drop_last, block=share.block)
        for pair in fresh.pairs(_dealt_again(spec, shards)):
            if pair is not None and resume.skips(pair[0]) and pair[1][0] not in skipped:
                latest.append(pair)
    if worker.skip:
        pairs = resumed().pairs(_dealt_again(spec, shards), part=worker.index, parts=worker.count)
        for pair in islice((p for p in pairs if p is not None), worker.skip):
            if pair[1][0] not in skipped:
                latest.append((resume.real(pair[0]), pair[1]))
        latest = deque(sorted(latest), maxlen=POOL_SAMPLES)
    if len(latest) < POOL_SAMPLES and worker.count > 1:  # a worker with too few samples: its fellows' first ones
        for part in range(worker.count):
            if part == worker.index:
                continue
            pairs = resumed().pairs(_dealt_again(spec, shards), part=part, parts=worker.count)
            theirs = ((resume.real(p[0]), p[1]) for p in pairs if p is not None and p[1][0] not in skipped)
            latest.extend(islice(theirs, POOL_SAMPLES - len(latest)))
        latest = deque(sorted(latest), maxlen=POOL_SAMPLES)
    kept: list[Item] = []
    read: set[int] = set()
    for item in reversed(latest):  # the latest first: their shards are the likeliest still cached
        if item[1][0] in read or len(read) < LOOK_BACK_SHARDS:
            read.add(item[1][0])
            kept.append(item)
    return kept[::-1]


def _dealt_again(spec: EpochSpec | MixSpec, shards: EpochShards) -> Iterator[SampleId | IdRun | list[SampleId]]:
    """The epoch's ids again, from the counts its sequence was fed."""
    if isinstance(spec, MixSpec):
        yield from spec.runs()  # planned with every count
        return
    counts = shards.sequenced
    feed = ShardFeed()
    for sid in spec.runs(feed):
        if sid is None:  # every count is final: fed whole at once
            assert feed.wanted is not None
            feed.grow(counts.get(feed.wanted, 0))
            feed.end()
            continue
        yield sid
