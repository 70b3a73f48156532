"""``wdscache.ShardListDataset``: random access to samples by index, as ``wids.ShardListDataset`` gives it,
through the node's agent and cache.

The dataset is a shard index (webdataset's wids JSON, or its list of ``{"url", "nsamples"}``):
sample ``i`` is sample ``i - start`` of the shard whose cumulative range holds it. ``ds[i]``
returns the dict ``wids`` returns for ``i``: each member's extension with its leading dot
(``".jpg"``) mapped to an ``io.BytesIO`` of its bytes, then ``__key__``, ``__dataset__``,
``__index__``, ``__shard__`` (the URL as wids resolves it) and ``__shardindex__``, passed
through the transformations (by default wids' own decoder, ``"PIL"``: see :func:`default_decoder`).

How a sample is read: each process that indexes the dataset, and each thread of it, has its own
session with the agent (made there on first use, so a ``DataLoader`` worker, forked or spawned,
or a thread of a pool talks over its own sockets). It pins the shard (waiting for its download,
which the agent makes once per node), asks one of the agent's sample workers once for the
shard's sample table (the byte ranges of every sample in the cache file, which the worker
already walked), and then copies each sample out of the cache file with one ``pread``. Up to
``lru_size`` shards stay pinned and open per session, the least recently read let go first;
the tables of shards let go are kept (bounded), tied to the identity of the file they
describe, so indexing a shard again costs one request to the agent, not another table.
Threads of a process may index one dataset at once: what they share (the sessions by thread,
``get_stats()``'s LRU count) is changed a step at a time, never looked at then changed, so no
read fails for another thread's (the counts themselves may miss a read two threads made at once).

Guarantees:

- No byte can be wrong: the cache file is opened only while pinned and must have the identity
  of the file the worker walked (device, inode, size, mtime); a cached shard is never written
  again, and a replaced one is refused (and its table fetched again).
- A process waiting for a download holds no other pin meanwhile, so processes cannot fill the
  budget with pins while each waits for room for another shard.
- A process that reads says it is there every ``PING_EVERY`` (and while it waits for a
  worker's table), so the agent keeps its pins; the ping carries its samples, bytes, rate and
  time waiting to pin shards so far, as a stream's report does, so the agent's stats show it
  reading, as rank 0 of job ``random-access/<dataset name>``, and count its samples. Its bye
  carries its totals: at ``close()``; dropped unclosed (wids needs no close()), as it is
  collected, sent without waiting for an answer (a finalizer must not block), so that the agent
  lets go of its pins at once; or, never closed (a DataLoader worker's), as its process
  exits normally (within ``EXIT_BYE_TIMEOUT`` for all its sessions; not one of a daemon thread
  still running then). One that reads nothing
  keeps up to ``lru_size`` shards pinned, until the agent drops it: after ``--reader-timeout``,
  or sooner while another reader (a stream, another process's session) waits for room that
  pins hold, once it has said nothing for the agent's ``IDLE_LET_GO`` (5 s; a session has no
  thread to let go of its pins when asked, as a stream does; the one silent longest goes first,
  one a second). So a read by another waits about that long for them; a process silent that
  long between its reads (a DataLoader worker waiting for its turn) may lose its pins too. Dropped, its pins are let go and its shards evictable; at its next
  read its ping finds that out, and it closes its files, says hello again and pins each shard
  it reads anew (its file opened again, the table checked against its identity). Until then
  it keeps its files open: a shard evicted meanwhile keeps its disk space (counted out of the
  budget, not out of the file system's free space, which ``--min-free`` goes by) until that
  read, or ``close()``.
- When the agent restarts, the session says hello again and opens its shards again.
- A bad index is an :class:`IndexError`; a shard that cannot be fetched a
  :class:`~wdscache.shared.errors.FetchError` naming it; a damaged one, one holding another
  count than the index says, or one whose cache file changed behind the agent's back (read
  the sample again), a
  :class:`~wdscache.shared.errors.ShardError`; an agent that does not answer an
  :class:`~wdscache.shared.errors.AgentUnavailableError`. Every error of ours is a
  :class:`~wdscache.shared.errors.WdsCacheError`, whose messages show no URL's user info or tokens.
- A forked process (a DataLoader worker) closes the cache files it inherited, without a word to
  the agent: they are its parent's pins.

Made in a process that has imported torch, the dataset is also a ``torch.utils.data.Dataset``,
as wids' is (``isinstance`` checks, ``ds1 + ds2`` a ``ConcatDataset``); the package never
imports torch itself.
"""

from __future__ import annotations

import base64
import bisect
import functools
import gzip
import hashlib
import io
import json
import multiprocessing.util
import operator
import os
import sys
import threading
import time
import uuid
import warnings
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any, NamedTuple
from urllib.parse import urlparse, urlunparse

from ..shared.client import BYE_TIMEOUT, CONSUMER_TIMEOUT, AgentConnection, resolve_endpoint, start_hint, weakly
from ..shared.errors import (
    AgentUnavailableError,
    ConfigError,
    FetchError,
    ProtocolError,
    ShardError,
    ShardIndexError,
    WdsCacheError,
    failed_shard,
)
from ..shared.layout import file_identity
from ..shared.messages import ByeMessage, Requests, WorkerRequest
from ..shared.protocol import pack_numbers, pages, process_identity
from ..shared.shard_index import ShardInfo, parse_shard_entries
from ..shared.urls import index_list, normalize_url
from .direct import pread_whole
from .epoch_shards import unread_error
from .loader import _env_places
from .pins import STATUS_EVERY
from .private import PrivateAgent, check_cache_dir
from .replies import reply_layouts, sample_table, table_rows
from .stream import same_directory
from .worker_links import WorkerLinks

