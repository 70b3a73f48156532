"""Mixtures and ``resampled=True`` in torch DataLoaders with workers, in one process (torch's
import is slow, and must not leak into the pytest process):

    python -m tests.helpers.torch_mix_job CACHE_DIR LIST_A LIST_B PATTERN

Prints one JSON object: what each rank, epoch and resume got (``url#key@source``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from torch.utils.data import DataLoader, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import wdscache
from wdscache import CachedMultiLoader


def ids(batch: dict[str, Any]) -> list[str]:
    return [f"{u}#{k}@{s}" for u, k, s in zip(batch["__url__"], batch["__key__"], batch["__source__"])]


def mixture(cache: str, a: str, b: str, rank: int, world: int) -> CachedMultiLoader:
    return CachedMultiLoader(
        mix={a: 3, b: 1},
        epoch_samples=61,
        cache_dir=cache,
        rank=rank,
        world_size=world,
        job=f"mix-w{world}",
        shuffle_buffer=16,
        timeout=60,
    )


def tagged(sample: dict[str, Any]) -> tuple[str, int]:
    info = get_worker_info()
    return f"{sample['__url__']}#{sample['__key__']}", info.id if info is not None else -1


def main(cache: str, a: str, b: str, pattern: str) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": []}
    for rank in range(2):  # two ranks, DataLoader(num_workers=2), two epochs
        ds = mixture(cache, a, b, rank, 2)
        dl = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
        epochs = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            epochs.append([i for batch in dl for i in ids(batch)])
        out["ranks"].append(epochs)
    out["whole"] = [i for batch in DataLoader(mixture(cache, a, b, 0, 1), batch_size=5) for i in ids(batch)]
    # StatefulDataLoader with 2 workers stopped after 3 batches; its state resumes on 3 workers
    dl = StatefulDataLoader(mixture(cache, a, b, 0, 1), batch_size=4, num_workers=2)
    out["first"] = [i for _, batch in zip(range(3), dl) for i in ids(batch)]
    state = dl.state_dict()
    ds = mixture(cache, a, b, 0, 1)
    ds.load_state_dict(state)
    out["rest"] = [i for batch in StatefulDataLoader(ds, batch_size=4, num_workers=3) for i in ids(batch)]
    # webdataset's resampled=True with with_epoch(n): each worker yields its n, set_epoch draws again
    rs = wdscache.WebDataset(pattern, cache_dir=cache, resampled=True, job="resampled").with_epoch(12).map(tagged)
    rdl = DataLoader(rs, batch_size=None, num_workers=2)
    out["resampled"] = []
    for epoch in range(2):
        rs.set_epoch(epoch)
        out["resampled"].append(list(rdl))
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
