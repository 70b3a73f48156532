"""One epoch of one rank, in the training process: the sample pipeline behind
``CachedMultiLoader``'s iteration (the guarantees are in :mod:`wdscache.training.loader`).

:class:`EpochStream` runs the epoch's sequence (:mod:`wdscache.shared.sequence`), feeding it what
it learns of each shard (:mod:`wdscache.training.epoch_shards`); has this rank's share batched
into reads (:mod:`wdscache.training.reads`, one record per read) of pinned shards
(:mod:`wdscache.training.pins`) and sent to the agent's workers (:mod:`wdscache.training.read_batches`);
decodes their replies (:mod:`wdscache.training.replies`); and hands the samples out in order,
every wait bounded by :mod:`wdscache.training.progress`.

The loader hands a stream what it needs explicitly: its settings (:class:`StreamSettings`)
and the session it opened with the agent (:class:`Session`); the stream tells it back
through the session's ``direct_failed``. One thread runs a stream; its reporter thread
has its own connection.

When the agent restarts, the stream goes on with its new run (:mod:`wdscache.training.restarts`):
what was delivered or received stays, so the epoch delivers each sample once; a new run
serving another list ends it. A read that fails is sent again, reopened, delayed, skipped or
raised by :mod:`wdscache.training.read_failures`.

Samples go out a read at a time: each read's samples are one list, handed out through its
iterator (:meth:`EpochStream.delivered_samples`), so no layer of Python runs per sample on the
way to the user; what was delivered is counted per read and, within the read being handed
out, by how far its iterator is.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter, length_hint
from typing import Any, cast

from ..shared.client import BYE_TIMEOUT, AgentConnection
from ..shared.errors import AgentUnavailableError, FetchError, ShardError, WdsCacheError, worker_fault
from ..shared.logs import get_logger
from ..shared.messages import END_ERROR_MAX, Requests, WorkerRequest
from ..shared.mixture import MixSpec
from ..shared.nodes import JobEpoch, NodeShare, NodeSpec
from ..shared.redact import redact_urls
from ..shared.sequence import EpochSpec, IdRun, RankShare, Resume, SampleId, ShardFeed
from .direct import CacheFiles
from .epoch_shards import EpochShards, OnError, StopEpoch
from .holes import HoleMode, Holes
from .look_back import LookBack
from .pins import Pins
from .progress import WORKERS_SILENT, ProgressClock, Waited, agent_gone
from .read_batches import SHARE_ENDED, ReadBatcher
from .read_failures import ReadFailures
from .reads import Item, ReadState, ReadTable
from .replies import decode_reply
from .reporter import ReportClock, Reporter
from .restarts import AgentRuns
from .worker_links import WorkerLinks
from .worker_slices import WHOLE, WorkerSlice

log = get_logger(__name__)

STREAM_POLL = 0.005  # seconds between looks at a shard still downloading, while nothing else arrives
# ...the epoch's first look (doubled at each look up to STREAM_POLL): its first sample, from a
# shard nobody prefetched, is looked for as soon as it may be there; later waits as ever.
STREAM_POLL_FIRST = 0.001
_END = object()
_SHARD = itemgetter(0)  # an id's shard


@dataclass(frozen=True)
class StreamSettings:
    """The loader's settings a stream follows (documented at ``CachedMultiLoader``)."""

    job: str
    rank: int
    world_size: int
    endpoint: str
    seed: int
    shuffle: bool
    shuffle_buffer: int
    drop_last: bool
    timeout: float
    on_error: OnError
    request_size: int
    inflight: int | None
    zero_copy: bool
    direct_reads: bool  # try them: asked for, and they did not fail in this loader before


@dataclass(frozen=True)
class Session:
    """The reader session a loader opened with the agent for one stream (its hello done)."""

    name: str  # the reader's name
    conn: AgentConnection
    hello: dict[str, Any]  # the agent's answer to the hello
    urls: Sequence[str]  # the URL list read
    list_id: str
    connect: Callable[[float], AgentConnection]  # another connection (the reporter thread's own)
    direct_failed: Callable[[str], None]  # why direct reads failed: the loader does not try them again
    reports: ReportClock  # the loader's, across its streams
    # The hello again, as the same reader, to a new run of the agent (it restarted); returns its
    # answer and the id of the list read there (the loader's own, else the new run's).
    hello_again: Callable[[AgentConnection, str], tuple[dict[str, Any], str]]


