"""The cache index: what is cached, in what state, and the counters behind ``wdscache stats``.

Stored in a diskcache (SQLite) under ``CACHE_DIR/index``. Values are JSON
strings, never pickles. One agent writes it; ``wdscache stats`` reads it.

Guarantees:

- Every change of a shard record and of the summary is one SQLite transaction,
  so a crash (even SIGKILL) leaves records and summary consistent.
- A record is written *before* the file it describes changes: ``DOWNLOADING``
  before a partial file is created, ``EVICTING`` before a shard file is deleted.
  After a crash the agent finishes or undoes those steps (see :mod:`wdscache.agent.cache`).
- The summary is O(1) to read, so ``wdscache stats`` answers at once on any cache size.

An index in a folder that cannot be written (a read-only file system) is still read, with
``read_only``: diskcache's opening writes its settings, so SQLite is opened read-only itself:
``immutable`` on a read-only file system with no write-ahead log beside the database (nothing
can change it, and SQLite needs no ``-shm`` file), else ``mode=ro``, which reads the log a killed
agent left but needs its ``-shm`` file too (without one the read fails with an error that says so).
:func:`read_summary` and :func:`read_index` fall back to it when the index cannot be opened to
write (a file system that turned read-only while its mount says ``rw``): not a damaged index.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import diskcache
from diskcache.core import MODE_RAW, MODE_TEXT

from .errors import WdsCacheError
from .layout import INDEX_DB, write_fault

# Failed shards listed in the summary; the rest are counted, not listed.
MAX_FAILED_LISTED = 100
_SHARD = "shard:"
_SUMMARY = "summary"
_META = "meta"
_COUNT = "count:"
COUNTERS = (
    "hits",
    "misses",
    "bytes_downloaded",
    "downloads",
    "redownloads",
    "bytes_redownloaded",
    "corrupt",
    "changed",
)


class IndexWriteError(WdsCacheError):
    """The index could not be written (its file system is full, say); nothing changed."""


class IndexReadError(WdsCacheError):
    """The index cannot be read: it is damaged (the agent's next start moves it aside)."""


# What opening or reading a damaged index raises (sqlite's own error, or values that are not ours).
DAMAGED = (sqlite3.DatabaseError, ValueError, TypeError, KeyError)


_SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_CANTOPEN = 8, 10, 14  # sqlite's primary result codes


def _write_refused(directory: Path, exc: BaseException) -> bool:
    """Whether opening the index to write failed as its file or folder cannot be written (sqlite's
    "attempt to write a readonly database", or an I/O error or failed open on a file system that
    refuses writes: one that turned read-only under an agent), not for what the index holds."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)  # (Python 3.11+; the message before)
    primary = code & 0xFF if code is not None else (_SQLITE_READONLY if "readonly" in str(exc) else None)
    if primary == _SQLITE_READONLY:
        return True
    return primary in (_SQLITE_IOERR, _SQLITE_CANTOPEN, None) and write_fault(directory.parent) is not None


def _damaged(directory: Path, exc: BaseException) -> IndexReadError:
    return IndexReadError(
        f"cannot read the index in {directory} ({exc}): it is damaged; the agent moves it aside at its "
        "next start and finds the cached shards again"
    )


class ShardState(str, enum.Enum):
    """Where a shard is in its life. Only CACHED shards are ever read.

    Transitions (anything else is a bug)::

        (none) -> QUEUED         planned: in a reader's window or asked for
        QUEUED -> (none)         dropped from the plan before it started
        QUEUED -> DOWNLOADING    a download thread took it
        DOWNLOADING -> CACHED    complete, checked, fsynced and renamed into shards/
        DOWNLOADING -> QUEUED    interrupted (shutdown, disk full): partial removed
        DOWNLOADING -> DOWNLOADING  interrupted with a validator: the record and its partial
                                 stay (no thread on it) until resumed or removed for space
        DOWNLOADING -> FAILED    permanent error (404, not a tar) or retries exhausted
        FAILED -> QUEUED         asked for again after the list changed or a retry delay
        CACHED -> EVICTING       chosen for eviction; the file is deleted next
        CACHED -> FAILED         its copy was found damaged after being downloaded once more
        EVICTING -> (none)       file gone, record deleted

    QUEUED lives only in the agent's memory; the others are persisted.
    """

    QUEUED = "queued"
    DOWNLOADING = "downloading"
    CACHED = "cached"
    FAILED = "failed"
    EVICTING = "evicting"


@dataclass
class ShardRecord:
    """What the index knows about one URL."""

    url: str
    state: ShardState
    size: int = 0  # bytes on disk when CACHED; expected size (0 = unknown) otherwise
    etag: str | None = None  # the source's validator: its ETag, else its Last-Modified date
    # The source's size when not ``size``: a gzip'd shard is cached decompressed. What a
    # restart compares with the source, with ``etag`` and ``last_modified``.
    source_size: int | None = None
    cached_at: float = 0.0
    last_read: float = 0.0
    reads: int = 0
    error: str | None = None
    # The source's Last-Modified date beside its ETag, when it sent both: a server that later
    # sends only one of them can still be compared (records written without it load as None).
    last_modified: str | None = None
    # Bytes of the shard's sample table file (CACHE_DIR/tables/), 0 when it has none. Counted
    # from before the file is written until after it is removed: the budget never misses it.
    table_size: int = 0
    # The MD5 (lowercase hex) a check of the cached file found equal to its shard index's, for a
    # copy whose version no validator names (one adopted into a rebuilt index): what makes it
    # current at a revalidation (wdscache.agent.opens). None: not checked so.
    md5: str | None = None

    @property
    def disk_bytes(self) -> int:
        """Bytes the budget counts for this record when CACHED: its file and its table file."""
        return self.size + self.table_size

    def to_json(self) -> str:
        d = asdict(self)
        d["state"] = self.state.value
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ShardRecord:
        """A record as :meth:`to_json` wrote it. Fields this version does not know (a later one's,
        after a rollback) are left out, not taken for damage: the cache and its validators stay."""
        d = json.loads(text)
        d["state"] = ShardState(d["state"])
        known = {k: v for k, v in d.items() if k in _RECORD_TYPES}
        for k, v in known.items():  # a value of another type is the entry's damage, not the index's
            if not isinstance(v, _RECORD_TYPES[k]) or isinstance(v, bool):
                raise TypeError(f"index record of {d.get('url')!r}: {k} is a {type(v).__name__}")
        return cls(**known)


_OPTIONAL_STR = (str, type(None))
_RECORD_TYPES: dict[str, type | tuple[type, ...]] = {
    "url": str,
    "state": ShardState,
    "size": int,
    "etag": _OPTIONAL_STR,
    "source_size": (int, type(None)),
    "cached_at": (int, float),
    "last_read": (int, float),
    "reads": int,
    "error": _OPTIONAL_STR,
    "last_modified": _OPTIONAL_STR,
    "table_size": int,
    "md5": _OPTIONAL_STR,
}


@dataclass
class Summary:
    """Aggregates kept beside the records so that stats never scan the index."""

    counts: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in ShardState})
    bytes_used: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # url -> error, at most MAX_FAILED_LISTED
    updated: float = 0.0
    table_bytes: int = 0  # of ``bytes_used``, the cached shards' sample table files

    def apply(self, old: ShardRecord | None, new: ShardRecord | None) -> None:
        for rec, sign in ((old, -1), (new, 1)):
            if rec is None:
                continue
            self.counts[rec.state.value] = self.counts.get(rec.state.value, 0) + sign
            if rec.state is ShardState.CACHED:
                self.bytes_used += sign * rec.disk_bytes
                self.table_bytes += sign * rec.table_size
        if old is not None and old.state is ShardState.FAILED:
            self.failed.pop(old.url, None)
        if new is not None and new.state is ShardState.FAILED and len(self.failed) < MAX_FAILED_LISTED:
            self.failed[new.url] = new.error or "unknown error"
        self.updated = time.time()


class Index:
    """The persistent map URL -> :class:`ShardRecord`, with its summary and counters.

    The agent holds an in-memory copy of every record (``records``), loaded once
    at start, and writes through on every change; readers of the index (stats)
    never need that copy.
    """

    def __init__(self, directory: Path, *, read_only: bool = False) -> None:
        self._db: diskcache.Cache | _ReadOnlyStore
        if read_only:
            self._db = _ReadOnlyStore(directory)
        else:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._db = diskcache.Cache(
                str(directory),
                eviction_policy="none",
                size_limit=1 << 62,
                statistics=False,
                tag_index=False,
                sqlite_synchronous=1,  # NORMAL: crash-consistent in WAL mode
            )
            for f in directory.iterdir():
                f.chmod(0o600)
        self.records: dict[str, ShardRecord] = {}
        self.summary = Summary()
        self._unsaved_reads: set[str] = set()
        self._unsaved_counts: dict[str, int] = {}
        # Samples per shard, kept after eviction: resuming or len() must not need a download.
        self.counts: dict[str, int] = {}
        # The copy each count was taken from (size, ETag): a copy downloaded again keeps the
        # count only if it is the same (see keep_count).
        self.counted_from: dict[str, tuple[int, str | None]] = {}
        self.unreadable = 0  # entries left out as this version cannot read them (see _load)
        self._load()

    def _load(self) -> None:
        # A record or count this version cannot read (a later release's state, a value of another
        # shape, after a rollback) is left out, alone: its shard is one the cache does not know
        # (adopted, or downloaded again), while the others keep their validators.
        for key in self._db.iterkeys():
            try:
                self._load_entry(key)
            except (ValueError, TypeError, KeyError):
                self.unreadable += 1
        # Rebuilt from the records rather than trusted: cheap at start, and self-healing.
        self.summary = Summary()
        for rec in self.records.values():
            self.summary.apply(None, rec)

    def _load_entry(self, key: object) -> None:
        if isinstance(key, str) and key.startswith(_SHARD):
            text = self._db.get(key)
            if isinstance(text, str):
                rec = ShardRecord.from_json(text)
                self.records[rec.url] = rec
        elif isinstance(key, str) and key.startswith(_COUNT):
            value = self._db.get(key)
            url = key[len(_COUNT) :]
            if isinstance(value, int):  # written before counts named their copy
                self.counts[url] = value
            elif isinstance(value, str):
                samples, size, etag = json.loads(value)
                self.counts[url], self.counted_from[url] = int(samples), (int(size), etag)

    def close(self) -> None:
        self._db.close()

    def get(self, url: str) -> ShardRecord | None:
        return self.records.get(url)

    def __iter__(self) -> Iterator[ShardRecord]:
        return iter(list(self.records.values()))

    def __len__(self) -> int:
        return len(self.records)

    def put(self, rec: ShardRecord) -> None:
        """Write ``rec`` (replacing any record of its URL) and the summary, atomically.

        Memory changes only once the transaction committed: on IndexWriteError
        (a full disk, say) the index is as it was, in memory and on disk.
        """
        old = self.records.get(rec.url)
        summary = self._summary_after(old, rec)
        with self._writing():
            self._db.set(_SHARD + rec.url, rec.to_json())
            self._db.set(_SUMMARY, json.dumps(asdict(summary)))
        self.summary = summary
        self.records[rec.url] = rec
        self._unsaved_reads.discard(rec.url)

    def delete(self, url: str) -> None:
        old = self.records.get(url)
        if old is None:
            return
        summary = self._summary_after(old, None)
        with self._writing():
            self._db.delete(_SHARD + url)
            self._db.set(_SUMMARY, json.dumps(asdict(summary)))
        self.summary = summary
        del self.records[url]

    def _summary_after(self, old: ShardRecord | None, new: ShardRecord | None) -> Summary:
        summary = Summary(
            dict(self.summary.counts),
            self.summary.bytes_used,
            dict(self.summary.failed),
            table_bytes=self.summary.table_bytes,
        )
        summary.apply(old, new)
        return summary

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            with self._db.transact():
                yield
        except sqlite3.OperationalError as exc:
            raise IndexWriteError(f"cannot write the index: {exc}") from exc

    def touch(self, url: str, now: float) -> None:
        """Record a read in memory; persisted with the next write of that record.

        Read times only order eviction, so losing the last few in a crash is harmless,
        and not writing on every read keeps the hot path off SQLite.
        """
        rec = self.records.get(url)
        if rec is not None:
            rec.last_read = now
            rec.reads += 1
            self._unsaved_reads.add(url)

    def read_until(self, url: str, now: float) -> None:
        """A reader let go of ``url`` at ``now``: it was read until then, so that is its last read
        time (no read more is counted). In memory, as :meth:`touch`."""
        rec = self.records.get(url)
        if rec is not None:
            rec.last_read = now
            self._unsaved_reads.add(url)

    def set_count(self, url: str, samples: int, size: int, etag: str | None) -> None:
        """``url`` holds ``samples`` samples in its copy of ``size`` bytes and ``etag``."""
        if self.counts.get(url) != samples or self.counted_from.get(url) != (size, etag):
            with self._writing():
                self._db.set(_COUNT + url, json.dumps([samples, size, etag]))
            self.counts[url], self.counted_from[url] = samples, (size, etag)

    def keep_count(self, url: str, size: int, etag: str | None) -> None:
        """A new copy of ``url`` arrived: keep its count only if it was taken from the same
        content (same size, and the same ETag when both copies have one)."""
        was = self.counted_from.get(url)
        if was is None or was[0] != size or (was[1] and etag and was[1] != etag):
            self.drop_count(url)

    def drop_count(self, url: str) -> None:
        if url in self.counts:
            with self._writing():
                self._db.delete(_COUNT + url)
            del self.counts[url]
            self.counted_from.pop(url, None)

    def set_meta(self, meta: dict) -> None:
        """Settings of the last agent (its budget), shown by stats when no agent runs."""
        with self._writing():
            self._db.set(_META, json.dumps(meta))

    def incr(self, counter: str, delta: int = 1) -> None:
        """Count in memory; :meth:`flush` persists. Counters are advisory, so a full disk or
        a crash may lose the last few seconds of them, and an open never waits on SQLite."""
        self._unsaved_counts[counter] = self._unsaved_counts.get(counter, 0) + delta

    def counters(self) -> dict[str, int]:
        return {name: int(self._db.get(name, 0)) + self._unsaved_counts.get(name, 0) for name in COUNTERS}

    def flush(self) -> None:
        """Persist counters and read times recorded in memory (IndexWriteError keeps them pending)."""
        with self._writing():
            for name, delta in self._unsaved_counts.items():
                self._db.incr(name, delta, default=0)
            for url in self._unsaved_reads:
                rec = self.records.get(url)
                if rec is not None:
                    self._db.set(_SHARD + url, rec.to_json())
        self._unsaved_counts.clear()
        self._unsaved_reads.clear()


def read_summary(directory: Path, *, read_only: bool = False) -> tuple[dict, dict[str, int], dict]:
    """The stored summary, counters and meta of an index, without loading its records;
    IndexReadError if it is damaged."""
    db: diskcache.Cache | _ReadOnlyStore
    try:
        if read_only:
            db = _ReadOnlyStore(directory, keys=(_SUMMARY, _META, *COUNTERS))
        else:
            db = diskcache.Cache(str(directory), eviction_policy="none", size_limit=1 << 62)
        try:
            text = db.get(_SUMMARY)
            summary = json.loads(text) if isinstance(text, str) else asdict(Summary())
            meta = db.get(_META)
            meta = json.loads(meta) if isinstance(meta, str) else {}
            return summary, {name: int(db.get(name, 0)) for name in COUNTERS}, meta
        finally:
            db.close()
    except (*DAMAGED, OSError) as exc:
        if not read_only and _write_refused(directory, exc):  # read as a read-only file system's
            return read_summary(directory, read_only=True)
        if isinstance(exc, OSError):
            raise
        raise _damaged(directory, exc) from None


def read_index(directory: Path, *, read_only: bool = False) -> Index:
    """The index in ``directory``, for a command that only reads it; IndexReadError if it is damaged."""
    try:
        return Index(directory, read_only=read_only)
    except (*DAMAGED, OSError) as exc:
        if not read_only and _write_refused(directory, exc):  # read as a read-only file system's
            return Index(directory, read_only=True)
        if isinstance(exc, OSError):
            raise
        raise _damaged(directory, exc) from None


class _ReadOnlyStore:
    """The values of an index read once with SQLite opened read-only (see the module's docstring):
    the keys and values it stores (strings: raw, or in a file for long ones; counters), never pickles."""

    def __init__(self, directory: Path, *, keys: tuple[str, ...] | None = None) -> None:
        # immutable reads the database file alone: right only when no write-ahead log holds
        # transactions not yet copied into it (one an agent that was killed left).
        immutable = bool(os.statvfs(directory).f_flag & os.ST_RDONLY) and not (directory / f"{INDEX_DB}-wal").exists()
        uri = f"file:{quote(str(directory / INDEX_DB))}?{'immutable=1' if immutable else 'mode=ro'}"
        query = "SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND mode IN (?, ?)"
        args: tuple[Any, ...] = (MODE_RAW, MODE_TEXT)
        if keys is not None:
            query += f" AND key IN ({', '.join('?' * len(keys))})"
            args += keys
        disk = diskcache.Disk(str(directory))
        try:
            con = sqlite3.connect(uri, uri=True)
            try:
                self._values = {
                    key: disk.fetch(mode, filename, value, False)
                    for key, mode, filename, value in con.execute(query, args)
                }
            finally:
                con.close()
        except (sqlite3.Error, OSError) as exc:
            raise WdsCacheError(
                f"cannot read the index in {directory}, a folder that cannot be written "
                f"({exc}); read it where it can be written, or while its agent runs"
            ) from None

    def iterkeys(self) -> Iterator[str]:
        return iter(list(self._values))

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def transact(self) -> contextlib.AbstractContextManager[None]:
        raise IndexWriteError("cannot write the index: it was opened read-only")

    def set(self, key: str, value: Any) -> bool:
        raise IndexWriteError("cannot write the index: it was opened read-only")

    def delete(self, key: str) -> bool:
        raise IndexWriteError("cannot write the index: it was opened read-only")

    def incr(self, key: str, delta: int = 1, default: int = 0) -> int:
        raise IndexWriteError("cannot write the index: it was opened read-only")

    def close(self) -> None:
        pass
