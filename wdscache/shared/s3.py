"""S3 sources (``s3://bucket/key``) through boto3: objects for the agent's download threads, and
the listing of prefixes and globs for whoever reads a URL list (the agent, a loader).

boto3 is an optional dependency (the package's ``s3`` extra), imported on first use: a process
whose lists hold no ``s3://`` entry never imports it, and one without it gets an error naming
the extra.

Where a client's settings come from: the endpoint is the one given (the agent's
``--s3-endpoint-url``), else what botocore finds itself (``AWS_ENDPOINT_URL_S3``,
``AWS_ENDPOINT_URL``, the profile's ``endpoint_url``); credentials, profile (``AWS_PROFILE``)
and region come from boto3's standard chain. This module reads no environment itself.

Threads: boto3 clients may be shared, sessions may not. The process makes one session, and
one botocore client for each set of settings (endpoint, timeouts, retries), under a lock; every
:class:`S3Client` with those settings uses that client. So botocore loads its S3 model and
credentials once, and a download or part thread's first request does not wait for a client of
its own (tens of ms of CPU each, serialized by the lock: paid again by each new part thread).
The shared client's connection pool (:data:`POOL_CONNECTIONS`) holds a connection for every
download thread and part at once, so connections are reused whichever thread asks next; the
clients live as long as the process.

Retries: a download's client makes one attempt per call (botocore's retries are off), so the
fetcher's own loop, with its backoff and retry count, decides what is tried again: a missing
or denied object is one request, never a storm. Listing keeps botocore's standard retries.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .config import default
from .errors import FetchError
from .redact import redact_urls

EXTRA = "s3:// sources need boto3: pip install boto3 (the package's s3 extra)"
# What a prefix stands for: the shards under it, by the names webdataset reads as tars (in any case).
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
# Throttling and server trouble: tried again with backoff. Any other error code is final.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_GLOB = re.compile(r"[*?\[]")
_ESCAPED = re.compile(r"\[([*?\[])\]")  # a glob character taken literally: alone in its class
# What a regex's class reads otherwise than a glob's: an escape, and a nested set or set operation to be.
_CLASS_SPECIAL = re.compile(r"[\\\[&~|]")
# Connections a shared client keeps for reuse: more than the agent's download threads and their
# parts use at once (2 x --download-workers x --download-parts, 32 by default); one beyond it is
# opened and closed after its request.
POOL_CONNECTIONS = 64


class Transient(Exception):
    """A failure worth trying again (throttling, a reset, a timeout): ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NoClient(Exception):
    """No client can be made (boto3 missing, an unknown profile, a bad endpoint): ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PreconditionFailed(Exception):
    """The object is no longer the version ``If-Match`` named (HTTP 412)."""


class RangeNotSatisfiable(Exception):
    """The range asked for starts at or past the object's end (HTTP 416)."""


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``("bucket", "key")`` (the key may be empty)."""
    bucket, _, key = url[len("s3://") :].partition("/")
    return bucket, key


def is_prefix(url: str) -> bool:
    """Whether ``url`` given alone (an index's entry, a job's URL) names a prefix, not one object:
    its key is empty or ends in ``/``. Alone, a key is taken literally, glob characters included."""
    key = split(url)[1]
    return not key or key.endswith("/")


def named_object(url: str) -> str | None:
    """The URL of the one object the list entry ``url`` names: ``url`` itself when its key holds
    no glob character, the key read literally when each of them is escaped in a class of its own
    (``[[]``, ``[*]``, ``[?]``, as :func:`literal_entry` writes them); None for a prefix or a
    glob, which stand for what a listing finds."""
    bucket, key = split(url)
    if not key or key.endswith("/"):
        return None
    if _GLOB.search(key) is None:
        return url
    if _GLOB.search(_ESCAPED.sub("", key)) is not None:
        return None
    return f"s3://{bucket}/" + _ESCAPED.sub(r"\1", key)


def is_listing(url: str) -> bool:
    """Whether the list entry ``url`` names several objects: a prefix (empty or ending in ``/``)
    or a glob (see :func:`named_object` for a key whose glob characters are all escaped)."""
    return named_object(url) is None


def literal_entry(url: str) -> str:
    """The list entry that names the object ``url`` (a key taken literally) and nothing else: each
    glob character of its key escaped in a class of its own, as fnmatch's ``[*]``."""
    bucket, key = split(url)
    return f"s3://{bucket}/" + _GLOB.sub(r"[\g<0>]", key) if _GLOB.search(key) else url


def listed_by(url: str) -> Callable[[str], bool]:
    """Whether a key of ``url``'s bucket is one the prefix or glob ``url`` stands for: under a
    prefix, the names that end like a tar; under a glob, the keys it matches."""
    key = split(url)[1]
    if _GLOB.search(key):
        pattern = glob_regex(key)
        return lambda k: pattern.fullmatch(k) is not None
    return lambda k: k.startswith(key) and k.lower().endswith(SHARD_SUFFIXES)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A key glob as a regex: ``*`` and ``?`` stay within one ``/`` segment, ``**`` crosses
    them, ``[abc]`` and ``[!abc]`` are character classes (as in a shell)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + _CLASS_SPECIAL.sub(r"\\\g<0>", body) + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def _boto() -> tuple[Any, Any, Any]:
    """boto3's session module, botocore's Config and exceptions; NoClient naming the extra."""
    try:
        import boto3.session
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise NoClient(EXTRA) from None
    return boto3.session, botocore.config.Config, botocore.exceptions


_session: Any = None  # the process's boto3 session, made by the first client
_clients: dict[tuple[str | None, float, float, bool], Any] = {}  # settings -> the process's botocore client
_session_lock = threading.Lock()


class Body:
    """One GetObject response: ``start`` is the offset of its first byte, ``total`` the object's
    size, ``chunks`` its bytes (a read error is :class:`Transient`); :meth:`close` lets go of
    its connection, read or not."""

    def __init__(
        self, start: int, total: int, etag: str | None, ranged: bool, chunks: Iterator[bytes], raw: Any
    ) -> None:
        self.start, self.total, self.etag, self.chunks = start, total, etag, chunks
        self.ranged = ranged  # the server answered the Range (206), not with the whole object
        self._raw = raw

    def close(self) -> None:
        self._raw.close()


class S3Client:
    """S3 requests with the given settings, through the process's botocore client for them
    (made by the first S3Client that asks; safe to use from any thread). Raises NoClient."""

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        connect_timeout: float = default("connect_timeout"),
        read_timeout: float = default("read_timeout"),
        retries: bool = False,
    ) -> None:
        global _session
        session_mod, config_cls, self._exc = _boto()
        settings = (endpoint_url, connect_timeout, read_timeout, retries)
        try:
            with _session_lock:
                if _session is None:
                    _session = session_mod.Session()
                if settings not in _clients:
                    _clients[settings] = _session.client(
                        "s3",
                        endpoint_url=endpoint_url,
                        config=config_cls(
                            connect_timeout=connect_timeout,
                            read_timeout=read_timeout,
                            retries={"mode": "standard"} if retries else {"total_max_attempts": 1},
                            max_pool_connections=POOL_CONNECTIONS,
                        ),
                    )
                self._client = _clients[settings]
        except self._exc.BotoCoreError as exc:  # an unknown profile, a bad endpoint, no region
            raise NoClient(f"cannot make an S3 client: {redact_urls(str(exc))}") from None

    def close(self) -> None:
        """Nothing to let go: the shared client, and its idle connections, stay for other threads."""

    def bucket_exists(self, url: str) -> bool | None:
        """Whether ``url``'s bucket is there (HeadBucket); None when that cannot be told."""
        try:
            self._client.head_bucket(Bucket=split(url)[0])
        except Exception as exc:
            problem = self._problem(url, exc)
            return False if isinstance(problem, FetchError) and problem.status == 404 else None
        return True

    def head(self, url: str) -> tuple[int, str | None]:
        """The object's size and ETag. Raises FetchError or :class:`Transient`."""
        bucket, key = split(url)
        try:
            r = self._client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            raise self._problem(url, exc) from None
        return int(r["ContentLength"]), r.get("ETag")

    def get(
        self, url: str, *, offset: int = 0, end: int | None = None, if_match: str | None = None, chunk: int = 64 << 10
    ) -> Body:
        """GetObject from ``offset`` (a Range past 0) up to ``end`` (exclusive; None: the object's
        end), only while its ETag is ``if_match`` if given.

        Raises FetchError (final), :class:`Transient`, :class:`PreconditionFailed` or :class:`RangeNotSatisfiable`.
        The caller closes the body.
        """
        bucket, key = split(url)
        args: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if offset or end is not None:
            args["Range"] = f"bytes={offset}-{'' if end is None else end - 1}"
        if if_match:
            args["IfMatch"] = if_match
        try:
            r = self._client.get_object(**args)
        except Exception as exc:
            raise self._problem(url, exc) from None
        ranged = r["ResponseMetadata"]["HTTPStatusCode"] == 206
        start, total = 0, int(r["ContentLength"])
        if ranged:
            start, total = _content_range(r.get("ContentRange", ""))
        return Body(start, total, r.get("ETag"), ranged, self._chunks(url, r["Body"], chunk), r["Body"])

    def _chunks(self, url: str, body: Any, size: int) -> Iterator[bytes]:
        try:
            while chunk := body.read(size):
                yield chunk
        except Exception as exc:
            raise self._problem(url, exc) from None

    def list(self, url: str, *, page_size: int | None = None) -> list[str]:
        """The ``s3://`` URLs of the shards a prefix or glob names, in key order.

        A prefix stands for the objects under it whose names end like a tar (``.tar``,
        ``.tar.gz``, ``.tgz``); a glob for the keys it matches. Raises FetchError or
        :class:`Transient`.
        """
        bucket, key = split(url)
        glob = _GLOB.search(key)
        prefix = key[: glob.start()] if glob else key
        matches = listed_by(url)
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, **({"PaginationConfig": {"PageSize": page_size}} if page_size else {})
        )
        keys: list[str] = []
        try:
            for page in pages:
                keys.extend(o["Key"] for o in page.get("Contents", ()) if matches(o["Key"]))
        except Exception as exc:
            raise self._problem(url, exc) from None
        return [f"s3://{bucket}/{k}" for k in sorted(keys)]  # sorted: not every store lists in order

    def _problem(self, url: str, exc: BaseException) -> BaseException:
        """What a botocore exception means for ``url``: FetchError (final), Transient, PreconditionFailed or
        RangeNotSatisfiable; any other exception is returned as it is."""
        e = self._exc
        bucket, key = split(url)
        if isinstance(exc, e.ClientError):
            err = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(err.get("Code") or status)
            if status == 412 or code == "PreconditionFailed":
                return PreconditionFailed(url)
            if status == 416 or code == "InvalidRange":
                return RangeNotSatisfiable(url)
            what = f"S3 {code} (HTTP {status}) for bucket {bucket!r}" + (f", key {key!r}" if key else "")
            message = err.get("Message")
            if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
                return Transient(what)
            return FetchError(url, f"{what}: {message}" if message else what, status=status, permanent=True)
        if isinstance(exc, (e.HTTPClientError, e.ConnectionError, e.IncompleteReadError)):
            return Transient(_said(exc))
        if isinstance(exc, e.NoCredentialsError):
            return FetchError(
                url, "no AWS credentials found (environment, AWS_PROFILE, ~/.aws, instance role)", permanent=True
            )
        if isinstance(exc, e.BotoCoreError):
            return FetchError(url, _said(exc), permanent=True)
        return exc


