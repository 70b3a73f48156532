"""ShardListDataset read by readers that never call ``close()``, in a process of its own (torch's
import is slow, and must not leak into the pytest process):

    python -m tests.helpers.random_access_counts_job INDEX_JSON CACHE_DIR

Reads every sample once through a ``DataLoader`` of 2 workers (``persistent_workers=False``),
forked then spawned (each epoch under a dataset name of its own: ``fork``, ``spawn``), and asks
``wdscache stats --json`` as each epoch ends (its workers have exited then); then reads every
sample in this process itself (dataset name ``main``) and exits without ``close()``. Prints one
JSON object: the samples and payload bytes each read, and the stats' ``rank_totals`` of each
epoch's job as it ended.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

from torch.utils.data import DataLoader

from scripts.console import wdscache_exe
from wdscache import ShardListDataset


def payload(batch: list[dict[str, Any]]) -> list[int]:
    """Each sample's fields' bytes (what the agent counts of it)."""
    return [sum(len(v.getvalue()) for v in s.values() if isinstance(v, io.BytesIO)) for s in batch]


def totals(cache: str, job: str) -> Any:
    out = subprocess.run(
        [wdscache_exe(), "stats", "--cache-dir", cache, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)["rank_totals"].get(job)


def main(index: str, cache: str) -> None:
    out: dict[str, Any] = {}
    for context in ("fork", "spawn"):
        ds = ShardListDataset(index, cache_dir=cache, dataset_name=context, transformations=[], timeout=60)
        loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=payload, multiprocessing_context=context)
        sizes = [n for batch in loader for n in batch]
        out[context] = {"samples": len(sizes), "bytes": sum(sizes), "totals": totals(cache, f"random-access/{context}")}
    ds = ShardListDataset(index, cache_dir=cache, dataset_name="main", transformations=[], timeout=60)
    sizes = payload([ds[i] for i in range(len(ds))])
    out["main"] = {"samples": len(sizes), "bytes": sum(sizes)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
