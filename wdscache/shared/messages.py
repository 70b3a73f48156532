"""Typed messages of the wire protocol, and the one place clients build them.

For every entry of :data:`~wdscache.shared.protocol.MESSAGES` there is a ``TypedDict``
``<Op>Message`` (``OpenMessage`` for ``open``, ``PrefetchStatusMessage`` for
``prefetch_status``): its ``op``, then its fields as the table gives them, those
marked ``?`` optional; and, for a message that has one, ``<Op>Reply`` with the
reply's fields (all optional: an error reply has ``ok`` false and ``error`` only).
``tests/test_protocol.py`` checks them against the table, field for field.
A worker's replies to a consumer have classes of their own in the shape it sends them
(:class:`SamplesReply`, :class:`ScannedReply`, :class:`WorkerErrorReply`, any of them a
:data:`ConsumerReply`), checked against the table's ``read`` and ``scan`` replies and against
every reply ``agent/worker.py`` builds; :mod:`wdscache.training.replies` decodes them.

:class:`Requests` builds every request a client sends (a consumer, a loader, a
``ShardClient``, the cache commands) and every report a worker sends; the
agent's and a worker's checks read the same table (:func:`~wdscache.shared.protocol.check`).
A message is a plain dict, built once: a request to a worker is on the hot path
(tens of thousands a second), so there is no object to convert, and
:func:`~wdscache.shared.protocol.pack` encodes it as it is. The connection adds
``id`` and ``key`` (to a worker: ``id`` and ``auth``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypedDict

from .protocol import PROTOCOL

# -- the messages and their replies, as MESSAGES lists them ------------------------------------


END_ERROR_MAX = 500  # characters of the error a bye carries, and the agent keeps, at most


class AuthMessage(TypedDict):
    op: Literal["auth"]
    nonce: str


class AuthReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    run: str
    endpoint: str
    proof: str
    protocol: int


class _HelloRequired(TypedDict):
    op: Literal["hello"]
    reader: str
    job: str
    rank: int
    world_size: int


class HelloMessage(_HelloRequired, total=False):
    list_id: str
    epoch: int
    process: list[Any]
    shuffle_buffer: int
    probe: bool
    loader: int
    launch: str
    random_access: bool
    protocol: int


class HelloReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    need_urls: bool
    workers: list[str]
    prefetch: int
    list_id: str
    n_urls: int
    local_urls: bool
    cache_dir: str
    cache_root: list[Any]


class _PutUrlsRequired(TypedDict):
    op: Literal["put_urls"]
    reader: str
    offset: int
    urls: list[str]


class PutUrlsMessage(_PutUrlsRequired, total=False):
    shards: list[Any]


class PutUrlsReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool


class _GetUrlsRequired(TypedDict):
    op: Literal["get_urls"]
    reader: str
    offset: int


class GetUrlsMessage(_GetUrlsRequired, total=False):
    list_id: str


class GetUrlsReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    list_id: str
    urls: list[str]


class _OpenRequired(TypedDict):
    op: Literal["open"]
    reader: str
    url: str


class OpenMessage(_OpenRequired, total=False):
    ahead: list[str]
    wait: bool
    while_downloading: bool
    release: list[str]
    also: list[str]
    said_hello: bool


class OpenReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    need_hello: bool
    cached: bool
    while_downloading: bool
    path: str
    size: int
    samples: int
    corrupt: bool
    also: list[Any]  # bools, one per shard asked for: pinned or not
    also_samples: list[Any]  # their counts (None: not pinned, or not known)


class StatusMessage(TypedDict):
    op: Literal["status"]
    reader: str
    url: str


class StatusReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    state: str
    written: int
    total: int
    reason: str
    corrupt: bool
    failing: str
    agent_fault: str


class ReleaseMessage(TypedDict):
    op: Literal["release"]
    reader: str
    urls: list[str]


class ReleaseReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool


class _ReportRequired(TypedDict):
    op: Literal["report"]
    reader: str
    job: str
    rank: int
    epoch: int
    position: int
    samples: int
    bytes: int
    rate: float
    wait_s: float


class ReportMessage(_ReportRequired, total=False):
    said_hello: bool


class ReportReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    need_hello: bool


class _PingRequired(TypedDict):
    op: Literal["ping"]
    reader: str


class PingMessage(_PingRequired, total=False):
    said_hello: bool
    # a ShardListDataset session's progress, for stats (as a report's: see Requests.ping)
    samples: int
    bytes: int
    rate: float
    wait_s: float


class PingReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    need_hello: bool
    known: bool


class _ByeRequired(TypedDict):
    op: Literal["bye"]
    reader: str


class ByeMessage(_ByeRequired, total=False):
    epoch: int
    position: int
    samples: int
    bytes: int
    wait_s: float
    end_error: str  # the error of ours that ended its epoch, raised to the script (redacted)


class ByeReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool


class CountsMessage(TypedDict):
    op: Literal["counts"]
    urls: list[str]


class CountsReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    counts: list[Any]


class CorruptMessage(TypedDict):
    op: Literal["corrupt"]
    url: str
    error: str


class CorruptReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool


class _StatsRequired(TypedDict):
    op: Literal["stats"]


class StatsMessage(_StatsRequired, total=False):
    flush: bool


class StatsReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    stats: dict[str, Any]


class _EvictRequired(TypedDict):
    op: Literal["evict"]
    urls: list[str]


class EvictMessage(_EvictRequired, total=False):
    force: bool


class EvictReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    evicted: list[str]
    bytes: int
    refused: list[Any]
    absent: list[str]


class _ClearRequired(TypedDict):
    op: Literal["clear"]


class ClearMessage(_ClearRequired, total=False):
    force: bool


class ClearReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    evicted: list[str]
    bytes: int
    refused: list[Any]
    absent: list[str]


class _PrefetchRequired(TypedDict):
    op: Literal["prefetch"]
    prefetch: str
    urls: list[str]


class PrefetchMessage(_PrefetchRequired, total=False):
    retry: bool


class PrefetchReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    asked: int


class PrefetchStatusMessage(TypedDict):
    op: Literal["prefetch_status"]
    prefetch: str


class PrefetchStatusReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    total: int
    cached: int
    failed: int
    pending: int
    bytes_cached: int
    bytes_written: int
    bytes_total: int
    waiting_for_space: str
    changes: list[Any]
    more: bool


class PrefetchEndMessage(TypedDict):
    op: Literal["prefetch_end"]
    prefetch: str


class PrefetchEndReply(TypedDict, total=False):
    ok: bool
    error: str
    fault: bool
    ended: bool


class WorkerMessage(TypedDict):
    op: Literal["worker"]
    secret: str
    index: int
    busy_s: float
    requests: int
    samples: int
    bytes: int
    indexed: int
    walked: int
    adopted: int
    loaded: int


class CountedMessage(TypedDict):
    op: Literal["counted"]
    secret: str
    url: str
    samples: int
    identity: list[Any]


class CorruptCopyMessage(TypedDict):
    op: Literal["corrupt_copy"]
    secret: str
    url: str
    identity: list[Any]
    error: str


class WalkedMessage(TypedDict):
    op: Literal["walked"]
    secret: str
    url: str
    identity: list[Any]
    layouts: list[Any]


class _IndexRequired(TypedDict):
    op: Literal["index"]
    url: str


class IndexMessage(_IndexRequired, total=False):
    now: bool


class HoldMessage(TypedDict):
    op: Literal["hold"]
    seconds: float


class _ReadRequired(TypedDict):
    op: Literal["read"]
    urls: list[str]


class ReadMessage(_ReadRequired, total=False):
    direct: bool
    places: bool
    id: str  # id and auth: added by the link that sends it, in place (no copy on the hot path)
    auth: str


class ReadReply(TypedDict, total=False):
    ok: bool
    error: str
    proof: str
    keys: list[str]
    layouts: list[Any]
    files: list[Any]
    kind: str
    reason: str
    offset: int
    url: str


class _ScanRequired(TypedDict):
    op: Literal["scan"]
    url: str


class ScanMessage(_ScanRequired, total=False):
    while_downloading: bool
    id: str
    auth: str


class ScanReply(TypedDict, total=False):
    ok: bool
    error: str
    proof: str
    count: int
    final: bool
    kind: str
    reason: str
    offset: int
    url: str


WorkerRequest = ReadMessage | ScanMessage  # what a consumer sends a worker


# -- a worker's replies, as it builds them ---------------------------------------------------
# Each reply of the table's ``read`` and ``scan`` in the shape a worker sends it: the reply's
# ``op`` names its kind, ``id`` is the request's, and ``proof`` is added as it is sent.
# ``tests/test_protocol.py`` checks them against the table and every reply worker.py builds
# against its class; a worker builds them as plain dict literals (no check per sample).


class _SamplesRequired(TypedDict):
    op: Literal["samples"]
    id: Any
    ok: Literal[True]
    keys: list[str]
    layouts: list[Any]


class SamplesReply(_SamplesRequired, total=False):
    """A worker's answer to ``read``: each sample's key, and the distinct tuples of extensions
    (``layouts``); the sample table (each sample's layout and span) and the runs of bytes
    follow as frames (``files``: the runs a direct consumer reads itself)."""

    files: list[Any]
    proof: str


class _ScannedRequired(TypedDict):
    op: Literal["scanned"]
    id: Any
    ok: Literal[True]
    count: int
    final: bool


class ScannedReply(_ScannedRequired, total=False):
    """A worker's answer to ``scan``: the shard's sample count (so far, unless ``final``)."""

    proof: str


#: Why a worker could not answer: no proof of the token, no such shard, not in the download so
#: far (ask again shortly), a damaged shard, a bad request or an error of the worker's (its
#: reply's ``url`` set: in opening or reading that shard's cache file), a fault of the agent's own
#: (out of open files).
WorkerErrorKind = Literal["refused", "missing", "pending", "corrupt", "protocol", "fault"]


class _WorkerErrorRequired(TypedDict):
    op: Literal["error"]
    id: Any
    ok: Literal[False]
    kind: WorkerErrorKind
    error: str


class WorkerErrorReply(_WorkerErrorRequired, total=False):
    """A worker's answer to ``read`` or ``scan`` that failed; ``url``: the shard it failed opening or
    reading (a read of several shards fails for that one alone); a ``corrupt`` one says where and why."""

    reason: str
    offset: int
    url: str
    proof: str


ConsumerReply = SamplesReply | ScannedReply | WorkerErrorReply  # what a worker answers a consumer


# -- building them --------------------------------------------------------------------------


class Requests:
    """The requests of one client, as reader ``reader`` (the name the agent knows it by:
    requests that name no reader ignore it). Arguments left at their default are left out
    of the message, where the receiver takes the same default. ``said_hello``: the reader
    said hello (a consumer's stream), so its opens, pings and reports say so, and an agent
    that dropped it since answers them ``need_hello``."""

    __slots__ = ("reader", "said_hello")

    def __init__(self, reader: str = "", *, said_hello: bool = False) -> None:
        self.reader = reader
        self.said_hello = said_hello

    # to the agent, as a reader

    def hello(
        self,
        job: str,
        rank: int,
        world_size: int,
        *,
        list_id: str | None = None,
        epoch: int | None = None,
        process: list[Any] | None = None,
        shuffle_buffer: int | None = None,
        probe: bool = False,
        loader: int | None = None,
        launch: str | None = None,
        random_access: bool = False,
    ) -> HelloMessage:
        m: HelloMessage = {
            "op": "hello",
            "reader": self.reader,
            "job": job,
            "rank": rank,
            "world_size": world_size,
            "protocol": PROTOCOL,
        }
        if list_id is not None:
            m["list_id"] = list_id
        if epoch is not None:
            m["epoch"] = epoch
        if process is not None:
            m["process"] = process
        if shuffle_buffer is not None:
            m["shuffle_buffer"] = shuffle_buffer
        if probe:
            m["probe"] = True
        if loader is not None:
            m["loader"] = loader
        if launch is not None:
            m["launch"] = launch
        if random_access:
            m["random_access"] = True
        return m

    def put_urls(self, offset: int, urls: list[str], shards: list[Any] | None = None) -> PutUrlsMessage:
        m: PutUrlsMessage = {"op": "put_urls", "reader": self.reader, "offset": offset, "urls": urls}
        if shards is not None:
            m["shards"] = shards
        return m

    def get_urls(self, offset: int, list_id: str | None = None) -> GetUrlsMessage:
        m: GetUrlsMessage = {"op": "get_urls", "reader": self.reader, "offset": offset}
        if list_id is not None:
            m["list_id"] = list_id
        return m

    def open(
        self,
        url: str,
        *,
        ahead: list[str] | None = None,
        wait: bool = True,
        while_downloading: bool = False,
        release: list[str] | None = None,
        also: list[str] | None = None,
    ) -> OpenMessage:
        m: OpenMessage = {"op": "open", "reader": self.reader, "url": url}
        if ahead is not None:
            m["ahead"] = ahead
        if not wait:
            m["wait"] = False
        if while_downloading:
            m["while_downloading"] = True
        if release:
            m["release"] = release
        if also:
            m["also"] = also
        if self.said_hello:
            m["said_hello"] = True
        return m

    def status(self, url: str) -> StatusMessage:
        return {"op": "status", "reader": self.reader, "url": url}

    def release(self, *urls: str) -> ReleaseMessage:
        return {"op": "release", "reader": self.reader, "urls": list(urls)}

    def report(
        self, job: str, rank: int, *, epoch: int, position: int, samples: int, bytes: int, rate: float, wait_s: float
    ) -> ReportMessage:
        m: ReportMessage = {
            "op": "report",
            "reader": self.reader,
            "job": job,
            "rank": rank,
            "epoch": epoch,
            "position": position,
            "samples": samples,
            "bytes": bytes,
            "rate": rate,
            "wait_s": wait_s,
        }
        if self.said_hello:
            m["said_hello"] = True
        return m

    def ping(
        self,
        *,
        samples: int | None = None,
        bytes: int | None = None,
        rate: float | None = None,
        wait_s: float | None = None,
    ) -> PingMessage:
        """A sign of life. A ``ShardListDataset`` session's (it has no report thread; it pings
        about once a second while it reads) carries its totals so far and its rate, which the
        agent takes as a report for stats."""
        m: PingMessage = {"op": "ping", "reader": self.reader}
        if self.said_hello:
            m["said_hello"] = True
        if samples is not None:
            m["samples"] = samples
        if bytes is not None:
            m["bytes"] = bytes
        if rate is not None:
            m["rate"] = rate
        if wait_s is not None:
            m["wait_s"] = wait_s
        return m

    def bye(
        self,
        *,
        epoch: int | None = None,
        position: int | None = None,
        samples: int | None = None,
        bytes: int | None = None,
        wait_s: float | None = None,
        end_error: str | None = None,
    ) -> ByeMessage:
        """A consumer's bye carries its final totals (see :meth:`report`) and how its epoch ended
        (``end_error``, already redacted, when an error of ours raised to the script ended it); any
        other reader's, none."""
        m: ByeMessage = {"op": "bye", "reader": self.reader}
        if end_error is not None:
            m["end_error"] = end_error
        if epoch is not None:
            m["epoch"] = epoch
        if position is not None:
            m["position"] = position
        if samples is not None:
            m["samples"] = samples
        if bytes is not None:
            m["bytes"] = bytes
        if wait_s is not None:
            m["wait_s"] = wait_s
        return m

    # to the agent, as any client

    @staticmethod
    def auth(nonce: str) -> AuthMessage:
        return {"op": "auth", "nonce": nonce}

    @staticmethod
    def counts(urls: list[str]) -> CountsMessage:
        return {"op": "counts", "urls": urls}

    @staticmethod
    def corrupt(url: str, error: str) -> CorruptMessage:
        return {"op": "corrupt", "url": url, "error": error}

    @staticmethod
    def stats(*, flush: bool = False) -> StatsMessage:
        return {"op": "stats", "flush": True} if flush else {"op": "stats"}

    @staticmethod
    def evict(urls: list[str], *, force: bool = False) -> EvictMessage:
        return {"op": "evict", "urls": urls, "force": force}

    @staticmethod
    def clear(*, force: bool = False) -> ClearMessage:
        return {"op": "clear", "force": force}

    @staticmethod
    def prefetch(name: str, urls: list[str], *, retry: bool = False) -> PrefetchMessage:
        return {"op": "prefetch", "prefetch": name, "urls": urls, "retry": retry}

    @staticmethod
    def prefetch_status(name: str) -> PrefetchStatusMessage:
        return {"op": "prefetch_status", "prefetch": name}

    @staticmethod
    def prefetch_end(name: str) -> PrefetchEndMessage:
        return {"op": "prefetch_end", "prefetch": name}

    # to a worker

    @staticmethod
    def read(urls: list[str], *, direct: bool = False, places: bool = False) -> ReadMessage:
        """A read of samples of ``urls``; its items go in a frame of their own, per sample the
        index of its URL in ``urls`` and its index in the shard (:func:`~wdscache.shared.protocol.pack_numbers`).
        ``direct``: file ranges, no bytes (but for short runs); ``places``: file ranges only, whatever
        their length (a random-access table of where the samples lie)."""
        if places:
            return {"op": "read", "urls": urls, "direct": True, "places": True}
        if direct:
            return {"op": "read", "urls": urls, "direct": True}
        return {"op": "read", "urls": urls}

    @staticmethod
    def scan(url: str, *, while_downloading: bool = False) -> ScanMessage:
        if while_downloading:
            return {"op": "scan", "url": url, "while_downloading": True}
        return {"op": "scan", "url": url}


class Reports:
    """The messages of a sample worker to the agent (each carries the workers' ``secret``),
    and the agent's hints back."""

    __slots__ = ("secret",)

    def __init__(self, secret: str) -> None:
        self.secret = secret

    def worker(
        self,
        index: int,
        *,
        busy_s: float,
        requests: int,
        samples: int,
        bytes: int,
        indexed: int,
        walked: int,
        adopted: int,
        loaded: int,
    ) -> WorkerMessage:
        return {
            "op": "worker",
            "secret": self.secret,
            "index": index,
            "busy_s": busy_s,
            "requests": requests,
            "samples": samples,
            "bytes": bytes,
            "indexed": indexed,
            "walked": walked,
            "adopted": adopted,
            "loaded": loaded,
        }

    def counted(self, url: str, samples: int, identity: Sequence[int]) -> CountedMessage:
        return {"op": "counted", "secret": self.secret, "url": url, "samples": samples, "identity": list(identity)}

    def corrupt_copy(self, url: str, identity: list[Any], error: str) -> CorruptCopyMessage:
        return {"op": "corrupt_copy", "secret": self.secret, "url": url, "identity": identity, "error": error}

    def walked(self, url: str, identity: list[Any], layouts: list[Any]) -> WalkedMessage:
        return {"op": "walked", "secret": self.secret, "url": url, "identity": identity, "layouts": layouts}

    @staticmethod
    def index(url: str, *, now: bool = False) -> IndexMessage:
        message: IndexMessage = {"op": "index", "url": url}
        if now:
            message["now"] = True
        return message

    @staticmethod
    def hold(seconds: float) -> HoldMessage:
        return {"op": "hold", "seconds": seconds}
