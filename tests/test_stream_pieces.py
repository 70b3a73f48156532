"""The epoch stream's pieces, each built directly, without sockets or an agent: the read
records and their transitions, reply decoding, pins, the sequence's feed and the
progress clock. The agent they talk to is a scripted stand-in for AgentConnection.
"""

from __future__ import annotations

import errno
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from wdscache.shared import protocol
from wdscache.shared.errors import AgentUnavailableError, FetchError, ProtocolError, ShardError
from wdscache.shared.protocol import pack_numbers
from wdscache.shared.sequence import EpochSpec, ShardFeed, global_sequence
from wdscache.training import pins as pins_module
from wdscache.training.direct import StaleFile
from wdscache.training.epoch_shards import EpochShards, StopEpoch
from wdscache.training.pins import Pins
from wdscache.training.progress import ProgressClock
from wdscache.training.read_batches import FIRST_REQUEST, REQUEST_BYTES, ReadBatcher
from wdscache.training.read_failures import ReadFailures
from wdscache.training.reads import ReadState, ReadTable
from wdscache.training.replies import decode_reply

URLS = [f"http://example.invalid/shard-{i}.tar" for i in range(4)]


class ScriptedAgent:
    """Answers requests from a table of op -> reply (a callable of the request, or a dict);
    records every request, each checked against the protocol's table."""

    def __init__(self, **replies: Any) -> None:
        self.replies = replies
        self.sent: list[dict[str, Any]] = []

    def request(self, header: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        protocol.check(header)  # as the agent would take it
        self.sent.append(dict(header))
        reply = self.replies.get(header["op"], {"ok": True})
        return reply(header) if callable(reply) else reply

    def request_patiently(
        self, header: dict[str, Any], *, liveness: float, probe: dict[str, Any], every: float, on_probe: Any
    ) -> dict[str, Any]:
        on_probe({"state": "downloading", "written": 10})
        return self.request(header)

    def ops(self) -> list[tuple[str, str | None]]:
        """(op, URL) of each request, in order; the pins let go that a request carried come
        before it, as the agent takes them: ("release", URL) each."""
        out: list[tuple[str, str | None]] = []
        for h in self.sent:
            out += [("release", url) for url in h.get("release", ())]
            out += [("release", url) for url in h["urls"]] if h["op"] == "release" else [(h["op"], h.get("url"))]
        return out


# -- reads ----------------------------------------------------------------------------


def items(n: int, shard: int = 0) -> list[tuple[int, tuple[int, int]]]:
    return [(i, (shard, i)) for i in range(n)]


def test_a_read_goes_from_sent_to_answered_and_is_handed_out_once() -> None:
    table = ReadTable()
    read = table.add(0, items(3))
    assert read.state is ReadState.NEW and table.hand_out(0) is None
    table.send(read, range(3), "r0", worker=1, direct=True, now=5.0)
    assert (read.state, read.rid, read.worker, read.direct, read.sent_at) == (ReadState.SENT, "r0", 1, True, 5.0)
    assert table.awaiting() == 1 and table.in_state(ReadState.SENT) == [read]
    assert table.hand_out(0) is None  # not answered yet
    assert table.replied("r0") is read and table.replied("r0") is None  # one reply per send
    assert table.awaiting() == 0
    table.answer(read, ["a", "b", "c"], [1, 2, 3])
    assert read.state is ReadState.ANSWERED
    assert table.hand_out(0) is read and table.hand_out(0) is None and not table.by_seq


def test_a_resent_read_ignores_the_reply_to_its_earlier_send() -> None:
    table = ReadTable()
    read = table.add(7, items(2))
    table.send(read, range(2), "r1", 0, False, now=0.0)
    read.resends += 1
    table.send(read, range(2), "r2", 1, False, now=1.0)
    assert table.replied("r1") is None  # a late answer finds no read
    assert table.awaiting() == 1 and table.replied("r2") is read


def test_delayed_and_reopened_reads_are_counted_and_leave_those_states_when_sent() -> None:
    table = ReadTable()
    a, b = table.add(0, items(2)), table.add(1, items(2, shard=1))
    table.send(a, range(2), "r0", 0, False, now=0.0)
    table.send(b, range(2), "r1", 0, False, now=0.0)
    table.replied("r0")
    table.delay(a, until=2.0, now=1.0)
    table.delay(a, until=3.0, now=2.5)  # asked again, "pending" again: the first answer counts
    assert (a.state, a.retry_at, a.pending_since, table.delayed) == (ReadState.DELAYED, 3.0, 1.0, 1)
    table.reopen(a)  # an open had to wait: delayed reads are pinned again first
    assert (table.delayed, table.reopening) == (0, 1)
    table.replied("r1")
    table.reopen(b)
    assert table.reopening == 2 and table.in_state(ReadState.REOPEN) == [a, b]
    table.send(a, range(2), "r2", 0, False, now=4.0)
    assert (a.state, table.reopening, table.awaiting()) == (ReadState.SENT, 1, 1)
    table.replied("r2")
    table.answer(a, [None, None], [0, 0])
    assert a.pending_since is None  # samples came: no longer waiting on its download


def test_sent_items_leave_out_the_holes() -> None:
    table = ReadTable()
    read = table.add(0, [(0, (0, 0)), (1, (1, 0)), (2, (0, 1))])
    table.send(read, [0, 2], "r0", 0, False, now=0.0)
    assert read.sent_items() == [(0, (0, 0)), (2, (0, 1))]
    samples, sizes = read.whole(["x", "y"], [5, 6])
    assert samples == ["x", None, "y"] and sizes == [5, 0, 6]


def test_a_read_that_goes_a_part_at_a_time_keeps_each_parts_samples_until_the_last() -> None:
    table = ReadTable()
    read = table.add(0, [(0, (0, 0)), (1, (1, 0)), (2, (2, 0)), (3, (1, 1))])
    table.send(read, [0, 1, 2, 3], "r0", 0, False, now=0.0)
    table.replied("r0")
    table.reopen(read)  # "missing": its shards are pinned again, but shard 1 could not be with the others
    read.later = {1}
    assert read.to_ask(skipped={2}) == [0]  # shard 2 skipped meanwhile: a hole
    table.send(read, [0], "r1", 0, False, now=1.0)
    table.replied("r1")
    table.part_answered(read, ["a"], [5])
    assert (read.state, read.later, table.reopening) == (ReadState.REOPEN, set(), 1)
    assert read.to_ask(skipped={2}) == [1, 3]
    table.send(read, [1, 3], "r2", 0, False, now=2.0)
    table.replied("r2")
    assert read.whole(["b", "d"], [6, 7]) == (["a", "b", None, "d"], [5, 6, 0, 7])


def test_a_read_cut_where_the_epoch_stops_keeps_the_items_before_and_is_asked_for_them_again() -> None:
    table = ReadTable()
    sent, delayed = table.add(0, [(0, (0, 3)), (1, (1, 0)), (2, (1, 1))]), table.add(1, [(3, (0, 0)), (4, (1, 0))])
    table.send(sent, range(3), "r0", 0, False, now=0.0)
    table.send(delayed, range(2), "r1", 0, False, now=0.0)
    table.replied("r1")
    table.delay(delayed, until=1.0, now=0.0)
    table.cut(sent, 1)  # shard 1 fails: the epoch stops at its first item
    table.cut(delayed, 1)
    assert [r.items for r in (sent, delayed)] == [[(0, (0, 3))], [(3, (0, 0))]]
    assert (sent.state, delayed.state, table.reopening, table.delayed) == (ReadState.REOPEN, ReadState.REOPEN, 2, 0)
    assert table.awaiting() == 0 and table.replied("r0") is None  # the reply to the whole read finds none
    parts = table.add(2, [(5, (0, 1)), (6, (2, 0)), (7, (1, 2)), (8, (2, 1))])
    parts.got = {0: ("a", 5), 1: ("b", 6), 3: ("d", 7)}  # parts came; shard 1's waits for its pin
    table.cut(parts, 2)
    assert parts.got == {0: ("a", 5), 1: ("b", 6)} and parts.to_ask(skipped={1}) == []


def test_reads_start_small_and_double_with_each_reply_up_to_request_size_and_about_four_mib() -> None:
    # Small first reads: a list of small shards whose counts are not known yet is opened and
    # counted as far as the first window of reads reaches, before the first sample comes.
    batcher = ReadBatcher(SimpleNamespace(settings=SimpleNamespace(request_size=512)))  # type: ignore[arg-type]
    limits = [batcher.request_limit]
    for _ in range(6):
        batcher.sized([1000] * 8)  # replies of 1 KB samples
        limits.append(batcher.request_limit)
    assert limits == [FIRST_REQUEST, 64, 128, 256, 512, 512, 512]
    batcher.sized([1_000_000])  # 1 MB samples: about 4 MiB a read at once
    assert batcher.request_limit == REQUEST_BYTES // 1_000_000
    small = ReadBatcher(SimpleNamespace(settings=SimpleNamespace(request_size=4)))  # type: ignore[arg-type]
    small.sized([1000])
    assert small.request_limit == 4


# -- reply decoding --------------------------------------------------------------------


def wire(header: dict[str, Any], frames: list[Any] | None = None) -> tuple[dict[str, Any], list[Any]]:
    """A reply written with each sample's ``exts`` and ``spans`` as a worker sends it: the
    distinct tuples of extensions as ``layouts``, and the sample table as the first frame."""
    header = dict(header)
    exts, spans = header.pop("exts"), header.pop("spans")
    layouts = list(dict.fromkeys(tuple(names) for names in exts))
    table: list[int] = []
    for names, span in zip(exts, spans):
        table += [layouts.index(tuple(names)), *span]
    return {**header, "layouts": [list(names) for names in layouts]}, [
        zmq.Frame(pack_numbers(table)),
        *(frames if frames is not None else [zmq.Frame(b"")]),
    ]


def reply(payloads: list[dict[str, bytes]], **extra: Any) -> tuple[dict[str, Any], list[zmq.Frame]]:
    """A worker's reply with every sample in one frame, as worker.py sends a run (``exts`` and
    ``spans`` as each sample's: see :func:`wire`)."""
    blob, spans = b"", []
    for sample in payloads:
        span = [0]
        for data in sample.values():
            span += [len(blob), len(data)]
            blob += data
        spans.append(span)
    header = {
        "ok": True,
        "keys": [f"k{i}" for i in range(len(payloads))],
        "exts": [list(s) for s in payloads],
        "spans": spans,
        **extra,
    }
    return header, [zmq.Frame(blob)]


def test_a_reply_decodes_to_samples_and_their_payload_bytes() -> None:
    header, frames = wire(*reply([{"cls": b"1", "jpg": b"abcd"}, {"cls": b"22", "jpg": b""}]))
    samples, sizes = decode_reply(header, frames, items(2, shard=2), URLS)
    assert samples == [
        {"__key__": "k0", "__url__": URLS[2], "cls": b"1", "jpg": b"abcd"},
        {"__key__": "k1", "__url__": URLS[2], "cls": b"22", "jpg": b""},
    ]
    assert sizes == [5, 2] and all(type(v) is bytes for s in samples for k, v in s.items() if k[0] != "_")
    views, _ = decode_reply(header, frames, items(2), URLS, zero_copy=True)
    assert type(views[0]["jpg"]) is memoryview and views[0]["jpg"].readonly and bytes(views[0]["jpg"]) == b"abcd"


@pytest.mark.parametrize(
    "frame_of, exts",
    [
        ([0, 0, 0], [["cls", "jpg"]] * 3),  # one layout, one frame (a shuffled read's copies)
        ([1, 0, 1], [["cls", "jpg"]] * 3),  # one layout, two frames (runs of two shards)
        ([0, 0, 1], [["cls", "jpg"], ["jpg"], ["cls", "jpg"]]),  # two layouts
    ],
)
def test_every_sample_gets_its_own_bytes_however_the_reply_lays_them_out(frame_of, exts) -> None:
    payloads = [{e: f"{e}{i}".encode() * (i + 1) for e in names} for i, names in enumerate(exts)]
    blobs, spans = [b"xx", b"y"], []  # bytes before each frame's first payload
    for f, sample in zip(frame_of, payloads):
        span = [f]
        for data in sample.values():
            span += [len(blobs[f]), len(data)]
            blobs[f] += data
        spans.append(span)
    header, frames = wire(
        {"ok": True, "keys": ["a", "b", "c"], "exts": exts, "spans": spans}, [zmq.Frame(b) for b in blobs]
    )
    for zero_copy in (False, True):
        samples, sizes = decode_reply(header, frames, items(3, shard=1), URLS, zero_copy=zero_copy)
        assert [{k: bytes(v) if k[0] != "_" else v for k, v in s.items()} for s in samples] == [
            {"__key__": key, "__url__": URLS[1], **p} for key, p in zip("abc", payloads)
        ]
        assert sizes == [sum(map(len, p.values())) for p in payloads]
        assert all(
            type(v) is (memoryview if zero_copy else bytes) for s in samples for k, v in s.items() if k[0] != "_"
        )


@pytest.mark.parametrize(
    "change",
    [
        {"keys": ["k0"]},  # does not match the request
        {"spans": [[0, 0, 1, 1, 4], [0, 5]]},  # a span for one extension, the sample has two
        {"spans": [[0, 0, 1, 1, 99], [0, 5, 1, 6, 1]]},  # past its frame
        {"spans": [[1, 0, 1, 1, 4], [0, 5, 1, 6, 1]]},  # a frame that is not there
        {"spans": [[0, -1, 1, 1, 4], [0, 5, 1, 6, 1]]},  # negative
        {"spans": [[0, 0, 1, 1, 4], [0, 5, 1, 6, 1, 7]]},  # a number too many
        {"exts": [["cls", "jpg"], ["cls", "jpg", "txt"]]},  # more extensions than the span has
        {"layouts": "cls"},
        {"layouts": [[]]},
        {"exts": [["cls", "jpg"], ["jpg", "cls"]], "layouts": [["cls", "jpg"]]},  # a layout not named
        {"table": b"\0" * 7},  # not a whole number of numbers
        {"files": [[0, 0, 1, 1, 2, 3, 4]]},  # file ranges a read without direct did not ask for
    ],
)
def test_a_reply_that_does_not_add_up_is_a_protocol_error(change: dict[str, Any]) -> None:
    header, frames = reply([{"cls": b"1", "jpg": b"abcd"}, {"cls": b"2", "jpg": b"e"}])
    table = change.pop("table", None)
    layouts = change.pop("layouts", None)
    header, frames = wire({**header, **change}, frames)
    if table is not None:
        frames[0] = zmq.Frame(table)
    if layouts is not None:
        header["layouts"] = layouts
    with pytest.raises(ProtocolError):
        decode_reply(header, frames, items(2), URLS)


class Ranges:
    """A file reader standing in for CacheFiles: every file holds bytes 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, tuple[int, ...], int, int]] = []

    def range(self, url: str, identity: Any, start: int, size: int) -> Ranges.Span:
        self.asked.append((url, tuple(identity), start, size))
        return Ranges.Span(start, size)

    class Span:
        def __init__(self, start: int, size: int) -> None:
            self.start, self.size = start, size

        def __len__(self) -> int:
            return self.size

        def read(self, offset: int, size: int) -> bytes:
            return bytes(range(self.start + offset, self.start + offset + size))


def test_a_direct_reply_reads_its_file_ranges_through_the_reader() -> None:
    ident = [1, 2, 100, 7]
    # shard 3's sample: frame 1 is the first file range (frame 0 the socket's, empty here)
    written = {"ok": True, "keys": ["k"], "exts": [["bin"]], "spans": [[1, 2, 3]], "files": [[0, 10, 20, *ident]]}
    header, frames = wire(written)
    files = Ranges()
    samples, sizes = decode_reply(header, frames, items(1, shard=3), URLS, direct=True, files=files)
    assert samples[0]["bin"] == bytes([12, 13, 14]) and sizes == [3]
    assert files.asked == [(URLS[3], tuple(ident), 10, 20)]
    with pytest.raises(ProtocolError):  # past the range's end
        decode_reply(*wire({**written, "spans": [[1, 18, 3]]}), items(1), URLS, direct=True, files=files)
    with pytest.raises(StaleFile) as stale:  # direct reads turned off since the read went out
        decode_reply(header, frames, items(1), URLS, direct=True, files=None)
    assert stale.value.errno == errno.ESTALE


class CountedFile:
    """A file reader whose every file holds bytes 0, 1, 2, ... (mod 256), counting the reads."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    def range(self, url: str, identity: Any, start: int, size: int) -> CountedFile:
        self.size = size
        return self

    def __len__(self) -> int:
        return self.size

    def read(self, offset: int, size: int) -> bytes:
        self.reads.append((offset, size))
        return bytes(x % 256 for x in range(offset, offset + size))


MIB = 1 << 20


@pytest.mark.parametrize(
    ("samples", "range_size", "reads"),
    [
        # small samples, every other one (one of two DataLoader workers): the range at once
        ([[(i * 7168, 1000), (i * 7168 + 1536, 3), (i * 7168 + 2048, 60)] for i in range(64)], 64 * 7168, 1),
        # one small sample of three payloads (a shuffled read): one read, not three
        ([[(0, 1000), (1536, 3), (2048, 60)]], 2108, 1),
        # one large sample: each payload copied once, not the range twice
        ([[(0, 110_000), (110_592, 3), (111_104, 60)]], 111_164, 3),
        # a few small samples scattered over a long range (a shuffled read): payload by payload
        ([[(i * MIB, 1000), (i * MIB + 1536, 60)] for i in range(3)], 2 * MIB + 1596, 6),
        # one payload: nothing to save
        ([[(0, 500)]], 500, 1),
        # small samples of two tuples of extensions (rows of two lengths): the range at once
        (
            [[(i * 4096, 1000), (i * 4096 + 1536, 3), *([(i * 4096 + 2048, 60)] if i % 2 else [])] for i in range(16)],
            16 * 4096,
            1,
        ),
        # large samples of two tuples of extensions: payload by payload
        ([[(i * 120_000, 110_000), *([(i * 120_000 + 110_592, 60)] if i % 2 else [])] for i in range(4)], 480_000, 6),
    ],
)
def test_a_file_range_is_read_whole_only_where_that_saves_syscalls(
    samples: list[list[tuple[int, int]]], range_size: int, reads: int
) -> None:
    header = {
        "ok": True,
        "keys": [f"k{i}" for i in range(len(samples))],
        "exts": [[f"e{j}" for j in range(len(s))] for s in samples],
        "spans": [[1, *[x for payload in sample for x in payload]] for sample in samples],
        "files": [[0, 0, range_size, 1, 2, range_size, 7]],
    }
    files = CountedFile()
    got, sizes = decode_reply(*wire(header), items(len(samples)), URLS, direct=True, files=files)
    assert len(files.reads) == reads
    for sample, payloads in zip(got, samples):  # the same bytes either way
        assert [sample[f"e{j}"] for j in range(len(payloads))] == [
            bytes(x % 256 for x in range(o, o + n)) for o, n in payloads
        ]
        assert all(type(v) is bytes for k, v in sample.items() if k[0] != "_")
    assert sizes == [sum(n for _, n in payloads) for payloads in samples]


# -- pins -------------------------------------------------------------------------------


def test_a_pin_is_let_go_once_no_read_holds_it_and_the_sequence_needs_it_no_more() -> None:
    agent = ScriptedAgent(open={"ok": True, "samples": 5})
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    noop = lambda *a: None  # noqa: E731
    assert pins.open(0, [URLS[1]], before_wait=noop, on_status=noop)["ok"]
    assert pins.opened == {0: 0} and agent.sent[0]["ahead"] == [URLS[1]] and "while_downloading" not in agent.sent[0]
    pins.opened[0] += 1  # a read of it is out
    pins.counted(0, 5)
    pins.given = 5
    for _ in range(5):  # the sequence gives out its ids
        pins.remaining[0] -= 1
    pins.release(0)
    assert 0 in pins.opened  # the read still holds it
    pins.opened[0] -= 1
    pins.release(0)
    assert 0 not in pins.opened and pins.letting_go == [URLS[0]]
    pins.open(1, [], before_wait=noop, on_status=noop)  # the agent hears of it with our next open, first
    assert agent.ops()[-2:] == [("release", URLS[0]), ("open", URLS[1])] and not pins.letting_go


def test_a_pin_let_go_is_sent_alone_once_it_waited_for_an_open_long_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = ScriptedAgent(open={"ok": True})
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    noop = lambda *a: None  # noqa: E731
    for shard in (0, 1):
        pins.open(shard, [], before_wait=noop, on_status=noop)
    for shard in (0, 1):
        pins.release(shard, force=True)
    pins.flush()
    assert pins.letting_go == [URLS[0], URLS[1]] and agent.ops()[-1] == ("open", URLS[1])  # not yet due
    monkeypatch.setattr(pins_module, "RELEASE_AFTER", 0.0)
    pins.flush()
    assert agent.sent[-1] == {"op": "release", "reader": "me", "urls": [URLS[0], URLS[1]]} and not pins.letting_go
    pins.flush()  # nothing left to tell
    assert len(agent.sent) == 3


def test_a_shard_is_let_go_once_the_share_dealt_its_last_id() -> None:
    agent = ScriptedAgent(open={"ok": True})
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    pins.open(1, [], before_wait=lambda: None, on_status=lambda s: None)
    pins.given = 3
    pins.counted(1, 0)  # its ids are all out (none) after 3 ids of the epoch
    pins.release_settled(2)
    assert 1 in pins.opened
    pins.release_settled(3)
    assert 1 not in pins.opened and not pins.unneeded


def test_an_open_that_must_wait_first_lets_go_of_every_other_pin() -> None:
    answers = iter(
        [{"ok": True}, {"ok": True}, {"ok": False, "cached": False}, {"ok": True, "while_downloading": True}]
    )
    agent = ScriptedAgent(open=lambda header: next(answers))
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    events: list[str] = []
    statuses: list[dict[str, Any]] = []
    pins.open(0, [], before_wait=lambda: None, on_status=statuses.append)
    pins.open(1, [], before_wait=lambda: None, on_status=statuses.append)
    pins.remaining[1] = 4  # still needed: only a wait lets go of it
    reply = pins.open(
        2, [], while_downloading=True, before_wait=lambda: events.append("finish reads"), on_status=statuses.append
    )
    assert reply["while_downloading"] and events == ["finish reads"] and pins.waits == 1
    assert pins.opened == {2: 0} and statuses == [{"state": "downloading", "written": 10}]
    assert [op for op in agent.ops() if op[0] == "release"] == [("release", URLS[0]), ("release", URLS[1])]
    assert agent.sent[-1].get("wait", True) is True and agent.sent[-1]["while_downloading"] is True


def test_an_open_that_must_wait_lets_go_even_of_shards_whose_reads_were_put_off_meanwhile() -> None:
    # Before the open waits, the stream waits for its reads at the workers; one answered
    # "pending" then (its shard's download started over) is put off, and must give its
    # pins back too: else the open waits for room that our own pins keep.
    answers = iter([{"ok": True}, {"ok": True}, {"ok": False, "cached": False}, {"ok": True}])
    agent = ScriptedAgent(open=lambda header: next(answers))
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    reads = ReadTable()
    stream = SimpleNamespace(
        pins=pins, reads=reads, shards=SimpleNamespace(skipped=set()), batches=SimpleNamespace(flush=lambda: None)
    )
    failures = ReadFailures(stream)  # type: ignore[arg-type]

    def drain() -> None:  # the worker answers every read at it: "pending"
        for read in reads.in_state(ReadState.SENT):
            assert reads.replied(read.rid) is read
            for _, (shard, _) in read.sent_items():  # as the stream counts a reply
                pins.opened[shard] -= 1
            failures.failed(read, {"ok": False, "kind": "pending"})

    stream.drain = drain
    for shard in (0, 1):
        pins.open(shard, [], before_wait=failures.hold_nothing, on_status=lambda s: None)
        pins.remaining[shard] = 5  # still needed: only a wait lets go of them
    read = reads.add(0, items(3, shard=0) + items(2, shard=1))
    reads.send(read, range(5), "r0", 0, False, time.monotonic())
    pins.opened.update({0: 3, 1: 2})
    pins.open(2, [], before_wait=failures.hold_nothing, on_status=lambda s: None)
    assert pins.opened == {2: 0} and pins.waits == 1
    assert read.state is ReadState.REOPEN and reads.reopening == 1 and not reads.delayed
    assert [op for op in agent.ops() if op[0] == "release"] == [("release", URLS[0]), ("release", URLS[1])]


def test_reads_dropped_where_a_shard_error_ends_the_epoch_give_their_pins_back() -> None:
    # The samples before the failing shard may still need an open that waits (a read asked
    # again after an agent restart): the pins of the reads dropped past the stop must not
    # keep the room that open waits for.
    answers = iter([{"ok": True}, {"ok": True}, {"ok": False, "cached": False}, {"ok": True}])
    agent = ScriptedAgent(open=lambda header: next(answers))
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    reads = ReadTable()
    stream = SimpleNamespace(
        pins=pins,
        reads=reads,
        spec=SimpleNamespace(epoch=0),
        shards=SimpleNamespace(skipped=set()),
        batches=SimpleNamespace(flush=lambda: None, seq_next=2),
    )
    failures = ReadFailures(stream)  # type: ignore[arg-type]
    for shard in (0, 1):
        pins.open(shard, [], before_wait=failures.hold_nothing, on_status=lambda s: None)
        pins.remaining[shard] = 5  # still needed: only a wait lets go of them
    first, second = reads.add(0, items(3, shard=0)), reads.add(1, items(2, shard=1))
    for read, rid in ((first, "r0"), (second, "r1")):
        reads.send(read, range(len(read.items)), rid, 0, False, time.monotonic())
    pins.opened.update({0: 3, 1: 2})
    stop = StopEpoch("shard 3 failed", 3)
    stop.seq = 1
    assert failures.stop_at(stop, None) == 1
    assert list(reads.by_seq) == [0] and pins.opened == {0: 3, 1: 0}
    pins.open(2, [], before_wait=lambda: None, on_status=lambda s: None)
    assert pins.opened == {0: 3, 2: 0}  # shard 1 let go before the wait; shard 0 is still read
    assert [op for op in agent.ops() if op[0] == "release"] == [("release", URLS[1])]


def test_an_open_again_gives_back_the_pin_held_and_a_failed_shard_is_dropped() -> None:
    agent = ScriptedAgent(open={"ok": True})
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    pins.open(3, [], before_wait=lambda: None, on_status=lambda s: None)
    pins.opened[3] = 2
    pins.open(3, [], again=True, before_wait=lambda: None, on_status=lambda s: None)
    assert agent.ops() == [("open", URLS[3]), ("release", URLS[3]), ("open", URLS[3])]
    assert "release" in agent.sent[-1]  # the pin given back rode on the open: one message
    assert pins.opened == {3: 2}  # the reads out still count
    pins.drop(3, timeout=1.0)
    assert pins.opened == {} and agent.ops()[-1] == ("release", URLS[3])
    pins.drop(3, timeout=1.0)  # not pinned: nothing to give back
    assert len(agent.sent) == 3


# -- the shards of an epoch -----------------------------------------------------------------


def epoch_shards(agent: ScriptedAgent, scans: list[dict[str, Any]], on_error: str = "raise") -> EpochShards:
    """EpochShards over URLS (in list order) whose worker answers ``scans`` in turn."""
    pins = Pins(agent, "me", URLS, timeout=10, files=None)
    clock = ProgressClock(agent, "me", URLS, endpoint="ipc://x", timeout=10)
    answers = iter(scans)
    return EpochShards(
        agent,
        "me",
        URLS,
        spec=EpochSpec(len(URLS), shuffle=False),
        prefetch=2,
        on_error=on_error,
        timeout=10,
        pins=pins,
        clock=clock,
        workers=lambda: 2,
        call_worker=lambda header, worker: next(answers),
        hold_nothing=lambda: None,
        sample_size=lambda size: None,
    )


def test_a_shards_count_comes_from_the_agent_the_open_or_a_scan() -> None:
    agent = ScriptedAgent(
        counts=lambda h: {"ok": True, "counts": [4 if u == URLS[0] else None for u in h["urls"]]},
        open=lambda h: {"ok": True, "samples": 6} if h["url"] == URLS[1] else {"ok": True},
    )
    shards = epoch_shards(agent, scans=[{"ok": True, "count": 9, "final": True}])
    assert list(shards.arrivals(0)) == [4]  # the agent's index knew it: not even opened
    assert agent.ops() == [("counts", None)] and len(agent.sent[0]["urls"]) == 4  # asked for the shards ahead too
    assert list(shards.arrivals(1)) == [6] and agent.sent[-1]["ahead"] == [URLS[2], URLS[3]]
    assert agent.ops()[1:] == [("counts", None), ("open", URLS[1])]
    assert list(shards.arrivals(2)) == [9] and URLS[2] in shards.learned  # scanned: its count reported
    assert shards.pins.remaining == {0: 4, 1: 6, 2: 9}


def test_a_downloading_shard_enters_as_its_samples_arrive() -> None:
    agent = ScriptedAgent(counts={"ok": True, "counts": [None] * 4}, open={"ok": True, "while_downloading": True})
    scans = [{"ok": True, "count": 2}, {"ok": True, "count": 2}, {"ok": True, "count": 5, "final": True}]
    shards = epoch_shards(agent, scans)
    assert list(shards.arrivals(0)) == [2, None, None, 5]
    assert 0 not in shards.pins.while_downloading and shards.sample_counts[0] == 5 and shards.pins.remaining[0] == 5


def test_a_cached_shards_count_grows_as_its_worker_walks_it() -> None:
    agent = ScriptedAgent(counts={"ok": True, "counts": [None] * 4}, open={"ok": True})
    scans = [{"ok": True, "count": 3}, {"ok": True, "count": 7}, {"ok": True, "count": 9, "final": True}]
    shards = epoch_shards(agent, scans)
    assert list(shards.arrivals(0)) == [3, 7, 9]  # the first samples before the walk ends
    assert shards.sample_counts[0] == 9 and shards.pins.remaining[0] == 9 and URLS[0] in shards.learned


def test_a_cached_shard_whose_walk_stops_is_counted_by_a_whole_scan() -> None:
    agent = ScriptedAgent(counts={"ok": True, "counts": [None] * 4}, open={"ok": True})
    gone = {"ok": True, "count": 0}  # its file went: the worker finds no walk under way
    shards = epoch_shards(agent, [{"ok": True, "count": 3}, gone, {"ok": True, "count": 9, "final": True}])
    assert list(shards.arrivals(0)) == [3, 9] and shards.sample_counts[0] == 9


def test_a_failed_shard_raises_or_is_skipped_and_let_go() -> None:
    agent = ScriptedAgent(counts={"ok": True, "counts": [None] * 4}, open={"ok": True})
    failed = {"ok": False, "kind": "corrupt", "error": "bad header"}
    # Damaged, and damaged again once renewed: the epoch ends there (the stream hands out the
    # samples before it), then raises the shard's error.
    with pytest.raises(StopEpoch) as stop:
        list(epoch_shards(agent, [failed, failed]).arrivals(0))
    assert stop.value.shard == 0 and isinstance(stop.value.error, ShardError), stop.value
    assert stop.value.error.url == URLS[0] and "bad header" in str(stop.value.error)
    # A cache file the worker cannot read (no damage found): skipped and let go, and the agent is
    # told of no corrupt copy, as it is of the damaged one above.
    assert ("corrupt", URLS[0]) in agent.ops()
    shards = epoch_shards(
        agent, [{"ok": False, "kind": "protocol", "error": "internal error: OSError"}], on_error="skip"
    )
    assert list(shards.arrivals(3)) == [0]
    assert shards.skipped == {3} and shards.sample_counts[3] == 0 and 3 not in shards.pins.opened
    assert agent.ops()[-1] == ("release", URLS[3]) and ("corrupt", URLS[3]) not in agent.ops()


def test_a_damaged_copy_is_read_again_once_from_a_new_copy() -> None:
    agent = ScriptedAgent()
    shards = epoch_shards(agent, [])
    exc = ShardError(URLS[1], "bad member")
    assert shards.found_corrupt(1, exc) and shards.found_corrupt(1, exc)  # until it is opened again
    shards.tell_corrupt()
    assert agent.ops() == [("corrupt", URLS[1])]  # told once, before the shard is opened again
    shards.reopened(1)
    assert not shards.found_corrupt(1, exc)  # the new copy is damaged too: the shard fails


# -- the sequence's feed -------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    shuffle=st.booleans(),
    buffer=st.integers(0, 50),
    chunks=st.lists(st.integers(0, 7), min_size=1, max_size=8).filter(any),
    seed=st.integers(0, 3),
)
def test_the_sequence_fed_in_pieces_is_the_sequence_of_the_counts(
    counts: list[int], shuffle: bool, buffer: int, chunks: list[int], seed: int
) -> None:
    spec = EpochSpec(len(counts), seed=seed, shuffle=shuffle, shuffle_buffer=buffer)
    want = list(global_sequence(spec, lambda s: range(counts[s])))
    feed = ShardFeed()
    got, given, turn = [], {}, 0
    for sid in global_sequence(spec, feed.samples):
        if sid is not None:
            got.append(sid)
            continue
        shard = feed.wanted
        assert shard is not None
        have = given.get(shard, 0)
        step = chunks[turn % len(chunks)]  # 0: nothing new yet
        turn += 1
        if have >= counts[shard] and step:
            feed.end()
        elif step:
            given[shard] = min(counts[shard], have + step)
            feed.grow(given[shard])
        assert turn < 10_000
    assert got == want


