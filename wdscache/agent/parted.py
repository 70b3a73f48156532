"""Fetching one shard as several ranged parts at once (the plan: :mod:`wdscache.agent.parts`).

The first part streams into the partial file, so a reader waiting for the shard is served
at once; the other parts come over their own connections, in threads of the download that
end with it, into side files appended in order (the partial file stays a contiguous
prefix). Every part's request names the version the first answer gave; an answer for any
other version (:class:`~wdscache.agent.shard_download.Changed`) starts the whole shard over,
never spliced. A cut part is retried alone, with backoff; only failures without progress
count against the retries.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import requests
import urllib3

from ..shared.config import format_size
from ..shared.errors import FetchError, out_of_files
from ..shared.logs import get_logger
from ..shared.tarwalk import HEAD_BYTES
from .parts import ByteRange, Plan, Stopped, append_side, remove_side_files, side_files
from .shard_download import (
    DISK_FULL_ERRNOS,
    SYNC_EVERY,
    Backoff,
    Cancelled,
    Changed,
    Download,
    Progress,
    Retry,
    check_tar_head,
    disk_full,
    reserve_holding,
    short,
    sync_part,
    truncate,
    write_all,
    write_body,
)

log = get_logger(__name__)

# How long a parted download waits for budget for its size plus one part before it goes on
# over one connection instead (which needs its size only).
PARTS_HOLD = 1.0
# Beyond the read timeout, how long the end of a parted download waits for its other threads.
PARTS_JOIN = 5.0

# Opens bytes ``start`` to ``end`` of the version ``d.progress.etag`` names, of a shard of ``total``
# bytes (raises Changed for any other answer).
OpenRange = Callable[[Download, int, int, int], AbstractContextManager[Iterator[bytes]]]


class PartedFetch:
    """The parts of one fetcher's downloads: ``parts`` connections a shard (fewer when its attempt
    could claim the open files of fewer: ``progress.parts``), ``part_size`` each, retried as
    ``backoff`` says; ``close_thread`` ends what a part's thread holds."""

    def __init__(
        self, parts: int, part_size: int, backoff: Backoff, read_timeout: float, close_thread: Callable[[], None]
    ) -> None:
        self.parts, self.part_size, self._backoff = parts, part_size, backoff
        self._read_timeout, self._close_thread = read_timeout, close_thread

    def first_range(self, d: Download, offset: int) -> tuple[int, int | None]:
        """Where the first request of an attempt starts and ends (None: it asks for the whole
        rest) when the shard may come in parts. A side file kept from earlier that starts
        where the partial file ends is appended to it first, and the request stops before
        the next one, so no byte is fetched twice. Side files are removed when unusable."""
        if self.parts < 2 or d.progress.single or not offset:
            remove_side_files(d.partial)  # only resumed beside the prefix they belong to
            return offset, None if self.parts < 2 or d.progress.single else self.part_size
        end = None
        for start, stop, path in side_files(d.partial):
            if start == offset and end is None:
                try:
                    offset += append_side(d.partial, path, offset)
                except OSError as exc:
                    if exc.errno in DISK_FULL_ERRNOS:
                        raise disk_full(d, exc) from exc
                    raise
                if offset < stop:
                    end = stop  # the rest of that part comes first
            elif start > offset:
                return offset, min(end or offset + self.part_size, start)
        return offset, end or offset + self.part_size

    def fetch(
        self,
        d: Download,
        head: ByteRange,
        total: int,
        first: Iterator[bytes],
        let_go: Callable[[], None],
        open_range: OpenRange,
    ) -> int:
        """Fetch ``d`` as parts, the first (``head``) from the answer ``first`` that gave its size."""
        d.progress.total = total
        progress = d.progress
        plan = Plan(d.partial, total, head, self.part_size, lambda n: _wrote(progress, n))
        d.progress.written = plan.held
        need = total + plan.largest  # an append holds a part's bytes twice for a moment
        try:
            granted = d.budget.reserve(d, need, PARTS_HOLD)
        except FetchError:  # more than the whole cache
            granted = False
        if not granted:
            log.info(
                "%s: the cache cannot hold %s for parallel parts now; using one connection", d.url, format_size(need)
            )
            self._one_connection(d, head, total, first, let_go)
        helpers = [
            threading.Thread(
                target=self._part_thread,
                args=(d, plan, open_range),
                daemon=True,
                name=f"{threading.current_thread().name}-part{i}",
            )
            for i in range(1, min(self.parts, d.progress.parts or self.parts, plan.pending + 1))
        ]
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
        if isinstance(error, Changed):
            log.warning(
                "%s: a part's answer is for another version (%s); downloading it again from byte 0", d.url, error
            )
            truncate(d.partial)
            remove_side_files(d.partial)
            d.progress.refused = (
                d.progress.etag
            )  # if the object comes back unchanged, its parts come over one connection
            raise Retry(f"{error}; the object changed during the download, starting over", 0.0)
        if isinstance(error, Stopped):  # stopped for a reason another thread did not keep
            raise Cancelled(d.url)
        if isinstance(error, OSError) and not isinstance(error, FetchError) and error.errno in DISK_FULL_ERRNOS:
            raise disk_full(d, error) from error  # a part appended to the partial file: no room for the copy
        if error is not None:
            raise error
        if not plan.complete:
            raise Retry(f"parts ended at byte {plan.prefix} of {total}")
        return total

    def _one_connection(
        self, d: Download, head: ByteRange, total: int, first: Iterator[bytes], let_go: Callable[[], None]
    ) -> None:
        """Go on over one connection, which needs the shard's size only: the first answer's
        bytes are kept, and the next request asks for the whole rest (raises Retry)."""
        d.progress.single = True
        remove_side_files(d.partial)
        d.progress.written = head.start
        if not reserve_holding(d, total, let_go):
            raise Retry("waited for cache space", 0.0, counts=False)
        write_body(d, first, head.end, check_head=head.start == 0)
        if d.progress.written != head.end:
            raise Retry(f"got {d.progress.written} of {head.end} bytes")
        raise Retry("going on over one connection", 0.0, counts=False)

    def _part_thread(self, d: Download, plan: Plan, open_range: OpenRange) -> None:
        try:
            self._take_parts(d, plan, open_range)
        except BaseException as exc:  # noqa: BLE001 (the download's thread raises it)
            plan.abort(exc)
        finally:
            self._close_thread()

    def _take_parts(self, d: Download, plan: Plan, open_range: OpenRange) -> None:
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
                    deadline = time.monotonic() + self._read_timeout + PARTS_JOIN
                if deadline is not None and time.monotonic() > deadline:
                    log.warning("%s: a part's thread did not stop in time", d.url)
                    return

    def _fetch_part(
        self, d: Download, plan: Plan, part: ByteRange, open_range: OpenRange, first: Iterator[bytes] | None = None
    ) -> None:
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
                raise Retry(f"got {part.have} of {part.size} bytes")
            except Retry as exc:
                reason, delay = exc.reason, exc.delay
            except FetchError:  # final (a FetchError is an OSError too: not one to retry)
                raise
            except (
                requests.ConnectionError,
                requests.Timeout,
                requests.exceptions.ChunkedEncodingError,
                urllib3.exceptions.HTTPError,
                OSError,
            ) as exc:
                if out_of_files(exc):  # the agent's fault: the download stops, its parts with it, and waits for files
                    raise
                reason, delay = f"{type(exc).__name__}: {short(exc)}", None
            if part.have > before:
                failures = 0
            failures += 1
            span = f"bytes {part.start}-{part.end - 1}"
            if failures > self._backoff.retries:
                raise FetchError(d.url, f"gave up after {self._backoff.retries} retries of {span}: {reason}")
            if delay is None:
                delay = self._backoff.delay(failures)
            log.info("retrying %s of %s in %.1fs (%s)", span, d.url, delay, reason)
            deadline = time.monotonic() + delay
            while (left := deadline - time.monotonic()) > 0:
                plan.stop.wait(min(left, 0.1))
                _check(d, plan)

    def _write_part(self, d: Download, plan: Plan, part: ByteRange, chunks: Iterator[bytes]) -> None:
        """Append ``chunks`` to ``part``'s file (the partial file, or its side file)."""
        path = d.partial if part.side is None else part.side
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            if os.fstat(fd).st_size != (part.start if part.side is None else 0) + part.have:
                raise Changed(f"{path.name} is not as the download left it")
            synced = part.have
            for chunk in chunks:
                if not chunk:
                    continue
                at = part.start + part.have
                if part.have + len(chunk) > part.size:
                    raise FetchError(d.url, f"server sent more than the bytes {part.start}-{part.end - 1} asked for")
                if part.side is None and at < HEAD_BYTES <= at + len(chunk):
                    check_tar_head(d, fd, chunk)
                _check(d, plan)  # before the write: nothing is written once the download stops
                plan.wrote(part, write_all(d, fd, chunk))
                if part.have - synced >= SYNC_EVERY:
                    sync_part(d, fd, path, getattr(os, "fdatasync", os.fsync))
                    synced = part.have
            sync_part(d, fd, path, os.fsync)
        finally:
            os.close(fd)


def _check(d: Download, plan: Plan) -> None:
    if d.cancel.is_set():
        raise Cancelled(d.url)
    if plan.stop.is_set():
        raise Stopped(d.url)


def _wrote(progress: Progress, n: int) -> None:
    """``n`` more bytes of a part came from the source and are on disk (under the plan's lock)."""
    progress.written += n
    progress.fetched += n
