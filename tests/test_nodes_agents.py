"""Several nodes on this one machine: one real agent per node (its own cache directory and
endpoint), real consumer processes as its ranks, the loopback shard server counting what
each node downloads.

Ranks never wait for each other, so the nodes run one after the other: the server's
request log between two of them is what that node's agent downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.agents import run_wdscache
from tests.helpers.procs import json_outputs, kill_left
from tests.helpers.streaming import samples_of, state_of
from tests.helpers.waits import wait_for
from wdscache import CachedMultiLoader
from wdscache.shared.errors import WdsCacheError
from wdscache.shared.nodes import assign
from wdscache.shared.urls import list_id

SHARDS, PER_SHARD = 6, 12


def indexed(dataset, tmp_path: Path) -> tuple[list[str], Path]:
    urls, _, _ = dataset(SHARDS, samples=PER_SHARD, payload=1500)
    index = tmp_path / "lists" / "shards.json"
    r = run_wdscache("index", *urls, "-o", index)
    assert r.returncode == 0, r.stderr
    return urls, index


def got_bytes(server) -> int:
    return sum(r.bytes_sent for r in server.requests if r.method == "GET")


def run_node(consumers, cache: Path, name: str, node: int, num_nodes: int, per_node: int, *args: str) -> list[list]:
    """The ranks of ``node`` (``per_node`` of them) as consumer processes; each one's lines."""
    procs = [
        consumers(
            cache,
            f"{name}-n{node}r{j}",
            "--job",
            name,
            "--rank",
            str(node * per_node + j),
            "--world-size",
            str(num_nodes * per_node),
            "--node",
            str(node),
            "--num-nodes",
            str(num_nodes),
            "--timeout",
            "60",
            *args,
        )
        for j in range(per_node)
    ]
    return [p.wait() for p in procs]


def keys(lines: list) -> list[tuple[str, str]]:
    return [(s["url"], s["key"]) for s in samples_of(lines)]


@pytest.mark.slow
@pytest.mark.parametrize("num_nodes", [2, 3])
def test_each_node_downloads_its_part_once_and_every_rank_gets_the_same_count(
    num_nodes, dataset, shard_server, start_agent, consumers, tmp_path
) -> None:
    urls, index = indexed(dataset, tmp_path)
    total_bytes = sum(Path(shard_server.root, u.rsplit("/", 1)[1]).stat().st_size for u in urls)
    shard_server.reset_log()
    agents, every_rank, downloaded = [], [], []
    for node in range(num_nodes):
        cache = tmp_path / f"cache{node}"
        agents.append(start_agent(cache, index, "--node-rank", str(node), "--num-nodes", str(num_nodes)))
        every_rank += run_node(consumers, cache, "e0", node, num_nodes, 2)
        downloaded.append(got_bytes(shard_server))
        shard_server.reset_log()
    everything = Counter(k for lines in every_rank for k in keys(lines))
    assert {url for url, _ in everything} == set(urls)
    assert len(everything) == SHARDS * PER_SHARD  # the union is the dataset
    assert len({len(keys(lines)) for lines in every_rank}) == 1  # every rank the same count
    for node_bytes in downloaded:
        assert abs(node_bytes - total_bytes / num_nodes) <= 0.1 * total_bytes / num_nodes, downloaded
    assert sum(downloaded) == total_bytes  # each shard downloaded by one node, once
    # epoch 2: the caches hold their parts, nothing is downloaded
    for node in range(num_nodes):
        again = run_node(consumers, tmp_path / f"cache{node}", "e1", node, num_nodes, 2, "--epoch", "1")
        assert len({len(keys(lines)) for lines in again}) == 1
    assert [r for r in shard_server.requests if r.method == "GET"] == []


