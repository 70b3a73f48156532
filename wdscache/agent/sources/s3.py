"""S3 sources (``s3://bucket/key``): ranged GETs through :mod:`wdscache.shared.s3`, one
client a thread (from the process's one boto3 session). A resume sends ``If-Match`` with
the ETag its bytes came with: an object replaced meanwhile answers HTTP 412."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ...shared import s3
from ...shared.errors import FetchError
from ..shard_download import Fetched, Gone, Retry, Unknown, short
from ..validators import Version
from .base import CHUNK, Replaced, Source, SourceResponse, Unsatisfiable


class S3Source(Source):
    parts = True
    describes = True

    def _client(self, url: str) -> s3.S3Client:
        # Like a requests session: one per thread, made in the thread that uses it.
        client = getattr(self._local, "client", None)
        if client is None:
            try:
                client = self._local.client = s3.S3Client(
                    endpoint_url=self.settings.s3_endpoint_url,
                    connect_timeout=self.settings.connect_timeout,
                    read_timeout=self.settings.read_timeout,
                )
            except s3.NoClient as exc:
                raise FetchError(url, exc.reason, permanent=True) from None
        return client

    def close_thread(self) -> None:
        client = getattr(self._local, "client", None)
        if client is not None:
            client.close()
            self._local.client = None

    def probe(self, url: str) -> Fetched | Gone | Unknown:
        try:
            client = self._client(url)
            return Fetched(*client.head(url))
        except FetchError as exc:
            if exc.status != 404:
                return Unknown(exc.reason)
            reason = exc.reason
        except s3.Transient as exc:
            return Unknown(exc.reason)
        except OSError as exc:
            return Unknown(short(exc))
        # Gone from a bucket that is there: a bucket missing is another endpoint's, or a misconfiguration.
        if client.bucket_exists(url) is True:
            return Gone(reason)
        return Unknown(f"{reason}, and its bucket is not there or cannot be asked")

    @contextmanager
    def open(
        self, url: str, start: int, end: int | None, held: str | None, cancel: threading.Event | None = None
    ) -> Iterator[SourceResponse]:
        client = self._client(url)
        try:
            body = client.get(url, offset=start, end=end, if_match=held if start else None, chunk=CHUNK)
        except s3.PreconditionFailed:
            raise Replaced("the object changed since the partial copy was made (If-Match: HTTP 412)") from None
        except s3.RangeNotSatisfiable:
            raise Unsatisfiable(lambda: _head_or_none(client, url) == (start, held)) from None
        except s3.Transient as exc:
            raise Retry(exc.reason) from None
        try:
            yield SourceResponse(
                _chunks(body.chunks), body.start, body.ranged, body.total, Version(etag=body.etag), body.close
            )
        finally:
            body.close()


def _chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` with a broken read as :class:`Retry`, as the retry loops know it."""
    try:
        yield from chunks
    except s3.Transient as exc:
        raise Retry(exc.reason) from None


def _head_or_none(client: s3.S3Client, url: str) -> tuple[int, str | None] | None:
    """An object's (size, ETag), or None if a HEAD cannot say now."""
    try:
        return client.head(url)
    except (FetchError, s3.Transient):
        return None
