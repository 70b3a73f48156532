"""Fetching one shard into the cache: HTTP(S), S3 or local files, with retries and resume.

A download writes ``partial/<name>`` and, only when the shard is complete, has the
size it announced and starts like a tar (or gzip'd tar), fsyncs it and renames it
to ``shards/<xx>/<name>``. So a file under ``shards/`` is always a whole, checked
shard, whatever happens to the process or the connection meanwhile.

A shard whose list came from a shard index has ``Download.expected``: the complete file
is checked against it before anything else (its size, and its MD5 when the index gives
one, hashed in one read of the file). A copy that differs is fetched once more from byte
0; a second one that differs fails the shard for good, the reason naming both values.
Its tar's samples are counted (a walk of its headers) just before it is published: a
count other than the index's fails the shard at once (the same bytes would count the same).

A gzip'd shard (known by its magic bytes, not its name) is cached as the plain tar
inside it: once downloaded, it is decompressed in a stream, a few MB at a time,
into ``partial/<name>~tar``, within the download's budget (grown as the tar grows),
checked, fsynced and renamed into place, and the compressed file is removed. So
workers map every cached shard, and no process holds a whole decompressed shard
in memory. One that expands beyond what the budget can hold, or whose gzip data is
damaged, fails for good and leaves nothing behind.

One :class:`Fetcher` serves all download threads; each thread gets its own
``requests.Session`` (connections are reused within a thread, never shared), and its own
boto3 client for ``s3://`` objects (:mod:`wdscache.shared.s3`: from the process's one session), made on first use.

S3 objects take the HTTP path's steps: the same retry loop and backoff, ranged resumes, budget,
checks and publish. A resume sends ``If-Match`` with the ETag its bytes came with, so an object
replaced meanwhile (HTTP 412) is fetched anew from byte 0, never spliced.

Validators: a shard's version is its ETag, or, from a server that sends none, its
Last-Modified date (for ``file:`` URLs, size and mtime). It is what revalidation
compares and what ``If-Range`` sends on a resume, so a partial file is continued
only while the object is the one its bytes came from. A server with neither
cannot be resumed (the download starts over) and a same-size change on it is not
detected by revalidation.

A shard larger than one part, from a source that answers ranged requests with a
validator, downloads as several ranged parts at once (:mod:`wdscache.agent.parts`); the
partial file stays a contiguous prefix of the shard, and the shard is checked and
published as any other.

A 429 or 503 with ``Retry-After`` (on a GET or a HEAD) holds every next request to
that URL, from any thread, until the time it names.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import logging
import os
import random
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterator
from urllib.parse import unquote, urlsplit

import requests
import urllib3

from ..shared import s3
from ..shared.config import default, format_size, parse_size
from ..shared.errors import FetchError, ShardError
from ..shared.shard_index import ShardInfo, count_samples, file_facts
from .gunzip import gunzip
from .parts import Part, Plan, Stopped, append_side, file_size, remove_side_files, side_files
from ..shared.tarwalk import GZIP_MAGIC, HEAD_BYTES, file_problem, tar_problem

log = logging.getLogger(__name__)

CHUNK = 64 << 10  # small reads: bytes received before a connection breaks are kept
# Reservations for bodies of unknown length grow in steps of this size.
GROW = 16 << 20
# How long a download may hold an open connection while waiting for cache space.
HOLD_CONNECTION = 5.0
# A download's partial file is written back every this many bytes as they arrive, so the
# fsync that ends it (while it holds its download slot) waits for the last few MB only,
# not for the whole shard.
SYNC_EVERY = 4 << 20
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write or sync refused for space
PERMANENT_STATUS = {400, 401, 403, 404, 405, 410, 451}
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
# How long a parted download waits for budget for its size plus one part before it goes on
# over one connection instead (which needs its size only).
PARTS_HOLD = 1.0
# Beyond the read timeout, how long the end of a parted download waits for its other threads.
PARTS_JOIN = 5.0


class Cancelled(Exception):
    """The download was abandoned (shutdown, or the shard left every window)."""


@dataclass
class Download:
    """One shard being fetched. The agent owns it; a download thread works on it.

    ``reserve(d, total, timeout)`` is provided by the agent: it blocks until the
    budget holds ``total`` bytes for this download (True), the timeout passes
    (False) or the download is cancelled (raises :class:`Cancelled`).
    """

    url: str
    partial: Path
    final: Path
    reserve: Callable[["Download", int, float | None], bool]
    etag: str | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    total: int | None = None  # the shard's size, once the source has said it
    written: int = 0
    expanded: int = 0  # bytes of a gzip'd shard's tar written so far (beside its ``written``)
    reserved: int = 0
    demanded: bool = False
    # A growing reservation (unknown size, or a gzip'd shard's tar): the bytes the next
    # one must hold at least; the budget may grant less than asked, never less than this.
    needed: int = 0
    gzipped: bool = False  # its body starts like gzip: readers wait for the tar, never stream it
    verify: bool = False  # only ask the source whether the cached copy is still current
    expected: ShardInfo | None = None  # what a shard index says of the file (checked before publish)
    digest: bool = False  # hash the source bytes (``md5``) even without an expected MD5
    md5: str | None = None  # the MD5 of the source bytes, once hashed
    single: bool = False  # over one connection: the budget could not hold parallel parts
    # A validator the source refused for a part of its own version: parts from it would never end.
    refused: str | None = None
    on_validator: Callable[["Download"], None] = lambda d: None


@dataclass(frozen=True)
class Fetched:
    size: int  # at the source
    etag: str | None
    stored: int | None = None  # in the cache, when not ``size``: a gzip'd shard is cached decompressed


class DiskFull(FetchError):
    """The cache's file system refused a write (ENOSPC, quota, file size limit)."""