# -- the progress clock -------------------------------------------------------------------


def test_the_clock_raises_only_after_timeout_seconds_without_progress() -> None:
    agent = ScriptedAgent(status={"ok": True, "state": "downloading", "written": 5})
    clock = ProgressClock(agent, "me", URLS, endpoint="ipc://x", timeout=30)
    clock.check_stall(lambda: pytest.fail("asked what we wait for before the timeout"))
    clock.heard(1, {"written": 5})
    moved = clock.progress_at
    clock.heard(1, {"written": 5})  # no more bytes: no progress
    assert clock.progress_at == moved and 1.0 <= clock.left() <= 30
    clock.progress_at = time.monotonic() - 31
    with pytest.raises(FetchError, match="no progress for 30s: its download has 5 bytes and gets no more"):
        clock.check_stall(lambda: (1, None))  # the agent is asked about it
    assert agent.ops() == [("status", URLS[1])]
    with pytest.raises(AgentUnavailableError, match="its workers did not answer"):
        clock.check_stall(lambda: (None, None))  # nothing downloading: the agent is pinged first
    assert agent.ops()[-1] == ("ping", None)
    assert clock.left() == 1.0


def test_a_direct_reply_of_small_samples_filling_their_range_reads_it_once() -> None:
    class Counted(Ranges):
        reads: list[tuple[int, int]] = []

        def range(self, url: str, identity: Any, start: int, size: int) -> Ranges.Span:
            span = super().range(url, identity, start, size)
            real = span.read
            span.read = lambda offset, size: Counted.reads.append((offset, size)) or real(offset, size)  # type: ignore[method-assign]
            return span

    # three samples of two fields, one after another in a range of 30 bytes (gaps for tar headers)
    spans = [[1, 0, 2, 4, 3], [1, 10, 2, 14, 3], [1, 20, 2, 24, 6]]
    header = {
        "ok": True,
        "keys": ["a", "b", "c"],
        "exts": [["cls", "txt"]] * 3,
        "spans": spans,
        "files": [[0, 100, 30, 1, 2, 500, 7]],
    }
    samples, sizes = decode_reply(*wire(header), items(3), URLS, direct=True, files=Counted())
    assert Counted.reads == [(0, 30)]  # one read of the whole range, not one per payload
    assert [s["txt"] for s in samples] == [bytes(range(104, 107)), bytes(range(114, 117)), bytes(range(124, 130))]
    assert all(type(s["cls"]) is bytes for s in samples) and sizes == [5, 5, 8]


