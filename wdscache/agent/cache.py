"""The shard cache: index, budget, pins and eviction. Owned by the agent's main loop.

What the cache finds when it opens (a crash, an unreadable index, files of earlier
names) is made right by :mod:`wdscache.agent.recovery`.

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
  DOWNLOADING record; kept across a restart whichever list named them; removed when
  space is needed, when their shard leaves the agent's list and no reader's list names
  it (:meth:`drop_partial`), after ``UNNAMED_GRACE`` of the agent's run with no list
  naming them (:mod:`wdscache.agent.unnamed_partials`), or at the next start if not resumable.
- Free-space margin: a reservation is granted only if the file system keeps
  ``min_free`` bytes (plus 1 MiB for the index) free after every in-flight
  download completes, as the file system counts its free space at that moment: a
  shard evicted for free space whose file another process still has open (a worker
  lets go of the files it maps within its sweep, ``SWEEP_EVERY``) frees nothing yet,
  so the reservation waits for that space to come back (up to ``AWAIT_FREED``,
  evicting nothing more for it meanwhile) instead of writing into space the disk
  does not have.
- Never evicted: a pinned shard (being read). Eviction prefers the least recently
  *read* shard (read until its reader let it go) outside every reader's window (shards
  a prefetch holds last); a demanded download may also take window shards,
  farthest-ahead first, but never pinned ones.
  A download only prefetches want never evicts a shard a prefetch holds.
- Every change of a shard's state made here (cached, failed, removed) is told to the
  :class:`ShardWatcher`, if one is set, as it happens.
- Index before files: a shard is marked EVICTING in the index before its file is
  deleted, and DOWNLOADING before its partial file exists; :meth:`recover`
  (:mod:`wdscache.agent.recovery`) finishes or undoes both after a crash.
- A cached file is a plain tar (a gzip'd shard is cached decompressed, and counted at
  that size).
- The cache directory removed or replaced behind the agent's back (a cleaner of /tmp, say)
  is a :class:`~wdscache.shared.errors.NoCacheError` at the next look (:meth:`flush`, every
  few seconds, or a look at its free space), which stops the agent with a line that says so;
  so are the files the agent holds in it removed or replaced while the directory stays (its lock
  file, which another agent could then lock anew, or the index's database), at :meth:`flush`.
- A shard's sample table file (:mod:`wdscache.agent.table_files`) is counted with its shard
  (``ShardRecord.table_size``) and removed with it, or as soon as the shard's record changes
  (a new download, a failure: :meth:`ShardCache.put`); when a reservation needs space, table
  files go after kept partials and before any shard is evicted.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from ..shared.config import format_size
from ..shared.errors import NoCacheError
from ..shared.index import IndexWriteError, ShardRecord, ShardState
from ..shared.layout import INDEX_DB, CacheLayout
from ..shared.logs import event, get_logger, iso_time
from ..shared.redact import redact_urls
from . import recovery
from .churn_log import Churn, ChurnLog
from .lock import AgentLock
from .parts import remove_side_files, side_bytes
from .recovery import size_or_none
from .shard_download import Download
from .table_files import TableFiles

log = get_logger(__name__)

INDEX_HEADROOM = 1 << 20  # the index shares the file system; a full disk must not stop it
# Seconds the space of a shard evicted for free space is awaited before more is evicted for it:
# a worker lets go of a file it maps within its sweep (SWEEP_EVERY, 0.05 s) of the delete.
AWAIT_FREED = 0.5


class ShardWatcher(Protocol):
    """Told of each change of a shard's state the cache makes (main loop)."""

    def cached(self, url: str, size: int) -> None:
        """``url`` is cached now, ``size`` bytes."""

    def failed(self, url: str, error: str) -> None:
        """``url`` failed (it is not cached, and not fetched again unless asked)."""

    def gone(self, url: str, why: str) -> None:
        """The cached ``url`` was removed (``why``: "evicted to ...")."""


# What a look at the cache directory's path gets once it was removed or replaced (on NFS too).
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ESTALE)


def _identity(path: Path) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode), None when there is none."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    return (st.st_dev, st.st_ino)


