"""The epoch's global sample sequence: a pure function of the list, the counts and the seeds.

Shards are read in :func:`~wdscache.shared.plan.shard_order`; their samples pass
through a seeded shuffle buffer; the output is the epoch's global sequence of
``(shard, sample)`` ids. Nothing here depends on the number of ranks, agent
workers or on timing, which is what makes every rank's share exact and a
checkpoint valid across world sizes.

Ranks take positions in blocks (:class:`RankShare`): the sequence is cut into
rows of ``W * BLOCK`` positions and rank ``r`` of ``W`` takes the ``r``-th block
of ``BLOCK`` consecutive positions of each row. Unshuffled, a rank thus reads
runs of neighbouring samples, which a worker sends as one frame rather than
one frame per sample. What is left after the last full row is dealt out one
position at a time (rank ``r`` takes ``r, r + W, ...``): with ``drop_last`` it
is cut to a multiple of ``W``; otherwise it is padded by wrapping around to the
start of the sequence. Every rank gets the same count.

An unshuffled sequence comes as runs of a shard's neighbouring samples
(:meth:`EpochSpec.runs`), which a rank deals by arithmetic: of each row it makes
only the ids it may take, so its cost per own sample does not grow with ``W``.
A shuffled one comes as lists of the ids that left the shuffle buffer together
(a mixture's as lists too), which a rank deals by slicing: each id still passes
the buffer, once, but no layer above it looks at each.

A rank learns that a row is full only once all its positions have come out
of the sequence, so with ``W > 1`` a rank's first sample of a row waits for
``W * BLOCK`` ids (no wait on a warm cache, where the counts are known).

Where a job stopped is a :class:`Resume`: all positions before ``position``,
plus the runs in ``done``. A block can be part-delivered when a checkpoint is
taken, so ``done`` holds the delivered part of each rank's block of that row
(and such runs of earlier checkpoints that are still ahead of ``position``:
at most one per rank of each). Resuming deals the positions not delivered,
in order, to the new ranks the same way; any world size can resume any
checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

from .plan import epoch_rng, shard_order

SampleId = tuple[int, int]  # (shard index in the list, sample index in the shard)


class IdRun(NamedTuple):
    """Neighbouring ids of the sequence: samples ``start`` to ``stop`` (excluded) of ``shard``,
    in order. Dealt without making an id of each (see :meth:`RankShare.pairs`)."""

    shard: int
    start: int
    stop: int


INITIAL = 100  # ids in the shuffle buffer before it gives out the first
# Positions a rank takes at a time. Part of what a job's ranks agree on: changing it
# changes every rank's share (a checkpoint stays valid: it names positions, not blocks).
BLOCK = 8


@dataclass(frozen=True)
class EpochSpec:
    """Everything the sequence of one epoch depends on (besides the per-shard counts)."""

    n_shards: int
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 1000
    # The shards read, of the list's ``n_shards`` (one node's part, see :mod:`wdscache.shared.nodes`):
    # None reads them all.
    shards: tuple[int, ...] | None = None

    def order(self) -> Sequence[int]:
        if self.shards is None:
            return shard_order(self.n_shards, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        mine = self.shards
        return tuple(mine[i] for i in shard_order(len(mine), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle))

    def ids(self, samples: Callable[[int], Iterable[int | None]]) -> Iterator[SampleId | None]:
        """The epoch's sample ids: :func:`global_sequence`."""
        return global_sequence(self, samples)

    def runs(self, feed: ShardFeed) -> Iterator[IdRun | list[SampleId] | None]:
        """The epoch's ids, as :meth:`ids` with ``feed.samples`` gives them, but unshuffled
        ones as one :class:`IdRun` for each piece of a shard that ``feed`` supplies at once,
        shuffled ones as lists: those that left the shuffle buffer as a piece arrived."""
        order = self.order()
        if self.shuffle and self.shuffle_buffer > 1:
            pieces = (None if got is None else zip(repeat(shard), got) for shard in order for got in feed.spans(shard))
            rng = epoch_rng(self.seed, self.epoch, "samples")
            yield from (out for out in buffered(pieces, rng, self.shuffle_buffer) if out != [])
            return
        for shard in order:
            for got in feed.spans(shard):
                yield None if got is None else IdRun(shard, got.start, got.stop)

    def following(self) -> EpochSpec:
        """The same reading of the next epoch."""
        return dataclasses.replace(self, epoch=self.epoch + 1)


