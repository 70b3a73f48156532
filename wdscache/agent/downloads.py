"""The agent's downloads: which shards download now, their threads, their budget, their ends.

Guarantees (threads):

- The main loop alone starts, cancels and ends downloads and changes every
  attribute here. Download threads (``2 * --download-workers`` of them) take a
  :class:`~wdscache.agent.shard_download.Download` from the task queue, move its bytes, ask for
  budget through :meth:`Downloads.reserve` (which blocks the thread, never the
  loop), and post what happened to the :class:`~wdscache.agent.events.Mailbox`.
  A download in parallel parts (:mod:`wdscache.agent.parts`) runs its extra
  connections in threads of its own, within its slot: ``--download-parts`` is per
  shard, ``--download-workers`` counts shards.
- A shard is never downloaded by two threads at once: its record
  (:class:`~wdscache.agent.shards.Shard`) holds a :class:`~wdscache.agent.shards.Slot` from
  the moment its task is queued until the main loop has recorded its end. What the policy
  notes of a download (out of every window since when, why it waits for space) is in its
  slot, and goes with it.
- Nothing outside the wanted shards (demanded ones, then the union of readers'
  windows) is started. Bytes cross the network once: a download is cancelled
  only after its shard has been out of every window for ``CANCEL_AFTER``
  seconds, or when a shard a reader waits for needs its slot; a cancelled
  download with a validator keeps its partial file and resumes from it.
- Budget is granted by the main loop in order of urgency, and a download only prefetches
  want never evicts a shard a prefetch holds: :mod:`wdscache.agent.grants` says how. A
  download cancelled there to break a growth deadlock starts again only once another
  download has ended; until then, only shards a reader waits for start.
- A full file system (a write of a shard or of the index refused) pauses every start for
  ``DISK_FULL_PAUSE`` after the last refusal; while paused, or while a shard a reader waits for
  waits for space below ``--min-free``, stats say the disk is short (:meth:`Downloads.disk`),
  with the file system's free bytes and the refusal.
- A download that finds no file to spare (EMFILE, ENFILE: for a connection, its partial file, a
  part's file) meets the agent's fault, never its shard's: the shard is never failed nor recorded
  failed for it. Its thread waits, keeping its slot and its partial file, and tries it again
  (from where its partial file ends) after a backoff (``FILES_BACKOFF``: 0.5 s, doubled each time
  in a row, at most 5 s: files come free as connections close, or once the limit is raised). Stats and a waiting reader's status say so (:meth:`Downloads.out_of_files`,
  :meth:`Downloads.progress`), and the log, at most once every ``FILES_LOG_EVERY``.
- The agent's last open files are kept for connections (``FILES_RESERVE``, at most a quarter of
  the limit): ZeroMQ ends the whole process when it cannot accept a connection on an ``ipc://``
  endpoint for want of a file (libzmq 4.3's ``ipc_listener`` aborts), so downloads must not use
  them up. A download attempt claims the files it may open (:func:`files_per_download`) before it
  starts (:class:`FileClaims`): of ``--download-parts`` parts, or of as many as the files free,
  less those claimed by the attempts under way, leave room for beside the reserve (down to one
  part, 3 files: its ``progress.parts``), so that
  a download never waits for files a download of fewer parts would find. Only when not even one
  part fits does it wait as one out of files does, its stats and log saying the files are held
  back (:class:`FilesHeldBack`), not that a file could not be opened; with no download under way,
  that the limit is too low for even one download. Its claim is let go when it ends. A download
  thread holds no kept connection while it waits for files, nor, while files are short, while it
  waits for a task. Connections alone (more consumers than the limit allows), or a limit lowered
  from outside, can still use up the reserve.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from ..shared.config import AgentConfig, format_size
from ..shared.errors import FetchError, files_free, out_of_files
from ..shared.index import ShardRecord, ShardState
from ..shared.logs import event, get_logger
from ..shared.shard_index import ShardInfo, file_facts
from .cache import ShardCache
from .churn_log import Churn
from .events import (
    BudgetAsked,
    DownloadCancelled,
    Downloaded,
    DownloadFailed,
    Event,
    Grant,
    Mailbox,
    OutOfSpace,
    Revalidated,
    ValidatorFound,
)
from .fetch import Fetcher
from .grants import NO_HOLD, Grants, NoRoom, PrefetchHold
from .shard_download import Backoff, Budget, Cancelled, DiskFull, Download, Fetched, Progress
from .shards import Shards
from .validators import common_validator, etag_md5

log = get_logger(__name__)

RATE_WINDOW = 10.0  # seconds over which download_rate is averaged
DISK_FULL_PAUSE = 2.0  # after ENOSPC, no new download starts for this long
# A download out of every window this long is cancelled (windows flicker as readers
# come, go and say hello; each flicker must not cost a download).
CANCEL_AFTER = 3.0
JOIN_TIMEOUT = 5.0  # seconds the download threads get to end at shutdown
# A download out of open files is tried again after this long, doubled each time in a row, at most the max.
FILES_BACKOFF = Backoff(0, 0.5, 5.0)
FILES_LOG_EVERY = 60.0  # downloads out of open files are logged (as warnings) at most this often
FILES_RESERVE = 64  # open files kept for connections (at most a quarter of the limit): see the module
IDLE_CHECK = 1.0  # how often an idle download thread looks whether files are short (then closes its connections)


class DiskShort(enum.Enum):
    """Why downloads wait for the cache's file system (stats' ``agent.disk.short``)."""

    FULL = "full"  # it refused a write (of a shard, or of the index): starts are paused
    MIN_FREE = "min_free"  # a shard a reader waits for waits for space: less than --min-free is free


class DiskRoom:
    """The cache's file system as downloads meet it: a write it refused (of a shard, or of the
    index) starts no download for ``DISK_FULL_PAUSE`` after it; stats say so (:meth:`view`)."""

    def __init__(self, cache: ShardCache, shards: Shards) -> None:
        self._cache, self._shards = cache, shards
        self._until = 0.0  # time.monotonic() of the pause's end
        self._error = ""  # the write refused last

    def pause(self, error: str) -> None:
        """Start no download for a while: the file system refused ``error``."""
        self._until, self._error = time.monotonic() + DISK_FULL_PAUSE, error

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._until

    def waits(self, waited_for: Collection[str]) -> list[dict[str, str]]:
        """While paused, the shards readers wait for (``waited_for``) that no download has yet, each with why."""
        if not self.paused:
            return []
        reason = (
            f"waiting for space: the file system refused a write ({self._error}); no download starts until it has room"
        )
        return [{"url": url, "reason": reason} for url in waited_for if self._shards.slot(url) is None]

    def view(self) -> dict[str, Any]:
        """Its free bytes, ``--min-free``, and whether downloads wait for it (``short``, a
        :class:`DiskShort` value, and ``error``: the write it refused, or why the shard waited for
        waits for space), else ``short`` null."""
        short: DiskShort | None = None
        error: str | None = None
        if self.paused:
            short, error = DiskShort.FULL, self._error
        else:
            for slot in self._shards.slots():
                if slot.download.demanded and slot.space.kind == "min-free":
                    short, error = DiskShort.MIN_FREE, slot.space.reason
                    break
        return {
            "free_bytes": self._cache.fs_free(),
            "min_free": self._cache.min_free,
            "short": None if short is None else short.value,
            "error": error,
        }


def files_reserve(limit: int) -> int:
    """The open files kept for connections under a limit of ``limit`` (see the module)."""
    return min(FILES_RESERVE, limit // 4)


def files_per_download(parts: int) -> int:
    """The most open files one download attempt of up to ``parts`` parts holds at once: a connection
    and a file for each part (the first part's is the partial file, the others' their side files),
    and one more (a side file is appended to the partial file through a second descriptor)."""
    return 1 + 2 * parts


class FilesHeldBack(Exception):
    """A download attempt was not started: the files it may open would eat into those kept for
    connections (see the module). The message says how many are free, and what to do."""


class FileClaims:
    """The open files download attempts under way may open (their claims), and the test each
    attempt passes before it starts (:meth:`claim`); thread-safe.

    A claim counts an attempt's files whether it has opened them yet or not: those it holds are
    counted in the files not free too, which errs on the side of connections (fewer downloads at
    once when files are short, never fewer files than the reserve)."""

    def __init__(self, parts: int) -> None:
        self.parts = parts  # --download-parts: the most one attempt fetches at once
        self._lock = threading.Lock()
        self._claimed = 0  # files claimed by the attempts under way

    @contextlib.contextmanager
    def claim(self) -> Iterator[int]:
        """Claim the files of an attempt of as many parts (up to ``parts``) as the files free,
        less those claimed, leave room for beside the reserve, while it runs (the ``with`` block,
        which gets that number of parts); FilesHeldBack if not even one part fits."""
        parts = self.parts
        with self._lock:  # (the free files are counted under it too: two claims never see the same files)
            free = files_free()
            if free is not None:
                left, limit = free
                reserve = files_reserve(limit)
                parts = min(self.parts, (left - self._claimed - reserve - 1) // 2)  # files_per_download inverted
                if parts < 1:
                    raise FilesHeldBack(self._held_back(left, limit, reserve))
            need = files_per_download(parts)
            self._claimed += need
        try:
            yield parts
        finally:
            with self._lock:
                self._claimed -= need

    def tight(self) -> bool:
        """Whether the files free, less those claimed, leave no room for an attempt of ``parts``
        parts beside the reserve: an idle download thread's kept connections are worth closing."""
        free = files_free()
        if free is None:
            return False
        left, limit = free
        with self._lock:
            return left - self._claimed - files_per_download(self.parts) < files_reserve(limit)

    def _held_back(self, left: int, limit: int, reserve: int) -> str:
        """Why an attempt cannot start (``left`` of ``limit`` files free, ``reserve`` kept)."""
        one = files_per_download(1)
        if not self._claimed:  # no download under way will end and let its files go
            return (
                f"{left} of {limit} open files free: the last {reserve} are kept for connections, and a "
                f"download needs {one} at least (one part): the limit is too low for even one download beside "
                "what the agent holds; raise ulimit -n / LimitNOFILE for the agent"
            )
        return (
            f"{left} of {limit} open files free, downloads under way claim {self._claimed} and the next one "
            f"{one} at least (one part): the last {reserve} are kept for connections; "
            "raise ulimit -n / LimitNOFILE for the agent"
        )


