"""The holes of one rank's epoch, in the training process: the places of samples whose shard
was skipped (``on_error="skip"``, or a handler that goes on), as the stream hands each read's
samples out (:class:`Holes`, one per epoch stream).

- One rank alone (``world_size == 1``) drops them, as webdataset does: the epoch yields the
  samples read and only those, each once. No other rank waits for its count, nor do its
  DataLoader workers for each other's. A checkpoint still counts positions of the share
  (:meth:`Holes.positions`): the holes before a sample handed out count as delivered with it,
  so a resumed run neither reads them as missing nor hands out a sample twice; holes after
  the last sample handed out are met again by the resumed run (dropped again if their shard
  still fails).
- Several ranks fill each hole with a repeat of a sample the rank read, so that every rank
  keeps the count the epoch planned (a data-parallel job whose ranks yield unequal counts
  hangs in its collectives). The repeat is chosen in a pool: the rank's latest samples before
  the hole, at most :data:`POOL_SAMPLES` and about :data:`POOL_BYTES` of payload (large
  samples make it smaller, never larger); the least repeated of them so far, ties broken by a
  hash of the seed, the epoch and the hole's position. So repeats spread over the pool (a
  sample comes back about holes / pool times), and the same inputs give the same repeats,
  however the share is cut into reads. Holes met before the rank read a pool's worth
  (:data:`POOL_SAMPLES` samples or :data:`POOL_BYTES`) wait for it, and the reads from the
  first of them on are held back until then (or the share's end): filled from those first
  samples, not from the few read before. Samples and positions stay one for one (every rank's
  checkpoint counts its samples handed out as positions, and the ranks' must agree). A stream
  whose share ends with more holes waiting than samples read, fewer than a pool's worth (a
  resumed rank's rest, a DataLoader worker's slice), has too few to spread the repeats over:
  other samples of the rank are read again for the pool (:meth:`Holes.prime`,
  :mod:`wdscache.training.look_back`), none of them handed out.

The pool keeps whole reads' lists (no step of Python per sample on the way out of a read
without holes): the latest reads holding :data:`POOL_SAMPLES` samples, fewer if they pass
:data:`POOL_BYTES`, so it holds at most about that plus one read (about 4 MiB: see
:mod:`wdscache.training.read_batches`); reads held back hold a pool's worth of samples at most,
and a place (a None) for each hole met meanwhile.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .reads import Item

POOL_SAMPLES = 64  # recent samples a hole's repeat is chosen among, at most...
POOL_BYTES = 32 << 20  # ...and about this much of their payload
_MASK = (1 << 64) - 1
PRIMED_BELOW = 1 << 62  # a primed sample's number is its count among them less this

Pooled = tuple[int, dict[str, Any], int]  # (number of the sample among those read, sample, payload bytes)


class HoleMode(enum.Enum):
    DROP = "drop"  # one rank: holes are left out
    FILL = "fill"  # several ranks: each hole is a repeat of a recent sample


@dataclass(slots=True)
class Recent:
    """A read's samples kept for the pool: ``first`` is the number of its first sample among
    the samples the rank read (repeats not counted)."""

    first: int
    samples: list[dict[str, Any]]
    sizes: list[int]
    nbytes: int  # their payload


@dataclass(slots=True)
class Pool:
    """FILL: the samples a hole's repeat is chosen among (oldest first) and their payload."""

    entries: deque[Pooled] = field(default_factory=deque)
    nbytes: int = 0

    def add(self, entry: Pooled) -> None:
        """``entry`` joins; the oldest go past POOL_SAMPLES or POOL_BYTES (one stays)."""
        entries = self.entries
        entries.append(entry)
        self.nbytes += entry[2]
        while len(entries) > POOL_SAMPLES or (len(entries) > 1 and self.nbytes > POOL_BYTES):
            self.nbytes -= entries.popleft()[2]


