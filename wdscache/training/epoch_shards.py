"""The shards of one epoch stream, in the training process: what the epoch's sequence
learns of each, keeping them pinned, and what becomes of one that fails.

The sequence (:mod:`wdscache.shared.sequence`) is pure: when it reaches a shard, the stream asks
:meth:`EpochShards.arrivals` what the shard holds, and feeds the answers to it. A count
comes from the agent's index (asked for many shards at once), from the open, or from a
scan by a worker; a shard still downloading is pinned as soon as its download holds its
budget and enters the sequence sample by sample as the worker finds them.

A failed shard raises its error, or with ``on_error="skip"`` is skipped: its samples not
read become holes. A corrupt copy is fetched once more: the agent is told, the shard is
opened again (``renewed``), and only a new copy that is corrupt too fails the shard. A copy
pinned that holds another count than the sequence took for its shard (its source overwritten,
the copy downloaded again) fails the shard too: its samples are never read by the old count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ..shared.client import AgentConnection
from ..shared.errors import (
    AgentUnavailableError,
    FetchError,
    ShardError,
    WdsCacheError,
    failed_shard,
    worker_fault,
)
from ..shared.logs import get_logger
from ..shared.messages import Requests, WorkerRequest
from ..shared.mixture import MixSpec
from ..shared.nodes import NodeSpec
from ..shared.plan import ShardOrder
from ..shared.protocol import pages
from ..shared.sequence import EpochSpec
from .pins import STATUS_EVERY, Pins
from .progress import ProgressClock

log = get_logger(__name__)

# What a shard that cannot be read does: "raise", "skip", or a handler given its error, as
# webdataset's handler= is: True skips the shard, False ends the epoch there, raising raises.
OnError = str | Callable[[BaseException], bool]


class StopEpoch(Exception):
    """A shard's error ends the epoch there, after the samples before it: a handler
    (``on_error=fn``) returned False, as webdataset's ``ignore_and_stop`` ends an iteration, or
    ``on_error="raise"`` (``error``: raised once those samples are handed out, where webdataset's
    reader raises it). Caught in the stream, which hands out the samples before the failing
    shard's first one first. ``shard`` is the shard that failed (None: not one shard's fault),
    ``seq`` the read that failed, if known."""

    def __init__(self, message: str, shard: int | None = None, error: WdsCacheError | None = None) -> None:
        super().__init__(message)
        self.shard, self.error = shard, error
        self.seq: int | None = None


def judge(on_error: OnError, exc: WdsCacheError, shard: int | None = None) -> None:
    """What ``on_error`` makes of ``exc`` (of ``shard``): return (skip the shard), or raise
    StopEpoch (carrying ``exc`` with "raise")."""
    if on_error == "raise":
        raise StopEpoch(str(exc), shard, error=exc)
    if callable(on_error) and not on_error(exc):
        raise StopEpoch(str(exc), shard)


COUNTS_AHEAD = 256  # shards whose counts are asked for at once, from the one the sequence reaches
# Shards after the one opened that its open pins too where they are cached: a rank of many
# reads a few samples of each shard, and an open a shard costs a request each side.
OPEN_TOGETHER = 4


class EpochShards:
    """The shards of ``urls`` as reader ``reader`` reads them in the epoch of ``spec``.

    ``workers()`` is how many workers the agent runs now (a restarted agent may run another
    number); ``call_worker(header, worker)`` asks a worker and returns its reply; ``hold_nothing()``
    finishes the stream's reads before an open has to wait (see :meth:`Pins.open`);
    ``sample_size(n)`` hears the bytes per sample of each copy pinned whose size and count are
    known (its file's size over its count, tar headers and all), before any of it is read.
    """

    def __init__(
        self,
        conn: AgentConnection,
        reader: str,
        urls: Sequence[str],
        *,
        spec: EpochSpec | NodeSpec | MixSpec,
        prefetch: int,
        on_error: OnError,
        timeout: float,
        pins: Pins,
        clock: ProgressClock,
        workers: Callable[[], int],
        call_worker: Callable[[WorkerRequest, int], dict[str, Any]],
        hold_nothing: Callable[[], None],
        sample_size: Callable[[float], None],
    ) -> None:
        self.conn, self.urls = conn, urls
        self.requests = Requests(reader, said_hello=True)
        self.on_error, self.timeout, self.prefetch, self.workers = on_error, timeout, prefetch, workers
        self.pins, self.clock = pins, clock
        self.call_worker, self.hold_nothing, self.sample_size = call_worker, hold_nothing, sample_size
        self.spec = spec
        self.order = ShardOrder.of(spec.order())  # positions looked up through it, not a dict a shard
        self._next_order: Sequence[int] | None = None  # the next epoch's, made once the window reaches it
        self.farthest = -1  # the farthest position of our order opened: our window runs from it (see ahead)
        # shard -> its samples, once known. A mixture's epoch was planned with every shard's count
        # (its sequence never asks arrivals()): a copy pinned holding another is checked against it.
        self.sample_counts: dict[int, int] = dict(enumerate(spec.counts)) if isinstance(spec, MixSpec) else {}
        # shard -> the samples the epoch's sequence holds of it (what it was fed: a shard skipped
        # keeps the count its holes were dealt by), to deal the epoch again (training.look_back)
        self.sequenced: dict[int, int] = {}
        self.file_sizes: dict[int, int] = {}  # shard -> its cache file's size, from its open until counted
        # Shards whose counts our workers found lately (url -> when): they report them to the
        # agent, and we wait for those reports before we say bye, so that len() knows them
        # once the epoch ends.
        self.learned: dict[str, float] = {}
        self.skipped: set[int] = set()  # failed, skipped (on_error="skip")
        self.retried: set[int] = set()  # found corrupt: the agent fetches them once more
        self.renewed: set[int] = set()  # of those, opened again since: corrupt now, they fail
        self.to_report: dict[int, str] = {}  # of those, not yet told to the agent
        # Shards whose samples their worker (worker_of) is still finding, a download or a cached
        # shard walked a step at a time: their reads go to that worker too (see worker_of).
        self.walking: set[int] = set()

    def worker_of(self, shard: int) -> int:
        """The worker that counts ``shard``, and serves its reads while it is :attr:`walking`:
        each worker asked for samples of a shard whose table it lacks walks its headers, so one
        worker is asked until the count is final (the agent, for its part, asks the worker of the
        shard's position in its list to walk a shard it publishes, and passes the table on)."""
        return shard % self.workers()

    # -- what the sequence is fed -------------------------------------------------

    def arrivals(self, shard: int) -> Iterator[int | None]:
        """What we learn of ``shard``'s samples when the sequence reaches it: how many it holds
        (its count, from the agent's index or a scan; or, while it downloads, how many its
        download brought so far), None while no more arrived. Ends once that is final."""
        counts = self.sample_counts
        if shard not in counts:
            pos = self.order.position(shard)
            self._known_counts(self.order[pos : pos + COUNTS_AHEAD])
        if shard not in counts:
            self.open(shard, while_downloading=True)
        if shard in self.pins.while_downloading or shard not in counts:
            self.walking.add(shard)
            try:
                yield from self._downloading(shard) if shard in self.pins.while_downloading else self._counting(shard)
            finally:
                self.walking.discard(shard)
            return
        self.pins.counted(shard, counts[shard])
        yield counts[shard]

    def _known_counts(self, shards: Iterable[int]) -> None:
        want = [s for s in shards if s not in self.sample_counts]
        if want:
            reply = self.conn.request(Requests.counts([self.urls[s] for s in want]))
            for s, c in zip(want, reply.get("counts", [])):
                if isinstance(c, int):
                    self.sample_counts[s] = c

    def _downloading(self, shard: int) -> Iterator[int | None]:
        """How many complete samples the worker finds in a shard still downloading.

        None while no more have arrived. The count is final once the worker finds the
        published file; a failed download ends the shard (``on_error``).
        """
        url = self.urls[shard]
        known, asked, changed = 0, time.monotonic(), False
        while True:
            # Asked each time: an agent restarted meanwhile may run another number of workers.
            reply = self.call_worker(Requests.scan(url, while_downloading=True), self.worker_of(shard))
            if reply.get("kind") == "missing" and shard not in self.pins.opened:
                # We let go of it, held by our user (Pins.let_go_parked), and it went: pin it again.
                self.open(shard, again=True, while_downloading=True)
                continue
            if not reply.get("ok"):
                error = unread_error(url, reply, self.clock.endpoint)
                break
            count = int(reply["count"])
            if count > known:
                self.clock.progress_at = time.monotonic()
                known = count
                yield known
            if reply.get("final") and count < known:
                # It started over on a new version at its source, of fewer samples than we gave out.
                error, changed = changed_error(url, known, count), True
                break
            if reply.get("final"):
                self.pins.while_downloading.discard(shard)
                self.sample_counts[shard] = known
                self.learned[url] = time.monotonic()
                self.pins.counted(shard, known)
                return
            if time.monotonic() - asked > STATUS_EVERY:
                asked = time.monotonic()
                status = self.conn.request(self.requests.status(url), timeout=self.clock.left())
                if status.get("state") == "failed":
                    error = self.failure(shard, status)
                    break
                self.clock.heard(shard, status)
                if status.get("state") in ("queued", "unknown", "cached"):
                    # The download lost its budget or was forgotten (the agent restarted), or
                    # it is cached but the worker cannot see it (its file went): pin it again,
                    # waiting without other pins until it downloads with its budget again.
                    self.open(shard, again=True, while_downloading=True)
            yield None
        self.pins.while_downloading.discard(shard)
        self.failed(shard, error, corrupt=not changed)  # raises, or skips the rest of the shard
        self.pins.counted(shard, known)

    def _counting(self, shard: int) -> Iterator[int]:
        """How many samples a cached shard holds, as its worker walks it a step at a time:
        the first samples of a long shard are read before its walk ends. Anything but a walk
        that moves on (its file gone, damaged, skipped) is left to :meth:`_scan`; the
        samples already counted stay counted, as they do for a download that fails."""
        url, known = self.urls[shard], 0
        while shard not in self.skipped:
            reply = self.call_worker(Requests.scan(url, while_downloading=True), self.worker_of(shard))
            count = int(reply["count"]) if reply.get("ok") else 0
            if reply.get("ok") and reply.get("final") and count >= known:
                self.learned[url] = time.monotonic()
                known = count
                break
            if count <= known:
                known = max(known, self._scan(shard, None if reply.get("ok") else reply))
                break
            self.clock.progress_at = time.monotonic()
            known = count
            yield known
        self.sample_counts[shard] = known
        self.pins.counted(shard, known)
        self._tell_size(shard)
        yield known

    def _scan(self, shard: int, given: dict[str, Any] | None = None) -> int:
        """``shard``'s count from a whole walk by its worker (``given``: its answer already at
        hand), pinned again when its copy went, read once more from a new copy when corrupt."""
        if shard in self.skipped:
            return 0
        url = self.urls[shard]
        repinned = False
        while True:
            reply = given if given is not None else self.call_worker(Requests.scan(url), self.worker_of(shard))
            given = None
            if reply.get("ok"):
                self.learned[url] = time.monotonic()
                return int(reply["count"])
            if reply.get("kind") == "missing":
                if repinned:
                    raise FetchError(url, "cache file vanished while pinned; is another process deleting files?")
                # Its copy went while we held it: another reader found it corrupt (the agent then
                # fetches it once more), or the agent restarted and lost our pin. Pin the new copy.
                repinned = True
                self.open(shard, again=True)
                if shard in self.skipped:
                    return 0
                continue
            exc = unread_error(url, reply, self.clock.endpoint)
            if not isinstance(exc, ShardError) or shard in self.renewed:
                self.failed(shard, exc)
                return 0
            # A corrupt copy: the agent fetches it once more; corrupt again, the shard fails.
            self.retried.add(shard)
            log.warning("%s; reading it again from a new copy", exc)
            self.report_corrupt(shard, str(exc))
            self.open(shard, again=True)
            self.renewed.add(shard)
            if shard in self.skipped:
                return 0

    # -- pins ---------------------------------------------------------------------

    def ahead(self, shard: int) -> list[str]:
        """Our window from ``shard``: the shards we read after it, or after the farthest shard
        of our order opened before it. A shard opened again (its pin let go before a wait, its
        copy evicted) is one the shuffle buffer still holds samples of, behind where we read:
        a window from it would move back over shards read already, and the agent would fetch
        those again and evict for them the shards fetched for where we read."""
        pos = self.order.position(shard)
        if pos < 0:  # not ours: a repeat of another node's sample
            pos = len(self.order)
        else:
            pos = self.farthest = max(pos, self.farthest)
        nxt = self.order[pos + 1 : pos + 1 + self.prefetch]
        if len(nxt) < self.prefetch:
            if self._next_order is None:
                self._next_order = self.spec.following().order()
            nxt += tuple(self._next_order[: self.prefetch - len(nxt)])
        return [self.urls[s] for s in nxt]

    def open(
        self, shard: int, *, again: bool = False, while_downloading: bool = False, also: Sequence[int] | None = None
    ) -> None:
        """Pin ``shard`` (see :meth:`Pins.open`), our window moving with it; one that fails is
        raised or skipped (:meth:`failed`). ``also``: the shards its open pins too if they are
        cached now (by default the next of our order, :meth:`soon`; none when opened ``again``)."""
        if shard in self.skipped or (shard in self.pins.opened and not again):
            return
        if also is None:
            also = () if again else self.soon(shard)
        reply = self.pins.open(
            shard,
            self.ahead(shard),
            again=again,
            while_downloading=while_downloading,
            also=also,
            before_wait=self.hold_nothing,
            on_status=lambda status: self.clock.heard(shard, status),
        )
        if not reply.get("ok"):
            self.failed(shard, self.failure(shard, reply))
            return
        for soon, pinned, count in zip(also, reply.get("also") or (), reply.get("also_samples") or [None] * len(also)):
            if pinned is True and not self._count_holds(soon, count):
                self.pins.release(soon, force=True)  # its open, when reads reach it, checks its copy
        if reply.get("while_downloading"):
            if shard not in self.sample_counts:
                self.pins.while_downloading.add(shard)
            return
        count = reply.get("samples")
        if not self._count_holds(shard, count if isinstance(count, int) else None):
            if count is None:
                count = self._walked(shard)
            if count is not None and count != self.sample_counts[shard]:
                self.failed(shard, changed_error(self.urls[shard], self.sample_counts[shard], count), corrupt=False)
        size = reply.get("size")
        if type(size) is int:
            self.file_sizes[shard] = size
            self._tell_size(shard)

    def _tell_size(self, shard: int) -> None:
        """Tell ``sample_size`` the bytes per sample of ``shard``'s copy pinned, once its file's
        size and its count are both known (a cached shard's count may come after its open)."""
        count = self.sample_counts.get(shard)
        if count and shard in self.file_sizes:
            self.sample_size(self.file_sizes.pop(shard) / count)

    def _count_holds(self, shard: int, count: int | None) -> bool:
        """Whether the copy of ``shard`` just pinned, which the agent says holds ``count`` samples
        (None: not counted), may be read by our plan: the sequence took no count of it yet (the
        copy's count becomes it, or with None is learned when the sequence reaches it), or took
        this one. False: our plan holds another count, or one the copy must be walked for."""
        planned = self.sample_counts.get(shard)
        if planned == count:
            return True
        if planned is not None and shard in self.pins.remaining:
            return False
        if count is None:
            self.sample_counts.pop(shard, None)
        else:
            self.sample_counts[shard] = count
        return True

    def _walked(self, shard: int) -> int | None:
        """``shard``'s count from a whole walk of the copy pinned (None: the walk failed; our reads
        of it fail alike, and are handled as they come)."""
        url = self.urls[shard]
        reply = self.call_worker(Requests.scan(url), self.worker_of(shard))
        if not reply.get("ok"):
            return None
        self.learned[url] = time.monotonic()
        return int(reply["count"])

    def soon(self, shard: int) -> list[int]:
        """The shards after ``shard`` in our order that its open pins too if they are cached now
        (see :meth:`Pins.open`): the next :data:`OPEN_TOGETHER` not pinned nor skipped. One whose
        count we do not know yet is counted as the sequence reaches it, as any pinned shard is."""
        pos = self.order.position(shard)
        if pos < 0:
            return []
        opened, skipped = self.pins.opened, self.skipped
        return [s for s in self.order[pos + 1 : pos + 1 + OPEN_TOGETHER] if s not in opened and s not in skipped]

    def check_download(self, shard: int) -> None:
        """Reads wait on ``shard``'s download: is it still going? Failed, it fails here;
        forgotten (the agent restarted) or without its budget, it is pinned again."""
        status = self.conn.request(self.requests.status(self.urls[shard]), timeout=self.clock.left())
        if status.get("state") == "failed":
            self.failed(shard, self.failure(shard, status))
        elif status.get("state") in ("queued", "unknown"):
            self.open(shard, again=True)
        else:
            self.clock.heard(shard, status)

    # -- failures -----------------------------------------------------------------

    def failed(self, shard: int, exc: WdsCacheError, *, corrupt: bool = True) -> None:
        """``shard`` cannot be read: end the epoch there (:class:`StopEpoch`, carrying ``exc``
        with ``on_error="raise"``), or (``on_error="skip"``) skip the shard: its samples not yet
        read become holes, dropped or filled with repeats by the stream (:mod:`.holes`).
        ``corrupt=False``: a ShardError that is no fault of the copy (the agent is not told of it).
        A shard skipped already (reads of it in flight together fail one after another) is let
        be: ``on_error`` hears of each shard once."""
        if shard in self.skipped:
            return
        self.pins.close_file(shard)
        if corrupt and isinstance(exc, ShardError):  # a failed download is already in the agent's stats
            self.report_corrupt(shard, str(exc))
        judge(self.on_error, exc, shard)
        log.warning("skipping %s: %s", self.urls[shard], exc)
        self.skipped.add(shard)
        self.sample_counts[shard] = 0
        self.pins.drop(shard, timeout=self.clock.left())  # reads of it still out keep their holes

    def failure(self, shard: int, reply: dict[str, Any]) -> WdsCacheError:
        """The error of a shard the agent failed (see :func:`failed_shard`)."""
        return failed_shard(self.urls[shard], reply)

    def found_corrupt(self, shard: int, exc: ShardError) -> bool:
        """A read found ``shard``'s copy corrupt. True: read it again once the shard is opened
        again (the agent fetches a new copy, told in :meth:`tell_corrupt`); False: it was
        opened again since (:meth:`reopened`), so the new copy is corrupt too."""
        if shard in self.renewed:
            return False
        # (A read sent before we opened the new copy still meets the old one.)
        if shard not in self.retried:
            self.retried.add(shard)
            self.to_report[shard] = str(exc)
            log.warning("%s; reading it again from a new copy", exc)
        return True

    def tell_corrupt(self) -> None:
        """Tell the agent of the corrupt copies found: before the shard is opened again, so that the
        agent fetches a new copy."""
        while self.to_report:
            shard, error = self.to_report.popitem()
            self.report_corrupt(shard, error)

    def reopened(self, shard: int) -> None:
        """``shard`` was pinned again for reads that go again."""
        if shard in self.retried:
            self.renewed.add(shard)  # opened since it was found corrupt: a new copy

    def report_corrupt(self, shard: int, error: str) -> None:
        try:
            self.conn.request(Requests.corrupt(self.urls[shard], error), timeout=min(5.0, self.timeout))
        except AgentUnavailableError:
            pass

    def await_counts(self, within: float = 1.0) -> None:
        """Wait (a little) until the agent holds the counts our workers found: their reports
        go by another socket than their replies to us, so they may arrive after our bye."""
        now = time.monotonic()
        deadline = now + within
        # Reports sent longer ago have arrived (or were dropped: they are advisory).
        missing = [url for url, when in self.learned.items() if now - when < within]
        while missing:
            counts = agent_counts(self.conn, missing, timeout=2.0)
            missing = [url for url, count in zip(missing, counts) if count is None]
            if not missing or time.monotonic() > deadline:
                return  # past the deadline a report was dropped (they are advisory): len() learns it later
            time.sleep(0.01)


def agent_counts(conn: AgentConnection, urls: Sequence[str], timeout: float | None = None) -> list[Any]:
    """The agent's sample count of each of ``urls`` (None: never counted), asked in pages."""
    counts: list[Any] = []
    for _, chunk in pages(urls):
        counts.extend(conn.request(Requests.counts(chunk), timeout=timeout).get("counts", []))
    return counts


def changed_error(url: str, planned: int, count: int) -> ShardError:
    """The error of a shard whose copy holds ``count`` samples where the epoch planned ``planned``."""
    return ShardError(
        url,
        f"it changed at its source since this epoch was planned: it holds {count} samples now, {planned} then; "
        "this epoch cannot read it by its plan, the next epoch reads it as it is now",
    )


def unread_error(url: str, reply: dict[str, Any], endpoint: str) -> WdsCacheError:
    """The error of a worker's failed answer about ``url``, for an epoch stream as for random
    access, so that ``on_error`` and the user see one class for one failure: a ShardError when
    the shard itself is bad (``corrupt``), the agent's own fault (``fault``: out of open files)
    as such, else a FetchError, as for any shard its source cannot give us (its cache file
    cannot be opened or read: that blames neither the shard's bytes nor its copy, which the
    agent is not told is corrupt)."""
    if reply.get("kind") == "corrupt":
        return shard_error(url, reply)
    if reply.get("kind") == "fault":
        return worker_fault(endpoint, reply)
    return FetchError(
        url, f"a sample worker of the agent could not read its cache file ({reply.get('error')}); see the agent's log"
    )


def shard_error(url: str, reply: dict[str, Any]) -> ShardError:
    """The error a worker's answer that ``url``'s copy is corrupt names."""
    offset = reply.get("offset")
    return ShardError(
        url, str(reply.get("reason") or reply.get("error")), offset=offset if isinstance(offset, int) else None
    )
