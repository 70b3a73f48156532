"""A rank's share split between the data-loading worker processes of that rank (torch's
``DataLoader(num_workers=K)``), and the job's position from what each of them delivered.

Worker ``k`` of ``K`` takes the rank's pairs (:class:`~wdscache.shared.sequence.RankShare`)
whose block ``v // BLOCK`` is ``k`` modulo ``K``: blocks of neighbouring positions stay
whole (one read each), the workers' parts are disjoint and together the rank's share,
so the rank's count does not depend on ``K`` and every rank's is the same.

A worker knows only its own count; the position of the job is the union of what each
worker delivered, which :func:`job_resume` computes from all the workers' states (every
rank is assumed to have delivered as much as this one, as for a single-process loader).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from ..shared.sequence import BLOCK, Resume, SampleId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """Worker ``index`` of ``count``; ``skip``: pairs of the part delivered before (a resume)."""

    index: int = 0
    count: int = 1
    skip: int = 0


def part_of(pairs: Iterable[tuple[int, SampleId] | None], part: Part, block: int = BLOCK) -> Iterator[tuple[int, SampleId] | None]:
    """The pairs of ``part`` (Nones passed on), its first ``part.skip`` left out."""
    v = 0  # the rank's pair index
    kept = 0
    for pair in pairs:
        if pair is None:
            yield None
            continue
        mine = (v // block) % part.count == part.index
        v += 1
        if mine:
            kept += 1
            if kept > part.skip:
                yield pair


@dataclass(frozen=True)
class Geometry:
    """How the epoch's rows were dealt, as far as a worker saw: enough to place any pair."""

    world_size: int
    full_rows: int
    tail: int | None  # positions after the full rows, once the ids ended
    block: int = BLOCK


def _delivered_pairs(counts: list[int], block: int) -> list[tuple[int, int]]:
    """Half-open runs of the rank's pair indices delivered, worker ``k`` having delivered
    its first ``counts[k]`` pairs (sorted, merged)."""
    K = len(counts)
    full = [n // block for n in counts]  # whole blocks each worker delivered
    lowest = min(full)
    runs: list[list[int]] = [[0, lowest * K * block]] if lowest else []
    top = max(j + 1 for j in full) * K
    for b in range(lowest * K, top):
        k, j = b % K, b // K
        if j < full[k]:
            end = (b + 1) * block
        elif j == full[k] and counts[k] % block:
            end = b * block + counts[k] % block
        else:
            continue
        start = b * block
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [(a, b) for a, b in runs]


def _positions(geo: Geometry, rank_runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The share-numbered positions (every rank's) of the rank's pair-index runs."""
    W, B = geo.world_size, geo.block
    if W == 1:  # the rank's pairs are the positions, in order (no rows)
        return rank_runs
    F = geo.full_rows * B  # pairs in the full rows
    out: list[tuple[int, int]] = []

    def in_block(k: int, o1: int, o2: int) -> None:
        base = k * W * B
        if o1 == 0 and o2 == B:
            out.append((base, base + W * B))
        else:
            out.extend((base + q * B + o1, base + q * B + o2) for q in range(W))

    for a, b in rank_runs:
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
            if geo.tail is None:
                raise ValueError("a worker state counts pairs past the rows it says were dealt")
            base = F * W
            t1, t2 = max(a, F) - F, b - F
            if t1 * W < geo.tail:
                out.append((base + t1 * W, base + min(geo.tail, t2 * W)))
    return out


def job_resume(start: Resume, geo: Geometry, counts: list[int]) -> Resume:
    """The job's :class:`Resume`: ``start``, and what the rank's workers delivered since
    (worker ``k`` its first ``counts[k]`` pairs), on every rank."""
    runs = _positions(geo, _delivered_pairs(counts, geo.block))
    real = start.real
    # A run maps to the positions from its first to its last: any between them were
    # delivered before ``start`` (that is why the share's numbering skips them).
    delivered = [(real(a), real(b - 1) + 1) for a, b in runs if b > a]
    return Resume.of(start.position, list(start.done) + delivered)


def combine(states: list[dict[str, Any]]) -> tuple[int, Resume]:
    """The epoch and :class:`Resume` of the job from the states of all of one rank's
    workers (``CachedMultiLoader.state_dict()`` taken in each)."""
    parts = [s["worker"] for s in states]
    count = parts[0]["of"]
    if sorted(p["part"] for p in parts) != list(range(count)) or any(p["of"] != count for p in parts):
        raise ValueError(f"need the states of all {count} workers of the loader, one each; got parts "
                         f"{sorted(p['part'] for p in parts)}")
    epochs = {s["epoch"] for s in states}
    if len(epochs) != 1:
        raise ValueError(f"the workers' states are of different epochs {sorted(epochs)}")
    epoch = epochs.pop()
    if all(p["complete"] for p in parts):
        return epoch + 1, Resume()
    if any(p.get("epoch_only") for p in parts):
        # Workers of a job on several nodes keep no mid-epoch position: the epoch starts over.
        log.warning("this checkpoint was taken in epoch %d by DataLoader workers of a job on several nodes, "
                    "which keep no position inside an epoch: epoch %d starts again from its beginning", epoch, epoch)
        return epoch, Resume()
    start = Resume.of(states[0]["position"], states[0]["done"])
    tails = [p["tail"] for p in parts if p["tail"] is not None]
    geo = Geometry(parts[0]["world_size"], max(p["full_rows"] for p in parts), tails[0] if tails else None)
    counts = [0] * count
    for p in parts:
        counts[p["part"]] = p["pairs"]
    return epoch, job_resume(start, geo, counts)
