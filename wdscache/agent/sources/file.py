"""Local files (``file:`` URLs). A file's version is its size and mtime; a resume of
another version, or past the file's end, is answered from byte 0 (as HTTP's ``If-Range``).
A file that changes size while it is copied fails the download."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ...shared.errors import FetchError
from ...shared.urls import file_path
from ..shard_download import Fetched, Gone, Unknown, short
from ..validators import Version
from .base import CHUNK, Source, SourceResponse


class FileSource(Source):
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
            st = os.fstat(f.fileno())
            tag = _tag(st)
            ranged = start <= st.st_size and (not start or held == tag)
            start = start if ranged else 0
            f.seek(start)
            yield SourceResponse(_chunks(url, f, start, st.st_size), start, ranged, st.st_size, Version(tag=tag))


def _chunks(url: str, f: BinaryIO, start: int, total: int) -> Iterator[bytes]:
    at = start
    for chunk in iter(lambda: f.read(CHUNK), b""):
        at += len(chunk)
        yield chunk
    if at != total:
        raise FetchError(url, f"file changed while copying ({at} of {total} bytes)")


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
