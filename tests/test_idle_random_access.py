"""An idle random-access reader's pins do not hold up a stream that waits for room.

A training job streams its train set and evaluates on a validation set read by index
(``ShardListDataset``, wids style) through the same agent. On a budget that holds the
validation set's pins but not a train shard beside them, the next train epoch waits for room
those pins hold. A stream held by its user lets go of its pins when the agent asks; a
random-access session has no thread to answer, so the agent lets go of the pins of one idle
for ``IDLE_LET_GO`` (as it would after ``--reader-timeout``), and the session pins its shards
again at its next read.

Real processes: the agent through its CLI on a small ``--cache-size``, the real HTTP shard
server, the validation set read in a process of its own (tests/helpers/idle_random_access_job.py)
that stays alive and idle while this process streams the train set.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scripts.shard_maker import make_dataset, write_url_list
from scripts.shard_server import ShardServer
from tests.helpers.streaming import reference
from wdscache import CachedMultiLoader
from wdscache.agent.readers import IDLE_LET_GO

ROOT = Path(__file__).resolve().parents[1]
SHARDS, PER_SHARD, PAYLOAD = 6, 10, 20_000  # shards of about 200 KB, train and validation alike
READER_TIMEOUT = 30.0  # --reader-timeout: the wait the stream had before the fix
LOADER_TIMEOUT = 15.0  # the stream's timeout: it raises if it waits that long without progress
LINE_TIMEOUT = 60.0  # seconds the validation process gets for a read of its whole set


def _line(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The next line ``proc`` prints, a JSON object, within ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the validation process printed nothing in {timeout:.0f} s"
    line = proc.stdout.readline()
    assert line, f"the validation process exited ({proc.wait(5)})"
    out: dict[str, Any] = json.loads(line)
    return out


@pytest.mark.slow
def test_an_idle_validation_set_lets_a_stream_waiting_for_room_go_on(
    shard_server: ShardServer, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    assert IDLE_LET_GO < LOADER_TIMEOUT < READER_TIMEOUT  # else the test would say nothing
    train = make_dataset(shard_server.root, SHARDS, PER_SHARD, payload=PAYLOAD, prefix="train")
    val = make_dataset(shard_server.root, SHARDS, PER_SHARD, payload=PAYLOAD, prefix="val", seed=1)
    train_urls = [shard_server.url(p.name) for p in train]
    val_urls = [shard_server.url(p.name) for p in val]
    index = tmp_path / "val.json"
    index.write_text(
        json.dumps({"wids_version": 1, "shardlist": [{"url": u, "nsamples": PER_SHARD} for u in val_urls]})
    )
    size = max(p.stat().st_size for p in train + val)
    # The validation set's pins (all its shards: fewer than lru_size) and half a shard: no train
    # shard fits beside them.
    budget = SHARDS * size + size // 2
    cache = tmp_path / "cache"
    # The agent's list is the validation set (its start-up prefetch fetches no train shard the
    # validation set would have to evict); the stream names its own.
    list_file = write_url_list(tmp_path / "lists" / "urls.txt", val_urls)
    agent = start_agent(
        cache, list_file, "--cache-size", str(budget), "--reader-timeout", str(READER_TIMEOUT), "--prefetch", "2"
    )
    val_proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.idle_random_access_job", str(index), str(cache)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "val.log", "wb"),  # noqa: SIM115 (closed with the process)
        text=True,
    )
    try:
        first = _line(val_proc, LINE_TIMEOUT)
        expected_val = {f"{u}#{k}": fields for (u, k), fields in reference(val, val_urls).items()}
        assert first["samples"] == expected_val
        assert len(first["files"]) == SHARDS, first  # every validation shard pinned and open
        assert agent.stats()["agent"]["pinned"] == SHARDS

        # The next train epoch, while the validation process lives on, idle with its pins.
        loader = CachedMultiLoader(train_urls, cache_dir=cache, job="train", timeout=LOADER_TIMEOUT)
        started = time.monotonic()
        got = Counter(f"{s['__url__']}#{s['__key__']}" for s in loader)
        took = time.monotonic() - started
        assert got == Counter(f"{u}#{k}" for u, k in reference(train, train_urls)), "the train epoch is not exact"
        assert took < LOADER_TIMEOUT, f"the train epoch took {took:.1f} s"
        assert val_proc.poll() is None, "the validation process is gone: its pins went with it"
        log = agent.stderr_text()
        assert "silent for" not in log, agent.stderr_tail()
        assert "while a reader waits for room its pins hold" in log, agent.stderr_tail()

        # The validation set reads the same bytes again, its pins taken anew. It held its files
        # open while idle (those of shards evicted meanwhile keep their space until then); its
        # read closed them and opened the shards it pinned again.
        assert val_proc.stdin is not None
        val_proc.stdin.write("again\n")
        val_proc.stdin.flush()
        second = _line(val_proc, LINE_TIMEOUT)
        assert second["samples"] == expected_val
        assert len(second["files_before"]) == SHARDS, second["files_before"]
        assert not [f for f in second["files"] if f.endswith("(deleted)")], second["files"]
        assert val_proc.wait(LINE_TIMEOUT) == 0
    finally:
        if val_proc.poll() is None:
            val_proc.kill()
            val_proc.wait(10)
