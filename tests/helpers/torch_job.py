"""Torch scenarios in one process (torch's import is slow, and must not leak into the pytest
process, where loaders made afterwards would become torch datasets):

    python -m tests.helpers.torch_job CACHE_DIR SCENARIO

Prints one JSON object: what each rank and epoch got (sample ids ``url#key``), for the
test to check.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from wdscache import CachedMultiLoader


def ids(batch: dict[str, Any]) -> list[str]:
    return [f"{u}#{k}" for u, k in zip(batch["__url__"], batch["__key__"])]


def loader(cache: str, rank: int, world: int, **kw: Any) -> CachedMultiLoader:
    return CachedMultiLoader(
        cache_dir=cache, rank=rank, world_size=world, job=f"torch-w{world}", shuffle_buffer=50, timeout=60, **kw
    )


def workers(cache: str) -> dict[str, Any]:
    """Two ranks, DataLoader(num_workers=2, persistent, pinned), two epochs set with set_epoch."""
    out: dict[str, Any] = {"ranks": []}
    for rank in range(2):
        ds = loader(cache, rank, 2)
        out["is_dataset"] = isinstance(ds, IterableDataset)
        dl = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True, pin_memory=True)
        epochs = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            got: list[str] = []
            for batch in dl:
                got += ids(batch)
            epochs.append(got)
        out["ranks"].append(epochs)
        out["len"] = len(ds)  # known once every shard was read
    # Workers started fresh ("spawn"), the dataset pickled to them.
    out["spawned"] = sorted(
        i
        for batch in DataLoader(loader(cache, 0, 1), batch_size=5, num_workers=2, multiprocessing_context="spawn")
        for i in ids(batch)
    )
    ds = loader(cache, 0, 1, batch_size=3, map=tensor_of)
    first = next(iter(ds))
    out["collated"] = {k: type(v).__name__ for k, v in first.items()}
    views = next(iter(loader(cache, 0, 1, batch_size=3, zero_copy=True)))  # memoryviews: torch's collate refuses them
    out["zero_copy_collated"] = {k: [type(x).__name__ for x in v] for k, v in views.items() if k == "cls"}
    return out


def epochs_of(ds: Any, dl: Any, n: int, *, set_each: bool) -> list[list[str]]:
    """What ``n`` iterations of ``dl`` over ``ds`` give, each an epoch (``set_each``: told by set_epoch)."""
    out = []
    for epoch in range(n):
        if set_each:
            ds.set_epoch(epoch)
        out.append([i for batch in dl for i in ids(batch)])
    return out


def fresh_workers(cache: str) -> dict[str, Any]:
    """Three epochs of DataLoader(num_workers=2) over a rank of two: torch's default workers
    (made anew each epoch, "fork" and "spawn") without set_epoch, and as references the same
    told by set_epoch and persistent workers without it; then a wdscache.WebDataset's."""
    import webdataset as wds

    import wdscache

    def run(set_each: bool, **kw: Any) -> list[list[str]]:
        ds = loader(cache, 0, 2)
        return epochs_of(ds, DataLoader(ds, batch_size=4, num_workers=2, **kw), 3, set_each=set_each)

    out: dict[str, Any] = {
        "fresh": run(False),
        "spawned": run(False, multiprocessing_context="spawn"),
        "told": run(True),
        "persistent": run(False, persistent_workers=True),
    }
    # set_epoch once, then none: the iterations after it move on from that epoch.
    ds = loader(cache, 0, 2)
    dl = DataLoader(ds, batch_size=4, num_workers=2)
    first = epochs_of(ds, dl, 1, set_each=True)
    ds.set_epoch(1)
    out["set_then_not"] = first + epochs_of(ds, dl, 2, set_each=False)
    # A DataLoader of another number of workers each epoch (0: the dataset iterated here).
    for name, layout in (("widths", [2, 2, 4, 2, 4]), ("here_and_there", [0, 2, 2, 0, 2])):
        got, told = loader(cache, 0, 2), loader(cache, 0, 2)
        out[name] = [[i for batch in DataLoader(got, batch_size=4, num_workers=k) for i in ids(batch)] for k in layout]
        out[f"{name}_told"] = []
        for epoch, k in enumerate(layout):
            told.set_epoch(epoch)
            out[f"{name}_told"].append(
                [i for batch in DataLoader(told, batch_size=4, num_workers=k) for i in ids(batch)]
            )
    pipeline = wdscache.WebDataset(
        None, cache_dir=cache, shardshuffle=True, job="torch-wds", timeout=60, rank=0, world_size=1
    ).map(lambda s: {"__url__": s["__url__"], "__key__": s["__key__"]})
    out["webdataset"] = epochs_of(pipeline, wds.WebLoader(pipeline, batch_size=4, num_workers=2), 2, set_each=False)
    return out


