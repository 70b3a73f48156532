"""A loader with ``map=`` workers, reading until interrupted (see tests/test_stream_options.py).

    python -m tests.helpers.map_interrupted_job CACHE_DIR

Prints ``reading`` once both map workers have given a result (both started: past their
initializer), then reads on (slowly) until SIGINT. SIGUSR1 dumps every thread's stack to stderr.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from typing import Any

from wdscache import CachedMultiLoader

WORKERS = 2


def slow(sample: dict[str, Any]) -> int:
    time.sleep(0.05)
    return os.getpid()


def main(cache: str) -> None:
    # As at a terminal: a process started in the background by a shell without job control (a CI
    # script's `cmd &`) begins with SIGINT ignored, and Python then raises no KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    loader = CachedMultiLoader(cache_dir=cache, shuffle=False, map=slow, workers=WORKERS, timeout=30)
    pids: set[int] = set()
    for _ in range(1000):
        for pid in loader:
            if len(pids) < WORKERS:
                pids.add(pid)
                if len(pids) == WORKERS:
                    print("reading", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
