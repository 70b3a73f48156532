"""A sample worker: one process that reads cached shards and answers consumers' reads.

A worker serves two requests (JSON headers, see :mod:`wdscache.shared.protocol`), each
only with the proof of its id under the worker's key for the agent's run (``"auth"``:
:func:`~wdscache.shared.protocol.request_proof` with :func:`~wdscache.shared.protocol.worker_key`,
which only holders of the cache directory's token can make; the agent gives the key
to the worker on its stdin). A request without it gets ``{"ok": false, "kind":
"refused", "error": ...}`` and nothing else: no file is opened for it. Every reply,
that one too, carries ``"proof"``: :func:`~wdscache.shared.protocol.reply_proof` of its id,
which the consumer checks before it uses anything of the reply::

    {"op": "read", "id": n, "auth": a, "urls": [u, ...], "direct": bool, "places": bool}
        followed by its items, one frame of 64-bit numbers (:func:`~wdscache.shared.protocol.pack_numbers`),
        per sample ``k, j``: sample ``j`` of the shard ``urls[k]``
        -> {"op": "samples", "id": n, "proof": p, "ok": true, "keys": [...],
            "layouts": [[ext, ...], ...], "files": [[k, offset, size, dev, inode, file size, mtime_ns], ...]}
           followed by the sample table, one frame of 64-bit numbers
           (:func:`~wdscache.shared.protocol.pack_numbers`), per sample ``layout, frame,
           offset, size, offset, size, ...``: its extensions are ``layouts[layout]``, and
           its fields lie in frame ``frame`` (of those after the table) at the given
           offsets, one (offset, size) per extension; then frames of raw shard bytes. Samples
           adjacent in their shard share a run of bytes (within MERGE_GAP; within
           DIRECT_GAP for a file range, whose gaps the consumer reads only to save calls),
           except in a read of scattered samples answered by columns
           (:mod:`wdscache.agent.scattered`: a piece per sample). A run
           of GATHER_BELOW bytes or more is a frame of its own (zero-copy from the
           mapped shard); the shorter ones are copied together into one frame (the
           first) while the worker's copy budget lasts, so that a scattered read, as a
           shuffled epoch makes, costs one frame rather than one per sample
           (:mod:`wdscache.agent.reply_frames`).
           With ``direct`` (a consumer that sees the agent's cache directory), the runs
           of a published, uncompressed shard of PREAD_BYTES or more (shorter ones are
           copied with the short runs while the budget lasts) are not sent at all: ``files`` (absent
           when empty) names each as a byte range of the cache file of ``urls[k]``,
           with the identity of the file the worker opened
           (:func:`~wdscache.shared.layout.file_identity`), and frame numbers past the last frame
           sent name them, in order. The consumer copies those payloads from the page
           cache itself (:mod:`wdscache.training.direct`): one copy per byte, where a frame costs
           three (into the socket, out of it, into ``bytes``). With ``places``, every run of
           such a shard is a file range, however short: random access's table of where its
           samples lie (:mod:`wdscache.training.random_access`)
    {"op": "scan", "id": n, "auth": a, "url": u, "while_downloading": bool}
        -> {"op": "scanned", "id": n, "proof": p, "ok": true, "count": c, "final": bool}

It resolves a URL to its cache file itself (the name derives from the URL, so a
request cannot name a file outside the cache). A file under ``shards/`` is
complete by construction; while there is none, a shard being downloaded is read
from its partial file (:class:`~wdscache.agent.growing.GrowingShard`), only its complete
samples and never beyond the bytes written, so a reader need not wait for the
whole shard. ``scan`` with ``while_downloading`` then answers the samples complete so far
with ``final`` false. Errors come back as ``{"ok": false, "kind": "missing" |
"corrupt" | "pending" | "protocol" | "fault", "error": ...}``; "pending" means the sample is
not in the partial file now (its download started over): ask again shortly; "fault" is the
agent's own (out of open files: :func:`~wdscache.shared.errors.out_of_files`), never the shard's.
One that failed opening or reading a shard (a "corrupt" one, or any error of no kind of its own:
its cache file is a directory, say) names it, ``"url": u``, so that a consumer blames that shard
alone, not the other shards of the read.

A worker that finds a published shard corrupt (a bad tar header) reports it to the agent
(``corrupt_copy``) with the identity of the file it read, and the agent downloads that copy
once more, or fails the shard if the copy it downloaded again is corrupt too.

A worker that walked a published shard's headers reports the table it found to the
agent, which passes it on to the other workers, who then do not walk it (the agent asks
one worker to walk it ahead: for a loader reading the agent's own list, the one it sends
the shard's reads to until its count is final). Walks ahead wait while the agent holds
them (a ``hold`` hint: a reader waits for a shard, and the CPU goes to what it waits for;
the agent's latest hint holds, one of 0 seconds lets them go),
but for a shard a reader holds as it is published (an ``index`` hint with ``now``): walked
first, whatever the hold, since until then each read of it walks its headers further.
A worker that reads a shard before that table comes walks it too, as far as its reads
need, and serves its payloads from the mapped file as a walked shard's (never copied:
``GrowingShard.mapped``). The report carries a secret
the agent gave its workers on their stdin, so no other peer can hand a worker a table;
the one receiving it checks it against the file it has (same identity, every payload
inside it).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import sys
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import add, ne, or_, sub
from typing import Any

import zmq

from ..shared.errors import ConfigError, ProtocolError, ShardError, out_of_files
from ..shared.layout import CacheLayout
from ..shared.logs import get_logger, log_uncaught
from ..shared.logs import setup as setup_logs
from ..shared.malloc import tune_malloc
from ..shared.messages import ConsumerReply, Reports, SamplesReply, ScannedReply, WorkerErrorKind, WorkerErrorReply
from ..shared.protocol import (
    PREAD_BYTES,
    Proofs,
    field,
    pack,
    pack_numbers,
    same_secret,
    unpack,
    unpack_numbers,
    zmq_context,
)
from ..shared.redact import redact_urls
from .growing import GrowingShard, NotYet
from .ipc_files import BoundFile, ipc_path
from .ipc_files import bind as bind_ipc
from .open_shards import SWEEP_EVERY, OpenShards
from .reply_frames import ReplyFrames
from .sampletable import PackedSamples, placed
from .scattered import scattered
from .shardview import ShardView

log = get_logger(__name__)

REPORT_EVERY = 1.0
HOLD_MAX = 1.0  # seconds: the longest hold of walks ahead a hint may ask for
MAX_ITEMS = 4096
DROP_EVERY = 0.005  # seconds between drops of served shard pages from a worker's RSS
# Samples this close in a shard go in one run, the tar headers between them too: enough
# for the headers between consecutive samples, too little to carry another rank's samples
# along unless they are tiny.
MERGE_GAP = 2048
# For a consumer that reads the file itself a run is only a range, whose gaps it reads only
# where it reads the range at once, to save a pread per payload. So ranges are merged across
# gaps of at most what a pread costs: the samples in order of one of two DataLoader workers
# share one range, but a rank of four, reading blocks of 8 small samples, gets one range per
# block, not one holding the other ranks' blocks too, which it would copy in vain
# (docs/benchmarks.md measures the difference).
DIRECT_GAP = PREAD_BYTES
# Failures a reply says by their kind (missing, pending, corrupt, protocol); anything else raised
# opening or reading a shard is a ShardFailure, which names it.
SAID_BY_KIND = (FileNotFoundError, NotYet, ShardError, ProtocolError)
REFUSED = (
    "refused: this worker serves only consumers that hold the agent's token "
    "(CACHE_DIR/token, readable by the cache directory's owner only); use CachedMultiLoader as that user"
)


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    endpoint: str
    cache_dir: str
    control: str  # the agent's endpoint, for reports
    parent: int
    log_format: str  # the agent's (AgentConfig.log_format): one format for every line of its log


class ShardFailure(Exception):
    """Opening or reading shard ``url`` for a request raised ``cause``, an error of no kind a reply
    says by itself (:data:`SAID_BY_KIND`): the reply names the shard."""

    def __init__(self, url: str, cause: Exception) -> None:
        super().__init__(url, cause)
        self.url, self.cause = url, cause


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the getppid() check in the loop still ends us
    if os.getppid() != parent:
        os._exit(0)


class _Worker:
    def __init__(self, spec: WorkerSpec, secret: str, key: str, serve_key: str) -> None:
        self.spec = spec
        self.reports = Reports(secret)  # our reports to the agent carry the workers' secret
        self.key = key  # for our reports to the agent
        self.proofs = Proofs(serve_key)  # what a consumer's request to us, and our reply, carry
        self.stop = False
        self.frames = ReplyFrames()  # replies' frames, and the served pages they were cut from
        self._last_drop = self._last_sweep = time.monotonic()
        self._walks_from = 0.0  # no walk ahead before this time (monotonic), as the agent's hold hints ask
        self._walk_now: set[str] = set()  # shards to index that readers hold: walked first, never held
        self.ctx = zmq_context(spec.endpoint)  # (its reports' socket dials the agent on the same host)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.file: BoundFile | None = None
        try:
            if ipc_path(spec.endpoint) is not None:
                # A stale file (our predecessor's, killed) is replaced; a live socket is refused.
                self.file = bind_ipc(self.sock, spec.endpoint, role=f" for sample worker {spec.index}")
            else:
                self.sock.bind(spec.endpoint)
        except BaseException as exc:
            self.sock.close(0)
            self.ctx.term()
            if isinstance(exc, (zmq.ZMQError, OSError)):
                raise ConfigError(
                    f"worker {spec.index} cannot listen on {redact_urls(spec.endpoint)} ({os.strerror(exc.errno or 0)})"
                ) from None
            raise
        self.report = self.ctx.socket(zmq.DEALER)
        self.report.setsockopt(zmq.LINGER, 0)
        self.report.setsockopt(zmq.SNDHWM, 100)
        self.report.connect(spec.control)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.report, zmq.POLLIN)
        self.shards = OpenShards(
            CacheLayout.of(spec.cache_dir),
            self.reports,
            self._send_report,
            self.frames.forget,
            spec.index,
        )
        self.busy = 0.0
        self.requests = self.samples = self.bytes = 0
        self._last_report = 0.0  # report at once: the agent learns where to send its hints

    def step(self) -> None:
        self._drop_served()
        # How long to wait for a request depends on the work due without one: shards to
        # index (unless the agent holds our walks ahead); served pages to drop (ZeroMQ goes
        # on sending, and faulting in, queued frames after we stop handling); open files to sweep.
        walk_in = self._walk_in()
        if walk_in == 0.0:
            idle = 0.0  # shards to index: only a look for requests first
        elif self.frames.served:
            idle = DROP_EVERY
        elif self.shards.held():
            idle = SWEEP_EVERY  # files held open: look for evicted ones on time
        else:
            idle = 0.1
        if walk_in:
            idle = min(idle, walk_in)  # walk again once the hold ends
        ready = dict(self.poller.poll(round(idle * 1000)))
        if self.report in ready:
            self._take_hints()
        if self.sock in ready:
            for _ in range(64):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t0 = time.perf_counter()
                self._handle(frames[0], frames[1:])
                self.busy += time.perf_counter() - t0
        elif self._walk_in() == 0.0:  # (a hint just taken may have asked for a hold)
            t0 = time.perf_counter()
            self.shards.index_ahead()
            self.busy += time.perf_counter() - t0
            if self._walk_now:
                self._walk_now.intersection_update(self.shards.to_index)
        now = time.monotonic()
        if now - self._last_report >= REPORT_EVERY:
            self._last_report = now
            self._send_report(
                self.reports.worker(
                    self.spec.index,
                    busy_s=round(self.busy, 3),
                    requests=self.requests,
                    samples=self.samples,
                    bytes=self.bytes,
                    indexed=len(self.shards.index),
                    walked=self.shards.walked,
                    adopted=self.shards.adopted,
                    loaded=self.shards.loaded,
                )
            )
            if os.getppid() != self.spec.parent:
                self.stop = True

    def _drop_served(self) -> None:
        if time.monotonic() - self._last_drop < DROP_EVERY:
            return
        self._last_drop = time.monotonic()
        self.frames.drop_sent()
        if self._last_drop - self._last_sweep >= SWEEP_EVERY:
            self._last_sweep = self._last_drop
            self.shards.sweep()

    def _take_hints(self) -> None:
        while True:
            try:
                header, payload = unpack(self.report.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except ProtocolError:
                continue  # only the agent talks on this socket; a bad hint is not worth more
            url = header.get("url")
            if header.get("op") == "index" and isinstance(url, str):
                if header.get("now") is True:
                    self.shards.to_index.appendleft(url)
                    self._walk_now.add(url)
                else:
                    self.shards.to_index.append(url)
            elif header.get("op") == "walked" and isinstance(url, str):
                self.shards.adopt(url, header, payload)
            elif header.get("op") == "hold":
                seconds = header.get("seconds")
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                    # The agent's latest word holds: 0 lets the walks go at once.
                    self._walks_from = time.monotonic() + min(max(float(seconds), 0.0), HOLD_MAX)

    def _walk_in(self) -> float | None:
        """Seconds until the next walk ahead may start (0.0: now; a shard a reader holds is
        never held back); None: no shard to index."""
        if not self.shards.to_index:
            return None
        if self.shards.to_index[0] in self._walk_now:
            return 0.0
        return max(0.0, self._walks_from - time.monotonic())

    def _send_report(self, header: Mapping[str, Any], frames: Sequence[bytes] = ()) -> None:
        try:
            self.report.send_multipart(pack({**header, "key": self.key}, *frames), zmq.NOBLOCK)
        except zmq.Again:
            pass  # reports are advisory; never block serving on them

    def _handle(self, ident: bytes, body: list[bytes]) -> None:
        rid, proved = None, False
        try:
            header, frames = unpack(body)
            rid = header.get("id")
            proved = same_secret(header.get("auth"), self.proofs.request(rid))
            op = header.get("op")
            if not proved:
                self._reply(ident, _error(rid, "refused", REFUSED), proved=False)
            elif op == "read":
                self._read(ident, header, frames)
            elif op == "scan":
                self._scan(ident, rid, field(header, "url", str), field(header, "while_downloading", bool, False))
            else:
                raise ProtocolError(f"unknown op {op!r}")
        except FileNotFoundError as exc:
            self._reply(ident, _error(rid, "missing", str(exc)), proved=proved)
        except NotYet as exc:
            self._reply(ident, _error(rid, "pending", str(exc)), proved=proved)
        except ShardError as exc:
            reply = _error(rid, "corrupt", str(exc))
            reply["reason"], reply["url"] = exc.reason, exc.url
            if exc.offset is not None:
                reply["offset"] = exc.offset
            self._reply(ident, reply, proved=proved)
        except ProtocolError as exc:
            self._reply(ident, _error(rid, "protocol", str(exc)), proved=proved)
        except ShardFailure as failure:
            reply = self._unexpected(rid, failure.cause, failure.url)
            reply["url"] = failure.url  # that shard's fault alone, not the read's other shards'
            self._reply(ident, reply, proved=proved)
        except Exception as exc:  # one bad request must never take the worker down
            self._reply(ident, self._unexpected(rid, exc), proved=proved)

    def _unexpected(self, rid: Any, exc: Exception, url: str | None = None) -> WorkerErrorReply:
        """The reply to request ``rid`` that raised ``exc`` (in opening or reading shard ``url``,
        if given), logged: a fault of the agent's (out of open files), else an internal error."""
        fault = out_of_files(exc)
        if fault is not None:  # ours, not the shard's: the consumer must not skip it for this
            log.error("worker %d: %s", self.spec.index, fault)
            return _error(rid, "fault", fault)
        if url is None:
            log.error("worker %d: error serving a request", self.spec.index, exc_info=exc)
        else:
            log.error("worker %d: error reading %s", self.spec.index, url, exc_info=exc)
        return _error(rid, "protocol", f"internal error: {type(exc).__name__}")

    def _scan(self, ident: bytes, rid: Any, url: str, partial: bool) -> None:
        try:
            count, final = self._count(url, partial)
        except SAID_BY_KIND:
            raise
        except Exception as exc:
            raise ShardFailure(url, exc) from exc
        self._reply(ident, _scanned(rid, count, final))

    def _count(self, url: str, partial: bool) -> tuple[int, bool]:
        """``url``'s samples known (so far, with ``partial``, while it downloads or is walked),
        and whether that is all of them."""
        try:
            walker = self.shards.unwalked(url) if partial else None
            if walker is not None:  # asked while downloading, and just published: the walk so far
                before = len(walker.samples)
                self.shards.walk(url, walker, before)
                if len(walker.samples) > before:
                    return len(walker.samples), False
                # Walked but for the last sample: the view below takes the walk over.
            view = self.shards.view(url)
            self._send_report(self.reports.counted(url, len(view.samples), view.identity))
            return len(view.samples), True
        except FileNotFoundError:
            if not partial:
                raise
            try:
                return len(self.shards.downloading(url, refresh=True).samples), False
            except FileNotFoundError:
                return 0, False  # not started yet, just published, or failed: ask again

    def _read(self, ident: bytes, header: dict[str, Any], frames: list[Any]) -> None:
        urls = field(header, "urls", list)
        direct = field(header, "direct", bool, False)
        places = field(header, "places", bool, False)  # file ranges only: a table of where samples lie
        if len(frames) != 1:
            raise ProtocolError("a read carries its items as one frame")
        numbers = unpack_numbers(frames[0])  # none negative
        n_items = len(numbers) // 2
        if len(numbers) % 2 or n_items > MAX_ITEMS or not all(isinstance(u, str) for u in urls):
            raise ProtocolError("bad read request")
        keys: list[str] = []
        layouts: dict[tuple[str, ...], int] = {}  # the distinct tuples of extensions, numbered
        # The sample table's rows in item order, a chunk of them at a time: (their run, None, row
        # length, rows), or for a group of stretches (their runs, each one's count of rows, row
        # length, rows); each row ``layout, frame, offset, size, ...`` with offsets in the
        # shard until the runs are made into frames, which then sets both.
        chunks: list[tuple[Any, list[int] | None, int, list[int]]] = []
        # Runs of bytes: (a mapped ShardView or a bytes block, start, end). Samples next to
        # each other in a shard share a run, so a request read in archive order costs one
        # run, not one per field; ReplyFrames makes the runs into frames.
        runs: list[list[Any]] = []  # [source, start, end]
        # Per URL: its view, its samples and their placer (None: a download's), their count, its merge gap.
        shards: list[tuple[Any, Any, Any, int, int]] = []
        files: dict[Any, list[int]] = {}  # published plain shards the consumer reads: [url index, *identity]
        # A download's (or a published shard's walk's) latest mapping served from: its payloads
        # go as a view's do (zero-copy, or file ranges of a published file), never copied.
        growing_maps: list[ShardView | None] = [None] * len(urls)
        for k, url in enumerate(urls):  # once per shard, not per sample
            try:
                view = self.shards.readable(url)
            except SAID_BY_KIND:
                raise
            except Exception as exc:  # its cache file a directory, say: this shard's failure, not the read's
                raise ShardFailure(url, exc) from exc
            if isinstance(view, GrowingShard):
                ranged = view.published and (direct or places)  # a download's file is not the consumer's to read
                shards.append((view, None, None, 0, DIRECT_GAP if ranged else MERGE_GAP))
                continue
            if (direct or places) and isinstance(view, ShardView):
                files[view] = [k, *view.identity]
            samples = view.samples
            placer = samples.placed if isinstance(samples, PackedSamples) else functools.partial(placed, samples)
            shards.append((view, samples, placer, len(samples), DIRECT_GAP if view in files else MERGE_GAP))
        nbytes = 0
        n_urls = len(urls)
        # Each shard's latest run and its index in ``runs``: a request that takes turns between
        # shards (a mixture's sources) still costs a run per stretch of a shard, not per sample.
        latest: list[tuple[list[Any], int] | None] = [None] * n_urls
        shard_of, index_of = numbers[0::2], numbers[1::2]
        if n_items and max(shard_of) >= n_urls:
            raise ProtocolError("read item names no URL")
        # Where each stretch of items that are consecutive samples of one shard begins (found in
        # C): a read in archive order is a few stretches, each served from slices of the table.
        breaks = map(
            or_, map(ne, shard_of[1:], shard_of[:-1]), map(ne, map(sub, index_of[1:], index_of[:-1]), repeat(1))
        )
        begins = [0, *compress(range(1, n_items), breaks)] if n_items else []
        by_stretch = 2 * len(begins) <= n_items
        if not by_stretch and not places:  # mostly single samples (a shuffled read): by columns, or all in one loop
            bulk = scattered(shard_of, index_of, shards, files, self.frames.room())
            if bulk is not None:
                copied = self.frames.gathered(bulk.pieces, bulk.views)
                self._answer(ident, header, bulk.nbytes, bulk.keys, bulk.layouts, bulk.table, [], [copied])
                return
            begins = begins[:1]
        stretches = list(zip(begins, [*begins[1:], n_items]))
        done_until = plain_until = 0  # stretches before these: served as a group; to serve one by one
        for s, (a, b) in enumerate(stretches):
            if s < done_until:
                continue
            k, j = shard_of[a], index_of[a]
            view, samples, placer, count, gap = shards[k]
            if s >= plain_until and by_stretch and isinstance(samples, PackedSamples) and len(samples.layouts) == 1:
                # This stretch and those after it of the same shard at once (a rank's blocks of 8
                # every W * 8 samples): one pass over their numbers, a run each.
                done_until = s + 1
                while done_until < len(stretches) and shard_of[stretches[done_until][0]] == k:
                    done_until += 1
                # One stretch (a read in archive order) costs less through run_of.
                group = _group(samples, index_of, stretches[s:done_until], count, gap) if done_until > s + 1 else None
                if group is not None:
                    rows, got, spans, size = group
                    stride = 2 * len(samples.layouts[0]) + 2
                    rows[0::stride] = [layouts.setdefault(samples.layouts[0], len(layouts))] * len(got)
                    ats = [_joined(runs, latest, k, view, first, end, gap) for first, end, _ in spans]
                    chunks.append((ats, [n for _, _, n in spans], stride, rows))
                    keys += got
                    nbytes += size
                    continue
                done_until, plain_until = s, done_until  # one, or a gap too wide, or past the shard's end
            one_run = by_stretch and b - a > 1 and j + b - a <= count and isinstance(samples, PackedSamples)
            stretch = samples.run_of(j, b - a) if one_run else None
            if stretch is not None:
                got, layout, fields = stretch
                names = samples.layouts[layout]
                row = _rows(fields, 2 * len(names), gap)
                if row is not None:  # one run: a row per sample from slices of the shard's table
                    at = _joined(runs, latest, k, view, fields[0], fields[-2] + fields[-1], gap)
                    stride = 2 * len(names) + 2
                    row[0::stride] = [layouts.setdefault(names, len(layouts))] * (b - a)
                    chunks.append((at, None, stride, row))
                    keys += got
                    nbytes += sum(fields[1::2])
                    continue
            for k, j in zip(shard_of[a:b], index_of[a:b]):  # sample by sample
                view, samples, placer, count, gap = shards[k]
                if placer is None:  # a download under way, or a walk of a published shard
                    try:
                        if j >= len(view.samples):
                            self.shards.walk(urls[k], view, j)
                        if j >= len(view.samples):
                            raise NotYet(f"{urls[k]} has no complete sample {j} yet")
                        key, names, place = placed(view.samples, j)
                        mapped = view.mapped(place[-2] + place[-1])
                    except SAID_BY_KIND:
                        raise
                    except Exception as exc:  # (a try costs nothing unless it raises)
                        raise ShardFailure(urls[k], exc) from exc
                    if mapped is not growing_maps[k]:  # a new mapping: no run of the old one grows into it
                        if view.published and growing_maps[k] is not None:
                            # The walk followed a new file at that path: one reply names one file a shard.
                            raise NotYet(f"{urls[k]} was replaced while it was read")
                        growing_maps[k], latest[k] = mapped, None
                        if view.published and (direct or places):
                            files[mapped] = [k, *mapped.identity]
                    at = _joined(runs, latest, k, mapped, place[0], place[-2] + place[-1], gap)
                else:
                    if j >= count:
                        raise ProtocolError(f"{urls[k]} has no sample {j}")
                    key, names, place = placer(j)
                    at = _joined(runs, latest, k, view, place[0], place[-2] + place[-1], gap)
                keys.append(key)
                place[0:0] = (layouts.setdefault(names, len(layouts)), 0)
                chunks.append((at, None, len(place), place))
                nbytes += sum(place[3::2])
        frames, ranges, run_places = self.frames.of(runs, files, ranges_only=places)
        table: list[int] = []
        for at, counts, stride, row in chunks:
            if counts is not None:  # a group of stretches, each a run of its own (or of one before it)
                places_of = [run_places[x] for x in at]
                row[1::stride] = list(chain.from_iterable(map(repeat, [frame for frame, _ in places_of], counts)))
                shifts = list(
                    chain.from_iterable(
                        map(repeat, map(sub, [b for _, b in places_of], [runs[x][1] for x in at]), counts)
                    )
                )
                for i in range(2, stride, 2):
                    row[i::stride] = list(map(add, row[i::stride], shifts))
                table += row
                continue
            frame, base = run_places[at]
            shift = base - runs[at][1]  # from the shard to the frame
            if stride == len(row):  # one sample
                row[1] = frame
                for i in range(2, stride, 2):
                    row[i] += shift
            else:
                row[1::stride] = [frame] * (len(row) // stride)
                for i in range(2, stride, 2):
                    row[i::stride] = [offset + shift for offset in row[i::stride]]
            table += row
        self._answer(ident, header, nbytes, keys, list(layouts), table, ranges, frames)

    def _answer(
        self,
        ident: bytes,
        header: dict[str, Any],
        nbytes: int,
        keys: list[str],
        layouts: Sequence[tuple[str, ...]],
        table: list[int],
        ranges: list[list[int]],
        frames: Sequence[Any],
    ) -> None:
        """Send a read's reply: the samples' ``keys`` (one a sample asked for), ``layouts`` and
        rows (``table``), the file ranges and the frames of bytes; ``nbytes`` more bytes served."""
        self.bytes += nbytes
        self.requests += 1
        self.samples += len(keys)
        reply: SamplesReply = {
            "op": "samples",
            "id": header.get("id"),
            "ok": True,
            "keys": keys,
            "layouts": [list(names) for names in layouts],
        }
        if ranges:
            reply["files"] = ranges
        self._reply(ident, reply, [pack_numbers(table), *frames])
        self._drop_served()  # after the send, in which pyzmq copies (so maps in) the small frames

    def _reply(self, ident: bytes, header: ConsumerReply, frames: Sequence[Any] = (), *, proved: bool = True) -> None:
        """Send a reply; to a ``proved`` request (its ``auth`` checked out) with the proof of its
        id, so that a consumer can tell ours. Never to one without: its id is its sender's
        choice, and proofs of ids of one's choice would let whoever takes a dead worker's
        port answer a consumer as that worker."""
        if proved:
            header["proof"] = self.proofs.reply(header["id"])
        try:
            self.sock.send_multipart([ident, *pack(header), *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("worker %d: dropped a reply to a consumer that does not read", self.spec.index)

    def close(self) -> None:
        self.shards.close()
        if self.file is not None:
            self.file.remove()  # while it still listens (see wdscache.agent.ipc_files)
        self.sock.close(0)
        self.report.close(0)
        self.ctx.term()


def _joined(
    runs: list[list[Any]],
    latest: list[tuple[list[Any], int] | None],
    k: int,
    view: Any,
    first: int,
    end: int,
    gap: int,
) -> int:
    """The index in ``runs`` of the run that bytes ``[first, end)`` of shard ``k`` (``view``)
    go in: the shard's latest run if they start at most ``gap`` bytes after its end (it then
    ends at ``end``), else a new one, which becomes the shard's latest."""
    last = latest[k]
    if last is not None and 0 <= first - last[0][2] <= gap:
        last[0][2] = end
        return last[1]
    run = [view, first, end]
    runs.append(run)
    latest[k] = (run, len(runs) - 1)
    return len(runs) - 1


def _group(
    samples: PackedSamples, index_of: Sequence[int], stretches: list[tuple[int, int]], count: int, gap: int
) -> tuple[list[int], list[str], list[tuple[int, int, int]], int] | None:
    """Stretches ``[a, b)`` of a read's items, each samples ``index_of[a]`` on of one shard whose
    samples have one tuple of extensions, served at once: their rows of the sample table
    (:func:`_table_rows`), keys, each stretch's ``(first byte, end, samples)`` and their
    payload bytes. None if a stretch passes ``count`` or its samples are not one run (a gap
    past ``gap``): the caller then serves them stretch by stretch, which says why."""
    width = 2 * len(samples.layouts[0])
    numbers, key_ends = samples.numbers, samples.key_ends
    fields, firsts, lasts = array("q"), array("q"), array("q")
    cuts = []  # per stretch, the index of its last sample
    for a, b in stretches:
        j, n = index_of[a], b - a
        if j + n > count:
            return None
        fields += numbers[j * width : (j + n) * width]
        if j:
            firsts += key_ends[j - 1 : j + n - 1]
        else:
            firsts.append(0)
            firsts += key_ends[: n - 1]
        lasts += key_ends[j : j + n]
        cuts.append(len(lasts) - 1)
    starts = fields[0::width]
    ends = list(map(add, fields[width - 2 :: width], fields[width - 1 :: width]))
    gaps = list(map(sub, starts[1:], ends))
    for cut in cuts[:-1]:  # between two stretches: not a gap of a run
        gaps[cut] = 0
    if gaps and (min(gaps) < 0 or max(gaps) > gap):
        return None
    heads = [0, *(cut + 1 for cut in cuts[:-1])]
    spans = list(
        zip(map(starts.__getitem__, heads), map(ends.__getitem__, cuts), map(sub, cuts, [h - 1 for h in heads]))
    )
    text = samples.keys
    return _table_rows(fields, width), [text[x:y] for x, y in zip(firsts, lasts)], spans, sum(fields[1::2])


def _rows(fields: array[int], width: int, gap: int) -> list[int] | None:
    """Rows of the sample table for consecutive samples of a shard whose ``width`` numbers
    each (``offset, size, ...``) are ``fields``, one sample after another
    (:meth:`PackedSamples.run_of`): each ``0, 0, offset, size, ...``, its layout and frame
    left for the caller. None unless each sample starts at most ``gap`` bytes after the one
    before it ends: else they are not one run."""
    if len(fields) > width:  # every sample's first byte, less the end of the one before it
        ends = map(add, fields[width - 2 : -width : width], fields[width - 1 : -width : width])
        gaps = list(map(sub, fields[width::width], ends))
        if min(gaps) < 0 or max(gaps) > gap:
            return None
    return _table_rows(fields, width)


def _table_rows(fields: array[int], width: int) -> list[int]:
    """Each sample's ``width`` numbers of ``fields`` as its row of the sample table,
    ``0, 0, offset, size, ...`` (its layout and frame left for the caller)."""
    row = [0] * (len(fields) // width * (width + 2))
    for i in range(width):
        row[2 + i :: width + 2] = fields[i::width]
    return row


def _scanned(rid: Any, count: int, final: bool) -> ScannedReply:
    """The reply to scan request ``rid``: ``count`` samples known, all of them if ``final``."""
    return {"op": "scanned", "id": rid, "ok": True, "count": count, "final": final}


def _error(rid: Any, kind: WorkerErrorKind, error: str) -> WorkerErrorReply:
    """The reply to request ``rid`` that failed (``kind``: why, see :data:`WorkerErrorKind`)."""
    return {"op": "error", "id": rid, "ok": False, "kind": kind, "error": error}


def worker_main(spec: WorkerSpec, ready_fd: int, secret: str, key: str, serve_key: str) -> None:
    """Entry point of a worker process: serve until SIGTERM or until the agent is gone."""
    _die_with_parent(spec.parent)
    setup_logs(sys.stderr, fmt=spec.log_format)  # (its stderr is the agent's)
    log_uncaught()
    # Copied replies come and go at up to GATHER_MAX (reply_frames.py) each. glibc's own thresholds adapt to
    # that size but still trim the heap, and fault it in again, as they come and go: shuffled
    # warm images, one consumer, 1.75 GB/s untuned against 2.1 tuned.
    tune_malloc()
    # Ctrl-C, and a hang-up (a terminal or SSH session closed), reach the whole group; the agent decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        worker = _Worker(spec, secret, key, serve_key)
    except ConfigError as exc:  # its endpoint taken since the agent's start: one line, and the agent retries
        log.error("%s", exc)
        sys.exit(1)
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "stop", True))
    try:
        while not worker.stop:
            worker.step()
    finally:
        worker.close()


def main(argv: list[str]) -> None:
    """``python -c _BOOT SYS_PATH SPEC READY_FD``, the secret and the keys on stdin: how :class:`WorkerPool`
    starts a worker."""
    secret, key, serve_key = (sys.stdin.readline().strip() for _ in range(3))
    worker_main(WorkerSpec(**json.loads(argv[1])), int(argv[2]), secret, key, serve_key)
