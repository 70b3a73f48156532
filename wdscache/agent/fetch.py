"""Fetching one shard into the cache: HTTP(S), S3 or local files, with retries and resume.

A download writes ``partial/<name>`` and, only when the shard is complete, has the
size it announced and starts like a tar (or gzip'd tar), fsyncs it and renames it
to ``shards/<xx>/<name>``. So a file under ``shards/`` is always a whole, checked
shard, whatever happens to the process or the connection meanwhile.

A shard whose list came from a shard index has ``Download.expected``. A size the source
announces before its body (Content-Length, a Content-Range's total, S3's ContentLength, a
file's stat) other than the index's fails the shard at once, no body read: the data changed
since it was indexed. The complete file is checked against it before anything else (its
size, and its MD5 when the index gives one, hashed in one read of the file). A copy that
differs is fetched once more from byte 0; a second one that differs fails the shard for
good, the reason naming both values.
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
Last-Modified date (for ``file:`` URLs, size and mtime); a server's Last-Modified is
kept beside its ETag too. A resume sends the version its bytes came with (``If-Range``;
S3's ``If-Match``), and every resumed answer, of the one request or of any part, must
carry that very validator (the same ETag, or the same Last-Modified date): an answer
for another version, or with no validator of that kind, starts the download over from
byte 0 with its side files removed, whether or not the server honoured the condition.
So bytes of two versions are never spliced. A server with neither validator cannot be
resumed (the download starts over).

Revalidation (:func:`common_validator`) compares the strongest validator both the cached
copy and the source have (ETag, else Last-Modified); with none in common (the server
changed what it sends, or sends nothing) the copy cannot be told current and is
downloaded again.

A shard larger than one part, from a source that answers ranged requests with a
validator, downloads as several ranged parts at once (:mod:`wdscache.agent.parts`); the
partial file stays a contiguous prefix of the shard, and the shard is checked and
published as any other.

A 429 or 503 with ``Retry-After`` (on a GET or a HEAD) holds every next request to
that URL, from any thread, until the time it names.

A failed attempt is named by its cause (:func:`cause_of`: connection refused, name resolution,
TLS, timed out, ...), in the error, the log and the download's ``failing`` (which a waiting
reader's ``status`` shows). A host that has not answered this agent once, refusing connections,
unknown to DNS or failing TLS (its certificate, or https:// to a port that does not speak it),
is a mistake in the URL far more often than an outage: a download of it that a reader waits
for gives up after ``UNREACHED_RETRIES`` retries (about a second), so the reader hears the
cause at once. A host that answered before, or a prefetch nobody waits for yet (the agent may
start before its server), gets the whole retry budget.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import random
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import requests
import urllib3

from ..shared import s3
from ..shared.config import default, parse_size
from ..shared.errors import FetchError
from ..shared.logs import get_logger
from ..shared.tarwalk import GZIP_MAGIC, file_problem
from .download import (
    Cancelled,
    Changed,
    Download,
    Fetched,
    Retry,
    check_announced,
    expected_problem,
    publish,
    publish_gunzipped,
    reserve_holding,
    short,
    truncate,
    write_body,
)
from .parted import PartedFetch
from .parts import Part, file_size, remove_side_files

log = get_logger(__name__)

CHUNK = 64 << 10  # small reads: bytes received before a connection breaks are kept
PERMANENT_STATUS = {400, 401, 403, 404, 405, 410, 451}
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
# How long a parted download waits for budget for its size plus one part before it goes on
# over one connection instead (which needs its size only).
PARTS_HOLD = 1.0
# Beyond the read timeout, how long the end of a parted download waits for its other threads.
PARTS_JOIN = 5.0
# Retries of a host that never answered this agent and cannot be reached (see the module's docstring).
UNREACHED_RETRIES = 2
CONNECTION_REFUSED = "connection refused"
NAME_RESOLUTION = "name resolution failed"
TLS_VERIFY = "TLS certificate verification failed"
TLS_FAILED = "TLS handshake failed"
UNREACHABLE = (CONNECTION_REFUSED, NAME_RESOLUTION, TLS_VERIFY, TLS_FAILED)


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
        self._parted = PartedFetch(self, download_parts, parse_size(download_part_size, what="--download-part-size"))
        self.s3_endpoint_url = s3_endpoint_url
        self.retries, self.backoff, self.backoff_max = retries, backoff, backoff_max
        self._local = threading.local()
        self._not_before: dict[str, float] = {}  # url -> monotonic time a Retry-After holds it until
        self._not_before_lock = threading.Lock()
        self._answered: set[str] = set()  # hosts (scheme://netloc) that answered an HTTP request

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

        The tag is what :meth:`fetch` records: the ETag or else the Last-Modified date
        (kept beside an ETag too), or size and mtime for a file.
        """
        parts = urlsplit(url)
        try:
            if parts.scheme == "file":
                st = os.stat(unquote(parts.path))
                return Fetched(st.st_size, f"{st.st_size}-{st.st_mtime_ns}")
            if parts.scheme in ("http", "https"):
                self._wait_turn(url)
                r = self._session().head(url, timeout=self.timeout, allow_redirects=True)
                self._answered.add(_host(url))
                if r.status_code in RETRY_STATUS:
                    self._hold(url, _retry_after(r.headers.get("Retry-After")))
                length = r.headers.get("Content-Length", "")
                if r.ok and length.isdigit():
                    return Fetched(int(length), validator(r.headers), last_modified=r.headers.get("Last-Modified"))
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
        problem = expected_problem(d)
        if problem:  # once more from byte 0: a copy damaged on the way, or a source replaced since
            log.warning("%s: %s; downloading it once more", d.url, problem)
            truncate(d.partial)
            remove_side_files(d.partial)
            size, etag = self._fetch_source(d, scheme)
            again = expected_problem(d)
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
            return Fetched(size, etag, stored=publish_gunzipped(d), last_modified=d.last_modified)
        publish(d)
        return Fetched(size, etag, last_modified=d.last_modified)

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
                d.failing = None
                return total, d.etag
            except Retry as exc:
                if not exc.counts:
                    continue
                reason, delay, cause = exc.reason, exc.delay, None
            except FetchError:  # final (a FetchError is an OSError too: not one to retry)
                raise
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                    urllib3.exceptions.HTTPError, OSError) as exc:
                cause = cause_of(exc)
                detail = f"{type(exc).__name__}: {short(exc)}"
                reason, delay = (f"{cause} ({detail})" if cause else detail), None
            if file_size(d.partial) > before:
                failures = 0  # progress was made: only consecutive failures count
            failures += 1
            budget = self.retries
            if cause in UNREACHABLE and d.demanded and _host(d.url) not in self._answered:
                budget = min(budget, UNREACHED_RETRIES)
            d.failing = f"attempt {failures} of {budget + 1} failed: {reason}"
            if failures > budget:
                never = " (the host never answered this agent)" if budget < self.retries else ""
                raise FetchError(d.url, f"gave up after {budget} retries{never}: {reason}")
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
            truncate(d.partial)
            offset = d.written = 0
        offset, end = self._parted.first_range(d, offset)
        d.written = offset
        headers = {"Accept-Encoding": "identity"}
        if offset or end is not None:
            headers["Range"] = f"bytes={offset}-{'' if end is None else end - 1}"
        if offset and d.etag:
            headers["If-Range"] = d.etag  # an ETag or an HTTP date: both are valid here
        self._wait_turn(d.url, d.cancel)
        with self._session().get(d.url, headers=headers, stream=True, timeout=self.timeout) as r:
            self._answered.add(_host(d.url))
            status = r.status_code
            if status in PERMANENT_STATUS:
                raise FetchError(d.url, f"HTTP {status} {r.reason}", status=status, permanent=True)
            if status in RETRY_STATUS:
                delay = _retry_after(r.headers.get("Retry-After"))
                self._hold(d.url, delay)
                raise Retry(f"HTTP {status} {r.reason}", delay)
            if status == 416 and offset:
                if (_unsatisfiable_size(r.headers.get("Content-Range", "")) == offset
                        and not unlike_version(d.etag, r.headers)):
                    # Nothing past our bytes, of the version If-Range named: the partial kept
                    # was whole already (cancelled after its last byte came). Checked as any.
                    check_announced(d, offset)
                    d.total = offset
                    d.last_modified = r.headers.get("Last-Modified") or d.last_modified
                    reserve_holding(d, offset, r.close)
                    return offset
                truncate(d.partial)  # our partial is not a prefix of this object
                raise Retry("HTTP 416 on resume; starting over", 0.0)
            if status == 206 and "Range" in headers:
                start, total = _content_range(r.headers.get("Content-Range", ""))
                if start != offset:
                    truncate(d.partial)
                    raise Retry("server resumed at the wrong offset; starting over", 0.0)
                if offset:
                    # A server may ignore If-Range: the answer itself must name our bytes' version.
                    _resumed_as(d, unlike_version(d.etag, r.headers))
                if end is not None and total is None:
                    d.single = True  # a part's answer without the shard's size: one request for it all
                    raise Retry("server sent no size with its range; using one connection", 0.0, counts=False)
            elif status == 200:
                remove_side_files(d.partial)  # an answer from byte 0: the object may have changed
                if offset:
                    log.info("%s: server ignored the Range request; downloading from the start", d.url)
                    truncate(d.partial)
                    offset = d.written = 0
                length = r.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
            else:
                raise FetchError(d.url, f"unexpected HTTP {status} {r.reason}", status=status, permanent=True)
            if total is not None:
                check_announced(d, total)  # before any byte of the body, and before the parts' plan
            etag = validator(r.headers)
            d.last_modified = r.headers.get("Last-Modified")
            if etag and etag != d.etag:
                d.etag = etag
                d.on_validator(d)  # recorded in the index, so a restart can resume safely
            if end is not None and status == 206 and _parts_can_name(etag, d) and total is not None and total > end:
                first = iter(lambda: r.raw.read1(CHUNK, decode_content=False), b"")
                return self._parted.fetch(d, Part(offset, end), total, first, r.close, self._http_range)
            if total is not None:
                d.total = total
                if not reserve_holding(d, total, r.close):
                    raise Retry("waited for cache space", 0.0, counts=False)
            # The bytes as stored: a server's Content-Encoding is not ours to undo. read1 returns
            # what has arrived (up to CHUNK), so a cancel leaves few received bytes unwritten.
            body = iter(lambda: r.raw.read1(CHUNK, decode_content=False), b"")
            write_body(d, body, total, check_head=offset == 0)
            if total is not None and d.written != total:
                raise Retry(f"got {d.written} of {total} bytes")
            return d.written

    def _s3_attempt(self, d: Download) -> int:
        offset = d.written
        if offset and not d.etag:
            truncate(d.partial)  # as for HTTP: bytes of an unknown version are never continued
            offset = d.written = 0
        client = self._s3(d.url)
        offset, end = self._parted.first_range(d, offset)
        d.written = offset
        try:
            body = client.get(d.url, offset=offset, end=end, if_match=d.etag if offset else None, chunk=CHUNK)
        except s3.Changed:
            truncate(d.partial)  # the object was replaced since our bytes came
            raise Retry("the object changed since the partial copy was made (If-Match: HTTP 412); "
                         "starting over", 0.0) from None
        except s3.Unsatisfiable:
            if offset and _head_or_none(client, d.url) == (offset, d.etag):
                # The partial kept was whole already (cancelled after its last byte came).
                check_announced(d, offset)
                d.total = offset
                d.reserve(d, offset, None)
                return offset
            truncate(d.partial)
            raise Retry("HTTP 416 on resume; starting over", 0.0) from None
        except s3.Transient as exc:
            raise Retry(exc.reason) from None
        try:
            check_announced(d, body.total)  # before any byte of the body, and before the parts' plan
            if not body.ranged:
                remove_side_files(d.partial)
            if offset and not body.ranged:
                log.info("%s: server ignored the Range request; downloading from the start", d.url)
                truncate(d.partial)
                offset = d.written = 0
            elif body.ranged and body.start != offset:
                truncate(d.partial)
                raise Retry("server resumed at the wrong offset; starting over", 0.0)
            elif offset:
                # A store may ignore If-Match: the answer itself must name our bytes' version.
                _resumed_as(d, None if body.etag == d.etag else
                            f"the answer's ETag is {body.etag}, the partial file's {d.etag}" if body.etag else
                            f"the answer has no ETag (the partial file's: {d.etag})")
            if body.etag and body.etag != d.etag:
                d.etag = body.etag
                d.on_validator(d)  # recorded in the index, so a restart can resume safely
            if end is not None and body.ranged and _parts_can_name(body.etag, d) and body.total > end:
                return self._parted.fetch(d, Part(offset, end), body.total, _s3_chunks(body.chunks), body.close,
                                    self._s3_range)
            d.total = body.total
            if not reserve_holding(d, body.total, body.close):
                raise Retry("waited for cache space", 0.0, counts=False)
            write_body(d, body.chunks, body.total, check_head=offset == 0)
        except s3.Transient as exc:
            raise Retry(exc.reason) from None
        finally:
            body.close()
        if d.written != body.total:
            raise Retry(f"got {d.written} of {body.total} bytes")
        return d.written

    # -- parallel ranged parts (wdscache.agent.parts) ---------------------

    @contextlib.contextmanager
    def _http_range(self, d: Download, start: int, end: int, total: int) -> Iterator[Iterator[bytes]]:
        """The body of bytes ``start`` to ``end`` of the version ``d.etag`` names."""
        assert d.etag is not None  # parts are planned only for a version they can name (_parts_can_name)
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
                raise Retry(f"HTTP {status} {r.reason}", delay)
            got = _content_range(r.headers.get("Content-Range", "")) if status == 206 else None
            if got != (start, total) or unlike_version(d.etag, r.headers):
                raise Changed(f"bytes {start}-{end - 1} came as HTTP {status} "
                               f"({r.headers.get('Content-Range') or 'no range'}, {validator(r.headers)})")
            yield iter(lambda: r.raw.read1(CHUNK, decode_content=False), b"")

    @contextlib.contextmanager
    def _s3_range(self, d: Download, start: int, end: int, total: int) -> Iterator[Iterator[bytes]]:
        try:
            body = self._s3(d.url).get(d.url, offset=start, end=end, if_match=d.etag, chunk=CHUNK)
        except (s3.Changed, s3.Unsatisfiable) as exc:
            raise Changed(f"bytes {start}-{end - 1}: {type(exc).__name__}") from None
        except s3.Transient as exc:
            raise Retry(exc.reason) from None
        try:
            if not body.ranged or body.start != start or body.total != total or body.etag != d.etag:
                raise Changed(f"bytes {start}-{end - 1} came as another range or version ({body.etag})")
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
                    truncate(d.partial)  # the file changed since the partial copy was made
                    offset = 0
                if d.etag != tag:
                    d.etag = tag
                    d.on_validator(d)
                d.written = offset
                check_announced(d, total)
                d.total = total
                d.reserve(d, total, None)
                f.seek(offset)
                write_body(d, iter(lambda: f.read(CHUNK), b""), total, check_head=offset == 0)
        except FileNotFoundError:
            raise FetchError(d.url, f"no such file: {src}", permanent=True) from None
        except PermissionError:
            raise FetchError(d.url, f"permission denied: {src}", permanent=True) from None
        if d.written != total:
            raise FetchError(d.url, f"file changed while copying ({d.written} of {total} bytes)")
        return total, f"{st.st_size}-{st.st_mtime_ns}"

    # -- pipe: sources (only listed when the agent runs with --allow-pipe) --

    def _fetch_pipe(self, d: Download) -> tuple[int, str | None]:
        truncate(d.partial)  # a command's output cannot be resumed
        d.written = 0
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(d.url[len("pipe:"):], shell=True, stdout=subprocess.PIPE, stderr=err,
                                    stdin=subprocess.DEVNULL)
            stdout = proc.stdout
            assert stdout is not None
            try:
                write_body(d, iter(lambda: stdout.read(CHUNK), b""), None, check_head=True)
            finally:
                if proc.poll() is None:
                    proc.kill()
                stdout.close()
                rc = proc.wait(10)
            if rc != 0:
                err.seek(0)
                msg = err.read()[-500:].decode(errors="replace").strip()
                raise FetchError(d.url, f"command exited with status {rc}: {msg}")
        return d.written, None

    # -- common -----------------------------------------------------------





