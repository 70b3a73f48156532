"""A training loop fed by wdscache: one process per rank, as torchrun starts them.

    torchrun --nproc-per-node 2 scripts/train_example.py --cache-dir DIR --epochs 2 --num-workers 2
    RANK=0 WORLD_SIZE=2 python scripts/train_example.py --cache-dir DIR --epochs 1   # one rank by hand

Needs a running agent on DIR (``wdscache agent --cache-dir DIR --urls LIST``), or ``--urls``
(a list file or pattern: then a private agent starts when none runs).

With PyTorch (and webdataset), it is the usual webdataset loop with one line changed:
``wdscache.WebDataset(...)`` with webdataset's stages, in a ``DataLoader`` (torchdata's
``StatefulDataLoader`` where installed) with ``--num-workers`` workers, and a tiny model in
``DistributedDataParallel`` over gloo on the CPU when torchrun started it. Every rank takes
the same number of steps. With ``--checkpoint``, rank 0 saves the model and the loader's
state after every step; a restarted job (killed at any moment, with any number of ranks or
workers) continues where the checkpoint stands, and each epoch still sees every sample once.
Without PyTorch or webdataset, the loop only counts, over ``CachedMultiLoader``'s own batches.

``--seen-log DIR`` writes what each rank saw (``rank-R.jsonl``: epoch, step, sample ids), the ids
of a step before its gradients are shared; a restart drops the steps after the checkpoint, as
it drops their updates of the model.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

try:
    import torch
    import webdataset  # noqa: F401 (wdscache.WebDataset builds on it)
except ImportError:  # the example runs without them
    torch = None

import wdscache


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def counting_loop(args: argparse.Namespace) -> None:
    """Without PyTorch: the loader's own batches, counted."""
    loader = wdscache.CachedMultiLoader(args.urls, cache_dir=args.cache_dir, batch_size=args.batch_size, seed=42)
    if args.checkpoint and args.checkpoint.exists():
        loader.load_state_dict(json.loads(args.checkpoint.read_text())["loader"])
    for epoch in range(args.epochs):
        t0, seen = time.monotonic(), 0
        for batch in loader:
            seen += len(batch["__key__"])
        took = time.monotonic() - t0
        print(f"rank {loader.rank}/{loader.world_size} epoch {epoch}: {seen} samples in {took:.2f}s", flush=True)
        if args.checkpoint and loader.rank == 0:
            write_atomically(args.checkpoint, json.dumps({"loader": loader.state_dict()}).encode())


def data_loader(dataset: Any, args: argparse.Namespace) -> Any:
    """torchdata's StatefulDataLoader where installed (its state resumes mid-epoch), else torch's."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    except ImportError:
        from torch.utils.data import DataLoader as Loader
    return Loader(dataset, batch_size=args.batch_size, num_workers=args.num_workers)


def torch_loop(args: argparse.Namespace) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    distributed = world > 1 and "MASTER_ADDR" in os.environ  # started by torchrun
    if distributed:
        torch.distributed.init_process_group("gloo")
    # The one changed line: webdataset.WebDataset(urls, ...) becomes wdscache.WebDataset(urls, cache_dir=...).
    dataset = (
        wdscache.WebDataset(args.urls, cache_dir=args.cache_dir, shardshuffle=True, seed=42)
        .shuffle(200)
        .decode()
        .to_tuple("__url__", "__key__", "cls")
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    start_epoch, step = 0, 0
    ckpt = torch.load(args.checkpoint, weights_only=True) if args.checkpoint and args.checkpoint.exists() else None
    if ckpt is not None:
        # Saved unwrapped (see save): it loads with or without DDP, so with any number of ranks.
        getattr(model, "module", model).load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step = ckpt["epoch"], ckpt["step"]
        if ckpt["data"]:  # stopped inside the epoch: the loader's state, from any number of ranks and
            dataset.load_state_dict(json.loads(ckpt["data"]))  # workers, into the dataset itself
            # The epoch the next iteration reads, as the state says: one taken once the epoch's last
            # sample was out (before the save after the loop) may already name the next epoch.
            start_epoch = dataset.state_dict()["epoch"]
    log = _Log(args.seen_log, rank, step) if args.seen_log else None
    for epoch in range(start_epoch, args.epochs):
        dataset.set_epoch(epoch)  # the resumed epoch's too: a state just loaded keeps its rest
        loader = data_loader(dataset, args)
        t0, seen, steps = time.monotonic(), 0, 0
        for urls, keys, labels in loader:
            step += 1
            steps += 1
            seen += len(keys)
            if log:
                log.write(epoch, step, [f"{u}#{k}" for u, k in zip(urls, keys)])
            x = labels.float().unsqueeze(1) / 1000
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()  # DDP shares the gradients here: every rank must take the same steps
            opt.step()
            if args.checkpoint and rank == 0 and hasattr(loader, "state_dict"):
                save(args.checkpoint, model, opt, epoch, step, loader.state_dict())
            if args.step_sleep:
                time.sleep(args.step_sleep)
        took = time.monotonic() - t0
        print(f"rank {rank}/{world} epoch {epoch}: {steps} steps, {seen} samples in {took:.2f}s", flush=True)
        if log:
            log.epoch_end(epoch, steps)
        if args.checkpoint and rank == 0:
            save(args.checkpoint, model, opt, epoch + 1, step, None)
    if distributed:
        torch.distributed.destroy_process_group()


def save(path: Path, model: Any, opt: Any, epoch: int, step: int, data_state: dict | None) -> None:
    """The job's checkpoint; ``data_state`` None: ``epoch`` starts from its beginning."""
    import io

    buf = io.BytesIO()
    torch.save(
        {
            "model": getattr(model, "module", model).state_dict(),  # without DDP's "module." prefix
            "opt": opt.state_dict(),
            "epoch": epoch,
            "step": step,
            "data": json.dumps(data_state) if data_state else "",
        },
        buf,
    )
    write_atomically(path, buf.getvalue())


class _Log:
    """What one rank saw, by step; on a restart the steps after the checkpoint's are dropped."""

    def __init__(self, folder: Path, rank: int, step: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}.jsonl"
        kept = []
        if self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step
            ]
        write_atomically(self.path, "".join(line + "\n" for line in kept).encode())
        self.out = open(self.path, "a", buffering=1)

    def write(self, epoch: int, step: int, ids: list[str]) -> None:
        self.out.write(json.dumps({"epoch": epoch, "step": step, "ids": ids}) + "\n")
        self.out.flush()
        os.fsync(self.out.fileno())

    def epoch_end(self, epoch: int, steps: int) -> None:
        self.out.write(json.dumps({"epoch_end": epoch, "steps": steps}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=os.environ.get("WDSCACHE_CACHE_DIR"))
    ap.add_argument("--urls", default=None, help="a URL list file or pattern (default: the agent's list)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    ap.add_argument("--checkpoint", type=Path, default=None, help="resume from / save the job's state here")
    ap.add_argument("--seen-log", type=Path, default=None, help="write the samples each rank saw into this folder")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    args = ap.parse_args()
    if torch is None:
        counting_loop(args)
    else:
        torch_loop(args)


if __name__ == "__main__":
    main()
