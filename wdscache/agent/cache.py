"""The shard cache: index, budget, pins and eviction. Owned by the agent's main loop.

Guarantees (the agent's main thread is the only caller; nothing here is thread-safe):

- Budget: bytes of cached shards plus bytes reserved for downloads in flight plus
  bytes of kept partial files never exceed ``limit``; a download reserves its full
  size before writing, and waits (is not granted) while the budget cannot hold it.
  A partial file in flight is counted through its reservation; one kept for a
  resume (:meth:`abandon` with ``keep_partial``, or found at start) by its size,
  and kept partials are the first thing removed when a reservation needs space.
  A reservation of unknown size (``pipe:``) grows in steps of at most a quarter
  of what the budget can spare (at least the bytes at hand). The index database itself is not counted.
- Kept partials: only with a validator (ETag, Last-Modified or file mtime) in their
  DOWNLOADING record; removed when space is needed, when their shard leaves the
  list (:meth:`drop_partial`), or at the next start if not resumable.
- Free-space margin: a reservation is granted only if the file system keeps
  ``min_free`` bytes (plus 1 MiB for the index) free after every in-flight
  download completes.
- Never evicted: a pinned shard (being read). Eviction prefers the least recently
  *read* shard outside every reader's window (shards a prefetch holds last); a demanded
  download may also take window shards, farthest-ahead first, but never pinned ones.
  A download only prefetches want never evicts a shard a prefetch holds.
- Every change of a shard's state made here (cached, failed, removed) is told to the
  :class:`ShardWatcher`, if one is set, as it happens.
- Index before files: a shard is marked EVICTING in the index before its file is
  deleted, and DOWNLOADING before its partial file exists; :meth:`recover`
  finishes or undoes both after a crash, and forgets records whose files are gone.
- File names of earlier versions (a URL's query in them, :func:`~wdscache.shared.layout.former_shard_name`)
  are renamed to today's when the cache opens, before anything reads them: each rename is atomic,
  so after a crash every file is under one of its two names and the next open renames the rest;
  the index, keyed by URL, is not changed.
- A cached file is a plain tar (a gzip'd shard is cached decompressed, and counted at
  that size): a gzip'd file found under ``shards/`` is forgotten and fetched again.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
from collections.abc import Collection, Container, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from ..shared.config import format_size
from ..shared.index import Index, IndexWriteError, ShardRecord, ShardState
from ..shared.layout import CacheLayout
from ..shared.logs import event, get_logger, iso_time
from ..shared.tarwalk import GZIP_MAGIC, file_problem
from .parts import owner_name, remove_side_files, side_bytes
from .shard_download import Download

log = get_logger(__name__)

INDEX_HEADROOM = 1 << 20  # the index shares the file system; a full disk must not stop it


class ShardWatcher(Protocol):
    """Told of each change of a shard's state the cache makes (main loop)."""

    def cached(self, url: str, size: int) -> None:
        """``url`` is cached now, ``size`` bytes."""

    def failed(self, url: str, error: str) -> None:
        """``url`` failed (it is not cached, and not fetched again unless asked)."""

    def gone(self, url: str, why: str) -> None:
        """The cached ``url`` was removed (``why``: "evicted to ...")."""


