"""``wdscache stats`` on an agent that runs but does not answer (busy, or stuck): shown running, with its
pid, and not answering, never as not running; the Kubernetes readiness probe calls it unready only
while it does not answer. And its figures of now: a rate shown while epochs are short, a download
rate that is what the source sends after a restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.console import wdscache_exe
from tests.helpers.procs import stat_fields
from tests.helpers.streaming import assert_epoch_exact, reference
from tests.helpers.waits import wait_for
from wdscache.shared.layout import CacheLayout

DAEMONSET = Path(__file__).resolve().parent.parent / "agent" / "kubernetes" / "daemonset.yaml"


def _metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _ready(cache: Path) -> bool:
    """Whether the DaemonSet's readiness probe, run as written on ``cache``, says ready."""
    found = re.search(r"readinessProbe:.*?- \|-\n\s*(.*?)\n", DAEMONSET.read_text(), re.S)
    assert found, "no readiness probe command in daemonset.yaml"
    command = found.group(1).replace("/mnt/wdscache", str(cache))
    env = {**os.environ, "PATH": f"{os.path.dirname(wdscache_exe())}:{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", command], env=env, timeout=30, stdin=subprocess.DEVNULL).returncode == 0


def _at_once(calls: dict[str, tuple]) -> dict[str, object]:
    """``{name: f(*args)}`` of ``calls`` (``{name: (f, *args)}``), all run at once."""
    with ThreadPoolExecutor(len(calls)) as pool:
        runs = {name: pool.submit(*call) for name, call in calls.items()}
        return {name: run.result() for name, run in runs.items()}


@pytest.mark.slow  # its stats calls wait out the reply that does not come (5 s)
def test_an_agent_that_does_not_answer_is_shown_running_but_not_answering(tmp_path, dataset, start_agent, run_cli):
    cache = tmp_path / "cache"
    agent = start_agent(cache, dataset(1).list_file)
    endpoint = json.loads((cache / "agent.json").read_text())["endpoint"]

    # Stopped, the agent keeps its lock but answers nothing, as a core busy with a huge list edit.
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stat_fields(agent.pid)[0] == "T", 10, "the agent never stopped")
        got = _at_once(  # each waits for the agent's reply first
            {
                "json": (run_cli, "stats", "--cache-dir", cache, "--json"),
                "text": (run_cli, "stats", "--cache-dir", cache),
                "prometheus": (run_cli, "stats", "--cache-dir", cache, "--prometheus"),
                "ready": (_ready, cache),
            }
        )
    finally:
        os.kill(agent.pid, signal.SIGCONT)

    for form in ("json", "text", "prometheus"):
        assert got[form].returncode == 0, (form, got[form].stderr)
    shown = json.loads(got["json"].stdout)["agent"]
    assert shown is not None, f"a live agent shown as not running:\n{got['text'].stdout}"
    assert shown.pop("uptime_s") >= 0
    assert shown == {"pid": agent.pid, "endpoint": endpoint, "answering": False}
    assert re.search(
        rf"^agent      pid {agent.pid}, up \d+s, running but not answering, endpoint {re.escape(endpoint)}$",
        got["text"].stdout,
        re.M,
    ), got["text"].stdout
    metrics = _metrics(got["prometheus"].stdout)
    assert (metrics["wdscache_agent_up"], metrics["wdscache_agent_answering"]) == (1, 0)
    # Its counters are ahead of the index's: none shown, rather than lower ones (a "reset").
    assert not [name for name in metrics if name.endswith("_total")], metrics
    assert got["ready"] is False  # (the kubelet turns it unready after failureThreshold such probes)

    # Going on, it answers again: running and answering, with what only its answer tells.
    got = _at_once({"json": (run_cli, "stats", "--cache-dir", cache, "--json"), "ready": (_ready, cache)})
    again = json.loads(got["json"].stdout)["agent"]
    assert (again["pid"], again["answering"], len(again["workers"])) == (agent.pid, True, 1)
    assert got["ready"] is True


