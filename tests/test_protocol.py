"""The wire protocol's table (wdscache.shared.protocol.MESSAGES) against the code that speaks it."""

from __future__ import annotations

import re
from pathlib import Path

import wdscache
from wdscache.agent import core as agent
from wdscache.shared import protocol

SOURCE = Path(wdscache.__file__).parent
REPLY_OPS = {"reply", "samples", "scanned", "error"}  # the op of a reply names its kind, not a request
TYPES = {"str", "int", "bool", "number", "list[str]", "list", "object"}


def test_every_op_the_agent_handles_is_in_the_table_and_nothing_else():
    to_agent = {m.op for m in protocol.MESSAGES if m.receiver == "agent"}
    # "auth" is answered at the door and "walked" passed on, before the table of handlers.
    assert set(agent.CONTROL_OPS) | {"auth", "walked"} == to_agent
    assert set(agent.WORKER_OPS) | {"walked"} == {m.op for m in protocol.MESSAGES if m.sender == "worker"}
    assert set(agent.READER_OPS) <= {m.op for m in protocol.MESSAGES if "reader" in m.fields}


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
