"""A rank's share split into slices (:class:`WorkerSlice`), one per data-loading worker process
of that rank (torch's ``DataLoader(num_workers=K)``), and the job's position from what each of
them delivered.

Worker ``k`` of ``K`` takes the rank's pairs (:class:`~wdscache.shared.sequence.RankShare`)
whose block ``v // BLOCK`` is ``k`` modulo ``K`` (:func:`~wdscache.shared.sequence.slice_of`):
blocks of neighbouring positions stay whole (one read each), the workers' slices are
disjoint and together the rank's share, so the rank's count does not depend on ``K`` and
every rank's is the same. The share makes only its slice's pairs where it can
(:meth:`~wdscache.shared.sequence.RankShare.pairs`), so in an unshuffled epoch on one node
a worker's cost does not grow with ``K``.

A worker knows only its own count; the position of the job is the union of what each
worker delivered, which :func:`job_resume` computes from all the workers' states (every
rank is assumed to have delivered as much as this one, as for a single-process loader).
On several nodes the union is kept as runs of the rank's pairs (:class:`Delivered`) until
the next epoch starts, when the counts are known and the runs are placed in the nodes' parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..shared.nodes import read_parts_state
from ..shared.sequence import BLOCK, RankShare, Resume


@dataclass(frozen=True)
class WorkerSlice:
    """A DataLoader worker's slice of a rank's share: worker ``index`` of ``count``; ``skip``:
    pairs of the slice delivered before (a resume); ``over``: the slice was over before (its
    worker's checkpoint says complete), so it yields nothing, however many pairs it has."""

    index: int = 0
    count: int = 1
    skip: int = 0
    over: bool = False


WHOLE = WorkerSlice()  # the whole share: one process reads it all


def delivered_pairs(counts: list[int], block: int = BLOCK) -> list[tuple[int, int]]:
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


@dataclass(frozen=True)
class Delivered:
    """What every rank of a job on several nodes delivered of its epoch since it started, as
    the DataLoader workers' states of one rank tell: ``runs`` of the rank's pair indexes, on
    the layout the checkpoint was taken on. Placing them needs the sample counts
    (:meth:`~wdscache.shared.nodes.JobEpoch.resume_after_runs`), which the loader learns
    from the agent when the epoch starts."""

    world_size: int
    num_nodes: int
    runs: tuple[tuple[int, int], ...]

    def to_state(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "num_nodes": self.num_nodes, "runs": [list(r) for r in self.runs]}

    @classmethod
    def from_state(cls, d: Any) -> Delivered:
        ok = (
            isinstance(d, dict)
            and all(type(d.get(k)) is int and d[k] >= 1 for k in ("world_size", "num_nodes"))
            and d["world_size"] % d["num_nodes"] == 0
            and isinstance(d.get("runs"), list)
            and all(
                isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] < r[1]
                for r in d["runs"]
            )
        )
        if not ok:
            raise ValueError(
                f"checkpoint 'delivered' must be {{world_size, num_nodes, runs: [[start, end], ...]}}; got {d!r}"
            )
        return cls(d["world_size"], d["num_nodes"], tuple((a, b) for a, b in d["runs"]))


def job_resume(start: Resume, share: RankShare, counts: list[int]) -> Resume:
    """The job's :class:`Resume`: ``start``, and what the rank's workers delivered since
    (worker ``k`` its first ``counts[k]`` pairs of ``share``, as dealt), on every rank."""
    return RankShare.dealt(
        share.world_size, share.full_rows, share.tail, resume=start, block=share.block
    ).resume_after_runs(delivered_pairs(counts, share.block))


def check_worker(w: Any) -> None:
    """Refuse, with a ValueError naming it, a worker's entry of a state that is not one."""

    def natural(k: str, least: int = 0) -> bool:
        return type(w.get(k)) is int and w[k] >= least

    ok = (
        isinstance(w, dict)
        and natural("part")
        and natural("of", 1)
        and w["part"] < w["of"]
        and natural("world_size", 1)
        and natural("pairs")
        and type(w.get("complete")) is bool
        and (
            ("started" not in w and natural("full_rows") and (w.get("tail") is None or natural("tail")))
            or (type(w.get("started")) is bool and natural("num_nodes", 1) and w["world_size"] % w["num_nodes"] == 0)
        )
    )
    if not ok:
        raise ValueError(
            "a DataLoader worker's checkpoint entry 'worker' needs whole numbers part < of, "
            "world_size, pairs, a boolean complete, and either full_rows and tail (one node) or "
            f"started and num_nodes, a divisor of world_size (several); got {w!r}"
        )


def combine(
    states: list[dict[str, Any]],
) -> tuple[int, Resume, tuple[list[list[int]], tuple[Resume, ...], Delivered | None] | None]:
    """The epoch and :class:`Resume` of the job from the states of all of one rank's
    workers (``CachedMultiLoader.state_dict()`` taken in each); for a job on several nodes
    also the epoch's parts, their resumes at its start and what was :class:`Delivered` since
    (the Resume is then empty)."""
    workers = [s["worker"] for s in states]
    count = workers[0]["of"]
    if sorted(w["part"] for w in workers) != list(range(count)) or any(w["of"] != count for w in workers):
        raise ValueError(
            f"need the states of all {count} workers of the loader, one each; got parts "
            f"{sorted(w['part'] for w in workers)}"
        )
    epochs = {s["epoch"] for s in states}
    if len(epochs) != 1:
        raise ValueError(f"the workers' states are of different epochs {sorted(epochs)}")
    epoch = epochs.pop()
    if all(w["complete"] for w in workers):
        return epoch + 1, Resume(), None
    counts = [0] * count
    for w in workers:
        counts[w["part"]] = w["pairs"]
    if len({"started" in w for w in workers}) > 1:
        raise ValueError("the workers' states mix a job on one node and a job on several")
    if "started" in workers[0]:  # a job on several nodes
        if any(w["started"] or w["pairs"] for w in workers) or "parts" in states[0]:
            return epoch, Resume(), _nodes_combined(states, counts)
        return epoch, Resume.of(states[0]["position"], states[0]["done"]), None  # none began: as it was given
    start = Resume.of(states[0]["position"], states[0]["done"])
    tails = [w["tail"] for w in workers if w["tail"] is not None]
    share = RankShare.dealt(workers[0]["world_size"], max(w["full_rows"] for w in workers), tails[0] if tails else None)
    return epoch, job_resume(start, share, counts), None


def _nodes_combined(
    states: list[dict[str, Any]], counts: list[int]
) -> tuple[list[list[int]], tuple[Resume, ...], Delivered | None]:
    """The parts, start resumes and :class:`Delivered` of the workers' states of a job on several nodes."""
    # A worker that has not begun this epoch may hold pairs of it all the same: those of the
    # checkpoint it was given (its own state), which it will skip.
    began = [s for s in states if s["worker"]["started"] or s["worker"]["pairs"]]
    if not began:  # no worker began the epoch: each holds the checkpoint it was given
        pending = states[0].get("delivered")
        parts, resumes = read_parts_state(states[0])
        return parts, resumes, Delivered.from_state(pending) if pending is not None else None
    # Those that began name the epoch's parts and their resumes at its start, the same for all;
    # the others delivered nothing of it.
    first = read_parts_state(began[0])
    if any(read_parts_state(s) != first for s in began[1:]):
        raise ValueError("the workers' states are of different epochs of the job: their parts differ")
    w = began[0]["worker"]
    return first[0], first[1], Delivered(w["world_size"], w["num_nodes"], tuple(delivered_pairs(counts)))
