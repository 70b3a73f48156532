"""The shard cache made right as it opens: after a crash, an unreadable index, or files of earlier names.

Run by :class:`~wdscache.agent.cache.ShardCache` at start, before anything reads the cache
(main thread only).

Guarantees:

- Nothing complete is lost: a cached shard whose file has its recorded size is kept; one
  renamed into place just before a crash (its record still DOWNLOADING) is adopted; with a
  rebuilt index, complete files the agent's list names are adopted (:func:`adopt`), since
  their names derive from their URLs. An adopted copy's version is unknown (its record has no
  validator): revalidation serves it only once its bytes are proved the source's shard
  (:mod:`wdscache.agent.opens`), else downloads it again.
- What a crash left half done is finished or undone: a half-done eviction (EVICTING) is
  finished; a partial file is kept for a Range resume when its DOWNLOADING record has a
  validator, whichever list named its shard (a job's own list does not outlive the agent:
  :mod:`wdscache.agent.unnamed_partials` removes those no list names again in time); it counts
  against the budget from then on. Every other partial file (with its side files,
  :mod:`wdscache.agent.parts`) is removed, its record first; records
  whose file is missing, has the wrong size, or is gzip'd (shards are cached decompressed)
  are forgotten, and FAILED records too (a new agent tries again).
- An unreadable index is moved aside (``index.corrupt-<time>``), never deleted, and a new
  one started; an empty index beside shard files is taken as deleted, and rebuilt from them.
- File names of earlier versions (a URL's query in them,
  :func:`~wdscache.shared.layout.former_shard_names`) are renamed to today's: each rename is
  atomic, so after a crash every file is under one of its two names and the next open
  renames the rest; the index, keyed by URL, is not changed.
- An entry where the cache keeps a file of its own (a shard's, a partial's) that is no regular
  file, or one where it keeps a folder that is no directory (an operator's mistake, a restore
  gone wrong: a directory, a symbolic link, a named pipe) is no copy of anything: it is moved
  aside (:func:`clear_way`, ``aside/<time>/<its path in the cache>``), never read, deleted or
  followed, with a warning naming it; its shard is downloaded again. A download clears its way
  the same, for one made while the agent runs.
- Sample table files (``tables/``) stay only for a kept shard whose record counts one of
  that size; every other one (its shard gone, a crash between a record and its file, a temp
  file) is removed, and a record that counts a table file no longer there counts none.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..shared.index import DAMAGED, Index, IndexWriteError, ShardState
from ..shared.layout import CacheLayout, is_fan
from ..shared.logs import get_logger
from ..shared.tarwalk import GZIP_MAGIC, file_problem
from .parts import owner_name

if TYPE_CHECKING:
    from .cache import ShardCache

log = get_logger(__name__)


def recover(cache: ShardCache) -> dict[str, int]:
    """Make ``cache``'s index and disk agree after any kind of stop; returns what was done.

    Complete shards are kept; records whose file is gone are forgotten; a shard
    renamed into place just before a crash is adopted; partial files are kept
    for resuming when their record has a validator (they count against the
    budget from now on); half-done evictions are finished.
    """
    index, layout = cache.index, cache.layout
    resumable: dict[str, str] = {}  # partial file name -> url
    done = {"kept": 0, "forgotten": 0, "adopted": 0, "partials_removed": 0, "evictions_finished": 0}
    tables: set[str] = set()  # table file names a kept record counts
    folders: dict[Path, bool] = {}  # fan folder -> whether it is clear (each looked at once)
    for rec in index:
        path = layout.shard_path(rec.url)
        if path.parent not in folders:
            folders[path.parent] = clear_way(layout, path.parent, folder=True)
        # A directory, a link or a pipe where a file belongs is no copy, and never opened (a pipe
        # blocks). One lstat a cached shard, as before: a regular file there is in no one's way.
        size = size_or_none(path)
        ways = [path] if size is None else []
        if rec.state is ShardState.DOWNLOADING:
            ways.append(layout.partial_path(rec.url))
        if not (folders[path.parent] and all([clear_way(layout, way) for way in ways])):
            index.delete(rec.url)  # (what could not be moved stays in the way, said; the shard starts over)
            done["forgotten"] += 1
            continue
        if rec.state is ShardState.CACHED:
            if size == rec.size and not _gzipped(path):
                done["kept"] += 1
                if rec.table_size:
                    table = layout.table_path(rec.url)
                    if size_or_none(table) == rec.table_size:
                        tables.add(table.name)
                    else:
                        index.put(dataclasses.replace(rec, table_size=0))
            else:
                log.warning(
                    "forgetting %s: its cache file is %s",
                    rec.url,
                    "gzip'd (shards are cached decompressed)" if size == rec.size else "missing or has the wrong size",
                )
                path.unlink(missing_ok=True)
                index.delete(rec.url)
                done["forgotten"] += 1
        elif rec.state is ShardState.EVICTING:
            path.unlink(missing_ok=True)
            index.delete(rec.url)
            done["evictions_finished"] += 1
        elif rec.state is ShardState.DOWNLOADING:
            if size is not None and (rec.size in (0, size)) and _head_ok(path):
                # Renamed into place, then killed before the index said so. A gzip'd source's
                # file is still there (removed once the index says so): its size is the source's,
                # which revalidation compares (the partial sweep below removes it).
                packed = layout.partial_path(rec.url)
                source_size = size_or_none(packed) if _gzipped(packed) else None
                cache.set_cached(rec.url, size, rec.etag, source_size=source_size)
                done["adopted"] += 1
            else:
                path.unlink(missing_ok=True)
                partial = layout.partial_path(rec.url)
                if rec.etag and size_or_none(partial):
                    resumable[partial.name] = rec.url
                else:
                    index.delete(rec.url)
        elif rec.state is ShardState.FAILED:
            # Failures are retried by a new agent: the server or the list may have changed. A failed
            # shard has no cache file: one there is a damaged copy whose removal a kill cut short
            # (ShardCache.fail_cached), which nothing counts and a new download must not adopt.
            path.unlink(missing_ok=True)
            index.delete(rec.url)
    # Partial files: resume those we were told to keep, remove every other one.
    # A parted download's side files go with their partial file (wdscache.agent.parts).
    for entry in os.scandir(layout.partial_dir):
        url = resumable.get(owner_name(entry.name))
        if not entry.is_file(follow_symlinks=False):
            clear_way(layout, Path(entry.path))
        elif url is None:
            os.unlink(entry.path)
            done["partials_removed"] += 1
        else:
            cache.kept[url] = cache.kept.get(url, 0) + entry.stat(follow_symlinks=False).st_size
    done["partials_kept"] = len(cache.kept)
    done["tables_removed"] = _sweep_tables(layout, tables)
    return done


def _sweep_tables(layout: CacheLayout, keep: set[str]) -> int:
    """Remove every file under ``tables/`` but those named in ``keep``; returns how many went."""
    removed = 0
    for folder in os.scandir(layout.tables_dir):
        if not folder.is_dir(follow_symlinks=False):
            os.unlink(folder.path)
            removed += 1
            continue
        for entry in os.scandir(folder.path):
            if entry.name not in keep and not entry.is_dir(follow_symlinks=False):  # nothing of ours
                os.unlink(entry.path)
                removed += 1
    return removed


def fanned_files(layout: CacheLayout, folder: Path) -> Iterator[Path]:
    """The regular files in the fan folders of ``folder`` (``shards/`` or ``tables/``): where the
    cache keeps its own files. Whatever else lies in a fan folder, or is where one belongs, is moved
    aside (:func:`clear_way`), never walked into nor deleted: a directory may hold anyone's files;
    an entry of ``folder`` that no fan folder is named as is left as it is."""
    for fan in sorted(os.scandir(folder), key=lambda e: e.name):
        if not is_fan(fan.name):  # (no folder of ours is named so: anyone's, left as it is)
            continue
        if not (clear_way(layout, Path(fan.path), folder=True) and os.path.isdir(fan.path)):  # (moved aside)
            continue
        for entry in sorted(os.scandir(fan.path), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False):
                yield Path(entry.path)
            else:
                clear_way(layout, Path(entry.path))


def adopt(cache: ShardCache, urls: Iterable[str]) -> int:
    """Take complete shard files of ``urls`` that ``cache``'s index does not know (a rebuilt index)."""
    adopted = 0
    for url in urls:
        if url in cache.index.records:
            continue
        rename_former(cache.layout, url)
        path = cache.layout.shard_path(url)
        if not (clear_way(cache.layout, path.parent, folder=True) and clear_way(cache.layout, path)):
            continue
        size = size_or_none(path)
        if size is not None and _head_ok(path):
            cache.set_cached(url, size, None)
            adopted += 1
    return adopted


