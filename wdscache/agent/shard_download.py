"""One shard's download: its record (:class:`Download`: what is fixed, the thread's
:class:`Progress`, the :class:`Budget` it asks), what it raises, and how its files are
written, synced and published.

Guarantees kept here, for every source and for parallel parts alike:

- a byte is written only while the download holds a reservation for it, and a write or a
  sync the file system refuses for space is :class:`DiskFull` for that shard;
- a partial file whose write-back failed is started over (never resumed from: pages
  already written may be lost), so a resume never splices unknown bytes;
- a starting-over file is a new file (:func:`truncate`): a worker reading the old one by
  its descriptor keeps the old bytes;
- :func:`publish` is the only way into ``shards/``: the complete, checked file, fsynced,
  renamed into place, and the rename fsynced; a gzip'd source is published as the tar
  inside it (:func:`publish_gunzipped`), decompressed within the budget.
"""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..shared.config import format_size
from ..shared.errors import FetchError, ShardError
from ..shared.redact import redact_urls
from ..shared.shard_index import ShardInfo, count_samples, file_facts
from ..shared.tarwalk import GZIP_MAGIC, HEAD_BYTES, file_problem, tar_problem
from .gunzip import gunzip

# How long a download may hold an open connection while waiting for cache space.
HOLD_CONNECTION = 5.0
# Reservations for bodies of unknown length grow in steps of this size.
GROW = 16 << 20
# A download's files are written back every this many bytes as they arrive, so the fsync
# that ends it (while it holds its download slot) waits for the last few MB only.
SYNC_EVERY = 4 << 20
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write or sync refused for space


class Cancelled(Exception):
    """The download was abandoned (shutdown, or the shard left every window)."""


@dataclass
class Progress:
    """What the download's thread writes as the download goes (the main loop only reads it)."""

    etag: str | None = None  # the version the partial file's bytes came with: ETag, else Last-Modified
    last_modified: str | None = None  # the source's Last-Modified date, when it gave one (beside an ETag)
    total: int | None = None  # the shard's size, once the source has said it
    written: int = 0  # bytes in the partial file (and, in a parted download, its parts' files)
    # Bytes this download took from the source, over all its attempts: the agent's download rate
    # counts these, not ``written``, which starts at what a resumed partial held already.
    fetched: int = 0
    expanded: int = 0  # bytes of a gzip'd shard's tar written so far (beside ``written``)
    gzipped: bool = False  # its body starts like gzip: readers wait for the tar, never stream it
    md5: str | None = None  # the MD5 of the source bytes, once hashed
    single: bool = False  # over one connection: the budget could not hold parallel parts
    # A validator the source refused for a part of its own version: parts from it would never end.
    refused: str | None = None
    failing: str | None = None  # the last attempt's failure, while the retries go on (for a reader's status)
    # While the download waits for open files (the agent ran out of them: its fault, not the
    # shard's), what that error says (wdscache.agent.downloads).
    fault: str | None = None
    # The most parts the attempt under way fetches at once: the open files it could claim
    # (wdscache.agent.downloads); None: --download-parts.
    parts: int | None = None
    unended: int | None = None  # the length of a body that came without one, nor its tar's end (see fetch)


@dataclass
class Budget:
    """The budget a download asks for. ``reserve(d, total, timeout)`` is the agent's: it blocks
    until the budget holds ``total`` bytes for ``d`` (True), the timeout passes (False) or the
    download is cancelled (raises :class:`Cancelled`), and sets ``reserved``."""

    reserve: Callable[[Download, int, float | None], bool]
    reserved: int = 0
    # A growing reservation (unknown size, or a gzip'd shard's tar): the bytes the next
    # one must hold at least; the budget may grant less than asked, never less than this.
    needed: int = 0