def dead_lock_holder(cache: str) -> dict[str, Any]:
    """A process killed while it held the dataset's epoch lock (forked, SIGKILLed), then a
    DataLoader of 2 workers and an iteration here, which take that lock: both read their epoch."""
    import os
    import signal

    ds = loader(cache, 0, 1)
    pid = os.fork()
    if pid == 0:  # the child takes the lock and dies holding it
        ds._epoch_box.get_lock().acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    workers = [i for batch in DataLoader(ds, batch_size=4, num_workers=2) for i in ids(batch)]
    here = [f"{s['__url__']}#{s['__key__']}" for s in ds]
    return {"workers": workers, "here": here}


def small_budget(cache: str) -> dict[str, Any]:
    """One rank in DataLoader(num_workers=3), a sample at a time in list order, of an agent whose
    budget holds two shards."""
    ds = CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20)
    dl = DataLoader(ds, batch_size=None, num_workers=3, collate_fn=as_is)
    return {"got": [f"{x['__url__']}#{x['__key__']}" for x in dl]}


def as_is(sample: dict[str, Any]) -> dict[str, Any]:
    return sample


def tensor_of(sample: dict[str, Any]) -> dict[str, Any]:
    return {"n": int(sample["cls"]), "x": torch.ones(2)}


def stateful(cache: str) -> dict[str, Any]:
    """StatefulDataLoader: stop after 5 batches, resume with the same workers; stop again,
    resume with 3 workers and world size 2."""
    out: dict[str, Any] = {}
    dl = StatefulDataLoader(loader(cache, 0, 1), batch_size=3, num_workers=2)
    first: list[str] = []
    for i, batch in enumerate(dl):
        first += ids(batch)
        if i == 4:
            break
    state = dl.state_dict()
    out["first"] = first
    # num_workers=0: the dataset's own state, taken in this process
    dl0 = StatefulDataLoader(loader(cache, 0, 1), batch_size=5)
    head = [i for _, batch in zip(range(3), dl0) for i in ids(batch)]
    state0 = dl0.state_dict()
    dl0 = StatefulDataLoader(loader(cache, 0, 1), batch_size=5)
    dl0.load_state_dict(state0)
    out["single"] = [head, [i for batch in dl0 for i in ids(batch)]]
    # The usual loop sets the resumed epoch at its top too: its rest, with workers or without.
    out["set_resumed"] = []
    for workers_, state_ in ((2, state), (0, state0)):
        ds = loader(cache, 0, 1)
        resumed = StatefulDataLoader(ds, batch_size=3 if workers_ else 5, num_workers=workers_)
        resumed.load_state_dict(state_)
        ds.set_epoch(0)
        out["set_resumed"].append([i for batch in resumed for i in ids(batch)])
    dl = StatefulDataLoader(loader(cache, 0, 1), batch_size=3, num_workers=2)
    dl.load_state_dict(state)
    second: list[str] = []
    for i, batch in enumerate(dl):
        second += ids(batch)
        if i == 3:
            break
    out["second"] = second
    state = dl.state_dict()
    out["rest"] = []
    for rank in range(2):
        ds = loader(cache, rank, 2)
        ds.load_state_dict(state)
        got: list[str] = []
        for batch in StatefulDataLoader(ds, batch_size=2, num_workers=3):
            got += ids(batch)
        out["rest"].append(got)
    # Near the end: worker 1's slice (38 samples) is over at its short 13th batch (batch 26),
    # while worker 0 (40) has one sample left: its fellow's rest is none, not the next epoch.
    dl = StatefulDataLoader(loader(cache, 0, 1), batch_size=3, num_workers=2)
    head = [i for _, batch in zip(range(26), dl) for i in ids(batch)]
    state = dl.state_dict()
    dl = StatefulDataLoader(loader(cache, 0, 1), batch_size=3, num_workers=2)
    dl.load_state_dict(state)
    out["near_end"] = [head, [i for batch in dl for i in ids(batch)]]
    # At the end: both workers' last batches short (40 and 38 samples), their fetchers met the end
    # before the last batch came out: the state names the next epoch, as loaded into a dataset.
    dl = StatefulDataLoader(loader(cache, 0, 1), batch_size=3, num_workers=2)
    assert len([i for _, batch in zip(range(27), dl) for i in ids(batch)]) == 78
    ds = loader(cache, 0, 1)
    ds.load_state_dict(dl.state_dict())
    out["at_end"] = [
        ds.state_dict()["epoch"],
        [i for batch in StatefulDataLoader(ds, batch_size=3) for i in ids(batch)],
    ]
    ds = loader(cache, 0, 1)
    ds.set_epoch(1)
    out["epoch_1"] = [i for batch in StatefulDataLoader(ds, batch_size=3) for i in ids(batch)]
    # A worker's own state does not resume another layout: the error says what does.
    dl = StatefulDataLoader(loader(cache, 0, 1), batch_size=3, num_workers=3)
    dl.load_state_dict(state)
    try:
        next(iter(dl))
    except Exception as exc:  # noqa: BLE001 (the DataLoader re-raises the worker's error as its own type)
        out["mismatch"] = str(exc)
    # Workers' states snapshot every 4 batches, the state taken 2 batches after one: loaded into
    # the dataset it would deliver those 2 again, so it is refused.
    dl = StatefulDataLoader(loader(cache, 0, 1), batch_size=3, num_workers=2, snapshot_every_n_steps=4)
    assert len([i for _, batch in zip(range(6), dl) for i in ids(batch)]) == 18
    try:
        loader(cache, 0, 1).load_state_dict(dl.state_dict())
    except ValueError as exc:
        out["behind"] = str(exc)
    return out


