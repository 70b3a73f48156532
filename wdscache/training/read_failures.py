"""What an epoch stream does when a read fails, in the training process.

A worker's answer to a read may be a failure (``kind``: refused, missing, pending, corrupt, a
fault of the agent's own, or a shard that cannot be read), a direct read of the cache files may fail, a request may get no
answer in time, and ``on_error``'s handler may say stop. :class:`ReadFailures` moves each read
concerned on by the transitions of :mod:`wdscache.training.reads` (the read table stays the one
record of each read's state), keeps the pin counts as the reads hold them, and says when the
epoch ends. With ``on_error="raise"`` a shard's failure ends the epoch at the shard's first
sample not handed out and raises, naming the shard, once every sample before it is handed out
(a read that holds some of them and items of the shard is cut and asked again for them: see
:meth:`ReadFailures.stop_at`); a worker refusing the consumer, or failing for a fault of the
agent's (out of open files), raises at once, whatever ``on_error``: no shard is blamed for it.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..shared.errors import NotTrustedError, ShardError, worker_fault
from ..shared.logs import get_logger
from .direct import StaleFile
from .epoch_shards import StopEpoch, judge, unread_error
from .pins import STATUS_EVERY
from .reads import Read, ReadState

if TYPE_CHECKING:
    from .stream import EpochStream

log = get_logger(__name__)

MAX_RESENDS = 3  # a request no worker answers this often fails instead of retrying forever
PENDING_RETRY = 0.05  # seconds before asking again for samples a restarted download does not hold yet
MAX_STALE = 8  # direct reads in a row finding a file replaced: past this we do not see the agent's files


class ReadFailures:
    """Failed reads of one epoch stream: sent again, reopened, delayed, skipped or raised."""

    def __init__(self, stream: EpochStream) -> None:
        self.stream = stream
        self.stale = 0  # direct reads in a row that found a file replaced (see direct_failed)
        self.last_status = 0.0  # when reads long delayed last had their downloads checked

    def failed(self, read: Read, header: dict[str, Any]) -> None:
        """A worker's answer to ``read`` says it failed (``header["kind"]``)."""
        stream = self.stream
        items, kind, reads = read.items, header.get("kind"), stream.reads
        if kind == "refused":  # not a shard's fault: never skipped
            raise NotTrustedError(
                f"a worker of the agent at {stream.settings.endpoint} refused this consumer: {header.get('error')}"
            )
        if kind == "fault":  # the agent's (out of open files, say): never a shard's, never skipped
            raise worker_fault(stream.settings.endpoint, header)
        if kind == "missing":
            # Evicted behind our back (the agent restarted and lost our pins, say): pin again,
            # which needs the agent, so not here (we may be inside a request to it): see recover.
            reads.reopen(read)
            return
        opened = stream.pins.opened
        if kind == "pending":
            # Read from a download that started over and has not got this far again yet.
            now = time.monotonic()
            for _, (pending, _) in read.sent_items():
                if pending in opened:
                    opened[pending] += 1
            reads.delay(read, now + PENDING_RETRY, now)
            return
        urls = stream.urls
        read_shards = {urls[sid[0]]: sid[0] for _, sid in read.sent_items()}
        shard = read_shards.get(str(header.get("url")))
        if shard is None:  # not one shard's fault (a bad request, a worker's bug): the whole read
            exc = unread_error(urls[read.sent_items()[0][1][0]], header, stream.settings.endpoint)
            with failing(read):
                judge(stream.settings.on_error, exc)
            log.warning("skipping %d samples: %s", len(items) - len(read.got), exc)
            reads.answer(read, *read.whole([], []))  # the samples of its earlier parts stay
            return
        exc = unread_error(urls[shard], header, stream.settings.endpoint)
        if isinstance(exc, ShardError) and stream.shards.found_corrupt(shard, exc):
            # The read goes again once the shard is opened again, from a new copy (recover).
            reads.reopen(read)
            return
        for _, (other, _) in read.sent_items():
            if other in opened:
                opened[other] += 1  # held again, as a SENT read's are: sent again, or cut by stop_at
        with failing(read):
            stream.shards.failed(shard, exc)  # StopEpoch unless on_error="skip"
        stream.batches.dispatch(read)  # the other shards' samples again; this one's are holes

    def direct_failed(self, exc: OSError) -> None:
        """A read of the cache files failed: one file replaced meanwhile costs that read only;
        anything else (or files replaced read after read) means we cannot read the cache
        files, so the workers send the bytes from now on, and the loader is told."""
        stream = self.stream
        self.stale += isinstance(exc, StaleFile)
        if stream.pins.files is not None and (not isinstance(exc, StaleFile) or self.stale >= MAX_STALE):
            why = str(exc)  # the message, not the exception: it holds frames
            stream.session.direct_failed(why)
            log.warning("cannot read the cache files directly (%s); the workers send the bytes instead", why)
            stream.pins.stop_direct()

    def resend_overdue(self, now: float) -> None:
        """Send again the reads whose retry time came, and those no worker answered in time."""
        stream = self.stream
        reads = stream.reads
        if reads.delayed:
            for read in reads.in_state(ReadState.DELAYED):
                if now >= read.retry_at:
                    stream.batches.dispatch(read)
        patience = min(stream.settings.timeout / 2, 10.0)
        for read in reads.in_state(ReadState.SENT):
            if now - read.sent_at > patience:
                # The worker may have died with our request: ask again (another worker, or for a
                # shard still counted its worker's replacement), unless the agent itself is gone
                # (then this raises a clear error within the timeout, no hang).
                stream.ping()
                if stream.runs.new_hello is not None:
                    stream.runs.relink()  # the agent restarted: every read went again, to its new workers
                    return
                read.resends += 1
                if read.resends > MAX_RESENDS:
                    url = stream.urls[read.items[read.sent[0]][1][0]]
                    raise ShardError(url, f"no worker answered {MAX_RESENDS + 1} times; a worker may die reading it")
                log.info("request to worker %d timed out; resending", read.worker)
                stream.batches.dispatch(read)

    def hold_nothing(self) -> None:
        """Before an open waits: what is batched goes out (its shards are pinned) and we wait for
        its answers; reads put off ("pending") give their pins back, to be pinned again
        (:meth:`recover`). That includes a read answered "pending" while we wait: no read holds
        a pin once this returns, or the open could wait for room that our own pins keep."""
        stream = self.stream
        stream.batches.flush()
        opened, reads, skipped = stream.pins.opened, stream.reads, stream.shards.skipped
        while True:
            for read in reads.in_state(ReadState.DELAYED):
                for _, (held, _) in read.sent_items():
                    if held in opened and held not in skipped:  # as failed() counted them
                        opened[held] -= 1
                reads.reopen(read)
            if not reads.awaiting():
                return
            stream.drain()

    def recover(self) -> None:
        """Reads that came back without their samples: pin lost shards again, give up on failed downloads."""
        stream = self.stream
        reads, pins, shards = stream.reads, stream.pins, stream.shards
        shards.tell_corrupt()
        while reads.reopening:
            read = reads.in_state(ReadState.REOPEN)[0]
            per_shard = Counter(read.items[i][1][0] for i in read.to_ask(shards.skipped))
            held = [s for s in per_shard if s in pins.opened]  # for other reads too
            free = [s for s in per_shard if s not in pins.opened]
            with failing(read):  # an open waits until cached; StopEpoch if it failed, unless skipped
                for shard in held:
                    shards.open(shard, again=True)  # its copy may have gone: pinned afresh
                if free:
                    # The rest are pinned with it only if cached now, never waited for: waiting for
                    # each in turn, each download could evict one pinned before (each wait lets go
                    # of our other pins), and with a budget of fewer shards than the read spans,
                    # that would go on for ever. What is not pinned goes in a later part.
                    shards.open(free[0], again=True, also=free[1:])
            read.later = {s for s in per_shard if s not in pins.opened and s not in shards.skipped}
            for shard, n in per_shard.items():
                if shard not in shards.skipped and shard not in read.later:
                    pins.opened[shard] += n
                    shards.reopened(shard)
            stream.batches.dispatch(read)
        now = time.monotonic()
        stuck = [
            read
            for read in reads.in_state(ReadState.DELAYED)
            if read.pending_since is not None and now - read.pending_since > STATUS_EVERY
        ]
        if not stuck or now - self.last_status < STATUS_EVERY:
            return
        # Reads waiting this long on a download: is it still going?
        self.last_status = now
        for read in stuck:
            if read.state is not ReadState.DELAYED:
                continue  # an open that had to wait put it back for reopening
            # A shard that fails here is let go; its items become holes.
            for shard in {sid[0] for _, sid in read.sent_items() if sid[0] not in shards.skipped}:
                with failing(read):
                    shards.check_download(shard)

    def stop_at(self, stop: StopEpoch, end: int | None) -> int:
        """The first read not handed out, now that a shard's error ends the epoch at ``stop`` (a
        handler said stop, or ``on_error="raise"``: its error comes once the samples before are
        handed out; ``end``: where an earlier stop ended it). The epoch stops at the read that
        failed, or an earlier one of the failing shard whose samples are not here (else the next
        read: what was batched goes out); that read, if it holds items before the shard's first,
        is cut there and asked again for them (its samples may be lost: the agent restarted, say),
        so that every sample before the shard is handed out, and the epoch stops after it. The
        reads from there on are forgotten (their pin counts given back), and the shard is let go,
        so that no read before it fails on it again."""
        stream = self.stream
        reads = stream.reads
        log.warning("epoch %d ends at a shard that cannot be read: %s", stream.spec.epoch, stop)
        if stop.shard is not None:
            stream.shards.skipped.add(stop.shard)  # never read again
        stream.batches.flush()
        at = stream.batches.seq_next if stop.seq is None else stop.seq
        if stop.shard is not None:
            at = min(
                (
                    read.seq
                    for read in reads.by_seq.values()
                    if read.state is not ReadState.ANSWERED and any(sid[0] == stop.shard for _, sid in read.items)
                ),
                default=at,
            )
        read = reads.by_seq.get(at)
        if (end is None or at < end) and read is not None and read.state is not ReadState.ANSWERED:
            first = next((i for i, (_, sid) in enumerate(read.items) if sid[0] == stop.shard), 0)
            if first:
                self.give_back(read)
                reads.cut(read, first)
                at += 1
        if end is not None:
            at = min(at, end)
        for dropped in reads.by_seq.values():  # else their shards stay pinned while an open waits for room
            if dropped.seq >= at:
                self.give_back(dropped)
        reads.drop_from(at)
        return at

    def give_back(self, read: Read) -> None:
        """The pin counts ``read`` holds given back: one per item asked for, while SENT or DELAYED."""
        if read.state in (ReadState.SENT, ReadState.DELAYED):
            opened = self.stream.pins.opened
            for _, (shard, _) in read.sent_items():
                if shard in opened:
                    opened[shard] -= 1


@contextlib.contextmanager
def failing(read: Read) -> Iterator[None]:
    """A StopEpoch raised here ends the epoch at ``read`` (the samples before the failing shard's
    first in it are handed out, and the reads before it)."""
    try:
        yield
    except StopEpoch as stop:
        if stop.seq is None:
            stop.seq = read.seq
        raise
