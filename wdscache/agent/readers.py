"""The agent's readers: who reads (hello, jobs, their processes), which lists, and their windows.

A *reader* is a consumer that said hello (it names its job, rank and list) or a
plain client that only opens shards; each has a window of the shards it reads
next (:class:`~wdscache.shared.plan.Reader`). Each reader is one :class:`ReaderRecord`:
its window, and for a consumer its job, rank, shuffle buffer and last report. This part
owns them, the jobs they form, the URL lists they read (the agent's own, and consumers'
lists kept while read) and the lists being uploaded; it says which shards the readers
want, and warns when they need more at once than the budget holds.

Guarantees:

- Main loop only. The ops return their replies (:class:`~wdscache.agent.control.Request`
  in, :data:`~wdscache.agent.control.Reply` out); the core sends them. No socket here.
- A reader reads the list it said hello on to its end, whatever edits of the
  list file happen meanwhile (:meth:`Readers.known`): an agent list that readers
  started their epoch on is kept while they read it.
- A reader whose process the agent sees (:class:`ProcessWatch`) is
  dropped as soon as that process ends; any other after ``--reader-timeout`` of
  silence. Whoever holds things for a reader is told when it goes (``gone``), so
  its pins go with it.
- While a reader waits for room that pins hold, a random-access reader (a
  ``ShardListDataset`` session, said so in its hello) silent for :data:`IDLE_LET_GO`
  and holding pins is dropped as after ``--reader-timeout`` (:meth:`Readers.let_go_idle`):
  a stream held by its user lets go of its pins when asked, but such a session has no
  thread to answer while its process reads nothing, and would hold them until the timeout.
  The one silent longest goes first, one every :data:`IDLE_LET_GO_EVERY`, while the wait
  lasts: one that reads steadily pings every second and is not taken for idle, but one
  silent between bursts of reads (a DataLoader worker waiting for its turn) may be.
- Lists are bounded (:mod:`wdscache.agent.job_lists`). A partial download kept for a resume
  that no list names for ``UNNAMED_GRACE`` is removed (:mod:`wdscache.agent.unnamed_partials`).
"""

from __future__ import annotations

import enum
import logging
import os
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..shared.config import AgentConfig
from ..shared.logs import event, get_logger
from ..shared.messages import END_ERROR_MAX
from ..shared.nodes import assign
from ..shared.plan import Reader, wanted
from ..shared.protocol import PAGE_BYTES, PROTOCOL, SAME_INSTALL, numbers, process_identity, speaks
from ..shared.protocol import field as get_field
from ..shared.redact import redact_urls
from ..shared.shard_index import ShardInfo
from ..shared.stats import jobs_view, with_fraction
from ..shared.urls import UrlList, list_id, whitespace_problem
from .budget_need import BudgetNeed
from .cache import ShardCache
from .control import Reply, Request
from .ended import Dropped, EndedConsumers
from .job_lists import JobLists
from .jobs import Jobs
from .rank_lists import Listed, RankLists, Reading, job_live
from .rank_totals import RankTotals
from .unnamed_partials import UnnamedPartials

log = get_logger(__name__)

STARTUP_READER = "(start-up plan)"
_PROCESS_ENDED = ": its process ended"  # why a reader whose process ended goes, in the log
HELLO_MAX = (1 << 31) - 1  # the most a hello's world size, epoch or shuffle buffer may be (torch's ranks are int32)
REPORT_FIELDS = ("samples", "bytes", "rate", "wait_s", "epoch", "position")
MAX_WATCHED = 512  # consumer processes watched at once (one descriptor each); others are timed out
# Seconds of silence after which a random-access reader holding pins may be dropped while a
# reader waits for room they hold: several of its pings (one a second while it reads, with the
# shards it holds pinned or a worker's table of one awaited), so a reader that reads steadily is
# not taken for idle even on a loaded machine; short next to --reader-timeout, which it would
# wait for else.
IDLE_LET_GO = 5.0
# Seconds between two such drops: the room one frees is often enough, and a session silent only
# between bursts of reads (a DataLoader worker waiting for its turn) pays for a drop with pinning
# its shards again; so the one silent longest goes first (a dataset read to its end), one at a time.
IDLE_LET_GO_EVERY = 1.0


