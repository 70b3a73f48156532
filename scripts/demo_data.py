"""Demo helpers: make a small synthetic WebDataset and serve it on loopback.

    python scripts/demo_data.py make DIR --shards 16 --samples 64 --payload 30000
    python scripts/demo_data.py serve DIR --port-file FILE [--rate BYTES_PER_S]

Uses the shard maker and loopback server the test suite uses too (scripts/shard_maker.py,
scripts/shard_server.py).
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from shard_maker import make_dataset  # siblings: this folder is first on sys.path
from shard_server import ShardServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write synthetic shards")
    mk.add_argument("root", type=Path)
    mk.add_argument("--shards", type=int, default=16)
    mk.add_argument("--samples", type=int, default=64)
    mk.add_argument("--payload", type=int, default=30_000)
    sv = sub.add_parser("serve", help="serve a folder over HTTP on 127.0.0.1 until SIGTERM")
    sv.add_argument("root", type=Path)
    sv.add_argument("--port-file", type=Path, required=True)
    sv.add_argument("--rate", type=float, default=None, help="per-connection cap, bytes/s")
    sv.add_argument("--ttfb", type=float, default=0.0)
    args = ap.parse_args()
    if args.cmd == "make":
        paths = make_dataset(args.root, args.shards, args.samples, payload=args.payload)
        print(f"wrote {len(paths)} shards to {args.root}")
        return
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with ShardServer(args.root, rate=args.rate, ttfb=args.ttfb) as server:
        args.port_file.write_text(str(server.port))
        while not stop.wait(1.0):
            pass


if __name__ == "__main__":
    main()
