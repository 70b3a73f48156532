"""``CachedMultiLoader``: the training-side iterator over samples served by the agent.

Each rank computes its epoch's global sequence itself (:mod:`wdscache.shared.sequence`)
from the URL list, the seeds and the per-shard sample counts, and reads its
share of the positions (blocks of neighbouring positions, see
:class:`~wdscache.shared.sequence.RankShare`) from the agent's workers. Ranks never wait for each
other while they read, so no rank can hang on another; they agree because the sequence is a
pure function of inputs they share (on several nodes, under ``torch.distributed``, they check
that they do as an epoch starts). A shard still downloading enters the
sequence sample by sample as its download brings them (the workers read its
complete samples from the partial file), so a cold start does not wait for
whole shards; only when its ids come out depends on timing, never which.

Guarantees (for the ranks of one job with the same settings):

- every epoch delivers each sample exactly once, plus at most ``W-1`` padding
  repeats (or none, with ``drop_last``), and every rank the same number. With ``mix=``
  (or ``resampled=True``) an epoch is ``epoch_samples`` samples instead, each source its
  exact share (:mod:`wdscache.shared.mixture`), shared and resumed the same way. With
  ``on_error="skip"`` a sample that cannot be read (its shard failed or is
  damaged) is left out with one rank, and with several replaced by a repeat of one
  of the rank's recent samples, so the counts stay equal
  (:mod:`wdscache.training.holes`); every sample of every healthy shard is still
  delivered. A shard whose
  download fails while it is streamed ends where it failed, which can differ
  between ranks (only then can their counts differ);
- no wait lasts longer than ``timeout`` seconds without progress (a sample, or
  bytes arriving for a shard waited for): then the error names the reason the
  agent gives (a failed download, no room in the cache, no answer);
- the same inputs give the same per-rank sequences whatever the number of agent
  workers, the timing or the machine load;
- ``state_dict()`` of any rank resumes the job, with any world size, at exactly
  the samples not yet delivered;
- on several nodes under ``torch.distributed``, the ranks compare the lists their agents
  hold when the loader is made and as each epoch starts in the rank's own process
  (:mod:`wdscache.training.node_lists`): if they differ, every rank raises the same
  ``ConfigError`` instead of starting an epoch of unequal counts;
- an agent restarted mid-epoch (on the same cache directory, with the same list) is
  taken up where the epoch stands: the epoch still delivers each sample once. With
  no agent back within ``timeout``, the error says the agent died or restarted
  (:class:`wdscache.training.stream.EpochStream`, "the agent restarted");
- a loader made before its node's agent (a job and its agent started together: the cache
  directory exists, ``urls`` is not given) waits up to ``timeout`` for the agent, and talks
  to it once its socket is bound (:mod:`wdscache.shared.client`);
- memory is bounded: at most ``inflight`` requests of ``request_size`` samples
  (and of about 4 MiB of payload, :data:`wdscache.training.read_batches.REQUEST_BYTES`, from
  the first request on where the shard read is cached) are outstanding; a consumer that stops
  reading stops asking.

The epoch itself (one rank's requests, pins and reordering) is
:class:`wdscache.training.stream.EpochStream`; this module keeps the user's side:
settings, ``map=``, batching. Checkpoints are taken and read by
:mod:`wdscache.training.checkpoints`, and a reader's hello to the agent is
:mod:`wdscache.training.hello`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import pickle
import signal
import sys
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any
from urllib.parse import urlsplit

from ..shared.client import CONSUMER_TIMEOUT, AgentConnection, resolve_endpoint, start_hint
from ..shared.errors import ConfigError
from ..shared.malloc import tune_malloc
from ..shared.messages import Requests
from ..shared.mixture import MixSpec
from ..shared.nodes import JobEpoch, NodeList, NodeShare, RankPlacement, job_epoch
from ..shared.protocol import launch_id
from ..shared.sequence import Resume, rank_length
from ..shared.urls import UrlList, file_path, list_id
from .agent_list import AgentList, LocalPaths
from .checkpoints import Checkpoints, NextEpoch
from .epoch_shards import agent_counts
from .hello import ReaderHello, say_hello
from .mixing import MixArg, mix_spec, read_mix_arg, shard_counts
from .node_lists import agree_on_list, check_kept
from .private import PrivateAgent, check_cache_dir
from .ranks import check_world, placement
from .reporter import ReportClock
from .stream import EpochStream, Session, StreamSettings
from .urls_arg import UrlsArg, given_names, pipe_refusal, pipe_urls, taken_once
from .worker_slices import WorkerSlice

MAP_TIMEOUT = 600.0  # seconds for one item of map=: a pool process killed (OOM) never answers
TORCH_LOADER = "TorchCachedMultiLoader"  # the name of the loader's class in a process that uses torch
# Loaders made in this process, by job: a loader's number among its job's. The ranks of a job make
# theirs in the same order, so the agent compares the lists of the ranks' loaders of one number
# (a training and a validation loader read different lists at once).
_MADE: Counter[str] = Counter()


@dataclass(frozen=True)
class Tuning:
    """The loader's performance knobs, in one place: none changes which samples an epoch
    delivers, their order or a checkpoint (``zero_copy`` changes the payloads' type only).
    Pass ``CachedMultiLoader(tuning=Tuning(...))``, or a knob by name as a keyword of its own.

    - ``request_size``: samples at most per request to a worker (fewer for large samples: a
      request asks for about 4 MiB of payload, the sample size taken from the replies, and
      before them from the size and count of each cached shard opened, so small samples go many
      to a request and large ones few; the first ask for at most 32, doubling with each reply).
    - ``inflight``: requests outstanding at most, the consumer's memory bound (None: twice the
      agent's workers, at least 4).
    - ``zero_copy``: payloads as read-only memoryviews instead of ``bytes`` (faster; not for
      webdataset's decoders; a view keeps the whole message it came in alive, up to
      ``request_size`` samples). It implies that the workers send every byte.
    - ``direct_reads``: copy payloads straight from the agent's cache files when this process
      may read them (one copy per byte instead of three; see :mod:`wdscache.training.direct`); False has
      the workers send every byte, as they do anyway for a shard still downloading.
    - ``tune_malloc``: keep glibc from handing freed sample memory back to the kernel (see
      :mod:`wdscache.shared.malloc`). It changes the allocator of the whole process; False leaves it be.
    """

    # A request costs messaging on both sides beside its samples (on 2 cores, warm 1 KB
    # samples: a worker's CPU per epoch fell by a third from 128 samples a request to 512; from
    # 512 to 2,048, by a tenth for a rank of 8, whose reads are 64 blocks of 8 at 512);
    # larger samples are held to about 4 MiB a request anyway.
    request_size: int = 2048
    inflight: int | None = None
    zero_copy: bool = False
    direct_reads: bool = True
    # On by default although it is process-wide, because the loader's own cost depends on it:
    # glibc hands a freed payload or message of ~100 KB+ back to the kernel, so the next one
    # page-faults fresh pages in, about 100,000 faults per GB of samples. Measured on 110 KB
    # samples, warm: a consumer's CPU per GB halves with it (direct reads, the default path)
    # and falls by a third when streamed (wdscache/shared/malloc.py).
    tune_malloc: bool = True


_TUNING_KNOBS = frozenset(f.name for f in dataclasses.fields(Tuning))


def _env_places() -> dict[str, Any]:
    """Defaults of where the agent is, and the job's name, from the environment (torchrun sets
    TORCHELASTIC_RUN_ID)."""
    env = os.environ
    return {
        "job": env.get("TORCHELASTIC_RUN_ID") or "default",
        "cache_dir": env.get("WDSCACHE_CACHE_DIR"),
        "endpoint": env.get("WDSCACHE_ENDPOINT"),
        # The agent's token (CACHE_DIR/token), for a consumer that cannot read the cache directory.
        "token": env.get("WDSCACHE_TOKEN") or None,
    }


def default_collate(samples: list[dict[str, Any]]) -> Any:
    """A batch as a dict of lists, one list per field; in a process that uses torch, torch's
    ``default_collate`` (numbers and arrays become tensors; bytes and strings stay lists), unless
    the payloads are memoryviews (``zero_copy``), which it does not take."""
    # torch is never imported here: a process without it does not pay for it
    if sys.modules.get("torch") is not None and samples and not any(type(v) is memoryview for v in samples[0].values()):
        from torch.utils.data import default_collate as torch_collate

        return torch_collate(samples)
    out: dict[str, list[Any]] = {}
    for sample in samples:
        for k, v in sample.items():
            out.setdefault(k, []).append(v)
    return out


class CachedMultiLoader:
    """Iterate samples of a WebDataset through the local wdscache agent.

    ``urls``: None streams the agent's own list; a list file, a shard index (wids JSON) or a
    list of URLs asks the agent to take that list up for this job. Each ``iter()`` is one
    epoch; the next one follows unless :meth:`set_epoch` says otherwise.

    Beyond webdataset's options: ``on_error`` ("raise", "skip", or a handler as webdataset's
    ``handler=``: called with the error of a shard that cannot be read, True skips the shard,
    False ends the epoch there, raising raises), and ``map=fn`` with
    ``workers=k`` to run ``fn`` on each sample in ``k`` processes (order kept). Those
    processes start fresh (multiprocessing's "forkserver", or "spawn" where there is none),
    not as forks of this process and its ZeroMQ threads, so ``fn`` must be picklable: a
    function defined at module level (or a ``functools.partial`` of one), as for torch's
    DataLoader workers under "spawn"; a lambda or a nested function is refused here.

    The performance knobs are one :class:`Tuning` (``tuning=``); each is also accepted as a
    keyword of its own (``request_size=64`` is ``tuning=Tuning(request_size=64)``), which wins
    over the same knob of ``tuning``.

    Made in a process that has imported torch, the loader is also a
    ``torch.utils.data.IterableDataset`` (:mod:`wdscache.training.dataset`): in a ``DataLoader``
    with ``num_workers=K``, each worker reads its own slice of the rank's share.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CachedMultiLoader:
        if cls is CachedMultiLoader and sys.modules.get("torch") is not None:
            cls = _torch_loader()
        return super().__new__(cls)

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        endpoint: str | None = None,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        node: int | None = None,
        num_nodes: int | None = None,
        reshuffle_nodes: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        batch_size: int | None = None,
        collate: Callable[[list[dict[str, Any]]], Any] | None = None,
        map: Callable[[dict[str, Any]], Any] | None = None,  # noqa: A002 (the documented name)
        workers: int = 0,
        drop_last: bool = False,
        timeout: float = CONSUMER_TIMEOUT,
        on_error: str | Callable[[BaseException], bool] = "raise",
        mix: Mapping[str, float] | None = None,
        epoch_samples: int | None = None,
        resampled: bool = False,
        tuning: Tuning | None = None,
        **knobs: Any,
    ) -> None:
        _check_arguments(knobs, on_error, batch_size)
        self.tuning = dataclasses.replace(tuning or Tuning(), **knobs)
        if map is not None and workers > 0:
            _check_picklable(map)
        # Several nodes, each with its own agent, read a part of the shards each (wdscache.shared.nodes).
        self.layout, self._world_from = placement(rank, world_size, node, num_nodes)
        self.rank, self.world_size = self.layout.rank, self.layout.world_size
        env = _env_places()
        self.cache_dir = cache_dir if cache_dir is not None else env["cache_dir"]
        self.endpoint = resolve_endpoint(self.cache_dir, endpoint or env["endpoint"])
        self.job = job or env["job"]
        self._number, _MADE[self.job] = _MADE[self.job], _MADE[self.job] + 1
        self._launch = launch_id()  # (made here, in the script's process: its DataLoader workers keep it)
        self.reshuffle_nodes = reshuffle_nodes
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.batch_size, self.collate = batch_size, collate or default_collate
        self.map_fn, self.workers = map, workers
        self.drop_last, self.timeout, self.on_error = drop_last, timeout, on_error
        listed, self._mix, self._given = _read_urls(taken_once(urls), mix, epoch_samples, resampled)
        if self._mix is not None and self.layout.num_nodes > 1:
            raise ConfigError(
                f"mix= and resampled=True read on one node only, and this job has num_nodes="
                f"{self.layout.num_nodes}: a mixture's sources are not split between nodes' caches"
            )
        self.urls = listed.urls if listed is not None else None
        # From a shard index: each shard's facts, sent to the agent with the list (it checks each
        # download against them, and knows the counts, so len() is known before the first epoch).
        self._shards = listed.shards if listed is not None else None
        self._own_list_id = list_id(self.urls) if self.urls is not None else None  # what a checkpoint names
        self._list_id = listed.list_id if listed is not None else None  # what the agent holds the list by
        self._agent_list: AgentList | None = None  # the agent's list as read last (its blocks kept)
        self._private_agent: PrivateAgent | None = None
        self._own_endpoint = endpoint is None and env["endpoint"] is None
        self._token = env["token"]
        if self._own_endpoint and self._token is None and self.cache_dir is not None:
            check_cache_dir(self.cache_dir, may_start=self.urls is not None)
        self._next = NextEpoch()
        # The epoch under way (its checkpoint is the loader's, until it ends or set_epoch or
        # load_state_dict says where the next starts), and the list id of the last one begun.
        self._current: EpochStream | None = None
        self._current_list: str | None = None
        self._resumed_from: dict[str, Any] | None = None
        self._direct_off: str | None = None  # why direct reads failed, once they did: not tried again
        self._reports = ReportClock()  # when its streams report, across its epochs
        # On several nodes, the list every rank of the job had when they last compared theirs (over
        # torch.distributed's process group: see wdscache.training.node_lists); None if they never did.
        # Compared here, it reaches DataLoader workers with the rest of the loader, which check theirs by it.
        self._job_list: NodeList | None = None
        self._agree_on_list()

    # -- epochs and checkpoints ---------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``, from its start (a checkpoint taken from now on
        says so, not where an epoch left unfinished stands); but a state just loaded that resumes
        epoch ``epoch`` stays as it is (as ``DistributedSampler.set_epoch`` leaves torchdata's
        resumed sampler), so that a loop that sets every epoch, the resumed one too, reads its
        rest, not the whole of it again."""
        if self._resumes(epoch):
            return
        self._let_go_of_current()
        self._next = NextEpoch(epoch)
        self._resumed_from = None

    def _resumes(self, epoch: int) -> bool:
        """Whether the next iteration resumes epoch ``epoch`` from a state loaded since the last one began."""
        return self._resumed_from is not None and self._next.epoch == epoch

    def _settle_next(self) -> None:
        """Say where the next iteration starts, as :meth:`__iter__` would, and begin nothing (no
        agent, no session): for a wrapper whose iteration calls ``iter()`` on the loader only at its
        first item (``wdscache.WebDataset``'s), so that a state taken between its ``iter()`` and
        that item (torchdata's ``StatefulDataLoader`` takes each worker's right after ``iter()``)
        names where the iteration starts, not the epoch before it. In a DataLoader worker, the
        epoch is its own (see :mod:`wdscache.training.dataset`)."""
        self._let_go_of_current()

    def _let_go_of_current(self) -> None:
        """The epoch under way is over for checkpoints: the next iteration's start is the position."""
        self._current = None

    def _worker_slice(self) -> WorkerSlice:
        """This process's slice of the rank's share: all of it (a DataLoader worker's: see
        :mod:`wdscache.training.dataset`)."""
        return WorkerSlice()

    def _in_worker(self) -> bool:
        """Whether this copy reads in a DataLoader worker (see :mod:`wdscache.training.dataset`)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """The job's position: any one rank's dict resumes every rank, with any world size.

        In a DataLoader worker, the position of this worker's slice (``"worker"``): it resumes
        the same worker of the same layout, and all the workers' states together resume any
        (see :meth:`load_state_dict`)."""
        return self._checkpoints().taken(self._current, self._next, self._worker_slice())

    def _state_after_current(self) -> dict[str, Any]:
        """The state once the epoch under way is over, as a cut ends it (``with_epoch``): the next
        epoch from its start; in a DataLoader worker, its slice complete (so that its fellows'
        states, of this epoch, combine with it)."""
        worker = self._worker_slice()
        if worker.count > 1:
            state = self.state_dict()
            state["worker"]["complete"] = True
            return state
        return self._checkpoints().taken(None, self._next, worker)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``: from :meth:`state_dict` of any rank of the stopped job, or a
        whole ``StatefulDataLoader.state_dict()`` of one (the states of all its workers: then
        any world size and any ``num_workers`` resume it)."""
        self._next, self._resumed_from = self._checkpoints().loaded(state, self._worker_slice())
        self._let_go_of_current()

    def _checkpoints(self) -> Checkpoints:
        """How this loader's checkpoints are taken and read (:mod:`wdscache.training.checkpoints`)."""
        return Checkpoints(
            seed=self.seed,
            shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer,
            drop_last=self.drop_last,
            mix=self._mix.fingerprint() if self._mix is not None else None,
            world_size=self.world_size,
            num_nodes=self.layout.num_nodes,
            list_id=self._current_list if self._current_list is not None else self._own_list_id,
        )

    def _session(
        self, conn: AgentConnection, name: str, *, epoch: int | None = None, probe: bool = False
    ) -> tuple[dict[str, Any], Sequence[str]]:
        """Say hello to the agent as reader ``name`` (:mod:`wdscache.training.hello`), starting
        ``epoch`` (None: not as a rank reading an epoch); returns the reply and the URL list in
        use. The agent's list is kept, and read again only when it changes."""
        shuffle_buffer = self.shuffle_buffer if self.shuffle else 0
        reader = ReaderHello(
            self.job,
            self.rank,
            self.world_size,
            shuffle_buffer,
            self.endpoint,
            self.urls,
            self._shards,
            self._list_id,
            self._number,
            self._launch,
        )
        hello, urls = say_hello(conn, name, reader, self._agent_list, epoch=epoch, probe=probe)
        if isinstance(urls, AgentList):
            self._agent_list = urls  # the latest list only
        return hello, urls

    # -- iteration ----------------------------------------------------------

    def close(self) -> None:
        """Stop using the private agent, if this loader used one: it stops once no loader does
        (the cache stays). Also done when the loader is garbage, and at interpreter exit."""
        if self._private_agent is not None:
            self._private_agent.release()
            self._private_agent = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, copy.deepcopy, a DataLoader worker started by "spawn") holds no
        # process-local state: no open epoch, no use of the private agent, which it joins
        # itself when it reads. Its next epoch is the one this loader's next would be.
        state = self.__dict__.copy()
        state["_private_agent"] = None
        state["_current"] = state["_current_list"] = None
        return state

    def __enter__(self) -> CachedMultiLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_agent(self) -> None:
        """With a list and a cache directory but no real agent there, use a private one (a notebook):
        join the one another loader started, or start it (see :mod:`wdscache.training.private`)."""
        if self._private_agent is not None and not self._private_agent.alive():
            self._private_agent.release()  # it died (killed): the next one is started or joined below
            self._private_agent = None
        if self._private_agent is not None or self.urls is None or self.cache_dir is None:
            return
        if not self._own_endpoint:
            return
        self._private_agent = PrivateAgent.use(self.cache_dir, self.urls, timeout=self.timeout)

    def __iter__(self) -> Iterator[Any]:
        check_world(self._world_from)
        self._ensure_agent()
        if self.tuning.tune_malloc:
            tune_malloc()
        nxt, worker = self._next, self._worker_slice()
        epoch, worker = nxt.epoch, WorkerSlice(worker.index, worker.count, nxt.skip, nxt.over)
        start: Resume | JobEpoch = nxt.start
        self._agree_on_list()
        # A mixture's counts first: counting may read shards for longer than the agent keeps a
        # silent reader, so the epoch's session opens after it.
        spec = self._mix_spec(epoch, worker.count) if self._mix is not None else None
        session = self._open_session(epoch)
        try:
            taken_on = self._resumed_from.get("urls") if self._resumed_from is not None else None
            if taken_on not in (None, session.list_id):
                raise ValueError(
                    f"the checkpoint was taken on list {taken_on}, but this rank reads list "
                    f"{session.list_id} (node {self.layout.node}'s agent's, or the loader's urls=): "
                    "resuming would mix datasets; give every node's agent (or the loader) the "
                    "checkpoint's list"
                )
            if self.layout.num_nodes > 1 or nxt.parts is not None:
                counts = agent_counts(session.conn, session.urls)
                if self.layout.num_nodes > 1:
                    check_kept(self.layout, NodeList.of(session.list_id, counts), self._job_list)
                start = self._job_epoch(counts, nxt)
        except BaseException:
            session.conn.close()
            raise
        local = (
            _named_as_given(session.urls, self._given)
            if not isinstance(session.urls, AgentList)
            else (LocalPaths() if session.hello.get("local_urls") else {})
        )
        rename = functools.partial(_as_given, local=local) if local else None
        stream = EpochStream(self._stream_settings(), session, epoch, start, worker, spec=spec, rename=rename)
        # Only now the next epoch: an iter() that failed to start leaves the position as it was.
        self._next = NextEpoch(epoch + 1)
        self._current, self._current_list = stream, stream.list_id
        self._resumed_from = None
        if self.map_fn is None and self.batch_size is None:  # counted a read at a time: no Python layer per sample
            return stream.delivered_samples()
        items: Iterator[Any] = chain.from_iterable(stream.chunks())
        if self.map_fn is not None:
            items = _mapped(items, self.map_fn, self.workers)
        if self.batch_size is None:
            return stream.delivering((1, item) for item in items)
        return stream.delivering(_batched(items, self.batch_size, self.collate))

    def _rank_share_empty(self) -> bool:
        """Whether the rank's share of the epoch last iterated held no sample for any of its
        DataLoader workers (a worker's own slice may be empty when the share is not: slices are
        blocks of samples, not shards). A resumed epoch's share is the rest of it: empty once
        its samples were all delivered before the checkpoint, which is no empty dataset."""
        stream = self._current
        if stream is None:
            return True
        share = stream.share
        resumes = share.job.resumes if isinstance(share, NodeShare) else (share.resume,)
        return not share.count and not any(r.delivered() for r in resumes)

    def _mix_spec(self, epoch: int, workers: int) -> MixSpec:
        """The mixture's epoch ``epoch`` (its counts learned first, if need be, through a session of their own)."""
        assert self._mix is not None
        urls, counts, _ = self._probe()
        counts = shard_counts(urls, counts, self._stream_settings(), self._open_session)
        return mix_spec(
            self._mix,
            counts,
            world_size=self.world_size,
            workers=workers,
            epoch=epoch,
            settings=self._stream_settings(),
        )

    def _agree_on_list(self) -> None:
        """On several nodes under the job's process group: every rank's list the same, or every rank raises."""
        self._job_list = agree_on_list(self.layout, self._probe) or self._job_list

    def _job_epoch(self, counts: Sequence[int | None], at: NextEpoch) -> JobEpoch:
        """The epoch ``at`` of a job on several nodes (or resumed from one): needs every shard's count."""
        parts, resumes = at.parts, at.part_resumes or (at.start,)
        if at.delivered is not None:  # what the ranks delivered, placed on the layout it was delivered on
            d = at.delivered
            then = job_epoch(
                counts,
                RankPlacement(0, d.world_size, 0, d.num_nodes),
                epoch=at.epoch,
                parts=parts,
                resumes=resumes,
                **self._job_options(),
            )
            parts, resumes = [list(p) for p in then.parts], then.resume_after_runs(d.runs)
        return job_epoch(counts, self.layout, epoch=at.epoch, parts=parts, resumes=resumes, **self._job_options())

    def _job_options(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "reshuffle": self.reshuffle_nodes,
        }

    def _stream_settings(self) -> StreamSettings:
        t = self.tuning
        return StreamSettings(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            endpoint=self.endpoint,
            seed=self.seed,
            shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer,
            drop_last=self.drop_last,
            timeout=self.timeout,
            on_error=self.on_error,
            request_size=t.request_size,
            inflight=t.inflight,
            zero_copy=t.zero_copy,
            direct_reads=t.direct_reads and not t.zero_copy and self._direct_off is None,
        )

    def _open_session(self, epoch: int | None = None) -> Session:
        """A new reader's session with the agent, for one stream: of the job's epoch ``epoch``
        (None: a mixture's shards counted)."""
        name = f"{self.job}/{self.rank}/{uuid.uuid4().hex[:8]}"
        conn = self._connection(self.timeout)
        try:
            hello, urls = self._session(conn, name, epoch=epoch)
        except BaseException:
            conn.close()
            raise
        return Session(
            name=name,
            conn=conn,
            hello=hello,
            urls=urls,
            list_id=self._list_read(hello),
            connect=self._connection,
            direct_failed=self._direct_failed,
            reports=self._reports,
            hello_again=functools.partial(self._hello_again, epoch=epoch),
        )

    def _list_read(self, hello: dict[str, Any]) -> str:
        """The id of the list this loader reads at the agent that answered ``hello``: its own, else the agent's."""
        return self._own_list_id or str(hello.get("list_id"))

    def _hello_again(self, conn: AgentConnection, name: str, epoch: int | None) -> tuple[dict[str, Any], str]:
        """Hello again as reader ``name`` of ``epoch`` (to a new run of the agent): its answer, and the list read there."""
        hello = self._session(conn, name, epoch=epoch)[0]
        return hello, self._list_read(hello)

    def _direct_failed(self, why: str) -> None:
        """A stream could not read the cache files: later epochs do not try again."""
        self._direct_off = why

    def _connection(self, timeout: float) -> AgentConnection:
        """A connection to the agent, which must prove it holds our cache directory's token: at the
        endpoint given, else wherever the cache directory's agent listens when it connects."""
        endpoint, hint = None if self._own_endpoint else self.endpoint, start_hint(self.cache_dir)
        return AgentConnection(endpoint, timeout=timeout, hint=hint, cache_dir=self.cache_dir, token=self._token)

    def _probe(self) -> tuple[Sequence[str], list[Any], str]:
        """The list this loader reads, the agent's count of each shard and the list's fingerprint,
        asked as a probe (not as a rank that reads)."""
        self._ensure_agent()
        conn = self._connection(self.timeout)
        name = f"len-{uuid.uuid4().hex[:8]}"
        try:
            hello, urls = self._session(conn, name, epoch=self._next.epoch, probe=True)
            conn.request(Requests(name).bye())
            counts = agent_counts(conn, urls)
        finally:
            conn.close()
        return urls, counts, self._list_read(hello)

    def __len__(self) -> int:
        """Samples (or batches) per rank in the next epoch; TypeError while some shard was never read."""
        if self._mix is not None:  # a mixture's length is its own, whatever the counts
            if self._mix.per_worker is not None and not self._in_worker():
                raise TypeError(
                    "length unknown: with resampled=True, with_epoch(n) gives each DataLoader worker n "
                    "samples, and the workers are not known here; give epoch_samples= (the job's "
                    "samples per epoch) for a length"
                )
            total = self._mix.total(self.world_size, self._worker_slice().count)
        else:
            urls, counts, _ = self._probe()
            if not urls or any(c is None for c in counts):
                raise TypeError("length unknown until every shard has been read once")
            if self.layout.num_nodes > 1 or self._next.parts is not None:
                job = self._job_epoch(counts, self._next)
                return job.per_rank if self.batch_size is None else -(-job.per_rank // self.batch_size)
            total = sum(counts)
        per_rank = rank_length(total - self._next.start.delivered(total), self.world_size, self.drop_last)
        if self.batch_size is None:
            return per_rank
        return -(-per_rank // self.batch_size)


# help() and IDEs show __init__'s keywords, not __new__'s (*args, **kwargs).
_INIT = inspect.signature(CachedMultiLoader.__init__)
CachedMultiLoader.__signature__ = _INIT.replace(  # type: ignore[attr-defined]
    parameters=list(_INIT.parameters.values())[1:], return_annotation=inspect.Signature.empty
)


def _check_arguments(knobs: dict[str, Any], on_error: Any, batch_size: int | None) -> None:
    """Refuse what CachedMultiLoader() cannot take, naming it."""
    unknown = sorted(set(knobs) - _TUNING_KNOBS)
    if unknown:
        raise TypeError(
            f"CachedMultiLoader() got unexpected keyword arguments {unknown}; "
            f"its tuning knobs are {sorted(_TUNING_KNOBS)}"
        )
    if not (on_error in ("raise", "skip") or callable(on_error)):
        raise ValueError(
            "on_error must be 'raise', 'skip' or a function of the error (True: skip the shard, "
            "False: end the epoch there), as webdataset's handler= is"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError("batch_size must be at least 1")


def _read_urls(
    urls: UrlsArg | None, mix: Mapping[str, float] | None, epoch_samples: int | None, resampled: bool
) -> tuple[UrlList | None, MixArg | None, dict[str, str]]:
    """The loader's list (None: the agent's), its mixture (mix= / resampled=: the sources' lists
    as one, see wdscache.training.mixing) and the shards the user named otherwise than their URLs
    (local paths, ``HTTP://``) as written, by their URLs (samples name them so, in __url__), of
    ``urls=`` or of every ``mix=`` source (a shard two sources name: as the first names it).
    pipe: commands are refused."""
    piped = pipe_urls(urls) if urls is not None else []
    if piped:
        raise ConfigError(pipe_refusal(f"urls={piped[0]!r}"))
    listed, mixed = read_mix_arg(urls, mix, epoch_samples, resampled)
    given: dict[str, str] = {}
    for source in [urls] if urls is not None else list(mix or ()):
        for url, name in given_names(source).items():
            given.setdefault(url, name)
    return listed, mixed, given


def _named_as_given(urls: Sequence[str], given: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    """Each local shard's ``__url__`` and ``__local_path__``, as webdataset's samples have them:
    the name the user gave it (else its ``file://`` URL) and its path (of ``file:rel/a.tar``, the part
    after the colon); and the ``__url__`` of each other shard the user wrote otherwise than its
    URL (``HTTP://``), with no ``__local_path__`` (None)."""
    named: dict[str, tuple[str, str | None]] = {
        url: (given.get(url, url), _given_path(given.get(url)) or file_path(url))
        for url in urls
        if url.startswith("file://")
    }
    named.update((url, (name, None)) for url, name in given.items() if not url.startswith("file://"))
    return named


def _given_path(name: str | None) -> str | None:
    return urlsplit(name).path if name is not None and name[:5].lower() == "file:" else name  # (as webdataset)


_UNSEEN: Any = object()  # a URL not named yet in _as_given (None: named by its URL)


def _as_given(samples: list[dict[str, Any]], local: dict[str, tuple[str, str | None]] | LocalPaths) -> None:
    """A read's samples, those of shards the user named otherwise than their URLs (local ones,
    ``HTTP://``) named in place as the user gave them: ``__url__`` and, of a local shard,
    ``__local_path__``, as webdataset's samples have them (the list is what goes out: the
    stream counts what was handed out by its iterator)."""
    seen: dict[str, tuple[str, str | None] | None] = {}  # each URL of the read named once, not once a sample
    for sample in samples:
        url = sample["__url__"]
        named = seen.get(url, _UNSEEN)
        if named is _UNSEEN:
            named = seen[url] = local.get(url)
        if named is not None:
            sample["__url__"], path = named
            if path is not None:
                sample["__local_path__"] = path


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

    # Its processes ignore SIGINT: a Ctrl-C at a terminal reaches the whole process group, and the
    # training process's KeyboardInterrupt ends the pool (below); each one's own would be noise.
    pool = multiprocessing.get_context(_start_method()).Pool(
        workers, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
    )
    try:
        ahead: deque[Any] = deque()
        for item in items:
            ahead.append(pool.apply_async(fn, (item,)))
            if len(ahead) >= 4 * workers:
                yield _result(ahead.popleft(), fn)
        while ahead:
            yield _result(ahead.popleft(), fn)
    finally:
        pool.terminate()
        pool.join()


def _result(pending: Any, fn: Callable[[Any], Any]) -> Any:
    """``pending``'s result (an ``AsyncResult`` of the ``map=`` pool), or TimeoutError naming ``map=``."""
    import multiprocessing

    try:
        return pending.get(timeout=MAP_TIMEOUT)
    except multiprocessing.TimeoutError:
        raise TimeoutError(
            f"map={fn!r} gave no result for an item within {MAP_TIMEOUT:.0f} s: one of its worker processes "
            "may have died (killed for memory?) or the function hangs; run it with workers=0 to see"
        ) from None


def _torch_loader() -> type[CachedMultiLoader]:
    """:class:`CachedMultiLoader` as a torch iterable dataset (:mod:`.dataset`), made once, on first use."""
    made = globals().get(TORCH_LOADER)
    if made is None:
        from .dataset import torch_loader  # imports torch: only in a process that did

        made = globals()[TORCH_LOADER] = torch_loader(CachedMultiLoader, TORCH_LOADER)
    return made


def __getattr__(name: str) -> Any:
    # Pickle finds the torch loader's class here, in a process that has not made it yet (a
    # DataLoader worker started by "spawn").
    if name == TORCH_LOADER:
        return _torch_loader()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
