"""The cache commands (``wdscache prefetch``, ``ls``, ``verify``, ``evict``, ``clear``), as a library.

Each one works with or without an agent: with one running, every change goes through its
control socket (:mod:`wdscache.agent.upkeep`), never behind its back, since the agent owns
the index, the pins and the budget; without one, the command holds the cache directory's
lock (an agent starting meanwhile waits for it) and changes the cache itself. ``prefetch``
without an agent runs one in this process for as long as it takes. An agent that runs but does
not answer (busy) is never taken for absent: a change waits a while for it, then fails saying
so; ``ls`` reads the index as it is.

A cache directory that cannot be written (a read-only file system): ``ls`` and ``verify``
read it (``verify`` lists the bad shards it cannot evict), the others refuse it with one line
naming it (:meth:`~wdscache.shared.layout.CacheLayout.check_writable`).

What a command found is returned as plain data (lists and dicts, JSON-ready); the CLI
prints it and turns it into an exit status.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..shared.client import AgentConnection
from ..shared.config import PREFETCH_GIVE_UP_AFTER, AgentConfig, check_count, default, parse_size
from ..shared.errors import (
    AgentUnavailableError,
    ConfigError,
    NoCacheError,
    ProtocolError,
    ShardError,
    UrlListError,
    WdsCacheError,
)
from ..shared.index import ShardState, read_index, read_summary
from ..shared.layout import CacheLayout
from ..shared.logs import get_logger, iso_time
from ..shared.messages import Requests
from ..shared.protocol import pages
from ..shared.redact import redact_urls
from ..shared.stats import ANSWER_TIMEOUT, agent_connection
from ..shared.tarwalk import walk
from ..shared.urls import format_url_list
from .cache import ShardCache
from .lock import AgentLock
from .recovery import fanned_files
from .upkeep import evict_shards

log = get_logger(__name__)

CONNECT_TIMEOUT = 2.0  # seconds to tell whether an agent runs, where its lock cannot tell
REQUEST_TIMEOUT = 30.0
POLL = 0.25  # seconds between prefetch progress reports (each costs what changed since the last)
AGENT_START_TIMEOUT = 60.0

#: (hashlib algorithm, hex digest) a shard's bytes must have, e.g. ("sha256", "9f86d0...").
Checksum = tuple[str, str]


def no_checksum(url: str) -> Checksum | None:
    """The default checksum source of :func:`verify`: none known. A shard index that records
    checksums (a wids index, say) passes its own lookup instead."""
    return None


# -- whether an agent runs --------------------------------------------------------------


def _layout(cache_dir: str | os.PathLike[str]) -> CacheLayout:
    layout = CacheLayout.of(cache_dir)
    if not layout.is_cache():
        raise NoCacheError(cache_dir=str(layout.root), read_only=layout.read_only())
    return layout


def _read_only(layout: CacheLayout) -> bool:
    return layout.read_only() is not None


@contextmanager
def _agent(layout: CacheLayout, *, flush: bool = False, needed: bool = True) -> Iterator[AgentConnection | None]:
    """The running agent's connection (proved with a first request, which with ``flush`` has it write
    the read times and counters it holds to the index), or None when none runs.

    An agent that runs (it holds the directory's lock) gets :data:`ANSWER_TIMEOUT` to answer: a
    busy one (re-reading a huge list) is not taken for absent. If it stays silent, with ``needed``
    (a change, which only it may make while it runs) AgentUnavailableError says so; without, None:
    a read then takes the index as it is. One still starting answers nothing yet: with ``needed``
    a WdsCacheError says so at once; without, None."""
    state = layout.agent_state()
    runs = None if state is None else layout.agent_holds_lock(state["pid"])
    starting = layout.starting_note()
    if starting is not None and needed:  # (it holds the lock: nothing can be done without it either)
        raise WdsCacheError(f"{starting}: try again once it answers (see 'wdscache stats')")
    conn = None
    if runs is not False and starting is None:  # (no reply would come from a dead or starting agent's socket)
        conn = agent_connection(layout, ANSWER_TIMEOUT if runs else CONNECT_TIMEOUT)
    if conn is not None:
        try:
            conn.request(Requests.stats(flush=flush))
        except AgentUnavailableError as exc:  # (an agent of another protocol says so: ProtocolError, raised)
            conn.close()
            conn = None
            if runs and needed and state is not None:
                raise AgentUnavailableError(
                    state["endpoint"],
                    ANSWER_TIMEOUT,
                    f"the agent (pid {state['pid']}) runs on {layout.root} but did not answer: it may be "
                    "busy (see 'wdscache stats'); try again",
                ) from exc
    try:
        yield conn
    finally:
        if conn is not None:
            conn.close()


def _ask(conn: AgentConnection, header: Mapping[str, Any]) -> dict[str, Any]:
    reply = conn.request(header, timeout=REQUEST_TIMEOUT)
    if not reply.get("ok"):
        raise WdsCacheError(f"the agent refused {header['op']!r}: {reply.get('error')}")
    return reply


@contextmanager
def _locked_cache(layout: CacheLayout, who: str) -> Iterator[ShardCache]:
    """The cache opened by this process, under the directory's lock (AgentRunningError if an agent holds it;
    ConfigError if the directory cannot be written)."""
    layout.check_writable(f"'wdscache {who}'")
    with AgentLock(layout.lock_path):
        cache = ShardCache(layout, limit=0, min_free=0)  # only removes: no budget needed
        try:
            yield cache
        finally:
            cache.close()


# -- ls, evict, clear -------------------------------------------------------------------------


def list_shards(cache_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every shard the index knows: {url, state, size, source_size (a gzip'd source's size; None:
    cached as it came), last_read (ISO 8601 or None), reads, samples (None: never counted),
    error (of a failed one)}, by URL. A running agent first writes the read times it holds in
    memory to the index, so a shard read a moment ago shows as read. With no agent running, a
    shard whose download was interrupted (its partial copy kept, resumed at the next start)
    shows as ``partial``, not ``downloading``."""
    layout = _layout(cache_dir)
    with _agent(layout, flush=True, needed=False):
        pass
    state = layout.agent_state()
    return _listed(layout, downloads_run=state is not None and layout.agent_holds_lock(state["pid"]) is not False)


