"""A training loop fed by wdscache: run one process per rank (as torchrun would).

    RANK=0 WORLD_SIZE=2 python scripts/train_example.py --cache-dir DIR --epochs 1
    torchrun --nproc-per-node 2 scripts/train_example.py --cache-dir DIR

Needs a running agent on DIR (``wdscache agent --cache-dir DIR --urls LIST``).
PyTorch is optional: with it, a tiny model trains on a feature of each sample;
without it, the loop only counts. Checkpoints hold ``loader.state_dict()``, so
a restarted job (with any number of ranks) continues the epoch where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from wdscache import CachedMultiLoader

try:
    import torch
except ImportError:  # the example runs without PyTorch
    torch = None


def features(batch: dict) -> list[list[float]]:
    # A stand-in for decoding: payload size and class label of each sample.
    return [[len(jpg) / 1e5, float(cls)] for jpg, cls in zip(batch["jpg"], batch["cls"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=os.environ.get("WDSCACHE_CACHE_DIR"))
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--checkpoint", type=Path, default=None, help="resume from / save the loader state here")
    args = ap.parse_args()

    loader = CachedMultiLoader(cache_dir=args.cache_dir, batch_size=args.batch_size, seed=42)
    if args.checkpoint and args.checkpoint.exists():
        loader.load_state_dict(json.loads(args.checkpoint.read_text())["loader"])
    model = torch.nn.Linear(2, 1) if torch else None
    opt = torch.optim.SGD(model.parameters(), lr=0.01) if torch else None

    for epoch in range(args.epochs):
        t0, seen = time.monotonic(), 0
        for batch in loader:
            seen += len(batch["__key__"])
            if torch:
                x = torch.tensor(features(batch))
                loss = (model(x[:, :1]) - x[:, 1:]).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        took = time.monotonic() - t0
        print(f"rank {loader.rank}/{loader.world_size} epoch {epoch}: {seen} samples in {took:.2f}s", flush=True)
        if args.checkpoint and loader.rank == 0:
            args.checkpoint.write_text(json.dumps({"loader": loader.state_dict()}))


if __name__ == "__main__":
    main()
