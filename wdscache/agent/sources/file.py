"""Local files (``file:`` URLs). A file's version is its size and mtime; a resume of
another version, or past the file's end, is answered from byte 0 (as HTTP's ``If-Range``).
A file that changes while it is copied (its size, mtime or ctime) is :class:`Replaced`: the
download starts over from byte 0, after a backoff (its writer may not be done)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ...shared.errors import FetchError
from ...shared.urls import file_path
from ..shard_download import Cancelled, Fetched, Gone, Unknown, short
from ..validators import Version
from .base import CHUNK, Replaced, Source, SourceResponse

# A file system stamps a change with its clock's current tick, so a write within the tick of the
# change before it leaves the file's times as they were. Linux's ticks are a few milliseconds
# (the margin also covers a network file system's clock a little off the agent's); a file
# system that keeps whole seconds (FAT keeps two) shows it in the times it gives.
FINE_TICK_NS = 100_000_000
COARSE_TICK_NS = 2_000_000_000
CHECK_EVERY = 4 << 20  # bytes read between two looks at the file's stat


class FileSource(Source):
    describes = True

    def probe(self, url: str) -> Fetched | Gone | Unknown:
        path = _path(url)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            # Gone from a folder that holds others; a folder missing or empty may be a file
            # system not mounted yet: that is no answer about the file.
            folder = os.path.dirname(path)
            if _holds_others(folder):
                return Gone("no such file")
            return Unknown(f"no such file, and its folder {folder} is missing or empty (not mounted yet?)")
        except OSError as exc:
            return Unknown(short(exc))
        return Fetched(st.st_size, _tag(st))

    @contextmanager
    def open(
        self, url: str, start: int, end: int | None, held: str | None, cancel: threading.Event | None = None
    ) -> Iterator[SourceResponse]:
        src = _path(url)
        try:
            f = open(src, "rb")  # noqa: SIM115 (closed below, after the body is read)
        except FileNotFoundError:
            raise FetchError(url, f"no such file: {src}", permanent=True) from None
        except PermissionError:
            raise FetchError(url, f"permission denied: {src}", permanent=True) from None
        except IsADirectoryError:
            raise FetchError(url, f"a folder, not a shard file: {src}", permanent=True) from None
        except NotADirectoryError:
            raise FetchError(url, f"no such file: {src} (a part of its path is a file)", permanent=True) from None
        with f:
            st = _settled(url, f, os.fstat(f.fileno()), cancel)
            tag = _tag(st)
            ranged = start <= st.st_size and (not start or held == tag)
            start = start if ranged else 0
            f.seek(start)
            yield SourceResponse(_chunks(f, start, st), start, ranged, st.st_size, Version(tag=tag))


def _settled(url: str, f: BinaryIO, st: os.stat_result, cancel: threading.Event | None) -> os.stat_result:
    """``st``, the open file's stat, once its last change is a tick of the file system's clock
    old: from then on every write to it shows in its times. Replaced if it changes meanwhile."""
    changed = max(st.st_mtime_ns, st.st_ctime_ns)
    tick = COARSE_TICK_NS if changed % 1_000_000_000 == 0 else FINE_TICK_NS
    wait_ns = changed + tick - time.time_ns()
    if wait_ns <= 0:
        return st
    # At most a tick: a change stamped further ahead comes from a clock ahead of ours, which no wait here settles.
    seconds = min(wait_ns, tick) / 1e9
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise Cancelled(url)
    _check_unchanged(f, st, None)
    return st


def _chunks(f: BinaryIO, start: int, opened: os.stat_result) -> Iterator[bytes]:
    """The file's bytes from ``start`` to the size it had when opened. Its stat is taken again
    after each run of reads (:data:`CHECK_EVERY` bytes), before that run's bytes are given: a
    write() changes the file's times before its bytes land, so the bytes given were all of the
    version opened (:func:`_settled` makes even a write within the tick of the file's last change
    show). A stat a run, not a read: on a network file system each may ask its server."""
    at, total = start, opened.st_size
    while at < total:
        run: list[bytes] = []
        end = min(total, at + CHECK_EVERY)
        got = at
        while got < end and (chunk := f.read(min(CHUNK, end - got))):
            run.append(chunk)
            got += len(chunk)
        _check_unchanged(f, opened, at)
        if not run:  # shorter, its stat the same: a network file system's stale attributes
            raise Replaced(f"{f.name} ended at byte {at} of {total} while it was copied", backoff=True)
        at = got
        yield from run


def _check_unchanged(f: BinaryIO, opened: os.stat_result, at: int | None) -> None:
    """Replaced if the open file's stat now differs from ``opened``'s (``at``: the bytes copied
    so far; None: before the copy began)."""
    now = os.fstat(f.fileno())
    if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) == (opened.st_size, opened.st_mtime_ns, opened.st_ctime_ns):
        return
    moved = [f"size {opened.st_size} -> {now.st_size}"] if now.st_size != opened.st_size else []
    moved += [
        name
        for name, old, new in (
            ("mtime", opened.st_mtime_ns, now.st_mtime_ns),
            ("ctime", opened.st_ctime_ns, now.st_ctime_ns),
        )
        if old != new
    ]
    if moved:
        when = "before it was copied" if at is None else f"while it was copied (at byte {at} of {opened.st_size})"
        raise Replaced(f"{f.name} changed {when} ({', '.join(moved)}); its writer may not be done", backoff=True)


def _path(url: str) -> Path:
    return Path(file_path(url))


def _tag(st: os.stat_result) -> str:
    return f"{st.st_size}-{st.st_mtime_ns}"


def _holds_others(folder: str) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError:
        return False
