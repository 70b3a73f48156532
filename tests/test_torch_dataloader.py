"""CachedMultiLoader in torch's DataLoader and torchdata's StatefulDataLoader.

The scenarios run in one child process each (tests/helpers/torch_job.py: torch's import
is slow, and a loader is a torch dataset only in a process that imported torch) against
a real agent over the real HTTP shard server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.procs import run_json_job
from tests.helpers.streaming import reference

pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed (scripts/test.sh installs it)")

SHARDS, PER_SHARD = 6, 13  # 78 samples: not a multiple of the ranks, workers or batches


def _run(cache: Path, scenario: str) -> dict[str, Any]:
    return run_json_job("tests.helpers.torch_job", str(cache), scenario)


@pytest.fixture
def warm(dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path) -> tuple[Path, set[str]]:
    urls, _, list_file = dataset(SHARDS, samples=PER_SHARD, payload=300)
    (tmp_path / "cachepath").write_text(str(tmp_path / "cache"))
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--workers", "2")
    everything = {
        f"{u}#{k}" for u in urls for k in (f"{u.rsplit('/', 1)[1].split('.')[0]}-{j:06d}" for j in range(PER_SHARD))
    }
    return cache, everything


@pytest.mark.slow
def test_dataloader_workers_made_anew_each_epoch_read_the_next_epoch_without_set_epoch(
    warm: tuple[Path, set[str]],
) -> None:
    """torch's default workers are copies of the dataset made each epoch: without set_epoch
    each iteration is still the next epoch, the same epochs set_epoch(0), (1), (2) give."""
    cache, _ = warm
    out = _run(cache, "fresh_workers")
    told = out["told"]
    assert len({tuple(e) for e in told}) == 3  # three orders
    for epoch in told:
        assert len(epoch) == 39 and len(set(epoch)) == 39  # the rank's share of 78, each once
    assert out["fresh"] == told
    assert out["spawned"] == told
    assert out["persistent"] == told
    assert out["set_then_not"] == told
    for name in ("widths", "here_and_there"):  # another number of workers each epoch
        assert out[name] == out[f"{name}_told"], name
        assert all(len(e) == len(set(e)) == 39 for e in out[name]) and len({tuple(e) for e in out[name]}) == 5
    first, second = out["webdataset"]
    assert first != second and sorted(first) == sorted(second) and len(set(first)) == len(first) == 78


@pytest.mark.slow
def test_an_epoch_lock_left_held_by_a_killed_process_does_not_stop_the_next_epochs(
    warm: tuple[Path, set[str]],
) -> None:
    cache, _ = warm
    out = _run(cache, "dead_lock_holder")
    for read in (out["workers"], out["here"]):
        assert len(read) == len(set(read)) == SHARDS * PER_SHARD
    assert out["workers"] != out["here"]  # epochs 0 and 1


@pytest.mark.slow
def test_dataloader_workers_split_each_ranks_share(warm: tuple[Path, set[str]]) -> None:
    cache, _ = warm
    out = _run(cache, "workers")
    assert out["is_dataset"] is True
    assert out["len"] == 39  # 78 samples over 2 ranks
    ranks = out["ranks"]
    for epoch in range(2):
        counts = [len(r[epoch]) for r in ranks]
        assert counts == [39, 39]
        together = Counter(ranks[0][epoch] + ranks[1][epoch])
        assert len(together) == SHARDS * PER_SHARD and set(together.values()) == {1}
    assert ranks[0][0] != ranks[0][1]  # set_epoch reached the persistent workers: another order
    assert out["collated"] == {"n": "Tensor", "x": "Tensor"}
    assert out["zero_copy_collated"] == {"cls": ["memoryview"] * 3}
    assert len(out["spawned"]) == 78 and len(set(out["spawned"])) == 78


@pytest.mark.slow
def test_stateful_dataloader_resumes_exactly_with_other_workers_and_ranks(warm: tuple[Path, set[str]]) -> None:
    cache, _ = warm
    out = _run(cache, "stateful")
    first, second, rest = out["first"], out["second"], out["rest"]
    assert len(first) == 15 and len(second) == 12
    assert len(rest[0]) == len(rest[1]) == (78 - 27 + 1) // 2
    together = Counter(first + second + rest[0] + rest[1])
    assert len(together) == 78
    # once each, but for the one padding repeat of an odd remainder over two ranks
    assert sorted(together.values()) == [1] * 77 + [2] or sorted(together.values()) == [1] * 78
    head, tail = out["single"]
    assert len(head) == 15 and len(tail) == 63 and len(set(head + tail)) == 78
    for taken, rest_after_set in zip(
        [first, head], out["set_resumed"]
    ):  # set_epoch of the resumed epoch keeps its rest
        assert len(rest_after_set) == 63 and len(set(taken + rest_after_set)) == 78
    head, tail = out["near_end"]
    assert len(head) == 77 and len(tail) == 1 and len(set(head + tail)) == 78
    named, following = out["at_end"]  # (docs/api.md: a state at an epoch's end may name the next one)
    assert named == 1 and following == out["epoch_1"] and len(set(following)) == 78
    assert (
        "to resume with another num_workers, world size or number of nodes, load the whole StatefulDataLoader"
        in out["mismatch"]
    )
    assert "taken 2 batch(es) after its workers' last snapshot" in out["behind"]


@pytest.mark.slow
def test_stateful_dataloader_workers_of_a_job_on_several_nodes_resume_exactly_on_any_layout(
    warm: tuple[Path, set[str]],
) -> None:
    cache, _ = warm
    out = _run(cache, "nodes")
    first, again, whole, rest = out["first"], out["again"], out["whole"], out["rest"]
    for rank in range(2):  # the same layout: the rest of the node's share, each sample once
        assert len(first[rank]) == 6 and len(whole[rank]) == 39 == len(set(whole[rank]))
        assert sorted(first[rank] + again[rank]) == sorted(whole[rank])
    everything = set(whole[0]) | set(whole[1])
    assert len(everything) == SHARDS * PER_SHARD  # the nodes' parts make the dataset
    # 1 node x 2 ranks, 3 workers each: the 66 not delivered, once each, in equal counts
    assert len(rest[0]) == len(rest[1]) == 33
    together = Counter(first[0] + first[1] + rest[0] + rest[1])
    assert set(together) == everything and set(together.values()) == {1}


@pytest.mark.slow
def test_dataloader_workers_read_their_epoch_under_a_budget_of_two_shards(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    """The DataLoader takes its workers' batches in turn: a worker whose batch is not asked for
    yet is held, and kept the pins of the shards it reads next while the worker asked waited
    for room they held, until its timeout. Asked by the agent, a held worker lets them go."""
    ds = dataset(8, samples=4, payload=1000)
    size = max(p.stat().st_size for p in ds.paths)
    cache = tmp_path / "cache"
    budget = str(2 * size + (8 << 10))
    start_agent(cache, ds.list_file, "--no-shuffle", "--prefetch", "1", "--cache-size", budget, "--min-free", "0")
    got = _run(cache, "small_budget")["got"]
    assert sorted(got) == sorted(f"{u}#{key}" for u, key in reference(ds.paths, ds.urls))