class HeldFiles:
    """The cache directory and the files in it that the agent holds open (its lock file, the
    index's database), as opened: :meth:`lost` tells when a path no longer leads to them."""

    def __init__(self, layout: CacheLayout, lock: AgentLock | None) -> None:
        """Call once the index is open."""
        self.layout, self._lock = layout, lock
        self._root = _identity(layout.root)
        self._index_db = _identity(layout.index_db)

    def lost(self) -> NoCacheError | None:
        """Why the cache directory is no longer the agent's, None while it is: the directory
        removed or replaced, or (the directory staying) its lock file or the index's database no
        longer the file at its path (a cleaner of old files removed them: another agent could
        lock a new lock file there, and write a new index)."""
        root = str(self.layout.root)
        if _identity(self.layout.root) != self._root:
            return NoCacheError(cache_dir=root, removed=True)
        files = []
        if self._lock is not None and not self._lock.holds():
            files.append(self.layout.lock_path.name)
        if _identity(self.layout.index_db) != self._index_db:
            files.append(f"{self.layout.index_dir.name}/{INDEX_DB}")
        return NoCacheError(cache_dir=root, removed=True, files=files) if files else None


class ShardCache:
    def __init__(self, layout: CacheLayout, *, limit: int, min_free: int, lock: AgentLock | None = None) -> None:
        """Open the cache of ``layout``; ``lock``: the directory's lock, held by this process (an
        agent's), which :meth:`flush` finds still at its path."""
        self.layout = layout
        self.limit, self.min_free = limit, min_free
        for folder in (layout.shards_dir, layout.partial_dir, layout.tables_dir):
            recovery.clear_way(layout, folder, folder=True)
            folder.mkdir(mode=0o700, exist_ok=True)
        self.index, self.rebuilt = recovery.open_index(layout)
        self._held = HeldFiles(layout, lock)  # (see flush)
        for rec in self.index:
            recovery.rename_former(layout, rec.url)
        self.inflight: dict[str, Download] = {}  # url -> download holding a reservation
        self.pins: dict[str, int] = {}  # url -> number of open reads
        # Why the last refused try_reserve was refused: (what ran short, a sentence for users).
        self.refusal: tuple[str, str] | None = None
        self.kept: dict[str, int] = {}  # url -> bytes of its partial file kept for a resume, not in flight
        self._freeing = Freeing()
        self.tables = TableFiles(self)
        self.watcher: ShardWatcher | None = None
        self.churn = ChurnLog()  # the level of each eviction to make room, a flood when the budget thrashes

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
        try:
            st = os.statvfs(self.layout.root)
        except OSError as exc:
            if exc.errno in _GONE:
                raise NoCacheError(cache_dir=str(self.layout.root), removed=True) from None
            raise
        return st.f_bavail * st.f_frsize

    def lost(self) -> NoCacheError | None:
        """Why the cache directory is no longer the agent's (:meth:`HeldFiles.lost`), None while it is."""
        return self._held.lost()

    def flush(self) -> None:
        """Write the index's counters and read times, once the cache directory and the files the
        agent holds in it are found to be the ones opened: NoCacheError if not (:meth:`lost`)."""
        lost = self.lost()
        if lost is not None:
            raise lost
        self.index.flush()

    # -- start-up ---------------------------------------------------------

    def recover(self) -> dict[str, int]:
        """Make index and disk agree after any kind of stop (see :func:`~wdscache.agent.recovery.recover`)."""
        return recovery.recover(self)

    def adopt(self, urls: Iterable[str]) -> int:
        """Take complete shard files of ``urls`` that the index does not know (a rebuilt index)."""
        return recovery.adopt(self, urls)

    # -- downloads --------------------------------------------------------

    def begin(self, d: Download) -> None:
        """Record that ``d`` starts (index first, then the partial file may be created); what
        lies where its file goes and is none (a directory made there) is moved aside, so that it
        can be published (:func:`~wdscache.agent.recovery.clear_way`)."""
        if recovery.clear_way(self.layout, d.final.parent, folder=True):
            recovery.clear_way(self.layout, d.final)
        old = self.index.get(d.url)
        self.put(ShardRecord(d.url, ShardState.DOWNLOADING, size=old.size if old else 0, etag=d.progress.etag))
        # A partial kept for this resume is counted through the reservation from now on: held
        # from the start, not only once the shard's size is granted (which the partial is part of),
        # and written already (not space the file system has yet to give).
        kept = self.kept.pop(d.url, 0)
        d.budget.reserved = max(d.budget.reserved, kept)
        d.progress.written = max(d.progress.written, kept)
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
        self.set_cached(
            d.url,
            size if stored is None else stored,
            etag,
            source_size=None if stored is None else size,
            last_modified=last_modified,
        )
        d.partial.unlink(missing_ok=True)  # a gzip'd source's file, kept until now (publish_gunzipped)
        self.inflight.pop(d.url, None)
        self.tables.published(d.url)
        if self.watcher is not None:
            self.watcher.cached(d.url, size if stored is None else stored)

    def fail(self, d: Download, error: str) -> None:
        """``d`` failed for good, ``error`` saying why: recorded redacted, as consumers and stats show it."""
        error = redact_urls(error)
        self.inflight.pop(d.url, None)
        self.tables.forget(d.url)
        self.kept.pop(d.url, None)
        d.partial.unlink(missing_ok=True)
        remove_side_files(d.partial)
        self.put(ShardRecord(d.url, ShardState.FAILED, error=error))
        if self.watcher is not None:
            self.watcher.failed(d.url, error)

    def fail_cached(self, url: str, error: str) -> None:
        """A cached shard is unusable (its copy is damaged, as is its source's): FAILED first,
        then its file goes (a reader holding it open keeps what it has); ``error`` recorded redacted."""
        error = redact_urls(error)
        self.put(ShardRecord(url, ShardState.FAILED, error=error))
        self.layout.shard_path(url).unlink(missing_ok=True)
        if self.watcher is not None:
            self.watcher.failed(url, error)

    def abandon(self, d: Download, *, keep_partial: bool = False) -> None:
        """``d`` stopped unfinished; its shard goes back to not cached.

        With ``keep_partial`` and a validator, its partial file stays for a Range resume
        (the DOWNLOADING record keeps the validator) and counts against the budget.
        """
        self.inflight.pop(d.url, None)
        self.tables.forget(d.url)
        size = size_or_none(d.partial)
        if keep_partial and d.progress.etag and size:
            self.set_validator(d.url, d.progress.etag)
            self.kept[d.url] = size + side_bytes(d.partial)
            return
        self.drop_partial(d.url)

    def drop_partial(self, url: str) -> None:
        """Remove the partial file kept for ``url`` (and its record), if any."""
        # The files first: on a full disk the index may refuse to change until they are gone. A crash
        # between leaves a DOWNLOADING record with no partial file, which the next start forgets.
        self.kept.pop(url, None)
        self.layout.partial_path(url).unlink(missing_ok=True)
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

    def shrink(self, wanted: Sequence[str]) -> None:
        """Bring what the cache holds within ``limit`` (restarted with a smaller one), giving up
        what a download needing room would: kept partials, then table files, then shards
        (those in ``wanted``, the readers' windows, last and from the far end)."""
        over = self.used + self.kept_bytes - self.limit
        if over > 0:
            over -= self._drop_kept(over)
        if over > 0:
            over -= self.tables.drop(over)
        if over > 0:
            self.evict(over, wanted=wanted, allow_window=True, why="evicted to shrink the cache to --cache-size")

    def forget_failure(self, url: str) -> None:
        rec = self.index.get(url)
        if rec is not None and rec.state is ShardState.FAILED:
            self.index.delete(url)

    def forget_failures(self, urls: Iterable[str]) -> None:
        """:meth:`forget_failure` of each of ``urls`` (a million, for an edit of a long list: the
        failed records are looked up among them, not each of them in the index)."""
        if not self.index.summary.counts.get(ShardState.FAILED.value):
            return
        failed = {rec.url for rec in self.index.records.values() if rec.state is ShardState.FAILED}
        for url in failed.intersection(urls):
            self.index.delete(url)

    def set_cached(
        self, url: str, size: int, etag: str | None, *, source_size: int | None = None, last_modified: str | None = None
    ) -> None:
        old = self.index.get(url)
        self.put(
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
                self.fs_free() - self.margin - self.unwritten,
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
        need, margin_need, free = self.shortfall(extra)
        if max(need, margin_need) > 0 and self._drop_kept(max(need, margin_need), spare=d.url):
            need, margin_need, free = self.shortfall(extra)
        if max(need, margin_need) > 0 and self.tables.drop(max(need, margin_need)):
            need, margin_need, free = self.shortfall(extra)
        shortfall = max(need, margin_need - self._freeing.awaited(margin_need))
        if shortfall > 0:
            if not self.evict(
                shortfall,
                wanted=wanted,
                allow_window=d.demanded,
                spare=d.url,
                prefetched=prefetched,
                spare_prefetched=spare_prefetched,
                why="evicted to make room for a shard readers need",
                churn=True,
            ):
                self.refusal = _why_refused(self, d, extra, need >= margin_need, free, wanted)
                return False
            need, margin_need, free = self.shortfall(extra)
            if margin_need > 0:  # evicted, but not free yet: the files are open elsewhere
                self._freeing.evicted(margin_need)
        if margin_need > 0:
            self.refusal = Freeing.refusal(margin_need)
            return False
        d.budget.reserved = total
        return True

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())

    def shortfall(self, extra: int) -> tuple[int, int, int]:
        """Bytes to free before ``extra`` more may be reserved: (for the budget, for the
        free-space margin, the file system's free bytes now)."""
        need = self.used + self.reserved + self.kept_bytes + extra - self.limit
        free = self.fs_free()
        return need, self.margin + self.unwritten + extra - free, free

    @property
    def unwritten(self) -> int:
        """Bytes reserved by downloads in flight and not written yet: free on the file system
        now, but promised."""
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
        churn: bool = False,
    ) -> bool:
        """Free ``nbytes`` of cached shards if possible (all or nothing); True on success.

        Outside the windows of ``wanted``, the least recently read go first, and shards
        ``prefetched`` (held by a prefetch) after every other, or never with ``spare_prefetched``.
        ``why`` is told to the watcher for each shard removed; ``churn``: room made for a download,
        logged as :class:`~.churn_log.ChurnLog` decides."""
        candidates = [
            r
            for r in self.index.records.values()
            if r.state is ShardState.CACHED
            and not self.pins.get(r.url)
            and r.url != spare
            and not (spare_prefetched and r.url in prefetched)
        ]
        chosen = _victims(candidates, nbytes, wanted, allow_window, prefetched)
        if chosen is None:
            return False
        for rec in chosen:
            self.remove(rec.url, why, churn=churn)
        return True

    def remove(self, url: str, why: str, *, churn: bool = False) -> None:
        """Evict one shard (``why``, for the watcher): mark it EVICTING, delete the file, drop the
        record. ``churn``: room made for a download, logged at the level :attr:`churn` says."""
        rec = self.index.get(url)
        if rec is None:
            return
        event(
            log,
            "evicted",
            "evicted %s (%s, last read %s): %s",
            url,
            format_size(rec.size),
            iso_time(rec.last_read) or "never",
            why.removeprefix("evicted").removeprefix(":").strip(),
            url=url,
            bytes=rec.size,
            last_read=iso_time(rec.last_read),
            why=why,
            level=self.churn.level(Churn.EVICTED) if churn else logging.INFO,
        )
        self.put(ShardRecord(url, ShardState.EVICTING, size=rec.size))
        self.layout.shard_path(url).unlink(missing_ok=True)
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
                self.layout.shard_path(rec.url).unlink(missing_ok=True)
                self.layout.table_path(rec.url).unlink(missing_ok=True)
                freed += rec.disk_bytes
                if self.watcher is not None:
                    self.watcher.gone(rec.url, "removed to free disk space for the index")
                try:
                    self.index.delete(rec.url)
                except IndexWriteError:
                    pass
        return freed

    def keep_margin(self, wanted: Sequence[str]) -> None:
        """Evict (outside windows only) if something else ate into the free-space margin."""
        short = self.margin + self.unwritten - self.fs_free()
        if short > 0:
            short -= self._drop_kept(short)
        if short > 0:
            short -= self.tables.drop(short)
        if short > 0:
            self.evict(short, wanted=wanted, allow_window=False, why="evicted to keep --min-free free")

    def put(self, rec: ShardRecord) -> None:
        """Write ``rec``; a table file the old record counted and ``rec`` does not goes with it.
        The record changes first (index before files), still counting the table's bytes; its
        count of them drops once the file is gone, so the budget never misses bytes on disk (a
        crash between leaves a count of a missing file, which recovery drops)."""
        old = self.index.get(rec.url)
        if old is not None and old.table_size and not rec.table_size:
            counted = dataclasses.replace(rec, table_size=old.table_size)
            if counted != old:
                self.index.put(counted)
            self.layout.table_path(rec.url).unlink(missing_ok=True)
        self.index.put(rec)

    # -- reads ------------------------------------------------------------

    def pin(self, url: str, *, read: bool) -> None:
        """Keep ``url`` from eviction until :meth:`unpin`; ``read``: a reader opens it, which
        counts as a read of it (its reads and last-read time, by which eviction orders)."""
        self.pins[url] = self.pins.get(url, 0) + 1
        if read:
            self.index.touch(url, time.time())

    def unpin(self, url: str, *, read: bool) -> None:
        """Let go of a :meth:`pin`; ``read``: a reader's, who read it until now (its last-read time:
        a shard held open for long is not the least recently read one)."""
        if read:
            self.index.read_until(url, time.time())
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