def open_index(layout: CacheLayout) -> tuple[Index, bool]:
    """Open the index, and whether it is to be rebuilt from the files (:func:`adopt`);
    a corrupt one is moved aside and started afresh.

    Nothing is lost for good: a fresh index adopts complete shard files again as
    the agent's list names them, since their names derive from their URLs.
    """
    try:
        index = Index(layout.index_dir)
    except DAMAGED as exc:
        if _no_room(exc):  # a full (or failing) disk, not a damaged index: kept as it is
            raise IndexWriteError(
                f"cannot open the index in {layout.index_dir} ({exc}): free space on its file system "
                "(the index is not damaged, and is kept)"
            ) from None
        aside = layout.root / f"index.corrupt-{int(time.time())}"
        log.error("the index is unreadable (%s); moved it to %s and starting a new one", exc, aside)
        os.replace(layout.index_dir, aside)
        return Index(layout.index_dir), True
    if index.unreadable:  # (a later release's entries, after a rollback): the agent adopts their shards
        log.warning(
            "the index holds %d entries this version cannot read (written by a later wdscache?): they are left "
            "out, and their shards taken as found",
            index.unreadable,
        )
    # An empty index beside shard files: it was deleted; rebuild it from the files.
    lost = not len(index) and any(p.is_file() for p in layout.shards_dir.rglob("*"))
    return index, lost


