"""What the agent's workers hold: shards indexed as soon as they are published, and no
evicted shard kept open (a descriptor or mapping would keep its disk space in use).

A real agent (started through the CLI) downloads from the loopback server; the
loader reads over real sockets; the workers are looked at through /proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import wait_for
from procs import worker_pids
from wdscache import CachedMultiLoader


def deleted_files_held(pid: int, under: Path) -> list[str]:
    """Files under ``under`` that process ``pid`` holds open or mapped after they were deleted."""
    held = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(under)) and target.endswith(" (deleted)"):
                held.append(target)
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if str(under) in line and line.endswith(" (deleted)"):
                held.append(line.split(None, 5)[-1])
    except FileNotFoundError:
        pass  # the worker is gone: it holds nothing
    return held


def test_workers_index_published_shards_before_anyone_reads_them(tmp_path, shard_server, dataset, start_agent):
    data = dataset(4, samples=20, payload=2000)
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", "4", "--workers", "2")
    # Each worker reports how many shards it has indexed, every second.
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4 and all(
        w.get("indexed") == 4 for w in s["agent"]["workers"]), 20, "both workers indexing the 4 shards")


def test_workers_let_go_of_evicted_shards(tmp_path, shard_server, dataset, start_agent):
    data = dataset(8, samples=20, payload=2500)
    size = max(p.stat().st_size for p in data.paths)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "2", "--workers", "2", "--cache-size", str(4 * size),
                        "--min-free", "0")
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        assert len(list(loader)) == 8 * 20
    # The budget holds 4 of the 8 shards: the others were evicted while the workers had read them.
    agent.wait_stats(lambda s: s["shards"]["cached"] <= 4, 20, "evictions")
    workers = worker_pids(agent.proc.pid)
    assert len(workers) == 2
    wait_for(lambda: not any(deleted_files_held(p, cache) for p in workers), 10,
             lambda: f"workers still hold evicted shards: {[deleted_files_held(p, cache) for p in workers]}")


def test_a_worker_imports_only_what_serving_needs() -> None:
    # The package's names resolve on first use, so a worker process does not carry the
    # loader, the agent or the command line (memory the agent's budget counts).
    code = "import json, sys, wdscache.pool; print(json.dumps([m for m in sys.modules if m.startswith('wdscache')]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert not {"wdscache.loader", "wdscache.agent", "wdscache.cli", "wdscache.stats"} & set(loaded), loaded
