"""One rank of a job whose script starts its process group itself, as ``torch.multiprocessing.spawn``
scripts do: no launcher, so no RANK, WORLD_SIZE or SLURM_* variable, only
``init_process_group(rank=..., world_size=...)`` over TCP on loopback:

    python -m tests.helpers.spawned_rank CACHE_DIR RANK WORLD_SIZE PORT

Before the group is initialised it makes a loader and a ``wdscache.WebDataset`` (which cannot
know the ranks yet), and after it another of each, all without ``rank=``/``world_size=``, over
the agent's list at ``CACHE_DIR``. It prints one JSON object: of the early ones, what their
first iteration raised (alone, and in a DataLoader worker forked or spawned) or the samples
they gave; of the later ones, their rank and world size and the sample ids (``url#key``) of one
epoch each (the loader's alone and through a DataLoader of 2 workers). The group's timeout is
30 s, so no collective waits longer.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

import wdscache
from wdscache import CachedMultiLoader


def ids(samples: Iterable[dict[str, Any]]) -> list[str]:
    return [f"{s['__url__']}#{s['__key__']}" for s in samples]


def batch_ids(batches: Iterable[dict[str, Any]]) -> list[str]:
    return [f"{u}#{k}" for b in batches for u, k in zip(b["__url__"], b["__key__"])]


def in_workers(dataset: Any, workers: int, context: str) -> list[str]:
    """One epoch of ``dataset`` through a DataLoader of ``workers`` workers started by ``context``."""
    return batch_ids(DataLoader(dataset, batch_size=4, num_workers=workers, multiprocessing_context=context))


def first_iteration(read: Callable[[], list[str]]) -> dict[str, Any]:
    """What one epoch of ``read`` gave: its ids, or the error it raised (class and message)."""
    try:
        return {"ids": read()}
    except Exception as exc:  # noqa: BLE001 (the test checks which, and its message)
        return {"error": type(exc).__name__, "message": str(exc)}


def main(cache: str, rank: int, world: int, port: int) -> dict[str, Any]:
    early = CachedMultiLoader(cache_dir=cache, job="early", timeout=30)
    early_wds = wdscache.WebDataset(cache_dir=cache, job="early-wds", timeout=30)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    try:
        out: dict[str, Any] = {"early": {}}
        out["early"]["loader"] = first_iteration(lambda: ids(early))
        out["early"]["wds"] = first_iteration(lambda: ids(early_wds))
        for context in ("fork", "spawn"):
            out["early"][context] = first_iteration(functools.partial(in_workers, early, 1, context))
        loader = CachedMultiLoader(cache_dir=cache, job="late", shuffle_buffer=20, timeout=30)
        out["layout"] = [loader.rank, loader.world_size]
        out["loader"] = ids(loader)
        out["dataloader"] = in_workers(loader, 2, "fork")
        out["wds"] = ids(wdscache.WebDataset(cache_dir=cache, shardshuffle=True, job="late-wds", timeout=30))
        # world_size=1 given: this rank reads everything (an evaluation on every rank, say).
        out["whole"] = first_iteration(lambda: ids(CachedMultiLoader(cache_dir=cache, job="whole", world_size=1)))
        return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    cache_dir, r, w, p = sys.argv[1:5]
    print(json.dumps(main(cache_dir, int(r), int(w), int(p))))
