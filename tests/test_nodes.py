"""Several nodes: which shards each reads, every rank's share, and resuming on another layout.

Pure functions, checked over many shapes: every rank of every node the same count, the
union the whole dataset, each node on its own part, and a checkpoint resumed on any layout
delivering the rest once.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from datetime import timedelta

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from wdscache.shared.errors import ConfigError, WdsCacheError
from wdscache.shared.nodes import JobEpoch, NodeList, RankPlacement, assign, check_same_list
from wdscache.shared.sequence import Resume, SampleId
from wdscache.training.node_lists import check_kept
from wdscache.training.worker_slices import delivered_pairs

Job = dict[str, object]


def layouts(num_nodes: int, per_node: int) -> list[RankPlacement]:
    return [RankPlacement(r, num_nodes * per_node, r // per_node, num_nodes) for r in range(num_nodes * per_node)]


def deliver(job: JobEpoch, stop: int | None = None) -> dict[int, list[SampleId]]:
    """Every rank's samples (the first ``stop`` of each, if given), as each rank computes them."""
    counts = job.counts
    out = {}
    for lay in layouts(job.layout.num_nodes, job.layout.local_world):
        mine = JobEpoch(
            job.counts,
            job.parts,
            job.resumes,
            lay,
            job.seed,
            job.epoch,
            job.shuffle,
            job.shuffle_buffer,
            job.drop_last,
            job.reshuffle,
            job.block,
        )
        share = mine.share()
        pairs = (p for p in share.pairs(mine.ids(lay.node, lambda s: range(counts[s]))) if p is not None)
        out[lay.rank] = [sid for _, sid in itertools.islice(pairs, stop)]
    return out


def dataset(counts: list[int]) -> set[SampleId]:
    return {(s, j) for s, n in enumerate(counts) for j in range(n)}


def test_parts_are_balanced_by_count_and_stable_unless_reshuffled() -> None:
    counts = [100 + (7 * i) % 23 for i in range(30)]
    parts = assign(counts, 3)
    assert sorted(s for p in parts for s in p) == list(range(30))
    totals = [sum(counts[s] for s in p) for p in parts]
    assert max(totals) - min(totals) <= max(counts)
    assert assign(counts, 3, epoch=5) == parts  # stable across epochs by default
    assert assign(counts, 3, epoch=1, reshuffle=True) != assign(counts, 3, epoch=2, reshuffle=True)


def test_each_node_downloads_within_ten_percent_of_its_share_of_bytes() -> None:
    counts = [90 + (13 * i) % 31 for i in range(24)]
    size = 1000  # bytes per sample: a part's bytes follow its count
    for n in (2, 3):
        job = JobEpoch.fresh(counts, layouts(n, 2)[0])
        total = sum(counts) * size
        for node in range(n):
            node_bytes = sum(counts[s] for s in job.node_shards(node)) * size
            assert abs(node_bytes - total / n) <= 0.1 * total / n


def test_order_within_a_node_changes_every_epoch_its_shards_do_not() -> None:
    counts = [10] * 12
    e0 = JobEpoch.fresh(counts, layouts(2, 2)[0], epoch=0)
    e1 = e0.following()
    assert e1.epoch == 1 and e0.node_shards(0) == e1.node_shards(0)
    assert e0.order(0) != e1.order(0) and set(e0.order(0)) == set(e1.order(0))


