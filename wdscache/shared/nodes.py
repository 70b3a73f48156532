"""A job over several nodes: which shards each node reads, and every rank's share of them.

Each node runs its own agent and cache, so each must read only a part of the shards.
The shards are split into *parts*, one per node, balanced by sample count
(:func:`assign`): stable from epoch to epoch unless ``reshuffle``, so that a cache
holding its node's part downloads nothing in the next epoch. A part is read like a
whole list on one node (:class:`~wdscache.shared.sequence.EpochSpec` with its
``shards``): its shards in a seeded order that changes every epoch, through the
shuffle buffer; the node's ranks deal its sequence as on one node
(:class:`~wdscache.shared.sequence.RankShare`). Parts differ in count by up to a shard,
so every rank of every node is brought to the same count ``per_rank``: without
``drop_last`` the ranks of a smaller part repeat their first samples, with it the
ranks of a larger part stop early.

All of it is a pure function of the list's counts, the seeds, the epoch and the layout
(nodes, ranks per node), which is why it needs the sample counts up front.

Resume (:meth:`JobEpoch.resume_after`): the parts of an epoch are fixed when it starts
(one per node of the job then) and each part keeps its own
:class:`~wdscache.shared.sequence.Resume`. The rest of a stopped epoch is dealt to the
new layout: on as many nodes as parts, node ``k`` goes on with part ``k``; on any other
number, the parts' undelivered positions, in part order, are cut into one contiguous
range per node (so a node reads a few parts' shards, not all). The next epoch has one
part per node of the new layout.

Every rank must compute the same split, so every node's agent must hold the same list with
the same counts: :class:`NodeList` is what a rank read its epoch from, and
:func:`check_same_list` refuses a job whose ranks' differ (the loader compares them over
torch.distributed's process group, see :mod:`wdscache.training.node_lists`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from .errors import ConfigError, WdsCacheError
from .plan import epoch_rng
from .sequence import BLOCK, EpochSpec, IdRun, RankShare, Resume, SampleId, rank_length, slice_of

Segment = tuple[int, int, int]  # (part, first, end): a range of a part's undelivered positions
# (part, offset, start, end): a node reads its part's sequence up to ``end``, numbered from
# ``offset`` in the node's ids; it deals the undelivered positions from ``start`` on.
Span = tuple[int, int, int, int]


def assign(
    counts: Sequence[int], num_nodes: int, *, seed: int = 0, epoch: int = 0, reshuffle: bool = False
) -> tuple[tuple[int, ...], ...]:
    """Split shards (by index, ``counts[i]`` samples each) into ``num_nodes`` parts of about
    the same count: largest first, each to the part holding fewest so far. Ties go by shard
    index, or with ``reshuffle`` by a seeded order of ``epoch`` (a new split every epoch)."""
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be at least 1, not {num_nodes}")
    order = list(range(len(counts)))
    if reshuffle:
        epoch_rng(seed, epoch, "nodes").shuffle(order)
    tiebreak = {shard: i for i, shard in enumerate(order)}
    totals = [0] * num_nodes
    parts: list[list[int]] = [[] for _ in range(num_nodes)]
    for shard in sorted(order, key=lambda s: (-counts[s], tiebreak[s])):
        k = min(range(num_nodes), key=lambda n: (totals[n], len(parts[n]), n))
        parts[k].append(shard)
        totals[k] += counts[shard]
    return tuple(tuple(sorted(p)) for p in parts)


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank runs: ``num_nodes`` nodes of ``world_size // num_nodes`` ranks each, global
    rank ``rank`` on node ``node`` (as torchrun numbers them: node-major)."""

    rank: int
    world_size: int
    node: int
    num_nodes: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.world_size % self.num_nodes:
            raise ConfigError(
                f"world_size={self.world_size} is not a multiple of num_nodes={self.num_nodes}: "
                "every node must run the same number of ranks (pass the loader node= and "
                "num_nodes= if the launcher's environment does not describe this job)"
            )
        if not 0 <= self.node < self.num_nodes:
            raise ConfigError(f"node {self.node} is not in [0, num_nodes={self.num_nodes})")
        if self.rank // self.local_world != self.node:
            raise ConfigError(
                f"rank {self.rank} of {self.world_size} is not on node {self.node} of {self.num_nodes} "
                f"(node k runs ranks k*{self.local_world} to (k+1)*{self.local_world}-1, as torchrun "
                "numbers them; pass the loader node= and num_nodes= if the launcher's environment does "
                "not describe this job)"
            )

    @property
    def local_world(self) -> int:
        return self.world_size // self.num_nodes

    @property
    def local_rank(self) -> int:
        return self.rank - self.node * self.local_world


