"""Private agents: one lives while any loader uses it, and stops once none does.

Loaders are real consumer processes (tests/consumer.py) given a URL list and a
cache directory with no agent running, so the first one starts a private agent
through the CLI; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.procs import cmdline, stat_fields
from tests.helpers.streaming import reference, samples_of
from tests.helpers.waits import wait_for

STOP_WITHIN = 15.0  # seconds a private agent gets to stop once its last loader is gone


def _state(cache: Path) -> dict | None:
    try:
        return json.loads((cache / "agent.json").read_text())
    except (OSError, ValueError):
        return None


def _running(pid: int) -> bool:
    f = stat_fields(pid)
    return f is not None and f[0] != "Z"


def _lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.startswith('{"key"'))
    except FileNotFoundError:
        return 0


@pytest.fixture
def private_agents() -> Iterator[list[int]]:
    """Pids of private agents a test saw; any still running at teardown is stopped (they are no children of ours)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _running(pid) and "wdscache" in cmdline(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _agent_up(cache: Path, pids: list[int], log: Path) -> int:
    state = wait_for(lambda: _state(cache), 30, lambda: f"no private agent came up\n{log.read_text()[-3000:]}")
    pids.append(state["pid"])
    return state["pid"]


def _gone(cache: Path, pid: int) -> bool:
    return not _running(pid) and not (cache / "agent.json").exists()


def _agent_log(cache: Path) -> str:
    try:
        return (cache / "private-agent.log").read_text()[-3000:]
    except FileNotFoundError:
        return "(no agent log)"


@pytest.mark.slow
def test_private_agent_lives_while_a_second_loader_uses_it(tmp_path, dataset, consumers, private_agents):
    data = dataset(8, samples=10, payload=500)
    ref = reference(data.paths, data.urls)
    cache = tmp_path / "cache"
    go = tmp_path / "go"
    first = consumers(cache, "first", "--urls", str(data.list_file), "--job", "a", "--linger-until", str(go))
    pid = _agent_up(cache, private_agents, first.log)
    # Small requests, slowly read: the second loader needs the agent for most of its epoch.
    second = consumers(
        cache,
        "second",
        "--urls",
        str(data.list_file),
        "--job",
        "b",
        "--seed",
        "3",
        "--request-size",
        "2",
        "--sleep",
        "0.1",
    )
    wait_for(
        lambda: _lines(second.out) >= 1,
        30,
        lambda: f"the second loader never got a sample\n{second.log.read_text()[-3000:]}",
    )
    go.touch()  # the first loader exits now, its epoch done, while the second is mid-epoch
    assert sorted((s["url"], s["key"]) for s in samples_of(first.wait())) == sorted(ref)
    assert _lines(second.out) < len(ref), "the second loader was not mid-epoch when the first one exited"

    got = samples_of(second.wait())
    assert sorted((s["url"], s["key"]) for s in got) == sorted(ref)
    assert all(s["fields"] == ref[(s["url"], s["key"])] for s in got)
    assert _agent_log(cache).count(" serving ") == 1  # both used the first one's agent
    wait_for(
        lambda: _gone(cache, pid),
        STOP_WITHIN,
        lambda: f"the private agent {pid} outlived its last loader\n{_agent_log(cache)}",
    )


def test_private_agent_of_a_killed_loader_stops_by_itself(tmp_path, dataset, consumers, private_agents):
    data = dataset(4, samples=10, payload=500)
    cache = tmp_path / "cache"
    sole = consumers(cache, "sole", "--urls", str(data.list_file), "--request-size", "2", "--sleep", "0.2")
    pid = _agent_up(cache, private_agents, sole.log)
    wait_for(lambda: _lines(sole.out) >= 1, 30, lambda: f"the loader never got a sample\n{sole.log.read_text()}")
    sole.kill()  # SIGKILL: no close(), no atexit
    wait_for(
        lambda: _gone(cache, pid),
        STOP_WITHIN,
        lambda: f"the private agent {pid} of a killed loader kept running\n{_agent_log(cache)}",
    )


def test_two_loaders_starting_at_once_share_one_private_agent(tmp_path, dataset, consumers, private_agents):
    data = dataset(4, samples=10, payload=500)
    ref = sorted(reference(data.paths, data.urls))
    cache = tmp_path / "cache"
    both = [consumers(cache, f"c{i}", "--urls", str(data.list_file), "--job", f"j{i}") for i in range(2)]
    pid = _agent_up(cache, private_agents, both[0].log)
    for c in both:
        assert sorted((s["url"], s["key"]) for s in samples_of(c.wait())) == ref
    wait_for(
        lambda: _gone(cache, pid),
        STOP_WITHIN,
        lambda: f"the private agent {pid} outlived its loaders\n{_agent_log(cache)}",
    )
    log = _agent_log(cache)
    assert log.count(" serving ") == 1 and "wdscache: error" not in log, log  # one agent started, none refused


@pytest.mark.slow
def test_loader_arriving_while_the_private_agent_stops_starts_a_new_one(tmp_path, dataset, private_agents):
    from wdscache import CachedMultiLoader

    data = dataset(3, samples=4, payload=500)
    ref = sorted(reference(data.paths, data.urls))
    cache = tmp_path / "cache"
    with CachedMultiLoader(data.urls, cache_dir=cache, job="a", rank=0, world_size=1, timeout=30) as loader:
        assert sorted((s["__url__"], s["__key__"]) for s in loader) == ref
        old = _state(cache)["pid"]
    private_agents.append(old)
    # The agent has found no loader left and is shutting down: a loader coming now must not join it.
    wait_for(
        lambda: "no loader uses this private agent" in _agent_log(cache),
        STOP_WITHIN,
        lambda: f"the private agent never noticed its loader had gone\n{_agent_log(cache)}",
        interval=0.01,
    )
    with CachedMultiLoader(data.urls, cache_dir=cache, job="b", rank=0, world_size=1, timeout=30) as loader:
        assert sorted((s["__url__"], s["__key__"]) for s in loader) == ref
        new = _state(cache)["pid"]
        private_agents.append(new)
    assert new != old
    wait_for(
        lambda: _gone(cache, new),
        STOP_WITHIN,
        lambda: f"the new private agent outlived its loader\n{_agent_log(cache)}",
    )


def test_a_loader_dropped_without_close_lets_its_private_agent_stop(tmp_path, dataset, private_agents):
    import gc

    from wdscache import CachedMultiLoader

    data = dataset(2, samples=4, payload=500)
    cache = tmp_path / "cache"
    loader = CachedMultiLoader(data.urls, cache_dir=cache, job="g", rank=0, world_size=1, timeout=30)
    assert len(list(loader)) == 8
    pid = _state(cache)["pid"]
    private_agents.append(pid)
    del loader
    gc.collect()  # garbage, never closed: its lock goes with it
    wait_for(
        lambda: _gone(cache, pid),
        STOP_WITHIN,
        lambda: f"the private agent of a dropped loader kept running\n{_agent_log(cache)}",
    )


def test_a_loader_whose_private_agent_was_killed_starts_a_new_one_at_its_next_epoch(tmp_path, dataset, private_agents):
    from wdscache import CachedMultiLoader

    data = dataset(2, samples=4, payload=500)
    ref = sorted(reference(data.paths, data.urls))
    cache = tmp_path / "cache"
    with CachedMultiLoader(data.urls, cache_dir=cache, job="k", rank=0, world_size=1, timeout=30) as loader:
        assert sorted((s["__url__"], s["__key__"]) for s in loader) == ref
        old = _state(cache)["pid"]
        private_agents.append(old)
        os.kill(old, signal.SIGKILL)  # the OOM killer, say
        wait_for(lambda: not _running(old), 10, "the agent never died")
        assert sorted((s["__url__"], s["__key__"]) for s in loader) == ref  # it said "start one" every epoch after
        new = _state(cache)["pid"]
        private_agents.append(new)
    assert new != old


def test_a_loader_with_urls_waits_for_a_running_agent_that_is_slow_to_answer(
    tmp_path, dataset, start_agent, private_agents
):
    from wdscache import CachedMultiLoader

    data = dataset(2, samples=4, payload=500)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    os.kill(agent.pid, signal.SIGSTOP)  # busy: it answers nothing for a while
    going_on = threading.Timer(2.5, os.kill, (agent.pid, signal.SIGCONT))
    going_on.start()
    try:
        loader = CachedMultiLoader(data.urls, cache_dir=cache, job="s", rank=0, world_size=1, timeout=30)
        reading = iter(loader)  # (it tried to start a private agent, which found this one and failed)
    finally:
        going_on.join()
    assert sorted((s["__url__"], s["__key__"]) for s in reading) == sorted(reference(data.paths, data.urls))
    assert _state(cache)["pid"] == agent.pid and not (cache / "private-agent.log").exists()


@pytest.mark.slow
def test_a_folder_of_webdatasets_download_cache_is_taken_with_a_warning_naming_it(
    tmp_path, dataset, private_agents, caplog
):
    # webdataset's WebDataset(cache_dir=) is its download cache; given to wdscache as is, a private
    # agent took the folder in silence (made it 0700) and left webdataset's files in it, unseen.
    wds = pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    import wdscache

    data = dataset(2, samples=4, payload=500)
    cache = tmp_path / "wds-cache"
    cache.mkdir()
    theirs = [dict(s) for s in wds.WebDataset(data.urls, shardshuffle=False, cache_dir=cache)]
    left = {p.name: p.read_bytes() for p in cache.iterdir()}
    assert sorted(left) == sorted(p.name for p in data.paths), left.keys()  # webdataset's copies of the shards
    caplog.set_level("WARNING", logger="wdscache")
    with wdscache.WebDataset(data.urls, shardshuffle=False, cache_dir=cache) as ds:
        ours = [dict(s) for s in ds]
        private_agents.append(_state(cache)["pid"])
    assert ours == [{k: v for k, v in s.items() if k != "__local_path__"} for s in theirs] and len(ours) == 8
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("wdscache") and r.levelname == "WARNING"]
    assert warned == [
        f"cache_dir {cache} is no wdscache cache yet but holds files ({', '.join(sorted(left))}): a private "
        "agent makes its cache there beside them (the folder made private, mode 0700) and leaves them as they "
        "are, unread and outside its budget; webdataset's download cache (its WebDataset(cache_dir=)) is not "
        "wdscache's: give wdscache a folder of its own"
    ], warned
    assert {n: (cache / n).read_bytes() for n in left} == left and cache.stat().st_mode & 0o777 == 0o700
    # A cache now: the next dataset on it says nothing, and nor does one on a folder of its own.
    caplog.clear()
    with wdscache.WebDataset(data.urls, shardshuffle=False, cache_dir=cache) as ds:
        assert len([s for s in ds]) == 8
    with wdscache.WebDataset(data.urls[:1], shardshuffle=False, cache_dir=tmp_path / "fresh") as ds:
        assert len([s for s in ds]) == 4
        private_agents.append(_state(tmp_path / "fresh")["pid"])
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.records
