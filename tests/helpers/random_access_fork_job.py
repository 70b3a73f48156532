"""A forked DataLoader worker of ShardListDataset, in a process of its own (torch's import is slow,
and must not leak into the pytest process):

    python -m tests.helpers.random_access_fork_job INDEX_JSON CACHE_DIR PARENT_INDEX WORKER_INDEX [thread]

The parent reads ``PARENT_INDEX`` (so it holds that shard's cache file open; with ``thread``, in
a thread of its own, ended before the fork), then one forked
DataLoader worker reads ``WORKER_INDEX``. Prints one JSON object: the files under the cache
directory each process holds open (``/proc/<pid>/fd``) once it has read, and each one's key.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.utils.data import DataLoader, Dataset

from wdscache import ShardListDataset


def open_cache_files(cache: str) -> list[str]:
    """The files under ``cache`` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed by now
            continue
        if target.startswith(cache + os.sep):
            found.append(target)
    return sorted(found)


class Probe(Dataset[dict[str, Any]]):
    """``ds[i]``'s key, and the cache files the process that read it holds open."""

    def __init__(self, ds: ShardListDataset, cache: str) -> None:
        self.ds, self.cache = ds, cache

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict[str, Any]:
        key = self.ds[index]["__key__"]
        return {"key": key, "files": open_cache_files(self.cache), "pid": os.getpid()}


def main(index: str, cache: str, parent_index: int, worker_index: int, in_thread: bool) -> None:
    cache = os.path.realpath(cache)
    ds = ShardListDataset(index, cache_dir=cache, transformations=[], timeout=60)
    probe = Probe(ds, cache)
    if in_thread:
        with ThreadPoolExecutor(1) as pool:
            parent = pool.submit(probe.__getitem__, parent_index).result()
    else:
        parent = probe[parent_index]
    loader = DataLoader(probe, batch_size=None, sampler=[worker_index], num_workers=1, multiprocessing_context="fork")
    (worker,) = list(loader)
    ds.close()
    print(json.dumps({"parent": parent, "worker": worker, "parent_pid": os.getpid()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["thread"])
