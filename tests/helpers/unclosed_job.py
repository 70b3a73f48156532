"""Readers dropped without ``close()`` and collected by the cycle collector, in a process of
its own (a hang must not take the pytest process with it):

    python -m tests.helpers.unclosed_job dataset|fork|loader|unstarted INDEX_JSON CACHE_DIR SECONDS

``dataset``: three ``ShardListDataset``s, each read once, then dropped and collected (as code
written for wids, which needs no close()). ``fork``: a dataset read in this process and
in a forked child, which drops its copy of the parent's session and its own; the parent reads
on. ``loader``: two ``CachedMultiLoader`` epochs left after their first sample, the
iterator held in a reference cycle. ``unstarted``: an ``iter(loader)`` dropped before its first
sample (its generator's ``finally`` never runs), then a whole epoch of the same loader; then a
loader and its iterator dropped before a sample: how many report threads are left after each. Prints a line per step; after SECONDS, faulthandler
prints every thread's stack and the process exits with status 1.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading
import time
from typing import Any

from wdscache import CachedMultiLoader, ShardListDataset


def _dataset(index: str, cache: str) -> None:
    for k in range(3):
        ds = ShardListDataset(index, cache_dir=cache, transformations=[], timeout=20)
        print(k, ds[k]["__key__"], flush=True)
        del ds
        gc.collect()
        print("collected", flush=True)


def _fork(index: str, cache: str, seconds: float) -> None:
    ds = ShardListDataset(index, cache_dir=cache, transformations=[], timeout=20)
    print("parent", ds[0]["__key__"], flush=True)
    pid = os.fork()
    if pid == 0:  # the parent's session dropped here must leave the parent's sockets alone
        status = 1
        try:
            print("child", ds[7]["__key__"], flush=True)
            del ds
            gc.collect()
            status = 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + seconds
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            raise SystemExit("the forked child did not end")
        time.sleep(0.01)
    if os.waitstatus_to_exitcode(done[1]) != 0:
        raise SystemExit("the forked child failed")
    print("parent", ds[1]["__key__"], flush=True)
    del ds
    gc.collect()
    print("collected", flush=True)


class _Holder:
    """A training loop's object that keeps its iterator, in a cycle with itself."""

    def __init__(self, it: Any) -> None:
        self.it, self.me = it, self


def _loader(cache: str) -> None:
    for k in range(2):
        loader = CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20)
        holder = _Holder(iter(loader))
        print(k, next(holder.it)["__key__"], flush=True)
        del loader, holder
        gc.collect()
        print("collected", flush=True)


def _unstarted(cache: str) -> None:
    loader = CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20)
    iter(loader)  # dropped at once: its stream is the loader's current one until the next iter()
    print("samples", sum(1 for _ in loader), flush=True)
    print("reporters", _reporters_left(), flush=True)
    loader.close()

    def dropped() -> None:  # a loader and its iterator, both dropped before a sample
        iter(CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20))

    dropped()
    print("reporters", _reporters_left(), flush=True)


def _reporters_left() -> int:
    """The report threads still running once the garbage is collected (a reporter sees its stream
    gone at its next report, a second at most). Collected again while we wait, as the interpreter
    would: a reporter still connecting holds its loader (and so its stream) until it has connected."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _reporters():
        gc.collect()
        time.sleep(0.05)
    return len(_reporters())


def _reporters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wdscache-report"]


def main(mode: str, index: str, cache: str, seconds: str) -> None:
    faulthandler.dump_traceback_later(float(seconds), exit=True)
    if mode == "dataset":
        _dataset(index, cache)
    elif mode == "fork":
        _fork(index, cache, float(seconds))
    elif mode == "unstarted":
        _unstarted(cache)
    else:
        _loader(cache)
    print("done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
