"""Epochs of one long-lived loader left early, in a process of its own:

    python -m tests.helpers.abandoned_epochs_job CACHE_DIR SCENARIO EPOCHS TAKE

Each of EPOCHS epochs is left after TAKE samples (TAKE below an epoch's length), then the
agent's stats are read over its socket (what ``wdscache stats --json`` shows): how many shards
are pinned, and by how many consumers. SCENARIO:

- ``break``: ``for sample in loader: ... break``, the iterator dropped with the loop;
- ``held``: the iterator kept in a variable after the break, until the next epoch's ``iter()``;
- ``dataloader``: torch's DataLoader with two persistent workers, broken out of; its workers
  keep their epoch's iterators until the next epoch.

Then one whole epoch, and the stats once it ended (``dataloader``: once the DataLoader and its
workers are gone). Prints one JSON object for the test to check.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from wdscache import CachedMultiLoader
from wdscache.shared.stats import collect

REQUEST_SIZE = 4  # samples a read asks for at most
INFLIGHT = 4  # reads out at most
SHUFFLE_BUFFER = 0  # shards in a new order each epoch, each read in order: a window in shard order
GONE_TIMEOUT = 30.0  # seconds the DataLoader's workers get to exit and say bye


def pins(cache: str) -> dict[str, int]:
    agent = collect(cache)["agent"]
    return {"pinned": agent["pinned"], "consumers": agent["consumers"]}


def ids(samples: list[dict[str, Any]]) -> list[str]:
    return [f"{s['__url__']}#{s['__key__']}" for s in samples]


def first(it: Iterator[dict[str, Any]], take: int) -> list[dict[str, Any]]:
    """The first ``take`` samples of ``it``, the loop broken out of (``it`` itself is not closed)."""
    got = []
    for sample in it:
        got.append(sample)
        if len(got) == take:
            break
    return got


def main(cache: str, scenario: str, epochs: int, take: int) -> dict[str, Any]:
    if scenario == "dataloader":
        import torch  # noqa: F401 (imported first, the loader is a torch dataset)
    loader = CachedMultiLoader(
        cache_dir=cache,
        job=f"abandoned-{scenario}",
        shuffle_buffer=SHUFFLE_BUFFER,
        request_size=REQUEST_SIZE,
        inflight=INFLIGHT,
        timeout=20,
    )
    out: dict[str, Any] = {"epochs": []}
    if scenario == "dataloader":
        from torch.utils.data import DataLoader

        dl = DataLoader(loader, batch_size=None, num_workers=2, persistent_workers=True, collate_fn=lambda s: s)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            got = first(iter(dl), take)
            out["epochs"].append({"taken": len(got), **pins(cache)})
        loader.set_epoch(epochs)
        out["whole"] = ids(list(dl))
        del dl  # its workers exit: their iterators go with them
        deadline = time.monotonic() + GONE_TIMEOUT
        while (after := pins(cache))["consumers"] and time.monotonic() < deadline:
            time.sleep(0.1)
        out["after"] = after
        return out
    held: Iterator[dict[str, Any]] | None = None
    for _ in range(epochs):
        if scenario == "held":
            held = iter(loader)  # the last epoch's iterator goes only now
            got = first(held, take)
        else:
            got = first(iter(loader), take)
        out["epochs"].append({"taken": len(got), **pins(cache)})
    held = None
    out["whole"] = ids(list(loader))
    out["after"] = pins(cache)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