_SQLITE_IOERR, _SQLITE_FULL = 10, 13  # sqlite's primary result codes (an extended one's low byte)


def _no_room(exc: BaseException) -> bool:
    """Whether sqlite failed for want of disk space or for an I/O error, not for what the file holds."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)  # (Python 3.11+; the message before)
    if code is not None:
        return code & 0xFF in (_SQLITE_IOERR, _SQLITE_FULL)
    return str(exc) in ("database or disk is full", "disk I/O error")


def rename_former(layout: CacheLayout, url: str) -> None:
    """Give the file of ``url`` its name of today if it has an earlier one (see the module docstring)."""
    formers = layout.former_shard_paths(url)
    if not formers:
        return
    current = layout.shard_path(url)
    if current.exists():
        return
    for former in formers:
        try:
            os.rename(former, current)
        except FileNotFoundError:
            continue
        log.info("renamed the cache file of %s to %s (a name holds no URL query or command words)", url, current.name)
        return


def clear_way(layout: CacheLayout, path: Path, *, folder: bool = False) -> bool:
    """Make way for a regular file of the cache's own at ``path`` in ``layout``'s directory (a
    folder with ``folder``): move aside what lies there when it is something else, to
    ``aside/<time>/<its path in the cache>``, never deleted (a directory may hold anything).
    False when it is still in the way (it could not be moved: said).

    Only the entry itself is looked at (``lstat``): a link where a file belongs is in the way
    whatever it points to, since the cache's own files are never links; it is moved, not
    followed. A folder may be a link to a directory (one put on another disk)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # (a folder above not one: cleared on its own)
        return True
    if stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode):
        return True
    if folder and stat.S_ISLNK(mode) and os.path.isdir(path):
        return True
    kind = next((k for test, k in _KINDS if test(mode)), "something else")
    rel = path.relative_to(layout.root)
    aside = layout.root / "aside" / str(int(time.time())) / rel
    while os.path.lexists(aside):  # (a rename would replace a file, or an empty directory)
        aside = aside.with_name(aside.name + "~")
    try:
        aside.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.rename(path, aside)
    except OSError as exc:
        log.error(
            "found %s at %s, where the cache keeps its own %s, and cannot move it aside (%s): remove it",
            kind,
            path,
            "folder" if folder else "file",
            exc,
        )
        return False
    log.warning(
        "found %s at %s, where the cache keeps its own %s: moved it to %s (not read, not deleted: look at it, "
        "then remove it)",
        kind,
        rel,
        "folder" if folder else "file",
        aside,
    )
    return True


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def size_or_none(path: Path) -> int | None:
    """The size of the regular file at ``path``, or None if there is none (nothing there, or
    something else: a directory, a link, a pipe)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _gzipped(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == GZIP_MAGIC
    except FileNotFoundError:
        return False


def _head_ok(path: Path) -> bool:
    """True when ``path`` starts like a plain tar (a cached shard is never gzip'd)."""
    return file_problem(path) is None and not _gzipped(path)