@dataclass
class Download:
    """One shard being fetched. The agent owns it; a download thread works on it. Its own
    fields are fixed once made, but ``demanded`` and ``cancel`` (the main loop's word to the
    thread); the thread writes ``progress``; ``budget`` is what it asks of the cache."""

    url: str
    partial: Path
    final: Path
    budget: Budget
    progress: Progress = field(default_factory=Progress)
    expected: ShardInfo | None = None  # what a shard index says of the file (checked before publish)
    verify: bool = False  # only ask the source whether the cached copy is still current
    # Hash the source bytes (``md5``) even without an expected MD5; for a revalidation, hash the
    # cached copy when an MD5 may prove it current (wdscache.agent.downloads).
    digest: bool = False
    on_validator: Callable[[Download], None] = lambda d: None  # the thread found the source's validator
    demanded: bool = False  # a reader waits for it
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Fetched:
    size: int  # at the source
    etag: str | None  # its validator: the ETag, else the Last-Modified date (a file: size and mtime)
    stored: int | None = None  # in the cache, when not ``size``: a gzip'd shard is cached decompressed
    last_modified: str | None = None  # the Last-Modified date, when the source gave one


@dataclass(frozen=True)
class Gone:
    """The source answered that the object is not there (HTTP 404 or 410, S3's NoSuchKey, no such
    file): a final answer, unlike one that could not be had. A cached copy of it is no longer the
    source's (never served once known: see :mod:`wdscache.agent.opens`)."""

    reason: str


@dataclass(frozen=True)
class Unknown:
    """The source could not say what it holds now (no answer, an error status such as an expired
    signature's 403, no size): ``reason`` says why, for the operator."""

    reason: str


class DiskFull(FetchError):
    """The cache's file system refused a write (ENOSPC, quota, file size limit)."""


class BadShard(FetchError):
    """The downloaded bytes are no shard its index describes, or not readable as one (another
    sample count, a tar or gzip stream damaged): the shard is bad, not its download, so its
    readers hear a ShardError (the agent's replies say ``corrupt``)."""


class Changed(Exception):
    """A ranged request of a parted download was answered for another version of the object."""


@dataclass(frozen=True)
class Backoff:
    """How failed attempts are retried: up to ``retries`` failures in a row without progress,
    each waited for a random time between half and all of ``backoff * 2 ** (failures - 1)``,
    at most ``backoff_max`` (unless the source named a time)."""

    retries: int
    backoff: float
    backoff_max: float

    def delay(self, failures: int) -> float:
        cap = min(self.backoff_max, self.backoff * 2 ** (failures - 1))
        return random.uniform(cap / 2, cap)