@pytest.mark.slow
def test_a_checkpoint_of_two_nodes_resumes_on_three_nodes_and_on_one(
    dataset, shard_server, start_agent, consumers, tmp_path
) -> None:
    urls, index = indexed(dataset, tmp_path)
    caches = [tmp_path / f"cache{node}" for node in range(3)]
    for node, cache in enumerate(caches):
        start_agent(cache, index, "--node-rank", str(node), "--num-nodes", "3")
    first = [
        lines for node in range(2) for lines in run_node(consumers, caches[node], "a", node, 2, 2, "--stop-after", "7")
    ]
    states = [state_of(lines) for lines in first]
    assert all(s == states[0] for s in states)  # any rank's checkpoint is the job's
    before = Counter(k for lines in first for k in keys(lines))
    assert sum(before.values()) == 4 * 7 and max(before.values()) == 1
    resume = json.dumps(states[0])
    dataset_keys = {(u, k) for lines in first for u, k in keys(lines)}
    for layout in ((3, 1), (1, 4)):
        nodes, per_node = layout
        rest = [
            lines
            for node in range(nodes)
            for lines in run_node(consumers, caches[node], f"b{nodes}", node, nodes, per_node, "--resume", resume)
        ]
        assert len({len(keys(lines)) for lines in rest}) == 1  # every rank the same count
        after = Counter(k for lines in rest for k in keys(lines))
        union = set(before) | set(after)
        dataset_keys |= set(after)
        assert len(union) == SHARDS * PER_SHARD, layout  # nothing lost
        left = SHARDS * PER_SHARD - len(before)
        # nothing repeated beyond padding: a part's shortfall and a row, per node
        assert 0 <= sum(after.values()) - left <= nodes * (PER_SHARD + per_node), layout
    assert {u for u, _ in dataset_keys} == set(urls)


def test_an_agent_prefetches_its_nodes_part_before_any_rank_connects(
    dataset, shard_server, start_agent, tmp_path
) -> None:
    urls, index = indexed(dataset, tmp_path)
    shard_server.reset_log()
    # Slurm's task environment gives --node-rank and --num-nodes (as in agent/slurm/)
    agent = start_agent(tmp_path / "cache", index, env={"SLURM_NODEID": "1", "SLURM_NNODES": "2"})
    part = assign([PER_SHARD] * SHARDS, 2)[1]
    agent.wait_stats(lambda s: s["shards"]["cached"] == len(part), 30, "the node's part was not cached")
    fetched = {r.path for r in shard_server.requests if r.method == "GET"}
    assert fetched == {urls[s].rsplit("/", 1)[1] for s in part}
    loader = CachedMultiLoader(cache_dir=tmp_path / "cache", rank=2, world_size=4, node=1, num_nodes=2)
    assert len(loader) == SHARDS * PER_SHARD // 4


def test_several_nodes_need_the_counts_first_and_agents_a_node_of_their_nodes(dataset, start_agent, tmp_path) -> None:
    _, _, plain = dataset(2, samples=3)
    start_agent(tmp_path / "cache", plain)
    loader = CachedMultiLoader(cache_dir=tmp_path / "cache", rank=0, world_size=2, node=0, num_nodes=2)
    with pytest.raises(WdsCacheError, match=r"sample count.*wdscache index"):
        next(iter(loader))
    r = run_wdscache(
        "agent", "--cache-dir", tmp_path / "other", "--urls", plain, "--node-rank", "2", "--num-nodes", "2"
    )
    assert r.returncode == 2 and "--node-rank 2 must be in [0, --num-nodes=2)" in r.stderr


# -- nodes whose agents hold different lists ------------------------------------------


def index_of(urls: list[str], path: Path) -> Path:
    r = run_wdscache("index", *urls, "-o", path)
    assert r.returncode == 0, r.stderr
    return path


def gloo_job(caches: list[Path], tmp_path: Path, workers: int, between: Callable[[], None] | None = None) -> list[dict]:
    """Node k's one rank on ``caches[k]`` in a real gloo process group (30 s timeout); what each
    printed. ``between`` runs once every rank made its loader, before any reads. Every process
    must end within the deadline: a rank left waiting is a failure."""
    init, go = tmp_path / f"pg-{workers}", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.helpers.gloo_rank",
                str(cache),
                str(rank),
                str(len(caches)),
                str(init),
                str(workers),
                *([str(go)] if between else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        for rank, cache in enumerate(caches)
    ]
    try:
        if between is not None:
            wait_for(
                lambda: (
                    all(Path(f"{go}.made{r}").exists() for r in range(len(caches)))
                    or any(p.poll() is not None for p in procs)
                ),
                60,
                "the ranks never made their loaders",
            )
            between()
            go.touch()
        return json_outputs(procs, 90)
    finally:
        kill_left(procs)


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


