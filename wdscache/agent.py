"""The agent: one per machine and cache directory; downloads ahead of demand and serves readers.

Structure: the main thread owns all state (index, budget, pins, readers, plan)
and runs :meth:`Agent.step` until asked to stop. Download threads only move
bytes: they take a :class:`~wdscache.fetch.Download`, ask the main thread for
budget through :meth:`Agent._reserve`, and report back through an event queue.
Signal handlers (installed by the CLI) only call :meth:`Agent.stop`.

Guarantees:

- A clean stop (first SIGTERM/SIGINT) abandons in-flight downloads and leaves
  the index consistent; the cache is kept, and so are the partial files of
  downloads whose server gave a validator (ETag or Last-Modified): the next
  agent resumes them with a Range request. Other partial files are removed.
- A crash or SIGKILL loses no complete shard: the next agent adopts or
  re-checks every record (:meth:`ShardCache.recover`) and downloads nothing
  that is already cached.
- Nothing outside the union of readers' windows (plus shards asked for) is
  started; a shard is never downloaded by two threads at once.
- Bytes cross the network once: a download is cancelled only after its shard
  has been out of every window for ``CANCEL_AFTER`` seconds (never while a
  reader that just said hello has no window yet and the start-up plan holds
  it), or when a shard a reader waits for needs its slot; a cancelled download
  with a validator keeps its partial file and resumes from it (Range + If-Range).
- A reader reads the list it said hello on to its end, whatever edits of the
  list file happen meanwhile (:meth:`Agent._known`).
- A reader whose process the agent sees (:meth:`Agent._watch_process`) is dropped,
  its pins released, as soon as that process ends.
- Only holders of the cache directory's token (``CACHE_DIR/token``, 0600: its
  owner) are served, on every endpoint, IPC or TCP: a message without this run's
  key (see :mod:`wdscache.protocol`) changes nothing and gets an error saying what
  to do; the only op taken without it, ``auth``, answers a proof and nothing else.
"""

from __future__ import annotations

import fcntl
import hmac
import itertools
import json
import logging
import os
import queue
import secrets
import select
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from .cache import ShardCache
from .config import AgentConfig, format_size, parse_size
from .errors import ConfigError, FetchError, ProtocolError
from .fetch import Cancelled, DiskFull, Download, Fetcher, same_version, validator_kind
from .cache import INDEX_HEADROOM
from .index import IndexWriteError, ShardState
from .layout import CacheLayout, write_private
from .lock import AgentLock
from .plan import Reader, wanted
from .pool import WorkerPool
from .protocol import field as get_field
from .stats import build, jobs_view, public, with_fraction
from .protocol import client_key, numbers, pack, pages, process_identity, proof, same_secret, strings, unpack
from .tario import file_identity
from .s3 import Listing
from .urls import UrlList, diff_urls, list_id, parse_url_list, read_url_list

log = logging.getLogger(__name__)

TICK = 0.05  # seconds the main loop waits for a message before doing its other work
RATE_WINDOW = 10.0  # seconds over which download_rate is averaged
FAILED_RETRY_AFTER = 60.0  # a failed shard asked for again after this long is retried
DISK_FULL_PAUSE = 2.0  # after ENOSPC, no new download starts for this long
WORKER_START_TIMEOUT = 30.0
STARTUP_READER = "(start-up plan)"
MAX_MESSAGE = 1 << 20
FLUSH_EVERY = 5.0  # seconds between writes of counters and read times to the index
REPORT_FIELDS = ("samples", "bytes", "rate", "wait_s", "epoch", "position")
INDEX_HINTS = 64  # shards lately published that a new worker is told to index
WORKER_FIELDS = ("busy_s", "requests", "samples", "bytes", "indexed", "walked", "adopted")
WORKER_OPS = ("worker", "counted", "damaged")  # reports only our workers may send (and "walked", with frames)
CONTROL_OPS = ("stats", "worker", "counted", "damaged", "corrupt", "counts", "hello", "put_urls", "get_urls",
               "open", "status", "release", "report", "ping", "bye")
# Ops of a reader, which name it ("reader"): each one counts as a sign of life.
READER_OPS = ("hello", "put_urls", "get_urls", "open", "status", "release", "report", "ping", "bye")
MAX_JOB_LISTS = 16
LIST_GRACE = 10.0  # seconds a list nobody reads is kept: the next epoch (or len()) need not send it again
MAX_WATCHED = 512  # consumer processes watched at once (one descriptor each); others are timed out
MAX_LISTED = 100  # corrupt or changed shards remembered for stats
SPACE_LOG_AFTER = 5.0  # a download waiting for space this long is logged (short waits are routine)
LIVE_WITHIN = 5.0  # a consumer reports every second; silent this long, it no longer holds its job's shape
MAX_JOB_URLS = 10_000_000
USERS_EVERY = 1.0  # seconds between a private agent's looks for a loader still using it
REFUSED = ("refused: this agent serves only clients that hold the token in its cache directory "
           "(CACHE_DIR/token, readable by the directory's owner only); run as that user and give the loader "
           "cache_dir, or set WDSCACHE_TOKEN to the token (a consumer that cannot see the cache directory)")
# A download out of every window this long is cancelled (windows flicker as readers
# come, go and say hello; each flicker must not cost a download).
CANCEL_AFTER = 3.0
GROWTH_GRACE = 1.0  # seconds every download may wait for room the others hold before one is cancelled


@dataclass
class _Grant:
    """A download thread's request for budget, answered by the main thread."""

    download: Download
    total: int
    event: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    withdrawn: bool = False
    error: Exception | None = None


@dataclass
class _Waiter:
    """A client waiting for a shard to be cached (or, with ``stream``, to be readable as it downloads)."""

    ident: bytes
    rid: Any
    reader: str
    stream: bool = False


