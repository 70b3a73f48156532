"""The wire protocol between the agent and its clients (ZeroMQ multipart messages).

A message is ``[header, payload...]``: the header is a UTF-8 JSON object with an
``op`` string; payload frames are raw bytes whose meaning the header gives.
Nothing received is ever unpickled or evaluated, so no peer can make the agent
or a consumer run code; a malformed message is a :class:`ProtocolError` for
that message only.

Requests carry an ``id`` chosen by the client; the reply repeats it. Every
message, its fields, who sends it and its reply are in :data:`MESSAGES`.

Versions: :data:`PROTOCOL` numbers the protocol. The agent names it in its answer to
``auth``, and a client refuses an agent that names another (or none: one from before the
number); a consumer names it in its ``hello``, and the agent refuses a consumer that names
another (or none). So an agent and a training process from two installs of wdscache that
do not speak alike fail at the first message, with an error that says so, never halfway
through an epoch on a message one of them does not know.

Who may talk: the agent keeps a token in its cache directory (``CACHE_DIR/token``,
0600), so only the directory's owner can read it. A client first sends
``{"op": "auth", "nonce": N}`` (the one message taken without a key) and accepts
the agent only if the reply's ``proof`` is :func:`proof` of the token, N, the
agent's ``run`` (a random string per agent process) and the ``endpoint`` it listens
on, which on this machine's own TCP addresses must be the port the client dialled
(:func:`same_endpoint`): another user's process listening on that endpoint cannot
answer it, nor pass it on to the agent on another port and its answer back, and
learns nothing from the client. Every other message to the agent then carries ``key``, :func:`client_key`
of the token and ``run``. A key seen by someone else is of no use once that agent
process has gone. Every reply to a message with the key (errors too) carries ``proof``,
the :func:`reply_proof` of its ``id`` under :func:`agent_key` (token, ``run``), a key that
never travels; a client takes a reply without it only as a refusal of its key, which it
answers by asking whoever listens to prove itself again. So a process that takes the
endpoint of an agent that has stopped (over TCP, a port is anyone's once it is free) gets
a key of no use and cannot answer a request believably.

Workers: a request to worker ``i`` carries no key but ``auth``, the
:func:`request_proof` of its ``id`` under :func:`worker_key` (token, ``run``,
``i``), and every reply of the worker to such a request (errors too) carries
``proof``, the :func:`reply_proof` of that ``id``; a consumer drops a reply
without it as if it never came. A request without its ``auth`` is refused with no
proof: its id is its sender's choice, and proofs of chosen ids are what an impostor
would need. So a process that binds a worker's port (first, or while the worker is
down) gets requests it can neither answer believably nor learn a key from, and
costs that worker's availability only. A consumer's request
ids are unique within its stream, so a recorded reply is no proof for another
request of that stream. What this does not do: encrypt (anyone who sees the
traffic reads it); and the proof covers the worker and the request id, not the
reply's fields or bytes (hashing every payload would cost more than the read), so
a relay to the real worker, if one could reach it, can pass on genuine replies
only as far as their proof goes: one that could rewrite traffic in flight
(not another local user of a loopback endpoint) could alter samples.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import os
import socket
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import zmq

from .errors import ProtocolError

# The protocol's number: raised with every change to a message that a peer of the number
# before would not read the same way (see the module docstring).
PROTOCOL = 3
MAX_HEADER = 1 << 20
MAX_ID = 64  # ASCII characters of a string ``id``
NUMBER_MAX = (1 << 63) - 1  # the largest figure a report may carry (see numbers)
# Made once: json.dumps and json.loads with options build a new encoder or decoder per call,
# a measurable share of a consumer's CPU at tens of thousands of messages a second.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
PAGE_BYTES = 256 << 10  # a page of URLs stays well inside MAX_HEADER, however long the URLs
# Direct reads (a worker's reply naming byte ranges of cache files): a ``pread`` called from
# Python costs about as much as copying this many bytes (0.5 µs against 20 GB/s or more from
# the page cache). A worker merges a reply's ranges across gaps of at most this, and the
# loader reads a range at once where that copies at most this much in vain per payload it
# saves a call for (wdscache.training.replies.read_dense).
PREAD_BYTES = 8 << 10


def speaks(protocol: Any) -> str:
    """What a peer that named ``protocol`` speaks, for an error saying two peers differ."""
    return f"protocol {protocol}" if type(protocol) is int else "a protocol from before numbered ones"


SAME_INSTALL = (
    "the agent and the programs that use it must run the same wdscache: restart the agent "
    "from the install the training uses, or run the training with the agent's"
)


def pages(urls: Sequence[str], start: int = 0) -> Iterator[tuple[int, list[str]]]:
    """``(offset, urls)`` pages of at most PAGE_BYTES of URL text each (at least one URL)."""
    i = start
    while i < len(urls):
        size, j = 0, i
        while j < len(urls) and (j == i or size + len(urls[j]) + 8 <= PAGE_BYTES):
            size += len(urls[j]) + 8
            j += 1
        yield i, list(urls[i:j])
        i = j


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state first, start time 20th); None
    for a process that is gone, or where /proc does not tell."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _identity(pid: int, fields: list[str] | None) -> list[Any] | None:
    """``[pid, start time, boot id, pid namespace]`` from ``fields`` (:func:`_stat`'s of ``pid``)."""
    if fields is None:
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return [pid, int(fields[19]), boot, namespace]


def process_identity(pid: int | None = None) -> list[Any] | None:
    """``[pid, start time, boot id, pid namespace]`` of process ``pid`` (default: this one) as
    this process sees them; None where /proc does not tell (not Linux, no such process).

    A consumer names its process in hello with it; the agent watches that process only if
    it sees the same identity: another machine has another boot id, another container
    another pid namespace, and a pid reused since another start time.
    """
    pid = os.getpid() if pid is None else pid
    return _identity(pid, _stat(pid))


def still_runs(identity: Sequence[Any] | None) -> bool:
    """Whether the process ``identity`` names (:func:`process_identity`'s) still runs here: that very
    process (not its pid reused), and not a zombie. A zombie has ended (SIGKILLed, say) but keeps
    its pid and start time until its parent reaps it, which a parent that never waits for it (a
    supervisor, a loader that started a private agent) may not do for long; it holds no lock, no
    socket, no file, and does nothing more."""
    if identity is None or not identity or type(identity[0]) is not int:
        return False
    fields = _stat(identity[0])
    return fields is not None and fields[0] not in ("Z", "X") and _identity(identity[0], fields) == list(identity)


def launch_id() -> str | None:
    """The run of a training script this process is (its pid, start time and boot id): a
    loader made here names it in its hello, and its DataLoader workers (copies of it) too, so
    that the agent tells the script run again under the same job name from the workers of one
    run. None where /proc does not tell."""
    ident = process_identity()
    return None if ident is None else ":".join(map(str, ident[:3]))


def pack(header: Mapping[str, Any], *payloads: bytes | memoryview) -> list[bytes | memoryview]:
    """Frames for ``header`` and ``payloads``."""
    return [_ENCODE(header).encode(), *payloads]


def pack_numbers(numbers: Sequence[int]) -> bytes:
    """Whole numbers as one frame, 64-bit little-endian: a read's items and its reply's sample
    table, which as JSON would cost their senders and readers about a microsecond a sample each."""
    table = array("q", numbers)
    if sys.byteorder == "big":
        table.byteswap()
    return table.tobytes()


def unpack_numbers(frame: Any) -> array[int]:
    """The numbers of a :func:`pack_numbers` frame (bytes, or a ZeroMQ frame); ProtocolError
    unless it holds a whole number of them and none is negative."""
    table = array("q")
    try:
        table.frombytes(frame.buffer if hasattr(frame, "buffer") else frame)
    except ValueError:
        raise ProtocolError("a frame of numbers is not a whole number of 64-bit numbers") from None
    if sys.byteorder == "big":
        table.byteswap()
    if table and min(table) < 0:
        raise ProtocolError("a frame of numbers holds a negative number")
    return table


def unpack(frames: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Header and payload frames of a received message; raises ProtocolError if malformed."""
    if not frames:
        raise ProtocolError("empty message")
    raw = frames[0]
    raw = raw.bytes if hasattr(raw, "bytes") else raw
    if len(raw) > MAX_HEADER:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER}")
    try:
        header = _DECODE(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"header is not UTF-8 JSON: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("header must be a JSON object with an 'op' string")
    rid = header.get("id")
    if not (rid is None or type(rid) is int or type(rid) is str and len(rid) <= MAX_ID and rid.isascii()):
        raise ProtocolError(f"a message's 'id' is a whole number or a string of at most {MAX_ID} ASCII characters")
    return header, list(frames[1:])


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    # 1e999 is valid JSON, and Python reads it as infinity: no count, size or rate is one, and
    # one kept in the stats would make every later stats reply one that no JSON reader takes.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


_DECODE = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite).decode


def field(header: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """``header[name]`` checked to be of ``kind``; ProtocolError otherwise."""
    if name not in header:
        if default is ...:
            raise ProtocolError(f"{header.get('op')!r} message lacks {name!r}")
        return default
    value = header[name]
    # bool is an int in Python; a flag sent where a count is expected is still wrong.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise ProtocolError(f"{header.get('op')!r} message: {name!r} has the wrong type")
    return value


def strings(header: dict[str, Any], name: str) -> list[str]:
    """``header[name]`` checked to be a list of strings."""
    value = field(header, name, list)
    if not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{header.get('op')!r} message: {name!r} must hold strings only")
    return value


def numbers(header: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    """The fields of ``names`` that ``header`` has, each checked to be a count, a rate or a
    time: a number from 0 to the largest of 64 bits (figures kept for stats, which add them up
    and format them as floats)."""
    out = {}
    for name in names:
        if name in header:
            value = field(header, name, (int, float))
            if not 0 <= value <= NUMBER_MAX:
                raise ProtocolError(f"{header.get('op')!r} message: {name!r} is out of range")
            out[name] = value
    return out


def proof(token: str, nonce: str, run: str, endpoint: str) -> str:
    """What the agent listening on ``endpoint`` answers to a client's ``auth`` nonce: only a
    holder of the token can, and only for that endpoint (see :func:`same_endpoint`)."""
    return hmac.new(token.encode(), f"wdscache agent {nonce} {run} {endpoint}".encode(), hashlib.sha256).hexdigest()


def same_endpoint(dialled: str, named: str) -> bool:
    """False when ``named``, the endpoint an agent proved it listens on, cannot be the one a
    client ``dialled``: on this machine's own TCP addresses (loopback, by any name, or
    ``0.0.0.0``), another port. There any local user may listen on a port first, and pass a
    client's ``auth`` on to the agent's port and its answer back; this refuses such a relay
    (and so a forward from one local port to the agent's: dial the agent's port). Elsewhere
    the endpoint is not compared: an IPC socket lies in the user's own folder (and may be
    mounted at another path in a container), and a remote TCP endpoint may be reached through
    a port mapping, its path trusted as it is for the rest of the traffic."""
    scheme, _, rest = dialled.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not _local_host(host.strip("[]")):
        return True
    named_scheme, _, named_rest = named.partition("://")
    return named_scheme == "tcp" and named_rest.rpartition(":")[2] == port


def zmq_context(endpoint: str) -> zmq.Context:
    """A ZeroMQ context whose sockets may bind or dial ``endpoint`` (and the workers' endpoints
    beside it, on its host). One to an IPv6 address in brackets (``tcp://[::1]:PORT``) needs
    ZeroMQ's IPV6 option, off by default, and gets it; no other does: with it, a name such as
    ``localhost`` might resolve to ``::1`` for the agent and to 127.0.0.1 for a client."""
    ctx = zmq.Context()
    if endpoint.startswith("tcp://["):
        ctx.set(zmq.IPV6, 1)
    return ctx


def _local_host(host: str) -> bool:
    """Whether TCP to ``host`` reaches this machine by a loopback or unspecified address (a name
    resolved as the system resolves it, /etc/hosts first: a name that does not resolve is not)."""
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_loopback or address.is_unspecified:
            return True
    return False


def client_key(token: str, run: str) -> str:
    """The ``key`` every message to the agent of run ``run`` carries (a client's, or a worker's report)."""
    return hmac.new(token.encode(), f"wdscache client {run}".encode(), hashlib.sha256).hexdigest()


def agent_key(token: str, run: str) -> str:
    """The key of the agent run ``run``'s replies: it never travels, replies carry proofs made
    with it (:class:`Proofs`)."""
    return hmac.new(token.encode(), f"wdscache replies {run}".encode(), hashlib.sha256).hexdigest()


def worker_key(token: str, run: str, index: int) -> str:
    """The key of worker ``index`` of the agent run ``run``: it never travels, requests and
    replies carry proofs made with it (:class:`Proofs`)."""
    return hmac.new(token.encode(), f"wdscache worker {index} {run}".encode(), hashlib.sha256).hexdigest()


class Proofs:
    """The request and reply proofs of one key, a worker's or the agent's (see the module
    docstring): the HMAC is keyed once, and copied per message (a consumer sends tens of
    thousands a second)."""

    __slots__ = ("_mac",)

    def __init__(self, key: str) -> None:
        self._mac = hmac.new(key.encode(), digestmod=hashlib.sha256)

    def _of(self, kind: str, rid: Any) -> str:
        mac = self._mac.copy()
        # The id as JSON (ASCII): ``1`` and ``"1"`` differ, and any string it holds encodes.
        mac.update(f"{kind} {_ENCODE(rid)}".encode())
        return mac.hexdigest()

    def request(self, rid: Any) -> str:
        """The ``auth`` of the request ``rid``."""
        return self._of("req", rid)

    def reply(self, rid: Any) -> str:
        """The ``proof`` of the reply to the request ``rid``."""
        return self._of("reply", rid)


def request_proof(key: str, rid: Any) -> str:
    """The ``auth`` a request of id ``rid`` to the worker of ``key`` carries."""
    return Proofs(key).request(rid)


def reply_proof(key: str, rid: Any) -> str:
    """The ``proof`` the worker or agent of ``key`` puts on its reply to the request ``rid``."""
    return Proofs(key).reply(rid)


def same_secret(value: Any, secret: str) -> bool:
    """True when ``value`` is the string ``secret`` (compared in constant time)."""
    return isinstance(value, str) and value.isascii() and hmac.compare_digest(value, secret)


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


# -- every message, in one table -----------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One message of the protocol: who sends it to whom, its fields, and its reply.

    Field types are JSON's, written as in Python (``str``, ``int``, ``bool``,
    ``number``, ``list[str]``, ``list``, ``object``); a ``?`` marks a field that
    may be left out. Every request also carries ``id`` (a whole number or a short ASCII
    string, repeated in its reply) and, but for ``auth``, the ``key`` of the agent, or to a worker
    ``auth``; a reply to either carries ``proof`` (see the module docstring).
    ``frames`` says what the payload frames hold, if any.
    """

    op: str
    sender: str
    receiver: str
    fields: dict[str, str]
    reply: dict[str, str] = dataclass_field(default_factory=dict)
    frames: str = ""
    about: str = ""


# An agent's reply: ``fault`` when it failed for a fault of its own (out of open files), not the
# request's nor a shard's. A worker's says so by its kind (_WORKER_ERROR).
_ERROR = {"ok": "bool", "error": "str?", "fault": "bool?"}
_WORKER_REPLY = {"ok": "bool", "error": "str?"}
# A reader that said hello marks its opens, pings and reports (said_hello); the agent refuses
# them with need_hello once it dropped the reader (silent past --reader-timeout), so that the
# reader says hello again rather than go on unknown, as a plain client.
_GREETED = {"said_hello": "bool?"}
_FORGOTTEN = {"need_hello": "bool?"}
# What a worker's error reply adds: its kind; the shard it failed opening or reading (url), so
# that a read of several shards blames that one alone; for a corrupt one, where and why.
_WORKER_ERROR = {"kind": "str?", "reason": "str?", "offset": "int?", "url": "str?"}

#: Every message: the code is checked against this table (tests/test_protocol.py).
MESSAGES: tuple[Message, ...] = (
    # clients (a consumer, a ShardClient, wdscache stats) to the agent
    Message(
        "auth",
        "client",
        "agent",
        {"nonce": "str"},
        {**_ERROR, "run": "str", "endpoint": "str", "proof": "str", "protocol": "int"},
        about="the agent proves it holds the token and listens on ``endpoint``; the only op taken without a key",
    ),
    Message(
        "hello",
        "consumer",
        "agent",
        {
            "reader": "str",
            "job": "str",
            "rank": "int",
            "world_size": "int",
            "list_id": "str?",
            "epoch": "int?",
            "process": "list?",
            "shuffle_buffer": "int?",
            "probe": "bool?",
            "loader": "int?",
            "launch": "str?",
            "random_access": "bool?",
            "protocol": "int?",
        },
        {
            **_ERROR,
            "need_urls": "bool?",
            "workers": "list[str]",
            "prefetch": "int",
            "list_id": "str",
            "n_urls": "int",
            "local_urls": "bool?",
            "cache_dir": "str",
            "cache_root": "list",
        },
        about="a rank joins its job; list_id names its own list (sent first with put_urls if asked); "
        "epoch: the job's epoch it starts (its readers of one epoch read one agent list); "
        "probe: only to learn the list and its counts (a loader's len()), not a rank reading; "
        "loader: the loader's number in its process (a rank whose list differs from a live rank's of its "
        "job, epoch and loader is refused); "
        "random_access: a ShardListDataset's session, whose pins no thread lets go of while it is idle "
        "(the agent drops it once idle for IDLE_LET_GO while a reader waits for room that pins hold); "
        "the reply's local_urls: the agent's list holds a file:// URL",
    ),
    Message(
        "put_urls",
        "consumer",
        "agent",
        {"reader": "str", "offset": "int", "urls": "list[str]", "shards": "list?"},
        _ERROR,
        about="a page of a consumer's own URL list, before its hello; from a shard index, with each "
        "URL's [nsamples, filesize, md5] (null: not given) in shards",
    ),
    Message(
        "get_urls",
        "consumer",
        "agent",
        {"reader": "str", "offset": "int", "list_id": "str?"},
        {**_ERROR, "list_id": "str", "urls": "list[str]"},
        about="a page of the list the reader said hello on (list_id: that list, while the agent holds it, "
        "also once the reader said bye)",
    ),
    Message(
        "open",
        "consumer",
        "agent",
        {
            "reader": "str",
            "url": "str",
            "ahead": "list[str]?",
            "wait": "bool?",
            "while_downloading": "bool?",
            "release": "list[str]?",
            "also": "list[str]?",
            **_GREETED,
        },
        {
            **_ERROR,
            **_FORGOTTEN,
            "cached": "bool?",
            "while_downloading": "bool?",
            "path": "str?",
            "size": "int?",
            "samples": "int?",
            "corrupt": "bool?",
            "also": "list?",
            "also_samples": "list?",
        },
        about="pin a shard (waiting for its download, or, while_downloading, as soon as it can be read while "
        "it downloads); moves the reader's window; release: shards the reader lets go of first; "
        "corrupt: it failed because its copies were corrupt; also: shards the reader reads next, pinned "
        "too if they are cached now (never waited for), once the shard is: the reply's also says which were, "
        "also_samples their counts as samples gives the shard's (null: not counted)",
    ),
    Message(
        "status",
        "consumer",
        "agent",
        {"reader": "str", "url": "str"},
        {
            **_ERROR,
            "state": "str",
            "written": "int?",
            "total": "int?",
            "reason": "str?",
            "corrupt": "bool?",
            "failing": "str?",
            "agent_fault": "str?",
        },
        about="where a shard stands: cached, downloading, queued (and why), failed, unknown; "
        "failing: the last attempt's failure while its download retries; agent_fault: a fault of the "
        "agent's own that keeps downloads from going on (out of open files), not the shard's",
    ),
    Message("release", "consumer", "agent", {"reader": "str", "urls": "list[str]"}, _ERROR, about="unpin shards"),
    Message(
        "report",
        "consumer",
        "agent",
        {
            "reader": "str",
            "job": "str",
            "rank": "int",
            "epoch": "int",
            "position": "int",
            "samples": "int",
            "bytes": "int",
            "rate": "number",
            "wait_s": "number",
            **_GREETED,
        },
        {**_ERROR, **_FORGOTTEN},
        about="a consumer's progress, every second, for stats",
    ),
    Message(
        "ping",
        "consumer",
        "agent",
        {"reader": "str", "samples": "int?", "bytes": "int?", "rate": "number?", "wait_s": "number?", **_GREETED},
        {**_ERROR, **_FORGOTTEN, "known": "bool?"},
        about="is the agent there, and does it know the reader (not dropped as silent); a random-access "
        "session's carries its progress, as a report does",
    ),
    Message(
        "bye",
        "consumer",
        "agent",
        {
            "reader": "str",
            "epoch": "int?",
            "position": "int?",
            "samples": "int?",
            "bytes": "int?",
            "wait_s": "number?",
            "end_error": "str?",
        },
        _ERROR,
        about="a reader leaves: its pins go; a consumer's bye carries its report's fields, its final totals "
        "(logged, and kept in stats' ended_jobs), and end_error: the error of ours that ended its epoch, "
        "raised to the script (redacted)",
    ),
    Message(
        "counts",
        "consumer",
        "agent",
        {"urls": "list[str]"},
        {**_ERROR, "counts": "list"},
        about="the sample count of each shard (null: never counted)",
    ),
    Message(
        "corrupt",
        "consumer",
        "agent",
        {"url": "str", "error": "str"},
        _ERROR,
        about="a consumer found a shard's copy corrupt: the agent fetches it once more",
    ),
    Message(
        "stats",
        "client",
        "agent",
        {"flush": "bool?"},
        {**_ERROR, "stats": "object"},
        about="the live stats object (flush: read times and counters written to the index first, for ls)",
    ),
    Message(
        "evict",
        "client",
        "agent",
        {"urls": "list[str]", "force": "bool?"},
        {**_ERROR, "evicted": "list[str]", "bytes": "int", "refused": "list", "absent": "list[str]"},
        about="evict these cached shards (refused: [{url, reason}], those readers hold, unless force)",
    ),
    Message(
        "clear",
        "client",
        "agent",
        {"force": "bool?"},
        {**_ERROR, "evicted": "list[str]", "bytes": "int", "refused": "list", "absent": "list[str]"},
        about="evict every cached shard (as evict)",
    ),
    Message(
        "prefetch",
        "client",
        "agent",
        {"prefetch": "str", "urls": "list[str]", "retry": "bool?"},
        {**_ERROR, "asked": "int"},
        about="add a page of shards to the prefetch named (made on its first page; retry: forget their "
        "earlier failures): fetched after every reader's window; asked: its shards in all",
    ),
    Message(
        "prefetch_status",
        "client",
        "agent",
        {"prefetch": "str"},
        {
            **_ERROR,
            "total": "int",
            "cached": "int",
            "failed": "int",
            "pending": "int",
            "bytes_cached": "int",
            "bytes_written": "int",
            "bytes_total": "int?",
            "waiting_for_space": "str?",
            "changes": "list",
            "more": "bool",
        },
        about="where the prefetch stands: counts, bytes (of its shards cached, and written so far of those "
        "downloading; bytes_total null until every size is known), why its downloads wait, and its "
        "shards whose state changed since the last status ([{url, state: cached|failed, size?, "
        "error?}]; more: not all fitted, ask again)",
    ),
    Message(
        "prefetch_end",
        "client",
        "agent",
        {"prefetch": "str"},
        {**_ERROR, "ended": "bool"},
        about="the prefetch is over: its shards stay cached, held no more (a prefetch silent for a minute ends too)",
    ),
    # the agent's workers to the agent (with the workers' secret too)
    Message(
        "worker",
        "worker",
        "agent",
        {
            "secret": "str",
            "index": "int",
            "busy_s": "number",
            "requests": "int",
            "samples": "int",
            "bytes": "int",
            "indexed": "int",
            "walked": "int",
            "adopted": "int",
            "loaded": "int",
        },
        about="a worker's counters, every second; the agent sends hints back on its socket",
    ),
    Message(
        "counted",
        "worker",
        "agent",
        {"secret": "str", "url": "str", "samples": "int", "identity": "list"},
        about="the sample count a worker found in a cached shard (identity: of the file it read)",
    ),
    Message(
        "corrupt_copy",
        "worker",
        "agent",
        {"secret": "str", "url": "str", "identity": "list", "error": "str"},
        about="a worker found the cached file of this identity corrupt",
    ),
    Message(
        "walked",
        "worker",
        "agent",
        {"secret": "str", "url": "str", "identity": "list", "layouts": "list"},
        frames="the packed sample table (sampletable.PackedSamples.parts)",
        about="a table a worker walked, passed on by the agent to the other workers",
    ),
    # the agent to its workers (hints: no reply)
    Message(
        "index",
        "agent",
        "worker",
        {"url": "str", "now": "bool?"},
        about="walk this shard, just published, while idle (now: a reader holds it; first, and never held)",
    ),
    Message(
        "hold",
        "agent",
        "worker",
        {"seconds": "number"},
        about="a reader waits for a shard: no walks ahead for seconds (0: walk again)",
    ),
    # consumers to a worker
    Message(
        "read",
        "consumer",
        "worker",
        {"urls": "list[str]", "direct": "bool?", "places": "bool?"},
        {
            **_WORKER_REPLY,
            "proof": "str",
            "keys": "list[str]",
            "layouts": "list",
            "files": "list?",
            **_WORKER_ERROR,
        },
        frames="the read: its items (pack_numbers: per sample the index of its URL in urls, then its index "
        "in the shard); the reply: the sample table (pack_numbers: per sample its layout, frame, then offset and "
        "size per extension), then the runs of shard bytes it points into (none for file ranges: see worker.py)",
        about="samples by url index and sample index; the reply's op is 'samples' (or 'error')",
    ),
    Message(
        "scan",
        "consumer",
        "worker",
        {"url": "str", "while_downloading": "bool?"},
        {**_WORKER_REPLY, "proof": "str", "count": "int", "final": "bool", **_WORKER_ERROR},
        about="a shard's sample count (so far, for a download); the reply's op is 'scanned' (or 'error')",
    ),
)

#: Answered at the agent's door (no key yet) and passed on to the workers (with frames): before
#: the agent's table of handlers, so in none of the op sets below.
AT_THE_DOOR, PASSED_ON = "auth", "walked"
#: The ops the agent's handlers serve: every message to the agent but those two.
CONTROL_OPS: tuple[str, ...] = tuple(
    m.op for m in MESSAGES if m.receiver == "agent" and m.op not in (AT_THE_DOOR, PASSED_ON)
)
#: Reports only the agent's own workers may send (they carry the workers' secret).
WORKER_OPS: tuple[str, ...] = tuple(m.op for m in MESSAGES if m.sender == "worker" and m.op in CONTROL_OPS)
#: Ops of a reader, which name it (``reader``): each one counts as a sign of life.
READER_OPS: tuple[str, ...] = tuple(m.op for m in MESSAGES if "reader" in m.fields and m.op in CONTROL_OPS)
#: Ops refused with ``need_hello`` when marked ``said_hello`` by a reader the agent does not know.
GREETED_OPS: tuple[str, ...] = tuple(m.op for m in MESSAGES if "said_hello" in m.fields)

MESSAGE = {m.op: m for m in MESSAGES}
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str,
    "int": int,
    "bool": bool,
    "number": (int, float),
    "list[str]": list,
    "list": list,
    "object": dict,
}
# op -> (name, Python type, required, strings only) of each field: the table, read once.
_CHECKS = {
    m.op: tuple(
        (name, _JSON_TYPES[kind.rstrip("?")], not kind.endswith("?"), kind.rstrip("?") == "list[str]")
        for name, kind in m.fields.items()
    )
    for m in MESSAGES
}


def check(header: dict[str, Any]) -> Message:
    """The table's entry for ``header``, once each field it lists is checked: present unless
    optional, of its JSON type. A ProtocolError names the op and the field otherwise (fields
    the table does not list, ``id``, ``key``, ``auth``, are not looked at)."""
    op = header.get("op")
    if not isinstance(op, str) or op not in MESSAGE:
        raise ProtocolError(f"unknown op {op!r}")
    for name, kind, required, only_strings in _CHECKS[op]:
        if name in header:
            if only_strings:
                strings(header, name)
            else:
                field(header, name, kind)
        elif required:
            raise ProtocolError(f"{op!r} message lacks {name!r}")
    return MESSAGE[op]
