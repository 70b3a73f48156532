"""A loader with ``map=`` workers, reading until interrupted (see tests/test_stream_options.py).

    python -m tests.helpers.map_interrupted_job CACHE_DIR

Prints ``reading`` once its first sample came, then reads on (slowly) until SIGINT.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from wdscache import CachedMultiLoader


def slow(sample: dict[str, Any]) -> str:
    time.sleep(0.05)
    return str(sample["__key__"])


def main(cache: str) -> None:
    loader = CachedMultiLoader(cache_dir=cache, shuffle=False, map=slow, workers=2, timeout=30)
    for epoch in range(1000):
        for i, _ in enumerate(loader):
            if epoch == 0 and i == 0:
                print("reading", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