def epoch_ids(
    spec: EpochSpec | NodeSpec | MixSpec, share: RankShare | NodeShare, pins: Pins, shards: EpochShards
) -> Iterator[SampleId | IdRun | list[SampleId] | None]:
    """The epoch's ids (every rank's), the sequence fed what we learn of each shard (see
    :meth:`EpochShards.arrivals`); None while a downloading shard has no more samples yet.
    Pins of shards no rank needs any more are released as the share settles past them."""
    # Runs once per id of a node's whole epoch, every rank's (a rank of four sees four ids
    # for each of its samples), but once per run of an unshuffled epoch and per list of a
    # shuffled one or a mixture's: kept to local names.
    remaining, unneeded = pins.remaining, pins.unneeded
    feed = ShardFeed()
    arrivals: Iterator[int | None] | None = None  # of the shard the sequence wants
    wanted = -1  # that shard
    ask = 0  # the feed's ask that ``arrivals`` answers
    items = spec.ids(feed.samples) if isinstance(spec, NodeSpec) else spec.runs(feed)
    for sid in items:
        if sid is None:  # the sequence wants more of a shard
            if arrivals is None or ask != feed.asks:
                # A new ask: a node's part may stop with its last id before its shard's end came,
                # and the next part ask for another shard (or that one from its start again).
                assert feed.wanted is not None  # set whenever the sequence yields None
                wanted = feed.wanted
                arrivals, ask = shards.arrivals(wanted), feed.asks
            got = next(arrivals, _END)
            if got is _END:
                feed.end()
                arrivals = None
            elif got is not None:
                feed.grow(cast(int, got))
                shards.sequenced[wanted] = cast(int, got)
            else:  # nothing new yet
                if unneeded and unneeded[0][0] <= share.settled:
                    pins.release_settled(share.settled)
                yield None
            continue
        if unneeded and unneeded[0][0] <= share.settled:  # per id: look before calling
            pins.release_settled(share.settled)
        taken: Iterable[tuple[int, int]]  # (shard, ids of it)
        if isinstance(sid, list):  # ids that left the shuffle buffer together
            pins.given += len(sid)
            taken = Counter(map(_SHARD, sid)).items()
        else:
            n = sid.stop - sid.start if isinstance(sid, IdRun) else 1
            pins.given += n
            taken = ((sid[0], n),)
        for shard, n in taken:
            left = remaining[shard] = remaining.get(shard, 0) - n
            if not left:
                # No rank needs it once the share has dealt this id (of a list, the whole
                # list: later than its last id, never sooner): until then ours may wait in a
                # row (and after that, our reads of it hold it: see Pins.release).
                pins.all_out(shard)
        yield sid


