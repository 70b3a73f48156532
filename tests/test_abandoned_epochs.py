"""Epochs left early hold no pins past their iterator: a long-lived loader broken out of every
epoch, or whose iterator is kept after the break, or read by a DataLoader's persistent workers,
never makes the agent's pinned set grow, and a budget far smaller than the dataset keeps serving.

Each epoch is one reader of the agent (its own session), closed, with a bye that lets go of all
its pins, when its iterator is closed or dropped (a loop broken out of drops it at once). Until
then, a stream left at its user's hands keeps at most its read-ahead window pinned
(:func:`window`), which it lets go of when another reader waits for room that they hold.

A real agent started through the CLI on a budget of a third of the dataset, the real HTTP shard
server, and the loader in a process of its own (tests/helpers/abandoned_epochs_job.py) that reads
the agent's stats after every epoch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from math import ceil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import abandoned_epochs_job as job
from tests.helpers.procs import run_json_job
from tests.helpers.streaming import reference
from wdscache.training.epoch_shards import OPEN_TOGETHER

SHARDS, PER_SHARD, PAYLOAD = 24, 20, 4000  # shards of about 100 KB
BUDGET_SHARDS = 10  # the cache holds this many: the prefetch window (8) and one read, not the dataset
EPOCHS, TAKE = 20, 30  # each epoch left after TAKE of its 480 samples


def window(readers: int = 1) -> int:
    """Shards a stream left at its user's hands may keep pinned: those of the positions it reads
    ahead, in a row of the epoch's shard order (no shuffle buffer: the read being handed out,
    ``inflight`` reads in the table and a batch being filled, ``request_size`` samples each), and
    the shards after them that its latest open pinned too where they were cached (``also``)."""
    ahead = (job.INFLIGHT + 2) * job.REQUEST_SIZE
    return readers * (ceil((ahead - 1) / PER_SHARD) + 1 + OPEN_TOGETHER)


@pytest.fixture
def served(dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path) -> tuple[Path, set[str]]:
    """A cold cache on a budget of BUDGET_SHARDS shards, and every sample id of the dataset."""
    urls, paths, list_file = dataset(SHARDS, samples=PER_SHARD, payload=PAYLOAD)
    budget = BUDGET_SHARDS * max(p.stat().st_size for p in paths)
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--cache-size", str(budget), "--workers", "2")
    everything = {f"{url}#{key}" for url, key in reference(paths, urls)}
    return cache, everything


def _check(out: dict[str, Any], everything: set[str], left_pinned: int, left_readers: int) -> None:
    epochs = out["epochs"]
    assert [e["taken"] for e in epochs] == [TAKE] * EPOCHS  # every epoch read on: no stall on the budget
    pinned = [e["pinned"] for e in epochs]
    assert max(pinned) <= left_pinned, f"pinned after each epoch left: {pinned}"
    assert max(e["consumers"] for e in epochs) <= left_readers, epochs
    assert Counter(out["whole"]) == Counter(everything)  # a whole epoch after them: each sample once
    assert out["after"] == {"pinned": 0, "consumers": 0}


@pytest.mark.slow
def test_epochs_broken_out_of_keep_no_pins(served: tuple[Path, set[str]]) -> None:
    """The loop broken out of closes its epoch there: nothing stays pinned between epochs."""
    cache, everything = served
    out = run_json_job("tests.helpers.abandoned_epochs_job", str(cache), "break", str(EPOCHS), str(TAKE))
    _check(out, everything, left_pinned=0, left_readers=0)


@pytest.mark.slow
def test_iterator_kept_after_break_holds_its_window_only(served: tuple[Path, set[str]]) -> None:
    """An iterator kept past its break holds its read-ahead window at most, until the next epoch's
    ``iter()`` replaces it: one reader's, never the epochs' before it."""
    cache, everything = served
    assert window() < BUDGET_SHARDS  # else the bound would say nothing the budget does not
    out = run_json_job("tests.helpers.abandoned_epochs_job", str(cache), "held", str(EPOCHS), str(TAKE))
    _check(out, everything, left_pinned=window(), left_readers=1)


@pytest.mark.slow
def test_persistent_dataloader_workers_broken_out_of(served: tuple[Path, set[str]]) -> None:
    """A DataLoader's persistent workers keep their epoch's streams while the main process is
    away: two readers' windows at most, whatever the number of epochs, none once they exit."""
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    cache, everything = served
    out = run_json_job("tests.helpers.abandoned_epochs_job", str(cache), "dataloader", str(EPOCHS), str(TAKE))
    _check(out, everything, left_pinned=min(window(2), BUDGET_SHARDS), left_readers=2)
