"""A validation set read by index, then left idle, in a process of its own:

    python -m tests.helpers.idle_random_access_job INDEX_JSON CACHE_DIR

Reads every sample of the index with ``wdscache.ShardListDataset`` (its default ``lru_size``,
so every shard of a small index stays pinned), pass after pass until one needed no download
(an open that waits lets go of the session's other pins: a later epoch's evaluation, its shards
cached), and prints one JSON line: each sample's fields' SHA-256 by key, and the cache files
this process holds open. Then it sits idle (no read, no
ping: as a training job's validation set between evaluations) until a line comes on stdin,
reads every sample again and prints a second such line, the files it held open before that
read too; then it closes the dataset and exits.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from wdscache import ShardListDataset

MAX_PASSES = 5  # reads of the whole set to have every shard cached and pinned at once


def cache_files(cache: str) -> list[str]:
    """The files under ``cache`` this process holds open (evicted ones too: ``(deleted)``)."""
    root = str(Path(cache).resolve())
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            out.append(target)
    return sorted(out)


def read_all(ds: ShardListDataset) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for i in range(len(ds)):
        sample: dict[str, Any] = ds[i]
        out[f"{sample['__shard__']}#{sample['__key__']}"] = {
            k.lstrip("."): hashlib.sha256(v.getvalue()).hexdigest() for k, v in sample.items() if not k.startswith("__")
        }
    return out


def main(index: str, cache: str) -> None:
    with ShardListDataset(index, cache_dir=cache, transformations=[], timeout=60) as ds:
        passes = 0
        while True:
            samples, passes = read_all(ds), passes + 1
            if len(files := cache_files(cache)) == len(ds.shards) or passes == MAX_PASSES:
                break
        print(json.dumps({"passes": passes, "samples": samples, "files": files}), flush=True)
        sys.stdin.readline()  # idle until the test says so
        before = cache_files(cache)
        print(json.dumps({"samples": read_all(ds), "files_before": before, "files": cache_files(cache)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