# Samples one table request asks a worker for: a worker takes up to 4096 items a read, and the
# reply's header (a key, extensions and a span per sample) must stay well inside the 1 MiB a
# header may hold.
TABLE_ITEMS = 2048
# Samples whose places a process keeps in the tables of shards it let go (a few hundred bytes each).
TABLE_SAMPLES = 250_000
# A sample spanning at most this many bytes of its shard is read with one pread and sliced (the
# slices copy it again, which costs less than a system call per field); a larger one per field.
ONE_READ = 64 << 10
# Seconds a process reads only shards it holds before it says it is there (a ping), as a stream's
# reports do: the agent drops a reader silent for --reader-timeout, and lets go of its pins.
PING_EVERY = 1.0
# Seconds a process's exit waits, all its sessions together, for the agent to take the byes of
# those never closed (a DataLoader worker's): the agent may be gone, and torch gives a worker
# 5 s to exit before it kills it.
EXIT_BYE_TIMEOUT = BYE_TIMEOUT
IMAGE_EXTENSIONS = ("jpg", "png", "ppm", "pgm", "pbm", "pnm")
TORCH_DATASET = "TorchShardListDataset"  # the name of the dataset's class in a process that uses torch

Sample = dict[str, Any]
Transform = Callable[[Sample], Any]


_forks = 0  # forks this process is down from the interpreter that started it


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


# -- wids' default decoder ---------------------------------------------------------------------


def default_decoder(sample: Sample, format: str = "PIL") -> Sample:  # noqa: A002 (wids' name)
    """wids' ``default_decoder`` (0.1.11), step for step, on a copy of ``sample``: a ``.gz`` that
    follows another extension is decompressed (the key kept); ``.txt``/``.text`` become ``str``,
    ``.cls``/``.cls2`` ``int``, ``.json`` its object, ``.npy`` an array, ``.mp`` msgpack,
    ``.pt``/``.pth`` ``torch.load`` (torch's own checks: weights only by default), ``.safetensors``
    its tensors; ``.pkl``/``.pickle`` stay ``io.BytesIO``, where wids unpickles them: unpickling
    bytes that came over the network runs whatever code their writer chose; then images (``.jpg``, ``.png``,
    ``.ppm``, ``.pgm``, ``.pbm``, ``.pnm``) ``PIL.Image.open`` (``format="PIL"``) or a numpy
    array of it (``"numpy"``). Every other field stays an ``io.BytesIO``."""
    result = dict(sample)
    for key, stream in list(result.items()):
        parts = key.split(".")
        if len(parts) >= 3 and parts[-1].lower() == "gz":
            result[key] = io.BytesIO(gzip.decompress(stream.read()))
    for key, stream in result.items():
        parts = key.split(".")
        if key.startswith("__") or len(parts) == 1:
            continue
        ext = parts[-1].lower()
        if isinstance(stream, bytes):
            stream = io.BytesIO(stream)
        if ext == "gz":
            ext = parts[-2].lower()
        if ext in ("txt", "text"):
            result[key] = stream.read().decode("utf-8")
        elif ext in ("cls", "cls2"):
            result[key] = int(stream.read().decode("utf-8"))
        elif ext == "safetensors":
            import safetensors.torch

            result[key] = safetensors.torch.load_file(stream)
        elif ext == "json":
            result[key] = json.loads(stream.read())
        elif ext == "npy":
            import numpy as np

            result[key] = np.load(stream)
        elif ext == "mp":
            import msgpack

            result[key] = msgpack.unpackb(stream.read(), raw=False)
        elif ext in ("pt", "pth"):
            import torch

            result[key] = torch.load(stream)
    if format.lower() not in ("pil", "numpy"):
        raise ValueError(f"Unknown format: {format}")
    for key, stream in result.items():
        parts = key.split(".")
        if key.startswith("__") or len(parts) == 1 or parts[-1].lower() not in IMAGE_EXTENSIONS:
            continue
        try:
            import PIL.Image
        except ImportError as exc:  # (wids imports it for every sample; here only for an image)
            raise ImportError(
                f"ShardListDataset's default decoder opens the image {key!r} with Pillow: pip install pillow, "
                "or give transformations=[] for the raw bytes"
            ) from exc
        if isinstance(stream, bytes):
            stream = io.BytesIO(stream)
        image = PIL.Image.open(stream)
        if format.lower() == "numpy":
            import numpy as np

            result[key] = np.asarray(image)
        else:
            result[key] = image
    return result


def transformations_of(transformations: Any) -> list[Transform]:
    """wids' ``transformations=``: a callable or a list of them; ``"PIL"`` and ``"numpy"`` name
    :func:`default_decoder` with that format."""
    items = transformations if isinstance(transformations, list) else [transformations]
    result: list[Transform] = []
    for t in items:
        if t in ("PIL", "numpy"):
            t = functools.partial(default_decoder, format=t)
        elif not callable(t):
            raise TypeError(f'transformations= takes callables (or "PIL", "numpy"), not {t!r}')
        result.append(t)
    return result


# -- the index ----------------------------------------------------------------------------------


def _wids_url(base: str | None, url: str) -> str:
    """``url`` resolved against ``base`` as wids resolves an index's shards (its ``urlmerge``)."""
    if base is None:
        return url
    b, u = urlparse(base), urlparse(url)
    path = u.path if u.path.startswith("/") else os.path.normpath(os.path.join(b.path, u.path))
    return urlunparse((u.scheme or b.scheme, u.netloc or b.netloc, path, u.params, u.query, u.fragment))


class _Index(NamedTuple):
    """A shard index as read: its entries as wids keeps them (each ``url`` resolved as wids
    resolves it), each one's URL and facts for the agent, and wids' ``spec`` and ``base``."""

    entries: list[dict[str, Any]]
    facts: list[tuple[str, ShardInfo]]
    spec: dict[str, Any]
    base: str | None


