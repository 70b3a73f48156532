"""HTTP(S) sources: ranged GETs over ``requests``, one session a thread.

A resume sends ``If-Range`` with the version its bytes came with. A 429 or 503 with
``Retry-After`` (on a GET or a HEAD) holds every next request to that URL, from any
thread, until the time it names: a GET waits for it (or its download's cancel), a HEAD
(:meth:`HttpSource.probe`) is not sent and knows nothing, at once. An answer's head (of a
GET or a HEAD) not whole within the read timeout of its request (not only no read that
long), or a GET's once its download is cancelled, ends the request (:mod:`.http_head`): a
GET's attempt fails (TimeoutError: retried as a read timeout is), a HEAD knows no size.
"""

from __future__ import annotations

import email.utils
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import requests

from ...shared.errors import FetchError
from ...shared.logs import get_logger
from ...shared.redact import redact_urls
from ..shard_download import Cancelled, Fetched, Gone, Retry, Unknown, short
from ..validators import Version
from .base import CHUNK, Settings, Source, SourceResponse, Unexpected, Unsatisfiable
from .http_head import WatchedAdapter, send_watched

log = get_logger(__name__)

PERMANENT_STATUS = {400, 401, 403, 404, 405, 410, 451}
GONE_STATUS = {404, 410}  # a final "no such object" (a 403 may be an expired signature of an object still there)
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
RETRY_AFTER_MAX = 600.0  # seconds: a longer Retry-After is held to this
# Asked of every request: a server that negotiates an encoding would otherwise describe an encoded
# body to a HEAD (its size and ETag) and send the GET the bytes as stored. (One that encodes whatever
# is asked sends both the same body: the agent keeps it as sent, and gunzips a gzip'd tar itself.)
_IDENTITY = {"Accept-Encoding": "identity"}
# Redirects that cannot be followed, however often asked: a loop (more than the session's
# max_redirects), or to a URL of another scheme or none.
UNFOLLOWED = (
    requests.TooManyRedirects,
    requests.exceptions.InvalidSchema,
    requests.exceptions.MissingSchema,
    requests.exceptions.InvalidURL,
)


