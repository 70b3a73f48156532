"""A training process stand-in: iterate a CachedMultiLoader and record what it got.

    python tests/consumer.py --cache-dir DIR --out FILE [--rank R --world-size W --job J ...]

Writes one JSON line per sample: {"key", "url", "fields": {ext: sha256}} and, at
the end (or after --stop-after samples), a line {"state": loader.state_dict()}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

from wdscache import CachedMultiLoader


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--urls", default=None)
    ap.add_argument("--job", default="job")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--node", type=int, default=None)
    ap.add_argument("--num-nodes", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1, help="epochs read one after another, from --epoch on")
    ap.add_argument("--shuffle-buffer", type=int, default=100)
    ap.add_argument("--no-shuffle", action="store_true")
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--resume", default=None, help="a JSON state dict to load")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each sample")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument(
        "--on-error",
        default="raise",
        choices=("raise", "skip", "stop"),
        help="stop: a handler that returns False (the epoch ends where a shard fails, no error)",
    )
    ap.add_argument("--request-size", type=int, default=None, help="the loader's, unless given")
    ap.add_argument(
        "--linger-until",
        default=None,
        help="after the epoch, wait (up to --timeout) for this file to exist before exiting",
    )
    args = ap.parse_args()
    # The loader's warnings (retries, skipped shards) land in the log a failing test shows.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loader = CachedMultiLoader(
        args.urls,
        cache_dir=args.cache_dir,
        job=args.job,
        rank=args.rank,
        world_size=args.world_size,
        node=args.node,
        num_nodes=args.num_nodes,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        shuffle_buffer=args.shuffle_buffer,
        drop_last=args.drop_last,
        timeout=args.timeout,
        on_error=(lambda exc: False) if args.on_error == "stop" else args.on_error,
        **({} if args.request_size is None else {"request_size": args.request_size}),
    )
    n = 0
    with open(args.out, "w", buffering=1) as out:  # line by line: a test can watch the progress
        for epoch in range(args.epoch, args.epoch + args.epochs):
            if args.resume and epoch == args.epoch:
                loader.load_state_dict(json.loads(args.resume))
            else:
                loader.set_epoch(epoch)
            for sample in loader:
                fields = {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}
                out.write(json.dumps({"key": sample["__key__"], "url": sample["__url__"], "fields": fields}) + "\n")
                n += 1
                if args.sleep:
                    time.sleep(args.sleep)
                if args.stop_after is not None and n >= args.stop_after:
                    break
            if args.stop_after is not None and n >= args.stop_after:
                break
        out.write(json.dumps({"state": loader.state_dict()}) + "\n")
    if args.linger_until:
        deadline = time.monotonic() + args.timeout
        while not os.path.exists(args.linger_until):
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
