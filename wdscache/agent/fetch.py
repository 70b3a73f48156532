"""Fetching one shard into the cache from any source (:mod:`.sources`), with retries and resume.

A download writes ``partial/<name>`` and, only when the shard is complete, has the
size it announced (sent without one, its tar reaches its end-of-archive marker) and
starts like a tar (or gzip'd tar), fsyncs it and renames it
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

One :class:`Fetcher` serves all download threads. Every source (HTTP(S), S3, a local file,
a ``pipe:`` command) only opens byte ranges (:class:`~.sources.base.Source`); one loop here
serves them all: the attempts, their retries and backoff, the resume, the checks on each
answer, parts, the budget and the writes. What a thread holds (a ``requests.Session``, a
boto3 client) is its own, made on first use.

Validators (:mod:`.validators`): a resume names the version its bytes came with (HTTP's
``If-Range``, S3's ``If-Match``), and every resumed answer, of the one request or of any
part, must carry that very validator: an answer for another version, or with no validator
of that kind, starts the download over from byte 0 with its side files removed, whether or
not the source honoured the condition. So bytes of two versions are never spliced. A
source with no validator cannot be resumed (the download starts over). An answer from byte
0 to a resume (a range ignored, or a file of another version) starts over too; an object
replaced since (S3's 412), or a range past its end that is not exactly the whole partial
file of that version (416), starts over from byte 0.

A shard larger than one part, from a source that answers ranged requests with a
validator, downloads as several ranged parts at once (:mod:`wdscache.agent.parts`); the
partial file stays a contiguous prefix of the shard, and the shard is checked and
published as any other.

A source that names a time to wait (HTTP's ``Retry-After``, :mod:`.sources.http`) has the
next attempt wait that long instead of the backoff.

A failed attempt is named by its cause (:func:`cause_of`: connection refused, name resolution,
TLS, timed out, ...), in the error, the log and the download's ``progress.failing`` (which a waiting
reader's ``status`` shows). A host that has not answered this agent once, refusing connections,
unknown to DNS or failing TLS (its certificate, or https:// to a port that does not speak it),
is a mistake in the URL far more often than an outage: a download of it that a reader waits
for gives up after ``UNREACHED_RETRIES`` retries (about a second), so the reader hears the
cause at once. A host that answered before, or a prefetch nobody waits for yet (the agent may
start before its server), gets the whole retry budget.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator
from urllib.parse import urlsplit

import requests
import urllib3

from ..shared.config import AgentConfig, default, parse_size
from ..shared.errors import FetchError, out_of_files, wrapped_errors
from ..shared.logs import event, get_logger
from ..shared.tarwalk import GZIP_MAGIC, cut_problem, file_problem
from .parted import PartedFetch
from .parts import ByteRange, file_size, remove_side_files
from .shard_download import (
    Backoff,
    Cancelled,
    Changed,
    Download,
    Fetched,
    Gone,
    Retry,
    Unknown,
    check_announced,
    expected_problem,
    publish,
    publish_gunzipped,
    reserve_holding,
    short,
    truncate,
    write_body,
)
from .sources import make_sources
from .sources.base import Replaced, Settings, Source, SourceResponse, Unexpected, Unsatisfiable
from .validators import strong

log = get_logger(__name__)

# Retries of a host that never answered this agent and cannot be reached (see the module's docstring).
UNREACHED_RETRIES = 2
CONNECTION_REFUSED = "connection refused"
NAME_RESOLUTION = "name resolution failed"
TLS_VERIFY = "TLS certificate verification failed"
TLS_FAILED = "TLS handshake failed"
UNREACHABLE = (CONNECTION_REFUSED, NAME_RESOLUTION, TLS_VERIFY, TLS_FAILED)
# What a failed attempt may raise that is worth another: a connection's or a read's error.
RETRIED = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
    OSError,
)


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
        self.settings = Settings(connect_timeout, read_timeout, s3_endpoint_url)
        self._sources = make_sources(self.settings)
        self._backoff = Backoff(retries, backoff, backoff_max)
        self._parted = PartedFetch(
            download_parts,
            parse_size(download_part_size, what="--download-part-size"),
            self._backoff,
            read_timeout,
            self.close_thread,
        )

    @classmethod
    def of(cls, config: AgentConfig) -> Fetcher:
        """The fetcher of an agent with ``config``."""
        return cls(
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            retries=config.retries,
            backoff=config.backoff,
            backoff_max=config.backoff_max,
            s3_endpoint_url=config.s3_endpoint_url,
            download_parts=config.download_parts,
            download_part_size=config.download_part_size,
        )

    def close_thread(self) -> None:
        """Close the calling thread's sessions and clients (call before the thread ends)."""
        for source in set(self._sources.values()):
            source.close_thread()

    def describe(self, url: str) -> Fetched | Gone | Unknown:
        """Size and version tag of ``url`` now (HEAD or stat); Gone when its source has no such
        object; Unknown (with why) when they cannot be known.

        The tag is what :meth:`fetch` records: the ETag or else the Last-Modified date
        (kept beside an ETag too), or size and mtime for a file.
        """
        scheme = urlsplit(url).scheme
        source = self._sources.get(scheme)
        return source.probe(url) if source is not None else Unknown(f"cannot fetch scheme {scheme!r}")

    def describes(self, url: str) -> bool:
        """Whether :meth:`describe` may tell ``url``'s size (not for a ``pipe:`` command)."""
        source = self._sources.get(urlsplit(url).scheme)
        return source is not None and source.describes

    def fetch(self, d: Download) -> Fetched:
        """Fetch ``d.url`` into ``d.final``. Raises FetchError or Cancelled.

        On any exception the partial file is left for the caller to remove or resume.
        """
        scheme = urlsplit(d.url).scheme
        source = self._sources.get(scheme)
        if source is None:
            raise FetchError(d.url, f"cannot fetch scheme {scheme!r}", permanent=True)
        d.partial.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        size, etag = self._fetch_source(d, source)
        problem = expected_problem(d)
        if problem:  # once more from byte 0: a copy damaged on the way, or a source replaced since
            log.warning("%s: %s; downloading it once more", d.url, problem)
            truncate(d.partial)
            remove_side_files(d.partial)
            size, etag = self._fetch_source(d, source)
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
            return Fetched(size, etag, stored=publish_gunzipped(d), last_modified=d.progress.last_modified)
        publish(d)
        return Fetched(size, etag, last_modified=d.progress.last_modified)

    def _fetch_source(self, d: Download, source: Source) -> tuple[int, str | None]:
        """The source's bytes, all of them, into ``d.partial``; the size and validator. Runs
        attempts (one request each, resuming from the partial file) until the shard is whole;
        retries with backoff, counting only consecutive failures without progress."""
        failures = 0
        while True:
            if d.cancel.is_set():
                raise Cancelled(d.url)
            before = d.progress.written = file_size(d.partial)
            try:
                total = self._attempt(d, source)
                d.progress.failing = None
                if d.cancel.is_set():
                    raise Cancelled(d.url)
                return total, d.progress.etag
            except Retry as exc:
                if not exc.counts:
                    continue
                reason, delay, cause = exc.reason, exc.delay, None
            except FetchError:  # final (a FetchError is an OSError too: not one to retry)
                raise
            except RETRIED as exc:
                if out_of_files(exc):  # the agent's fault, not the source's: see wdscache.agent.downloads
                    raise
                cause = cause_of(exc)
                detail = f"{type(exc).__name__}: {short(exc)}"
                reason, delay = (f"{cause} ({detail})" if cause else detail), None
            if file_size(d.partial) > before:
                failures = 0  # progress was made: only consecutive failures count
            failures += 1
            budget = self._backoff.retries
            if cause in UNREACHABLE and d.demanded and not source.answered(d.url):
                budget = min(budget, UNREACHED_RETRIES)
            d.progress.failing = f"attempt {failures} of {budget + 1} failed: {reason}"
            if failures > budget:
                never = " (the host never answered this agent)" if budget < self._backoff.retries else ""
                raise FetchError(d.url, f"gave up after {budget} retries{never}: {reason}")
            if delay is None:
                delay = self._backoff.delay(failures)
            event(
                log,
                "retrying",
                "retrying %s in %.1fs (%s)",
                d.url,
                delay,
                reason,
                url=d.url,
                delay_s=round(delay, 1),
                attempt=failures,
                reason=reason,
            )
            if d.cancel.wait(delay):
                raise Cancelled(d.url)

    def _attempt(self, d: Download, source: Source) -> int:
        """One request, from where the partial file ends; the bytes written (Retry: another attempt)."""
        # A reservation grows by steps only while this answer's body is of unknown size (an
        # earlier answer's may have been): one that gives the size is granted it whole, or waits.
        d.budget.needed = 0
        offset = d.progress.written
        if offset and not d.progress.etag:
            # Without a validator we cannot tell whether the object changed since these bytes came:
            # splicing two versions would publish a wrong shard, so start over.
            truncate(d.partial)
            offset = d.progress.written = 0
        offset, end = self._parted.first_range(d, offset) if source.parts else (offset, None)
        d.progress.written = offset
        try:
            with source.open(d.url, offset, end, d.progress.etag, d.cancel) as answer:
                written = self._take(d, source, answer, offset, end)
            if answer.total is None:  # checked once the source closed: a pipe's exit status says more
                self._check_ended(d)
            return written
        except Unsatisfiable as exc:
            if offset and exc.whole():
                # Nothing past our bytes, of the version asked for: the partial kept was whole
                # already (cancelled after its last byte came). Checked as any.
                check_announced(d, offset)
                d.progress.total = offset
                d.progress.last_modified = exc.last_modified or d.progress.last_modified
                d.budget.reserve(d, offset, None)
                return offset
            truncate(d.partial)  # our partial is not a prefix of this object
            raise Retry("HTTP 416 on resume; starting over", 0.0) from None
        except Replaced as exc:
            truncate(d.partial)
            raise Retry(f"{exc}; starting over", None if exc.backoff else 0.0) from None
        except Unexpected as exc:
            raise FetchError(d.url, exc.reason, status=exc.status, permanent=True) from None

    def _take(self, d: Download, source: Source, answer: SourceResponse, offset: int, end: int | None) -> int:
        """Check ``answer`` (to a request from ``offset``) against the partial file, and write its body."""
        total, version = answer.total, answer.version
        if answer.ranged:
            if answer.start != offset:
                truncate(d.partial)
                raise Retry("server resumed at the wrong offset; starting over", 0.0)
            if offset:
                # A source may ignore If-Range or If-Match: the answer itself must name our bytes' version.
                _resumed_as(d, version.unlike(d.progress.etag))
            if end is not None and total is None:
                d.progress.single = True  # a part's answer without the shard's size: one request for it all
                raise Retry("server sent no size with its range; using one connection", 0.0, counts=False)
        else:
            remove_side_files(d.partial)  # an answer from byte 0: the object may have changed
            if offset:
                # A whole answer to a Range with If-Range: the source changed, or ignores ranges.
                changed = bool(d.progress.etag) and version.unlike(d.progress.etag) is not None
                why = "the source changed since the partial was written" if changed else "the source ignored the Range"
                log.info("%s: %s; downloading from the start", d.url, why)
                truncate(d.partial)
                offset = d.progress.written = 0
        if total is not None:
            check_announced(d, total)  # before any byte of the body, and before the parts' plan
        d.progress.last_modified = version.last_modified
        if version.validator and version.validator != d.progress.etag:
            d.progress.etag = version.validator
            d.on_validator(d)  # recorded in the index, so a restart can resume safely
        if end is not None and answer.ranged and total is not None and total > end:
            if not _parts_can_name(version.validator, d):
                # No version the other parts could name (no validator, a weak one, or one a part
                # was answered without): the rest of this part's bytes would have to come as
                # attempts of their own, so the whole comes over one connection instead.
                d.progress.single = True
                raise Retry("no version the parts could name; using one connection", 0.0, counts=False)
            return self._parted.fetch(
                d,
                ByteRange(offset, end),
                total,
                answer.chunks,
                answer.let_go,
                lambda d, start, end, total: self._open_part(source, d, start, end, total),
            )
        if total is not None:
            d.progress.total = total
            if not reserve_holding(d, total, answer.let_go):
                raise Retry("waited for cache space", 0.0, counts=False)
        write_body(d, answer.chunks, total, check_head=offset == 0)
        if total is not None and d.progress.written != total:
            raise Retry(f"got {d.progress.written} of {total} bytes")
        return d.progress.written

    def _check_ended(self, d: Download) -> None:
        """A body without its length ends where the connection does, cut short or not: one that
        does not end as a whole tar does is asked for again (from its end, where the source
        sends the rest, or says there is none with a 416; else whole), and taken as it is only
        when it comes again as long (a tar some writer left without its end-of-archive marker)."""
        problem = cut_problem(d.partial, url=d.url)
        if problem is None or d.progress.unended == d.progress.written:
            return
        d.progress.unended = d.progress.written
        raise Retry(f"the body came without its length and may be cut short: {problem}", 0.0)

    @contextlib.contextmanager
    def _open_part(self, source: Source, d: Download, start: int, end: int, total: int) -> Iterator[Iterator[bytes]]:
        """The body of bytes ``start`` to ``end`` of the version ``d.progress.etag`` names (a part of a parted download)."""
        assert d.progress.etag is not None  # parts are planned only for a version they can name (_parts_can_name)
        span = f"bytes {start}-{end - 1}"
        with contextlib.ExitStack() as stack:
            try:
                answer = stack.enter_context(source.open(d.url, start, end, d.progress.etag, d.cancel))
            except (Unsatisfiable, Replaced, Unexpected) as exc:
                raise Changed(f"{span}: {exc}") from None
            except FetchError as exc:
                raise FetchError(
                    d.url, f"{exc.reason} for {span}", status=exc.status, permanent=exc.permanent
                ) from None
            if (
                not answer.ranged
                or answer.start != start
                or answer.total != total
                or answer.version.unlike(d.progress.etag)
            ):
                got = f"bytes from {answer.start} of {answer.total}" if answer.ranged else "no range"
                raise Changed(f"{span} came as {got} ({answer.version.validator})")
            yield answer.chunks