def global_sequence(spec: EpochSpec, samples: Callable[[int], Iterable[int | None]]) -> Iterator[SampleId | None]:
    """Yield the epoch's sample ids in order; ``samples(shard)`` gives a shard's sample
    indices ``0, 1, ...`` when the sequence reaches it.

    ``samples`` may yield None, meaning "no more yet" (a shard still downloading, or
    one whose count the caller has still to learn: see :class:`ShardFeed`): the None
    is passed on, so that the caller can do other work and ask again. It never
    changes the sequence, only when its ids come out.

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
    pieces = (None if j is None else ((shard, j),) for shard in order for j in samples(shard))
    for out in buffered(pieces, rng, size):
        if out is None:
            yield None
        else:
            yield from out


def buffered(
    pieces: Iterable[Iterable[SampleId] | None], rng: random.Random, size: int
) -> Iterator[list[SampleId] | None]:
    """Ids through the shuffle buffer of :func:`global_sequence` (``size`` > 1 ids at most,
    drawn from with ``rng``), as they arrive in ``pieces``: for each piece, the list of ids
    that left the buffer as its ids went in (maybe empty), and at the end the rest; a None
    piece is passed on. ``pieces`` may be endless. How the ids are cut into pieces never
    changes the sequence. Ids are kept as given: a mixture's are tuples of a class naming
    their source."""
    initial = min(size, INITIAL)
    buf: list[SampleId] = []
    append, pop, getrandbits = buf.append, buf.pop, rng.getrandbits
    arrived = 0
    for piece in pieces:
        if piece is None:
            yield None
            continue
        out: list[SampleId] = []
        for sid in piece:
            append(sid)
            n = len(buf)
            arrived += 1
            if n >= size or (n >= initial and not arrived & 1):
                # rng.randrange(n), the same draws (CPython's _randbelow_with_getrandbits,
                # unchanged from 3.10 to 3.13), without its two calls an id
                bits = n.bit_length()
                k = getrandbits(bits)
                while k >= n:
                    k = getrandbits(bits)
                buf[k], buf[-1] = buf[-1], buf[k]
                out.append(pop())
        yield out
    rng.shuffle(buf)
    yield buf


class ShardFeed:
    """Shards' samples as the caller learns them, for :func:`global_sequence`, which then
    never waits on I/O: ``global_sequence(spec, feed.samples)``.

    When the sequence reaches a shard, or has taken every sample it was given of it, it
    yields None with ``wanted`` set to that shard. The caller then says what it knows:
    :meth:`grow` (the shard holds ``count`` samples so far), :meth:`end` (no more than it
    was given), or nothing yet (the sequence asks again at its next None). What is
    supplied when never changes the sequence, only when its ids come out.
    """

    def __init__(self) -> None:
        self.wanted: int | None = None
        # Shards asked for so far (the same one again counts too: a node's next part may start
        # one the part before left unfinished): what is learnt of a shard is for one ask of it.
        self.asks = 0
        self._count = 0
        self._ended = False

    def samples(self, shard: int) -> Iterator[int | None]:
        """``shard``'s sample indices, as supplied; None whenever the caller has to supply more."""
        for got in self.spans(shard):
            if got is None:
                yield None
            else:
                yield from got

    def spans(self, shard: int) -> Iterator[range | None]:
        """``shard``'s sample indices as :meth:`samples` gives them, those supplied at once as one range."""
        self.wanted, self._count, self._ended = shard, 0, False
        self.asks += 1
        given = 0
        while True:
            if self._count > given:
                yield range(given, self._count)
                given = self._count
            elif self._ended:
                self.wanted = None
                return
            else:
                yield None

    def grow(self, count: int) -> None:
        """The wanted shard holds ``count`` samples (so far)."""
        self._count = max(self._count, count)

    def end(self) -> None:
        """The wanted shard holds no samples beyond those supplied."""
        self._ended = True