def test_the_readiness_probe_is_ready_while_the_agent_answers_and_not_once_it_stopped(tmp_path, dataset, start_agent):
    cache = tmp_path / "cache"
    agent = start_agent(cache, dataset(1).list_file)
    assert _ready(cache)
    assert agent.stop() == 0
    assert not _ready(cache)  # the cache is there ("agent": null), the agent is not


@pytest.mark.slow
def test_a_job_of_epochs_shorter_than_a_report_shows_its_rate_while_it_reads(tmp_path, dataset, start_agent):
    # Each epoch is a consumer of its own, over in well under the second between reports: the
    # loader's reports keep their clock across its epochs, and each epoch shows the latest rate.
    from wdscache import CachedMultiLoader

    data = dataset(2, samples=50, payload=500)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "every shard cached")
    stop, epochs = threading.Event(), [0]

    def read() -> None:
        with CachedMultiLoader(data.urls, cache_dir=cache, job="short", shuffle=False, timeout=30) as loader:
            while not stop.is_set():
                assert sum(1 for _ in loader) == 100
                epochs[0] += 1

    reader = threading.Thread(target=read)
    reader.start()
    try:
        s = agent.wait_stats(lambda s: s["jobs"].get("short", {}).get("0", {}).get("rate", 0) > 0, 20, "a rate shown")
    finally:
        stop.set()
        reader.join(30)
    assert not reader.is_alive()
    rank = s["jobs"]["short"]["0"]
    assert rank["rate"] > 100 and "samples" in rank, rank
    assert epochs[0] > 2, epochs  # epochs shorter than a report did go by


@pytest.mark.slow  # partial files built at 400 KB/s, then resumed at 50 KB/s for a few seconds
def test_downloads_resumed_from_partial_files_count_only_the_bytes_fetched_in_the_rate(
    tmp_path, shard_server, dataset, start_agent, consumers
):
    # After a restart the rate counted each resumed download's partial file as bytes of the last
    # seconds: "now 7.7M/s" where the source sent 0.4 MB/s. The server paces each connection to
    # its rate from the first byte of the body, so no honest figure exceeds it per download.
    data = dataset(3, samples=30, payload=100_000)
    data.list_file.write_text(data.urls[0] + "\n")  # the agent's own list; the job reads the two others
    own = tmp_path / "own.txt"
    own.write_text("".join(u + "\n" for u in data.urls[1:]))
    cache = tmp_path / "cache"
    args = ("--prefetch", "1", "--download-parts", "1", "--cache-size", "100M")
    shard_server.rate = 400_000
    agent = start_agent(cache, data.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 30, "the agent's own shard cached")
    reader = consumers(cache, "reader", "--job", "resumed", "--urls", str(own), "--no-shuffle", "--timeout", "60")
    layout = CacheLayout.of(cache)
    partials = [layout.partial_path(u) for u in data.urls[1:]]

    def held() -> int:
        return sum(p.stat().st_size for p in partials if p.exists())

    size = data.paths[1].stat().st_size
    wait_for(lambda: held() >= size, 60, lambda: f"partials never grew: {held()} bytes\n{agent.stderr_tail()}")
    assert agent.stop() == 0
    kept = held()
    assert kept >= size, kept

    per_connection = shard_server.rate = 50_000
    agent = start_agent(cache, data.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["downloading"] > 0, 30, "the job's shards resumed")
    rates = []
    deadline = time.monotonic() + 4.0  # the first seconds of the window: the partials' bytes would dominate
    while time.monotonic() < deadline:
        s = agent.stats()
        rates.append((s["download_rate"], s["shards"]["downloading"]))
    assert all(rate <= 1.3 * per_connection * max(1, n) for rate, n in rates), (kept, rates)
    assert any(rate > 0 for rate, _ in rates), rates  # the bytes that do come are counted
    resumed = [r for r in shard_server.requests if r.method == "GET" and r.range and not r.range.startswith("bytes=0-")]
    assert resumed, "no download was resumed from its partial file"
    shard_server.rate = None
    assert_epoch_exact(reader.wait(), reference(data.paths[1:], data.urls[1:]))
