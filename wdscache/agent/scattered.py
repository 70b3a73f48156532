"""A read of scattered samples, as a shuffled epoch makes, answered by whole columns.

The general path of a read (``_Worker._read``) works a stretch of consecutive samples at
a time: its place in the table, its run of bytes, the run's copy, its rows of the reply.
A read in archive order is a few stretches; in a shuffled read every sample is one, and
on small samples that work, done sample by sample, would be most of a worker's time.
When each sample of such a read can be copied (:func:`scattered` says when), the same
reply is built here from columns of the shards' tables, each gathered in one pass over
the read, and the copies are made in one join. The consumer reads it as any other reply:
a row per sample pointing into one copied frame. The one difference: two samples next
to each other in their shard are two pieces, not one run (the tar header between them is
not copied).

Main loop of one worker only (as :mod:`wdscache.agent.reply_frames`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from operator import add, and_, eq, ge, sub
from typing import Any

from ..shared.protocol import PREAD_BYTES
from .reply_frames import GATHER_BELOW
from .sampletable import PackedSamples

_CLOSE = range(1, 5)  # samples apart in their shard that a file range likely holds together


@dataclass(frozen=True)
class Scattered:
    """A reply to a scattered read: sample ``i``'s key is ``keys[i]``, its row (``layout, 0,
    offset, size, ...``, offsets into the one frame that ``pieces`` joined make) is in
    ``table``; ``views`` are the mapped shards they were cut from (whose pages leave the
    worker's RSS once the frame is sent)."""

    keys: list[str]
    layouts: list[tuple[str, ...]]
    table: list[int]
    pieces: list[memoryview]
    views: list[Any]
    nbytes: int


def scattered(
    shard_of: Sequence[int],
    index_of: Sequence[int],
    shards: Sequence[tuple[Any, Any, Any, int, int]],
    files: Mapping[Any, Any],
    room: int,
) -> Scattered | None:
    """The reply to a read of sample ``index_of[i]`` of shard ``shard_of[i]`` for each ``i``
    (``shards[k]``: its view, samples, placer, count and merge gap, as ``_read`` makes them),
    or None when the general path must answer it: fewer than two samples; a shard still
    downloading or being walked, or whose samples have more than one layout; layouts of
    different lengths across the read; a sample number past a shard's end (the general path
    says which); a sample as long as a file range of ``files`` (``PREAD_BYTES``) or a
    frame of its own (``GATHER_BELOW``), or close enough behind the one before it of a shard
    of ``files`` to share a file range with it (samples mostly a few apart in such a shard:
    told before any column is built); or more bytes in all than ``room``."""
    n = len(shard_of)
    if n < 2:
        return None
    if files:
        # Samples a few apart in one shard, one after another (every other sample of a shard, as one
        # of two DataLoader workers reads it in order): runs the general path names as file ranges.
        # Such a read is left to it before any column is built (``_ranged`` decides the others).
        steps = map(_CLOSE.__contains__, map(sub, index_of[1:], index_of[:-1]))
        if 4 * sum(map(and_, map(eq, shard_of[1:], shard_of[:-1]), steps)) > n:
            return None
    used = set(shard_of)
    tables: list[PackedSamples | None] = [None] * len(shards)
    for k in used:
        samples = shards[k][1]
        if not isinstance(samples, PackedSamples) or len(samples.layouts) != 1:
            return None
        tables[k] = samples
    width = len(shards[shard_of[0]][1].layouts[0])
    if any(len(shards[k][1].layouts[0]) != width for k in used):
        return None
    counts = [count for _, _, _, count, _ in shards]
    if any(map(ge, index_of, map(counts.__getitem__, shard_of))):
        return None
    # One layout: sample j's numbers (offset, size of each field) are the 2 * width from 2 * width * j on.
    w2 = 2 * width
    numbers = [t.numbers if t is not None else None for t in tables]
    cols = list(zip(*[numbers[k][j * w2 : j * w2 + w2] for k, j in zip(shard_of, index_of)]))  # type: ignore[index]
    starts, ends = cols[0], list(map(add, cols[-2], cols[-1]))
    lengths = list(map(sub, ends, starts))
    limits = [PREAD_BYTES if view in files else GATHER_BELOW for view, *_ in shards]
    if any(map(ge, lengths, map(limits.__getitem__, shard_of))) or sum(lengths) > room:
        return None
    for k in used:
        view, _, _, _, merged = shards[k]
        if view in files and _ranged(starts, ends, list(map(eq, shard_of, repeat(k))), merged):
            return None
    texts = [(t.keys, t.key_ends) if t is not None else ("", ()) for t in tables]
    keys = [texts[k][0][texts[k][1][j - 1] if j else 0 : texts[k][1][j]] for k, j in zip(shard_of, index_of)]
    data = [view.data if tables[k] is not None else None for k, (view, *_) in enumerate(shards)]
    pieces = [data[k][a:b] for k, a, b in zip(shard_of, starts, ends)]  # type: ignore[index]
    numbered: dict[tuple[str, ...], int] = {}
    layout_of = [numbered.setdefault(t.layouts[0], len(numbered)) if t is not None else 0 for t in tables]
    # Each sample's offsets move from its shard to where its piece lies in the frame.
    shift = list(map(sub, accumulate(lengths, initial=0), starts))
    row = w2 + 2
    table = [0] * (n * row)  # frame 0: the copied frame, for every sample
    table[0::row] = list(map(layout_of.__getitem__, shard_of))
    for i in range(width):
        table[2 + 2 * i :: row] = list(map(add, cols[2 * i], shift))
        table[3 + 2 * i :: row] = cols[2 * i + 1]
    views = [shards[k][0] for k in used]
    return Scattered(keys, list(numbered), table, pieces, views, sum(map(sum, cols[1::2])))


def _ranged(starts: Sequence[int], ends: Sequence[int], mine: list[bool], merged: int) -> bool:
    """Whether the general path would name a file range for some of the samples ``mine`` marks
    (of one shard the consumer reads itself; each ``[starts[i], ends[i])``, in read order): a
    sample at most ``merged`` bytes past the end of the one before it of the shard makes a run
    with it, and a run of ``PREAD_BYTES`` or more goes as a range (every other sample, as one
    of two DataLoader workers reads them). Runs shorter than that are copied either way."""
    firsts, lasts = list(compress(starts, mine)), list(compress(ends, mine))
    gaps = list(map(sub, firsts[1:], lasts))
    ordered = sorted(gaps)  # no sample makes a run with the one before it (the usual case): no loop
    at = bisect_left(ordered, 0)
    if at == len(ordered) or ordered[at] > merged:
        return False
    run_start = firsts[0]
    for i, gap in enumerate(gaps):
        if not 0 <= gap <= merged:
            run_start = firsts[i + 1]
        elif lasts[i + 1] - run_start >= PREAD_BYTES:
            return True
    return False