PARTIAL = "partial"  # (ls's state of a download interrupted with its partial copy kept, while no agent runs)


def _listed(layout: CacheLayout, *, downloads_run: bool = True) -> list[dict[str, Any]]:
    """:func:`list_shards` as the index holds them now (``downloads_run``: an agent may be
    downloading the shards the index has as downloading)."""
    index = read_index(layout.index_dir, read_only=_read_only(layout))
    try:
        return [
            {
                "url": r.url,
                "state": r.state.value if downloads_run or r.state is not ShardState.DOWNLOADING else PARTIAL,
                "size": r.size,
                "source_size": r.source_size,
                "last_read": iso_time(r.last_read),
                "reads": r.reads,
                "samples": index.counts.get(r.url),
                "error": r.error,
            }
            for r in sorted(index.records.values(), key=lambda r: r.url)
        ]
    finally:
        index.close()


def evict(cache_dir: str | os.PathLike[str], urls: Sequence[str], *, force: bool = False) -> dict[str, Any]:
    """Evict the cached shards of ``urls`` (see :func:`~wdscache.agent.upkeep.evict_shards` for the result).

    A URL may be given as ``ls`` shows it, redacted, when it shows only one URL the index knows."""
    layout = _layout(cache_dir)
    with _agent(layout, flush=True) as conn:  # (one wait for a busy agent, not one for ls and one here)
        urls = _as_known(layout, urls)
        if conn is not None:
            out: dict[str, Any] = {"evicted": [], "bytes": 0, "refused": [], "absent": []}
            for _, page in pages(list(urls)):
                reply = _ask(conn, Requests.evict(page, force=force))
                for key in out:
                    out[key] += reply[key]
            return out
    with _locked_cache(layout, "evict") as cache:
        return evict_shards(cache, urls, force=force, why="evicted on request")


def _as_known(layout: CacheLayout, urls: Sequence[str]) -> list[str]:
    """``urls``, each shown redacted (:func:`~wdscache.shared.redact.redact_urls`) replaced by the one
    URL of the index it shows; one the index knows, or that shows several, stays as given."""
    known = [s["url"] for s in _listed(layout)]
    shows: dict[str, list[str]] = {}
    for url in known:
        shows.setdefault(redact_urls(url), []).append(url)
    held = set(known)
    return [url if url in held or len(shows.get(url, ())) != 1 else shows[url][0] for url in urls]