def _said(exc: BaseException) -> str:
    """A botocore exception as a reason: its class and its text, redacted (botocore's text holds the
    endpoint URL it asked, user info included)."""
    return f"{type(exc).__name__}: {redact_urls(str(exc))}"


def _content_range(value: str) -> tuple[int, int]:
    """``bytes 100-199/1000`` -> ``(100, 1000)``; ``(-1, -1)`` when it does not parse."""
    m = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+)\s*", value)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


class Listing:
    """The ``lister`` a URL list is read with (:func:`wdscache.shared.urls.parse_url_list`): the URLs
    each ``s3://`` entry stands for. A prefix or glob is listed (ListObjectsV2, every page) by a
    client made on first need, in the calling thread; a single object (:func:`named_object`) stands for itself.

    ``fetching`` (the agent): a single object too needs boto3, so a list the agent cannot
    fetch is refused when it is read, not shard by shard later.
    """

    def __init__(self, *, endpoint_url: str | None = None, fetching: bool = False) -> None:
        self.endpoint_url, self.fetching = endpoint_url, fetching
        self.listed = 0  # prefixes and globs listed so far: a list that names one may change unedited
        self._client: S3Client | None = None

    def __call__(self, url: str) -> Sequence[str]:
        """Raises ValueError saying why ``url`` cannot be listed (or, ``fetching``, fetched)."""
        named = named_object(url)
        if named is not None:
            if self.fetching:
                self._connect()
            return (named,)
        self.listed += 1
        try:
            urls = self._connect().list(url)
        except (FetchError, Transient) as exc:
            raise ValueError(f"cannot list it: {getattr(exc, 'reason', exc)}") from None
        if not urls:
            what = (
                "no key matches the glob"
                if _GLOB.search(split(url)[1])
                else f"no object whose name ends in {'/'.join(SHARD_SUFFIXES)} under the prefix"
            )
            raise ValueError(f"{what}: it stands for no shard")
        return urls

    def _connect(self) -> S3Client:
        if self._client is None:
            try:
                self._client = S3Client(endpoint_url=self.endpoint_url, retries=True)
            except NoClient as exc:
                raise ValueError(exc.reason) from None
        return self._client
