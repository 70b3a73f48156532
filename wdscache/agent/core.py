"""The agent: one per machine and cache directory; downloads ahead of demand and serves readers.

Structure: a small core composed of parts that each own one concept and its state:

- :class:`~wdscache.agent.control.ControlSocket`: the control socket, its door (the token) and replies;
- :class:`~wdscache.agent.readers.Readers`: hello, jobs, lists, expiry, readers' windows;
- :class:`~wdscache.agent.opens.Opens`: open, pins, waiters, status, revalidation, damage, a policy over
  the :class:`~wdscache.agent.shards.Shards` table (one record per shard the agent is busy with);
- :class:`~wdscache.agent.downloads.Downloads`: scheduling, download threads, budget grants;
- :class:`~wdscache.agent.worker_reports.WorkerReports`: the sample workers' reports and hints;
- :class:`~wdscache.agent.list_file.ListFile`: the ``--urls`` file, watched;
- :class:`~wdscache.agent.upkeep.Upkeep`: the cache commands (evict, clear, prefetch);
- :class:`~wdscache.agent.prefetches.Prefetches`: the prefetches under way, their shards and wishes;
- :class:`~wdscache.agent.metrics.MetricsServer`: ``/metrics``, when asked for (``--metrics-port``).

:meth:`Agent.start` builds them once the cache is open, so while the agent runs
none is missing; the core routes each control op to its handler (``_ops``) and
each event of a download thread to what it changes (``_on_event``, by the
event's type, see :mod:`wdscache.agent.events`), and runs :meth:`Agent.step`.
Handlers take a :class:`~wdscache.agent.control.Request` and return its reply
(None: no reply now, or a request held, answered later through
:meth:`Opens.take_answers`); the core alone sends replies.

Threads: the main thread owns all state and runs :meth:`Agent.step` until asked
to stop. Download threads only move bytes and post events; the watchdog thread
only sets a flag. Signal handlers (installed by the CLI) only call :meth:`Agent.stop`.

Guarantees:

- A clean stop (first SIGTERM/SIGINT/SIGHUP) abandons in-flight downloads and leaves
  the index consistent; the cache is kept, and so are the partial files of
  downloads whose server gave a validator (ETag or Last-Modified) of shards a
  list names: the next agent resumes them with a Range request, a job's own
  list's too when the job names them again (a crash keeps every one with a
  validator). Other partial files are removed; so are kept ones no list names for
  ``UNNAMED_GRACE`` (:mod:`wdscache.agent.unnamed_partials`, checked as readers expire).
- A crash or SIGKILL loses no complete shard: the next agent adopts or
  re-checks every record (:meth:`ShardCache.recover`) and downloads nothing
  that is already cached.
- Nothing outside the union of readers' windows (plus shards asked for) is
  started, a shard is never downloaded by two threads at once, and bytes cross
  the network once (:mod:`wdscache.agent.downloads`).
- A reader reads the list it said hello on to its end, and one whose process
  ends is dropped at once, its pins released (:mod:`wdscache.agent.readers`).
- Only holders of the cache directory's token are served (:mod:`wdscache.agent.control`).
- A start that fails (a bad line of the list too) leaves the cache directory as it
  was (:mod:`wdscache.agent.startup`).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

from ..shared.config import AgentConfig, format_size
from ..shared.errors import ProtocolError, WdsCacheError, out_of_files
from ..shared.index import IndexWriteError, ShardRecord, ShardState
from ..shared.layout import CacheLayout, write_atomic, write_fault
from ..shared.logs import get_logger
from ..shared.malloc import release_freed
from ..shared.metrics import require as require_metrics
from ..shared.protocol import CONTROL_OPS, GREETED_OPS, READER_OPS, WORKER_OPS, process_identity, strings
from ..shared.protocol import field as get_field
from ..shared.stats import build
from ..shared.urls import UrlList, Urls
from ..shared.verdict import starved_by
from .cache import INDEX_HEADROOM, ShardCache
from .control import ControlSocket, Reply, Request
from .downloads import Downloads
from .events import (
    BudgetAsked,
    DownloadCancelled,
    Downloaded,
    DownloadFailed,
    Mailbox,
    OutOfSpace,
    Revalidated,
    ValidatorFound,
)
from .fetch import Fetcher
from .list_file import ListChange, ListFile
from .lock import AgentLock
from .metrics import MetricsServer
from .opens import Opens
from .pool import WorkerPool
from .prefetches import Prefetches
from .readers import Readers, dropped_reply
from .shard_download import BadShard
from .shards import Shards
from .startup import StartStep, StoppedStarting, in_thread, take_cache_dir
from .upkeep import Upkeep
from .waits_view import SourceSilence, waits
from .worker_reports import WorkerReports

log = get_logger(__name__)

TICK = 0.05  # seconds the main loop waits for a message before doing its other work
LOOKUP_STEP = 10_000  # URLs of a list's lookup table made in one turn of the loop (~5 ms)
WORKER_START_TIMEOUT = 30.0
FLUSH_EVERY = 5.0  # seconds between writes of counters and read times to the index
METRICS_EVERY = 1.0  # seconds between the stats snapshots /metrics answers from
USERS_EVERY = 1.0  # seconds between a private agent's looks for a loader still using it

Handler = Callable[[Request], Reply | None]  # None: no reply now (a one-way report, or a request held)


class Agent:
    """Run with :meth:`run` (blocks until :meth:`stop`), or drive :meth:`start`/:meth:`step`/:meth:`shutdown`."""

    # Built by start(): step() and shutdown() run only after it succeeded.
    pool: WorkerPool
    cache: ShardCache
    mailbox: Mailbox
    socket: ControlSocket
    readers: Readers
    downloads: Downloads
    opens: Opens
    workers: WorkerReports
    upkeep: Upkeep
    prefetches: Prefetches
    _ops: dict[str, Handler]

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.layout = CacheLayout.of(config.cache_dir)
        self.endpoint = config.endpoint or self.layout.default_endpoint()
        self._stop = threading.Event()
        self._lock = AgentLock(self.layout.lock_path)
        self._run = secrets.token_hex(16)  # names this agent process: a key seen by others dies with it
        # agent.json's start; uptime is by the monotonic clock, which no NTP step moves
        self._started, self._started_mono = time.time(), time.monotonic()
        self._last_flush = time.monotonic()
        self._last_metrics = time.monotonic()
        self._metrics: MetricsServer | None = None  # serving /metrics (--metrics-port)
        self._list_file = ListFile(config)
        # A list whose lookup table (by URL) is not made yet: the loop makes it a step a turn.
        self._lookups: Urls | None = None
        self._held_up = False  # a reader waits for room that pins hold (see _op_report)
        self._private = _PrivateUse(config.private_users)
        if config.metrics_port is not None:
            require_metrics()  # before anything starts: the missing extra is a bad option
        self.fetcher = Fetcher.of(config)
        self._on_event: dict[type, Callable[[Any], None]] = {
            BudgetAsked: lambda e: self.downloads.asked(e.grant),
            ValidatorFound: lambda e: self.cache.set_validator(e.download.url, e.etag),
            Downloaded: self._downloaded,
            Revalidated: self._revalidated,
            DownloadFailed: self._failed,
            OutOfSpace: self._out_of_space,
            DownloadCancelled: self._cancelled,
        }

    # -- life cycle ---------------------------------------------------------

    def run(self) -> None:
        """Start, serve until :meth:`stop`, shut down cleanly."""
        try:
            self.start()
        except StoppedStarting as exc:  # (the start undid what it did)
            log.info("%s; exiting", exc)
            return
        try:
            while not self._stop.is_set():
                try:
                    self.step()
                except IndexWriteError as exc:
                    self._index_full(exc)
        finally:
            self.shutdown()

    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler: it only sets a flag)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        """Take the cache directory, read the list, open the cache and build the parts; a start
        that fails (a bad line of the list, say) leaves the cache directory as it was."""
        # A million lines take a second or two to read: the directory is taken and the
        # worker processes start meanwhile (on the other cores).
        listed = in_thread(self._list_file.read)
        took = take_cache_dir(
            self.config,
            self.layout,
            self._lock,
            self.fetcher,
            listed,
            self.endpoint,
            self._run,
            self._stop,
            self._write_state,
        )
        self.pool, self.cache, self.mailbox, self.socket = took.pool, took.cache, took.mailbox, took.socket
        self._metrics = took.metrics
        self._build(took.urls, cache_root=[took.root.st_dev, took.root.st_ino])
        self.downloads.start_threads()
        if self._metrics is not None:
            self._metrics.update(self.stats())
            log.info("serving metrics on %s", self._metrics.url)
        # Ready means ready to serve samples: a consumer's first request should not wait for a process start.
        self._write_state(StartStep.WORKERS)
        if not self.pool.wait_ready(WORKER_START_TIMEOUT):
            log.warning("sample workers not up after %.0f s; serving anyway", WORKER_START_TIMEOUT)
        self._write_state()
        self._list_file.watch()
        log.info(
            "agent %d serving %s on %s: %d shards listed, %s cached of %s budget",
            os.getpid(),
            self.layout.root,
            self.endpoint,
            len(took.urls),
            format_size(self.cache.used),
            format_size(self.cache.limit),
        )
        self._lookups = took.urls.urls  # a long list is served before its table is whole

    def _build(self, urls: UrlList, cache_root: list[int]) -> None:
        """The parts, on the open cache, the bound socket and the started workers."""
        cfg = self.config
        self.readers = Readers(
            cfg,
            self.cache,
            urls,
            endpoint=self.socket.endpoint,
            workers=self.pool.endpoints,
            cache_root=cache_root,
            gone=self._reader_gone,
            watch=self.socket.watch,
            unwatch=self.socket.unwatch,
        )
        shards = Shards()  # one record per shard the agent is busy with, for the opens and the downloads
        self.downloads = Downloads(
            cfg, self.cache, shards, self.fetcher, self.mailbox, expected=self.readers.shard_info
        )
        self.opens = Opens(cfg, self.cache, shards, self.readers, self.downloads)
        self.silence = SourceSilence(shards)  # which downloads' sources send nothing, for stats
        self.workers = WorkerReports(self.pool, self.socket)
        self.prefetches = Prefetches(self.cache, self.downloads)
        self.cache.watcher = self.prefetches
        self.upkeep = Upkeep(self.cache, self.prefetches, self.readers)
        self.socket.watch(self.mailbox.fileno())
        handlers: dict[str, Handler] = {
            "stats": self._op_stats,
            "counts": self._op_counts,
            "counted": self.opens.op_counted,
            "ping": self.readers.op_ping,
            "hello": self._op_hello,
            "put_urls": self.readers.op_put_urls,
            "get_urls": self.readers.op_get_urls,
            "report": self._op_report,
            "bye": self.readers.op_bye,
            "open": self.opens.op_open,
            "status": self.opens.op_status,
            "release": self.opens.op_release,
            "corrupt_copy": self.opens.op_corrupt_copy,
            "corrupt": self.opens.op_corrupt,
            "worker": lambda r: self.workers.op_worker(r.ident, r.rid, r.header),
            "evict": self.upkeep.op_evict,
            "clear": self.upkeep.op_clear,
            "prefetch": self.upkeep.op_prefetch,
            "prefetch_status": self.upkeep.op_prefetch_status,
            "prefetch_end": self.upkeep.op_prefetch_end,
        }
        self._ops = {op: handlers[op] for op in CONTROL_OPS}

    def _write_state(self, starting: StartStep | None = None) -> None:
        """agent.json: who serves the directory, and where; while it starts (``starting``), what it does."""
        state = {"pid": os.getpid(), "started": self._started, "endpoint": self.endpoint, "process": process_identity()}
        state |= {"metrics": self._metrics.url} if self._metrics is not None else {}
        if starting is not None:  # (stats and loaders wait for it, rather than take it for no agent)
            state["starting"] = starting.value
        if self.config.private_users is not None:  # loaders joining us lock it
            state["private_users"] = str(self.config.private_users)
        _publish_state(self.layout.state_path, state, starting is not None)

    def shutdown(self) -> None:
        """Abandon downloads (keeping resumable partial files), close the index, free the lock."""
        log.info("stopping: abandoning %d download(s)", self.downloads.count())
        self.pool.stop()
        self._list_file.stop()
        self.downloads.stop()
        try:
            self._drain_events()  # a download that completed meanwhile is recorded, not orphaned
        except IndexWriteError as exc:
            log.warning("could not record the last downloads: %s", exc)
        # Once the cache directory or its files were removed or replaced under us, what is at their
        # paths may be another agent's: no partial file is removed or kept there, nor agent.json removed.
        ours = self.cache.lost() is None
        if ours:
            self.downloads.abandon_all(keep_partial=self.readers.known)  # resumed from when wanted again
        self._churn_summary(last=True)  # before the readers go: it names what they need
        self.fetcher.close_thread()
        self._list_file.join(2.0)
        self.readers.close()
        if self._metrics is not None:
            self._metrics.close()
        self.socket.close()
        if not self.downloads.threads_alive():  # else it could write to a descriptor number reused meanwhile
            self.mailbox.close()
        self.cache.close()
        if ours:
            try:
                self.layout.state_path.unlink(missing_ok=True)
            except OSError as exc:  # its file system turned read-only: readers check the lock, not the file alone
                log.warning("left %s behind: cannot remove it (%s)", self.layout.state_path, exc.strerror)
        self._lock.release()
        self._private.release()  # a loader waiting to use a private agent may now start a new one
        log.info("stopped")

    # -- the loop -----------------------------------------------------------

    def step(self) -> None:
        """One turn of the main loop: messages, a step of the list's lookup table, download
        events, the list, the plan."""
        self._serve(TICK if self._lookups is None else 0.0)
        if self._lookups is not None and self._lookups.make_lookups(LOOKUP_STEP):
            self._lookups = None  # whole (or finished by a lookup meanwhile)
        self._drain_events()
        change = self._list_file.changed()
        if change is not None:
            self._take_list(change)
            del change  # the list before it goes with it (unless an epoch under way reads it)
            release_freed()  # else its arrays, freed between live blocks, stay in the process
        self.readers.expire()
        self.prefetches.expire()
        self.pool.check()
        self._schedule()
        self._send_answers()
        self._periodic()
        if self._private.unused():
            self.stop()

    def _schedule(self) -> None:
        demanded = self.opens.demanded()
        self.workers.hold_walks(bool(demanded))  # a reader waits: the CPU goes to what it waits for
        planned = self.readers.planned()
        # Not the shards asked for: a read of one walks it anyway, and they come and go.
        self.workers.wanted(planned, self.cache.is_cached, self.readers.position)
        self.opens.revalidate_ahead(planned)
        readers = self._readers_want(demanded, planned)
        seen = set(readers)
        # The next prefetch wishes only: enough to fill the download slots, whatever the lists' length.
        warm = [u for u in self.prefetches.wanted(self.config.download_workers) if u not in seen]
        want = readers + warm
        for url in self.downloads.schedule(
            want, self.readers.holding(want), set(demanded), self.prefetches.hold(set(warm))
        ):
            self.opens.answer_while_downloading(url)
        self._held_up = any(self.downloads.space_wait(u) for u in demanded) and any(self.cache.pins.values())
        if self._held_up:  # streams are asked to let go of their parked pins (_op_report); idle sessions are let go of
            self.readers.let_go_idle(self.opens.held)
        for given_up in self.downloads.no_room():
            self.prefetches.no_room(given_up)

    def _readers_want(self, demanded: list[str] | None = None, planned: list[str] | None = None) -> list[str]:
        """Shards asked for (oldest first), then the union of readers' windows by urgency."""
        demanded = self.opens.demanded() if demanded is None else demanded
        planned = self.readers.planned() if planned is None else planned
        first = set(demanded)
        return demanded + [u for u in planned if u not in first]

    def _wanted(self) -> list[str]:
        """What readers want (:meth:`_readers_want`), then the next shards to prefetch (``wdscache prefetch``)."""
        want = self._readers_want()
        seen = set(want)
        return want + [u for u in self.prefetches.wanted(self.config.download_workers) if u not in seen]

    def _periodic(self) -> None:
        self.downloads.sample_rate()
        self.silence.sample()
        now = time.monotonic()
        if self._metrics is not None and now - self._last_metrics >= METRICS_EVERY:
            self._last_metrics = now
            self._metrics.update(self.stats())
        if now - self._last_flush > FLUSH_EVERY:
            self._last_flush = now
            self.cache.flush()
        self._churn_summary()

    def _churn_summary(self, last: bool = False) -> None:
        """The summary of a minute's re-downloads and evictions to make room, when past a few
        they went to DEBUG (:class:`~.churn_log.ChurnLog`); ``last``: at the stop, however short the minute."""
        self.cache.churn.tick(lambda: self.readers.need(self.opens.held)[0], self.cache.limit, last=last)

    def _index_full(self, exc: IndexWriteError) -> None:
        """The index could not be written: pause downloads and free disk space without it; or,
        when its file system refuses writes for another reason (read-only, I/O errors), stop
        (WdsCacheError naming it): freeing space would not help, and nothing could be recorded."""
        fault = write_fault(self.layout.index_dir)
        if fault is not None:
            raise WdsCacheError(
                f"{fault.describe(self.layout.root)} ({exc}): the agent stops, as it can record nothing "
                "more; the cached shards stay: start it again once the file system is writable"
            )
        if not self.downloads.paused:
            log.error("%s; pausing downloads and freeing space", exc)
        self.downloads.pause(str(exc))
        self.cache.free_files(INDEX_HEADROOM, self._wanted())

    def _reader_gone(self, name: str) -> None:
        self.opens.release_all(name)

    def _take_list(self, change: ListChange) -> None:
        """The list file changed: epochs under way finish on their list. What changed came from the
        list's thread (:class:`ListChange`): only the cache's and waiting readers' part is looked at."""
        old, new = self.readers.urls, change.urls
        if not change.added and not change.removed and new.urls == old.urls and new.shards == old.shards:
            return
        self._list_file.log_change(change.added, change.removed, len(new))
        self.readers.replace_list(new)  # first: the list file's reader takes it for served now
        self._lookups = new.urls
        kept, asked = list(self.cache.kept), self.opens.demanded()
        removed = set(change.removed) if kept or asked else set()
        for url in kept:
            if url in removed and not self.readers.known(url):
                self.cache.drop_partial(url)  # a partial of a shard no longer listed is garbage
        for url in asked:
            if url in removed and not self.readers.read_by_a_consumer(url):
                self.opens.unlisted(url)
        # Last: a full index (IndexWriteError) leaves the rest done. A shard listed again is tried
        # again; one no list names any more is no failure of anyone's.
        self.cache.forget_failures(chain(change.added, (u for u in change.removed if not self.readers.known(u))))

    # -- download events ------------------------------------------------------

    def _drain_events(self) -> None:
        while (event := self.mailbox.take()) is not None:
            try:
                self._on_event[type(event)](event)
            except IndexWriteError:
                self.mailbox.put_back(event)  # handled again once there is room
                raise

    # Each ends with downloads.ended: a failed index write (handled again later) leaves the download active.

    def _downloaded(self, e: Downloaded) -> None:
        url = e.download.url
        if self.downloads.record_download(e.download, e.fetched):
            self.readers.check_need(self.opens.held, again=url)
        self.opens.downloaded(url)
        self.workers.published(url, self.readers.position(url), now=self.opens.held_by_any(url))
        self.downloads.ended(e.download)

    def _revalidated(self, e: Revalidated) -> None:
        self.opens.revalidated(e.download.url, e.now, e.download.progress.md5)
        self.downloads.ended(e.download)

    def _failed(self, e: DownloadFailed) -> None:
        self.downloads.record_failure(e.download, e.error)
        self.opens.failed(e.download.url, e.error.reason, corrupt=isinstance(e.error, BadShard))
        self.downloads.ended(e.download)

    def _out_of_space(self, e: OutOfSpace) -> None:
        self.downloads.record_out_of_space(e.download, e.error, self._wanted())
        self.downloads.ended(e.download)

    def _cancelled(self, e: DownloadCancelled) -> None:
        self.downloads.record_cancel(e.download, keep_partial=self.readers.known(e.download.url))
        self.downloads.ended(e.download)

    # -- the control socket ---------------------------------------------------

    def _serve(self, timeout: float) -> None:
        ready = self.socket.poll(timeout)
        if self.mailbox.fileno() in ready:
            self.mailbox.clear()  # the events themselves are in the queue
        if self.socket.readable not in ready:
            return
        for ident, header, payload in self.socket.receive():
            rid = header.get("id")
            try:
                if header["op"] == "walked":
                    self.workers.pass_on(ident, header, payload)
                    self._keep_table(header, payload)
                else:
                    self._handle(ident, header)
            except ProtocolError as exc:
                self.socket.reply(ident, rid, ok=False, error=str(exc))
            except IndexWriteError as exc:  # (out of the try: a stop it makes is not one bad message's)
                if header["op"] != "walked":  # (a worker's table: nobody waits for an answer)
                    self.socket.reply(ident, rid, ok=False, retry=True, error=f"{exc}; try again shortly")
                self._index_full(exc)
            except Exception as exc:  # one bad message must never take the agent down
                fault = out_of_files(exc)
                if fault is not None:  # ours, not a shard's: the consumer must not skip one for it
                    log.error("%s", fault)
                    self.socket.reply(ident, rid, ok=False, fault=True, error=fault)
                    continue
                log.exception("error handling a message")
                self.socket.reply(ident, rid, ok=False, error=f"internal error: {type(exc).__name__}")
        self._send_answers()

    def _keep_table(self, header: dict[str, Any], frames: list[Any]) -> None:
        """A walked table (checked by ``pass_on``) kept on disk for agents started later, if the
        cache has room for it; the workers check it again when they read it. IndexWriteError if its
        record cannot be written (see ``_serve``)."""
        self.cache.tables.store(header["url"], header["identity"], header["layouts"], [bytes(f) for f in frames])

    def _send_answers(self) -> None:
        """Send the replies to held requests that became answerable (waiters whose shard came)."""
        for answer in self.opens.take_answers():
            self.socket.answer(answer)

    def _handle(self, ident: bytes, header: dict[str, Any]) -> None:
        """One admitted message: its op's handler (see wdscache.shared.protocol.MESSAGES)."""
        op = header["op"]
        handler = self._ops.get(op)
        if handler is None:
            raise ProtocolError(f"unknown op {op!r}")
        if op in WORKER_OPS:
            self.workers.check(header)
        if op in READER_OPS:
            self.readers.seen(get_field(header, "reader", str))
        dropped = (
            op in GREETED_OPS and get_field(header, "said_hello", bool, False) and header["reader"] not in self.readers
        )
        body = dropped_reply(header["reader"]) if dropped else handler(Request(ident, header.get("id"), header))
        if body is not None:
            self.socket.reply(ident, header.get("id"), **body)

    def _op_stats(self, request: Request) -> Reply:
        if get_field(request.header, "flush", bool, False):  # wdscache ls reads the index: it shows this moment's reads
            self._last_flush = time.monotonic()
            self.cache.index.flush()
        return {"ok": True, "stats": self.stats()}

    def _op_report(self, request: Request) -> Reply:
        """A consumer's report (:meth:`Readers.op_report`). While a reader waits for room that pins
        hold, each consumer is asked to let go of the pins it does not read now: one held by its
        user (a rank in a collective, a DataLoader worker whose batch is not asked for yet) may be
        what the waiting reader's own job waits for, and its pins would hold that room for ever."""
        reply = self.readers.op_report(request)
        if self._held_up and reply.get("ok"):
            reply["let_go"] = True
        return reply

    def _op_counts(self, request: Request) -> Reply:
        samples = self.readers.samples  # counted in a copy, else from a shard index
        return {"ok": True, "counts": [samples(u) for u in strings(request.header, "urls")]}

    def _op_hello(self, request: Request) -> Reply:
        reply = self.readers.op_hello(request)
        if request.header["reader"] in self.readers:
            self.readers.check_need(self.opens.held)
        return reply

    # -- statistics -----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The live statistics object (see :mod:`wdscache.shared.stats` for its fields)."""
        return _live_stats(self)