class Retry(Exception):
    """Try again after ``delay`` (None: backoff); ``counts`` False for retries that are no failure."""

    def __init__(self, reason: str, delay: float | None = None, *, counts: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.delay, self.counts = reason, delay, counts


def check_tar_head(d: Download, fd: int, pending: bytes) -> None:
    # Checked as soon as 64 KiB arrive, so a wrong body is refused early, not after 1 GB.
    head = os.pread(fd, HEAD_BYTES, 0) + pending
    d.progress.gzipped = head.startswith(GZIP_MAGIC)
    problem = tar_problem(head[:HEAD_BYTES])
    if problem:
        raise FetchError(d.url, problem, permanent=True)


def _check_count(d: Download, tar: Path) -> None:
    """The samples of ``d``'s complete tar are those its shard index gives: the sequence of an
    epoch is built on that count before the shard is read. The bytes are the ones the index
    describes (size and MD5 checked), so another copy would not help: the shard fails."""
    assert d.expected is not None
    try:
        problem = d.expected.count_mismatch(count_samples(tar, url=d.url))
    except ShardError as exc:
        problem = f"not a readable tar: {exc.reason}" + (f" (at byte {exc.offset})" if exc.offset is not None else "")
    if problem:
        raise BadShard(d.url, problem, permanent=True)


def check_announced(d: Download, total: int) -> None:
    """The size the source announces before its body (a Content-Length, a Content-Range's
    total, S3's ContentLength, a file's stat), against the one ``d``'s shard index gives.
    Another size is another shard, and a second copy would be no different: the shard
    fails at once (FetchError, permanent), before a byte of its body is downloaded."""
    indexed = d.expected.filesize if d.expected is not None else None
    if indexed is not None and total != indexed:
        raise FetchError(
            d.url,
            f"the source is {total} bytes, but the shard index says {indexed}: the shard "
            "changed since it was indexed; run 'wdscache index' again to make a new index",
            permanent=True,
        )


def reserve_holding(d: Download, total: int, let_go: Callable[[], None]) -> bool:
    """Reserve ``total`` bytes for ``d`` while holding its connection, for a short while; then
    ``let_go`` of the connection (waiting for space could take long) and wait: False."""
    if d.budget.reserve(d, total, HOLD_CONNECTION):
        return True
    let_go()
    d.budget.reserve(d, total, None)
    return False


def sync_part(d: Download, fd: int, path: Path, sync: Callable[[int], None]) -> None:
    """As :func:`sync_partial`, for a part's file: a failed write-back loses the file."""
    try:
        sync(fd)
    except OSError as exc:
        truncate(path) if path == d.partial else path.unlink(missing_ok=True)
        if exc.errno in DISK_FULL_ERRNOS:
            raise disk_full(d, exc) from exc
        raise


def write_all(d: Download, fd: int, data: bytes) -> int:
    """Write all of ``data`` at the end of ``fd``; returns its length. A write the file
    system refuses for space is DiskFull for ``d``."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError as exc:
            if exc.errno in DISK_FULL_ERRNOS:
                raise disk_full(d, exc) from exc
            raise
        view = view[n:]
    return len(data)


def _sync_tar(d: Download, fd: int, sync: Callable[[int], None]) -> None:
    try:
        sync(fd)
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise disk_full(d, exc) from exc
        raise


def disk_full(d: Download, exc: OSError) -> DiskFull:
    return DiskFull(d.url, f"cannot write the cache: {os.strerror(exc.errno or 0)}")


def sync_partial(d: Download, fd: int, sync: Callable[[int], None]) -> None:
    """Write the partial file back to disk. A failed write-back may have lost pages already
    written, and a later sync would not say so: the partial file is never resumed from."""
    try:
        sync(fd)
    except OSError as exc:
        truncate(d.partial)
        if exc.errno in DISK_FULL_ERRNOS:  # some file systems take the space only now
            raise disk_full(d, exc) from exc
        raise


def write_body(d: Download, chunks: Iterable[bytes], total: int | None, *, check_head: bool) -> None:
    """Append ``chunks`` to ``d``'s partial file within its reservation (asking for more as a body
    of unknown size grows), its tar head checked when ``check_head``; synced every SYNC_EVERY
    bytes and at the end. Raises FetchError past ``total``, Cancelled once cancelled."""
    fd = os.open(d.partial, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    synced = d.progress.written
    try:
        for chunk in chunks:
            if not chunk:
                continue
            if total is not None and d.progress.written + len(chunk) > total:
                raise FetchError(d.url, f"server sent more than its Content-Length ({total})")
            if total is None and d.progress.written + len(chunk) > d.budget.reserved:
                # Asks for a step ahead; the budget grants what it can spare, at least this chunk.
                d.budget.needed = d.progress.written + len(chunk)
                d.budget.reserve(d, d.budget.needed + GROW, None)
            if check_head and d.progress.written < HEAD_BYTES <= d.progress.written + len(chunk):
                check_tar_head(d, fd, chunk)
            n = write_all(d, fd, chunk)
            d.progress.written += n
            d.progress.fetched += n
            if d.cancel.is_set():  # checked after the write: bytes received are kept for a resume
                raise Cancelled(d.url)
            if d.progress.written - synced >= SYNC_EVERY:
                sync_partial(d, fd, getattr(os, "fdatasync", os.fsync))  # no fdatasync on macOS
                synced = d.progress.written
        if check_head and d.progress.written < HEAD_BYTES:
            check_tar_head(d, fd, b"")
        sync_partial(d, fd, os.fsync)
    finally:
        os.close(fd)


def expected_problem(d: Download) -> str | None:
    """Why ``d``'s complete partial file is not the shard its index describes (None: it is,
    or there is no index). Hashes the file when an MD5 is expected or ``d.digest`` asks."""
    want_md5 = d.digest or (d.expected is not None and d.expected.md5 is not None)
    if d.expected is None and not want_md5:
        return None
    size, d.progress.md5 = file_facts(d.partial, md5=want_md5)
    return d.expected.mismatch(size, d.progress.md5) if d.expected is not None else None


def truncate(path: Path) -> None:
    """Start ``path`` over, empty, as a new file: a worker reading the old one by its
    descriptor keeps the old bytes and never sees new bytes at offsets it already knows."""
    path.unlink(missing_ok=True)
    with open(path, "wb"):
        pass


def short(exc: BaseException) -> str:
    """``exc``'s text, its URLs redacted, cut to 200 characters (after the redaction: a cut before
    it may drop the "@" that ends a URL's user info, and the secret would show)."""
    text = redact_urls(str(exc))
    return text if len(text) < 200 else text[:197] + "..."


