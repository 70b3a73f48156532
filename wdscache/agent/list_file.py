"""The agent's URL list file (``--urls``): read at start, watched, read again when it changes.

Guarantees:

- A list that cannot be read, or holds no URL, stops the start before anything
  on disk changes; a bad edit later keeps the current list (and says why).
- Any event in the file's folder counts as a possible change (Kubernetes updates a
  mounted ConfigMap by swapping a ``..data`` symlink, never touching the file's
  name); the file is read again only if its stat (through symlinks) changed, and
  parsed again only if its bytes did (their SHA-256 differs).
- The watchdog thread only sets a flag; the main loop sees it and has the file read in another
  thread, and takes the new list once it is read: while a long list is parsed (a million lines
  take a second or two), or a read hangs (a stalled network file system), the agent goes on
  serving on the list it has. That thread also works out what the edit added and removed, and
  the new list's lookup table and id (:class:`ListChange`), which for a rewrite of a million
  lines take as long again: the loop takes the change in milliseconds.
- What a parse freed goes back to the kernel after it (glibc's malloc_trim).
- A change is logged as one record (event ``list_changed``): how many URLs were added and
  removed, and the first :data:`LIST_SAMPLE` of each, redacted as every log record is.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from ..shared.config import AgentConfig
from ..shared.errors import ConfigError
from ..shared.logs import event, get_logger
from ..shared.malloc import release_freed
from ..shared.s3 import Listing
from ..shared.urls import UrlList, diff_urls, list_id, list_of_bytes, read_list_bytes

log = get_logger(__name__)

SETTLE = 0.1  # seconds editors get to finish writing a file in several steps
LIST_SAMPLE = 5  # URLs added, and removed, that a list change's log record names


@dataclass(frozen=True)
class ListChange:
    """An edit of the list file, as the reading thread found it: the new list (its lookup table
    and id made) and the URLs only it holds (``added``) and only the list before it held (``removed``),
    each in list order."""

    urls: UrlList
    added: list[str]
    removed: list[str]


class ListFile:
    """The list file of ``config``; :meth:`watch` starts watching it, :meth:`stop` ends that."""

    def __init__(self, config: AgentConfig) -> None:
        self._path, self._allow_pipe = config.urls, config.allow_pipe
        self._lister = Listing(endpoint_url=config.s3_endpoint_url, fetching=True)  # s3:// prefixes and globs
        self._signature: tuple[int, ...] | None = None
        self._digest: bytes | None = None  # of the bytes last parsed, if they name no prefix or glob
        self._touched = threading.Event()  # set by the watchdog thread
        self._observer: Any = None
        self._reading: Future[ListChange | None] | None = None  # the file's read in another thread, if one runs
        self._listed: UrlList | None = None  # the list the agent serves: read at start, or the last change taken

    def read(self) -> UrlList:
        """Read the list now (raises :class:`ConfigError` for a list that is empty or wrong): the
        list the agent starts with."""
        self._listed = self._parse()
        return self._listed

    def _parse(self) -> UrlList:
        self._signature = _stat_signature(self._path)
        data = read_list_bytes(str(self._path))
        digest = hashlib.sha256(data).digest()
        listed = self._lister.listed
        try:
            urls = list_of_bytes(data, path=str(self._path), allow_pipe=self._allow_pipe, lister=self._lister)
        finally:
            del data
            release_freed()  # the parse's transients: else each edit of a long list leaves more RSS
        if not len(urls):
            raise ConfigError(f"URL list {self._path} holds no URL")
        if urls.duplicates:
            log.warning("%s: ignored %d duplicate URL(s)", self._path, urls.duplicates)
        # A list naming an s3:// prefix or glob is read again whenever the file is touched, even
        # alike: touching it is how an operator says the prefix's objects changed.
        self._digest = digest if self._lister.listed == listed else None
        return urls

    def changed(self) -> ListChange | None:
        """The list as it is now and how it changed, if the file changed since it was last read;
        else None. The file is read in another thread, so the caller goes on meanwhile: a later
        call, the first after the read ended, returns the change (or raises what the read raised)."""
        if self._reading is not None:
            if not self._reading.done():
                return None
            done, self._reading = self._reading, None
            change = done.result()
            if change is not None:  # taken: the next edit is told against it
                self._listed = change.urls
            return change
        if not self._touched.is_set():
            return None
        self._touched.clear()
        if _stat_signature(self._path) == self._signature:
            return None
        reading: Future[ListChange | None] = Future()
        self._reading = reading

        def read() -> None:
            try:
                reading.set_result(self._read_edited())
            except Exception as exc:  # raised by changed(), in the caller's thread
                reading.set_exception(exc)

        # A daemon: a read that hangs must not keep the stopped agent from exiting.
        threading.Thread(target=read, name="list-read", daemon=True).start()
        return None

    def _read_edited(self) -> ListChange | None:
        """The edited file's list and what changed; None if its bytes are those last parsed, or
        wrong (logged)."""
        time.sleep(SETTLE)
        signature, digest = _stat_signature(self._path), _digest(self._path)
        if digest is not None and digest == self._digest:
            self._signature = signature  # touched, or written again alike: nothing to parse
            return None  # (a change after this stat shows in the next one)
        before = self._listed  # (set by the caller's thread only, and not while this runs)
        try:
            urls = self._parse()
        except ConfigError as exc:
            log.error("keeping the current URL list: %s", exc)
            return None
        assert before is not None  # (read() made it before the file was watched)
        added, removed = diff_urls(before, urls)
        urls.urls.make_lookups()
        list_id(urls.urls)  # (kept with them: the readers name the list by it)
        return ListChange(urls, added, removed)

    def log_change(self, added: Sequence[str], removed: Sequence[str], shards: int) -> None:
        """Log that the list now holds ``shards`` URLs, ``added`` and ``removed`` (one record)."""
        event(
            log,
            "list_changed",
            "URL list changed: %d added, %d removed (%d shards now)%s%s",
            len(added),
            len(removed),
            shards,
            _sample("added", added),
            _sample("removed", removed),
            path=str(self._path),
            added=len(added),
            removed=len(removed),
            shards=shards,
            added_urls=list(added[:LIST_SAMPLE]),
            removed_urls=list(removed[:LIST_SAMPLE]),
        )

    def watch(self) -> None:
        touched = self._touched

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                touched.set()

        self._observer = Observer()
        self._observer.schedule(Handler(), os.path.dirname(os.path.abspath(self._path)), recursive=False)
        self._observer.daemon = True
        self._observer.start()

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()

    def join(self, timeout: float) -> None:
        if self._observer is not None:
            self._observer.join(timeout)


def _sample(what: str, urls: Sequence[str]) -> str:
    """``; what: `` the first :data:`LIST_SAMPLE` of ``urls`` and how many more, for a log line."""
    if not urls:
        return ""
    more = f" and {len(urls) - LIST_SAMPLE} more" if len(urls) > LIST_SAMPLE else ""
    return f"; {what}: {', '.join(urls[:LIST_SAMPLE])}{more}"


def _digest(path: Path) -> bytes | None:
    """The SHA-256 of the file's bytes (None: it cannot be read; reading it again says why)."""
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return digest.digest()
    except OSError:
        return None


def _stat_signature(path: Path) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)  # follows symlinks, so a swapped ConfigMap link shows
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
