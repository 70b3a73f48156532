"""The agent's start-up: taking the cache directory, and opening the cache on it.

:func:`take_cache_dir` takes the cache directory (its lock), starts the worker processes,
opens the cache (recovered, shrunk to the budget, the budget checked against the start-up
window's shards), the mailbox, the control socket and the metrics server, while the list is
read in another thread (a million lines take a second or two): the worker processes start
meanwhile, and the list is needed only once the cache opens.

Guarantees:

- A start that fails leaves the cache directory as it was: a bad line of the list, a budget
  refused, a socket in use, anything; what it took (lock, workers, cache, mailbox, socket) is
  given back in reverse order, the lock last, and what it made in the directory (lock file,
  token, index, folders; the directory itself) is removed (:meth:`CacheLayout.undo_start`).
- Every file and socket the agent makes from here on is private to its user (umask 077).
- The soft limit on open files is raised to the hard one before the workers start (they inherit
  it), and a limit lower than the work may need (:func:`open_files_wanted`) is warned about, naming
  it and how to raise it: downloads leave the last files to connections
  (:mod:`wdscache.agent.downloads`), but a process with no file for a connection made to its
  ``ipc://`` endpoint is ended by ZeroMQ, and too many consumers can take them all.
- The start-up window's sizes are asked of their sources for at most the time an answer may take
  to begin (``Settings.answer_timeout``: the connect timeout, 10 s, and ``--read-timeout``), and
  no longer once the agent is told to stop: a size not known by then is unknown, as one a server
  does not give (a failed HEAD, a timed-out one); a start that has unknown sizes says so, in a
  warning naming one such URL and why (redacted, as every log line).
- A list that cannot be read (a hung mount) does not keep the agent from stopping: once told to,
  the start ends (:class:`StoppedStarting`) without waiting for it, its reading thread a daemon.
- From the moment it holds the lock the agent says it is starting, and what it is doing
  (a :class:`StartStep`, through the ``doing`` its caller gives: agent.json, which ``wdscache
  stats`` and loaders read), so that a start that takes a while (a long list, many cached shards,
  slow sources) shows as one, never as no agent; a start that fails removes what it said.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from enum import Enum

from ..shared.config import AgentConfig, format_size, parse_size
from ..shared.errors import AgentRunningError, ConfigError
from ..shared.layout import CacheLayout
from ..shared.logs import get_logger
from ..shared.protocol import still_runs
from ..shared.urls import UrlList
from .cache import INDEX_HEADROOM, ShardCache
from .control import ControlSocket
from .downloads import files_per_download
from .events import Mailbox
from .fetch import Fetcher
from .lock import AgentLock
from .metrics import MetricsServer
from .pool import WorkerPool, check_endpoints
from .readers import startup_reader
from .shard_download import Fetched, Gone, Unknown

log = get_logger(__name__)

# Open files an agent's processes need whatever the consumers: its workers' shards, downloads
# in flight, sockets of its own, logs, the index. Each consumer (each DataLoader worker of each
# rank) adds a connection to the agent and one to every worker: CONSUMERS of them are allowed for.
OWN_FILES = 256
CONSUMERS = 512
PROBE_THREADS = 16  # the start-up window's sizes asked of their sources at once
LOOK_EVERY = 0.25  # seconds between looks at the stop flag while sizes are asked
# Seconds a start waits for an agent still running on the directory whose lock file was removed
# under it (it stops at its next look, within FLUSH_EVERY and its shutdown), and between looks.
UNLOCKED_GRACE = 20.0
UNLOCKED_LOOK = 0.05


class StartStep(Enum):
    """What a starting agent is doing, as ``wdscache stats`` shows it (``starting: ...``)."""

    LIST = "reading the URL list"
    CACHE = "checking the cached shards"
    SIZES = "asking sources for the first shards' sizes"
    WORKERS = "waiting for its sample workers"


class StoppedStarting(Exception):
    """The agent was told to stop before its start was done: it stops, having started nothing."""


def in_thread(read: Callable[[], UrlList]) -> Future[UrlList]:
    """What ``read`` returns (or raises), got in a daemon thread: one hung on a mount must not
    keep the stopped agent from exiting, as an executor's thread would (it is joined at exit)."""
    listed: Future[UrlList] = Future()

    def run() -> None:
        try:
            listed.set_result(read())
        except BaseException as exc:  # raised by the .result() of whoever waits for it
            listed.set_exception(exc)

    threading.Thread(target=run, name="list", daemon=True).start()
    return listed