class EpochStream:
    """One epoch of one rank: the worker sockets, the reads out and the sample pipeline."""

    def __init__(
        self,
        settings: StreamSettings,
        session: Session,
        epoch: int,
        start: Resume | JobEpoch,
        worker_slice: WorkerSlice = WHOLE,
        spec: EpochSpec | MixSpec | None = None,
        rename: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        self.settings = s = settings
        self.rename = rename  # what a read's samples get in place before they go out (see _pipeline)
        self.worker_slice = worker_slice  # this process's slice of the rank's share (a DataLoader worker's)
        self.session = session
        self.name, self.conn, self.urls, self.list_id = session.name, session.conn, session.urls, session.list_id
        self.requests = Requests(self.name, said_hello=True)
        hello = session.hello
        self.finished = False  # resources released
        self.complete = False  # every sample of the rank's share was delivered
        self.spec, self.share = _spec_and_share(s, len(self.urls), epoch, start, spec)
        self._delivered = 0  # samples handed to the user, but for the chunk being handed out (see delivered)
        self._handing: tuple[int, Iterator[Any]] | None = None  # that chunk: its length and iterator
        self.clock = ProgressClock(self.conn, self.name, self.urls, endpoint=s.endpoint, timeout=s.timeout)
        # Payloads read from the cache files here (the agent says where they are), if we see
        # its very cache directory, unless a read of them fails: then the workers send them.
        direct = s.direct_reads and same_directory(hello)
        self.pins = Pins(
            self.conn, self.name, self.urls, timeout=s.timeout, files=CacheFiles(hello["cache_dir"]) if direct else None
        )
        # A mixture knows its counts up front: every shard's ids in the epoch are known, so its
        # pins go once the share is past its last (the sequence never asks arrivals()).
        self.labelled = isinstance(self.spec, MixSpec) and self.spec.mixture.labelled
        if isinstance(self.spec, MixSpec):
            for shard, n in self.spec.totals().items():
                self.pins.counted(shard, n)
        endpoints = hello["workers"]
        self.workers = WorkerLinks(endpoints, [self.conn.worker_key(i) or "" for i in range(len(endpoints))])
        if not self.workers:
            raise WdsCacheError(f"the agent at {s.endpoint} has no workers")
        self.failures = ReadFailures(self)
        self.batches = ReadBatcher(self)  # the share batched into reads, sent to the workers
        self.shards = EpochShards(
            self.conn,
            self.name,
            self.urls,
            spec=self.spec,
            prefetch=int(hello.get("prefetch", 8)),
            on_error=s.on_error,
            timeout=s.timeout,
            pins=self.pins,
            clock=self.clock,
            workers=lambda: len(self.workers),
            call_worker=self._worker_call,
            hold_nothing=self.failures.hold_nothing,
            sample_size=self.batches.presized,
        )
        self.reads = ReadTable()
        self.call_replies: dict[str, dict[str, Any] | None] = {}  # rid -> reply of a _worker_call
        self.stats = {"samples": 0, "bytes": 0, "wait_s": 0.0}  # samples out of _pipeline
        self.holes = Holes.of(s.world_size, s.seed, epoch)  # skipped shards' samples: dropped or filled
        # Since when the rank has been waiting for its next read (None: it has one, or is away with
        # the samples): reports count a wait under way too, or one long wait shows only once it ends.
        self._waiting_from: float | None = None
        self._out: tuple[Iterator[Any], list[int]] | None = None  # the latest read's samples (see _pipeline)
        self.broken = False  # the epoch ended in an error: close quickly
        self.end_error: str | None = None  # the error of ours that ended the epoch, for our bye
        self.epoch = epoch
        report = functools.partial(self.requests.report, s.job, s.rank)
        self.reporter = Reporter(session.connect, report, self._figures, session.reports, self.pins.let_go_parked)
        self.runs = AgentRuns(self)  # the agent run our links and pins belong to, and a new one taken up

    # -- the rank's share -------------------------------------------------------

    def resume(self) -> Resume | tuple[Resume, ...]:
        """Where the job stands, if every rank delivered as many samples as this one (on several
        nodes: each part's)."""
        return self.share.resume_after(self.delivered)

    @property
    def progress(self) -> int:
        """Samples the job delivered this epoch, if every rank delivered as many as this one
        (for stats: cheap, and counts padding)."""
        return self.share.resume.delivered() + self.delivered * self.settings.world_size

    def _owned(self) -> Iterator[Item | None]:
        """(position, id) of this rank's samples not delivered before, padded or cut at the end
        (see :class:`~wdscache.shared.sequence.RankShare`); None while a downloading shard has no
        more samples yet. Positions delivered before cost counts only, never payloads."""
        w = self.worker_slice
        yield from self.share.pairs(
            epoch_ids(self.spec, self.share, self.pins, self.shards),
            part=w.index,
            parts=w.count,
            skip=sys.maxsize if w.over else w.skip,  # (the share's pairs still counted: see RankShare.count)
        )
        self.pins.release_settled(self.share.settled)

    def counts(self) -> dict[int, int]:
        """Run the epoch's sequence without reading a payload, and close: what it learned of each
        shard's count (a mixture's epoch needs them all before it starts)."""
        try:
            for pair in self._owned():
                if pair is None:
                    self.pins.flush()
                    time.sleep(STREAM_POLL)  # a shard still downloading: look again soon
        except StopEpoch as stop:
            if stop.error is None:
                raise
            self.end_error = told(stop.error)
            raise stop.error from None
        except WdsCacheError as exc:
            ended = self._ending(exc)
            if ended is exc:
                raise
            raise ended from None
        finally:
            self.close()
        return dict(self.shards.sample_counts)

    def chunks(self) -> Iterator[Iterator[dict[str, Any]]]:
        """The rank's samples in order, an iterator over a list per read (see :meth:`_pipeline`)."""
        try:
            yield from self._pipeline()
        except WdsCacheError as exc:
            ended = self._ending(exc)
            if ended is exc:
                raise
            raise ended from None
        finally:
            self.close()

    def _ending(self, exc: WdsCacheError) -> WdsCacheError:
        """The error that ends the epoch for ``exc`` (told in our bye): an agent gone silent is
        :func:`~.progress.agent_gone`'s; any other is ``exc`` itself. The epoch is broken either
        way: the agent may be gone, and is not waited for again on the way out."""
        self.broken = True
        if isinstance(exc, AgentUnavailableError) and exc.hint != WORKERS_SILENT:  # (WORKERS_SILENT: it answered)
            exc = agent_gone(exc, self.settings.timeout)
        self.end_error = told(exc)
        return exc

    @property
    def delivered(self) -> int:
        """Positions of the share handed to the user (not merely received: map/batch look ahead);
        of a chunk being handed out (:meth:`delivered_samples`), those its iterator gave out.
        One per sample, but for holes dropped (see :mod:`wdscache.training.holes`)."""
        handing = self._handing
        if handing is None:
            return self.holes.positions(self._delivered)
        n, it = handing
        return self.holes.positions(self._delivered + n - length_hint(it))

    def delivering(self, items: Iterator[tuple[int, Any]]) -> Iterator[Any]:
        """Yield items, counting the samples in each once the user has it (for :meth:`resume`)."""
        try:
            for n, item in items:
                self._delivered += n
                yield item
        except StopEpoch as stop:  # on_error's handler said stop (a shard failed while read): it ends here
            log.warning("epoch %d ends at a shard that cannot be read: %s", self.spec.epoch, stop)
        self.complete = True  # an epoch a handler stopped is over too: the next one follows

    def delivered_samples(self) -> Iterator[dict[str, Any]]:
        """The rank's samples as :meth:`delivering` yields them, counted a chunk at a time: no
        layer of Python per sample (``delivered`` asks the chunk's iterator how far it is)."""
        handed = self._handed()
        try:
            yield from chain.from_iterable(handed)
        finally:
            handed.close()

    def _handed(self) -> Generator[Iterator[dict[str, Any]], None, None]:
        try:
            for it in self.chunks():
                n = length_hint(it)
                self._handing = (n, it)
                yield it
                self._delivered += n  # all of it was handed out, or we would not be here
                self._handing = None
        except StopEpoch as stop:  # as in delivering
            log.warning("epoch %d ends at a shard that cannot be read: %s", self.spec.epoch, stop)
        self.complete = True

    def _pipeline(self) -> Iterator[Iterator[dict[str, Any]]]:
        """The rank's samples in order, an iterator over a list per read (``_out``: that one,
        and the payload bytes of each sample in it), each list renamed in place first
        (``rename``): the reporter counts what went out by that very iterator. A hole (a sample
        of a shard skipped with ``on_error="skip"``) is dropped with one rank, and filled with a
        repeat of a recent sample with several, so that every rank keeps its count
        (:mod:`wdscache.training.holes`)."""
        limit = self.settings.inflight or max(4, 2 * len(self.workers))
        owned = self._owned()
        reads = self.reads
        by_seq = reads.by_seq
        batches = self.batches
        pins = self.pins
        seq_yield = 0
        exhausted = False
        holes = self.holes
        end: int | None = None  # a shard's error ends the epoch (StopEpoch): the first read not handed out
        look = LookBack(self.spec, self.share, self.shards, self.settings, self.worker_slice)  # (see holes.py)
        error: WdsCacheError | None = None  # and with on_error="raise", its error, raised there
        poll = STREAM_POLL_FIRST  # the next wait for a shard still downloading
        try:
            while True:
                t0 = self._waiting_from = time.perf_counter()
                stalled = False
                try:
                    if pins.letting_go:
                        pins.flush()
                    if self.runs.repinning:
                        self.runs.repin()
                    if reads.reopening or reads.delayed:
                        self.failures.recover()
                    # Reads waiting to be pinned again do not count: their samples are not here.
                    while not exhausted and len(by_seq) - reads.reopening < limit:
                        filled_to = batches.fill(owned)
                        if filled_to is SHARE_ENDED:
                            exhausted = True
                            break
                        if filled_to is None:
                            # A shard still downloading has no more samples yet: what we have went out
                            # (the first sample goes out as soon as it is complete); look again soon.
                            stalled = True
                            break
                    if seq_yield >= (batches.seq_next if end is None else end) and exhausted:
                        # Too few samples read for the holes waiting: others of the rank, for the pool only
                        if end is not None or not holes.short or (again := look.next_pass()) is None:
                            break
                        owned, exhausted = iter(again), False
                        continue
                    read = reads.hand_out(seq_yield)
                    if read is None:
                        self._receive(poll if stalled else 0.1)
                        poll = min(STREAM_POLL, 2 * poll) if stalled else poll
                        self._waiting_from = None  # (before the wait is added: a report then counts it once)
                        self.stats["wait_s"] += time.perf_counter() - t0
                        self.clock.check_stall(self._waited_for)
                        continue
                except (StopEpoch, FetchError, AgentUnavailableError) as stop:
                    if look.began:
                        break  # a read only for the pool failed or stalls: the epoch fills from what came
                    if not isinstance(stop, StopEpoch):
                        raise
                    exhausted = True  # the samples before the failing shard still come, then the epoch ends
                    at = self.failures.stop_at(stop, end)
                    if end is None or at < end:
                        error = stop.error
                    end = at
                    continue
                seq_yield += 1
                poll = STREAM_POLL
                stats = self.stats
                self._waiting_from = None
                stats["wait_s"] += time.perf_counter() - t0
                samples = read.samples
                sizes = read.sizes  # from the reply: no pass over each sample
                if look.began:
                    holes.prime(samples, sizes)
                    continue
                if holes.held is not None or None in samples:
                    out = holes.take(read.items, samples, sizes)
                    if out is None:  # held back until the rank read a pool's worth to fill the holes from
                        continue
                    samples, sizes = out
                    nbytes = sum(sizes)
                else:
                    nbytes = sum(sizes)
                    holes.whole(samples, sizes, nbytes)
                yield self._handed_out(samples, sizes, nbytes)
                pins.unpark()
                self.clock.progress_at = time.monotonic()  # the user's time between samples is no stall
            rest = holes.rest()
            if rest is not None:
                yield self._handed_out(*rest, sum(rest[1]))
                pins.unpark()
            unfilled = holes.unfilled()
            if unfilled and error is None:
                nothing_to_repeat(self, unfilled)
        finally:
            self._waiting_from = None  # the epoch's end, or its close: no wait goes on
        if error is not None:
            raise error

    def _handed_out(self, samples: list[dict[str, Any]], sizes: list[int], nbytes: int) -> Iterator[dict[str, Any]]:
        """The iterator of a read's samples (``nbytes`` of payload), renamed and counted, its
        pins let go as they must be while the user holds it (:meth:`_pipeline` yields it)."""
        if self.rename is not None:
            self.rename(samples)
        it = iter(samples)
        self.stats["samples"] += len(samples)
        self.stats["bytes"] += nbytes
        self._out = (it, sizes)  # after the counts: the reporter's thread subtracts what is left of it
        pins = self.pins
        if pins.letting_go:  # the user may hold us at the yield for long: no pin let go stays held
            pins.flush(now=True)
        if self.reporter.forgotten:  # dropped while stopped: pinned again before more is handed out
            self.runs.check()
        pins.parked = True  # held at its user's hands: see Pins.let_go_parked
        return it

    # -- reads --------------------------------------------------------------------

    def drain(self) -> None:
        """Wait for every read at a worker (their samples stay in the table).

        Reads put aside for :meth:`ReadFailures.recover` are not waited for: that needs the agent,
        and this is called while talking to it.
        """
        while self.reads.awaiting():
            self._receive()
            self.clock.check_stall(self._waited_for)

    def _waited_for(self) -> Waited:
        """A shard whose download this stream waits for, if any (for the progress clock)."""
        for shard in self.pins.while_downloading:
            return shard, None
        for read in self.reads.in_state(ReadState.DELAYED):
            return read.items[0][1][0], None
        return None, None

    def _worker_call(self, header: WorkerRequest, worker: int) -> dict[str, Any]:
        """One request to a worker; replies to our reads that arrive meanwhile are kept.

        Asked again every few seconds (a restarted worker lost it) while the agent answers.
        """
        timeout = self.settings.timeout
        while True:
            links = self.workers
            rid = links.send(worker % len(links), header.copy(), "c")  # a new run may have fewer workers
            self.call_replies[rid] = None
            again = time.monotonic() + min(5.0, timeout / 2)
            while self.call_replies[rid] is None and time.monotonic() < again and self.workers is links:
                self._receive()
            reply = self.call_replies.pop(rid)
            if reply is not None and reply.get("kind") == "fault":  # the agent's, not the shard's
                raise worker_fault(self.settings.endpoint, reply)
            if reply is not None:
                return reply
            if self.workers is not links:
                continue  # the agent restarted: ask the new run's worker
            self.ping()  # raises if the agent is gone
            if self.runs.new_hello is not None:
                self.runs.relink()
                continue
            if time.monotonic() - self.clock.progress_at > timeout:
                raise AgentUnavailableError(self.settings.endpoint, timeout, WORKERS_SILENT)

    def _receive(self, timeout: float = 0.1) -> None:
        """Take in worker replies (waiting up to ``timeout`` for one); resend lost requests."""
        self.runs.check()
        for header, payload in self.workers.replies(timeout):
            self._accept(header, payload)
        self.runs.check()
        self.failures.resend_overdue(time.monotonic())

    def ping(self) -> None:
        """Ask the agent whether it is there (a new run of it proves itself: see :attr:`runs`);
        raises within the timeout if it is gone."""
        self.conn.request(self.requests.ping(), timeout=self.clock.left())

    def _accept(self, header: dict[str, Any], payload: list[Any]) -> None:
        """Take in a worker's (proved) reply: to a call, or to a read."""
        if header.get("id") in self.call_replies:
            self.call_replies[header["id"]] = header
            return
        read = self.reads.replied(header.get("id"))
        if read is None:
            return  # a late answer to a request we already sent again
        items, direct = read.sent_items(), read.direct
        opened = self.pins.opened
        for _, (shard, _) in items:  # one count per item, as _add counted them
            if shard in opened:  # (a shard that failed meanwhile is let go already)
                opened[shard] -= 1
        if not header.get("ok"):
            self.failures.failed(read, header)
        else:
            read.pending_since = None  # samples came: its download has them
            try:
                samples, sizes = decode_reply(
                    header,
                    payload,
                    items,
                    self.urls,
                    zero_copy=self.settings.zero_copy,
                    direct=direct,
                    files=self.pins.files,
                    labelled=self.labelled,
                )
                self.clock.progress_at = time.monotonic()
                self.batches.sized(sizes)
                if read.later:  # a part of a read that goes a part at a time: the rest go next
                    self.reads.part_answered(read, samples, sizes)
                else:
                    if len(items) < len(read.items):  # holes where a skipped shard's items were, or earlier parts
                        samples, sizes = read.whole(samples, sizes)
                    self.reads.answer(read, samples, sizes)
                if direct:
                    self.failures.stale = 0
            except OSError as exc:  # from a direct read only
                self.failures.direct_failed(exc)
                for _, (shard, _) in items:
                    if shard in opened:
                        opened[shard] += 1  # still pinned: asked again, its bytes sent this time
                self.batches.dispatch(read, direct=False)
                return
        for shard in {sid[0] for _, sid in items}:
            self.pins.release(shard)

    # -- reports and cleanup -----------------------------------------------------

    def _figures(self) -> dict[str, Any]:
        """What a report tells of this stream, and our bye its totals (read from the reporter's
        thread too: a snapshot of numbers, each read at once)."""
        stats, out, since = self.stats, self._out, self._waiting_from
        waited = stats["wait_s"] + (time.perf_counter() - since if since is not None else 0.0)
        samples, nbytes = stats["samples"], stats["bytes"]
        if out is not None:  # the samples of the latest read not handed out yet do not count
            it, sizes = out
            left = length_hint(it)
            if left:
                samples, nbytes = samples - left, nbytes - sum(sizes[len(sizes) - left :])
        return {
            "epoch": self.epoch,
            "position": self.progress,
            "samples": samples,
            "bytes": nbytes,
            "wait_s": round(waited, 3),
        }

    def close(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.reporter.stop()  # first: its thread may be letting go of our pins
        self.pins.stop_direct()  # before bye lets go of our pins
        try:
            if not self.broken:
                self.shards.await_counts()
            # With our totals: the agent logs and lists them, and its last report may be a second old.
            bye = self.requests.bye(**self._figures(), end_error=self.end_error)
            self.conn.request(bye, timeout=0.5 if self.broken else BYE_TIMEOUT)
        except AgentUnavailableError:
            pass
        finally:  # whatever the agent answered: no socket is left to the garbage collector
            self.conn.close()
            self.workers.close()


def told(error: BaseException) -> str:
    """An error of ours that ends an epoch, as the bye tells it (stats' ``ended_jobs``): named,
    redacted (its URLs' secrets), at most END_ERROR_MAX characters. (An error of the script's own
    stages passes outside the stream, which only sees itself closed, as after a ``break``.)"""
    return redact_urls(f"{type(error).__name__}: {error}")[:END_ERROR_MAX]


def _spec_and_share(
    s: StreamSettings, n_urls: int, epoch: int, start: Resume | JobEpoch, spec: EpochSpec | MixSpec | None
) -> tuple[EpochSpec | NodeSpec | MixSpec, RankShare | NodeShare]:
    """The epoch's sequence and this rank's share of it: of a mixture's epoch or some of the list's
    shards (``spec``), of a job on several nodes (this node's part, :mod:`wdscache.shared.nodes`),
    or of the list's epoch ``epoch`` (a checkpoint's positions, from any world size: the rest are
    dealt to this job's ranks)."""
    if isinstance(start, JobEpoch):
        assert spec is None
        return NodeSpec(start, start.layout.node), start.share()
    share = RankShare(s.world_size, s.rank, resume=start, drop_last=s.drop_last)
    return (spec if spec is not None else EpochSpec(n_urls, s.seed, epoch, s.shuffle, s.shuffle_buffer)), share


def nothing_to_repeat(stream: EpochStream, holes: int) -> None:
    """A share whose every sample here lay in shards skipped (``on_error="skip"``) read none:
    ShardError, when the whole share is so. With several ranks there is none to repeat in
    their ``holes``, so the rank cannot keep the count every rank gets, and a data-parallel
    job would wait forever on the ranks that got theirs; with one rank the epoch would be
    empty, which webdataset's readers refuse too. With several ranks, a rest resumed from a
    checkpoint and a DataLoader worker's slice were filled from the rank's other samples (those
    before the checkpoint, its fellow workers': :mod:`~wdscache.training.look_back`): they come
    here only when there were none, or those failed too. With one rank, the rest of a share resumed from
    a checkpoint (its samples before it were read then) and a DataLoader worker's slice (its
    fellows may have samples) end short instead, with a warning; so does a rest resumed on
    several nodes, whose samples before the checkpoint are not read again."""
    skipped = sorted(stream.shards.skipped)
    url = stream.urls[skipped[0]] if skipped else "?"
    more = f" and {len(skipped) - 1} other shard(s)" if len(skipped) > 1 else ""
    share = stream.share
    resumes = share.job.resumes if isinstance(share, NodeShare) else (share.resume,)
    rank, epoch, dropping = stream.settings.rank, stream.spec.epoch, stream.holes.mode is HoleMode.DROP
    resumed = bool(stream.worker_slice.skip or any(r.delivered() for r in resumes))
    if resumed and (dropping or isinstance(share, NodeShare)):
        since = f"rank {rank}'s rest of epoch {epoch} since its checkpoint lies in shards that failed ({url}{more})"
        if dropping:
            log.warning("%s: it yields none of its %d samples", since, holes)
        else:
            log.warning(
                "%s: no sample read since to repeat in the %d places skipped, so it ends %d short of the other ranks",
                since,
                holes,
                holes,
            )
        return
    if dropping and stream.worker_slice.count > 1:
        log.warning(
            "DataLoader worker %d's part of epoch %d lies in shards that failed (%s%s): it yields none of its %d "
            "samples",
            stream.worker_slice.index,
            epoch,
            url,
            more,
            holes,
        )
        return
    if dropping:
        raise ShardError(
            url,
            f"every sample of epoch {epoch} lies in shards that failed (this one{more}): all {holes} were "
            "skipped, so the epoch has none to yield; fix or drop the failed shards",
        )
    where = "since its checkpoint, and before it," if resumed else "here"
    raise ShardError(
        url,
        f"every sample rank {rank} reads {where} in epoch {epoch} lies in shards that "
        f"failed (this one{more}): none was read to repeat in the {holes} places skipped, so its count "
        "cannot equal the other ranks'; fix or drop the failed shards",
    )


def same_directory(hello: dict[str, Any]) -> bool:
    """True when the agent's cache directory, as it names it, is the one we see at that path
    (same device and inode): not so for an agent on another machine, or in another container
    whose socket or port was shared with us."""
    path, root = hello.get("cache_dir"), hello.get("cache_root")
    if not (isinstance(path, str) and os.path.isabs(path) and "\0" not in path and isinstance(root, list)):
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return [st.st_dev, st.st_ino] == root