def test_holes_are_dropped_with_one_rank_and_counted_as_positions() -> None:
    from wdscache.training.holes import Holes

    a, b, c = {"__key__": "a"}, {"__key__": "b"}, {"__key__": "c"}
    holes = Holes.of(1, seed=0, epoch=0)
    items = [(p, (0, p)) for p in range(5)]
    assert holes.take(items[:4], [None, a, None, b], [0, 5, 0, 7]) == ([a, b], [5, 7])
    holes.whole([c], [3], 3)
    assert [holes.positions(k) for k in range(4)] == [0, 2, 4, 5]  # a hole counts with the sample after it
    assert holes.unfilled() == 0
    empty = Holes.of(1, seed=0, epoch=0)
    assert empty.take(items[:2], [None, None], [0, 0]) == ([], [])
    assert empty.unfilled() == 2 and empty.positions(0) == 0


def test_holes_are_filled_with_the_least_repeated_of_a_pool_and_count_no_bytes() -> None:
    from wdscache.training.holes import POOL_SAMPLES, Holes

    def run() -> list:
        holes = Holes.of(2, seed=3, epoch=1)
        samples = [{"__key__": str(i)} for i in range(POOL_SAMPLES + 4)]
        got = []
        # holes first: held back until a pool's worth is read, then filled from it
        assert holes.take([(0, (0, 0)), (1, (0, 1))], [None, None], [0, 0]) is None
        assert holes.take([(2, (1, 0))], [samples[0]], [5]) is None
        held = holes.take(
            [(3 + i, (1, 1 + i)) for i in range(POOL_SAMPLES - 1)], samples[1:POOL_SAMPLES], [5] * (POOL_SAMPLES - 1)
        )
        assert held is not None
        out, sizes = held
        assert len(out) == POOL_SAMPLES + 2 and sizes[:3] == [0, 0, 5] and out[2] is samples[0]
        assert out[0] is not out[1] and out[0]["__key__"] != out[1]["__key__"]  # two repeats, two samples
        got += out
        n = 3 * POOL_SAMPLES
        filled = holes.take([(100 + i, (2, i)) for i in range(n)], [None] * n, [0] * n)
        assert filled is not None and filled[1] == [0] * n
        got += filled[0]
        return [s["__key__"] for s in got]

    keys = run()
    counts = {k: keys.count(k) for k in set(keys)}
    assert len(counts) == POOL_SAMPLES and max(counts.values()) <= 1 + 3 + 1  # spread over the pool
    assert run() == keys  # the same inputs, the same repeats
