"""A training process out of open files gets a WdsCacheError that names its limit, never an
abort. A real agent (started through the CLI) serves a cached list; consumers, each a process of
its own whose limit on open files is 256, take all but a few of them and read an epoch. ZeroMQ
aborts a process (SIGABRT, no traceback) when the start of a context cannot make its epoll
descriptor, and raises a bare ZMQError when a socket cannot have its own: with 2 to 4, or 9 to
11, files free the consumer died so, with 1 or 5 to 8 it raised ZMQError.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.few_files_job import LIMIT

SHARDS, SAMPLES = 4, 4
FREE = (0, 1, 2, 3, 4, 6, 9, 10, 11, 13)  # files left free to a consumer: the abort range and around it


@pytest.mark.slow
def test_a_consumer_out_of_files_raises_an_error_naming_its_limit(tmp_path, dataset, start_agent):
    data = dataset(SHARDS, samples=SAMPLES, payload=200)
    agent = start_agent(tmp_path / "cache", data.list_file, "--no-shuffle", "--prefetch", str(SHARDS))
    agent.wait_stats(lambda s: s["shards"].get("cached") == SHARDS, 30, "shards cached")
    outcomes = {}
    for free in FREE:
        done = subprocess.run(
            [sys.executable, "-m", "tests.helpers.few_files_job", str(agent.cache_dir), str(free), "10"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=60,
        )
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        outcomes[free] = (done.returncode, done.stdout.strip(), last)
    assert not [free for free, (rc, _, _) in outcomes.items() if rc == -signal.SIGABRT], outcomes
    for free, (rc, out, last) in outcomes.items():
        if rc == 0:  # enough for a connection: the whole epoch
            assert out == f"read {SHARDS * SAMPLES}", (free, outcomes)
            continue
        assert rc == 1 and last.startswith("wdscache.WdsCacheError: "), (free, outcomes)
        assert f"of its {LIMIT} open files" in last and "ulimit -n" in last, (free, outcomes)
    # Too few for a connection to the agent: no read went out.
    assert all(outcomes[free][0] == 1 for free in (0, 1, 2, 3, 4, 6)), outcomes
    assert agent.running()