class _Changed(Exception):
    """A ranged request of a parted download was answered for another version of the object."""


class _Retry(Exception):
    """Try again after ``delay`` (None: backoff); ``counts`` False for retries that are no failure."""

    def __init__(self, reason: str, delay: float | None = None, *, counts: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.delay, self.counts = reason, delay, counts


class Fetcher:
    """Downloads shards; safe to call from several threads at once."""

    def __init__(
        self,
        *,
        connect_timeout: float = default("connect_timeout"),
        read_timeout: float = default("read_timeout"),
        retries: int = default("retries"),
        backoff: float = default("backoff"),
        backoff_max: float = default("backoff_max"),
        s3_endpoint_url: str | None = default("s3_endpoint_url"),
        download_parts: int = default("download_parts"),
        download_part_size: str = default("download_part_size"),
    ) -> None:
        self.timeout = (connect_timeout, read_timeout)
        self.parts = download_parts
        self.part_size = parse_size(download_part_size, what="--download-part-size")
        self.s3_endpoint_url = s3_endpoint_url
        self.retries, self.backoff, self.backoff_max = retries, backoff, backoff_max
        self._local = threading.local()
        self._not_before: dict[str, float] = {}  # url -> monotonic time a Retry-After holds it until
        self._not_before_lock = threading.Lock()

    def _session(self) -> requests.Session:
        # Created lazily in the thread that uses it: sessions are not shared.
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["User-Agent"] = "wdscache"
        return session

    def _s3(self, url: str) -> s3.S3Client:
        # Like the requests session: one per thread, made in the thread that uses it.
        client = getattr(self._local, "s3", None)
        if client is None:
            try:
                client = self._local.s3 = s3.S3Client(
                    endpoint_url=self.s3_endpoint_url, connect_timeout=self.timeout[0], read_timeout=self.timeout[1])
            except s3.NoClient as exc:
                raise FetchError(url, exc.reason, permanent=True) from None
        return client

    def close_thread(self) -> None:
        """Close the calling thread's sessions and clients (call before the thread ends)."""
        for name in ("session", "s3"):
            held = getattr(self._local, name, None)
            if held is not None:
                held.close()
                setattr(self._local, name, None)

    def _hold(self, url: str, delay: float | None) -> None:
        """A Retry-After of ``delay`` seconds: no request to ``url`` before then."""
        if delay:
            with self._not_before_lock:
                until = time.monotonic() + delay
                self._not_before[url] = max(until, self._not_before.get(url, 0.0))

    def _wait_turn(self, url: str, cancel: threading.Event | None = None) -> None:
        """Wait until a Retry-After that ``url`` gave has passed (raises Cancelled if cancelled)."""
        with self._not_before_lock:
            delay = self._not_before.get(url, 0.0) - time.monotonic()
            if delay <= 0:
                self._not_before.pop(url, None)
                return
        log.info("waiting %.1fs before asking %s again (Retry-After)", delay, url)
        if cancel is None:
            time.sleep(delay)
        elif cancel.wait(delay):
            raise Cancelled(url)

    def describe(self, url: str) -> Fetched | None:
        """Size and version tag of ``url`` now (HEAD or stat); None when it cannot be known.

        The tag is what :meth:`fetch` records: the ETag or else the Last-Modified date,
        or size and mtime for a file.
        """
        parts = urlsplit(url)
        try:
            if parts.scheme == "file":
                st = os.stat(unquote(parts.path))
                return Fetched(st.st_size, f"{st.st_size}-{st.st_mtime_ns}")
            if parts.scheme in ("http", "https"):
                self._wait_turn(url)
                r = self._session().head(url, timeout=self.timeout, allow_redirects=True)
                if r.status_code in RETRY_STATUS:
                    self._hold(url, _retry_after(r.headers.get("Retry-After")))
                length = r.headers.get("Content-Length", "")
                if r.ok and length.isdigit():
                    return Fetched(int(length), validator(r.headers))
            if parts.scheme == "s3":
                return Fetched(*self._s3(url).head(url))
        except (OSError, requests.RequestException, FetchError, s3.Transient):
            pass
        return None

    def fetch(self, d: Download) -> Fetched:
        """Fetch ``d.url`` into ``d.final``. Raises FetchError or Cancelled.

        On any exception the partial file is left for the caller to remove or resume.
        """
        scheme = urlsplit(d.url).scheme
        d.partial.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        size, etag = self._fetch_source(d, scheme)
        problem = self._check_expected(d)
        if problem:  # once more from byte 0: a copy damaged on the way, or a source replaced since
            log.warning("%s: %s; downloading it once more", d.url, problem)
            _truncate(d.partial)
            remove_side_files(d.partial)
            size, etag = self._fetch_source(d, scheme)
            again = self._check_expected(d)
            if again:
                first = "" if again == problem else f"; the first copy had {problem}"
                raise FetchError(d.url, f"{again} (downloaded twice{first})", permanent=True)
        # Again on the whole file: a resumed download skipped the check on its first bytes.
        problem = file_problem(d.partial)
        if problem:
            raise FetchError(d.url, problem, permanent=True)
        with open(d.partial, "rb") as f:
            packed = f.read(2) == GZIP_MAGIC
        if packed:
            return Fetched(size, etag, stored=self._publish_gunzipped(d))
        self._publish(d)
        return Fetched(size, etag)

    def _fetch_source(self, d: Download, scheme: str) -> tuple[int, str | None]:
        """The source's bytes, all of them, into ``d.partial``; the size and validator."""
        if scheme in ("http", "https"):
            size, etag = self._fetch_remote(d, self._http_attempt)
        elif scheme == "s3":
            size, etag = self._fetch_remote(d, self._s3_attempt)
        elif scheme == "file":
            size, etag = self._fetch_file(d)
        elif d.url.startswith("pipe:"):
            size, etag = self._fetch_pipe(d)
        else:
            raise FetchError(d.url, f"cannot fetch scheme {scheme!r}", permanent=True)
        if d.cancel.is_set():
            raise Cancelled(d.url)
        return size, etag

    @staticmethod
    def _check_expected(d: Download) -> str | None:
        """Why ``d``'s complete partial file is not the shard its index describes (None: it is,
        or there is no index). Hashes the file when an MD5 is expected or ``d.digest`` asks."""
        want_md5 = d.digest or (d.expected is not None and d.expected.md5 is not None)
        if d.expected is None and not want_md5:
            return None
        size, d.md5 = file_facts(d.partial, md5=want_md5)
        return d.expected.mismatch(size, d.md5) if d.expected is not None else None

    # -- HTTP and S3 ------------------------------------------------------

    def _fetch_remote(self, d: Download, attempt: Callable[[Download], int]) -> tuple[int, str | None]:
        """Run ``attempt`` (one request, resuming from the partial file) until the shard is
        whole; retries with backoff, counting only consecutive failures without progress."""
        failures = 0
        while True:
            if d.cancel.is_set():
                raise Cancelled(d.url)
            before = d.written = file_size(d.partial)
            try:
                total = attempt(d)
                return total, d.etag
            except _Retry as exc:
                if not exc.counts:
                    continue
                reason, delay = exc.reason, exc.delay
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                    urllib3.exceptions.HTTPError, OSError) as exc:
                reason, delay = f"{type(exc).__name__}: {_short(exc)}", None
            if file_size(d.partial) > before:
                failures = 0  # progress was made: only consecutive failures count
            failures += 1
            if failures > self.retries:
                raise FetchError(d.url, f"gave up after {self.retries} retries: {reason}")
            if delay is None:
                cap = min(self.backoff_max, self.backoff * 2 ** (failures - 1))
                delay = random.uniform(cap / 2, cap)
            log.info("retrying %s in %.1fs (%s)", d.url, delay, reason)
            if d.cancel.wait(delay):
                raise Cancelled(d.url)

    def _http_attempt(self, d: Download) -> int:
        offset = d.written
        if offset and not d.etag:
            # Without a validator we cannot tell whether the object changed since these bytes came:
            # splicing two versions would publish a wrong shard, so start over.
            _truncate(d.partial)
            offset = d.written = 0
        offset, end = self._first_range(d, offset)
        d.written = offset
        headers = {"Accept-Encoding": "identity"}
        if offset or end is not None:
            headers["Range"] = f"bytes={offset}-{'' if end is None else end - 1}"
        if offset:
            headers["If-Range"] = d.etag  # an ETag or an HTTP date: both are valid here
        self._wait_turn(d.url, d.cancel)
        with self._session().get(d.url, headers=headers, stream=True, timeout=self.timeout) as r:
            status = r.status_code
            if status in PERMANENT_STATUS:
                raise FetchError(d.url, f"HTTP {status} {r.reason}", status=status, permanent=True)
            if status in RETRY_STATUS:
                delay = _retry_after(r.headers.get("Retry-After"))
                self._hold(d.url, delay)
                raise _Retry(f"HTTP {status} {r.reason}", delay)
            if status == 416 and offset:
                if _unsatisfiable_size(r.headers.get("Content-Range", "")) == offset and d.etag:
                    # Nothing past our bytes, of the version If-Range named: the partial kept
                    # was whole already (cancelled after its last byte came). Checked as any.
                    d.total = offset
                    _reserve_holding(d, offset, r.close)
                    return offset
                _truncate(d.partial)  # our partial is not a prefix of this object
                raise _Retry("HTTP 416 on resume; starting over", 0.0)
            if status == 206 and "Range" in headers:
                start, total = _content_range(r.headers.get("Content-Range", ""))
                if start != offset:
                    _truncate(d.partial)
                    raise _Retry("server resumed at the wrong offset; starting over", 0.0)
                if end is not None and total is None:
                    d.single = True  # a part's answer without the shard's size: one request for it all
                    raise _Retry("server sent no size with its range; using one connection", 0.0, counts=False)
            elif status == 200:
                remove_side_files(d.partial)  # an answer from byte 0: the object may have changed
                if offset:
                    log.info("%s: server ignored the Range request; downloading from the start", d.url)
                    _truncate(d.partial)
                    offset = d.written = 0
                length = r.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
            else:
                raise FetchError(d.url, f"unexpected HTTP {status} {r.reason}", status=status, permanent=True)
            etag = validator(r.headers)
            if etag and etag != d.etag:
                d.etag = etag
                d.on_validator(d)  # recorded in the index, so a restart can resume safely
            if end is not None and status == 206 and _parts_can_name(etag, d) and total > end:
                first = iter(lambda: r.raw.read1(CHUNK, decode_content=False), b"")
                return self._parted(d, Part(offset, end), total, first, r.close, self._http_range)
            if total is not None:
                d.total = total
                if not _reserve_holding(d, total, r.close):
                    raise _Retry("waited for cache space", 0.0, counts=False)
            # The bytes as stored: a server's Content-Encoding is not ours to undo. read1 returns
            # what has arrived (up to CHUNK), so a cancel leaves few received bytes unwritten.
            body = iter(lambda: r.raw.read1(CHUNK, decode_content=False), b"")
            self._write_body(d, body, total, check_head=offset == 0)
            if total is not None and d.written != total:
                raise _Retry(f"got {d.written} of {total} bytes")
            return d.written

    def _s3_attempt(self, d: Download) -> int:
        offset = d.written
        if offset and not d.etag:
            _truncate(d.partial)  # as for HTTP: bytes of an unknown version are never continued
            offset = d.written = 0
        client = self._s3(d.url)
        offset, end = self._first_range(d, offset)
        d.written = offset
        try:
            body = client.get(d.url, offset=offset, end=end, if_match=d.etag if offset else None, chunk=CHUNK)
        except s3.Changed:
            _truncate(d.partial)  # the object was replaced since our bytes came
            raise _Retry("the object changed since the partial copy was made (If-Match: HTTP 412); "
                         "starting over", 0.0) from None
        except s3.Unsatisfiable:
            if offset and self._s3_head(client, d.url) == (offset, d.etag):
                # The partial kept was whole already (cancelled after its last byte came).
                d.total = offset
                d.reserve(d, offset, None)
                return offset
            _truncate(d.partial)
            raise _Retry("HTTP 416 on resume; starting over", 0.0) from None
        except s3.Transient as exc:
            raise _Retry(exc.reason) from None
        try:
            if not body.ranged:
                remove_side_files(d.partial)
            if offset and not body.ranged:
                log.info("%s: server ignored the Range request; downloading from the start", d.url)
                _truncate(d.partial)
                offset = d.written = 0
            elif body.ranged and body.start != offset:
                _truncate(d.partial)
                raise _Retry("server resumed at the wrong offset; starting over", 0.0)
            if body.etag and body.etag != d.etag:
                d.etag = body.etag
                d.on_validator(d)  # recorded in the index, so a restart can resume safely
            if end is not None and body.ranged and _parts_can_name(body.etag, d) and body.total > end:
                return self._parted(d, Part(offset, end), body.total, _s3_chunks(body.chunks), body.close,
                                    self._s3_range)
            d.total = body.total
            if not _reserve_holding(d, body.total, body.close):
                raise _Retry("waited for cache space", 0.0, counts=False)
            self._write_body(d, body.chunks, body.total, check_head=offset == 0)
        except s3.Transient as exc:
            raise _Retry(exc.reason) from None
        finally:
            body.close()
        if d.written != body.total:
            raise _Retry(f"got {d.written} of {body.total} bytes")
        return d.written

    @staticmethod
    def _s3_head(client: s3.S3Client, url: str) -> tuple[int, str | None] | None:
        try:
            return client.head(url)
        except (FetchError, s3.Transient):
            return None

    # -- parallel ranged parts (wdscache.agent.parts) ---------------------

    def _first_range(self, d: Download, offset: int) -> tuple[int, int | None]:
        """Where the first request of an attempt starts and ends (None: it asks for the whole
        rest) when the shard may come in parts. A side file kept from earlier that starts
        where the partial file ends is appended to it first, and the request stops before
        the next one, so no byte is fetched twice. Side files are removed when unusable."""
        if self.parts < 2 or d.single or not offset:
            remove_side_files(d.partial)  # only resumed beside the prefix they belong to
            return offset, None if self.parts < 2 or d.single else self.part_size
        end = None
        for start, stop, path in side_files(d.partial):
            if start == offset and end is None:
                offset += append_side(d.partial, path, offset)
                if offset < stop:
                    end = stop  # the rest of that part comes first
            elif start > offset:
                return offset, min(end or offset + self.part_size, start)
        return offset, end or offset + self.part_size

    def _parted(self, d: Download, head: Part, total: int, first: Iterator[bytes], let_go: Callable[[], None],
                open_range: Callable[[Download, int, int, int], ContextManager[Iterator[bytes]]]) -> int:
        """Fetch ``d`` as parts, the first (``head``) from the answer ``first`` that gave its size."""
        d.total = total
        plan = Plan(d.partial, total, head, self.part_size, lambda n: setattr(d, "written", d.written + n))
        d.written = plan.held
        need = total + plan.largest  # an append holds a part's bytes twice for a moment
        try:
            granted = d.reserve(d, need, PARTS_HOLD)
        except FetchError:  # more than the whole cache
            granted = False
        if not granted:
            # One connection needs the shard's size only: this answer's bytes are kept, and the
            # next request asks for the whole rest.
            log.info("%s: the cache cannot hold %s for parallel parts now; using one connection",
                     d.url, format_size(need))
            d.single = True
            remove_side_files(d.partial)
            d.written = head.start
            if not _reserve_holding(d, total, let_go):
                raise _Retry("waited for cache space", 0.0, counts=False)
            self._write_body(d, first, head.end, check_head=head.start == 0)
            if d.written != head.end:
                raise _Retry(f"got {d.written} of {head.end} bytes")
            raise _Retry("going on over one connection", 0.0, counts=False)
        helpers = [threading.Thread(target=self._part_thread, args=(d, plan, open_range), daemon=True,
                                    name=f"{threading.current_thread().name}-part{i}")
                   for i in range(1, min(self.parts, plan.pending + 1))]
        for t in helpers:
            t.start()
        try:
            self._fetch_part(d, plan, head, open_range, first)
            plan.finish(head)
            self._take_parts(d, plan, open_range)
        except BaseException as exc:  # noqa: BLE001 (kept as the plan's error, raised below)
            plan.abort(exc)
        finally:
            self._join_parts(d, plan, helpers)
        error = plan.error
        if isinstance(error, _Changed):
            _truncate(d.partial)
            remove_side_files(d.partial)
            d.refused = d.etag  # if the object comes back unchanged, its parts come over one connection
            raise _Retry(f"{error}; the object changed during the download, starting over", 0.0)
        if isinstance(error, Stopped):  # stopped for a reason another thread did not keep
            raise Cancelled(d.url)
        if error is not None:
            raise error
        if not plan.complete:
            raise _Retry(f"parts ended at byte {plan.prefix} of {total}")
        return total

    def _part_thread(self, d: Download, plan: Plan, open_range) -> None:
        try:
            self._take_parts(d, plan, open_range)
        except BaseException as exc:  # noqa: BLE001 (the download's thread raises it)
            plan.abort(exc)
        finally:
            self.close_thread()

    def _take_parts(self, d: Download, plan: Plan, open_range) -> None:
        while (part := plan.take()) is not None:
            self._fetch_part(d, plan, part, open_range)
            plan.finish(part)

    def _join_parts(self, d: Download, plan: Plan, helpers: list[threading.Thread]) -> None:
        """Wait for ``helpers``; once the download stops, for at most a read timeout and a bit."""
        deadline = None
        for t in helpers:
            while t.is_alive():
                t.join(0.1)
                if deadline is None and (d.cancel.is_set() or plan.stop.is_set()):
                    plan.stop.set()
                    deadline = time.monotonic() + self.timeout[1] + PARTS_JOIN
                if deadline is not None and time.monotonic() > deadline:
                    log.warning("%s: a part's thread did not stop in time", d.url)
                    return

    def _fetch_part(self, d: Download, plan: Plan, part: Part, open_range,
                    first: Iterator[bytes] | None = None) -> None:
        """Fetch the rest of ``part`` (from ``first``, an answer already open, then by ranged
        requests), retrying with backoff; only consecutive failures without progress count."""
        failures = 0
        while part.have < part.size:
            _check(d, plan)
            before = part.have
            try:
                if first is not None:
                    chunks, first = first, None
                    self._write_part(d, plan, part, chunks)
                else:
                    with open_range(d, part.start + part.have, part.end, plan.total) as chunks:
                        self._write_part(d, plan, part, chunks)
                if part.have == part.size:
                    return
                raise _Retry(f"got {part.have} of {part.size} bytes")
            except _Retry as exc:
                reason, delay = exc.reason, exc.delay
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                    urllib3.exceptions.HTTPError, OSError) as exc:
                reason, delay = f"{type(exc).__name__}: {_short(exc)}", None
            if part.have > before:
                failures = 0
            failures += 1
            span = f"bytes {part.start}-{part.end - 1}"
            if failures > self.retries:
                raise FetchError(d.url, f"gave up after {self.retries} retries of {span}: {reason}")
            if delay is None:
                cap = min(self.backoff_max, self.backoff * 2 ** (failures - 1))
                delay = random.uniform(cap / 2, cap)
            log.info("retrying %s of %s in %.1fs (%s)", span, d.url, delay, reason)
            deadline = time.monotonic() + delay
            while (left := deadline - time.monotonic()) > 0:
                plan.stop.wait(min(left, 0.1))
                _check(d, plan)

    def _write_part(self, d: Download, plan: Plan, part: Part, chunks: Iterator[bytes]) -> None:
        """Append ``chunks`` to ``part``'s file (the partial file, or its side file)."""
        path = d.partial if part.side is None else part.side
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            if os.fstat(fd).st_size != (part.start if part.side is None else 0) + part.have:
                raise _Changed(f"{path.name} is not as the download left it")
            synced = part.have
            for chunk in chunks:
                if not chunk:
                    continue
                at = part.start + part.have
                if part.have + len(chunk) > part.size:
                    raise FetchError(d.url, f"server sent more than the bytes {part.start}-{part.end - 1} asked for")
                if part.side is None and at < HEAD_BYTES <= at + len(chunk):
                    self._check_head(d, fd, chunk)
                _check(d, plan)  # before the write: nothing is written once the download stops
                plan.wrote(part, _write_all(d, fd, chunk))
                if part.have - synced >= SYNC_EVERY:
                    _sync_part(d, fd, path, getattr(os, "fdatasync", os.fsync))
                    synced = part.have
            _sync_part(d, fd, path, os.fsync)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _http_range(self, d: Download, start: int, end: int, total: int) -> Iterator[Iterator[bytes]]:
        """The body of bytes ``start`` to ``end`` of the version ``d.etag`` names."""
        headers = {"Accept-Encoding": "identity", "Range": f"bytes={start}-{end - 1}", "If-Range": d.etag}
        self._wait_turn(d.url, d.cancel)
        with self._session().get(d.url, headers=headers, stream=True, timeout=self.timeout) as r:
            status = r.status_code
            if status in PERMANENT_STATUS:
                raise FetchError(d.url, f"HTTP {status} {r.reason} for bytes {start}-{end - 1}", status=status,
                                 permanent=True)
            if status in RETRY_STATUS:
                delay = _retry_after(r.headers.get("Retry-After"))
                self._hold(d.url, delay)
                raise _Retry(f"HTTP {status} {r.reason}", delay)
            got = _content_range(r.headers.get("Content-Range", "")) if status == 206 else None
            if got != (start, total) or validator(r.headers) != d.etag:
                raise _Changed(f"bytes {start}-{end - 1} came as HTTP {status} "
                               f"({r.headers.get('Content-Range') or 'no range'}, {validator(r.headers)})")
            yield iter(lambda: r.raw.read1(CHUNK, decode_content=False), b"")

    @contextlib.contextmanager
    def _s3_range(self, d: Download, start: int, end: int, total: int) -> Iterator[Iterator[bytes]]:
        try:
            body = self._s3(d.url).get(d.url, offset=start, end=end, if_match=d.etag, chunk=CHUNK)
        except (s3.Changed, s3.Unsatisfiable) as exc:
            raise _Changed(f"bytes {start}-{end - 1}: {type(exc).__name__}") from None
        except s3.Transient as exc:
            raise _Retry(exc.reason) from None
        try:
            if not body.ranged or body.start != start or body.total != total or body.etag != d.etag:
                raise _Changed(f"bytes {start}-{end - 1} came as another range or version ({body.etag})")
            yield _s3_chunks(body.chunks)
        finally:
            body.close()

    # -- local files ------------------------------------------------------

    def _fetch_file(self, d: Download) -> tuple[int, str | None]:
        src = Path(unquote(urlsplit(d.url).path))
        try:
            with open(src, "rb") as f:
                st = os.fstat(f.fileno())
                total = st.st_size
                offset = file_size(d.partial)
                tag = f"{st.st_size}-{st.st_mtime_ns}"
                if offset > total or (offset and d.etag != tag):
                    _truncate(d.partial)  # the file changed since the partial copy was made
                    offset = 0
                if d.etag != tag:
                    d.etag = tag
                    d.on_validator(d)
                d.written = offset
                d.total = total
                d.reserve(d, total, None)
                f.seek(offset)
                self._write_body(d, iter(lambda: f.read(CHUNK), b""), total, check_head=offset == 0)
        except FileNotFoundError:
            raise FetchError(d.url, f"no such file: {src}", permanent=True) from None
        except PermissionError:
            raise FetchError(d.url, f"permission denied: {src}", permanent=True) from None
        if d.written != total:
            raise FetchError(d.url, f"file changed while copying ({d.written} of {total} bytes)")
        return total, f"{st.st_size}-{st.st_mtime_ns}"

    # -- pipe: sources (only listed when the agent runs with --allow-pipe) --

    def _fetch_pipe(self, d: Download) -> tuple[int, str | None]:
        _truncate(d.partial)  # a command's output cannot be resumed
        d.written = 0
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(d.url[len("pipe:"):], shell=True, stdout=subprocess.PIPE, stderr=err,
                                    stdin=subprocess.DEVNULL)
            assert proc.stdout is not None
            try:
                self._write_body(d, iter(lambda: proc.stdout.read(CHUNK), b""), None, check_head=True)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.stdout.close()
                rc = proc.wait(10)
            if rc != 0:
                err.seek(0)
                msg = err.read()[-500:].decode(errors="replace").strip()
                raise FetchError(d.url, f"command exited with status {rc}: {msg}")
        return d.written, None

    # -- common -----------------------------------------------------------

    def _write_body(self, d: Download, chunks, total: int | None, *, check_head: bool) -> None:
        fd = os.open(d.partial, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        synced = d.written
        try:
            for chunk in chunks:
                if not chunk:
                    continue
                if total is not None and d.written + len(chunk) > total:
                    raise FetchError(d.url, f"server sent more than its Content-Length ({total})")
                if total is None and d.written + len(chunk) > d.reserved:
                    # Asks for a step ahead; the budget grants what it can spare, at least this chunk.
                    d.needed = d.written + len(chunk)
                    d.reserve(d, d.needed + GROW, None)
                if check_head and d.written < HEAD_BYTES <= d.written + len(chunk):
                    self._check_head(d, fd, chunk)
                d.written += _write_all(d, fd, chunk)
                if d.cancel.is_set():  # checked after the write: bytes received are kept for a resume
                    raise Cancelled(d.url)
                if d.written - synced >= SYNC_EVERY:
                    _sync(d, fd, getattr(os, "fdatasync", os.fsync))  # no fdatasync on macOS
                    synced = d.written
            if check_head and d.written < HEAD_BYTES:
                self._check_head(d, fd, b"")
            _sync(d, fd, os.fsync)
        finally:
            os.close(fd)

    @staticmethod
    def _check_head(d: Download, fd: int, pending: bytes) -> None:
        # Checked as soon as 64 KiB arrive, so a wrong body is refused early, not after 1 GB.
        head = os.pread(fd, HEAD_BYTES, 0) + pending
        d.gzipped = head.startswith(GZIP_MAGIC)
        problem = tar_problem(head[:HEAD_BYTES])
        if problem:
            raise FetchError(d.url, problem, permanent=True)

    def _publish_gunzipped(self, d: Download) -> int:
        """Publish the tar inside ``d``'s complete, gzip'd partial file as the shard; its size.

        The download's reservation covers the compressed file and the tar while both
        exist. Raises FetchError (permanent) for damaged gzip data, a tar that is not
        one, or a tar beyond what may be reserved; the tar's file is removed then.
        """
        tar = d.partial.with_name(d.partial.name + "~tar")  # "~" is in no partial file's name
        packed, d.expanded = d.written, 0
        try:
            with open(d.partial, "rb") as src:
                fd = os.open(tar, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    synced = 0
                    for piece in gunzip(src.read, url=d.url):
                        if d.cancel.is_set():
                            raise Cancelled(d.url)
                        if packed + d.expanded + len(piece) > d.reserved:
                            self._grow_for_tar(d, packed, len(piece))
                        d.expanded += _write_all(d, fd, piece)
                        if d.expanded - synced >= SYNC_EVERY:
                            _sync_tar(d, fd, getattr(os, "fdatasync", os.fsync))
                            synced = d.expanded
                    problem = file_problem(tar)
                    if problem:
                        raise FetchError(d.url, f"gzip'd data is no tar: {problem}", permanent=True)
                    _sync_tar(d, fd, os.fsync)
                finally:
                    os.close(fd)
            self._publish(d, tar)
        except ShardError as exc:
            raise FetchError(d.url, f"{exc.reason} (at byte {exc.offset} of the gzip'd file)", permanent=True) from None
        finally:
            tar.unlink(missing_ok=True)  # gone already once published
        d.partial.unlink()  # after the rename: a crash in between leaves a published shard
        return d.expanded

    @staticmethod
    def _grow_for_tar(d: Download, packed: int, piece: int) -> None:
        """Reserve room for ``piece`` more bytes of ``d``'s tar (beside the compressed file)."""
        d.needed = packed + d.expanded + piece  # granted at least this, up to a step ahead
        try:
            d.reserve(d, d.needed + GROW, None)
        except FetchError as exc:
            raise FetchError(
                d.url, f"gzip'd shard expands beyond the cache's budget: {format_size(d.expanded + piece)} "
                f"decompressed so far (from {format_size(packed)}); {exc.reason}", permanent=True,
            ) from None

    @staticmethod
    def _publish(d: Download, path: Path | None = None) -> None:
        """Rename ``path`` (the partial file by default) into place as the shard's file; one whose
        shard index gives another sample count is refused (FetchError, permanent)."""
        if d.expected is not None:
            _check_count(d, path or d.partial)
        d.final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.replace(path or d.partial, d.final)
        dir_fd = os.open(d.final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)


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
        raise FetchError(d.url, problem, permanent=True)


def _reserve_holding(d: Download, total: int, let_go: Callable[[], None]) -> bool:
    """Reserve ``total`` bytes for ``d`` while holding its connection, for a short while; then
    ``let_go`` of the connection (waiting for space could take long) and wait: False."""
    if d.reserve(d, total, HOLD_CONNECTION):
        return True
    let_go()
    d.reserve(d, total, None)
    return False


def _parts_can_name(tag: str | None, d: Download) -> bool:
    """Whether ranged parts may name version ``tag`` in their requests: a strong validator
    (a weak ETag never matches ``If-Range``) that the source has not refused already."""
    return bool(tag) and not tag.startswith("W/") and tag != d.refused


def _check(d: Download, plan: Plan) -> None:
    if d.cancel.is_set():
        raise Cancelled(d.url)
    if plan.stop.is_set():
        raise Stopped(d.url)


def _s3_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` with a broken read as :class:`_Retry`, as the part's retry loop knows it."""
    try:
        yield from chunks
    except s3.Transient as exc:
        raise _Retry(exc.reason) from None


def _sync_part(d: Download, fd: int, path: Path, sync: Callable[[int], None]) -> None:
    """As :func:`_sync`, for a part's file: a failed write-back loses the file."""
    try:
        sync(fd)
    except OSError as exc:
        _truncate(path) if path == d.partial else path.unlink(missing_ok=True)
        if exc.errno in DISK_FULL_ERRNOS:
            raise _disk_full(d, exc) from exc
        raise


def _write_all(d: Download, fd: int, data: bytes) -> int:
    """Write all of ``data`` at the end of ``fd``; returns its length. A write the file
    system refuses for space is DiskFull for ``d``."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError as exc:
            if exc.errno in DISK_FULL_ERRNOS:
                raise _disk_full(d, exc) from exc
            raise
        view = view[n:]
    return len(data)


def _sync_tar(d: Download, fd: int, sync: Callable[[int], None]) -> None:
    try:
        sync(fd)
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise _disk_full(d, exc) from exc
        raise


def _disk_full(d: Download, exc: OSError) -> DiskFull:
    return DiskFull(d.url, f"cannot write the cache: {os.strerror(exc.errno or 0)}")


def _sync(d: Download, fd: int, sync: Callable[[int], None]) -> None:
    """Write the partial file back to disk. A failed write-back may have lost pages already
    written, and a later sync would not say so: the partial file is never resumed from."""
    try:
        sync(fd)
    except OSError as exc:
        _truncate(d.partial)
        if exc.errno in DISK_FULL_ERRNOS:  # some file systems take the space only now
            raise _disk_full(d, exc) from exc
        raise


def _truncate(path: Path) -> None:
    """Start ``path`` over, empty, as a new file: a worker reading the old one by its
    descriptor keeps the old bytes and never sees new bytes at offsets it already knows."""
    path.unlink(missing_ok=True)
    with open(path, "wb"):
        pass


def validator(headers) -> str | None:
    """The version a response names: its ETag, else its Last-Modified date (None: neither)."""
    return headers.get("ETag") or headers.get("Last-Modified") or None


def same_version(old: str | None, new: str | None) -> bool | None:
    """Whether two validators name one version; None when they cannot be compared (one is
    missing, or one is an ETag and the other a date: the server changed what it sends)."""
    if not old or not new or _is_etag(old) != _is_etag(new):
        return None
    return old == new


def validator_kind(value: str) -> str:
    """What a validator is, for messages: "ETag", "Last-Modified", or "size-mtime" (a file)."""
    if _is_etag(value):
        return "ETag"
    try:
        email.utils.parsedate_to_datetime(value)
        return "Last-Modified"
    except (TypeError, ValueError):
        return "size-mtime"


def _is_etag(value: str) -> bool:
    return value.startswith(('"', "W/"))


def _unsatisfiable_size(value: str) -> int | None:
    """The size a 416's ``Content-Range: bytes */SIZE`` gives, if it does."""
    unit, _, rest = value.strip().partition(" ")
    return int(rest[2:]) if unit == "bytes" and rest.startswith("*/") and rest[2:].isdigit() else None


def _content_range(value: str) -> tuple[int, int | None]:
    # "bytes 100-199/1000" -> (100, 1000)
    try:
        unit, rest = value.split(" ", 1)
        span, total = rest.split("/", 1)
        return int(span.split("-", 1)[0]), None if total == "*" else int(total)
    except ValueError:
        return -1, None


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), 600.0)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return min(max(0.0, when - time.time()), 600.0)


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 200 else text[:197] + "..."
