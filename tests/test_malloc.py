"""wdscache.shared.malloc: freed message memory stays in the process for the next message.

Each case runs in a fresh interpreter (the settings are process-wide) and counts
the page faults of a receive-like pattern: a window of a few MB-sized buffers of
varying sizes, allocated and freed over and over.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PATTERN = """
import resource, sys
from collections import deque
if sys.argv[1] == "tuned":
    from wdscache.shared.malloc import tune_malloc
    assert tune_malloc() and tune_malloc()  # idempotent
elif sys.argv[1].startswith("loader"):  # a loader's epoch first: tune_malloc=True unless "loader-untuned"
    from wdscache import CachedMultiLoader
    flag = sys.argv[1] == "loader"
    with CachedMultiLoader(cache_dir=sys.argv[2], shuffle=False, timeout=30, tune_malloc=flag) as loader:
        assert len(list(loader)) == 4
window = deque(maxlen=8)
sizes = [(1 << 20) + (i * 337_000) % (3 << 20) for i in range(64)]
for size in sizes:  # warm up: the first use of memory always faults
    window.append(b"x" * size)
window.clear()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    for size in sizes:
        window.append(b"x" * size)
    window.clear()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, *args: str) -> int:
    # Without settings that would change the allocator or its thresholds behind our back.
    env = {
        k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k in ("LD_PRELOAD", "GLIBC_TUNABLES"))
    }
    done = subprocess.run(
        [sys.executable, "-c", PATTERN, mode, *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_tuned_malloc_reuses_freed_message_memory() -> None:
    untuned, tuned = _faults("default"), _faults("tuned")
    # 256 buffers of 1-4 MB: glibc by default maps and unmaps most of them (thousands of
    # faults); tuned, the heap keeps the freed memory and nothing faults again.
    assert untuned > 5000, f"the pattern no longer shows glibc's default behaviour ({untuned} faults)"
    assert tuned < untuned // 20, (tuned, untuned)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_the_loader_tunes_malloc_unless_told_not_to(tmp_path, dataset, start_agent) -> None:
    data = dataset(1, samples=4, payload=100)
    cache = str(tmp_path / "cache")
    start_agent(cache, data.list_file)
    # After an epoch of a loader, its process reuses freed message memory, or (told not to) faults it in again.
    untuned, tuned = _faults("loader-untuned", cache), _faults("loader", cache)
    assert untuned > 5000, f"the pattern no longer shows glibc's default behaviour ({untuned} faults)"
    assert tuned < untuned // 20, (tuned, untuned)
