"""A million-shard URL list or shard index: the agent starts on it, holds every URL at its place,
serves a loader, and takes live edits of the file (the URLs added and removed, nothing else)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.agents import AgentProc
from wdscache import CachedMultiLoader
from wdscache.shared.client import AgentConnection, resolve_endpoint
from wdscache.training.read_batches import FIRST_REQUEST

MILLION = 1_000_000
# Shards that exist, first in the list (the rest are missing: a loader that reached one would fail
# on it), with more samples than a loader asks for before its first reply: INFLIGHT reads of
# FIRST_REQUEST samples, sent at once on a machine slow to answer them.
REAL = 16
INFLIGHT = 4
SAMPLES = INFLIGHT * FIRST_REQUEST // REAL + 1
# Reading and planning a million URLs takes the agent a second or two on an idle machine; this
# allows for a machine shared with other test processes.
READY_TIMEOUT = 60.0
PROBES = (0, 1, 2, 3, 4, 123_457, 500_000, MILLION - 2, MILLION - 1)  # positions whose URLs are checked


def _listed(cache: Path, positions: tuple[int, ...]) -> dict[int, str]:
    """The URL the agent holds at each of ``positions`` of its list (a page from each, ``get_urls``)."""
    conn = AgentConnection(resolve_endpoint(cache, None), timeout=30, cache_dir=cache)
    try:
        return {at: conn.request({"op": "get_urls", "reader": "probe", "offset": at})["urls"][0] for at in positions}
    finally:
        conn.close()


def _million(real: list[str], url_of) -> list[str]:
    return real + [url_of(f"missing-{i:07d}.tar") for i in range(len(real), MILLION)]


def _first_sample(cache: Path) -> dict:
    with CachedMultiLoader(
        cache_dir=cache, job="million", rank=0, world_size=1, shuffle=False, timeout=30, inflight=INFLIGHT
    ) as loader:
        return next(iter(loader))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _started(start_agent, cache: Path, list_file: Path) -> AgentProc:
    agent = start_agent(cache, list_file, "--prefetch", "2", "--no-shuffle", wait=False)
    agent.wait_up(READY_TIMEOUT)
    return agent


@pytest.mark.slow
def test_a_million_line_list_is_held_in_order_served_and_edited_live(tmp_path, dataset, shard_server, start_agent):
    real, _, _ = dataset(REAL, samples=SAMPLES)
    urls = _million(real, shard_server.url)
    list_file = tmp_path / "big" / "urls.txt"
    list_file.parent.mkdir()
    list_file.write_text("\n".join(urls) + "\n")
    cache = tmp_path / "cache"
    agent = _started(start_agent, cache, list_file)

    assert agent.stats()["agent"]["urls"] == MILLION
    assert _listed(cache, PROBES) == {at: urls[at] for at in PROBES}
    assert _first_sample(cache)["__url__"] == real[0]

    # An edit: one URL gone from the middle, one added at the end; the others keep their order.
    edited = urls[:500_000] + urls[500_001:] + [shard_server.url("added.tar")]
    _replace(list_file, "\n".join(edited) + "\n")
    agent.wait_stats(lambda s: "URL list changed" in agent.stderr_text(), READY_TIMEOUT, "the edited list taken")
    assert "URL list changed: 1 added, 1 removed (1000000 shards now)" in agent.stderr_text()
    assert _listed(cache, (499_999, 500_000, MILLION - 1)) == {
        499_999: urls[499_999],
        500_000: urls[500_001],
        MILLION - 1: shard_server.url("added.tar"),
    }


@pytest.mark.slow
def test_a_million_entry_shard_index_is_held_with_each_shards_facts(tmp_path, dataset, shard_server, start_agent):
    real, paths, _ = dataset(REAL, samples=SAMPLES)
    urls = _million(real, shard_server.url)
    index = tmp_path / "big" / "shards.json"
    index.parent.mkdir()
    sizes = [p.stat().st_size for p in paths]
    entries = [{"url": u, "nsamples": SAMPLES, "filesize": sizes[i]} for i, u in enumerate(real)]
    entries += [{"url": u, "nsamples": 7 + i % 3, "filesize": 1 << 20} for i, u in enumerate(urls[REAL:], REAL)]
    index.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": entries}))
    cache = tmp_path / "cache"
    agent = _started(start_agent, cache, index)

    assert agent.stats()["agent"]["urls"] == MILLION
    assert _listed(cache, PROBES) == {at: urls[at] for at in PROBES}
    conn = AgentConnection(resolve_endpoint(cache, None), timeout=30, cache_dir=cache)
    try:
        counts = conn.request({"op": "counts", "urls": [urls[at] for at in PROBES]})["counts"]
    finally:
        conn.close()
    assert counts == [SAMPLES if at < REAL else 7 + at % 3 for at in PROBES]
    assert _first_sample(cache)["__url__"] == real[0]


def _anon_mb(pid: int) -> float:
    """The private memory (RssAnon) of process ``pid``, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


EDITS = 5


@pytest.mark.slow
def test_live_edits_of_a_million_line_list_leave_the_agents_memory_steady(tmp_path, start_agent):
    folder = tmp_path / "big"
    folder.mkdir()
    one, listed = folder / "one.txt", folder / "urls.txt"
    urls = [str(folder / f"missing-{i:07d}.tar") for i in range(MILLION)]
    one.write_text(urls[0] + "\n")
    small = _started(start_agent, tmp_path / "one", one)
    base = _anon_mb(small.pid)  # an agent without a list to speak of
    small.stop()
    listed.write_text("\n".join(urls) + "\n")
    agent = _started(start_agent, tmp_path / "cache", listed)
    started = _anon_mb(agent.pid)
    per_list = started - base
    assert per_list < 250, f"a million listed shards take {per_list:.0f} MB"

    for edit in range(1, EDITS + 1):  # one more URL at the end each time
        urls.append(str(folder / f"added-{edit}.tar"))
        _replace(listed, "\n".join(urls) + "\n")
        taken = MILLION + edit
        # (stats from the index alone, without "agent", while the agent is busy reading the list)
        agent.wait_stats(lambda s: (s.get("agent") or {}).get("urls") == taken, READY_TIMEOUT, f"edit {edit} taken")  # noqa: B023
    grown = _anon_mb(agent.pid) - started
    assert grown < 0.4 * per_list, f"{EDITS} edits grew the agent by {grown:.0f} MB; the list takes {per_list:.0f} MB"