def rank_length(total: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank receives in an epoch of ``total`` samples."""
    return total // world_size if drop_last else math.ceil(total / world_size)


@dataclass(frozen=True)
class Resume:
    """Positions of an epoch already delivered: all before ``position``, and the half-open
    runs in ``done`` (sorted, disjoint, each after ``position`` and not touching it)."""

    position: int = 0
    done: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        last = self.position
        for a, b in self.done:
            if not last < a < b:
                raise ValueError(f"not a normal Resume: {self}; build it with Resume.of")
            last = b

    @classmethod
    def of(cls, position: int, runs: Iterable[Sequence[int]] = ()) -> Resume:
        """The normal form of "before ``position``, and ``runs``" (runs may overlap or touch)."""
        merged: list[list[int]] = []
        for a, b in sorted((int(a), int(b)) for a, b in runs):
            if b <= a or b <= position:
                continue
            a = max(a, position)
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        if merged and merged[0][0] == position:
            position = merged.pop(0)[1]
        return cls(position, tuple((a, b) for a, b in merged))

    def delivered(self, total: int | None = None) -> int:
        """How many positions were delivered (of the first ``total``, if given)."""
        if total is None:
            return self.position + sum(b - a for a, b in self.done)
        return min(self.position, total) + sum(max(0, min(b, total) - a) for a, b in self.done)

    def skips(self, pos: int) -> bool:
        """True if position ``pos`` was delivered."""
        if pos < self.position:
            return True
        i = bisect_right(self.done, (pos, float("inf"))) - 1
        return i >= 0 and self.done[i][0] <= pos < self.done[i][1]

    def real(self, v: int) -> int:
        """The position of the ``v``-th position (from 0) not delivered."""
        pos = self.position + v
        for a, b in self.done:
            if a > pos:
                break
            pos += b - a
        return pos


def _ids_at(piece: IdRun | list[SampleId], x: int, y: int, step: int = 1) -> list[SampleId]:
    """The ids at offsets ``range(x, y, step)`` (none negative) of ``piece``."""
    if isinstance(piece, list):
        return piece[x:y:step]
    shard, start = piece.shard, piece.start
    return [(shard, start + i) for i in range(x, y, step)]


def _pieces(resume: Resume, a: int, b: int) -> Iterator[tuple[int, int, bool]]:
    """Positions ``[a, b)`` in order, as pieces ``(start, stop, kept)``: kept if not delivered in ``resume``."""
    if a < resume.position:
        yield a, min(b, resume.position), False
        a = min(b, resume.position)
    i = bisect_right(resume.done, (a, float("inf"))) - 1
    for x, y in resume.done[max(i, 0) :]:
        if a >= b:
            return
        if y <= a:
            continue
        if x > a:
            yield a, min(x, b), True
            a = min(x, b)
        if a < b:
            yield a, min(y, b), False
            a = min(y, b)
    if a < b:
        yield a, b, True


def slice_of(
    pairs: Iterable[tuple[int, SampleId] | None], part: int, parts: int, skip: int = 0, block: int = BLOCK
) -> Iterator[tuple[int, SampleId] | None]:
    """Slice ``part`` of ``parts`` of a share's pairs (Nones passed on), its first ``skip``
    left out: the pairs whose block ``v // block`` is ``part`` modulo ``parts``, ``v``
    counting the pairs. Blocks of neighbouring positions stay whole (one read each); the
    slices are disjoint and together the share. A DataLoader worker reads such a slice
    (:class:`~wdscache.training.worker_slices.WorkerSlice`)."""
    v = 0
    kept = 0
    for pair in pairs:
        if pair is None:
            yield None
            continue
        mine = (v // block) % parts == part
        v += 1
        if mine:
            kept += 1
            if kept > skip:
                yield pair


def _blocks_of(start: int, stop: int, part: int, parts: int, block: int) -> Iterator[tuple[int, int]]:
    """The runs of ``[start, stop)`` whose block ``v // block`` is ``part`` modulo ``parts``."""
    period = parts * block
    x = start - start % period + part * block  # our block in start's period
    if x + block <= start:
        x += period
    while x < stop:
        yield max(x, start), min(x + block, stop)
        x += period


class RankShare:
    """One rank's share of an epoch: ``(position, id)`` pairs from the epoch's ids.

    A pair's position counts only the positions not in ``resume``, from 0 (padding
    repeats come after the last). :meth:`resume_after` gives the job's
    :class:`Resume` once every rank has delivered ``n`` of its pairs. One
    :meth:`pairs` iteration per instance: it records how the rows were dealt.
    """

    def __init__(
        self, world_size: int, rank: int, *, resume: Resume = Resume(), drop_last: bool = False, block: int = BLOCK
    ) -> None:
        self.world_size, self.rank, self.resume = world_size, rank, resume
        self.drop_last, self.block = drop_last, block
        self.full_rows = 0  # rows dealt out in blocks
        self.tail: int | None = None  # positions left after the full rows, once the ids ended
        self.count: int | None = None  # the share's pairs (every slice's), once the ids ended
        # Ids of the sequence (from its start) that no longer wait in a row: every one of
        # them dealt, and this rank's handed out. What comes later may still be ours.
        self.settled = 0

    def pairs(
        self,
        ids: Iterable[SampleId | IdRun | list[SampleId] | None],
        *,
        part: int = 0,
        parts: int = 1,
        skip: int = 0,
    ) -> Iterator[tuple[int, SampleId] | None]:
        """This rank's pairs; a None from ``ids`` (no more yet) is passed on. An :class:`IdRun`
        is dealt arithmetically: of its ids, only this rank's are made; a list of ids (of a
        shuffled epoch or a mixture) the same way, by slicing.

        With ``parts`` > 1 or a ``skip``, only slice ``part`` of them, its first ``skip``
        left out: what :func:`slice_of` keeps of them, in blocks of the share's ``block``.
        The record of the dealing (``full_rows``, ``tail``, ``settled``) is the whole
        share's, but only the slice's pairs are made (of a row, an :class:`IdRun` or a
        list): a slice costs about its own pairs, not the share's. Single ids (a node's
        sequence) pass one by one."""
        W, r, B = self.world_size, self.rank, self.block
        WB, lo, hi = W * B, r * B, r * B + B  # a row's length; our block in it
        resume = self.resume
        first: list[SampleId] = []  # the epoch's first ids, for padding
        # The current row (positions full_rows * WB onwards): how long it is so far, and only
        # the ids of it this rank may take: those of our block, and those at r, r + W, ...
        # (ours if the ids end before the row is full).
        row = 0
        block: list[SampleId] = []
        spaced: list[SampleId] = []
        spaced_at = r  # the row's next index that goes in spaced
        pos = v = 0  # position in the epoch; in the share's numbering
        whole = parts == 1 and not skip  # every pair of the share
        left = skip  # the slice's pairs still to leave out
        # A full row gives the share ``B`` pairs, one block of the slices (a share is
        # iterated once, from no rows): the row's are ours or none is, so a row not ours is
        # not even collected.
        ours = self.full_rows % parts == part  # the current row's block is the slice's (always, without slices)

        def sliced(batch: Iterable[tuple[int, SampleId]]) -> list[tuple[int, SampleId]]:
            """The slice's pairs of ``batch``, the share's next pairs (``v`` counts them)."""
            nonlocal v, left
            kept = []
            for pair in batch:
                if (v // B) % parts == part:
                    if left:
                        left -= 1
                    else:
                        kept.append(pair)
                v += 1
            return kept

        for sid in ids:
            if sid is None:
                yield None
                continue
            if isinstance(sid, (IdRun, list)):  # ids of consecutive positions: dealt by arithmetic and slices
                n = len(sid) if isinstance(sid, list) else sid.stop - sid.start
                if len(first) < W:
                    first += _ids_at(sid, 0, min(n, W - len(first)))
                end = pos + n
                for a, b, kept in _pieces(resume, pos, end):
                    if not kept:
                        if not row:
                            self.settled = b
                        continue
                    o = a - pos  # the offset in the piece of the id at position a
                    if W == 1 and whole:
                        for p, one in enumerate(_ids_at(sid, o, o + b - a), a):
                            yield v, one
                            v += 1
                            self.settled = p + 1
                        continue
                    if W == 1:  # the slice's blocks of [v, v + b - a), found by arithmetic
                        v0 = v
                        for x, y in _blocks_of(v, v + b - a, part, parts, B):
                            taken = min(left, y - x)
                            left -= taken
                            self.settled = a + x + taken - v0
                            for u, one in zip(range(x + taken, y), _ids_at(sid, o + x + taken - v0, o + y - v0)):
                                yield u, one
                                self.settled = a + u - v0 + 1
                        v += b - a
                        self.settled = b
                        continue
                    while a < b:
                        k = min(b - a, WB - row)  # this many go into the row
                        mine = range(max(row, lo), min(row + k, hi))
                        if ours and mine:
                            block += _ids_at(sid, o + mine.start - row, o + mine.stop - row)
                        a += k
                        if row + k < WB:  # the row stays open: the ids at r, r + W, ... may be ours
                            spaced += _ids_at(sid, o + spaced_at - row, o + k, W)
                            spaced_at += W * len(range(spaced_at, row + k, W))
                            row += k
                            break
                        o += k
                        base = self.full_rows * WB
                        self.full_rows += 1
                        for i in range(min(left, len(block)), len(block)):
                            yield base + lo + i, block[i]
                        if not whole:
                            left -= min(left, len(block))
                            ours = self.full_rows % parts == part
                        row, block, spaced, spaced_at = 0, [], [], r
                        self.settled = a
                pos = end
                continue
            if len(first) < W:
                first.append(sid)
            pos += 1
            if pos <= resume.position or (resume.done and resume.skips(pos - 1)):
                if not row:
                    self.settled = pos
                continue
            if W == 1:  # everything is ours, in order: no row to wait for
                if whole or (v // B) % parts == part and not left:
                    yield v, sid
                elif (v // B) % parts == part:
                    left -= 1
                v += 1
                self.settled = pos
                continue
            if lo <= row < hi and ours:
                block.append(sid)
            if row == spaced_at:
                spaced.append(sid)
                spaced_at += W
            row += 1
            if row == WB:
                base = self.full_rows * WB
                self.full_rows += 1
                for i in range(min(left, len(block)), len(block)):
                    yield base + lo + i, block[i]
                if not whole:
                    left -= min(left, len(block))
                    ours = self.full_rows % parts == part
                row, block, spaced, spaced_at = 0, [], [], r
                self.settled = pos
        self.tail = row
        base = self.full_rows * WB
        cut = row - row % W
        last = list(zip(range(base + r, base + cut, W), spaced))
        if row > cut and not self.drop_last:
            # The row is padded by wrapping around to the start: the ids at cut, cut + 1, ...
            # then the epoch's first ones again.
            last.append((base + cut + r, spaced[-1] if r < row - cut else first[(r - (row - cut)) % len(first)]))
        self.count = v if W == 1 else self.full_rows * B + len(last)
        if not whole and W > 1:
            v = self.full_rows * B  # the full rows' pairs, counted
        yield from last if whole else sliced(last)
        self.settled = pos

    @classmethod
    def known(
        cls,
        world_size: int,
        rank: int,
        length: int,
        *,
        resume: Resume = Resume(),
        drop_last: bool = False,
        block: int = BLOCK,
    ) -> RankShare:
        """The share of an epoch whose ``length`` positions not in ``resume`` are known up front (the
        sample counts are): :meth:`resume_after` then needs no :meth:`pairs` iteration."""
        share = cls(world_size, rank, resume=resume, drop_last=drop_last, block=block)
        share.full_rows = length // (world_size * block) if world_size > 1 else 0
        share.tail = length - share.full_rows * world_size * block
        return share

    @classmethod
    def dealt(
        cls, world_size: int, full_rows: int, tail: int | None, *, resume: Resume = Resume(), block: int = BLOCK
    ) -> RankShare:
        """The share as a rank's :meth:`pairs` dealt it, from what that recorded (``full_rows``,
        ``tail``): for :meth:`resume_after_runs` in another process."""
        share = cls(world_size, 0, resume=resume, block=block)
        share.full_rows, share.tail = full_rows, tail
        return share

    def resume_after(self, n: int) -> Resume:
        """The job's :class:`Resume` once each rank delivered its first ``n`` pairs.

        Needs those pairs to have been produced by :meth:`pairs` (they have been, if
        this rank delivered them).
        """
        return self.resume_after_runs([(0, n)] if n > 0 else [])

    def resume_after_runs(self, runs: Iterable[tuple[int, int]]) -> Resume:
        """The job's :class:`Resume` once each rank delivered its pairs of ``runs``: half-open
        runs of pair indexes, in the order :meth:`pairs` gave them (the DataLoader workers of
        a rank deliver blocks of them, see :mod:`wdscache.training.worker_slices`). Padding
        repeats count for nothing."""
        real = self.resume.real
        # A run maps to the positions from its first to its last: any between them were
        # delivered before (they are why the numbering skips them).
        delivered = [(real(a), real(b - 1) + 1) for a, b in self._positions(runs) if b > a]
        return Resume.of(self.resume.position, list(self.resume.done) + delivered)

    def _positions(self, runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The positions (every rank's, in this share's numbering) of the rank's pair-index ``runs``."""
        W, B = self.world_size, self.block
        if W == 1:  # the rank's pairs are the positions, in order (no rows)
            return list(runs)
        F = self.full_rows * B  # pairs in the full rows
        out: list[tuple[int, int]] = []

        def in_block(k: int, o1: int, o2: int) -> None:
            base = k * W * B
            if o1 == 0 and o2 == B:
                out.append((base, base + W * B))
            else:
                out.extend((base + q * B + o1, base + q * B + o2) for q in range(W))

        for a, b in runs:
            if a < F:
                e = min(b, F)
                k1, k2 = a // B, (e - 1) // B
                if k1 == k2:
                    in_block(k1, a - k1 * B, e - k1 * B)
                else:
                    in_block(k1, a - k1 * B, B)
                    if k2 > k1 + 1:
                        out.append(((k1 + 1) * W * B, k2 * W * B))
                    in_block(k2, 0, e - k2 * B)
            if b > F:
                if self.tail is None:
                    raise ValueError("more pairs delivered than were dealt")
                base = F * W
                t1, t2 = max(a, F) - F, b - F
                if t1 * W < self.tail:
                    out.append((base + t1 * W, base + min(self.tail, t2 * W)))
        return out