@dataclass(slots=True)
class Held:
    """FILL: what is held back until the rank read a pool's worth: the samples to hand out
    (None at a hole) and their sizes, and each hole's (index there, position in the epoch)."""

    samples: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    holes: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Holes:
    """The holes of one epoch stream: dropped or filled (see the module docstring)."""

    mode: HoleMode
    seed: int
    epoch: int
    real: int = 0  # samples read (no repeat)
    real_bytes: int = 0  # and their payload, while it matters (until a pool's worth)
    repeated: int = 0  # FILL: holes filled
    dropped: int = 0  # DROP: holes left out
    held: Held | None = None  # FILL: reads held back (see Held)
    recent: deque[Recent] = field(default_factory=deque)  # FILL: the latest reads, oldest first
    held_samples: int = 0  # samples in ``recent``...
    held_bytes: int = 0  # ...and their payload
    uses: dict[int, int] = field(default_factory=dict)  # FILL: sample number -> its repeats so far
    # DROP: the sample numbers after which holes were dropped, and the holes dropped before each.
    marks_at: list[int] = field(default_factory=list)
    marks_holes: list[int] = field(default_factory=list)
    _pending: bool = False  # DROP: holes dropped since the latest sample
    primed: int = 0  # FILL: samples read before a checkpoint for the pool (see prime)...
    primed_reads: int = 0  # ...and the reads of ``recent`` that hold them (its first)

    @classmethod
    def of(cls, world_size: int, seed: int, epoch: int) -> Holes:
        return cls(HoleMode.DROP if world_size == 1 else HoleMode.FILL, seed, epoch)

    @property
    def warm(self) -> bool:
        """FILL: the rank read a pool's worth: a hole is filled at once."""
        return self.real >= POOL_SAMPLES or self.real_bytes >= POOL_BYTES

    def whole(self, samples: list[dict[str, Any]], sizes: list[int], nbytes: int) -> None:
        """A read without holes, none held back (the usual case: a step per read, none per sample)."""
        if not samples:
            return
        if self.mode is HoleMode.FILL:
            self._keep(Recent(self.real, samples, sizes, nbytes))
            if not self.warm:
                self.real_bytes += nbytes
        elif self._pending:  # holes dropped before its first sample
            self._mark()
        self.real += len(samples)

    def take(
        self, items: list[Item], samples: list[Any], sizes: list[int]
    ) -> tuple[list[dict[str, Any]], list[int]] | None:
        """A read's samples (None for a hole) and their payload bytes, as handed out: the holes
        dropped, or filled (a repeat counts no bytes); None while FILL holds them back (then
        this read's and the held ones come out together, see :meth:`rest`)."""
        if self.mode is HoleMode.DROP:
            return self._dropped(samples, sizes)
        held = self.held if self.held is not None else Held()
        out, out_sizes, waiting = held.samples, held.sizes, held.holes
        pool = self._pool()
        got: list[dict[str, Any]] = []
        got_sizes: list[int] = []
        first = self.real
        for (pos, _), sample, nbytes in zip(items, samples, sizes):
            if sample is None:
                self.repeated += 1
                if self.warm:
                    out.append(self._repeat(pool, pos))
                else:
                    waiting.append((len(out), pos))
                    out.append(None)
                out_sizes.append(0)
                continue
            out.append(sample)
            out_sizes.append(nbytes)
            got.append(sample)
            got_sizes.append(nbytes)
            pool.add((self.real, sample, nbytes))
            if self.warm:
                self.real += 1
                continue
            self.real += 1
            self.real_bytes += nbytes
            if self.warm and waiting:  # a pool's worth at last: the first pool fills what waited
                self._fill(held, pool)
        if got:
            self._keep(Recent(first, got, got_sizes, sum(got_sizes)))
        if waiting:
            self.held = held
            return None
        self.held = None
        return out, out_sizes

    def rest(self) -> tuple[list[dict[str, Any]], list[int]] | None:
        """What is held back once the share is over (filled from every sample read, if fewer
        than a pool's worth); None if nothing is, or nothing was read to fill it with (see
        :meth:`unfilled`)."""
        held = self.held
        if held is None or not self.real:
            return None
        self._fill(held, self._pool())
        self.held = None
        return held.samples, held.sizes

    @property
    def short(self) -> bool:
        """FILL: more holes wait than samples were read to fill them with, fewer than a pool's
        worth (the share is over: a resumed rank's rest, a DataLoader worker's slice; see
        :meth:`prime`)."""
        return self.held is not None and len(self.held.holes) > self.real and not self.warm

    def prime(self, samples: list[Any], sizes: list[int]) -> None:
        """FILL: samples read only to fill the holes a :attr:`short` rank holds back (a resumed
        rank's samples before its checkpoint, oldest first; None for one whose shard fails now):
        they join the pool as older than every sample read since, and :meth:`rest` fills from
        them too; none is handed out."""
        got = [i for i, sample in enumerate(samples) if sample is not None]
        if got:
            kept = [sizes[i] for i in got]
            # Numbered below every sample read (from 0), in the order they come: the pool takes
            # the latest samples first, so those read since the checkpoint stay in it.
            read = Recent(self.primed - PRIMED_BELOW, [samples[i] for i in got], kept, sum(kept))
            self.recent.insert(self.primed_reads, read)
            self.primed_reads += 1
            self.primed += len(got)
            self.held_samples += len(got)
            self.held_bytes += read.nbytes
            self.real += len(got)

    def unfilled(self) -> int:
        """Holes with no sample read to show for them once the share is over (and :meth:`rest`
        taken): FILL's held ones, or with DROP, all, when no sample at all was read."""
        if self.mode is HoleMode.FILL:
            return len(self.held.holes) if self.held is not None else 0
        return self.dropped if not self.real else 0

    def positions(self, handed: int) -> int:
        """Positions of the share the first ``handed`` samples out account for: with DROP, the
        holes dropped before the last of them too (see the module docstring)."""
        if not self.marks_at or not handed:
            return handed
        i = bisect_right(self.marks_at, handed - 1)
        return handed + (self.marks_holes[i - 1] if i else 0)

    # -- DROP --------------------------------------------------------------------------

    def _dropped(self, samples: list[Any], sizes: list[int]) -> tuple[list[dict[str, Any]], list[int]]:
        out: list[dict[str, Any]] = []
        out_sizes: list[int] = []
        for sample, nbytes in zip(samples, sizes):
            if sample is None:
                self.dropped += 1
                self._pending = True
                continue
            if self._pending:
                self._mark()
            self.real += 1
            out.append(sample)
            out_sizes.append(nbytes)
        return out, out_sizes

    def _mark(self) -> None:
        """Sample ``real`` follows holes dropped: they count with it (see :meth:`positions`)."""
        self.marks_at.append(self.real)
        self.marks_holes.append(self.dropped)
        self._pending = False

    # -- FILL --------------------------------------------------------------------------

    def _keep(self, read: Recent) -> None:
        """Keep ``read`` for the pool; forget the oldest reads the pool does not reach (the
        newer ones hold a pool's worth without them)."""
        recent = self.recent
        recent.append(read)
        self.held_samples += len(read.samples)
        self.held_bytes += read.nbytes
        while len(recent) > 1 and (
            self.held_samples - len(recent[0].samples) >= POOL_SAMPLES
            or self.held_bytes - recent[0].nbytes >= POOL_BYTES
        ):
            old = recent.popleft()
            self.held_samples -= len(old.samples)
            self.held_bytes -= old.nbytes

    def _pool(self) -> Pool:
        """The pool now: the latest samples read, oldest first, at most POOL_SAMPLES and about
        POOL_BYTES of payload (at least one, if any was read)."""
        latest: list[Pooled] = []
        nbytes = 0
        for read in reversed(self.recent):
            for i in range(len(read.samples) - 1, -1, -1):
                nbytes += read.sizes[i]
                if latest and (len(latest) >= POOL_SAMPLES or nbytes > POOL_BYTES):
                    break
                latest.append((read.first + i, read.samples[i], read.sizes[i]))
            else:
                continue
            break
        if latest and self.uses and min(self.uses) < latest[-1][0]:  # forget counts of samples gone from it
            oldest = latest[-1][0]
            self.uses = {n: c for n, c in self.uses.items() if n >= oldest}
        return Pool(deque(reversed(latest)), nbytes=sum(b for _, _, b in latest))

    def _fill(self, held: Held, pool: Pool) -> None:
        """Fill the holes ``held`` waits with, from ``pool``."""
        for at, pos in held.holes:
            held.samples[at] = self._repeat(pool, pos)
        held.holes.clear()

    def _repeat(self, pool: Pool, pos: int) -> dict[str, Any]:
        """A copy of the least repeated sample of ``pool``, ties broken by the hash of the hole's position."""
        uses = self.uses
        least = min(uses.get(n, 0) for n, _, _ in pool.entries)
        ties = [(n, s) for n, s, _ in pool.entries if uses.get(n, 0) == least]
        n, sample = ties[_mix(self.seed, self.epoch, pos) % len(ties)]
        uses[n] = least + 1
        return dict(sample)


def _mix(*values: int) -> int:
    """A 64-bit hash of ``values`` (splitmix64 steps): the same in every process and run,
    unlike ``hash()`` of a str."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h
