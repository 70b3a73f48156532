"""``CachedMultiLoader``: the training-side iterator over samples served by the agent.

Each rank computes its epoch's global sequence itself (:mod:`wdscache.sequence`)
from the URL list, the seeds and the per-shard sample counts, and reads its
share of the positions (blocks of neighbouring positions, see
:class:`~wdscache.sequence.RankShare`) from the agent's workers. Ranks never wait for each
other, so no rank can hang on another; they agree because the sequence is a
pure function of inputs they share. A shard still downloading enters the
sequence sample by sample as its download brings them (the workers read its
complete samples from the partial file), so a cold start does not wait for
whole shards; only when its ids come out depends on timing, never which.

Guarantees (for the ranks of one job with the same settings):

- every epoch delivers each sample exactly once, plus at most ``W-1`` padding
  repeats (or none, with ``drop_last``), and every rank the same number. With
  ``on_error="skip"`` a sample that cannot be read (its shard failed or is
  damaged) is replaced by a repeat of one the rank did read, so the counts stay
  equal; every sample of every healthy shard is still delivered. A shard whose
  download fails while it is streamed ends where it failed, which can differ
  between ranks (only then can their counts differ);
- no wait lasts longer than ``timeout`` seconds without progress (a sample, or
  bytes arriving for a shard waited for): then the error names the reason the
  agent gives (a failed download, no room in the cache, no answer);
- the same inputs give the same per-rank sequences whatever the number of agent
  workers, the timing or the machine load;
- ``state_dict()`` of any rank resumes the job, with any world size, at exactly
  the samples not yet delivered;
- memory is bounded: at most ``inflight`` requests of ``request_size`` samples
  (and, once replies show the sample size, of about REQUEST_BYTES of payload)
  are outstanding; a consumer that stops reading stops asking.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import pickle
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import zmq

from .client import AgentConnection, resolve_endpoint, start_hint
from .direct import CacheFiles, FileRange, StaleFile
from .errors import AgentUnavailableError, FetchError, NotTrustedError, ProtocolError, ShardError, WdsCacheError
from .malloc import tune_malloc
from .protocol import WorkerProofs, pack, pages, process_identity, same_secret, unpack
from .s3 import Listing
from .sequence import EpochSpec, RankShare, Resume, SampleId, global_sequence, rank_length
from .private import PrivateAgent
from .urls import format_url_list, list_id, parse_url_list, read_url_list

log = logging.getLogger(__name__)

REPORT_EVERY = 1.0
REPORT_TIMEOUT = 1.0  # reports are advisory: one the agent does not answer soon is skipped
MAX_RESENDS = 3  # a request no worker answers this often fails instead of retrying forever
STREAM_POLL = 0.005  # seconds between looks at a shard still downloading, while nothing else arrives
STATUS_EVERY = 1.0  # seconds between asking the agent how a download we stream from is going
PENDING_RETRY = 0.05  # seconds before asking again for samples a restarted download does not hold yet
# Payload a request asks for once replies show the sample size: each request costs messaging
# on both sides, so small samples go many to a request, while the bytes in flight bound a
# consumer's memory.
REQUEST_BYTES = 4 << 20
FIRST_REQUEST = 32  # samples a request asks for before that
_END = object()
MAX_STALE = 8  # direct reads in a row finding a file replaced: past this we do not see the agent's files
STATE_VERSION = 2  # 2 added "done"; a version 1 state is read as one without it


@dataclass
class _Read:
    """A read sent to a worker. ``sent`` indexes the items asked for; the others are holes
    (their shard was skipped), filled with repeats when the samples are handed out."""

    items: list[tuple[int, SampleId]]
    sent: Sequence[int]  # range(len(items)) when no item is a hole
    at: float
    rid: str
    worker: int
    direct: bool

    def sent_items(self) -> list[tuple[int, SampleId]]:
        if len(self.sent) == len(self.items):
            return self.items
        return [self.items[i] for i in self.sent]


@dataclass(frozen=True)
class Tuning:
    """The loader's performance knobs, in one place: none changes which samples an epoch
    delivers, their order or a checkpoint (``zero_copy`` changes the payloads' type only).
    Pass ``CachedMultiLoader(tuning=Tuning(...))``, or a knob by name as a keyword of its own.

    - ``request_size``: samples at most per request to a worker (fewer once replies show the
      sample size: a request asks for about REQUEST_BYTES of payload, so small samples go many
      to a request and large ones few).
    - ``inflight``: requests outstanding at most, the consumer's memory bound (None: twice the
      agent's workers, at least 4).
    - ``zero_copy``: payloads as read-only memoryviews instead of ``bytes`` (faster; not for
      webdataset's decoders; a view keeps the whole message it came in alive, up to
      ``request_size`` samples). It implies that the workers send every byte.
    - ``direct_reads``: copy payloads straight from the agent's cache files when this process
      may read them (one copy per byte instead of three; see :mod:`wdscache.direct`); False has
      the workers send every byte, as they do anyway for a shard still downloading.
    - ``tune_malloc``: keep glibc from handing freed sample memory back to the kernel (see
      :mod:`wdscache.malloc`). It changes the allocator of the whole process; False leaves it be.
    """

    request_size: int = 128
    inflight: int | None = None
    zero_copy: bool = False
    direct_reads: bool = True
    # On by default although it is process-wide, because the loader's own cost depends on it:
    # glibc hands a freed payload or message of ~100 KB+ back to the kernel, so the next one
    # page-faults fresh pages in, about 100,000 faults per GB of samples. Measured on 110 KB
    # samples, warm: a consumer's CPU per GB halves with it (direct reads, the default path)
    # and falls by a third when streamed (wdscache/malloc.py).
    tune_malloc: bool = True


_TUNING_KNOBS = frozenset(f.name for f in dataclasses.fields(Tuning))


def _env_defaults() -> dict[str, Any]:
    """Defaults a training launcher provides (torchrun sets RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID)."""
    env = os.environ
    return {
        "rank": int(env.get("RANK", 0)),
        "world_size": int(env.get("WORLD_SIZE", 1)),
        "job": env.get("TORCHELASTIC_RUN_ID") or "default",
        "cache_dir": env.get("WDSCACHE_CACHE_DIR"),
        "endpoint": env.get("WDSCACHE_ENDPOINT"),
        # The agent's token (CACHE_DIR/token), for a consumer that cannot read the cache directory.
        "token": env.get("WDSCACHE_TOKEN") or None,
    }


def default_collate(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """A batch as a dict of lists, one list per field."""
    out: dict[str, list[Any]] = {}
    for sample in samples:
        for k, v in sample.items():
            out.setdefault(k, []).append(v)
    return out


class CachedMultiLoader:
    """Iterate samples of a WebDataset through the local wdscache agent.

    ``urls``: None streams the agent's own list; a list file or a list of URLs
    asks the agent to take that list up for this job. Each ``iter()`` is one
    epoch; the next one follows unless :meth:`set_epoch` says otherwise.

    Beyond webdataset's options: ``on_error`` ("raise" or "skip"), and ``map=fn`` with
    ``workers=k`` to run ``fn`` on each sample in ``k`` processes (order kept). Those
    processes start fresh (multiprocessing's "forkserver", or "spawn" where there is none),
    not as forks of this process and its ZeroMQ threads, so ``fn`` must be picklable: a
    function defined at module level (or a ``functools.partial`` of one), as for torch's
    DataLoader workers under "spawn"; a lambda or a nested function is refused here.

    The performance knobs are one :class:`Tuning` (``tuning=``); each is also accepted as a
    keyword of its own (``request_size=64`` is ``tuning=Tuning(request_size=64)``), which wins
    over the same knob of ``tuning``.
    """

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        endpoint: str | None = None,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        batch_size: int | None = None,
        collate: Callable[[list[dict[str, Any]]], Any] | None = None,
        map: Callable[[dict[str, Any]], Any] | None = None,  # noqa: A002 (the documented name)
        workers: int = 0,
        drop_last: bool = False,
        timeout: float = 60.0,
        on_error: str = "raise",
        tuning: Tuning | None = None,
        **knobs: Any,
    ) -> None:
        unknown = sorted(set(knobs) - _TUNING_KNOBS)
        if unknown:
            raise TypeError(f"CachedMultiLoader() got unexpected keyword arguments {unknown}; "
                            f"its tuning knobs are {sorted(_TUNING_KNOBS)}")
        self.tuning = dataclasses.replace(tuning or Tuning(), **knobs)
        if map is not None and workers > 0:
            _check_picklable(map)
        env = _env_defaults()
        self.cache_dir = cache_dir if cache_dir is not None else env["cache_dir"]
        self.endpoint = resolve_endpoint(self.cache_dir, endpoint or env["endpoint"])
        self.job = job or env["job"]
        self.rank = env["rank"] if rank is None else rank
        self.world_size = env["world_size"] if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if on_error not in ("raise", "skip"):
            raise ValueError("on_error must be 'raise' or 'skip'")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.batch_size, self.collate = batch_size, collate or default_collate
        self.map_fn, self.workers = map, workers
        self.drop_last, self.timeout, self.on_error = drop_last, timeout, on_error
        self.urls = _normalize_urls(urls)
        self._own_list_id = list_id(self.urls) if self.urls is not None else None
        self._agent_lists: dict[str, tuple[str, ...]] = {}
        self._private_agent: PrivateAgent | None = None
        self._own_endpoint = endpoint is None and env["endpoint"] is None
        self._token = env["token"]
        self._epoch = 0
        self._start = Resume()  # what the next epoch has delivered already (a checkpoint's)
        self._current: _Stream | None = None
        self._resumed_from: dict[str, Any] | None = None
        self._direct_off: str | None = None  # why direct reads failed, once they did: not tried again

    # -- epochs and checkpoints ---------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``, from its start."""
        self._epoch, self._start = epoch, Resume()

    def state_dict(self) -> dict[str, Any]:
        """The job's position: any one rank's dict resumes every rank, with any world size."""
        if self._current is not None and not self._current.complete:
            epoch, at = self._current.spec.epoch, self._current.resume()
        else:
            epoch, at = self._epoch, self._start
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": at.position,  # every position before it was delivered...
            "done": [list(run) for run in at.done],  # ...and these runs after it
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "urls": self._current.list_id if self._current is not None else self._own_list_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state`` (from :meth:`state_dict` of any rank of the stopped job)."""
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"unsupported wdscache state version {state.get('version')!r}")
        for name in ("seed", "shuffle", "shuffle_buffer", "drop_last"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"checkpoint has {name}={state[name]!r} but this loader {name}={getattr(self, name)!r}; "
                    "the sequence would differ, so resuming would repeat or skip samples"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not (_natural(epoch) and _natural(position)):
            raise ValueError(f"checkpoint needs whole numbers >= 0 for 'epoch' and 'position', not {epoch!r}, "
                             f"{position!r}")
        done = state.get("done", []) if state["version"] > 1 else []
        if not (isinstance(done, list) and all(isinstance(run, list) and len(run) == 2 and all(map(_natural, run))
                                               and run[0] < run[1] for run in done)):
            raise ValueError(f"checkpoint 'done' must be a list of [start, end] position pairs, start < end; "
                             f"got {done!r}")
        self._epoch, self._start = epoch, Resume.of(position, done)
        self._resumed_from = state

    def _session(self, conn: AgentConnection, name: str) -> tuple[dict[str, Any], Sequence[str]]:
        """Say hello to the agent as reader ``name``; returns the reply and the URL list in use.

        Lists go in pages and are cached by their id, so each is sent once per loader.
        """
        # The process, so that an agent on this machine notices at once when it ends (a SIGKILL).
        request: dict[str, Any] = {"op": "hello", "reader": name, "job": self.job, "rank": self.rank,
                                   "world_size": self.world_size, "process": process_identity(),
                                   # the agent warns when pins on the shards it spans outgrow the budget
                                   "shuffle_buffer": self.shuffle_buffer if self.shuffle else 0}
        if self.urls is not None:
            request["list_id"] = self._own_list_id
        hello = conn.request(request)
        if hello.get("need_urls") and self.urls is not None:
            for offset, chunk in pages(self.urls):
                page = conn.request({"op": "put_urls", "reader": name, "offset": offset, "urls": chunk})
                if not page.get("ok"):
                    raise WdsCacheError(f"the agent at {self.endpoint} refused the URL list: {page.get('error')}")
            hello = conn.request(request)
        if not hello.get("ok"):
            raise WdsCacheError(f"the agent at {self.endpoint} refused this consumer: {hello.get('error')}")
        if self.urls is not None:
            return hello, self.urls
        key = str(hello.get("list_id"))
        if key not in self._agent_lists:
            urls: list[str] = []
            while len(urls) < int(hello.get("n_urls", 0)):
                page = conn.request({"op": "get_urls", "reader": name, "offset": len(urls)})
                if page.get("list_id") != key or not page.get("urls"):
                    raise WdsCacheError("the agent's URL list changed while it was being read; try again")
                urls.extend(page["urls"])
            self._agent_lists = {key: tuple(urls)}  # the latest list only
        return hello, self._agent_lists[key]

    # -- iteration ----------------------------------------------------------

    def close(self) -> None:
        """Stop using the private agent, if this loader used one: it stops once no loader does
        (the cache stays). Also done when the loader is garbage, and at interpreter exit."""
        if self._private_agent is not None:
            self._private_agent.release()
            self._private_agent = None

    def __enter__(self) -> "CachedMultiLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_agent(self) -> None:
        """With a list and a cache directory but no real agent there, use a private one (a notebook):
        join the one another loader started, or start it (see :mod:`wdscache.private`)."""
        if self._private_agent is not None or self.urls is None or self.cache_dir is None:
            return
        if not self._own_endpoint:
            return
        self._private_agent = PrivateAgent.use(self.cache_dir, self.urls, timeout=self.timeout)

    def __iter__(self) -> Iterator[Any]:
        self._ensure_agent()
        if self.tuning.tune_malloc:
            tune_malloc()
        epoch, start = self._epoch, self._start
        self._epoch, self._start = epoch + 1, Resume()
        stream = _Stream(self, epoch, start)
        self._current = stream
        if self._resumed_from is not None and self._resumed_from.get("urls") not in (None, stream.list_id):
            stream.close()
            raise ValueError("the checkpoint was taken on another URL list; resuming would mix datasets")
        self._resumed_from = None
        items: Iterator[Any] = stream.samples()
        if self.map_fn is not None:
            items = _mapped(items, self.map_fn, self.workers)
        if self.batch_size is None:
            return _delivered(stream, ((1, item) for item in items))
        return _delivered(stream, _batched(items, self.batch_size, self.collate))

    def _connection(self, timeout: float) -> AgentConnection:
        """A connection to the agent, which must prove it holds our cache directory's token."""
        return AgentConnection(self.endpoint, timeout=timeout, hint=start_hint(self.cache_dir),
                               cache_dir=self.cache_dir, token=self._token)

    def __len__(self) -> int:
        """Samples (or batches) per rank in the next epoch; TypeError while some shard was never read."""
        conn = self._connection(self.timeout)
        name = f"len-{uuid.uuid4().hex[:8]}"
        try:
            _, urls = self._session(conn, name)
            conn.request({"op": "bye", "reader": name})
            counts = _agent_counts(conn, urls)
        finally:
            conn.close()
        if not urls or any(c is None for c in counts):
            raise TypeError("length unknown until every shard has been read once")
        total = sum(counts)
        per_rank = rank_length(total - self._start.delivered(total), self.world_size, self.drop_last)
        if self.batch_size is None:
            return per_rank
        return -(-per_rank // self.batch_size)


def _agent_counts(conn: AgentConnection, urls: Sequence[str], timeout: float | None = None) -> list[Any]:
    """The agent's sample count of each of ``urls`` (None: never counted), asked in pages."""
    counts: list[Any] = []
    for _, chunk in pages(urls):
        counts.extend(conn.request({"op": "counts", "urls": chunk}, timeout=timeout).get("counts", []))
    return counts


def _natural(x: Any) -> bool:
    return type(x) is int and x >= 0


def _normalize_urls(urls: str | os.PathLike[str] | Sequence[str] | None) -> tuple[str, ...] | None:
    if urls is None:
        return None
    if isinstance(urls, (str, os.PathLike)):
        return read_url_list(urls, lister=Listing()).urls
    return parse_url_list(format_url_list(urls), base_dir=os.getcwd(), lister=Listing()).urls


class _Stream:
    """One epoch of one rank: the agent session, the worker sockets, and the sample pipeline."""

    def __init__(self, loader: CachedMultiLoader, epoch: int, start: Resume) -> None:
        self.loader = loader
        self.finished = False  # resources released
        self.complete = False  # every sample of the rank's share was delivered
        self.name = f"{loader.job}/{loader.rank}/{uuid.uuid4().hex[:8]}"
        self.conn = loader._connection(loader.timeout)
        try:
            hello, self.urls = loader._session(self.conn, self.name)
        except BaseException:
            self.conn.close()
            raise
        self.list_id = str(hello.get("list_id")) if loader.urls is None else loader._own_list_id
        self.prefetch = int(hello.get("prefetch", 8))
        self.spec = EpochSpec(len(self.urls), loader.seed, epoch, loader.shuffle, loader.shuffle_buffer)
        # A checkpoint's positions, from any world size: the rest are dealt to this job's ranks.
        self.share = RankShare(loader.world_size, loader.rank, resume=start, drop_last=loader.drop_last)
        self.delivered = 0  # samples handed to the user (not merely received: map/batch look ahead)
        self.order = self.spec.order()
        self.next_order = EpochSpec(len(self.urls), loader.seed, epoch + 1, loader.shuffle).order()
        self.order_pos = {shard: i for i, shard in enumerate(self.order)}
        self.counts: dict[int, int] = {}
        # Shards whose counts our workers found lately (url -> when): they report them to the
        # agent, and we wait for those reports before we say bye, so that len() knows them
        # once the epoch ends.
        self.learned: dict[str, float] = {}
        # Pinned shards -> number of our outstanding reads. A consumer that must wait for a
        # download first lets go of every other pin it is not reading (see _open), so pins
        # never deadlock the budget.
        self.opened: dict[int, int] = {}
        self.partial: set[int] = set()  # pinned while downloading: read as the download goes
        # shard -> ids not yet emitted by the global sequence (its count minus those emitted;
        # negative while a shard streams and its count is not known yet)
        self.remaining: dict[int, int] = {}
        self.seen = 0  # ids the sequence gave out
        self.unneeded: deque[tuple[int, int]] = deque()  # (seen, shard): its last id, to release once dealt
        self.skipped: set[int] = set()
        self.ctx = zmq.Context()
        # Payloads read from the cache files here (the agent says where they are), if we see
        # its very cache directory, unless a read of them fails: then the workers send them.
        direct = (loader.tuning.direct_reads and not loader.tuning.zero_copy and loader._direct_off is None
                  and _same_directory(hello))
        self.files = CacheFiles(hello["cache_dir"]) if direct else None
        self.stale = 0  # direct reads in a row that found a file replaced (see _accept)
        self.workers = [self._connect(ep) for ep in hello["workers"]]
        # Every request to a worker carries the proof of its id under that worker's key (it
        # refuses any without), and every reply of it the proof of its own: see protocol.py.
        self.endpoints: list[str] = list(hello["workers"])
        self.proofs = [WorkerProofs(self.conn.worker_key(i) or "") for i in range(len(self.workers))]
        self.unproved_warned = False
        if not self.workers:
            raise WdsCacheError(f"the agent at {loader.endpoint} has no workers")
        self.poller = zmq.Poller()
        for w in self.workers:
            self.poller.register(w, zmq.POLLIN)
        self.rr = itertools.count()
        self.pending: dict[int, _Read] = {}  # reads sent, by sequence number
        # Reads to send again: seq -> (items, when). Their shards are downloading and do not
        # hold those samples yet (the download started over), or were pinned again (see _recover).
        self.delayed: dict[int, tuple[list[tuple[int, SampleId]], float]] = {}
        self.unanswered_since: dict[int, float] = {}  # seq -> first "pending" answer
        self.reopen: dict[int, list[tuple[int, SampleId]]] = {}  # reads whose shard the worker did not find
        self.waits = 0  # opens that had to wait, letting go of our other pins
        self.last_status = 0.0
        self.done: dict[int, tuple[list[dict[str, Any]], list[int]]] = {}  # seq -> (samples, their payload bytes)
        self.rids: dict[str, int] = {}
        self.next_rid = itertools.count()  # request ids: unique within this stream (its own sockets)
        self.resends: dict[int, int] = {}
        self.batch: list[tuple[int, SampleId]] = []  # items of the next request, their shards pinned
        self.request_limit = min(loader.tuning.request_size, FIRST_REQUEST)  # samples per request, see _sized
        self.per_sample = 0.0  # payload bytes per sample of the latest replies, see _sized
        self.seq_next = 0
        self.calls: dict[str, dict[str, Any] | None] = {}  # rid -> reply of a _worker_call
        self.stats = {"samples": 0, "bytes": 0, "wait_s": 0.0, "repeated": 0}
        # The last moment something moved (a sample came, a download we wait for grew, the
        # user handed control back): no wait may outlast it by more than the timeout.
        self.progress_at = time.monotonic()
        self.written: dict[int, int] = {}  # bytes the agent said a download we wait for holds
        self.retried: set[int] = set()  # shards found damaged: the agent fetches them once more
        self.renewed: set[int] = set()  # of those, opened again since: damaged now, they fail
        self.to_report: dict[int, str] = {}  # of those, damage not yet told to the agent
        self.broken = False  # the epoch ended in an error: close quickly
        self._stop_reports = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="wdscache-report", daemon=True)
        self._reporter.start()

    def _connect(self, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    # -- shards ---------------------------------------------------------------

    def _known_counts(self, shards: Iterable[int]) -> None:
        want = [s for s in shards if s not in self.counts]
        if want:
            reply = self.conn.request({"op": "counts", "urls": [self.urls[s] for s in want]})
            for s, c in zip(want, reply.get("counts", [])):
                if isinstance(c, int):
                    self.counts[s] = c

    def shard_samples(self, shard: int) -> Iterator[int | None]:
        """Sample indices of ``shard`` for the sequence: all at once when its count is known
        (from the agent's index, or by scanning it), else as its download brings them."""
        if shard not in self.counts:
            pos = self.order_pos[shard]
            self._known_counts(self.order[pos : pos + 256])
        if shard not in self.counts:
            self._open(shard, stream=True)
        if shard in self.partial:
            yield from self._stream(shard)
            return
        if shard not in self.counts:
            self.counts[shard] = self._scan(shard)
        self._counted(shard, self.counts[shard])
        yield from range(self.counts[shard])

    def _counted(self, shard: int, count: int) -> None:
        """``shard``'s count is final: once the sequence has emitted that many, we can let it go."""
        self.remaining[shard] = self.remaining.get(shard, 0) + count
        if not self.remaining[shard]:
            self.unneeded.append((self.seen, shard))  # its ids are all out: once dealt, let go

    def _stream(self, shard: int) -> Iterator[int | None]:
        """Indices of a shard still downloading, as the worker finds complete samples in it.

        Yields None while no more have arrived. The count is final once the worker
        finds the published file; a failed download ends the shard (``on_error``).
        """
        url, worker = self.urls[shard], shard % len(self.workers)
        known, asked = 0, time.monotonic()
        while True:
            reply = self._worker_call({"op": "scan", "url": url, "partial": True}, worker)
            if not reply.get("ok"):
                error: WdsCacheError = _shard_error(url, reply)
                break
            count = int(reply["count"])
            if count > known:
                self.progress_at = time.monotonic()
            yield from range(known, count)
            known = max(known, count)
            if reply.get("final"):
                self.partial.discard(shard)
                self.counts[shard] = known
                self.learned[url] = time.monotonic()
                self._counted(shard, known)
                return
            if time.monotonic() - asked > STATUS_EVERY:
                asked = time.monotonic()
                status = self.conn.request({"op": "status", "reader": self.name, "url": url}, timeout=self._left())
                if status.get("state") == "failed":
                    error = self._failure(shard, status)
                    break
                written = status.get("written")
                if isinstance(written, int) and written > self.written.get(shard, -1):
                    self.written[shard] = written
                    self.progress_at = time.monotonic()
                self._check_stall(lambda: (shard, status))
                if status.get("state") in ("queued", "unknown", "cached"):
                    # The download lost its budget or was forgotten (the agent restarted), or
                    # it is cached but the worker cannot see it (its file went): pin it again,
                    # waiting without other pins until it downloads with its budget again.
                    self._open(shard, again=True, stream=True)
            yield None
        self.partial.discard(shard)
        self._failed(shard, error)  # raises, or skips the rest of the shard
        self._counted(shard, known)

    def _ahead(self, shard: int) -> list[str]:
        pos = self.order_pos[shard]
        nxt = self.order[pos + 1 : pos + 1 + self.prefetch]
        nxt += self.next_order[: self.prefetch - len(nxt)]
        return [self.urls[s] for s in nxt]

    def _open(self, shard: int, *, again: bool = False, stream: bool = False) -> None:
        """Pin ``shard`` in the agent, waiting for its download if need be; moves our window.

        With ``stream`` (the sequence reaching a shard), a shard not cached yet is pinned
        as soon as its download holds its budget (``partial``) and read as it arrives.
        ``again``: the agent lost the shard (restarted, or its file
        went): give back the pin we think we hold and take a new one.
        """
        if shard in self.skipped or (shard in self.opened and not again):
            return
        url = self.urls[shard]
        if shard in self.opened:
            if self.files is not None:
                self.files.close(url)  # its file may be replaced before we read it again
            self.conn.request({"op": "release", "reader": self.name, "url": url})
        request = {"op": "open", "reader": self.name, "url": url, "ahead": self._ahead(shard), "wait": False,
                   "stream": stream}
        reply = self.conn.request(request)
        if not reply.get("ok") and reply.get("cached") is False:
            # We wait, for the download or for its budget: hold no other pins meanwhile, or
            # consumers could fill the budget with pins while each waits for space for the next
            # shard. What is batched so far goes out first (its shards are pinned), and we wait
            # for its answers; reads put off (see _recover) give their pins back too. (Once a
            # download holds its budget, pins cannot hold it up.)
            self._flush()
            for seq, (items, _) in list(self.delayed.items()):
                del self.delayed[seq]
                for _, (held, _) in items:
                    if held in self.opened and held not in self.skipped:  # as _read_failed counted them
                        self.opened[held] -= 1
                self.reopen[seq] = items
            self._drain()
            if self.files is not None:
                self.files.close(url)  # a reply drained may have opened it: we hold no pin while we wait
            for held in list(self.opened):
                if held != shard:
                    self._release(held, force=True)
            self.waits += 1
            request["wait"] = True
            probe = {"op": "status", "reader": self.name, "url": url}
            reply = self.conn.request_patiently(
                request, liveness=self.loader.timeout, probe=probe, every=min(STATUS_EVERY, self.loader.timeout / 4),
                on_probe=lambda status: self._waited(shard, status))
        if not reply.get("ok"):
            self._failed(shard, self._failure(shard, reply))
            return
        self.opened.setdefault(shard, 0)
        if reply.get("partial"):
            if shard not in self.counts:
                self.partial.add(shard)
        elif isinstance(reply.get("samples"), int):
            self.counts.setdefault(shard, reply["samples"])

    # -- progress and stalls ------------------------------------------------------

    def _waited(self, shard: int, status: dict[str, Any]) -> None:
        """What the agent says of a shard we wait for: bytes arriving are progress, and no
        progress for ``timeout`` seconds ends the wait (a failed download ends it with the
        agent's answer to the open itself)."""
        written = status.get("written")
        if isinstance(written, int) and written > self.written.get(shard, -1):
            self.written[shard] = written
            self.progress_at = time.monotonic()
        self._check_stall(lambda: (shard, status))

    def _check_stall(self, waited: Callable[[], tuple[int, dict[str, Any] | None]] | None = None) -> None:
        """Raise if nothing moved for ``timeout`` seconds; ``waited`` gives the shard waited
        for and what the agent said of it (asked here if it says nothing)."""
        timeout = self.loader.timeout
        if time.monotonic() - self.progress_at <= timeout:
            return
        shard, status = waited() if waited is not None else (self._waiting_on(), None)
        if shard is None:
            # Nothing of ours is downloading: our reads went unanswered. Is the agent there?
            self.conn.request({"op": "ping", "reader": self.name}, timeout=min(2.0, timeout))
            raise AgentUnavailableError(self.loader.endpoint, timeout, "its workers did not answer")
        url = self.urls[shard]
        if status is None:
            status = self.conn.request({"op": "status", "reader": self.name, "url": url},
                                       timeout=min(2.0, timeout))
        raise FetchError(url, f"no progress for {timeout:g}s: {_why(status)}")

    def _waiting_on(self) -> int | None:
        """A shard whose download this stream waits for, if any."""
        for shard in self.partial:
            return shard
        for entry in self.delayed.values():
            return entry[0][0][1][0]
        return None

    def _left(self) -> float:
        """Seconds until the wait in progress counts as a stall; at least one, so that a busy
        agent's answer near the end still counts."""
        return max(1.0, self.progress_at + self.loader.timeout - time.monotonic())

    def _release(self, shard: int, *, force: bool = False) -> None:
        """Unpin ``shard`` once we have no read of it outstanding and (unless forced) need it no more."""
        if self.opened.get(shard) == 0 and (force or self.remaining.get(shard, 1) == 0):
            del self.opened[shard]
            if self.files is not None:
                self.files.close(self.urls[shard])  # before the agent may evict it: its space comes back
            self.conn.request({"op": "release", "reader": self.name, "url": self.urls[shard]})

    def _scan(self, shard: int) -> int:
        if shard in self.skipped:
            return 0
        url = self.urls[shard]
        while True:
            reply = self._worker_call({"op": "scan", "url": url}, shard % len(self.workers))
            if reply.get("ok"):
                self.learned[url] = time.monotonic()
                return int(reply["count"])
            if reply.get("kind") == "missing":
                raise FetchError(url, "cache file vanished while pinned; is another process deleting files?")
            exc = _shard_error(url, reply)
            if reply.get("kind") != "corrupt" or shard in self.renewed:
                self._failed(shard, exc)
                return 0
            # A damaged copy: the agent fetches it once more; damaged again, the shard fails.
            self.retried.add(shard)
            log.warning("%s; reading it again from a new copy", exc)
            self._report_damage(shard, str(exc))
            self._open(shard, again=True)
            self.renewed.add(shard)
            if shard in self.skipped:
                return 0

    def _failed(self, shard: int, exc: WdsCacheError) -> None:
        """``shard`` cannot be read: raise ``exc``, or (``on_error="skip"``) skip the shard: its
        samples not yet read become holes, filled with repeats (see :meth:`_pipeline`)."""
        url = self.urls[shard]
        if self.files is not None:
            self.files.close(url)
        if isinstance(exc, ShardError):  # a failed download is already in the agent's stats
            self._report_damage(shard, str(exc))
        if self.loader.on_error == "raise":
            raise exc
        log.warning("skipping %s: %s", url, exc)
        self.skipped.add(shard)
        self.counts[shard] = 0
        if self.opened.pop(shard, None) is not None:  # reads of it still out keep their holes
            self.conn.request({"op": "release", "reader": self.name, "url": url}, timeout=self._left())

    def _failure(self, shard: int, reply: dict[str, Any]) -> WdsCacheError:
        """The error of a shard the agent failed: a ShardError once its copies were found
        damaged (the shard itself is bad), else a FetchError (its download failed)."""
        error = str(reply.get("error") or "download failed")
        if reply.get("damaged") is True:
            return ShardError(self.urls[shard], error)
        return FetchError(self.urls[shard], error)

    def _report_damage(self, shard: int, error: str) -> None:
        try:
            self.conn.request({"op": "corrupt", "url": self.urls[shard], "error": error},
                              timeout=min(5.0, self.loader.timeout))
        except AgentUnavailableError:
            pass

    def _worker_call(self, header: dict[str, Any], worker: int) -> dict[str, Any]:
        """One request to a worker; replies to our reads that arrive meanwhile are kept.

        Asked again every few seconds (a restarted worker lost it) while the agent answers.
        """
        while True:
            rid = f"c{next(self.next_rid)}"
            self.calls[rid] = None
            self.workers[worker].send_multipart(pack({**header, "id": rid, "auth": self.proofs[worker].request(rid)}))
            again = time.monotonic() + min(5.0, self.loader.timeout / 2)
            while self.calls[rid] is None and time.monotonic() < again:
                self._receive()
            reply = self.calls.pop(rid)
            if reply is not None:
                return reply
            self.conn.request({"op": "ping", "reader": self.name}, timeout=self._left())  # raises if the agent is gone
            if time.monotonic() - self.progress_at > self.loader.timeout:
                raise AgentUnavailableError(self.loader.endpoint, self.loader.timeout, "its worker did not answer")

    def resume(self) -> Resume:
        """Where the job stands, if every rank delivered as many samples as this one."""
        return self.share.resume_after(self.delivered)

    @property
    def progress(self) -> int:
        """Samples the job delivered this epoch, if every rank delivered as many as this one
        (for stats: cheap, and counts padding)."""
        return self.share.resume.delivered() + self.delivered * self.loader.world_size

    # -- the rank's share -------------------------------------------------------

    def _global(self) -> Iterator[SampleId | None]:
        # Runs once per id of the whole epoch, every rank's (a rank of four sees four ids for
        # each of its samples): kept to local names.
        share, remaining, unneeded = self.share, self.remaining, self.unneeded
        for sid in global_sequence(self.spec, self.shard_samples):
            if unneeded and unneeded[0][0] <= share.settled:  # per id: look before calling
                self._release_settled()
            if sid is not None:
                self.seen += 1
                shard = sid[0]
                left = remaining[shard] = remaining.get(shard, 0) - 1
                if not left:
                    # No rank needs it once the share has dealt this id: until then ours may
                    # wait in a row (and after that, our reads of it hold it: see _release).
                    unneeded.append((self.seen, shard))
            yield sid

    def _release_settled(self) -> None:
        while self.unneeded and self.unneeded[0][0] <= self.share.settled:
            self._release(self.unneeded.popleft()[1])

    def _owned(self) -> Iterator[tuple[int, SampleId] | None]:
        """(position, id) of this rank's samples not delivered before, padded or cut at the end
        (see :class:`~wdscache.sequence.RankShare`); None while a downloading shard has no
        more samples yet. Positions delivered before cost counts only, never payloads."""
        yield from self.share.pairs(self._global())
        self._release_settled()

    def samples(self) -> Iterator[dict[str, Any]]:
        try:
            yield from self._pipeline()
        except WdsCacheError:
            self.broken = True  # the agent may be gone: do not wait for it again on the way out
            raise
        finally:
            self.close()

    def _pipeline(self) -> Iterator[dict[str, Any]]:
        """The rank's samples in order. A hole (a sample of a shard skipped with
        ``on_error="skip"``) is filled with a repeat of the sample before it (of the first
        one read, for holes before it), so every rank keeps its count."""
        limit = self.loader.tuning.inflight or max(4, 2 * len(self.workers))
        owned = self._owned()
        seq_yield = 0
        exhausted = False
        last: dict[str, Any] | None = None  # the latest sample read, to repeat in a hole
        owed = 0  # holes before the first sample read
        while True:
            t0 = time.perf_counter()
            stalled = False
            if self.reopen or self.delayed:
                self._recover()
            while not exhausted and len(self.pending) + len(self.delayed) + len(self.done) < limit:
                item = next(owned, _END)
                if item is _END:
                    exhausted = True
                    self._flush()
                    break
                if item is None:
                    # A shard still downloading has no more samples yet: send what we have
                    # (the first sample goes out as soon as it is complete) and look again soon.
                    stalled = True
                    self._flush()
                    break
                self._add(item)
            if seq_yield == self.seq_next and exhausted:
                break
            if seq_yield not in self.done:
                self._receive(STREAM_POLL if stalled else 0.1)
                self.stats["wait_s"] += time.perf_counter() - t0
                self._check_stall()
                continue
            out, sizes = self.done.pop(seq_yield)
            seq_yield += 1
            self.stats["wait_s"] += time.perf_counter() - t0
            for sample, nbytes in zip(out, sizes):  # sizes from the reply: no pass over each sample
                if sample is None:
                    self.stats["repeated"] += 1
                    if last is None:
                        owed += 1
                        continue
                    sample = dict(last)
                self.stats["samples"] += 1
                self.stats["bytes"] += nbytes
                yield sample
                last = sample
                for _ in range(owed):
                    self.stats["samples"] += 1
                    yield dict(last)
                owed = 0
            self.progress_at = time.monotonic()  # the user's time between samples is no stall

    def _add(self, item: tuple[int, SampleId]) -> None:
        """Batch ``item``, its shard pinned; a batch only ever holds pinned shards.

        A request thus never needs more shards at once than are already pinned, so
        consumers competing for a small budget always make progress.
        """
        shard = item[1][0]
        self._open(shard)  # may flush the batch and wait, holding no pins meanwhile
        if shard not in self.skipped:
            self.opened[shard] += 1
        self.batch.append(item)  # a skipped shard's item is a hole, filled with a repeat
        if len(self.batch) >= self.request_limit:
            self._flush()

    def _flush(self) -> None:
        if self.batch:
            batch, self.batch = self.batch, []
            self._dispatch(self.seq_next, batch)
            self.seq_next += 1

    def _dispatch(self, seq: int, items: list[tuple[int, SampleId]], direct: bool = True) -> None:
        """Send the read of ``items`` (with direct reads if on and ``direct``)."""
        self.delayed.pop(seq, None)
        # Per request, on the hot path: no skipped shard (the usual case), no filtering.
        sent: Sequence[int] = ([i for i, (_, (shard, _)) in enumerate(items) if shard not in self.skipped]
                               if self.skipped else range(len(items)))
        if not sent:
            self.done[seq] = ([None] * len(items), [0] * len(items))
            return
        urls: list[str] = []
        index: dict[int, int] = {}
        wire = []
        for i in sent:
            shard, j = items[i][1]
            if shard not in index:
                index[shard] = len(urls)
                urls.append(self.urls[shard])
            wire.append([index[shard], j])
        w = next(self.rr) % len(self.workers)
        rid = f"r{next(self.next_rid)}"
        self.rids[rid] = seq
        direct = direct and self.files is not None
        self.pending[seq] = _Read(items, sent, time.monotonic(), rid, w, direct)
        request = {"op": "read", "id": rid, "auth": self.proofs[w].request(rid), "urls": urls, "items": wire}
        if direct:
            request["direct"] = True
        self.workers[w].send_multipart(pack(request))

    def _drain(self) -> None:
        """Wait for every outstanding read (their samples stay in ``done``).

        Reads put aside for :meth:`_recover` are not waited for: that needs the agent,
        and this is called while talking to it.
        """
        while self.pending:
            self._receive()
            self._check_stall()

    def _recover(self) -> None:
        """Reads that came back without their samples: pin lost shards again, give up on failed downloads."""
        while self.to_report:
            # Told before the shard is opened again, so that the agent fetches a new copy.
            shard, error = self.to_report.popitem()
            self._report_damage(shard, error)
        while self.reopen:
            seq, items = self.reopen.popitem()
            per_shard = Counter(sid[0] for _, sid in items if sid[0] not in self.skipped)
            again = set(per_shard)
            while True:
                waits = self.waits
                for shard in per_shard:
                    self._open(shard, again=shard in again)  # waits until cached; may raise (on_error="raise")
                    again.discard(shard)
                if self.waits == waits:
                    break  # all pinned at once (an open that had to wait let go of the others)
            for shard, n in per_shard.items():
                if shard not in self.skipped:
                    self.opened[shard] += n
                if shard in self.retried:
                    self.renewed.add(shard)  # opened since it was found damaged: a new copy
            self._dispatch(seq, items)
        now = time.monotonic()
        stuck = [seq for seq in self.delayed if now - self.unanswered_since.get(seq, now) > STATUS_EVERY]
        if not stuck or now - self.last_status < STATUS_EVERY:
            return
        # Reads waiting this long on a download: is it still going?
        self.last_status = now
        for seq in stuck:
            if seq not in self.delayed:
                continue  # an open that had to wait put it back for reopening
            items = self.delayed[seq][0]
            # A shard that fails here is let go by _failed; its items become holes.
            for shard in {sid[0] for _, sid in items if sid[0] not in self.skipped}:
                status = self.conn.request({"op": "status", "reader": self.name, "url": self.urls[shard]},
                                           timeout=self._left())
                if status.get("state") == "failed":
                    self._failed(shard, self._failure(shard, status))
                elif status.get("state") in ("queued", "unknown"):
                    self._open(shard, again=True)
                else:
                    self._waited(shard, status)

    def _receive(self, timeout: float = 0.1) -> None:
        """Take in worker replies (waiting up to ``timeout`` for one); resend lost requests."""
        events = dict(self.poller.poll(int(timeout * 1000)))
        for w, sock in enumerate(self.workers):
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._accept(frames, w)
        now = time.monotonic()
        for seq, (items, when) in list(self.delayed.items()):
            if now >= when:
                self._dispatch(seq, items)
        for seq, read in list(self.pending.items()):
            if now - read.at > min(self.loader.timeout / 2, 10.0):
                # The worker may have died with our request: ask another (or its replacement),
                # unless the agent itself is gone (then this raises a clear error within the
                # timeout, no hang).
                self.conn.request({"op": "ping", "reader": self.name}, timeout=self._left())
                self.resends[seq] = self.resends.get(seq, 0) + 1
                if self.resends[seq] > MAX_RESENDS:
                    url = self.urls[read.items[read.sent[0]][1][0]]
                    raise ShardError(url, f"no worker answered {MAX_RESENDS + 1} times; a worker may die reading it")
                log.info("request to worker %d timed out; resending", read.worker)
                del self.rids[read.rid]
                del self.pending[seq]
                self._dispatch(seq, read.items)

    def _accept(self, frames: list[Any], worker: int) -> None:
        """Take in a reply from the socket of ``worker``: one without that worker's proof is
        dropped before anything of it is used (as if lost: the request is sent again)."""
        try:
            header, payload = unpack(frames)
            proved = same_secret(header.get("proof"), self.proofs[worker].reply(header.get("id")))
        except ProtocolError:
            proved = False
        if not proved:
            if not self.unproved_warned:
                self.unproved_warned = True
                log.warning("a reply from %s without the worker's proof was dropped: another process may hold "
                            "that port", self.endpoints[worker])
            return
        if header.get("id") in self.calls:
            self.calls[header["id"]] = header
            return
        seq = self.rids.pop(str(header.get("id")), None)
        if seq is None or seq not in self.pending:
            return  # a late answer to a request we already sent again
        read = self.pending.pop(seq)
        items, direct = read.sent_items(), read.direct
        for _, (shard, _) in items:  # one count per item, as _add counted them
            if shard in self.opened:  # (a shard that failed meanwhile is let go already)
                self.opened[shard] -= 1
        if not header.get("ok"):
            self._read_failed(seq, read, header)
        else:
            self.unanswered_since.pop(seq, None)
            try:
                samples, sizes = self._samples(header, payload, items, direct)
                self.progress_at = time.monotonic()
                self._sized(sizes)
                if len(items) < len(read.items):  # holes where a skipped shard's items were
                    it = iter(zip(samples, sizes))
                    got = [next(it) if i in read.sent else (None, 0) for i in range(len(read.items))]
                    samples, sizes = [s for s, _ in got], [n for _, n in got]
                self.done[seq] = (samples, sizes)
                if direct:
                    self.stale = 0
            except OSError as exc:  # from a direct read only
                self.stale += isinstance(exc, StaleFile)
                if self.files is not None and (not isinstance(exc, StaleFile) or self.stale >= MAX_STALE):
                    # Not one file replaced meanwhile (that costs this read only): we cannot read
                    # the cache files, so the workers send the bytes from now on.
                    self.loader._direct_off = str(exc)  # the message, not the exception: it holds frames
                    log.warning("cannot read the cache files directly (%s); the workers send the bytes instead",
                                self.loader._direct_off)
                    self.files.close()
                    self.files = None
                for _, (shard, _) in items:
                    if shard in self.opened:
                        self.opened[shard] += 1  # still pinned: asked again, its bytes sent this time
                self._dispatch(seq, read.items, direct=False)
                return
        for shard in {sid[0] for _, sid in items}:
            self._release(shard)

    def _sized(self, sizes: list[int]) -> None:
        """Size the next requests by the payload per sample of the latest replies (about
        REQUEST_BYTES each): larger samples count at once, smaller ones as the estimate decays."""
        if sizes:
            self.per_sample = max(sum(sizes) / len(sizes), 0.75 * self.per_sample, 1.0)
            self.request_limit = max(1, min(self.loader.tuning.request_size, int(REQUEST_BYTES // self.per_sample)))

    def _samples(
        self, header: dict[str, Any], payload: list[Any], items: list, direct: bool
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """The samples of a worker's reply, and the payload bytes of each."""
        keys, exts, spans = header.get("keys"), header.get("exts"), header.get("spans")
        if not (isinstance(keys, list) and isinstance(exts, list) and isinstance(spans, list)
                and len(keys) == len(exts) == len(spans) == len(items)):
            raise ProtocolError("worker reply does not match the request")
        frames: list[Any] = [memoryview(f.buffer).toreadonly() for f in payload]
        if "files" in header:
            if not direct:
                raise ProtocolError("worker reply names file ranges this consumer did not ask for")
            frames += self._file_ranges(header["files"], items)
        samples = []
        sizes = []
        zero_copy, urls = self.loader.tuning.zero_copy, self.urls
        try:
            for (_, (shard, _)), key, names, span in zip(items, keys, exts, spans):
                # Checked enough that no reply can make us read outside its frames; a
                # non-number anywhere fails the slicing (TypeError) and so the reply.
                if len(span) != 1 + 2 * len(names) or min(span) < 0:
                    raise ProtocolError("worker reply has a bad span")
                frame = frames[span[0]]
                limit = len(frame)
                from_file = type(frame) is FileRange
                sample: dict[str, Any] = {"__key__": key, "__url__": urls[shard]}
                nbytes = 0
                i = 1
                for ext in names:
                    offset, size = span[i], span[i + 1]
                    i += 2
                    if offset + size > limit:
                        raise ProtocolError("worker reply has a span past its frame")
                    if from_file:
                        sample[ext] = frame.read(offset, size)
                    else:
                        # bytes by default (webdataset's decoders want bytes); zero_copy gives
                        # read-only memoryviews into the received message instead.
                        value = frame[offset : offset + size]
                        sample[ext] = value if zero_copy else value.tobytes()
                    nbytes += size
                samples.append(sample)
                sizes.append(nbytes)
        except (TypeError, IndexError):
            raise ProtocolError("worker reply has a bad span") from None
        return samples, sizes

    def _file_ranges(self, ranges: Any, items: list) -> list[FileRange]:
        """The byte ranges of cache files a reply names (``files``, see :mod:`wdscache.pool`)."""
        if self.files is None:  # a read sent before direct reads were turned off: asked again
            raise StaleFile(errno.ESTALE, "direct reads are off")
        if not isinstance(ranges, list):
            raise ProtocolError("worker reply has a bad file range")
        urls = [self.urls[shard] for shard in dict.fromkeys(sid[0] for _, sid in items)]  # as _dispatch
        views = []
        named: dict[int, list[int]] = {}
        for entry in ranges:
            # identity: device, inode, size, mtime (which may be before 1970)
            if not (isinstance(entry, list) and len(entry) == 7 and all(type(x) is int for x in entry)
                    and 0 <= entry[0] < len(urls) and min(entry[1:4]) >= 0):
                raise ProtocolError("worker reply has a bad file range")
            k, start, size, *identity = entry
            if named.setdefault(k, identity) != identity:
                raise ProtocolError("worker reply names two files for one shard")
            views.append(self.files.range(urls[k], identity, start, size))
        return views

    def _read_failed(self, seq: int, read: _Read, header: dict[str, Any]) -> None:
        items, kind = read.items, header.get("kind")
        if kind == "refused":  # not a shard's fault: never skipped
            raise NotTrustedError(f"a worker of the agent at {self.loader.endpoint} refused this consumer "
                                  f"(if the agent restarted meanwhile, start the epoch again): {header.get('error')}")
        if kind == "missing":
            # Evicted behind our back (the agent restarted and lost our pins, say): pin again,
            # which needs the agent, so not here (we may be inside a request to it): see _recover.
            self.reopen[seq] = items
            return
        if kind == "pending":
            # Read from a download that started over and has not got this far again yet.
            now = time.monotonic()
            self.unanswered_since.setdefault(seq, now)
            for _, (shard, _) in read.sent_items():
                if shard in self.opened:
                    self.opened[shard] += 1
            self.delayed[seq] = (items, now + PENDING_RETRY)
            return
        read_shards = {self.urls[sid[0]]: sid[0] for _, sid in read.sent_items()}
        shard = read_shards.get(str(header.get("url")))
        if shard is None:  # not one shard's fault (a bad request, a worker's bug): the whole read
            exc = _shard_error(self.urls[read.sent_items()[0][1][0]], header)
            if self.loader.on_error == "raise":
                raise exc
            log.warning("skipping %d samples: %s", len(items), exc)
            self.done[seq] = ([None] * len(items), [0] * len(items))
            return
        exc = _shard_error(self.urls[shard], header)
        if kind == "corrupt" and shard not in self.renewed:
            # A damaged copy: the agent fetches it once more (told in _recover, before we open
            # it again) and the read goes again; the new copy damaged too, the shard fails below.
            # (A read sent before we opened the new copy still meets the old one.)
            if shard not in self.retried:
                self.retried.add(shard)
                self.to_report[shard] = str(exc)
                log.warning("%s; reading it again from a new copy", exc)
            self.reopen[seq] = items
            return
        self._failed(shard, exc)  # raises with on_error="raise"
        for _, (other, _) in read.sent_items():
            if other in self.opened:
                self.opened[other] += 1
        self._dispatch(seq, items)  # the other shards' samples again; this one's are holes

    # -- reports and cleanup -----------------------------------------------------

    def _report_loop(self) -> None:
        # Its own socket: ZeroMQ sockets belong to one thread.
        conn = self.loader._connection(REPORT_TIMEOUT)
        last = (time.monotonic(), 0)
        try:
            while not self._stop_reports.wait(REPORT_EVERY):
                now, n = time.monotonic(), self.stats["samples"]
                rate = (n - last[1]) / (now - last[0])
                last = (now, n)
                try:
                    conn.request({"op": "report", "reader": self.name, "job": self.loader.job,
                                  "rank": self.loader.rank, "epoch": self.spec.epoch,
                                  "position": self.progress, "samples": n, "bytes": self.stats["bytes"],
                                  "rate": round(rate, 1), "wait_s": round(self.stats["wait_s"], 3)})
                except AgentUnavailableError:
                    continue
        finally:
            conn.close()

    def _await_counts(self, within: float = 1.0) -> None:
        """Wait (a little) until the agent holds the counts our workers found: their reports
        go by another socket than their replies to us, so they may arrive after our bye."""
        now = time.monotonic()
        deadline = now + within
        # Reports sent longer ago have arrived (or were dropped: they are advisory).
        missing = [url for url, when in self.learned.items() if now - when < within]
        while missing:
            counts = _agent_counts(self.conn, missing, timeout=2.0)
            missing = [url for url, count in zip(missing, counts) if count is None]
            if not missing or time.monotonic() > deadline:
                return  # past the deadline a report was dropped (they are advisory): len() learns it later
            time.sleep(0.01)

    def close(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.files is not None:
            self.files.close()  # before bye lets go of our pins
        self._stop_reports.set()
        self._reporter.join(REPORT_EVERY + REPORT_TIMEOUT + 1.0)
        try:
            if not self.broken:
                self._await_counts()
            self.conn.request({"op": "bye", "reader": self.name}, timeout=0.5 if self.broken else 2.0)
        except AgentUnavailableError:
            pass
        self.conn.close()
        for w in self.workers:
            w.close(0)
        self.ctx.term()


def _same_directory(hello: dict[str, Any]) -> bool:
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


def _why(status: dict[str, Any]) -> str:
    """Why a shard is not there yet, from the agent's status of it."""
    state = status.get("state")
    if state == "failed":
        return f"its download failed: {status.get('error')}"
    if status.get("reason"):
        return str(status["reason"])
    written, total = status.get("written"), status.get("total")
    if isinstance(written, int):
        of = f" of {total}" if isinstance(total, int) else ""
        return f"its download has {written}{of} bytes and gets no more"
    if state == "queued":
        return "its download waits for a connection"
    if state == "cached":
        return "it is cached, but the agent's workers did not answer"
    return f"the agent has no download of it ({state})"


def _shard_error(url: str, reply: dict[str, Any]) -> ShardError:
    offset = reply.get("offset")
    return ShardError(url, str(reply.get("reason") or reply.get("error")),
                      offset=offset if isinstance(offset, int) else None)


def _delivered(stream: _Stream, items: Iterator[tuple[int, Any]]) -> Iterator[Any]:
    """Yield items, counting the samples in each once the user has it (for state_dict)."""
    for n, item in items:
        stream.delivered += n
        yield item
    stream.complete = True


def _batched(items: Iterator[Any], size: int, collate: Callable[[list[Any]], Any]) -> Iterator[tuple[int, Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield size, collate(batch)
            batch = []
    if batch:
        yield len(batch), collate(batch)


def _check_picklable(fn: Callable[[Any], Any]) -> None:
    """Refuse, naming ``map=``, a function the pool's fresh processes could not be sent."""
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"map={fn!r} cannot be sent to the map worker processes ({exc}): with workers > 0, map= "
            "takes a picklable callable, such as a function defined at module level or a "
            "functools.partial of one (not a lambda or a nested function); workers=0 runs it in "
            "this process instead"
        ) from exc


def _start_method() -> str:
    """How the ``map=`` pool starts its processes: never "fork". The training process runs
    ZeroMQ's I/O threads (and often threads of its own); a fork copies their locks in whatever
    state they are, and a child can hang on one that no thread will ever release. "forkserver"
    forks from a clean single-threaded server process; "spawn" where there is none (Windows)."""
    import multiprocessing

    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _mapped(items: Iterator[Any], fn: Callable[[Any], Any], workers: int) -> Iterator[Any]:
    """``fn`` over ``items`` in ``workers`` processes (or inline), order kept, a bounded number ahead."""
    if workers <= 0:
        for item in items:
            yield fn(item)
        return
    import multiprocessing

    pool = multiprocessing.get_context(_start_method()).Pool(workers)
    try:
        ahead: deque[Any] = deque()
        for item in items:
            ahead.append(pool.apply_async(fn, (item,)))
            if len(ahead) >= 4 * workers:
                yield ahead.popleft().get(timeout=600)
        while ahead:
            yield ahead.popleft().get(timeout=600)
    finally:
        pool.terminate()
        pool.join()