def cause_of(exc: BaseException) -> str | None:
    """What made a request fail, in a few words (None: nothing more telling than the error):
    the first known cause in the chain of errors ``exc`` wraps (requests wraps urllib3's, which
    wraps the socket's: :func:`~wdscache.shared.errors.wrapped_errors`)."""
    for e in wrapped_errors(exc):
        if isinstance(e, ConnectionRefusedError) or "Connection refused" in str(e):
            return CONNECTION_REFUSED
        if (
            isinstance(e, socket.gaierror)
            or "Name or service not known" in str(e)
            or "Temporary failure in name resolution" in str(e)
            or "nodename nor servname" in str(e)
        ):
            return NAME_RESOLUTION
        if isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
            return TLS_VERIFY
        if isinstance(e, (ssl.SSLError, requests.exceptions.SSLError)):
            return TLS_FAILED
        if isinstance(e, ConnectionResetError):
            return "connection reset"
        if isinstance(e, (TimeoutError, socket.timeout, requests.Timeout, urllib3.exceptions.TimeoutError)):
            return "timed out"
    return None


def _parts_can_name(tag: str | None, d: Download) -> bool:
    """Whether ranged parts may name version ``tag`` in their requests: a strong validator
    that the source has not refused already."""
    return strong(tag) and tag != d.progress.refused


def _resumed_as(d: Download, problem: str | None) -> None:
    """A resumed answer is continued only for the version the partial file's bytes came with:
    else the partial file and its side files go, and the download starts over from byte 0."""
    if problem is None:
        return
    log.warning("%s: a resumed answer is for another version (%s); downloading it again from byte 0", d.url, problem)
    truncate(d.partial)
    remove_side_files(d.partial)
    raise Retry(f"resumed answer for another version ({problem}); starting over", 0.0)