def startup_reader(n_shards: int, config: AgentConfig, counts: Sequence[int | None] | None = None) -> Reader:
    """The plan the agent prefetches by before any reader has a window: the list in its seeded order;
    on a node of several, the node's part (:func:`~wdscache.shared.nodes.assign`, from ``counts``:
    without every count, nothing until a consumer says what it reads)."""
    if config.num_nodes == 1 or counts is None:
        return Reader(STARTUP_READER, n_shards, seed=config.seed, shuffle=config.shuffle)
    if any(c is None for c in counts):
        log.info(
            "no start-up prefetch: node %d of %d needs every shard's count to know its part (a shard index gives them)",
            config.node_rank,
            config.num_nodes,
        )
        return Reader(STARTUP_READER, n_shards, seed=config.seed, shuffle=config.shuffle, shards=())
    part = assign([int(c) for c in counts if c is not None], config.num_nodes)[config.node_rank]
    return Reader(STARTUP_READER, n_shards, seed=config.seed, shuffle=config.shuffle, shards=part)


def _rank_live(consumers: dict[str, dict[str, Any]], job: str, rank: int) -> bool:
    """Whether some consumer of ``consumers`` reads as ``rank`` of ``job``."""
    return any(c.get("job") == job and c.get("rank") == rank for c in consumers.values())


class ProcessWatch:
    """The consumers' processes the agent sees, each watched through a pidfd, so that its
    reader is dropped the moment it ends. Another's (another machine or container, no
    pidfd, beyond ``MAX_WATCHED``) goes after ``--reader-timeout`` of silence instead."""

    def __init__(self, watch: Callable[[int], None], unwatch: Callable[[int], None]) -> None:
        self._watch, self._unwatch = watch, unwatch  # wake the main loop when a watched process ends
        self._readers: dict[int, str] = {}  # pidfd -> the reader whose process it is
        self._deaths = select.poll()  # the watched pidfds: readable once their process ended

    def start(self, name: str, claimed: Any) -> int:
        """Watch the process reader ``name`` named in hello (``claimed``: its identity) if we
        see that very process: its pidfd, else -1."""
        if not (
            isinstance(claimed, list)
            and len(claimed) == 4
            and type(claimed[0]) is int
            and 0 < claimed[0] < 1 << 31
            and len(self._readers) < MAX_WATCHED
        ):
            return -1
        try:
            fd = os.pidfd_open(claimed[0])
        except (AttributeError, OSError):
            return -1
        # Compared once the pidfd is open: if the identity matches, it is that process's pidfd.
        if process_identity(claimed[0]) != claimed:
            os.close(fd)
            return -1
        self._readers[fd] = name
        self._deaths.register(fd, select.POLLIN)
        self._watch(fd)  # wakes the main loop when it ends
        return fd

    def stop(self, fd: int) -> None:
        del self._readers[fd]
        self._deaths.unregister(fd)
        self._unwatch(fd)
        os.close(fd)

    def ended(self) -> list[str]:
        """The readers whose process ended (still watched: :meth:`stop` each)."""
        return [self._readers[fd] for fd, _ in self._deaths.poll(0)] if self._readers else []

    def close(self) -> None:
        for fd in list(self._readers):
            self.stop(fd)


def dropped_reply(name: str) -> Reply:
    """The answer to an open, ping or report of reader ``name`` that said hello, once the agent
    dropped it (silent past --reader-timeout, see GREETED_OPS): it says hello again and asks once more."""
    return {
        "ok": False,
        "need_hello": True,
        "error": f"reader {name} was dropped after --reader-timeout of silence: say hello again",
    }


class Silence(enum.Enum):
    """Why a reader that said nothing for a while is dropped (it comes back with a hello, as
    the same reader): the value is the event logged."""

    TIMED_OUT = "consumer_timed_out"  # silent for --reader-timeout
    IDLE = "consumer_idle_let_go"  # a random-access reader idle while a reader waits for room its pins hold