def clear(cache_dir: str | os.PathLike[str], *, force: bool = False) -> dict[str, Any]:
    """Evict every cached shard (as :func:`evict`), plus ``agent``: whether an agent ran. A running
    agent then prefetches nothing for its start-up plan until its list changes: it fetches again
    only what readers ask for (:mod:`wdscache.agent.upkeep`)."""
    layout = _layout(cache_dir)
    with _agent(layout) as conn:
        if conn is not None:
            reply = _ask(conn, Requests.clear(force=force))
            return {**{k: reply[k] for k in ("evicted", "bytes", "refused", "absent")}, "agent": True}
    with _locked_cache(layout, "clear") as cache:
        if cache.rebuilt:  # its index unreadable or gone: no file under it can be named, all go
            return {**_remove_unnamed(layout), "agent": False}
        cached = [r.url for r in cache.index.records.values() if r.state is ShardState.CACHED]
        return {**evict_shards(cache, cached, force=force, why="evicted on request"), "agent": False}


def _remove_unnamed(layout: CacheLayout) -> dict[str, Any]:
    """Remove every shard and sample table file (an index that names none of them), and move aside
    whatever else lies where they belong (:func:`~wdscache.agent.recovery.fanned_files`): the result
    of :func:`evict_shards`, with the shard files' paths for URLs (their tables' bytes freed too)."""
    removed, freed = [], 0
    for folder in (layout.shards_dir, layout.tables_dir):
        for path in list(fanned_files(layout, folder)):
            freed += path.stat().st_size
            path.unlink()
            if folder == layout.shards_dir:
                removed.append(str(path))
    log.info("removed %d files of %s (%d bytes): its index named none of them", len(removed), layout.root, freed)
    return {"evicted": removed, "bytes": freed, "refused": [], "absent": []}


# -- verify -----------------------------------------------------------------------------------


def shard_problem(path: Path, url: str, size: int, checksum: Checksum | None) -> str | None:
    """What is wrong with the cached file of ``url`` (expected ``size`` bytes), or None: its size,
    its tar structure (every header walked), and ``checksum`` if one is known."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return "its file is missing"
    if actual != size:
        return f"its file has {actual} bytes, the index says {size}"
    try:
        with open(path, "rb") as f:
            if actual == 0:
                raise ShardError(url, "empty file, not a tar archive", offset=0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                with memoryview(m) as view:  # released before the map closes
                    for _ in walk(view, url):
                        pass
                if checksum is not None:
                    algorithm, expected = checksum
                    digest = hashlib.new(algorithm, m).hexdigest()
                    if digest != expected.lower():
                        return f"its {algorithm} is {digest}, its index says {expected}"
    except ShardError as exc:
        return f"not a valid tar: {exc}"
    except ValueError as exc:  # an unknown hash algorithm
        return f"cannot check its checksum: {exc}"
    return None


def verify(
    cache_dir: str | os.PathLike[str], *, checksum_of: Callable[[str], Checksum | None] = no_checksum
) -> dict[str, Any]:
    """Re-check every cached shard (:func:`shard_problem`) and evict the bad ones:
    {checked, bad: [{url, problem}], evicted: [url], refused: [{url, reason}] (held by a reader, or
    the directory cannot be written)}."""
    checked, bad = 0, []
    layout = _layout(cache_dir)
    with _agent(layout) as conn:
        if conn is None and layout.read_only() is None:
            with _locked_cache(layout, "verify") as cache:  # opened once: files named by an earlier version are renamed
                if cache.rebuilt:
                    raise WdsCacheError(
                        f"the index of {layout.root} was unreadable or gone (a new one is started; a damaged one "
                        "is kept as index.corrupt-*), so no shard file there can be named: the next agent names "
                        "them again from its URL list as it starts; verify after that, or clear the cache"
                    )
    for shard in list_shards(cache_dir):
        if shard["state"] != "cached":
            continue
        checked += 1
        # A checksum is of the source's bytes: a gzip'd source is cached as the tar inside it.
        checksum = checksum_of(shard["url"]) if shard["source_size"] is None else None
        problem = shard_problem(_cached_file(layout, shard["url"]), shard["url"], shard["size"], checksum)
        if problem is not None:
            bad.append({"url": shard["url"], "problem": problem})
    why = layout.read_only()
    if bad and why is not None:
        refused = [{"url": b["url"], "reason": f"the cache directory {why}"} for b in bad]
        return {"checked": checked, "bad": bad, "evicted": [], "refused": refused}
    evicted = evict(cache_dir, [b["url"] for b in bad]) if bad else {"evicted": [], "refused": []}
    return {"checked": checked, "bad": bad, "evicted": evicted["evicted"], "refused": evicted["refused"]}


def _cached_file(layout: CacheLayout, url: str) -> Path:
    """Where ``url``'s cached copy is: under the name an earlier version gave it, on a read-only
    cache no agent has opened since (its files cannot be renamed)."""
    path = layout.shard_path(url)
    if path.exists():
        return path
    return next((former for former in layout.former_shard_paths(url) if former.exists()), path)


# -- prefetch -----------------------------------------------------------------------------------


@dataclass
class PrefetchProgress:
    """Where a prefetch stands: shards and bytes done of all, the rate since it began."""

    total: int
    cached: int = 0  # shards cached now (one cached, then evicted for a reader, is failed)
    failed: dict[str, str] = field(default_factory=dict)  # url -> why
    bytes_done: int = 0  # bytes of the shards cached (and of those downloading, so far)
    bytes_total: int | None = None  # None while some shard's size is unknown
    rate: float = 0.0  # bytes a second fetched by this prefetch
    finished: list[str] = field(default_factory=list)  # shards cached or failed since the last report

    @property
    def done(self) -> bool:
        return self.cached + len(self.failed) >= self.total

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate (None: not known)."""
        if self.bytes_total is None or self.rate <= 0:
            return None
        return max(0.0, (self.bytes_total - self.bytes_done) / self.rate)


