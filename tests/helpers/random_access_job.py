"""ShardListDataset under torch's DataLoader, in a process of its own (torch's import is slow,
and must not leak into the pytest process):

    python -m tests.helpers.random_access_job INDEX_JSON CACHE_DIR WIDS_DIR

Prints one JSON object: for each sampler, the sample indices the DataLoader workers read and
each one's digest, next to the digest ``wids.ShardListDataset`` gives for that index (read
in this process from its own download folder, the byte reference).
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import warnings
from typing import Any

import torch
import wids
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from wdscache import ShardListDataset


def digest(sample: dict[str, Any]) -> list[Any]:
    """Every key in order, with its payload's SHA-256 (or its value, for the metadata)."""
    out = []
    for key, value in sample.items():
        if isinstance(value, io.BytesIO):
            value = hashlib.sha256(value.getvalue()).hexdigest()
        out.append([key, value if value is None or isinstance(value, str) else int(value)])
    return out


def digests(batch: list[dict[str, Any]]) -> list[list[Any]]:
    return [digest(s) for s in batch]


def read(ds: ShardListDataset, sampler: Any, **kw: Any) -> list[list[Any]]:
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=digests, **kw)
    return [d for batch in loader for d in batch]


def main(index: str, cache: str, wids_dir: str) -> None:
    ds = ShardListDataset(index, cache_dir=cache, transformations=[], timeout=60)
    out: dict[str, Any] = {"len": len(ds)}
    out["distributed"] = [
        read(ds, DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=3)) for r in range(2)
    ]
    weights = torch.linspace(0.1, 1.0, len(ds))
    out["weighted"] = read(ds, WeightedRandomSampler(weights, 40, generator=torch.Generator().manual_seed(5)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without distributed initialized": one process here
        chunked = wids.DistributedChunkedSampler(ds, chunksize=7, seed=1)
    out["chunked"] = read(ds, chunked)
    out["spawned"] = read(
        ds, DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=4), multiprocessing_context="spawn"
    )
    out["is_dataset"] = isinstance(ds, torch.utils.data.Dataset)
    both = ds + ds  # torch's ConcatDataset, as of two wids datasets
    out["concat"] = [len(both), digest(both[len(ds) + 5]), digest(ds[5])]
    reference = wids.ShardListDataset(index, cache_dir=wids_dir, transformations=[])
    out["wids"] = [digest(reference[i]) for i in range(len(reference))]
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