def _wait_list(listed: Future[UrlList], stop: threading.Event) -> UrlList:
    """The list ``listed`` gives, or :class:`StoppedStarting` once ``stop`` is set before it came."""
    while not wait([listed], timeout=LOOK_EVERY).done:
        if stop.is_set():
            raise StoppedStarting("stopped before the URL list was read")
    return listed.result()


@dataclass(frozen=True)
class Taken:
    """What a start took: the list, the cache directory's stat, and the open parts."""

    urls: UrlList
    root: os.stat_result
    pool: WorkerPool
    cache: ShardCache
    mailbox: Mailbox
    socket: ControlSocket
    metrics: MetricsServer | None


def open_files_wanted(cfg: AgentConfig) -> int:
    """Open files the agent's busiest process may need: those of each download (its partial file,
    a connection and a file for each part; as many downloads again for shards readers wait for),
    and CONSUMERS consumers' connections."""
    return OWN_FILES + 2 * cfg.download_workers * files_per_download(cfg.download_parts) + CONSUMERS


def raise_open_files(cfg: AgentConfig) -> int:
    """Raise the soft limit on open files (``ulimit -n``) to the hard one, for this process and the
    workers it starts; warn if even that is below :func:`open_files_wanted`. The limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a hard limit the kernel caps lower (macOS's unlimited)
            log.debug("the open files limit stays %d: %s", soft, exc)
    wanted = open_files_wanted(cfg)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "the limit on open files is %d (ulimit -n; hard limit %s), below what %d consumers and these "
            "downloads may take: downloads wait rather than take the last files, kept for connections, but a "
            "process (the agent, or a sample worker) left with no file for a consumer's connection is ended "
            "by ZeroMQ and restarted (the agent by its supervisor); raise ulimit -n, or LimitNOFILE= in a "
            "systemd unit, to %d or more",
            soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard,
            CONSUMERS,
            wanted,
        )
    return soft


def take_cache_dir(
    cfg: AgentConfig,
    layout: CacheLayout,
    lock: AgentLock,
    fetcher: Fetcher,
    listed: Future[UrlList],
    endpoint: str,
    run: str,
    stop: threading.Event,
    doing: Callable[[StartStep], None],
) -> Taken:
    """Take the cache directory of ``layout``, start the workers and open the cache, with the
    list being read meanwhile (``listed``), saying each step with ``doing`` (it writes agent.json)
    once the lock is held. Whatever fails (a bad line of the list too) undoes what this start did
    there (agent.json removed), the lock released last. Once ``stop`` is set, a list still being
    read is not waited for (:class:`StoppedStarting`), nor sizes still asked of sources (the start
    ends soon, for the agent to stop). The limit on open files is raised first (:func:`raise_open_files`)."""
    raise_open_files(cfg)
    made = layout.prepare()
    root = os.stat(layout.root)
    os.umask(0o077)  # every file and socket we create is private to this user
    before = set(os.listdir(layout.root))
    with contextlib.ExitStack() as undo:
        lock.acquire()
        undo.callback(lock.release)
        _await_unlocked_agent(layout, stop)
        # Undone with the lock still held, after everything below: a directory that was
        # empty is left empty (and one this start made, gone).
        undo.callback(layout.undo_start, before, made)
        # Ours now, whatever an agent that died left there: removed by a start that fails.
        undo.callback(layout.state_path.unlink, missing_ok=True)
        doing(StartStep.LIST)
        token = layout.ensure_token()
        # Worker processes take a while to start: they do so while the list is read and
        # the cache is opened.
        pool = WorkerPool(
            n=cfg.workers,
            agent_endpoint=endpoint,
            cache_dir=str(layout.root),
            token=token,
            run=run,
            log_format=cfg.log_format,
        )
        check_endpoints(endpoint, pool.endpoints)
        pool.start()
        undo.callback(pool.stop)
        urls = _wait_list(listed, stop)
        doing(StartStep.CACHE)
        cache = _open_cache(layout, lock, cfg, urls, fetcher, stop, doing)
        undo.callback(cache.close)
        mailbox = Mailbox()
        undo.callback(mailbox.close)
        socket = ControlSocket(endpoint, token=token, run=run)
        undo.callback(socket.close)
        metrics = None if cfg.metrics_port is None else MetricsServer(cfg.metrics_host, cfg.metrics_port)
        undo.pop_all()
    return Taken(urls, root, pool, cache, mailbox, socket, metrics)


def _await_unlocked_agent(layout: CacheLayout, stop: threading.Event) -> None:
    """Wait for the agent agent.json names to be gone, should it still run here though we hold the
    lock: a cleaner of old files removed its lock file (we locked a new one), and it stops once it
    finds so (at its next flush, every few seconds: :meth:`ShardCache.lost`). Until then it may
    still write at the cache's paths. AgentRunningError if it runs on past :data:`UNLOCKED_GRACE`
    (a wdscache that does not look), :class:`StoppedStarting` once ``stop`` is set."""
    state = layout.agent_state()
    if state is None or state["pid"] == os.getpid() or state.get("process") is None:
        return
    deadline = time.monotonic() + UNLOCKED_GRACE
    said = False
    # That very process, not its pid reused; not a zombie either (killed, its parent has not
    # reaped it yet: its lock and files are gone with it, and it writes nothing more).
    while still_runs(state["process"]):
        if time.monotonic() >= deadline:
            raise AgentRunningError(str(layout.root), state["pid"])
        if not said:
            log.warning(
                "the agent (pid %d) on %s still runs though its lock file was removed under it: "
                "waiting for it to stop (for at most %.0fs)",
                state["pid"],
                layout.root,
                UNLOCKED_GRACE,
            )
            said = True
        if stop.wait(UNLOCKED_LOOK):
            raise StoppedStarting("stopped while the agent before still ran")


def _open_cache(
    layout: CacheLayout,
    lock: AgentLock,
    cfg: AgentConfig,
    urls: UrlList,
    fetcher: Fetcher,
    stop: threading.Event,
    doing: Callable[[StartStep], None],
) -> ShardCache:
    """Open the cache: recover it, shrink it to the budget, check the budget can hold a window."""
    st = os.statvfs(layout.root)
    fs_total = st.f_blocks * st.f_frsize
    limit = parse_size(cfg.cache_size, total=fs_total, what="--cache-size")
    min_free = parse_size(cfg.min_free, total=fs_total, what="--min-free")
    cache = ShardCache(layout, limit=limit, min_free=min_free, lock=lock)
    try:
        window = startup_reader(len(urls), cfg).window(cfg.prefetch) if cfg.startup_prefetch else []
        first = [urls.urls[i] for i in window]
        # Partials with a validator are resumed whichever shard they are, a job's own list's too
        # (they count against the budget; wdscache.agent.unnamed_partials removes those nobody names).
        recovered = cache.recover()
        if cache.rebuilt or cache.index.unreadable:  # (files the index does not name: see recovery.open_index)
            recovered["adopted"] += cache.adopt(urls.urls)
        if any(recovered.values()):
            log.info("recovered the cache: %s", ", ".join(f"{k} {v}" for k, v in recovered.items() if v))
        # A budget refused leaves the cache as it was: checked before it shrinks to it.
        probe = functools.partial(_probe_sizes, cache, fetcher, first, stop, doing)
        _check_budget(cache, cfg.prefetch, min(cfg.prefetch + 1, len(urls)), probe, fs_total)
        cache.shrink(first)  # restarted with a smaller --cache-size: to it before anything else
        cache.index.set_meta(
            {"bytes_limit": limit, "min_free": min_free, "prefetch": cfg.prefetch, "urls": str(cfg.urls)}
        )
    except BaseException:
        cache.close()
        raise
    return cache


def _check_budget(
    cache: ShardCache, prefetch: int, need_shards: int, probe: Callable[[], list[int]], fs_total: int
) -> None:
    """Refuse a budget that can never hold a reader's window of the largest shards we know of
    (the start-up window's sizes ``probe`` gives, 0 for one not known, asked only of a budget that
    can hold any shard; a reader holds ``need_shards`` at once).

    What can ever be used is the smaller of --cache-size and the file system's size
    less --min-free and the index's headroom. Free space taken by other files may
    come back, so too little of it now is a warning, not a refusal.
    """
    room = fs_total - cache.margin  # the most the file system can ever give to shards
    usable = min(cache.limit, room)
    where = (
        f"the file system of {cache.layout.root} is {format_size(fs_total)} in all, --min-free "
        f"{format_size(cache.min_free)} (+{format_size(INDEX_HEADROOM)} for the index) must stay free, "
        f"--cache-size {format_size(cache.limit)}"
    )
    if usable <= 0:
        fix = "give --cache-size a size above 0" if cache.limit <= 0 else "lower --min-free or use a larger file system"
        raise ConfigError(f"no shard can ever be cached: {where}; {fix}")
    sizes = [s for s in probe() if s]
    if not sizes:
        return
    need = need_shards * max(sizes)
    window = (
        f"shards here are up to {format_size(max(sizes))} and a reader needs {need_shards} of them "
        f"on disk (the one it reads and {need_shards - 1} ahead)"
    )
    if need > cache.limit:
        raise ConfigError(
            f"--cache-size {format_size(cache.limit)} is too small for --prefetch "
            f"{prefetch}: {window}; the smallest budget that works is {need} bytes "
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
        log.warning(
            "only %s of the file system can hold shards now (%s free, --min-free %s): %s, %s; "
            "downloads wait for space until other files make room",
            format_size(max(0, free)),
            format_size(cache.fs_free()),
            format_size(cache.min_free),
            window,
            format_size(need),
        )


def _probe_sizes(
    cache: ShardCache,
    fetcher: Fetcher,
    urls: list[str],
    stop: threading.Event,
    doing: Callable[[StartStep], None],
) -> list[int]:
    """The size of each of ``urls`` (0: unknown): the index's, else its source's (a HEAD, or a
    stat), all asked at once (a start waits for the slowest answer, not for the sum of them), for
    at most an answer's time and until ``stop`` is set (see the module's guarantees)."""
    known = {u: rec.size for u in urls if (rec := cache.index.get(u)) is not None and rec.size}
    ask = [u for u in urls if u not in known and fetcher.describes(u)]  # (a pipe's command tells none: not asked)
    if ask:
        doing(StartStep.SIZES)
        known.update(_ask_sizes(fetcher, ask, len(urls), stop))
    return [known.get(u, 0) for u in urls]


def _ask_sizes(fetcher: Fetcher, urls: list[str], window: int, stop: threading.Event) -> dict[str, int]:
    """The sizes of ``urls`` (of the ``window`` first shards) their sources give within
    ``fetcher.settings.answer_timeout``, asked in up to ``PROBE_THREADS`` threads; none more once
    ``stop`` is set. One not given (no answer in time, or one without a size: a failed HEAD, a
    404) is left out, and warned about. The threads are daemons: one still waiting for its
    source (a hung mount, say) is left to end by itself, and never holds the agent's exit."""
    todo: deque[str] = deque(urls)
    got: dict[str, Fetched | Gone | Unknown] = {}
    lock, done = threading.Lock(), threading.Event()

    def ask() -> None:
        while True:
            with lock:
                if not todo:
                    return
                url = todo.popleft()
            answer = _describe(fetcher, url)
            with lock:
                got[url] = answer
                if len(got) == len(urls):
                    done.set()

    seconds = fetcher.settings.answer_timeout
    # (a silent source holds the start this long: said now, not only once it is over)
    log.info(
        "asking the sources of %d of the first %d shards for their sizes, for at most %gs "
        "(the connect timeout + --read-timeout)",
        len(urls),
        window,
        seconds,
    )
    for i in range(min(len(urls), PROBE_THREADS)):
        threading.Thread(target=ask, name=f"probe-{i}", daemon=True).start()
    deadline = time.monotonic() + seconds
    while not done.wait(max(0.0, min(LOOK_EVERY, deadline - time.monotonic()))):
        if stop.is_set() or time.monotonic() >= deadline:
            break
    with lock:
        todo.clear()  # (a thread still asking asks no more)
        answers = dict(got)
    unknown = {}
    for url in urls:
        answer = answers.get(url)
        if not isinstance(answer, Fetched):
            unknown[url] = _why_unknown(answer, seconds)
    if unknown and not stop.is_set():
        url, why = next(iter(unknown.items()))
        log.warning(
            "%d of the first %d shards' sizes not known (the budget is checked against the others): "
            "a slow, unreachable or failing source? e.g. %s: %s",
            len(unknown),
            window,
            url,
            why,
        )
    return {u: a.size for u, a in answers.items() if isinstance(a, Fetched)}


def _why_unknown(answer: Gone | Unknown | None, seconds: float) -> str:
    """Why a size is not known: its source's answer without one, or none within ``seconds``."""
    if answer is None:
        return f"no answer within {seconds:g}s (the connect timeout + --read-timeout)"
    return answer.reason


def _describe(fetcher: Fetcher, url: str) -> Fetched | Gone | Unknown:
    try:
        return fetcher.describe(url)
    finally:
        fetcher.close_thread()  # a probe thread may ask again: no session lingers past its answer
