"""An agent while it starts (it holds the cache directory, but answers only once started): shown
starting, with what it does, by ``wdscache stats`` (text, ``--json`` and metrics), and named as
starting to a loader that waited its timeout for it, never as an agent to start; sources that give
no size at start-up (a HEAD that failed or timed out) are warned about, naming one (redacted); a
hang-up (SIGHUP: the SSH session of an agent in its foreground closed) stops it cleanly.

Real agents through the CLI, against a real local server that accepts connections and never answers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.agents import wdscache_exe
from tests.helpers.waits import wait_for
from wdscache.shared.errors import AgentUnavailableError

STOP_WITHIN = 10.0  # seconds an agent gets to exit after one signal


class SilentSource:
    """A server on 127.0.0.1 that accepts every connection and never sends a byte (a host whose
    service hangs): the connections it took are kept open until :meth:`close`."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-source", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._changed:
                self._held.append(conn)
                self._changed.notify_all()

    def wait_connections(self, n: int, timeout: float) -> None:
        """Until ``n`` connections came (fails the test after ``timeout``)."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._held) >= n, timeout):
                pytest.fail(f"{len(self._held)} connection(s) came in {timeout:g}s, not {n}", pytrace=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def silent_source() -> Iterator[SilentSource]:
    source = SilentSource()
    try:
        yield source
    finally:
        source.close()


def _list_of(tmp_path: Path, source: SilentSource, n: int, query: str = "") -> tuple[Path, list[str]]:
    urls = [f"http://127.0.0.1:{source.port}/s-{i:03d}.tar{query}" for i in range(n)]
    path = tmp_path / "urls.txt"
    path.write_text("".join(u + "\n" for u in urls))
    return path, urls


def _metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@pytest.mark.slow  # the loader waits out its timeout (3 s) for the agent still starting
def test_an_agent_asking_silent_sources_for_sizes_shows_as_starting_and_a_loader_is_told_so(
    tmp_path, silent_source, start_agent, run_cli
):
    from wdscache import CachedMultiLoader

    list_file, _ = _list_of(tmp_path, silent_source, 2)
    cache = tmp_path / "cache"
    # A read timeout far longer than the test: its start-up asks for the sizes until it is stopped.
    agent = start_agent(cache, list_file, "--read-timeout", "600", wait=False)
    silent_source.wait_connections(2, 20)  # the start-up's HEADs: it holds the lock, and has not answered
    endpoint = f"ipc://{cache.resolve()}/agent.sock"

    got = run_cli("stats", "--cache-dir", cache, "--json")
    assert got.returncode == 0, got.stderr
    shown = json.loads(got.stdout)["agent"]
    assert shown is not None, f"an agent starting shown as not running:\n{got.stdout}"
    assert shown.pop("uptime_s") >= 0
    doing = "asking sources for the first shards' sizes"
    assert shown == {"pid": agent.pid, "endpoint": endpoint, "answering": False, "starting": doing}
    got = run_cli("stats", "--cache-dir", cache)
    assert got.returncode == 0, got.stderr
    line = rf"^agent      pid {agent.pid}, up \d+s, starting: {re.escape(doing)}, endpoint {re.escape(endpoint)}$"
    assert re.search(line, got.stdout, re.M), got.stdout
    got = run_cli("stats", "--cache-dir", cache, "--prometheus")
    assert got.returncode == 0, got.stderr
    metrics = _metrics(got.stdout)
    assert [metrics[f"wdscache_agent_{m}"] for m in ("up", "answering", "starting")] == [1, 0, 1], metrics

    # A loader made meanwhile waits its timeout for it, then says it is starting: not to start one.
    with CachedMultiLoader(cache_dir=cache, timeout=3) as loader:
        with pytest.raises(AgentUnavailableError) as raised:
            next(iter(loader))
    told = str(raised.value)
    assert f"the agent (pid {agent.pid}) on {cache.resolve()} is still starting ({doing}, for " in told, told
    assert "start one with" not in told, told
    # Its log said what it waits for as the wait began, not only once it is over.
    assert (
        "INFO wdscache.agent.startup: asking the sources of 2 of the first 2 shards for their sizes, for at most "
        "610s" in agent.stderr_text()
    ), agent.stderr_tail()

    assert agent.running(), agent.stderr_tail()
    assert agent.stop(timeout=STOP_WITHIN) == 0 and not agent.killed, agent.stderr_tail()
    assert not (cache / "agent.json").exists()


@pytest.mark.slow  # (about 3 s: kept out of the default suite's 5 minutes)
def test_sizes_a_start_could_not_get_are_warned_about_naming_a_url_redacted(tmp_path, silent_source, start_agent):
    list_file, urls = _list_of(tmp_path, silent_source, 2, query="?sig=SECRET")
    # Each HEAD times out after --read-timeout (1 s), well before the start-up's bound (10 s more).
    agent = start_agent(tmp_path / "cache", list_file, "--read-timeout", "1", wait=False)
    warned = wait_for(
        lambda: [line for line in agent.stderr_text().splitlines() if "sizes not known" in line],
        20,
        lambda: f"no warning of the sizes not known\n{agent.stderr_tail()}",
    )
    assert len(warned) == 1, warned
    assert "2 of the first 2 shards' sizes not known" in warned[0], warned
    # (the HEAD's whole-head bound, or requests' own read timeout: whichever ends first)
    named = (
        r"e\.g\. http://127\.0\.0\.1:\d+/s-00[01]\.tar\?sig=\*\*\*: (TimeoutError: no whole response head|ReadTimeout)"
    )
    assert re.search(named, warned[0]), warned
    assert "SECRET" not in agent.stderr_text()
    agent.wait_up()
    assert agent.stop(timeout=STOP_WITHIN) == 0 and not agent.killed, agent.stderr_tail()


def test_a_hang_up_stops_the_agent_cleanly(tmp_path, dataset, start_agent):
    cache = tmp_path / "cache"
    agent = start_agent(cache, dataset(1).list_file)
    assert (cache / "agent.json").exists()
    assert agent.stop(signal.SIGHUP, timeout=STOP_WITHIN) == 0 and not agent.killed, agent.stderr_tail()
    logged = agent.stderr_text()
    assert "stopping" in logged and logged.rstrip().endswith("stopped"), logged
    assert not (cache / "agent.json").exists() and not (cache / "agent.sock").exists()


def _ignores_hang_up(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGHUP (its bit in /proc's SigIgn mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
    return bool(ignored >> (signal.SIGHUP - 1) & 1)


@pytest.mark.slow  # (about 3 s: kept out of the default suite's 5 minutes)
def test_an_agent_started_under_nohup_outlives_a_hang_up(tmp_path, dataset, start_agent):
    """nohup ignores SIGHUP so that the agent outlives the session that started it: the agent
    leaves it ignored (a hang-up stops only an agent whose session may end it)."""
    cache = tmp_path / "cache"
    agent = start_agent(cache, dataset(1).list_file, exe=["nohup", wdscache_exe()])
    assert _ignores_hang_up(agent.pid)
    os.kill(agent.pid, signal.SIGHUP)
    agent.stats()  # (a round trip of the agent's loop since the hang-up)
    assert agent.running() and "stopping" not in agent.stderr_text(), agent.stderr_tail()
    plain = start_agent(tmp_path / "other", dataset(1, list_name="other.txt").list_file)
    assert not _ignores_hang_up(plain.pid)


def test_a_start_on_pipe_sources_asks_them_no_size_and_warns_of_none(tmp_path, dataset, start_agent):
    # A pipe's command cannot tell a size: not asked, it is not a source that failed to answer.
    ds = dataset(2)
    lists = tmp_path / "pipes" / "urls.txt"
    lists.parent.mkdir()
    lists.write_text("".join(f"pipe:cat {p}\n" for p in ds.paths))
    agent = start_agent(tmp_path / "cache", lists, "--allow-pipe")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "the pipes' shards cached")
    assert "sizes not known" not in agent.stderr_text() and "asking the sources" not in agent.stderr_text()