def publish_gunzipped(d: Download) -> int:
    """Publish the tar inside ``d``'s complete, gzip'd partial file as the shard; its size.

    The download's reservation covers the compressed file and the tar while both
    exist. Raises BadShard for damaged gzip data, FetchError (permanent) for a tar that is
    not one, or a tar beyond what may be reserved; the tar's file is removed then. The
    gzip'd file stays: :meth:`~wdscache.agent.cache.ShardCache.finish` removes it.
    """
    tar = d.partial.with_name(d.partial.name + "~tar")  # "~" is in no partial file's name
    packed, d.progress.expanded = d.progress.written, 0
    try:
        with open(d.partial, "rb") as src:
            fd = os.open(tar, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                synced = 0
                for piece in gunzip(src.read, url=d.url):
                    if d.cancel.is_set():
                        raise Cancelled(d.url)
                    if packed + d.progress.expanded + len(piece) > d.budget.reserved:
                        _grow_for_tar(d, packed, len(piece))
                    d.progress.expanded += write_all(d, fd, piece)
                    if d.progress.expanded - synced >= SYNC_EVERY:
                        _sync_tar(d, fd, getattr(os, "fdatasync", os.fsync))
                        synced = d.progress.expanded
                problem = file_problem(tar)
                if problem:
                    raise FetchError(d.url, f"gzip'd data is no tar: {problem}", permanent=True)
                _sync_tar(d, fd, os.fsync)
            finally:
                os.close(fd)
        publish(d, tar)
    except ShardError as exc:
        raise BadShard(d.url, f"{exc.reason} (at byte {exc.offset} of the gzip'd file)", permanent=True) from None
    finally:
        tar.unlink(missing_ok=True)  # gone already once published
    # The gzip'd file stays until the index records the shard (ShardCache.finish): a crash in
    # between leaves it beside the tar, and a restart learns the source's size from it.
    return d.progress.expanded


def _grow_for_tar(d: Download, packed: int, piece: int) -> None:
    """Reserve room for ``piece`` more bytes of ``d``'s tar (beside the compressed file)."""
    d.budget.needed = packed + d.progress.expanded + piece  # granted at least this, up to a step ahead
    try:
        d.budget.reserve(d, d.budget.needed + GROW, None)
    except FetchError as exc:
        raise FetchError(
            d.url,
            f"gzip'd shard expands beyond the cache's budget: {format_size(d.progress.expanded + piece)} "
            f"decompressed so far (from {format_size(packed)}); {exc.reason}",
            permanent=True,
        ) from None


def publish(d: Download, path: Path | None = None) -> None:
    """Rename ``path`` (the partial file by default) into place as the shard's file; one whose
    shard index gives another sample count is refused (BadShard)."""
    if d.expected is not None:
        _check_count(d, path or d.partial)
    d.final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.replace(path or d.partial, d.final)
    dir_fd = os.open(d.final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