def _victims(
    candidates: list[ShardRecord], nbytes: int, wanted: Sequence[str], allow_window: bool, prefetched: Collection[str]
) -> list[ShardRecord] | None:
    """The ``candidates`` (evictable records) to evict to free ``nbytes``, in order, or None when
    they cannot: outside the windows of ``wanted`` first, the least recently read first and those
    ``prefetched`` last; then, with ``allow_window``, inside them, the latest wanted first."""
    window = set(wanted)
    outside = sorted((r for r in candidates if r.url not in window), key=lambda r: (r.url in prefetched, r.last_read))
    chosen: list[ShardRecord] = []
    freed = 0
    for rec in outside:
        if freed >= nbytes:
            break
        chosen.append(rec)
        freed += rec.disk_bytes
    if freed < nbytes and allow_window:
        rank = {u: i for i, u in enumerate(wanted)}
        for rec in sorted((r for r in candidates if r.url in window), key=lambda r: -rank[r.url]):
            if freed >= nbytes:
                break
            chosen.append(rec)
            freed += rec.disk_bytes
    return chosen if freed >= nbytes else None


def _why_refused(
    cache: ShardCache,
    d: Download,
    extra: int,
    budget: bool,
    free: int,
    wanted: Sequence[str],
) -> tuple[str, str]:
    """(kind, sentence): why ``extra`` more bytes for ``d`` cannot be had by evicting from ``cache``."""
    window = set(wanted)
    pinned = in_window = evictable = 0
    for r in cache.index.records.values():
        if r.state is not ShardState.CACHED or r.url == d.url:
            continue
        if cache.pins.get(r.url):
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
            f"the budget (--cache-size {format_size(cache.limit)}) holds {format_size(cache.used)} cached and "
            f"{format_size(cache.reserved + cache.kept_bytes)} reserved or kept for resuming, and "
            f"{format_size(extra)} more cannot be freed ({held})"
        )
    return "min-free", (
        f"the file system keeps --min-free {format_size(cache.min_free)} (+{format_size(INDEX_HEADROOM)} for "
        f"the index) free and has {format_size(free)} free ({format_size(cache.unwritten)} of it promised "
        f"to downloads in flight); {format_size(extra)} more cannot be freed ({held})"
    )


class Freeing:
    """The space of shards evicted for free space that the file system did not show free
    yet (another process still has their files open), awaited for up to ``AWAIT_FREED``
    rather than evicted for again (see the module docstring)."""

    def __init__(self) -> None:
        self._held, self._until = 0, 0.0

    def evicted(self, still_short: int) -> None:
        """Shards were just evicted, and the file system is still ``still_short`` bytes short."""
        self._held, self._until = still_short, time.monotonic() + AWAIT_FREED

    def awaited(self, margin_need: int) -> int:
        """Bytes of the free-space shortfall ``margin_need`` that evicted shards will free once
        the processes that have their files open let go."""
        if margin_need <= 0 or time.monotonic() >= self._until:
            self._held = 0  # come back, or awaited long enough: evict for it again
            return 0
        return self._held

    @staticmethod
    def refusal(margin_need: int) -> tuple[str, str]:
        """A reservation's refusal while the space is awaited: (kind, sentence)."""
        return "min-free", (
            f"waiting for the space of evicted shards to come back ({format_size(margin_need)} short of "
            f"--min-free on the file system; a worker still has their files open)"
        )