@dataclass(slots=True, eq=False)
class ReaderRecord:
    """One reader: its window (``plan``); for a consumer (said hello), its job, rank and last
    report (``consumer``), and the shuffle buffer it said hello with (samples)."""

    plan: Reader
    consumer: dict[str, Any] | None = None  # {"job", "rank", "seen", and the last report's figures}
    probe: bool = False  # said hello only to learn the list (a loader's len()): neither joins nor leaves a job
    buffer: int = 0
    counted: dict[str, float] = field(default_factory=dict)  # its reports' figures its rank's totals hold
    own_list: bool = False  # reads a list of its own (else the agent's, as it was when its epoch started)
    launch: str | None = None  # the run of the training script it is part of (its hello's launch)
    random_access: bool = False  # a ShardListDataset's session: no thread lets go of its pins while it is idle

    def dropped(self, silent: Silence | None) -> Dropped | None:
        """What a reader dropped as ``silent`` comes back to (its totals; its list, but its own,
        which it sends again); None for one that left."""
        return None if silent is None else Dropped(self.counted, None if self.own_list else self.plan.list_id)


class Readers:
    """The readers, their jobs and lists, and what they want next."""

    def __init__(
        self,
        config: AgentConfig,
        cache: ShardCache,
        urls: UrlList,
        *,
        endpoint: str,
        workers: list[str],
        cache_root: list[int],
        gone: Callable[[str], None],
        watch: Callable[[int], None] = lambda fd: None,
        unwatch: Callable[[int], None] = lambda fd: None,
    ) -> None:
        self._config, self._cache = config, cache
        self._processes = ProcessWatch(watch, unwatch)
        self._workers, self._cache_root = workers, cache_root  # told in hello (endpoints; for direct reads)
        self._gone = gone  # told the name of each reader that goes, once it is gone
        self.urls = urls  # the agent's current list (from its list file)
        self.list_id = list_id(urls.urls)
        self._readers: dict[str, ReaderRecord] = {}
        # the lists readers read besides the agent's current one, and those being uploaded
        self._lists = JobLists(endpoint, idle=config.reader_timeout)
        # Kept partial downloads no list names (a job's that never came back) go in time.
        self._unnamed = UnnamedPartials(cache, self.known, time.monotonic())
        # The start-up window's URLs and their positions in the list, as last asked: their facts
        # are read by position, so the downloads that start with the agent need no lookup table.
        self._window_at: dict[str, int] = {}
        self._startup = self._startup_plan(urls)
        self._startup_stopped = False  # by wdscache clear, until the list changes: no refill nobody asked for
        self._startup_left: set[str] = set()  # evicted by wdscache evict, until the list changes: the same
        self._jobs = Jobs()  # their world sizes (its ranks must agree), and the list each of their epochs reads
        self._ranks = RankLists()  # the list each rank of an epoch reads (its ranks must agree)
        self._ended = EndedConsumers()  # the ranks of consumers that left lately, and those dropped as silent
        self._idle_dropped_at = 0.0  # when let_go_idle last dropped a reader
        self._totals = RankTotals()  # each rank's over the agent's life (the metrics' counters)
        self._need = BudgetNeed(cache, config.prefetch)  # what they need of the budget, and its warning

    # -- who reads ------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._readers

    def seen(self, name: str) -> None:
        """A sign of life from reader ``name`` (any of its ops)."""
        record = self._readers.get(name)
        if record is not None:
            record.plan.last_seen = time.monotonic()

    def known(self, url: str, name: str | None = None) -> bool:
        """In the list reader ``name`` reads; for a plain client (no hello), in the agent's list or in
        a list some reader reads. Only listed shards are ever fetched."""
        record = self._readers.get(name) if name is not None else None
        reader = record.plan if record is not None else None
        if reader is not None and reader.list_id is not None:
            return self._in_list(url, reader.list_id)
        return self.position(url) is not None or any(url in listed for listed in self._lists)

    def _in_list(self, url: str, key: str) -> bool:
        """Whether ``url`` is in the list ``key`` names (the agent's own: by :meth:`position`)."""
        return self.position(url) is not None if key == self.list_id else url in self._list(key)

    def position(self, url: str) -> int | None:
        """Where ``url`` is in the agent's list (None: not in it). The start-up window's URLs are
        known without a lookup: a long list's lookup table is whole only a while after the start."""
        at = self._window_at.get(url)
        if at is None:
            at = self.urls.urls.position(url)
        return at if at >= 0 else None

    def shard_info(self, url: str, name: str | None = None) -> ShardInfo | None:
        """What a shard index says of ``url``: the one of the list reader ``name`` reads, if it
        reads one kept besides the agent's; else the agent's list's, else that of the latest
        job's list that holds it."""
        record = self._readers.get(name) if name is not None else None
        key = record.plan.list_id if record is not None else None
        if key is not None and key != self.list_id and key in self._lists:
            return self._lists.get(key, self.urls).info(url)
        info = self.list_info(url)
        if info is None:
            info = next((i for listed in reversed(self._lists) if (i := listed.info(url)) is not None), None)
        return info

    def list_info(self, url: str) -> ShardInfo | None:
        """What the agent's own list (its list file, a shard index) says of ``url`` (None: nothing)."""
        facts = self.urls.shards
        at = self.position(url) if facts is not None else None
        return facts[at] if facts is not None and at is not None else None

    def samples(self, url: str) -> int | None:
        """``url``'s sample count: the one counted in a copy of it, else its shard index's (None: neither).
        A count taken from a copy wins: the index's is what the sequence uses until the shard is walked."""
        counted = self._cache.index.counts.get(url)
        if counted is not None:
            return counted
        info = self.shard_info(url)
        return info.nsamples if info is not None else None

    def opened(self, name: str, url: str, ahead: list[Any] | None) -> None:
        """Reader ``name`` opens ``url`` (listed for it): its window moves (``ahead``: the shards it
        says it reads next). A plain client becomes a reader that reads in list order."""
        record = self._readers.get(name)
        if record is None:
            # A plain client reads in list order; its window is the shards after this one.
            record = self._readers[name] = ReaderRecord(Reader(name, len(self.urls), shuffle=False))
        reader = record.plan
        if ahead is not None:
            reader.ahead = [u for u in ahead[: self._config.prefetch] if isinstance(u, str) and self.known(u, name)]
        elif reader.ahead is None and (at := self.position(url)) is not None:
            reader.advance_to(at)

    def planned(self) -> list[str]:
        """The union of the readers' windows by urgency (the start-up plan while nobody reads)."""
        prefetch, urls = self._config.prefetch, self.urls.urls
        windows = []
        for r in self._plans():
            if r.ahead is not None:
                windows.append(r.ahead[:prefetch])
            else:
                windows.append([urls[i] for i in r.window(prefetch) if i < len(urls)])
        if not any(windows):
            # Nobody reads yet (or consumers only said hello): keep the start-up plan.
            windows = [self._startup_window()]
        return wanted(windows, prefetch)

    def holding(self, want: list[str]) -> set[str]:
        """Shards whose downloads are not cancelled: ``want``, and the start-up plan while some reader
        said hello but has no window yet (its window may well be that plan)."""
        holding = set(want)
        if any(r.ahead == [] for r in self._plans()):
            holding.update(self._startup_window())
        return holding

    def _plans(self) -> list[Reader]:
        return [record.plan for record in self._readers.values()]

    def stop_startup(self) -> None:
        """Prefetch nothing for the start-up plan (``wdscache clear`` emptied the cache): shards come
        back only as readers ask for them, until the list file changes."""
        self._startup_stopped = True

    def leave_out_of_startup(self, urls: list[str]) -> None:
        """The start-up plan prefetches none of ``urls`` (``wdscache evict`` removed them): they come
        back only as readers ask for them, until the list file changes."""
        self._startup_left.update(urls)

    def _startup_window(self) -> list[str]:
        if self._startup_stopped or not self._config.startup_prefetch:
            return []
        urls, left = self.urls.urls, self._startup_left
        window = (i for i in self._startup.window(self._config.prefetch) if i < len(urls))
        self._window_at = {urls[i]: i for i in window if not left or urls[i] not in left}
        return list(self._window_at)

    # -- ops ------------------------------------------------------------------

    def op_hello(self, request: Request) -> Reply:
        """A consumer joins a job: check it agrees with the job's other ranks, take up its list.

        Lists travel in pages (``put_urls`` / ``get_urls``), never in one message, and
        are known by ``list_id`` (a hash), so a list is sent once, not every epoch.
        """
        hello = _hello_of(request.header)
        if not isinstance(hello, _Hello):
            return hello
        name, job, world, rank, epoch, claimed, probe = (
            hello.name,
            hello.job,
            hello.world,
            hello.rank,
            hello.epoch,
            hello.claimed,
            hello.probe,
        )
        refused = self._lists.take(name, claimed, self._read_lists())
        if refused is not None:
            return refused
        consumers, loader, own = self._consumers(), hello.loader, claimed is not None
        refusal = self._jobs.refusal(job, world, rank, lambda: job_live(consumers, job))
        warning = None  # of its list against its fellow ranks', for its process to log too
        if refusal is None and epoch is not None:  # its list, as those of the other ranks of its epoch
            mine = claimed or self._jobs.list_of(job, world, epoch, self.list_id, self._holds, reader=name, probe=True)
            reading = Reading(job, loader, epoch, rank, world, Listed(mine, len(self._list(mine)), own))
            warning = self._ranks.check(name, reading, consumers, lambda key: self._list(key).urls)
        if refusal is not None:
            return {"ok": False, "error": refusal}
        # No window until the consumer opens its first shard: the start-up plan stays meanwhile.
        before = self._readers.get(name)
        again = before is not None and before.consumer is not None  # its next epoch: it did not leave, nor join anew
        self.drop(name, why=None)
        back = self._ended.back(name) if not probe else None  # dropped as silent, it comes back
        if back is None and not probe and not _rank_live(consumers, job, rank):
            self._ended.joined(job, rank, hello.launch)  # (a new run of the job?)
        # It reads the list it named; else the one its job's epoch reads (the first of its readers
        # took the agent's list as it was then), to that epoch's end, whatever edits come.
        key = claimed
        if key is None:
            read = back.list_id if back is not None and back.list_id and self._holds(back.list_id) else self.list_id
            key = self._jobs.list_of(job, world, epoch, read, self._holds, reader=name, probe=probe)
        record = self._readers[name] = ReaderRecord(Reader(name, ahead=[], list_id=key), own_list=own)
        record.launch, record.random_access = hello.launch, hello.random_access
        if probe:
            record.probe = True
        else:
            if epoch is not None:
                self._ranks.join(name, Reading(job, loader, epoch, rank, world, Listed(key, len(self._list(key)), own)))
            # Stamped: its first report's share of time spent waiting counts from here.
            record.consumer = with_fraction(None, {"job": job, "rank": rank, "world": world}, "wait_s", "waiting")
            record.buffer = hello.buffer
            if back is not None:
                record.counted = dict(back.counted)  # its reports go on from there: nothing counted twice
            self._totals.add((job, str(rank)), record.counted, {})  # its rank is shown from now on
        record.plan.pidfd = self._processes.start(name, request.header.get("process"))
        if not again and not record.probe:
            event(
                log,
                "consumer_joined",
                "consumer %s joined job %r as rank %d of %d",
                name,
                job,
                rank,
                world,
                reader=name,
                job=job,
                rank=rank,
                world_size=world,
            )
        agents = self.list_id if claimed is not None else key  # the agent's list it reads, if it reads one
        listed = self._list(agents)
        return {
            "ok": True,
            "workers": self._workers,
            "prefetch": self._config.prefetch,
            "list_id": agents,
            "n_urls": len(listed),
            "local_urls": listed.local,  # (a loader reading it adds each local shard's path to its samples)
            # for direct reads (wdscache.training.direct)
            "cache_dir": str(self._cache.layout.root),
            "cache_root": self._cache_root,
            "warning": warning,
        }

    def op_put_urls(self, request: Request) -> Reply:
        """A page of a consumer's own list, before its hello names it."""
        return self._lists.put_page(request.header["reader"], request.header) or {"ok": True, "error": None}

    def op_get_urls(self, request: Request) -> Reply:
        """A page of the list the reader said hello on, even if the file changed since."""
        header = request.header
        record = self._readers.get(header["reader"])
        offset = get_field(header, "offset", int)
        named = get_field(header, "list_id", str, None)  # (a len() reads its list after its bye)
        claimed = record.plan.list_id if record is not None else named if named and self._holds(named) else None
        listed = claimed if claimed is not None else self.list_id
        page = self._list(listed).urls.page(max(0, offset), PAGE_BYTES)
        return {"ok": True, "list_id": listed, "urls": page}

    def op_report(self, request: Request) -> Reply:
        """A consumer's progress, for stats."""
        name = request.header["reader"]
        figures = numbers(request.header, REPORT_FIELDS)
        record = self._readers.get(name)
        if record is not None:
            self._record(record, figures)
        return {"ok": True} if record is not None else {"ok": False, "error": "unknown reader; say hello first"}

    def op_ping(self, request: Request) -> Reply:
        """A sign of life; one with a report's fields (a ``ShardListDataset`` session's, which
        has no report thread) is its consumer's report too, so stats show it reading."""
        figures = numbers(request.header, REPORT_FIELDS)  # checked first: a malformed ping changes nothing
        record = self._readers.get(request.header["reader"])
        if figures and record is not None and record.consumer is not None:
            self._record(record, figures)
        return {"ok": True, "known": record is not None}

    def op_bye(self, request: Request) -> Reply:
        """A reader leaves. A consumer's bye carries its report's fields, so that the totals it
        leaves with are final even where its last stretch (or all of a short epoch) fell between
        reports; a bye without them leaves the last report's. It may say the error that ended its
        epoch (kept with its rank in ``ended_jobs``)."""
        name = request.header["reader"]
        figures = numbers(request.header, REPORT_FIELDS)  # checked first: a malformed bye changes nothing
        end = _end_error(request.header)
        record = self._readers.get(name)
        if figures and record is not None and record.consumer is not None:
            self._record(record, figures)
        if record is not None and record.consumer is not None:
            record.consumer.update(end)
        elif record is None:  # dropped as silent, it never said hello again: its totals still count
            self._ended.said_bye(name, figures, self._totals.add, end)
        self.drop(name)
        return {"ok": True}

    def _record(self, record: ReaderRecord, figures: dict[str, float]) -> None:
        """A report's ``figures`` as the stats of the reader's consumer, and counted in its rank's totals."""
        known = record.consumer or {}
        report = {"job": known.get("job"), "rank": known.get("rank"), "world": known.get("world"), **figures}
        if known.get("job") is not None:  # (not a probe's, nor a plain client's: they said no job)
            self._totals.add((str(known["job"]), str(known.get("rank"))), record.counted, figures)
        record.consumer = with_fraction(known, report, "wait_s", "waiting")

    # -- going ------------------------------------------------------------------

    def drop(self, name: str, why: str | None = " said bye", *, silent: Silence | None = None) -> None:
        """Reader ``name`` goes (said bye, said hello again (``why`` None), or went away, or
        ``silent``: then it may come back); ``why`` follows its name in the log line."""
        self._lists.drop_upload(name)
        self._jobs.leave(name)
        self._ranks.leave(name)
        record = self._readers.pop(name, None)
        if record is None:
            return
        if record.plan.pidfd >= 0:
            self._processes.stop(record.plan.pidfd)
        self._gone(name)
        consumer = record.consumer
        if why is None or record.probe:
            return
        _log_gone(name, why, consumer, silent)
        if consumer is None:  # a plain client
            return
        # Kept for stats a while (ended_jobs), with its totals; one dropped as silent may come back;
        # one whose process ended without a bye (killed, crashed mid-epoch) is named while its job reads on.
        gone = why == _PROCESS_ENDED
        self._ended.left(name, {**consumer, "_launch": record.launch, "gone": gone}, record.dropped(silent))

    def expire(self) -> None:
        """Drop readers whose process ended or that went silent; free the lists nobody reads, and
        the kept partials no list names."""
        for name in self._processes.ended():
            self.drop(name, why=_PROCESS_ENDED)
        now = time.monotonic()
        for name, record in list(self._readers.items()):
            quiet = now - record.plan.last_seen
            if quiet > self._config.reader_timeout:
                self.drop(name, why=f" silent for {quiet:.0f}s (--reader-timeout)", silent=Silence.TIMED_OUT)
        self._ended.expire(now)
        self._totals.expire(lambda: {(str(c.get("job")), str(c.get("rank"))) for c in self._consumers().values()})
        self._jobs.forget({str(c.get("job")) for c in self._consumers().values()})
        self._lists.free(self._read_lists())
        self._unnamed.check(now)

    def let_go_idle(self, held: Callable[[str], int]) -> None:
        """A reader waits for room that pins hold: drop, as after ``--reader-timeout``, the
        random-access reader silent longest of those silent for :data:`IDLE_LET_GO` that hold pins
        (``held(name)``: how many shards reader ``name`` holds open); none if one was dropped less
        than :data:`IDLE_LET_GO_EVERY` ago. It pins its shards again at its next read (its ping
        finds it dropped: it closes its files and says hello again)."""
        now = time.monotonic()
        if now - self._idle_dropped_at >= IDLE_LET_GO_EVERY and (idle := _longest_idle(self._readers, held, now)):
            quiet, name = idle
            self._idle_dropped_at = now
            why = f" idle for {quiet:.0f}s while a reader waits for room its pins hold"
            self.drop(name, why=why, silent=Silence.IDLE)

    def close(self) -> None:
        """Stop watching processes (at shutdown)."""
        self._processes.close()

    # -- jobs and lists -----------------------------------------------------------

    def _holds(self, key: str) -> bool:
        """Whether the list ``key`` names is the agent's or one it keeps."""
        return key == self.list_id or key in self._lists

    def _read_lists(self) -> set[str | None]:
        """The ids of the lists read: by a reader, or by a job's epoch that more readers may join."""
        return {r.list_id for r in self._plans()} | self._jobs.lists() | self._ended.lists()

    def _consumers(self) -> dict[str, dict[str, Any]]:
        """The consumers (readers that said hello, probes left out) by name: their job, rank and last report."""
        return {n: r.consumer for n, r in self._readers.items() if r.consumer is not None}

    def fetchable(self, url: str) -> bool:
        """May a client of this endpoint have ``url`` fetched: in the agent's list, or a URL of a scheme
        its clients may use (:attr:`JobLists.schemes`) that holds no white space but an ``s3://`` key's."""
        return self.position(url) is not None or (
            url.startswith(self._lists.schemes) and whitespace_problem(url) is None
        )

    def _list(self, key: str | None) -> UrlList:
        """The list ``key`` names: one kept in ``_lists``, else the agent's current list."""
        return self._lists.get(key, self.urls) if key is not None else self.urls

    def replace_list(self, new: UrlList) -> None:
        """The agent's list file changed to ``new``. Epochs under way finish on the list they
        started with; the next ones take the new one."""
        if self.list_id in self._read_lists():
            self._lists.keep(self.list_id, self.urls)
        self.urls, self._window_at = new, {}
        self.list_id = list_id(new.urls)
        # Positions in the agent's list refer to the old list: those readers start over on
        # the new one. Readers keep their pins and their own windows.
        for r in self._plans():
            if r.ahead is None:
                r.n_shards, r.position = len(new), 0
        self._startup = self._startup_plan(new)
        self._startup_stopped = False
        self._startup_left = set()

    def _startup_plan(self, urls: UrlList) -> Reader:
        """The start-up plan over ``urls`` (on a node of several, from its shards' counts)."""
        counts = [self.samples(u) for u in urls.urls] if self._config.num_nodes > 1 else None
        return startup_reader(len(urls), self._config, counts)

    def read_by_a_consumer(self, url: str) -> bool:
        """True if a reader that said hello reads a list holding ``url``."""
        return any(r.list_id is not None and self._in_list(url, r.list_id) for r in self._plans())

    # -- what they need -------------------------------------------------------------

    def check_need(self, held: Callable[[str], int], again: str | None = None) -> None:
        """Warn when the readers need more bytes at once than the budget holds (see :meth:`need`);
        ``held(name)``: how many shards reader ``name`` holds open.

        Called at each hello and each re-download (``again``); warns once, and again only
        for a larger need.
        """
        self._need.warn(*self.need(held), again=again)

    def need(self, held: Callable[[str], int]) -> tuple[int, str]:
        """Bytes the readers hold at once, and how (:meth:`BudgetNeed.of`)."""
        readers = [
            (name, str((record.consumer or {}).get("job", name)), record.buffer, record.plan.list_id or self.list_id)
            for name, record in self._readers.items()
            if name != STARTUP_READER
        ]
        return self._need.of(readers, {key: self._list(key).urls for *_, key in readers}, held, self.known)

    # -- for stats --------------------------------------------------------------------

    def job_of(self, name: str) -> str | None:
        """The job reader ``name`` said it reads for (None: none, or no such reader)."""
        record = self._readers.get(name)
        job = (record.consumer or {}).get("job") if record is not None else None
        return None if job is None else str(job)

    def view(self, starved_by: Callable[[str], str]) -> dict[str, Any]:
        """The consumers, their jobs and the lists kept, for the stats reply (``starved_by(job)``:
        what a starved rank of ``job`` waits for)."""
        consumers = self._consumers()
        return {
            "consumers": len(consumers),
            "job_lists": len(self._lists),
            "jobs": jobs_view(consumers, starved_by),
            "ended_jobs": self._ended.view(),
            "rank_totals": self._totals.view(),
        }