@pytest.mark.slow
@needs_torch
def test_nodes_whose_agents_hold_different_lists_all_fail_at_once_naming_both_lists(
    dataset, start_agent, tmp_path
) -> None:
    urls, _, _ = dataset(20, samples=5, payload=100)
    whole = index_of(urls, tmp_path / "lists" / "all.json")
    fewer = index_of(urls[:18], tmp_path / "lists" / "fewer.json")
    caches = [tmp_path / "cache0", tmp_path / "cache1"]
    start_agent(caches[0], whole, "--node-rank", "0", "--num-nodes", "2")
    start_agent(caches[1], fewer, "--node-rank", "1", "--num-nodes", "2")
    outs = gloo_job(caches, tmp_path, 2)  # refused as the loaders are made, before any DataLoader
    for out in outs:  # every rank the same error, none a sample
        assert out.get("error") == "ConfigError", out
        message = out["message"]
        assert f"node 0: list {list_id(urls)} (20 shards, 100 samples" in message
        assert f"node 1: list {list_id(urls[:18])} (18 shards, 90 samples" in message
        assert "Give every node's agent the same list" in message
    assert outs[0]["message"] == outs[1]["message"]


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize("workers", [0, 2])
def test_a_node_whose_agent_takes_up_another_list_after_the_loaders_were_made_is_refused(
    workers, dataset, start_agent, tmp_path
) -> None:
    urls, _, _ = dataset(8, samples=4, payload=100)
    whole = index_of(urls, tmp_path / "lists" / "all.json")
    fewer = index_of(urls[:6], tmp_path / "lists" / "fewer.json")
    caches, agents = [tmp_path / "cache0", tmp_path / "cache1"], []
    for node, cache in enumerate(caches):  # each agent on a list file of its own folder, which it watches
        own = tmp_path / f"node{node}" / "shards.json"
        own.parent.mkdir()
        own.write_bytes(whole.read_bytes())
        agents.append(start_agent(cache, own, "--node-rank", str(node), "--num-nodes", "2"))

    def node_1_takes_up_fewer() -> None:
        edited = tmp_path / "node1" / "shards.json.tmp"
        edited.write_bytes(fewer.read_bytes())
        edited.replace(tmp_path / "node1" / "shards.json")
        agents[1].wait_stats(lambda s: s["agent"]["urls"] == 6, 30, "node 1's agent kept its list")

    outs = gloo_job(caches, tmp_path, workers, between=node_1_takes_up_fewer)
    if workers == 0:  # the ranks compare their lists again as the epoch starts: both refuse it
        for out in outs:
            assert out.get("error") == "ConfigError", out
            assert (
                f"node 0: list {list_id(urls)} (8 shards, 32 samples" in out["message"]
                and f"node 1: list {list_id(urls[:6])} (6 shards, 24 samples" in out["message"]
            )
    else:  # DataLoader workers cannot use the group: node 1's check theirs by the list agreed on
        assert outs[1].get("error") == "ConfigError", outs[1]
        assert (
            f"node 1's agent now holds list {list_id(urls[:6])} (6 shards, 24 samples" in outs[1]["message"]
            and f"agreed on list {list_id(urls)} (8 shards, 32 samples" in outs[1]["message"]
        )
        assert "ids" in outs[0]  # node 0's agent kept the job's list (a DDP job then stops on node 1's error)


@pytest.mark.slow
@needs_torch
def test_nodes_on_the_same_list_in_a_process_group_get_every_sample_once_in_equal_counts(
    dataset, start_agent, tmp_path
) -> None:
    urls, _, _ = dataset(7, samples=5, payload=100)  # parts of 20 and 15 samples: node 1 repeats 5
    index = index_of(urls, tmp_path / "lists" / "all.json")
    caches = [tmp_path / "cache0", tmp_path / "cache1"]
    for node, cache in enumerate(caches):
        start_agent(cache, index, "--node-rank", str(node), "--num-nodes", "2")
    outs = gloo_job(caches, tmp_path, 2)
    got = [out.get("ids") for out in outs]
    assert all(g is not None for g in got), outs
    assert len(got[0]) == len(got[1]) == 20
    assert len(set(got[0]) | set(got[1])) == 35  # every sample
    assert len(set(got[0])) == 20 and not set(got[0]) & set(got[1])  # once (node 1's 5 repeats its own)