def _host(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def cause_of(exc: BaseException) -> str | None:
    """What made a request fail, in a few words (None: nothing more telling than the error):
    the first known cause in the chain of errors ``exc`` wraps (requests wraps urllib3's, which
    wraps the socket's)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError) or "Connection refused" in str(e):
            return CONNECTION_REFUSED
        if isinstance(e, socket.gaierror) or "Name or service not known" in str(e) \
                or "Temporary failure in name resolution" in str(e) or "nodename nor servname" in str(e):
            return NAME_RESOLUTION
        if isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
            return TLS_VERIFY
        if isinstance(e, (ssl.SSLError, requests.exceptions.SSLError)):
            return TLS_FAILED
        if isinstance(e, ConnectionResetError):
            return "connection reset"
        if isinstance(e, (TimeoutError, socket.timeout, requests.Timeout, urllib3.exceptions.TimeoutError)):
            return "timed out"
        todo.extend(x for x in (e.__cause__, e.__context__, getattr(e, "reason", None), *e.args)
                    if isinstance(x, BaseException))
    return None


def _parts_can_name(tag: str | None, d: Download) -> bool:
    """Whether ranged parts may name version ``tag`` in their requests: a strong validator
    (a weak ETag never matches ``If-Range``) that the source has not refused already."""
    return tag is not None and tag != "" and not tag.startswith("W/") and tag != d.refused


def _s3_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` with a broken read as :class:`Retry`, as the part's retry loop knows it."""
    try:
        yield from chunks
    except s3.Transient as exc:
        raise Retry(exc.reason) from None


def validator(headers) -> str | None:
    """The version a response names: its ETag, else its Last-Modified date (None: neither)."""
    return headers.get("ETag") or headers.get("Last-Modified") or None


def unlike_version(held: str | None, headers) -> str | None:
    """Why a response is not of version ``held`` (the validator a partial file's bytes came
    with); None when it carries that very validator: the same ETag, or for a date the same
    Last-Modified. A response without a validator of that kind is not of that version."""
    if not held:
        return "the partial file has no validator"
    kind = "ETag" if _is_etag(held) else "Last-Modified"
    got = headers.get(kind)
    if got == held:
        return None
    return f"the answer's {kind} is {got}, the partial file's {held}" if got else \
        f"the answer has no {kind} (the partial file's: {held})"


def common_validator(old: str | None, old_date: str | None, new: str | None,
                     new_date: str | None) -> tuple[str, str, str] | None:
    """The strongest validator a cached copy (validator ``old``, Last-Modified ``old_date``)
    and the source now (``new``, ``new_date``) both have: the ETag, a file's size and mtime,
    else the Last-Modified date, as (kind, the copy's, the source's); the two are one version
    if those are equal. None when they have none in common (the server changed what it
    sends, or sends nothing): they cannot be compared."""
    mine, theirs = _validators(old, old_date), _validators(new, new_date)
    for kind in ("ETag", "size-mtime", "Last-Modified"):
        if kind in mine and kind in theirs:
            return kind, mine[kind], theirs[kind]
    return None


def _validators(tag: str | None, date: str | None) -> dict[str, str]:
    """The validators a version is known by, by kind."""
    known = {validator_kind(tag): tag} if tag else {}
    if date:
        known.setdefault("Last-Modified", date)
    return known


def _resumed_as(d: Download, problem: str | None) -> None:
    """A resumed answer is continued only for the version the partial file's bytes came with:
    else the partial file and its side files go, and the download starts over from byte 0."""
    if problem is None:
        return
    log.warning("%s: a resumed answer is for another version (%s); downloading it again from byte 0", d.url,
                problem)
    truncate(d.partial)
    remove_side_files(d.partial)
    raise Retry(f"resumed answer for another version ({problem}); starting over", 0.0)


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


def _head_or_none(client: s3.S3Client, url: str) -> tuple[int, str | None] | None:
    """An object's (size, ETag), or None if a HEAD cannot say now."""
    try:
        return client.head(url)
    except (FetchError, s3.Transient):
        return None