@settings(max_examples=150, deadline=timedelta(seconds=5), derandomize=True)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    nodes=st.integers(1, 3),
    per_node=st.integers(1, 3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    block=st.integers(1, 4),
)
def test_every_rank_gets_the_same_count_and_the_union_is_the_dataset(
    counts: list[int], nodes: int, per_node: int, drop_last: bool, shuffle: bool, block: int
) -> None:
    assume(sum(1 for c in counts if c) >= nodes)  # else refused: a node without samples
    job = JobEpoch.fresh(
        counts, layouts(nodes, per_node)[0], seed=3, shuffle=shuffle, shuffle_buffer=7, drop_last=drop_last, block=block
    )
    got = deliver(job)
    assert {len(v) for v in got.values()} == {job.per_rank}
    seen = Counter(sid for v in got.values() for sid in v)
    if drop_last:
        assert max(seen.values(), default=1) == 1
    else:
        assert set(seen) == dataset(counts)
        # the padding: at most a part's shortfall from the largest, and a row's
        assert sum(seen.values()) - sum(counts) <= nodes * (max(counts) + per_node)
    for rank, samples in got.items():  # each node on its own part
        assert {s for s, _ in samples} <= set(job.parts[rank // per_node])
    assert got == deliver(job)  # a pure function


def resume_on(job: JobEpoch, resumes: tuple[Resume, ...], nodes: int, per_node: int) -> JobEpoch:
    return JobEpoch(
        job.counts,
        job.parts,
        resumes,
        layouts(nodes, per_node)[0],
        job.seed,
        job.epoch,
        job.shuffle,
        job.shuffle_buffer,
        job.drop_last,
        job.reshuffle,
        job.block,
    )


@pytest.mark.parametrize("then", [(3, 1), (1, 4), (2, 2), (2, 1)])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.97])
def test_a_checkpoint_of_two_nodes_resumes_on_another_layout_delivering_the_rest_once(
    then: tuple[int, int], fraction: float
) -> None:
    counts = [37, 41, 29, 33, 40, 35, 38]
    job = JobEpoch.fresh(counts, layouts(2, 2)[0], seed=1, shuffle_buffer=20)
    stop = int(fraction * job.per_rank)
    first = deliver(job, stop)
    at = job.share().resume_after(stop)
    assert all(job.share(lay).resume_after(stop) == at for lay in layouts(2, 2))  # any rank's is the job's
    before = Counter(sid for v in first.values() for sid in v)
    assert sum(r.delivered() for r in at) == len(before)  # the samples delivered (padding repeats some)
    rest = resume_on(job, at, *then)
    second = deliver(rest)
    assert {len(v) for v in second.values()} == {rest.per_rank}
    after = Counter(sid for v in second.values() for sid in v)
    assert set(before) | set(after) == dataset(counts)
    # beyond the rest, repeats only as padding: what the parts differ by, and a row
    rest_count = len(dataset(counts)) - len(before)
    assert 0 <= sum(after.values()) - rest_count <= then[0] * (max(counts) + then[1])
    # each new node reads a few parts, not the whole list
    for node in range(then[0]):
        assert rest.node_shards(node) <= set(itertools.chain(*job.parts))


def test_a_checkpoint_inside_a_resumed_epoch_resumes_again() -> None:
    counts = [30, 31, 32, 33, 34, 35]
    job = JobEpoch.fresh(counts, layouts(2, 2)[0], shuffle_buffer=10)
    seen: Counter[SampleId] = Counter()
    for nodes, per_node in ((3, 1), (1, 4), (2, 3)):
        stop = job.per_rank // 3
        for v in deliver(job, stop).values():
            seen.update(v)
        job = resume_on(job, job.share().resume_after(stop), nodes, per_node)
    for v in deliver(job).values():
        seen.update(v)
    assert set(seen) == dataset(counts)
    assert sum(seen.values()) - len(seen) <= 2 * (max(counts) + 3)


def test_a_layout_must_put_the_same_ranks_on_every_node() -> None:
    with pytest.raises(ConfigError, match="multiple of num_nodes"):
        RankPlacement(0, 5, 0, 2)
    with pytest.raises(ConfigError, match="not on node 1"):
        RankPlacement(0, 4, 1, 2)
    with pytest.raises(ConfigError, match=re.escape("node 2 is not in [0, num_nodes=2)")):
        RankPlacement(0, 4, 2, 2)
    with pytest.raises(WdsCacheError, match="1 shards with samples for 2 nodes: every node needs at least one"):
        JobEpoch.fresh([5, 0], layouts(2, 1)[0])


def test_the_layout_defaults_from_torchruns_environment_and_from_slurms(monkeypatch, tmp_path) -> None:
    from wdscache import CachedMultiLoader

    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_NODEID",
        "SLURM_NNODES",
        "SLURM_STEP_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    url = ["http://127.0.0.1:9/a.tar"]
    assert CachedMultiLoader(url, cache_dir=tmp_path).layout == RankPlacement(0, 1, 0, 1)
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "6", "SLURM_NODEID": "0", "SLURM_NNODES": "3"}.items():
        monkeypatch.setenv(name, value)
    # a batch script sees the job's tasks but is one process: not a rank of six
    assert CachedMultiLoader(url, cache_dir=tmp_path).layout == RankPlacement(0, 1, 0, 1)
    for name, value in {"SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NODEID": "1"}.items():  # a task of srun
        monkeypatch.setenv(name, value)
    assert CachedMultiLoader(url, cache_dir=tmp_path).layout == RankPlacement(2, 6, 1, 3)
    # torchrun inside a Slurm step: torchrun's numbering wins
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    assert CachedMultiLoader(url, cache_dir=tmp_path).layout == RankPlacement(5, 8, 1, 2)
    assert CachedMultiLoader(url, cache_dir=tmp_path, rank=1, node=0).layout == RankPlacement(1, 8, 0, 2)