def _read_index(shards: Any, base: str | None, options: dict[str, Any] | None) -> _Index:
    """``shards`` read as wids reads it: a JSON file (its path, or the file open), whose fields
    ``options`` replace, or a list of entries (``options`` then is the ``spec``, as in wids)."""
    if isinstance(shards, (str, os.PathLike, io.IOBase)):
        if isinstance(shards, io.IOBase):  # wids reads an open file; its URLs resolve against base alone
            path = str(getattr(shards, "name", "the shard index"))
            try:
                data = shards.read()
                text = data.decode("utf-8") if isinstance(data, bytes) else str(data)
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"cannot read the shard index {path}: {exc}") from None
        else:
            path = os.fspath(shards)
            if "://" in path:
                raise ConfigError(
                    f"ShardListDataset({path!r}): give the shard index as a local JSON file (or its "
                    'list of {"url", "nsamples"}); download a remote index first'
                )
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise ConfigError(f"cannot read the shard index {path}: {exc.strerror or exc}") from None
            base = os.path.dirname(path) if base is None else base  # wids: the index's folder, as written
        entries: list[dict[str, Any]] = []
        facts: list[tuple[str, ShardInfo]] = []
        top, listed = parse_shard_entries(text, path=path, overrides=options)
        for entry, info in listed:
            resolved = _wids_url(base, entry["url"])
            kept = {**entry, "url": resolved}  # wids keeps every key (its "dataset" is __dataset__)
            for key in ("weight", "name"):  # and gives each the index's own where it has none
                if key not in kept and top.get(key) is not None:
                    kept[key] = top[key]
            entries.append(kept)
            facts.append((resolved, info))
        return _Index(entries, facts, {**top, "shardlist": entries}, base)
    if isinstance(shards, dict) or not isinstance(shards, Sequence):
        raise TypeError(
            "ShardListDataset() takes a shard index: a JSON file's path (or the file open), or its "
            '"shardlist", a list of {"url": ..., "nsamples": ...}'
        )
    entries, facts = [], []
    for i, entry in enumerate(shards):
        url = entry.get("url") if isinstance(entry, dict) else None
        try:
            if not isinstance(url, str) or not url.strip():
                raise ValueError('each entry is a dict with a "url" string and "nsamples"')
            if "nsamples" not in entry:
                raise ValueError('"nsamples" is missing')
            info = ShardInfo.from_wire([entry.get("nsamples"), entry.get("filesize"), entry.get("md5sum")])
        except ValueError as exc:
            raise ShardIndexError("shards", i, str(exc), url=url) from None
        entries.append(dict(entry))  # wids keeps the caller's dicts; a copy, so ours cannot change
        facts.append((url, info))
    return _Index(entries, facts, {} if options is None else options, None)  # wids: base given is unused


# -- the dataset ----------------------------------------------------------------------------------