def _log_gone(name: str, why: str, consumer: dict[str, Any] | None, silent: Silence | None) -> None:
    """Log that reader ``name`` (a consumer, or a plain client) went, ``why`` after its name."""
    # A timeout is news (a process stopped or hung); an idle reader let go of is routine.
    level = logging.WARNING if silent is Silence.TIMED_OUT else logging.INFO
    if consumer is None:
        log.log(level, "reader %s%s; releasing its shards", name, why)
        return
    samples = int(consumer.get("samples", 0))
    event(
        log,
        "consumer_left" if silent is None else silent.value,
        "reader %s%s; releasing its shards (job %r, rank %s, %d samples)",
        name,
        why,
        consumer.get("job"),
        consumer.get("rank"),
        samples,
        level=level,
        reader=name,
        job=consumer.get("job"),
        rank=consumer.get("rank"),
        why=why.strip(" :"),
        samples=samples,
    )


@dataclass(frozen=True, slots=True)
class _Hello:
    """A hello's fields, checked before anything changes (:func:`_hello_of`)."""

    name: str
    job: str
    world: int
    rank: int
    epoch: int | None
    buffer: int  # its shuffle buffer (a loader's -1 is none, as ever)
    claimed: str | None  # the list it names (its own), if any
    probe: bool  # not a rank reading: neither joins nor leaves the job
    random_access: bool  # a ShardListDataset's session (see let_go_idle)
    loader: int  # the loader's number in its process
    launch: str | None  # the run of the training script it is part of