def test_a_rank_or_world_size_that_is_no_whole_number_is_refused_naming_it(monkeypatch, tmp_path) -> None:
    import numpy as np

    from wdscache import CachedMultiLoader, ConfigError, ShardListDataset

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    url = ["http://127.0.0.1:9/a.tar"]
    for args, says in (
        ({"rank": "1", "world_size": 2}, "rank='1': give a whole number"),
        ({"world_size": 2.0}, "2.0"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            CachedMultiLoader(url, cache_dir=tmp_path, **args)
    assert CachedMultiLoader(url, cache_dir=tmp_path, rank=np.int64(1), world_size=2).layout.rank == 1
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "WORLD_SIZE is not set in the environment, nor a torch.distributed process group initialised: pass world_size="
        ),
    ):
        CachedMultiLoader(url, cache_dir=tmp_path)
    for name, value in (("RANK", "abc"), ("LOCAL_WORLD_SIZE", "0")):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=re.escape(f"the environment's {name}={value!r} is no whole number")):
            CachedMultiLoader(url, cache_dir=tmp_path)
        # Given explicitly, or not needed at all (random access has no ranks): the variable is not read.
        assert CachedMultiLoader(url, cache_dir=tmp_path, rank=1, world_size=2, node=0, num_nodes=1).layout.rank == 1
        if name == "RANK":  # (node and num_nodes from the environment: RANK is not theirs)
            assert CachedMultiLoader(url, cache_dir=tmp_path, rank=1, world_size=2).layout.rank == 1
        index = tmp_path / "index.json"
        index.write_text('{"shardlist": [{"url": "http://127.0.0.1:9/a.tar", "nsamples": 1}]}')
        assert len(ShardListDataset(str(index), cache_dir=tmp_path)) == 1
        monkeypatch.delenv(name)


@settings(max_examples=150, deadline=timedelta(seconds=5), derandomize=True)
@given(
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    first=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    hops=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.floats(0, 1)), max_size=3),
    fraction=st.floats(0, 1),
    block=st.integers(1, 4),
)
def test_any_chain_of_checkpoints_on_any_layouts_delivers_every_sample(
    counts: list[int], first: tuple[int, int], hops: list[tuple[int, int, float]], fraction: float, block: int
) -> None:
    assume(sum(1 for c in counts if c) >= first[0])
    job = JobEpoch.fresh(counts, layouts(*first)[0], seed=2, shuffle_buffer=5, block=block)
    seen: Counter[SampleId] = Counter()
    exact = True
    for nodes, per_node, next_fraction in hops:
        stop = int(fraction * job.per_rank)
        got = deliver(job, stop)
        assert {len(v) for v in got.values()} == {stop}
        for v in got.values():
            seen.update(v)
        at = job.share().resume_after(stop)
        # exactly what was delivered, padding aside (a node with no positions left repeats a sample of
        # another node's, maybe one not delivered yet)
        exact = exact and all(job.node_length(k) for k in range(job.layout.num_nodes))
        if exact:
            assert sum(r.delivered() for r in at) == len(seen)
        else:
            assert sum(r.delivered() for r in at) <= len(seen)
        job = resume_on(job, at, nodes, per_node)
        fraction = next_fraction
    got = deliver(job)
    assert {len(v) for v in got.values()} == {job.per_rank}
    for v in got.values():
        seen.update(v)
    if sum(counts) >= job.layout.world_size:
        assert set(seen) == dataset(counts)


def test_loader_reads_a_checkpoint_of_parts_and_refuses_a_malformed_one(tmp_path) -> None:
    from wdscache import CachedMultiLoader

    loader = CachedMultiLoader(
        ["http://127.0.0.1:9/a.tar", "http://127.0.0.1:9/b.tar"],
        cache_dir=tmp_path,
        rank=0,
        world_size=2,
        node=0,
        num_nodes=2,
    )
    state = {**loader.state_dict(), "version": 3, "parts": [[0], [1]], "resumes": [[5, [[7, 9]]], [0, []]]}
    loader.load_state_dict(state)
    again = loader.state_dict()
    assert (again["version"], again["parts"], again["resumes"]) == (3, [[0], [1]], [[5, [[7, 9]]], [0, []]])
    for parts, resumes in (
        ([[0], [1]], [[5, []]]),
        ([[0], ["x"]], [[0, []], [0, []]]),
        ([[0], [1]], [[0, [[3, 3]]], [0, []]]),
    ):
        with pytest.raises(ValueError, match="'parts'"):
            loader.load_state_dict({**state, "parts": parts, "resumes": resumes})
    loader.set_epoch(1)
    assert "parts" not in loader.state_dict() and loader.state_dict()["version"] == 2