class Agent:
    """Run with :meth:`run` (blocks until :meth:`stop`), or drive :meth:`start`/:meth:`step`/:meth:`shutdown`."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.layout = CacheLayout.of(config.cache_dir)
        self._root_id: list[int] = []  # (device, inode) of the cache directory, once it exists
        self.endpoint = config.endpoint or self.layout.default_endpoint()
        self._stop = threading.Event()
        self._events: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        # Download threads post events (_post) and wake the main loop through a pipe (made in
        # _bind), so a finished download's slot or a budget request is handled at once, not
        # at the next TICK.
        self._wake_r = self._wake_w = -1
        self._tasks: queue.SimpleQueue[Download | None] = queue.SimpleQueue()
        self._urls_changed = threading.Event()
        self._urls_signature: tuple[int, ...] | None = None
        self._threads: list[threading.Thread] = []
        self._grants: list[_Grant] = []
        self._worker_idents: dict[int, bytes] = {}  # worker index -> its report socket, for hints
        self._published: deque[str] = deque(maxlen=INDEX_HINTS)  # shards lately published, for workers
        self._walker = itertools.count()  # which worker walks the next shard published
        self._active: dict[str, Download] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._demanded: dict[str, float] = {}  # url -> when first asked for
        # list_id -> a list readers read besides the agent's current one: a consumer's own, or
        # an earlier agent list that readers started their epoch on (kept while read, see _free_lists)
        self._lists: dict[str, UrlList] = {}
        self._unread_since: dict[str, float] = {}  # list_id -> when its last reader left
        self._watched: dict[int, str] = {}  # pidfd -> the reader whose process it is
        self._deaths = select.poll()  # the watched pidfds: readable once their process ended
        self._uploads: dict[str, list[Any]] = {}  # reader -> pages of its list received so far
        self._list_id = ""
        self._corrupt: dict[str, str] = {}  # url -> why it could not be read
        self._changed: dict[str, str] = {}  # url -> how it changed on the server
        self._suspect: set[str] = set()  # cached shards a read found damaged: fetched again at the next open
        self._refetched: set[str] = set()  # damaged shards downloaded once more, not yet read fine since
        self._failed_damaged: set[str] = set()  # failed because their copies were damaged, not their downloads
        self._growth_stuck_since: float | None = None  # since when every download waits for growth room
        self._verified: set[str] = set()  # cached shards known current (downloaded or checked this run)
        self._failed_at: dict[str, float] = {}
        self._unwanted_since: dict[str, float] = {}  # url of a download -> when it left every window
        self._paused_until = 0.0
        self._space_waits: dict[str, str] = {}  # url -> why its download waits for space (for stats, status)
        self._space_said: dict[str, tuple[float, str | None]] = {}  # url -> (waiting since, kind logged)
        self._had: set[str] = set()  # shards this cache held during this run (cached at start or downloaded)
        self._early_counts: dict[str, int] = {}  # url -> samples a worker counted before "done" came
        self._buffers: dict[str, int] = {}  # reader -> the shuffle buffer it said hello with (samples)
        # The control ops (wdscache.protocol.MESSAGES, to the agent; "auth" and "walked" are
        # taken in _serve): op -> handler(ident, id, header).
        self._ops: dict[str, Callable[[bytes, Any, dict[str, Any]], None]] = {
            op: getattr(self, f"_op_{op}") for op in CONTROL_OPS}
        self._thrash_warned = 0  # the budget named by the last warning that readers need more
        self.readers: dict[str, Reader] = {}
        self.jobs: dict[str, dict[str, Any]] = {}  # job -> {"world_size"}, to check its ranks agree
        self.consumers: dict[str, dict[str, Any]] = {}  # reader name -> its last report
        self.worker_stats: dict[int, dict[str, Any]] = {}
        self.pool: WorkerPool | None = None
        self._downloaded_done = 0
        self._rate_samples: deque[tuple[float, int]] = deque()
        self._started = time.time()
        self._last_flush = time.monotonic()
        self._lock = AgentLock(self.layout.lock_path)
        self._users_at = 0.0  # when a private agent looks for its loaders next
        self._users_fd = -1  # a private agent's exclusive lock on its users file, once no loader is left
        self._token = self._key = ""  # the cache directory's token, and this run's key (set in start)
        self._run = secrets.token_hex(16)  # names this agent process: a key seen by others dies with it
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._observer: Any = None
        self.cache: ShardCache | None = None
        self.urls = UrlList(None, ())
        self._startup = Reader(STARTUP_READER, 0)
        self.fetcher = Fetcher(
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            retries=config.retries,
            backoff=config.backoff,
            backoff_max=config.backoff_max,
            s3_endpoint_url=config.s3_endpoint_url,
        )

    # -- life cycle ---------------------------------------------------------

    def run(self) -> None:
        """Start, serve until :meth:`stop`, shut down cleanly."""
        self.start()
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
        """Check everything that can be wrong before taking the cache directory."""
        cfg = self.config
        # The list is read first: a bad line stops us before anything on disk changes.
        self._urls_signature = _stat_signature(cfg.urls)
        self.urls = _read_list(cfg)
        self._list_id = list_id(self.urls.urls)
        self.layout.prepare()
        root = os.stat(self.layout.root)
        self._root_id = [root.st_dev, root.st_ino]
        os.umask(0o077)  # every file and socket we create is private to this user
        self._lock.acquire()
        try:
            self._token = self.layout.ensure_token()
        except BaseException:
            self._lock.release()
            raise
        self._key = client_key(self._token, self._run)
        # Worker processes take a while to start: they do so while the cache is opened.
        self.pool = WorkerPool(n=self.config.workers, agent_endpoint=self.endpoint, cache_dir=str(self.layout.root),
                               token=self._token, run=self._run)
        self.pool.start()
        try:
            self._open_cache()
            self._bind()
        except BaseException:
            self.pool.stop()
            self.pool = None
            self._close_wake()
            self._close_cache()
            self._lock.release()
            raise
        self._start_threads()
        # Ready means ready to serve samples: a consumer's first request should not wait for a process start.
        if not self.pool.wait_ready(WORKER_START_TIMEOUT):
            log.warning("sample workers not up after %.0f s; serving anyway", WORKER_START_TIMEOUT)
        self._write_state()
        self._watch()
        log.info(
            "agent %d serving %s on %s: %d shards listed, %s cached of %s budget",
            os.getpid(), self.layout.root, self.endpoint, len(self.urls),
            format_size(self.cache.used), format_size(self.cache.limit),
        )

    def _open_cache(self) -> None:
        cfg = self.config
        st = os.statvfs(self.layout.root)
        fs_total = st.f_blocks * st.f_frsize
        limit = parse_size(cfg.cache_size, total=fs_total, what="--cache-size")
        min_free = parse_size(cfg.min_free, total=fs_total, what="--min-free")
        self.cache = ShardCache(self.layout, limit=limit, min_free=min_free)
        self._startup = self._startup_reader()
        first = [self.urls.urls[i] for i in self._startup.window(cfg.prefetch)]
        # Partials with a validator are resumed whichever shard they are (they count against the budget).
        done = self.cache.recover(keep_partial=self.urls)
        if self.cache.rebuilt:
            done["adopted"] += self.cache.adopt(self.urls.urls)
        if any(done.values()):
            log.info("recovered the cache: %s", ", ".join(f"{k} {v}" for k, v in done.items() if v))
        if self.cache.used > self.cache.limit:
            # Restarted with a smaller --cache-size: shrink to it before anything else.
            self.cache.evict(self.cache.used - self.cache.limit, wanted=first, allow_window=True)
        self._check_budget(first, fs_total)
        self._had.update(r.url for r in self.cache.index if r.state is ShardState.CACHED)
        self.cache.index.set_meta({"bytes_limit": limit, "prefetch": cfg.prefetch, "urls": str(cfg.urls)})

    def _check_budget(self, first: list[str], fs_total: int) -> None:
        """Refuse a budget that can never hold a reader's window of the largest shards we know of.

        What can ever be used is the smaller of --cache-size and the file system's size
        less --min-free and the index's headroom. Free space taken by other files may
        come back, so too little of it now is a warning, not a refusal.
        """
        cache = self.cache
        assert cache is not None
        room = fs_total - cache.margin  # the most the file system can ever give to shards
        usable = min(cache.limit, room)
        where = (f"the file system of {self.layout.root} is {format_size(fs_total)} in all, --min-free "
                 f"{format_size(cache.min_free)} (+{format_size(INDEX_HEADROOM)} for the index) must stay free, "
                 f"--cache-size {format_size(cache.limit)}")
        if usable <= 0:
            raise ConfigError(f"no shard can ever be cached: {where}; lower --min-free or use a larger file system")
        sizes = [s for s in (self._probe_size(u) for u in first) if s]
        if not sizes:
            return
        need_shards = min(self.config.prefetch + 1, len(self.urls))
        need = need_shards * max(sizes)
        window = (f"shards here are up to {format_size(max(sizes))} and a reader needs {need_shards} of them "
                  f"on disk (the one it reads and {need_shards - 1} ahead)")
        if need > cache.limit:
            raise ConfigError(
                f"--cache-size {format_size(cache.limit)} is too small for --prefetch "
                f"{self.config.prefetch}: {window}; the smallest budget that works is {need} bytes "
                f"({format_size(need)}), or lower --prefetch ({where})"
            )
        if need > room:
            raise ConfigError(
                f"the file system cannot hold the window: {where}; so at most {format_size(room)} can hold "
                f"shards; {window}, {format_size(need)}; lower --min-free or --prefetch, or use a file system "
                f"of at least {format_size(need + cache.margin)}"
            )
        free = cache.fs_free() + cache.used - cache.margin  # our own shards can be evicted
        if need > free:
            log.warning("only %s of the file system can hold shards now (%s free, --min-free %s): %s, %s; "
                        "downloads wait for space until other files make room",
                        format_size(max(0, free)), format_size(cache.fs_free()), format_size(cache.min_free),
                        window, format_size(need))

    def _probe_size(self, url: str) -> int:
        assert self.cache is not None
        rec = self.cache.index.get(url)
        if rec is not None and rec.size:
            return rec.size
        described = self.fetcher.describe(url)
        return described.size if described else 0

    def _startup_reader(self) -> Reader:
        return Reader(STARTUP_READER, len(self.urls), seed=self.config.seed, shuffle=self.config.shuffle)

    def _bind(self) -> None:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)  # a peer sending more is disconnected
        sock.setsockopt(zmq.SNDHWM, 10_000)
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://"):])
            # We hold the lock, so a socket file left here is a dead agent's.
            path.unlink(missing_ok=True)
            sock.bind(self.endpoint)
            path.chmod(0o600)
        else:
            sock.bind(self.endpoint)
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _close_wake(self) -> None:
        """Close the wake-up pipe, unless a download thread still runs (it could write to a
        descriptor number reused meanwhile)."""
        if self._wake_r >= 0 and not any(t.is_alive() for t in self._threads):
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _write_state(self) -> None:
        state = {"pid": os.getpid(), "started": self._started, "endpoint": self.endpoint}
        if self.config.private_users is not None:
            state["private_users"] = str(self.config.private_users)  # loaders joining us lock it
        write_private(self.layout.state_path, json.dumps(state).encode())

    def _start_threads(self) -> None:
        # Twice --download-workers: prefetches use at most half, so a shard a reader waits for
        # starts at once instead of queueing behind prefetches nobody asked for (_schedule).
        for i in range(2 * self.config.download_workers):
            t = threading.Thread(target=self._download_thread, name=f"download-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _watch(self) -> None:
        changed = self._urls_changed

        class Handler(FileSystemEventHandler):
            # Any event in the list's folder counts: Kubernetes updates a mounted
            # ConfigMap by swapping a "..data" symlink, never touching the file's name.
            # _reload_urls compares the file's stat, so unrelated events cost one stat().
            def on_any_event(self, event: FileSystemEvent) -> None:
                changed.set()

        self._observer = Observer()
        self._observer.schedule(Handler(), os.path.dirname(os.path.abspath(self.config.urls)), recursive=False)
        self._observer.daemon = True
        self._observer.start()

    def shutdown(self) -> None:
        """Abandon downloads (keeping resumable partial files), close the index, free the lock."""
        log.info("stopping: abandoning %d download(s)", len(self._active))
        if self.pool is not None:
            self.pool.stop()
        if self._observer is not None:
            self._observer.stop()
        for d in self._active.values():
            d.cancel.set()
        for _ in self._threads:
            self._tasks.put(None)
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.cache is not None:
            try:
                self._drain_events()  # a download that completed meanwhile is recorded, not orphaned
            except IndexWriteError as exc:
                log.warning("could not record the last downloads: %s", exc)
            for d in list(self._active.values()):
                if not d.verify:  # a revalidation holds a cached shard, not a partial one
                    self.cache.abandon(d, keep_partial=self._known(d.url))
        self._active.clear()
        self.fetcher.close_thread()
        if self._observer is not None:
            self._observer.join(2.0)
        for fd in list(self._watched):
            self._unwatch(fd)
        if self._sock is not None:
            self._sock.close(0)
            if self.endpoint.startswith("ipc://"):
                Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)
        if self._ctx is not None:
            self._ctx.term()
        self._close_wake()
        self._close_cache()
        self.layout.state_path.unlink(missing_ok=True)
        self._lock.release()
        if self._users_fd >= 0:  # a loader waiting to use a private agent may now start a new one
            os.close(self._users_fd)
            self._users_fd = -1
        log.info("stopped")

    def _close_cache(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    # -- the loop -----------------------------------------------------------

    def step(self) -> None:
        """One turn of the main loop: messages, download events, the list, the plan."""
        self._serve(TICK)
        self._drain_events()
        if self._urls_changed.is_set():
            self._reload_urls()
        self._expire_readers()
        if self.pool is not None:
            self.pool.check()
        self._schedule()
        self._periodic()
        self._check_users()

    def _check_users(self) -> None:
        """A private agent stops once no loader holds a shared lock on its users file (wdscache.private)."""
        now = time.monotonic()
        if self.config.private_users is None or self._users_fd >= 0 or now < self._users_at:
            return
        self._users_at = now + USERS_EVERY
        try:
            fd = os.open(self.config.private_users, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # no way to tell whether a loader still uses us: do not run for ever
            log.warning("cannot open the private agent's users file %s (%s): stopping", self.config.private_users,
                        exc)
            self.stop()
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # some loader holds it: we are still in use
            return
        # Kept until shutdown is over, so a loader arriving meanwhile waits for us to be gone
        # and starts a new agent rather than joining one that is going away.
        self._users_fd = fd
        log.info("no loader uses this private agent any more: stopping")
        self.stop()

    def _index_full(self, exc: IndexWriteError) -> None:
        """The index could not be written: pause downloads and free disk space without it."""
        assert self.cache is not None
        if time.monotonic() >= self._paused_until:
            log.error("%s; pausing downloads and freeing space", exc)
        self._paused_until = time.monotonic() + DISK_FULL_PAUSE
        self.cache.free_files(INDEX_HEADROOM, self._wanted_urls())

    def _drain_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            try:
                self._event(*event)
            except IndexWriteError:
                self._events.put(event)  # handled again once there is room
                raise

    def _event(self, kind: str, d: Download, value: Any) -> None:
        """One report from a download thread."""
        assert self.cache is not None
        if kind == "reserve":
            self._grants.append(value)
            return
        if kind == "validator":
            self.cache.set_validator(d.url, value)
            return
        if kind == "verified":
            self._verified_event(d.url, value)
        elif kind == "done":
            self._verified.add(d.url)
            again = d.url in self._had or d.url in self.cache.index.counts
            stored = value.size if value.stored is None else value.stored  # what "counted" records too
            self.cache.index.keep_count(d.url, stored, value.etag)  # if the content is what was counted
            self.cache.finish(d, value.size, value.etag, stored=value.stored)
            early = self._early_counts.pop(d.url, None)
            if early is not None:
                self.cache.index.set_count(d.url, early, stored, value.etag)
            self.cache.index.incr("bytes_downloaded", value.size)
            self.cache.index.incr("downloads")
            self._had.add(d.url)
            if again:
                self.cache.index.incr("redownloads")
                self.cache.index.incr("bytes_redownloaded", value.size)
                self._check_readers(again=d.url)
            self._failed_at.pop(d.url, None)
            log.info("cached %s (%s)", d.url, format_size(value.size))
            self._answer_waiters(d.url)
            if d.url in self._published:
                self._published.remove(d.url)  # downloaded again: once is enough
            self._published.append(d.url)
            # One worker walks it ahead and reports the table, which the others get (_pass_on).
            idents = list(self._worker_idents.values())
            if idents:
                self._hint(idents[next(self._walker) % len(idents)], {"op": "index", "url": d.url})
        elif kind == "failed" and isinstance(value, DiskFull):
            # Not the shard's fault: drop the partial, make room, try again shortly.
            self.cache.abandon(d)
            self._paused_until = time.monotonic() + DISK_FULL_PAUSE
            log.warning("%s; abandoned %s, will retry after making room", value.reason, d.url)
            self.cache.evict(d.written + self.cache.margin, wanted=self._wanted_urls(), allow_window=False)
        elif kind == "failed":
            self.cache.fail(d, value.reason)
            self._failed_at[d.url] = time.monotonic()
            log.error("failed %s: %s", d.url, value.reason)
            self._answer_waiters(d.url, error=value.reason)
        elif kind == "cancelled":
            self.cache.abandon(d, keep_partial=self._known(d.url))  # resumed from it when wanted again
        # Last, so that a failed index write (handled again later) leaves the download active.
        self._active.pop(d.url, None)
        self._downloaded_done += d.written

    def _check_readers(self, again: str | None = None) -> None:
        """Warn when the readers need more bytes at once than the budget holds (see :meth:`_readers_need`).

        Called at each hello and each re-download (``again``); warns once, and again only
        for a larger need.
        """
        assert self.cache is not None
        need, why = self._readers_need()
        st = os.statvfs(self.layout.root)
        usable = min(self.cache.limit, st.f_blocks * st.f_frsize - self.cache.margin)
        if need <= usable or need <= self._thrash_warned:
            return
        self._thrash_warned = need
        seen = f" ({again} was just downloaded again)" if again else ""
        log.warning(
            "readers need more than the budget holds: %s; %s of it can be used (--cache-size %s), so shards they "
            "still need are evicted and downloaded again%s; a budget of %d bytes (%s) stops it, or lower "
            "shuffle_buffer or --prefetch", why, format_size(usable), format_size(self.cache.limit), seen,
            need, format_size(need))

    def _readers_need(self) -> tuple[int, str]:
        """Bytes the readers hold at once, and how: a consumer pins every shard whose samples are
        still in its shuffle buffer (its hello says how many samples that holds, the index how
        many a shard has), the shard it opens, and its window of --prefetch shards ahead."""
        assert self.cache is not None
        idx, prefetch = self.cache.index, self.config.prefetch
        self._buffers = {n: b for n, b in self._buffers.items() if n in self.readers}
        counts = [c for c in itertools.islice(idx.counts.values(), 10_000) if c > 0]
        sizes = [r.size for r in itertools.islice(idx.records.values(), 10_000)
                 if r.state is ShardState.CACHED and r.size]
        if not counts or not sizes:
            return 0, "nothing known yet"
        per_shard = max(1, sum(counts) // len(counts))
        n_shards = max([len(self.urls), *(len(listed) for listed in self._lists.values())])
        spans: dict[str, tuple[int, int]] = {}  # job (or reader) -> (shuffle buffer, shards it holds)
        for name, r in self.readers.items():
            if name == STARTUP_READER:
                continue
            job = str(self.consumers.get(name, {}).get("job", name))
            buffer = self._buffers.get(name, 0)
            held = max(-(-buffer // per_shard) + 1, len(r.pins))  # a buffer may end in a shard begun
            spans[job] = max(spans.get(job, (0, 0)), (buffer, min(n_shards, held + prefetch)))
        shards = min(n_shards, sum(h for _, h in spans.values()))
        need = shards * max(sizes)
        jobs = ", ".join(f"job {j!r} (shuffle_buffer {b}) holds up to {h}" for j, (b, h) in sorted(spans.items()))
        return need, (f"{jobs} shard(s) at once (the shards its shuffle buffer spans at about {per_shard} samples "
                      f"a shard, the one it opens and --prefetch {prefetch} ahead), of up to "
                      f"{format_size(max(sizes))} each: {format_size(need)}")

    def _hint(self, ident: bytes, header: dict[str, Any]) -> None:
        """A hint to a worker (it acts on it when idle); one that cannot be reached misses it."""
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, *pack(header)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _check_worker(self, header: dict[str, Any]) -> None:
        """Refuse a worker's report unless it carries our workers' secret: from anyone else, a
        table or a count could misdirect reads, a registration could take a worker's hints."""
        secret = header.pop("secret", None)
        if (self.pool is None or not isinstance(secret, str) or not secret.isascii()
                or not hmac.compare_digest(secret, self.pool.secret)):
            raise ProtocolError(f"{header['op']!r} is for the agent's own workers")

    def _pass_on(self, sender: bytes, header: dict[str, Any], frames: list[Any]) -> None:
        """A worker's table of a shard it walked, to the other workers."""
        self._check_worker(header)
        message = pack(header, *frames)
        for ident in self._worker_idents.values():
            if ident != sender:
                try:
                    self._sock.send_multipart([ident, *message], zmq.NOBLOCK)  # type: ignore[union-attr]
                except zmq.ZMQError:
                    pass  # that worker walks the shard itself

    def _damaged(self, url: str, error: str, identity: list[Any] | None, who: str) -> None:
        """A read found ``url``'s cached copy damaged: it is downloaded once more when no reader
        holds it, and failed (with the reason) if that new copy is damaged too.

        ``identity`` names the file a worker read; a consumer cannot say which copy it read
        (None), so its report only ever asks for the one new download. A report about a copy
        replaced since changes nothing.
        """
        assert self.cache is not None
        rec = self.cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            return
        if identity is not None:
            try:
                if list(file_identity(os.stat(self.cache.path(url)))) != identity:
                    return
            except OSError:
                return
        elif url in self._refetched:
            return
        if url in self._suspect:
            return  # this copy was reported already
        log.error("damaged shard reported by %s: %s: %s", who, url, error[:500])
        self.cache.index.incr("corrupt")
        self._corrupt[url] = error[:500]
        while len(self._corrupt) > MAX_LISTED:
            self._corrupt.pop(next(iter(self._corrupt)))
        if url not in self._refetched:
            self._suspect.add(url)
            return
        reason = f"damaged again after it was downloaded once more: {error[:400]}"
        log.error("failed %s: %s", url, reason)
        self._suspect.discard(url)
        self._failed_damaged.add(url)
        self.cache.fail_cached(url, reason)
        self._failed_at[url] = time.monotonic()
        self._answer_waiters(url, error=reason)

    def _verified_event(self, url: str, now: Any) -> None:
        """A cached shard from an earlier run was compared with its source."""
        assert self.cache is not None
        self.cache.unpin(url)
        rec = self.cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            self._demanded.setdefault(url, time.monotonic())  # gone meanwhile: its waiters need it
            return
        changed = None
        if now is None:
            log.info("could not revalidate %s; serving the cached copy", url)
        elif now.size != (rec.source_size or rec.size):
            changed = f"size changed on the server ({rec.source_size or rec.size} -> {now.size} bytes)"
        elif same_version(rec.etag, now.etag) is False:
            changed = f"changed on the server ({validator_kind(rec.etag)} {rec.etag} -> {now.etag})"
        if changed is None:
            self._verified.add(url)
            self._answer_waiters(url)
            return
        log.error("%s %s; downloading it again", url, changed)
        self._changed[url] = changed
        while len(self._changed) > MAX_LISTED:
            self._changed.pop(next(iter(self._changed)))
        self.cache.index.incr("changed")
        self.cache.remove(url)
        self.cache.index.drop_count(url)
        self._demanded.setdefault(url, time.monotonic())  # its waiters get the new copy

    def _revalidate(self, url: str) -> None:
        assert self.cache is not None
        if url in self._active:
            return
        self.cache.pin(url)  # not evicted while we ask; unpinned when the answer comes
        d = Download(url, partial=self.layout.partial_path(url), final=self.layout.shard_path(url),
                     reserve=self._reserve, verify=True)
        self._active[url] = d
        self._tasks.put(d)

    def _schedule(self) -> None:
        """Start downloads for the most urgent wanted shards; cancel those no longer wanted.

        Prefetches take at most --download-workers connections; a shard a reader waits
        for may take as many again, so it never queues behind prefetches.

        The cancel rule: a download is cancelled once its shard has been out of the
        wanted set for ``CANCEL_AFTER`` seconds in a row, counting the start-up plan as
        wanted while any reader has said hello but has no window yet (its window may
        well be that plan); or at once when all slots are busy, a shard a reader waits
        for has none, and this download is out of the wanted set. A cancelled download
        keeps its partial file when it has a validator, and resumes from it.
        """
        assert self.cache is not None
        want = self._wanted_urls()
        holding = set(want)
        if any(r.ahead == [] for r in self.readers.values()):
            urls = self.urls.urls
            holding.update(urls[i] for i in self._startup.window(self.config.prefetch) if i < len(urls))
        now = time.monotonic()
        self._unwanted_since = {u: t for u, t in self._unwanted_since.items()
                                if u in self._active and u not in holding}
        for url, d in list(self._active.items()):
            if url in holding or d.cancel.is_set():
                continue
            since = self._unwanted_since.setdefault(url, now)
            if now - since >= CANCEL_AFTER:
                log.info("no longer wanted, abandoning %s (out of every window for %.0fs)", url, now - since)
                d.cancel.set()
        for url in want:
            if time.monotonic() < self._paused_until:
                break
            if url in self._active or self.cache.is_cached(url):
                continue
            rec = self.cache.index.get(url)
            if rec is not None and rec.state is ShardState.FAILED:
                continue
            # Demanded shards come first in ``want``; they may use the extra connections.
            slots = self.config.download_workers * (2 if url in self._demanded else 1)
            if len(self._active) >= slots:
                if url in self._demanded and not self._cancel_unwanted():
                    self._preempt()
                break
            self._start_download(url)
        self._answer_grants(want)
        self.cache.keep_margin(want)

    def _cancel_unwanted(self) -> bool:
        """Free a slot for a shard someone waits for: cancel a download out of every window
        (it keeps its partial); True if a slot is being freed."""
        for url in self._unwanted_since:
            d = self._active[url]
            if not d.verify:
                if not d.cancel.is_set():
                    log.info("abandoning %s (no longer wanted) for a shard a reader waits for", url)
                    d.cancel.set()
                return True
        return False

    def _preempt(self) -> None:
        """Free a slot for a shard someone waits for: cancel a prefetch still waiting for budget.

        Such a prefetch holds a slot but may not evict window shards; the demanded
        download may, so without this both could wait for ever.
        """
        waiting = {g.download.url for g in self._grants}
        if any(d.cancel.is_set() for d in self._active.values()):
            return  # a slot is being freed already
        for d in self._active.values():
            if not d.demanded and not d.verify and d.url in waiting:
                log.info("pausing the prefetch of %s for a shard a reader waits for", d.url)
                d.cancel.set()
                return

    def _wanted_urls(self) -> list[str]:
        """Shards asked for (oldest first), then the union of readers' windows by urgency."""
        prefetch, urls = self.config.prefetch, self.urls.urls
        windows = []
        for r in self.readers.values():
            if r.ahead is not None:
                windows.append(r.ahead[:prefetch])
            else:
                windows.append([urls[i] for i in r.window(prefetch) if i < len(urls)])
        if not any(windows):
            # Nobody reads yet (or consumers only said hello): keep the start-up plan.
            windows = [[urls[i] for i in self._startup.window(prefetch) if i < len(urls)]]
        planned = wanted(windows, prefetch)
        demanded = sorted(self._demanded, key=self._demanded.__getitem__)
        return demanded + [u for u in planned if u not in self._demanded]

    def _start_download(self, url: str) -> None:
        assert self.cache is not None
        rec = self.cache.index.get(url)
        d = Download(
            url,
            partial=self.layout.partial_path(url),
            final=self.layout.shard_path(url),
            reserve=self._reserve,
            etag=rec.etag if rec else None,
            demanded=url in self._demanded,
            on_validator=lambda d: self._post(("validator", d, d.etag)),
        )
        self.cache.begin(d)
        self._active[url] = d
        self._tasks.put(d)
        log.debug("downloading %s", url)

    def _answer_grants(self, want: list[str]) -> None:
        assert self.cache is not None
        rank = {u: i for i, u in enumerate(want)}
        self._grants.sort(key=lambda g: (not g.download.demanded, rank.get(g.download.url, len(rank))))
        pending = []
        waits: dict[str, str] = {}
        for g in self._grants:
            with g.lock:
                if g.withdrawn:
                    continue
                try:
                    granted = self.cache.try_reserve(g.download, g.total, wanted=want)
                except OverflowError as exc:
                    g.error = FetchError(g.download.url, str(exc), permanent=True)
                    granted = True
                if granted:
                    g.event.set()
                    if self._streamable(g.download.url):
                        self._answer_streamers(g.download.url)
                else:
                    pending.append(g)
                    if self.cache.refusal is not None:
                        self._waits_for_space(g.download.url, *self.cache.refusal, waits)
        self._grants = pending
        self._break_growth_deadlock(pending)
        self._space_waits = waits  # granted or ended downloads wait no more
        self._space_said = {u: said for u, said in self._space_said.items() if u in waits}

    def _break_growth_deadlock(self, pending: list[_Grant]) -> None:
        """Downloads that grow their reservation as they go (bodies of unknown size, gzip'd shards
        being decompressed) hold budget while they ask for more: two of them can each wait for
        the other's. When every download in flight waits so, the one that wrote least is
        cancelled (it starts over later), and the others can go on."""
        growing = [g for g in pending if g.download.reserved > 0 and not g.download.cancel.is_set()]
        if len(growing) < 2 or len(pending) < len(self._active):
            self._growth_stuck_since = None
            return  # some download is still moving: it may free space
        now = time.monotonic()
        if self._growth_stuck_since is None:
            self._growth_stuck_since = now
        if now - self._growth_stuck_since < GROWTH_GRACE:
            return  # a reader may let go of a pin meanwhile
        self._growth_stuck_since = None
        victim = min(growing, key=lambda g: (g.download.demanded, g.download.written + g.download.expanded))
        log.info("cancelling %s: it and %d other download(s) each wait for space the others hold",
                 victim.download.url, len(growing) - 1)
        victim.download.cancel.set()

    def _waits_for_space(self, url: str, kind: str, reason: str, waits: dict[str, str]) -> None:
        """Note why ``url`` waits for space. Logged once it has waited SPACE_LOG_AFTER, and again
        only when what runs short changes (the budget, or the file system's free space)."""
        waits[url] = f"waiting for space: {reason}"
        now = time.monotonic()
        since, said = self._space_said.get(url, (now, None))
        if said != kind and now - since >= SPACE_LOG_AFTER:
            log.warning("%s waits for space: %s", url, reason)
            said = kind
        self._space_said[url] = (since, said)

    def _reserve(self, d: Download, total: int, timeout: float | None) -> bool:
        """Called in a download thread: block until the main thread grants ``total`` bytes."""
        g = _Grant(d, total)
        self._post(("reserve", d, g))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not g.event.wait(0.05):
            if d.cancel.is_set() or (deadline is not None and time.monotonic() > deadline):
                with g.lock:
                    if not g.event.is_set():
                        g.withdrawn = True
                        if d.cancel.is_set():
                            raise Cancelled(d.url)
                        return False
                break
        if g.error is not None:
            raise g.error
        return True

    def _download_thread(self) -> None:
        while True:
            d = self._tasks.get()
            if d is None:
                break
            try:
                if d.verify:
                    kind, result = "verified", self.fetcher.describe(d.url)
                elif d.cancel.is_set():
                    raise Cancelled(d.url)
                else:
                    kind, result = "done", self.fetcher.fetch(d)
            except Cancelled:
                kind, result = "cancelled", None
            except FetchError as exc:
                kind, result = "failed", exc
            except Exception as exc:  # a bug must not kill the thread and hang the agent
                log.exception("unexpected error downloading %s", d.url)
                kind, result = "failed", FetchError(d.url, f"internal error: {exc!r}")
            self._post((kind, d, result))
        self.fetcher.close_thread()

    def _post(self, event: tuple[str, Any, Any]) -> None:
        """From a download thread: hand ``event`` to the main loop and wake it."""
        self._events.put(event)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the main loop is awake already

    def _reload_urls(self) -> None:
        self._urls_changed.clear()
        signature = _stat_signature(self.config.urls)
        if signature == self._urls_signature:
            return
        time.sleep(0.1)  # editors write in several steps; read once they are done
        self._urls_signature = _stat_signature(self.config.urls)
        try:
            new = _read_list(self.config)
        except ConfigError as exc:
            log.error("keeping the current URL list: %s", exc)
            return
        added, removed = diff_urls(self.urls, new)
        if not added and not removed and new.urls == self.urls.urls:
            return
        log.info("URL list changed: %d added, %d removed (%d shards now)", len(added), len(removed), len(new))
        for url in added[:5]:
            log.info("  + %s", url)
        for url in removed[:5]:
            log.info("  - %s", url)
        assert self.cache is not None
        for url in added:
            self.cache.forget_failure(url)
        if any(r.list_id == self._list_id for r in self.readers.values()):
            # Epochs under way finish on the list they started with; the next ones take the new one.
            self._lists.setdefault(self._list_id, self.urls)
        self.urls = new
        self._list_id = list_id(new.urls)
        for url in removed:
            if url in self.cache.kept and not self._known(url):
                self.cache.drop_partial(url)  # a partial of a shard no longer listed is garbage
        gone = set(removed)
        for url in list(self._demanded):
            if url in gone and not any(r.list_id is not None and url in self._list(r.list_id)
                                       for r in self.readers.values()):
                self._demanded.pop(url)
                self._answer_waiters(url, error="removed from the agent's URL list")
        # Positions in the agent's list refer to the old list: those readers start over on
        # the new one. Readers keep their pins and their own windows.
        for r in self.readers.values():
            if r.ahead is None:
                r.n_shards, r.position = len(new), 0
        self._startup = self._startup_reader()

    def _expire_readers(self) -> None:
        for fd, _ in self._deaths.poll(0) if self._watched else ():
            log.info("reader %s: its process ended; releasing its shards", self._watched[fd])
            self._drop_reader(self._watched[fd])
        now = time.monotonic()
        for name, r in list(self.readers.items()):
            if now - r.last_seen > self.config.reader_timeout:
                log.warning("reader %s silent for %.0fs: releasing its shards", name, now - r.last_seen)
                self._drop_reader(name)
        self._free_lists()

    def _drop_reader(self, name: str) -> None:
        self._uploads.pop(name, None)
        r = self.readers.pop(name, None)
        if r is not None and r.pidfd >= 0:
            self._unwatch(r.pidfd)
        if r is None or self.cache is None:
            return
        for url, count in r.pins.items():
            for _ in range(count):
                self.cache.unpin(url)
            self._refetch_if_damaged(url)
        self.consumers.pop(name, None)

    def _periodic(self) -> None:
        now = time.monotonic()
        total = self._downloaded_done + sum(d.written for d in self._active.values())
        self._rate_samples.append((now, total))
        while self._rate_samples and now - self._rate_samples[0][0] > RATE_WINDOW:
            self._rate_samples.popleft()
        if now - self._last_flush > FLUSH_EVERY and self.cache is not None:
            self._last_flush = now
            self.cache.index.flush()

    # -- the control socket ---------------------------------------------------

    def _serve(self, timeout: float) -> None:
        assert self._sock is not None
        ready = dict(self._poller.poll(int(timeout * 1000)))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass  # drained: the events themselves are in the queue
        if self._sock not in ready:
            return
        for _ in range(1000):  # bounded, so a flood cannot starve the rest of the loop
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, body = frames[0], frames[1:]
            rid = None
            try:
                header, payload = unpack(body)
                rid = header.get("id")
                if not self._admitted(ident, rid, header):
                    continue
                if header["op"] == "walked":
                    self._pass_on(ident, header, payload)
                else:
                    self._handle(ident, header)
            except ProtocolError as exc:
                self._reply(ident, rid, ok=False, error=str(exc))
            except IndexWriteError as exc:
                self._reply(ident, rid, ok=False, retry=True, error=f"{exc}; try again shortly")
                self._index_full(exc)
            except Exception as exc:  # one bad message must never take the agent down
                log.exception("error handling a message")
                self._reply(ident, rid, ok=False, error=f"internal error: {type(exc).__name__}")

    def _admitted(self, ident: bytes, rid: Any, header: dict[str, Any]) -> bool:
        """The one door, before any op runs: True for a message with this run's key.

        ``auth`` (a client asking us to prove we hold the token) is answered here and
        runs nothing; anything else without the key gets REFUSED.
        """
        if header["op"] == "auth":
            nonce = header.get("nonce")
            if isinstance(nonce, str) and nonce.isascii() and 16 <= len(nonce) <= 256:
                self._reply(ident, rid, ok=True, run=self._run, proof=proof(self._token, nonce, self._run))
            else:
                self._reply(ident, rid, ok=False, error="'auth' needs a 'nonce' of 16 to 256 ASCII characters")
            return False
        if same_secret(header.pop("key", None), self._key):  # popped: never passed on to workers
            return True
        self._reply(ident, rid, ok=False, need_token=True, error=REFUSED)
        return False

    def _reply(self, ident: bytes, rid: Any, **body: Any) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, *pack({"op": "reply", "id": rid, **body})], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropping a reply to a client that does not read")

    def _handle(self, ident: bytes, header: dict[str, Any]) -> None:
        """One admitted message: its op's handler (see wdscache.protocol.MESSAGES)."""
        op = header["op"]
        handler = self._ops.get(op)
        if handler is None:
            raise ProtocolError(f"unknown op {op!r}")
        if op in WORKER_OPS:
            self._check_worker(header)
        if op in READER_OPS:
            reader = self.readers.get(get_field(header, "reader", str))
            if reader is not None:
                reader.last_seen = time.monotonic()
        handler(ident, header.get("id"), header)

    def _op_stats(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        self._reply(ident, rid, ok=True, stats=self.stats())

    def _op_worker(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        i = get_field(header, "index", int)
        if 0 <= i < self.config.workers:
            if self._worker_idents.get(i) != ident:  # a new worker (or restarted: a new socket)
                self._worker_idents[i] = ident
                for url in self._published:  # it missed these hints (and the tables of them)
                    self._hint(ident, {"op": "index", "url": url})
            report = {"index": i, **numbers(header, WORKER_FIELDS)}
            self.worker_stats[i] = with_fraction(self.worker_stats.get(i), report, "busy_s", "busy")

    def _op_counted(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        assert self.cache is not None
        url, samples = get_field(header, "url", str), get_field(header, "samples", int)
        # Only for shards cached here (a worker just scanned it), whose copy we know; anything else is noise.
        rec = self.cache.index.get(url)
        if samples < 0 or rec is None:
            return
        if rec.state is ShardState.CACHED:
            self.cache.index.set_count(url, samples, rec.size, rec.etag)
            self._refetched.discard(url)  # its headers read fine: later damage gets one more download
        elif url in self._active and self.cache.path(url).exists():
            # Published a moment ago (a worker saw the file): its "done" event, still queued, records it.
            self._early_counts[url] = samples

    def _op_damaged(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        # From one of our workers (checked in _handle), naming the copy it read.
        url, error = get_field(header, "url", str), get_field(header, "error", str)
        self._damaged(url, error, get_field(header, "identity", list), "a worker")

    def _op_corrupt(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        url, error = get_field(header, "url", str), get_field(header, "error", str)
        self._damaged(url, error, None, "a consumer")
        self._reply(ident, rid, ok=True)

    def _op_counts(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        assert self.cache is not None
        counts = self.cache.index.counts
        self._reply(ident, rid, ok=True, counts=[counts.get(u) for u in strings(header, "urls")])

    def _op_hello(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        name = header["reader"]
        self._hello(ident, rid, name, header)
        if name in self.readers:
            self._buffers[name] = max(0, get_field(header, "shuffle_buffer", int, 0))
            self._check_readers()

    def _op_put_urls(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        error = self._put_urls(header["reader"], header)
        self._reply(ident, rid, ok=error is None, error=error)

    def _op_get_urls(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        reader = self.readers.get(header["reader"])
        offset = get_field(header, "offset", int)
        # The list the reader said hello on, even if the file changed since.
        listed = reader.list_id if reader is not None and reader.list_id is not None else self._list_id
        page = next(pages(self._list(listed).urls, max(0, offset)), (offset, []))[1]
        self._reply(ident, rid, ok=True, list_id=listed, urls=page)

    def _op_open(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        ahead = get_field(header, "ahead", list, None)
        wait = get_field(header, "wait", bool, True)
        stream = get_field(header, "stream", bool, False)
        self._open(ident, rid, header["reader"], get_field(header, "url", str), ahead, wait, stream)

    def _op_status(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        self._reply(ident, rid, ok=True, **self._status(get_field(header, "url", str)))

    def _op_release(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        self._release(header["reader"], get_field(header, "url", str))
        self._reply(ident, rid, ok=True)

    def _op_report(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        name = header["reader"]
        if name in self.readers:
            known = self.consumers.get(name, {})
            report = {"job": known.get("job"), "rank": known.get("rank"), **numbers(header, REPORT_FIELDS)}
            self.consumers[name] = with_fraction(known, report, "wait_s", "waiting")
        self._reply(ident, rid, ok=name in self.readers, error="unknown reader; say hello first")

    def _op_ping(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        self._reply(ident, rid, ok=True)

    def _op_bye(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        self._drop_reader(header["reader"])
        self._reply(ident, rid, ok=True)

    def _hello(self, ident: bytes, rid: Any, name: str, header: dict[str, Any]) -> None:
        """A consumer joins a job: check it agrees with the job's other ranks, take up its list.

        Lists travel in pages (``put_urls`` / ``get_urls``), never in one message, and
        are known by ``list_id`` (a hash), so a list is sent once, not every epoch.
        """
        job = get_field(header, "job", str)
        world = get_field(header, "world_size", int)
        rank = get_field(header, "rank", int)
        if not 0 <= rank < world:
            self._reply(ident, rid, ok=False, error=f"rank {rank} is not in [0, {world})")
            return
        claimed = get_field(header, "list_id", str, None)
        uploaded = self._uploads.pop(name, None)
        if claimed is not None and claimed not in self._lists:
            if uploaded is None:
                self._reply(ident, rid, ok=False, need_urls=True, error="send the list first (put_urls)")
                return
            try:
                parsed = self._job_list(uploaded)
            except ConfigError as exc:
                self._reply(ident, rid, ok=False, error=str(exc))
                return
            if list_id(parsed.urls) != claimed:
                self._reply(ident, rid, ok=False, error="the list sent does not match its list_id")
                return
            if len(self._lists) >= MAX_JOB_LISTS:
                self._free_lists(grace=0.0)  # lists nobody reads make room first
            if len(self._lists) >= MAX_JOB_LISTS:
                self._reply(ident, rid, ok=False, error=(
                    f"the agent holds {MAX_JOB_LISTS} URL lists of running jobs; try again once one ends"))
                return
            self._lists[claimed] = parsed
        known = self.jobs.get(job)
        if known is not None and known["world_size"] != world and self._job_ranks(job):
            self._reply(ident, rid, ok=False, error=(
                f"job {job!r} runs with world_size {known['world_size']}, but rank {rank} says {world}; "
                "give each launch its own job name"))
            return
        self.jobs[job] = {"world_size": world}
        # No window until the consumer opens its first shard: the start-up plan stays meanwhile.
        self._drop_reader(name)
        # It reads the list it named, or the agent's list as it is now until its epoch ends.
        self.readers[name] = Reader(name, ahead=[], list_id=claimed if claimed is not None else self._list_id)
        self.consumers[name] = {"job": job, "rank": rank, "seen": time.time()}
        self._watch_process(name, header.get("process"))
        self._reply(
            ident, rid, ok=True,
            workers=self.pool.endpoints if self.pool else [],
            prefetch=self.config.prefetch,
            list_id=self._list_id, n_urls=len(self.urls),
            cache_dir=str(self.layout.root), cache_root=self._root_id,  # for direct reads (wdscache.direct)
        )

    def _put_urls(self, name: str, header: dict[str, Any]) -> str | None:
        """A page of a consumer's own list; returns an error or None."""
        offset = get_field(header, "offset", int)
        page = strings(header, "urls")
        if name not in self._uploads and len(self._uploads) >= MAX_JOB_LISTS:
            return "too many lists being uploaded at once; try again"
        got = self._uploads.setdefault(name, [])
        if offset != len(got):
            self._uploads.pop(name, None)
            return f"list page at {offset} does not follow the {len(got)} URLs received"
        if len(got) + len(page) > MAX_JOB_URLS:
            self._uploads.pop(name, None)
            return f"a job's list may hold at most {MAX_JOB_URLS} URLs"
        got.extend(page)
        return None

    def _list(self, key: str | None) -> UrlList:
        """The list ``key`` names: one kept in ``_lists``, else the agent's current list."""
        return self._lists.get(key, self.urls) if key is not None else self.urls

    def _known(self, url: str, reader: Reader | None = None) -> bool:
        """In the list ``reader`` reads; for a plain client (no hello), in the agent's list or in
        a list some reader reads. Only listed shards are ever fetched."""
        if reader is not None and reader.list_id is not None:
            return url in self._list(reader.list_id)
        return url in self.urls or any(url in listed for listed in self._lists.values())

    def _free_lists(self, grace: float = LIST_GRACE) -> None:
        """Forget the lists no reader has read for ``grace`` seconds (a million URLs is
        about 140 MB); a consumer that comes back sends its list again (``need_urls``)."""
        now = time.monotonic()
        read = {r.list_id for r in self.readers.values()}
        for key in list(self._lists):
            if key in read:
                self._unread_since.pop(key, None)
            elif now - self._unread_since.setdefault(key, now) >= grace:
                del self._lists[key]
                self._unread_since.pop(key)

    def _watch_process(self, name: str, claimed: Any) -> None:
        """Watch the process a consumer named in hello, if we see that very process, so that
        its reader is dropped the moment it ends. Else (another machine or container, no
        pidfd) the reader goes after ``--reader-timeout`` of silence."""
        if not (isinstance(claimed, list) and len(claimed) == 4 and type(claimed[0]) is int
                and 0 < claimed[0] < 1 << 31 and len(self._watched) < MAX_WATCHED):
            return
        try:
            fd = os.pidfd_open(claimed[0])
        except (AttributeError, OSError):
            return
        # Compared once the pidfd is open: if the identity matches, it is that process's pidfd.
        if process_identity(claimed[0]) != claimed:
            os.close(fd)
            return
        self.readers[name].pidfd = fd
        self._watched[fd] = name
        self._deaths.register(fd, select.POLLIN)
        self._poller.register(fd, zmq.POLLIN)  # wakes the main loop when it ends

    def _unwatch(self, fd: int) -> None:
        del self._watched[fd]
        self._deaths.unregister(fd)
        self._poller.unregister(fd)
        os.close(fd)

    def _job_ranks(self, job: str) -> list[int]:
        """Ranks of ``job`` alive now: reporting recently (a killed rank's reader lingers until
        --reader-timeout, and must not block an elastic restart with another world size)."""
        now = time.time()
        return [c["rank"] for n, c in self.consumers.items()
                if c.get("job") == job and n in self.readers and now - c.get("seen", 0.0) < LIVE_WITHIN]

    def _job_list(self, urls: list[Any]) -> UrlList:
        """A consumer's own URL list, held to what this endpoint may fetch for others."""
        # Over a TCP endpoint a peer may be another machine: it must not make us read local files.
        # Nor fetch from S3 with our credentials: s3:// too only for a peer on this machine.
        schemes: tuple[str, ...] = ("http://", "https://")
        if self.endpoint.startswith("ipc://"):
            schemes += ("file://", "s3://")
        for u in urls:
            if not isinstance(u, str) or not u.startswith(schemes) or any(c.isspace() for c in u):
                raise ConfigError(f"{str(u)[:200]!r}: a job's URLs must be absolute {'/'.join(schemes)} URLs")
        parsed = parse_url_list("\n".join(u.replace("{", "\\{").replace("}", "\\}") for u in urls))
        return parsed

    def _open(
        self, ident: bytes, rid: Any, name: str, url: str, ahead: list[Any] | None = None, wait: bool = True,
        stream: bool = False,
    ) -> None:
        """Pin ``url`` for reader ``name`` once it is cached (``wait``), or answer that it is not.

        With ``stream``, a shard not cached yet is pinned as soon as its download
        holds its whole budget (the reply says ``partial``): the reader then reads
        its complete samples from the workers while it downloads, and the pin holds
        the shard once it is published. Not before: a reader that holds pins while
        it waits for a download that waits for budget could deadlock the cache, so
        until then the answer is "not cached" (or, with ``wait``, comes later).
        """
        assert self.cache is not None
        reader = self.readers.get(name)
        if not self._known(url, reader):
            self._reply(ident, rid, ok=False, error=f"{url} is not in the agent's URL list ({self.config.urls})")
            return
        if reader is None:
            # A plain client reads in list order; its window is the shards after this one.
            reader = self.readers[name] = Reader(name, len(self.urls), shuffle=False)
        if ahead is not None:
            reader.ahead = [u for u in ahead[: self.config.prefetch] if isinstance(u, str) and self._known(u, reader)]
        elif reader.ahead is None and url in self.urls:
            reader.advance_to(self.urls.index(url))
        rec = self.cache.index.get(url)
        if rec is not None and rec.state is ShardState.CACHED and not self.cache.path(url).exists():
            # Deleted behind our back: forget it and download it again, never serve a missing file.
            log.warning("cache file of %s vanished; downloading it again", url)
            self.cache.remove(url)
            rec = None
        elif rec is not None and url in self._suspect:
            # A read found it damaged: it is fetched once more (a bad copy is repaired; a bad source
            # is failed once its new copy is found damaged too, see _damaged), now if nobody
            # holds it, else once they let go; meanwhile it is not cached for this reader.
            self._refetch_if_damaged(url)
            rec = None
        if rec is not None and rec.state is ShardState.CACHED:
            self.cache.index.incr("hits")
            if url in self._verified or not self.config.revalidate:
                self._grant_open(ident, rid, name, url)
                return
            # Cached by an earlier run: check it is still what the source holds first.
            self._revalidate(url)
            if wait:
                self._waiters.setdefault(url, []).append(_Waiter(ident, rid, name))
            else:
                self._reply(ident, rid, ok=False, cached=False, error="revalidating")
            return
        self.cache.index.incr("misses")
        if rec is not None and rec.state is ShardState.FAILED:
            failed_at = self._failed_at.get(url, 0.0)
            if time.monotonic() - failed_at < FAILED_RETRY_AFTER:
                self._reply(ident, rid, ok=False, error=rec.error or "download failed",
                            damaged=url in self._failed_damaged)
                return
            self.cache.forget_failure(url)
            self._failed_damaged.discard(url)
            self._refetched.discard(url)  # a new try from the start: one more download if damaged again
        self._demanded.setdefault(url, time.monotonic())
        d = self._active.get(url)
        if d is not None:
            d.demanded = True
        if stream and self._streamable(url):
            self._grant_open(ident, rid, name, url, partial=True)
        elif wait:
            self._waiters.setdefault(url, []).append(_Waiter(ident, rid, name, stream))
        else:
            self._reply(ident, rid, ok=False, cached=False, error="not cached yet")

    def _grant_open(self, ident: bytes, rid: Any, name: str, url: str, *, partial: bool = False) -> None:
        assert self.cache is not None
        reader = self.readers.get(name)
        if reader is None:
            self._reply(ident, rid, ok=False, error="reader expired while waiting")
            return
        reader.pins[url] = reader.pins.get(url, 0) + 1
        self.cache.pin(url)  # a shard still downloading stays pinned once published
        if partial:
            self._reply(ident, rid, ok=True, partial=True)
            return
        self._reply(ident, rid, ok=True, path=str(self.cache.path(url)), size=self.cache.index.get(url).size,
                    samples=self.cache.index.counts.get(url))

    def _status(self, url: str) -> dict[str, Any]:
        """Where ``url`` stands: cached; downloading (with its budget); queued (for a download
        slot or budget); failed (with the error); or unknown (nobody asked for it)."""
        assert self.cache is not None
        rec = self.cache.index.get(url)
        if url in self._suspect:
            return {"state": "queued", "reason": "its cached copy is damaged: it is downloaded again once the "
                                                 "readers that hold it let go"}
        if rec is not None and rec.state is ShardState.CACHED:
            return {"state": "cached"}
        d = self._active.get(url)
        # Bytes written so far (a gzip'd shard's tar too): a waiting consumer counts their growth as progress.
        progress = {"written": d.written + d.expanded, "total": d.total} if d is not None and not d.verify else {}
        if url in self._space_waits:  # before "downloading": a stream that waits for space should say why
            return {"state": "queued", "reason": self._space_waits[url], **progress}
        if self._streamable(url):
            return {"state": "downloading", **progress}
        if rec is not None and rec.state is ShardState.FAILED:
            # "damaged": its copies were found damaged (the shard is bad, not its download).
            return {"state": "failed", "error": rec.error or "download failed", "damaged": url in self._failed_damaged}
        return {"state": "queued" if url in self._active or url in self._demanded else "unknown", **progress}

    def _streamable(self, url: str) -> bool:
        """True when ``url`` is downloading with its whole size reserved: it will finish whatever is pinned."""
        d = self._active.get(url)
        # A gzip'd shard is read once decompressed: a stream would hold its pins while the tar
        # still needs room.
        return d is not None and not d.verify and not d.gzipped and d.total is not None and d.reserved >= d.total

    def _answer_streamers(self, url: str) -> None:
        """The download of ``url`` got its budget: readers waiting to stream it may start."""
        waiting = self._waiters.get(url, [])
        for w in [w for w in waiting if w.stream]:
            self._grant_open(w.ident, w.rid, w.reader, url, partial=True)
        rest = [w for w in waiting if not w.stream]
        if rest:
            self._waiters[url] = rest
        else:
            self._waiters.pop(url, None)

    def _answer_waiters(self, url: str, error: str | None = None) -> None:
        self._demanded.pop(url, None)
        for w in self._waiters.pop(url, []):
            if error is None:
                self._grant_open(w.ident, w.rid, w.reader, url)
            else:
                self._reply(w.ident, w.rid, ok=False, error=error)

    def _release(self, name: str, url: str) -> None:
        assert self.cache is not None
        reader = self.readers.get(name)
        if reader is None or reader.pins.get(url, 0) <= 0:
            return
        reader.pins[url] -= 1
        if not reader.pins[url]:
            del reader.pins[url]
        self.cache.unpin(url)
        self._refetch_if_damaged(url)

    def _refetch_if_damaged(self, url: str) -> None:
        """A damaged copy nobody holds any more is dropped, and downloaded once more for the
        readers waiting for it (see :meth:`_damaged`)."""
        assert self.cache is not None
        if url not in self._suspect or self.cache.pins.get(url):
            return
        log.warning("downloading %s again: %s", url, self._corrupt.get(url, "found damaged"))
        self._suspect.discard(url)
        self._refetched.add(url)
        # Its sample count stays: it was found in a copy of this very version, and the ranks
        # of a job that ask for it meanwhile must all get the same answer.
        self.cache.remove(url)
        self._demanded.setdefault(url, time.monotonic())

    # -- statistics -----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The live statistics object (see :mod:`wdscache.stats` for its fields)."""
        assert self.cache is not None
        idx = self.cache.index
        counts = dict(idx.summary.counts)
        counts["downloading"] = len(self._active)
        want = self._wanted_urls()
        counts["queued"] = sum(1 for u in want if u not in self._active and not self.cache.is_cached(u)
                               and (idx.get(u) is None or idx.get(u).state is not ShardState.FAILED))
        rate = 0.0
        if len(self._rate_samples) >= 2:
            (t0, b0), (t1, b1) = self._rate_samples[0], self._rate_samples[-1]
            rate = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        return build(
            cache_dir=str(self.layout.root),
            summary={"counts": counts, "bytes_used": idx.summary.bytes_used, "failed": idx.summary.failed},
            counters=idx.counters(),
            bytes_limit=self.cache.limit,
            download_rate=rate,
            agent={
                "pid": os.getpid(),
                "uptime_s": round(time.time() - self._started, 1),
                "endpoint": self.endpoint,
                "consumers": len(self.consumers),
                "bytes_reserved": self.cache.reserved,
                "urls": len(self.urls),
                "job_lists": len(self._lists),
                "pinned": sum(1 for n in self.cache.pins.values() if n > 0),
                "workers": [public(self.worker_stats.get(i, {"index": i})) for i in range(self.config.workers)],
                "worker_restarts": self.pool.restarts if self.pool else 0,
                "corrupt": [{"url": u, "error": e} for u, e in self._corrupt.items()],
                "changed": [{"url": u, "error": e} for u, e in self._changed.items()],
                "waiting_for_space": [{"url": u, "reason": r} for u, r in self._space_waits.items()],
            },
            jobs=jobs_view(self.consumers, self._starved_by()),
        )

    def _starved_by(self) -> str:
        """What a waiting consumer is waiting for: downloads, the workers, or (else) its own reads."""
        if self._demanded:
            return "downloads"
        busy = [w.get("busy", 0.0) for w in self.worker_stats.values()]
        if busy and sum(busy) / len(busy) > 0.8:
            return "workers"
        return "latency"


def _read_list(cfg: AgentConfig) -> UrlList:
    lister = Listing(endpoint_url=cfg.s3_endpoint_url, fetching=True)  # lists s3:// prefixes and globs
    urls = read_url_list(cfg.urls, allow_pipe=cfg.allow_pipe, lister=lister)
    if not len(urls):
        raise ConfigError(f"URL list {cfg.urls} holds no URL")
    if urls.duplicates:
        log.warning("%s: ignored %d duplicate URL(s)", cfg.urls, urls.duplicates)
    return urls


def _stat_signature(path: Path) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)  # follows symlinks, so a swapped ConfigMap link shows
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