def _live_stats(agent: Agent) -> dict[str, Any]:
    """``agent``'s live statistics object (see :mod:`wdscache.shared.stats` for its fields)."""
    cache, index = agent.cache, agent.cache.index
    by_state = _shard_counts(cache, agent.downloads, agent.prefetches, agent._readers_want())
    waited = agent.opens.shards.waited_for_by(agent.readers.job_of)
    agent_view = {
        "workers": agent.workers.view(),
        **waits(waited, agent.opens.shards, index, agent.silence.sends_nothing()),
        "retrying": agent.downloads.retrying(waited),
        "need_bytes": agent.readers.need(agent.opens.held)[0],
        "disk": agent.downloads.disk(),
        "out_of_files": agent.downloads.out_of_files(),
    }
    state = {"bytes_limit": cache.limit, "shards": by_state, "agent": agent_view}
    readers = agent.readers.view(lambda job: starved_by(state, job) or "latency")
    return build(
        cache_dir=str(agent.layout.root),
        summary={
            "counts": by_state,
            "bytes_used": index.summary.bytes_used,
            "table_bytes": index.summary.table_bytes,
            "failed": index.summary.failed,
        },
        counters=index.counters(),
        bytes_limit=cache.limit,
        download_rate=agent.downloads.rate(),
        agent={
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - agent._started_mono, 1),
            "endpoint": agent.endpoint,
            "answering": True,  # (stats shows an agent that gives no reply in time with False)
            "consumers": readers["consumers"],
            "bytes_reserved": cache.reserved,
            "urls": len(agent.readers.urls),
            "job_lists": readers["job_lists"],
            "pinned": sum(1 for n in cache.pins.values() if n > 0),
            **agent_view,
            "worker_restarts": agent.pool.restarts,
            **agent.opens.view(),
            "waiting_for_space": agent.downloads.space_waits(waited),
        },
        jobs=readers["jobs"],
        ended_jobs=readers["ended_jobs"],
        rank_totals=readers["rank_totals"],
    )