class ShardCache:
    def __init__(self, layout: CacheLayout, *, limit: int, min_free: int) -> None:
        self.layout = layout
        self.limit, self.min_free = limit, min_free
        for folder in (layout.shards_dir, layout.partial_dir):
            folder.mkdir(mode=0o700, exist_ok=True)
        self.index, self.rebuilt = _open_index(layout)
        for rec in self.index:
            _rename_former(layout, rec.url)
        self.inflight: dict[str, Download] = {}  # url -> download holding a reservation
        self.pins: dict[str, int] = {}  # url -> number of open reads
        # Why the last refused try_reserve was refused: (what ran short, a sentence for users).
        self.refusal: tuple[str, str] | None = None
        self.kept: dict[str, int] = {}  # url -> bytes of its partial file kept for a resume, not in flight
        self.watcher: ShardWatcher | None = None

    # -- queries ----------------------------------------------------------

    @property
    def margin(self) -> int:
        """Free space kept on the file system: --min-free, plus room for the index to grow."""
        return self.min_free + INDEX_HEADROOM

    @property
    def used(self) -> int:
        return self.index.summary.bytes_used

    @property
    def reserved(self) -> int:
        return sum(d.budget.reserved for d in self.inflight.values())

    def is_cached(self, url: str) -> bool:
        rec = self.index.get(url)
        return rec is not None and rec.state is ShardState.CACHED

    def path(self, url: str) -> Path:
        return self.layout.shard_path(url)

    def fs_free(self) -> int:
        st = os.statvfs(self.layout.root)
        return st.f_bavail * st.f_frsize

    # -- start-up ---------------------------------------------------------

    def recover(self, keep_partial: Container[str] = ()) -> dict[str, int]:
        """Make index and disk agree after any kind of stop; returns what was done.

        Complete shards are kept; records whose file is gone are forgotten; a shard
        renamed into place just before a crash is adopted; partial files are kept
        for resuming only for ``keep_partial`` URLs whose record has a validator
        (they count against the budget from now on); half-done evictions are finished.
        """
        keep = keep_partial
        resumable: dict[str, str] = {}  # partial file name -> url
        done = {"kept": 0, "forgotten": 0, "adopted": 0, "partials_removed": 0, "evictions_finished": 0}
        for rec in self.index:
            path = self.layout.shard_path(rec.url)
            if rec.state is ShardState.CACHED:
                size = _size_or_none(path)
                if size == rec.size and not _gzipped(path):
                    done["kept"] += 1
                else:
                    log.warning(
                        "forgetting %s: its cache file is %s",
                        rec.url,
                        "gzip'd (shards are cached decompressed)"
                        if size == rec.size
                        else "missing or has the wrong size",
                    )
                    _unlink(path)
                    self.index.delete(rec.url)
                    done["forgotten"] += 1
            elif rec.state is ShardState.EVICTING:
                _unlink(path)
                self.index.delete(rec.url)
                done["evictions_finished"] += 1
            elif rec.state is ShardState.DOWNLOADING:
                size = _size_or_none(path)
                if size is not None and (rec.size in (0, size)) and _head_ok(path):
                    # Renamed into place, then killed before the index said so.
                    self._set_cached(rec.url, size, rec.etag)
                    done["adopted"] += 1
                else:
                    _unlink(path)
                    partial = self.layout.partial_path(rec.url)
                    if rec.url in keep and rec.etag and _size_or_none(partial):
                        resumable[partial.name] = rec.url
                    else:
                        self.index.delete(rec.url)
            elif rec.state is ShardState.FAILED:
                # Failures are retried by a new agent: the server or the list may have changed.
                self.index.delete(rec.url)
        # Partial files: resume those we were told to keep, remove every other one.
        # A parted download's side files go with their partial file (wdscache.agent.parts).
        for entry in os.scandir(self.layout.partial_dir):
            url = resumable.get(owner_name(entry.name))
            if url is None:
                os.unlink(entry.path)
                done["partials_removed"] += 1
            else:
                self.kept[url] = self.kept.get(url, 0) + entry.stat().st_size
        done["partials_kept"] = len(self.kept)
        return done

    def adopt(self, urls: Iterable[str]) -> int:
        """Take complete shard files of ``urls`` that the index does not know (a rebuilt index)."""
        adopted = 0
        for url in urls:
            if url in self.index.records:
                continue
            _rename_former(self.layout, url)
            path = self.layout.shard_path(url)
            size = _size_or_none(path)
            if size is not None and _head_ok(path):
                self._set_cached(url, size, None)
                adopted += 1
        return adopted

    # -- downloads --------------------------------------------------------

    def begin(self, d: Download) -> None:
        """Record that ``d`` starts (index first, then the partial file may be created)."""
        old = self.index.get(d.url)
        self.index.put(ShardRecord(d.url, ShardState.DOWNLOADING, size=old.size if old else 0, etag=d.progress.etag))
        self.kept.pop(d.url, None)  # counted through the reservation from now on
        self.inflight[d.url] = d

    def set_validator(self, url: str, etag: str | None) -> None:
        """Record the version a download is fetching, so that a restart resumes it only if unchanged."""
        rec = self.index.get(url)
        if rec is not None and rec.state is ShardState.DOWNLOADING and rec.etag != etag:
            self.index.put(dataclasses.replace(rec, etag=etag))

    def finish(
        self, d: Download, size: int, etag: str | None, *, stored: int | None = None, last_modified: str | None = None
    ) -> None:
        """``d`` was published under shards/: it is cached now (``size`` at the source,
        ``stored`` in the cache when not the same; its validators ``etag`` and ``last_modified``)."""
        self._set_cached(
            d.url,
            size if stored is None else stored,
            etag,
            source_size=None if stored is None else size,
            last_modified=last_modified,
        )
        self.inflight.pop(d.url, None)
        if self.watcher is not None:
            self.watcher.cached(d.url, size if stored is None else stored)

    def fail(self, d: Download, error: str) -> None:
        self.inflight.pop(d.url, None)
        self.kept.pop(d.url, None)
        _unlink(d.partial)
        remove_side_files(d.partial)
        self.index.put(ShardRecord(d.url, ShardState.FAILED, error=error))
        if self.watcher is not None:
            self.watcher.failed(d.url, error)

    def fail_cached(self, url: str, error: str) -> None:
        """A cached shard is unusable (its copy is damaged, as is its source's): FAILED first,
        then its file goes (a reader holding it open keeps what it has)."""
        self.index.put(ShardRecord(url, ShardState.FAILED, error=error))
        _unlink(self.layout.shard_path(url))
        if self.watcher is not None:
            self.watcher.failed(url, error)

    def abandon(self, d: Download, *, keep_partial: bool = False) -> None:
        """``d`` stopped unfinished; its shard goes back to not cached.

        With ``keep_partial`` and a validator, its partial file stays for a Range resume
        (the DOWNLOADING record keeps the validator) and counts against the budget.
        """
        self.inflight.pop(d.url, None)
        size = _size_or_none(d.partial)
        if keep_partial and d.progress.etag and size:
            self.set_validator(d.url, d.progress.etag)
            self.kept[d.url] = size + side_bytes(d.partial)
            return
        self.drop_partial(d.url)

    def drop_partial(self, url: str) -> None:
        """Remove the partial file kept for ``url`` (and its record), if any."""
        self.kept.pop(url, None)
        _unlink(self.layout.partial_path(url))
        remove_side_files(self.layout.partial_path(url))
        rec = self.index.get(url)
        if rec is not None and rec.state is ShardState.DOWNLOADING:
            self.index.delete(url)

    def _drop_kept(self, nbytes: int, spare: str | None = None) -> int:
        """Remove kept partials (oldest first) until ``nbytes`` are freed; returns bytes freed."""
        freed = 0
        for url in list(self.kept):
            if freed >= nbytes:
                break
            if url != spare:
                freed += self.kept[url]
                log.info("removing the partial download of %s to make room", url)
                self.drop_partial(url)
        return freed

    def forget_failure(self, url: str) -> None:
        rec = self.index.get(url)
        if rec is not None and rec.state is ShardState.FAILED:
            self.index.delete(url)

    def _set_cached(
        self, url: str, size: int, etag: str | None, *, source_size: int | None = None, last_modified: str | None = None
    ) -> None:
        old = self.index.get(url)
        self.index.put(
            ShardRecord(
                url,
                ShardState.CACHED,
                size=size,
                etag=etag,
                last_modified=last_modified,
                source_size=source_size,
                cached_at=time.time(),
                last_read=old.last_read if old else 0.0,
                reads=old.reads if old else 0,
            )
        )

    # -- budget -----------------------------------------------------------

    def try_reserve(
        self,
        d: Download,
        total: int,
        *,
        wanted: Sequence[str],
        prefetched: Collection[str] = (),
        spare_prefetched: bool = False,
    ) -> bool:
        """Reserve ``total`` bytes for ``d`` if the budget can hold them, evicting if needed.

        ``wanted`` lists the shards in readers' windows, most urgent first; they are
        evicted only for a demanded download, and from the far end. ``prefetched``: the
        cached shards prefetches hold, evicted last, and never with ``spare_prefetched``
        (``d`` is only a prefetch's). When refused, :attr:`refusal` says why (the budget,
        or the file system's free space).
        """
        if d.budget.needed:
            # A growing reservation (a body of unknown size, a gzip'd shard being decompressed):
            # ``total`` is a wish; grant what the budget can spare, at least ``needed``.
            if d.budget.needed > self.limit:
                raise OverflowError(
                    f"the shard reached {format_size(d.budget.needed)} ({d.budget.needed} bytes) and is still growing, "
                    f"more than the whole cache (--cache-size {format_size(self.limit)})"
                )
            spare = min(
                self.limit - self.used - self.reserved - self.kept_bytes,
                self.fs_free() - self.margin - self._unwritten(),
            )
            # A quarter of what is spare at most, so that downloads beside it find room too.
            total = max(d.budget.needed, min(total, d.budget.reserved + spare // 4))
        extra = total - d.budget.reserved
        if extra <= 0:
            return True
        if total > self.limit:
            raise OverflowError(
                f"shard of {format_size(total)} is larger than the whole cache (--cache-size {format_size(self.limit)})"
            )
        need, margin_need, free = self._shortfall(extra)
        if max(need, margin_need) > 0 and self._drop_kept(max(need, margin_need), spare=d.url):
            need, margin_need, free = self._shortfall(extra)
        shortfall = max(need, margin_need)
        if shortfall > 0 and not self.evict(
            shortfall,
            wanted=wanted,
            allow_window=d.demanded,
            spare=d.url,
            prefetched=prefetched,
            spare_prefetched=spare_prefetched,
            why="evicted to make room for a shard readers need",
        ):
            self.refusal = self._why_refused(d, extra, need >= margin_need, free, wanted)
            return False
        d.budget.reserved = total
        return True

    def _why_refused(
        self,
        d: Download,
        extra: int,
        budget: bool,
        free: int,
        wanted: Sequence[str],
    ) -> tuple[str, str]:
        """(kind, sentence): why ``extra`` more bytes for ``d`` cannot be had by evicting."""
        window = set(wanted)
        pinned = in_window = evictable = 0
        for r in self.index.records.values():
            if r.state is not ShardState.CACHED or r.url == d.url:
                continue
            if self.pins.get(r.url):
                pinned += 1
            elif r.url in window and not d.demanded:
                in_window += 1
            else:
                evictable += r.size
        held = f"{pinned} other shard(s) pinned by readers"
        if not d.demanded:
            held += f", {in_window} in a reader's window"
        held += f", {format_size(evictable)} evictable"
        if budget:
            return "budget", (
                f"the budget (--cache-size {format_size(self.limit)}) holds {format_size(self.used)} cached and "
                f"{format_size(self.reserved + self.kept_bytes)} reserved or kept for resuming, and "
                f"{format_size(extra)} more cannot be freed ({held})"
            )
        return "min-free", (
            f"the file system keeps --min-free {format_size(self.min_free)} (+{format_size(INDEX_HEADROOM)} for "
            f"the index) free and has {format_size(free)} free ({format_size(self._unwritten())} of it promised "
            f"to downloads in flight); {format_size(extra)} more cannot be freed ({held})"
        )

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())

    def _shortfall(self, extra: int) -> tuple[int, int, int]:
        """Bytes to free before ``extra`` more may be reserved: (for the budget, for the
        free-space margin, the file system's free bytes now)."""
        need = self.used + self.reserved + self.kept_bytes + extra - self.limit
        free = self.fs_free()
        return need, self.margin + self._unwritten() + extra - free, free

    def _unwritten(self) -> int:
        return sum(max(0, d.budget.reserved - d.progress.written - d.progress.expanded) for d in self.inflight.values())

    def evict(
        self,
        nbytes: int,
        *,
        wanted: Sequence[str],
        allow_window: bool,
        why: str,
        spare: str | None = None,
        prefetched: Collection[str] = (),
        spare_prefetched: bool = False,
    ) -> bool:
        """Free ``nbytes`` of cached shards if possible (all or nothing); True on success.

        Outside the windows of ``wanted``, the least recently read go first, and shards
        ``prefetched`` (held by a prefetch) after every other, or never with ``spare_prefetched``.
        ``why`` is told to the watcher for each shard removed."""
        window = set(wanted)
        candidates = [
            r
            for r in self.index.records.values()
            if r.state is ShardState.CACHED
            and not self.pins.get(r.url)
            and r.url != spare
            and not (spare_prefetched and r.url in prefetched)
        ]
        outside = sorted(
            (r for r in candidates if r.url not in window), key=lambda r: (r.url in prefetched, r.last_read)
        )
        chosen: list[ShardRecord] = []
        freed = 0
        for rec in outside:
            if freed >= nbytes:
                break
            chosen.append(rec)
            freed += rec.size
        if freed < nbytes and allow_window:
            rank = {u: i for i, u in enumerate(wanted)}
            inside = sorted((r for r in candidates if r.url in window), key=lambda r: -rank[r.url])
            for rec in inside:
                if freed >= nbytes:
                    break
                chosen.append(rec)
                freed += rec.size
        if freed < nbytes:
            return False
        for rec in chosen:
            self.remove(rec.url, why)
        return True

    def remove(self, url: str, why: str) -> None:
        """Evict one shard (``why``, for the watcher): mark it EVICTING, delete the file, drop the record."""
        rec = self.index.get(url)
        if rec is None:
            return
        event(
            log,
            "evicted",
            "evicted %s (%s, last read %s)",
            url,
            format_size(rec.size),
            iso_time(rec.last_read) or "never",
            url=url,
            bytes=rec.size,
            last_read=iso_time(rec.last_read),
        )
        self.index.put(ShardRecord(url, ShardState.EVICTING, size=rec.size))
        _unlink(self.layout.shard_path(url))
        self.index.delete(url)
        if self.watcher is not None and rec.state is ShardState.CACHED:
            self.watcher.gone(url, why)

    def free_files(self, nbytes: int, wanted: Sequence[str]) -> int:
        """Delete files of evictable shards even if the index cannot be written (it is full).

        The one place files go before the index: a record left behind points at a
        missing file, which every open checks (and :meth:`recover` forgets).
        """
        window = set(wanted)
        freed = 0
        for rec in sorted(self.index.records.values(), key=lambda r: r.last_read):
            if freed >= nbytes:
                break
            if rec.state is ShardState.CACHED and rec.url not in window and not self.pins.get(rec.url):
                _unlink(self.layout.shard_path(rec.url))
                freed += rec.size
                if self.watcher is not None:
                    self.watcher.gone(rec.url, "removed to free disk space for the index")
                try:
                    self.index.delete(rec.url)
                except IndexWriteError:
                    pass
        return freed

    def keep_margin(self, wanted: Sequence[str]) -> None:
        """Evict (outside windows only) if something else ate into the free-space margin."""
        short = self.margin + self._unwritten() - self.fs_free()
        if short > 0:
            short -= self._drop_kept(short)
        if short > 0:
            self.evict(short, wanted=wanted, allow_window=False, why="evicted to keep --min-free free")

    # -- reads ------------------------------------------------------------

    def pin(self, url: str) -> None:
        self.pins[url] = self.pins.get(url, 0) + 1
        self.index.touch(url, time.time())

    def unpin(self, url: str) -> None:
        n = self.pins.get(url, 0) - 1
        if n > 0:
            self.pins[url] = n
        else:
            self.pins.pop(url, None)

    def close(self) -> None:
        try:
            self.index.flush()
        except IndexWriteError as exc:
            log.warning("last counters and read times not saved: %s", exc)
        self.index.close()


def _open_index(layout: CacheLayout) -> tuple[Index, bool]:
    """Open the index; a corrupt one is moved aside and started afresh.

    Nothing is lost for good: a fresh index adopts complete shard files again as
    the agent's list names them (:meth:`ShardCache.adopt`), since their names
    derive from their URLs.
    """
    try:
        index = Index(layout.index_dir)
    except (sqlite3.DatabaseError, ValueError, TypeError, KeyError) as exc:
        aside = layout.root / f"index.corrupt-{int(time.time())}"
        log.error("the index is unreadable (%s); moved it to %s and starting a new one", exc, aside)
        os.replace(layout.index_dir, aside)
        return Index(layout.index_dir), True
    # An empty index beside shard files: it was deleted; rebuild it from the files.
    lost = not len(index) and any(True for _ in os.scandir(layout.shards_dir))
    return index, lost


def _rename_former(layout: CacheLayout, url: str) -> None:
    """Give the file of ``url`` its name of today if it has its earlier one (see the module docstring)."""
    former = layout.former_shard_path(url)
    if former is None:
        return
    current = layout.shard_path(url)
    if current.exists():
        return
    try:
        os.rename(former, current)
    except FileNotFoundError:
        return
    log.info("renamed the cache file of %s to %s (names no longer hold a URL's query)", url, current.name)


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _gzipped(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == GZIP_MAGIC
    except FileNotFoundError:
        return False


def _head_ok(path: Path) -> bool:
    """True when ``path`` starts like a plain tar (a cached shard is never gzip'd)."""
    return file_problem(path) is None and not _gzipped(path)
