"""The sample table files kept beside the cached shards (``CACHE_DIR/tables/``), so that an
agent started again reads each shard's table instead of walking its tar headers.

A worker that walks a shard reports its table to the agent (``walked``), which passes it on
to the other workers and keeps it here; the format, and the checks a worker makes before it
takes a table file, are :mod:`wdscache.agent.sampletable`'s. Owned by
:class:`~wdscache.agent.cache.ShardCache` (the agent's main loop only; not thread-safe).

Guarantees:

- Optional: a table file is written only for the file cached now (same identity as the walk
  found), and only into room the budget and the free-space margin have without evicting
  anything; losing one costs a walk of its shard, never a wrong byte.
- Counted: the shard's record counts the table file (``ShardRecord.table_size``) from before
  it is written until after it is removed, so the budget never misses bytes on disk: a table
  that goes (:meth:`TableFiles.drop`, :meth:`ShardCache.put
  <wdscache.agent.cache.ShardCache.put>`, a write that fails, in ``finally``, leaving no file)
  is deleted first, its count dropped after. A crash between leaves a count of a missing
  file, which recovery drops (and a file no record counts, which recovery removes).
- Atomic: published by a temp file in the same folder and a rename. Not fsynced: the main
  loop writes it, and an fsync while downloads write waited up to a tenth of a second, which
  every request waited with it. A file a power loss left short or empty fails the digest it
  holds (:func:`~wdscache.agent.sampletable.read_table_file`): it costs a walk, never a wrong byte.
- Given up first: when a download needs room, table files go (the least recently read
  shards' first) before any shard is evicted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING

from ..shared.index import IndexWriteError, ShardState
from ..shared.layout import file_identity, write_atomic
from ..shared.logs import get_logger
from .sampletable import table_file, table_file_holds

if TYPE_CHECKING:
    from .cache import ShardCache

log = get_logger(__name__)

EARLY_TABLES = 4 << 20  # bytes of walked tables held for downloads not yet finished

Table = tuple[list[int], list[list[str]], list[bytes]]
"""A walked table as a worker reports it: the cache file's identity, layouts and frames."""


class TableFiles:
    """The table files of ``cache``'s shards."""

    def __init__(self, cache: ShardCache) -> None:
        self._cache = cache
        # Tables of shards whose file was published before the main loop finished their download
        # (a worker reading the download saw the file first): kept once it has, at most EARLY_TABLES bytes.
        self._early: dict[str, Table] = {}

    def store(self, url: str, identity: list[int], layouts: list[list[str]], frames: list[bytes]) -> bool:
        """Keep the table a worker found in ``url``'s cache file (of ``identity``) on disk;
        True if it was written. In place of a table file that is not this file's (of a file
        moved to another file system, say, or damaged); the record counts the larger of old
        and new while it is written."""
        cache = self._cache
        if url in cache.inflight:  # its file was published before the main loop heard of it
            self._early.pop(url, None)
            self._early[url] = (identity, layouts, frames)
            while sum(sum(map(len, t[2])) for t in self._early.values()) > EARLY_TABLES:
                del self._early[next(iter(self._early))]
            return False
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            return False
        path = cache.layout.table_path(url)
        try:
            if list(file_identity(os.stat(cache.layout.shard_path(url)))) != identity:
                return False  # replaced or gone since the walk
        except OSError:
            return False
        if rec.table_size and table_file_holds(path, tuple(identity)):
            return False  # kept already
        data = table_file(identity, layouts, frames)
        if max(cache.shortfall(len(data) - rec.table_size)[:2]) > 0:
            return False
        cache.index.put(dataclasses.replace(rec, table_size=max(len(data), rec.table_size)))
        written = False
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_atomic(path, data, durable=False)  # (see the module's guarantees)
            written = True
        except OSError as exc:
            log.warning(
                "the sample table of %s was not kept at %s: %s; an agent started later walks the shard again",
                url,
                path,
                exc.strerror or exc,
            )
        finally:
            now = cache.index.get(url)
            if not written:  # a table of another identity (the old one, if any) is of no use either
                for stale in (path.with_name(f".{path.name}.{os.getpid()}.tmp"), path):
                    with contextlib.suppress(OSError):
                        stale.unlink(missing_ok=True)
            if now is not None and now.table_size != (len(data) if written else 0):
                cache.index.put(dataclasses.replace(now, table_size=len(data) if written else 0))
        return written

    def published(self, url: str) -> None:
        """``url``'s download is finished (its shard cached): keep a table that came before."""
        early = self._early.pop(url, None)
        if early is not None:
            with contextlib.suppress(IndexWriteError):  # a table is optional; the shard is cached
                self.store(url, *early)

    def forget(self, url: str) -> None:
        """``url``'s download stopped unfinished: a table that came before is of no file."""
        self._early.pop(url, None)

    def drop(self, nbytes: int) -> int:
        """Remove table files, the least recently read shards' first, until ``nbytes`` are
        freed; returns the bytes freed. Room a download needs goes to it before any shard is
        evicted: losing a table costs a walk of its shard later, evicting a shard a download."""
        cache = self._cache
        tabled = [r for r in cache.index.records.values() if r.table_size and r.state is ShardState.CACHED]
        freed = 0
        for rec in sorted(tabled, key=lambda r: r.last_read):
            if freed >= nbytes:
                break
            cache.put(dataclasses.replace(rec, table_size=0))
            freed += rec.table_size
        return freed