@settings(max_examples=120, deadline=timedelta(seconds=5), derandomize=True)
@given(
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    first=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    then=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    workers=st.integers(1, 4),
    fractions=st.lists(st.floats(0, 1), min_size=4, max_size=4),
    block=st.integers(1, 4),
    drop_last=st.booleans(),
)
def test_dataloader_workers_checkpoint_of_several_nodes_resumes_on_any_layout(
    counts: list[int],
    first: tuple[int, int],
    then: tuple[int, int],
    workers: int,
    fractions: list[float],
    block: int,
    drop_last: bool,
) -> None:
    """Each rank's workers deliver slices of its share (NodeShare.pairs with part and parts), each its own count
    (the same on every rank); their runs placed in the parts resume the rest on another layout."""
    assume(sum(1 for c in counts if c) >= first[0])
    job = JobEpoch.fresh(counts, layouts(*first)[0], seed=3, shuffle_buffer=5, block=block, drop_last=drop_last)
    seen: Counter[SampleId] = Counter()
    done: list[int] = []
    for lay in layouts(*first):
        mine = JobEpoch(
            job.counts,
            job.parts,
            job.resumes,
            lay,
            job.seed,
            job.epoch,
            job.shuffle,
            job.shuffle_buffer,
            job.drop_last,
            job.reshuffle,
            job.block,
        )
        shares = [mine.share() for _ in range(workers)]
        slices = [
            [p for p in share.pairs(mine.ids(lay.node, lambda s: range(counts[s])), part=k, parts=workers) if p]
            for k, share in enumerate(shares)
        ]
        # Each worker's share counts the rank's pairs, every slice's (an empty slice is no empty share).
        assert {share.count for share in shares} == {sum(map(len, slices))}
        done = [int(f * len(p)) for f, p in zip(fractions, slices)]
        real = job.node_length(lay.node)  # positions past the node's are padding repeats
        for k, one in enumerate(slices):
            seen.update(sid for pos, sid in one[: done[k]] if pos < real)
    assert set(seen.values()) <= {1}
    at = job.resume_after_runs(delivered_pairs(done, block))
    assert sum(r.delivered() for r in at) == len(seen)  # exactly the samples delivered, padding aside
    rest = resume_on(job, at, *then)
    got = deliver(rest)
    assert {len(v) for v in got.values()} == {rest.per_rank}
    for v in got.values():
        seen.update(v)
    if not drop_last and sum(counts) >= job.layout.world_size and sum(counts) >= rest.layout.world_size:
        assert set(seen) == dataset(counts)


def test_ranks_on_different_lists_are_refused_naming_each_list_and_its_nodes() -> None:
    layout = RankPlacement(0, 4, 0, 2)
    twenty, eighteen = NodeList.of("aaaa", [100] * 20), NodeList.of("bbbb", [100] * 18)
    check_same_list([twenty] * 4, layout)  # one list: nothing to say
    with pytest.raises(ConfigError) as caught:
        check_same_list([twenty, twenty, eighteen, eighteen], layout)
    message = str(caught.value)
    assert "node 0: list aaaa (20 shards, 2,000 samples" in message
    assert "node 1: list bbbb (18 shards, 1,800 samples" in message
    assert "Give every node's agent the same list" in message
    # the same list, its counts differing on one rank of node 1
    recounted = NodeList.of("aaaa", [100] * 19 + [99])
    with pytest.raises(ConfigError, match=r"nodes 0, 1 \(ranks 0, 1, 2\).*node 1 \(rank 3\)"):
        check_same_list([twenty, twenty, twenty, recounted], layout)
    # the same list, node 1's agent not knowing every count yet: said so, not "different lists"
    uncounted = NodeList.of("aaaa", [100] * 19 + [None])
    with pytest.raises(
        ConfigError, match=r"the same list, but the agents of node 1 do not know every shard's sample count"
    ):
        check_same_list([twenty, twenty, uncounted, uncounted], layout)
    with pytest.raises(WdsCacheError, match=r"rank 2 \(node 1\) could not start its epoch.*no agent"):
        check_same_list([twenty, twenty, "AgentUnavailableError: no agent", eighteen], layout)
    assert NodeList.from_wire(twenty.to_wire()) == twenty
    with pytest.raises(ValueError):
        NodeList.from_wire({"list_id": 3, "shards": 20, "samples": None, "counts": None})


def test_an_epoch_on_another_list_than_the_ranks_agreed_on_is_refused() -> None:
    layout = RankPlacement(1, 2, 1, 2)
    agreed = NodeList.of("aaaa", [100] * 20)
    check_kept(layout, agreed, agreed)
    check_kept(layout, NodeList.of("aaaa", [None] * 20), agreed)  # counts its agent has not learnt yet
    check_kept(layout, NodeList.of("bbbb", [100] * 18), None)  # the ranks never compared: nothing to go by
    with pytest.raises(
        ConfigError,
        match=r"node 1's agent now holds list bbbb \(18 shards, 1,800 samples.*"
        r"agreed on list aaaa \(20 shards, 2,000 samples",
    ):
        check_kept(layout, NodeList.of("bbbb", [100] * 18), agreed)
    with pytest.raises(ConfigError, match="agreed on"):
        check_kept(layout, NodeList.of("aaaa", [100] * 19 + [99]), agreed)