class FilesShort:
    """Downloads' waits while the agent is short of open files (see the module): each in its
    download's thread; the warnings, at most one every ``FILES_LOG_EVERY``, shared. Each attempt
    claims its files (``claims``) while it runs."""

    def __init__(self, claims: FileClaims) -> None:
        self.claims = claims
        self._logged: float | None = None  # time.monotonic() of the last warning

    def fetch(self, fetcher: Fetcher, d: Download) -> Fetched:
        """Fetch ``d`` in as many parts at once as the files free leave room for; while the agent is
        short of open files (it ran out, or not even one part's files are free beside the reserve),
        wait and try again, from where the partial file ends. Its ``progress.fault`` says so until
        it ends."""
        short = 0  # times in a row it found no file to spare
        while True:
            if d.cancel.is_set():
                raise Cancelled(d.url)
            try:
                with self.claims.claim() as parts:
                    if parts < self.claims.parts:
                        log.info(
                            "%s: downloading in %d part(s) at once, not %d: the open files free leave room for "
                            "no more beside those kept for connections",
                            d.url,
                            parts,
                            self.claims.parts,
                        )
                    d.progress.parts = parts
                    fetched = fetcher.fetch(d)
            except (Cancelled, DiskFull):
                raise
            except FilesHeldBack as exc:
                fault = str(exc)
            except Exception as exc:
                if (out := out_of_files(exc)) is None:
                    raise
                fault = out
            else:
                d.progress.fault = None
                return fetched
            short += 1
            d.progress.fault = fault
            fetcher.close_thread()  # its kept connection is a file held while it waits
            self._wait(d, fault, FILES_BACKOFF.delay(min(short, 16)))  # (at the max long before 16)

    def idle(self, fetcher: Fetcher) -> None:
        """A download thread found no task for ``IDLE_CHECK``: while the agent is short of open
        files (:meth:`FileClaims.tight`), it closes the connections ``fetcher`` keeps for it, a file
        each, which a download, or a connection to the agent, may need."""
        if self.claims.tight():
            fetcher.close_thread()

    def _wait(self, d: Download, fault: str, delay: float) -> None:
        """Say that ``d`` found no file to spare (a warning at most every ``FILES_LOG_EVERY``), and
        wait ``delay`` (Cancelled if cancelled meanwhile)."""
        now = time.monotonic()
        warn = self._logged is None or now - self._logged >= FILES_LOG_EVERY
        if warn:  # (threads may both warn at once: no harm)
            self._logged = now
        event(
            log,
            "out_of_files",
            "%s: %s; trying it again in %.1fs",
            d.url,
            fault,
            delay,
            level=logging.WARNING if warn else logging.DEBUG,
            url=d.url,
            delay_s=round(delay, 1),
            error=fault,
        )
        if d.cancel.wait(delay):
            raise Cancelled(d.url)