def _hello_of(header: dict[str, Any]) -> _Hello | Reply:
    """The fields of a hello, or the reply that refuses it (a value out of bounds, another
    protocol); ProtocolError for a field of the wrong type."""
    name, world, rank = header["reader"], get_field(header, "world_size", int), get_field(header, "rank", int)
    job = get_field(header, "job", str)
    if not 0 <= rank < world:
        return {"ok": False, "error": f"rank {rank} is not in [0, {world})"}
    epoch = get_field(header, "epoch", int, None)
    buffer = max(0, get_field(header, "shuffle_buffer", int, 0))
    for what, value in (("world_size", world), ("epoch", epoch or 0), ("shuffle_buffer", buffer)):
        if not 0 <= value <= HELLO_MAX:
            return {"ok": False, "error": f"{what} {value} is not in [0, {HELLO_MAX}]"}
    if not name:
        return {"ok": False, "error": "a reader's name is empty"}
    said = header.get("protocol")
    if said != PROTOCOL:
        return {"ok": False, "error": f"it speaks {speaks(said)}, the agent {speaks(PROTOCOL)}; {SAME_INSTALL}"}
    return _Hello(
        name,
        job,
        world,
        rank,
        epoch,
        buffer,
        claimed=get_field(header, "list_id", str, None),
        probe=header.get("probe") is True,
        random_access=get_field(header, "random_access", bool, False),
        loader=get_field(header, "loader", int, 0),
        launch=get_field(header, "launch", str, None),
    )


def _longest_idle(readers: dict[str, ReaderRecord], held: Callable[[str], int], now: float) -> tuple[float, str] | None:
    """(seconds silent, name) of the random-access reader silent longest of those silent for
    :data:`IDLE_LET_GO` that hold pins (``held``); None if there is none."""
    idle = [
        (now - record.plan.last_seen, name)
        for name, record in readers.items()
        if record.random_access and now - record.plan.last_seen > IDLE_LET_GO and held(name)
    ]
    return max(idle) if idle else None


def _end_error(header: dict[str, Any]) -> dict[str, str]:
    """The error a bye says ended its consumer's epoch (``end_error``), redacted again (the agent's
    stats are shown to anyone on the machine); {} when it says none."""
    error = get_field(header, "end_error", str, None)
    # (Ours send no more than END_ERROR_MAX: cut first, so that a long one costs the loop no time.)
    return {} if error is None else {"end_error": redact_urls(error[:END_ERROR_MAX])}
