"""The wire protocol's table (wdscache.shared.protocol.MESSAGES) against the code that speaks it."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Literal, get_type_hints

import pytest

import wdscache
from wdscache.agent import core as agent
from wdscache.agent.cache_commands import evict, verify
from wdscache.shared import client, messages, protocol
from wdscache.shared.errors import ProtocolError
from wdscache.shared.messages import Reports, Requests
from wdscache.shared.stats import collect

SOURCE = Path(wdscache.__file__).parent
REPLY_OPS = {"reply", "samples", "scanned", "error"}  # the op of a reply names its kind, not a request
TYPES = {
    "str": str,
    "int": int,
    "bool": bool,
    "number": float,
    "list[str]": list[str],
    "list": list[Any],
    "object": dict[str, Any],
}
LINK_FIELDS = {"id", "auth"}  # what the link to a worker adds to a request, in place

# Every message as the code builds it, once with every optional field and once with none.
URL, URLS = "http://127.0.0.1:1/a.tar", ["http://127.0.0.1:1/a.tar", "http://127.0.0.1:1/b.tar"]
REQUESTS, REPORTS = Requests("reader-1"), Reports("s" * 32)
BUILT: dict[str, list[dict[str, Any]]] = {
    "auth": [Requests.auth("n" * 32)],
    "hello": [
        REQUESTS.hello("job", 0, 1),
        REQUESTS.hello("job", 1, 2, list_id="l", process=[1, 2, "boot", 3], shuffle_buffer=10, probe=True),
    ],
    "put_urls": [REQUESTS.put_urls(0, URLS), REQUESTS.put_urls(0, URLS, [[5, 100, None], None])],
    "get_urls": [REQUESTS.get_urls(2)],
    "open": [REQUESTS.open(URL), REQUESTS.open(URL, ahead=URLS, wait=False, while_downloading=True)],
    "status": [REQUESTS.status(URL)],
    "release": [REQUESTS.release(URL)],
    "report": [REQUESTS.report("job", 0, epoch=1, position=2, samples=3, bytes=4, rate=5.5, wait_s=0.25)],
    "ping": [REQUESTS.ping()],
    "bye": [REQUESTS.bye(), REQUESTS.bye(epoch=1, position=2, samples=3, bytes=4, wait_s=0.5)],
    "counts": [Requests.counts(URLS)],
    "corrupt": [Requests.corrupt(URL, "bad tar header")],
    "stats": [Requests.stats(), Requests.stats(flush=True)],
    "evict": [Requests.evict(URLS), Requests.evict(URLS, force=True)],
    "clear": [Requests.clear(), Requests.clear(force=True)],
    "prefetch": [Requests.prefetch("p", URLS), Requests.prefetch("p", URLS, retry=True)],
    "prefetch_status": [Requests.prefetch_status("p")],
    "prefetch_end": [Requests.prefetch_end("p")],
    "worker": [REPORTS.worker(0, busy_s=0.5, requests=1, samples=2, bytes=3, indexed=4, walked=5, adopted=6, loaded=7)],
    "counted": [REPORTS.counted(URL, 7, [1, 2, 3, 4])],
    "corrupt_copy": [REPORTS.corrupt_copy(URL, [1, 2, 3, 4], "bad tar header")],
    "walked": [REPORTS.walked(URL, [1, 2, 3, 4], [[0, 1]])],
    "index": [Reports.index(URL), Reports.index(URL, now=True)],
    "hold": [Reports.hold(0.1)],
    "read": [Requests.read([URL]), Requests.read([URL], direct=True)],
    "scan": [Requests.scan(URL), Requests.scan(URL, while_downloading=True)],
}


def _class_name(op: str) -> str:
    return "".join(part.capitalize() for part in op.split("_"))


def test_every_op_the_agent_handles_is_in_the_table_and_nothing_else():
    to_agent = {m.op for m in protocol.MESSAGES if m.receiver == "agent"}
    # The agent serves the op sets of the table itself.
    assert (agent.CONTROL_OPS, agent.WORKER_OPS, agent.READER_OPS) == (
        protocol.CONTROL_OPS,
        protocol.WORKER_OPS,
        protocol.READER_OPS,
    )
    # "auth" is answered at the door and "walked" passed on, before the table of handlers.
    assert set(protocol.CONTROL_OPS) | {"auth", "walked"} == to_agent
    assert set(protocol.WORKER_OPS) | {"walked"} == {m.op for m in protocol.MESSAGES if m.sender == "worker"}
    assert set(protocol.READER_OPS) == {
        "hello",
        "put_urls",
        "get_urls",
        "open",
        "status",
        "release",
        "report",
        "ping",
        "bye",
    }


def test_every_op_in_the_code_is_in_the_table():
    listed = {m.op for m in protocol.MESSAGES}
    sent = set()
    for path in SOURCE.rglob("*.py"):
        sent |= set(re.findall(r'"op": *"([a-z_]+)"', path.read_text()))
        sent |= set(re.findall(r'op == "([a-z_]+)"', path.read_text()))
    assert sent - REPLY_OPS <= listed, sorted(sent - REPLY_OPS - listed)
    assert listed <= sent, sorted(listed - sent)  # nothing in the table that no code sends


def test_the_table_is_well_formed():
    ops = [m.op for m in protocol.MESSAGES]
    assert len(ops) == len(set(ops))
    for m in protocol.MESSAGES:
        assert m.sender in {"client", "consumer", "worker", "agent"} and m.receiver in {"agent", "worker"}, m
        for kind in [*m.fields.values(), *m.reply.values()]:
            assert kind.rstrip("?") in TYPES, (m.op, kind)


@pytest.mark.parametrize("m", protocol.MESSAGES, ids=lambda m: m.op)
def test_every_message_has_a_typed_class_with_the_fields_of_the_table(m: protocol.Message):
    message = getattr(messages, f"{_class_name(m.op)}Message")
    hints = get_type_hints(message)
    link = LINK_FIELDS if (m.sender, m.receiver) == ("consumer", "worker") else set()
    assert message.__required_keys__ == {"op", *(k for k, v in m.fields.items() if not v.endswith("?"))}
    assert message.__optional_keys__ == {*(k for k, v in m.fields.items() if v.endswith("?")), *link}
    assert hints["op"] == Literal[m.op]
    assert {k: hints[k] for k in m.fields} == {k: TYPES[v.rstrip("?")] for k, v in m.fields.items()}
    if m.reply:
        reply = getattr(messages, f"{_class_name(m.op)}Reply")
        assert reply.__optional_keys__ == set(m.reply) and not reply.__required_keys__
        assert get_type_hints(reply) == {k: TYPES[v.rstrip("?")] for k, v in m.reply.items()}
    else:
        assert not hasattr(messages, f"{_class_name(m.op)}Reply")


# A worker's replies by their op, and the request each answers.
WORKER_REPLIES = {
    "samples": messages.SamplesReply,
    "scanned": messages.ScannedReply,
    "error": messages.WorkerErrorReply,
}
ANSWERS = {"read": "samples", "scan": "scanned"}


@pytest.mark.parametrize("op", sorted(ANSWERS))
def test_a_workers_reply_classes_have_the_fields_the_table_gives_its_reply(op: str):
    table = protocol.MESSAGE[op].reply
    ok, error = WORKER_REPLIES[ANSWERS[op]], messages.WorkerErrorReply
    fields = {k: get_type_hints(c)[k] for c in (ok, error) for k in c.__required_keys__ | c.__optional_keys__}
    del fields["op"], fields["id"]  # the reply's kind, and the request's id
    assert set(fields) == set(table)
    # ``proof`` is added as the reply is sent; ``ok`` and an error's ``kind`` are narrowed to their values.
    assert {k for k, v in table.items() if not v.endswith("?")} - {"proof"} <= ok.__required_keys__
    assert {k for k, v in table.items() if not v.endswith("?")} - {"proof", *ok.__required_keys__} == set()
    assert {k: v for k, v in fields.items() if k not in ("ok", "kind")} == {
        k: TYPES[v.rstrip("?")] for k, v in table.items() if k not in ("ok", "kind")
    }


def test_every_reply_a_worker_builds_is_of_its_class():
    tree = ast.parse((SOURCE / "agent" / "worker.py").read_text())
    built = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys)):
            continue
        values = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
        op = values.get("op")
        if isinstance(op, ast.Constant) and op.value in WORKER_REPLIES:
            cls = WORKER_REPLIES[op.value]
            assert cls.__required_keys__ - {"proof"} <= set(values) <= cls.__required_keys__ | cls.__optional_keys__
            built.add(op.value)
    assert built == set(WORKER_REPLIES)
    # Fields set after the literal (a direct read's files, where a corrupt shard failed, the proof).
    targets = [t for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets]
    targets += [e for t in targets if isinstance(t, ast.Tuple) for e in t.elts]
    added = {
        t.slice.value
        for t in targets
        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)
    }
    assert added and added <= {k for c in WORKER_REPLIES.values() for k in c.__optional_keys__}, added


def test_every_message_the_code_builds_is_one_its_receiver_accepts():
    assert set(BUILT) == {m.op for m in protocol.MESSAGES}  # a builder for every message
    for op, built in BUILT.items():
        for header in built:
            assert header["op"] == op and protocol.check(header).op == op
            # What the connection adds is no concern of the table.
            assert protocol.check({**header, "id": 7, "key": "k", "auth": "a"}).op == op
    # The builders leave out what is left at its default, and set what is not.
    assert BUILT["open"][0] == {"op": "open", "reader": "reader-1", "url": URL}
    assert BUILT["open"][1]["wait"] is False and BUILT["open"][1]["while_downloading"] is True
    assert BUILT["read"][0] == {"op": "read", "urls": [URL]}
    assert BUILT["scan"][1] == {"op": "scan", "url": URL, "while_downloading": True}


@pytest.mark.parametrize("m", protocol.MESSAGES, ids=lambda m: m.op)
def test_a_message_missing_a_required_field_or_with_a_wrong_type_is_a_protocol_error_naming_it(m: protocol.Message):
    full = BUILT[m.op][-1]
    for name, kind in m.fields.items():
        if not kind.endswith("?"):
            with pytest.raises(ProtocolError, match=f"'{m.op}' message lacks '{name}'"):
                protocol.check({k: v for k, v in full.items() if k != name})
        wrong = "text" if kind.rstrip("?") != "str" else 5
        with pytest.raises(ProtocolError, match=f"'{m.op}' message: '{name}'"):
            protocol.check({**full, name: wrong})


def test_a_count_sent_as_a_flag_and_a_list_of_urls_holding_numbers_are_refused():
    with pytest.raises(ProtocolError, match="'get_urls' message: 'offset' has the wrong type"):
        protocol.check({**REQUESTS.get_urls(0), "offset": True})
    with pytest.raises(ProtocolError, match="'counts' message: 'urls' must hold strings only"):
        protocol.check({"op": "counts", "urls": [URL, 5]})
    with pytest.raises(ProtocolError, match="unknown op 'nope'"):
        protocol.check({"op": "nope"})


# -- versions ------------------------------------------------------------------------------------


def test_an_agent_and_a_consumer_of_two_protocols_refuse_each_other_at_the_first_message(
    tmp_path: Path, dataset: Any, start_agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = dataset(1, samples=4)
    cache = tmp_path / "cache"
    start_agent(cache, ds.list_file)
    ours = protocol.PROTOCOL

    # A client of another number (another install of wdscache) refuses the agent at its auth.
    monkeypatch.setattr(client, "PROTOCOL", ours + 1)
    with pytest.raises(ProtocolError) as info:
        list(wdscache.CachedMultiLoader(cache_dir=cache, job="j", timeout=10))
    assert f"speaks protocol {ours}, this client protocol {ours + 1}; " in str(info.value), info.value
    assert "must run the same wdscache" in str(info.value)
    monkeypatch.undo()

    # The agent refuses a consumer that names another number at its hello...
    monkeypatch.setattr(messages, "PROTOCOL", ours + 1)
    with pytest.raises(wdscache.WdsCacheError) as info:
        list(wdscache.CachedMultiLoader(cache_dir=cache, job="j", timeout=10))
    assert f"refused this consumer: it speaks protocol {ours + 1}, the agent protocol {ours}; " in str(info.value)
    monkeypatch.undo()
    # ... or none, as a consumer from before the number does.
    conn = client.AgentConnection(client.resolve_endpoint(cache, None), cache_dir=cache, timeout=10)
    try:
        old = {k: v for k, v in Requests("old").hello("j", 0, 1).items() if k != "protocol"}
        reply = conn.request(old)
    finally:
        conn.close()
    assert reply["ok"] is False and "it speaks a protocol from before numbered ones" in reply["error"], reply
    assert len(list(wdscache.CachedMultiLoader(cache_dir=cache, job="j", timeout=10))) == 4  # ours is served

    # The commands of another install name both protocols too: they took the refusal for no answer
    # (stats: "running but not answering"; verify, evict, clear: "it may be busy; try again").
    monkeypatch.setattr(client, "PROTOCOL", ours + 1)
    for command in (lambda: collect(cache), lambda: verify(cache), lambda: evict(cache, ds.urls[:1])):
        with pytest.raises(ProtocolError, match=f"speaks protocol {ours}, this client protocol {ours + 1}; "):
            command()


@pytest.mark.parametrize(
    "dialled", ["127.0.0.1", "127.1.2.3", "localhost", "LOCALHOST", "0.0.0.0", "[::1]", "[::ffff:127.0.0.1]"]
)
def test_an_agent_on_this_machine_must_name_the_port_dialled(dialled: str) -> None:
    """On this machine's own addresses, however written, another local user may hold the port a
    client dials and relay to the agent's: the agent's proof must name the dialled port."""
    assert protocol.same_endpoint(f"tcp://{dialled}:5555", "tcp://127.0.0.1:5555")
    assert not protocol.same_endpoint(f"tcp://{dialled}:5555", "tcp://127.0.0.1:6666")
    assert not protocol.same_endpoint(f"tcp://{dialled}:5555", "ipc:///run/agent.sock")


@pytest.mark.parametrize("dialled", ["tcp://10.1.2.3:5555", "tcp://no-such-host.invalid:5555", "ipc:///a/agent.sock"])
def test_an_agent_elsewhere_or_over_ipc_is_not_held_to_the_port(dialled: str) -> None:
    assert protocol.same_endpoint(dialled, "tcp://0.0.0.0:6666")