@pytest.mark.slow
def test_nodes_whose_loaders_are_given_the_list_read_it_whatever_their_agents_hold(
    dataset, start_agent, consumers, tmp_path
) -> None:
    urls, _, _ = dataset(6, samples=4, payload=100)
    whole = index_of(urls, tmp_path / "lists" / "all.json")
    fewer = index_of(urls[:5], tmp_path / "lists" / "fewer.json")
    caches = [tmp_path / "cache0", tmp_path / "cache1"]
    start_agent(caches[0], whole, "--node-rank", "0", "--num-nodes", "2")
    start_agent(caches[1], fewer, "--node-rank", "1", "--num-nodes", "2")
    every_rank = [
        lines
        for node in range(2)
        for lines in run_node(consumers, caches[node], "given", node, 2, 1, "--urls", str(whole))
    ]
    assert [len(keys(lines)) for lines in every_rank] == [12, 12]
    got = [k for lines in every_rank for k in keys(lines)]
    assert len(set(got)) == len(got) and {u for u, _ in got} == set(urls)  # every sample once


@pytest.mark.slow
def test_a_checkpoint_resumed_on_a_node_whose_list_changed_is_refused_naming_both_lists(
    dataset, start_agent, tmp_path
) -> None:
    urls, _, _ = dataset(4, samples=3, payload=100)
    whole = index_of(urls, tmp_path / "lists" / "all.json")
    fewer = index_of(urls[:3], tmp_path / "lists" / "fewer.json")
    start_agent(tmp_path / "cache0", whole)
    start_agent(tmp_path / "cache1", fewer)
    first = CachedMultiLoader(cache_dir=tmp_path / "cache0", rank=0, world_size=2, node=0, num_nodes=2)
    it = iter(first)
    next(it)
    state = first.state_dict()
    later = CachedMultiLoader(cache_dir=tmp_path / "cache1", rank=1, world_size=2, node=1, num_nodes=2)
    later.load_state_dict(state)
    with pytest.raises(
        ValueError,
        match=rf"taken on list {list_id(urls)}, but this rank reads list "
        rf"{list_id(urls[:3])}.*checkpoint's list",
    ):
        next(iter(later))


def test_a_checkpoint_of_three_nodes_resumed_on_one_reads_each_parts_shards_to_their_end(tmp_path) -> None:
    """Resumed on fewer nodes, a node reads several parts one after the other; a part may end with
    its last id before its shard's end is known, and the next part's shard must be read from its
    own start (it was taken for empty, its samples never delivered, the ranks padded instead)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from shard_maker import make_shard, synth_samples

    paths = []
    for i, n in enumerate((6, 2, 0, 6)):  # parts [[0], [3], [1, 2]]: node 0's part ends where shard 0 does
        paths.append(tmp_path / f"s{i}.tar")
        make_shard(paths[-1], synth_samples(i, n, payload=50))
    index = tmp_path / "shards.json"
    r = run_wdscache("index", *map(str, paths), "-o", index)
    assert r.returncode == 0, r.stderr
    everything = {(i, k) for i, n in enumerate((6, 2, 0, 6)) for k in range(n)}
    cache = tmp_path / "cache"  # a private agent

    def loader(rank: int, world: int, nodes: int, job: str) -> CachedMultiLoader:
        node = rank * nodes // world
        return CachedMultiLoader(
            str(index), cache_dir=cache, rank=rank, world_size=world, node=node, num_nodes=nodes, job=job, **opts
        )

    def sid(sample: dict) -> tuple[int, int]:
        return int(sample["__url__"].rsplit("/s", 1)[1].split(".")[0]), int(sample["__key__"].rsplit("_", 1)[1])

    for drop_last in (False, True):
        opts = {"shuffle": False, "drop_last": drop_last, "timeout": 30}
        first, state = Counter(), None
        # 3 nodes of 2 ranks: each rank two samples of its three (with drop_last one of one: the
        # last node has two samples), then a checkpoint.
        for rank in range(6):
            one = loader(rank, 6, 3, f"first-{drop_last}")
            it = iter(one)
            first.update(sid(next(it)) for _ in range(1 if drop_last else 2))
            state = one.state_dict()
        rest = []
        for rank in range(2):  # resumed on 1 node of 2 ranks
            one = loader(rank, 2, 1, f"rest-{drop_last}")
            one.load_state_dict(state)
            rest.append([sid(s) for s in one])
        assert len(rest[0]) == len(rest[1]), rest
        after = Counter(s for r in rest for s in r)
        assert set(first) | set(after) == everything, (drop_last, sorted(everything - set(first) - set(after)))
        if drop_last:
            assert not set(first) & set(after) and max(after.values()) == 1, (first, after)
