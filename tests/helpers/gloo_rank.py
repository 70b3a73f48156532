"""One rank of a job on several nodes, in a real gloo process group on loopback:

    python -m tests.helpers.gloo_rank CACHE_DIR RANK WORLD_SIZE INIT_FILE NUM_WORKERS [GO_FILE]

Node ``RANK`` of ``WORLD_SIZE`` (one rank per node), its agent's cache ``CACHE_DIR``; it
makes its loader (with ``GO_FILE``, then writes ``GO_FILE.made<RANK>`` and waits up to 30 s
for ``GO_FILE`` to exist) and reads one epoch (through a DataLoader of ``NUM_WORKERS`` workers if above 0) and prints one
JSON object: the sample ids it got (``url#key``), or the error it raised (class and message).
The process group's timeout is 30 s, so no collective waits longer.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader

from wdscache import CachedMultiLoader


def main(cache: str, rank: int, world: int, init_file: str, workers: int, go: str | None) -> dict[str, object]:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        loader = CachedMultiLoader(
            cache_dir=cache,
            rank=rank,
            world_size=world,
            node=rank,
            num_nodes=world,
            job="gloo",
            shuffle_buffer=20,
            timeout=30,
        )
        if go is not None:
            Path(f"{go}.made{rank}").touch()
            deadline = time.monotonic() + 30
            while not Path(go).exists():
                if time.monotonic() > deadline:
                    return {"error": "TimeoutError", "message": f"{go} never appeared"}
                time.sleep(0.05)
        got: list[str] = []
        if workers:
            for batch in DataLoader(loader, batch_size=4, num_workers=workers):
                got += [f"{u}#{k}" for u, k in zip(batch["__url__"], batch["__key__"])]
        else:
            got = [f"{s['__url__']}#{s['__key__']}" for s in loader]
        return {"ids": got}
    except Exception as exc:  # noqa: BLE001 (the test checks which, and its message)
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    cache_dir, r, w, init, k = sys.argv[1:6]
    print(json.dumps(main(cache_dir, int(r), int(w), init, int(k), sys.argv[6] if len(sys.argv) > 6 else None)))
