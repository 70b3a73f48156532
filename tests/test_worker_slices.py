"""A rank's share split between DataLoader workers (wdscache.training.worker_slices), without torch:
the slices are disjoint and whole, and the job's position from all workers' counts is exact."""

from __future__ import annotations

import json
import random

import pytest

from wdscache.shared.sequence import RankShare, Resume, slice_of
from wdscache.training.checkpoints import NextEpoch
from wdscache.training.loader import CachedMultiLoader
from wdscache.training.worker_slices import WorkerSlice, combine, job_resume


def _shares(n: int, world: int, start: Resume) -> list[tuple[RankShare, list[tuple[int, tuple[int, int]]]]]:
    ids = [(0, i) for i in range(n)]
    out = []
    for rank in range(world):
        share = RankShare(world, rank, resume=start)
        out.append((share, list(share.pairs(ids))))
    return out


@pytest.mark.parametrize("n,world,workers", [(78, 1, 2), (203, 2, 3), (500, 4, 2), (37, 3, 4)])
def test_slices_are_disjoint_and_make_the_share(n: int, world: int, workers: int) -> None:
    for _share, pairs in _shares(n, world, Resume()):
        slices = [list(slice_of(iter(pairs), k, workers)) for k in range(workers)]
        assert sorted(p for one in slices for p in one) == sorted(pairs)


@pytest.mark.parametrize("seed", range(40))
def test_job_resume_is_the_union_of_what_every_worker_delivered(seed: int) -> None:
    rng = random.Random(seed)
    n, world, workers = rng.randrange(1, 400), rng.randrange(1, 5), rng.randrange(1, 5)
    start = Resume.of(rng.randrange(0, 30), [(40, 45), (60, 70)]) if rng.random() < 0.5 else Resume()
    shares = _shares(n, world, start)
    slices = [[list(slice_of(iter(pairs), k, workers)) for k in range(workers)] for _, pairs in shares]
    lengths = [len(p) for p in slices[0]]
    # Workers near each other (a DataLoader deals batches round robin), but any counts must work.
    counts = [rng.randrange(0, length + 1) for length in lengths]
    expected = {p for p in range(n) if start.skips(p)}
    left = n - start.delivered(n)  # positions in the share's numbering; those past them are padding
    for rank_slices in slices:
        for k, one in enumerate(rank_slices):
            expected |= {sid[1] for pos, sid in one[: counts[k]] if pos < left}
    share = shares[0][0]
    got = job_resume(start, share, counts)
    assert {p for p in range(n) if got.skips(p)} == expected


class _Worker(CachedMultiLoader):
    """A loader as DataLoader worker ``k`` of 2 sees itself (no torch needed)."""

    k = 0

    def _worker_slice(self) -> WorkerSlice:
        return WorkerSlice(self.k, 2)


def _worker(k: int, tmp_path, num_nodes: int = 2) -> _Worker:
    loader = _Worker(
        [f"http://127.0.0.1:9/s{i}.tar" for i in range(4)],
        cache_dir=tmp_path,
        endpoint="ipc:///nonexistent",
        rank=0,
        world_size=2,
        node=0,
        num_nodes=num_nodes,
    )
    loader.k = k
    return loader


def _began(k: int, pairs: int, tmp_path) -> dict:
    """Worker ``k``'s state mid-epoch 0 of a job on 2 nodes, ``pairs`` of its part delivered."""
    state = (
        _worker(k, tmp_path)
        ._checkpoints()
        .state(NextEpoch(0, parts=[[0, 1], [2, 3]], part_resumes=(Resume(), Resume())))
    )
    state["worker"] = {
        "part": k,
        "of": 2,
        "world_size": 2,
        "num_nodes": 2,
        "pairs": pairs,
        "complete": False,
        "started": True,
    }
    return state


def test_workers_states_of_several_nodes_taken_before_they_begin_again_still_say_what_was_delivered(tmp_path) -> None:
    states = [_began(0, 5, tmp_path), _began(1, 3, tmp_path)]
    _, _, nodes = combine(states)
    assert nodes is not None and nodes[2] is not None and nodes[2].runs == ((0, 5), (8, 11))
    again = []
    for k in range(2):  # each worker resumes its own state and is asked for it before its epoch begins
        loader = _worker(k, tmp_path)
        loader.load_state_dict(states[k])
        again.append(json.loads(json.dumps(loader.state_dict())))
    assert combine(again)[2] == nodes


def test_a_workers_own_state_resumes_only_its_layout_and_a_malformed_one_is_a_value_error(tmp_path) -> None:
    state = _began(0, 5, tmp_path)
    with pytest.raises(ValueError, match="on 2 node"):
        _worker(0, tmp_path, num_nodes=1).load_state_dict(state)
    for bad in ({"pairs": -4}, {"pairs": "5"}, {"num_nodes": 3}, {"started": None}):
        broken = {**state, "worker": {**state["worker"], **bad}}
        with pytest.raises(ValueError, match="checkpoint entry 'worker'"):
            _worker(0, tmp_path).load_state_dict(broken)


def test_workers_states_of_one_node_taken_before_they_begin_again_resume_the_same(tmp_path) -> None:
    states = []
    for k, pairs in ((0, 5), (1, 3)):
        state = _worker(k, tmp_path, num_nodes=1)._checkpoints().state(NextEpoch(0))
        state["worker"] = {
            "part": k,
            "of": 2,
            "world_size": 2,
            "pairs": pairs,
            "complete": False,
            "full_rows": 3,
            "tail": None,
        }
        states.append(state)
    again = []
    for k in range(2):
        loader = _worker(k, tmp_path, num_nodes=1)
        loader.load_state_dict(states[k])
        again.append(loader.state_dict())
    assert combine(again) == combine(states)
