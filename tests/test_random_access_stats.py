"""A ShardListDataset reader shows in the agent's stats as a consumer that reads: its samples and
bytes counted, never taken for silent (stopped or hung) while it reads.

A session has no report thread: its once-a-second ping carries its figures, and its bye its
totals. Real processes: the agent through its CLI, the real HTTP shard server, ``wdscache
stats`` through its CLI; the dataset read in a thread of this process past the silence
threshold (``SILENT_AFTER``), as a validation loop does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scripts.shard_maker import make_dataset, write_url_list
from scripts.shard_server import ShardServer
from tests.helpers.agents import run_wdscache
from tests.helpers.procs import kill_left, run_json_job
from tests.helpers.waits import wait_for
from wdscache import ShardListDataset
from wdscache.shared.verdict import SILENT_AFTER

ROOT = Path(__file__).resolve().parents[1]
SHARDS, PER_SHARD = 3, 10
READ_FOR = SILENT_AFTER + 2.0  # seconds of reads before stats are asked: past the silence threshold


class _Reads:
    """Reads ``ds`` sample after sample in a thread of its own until stopped, counting the samples
    and their fields' bytes (what the agent should count)."""

    def __init__(self, ds: ShardListDataset) -> None:
        self.ds = ds
        self.samples = self.bytes = 0
        self.first_at: float | None = None  # time.monotonic() of the first sample read
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="random-access-reads", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            i = 0
            while not self._stop.is_set():
                sample = self.ds[i % len(self.ds)]
                self.bytes += sum(len(v.getvalue()) for k, v in sample.items() if k.startswith("."))
                self.samples += 1
                if self.first_at is None:
                    self.first_at = time.monotonic()
                i += 1
                self._stop.wait(0.01)  # a steady reader, not a busy loop on a shared machine
        except BaseException as exc:  # reported by the test
            self.error = exc

    def read_for(self, seconds: float) -> bool:
        """Whether it has read for ``seconds`` since its first sample (raising what the reads raised)."""
        if self.error is not None:
            raise self.error
        return self.first_at is not None and time.monotonic() - self.first_at > seconds

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the reads did not stop"
        if self.error is not None:
            raise self.error


@pytest.mark.slow
def test_a_random_access_reader_is_counted_and_not_silent_while_it_reads(
    shard_server: ShardServer, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    paths = make_dataset(shard_server.root, SHARDS, PER_SHARD, payload=2000)
    urls = [shard_server.url(p.name) for p in paths]
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": u, "nsamples": PER_SHARD} for u in urls]}))
    cache = tmp_path / "cache"
    agent = start_agent(cache, write_url_list(tmp_path / "lists" / "urls.txt", urls))
    ds = ShardListDataset(index, cache_dir=cache, transformations=[], timeout=30)
    job = f"random-access/{ds.dataset_name}"
    reads = _Reads(ds)
    try:
        wait_for(lambda: reads.read_for(READ_FOR), 60, "the dataset read nothing for 60 s")
        stats = agent.stats()
        rank = stats["jobs"][job]["0"]
        assert "silent_s" not in rank, rank  # it reads: no verdict that it stopped or hung
        assert rank["samples"] > 0 and rank["bytes"] > 0 and rank["rate"] > 0, rank
        totals = stats["rank_totals"][job]["0"]
        assert totals["samples"] > 0 and totals["bytes"] > 0, totals
        text = run_wdscache("stats", "--cache-dir", cache, timeout=10)
        assert text.returncode == 0, text.stderr
        assert "silent" not in text.stdout, text.stdout
    finally:
        reads.stop()
        ds.close()
    # Its bye carries its totals: the ended job and its rank's totals hold every sample read, once.
    stats = agent.stats()
    ended = stats["ended_jobs"][job]["0"]
    assert (ended["samples"], ended["bytes"]) == (reads.samples, reads.bytes), ended
    totals = stats["rank_totals"][job]["0"]
    assert (totals["samples"], totals["bytes"]) == (reads.samples, reads.bytes), totals


@pytest.mark.slow
def test_readers_that_never_close_are_counted_whole_as_their_processes_exit(
    shard_server: ShardServer, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # DataLoader workers never call close(), and read a small dataset well within a ping's second:
    # their samples reach the agent with their processes' exit, before the epoch's loop ends.
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    paths = make_dataset(shard_server.root, SHARDS, PER_SHARD, payload=2000)
    urls = [shard_server.url(p.name) for p in paths]
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": u, "nsamples": PER_SHARD} for u in urls]}))
    cache = tmp_path / "cache"
    agent = start_agent(cache, write_url_list(tmp_path / "lists" / "urls.txt", urls))
    out = run_json_job("tests.helpers.random_access_counts_job", str(index), str(cache))
    for context in ("fork", "spawn"):
        read = out[context]
        assert read["samples"] == SHARDS * PER_SHARD, read
        assert read["totals"]["0"]["samples"] == read["samples"], (context, read)
        assert read["totals"]["0"]["bytes"] == read["bytes"], (context, read)
    # A plain process that exits without close() says its totals too.
    read = out["main"]
    totals = agent.stats()["rank_totals"]["random-access/main"]["0"]
    assert read["samples"] == SHARDS * PER_SHARD, read
    assert (totals["samples"], totals["bytes"]) == (read["samples"], read["bytes"]), totals


@pytest.mark.slow
def test_a_dataset_dropped_without_close_says_its_bye_as_it_is_collected(
    shard_server: ShardServer, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # An evaluation dataset built and dropped (wids needs no close()), in a process that runs on:
    # once collected, the agent lets go of its pins and counts its samples at once, not after
    # --reader-timeout of silence, which would count only those of its pings (none, for a
    # session younger than a ping's second).
    paths = make_dataset(shard_server.root, SHARDS, PER_SHARD, payload=2000)
    urls = [shard_server.url(p.name) for p in paths]
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": u, "nsamples": PER_SHARD} for u in urls]}))
    cache, out = tmp_path / "cache", tmp_path / "read.json"
    agent = start_agent(cache, write_url_list(tmp_path / "lists" / "urls.txt", urls), "--reader-timeout", "60")
    reads = 2 * PER_SHARD
    job = [
        sys.executable,
        "-m",
        "tests.helpers.dropped_random_access_job",
        str(index),
        str(cache),
        str(reads),
        str(out),
    ]
    proc = subprocess.Popen(job, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(
            lambda: out.exists() or proc.poll() is not None, 60, "the consumer read nothing, nor dropped its dataset"
        )
        assert proc.poll() is None, proc.communicate()
        read = json.loads(out.read_text())
        assert read["samples"] == reads, read
        name = f"random-access/{read['dataset']}"

        def let_go_and_counted(stats: dict[str, Any]) -> bool:
            ended = stats["ended_jobs"].get(name, {}).get("0", {})
            totals = stats["rank_totals"].get(name, {}).get("0", {})
            return (
                name not in stats["jobs"]
                and stats["agent"]["pinned"] == 0
                and (ended.get("samples"), ended.get("bytes")) == (reads, read["bytes"])
                and (totals.get("samples"), totals.get("bytes")) == (reads, read["bytes"])
            )

        # Far below the reader timeout (60 s), with the consumer still running.
        agent.wait_stats(let_go_and_counted, 10, "the dropped dataset's reader let go, its samples counted")
        assert proc.poll() is None, proc.communicate()
        assert f"said bye; releasing its shards (job {name!r}, rank 0, {reads} samples)" in agent.stderr_text()
    finally:
        kill_left([proc])
        proc.communicate()