class ShardListDataset:
    """Samples of a shard index by index, read through the node's wdscache agent: a drop-in for
    ``wids.ShardListDataset`` (see the module docstring for what ``ds[i]`` holds).

    ``shards``: a wids shard index (the path of its JSON file, or the file open) or its list of
    ``{"url": ..., "nsamples": ...}``; relative URLs in a file resolve against its folder (or
    ``base``), and ``options`` replace the file's own fields, as in wids. ``cache_dir``/``endpoint``
    find the agent as for ``CachedMultiLoader`` (a private agent is started on ``cache_dir`` when
    none runs there). ``lru_size``: shards each process (each thread that reads) keeps pinned and
    open. ``transformations``: as in wids. ``cache_size``, ``keep`` and ``localname`` are wids'
    options for its own download folder: the agent's cache (``--cache-size``) decides here, so
    they change nothing. ``timeout``: seconds without an answer from the agent before giving up
    (a download in progress answers).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ShardListDataset:
        if cls is ShardListDataset and sys.modules.get("torch") is not None:
            cls = _torch_dataset()
        return super().__new__(cls)

    def __init__(
        self,
        shards: str | os.PathLike[str] | io.IOBase | Sequence[dict[str, Any]],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        endpoint: str | None = None,
        lru_size: int = 10,
        dataset_name: str | None = None,
        transformations: Any = "PIL",
        base: str | None = None,
        cache_size: int | None = None,
        keep: bool = False,
        localname: Callable[[str], str] | None = None,
        options: dict[str, Any] | None = None,
        timeout: float = CONSUMER_TIMEOUT,
    ) -> None:
        del cache_size, keep, localname  # wids' own download folder; the agent's cache governs here
        if lru_size < 1:
            raise ValueError("lru_size must be at least 1")
        index = _read_index(shards, base, options)
        self.shards, facts, self.spec, self.base = index.entries, index.facts, index.spec, index.base
        if not self.shards:
            raise ShardIndexError(
                str(shards) if isinstance(shards, (str, os.PathLike)) else "shards", None, "the index lists no shard"
            )
        name = self.spec.get("name") if isinstance(shards, (str, os.PathLike, io.IOBase)) else None
        self.dataset_name = (
            dataset_name
            or (name if isinstance(name, str) else None)  # an index file's own, as wids takes it
            or _wids_name(shards, [entry["url"] for entry in self.shards])
        )
        # checked ints, whatever integer type an entry gave (an index file gives every count)
        self.lengths = [info.nsamples or 0 for _, info in facts]
        self._ends = list(_cumulative(self.lengths))
        self.cum_lengths = list(self._ends)  # wids' name for them (its own list: a caller may change it)
        self._starts = [0, *self._ends[:-1]]
        # get_stats(): samples read in this process, and shards read that were not among its
        # lru_size latest (wids' LRU misses: pins let go while a download waits do not count)
        self.accesses = self.misses = 0
        self._latest: OrderedDict[int, None] = OrderedDict()
        self._warned_misses = False  # check_cache_misses() warns once, as wids' does
        self.total_length = self._ends[-1]
        self._list = index_list(facts, path="shards", base_dir=os.getcwd())
        # entry -> its shard's position in the agent's list (the list drops a URL listed twice),
        # and the __dataset__ and __shard__ of its samples
        self._places = [
            (self._list.index(normalize_url(url, os.getcwd())), e.get("dataset"), e["url"])
            for (url, _), e in zip(facts, self.shards)
        ]
        env = _env_places()
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else env["cache_dir"]
        self.endpoint = resolve_endpoint(self.cache_dir, endpoint or env["endpoint"])
        self._private = endpoint is None and env["endpoint"] is None and self.cache_dir is not None
        self._token = env["token"]
        if self._private and self._token is None and self.cache_dir is not None:
            # The index lists the shards, so a private agent may start in a new folder, as a
            # loader's with urls=; a typo'd path whose folder does not exist is refused here.
            check_cache_dir(self.cache_dir, may_start=True)
        self.lru_size, self.timeout = lru_size, timeout
        self.transformations = transformations_of(transformations)
        # Each thread's session (its sockets, pins and files): ZeroMQ sockets are used by one
        # thread at a time, and threads read at once.
        self._sessions: dict[threading.Thread, _Session] = {}
        self._forks = _forks  # the process's forks its sessions were made after

    def add_transform(self, transform: Transform) -> ShardListDataset:
        """Apply ``transform`` after the others."""
        self.transformations.append(transform)
        return self

    def __len__(self) -> int:
        return self.total_length

    def get_stats(self) -> tuple[int, int]:
        """``(accesses, misses)``, as wids gives them: the samples (and ``get_shard`` calls) of this
        process, and how many of them were of a shard not among the ``lru_size`` it read latest."""
        return self.accesses, self.misses

    def check_cache_misses(self) -> None:
        """Warn (once) when more than 30% of over 100 reads were misses (see :meth:`get_stats`), as
        wids does at every read (it prints; this is a ``UserWarning``): each miss pins a shard
        anew, so reads out of shard order are slow."""
        accesses, misses = self.accesses, self.misses
        if accesses > 100 and misses * 10 > accesses * 3 and not self._warned_misses:
            self._warned_misses = True
            warnings.warn(
                f"ShardListDataset: {misses} of {accesses} reads ({misses / accesses:.1%}) were of a shard "
                f"not among the {self.lru_size} read latest; read in shard order (wids.ShardedSampler, "
                "wids.ChunkedSampler) or raise lru_size",
                UserWarning,
                stacklevel=3,
            )

    def _count(self, shard: int) -> None:
        """One access to ``shard`` (the agent's list position) in :meth:`get_stats`, as wids' LRU
        counts it (in line in ``__getitem__``)."""
        self.accesses += 1
        try:  # (one step, not a look then a move: another thread may let it go in between)
            self._latest.move_to_end(shard)
        except KeyError:
            self._miss(shard)

    def _miss(self, shard: int) -> None:
        self.misses += 1
        latest = self._latest
        latest[shard] = None
        if len(latest) > self.lru_size:
            latest.popitem(last=False)

    def get_shard(self, index: int) -> tuple[ShardSamples, int, dict[str, Any]]:
        """wids' ``get_shard``: ``(shard, inner, entry)`` of sample ``index``: its shard's samples
        (``len(shard)``, and ``shard[inner]`` the sample without the fields ``ds[index]`` adds or
        its transformations), its place there and its entry of ``shards``. The shard is pinned
        and opened here (waiting for its download), as wids downloads and opens it; one access
        in :meth:`get_stats`."""
        entry, inner = self.locate(index)
        shard = self._places[entry][0]
        self._session().hold(shard)
        self._count(shard)
        return ShardSamples(self, shard, self.shards[entry]["url"], self.lengths[entry]), inner, self.shards[entry]

    def locate(self, index: int) -> tuple[int, int]:
        """``(entry, sample in its shard)`` of sample ``index``; IndexError outside ``[0, len)``."""
        i = operator.index(index)
        if not 0 <= i < self.total_length:
            raise self._out_of_range(i)
        entry = bisect.bisect_right(self._ends, i)
        return entry, i - self._starts[entry]

    def _out_of_range(self, i: int) -> IndexError:
        # wids reads a negative index from the end of its first shard; counting it from the end
        # of the dataset would be another sample: neither is what a script that passes one meant.
        return IndexError(
            f"index {i} is out of range: the dataset has {self.total_length} samples"
            + (f" (indexes count from 0, not from the end: the last is {self.total_length - 1})" if i < 0 else "")
        )

    def __getitem__(self, index: int) -> Any:
        # The per-sample path, in line (each call and attribute lookup shows at a few µs a sample):
        # locate, the session's pinned shard, one pread (a few for a large sample), the slices.
        i = operator.index(index)
        if not 0 <= i < self.total_length:
            raise self._out_of_range(i)
        entry = bisect.bisect_right(self._ends, i)
        inner = i - self._starts[entry]
        shard, dataset, url = self._places[entry]
        if self._forks != _forks:  # a forked child never uses its parent's sockets (any thread's)
            self._forget_parents()
        session = self._sessions.get(threading.current_thread())
        if session is None:
            session = self._new_session()
        sample = session.sample(shard, inner)
        self.accesses += 1  # (_count, in line)
        try:
            self._latest.move_to_end(shard)
        except KeyError:
            self._miss(shard)
        if self.misses * 10 > self.accesses * 3 > 300:  # wids checks at every read; a call costs more
            self.check_cache_misses()
        sample["__dataset__"] = dataset
        sample["__index__"] = index
        sample["__shard__"] = url
        sample["__shardindex__"] = inner
        for transform in self.transformations:
            sample = transform(sample)
        return sample

    def _session(self) -> _Session:
        """This thread's session (as ``__getitem__`` finds it, in line)."""
        if self._forks != _forks:
            self._forget_parents()
        session = self._sessions.get(threading.current_thread())
        return session if session is not None else self._new_session()

    def _forget_parents(self) -> None:
        """In a forked child: close the files of the parent's sessions, without a word to the agent."""
        sessions, self._sessions, self._forks = list(self._sessions.values()), {}, _forks
        for session in sessions:
            session.forget()

    def _new_session(self) -> _Session:
        """This thread's session; those of threads that ended go first (their pins and files,
        which would hold evicted shards' space)."""
        # (Threads make theirs at once: the dict is copied whole before a look through it, and a
        # session another thread took away first is not taken again.)
        alive = set(threading.enumerate())
        for thread in [t for t in list(self._sessions) if t not in alive]:
            ended = self._sessions.pop(thread, None)
            if ended is not None:
                ended.close()  # (its thread ended: no other uses its sockets)
        session = self._sessions[threading.current_thread()] = _Session(self)
        return session

    def close(self) -> None:
        """Say goodbye to the agent (our pins go) and close this process's sockets and files (every
        thread's: call it once the threads that read are done); a later ``ds[i]`` starts again."""
        if self._forks != _forks:
            self._forget_parents()
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_sessions"] = {}  # sockets and files belong to the process that made them
        return state

    def __enter__(self) -> ShardListDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _torch_dataset() -> type[ShardListDataset]:
    """:class:`ShardListDataset` as a ``torch.utils.data.Dataset``, made once, on first use."""
    made = globals().get(TORCH_DATASET)
    if made is None:
        from torch.utils.data import Dataset  # only in a process that imported torch

        made = globals()[TORCH_DATASET] = type(
            TORCH_DATASET, (ShardListDataset, Dataset), {"__module__": __name__, "__qualname__": TORCH_DATASET}
        )
    return made


def __getattr__(name: str) -> Any:
    # Pickle finds the torch dataset's class here, in a process that has not made it yet (a
    # DataLoader worker started by "spawn").
    if name == TORCH_DATASET:
        return _torch_dataset()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _wids_name(shards: Any, urls: list[str]) -> str:
    """wids' name of a dataset given none: its ``hash_dataset_name`` of ``str(shards)``; of its
    ``urls`` for an open file without a name (``io.BytesIO``, whose ``str`` is its address: another
    in each process, where the ranks of a job name one dataset alike)."""
    named = urls if isinstance(shards, io.IOBase) and not hasattr(shards, "name") else shards
    return base64.urlsafe_b64encode(hashlib.sha256(str(named).encode()).digest())[:16].decode("ascii")


class ShardSamples:
    """One shard's samples, as :meth:`ShardListDataset.get_shard` gives them (wids gives its
    ``IndexedTarSamples``): ``len(shard)``, and ``shard[i]`` the ``i``-th sample (from the end for
    a negative ``i``, as a list counts) with its fields as ``io.BytesIO`` and ``__key__``, read
    through the dataset's session of the thread that reads (pinning the shard again if it was
    let go). ``url``: the shard's URL as the index gives it (wids' ``path`` is its download)."""

    def __init__(self, ds: ShardListDataset, shard: int, url: str, length: int) -> None:
        self._ds, self._shard, self.url, self._length = ds, shard, url, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Sample:
        i = operator.index(index)
        inner = i + self._length if i < 0 else i
        if not 0 <= inner < self._length:
            raise IndexError(f"index {i} is out of range: the shard {self.url} has {self._length} samples")
        return self._ds._session().sample(self._shard, inner)

    def __repr__(self) -> str:
        return f"<ShardSamples {self.url} ({self._length} samples)>"


def _cumulative(lengths: list[int]) -> Any:
    total = 0
    for n in lengths:
        total += n
        yield total


# -- one process's session with the agent ---------------------------------------------------------


@dataclass
class _Table:
    """A shard's samples in one cache file (of ``identity``). Sample ``i`` is ``keys[i]``, its
    fields named ``names[i]`` (the extensions with their dot, as wids names them; one tuple
    shared by the samples with the same fields), and ``places`` from ``at[i]`` on holds where
    its span starts in the file, the span's size, then each field's start and end within the
    span. Flat arrays: a few cache lines a sample, about 150 bytes with its key."""

    identity: tuple[int, ...]
    keys: list[str] = field(default_factory=list)
    names: list[tuple[str, ...]] = field(default_factory=list)
    at: array[int] = field(default_factory=lambda: array("q"))
    places: array[int] = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class _Totals:
    """A session's figures for the agent's stats, as its reads count them: the samples read, their
    payload bytes, and the seconds its reads waited to pin a shard (a download, room, the shard's
    table). A record of their own, so that the finalizer of a session dropped unclosed holds
    them, not the session."""

    samples: int = 0
    bytes: int = 0
    wait_s: float = 0.0

    def bye(self, requests: Requests) -> ByeMessage:
        """The session's bye, with these totals (whichever way it goes: :meth:`_Session.close`, at
        its process's exit, or as it is collected)."""
        return requests.bye(samples=self.samples, bytes=self.bytes, wait_s=round(self.wait_s, 3))


class _Open(NamedTuple):
    """A shard this process holds pinned, its cache file open (a tuple: unpacked per sample)."""

    fd: int
    table: _Table


class _Session:
    """One process's reader of the agent: its pins, open files, tables and worker sockets."""

    def __init__(self, ds: ShardListDataset) -> None:
        self.forks = _forks
        self.pid = os.getpid()
        self.ds = ds
        self.urls = ds._list.urls
        self.private = (
            PrivateAgent.use(ds.cache_dir, self.urls, timeout=ds.timeout)
            if ds._private and ds.cache_dir is not None
            else None
        )
        self.conn = AgentConnection(
            None if ds._private else ds.endpoint,  # (no endpoint given: wherever the directory's agent listens)
            timeout=ds.timeout,
            hint=start_hint(ds.cache_dir),
            cache_dir=ds.cache_dir,
            token=ds._token,
        )
        self.name = f"{ds.dataset_name}/{self.pid}/{uuid.uuid4().hex[:8]}"
        self.requests = Requests(self.name)
        self.pinned: OrderedDict[int, _Open] = OrderedDict()  # shard position -> its pin, least recent first
        self.tables: OrderedDict[int, _Table] = OrderedDict()
        self.table_samples = 0
        self.last = -1  # the shard read last (at the end of the LRU order already)
        self.seen: set[int] = set()  # shards opened once: downloaded, not worth a place in the window
        self.links: WorkerLinks | None = None
        self.hello: dict[str, Any] = {}
        self.contact = 0.0  # when we last said hello or pinged (see _still_known)
        # For the agent's stats, carried by our pings (we have no report thread) and our bye:
        # our totals; and when we last pinged and our samples then (our rate is of the samples since).
        self.totals = _Totals()
        self.pinged_at, self.pinged_samples = time.monotonic(), 0
        try:
            self._say_hello()
        except BaseException:
            self.conn.close()
            raise
        # (Weakly: the finalizer below holds our connection, which must not hold us.)
        self.conn.on_new_run = weakly(self._agent_restarted)
        # A dataset dropped without close() (wids needs none: an evaluation set built and dropped
        # every few minutes) says its bye as it is collected, so that the agent lets go of its
        # pins and counts its samples at once, not after --reader-timeout of silence.
        self._dropped = weakref.finalize(
            self, _bye_dropped, self.pid, self.pinned, self.conn, self.requests, self.totals
        )
        self._dropped.atexit = False  # at exit, _bye_at_exit says it (or a daemon thread reads on)
        self.thread = threading.current_thread()  # the one that uses our sockets (see _bye_at_exit)
        # One never closed (a DataLoader worker's: torch calls no close() there) says its bye as
        # its process exits normally: multiprocessing runs these finalizers as its children end,
        # where atexit handlers do not run, and from an atexit hook in any other process.
        self._at_exit = multiprocessing.util.Finalize(self, _bye_at_exit, args=(weakref.ref(self),), exitpriority=0)

    def _say_hello(self) -> None:
        """Join as a reader of our own list (sent first if the agent does not hold it)."""
        urls, infos = self.urls, self.ds._list.shards
        assert infos is not None  # a shard index gives every shard's facts
        request = self.requests.hello(
            f"random-access/{self.ds.dataset_name}",
            0,
            1,
            process=process_identity(),
            list_id=self.ds._list.list_id,
            random_access=True,  # no thread lets go of our pins while we read nothing: the agent may (see the module)
        )
        hello = self.conn.request(request)
        if hello.get("need_urls"):
            for offset, chunk in pages(urls):
                page = self.conn.request(
                    self.requests.put_urls(offset, chunk, [i.to_wire() for i in infos[offset : offset + len(chunk)]])
                )
                if not page.get("ok"):
                    raise WdsCacheError(f"the agent at {self.ds.endpoint} refused the shard index: {page.get('error')}")
            hello = self.conn.request(request)
        if not hello.get("ok"):
            raise WdsCacheError(f"the agent at {self.ds.endpoint} refused this reader: {hello.get('error')}")
        if not same_directory(hello):
            raise WdsCacheError(
                f"the agent at {self.ds.endpoint} keeps its cache in {hello.get('cache_dir')}, which this process "
                "does not see: ShardListDataset reads the cache files itself; run it on the agent's machine, "
                "with its cache directory visible"
            )
        self.hello, self.contact = hello, time.monotonic()
        if self.links is not None:
            self.links.close()
        workers = hello.get("workers") or []
        keys = [self.conn.worker_key(i) for i in range(len(workers))]
        if not workers or None in keys:
            raise ProtocolError(f"the agent at {self.ds.endpoint} named no sample workers in its hello")
        self.links = WorkerLinks(workers, [str(k) for k in keys])

    def _agent_restarted(self) -> None:
        """A new run knows nothing of us: hello again; our pins are gone, so our files close
        (shards are opened again when read; the tables stay, checked against each file)."""
        for shard, held in self.pinned.items():
            self._keep_table(shard, held.table)
        _close_files(self.pinned)
        self.last = -1
        self._say_hello()

    def _still_known(self) -> None:
        """A ping ``PING_EVERY`` after the last (or our hello), whatever requests came between:
        stats take it for our report, due about every second while we read. It keeps our pins,
        or finds that the agent dropped us as silent and let them go (their shards may be
        evicted, whose space must come back): then as after a restart."""
        if not self._ping():
            self._agent_restarted()

    def _here(self, timeout: float) -> None:
        """A ping while we wait for a worker (the table of a large shard), waited for ``timeout`` at
        most (the time our wait has left): a session that asks is
        not idle, and the agent must not let go of the pin whose table we are making. An agent
        that forgot us is for the next read to act on (its ping, :meth:`_still_known`, comes at
        once): a hello again now would replace the links we wait on."""
        if not self._ping(timeout):
            self.contact = 0.0

    def _ping(self, timeout: float = PING_EVERY) -> bool:
        """Whether the agent still knows us. Waited for ``timeout`` at most: an agent that does
        not answer is taken to (the files we hold stay right to read whether it answers or not; a
        read of another shard finds out). The ping carries our figures, as a stream's report
        does: the agent shows us reading, not silent, and counts our samples."""
        now = self.contact = time.monotonic()
        totals = self.totals
        samples, since = totals.samples, now - self.pinged_at
        rate = (samples - self.pinged_samples) / since if since > 0 else 0.0
        self.pinged_at, self.pinged_samples = now, samples
        ping = self.requests.ping(
            samples=samples, bytes=totals.bytes, rate=round(rate, 1), wait_s=round(totals.wait_s, 3)
        )
        try:
            return self.conn.request(ping, timeout=timeout).get("known") is not False
        except AgentUnavailableError:
            return True

    # -- reading ------------------------------------------------------------------------------------

    def hold(self, shard: int) -> _Open:
        """The shard at ``shard`` in our list pinned and open, the latest read in our LRU order."""
        if time.monotonic() - self.contact > PING_EVERY:
            self._still_known()
        held = self.pinned.get(shard)
        if held is None:
            started = time.monotonic()
            try:
                held = self._pin(shard)
            finally:
                self.totals.wait_s += time.monotonic() - started
        elif shard != self.last:
            self.pinned.move_to_end(shard)
        self.last = shard
        return held

    def sample(self, shard: int, inner: int) -> Sample:
        """Sample ``inner`` of the shard at ``shard`` in our list, its fields as ``io.BytesIO``
        (which takes a ``bytes`` without copying it)."""
        held = self.pinned.get(shard)
        if held is None or shard != self.last or time.monotonic() - self.contact > PING_EVERY:
            held = self.hold(shard)  # (the common case, the shard read last, needs no call)
        fd, table = held
        places = table.places
        k = table.at[inner]
        start, size = places[k], places[k + 1]
        sample: dict[str, Any] = {}  # filled by a loop: a comprehension costs a call more
        payload = 0  # the fields' bytes, counted for stats as a stream counts them
        if size <= ONE_READ:  # one read of the span, tar headers and all, sliced
            data = os.pread(fd, size, start)
            if len(data) == size:
                for name in table.names[inner]:
                    k += 2
                    a, b = places[k], places[k + 1]
                    sample[name] = BytesIO(data[a:b])
                    payload += b - a
                sample["__key__"] = table.keys[inner]
                totals = self.totals
                totals.samples += 1
                totals.bytes += payload
                return sample
        else:  # a read per field: each byte copied once
            for name in table.names[inner]:
                k += 2
                a, b = places[k], places[k + 1]
                data = pread_whole(fd, b - a, start + a)
                if len(data) != b - a:
                    break
                sample[name] = BytesIO(data)
                payload += b - a
            else:
                sample["__key__"] = table.keys[inner]
                totals = self.totals
                totals.samples += 1
                totals.bytes += payload
                return sample
        # Cut short behind the agent's back: never served; open it (and walk its table) again.
        self._let_go(shard)
        self.table_samples -= len(self.tables.pop(shard))
        raise ShardError(
            self.urls[shard],
            "its cache file is shorter than when its table was made (changed "
            "behind the agent's back); read the sample again",
        )

    def _pin(self, shard: int) -> _Open:
        """Pin ``shard`` (waiting for its download), open its cache file, know its table."""
        url = self.urls[shard]
        # Room first: a release may be the request that finds a restarted agent, which closes
        # every pinned file; so it comes before our open, which the new run then answers.
        while len(self.pinned) >= self.ds.lru_size:
            self._let_go(next(iter(self.pinned)))
        ahead = self._ahead(shard)
        reply = self.conn.request(self.requests.open(url, ahead=ahead, wait=False))
        if not reply.get("ok") and reply.get("cached") is False:
            # Waiting for a download or for room: we hold no other pin meanwhile (see the module).
            for other in list(self.pinned):
                self._let_go(other)
            reply = self.conn.request_patiently(
                self.requests.open(url, ahead=ahead),
                liveness=self.ds.timeout,
                probe=self.requests.status(url),
                every=min(STATUS_EVERY, self.ds.timeout / 4),
            )
        if not reply.get("ok"):
            raise failed_shard(url, reply, permanent=True)
        self.seen.add(shard)
        try:
            fd = os.open(reply["path"], os.O_RDONLY | os.O_CLOEXEC)
        except (KeyError, TypeError, OSError) as exc:
            self.conn.request(self.requests.release(url))
            raise FetchError(url, f"its cache file cannot be opened: {exc}") from None
        try:
            identity = file_identity(os.fstat(fd))
            table = self.tables.pop(shard, None)
            if table is not None:
                self.table_samples -= len(table)
            if table is None or table.identity != identity:
                table = self._table(shard, identity)
        except BaseException as exc:
            os.close(fd)
            self._release_after(url, exc)
            raise
        held = self.pinned[shard] = _Open(fd, table)
        return held

    def _release_after(self, url: str, error: BaseException) -> None:
        """Give back the pin of ``url``, whose table ``error`` kept us from making. After a worker
        that did not answer (``AgentUnavailableError``), the agent may be as silent: the release
        waits ``PING_EVERY`` at most, and unanswered, goes with our bye (or our silence), so
        that the error told is the worker's, within our timeout."""
        if not isinstance(error, AgentUnavailableError):
            self.conn.request(self.requests.release(url))
            return
        try:
            self.conn.request(self.requests.release(url), timeout=PING_EVERY)
        except AgentUnavailableError:
            pass

    def _ahead(self, shard: int) -> list[str]:
        """Our window: the shards after ``shard`` in the list (from its start again) not opened yet,
        as many as the agent prefetches. Random access has no order; this one downloads them all."""
        n, want = len(self.urls), int(self.hello.get("prefetch", 0))
        ahead: list[str] = []
        for k in range(1, n):
            if len(ahead) >= want:
                break
            other = (shard + k) % n
            if other not in self.seen:
                ahead.append(self.urls[other])
        return ahead

    def _let_go(self, shard: int) -> None:
        held = self.pinned.pop(shard, None)
        if held is None:
            return
        if shard == self.last:
            self.last = -1
        os.close(held.fd)  # before the agent may evict it: its space comes back
        self.conn.request(self.requests.release(self.urls[shard]))
        self._keep_table(shard, held.table)

    def _keep_table(self, shard: int, table: _Table) -> None:
        """Keep the table of a shard we let go (the latest, within ``TABLE_SAMPLES``)."""
        self.tables[shard] = table
        self.tables.move_to_end(shard)
        self.table_samples += len(table)
        while self.table_samples > TABLE_SAMPLES and self.tables:
            self.table_samples -= len(self.tables.popitem(last=False)[1])

    def _table(self, shard: int, identity: tuple[int, ...]) -> _Table:
        """The shard's sample table from one of the agent's workers (which walked it), for the
        cache file of ``identity``: byte ranges of the file, never its bytes."""
        assert self.links is not None
        infos = self.ds._list.shards
        assert infos is not None  # a shard index gives every shard's facts
        url, n = self.urls[shard], infos[shard].nsamples
        table = _Table(identity)
        layouts: dict[tuple[str, ...], tuple[str, ...]] = {}  # each sample's field names, made once
        worker = shard % len(self.links)
        header, _ = self._ask(worker, Requests.scan(url))
        if not header.get("ok"):
            raise unread_error(url, header, self.ds.endpoint)
        if header.get("count") != n:
            raise ShardError(url, f"{header.get('count')} samples, but the shard index says {n}")
        for first in range(0, n, TABLE_ITEMS):
            count = min(n, first + TABLE_ITEMS) - first
            items = pack_numbers([x for j in range(first, first + count) for x in (0, j)])
            header, frames = self._ask(worker, Requests.read([url], places=True), items)
            if not header.get("ok"):
                raise unread_error(url, header, self.ds.endpoint)
            _add_rows(table, layouts, header, frames, count, url)
        return table

    def _ask(self, worker: int, request: WorkerRequest, *payload: bytes) -> tuple[dict[str, Any], list[Any]]:
        """Send ``request`` (and its ``payload`` frames) to ``worker``; its proved reply, or
        AgentUnavailableError after the timeout."""
        assert self.links is not None
        rid = self.links.send(worker, request, "t", *payload)
        deadline = time.monotonic() + self.ds.timeout
        while (left := deadline - time.monotonic()) > 0:
            for header, frames in self.links.replies(min(0.25, left)):
                if header.get("id") == rid:
                    return header, frames
            left = deadline - time.monotonic()
            if left > 0 and time.monotonic() - self.contact > PING_EVERY:
                self._here(min(PING_EVERY, left))
        raise AgentUnavailableError(
            self.links.endpoints[worker], self.ds.timeout, "the agent's sample worker did not answer"
        )

    def forget(self) -> None:
        """In a forked child: close the cache files inherited from the parent, without a word to
        the agent (the pins are the parent's, as are the sockets), so that no file the agent
        evicts stays open here."""
        _close_files(self.pinned)

    def close(self, timeout: float = BYE_TIMEOUT) -> None:
        """Say bye, with our totals (waiting ``timeout`` at most for the agent), and close our
        files and sockets."""
        self._at_exit.cancel()
        self._dropped.detach()  # (said here: not again as we are collected)
        _close_files(self.pinned)
        try:
            self.conn.request(self.totals.bye(self.requests), timeout=timeout)
        except WdsCacheError:
            pass
        finally:
            self.conn.close()
            if self.links is not None:
                self.links.close()
            if self.private is not None:
                self.private.release()


_exit_deadline = 0.0  # time.monotonic() by which this process's exit byes end (0: not exiting yet)


def _bye_at_exit(session_ref: weakref.ReferenceType[_Session]) -> None:
    """At the normal exit of the process that made it (a :class:`multiprocessing.util.Finalize`
    runs in no other), the bye of a session never closed: its pings count its samples up to a
    second before, its bye all of them. The byes of a process's sessions wait
    ``EXIT_BYE_TIMEOUT`` at most all together (the agent may be gone)."""
    global _exit_deadline
    session = session_ref()
    if session is None:  # (collected: the finalizer runs then too, and has nothing to say)
        return
    if session.thread is not threading.current_thread() and session.thread.is_alive():
        return  # a daemon thread that reads on may be using its sockets
    if not _exit_deadline:
        _exit_deadline = time.monotonic() + EXIT_BYE_TIMEOUT
    session.conn.on_new_run = None  # a restarted agent knows nothing of us: no hello again at exit
    session.close(timeout=max(0.0, _exit_deadline - time.monotonic()))


def _bye_dropped(
    pid: int, pinned: OrderedDict[int, _Open], conn: AgentConnection, requests: Requests, totals: _Totals
) -> None:
    """A session dropped without ``close()``, collected: its files close; in the process that made
    it (of ``pid``: a forked child's copy holds its parent's pins, see :meth:`_Session.forget`),
    its bye goes, with its ``totals``, not waited for (the collector may run this in any thread, at
    any allocation: it must neither block nor raise), and its connection closes."""
    _close_files(pinned)
    if os.getpid() == pid:
        conn.tell_and_close(totals.bye(requests))


def _close_files(pinned: OrderedDict[int, _Open]) -> None:
    while pinned:
        os.close(pinned.popitem()[1].fd)


def _add_rows(
    table: _Table,
    layouts: dict[tuple[str, ...], tuple[str, ...]],
    header: dict[str, Any],
    frames: list[Any],
    n_items: int,
    url: str,
) -> None:
    """The samples of a worker's direct reply (its ``frames`` after the header), as places in
    the cache file of ``table.identity`` (``layouts``: the tuples of field names the table
    holds so far)."""
    keys, files = header.get("keys"), header.get("files")
    numbers, named = sample_table(frames), reply_layouts(header)
    if not (isinstance(keys, list) and isinstance(files, list) and len(keys) == n_items):
        raise ProtocolError(f"a worker's table of {url} does not match the request")
    n_frames = len(frames) - 1  # the runs sent (none, for a direct reply of a published shard)
    size = table.identity[2]
    try:
        for entry in files:
            if [int(x) for x in entry[3:]] != list(table.identity):
                raise ShardError(
                    url,
                    "the worker read another copy of its cache file than the one pinned (replaced "
                    "meanwhile); read the sample again",
                )
        rows = list(table_rows(numbers, named))
        if len(rows) != len(keys):
            raise ProtocolError(f"a worker's table of {url} does not match its samples")
        for key, (names, frame, pairs_at) in zip(keys, rows):
            if frame < n_frames:
                raise ProtocolError(f"a worker's table of {url} has a bad span")
            entry = files[frame - n_frames]
            span = numbers[pairs_at : pairs_at + 2 * len(names)]
            if len(span) != 2 * len(names):
                raise ProtocolError(f"a worker's table of {url} has a bad span")
            offsets = [int(entry[1]) + span[2 * i] for i in range(len(names))]
            start = offsets[0]
            ends = [offsets[i] + span[2 * i + 1] for i in range(len(names))]
            if max(ends) > size or min(offsets) < start:
                raise ProtocolError(f"a worker's table of {url} names bytes outside its cache file")
            fields = tuple("." + ext for ext in names)
            table.keys.append(str(key))
            table.names.append(layouts.setdefault(fields, fields))
            table.at.append(len(table.places))
            table.places.extend((start, max(ends) - start))
            for field_at, end in zip(offsets, ends):
                table.places.extend((field_at - start, end - start))
    except (TypeError, IndexError, ValueError):
        raise ProtocolError(f"a worker's table of {url} is malformed") from None