@dataclass(frozen=True)
class JobEpoch:
    """One epoch of a multi-node job, as every rank of it computes it: its ``parts`` (shards
    per part), each part's ``resumes`` (positions delivered before), laid out on ``layout``."""

    counts: tuple[int, ...]  # every shard's samples
    parts: tuple[tuple[int, ...], ...]
    resumes: tuple[Resume, ...]
    layout: RankPlacement
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 1000
    drop_last: bool = False
    reshuffle: bool = False
    block: int = BLOCK
    _segments: tuple[tuple[Segment, ...], ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def fresh(
        cls,
        counts: Sequence[int],
        layout: RankPlacement,
        *,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        drop_last: bool = False,
        reshuffle: bool = False,
        block: int = BLOCK,
    ) -> JobEpoch:
        """An epoch from its start: one part per node (each with samples, or it refuses)."""
        parts = assign(counts, layout.num_nodes, seed=seed, epoch=epoch, reshuffle=reshuffle)
        if any(sum(counts[s] for s in p) == 0 for p in parts):
            raise WdsCacheError(
                f"the list has {sum(1 for c in counts if c)} shards with samples for "
                f"{layout.num_nodes} nodes: every node needs at least one; use fewer nodes"
            )
        return cls(
            tuple(counts),
            parts,
            (Resume(),) * len(parts),
            layout,
            seed,
            epoch,
            shuffle,
            shuffle_buffer,
            drop_last,
            reshuffle,
            block,
        )

    def __post_init__(self) -> None:
        if len(self.resumes) != len(self.parts):
            raise ValueError(f"{len(self.resumes)} resumes for {len(self.parts)} parts")
        left = [self.left(p) for p in range(len(self.parts))]
        n = self.layout.num_nodes
        segments: tuple[tuple[tuple[int, int, int], ...], ...]
        if n == len(self.parts):
            segments = tuple(((k, 0, left[k]),) for k in range(n))
        else:  # contiguous ranges of the parts' undelivered positions, in part order
            total = sum(left)
            cuts = [j * total // n for j in range(n + 1)]
            segments = tuple(_cut(left, cuts[j], cuts[j + 1]) for j in range(n))
        object.__setattr__(self, "_segments", segments)

    # -- the whole job ----------------------------------------------------------

    def part_total(self, p: int) -> int:
        return sum(self.counts[s] for s in self.parts[p])

    def left(self, p: int) -> int:
        """Part ``p``'s positions not delivered before."""
        total = self.part_total(p)
        return total - self.resumes[p].delivered(total)

    def node_length(self, node: int) -> int:
        """Positions node ``node``'s ranks deal among them."""
        return sum(b - a for _, a, b in self._segments[node])

    @property
    def per_rank(self) -> int:
        """Samples every rank of every node delivers this epoch."""
        L, n = self.layout.local_world, self.layout.num_nodes
        lengths = [rank_length(self.node_length(j), L, self.drop_last) for j in range(n)]
        return min(lengths) if self.drop_last else max(lengths)

    def part_spec(self, p: int) -> EpochSpec:
        return EpochSpec(
            len(self.counts), self.seed, self.epoch, self.shuffle, self.shuffle_buffer, shards=self.parts[p]
        )

    def node_shards(self, node: int) -> set[int]:
        """The shards node ``node`` reads (a superset, for a node on a range of a part)."""
        return {s for p, a, b in self._segments[node] if b > a for s in self.parts[p]}

    def following(self) -> JobEpoch:
        """The next epoch, from its start, on the same layout."""
        return JobEpoch.fresh(
            self.counts,
            self.layout,
            seed=self.seed,
            epoch=self.epoch + 1,
            shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer,
            drop_last=self.drop_last,
            reshuffle=self.reshuffle,
            block=self.block,
        )

    def resume_after(self, n: int) -> tuple[Resume, ...]:
        """Each part's :class:`Resume` once every rank of the job delivered ``n`` samples."""
        return self.resume_after_runs([(0, n)] if n > 0 else [])

    def resume_after_runs(self, delivered: Sequence[tuple[int, int]]) -> tuple[Resume, ...]:
        """Each part's :class:`Resume` once every rank of the job delivered the pairs of
        ``delivered`` (half-open runs of pair indexes: its first ``n``, or what its DataLoader
        workers delivered, see :mod:`wdscache.training.worker_slices`)."""
        runs: list[list[tuple[int, int]]] = [[] for _ in self.parts]
        for node in range(self.layout.num_nodes):
            local = self._local(node)
            share = RankShare.known(
                self.layout.local_world,
                0,
                self.node_length(node),
                resume=local.resume,
                drop_last=self.drop_last,
                block=self.block,
            )
            mine = rank_length(self.node_length(node), self.layout.local_world, self.drop_last)
            at = share.resume_after_runs([(a, min(b, mine)) for a, b in delivered if a < mine])  # past: padding
            for p, offset, start, end in local.spans:
                for a, b in [(0, at.position), *at.done]:  # only the segment's: the rest is other nodes'
                    a, b = max(a, offset + start), min(b, offset + end)
                    if a < b:
                        runs[p].append((a - offset, b - offset))
        return tuple(Resume.of(r.position, [*r.done, *runs[p]]) for p, r in enumerate(self.resumes))

    # -- one node ----------------------------------------------------------------

    def _local(self, node: int) -> _NodeStream:
        """How node ``node``'s ids are numbered: its segments' parts one after the other, each
        cut after its segment's last position; the positions not in a segment count as
        delivered (:class:`Resume`), so its ranks deal exactly the segments."""
        spans: list[Span] = []
        delivered: list[tuple[int, int]] = []
        offset = 0
        for p, a, b in self._segments[node]:
            if b <= a:
                continue
            r = self.resumes[p]
            start, end = r.real(a), r.real(b - 1) + 1
            spans.append((p, offset, start, end))
            delivered.append((offset, offset + start))
            delivered += [
                (offset + max(x, start), offset + min(y, end))
                for x, y in [(0, r.position), *r.done]
                if max(x, start) < min(y, end)
            ]
            offset += end
        return _NodeStream(tuple(spans), Resume.of(0, delivered))

    def ids(self, node: int, samples: Callable[[int], Iterable[int | None]]) -> Iterator[SampleId | None]:
        """Node ``node``'s ids in its numbering (see :meth:`_local`); None as in
        :func:`~wdscache.shared.sequence.global_sequence`."""
        for p, _, _, end in self._local(node).spans:
            got = 0
            for sid in self.part_spec(p).ids(samples):
                yield sid
                if sid is not None:
                    got += 1
                    if got == end:
                        break

    def order(self, node: int) -> tuple[int, ...]:
        """The shards node ``node`` reads, in the order it reads them."""
        return tuple(s for p, _, _, _ in self._local(node).spans for s in self.part_spec(p).order())

    def share(self, rank: RankPlacement | None = None) -> NodeShare:
        """The share of ``rank`` (this layout's rank, by default)."""
        return NodeShare(self, rank or self.layout)


@dataclass(frozen=True)
class _NodeStream:
    spans: tuple[Span, ...]
    resume: Resume


class NodeShare:
    """One rank's share of a :class:`JobEpoch`, used as a :class:`RankShare` is: ``pairs``
    over the node's ids (:meth:`JobEpoch.ids`), then :meth:`resume_after`."""

    def __init__(self, job: JobEpoch, layout: RankPlacement) -> None:
        self.job, self.layout = job, layout
        local = job._local(layout.node)
        self.length = job.node_length(layout.node)
        self.inner = RankShare(
            layout.local_world, layout.local_rank, resume=local.resume, drop_last=job.drop_last, block=job.block
        )
        self.resume = self.inner.resume
        self.count: int | None = None  # the rank's pairs (every slice's), once the ids ended

    @property
    def settled(self) -> int:
        return self.inner.settled

    def pairs(
        self, ids: Iterable[SampleId | IdRun | list[SampleId] | None], *, part: int = 0, parts: int = 1, skip: int = 0
    ) -> Iterator[tuple[int, SampleId] | None]:
        """The rank's ``per_rank`` pairs: the node's share, cut or padded with repeats of its own
        first samples to the job's count; with ``parts`` > 1 or ``skip`` only slice ``part`` of them, its
        first ``skip`` left out (:func:`~wdscache.shared.sequence.slice_of`)."""
        mine = self._pairs(ids)
        return mine if parts == 1 and not skip else slice_of(mine, part, parts, skip, self.job.block)

    def _pairs(self, ids: Iterable[SampleId | IdRun | list[SampleId] | None]) -> Iterator[tuple[int, SampleId] | None]:
        want = self.job.per_rank
        mine: list[tuple[int, SampleId]] = []
        for pair in self.inner.pairs(ids):
            if pair is None:
                yield None
                continue
            if len(mine) == want:
                continue  # drop_last on a larger part: these are dropped (the ids still pass)
            mine.append(pair)
            yield pair
        short = want - len(mine)
        taken = len(mine)
        if not mine:  # nothing left on this node (fewer positions left than ranks): the list's first sample
            mine = [(0, (min(s for s, c in enumerate(self.job.counts) if c), 0))] if any(self.job.counts) else []
        self.count = taken + (short if mine else 0)
        base = self.length + self.layout.local_world  # positions past any the node deals
        for i in range(short if mine else 0):
            yield base + i * self.layout.local_world + self.layout.local_rank, mine[i % len(mine)][1]

    def resume_after(self, n: int) -> tuple[Resume, ...]:
        """Each part's :class:`Resume` once every rank of the job delivered ``n`` samples."""
        return self.job.resume_after(n)


def _cut(left: Sequence[int], a: int, b: int) -> tuple[Segment, ...]:
    """Positions ``[a, b)`` of the parts' undelivered positions laid end to end, as segments."""
    out: list[Segment] = []
    start = 0
    for p, n in enumerate(left):
        lo, hi = max(a, start), min(b, start + n)
        if lo < hi:
            out.append((p, lo - start, hi - start))
        start += n
    return tuple(out)


@dataclass(frozen=True)
class NodeSpec:
    """One node's reading of a :class:`JobEpoch`, used as an
    :class:`~wdscache.shared.sequence.EpochSpec` is (by a rank's stream)."""

    job: JobEpoch
    node: int

    @property
    def epoch(self) -> int:
        return self.job.epoch

    @property
    def n_shards(self) -> int:
        return len(self.job.counts)

    def order(self) -> tuple[int, ...]:
        return self.job.order(self.node)

    def ids(self, samples: Callable[[int], Iterable[int | None]]) -> Iterator[SampleId | None]:
        return self.job.ids(self.node, samples)

    def following(self) -> NodeSpec:
        return NodeSpec(self.job.following(), self.node)


def job_epoch(
    counts: Sequence[int | None],
    layout: RankPlacement,
    *,
    epoch: int,
    parts: Sequence[Sequence[int]] | None,
    resumes: Sequence[Resume],
    seed: int,
    shuffle: bool,
    shuffle_buffer: int,
    drop_last: bool,
    reshuffle: bool,
) -> JobEpoch:
    """The epoch a rank of a multi-node job reads: from its start (``parts`` None, ``resumes`` one
    empty :class:`Resume`), the rest of a single-node checkpoint (``parts`` None: one part, the whole
    list), or of a multi-node one (its ``parts`` and their ``resumes``). Refuses without every
    shard's count."""
    missing = [i for i, c in enumerate(counts) if c is None]
    if missing:
        raise WdsCacheError(
            f"a job on several nodes needs every shard's sample count before it starts, and {len(missing)} of "
            f"{len(counts)} shards have none (the first: shard {missing[0]}): give the loader a shard index "
            "(`wdscache index LIST -o shards.json`, then urls='shards.json' and the agents' --urls shards.json), "
            "or let one epoch run on one node first (its agent then knows the counts; every node's agent must)"
        )
    known = [int(c) for c in counts if c is not None]
    if parts is None and tuple(resumes) != (Resume(),):
        parts = [list(range(len(known)))]
    if parts is None:
        return JobEpoch.fresh(
            known,
            layout,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            drop_last=drop_last,
            reshuffle=reshuffle,
        )
    if sorted(s for p in parts for s in p) != list(range(len(known))):
        raise ValueError("the checkpoint's parts do not cover this list's shards; was it taken on another list?")
    return JobEpoch(
        tuple(known),
        tuple(tuple(p) for p in parts),
        tuple(resumes),
        layout,
        seed,
        epoch,
        shuffle,
        shuffle_buffer,
        drop_last,
        reshuffle,
    )


def parts_state(parts: Sequence[Sequence[int]], resumes: Sequence[Resume]) -> dict[str, Any]:
    """A multi-node checkpoint's own entries (JSON-able): the parts, and each part's positions."""
    return {
        "parts": [list(p) for p in parts],
        "resumes": [[r.position, [list(run) for run in r.done]] for r in resumes],
    }


def read_parts_state(state: dict[str, Any]) -> tuple[list[list[int]], tuple[Resume, ...]]:
    """The parts and each part's :class:`Resume` of a checkpoint's :func:`parts_state` entries, checked."""
    parts, resumes = state.get("parts"), state.get("resumes")
    if not (
        isinstance(parts, list)
        and all(isinstance(p, list) and all(map(_natural, p)) for p in parts)
        and isinstance(resumes, list)
        and len(resumes) == len(parts)
        and all(
            isinstance(r, list)
            and len(r) == 2
            and _natural(r[0])
            and isinstance(r[1], list)
            and all(
                isinstance(run, list) and len(run) == 2 and all(map(_natural, run)) and run[0] < run[1] for run in r[1]
            )
            for r in resumes
        )
    ):
        raise ValueError(
            "checkpoint 'parts' must be lists of shard indexes and 'resumes' one [position, "
            f"[[start, end], ...]] per part; got {parts!r}, {resumes!r}"
        )
    return parts, tuple(Resume.of(r[0], r[1]) for r in resumes)


def _natural(x: Any) -> bool:
    return type(x) is int and x >= 0


@dataclass(frozen=True)
class NodeList:
    """The list a rank reads an epoch from, as its node's agent holds it: the list's fingerprint
    (:func:`~wdscache.shared.urls.list_id`), its shards, their samples and a digest of each
    shard's count (``samples`` and ``counts`` None while a count is unknown)."""

    list_id: str
    shards: int
    samples: int | None
    counts: str | None

    @classmethod
    def of(cls, list_id: str, counts: Sequence[int | None]) -> NodeList:
        if any(c is None for c in counts):
            return cls(list_id, len(counts), None, None)
        digest = hashlib.sha256(" ".join(str(c) for c in counts).encode()).hexdigest()[:8]
        return cls(list_id, len(counts), sum(int(c) for c in counts if c is not None), digest)

    def describe(self) -> str:
        samples = "samples not all counted" if self.samples is None else f"{self.samples:,} samples"
        return f"list {self.list_id} ({self.shards} shards, {samples}, counts {self.counts})"

    def to_wire(self) -> dict[str, Any]:
        return {"list_id": self.list_id, "shards": self.shards, "samples": self.samples, "counts": self.counts}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> NodeList:
        """Checked: a field of the wrong type is a ValueError."""
        list_id, shards, samples, counts = d.get("list_id"), d.get("shards"), d.get("samples"), d.get("counts")
        if not (
            isinstance(list_id, str)
            and _natural(shards)
            and (samples is None or _natural(samples))
            and (counts is None or isinstance(counts, str))
        ):
            raise ValueError(f"not a node's list: {d!r}")
        return cls(list_id, cast(int, shards), samples, counts)


def check_same_list(lists: Sequence[NodeList | str], layout: RankPlacement) -> None:
    """Refuse, on every rank alike, a job whose ranks (``lists[r]``: rank ``r``'s list, or why it
    has none) read different lists: their split into parts would differ, so counts would be
    unequal and samples lost. The error names each list and the nodes holding it."""
    failed = [(r, why) for r, why in enumerate(lists) if isinstance(why, str)]
    if failed:
        r, why = failed[0]
        raise WdsCacheError(
            f"rank {r} (node {r // layout.local_world}) could not start its epoch, so no rank does: {why}"
        )
    held: dict[NodeList, list[int]] = {}
    for r, listed in enumerate(lists):
        assert isinstance(listed, NodeList)
        held.setdefault(listed, []).append(r)
    if len(held) == 1:
        return
    if len({(listed.list_id, listed.shards) for listed in held}) == 1:
        uncounted = sorted(r for listed, ranks in held.items() if listed.counts is None for r in ranks)
        if uncounted and len({listed.counts for listed in held if listed.counts is not None}) <= 1:
            # One list, but some agents have not counted every shard yet: not a disagreement.
            raise ConfigError(
                f"the nodes read the same list, but the agents of {_ranks(uncounted, layout)} do not know every "
                "shard's sample count yet, which the split between nodes needs: give every "
                "node's agent a shard index (made by `wdscache index`), then restart the job"
            )
    which = "; ".join(f"{_ranks(ranks, layout)}: {listed.describe()}" for listed, ranks in held.items())
    raise ConfigError(
        f"the nodes of this job read different lists, so their ranks would get unequal counts and some samples "
        f"none: {which}. Give every node's agent the same list (the same --urls file, best a shard index "
        "made by `wdscache index`), or give the loader the list itself (urls='shards.json'), then restart the job"
    )


def _ranks(ranks: list[int], layout: RankPlacement) -> str:
    nodes = sorted({r // layout.local_world for r in ranks})
    whole = all(r in ranks for n in nodes for r in range(n * layout.local_world, (n + 1) * layout.local_world))
    where = f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}"
    return where if whole else f"{where} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