def prefetch(
    cache_dir: str | os.PathLike[str],
    urls: Sequence[str],
    *,
    report: Callable[[PrefetchProgress], None],
    cache_size: str | None = None,
    min_free: str | None = None,
    download_workers: int | None = None,
    give_up_after: float = PREFETCH_GIVE_UP_AFTER,
    s3_endpoint_url: str | None = None,
) -> PrefetchProgress:
    """Fetch ``urls`` into the cache: through the running agent, else through one run in this process
    (with ``cache_size`` and ``min_free``, default the last agent's, ``download_workers`` and
    ``s3_endpoint_url``) until done, or
    until downloads wait for space ``give_up_after`` seconds with no progress (the rest then fail).

    Each shard is downloaded at most once, and never evicted for another of ``urls``: once the
    budget (less what readers hold) is full of them, the rest fail with a reason naming it
    (:mod:`wdscache.agent.prefetches`). ``report`` is called with the progress about every
    :data:`POLL` seconds; the last one is returned, its ``cached`` the shards cached at the end.

    Raises :class:`ConfigError` for a ``cache_size``, ``min_free`` or ``download_workers`` the agent
    would refuse, whether or not an agent runs (a running one does not use them)."""
    if cache_size is not None:
        parse_size(cache_size, total=1, what="--cache-size")  # the syntax; a percentage is resolved at start
    if min_free is not None:
        parse_size(min_free, total=1, what="--min-free")
    if download_workers is not None:
        check_count("download_workers", download_workers)
    if math.isnan(give_up_after):
        raise ConfigError(f"--give-up-after {give_up_after}: use a number of seconds")
    layout = CacheLayout.of(cache_dir)
    if layout.is_cache():
        with _agent(layout) as conn:
            if conn is not None:
                return _prefetch_through(conn, urls, report, give_up_after)
    with _own_agent(layout, urls, cache_size, min_free, download_workers, s3_endpoint_url) as conn:
        return _prefetch_through(conn, urls, report, give_up_after)