class Downloads:
    """Download tasks and threads, preemption and their ends; budget grants through :class:`Grants`."""

    def __init__(
        self,
        config: AgentConfig,
        cache: ShardCache,
        shards: Shards,
        fetcher: Fetcher,
        mailbox: Mailbox,
        *,
        expected: Callable[[str], ShardInfo | None] = lambda url: None,
    ) -> None:
        self._config, self._cache, self._fetcher, self._mailbox = config, cache, fetcher, mailbox
        self._shards = shards  # each download in flight is in its shard's record
        self._expected = expected  # what a shard index says of a URL: each download is checked against it
        self._tasks: queue.SimpleQueue[Download | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._grants = Grants(cache)  # budget asked for and not granted yet
        self._disk = DiskRoom(cache, shards)
        # Downloads cancelled to break a growth deadlock (Grants.gave_way): until another download
        # ends, neither they nor any download no reader waits for start, so that the space they let
        # go of goes to the downloads left, not straight back to them or to a newcomer.
        self._gave_way: set[str] = set()
        # Shards this cache held during this run (cached at start or downloaded): one more is a re-download.
        self._had: set[str] = {r.url for r in cache.index if r.state is ShardState.CACHED}
        self._files = FilesShort(FileClaims(config.download_parts))
        self._finished_bytes = 0  # bytes fetched by downloads that ended, for the rate
        self._rate_samples: deque[tuple[float, int]] = deque()

    def start_threads(self) -> None:
        # Twice --download-workers: prefetches use at most half, so a shard a reader waits for
        # starts at once instead of queueing behind prefetches nobody asked for (schedule).
        for i in range(2 * self._config.download_workers):
            t = threading.Thread(target=self._thread, name=f"download-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    # -- what runs ------------------------------------------------------------

    def __contains__(self, url: object) -> bool:
        """True while ``url`` downloads (or is revalidated)."""
        return isinstance(url, str) and self._shards.slot(url) is not None

    def count(self) -> int:
        """Downloads (and revalidations) running or queued."""
        return self._shards.downloads()

    def running(self) -> list[str]:
        """The shards downloading (revalidations left out)."""
        return [slot.download.url for slot in self._shards.slots() if not slot.download.verify]

    def readable_while_downloading(self, url: str) -> bool:
        """True when ``url`` is downloading with its whole size reserved: it will finish whatever is pinned."""
        d = self._download(url)
        # A gzip'd shard is read once decompressed: a reader of its partial file would hold
        # its pins while the tar still needs room.
        if d is None or d.verify or d.progress.gzipped or d.progress.total is None:
            return False
        return d.budget.reserved >= d.progress.total

    def progress(self, url: str) -> dict[str, Any]:
        """Bytes written so far and the size, of a download of ``url`` ({} if none), and
        while its attempts fail, the last one's failure (``failing``); while it waits for open
        files, the agent's fault that holds it (``agent_fault``)."""
        d = self._download(url)
        if d is None or d.verify:
            return {}
        # A gzip'd shard's tar too: a waiting consumer counts their growth as progress.
        got: dict[str, Any] = {"written": d.progress.written + d.progress.expanded, "total": d.progress.total}
        if d.progress.failing:
            got["failing"] = d.progress.failing
        if d.progress.fault:
            got["agent_fault"] = d.progress.fault
        return got

    def space_wait(self, url: str) -> str | None:
        """Why the download of ``url`` waits for space, if it does."""
        slot = self._shards.slot(url)
        return slot.space.reason if slot is not None else None

    def space_waits(self, waited_for: Collection[str]) -> list[dict[str, str]]:
        """The downloads that wait for space, each with why; while starts are paused for a full
        disk, the shards readers wait for (``waited_for``) that have no download yet too."""
        waits = [
            {"url": slot.download.url, "reason": slot.space.reason}
            for slot in self._shards.slots()
            if slot.space.reason is not None
        ]
        return waits + self._disk.waits(waited_for)

    def disk(self) -> dict[str, Any]:
        """The cache's file system as stats show it (:meth:`DiskRoom.view`)."""
        return self._disk.view()

    def out_of_files(self) -> str | None:
        """While some download waits for open files (the agent ran out of them), what that error says."""
        return next((s.download.progress.fault for s in self._shards.slots() if s.download.progress.fault), None)

    def retrying(self, waited_for: Mapping[str, Collection[str]]) -> list[dict[str, Any]]:
        """The downloads whose last attempt failed, retried after a backoff: each with that failure,
        whether a reader waits for it (``waited_for``: url -> the jobs of the readers that wait)
        and the jobs whose readers wait."""
        return [
            {
                "url": d.url,
                "error": d.progress.failing,
                "demanded": d.url in waited_for,
                "jobs": sorted(waited_for.get(d.url, ())),
            }
            for d in (slot.download for slot in self._shards.slots())
            if d.progress.failing is not None
        ]

    def _download(self, url: str) -> Download | None:
        slot = self._shards.slot(url)
        return slot.download if slot is not None else None

    def demand(self, url: str) -> None:
        """A reader waits for ``url``: its download, if one runs, may evict window shards."""
        d = self._download(url)
        if d is not None:
            d.demanded = True

    def pause(self, error: str) -> None:
        """Start no download for a while: the file system refused ``error`` (the disk is full)."""
        self._disk.pause(error)

    @property
    def paused(self) -> bool:
        return self._disk.paused

    def rate(self) -> float:
        """Bytes a second downloaded over the last ``RATE_WINDOW`` seconds, up to now; 0 once no
        download runs (a figure for what happens now, not an average that lingers). Only bytes
        that came from the source count: a resumed download's partial file came before."""
        self.sample_rate()
        if not self.running() or len(self._rate_samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._rate_samples[0], self._rate_samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def sample_rate(self) -> None:
        now = time.monotonic()
        self._rate_samples.append(
            (now, self._finished_bytes + sum(s.download.progress.fetched for s in self._shards.slots()))
        )
        while self._rate_samples and now - self._rate_samples[0][0] > RATE_WINDOW:
            self._rate_samples.popleft()

    # -- scheduling -----------------------------------------------------------

    def schedule(
        self, want: list[str], holding: set[str], demanded: Collection[str], hold: PrefetchHold = NO_HOLD
    ) -> list[str]:
        """Start downloads for the most urgent of ``want``; cancel those no longer wanted;
        answer budget requests (``hold``: what prefetches ask of it). Returns the shards that
        became readable while they download.

        Prefetches take at most --download-workers connections; a shard a reader waits
        for (``demanded``, first in ``want``) may take as many again, so it never queues
        behind prefetches.

        The cancel rule: a download is cancelled once its shard has been out of
        ``holding`` (the wanted shards, and the start-up plan while some reader has
        said hello but has no window yet) for ``CANCEL_AFTER`` seconds in a row; or at
        once when all slots are busy, a shard a reader waits for has none, and this
        download is out of the wanted set.
        """
        now = time.monotonic()
        for slot in self._shards.slots():
            d, url = slot.download, slot.download.url
            if url in holding:
                slot.unwanted_since = None
                continue
            if d.cancel.is_set():
                continue
            if slot.unwanted_since is None:
                slot.unwanted_since = now
            since = slot.unwanted_since
            if now - since >= CANCEL_AFTER:
                log.info("no longer wanted, abandoning %s (out of every window for %.0fs)", url, now - since)
                d.cancel.set()
        for url in want:
            if self.paused:
                break
            if self._shards.slot(url) is not None or self._cache.is_cached(url):
                continue
            if url in self._gave_way or (self._gave_way and url not in demanded):
                continue
            rec = self._cache.index.get(url)
            if rec is not None and rec.state is ShardState.FAILED:
                continue
            slots = self._config.download_workers * (2 if url in demanded else 1)
            if self._shards.downloads() >= slots:
                if url in demanded and not self._cancel_unwanted():
                    self._preempt()
                break
            self._start(url, demanded=url in demanded)
        waits = {slot.download.url: slot.space for slot in self._shards.slots()}
        readable = self._grants.answer(want, hold, waits, self.readable_while_downloading)
        self._gave_way.update(self._grants.gave_way())
        self._cache.keep_margin(want)
        return readable

    def _start(self, url: str, *, demanded: bool) -> None:
        rec = self._cache.index.get(url)
        d = Download(
            url,
            partial=self._cache.layout.partial_path(url),
            final=self._cache.layout.shard_path(url),
            budget=Budget(self.reserve),
            progress=Progress(etag=rec.etag if rec else None),
            demanded=demanded,
            expected=self._expected(url),
            on_validator=lambda d: self._mailbox.post(ValidatorFound(d, d.progress.etag)),
        )
        self._cache.begin(d)
        self._shards.start_download(d)
        self._tasks.put(d)
        log.debug("downloading %s", url)

    def revalidate(self, url: str) -> None:
        """Ask the source whether the cached ``url`` is still current (a :class:`Revalidated` comes back)."""
        if self._shards.slot(url) is not None:
            return
        # Not evicted while we ask; unpinned when the answer comes. No reader reads it, so no
        # read is counted: a restart must not make every cached shard look recently read.
        self._cache.pin(url, read=False)
        rec, info = self._cache.index.get(url), self._expected(url)
        d = Download(
            url,
            partial=self._cache.layout.partial_path(url),
            final=self._cache.layout.shard_path(url),
            budget=Budget(self.reserve),
            # The version the copy holds, and whether its bytes may prove it (see _revalidate).
            progress=Progress(
                etag=rec.etag if rec else None,
                last_modified=rec.last_modified if rec else None,
                total=(rec.source_size or rec.size) if rec else None,
            ),
            expected=info,
            verify=True,
            digest=_may_digest(rec, info),
        )
        self._shards.start_download(d)
        self._tasks.put(d)

    def _cancel_unwanted(self) -> bool:
        """Free a slot for a shard someone waits for: cancel a download out of every window
        (it keeps its partial); True if a slot is being freed."""
        unwanted = [s for s in self._shards.slots() if s.unwanted_since is not None]
        for slot in sorted(unwanted, key=lambda s: s.unwanted_since or 0.0):
            d, url = slot.download, slot.download.url
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
        waiting = self._grants.waiting()
        running = [slot.download for slot in self._shards.slots()]
        if any(d.cancel.is_set() for d in running):
            return  # a slot is being freed already
        for d in running:
            if not d.demanded and not d.verify and d.url in waiting:
                log.info("pausing the prefetch of %s for a shard a reader waits for", d.url)
                d.cancel.set()
                return

    # -- budget ---------------------------------------------------------------

    def asked(self, grant: Grant) -> None:
        """A thread's budget request (answered at the next :meth:`schedule`)."""
        self._grants.asked(grant)

    def no_room(self) -> list[NoRoom]:
        """The downloads only prefetches wanted given up (cancelled) since the last call."""
        return self._grants.no_room()

    # -- ends (main loop, from the events) --------------------------------------

    def record_download(self, d: Download, fetched: Fetched) -> bool:
        """Record the published shard in the index; True if this run held it before (a re-download)."""
        index = self._cache.index
        again = d.url in self._had or d.url in index.counts
        stored = fetched.size if fetched.stored is None else fetched.stored  # what "counted" records too
        index.keep_count(d.url, stored, fetched.etag)  # if the content is what was counted
        self._cache.finish(d, fetched.size, fetched.etag, stored=fetched.stored, last_modified=fetched.last_modified)
        slot = self._shards.slot(d.url)
        if slot is not None and slot.counted is not None:
            index.set_count(d.url, slot.counted, stored, fetched.etag)
        index.incr("bytes_downloaded", fetched.size)
        index.incr("downloads")
        self._had.add(d.url)
        if again:
            index.incr("redownloads")
            index.incr("bytes_redownloaded", fetched.size)
            event(
                log,
                "redownloaded",
                "cached %s again (%s): this cache held it before",
                d.url,
                format_size(fetched.size),
                url=d.url,
                bytes=fetched.size,
                level=self._cache.churn.level(Churn.REDOWNLOADED),
            )
        else:
            event(log, "cached", "cached %s (%s)", d.url, format_size(fetched.size), url=d.url, bytes=fetched.size)
        return again

    def counted_early(self, url: str, samples: int) -> None:
        """A worker counted ``url``'s samples before its end was recorded: the count is kept for then."""
        slot = self._shards.slot(url)
        if slot is not None:
            slot.counted = samples

    def record_out_of_space(self, d: Download, error: DiskFull, want: Sequence[str]) -> None:
        """The file system refused a write: not the shard's fault. Drop the partial, make room,
        start nothing for a while; the shard is tried again then."""
        self._cache.abandon(d)
        self.pause(error.reason)
        log.warning("%s; abandoned %s, will retry after making room", error.reason, d.url)
        self._cache.evict(
            d.progress.written + self._cache.margin,
            wanted=want,
            allow_window=False,
            why="evicted: the file system ran out of space",
        )

    def record_failure(self, d: Download, error: FetchError) -> None:
        self._cache.fail(d, error.reason)
        event(log, "failed", "failed %s: %s", d.url, error.reason, level=logging.ERROR, url=d.url, error=error.reason)

    def record_cancel(self, d: Download, *, keep_partial: bool) -> None:
        """``d`` was abandoned; with ``keep_partial`` its partial file stays to be resumed when wanted again."""
        self._cache.abandon(d, keep_partial=keep_partial)

    def ended(self, d: Download) -> None:
        """Its end is recorded: the slot is free. Called last, so that a failed index write
        (the event is handled again later) leaves the download active."""
        self._shards.end_download(d.url)
        self._finished_bytes += d.progress.fetched
        if not d.verify and d.url not in self._gave_way:
            self._gave_way.clear()  # its space is free: the downloads that gave way may start again

    # -- download threads ---------------------------------------------------------

    def reserve(self, d: Download, total: int, timeout: float | None) -> bool:
        """In a download thread: block until the main loop grants ``total`` bytes (True), the
        timeout passes (False) or ``d`` is cancelled (raises :class:`Cancelled`)."""
        g = Grant(d, total)
        self._mailbox.post(BudgetAsked(g))
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

    def _thread(self) -> None:
        """A download thread: runs tasks until it takes None (idle, see :meth:`FilesShort.idle`)."""
        while True:
            try:  # (stop() puts one None for each thread, after its tasks cancelled)
                d = self._tasks.get(timeout=IDLE_CHECK)
            except queue.Empty:
                self._files.idle(self._fetcher)
                continue
            if d is None:
                break
            self._mailbox.post(self._run(d))
        self._fetcher.close_thread()

    def _run(self, d: Download) -> Event:
        try:
            if d.verify:
                return self._revalidate(d)
            return Downloaded(d, self._files.fetch(self._fetcher, d))
        except Cancelled:
            return DownloadCancelled(d)
        except DiskFull as exc:
            return OutOfSpace(d, exc)
        except FetchError as exc:
            return DownloadFailed(d, exc)
        except Exception as exc:  # a bug must not kill the thread and hang the agent
            log.exception("unexpected error downloading %s", d.url)
            return DownloadFailed(d, FetchError(d.url, f"internal error: {exc!r}"))

    def _revalidate(self, d: Download) -> Revalidated:
        """Ask the source of the cached ``d.url`` what it holds now. When that has no validator in
        common with the copy's (an adopted copy has none) but is of the copy's size, and an MD5
        could prove the copy (its shard index's, or an ETag that is one), the copy is hashed too
        (``d.progress.md5``), once, in this download slot: :mod:`wdscache.agent.opens` decides."""
        now = self._fetcher.describe(d.url)
        p = d.progress
        if (
            d.digest
            and isinstance(now, Fetched)
            and now.size == p.total
            and common_validator(p.etag, p.last_modified, now.etag, now.last_modified) is None
            and ((d.expected is not None and d.expected.md5 is not None) or etag_md5(now.etag) is not None)
        ):
            try:
                size, p.md5 = file_facts(d.final, md5=True)
            except OSError as exc:  # (gone behind our back: the open that needs it downloads it again)
                log.warning("could not read the cached copy of %s to check its MD5: %s", d.url, exc)
            else:
                if size != p.total:  # changed behind our back while hashed: proves nothing
                    p.md5 = None
        return Revalidated(d, now)

    # -- shutdown ---------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every download and end the threads (each gets up to ``JOIN_TIMEOUT`` in all)."""
        for slot in self._shards.slots():
            slot.download.cancel.set()
        for _ in self._threads:
            self._tasks.put(None)
        deadline = time.monotonic() + JOIN_TIMEOUT
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def threads_alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def abandon_all(self, keep_partial: Callable[[str], bool]) -> None:
        """Record the downloads still unfinished as abandoned (``keep_partial(url)``: keep the partial file)."""
        for d in [slot.download for slot in self._shards.slots()]:
            if not d.verify:  # a revalidation holds a cached shard, not a partial one
                self._cache.abandon(d, keep_partial=keep_partial(d.url))
            self._shards.end_download(d.url)


def _may_digest(rec: ShardRecord | None, info: ShardInfo | None) -> bool:
    """Whether the cached copy ``rec`` may be hashed at its revalidation: it holds the bytes of its
    source as they are (not decompressed from gzip), and is not known already to have the MD5 its
    shard index (``info``) gives."""
    if rec is None or rec.source_size is not None:
        return False
    return rec.md5 is None or info is None or rec.md5 != info.md5
