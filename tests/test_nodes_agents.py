"""Several nodes on this one machine: one real agent per node (its own cache directory and
endpoint), real consumer processes as its ranks, the loopback shard server counting what
each node downloads.

Ranks never wait for each other, so the nodes run one after the other: the server's
request log between two of them is what that node's agent downloaded.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from wdscache import CachedMultiLoader
from wdscache.shared.errors import WdsCacheError
from wdscache.shared.nodes import assign
from tests.helpers.agents import run_wdscache
from tests.helpers.streaming import samples_of, state_of

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
    procs = [consumers(cache, f"{name}-n{node}r{j}", "--job", name, "--rank", str(node * per_node + j),
                       "--world-size", str(num_nodes * per_node), "--node", str(node), "--num-nodes",
                       str(num_nodes), "--timeout", "60", *args) for j in range(per_node)]
    return [p.wait() for p in procs]


def keys(lines: list) -> list[tuple[str, str]]:
    return [(s["url"], s["key"]) for s in samples_of(lines)]


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_each_node_downloads_its_part_once_and_every_rank_gets_the_same_count(
        num_nodes, dataset, shard_server, start_agent, consumers, tmp_path) -> None:
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


def test_a_checkpoint_of_two_nodes_resumes_on_three_nodes_and_on_one(
        dataset, shard_server, start_agent, consumers, tmp_path) -> None:
    urls, index = indexed(dataset, tmp_path)
    caches = [tmp_path / f"cache{node}" for node in range(3)]
    for node, cache in enumerate(caches):
        start_agent(cache, index, "--node-rank", str(node), "--num-nodes", "3")
    first = [lines for node in range(2) for lines in run_node(consumers, caches[node], "a", node, 2, 2,
                                                                "--stop-after", "7")]
    states = [state_of(lines) for lines in first]
    assert all(s == states[0] for s in states)  # any rank's checkpoint is the job's
    before = Counter(k for lines in first for k in keys(lines))
    assert sum(before.values()) == 4 * 7 and max(before.values()) == 1
    resume = json.dumps(states[0])
    dataset_keys = {(u, k) for lines in first for u, k in keys(lines)}
    for layout in ((3, 1), (1, 4)):
        nodes, per_node = layout
        rest = [lines for node in range(nodes)
                for lines in run_node(consumers, caches[node], f"b{nodes}", node, nodes, per_node,
                                      "--resume", resume)]
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
        dataset, shard_server, start_agent, tmp_path) -> None:
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


def test_several_nodes_need_the_counts_first_and_agents_a_node_of_their_nodes(
        dataset, start_agent, tmp_path) -> None:
    _, _, plain = dataset(2, samples=3)
    start_agent(tmp_path / "cache", plain)
    loader = CachedMultiLoader(cache_dir=tmp_path / "cache", rank=0, world_size=2, node=0, num_nodes=2)
    with pytest.raises(WdsCacheError, match=r"sample count.*wdscache index"):
        next(iter(loader))
    r = run_wdscache("agent", "--cache-dir", tmp_path / "other", "--urls", plain, "--node-rank", "2",
                     "--num-nodes", "2")
    assert r.returncode == 2 and "--node-rank 2 must be in [0, --num-nodes=2)" in r.stderr