@contextmanager
def _own_agent(
    layout: CacheLayout,
    urls: Sequence[str],
    cache_size: str | None,
    min_free: str | None,
    download_workers: int | None,
    s3_endpoint_url: str | None,
) -> Iterator[AgentConnection]:
    """An agent run in this process (a thread) on ``layout``, for a prefetch; stopped at the end.
    Its budget and free space kept are the last agent's unless given (else the agent's defaults)."""
    from .core import Agent

    layout.check_writable("'wdscache prefetch'")
    need_last = (cache_size is None or min_free is None) and layout.is_cache()
    last = read_summary(layout.index_dir)[2] if need_last else {}
    if cache_size is None:
        limit = last.get("bytes_limit")
        cache_size = str(limit) if isinstance(limit, int) and limit > 0 else default("cache_size")
    if min_free is None:
        kept = last.get("min_free")
        min_free = str(kept) if isinstance(kept, int) and kept >= 0 else default("min_free")
    with tempfile.TemporaryDirectory(prefix="wdscache-prefetch-") as folder:
        list_file = Path(folder) / "urls.txt"
        list_file.write_text(format_url_list(urls))  # its list: what it may fetch (the prefetch op says when)
        agent = Agent(
            AgentConfig(
                cache_dir=layout.root,
                urls=list_file,
                cache_size=cache_size,
                min_free=min_free,
                prefetch=1,
                workers=1,
                shuffle=False,
                startup_prefetch=False,  # the prefetch op says what to fetch: no shard twice, nor one not asked
                s3_endpoint_url=s3_endpoint_url,
                download_workers=default("download_workers") if download_workers is None else download_workers,
            )
        )
        failure: list[BaseException] = []

        def run() -> None:
            try:
                agent.run()
            except BaseException as exc:  # told to the waiting thread
                failure.append(exc)

        thread = threading.Thread(target=run, name="prefetch-agent", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + AGENT_START_TIMEOUT
            while True:
                if failure:
                    raise _as_given(failure[0], list_file)
                conn = agent_connection(layout, CONNECT_TIMEOUT) if layout.state_path.exists() else None
                if conn is not None:
                    try:
                        conn.request(Requests.stats())
                        break
                    except (AgentUnavailableError, ProtocolError):
                        conn.close()
                if time.monotonic() > deadline:
                    raise AgentUnavailableError(str(layout.root), AGENT_START_TIMEOUT, "the prefetch's own agent")
                time.sleep(0.05)
            try:
                yield conn
            finally:
                conn.close()
        finally:
            agent.stop()
            thread.join(REQUEST_TIMEOUT)
        if failure:
            raise _as_given(failure[0], list_file)


def _as_given(exc: BaseException, list_file: Path) -> BaseException:
    """``exc``, a line of the prefetch's own list file (a temporary file the user never wrote)
    named as the command line's."""
    if isinstance(exc, UrlListError) and exc.path == str(list_file):
        return UrlListError("the command line", exc.lineno, exc.line, exc.reason)
    return exc


def _prefetch_through(
    conn: AgentConnection, urls: Sequence[str], report: Callable[[PrefetchProgress], None], give_up_after: float
) -> PrefetchProgress:
    """Hand ``urls`` to the agent as one prefetch, follow it to its end, then end it there."""
    urls = list(dict.fromkeys(urls))
    name = secrets.token_hex(8)
    for _, page in pages(urls):
        _ask(conn, Requests.prefetch(name, page, retry=True))
    try:
        progress = _follow(conn, name, urls, report, give_up_after)
    except WdsCacheError:
        _end(conn, name)
        raise
    _end(conn, name)
    return progress


def _end(conn: AgentConnection, name: str) -> None:
    """End prefetch ``name`` in the agent (which ends a silent one by itself, should this fail)."""
    try:
        _ask(conn, Requests.prefetch_end(name))
    except WdsCacheError as exc:
        log.warning("could not end the prefetch in the agent: %s", exc)


def _follow(
    conn: AgentConnection, name: str, urls: list[str], report: Callable[[PrefetchProgress], None], give_up_after: float
) -> PrefetchProgress:
    """Poll prefetch ``name`` until every shard is cached or failed (each poll costs the shards that
    changed since the last), or until its downloads wait for space ``give_up_after`` seconds
    with no progress (the rest then fail)."""
    start = time.monotonic()
    progress = PrefetchProgress(total=len(urls))
    cached: set[str] = set()  # the shards cached, as far as the changes told
    base: int | None = None  # bytes done at the start (shards cached already)
    stuck_since = start
    last_mark: tuple[int, int] = (-1, -1)
    while True:
        progress.finished = []
        while True:
            reply = _ask(conn, Requests.prefetch_status(name))
            for change in reply["changes"]:
                url = change["url"]
                if change["state"] == "cached":
                    cached.add(url)
                    progress.failed.pop(url, None)
                else:
                    cached.discard(url)
                    progress.failed[url] = change.get("error") or "failed"
                progress.finished.append(url)
            if not reply["more"]:
                break
        progress.cached = reply["cached"]
        progress.bytes_done = reply["bytes_cached"] + reply["bytes_written"]
        progress.bytes_total = reply["bytes_total"]
        now = time.monotonic()
        if base is None:
            base = progress.bytes_done
        progress.rate = (progress.bytes_done - base) / (now - start) if now > start else 0.0
        # No progress while downloads wait for space: the budget is full of what readers hold, and stays so.
        waiting = reply["waiting_for_space"]
        mark = (progress.bytes_done, progress.cached + len(progress.failed))
        if mark != last_mark or not waiting:
            last_mark, stuck_since = mark, now
        elif now - stuck_since >= give_up_after:
            for url in urls:
                if url not in cached and url not in progress.failed:
                    progress.failed[url] = f"{waiting} (given up after {give_up_after:g} s without progress)"
                    progress.finished.append(url)
        report(progress)
        if progress.done:
            return progress
        time.sleep(POLL)
