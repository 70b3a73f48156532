"""A ``ShardListDataset`` read, then dropped without ``close()`` and collected (as an evaluation
dataset built every few minutes and dropped, which wids needs no close() for), in a process
that stays alive afterwards:

    python -m tests.helpers.dropped_random_access_job INDEX_JSON CACHE_DIR SAMPLES OUT_JSON

Reads samples ``0 .. SAMPLES-1``, drops the dataset and collects it, then writes to OUT_JSON
(whole, by a rename) the dataset's name and the samples and payload bytes read, and sleeps
until it is killed; after 120 s faulthandler prints every thread's stack and exits with status 1.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import json
import os
import sys
import time

from wdscache import ShardListDataset

LIFETIME = 120.0  # seconds the process waits to be killed


def main(index: str, cache: str, samples: str, out: str) -> None:
    faulthandler.dump_traceback_later(LIFETIME, exit=True)
    ds = ShardListDataset(index, cache_dir=cache, transformations=[], timeout=30)
    read = [ds[i] for i in range(int(samples))]
    payload = sum(len(v.getvalue()) for s in read for v in s.values() if isinstance(v, io.BytesIO))
    name = ds.dataset_name
    del ds
    gc.collect()
    with open(out + ".part", "w") as f:
        json.dump({"dataset": name, "samples": len(read), "bytes": payload}, f)
    os.rename(out + ".part", out)
    time.sleep(LIFETIME)


if __name__ == "__main__":
    main(*sys.argv[1:5])
