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

from wdscache import CachedMultiLoader

PATTERN = """
import resource, sys
from collections import deque
if sys.argv[1] == "tuned":
    from wdscache.shared.malloc import tune_malloc
    assert tune_malloc() and tune_malloc()  # idempotent
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


def _faults(mode: str) -> int:
    # Without settings that would change the allocator or its thresholds behind our back.
    env = {
        k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k in ("LD_PRELOAD", "GLIBC_TUNABLES"))
    }
    done = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_tuned_malloc_reuses_freed_message_memory() -> None:
    untuned, tuned = _faults("default"), _faults("tuned")
    # 256 buffers of 1-4 MB: glibc by default maps and unmaps most of them (thousands of
    # faults); tuned, the heap keeps the freed memory and nothing faults again.
    assert untuned > 5000, f"the pattern no longer shows glibc's default behaviour ({untuned} faults)"
    assert tuned < untuned // 20, (tuned, untuned)


def test_the_loader_tunes_malloc_unless_told_not_to(tmp_path, dataset, start_agent, monkeypatch) -> None:
    import wdscache.training.loader

    data = dataset(1, samples=4, payload=100)
    start_agent(tmp_path / "cache", data.list_file)
    calls = []
    monkeypatch.setattr(wdscache.training.loader, "tune_malloc", lambda: calls.append(1) or True)
    for flag in (False, True):
        with CachedMultiLoader(cache_dir=tmp_path / "cache", shuffle=False, timeout=30, tune_malloc=flag) as loader:
            assert len(list(loader)) == 4
    assert calls == [1]  # only the loader with tune_malloc=True