def nodes(cache: str) -> dict[str, Any]:
    """Two nodes of one rank each, in StatefulDataLoaders with 2 workers (their states asked for
    at every batch), both stopped after 2 batches. Each rank's own state resumes it on the same
    layout; rank 0's, loaded into the dataset, resumes the job on 1 node x 2 ranks, 3 workers each."""

    def make(rank: int, ds: CachedMultiLoader | None = None, workers: int = 2) -> StatefulDataLoader:
        return StatefulDataLoader(
            ds or loader(cache, rank, 2, node=rank, num_nodes=2), batch_size=3, num_workers=workers
        )

    for _ in loader(cache, 0, 1):  # one epoch on one node: the agent learns the counts
        pass
    out: dict[str, Any] = {"first": [], "again": [], "whole": [], "rest": []}
    states = []
    for rank in range(2):
        dl = make(rank)
        out["first"].append([i for _, batch in zip(range(2), dl) for i in ids(batch)])
        states.append(dl.state_dict())
        dl = make(rank)
        dl.load_state_dict(states[rank])
        out["again"].append([i for batch in dl for i in ids(batch)])
        out["whole"].append([i for batch in make(rank) for i in ids(batch)])
    for rank in range(2):
        ds = loader(cache, rank, 2)
        ds.load_state_dict(states[0])
        out["rest"].append([i for batch in make(rank, ds, workers=3) for i in ids(batch)])
    return out


def holes_resumed(cache: str) -> dict[str, Any]:
    """Two ranks over a list whose last shard fails (tests/test_skip_holes.py's ``tailed``),
    unshuffled, on_error="skip", in StatefulDataLoaders of 2 workers: 4 batches of 4 each (8
    samples of each worker), then the rest resumed from each rank's own state (each worker
    from its own), and from rank 0's whole state loaded into the dataset."""

    def make(rank: int, ds: CachedMultiLoader | None = None) -> StatefulDataLoader:
        ds = ds if ds is not None else loader(cache, rank, 2, shuffle=False, on_error="skip", request_size=4)
        return StatefulDataLoader(ds, batch_size=4, num_workers=2)

    out: dict[str, Any] = {"first": [], "rest": [], "whole": []}
    states = []
    for rank in range(2):
        dl = make(rank)
        out["first"].append([i for _, batch in zip(range(4), dl) for i in ids(batch)])
        states.append(dl.state_dict())
        dl = make(rank)
        dl.load_state_dict(states[rank])
        out["rest"].append([i for batch in dl for i in ids(batch)])
    for rank in range(2):
        ds = loader(cache, rank, 2, shuffle=False, on_error="skip", request_size=4)
        ds.load_state_dict(states[0])
        out["whole"].append([i for batch in make(rank, ds) for i in ids(batch)])
    return out


def holes_workers(cache: str) -> dict[str, Any]:
    """Three ranks over ``tailed``'s list, unshuffled, on_error="skip", in DataLoaders of 2
    workers: rank 2's worker 1 gets holes alone. Each rank's epoch."""
    out: dict[str, Any] = {"ranks": []}
    for rank in range(3):
        ds = loader(cache, rank, 3, shuffle=False, on_error="skip", request_size=4)
        out["ranks"].append([i for batch in DataLoader(ds, batch_size=4, num_workers=2) for i in ids(batch)])
    return out


if __name__ == "__main__":
    cache_dir, scenario = sys.argv[1], sys.argv[2]
    scenarios = {
        "workers": workers,
        "stateful": stateful,
        "nodes": nodes,
        "small_budget": small_budget,
        "fresh_workers": fresh_workers,
        "dead_lock_holder": dead_lock_holder,
        "holes_resumed": holes_resumed,
        "holes_workers": holes_workers,
    }
    print(json.dumps(scenarios[scenario](cache_dir)))