class HttpSource(Source):
    parts = True
    describes = True

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        # Both changed by every download thread: guarded by _lock.
        self._not_before: dict[str, float] = {}  # url -> monotonic time a Retry-After holds it until
        self._answered: set[str] = set()  # hosts (scheme://netloc) that answered a request
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        # Created lazily in the thread that uses it: sessions are not shared.
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["User-Agent"] = "wdscache"
            adapter = WatchedAdapter()
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        return session

    def close_thread(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
            self._local.session = None

    def answered(self, url: str) -> bool:
        with self._lock:
            return _host(url) in self._answered

    def probe(self, url: str) -> Fetched | Gone | Unknown:
        """What ``url`` is now, by HEAD. Never waits for a Retry-After: its callers (a revalidation,
        which holds a download slot and maybe a reader's open; the start-up's size checks) do
        better with no answer now (the cached copy served, the size unknown) than with one later."""
        held = self._held_for(url)
        if held > 0:
            return Unknown(f"not asked: its source's Retry-After holds it {held:.1f}s more")
        try:
            session = self._session()
            r = send_watched(
                lambda: session.head(url, headers=_IDENTITY, timeout=self.settings.timeout, allow_redirects=True),
                url,
                self.settings.read_timeout,
            )
        except (OSError, requests.RequestException) as exc:
            return Unknown(f"{type(exc).__name__}: {short(exc)}")
        self._heard_from(url)
        if r.status_code in RETRY_STATUS:
            self._hold(url, _retry_after(r.headers.get("Retry-After")))
        if r.status_code in GONE_STATUS:
            return Gone(_answer(r))
        length = r.headers.get("Content-Length", "")
        if not r.ok:
            return Unknown(_answer(r))
        if not length.isdigit():
            return Unknown(f"{_answer(r)} without a Content-Length")
        return Fetched(int(length), _version(r.headers).validator, last_modified=r.headers.get("Last-Modified"))

    @contextmanager
    def open(
        self, url: str, start: int, end: int | None, held: str | None, cancel: threading.Event | None = None
    ) -> Iterator[SourceResponse]:
        headers = dict(_IDENTITY)
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if start and held:
            headers["If-Range"] = held  # an ETag or an HTTP date: both are valid here
        self._wait_turn(url, cancel)
        session = self._session()
        try:
            answer = send_watched(
                lambda: session.get(url, headers=headers, stream=True, timeout=self.settings.timeout),
                url,
                self.settings.read_timeout,
                cancel,
            )
        except UNFOLLOWED as exc:  # no other attempt can get further: the server sends every one there
            if isinstance(exc, requests.exceptions.InvalidProxyURL) or "SOCKS" in str(exc):
                raise  # (the same errors of a proxy's setting: retried, as any error of a connection)
            raise FetchError(
                url,
                f"{type(exc).__name__}: {short(exc)}: check the URL and where its server redirects it",
                permanent=True,
            ) from None
        with answer as r:
            self._heard_from(url)
            status = r.status_code
            if status in GONE_STATUS:
                raise FetchError(url, f"{_answer(r)}: the source does not have it", status=status, permanent=True)
            if status in PERMANENT_STATUS:
                raise FetchError(url, _answer(r), status=status, permanent=True)
            if status in RETRY_STATUS:
                delay = _retry_after(r.headers.get("Retry-After"))
                self._hold(url, delay)
                raise Retry(_answer(r), delay)
            version = _version(r.headers)
            if status == 416 and start:
                size = _unsatisfiable_size(r.headers.get("Content-Range", ""))
                raise Unsatisfiable(lambda: size == start and not version.unlike(held), version.last_modified)
            # read1 returns what has arrived (up to CHUNK), so a cancel leaves few received bytes unwritten.
            chunks = iter(lambda: r.raw.read1(CHUNK, decode_content=False), b"")
            if status == 206 and "Range" in headers:
                got, total = _content_range(r.headers.get("Content-Range", ""))
                yield SourceResponse(chunks, got, True, total, version, r.close)
            elif status == 200:
                length = r.headers.get("Content-Length")
                yield SourceResponse(
                    chunks, 0, False, int(length) if length and length.isdigit() else None, version, r.close
                )
            else:
                raise Unexpected(f"unexpected {_answer(r)}", status)

    def _heard_from(self, url: str) -> None:
        with self._lock:
            self._answered.add(_host(url))

    def _hold(self, url: str, delay: float | None) -> None:
        """A Retry-After of ``delay`` seconds: no request to ``url`` before then."""
        if delay:
            with self._lock:
                until = time.monotonic() + delay
                self._not_before[url] = max(until, self._not_before.get(url, 0.0))

    def _held_for(self, url: str) -> float:
        """The seconds a Retry-After that ``url`` gave still holds it (0: none does)."""
        with self._lock:
            delay = self._not_before.get(url, 0.0) - time.monotonic()
            if delay <= 0:
                self._not_before.pop(url, None)
                return 0.0
            return delay

    def _wait_turn(self, url: str, cancel: threading.Event | None) -> None:
        """Wait until a Retry-After that ``url`` gave has passed (raises Cancelled if cancelled)."""
        delay = self._held_for(url)
        if delay <= 0:
            return
        log.info("waiting %.1fs before asking %s again (Retry-After)", delay, url)
        if cancel is None:
            time.sleep(delay)
        elif cancel.wait(delay):
            raise Cancelled(url)


def _answer(r: requests.Response) -> str:
    """``HTTP 403 Forbidden``: the status and the server's reason phrase, redacted (a server may
    echo the request's path there, a signed URL's query included)."""
    return f"HTTP {r.status_code} {redact_urls(r.reason or '')}".rstrip()


def _host(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _version(headers: requests.structures.CaseInsensitiveDict[str]) -> Version:
    return Version(etag=headers.get("ETag") or None, last_modified=headers.get("Last-Modified") or None)


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
        return min(float(value), RETRY_AFTER_MAX)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return min(max(0.0, when - time.time()), RETRY_AFTER_MAX)