def _publish_state(path: Path, state: dict[str, Any], starting: bool) -> None:
    """Write agent.json: synced once started; while ``starting`` a step is only shown, not synced
    (a short file after a power loss is no state), and one that cannot be written (a full disk)
    holds up no start, which fails where it must, saying why."""
    if not starting:
        write_atomic(path, json.dumps(state).encode())
        return
    try:
        write_atomic(path, json.dumps(state).encode(), durable=False)
    except OSError as exc:
        log.debug("could not say the start's step in %s: %s", path, exc.strerror)


class _PrivateUse:
    """A private agent stops once no loader holds a shared lock on its users file (:mod:`wdscache.training.private`)."""

    def __init__(self, path: Path | None) -> None:
        self._path = path  # None: not a private agent
        self._next = 0.0  # when to look next
        self._fd = -1  # our exclusive lock on the users file, once no loader is left

    def unused(self) -> bool:
        """True (once) when no loader uses this private agent any more, or that cannot be told."""
        now = time.monotonic()
        if self._path is None or self._fd >= 0 or now < self._next:
            return False
        self._next = now + USERS_EVERY
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # no way to tell whether a loader still uses us: do not run for ever
            log.warning("cannot open the private agent's users file %s (%s): stopping", self._path, exc)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # some loader holds it: we are still in use
            return False
        # Kept until shutdown is over, so a loader arriving meanwhile waits for us to be gone
        # and starts a new agent rather than joining one that is going away.
        self._fd = fd
        log.info("no loader uses this private agent any more: stopping")
        return True

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _shard_counts(cache: ShardCache, downloads: Downloads, prefetches: Prefetches, wanted: list[str]) -> dict[str, int]:
    """Shards by state, as stats shows them: the index's, with those downloading now and those
    queued (prefetches asked for, and shards the readers' windows want that nothing fetches yet)."""
    index = cache.index
    by_state = dict(index.summary.counts)
    by_state["downloading"] = downloads.count()
    by_state["queued"] = prefetches.queued() + sum(
        1
        for u in wanted
        if u not in downloads and not cache.is_cached(u) and not _failed(index.get(u)) and not prefetches.asks_for(u)
    )
    return by_state


def _failed(rec: ShardRecord | None) -> bool:
    return rec is not None and rec.state is ShardState.FAILED
