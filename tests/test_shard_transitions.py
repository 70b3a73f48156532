"""A shard's record moves only by the transitions its table writes down; the table drops records nobody refers to."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from wdscache.agent import shards
from wdscache.agent.control import Request
from wdscache.agent.shard_download import Budget, Download
from wdscache.agent.shards import TRANSITIONS, IllegalTransition, Phase, Shard, Shards, Waiter


@pytest.mark.parametrize(("start", "to"), list(itertools.product(Phase, Phase)))
def test_every_transition_not_in_the_table_raises(start: Phase, to: Phase) -> None:
    shard = Shard("http://h/a.tar", phase=start)
    if (start, to) in TRANSITIONS:
        Shards.move(shard, to)
        assert shard.phase is to
    else:
        with pytest.raises(IllegalTransition, match=f"from {start.name} to {to.name}"):
            Shards.move(shard, to)
        assert shard.phase is start


def test_the_table_is_the_one_in_the_module_docstring() -> None:
    assert shards.__doc__ is not None
    rows = {
        (f, t)
        for line in shards.__doc__.splitlines()
        if (words := line.split()) and words[0] in Phase.__members__ and words[-1] in Phase.__members__
        for f, t in [(Phase[words[0]], Phase[words[-1]])]
    }
    assert rows == TRANSITIONS


def test_a_record_lives_while_something_refers_to_it() -> None:
    table = Shards()
    shard = table.record("http://h/a.tar")
    table.pin(shard, "r")
    table.pin(shard, "r")
    table.settle(shard)
    assert table.get("http://h/a.tar") is shard and table.holds("r") == 1 and table.held_by("r") == [shard]
    assert table.unpin(shard, "r") and table.unpin(shard, "r") and not table.unpin(shard, "r")
    assert table.holds("r") == 0
    shard.waiters.append(Waiter(Request(b"c", 1, {}), "r"))
    table.settle(shard)
    assert len(table) == 1
    shard.waiters.clear()
    shard.asked_at = 1.0
    assert table.demanded() == ["http://h/a.tar"]
    shard.asked_at = None
    table.settle(shard)
    assert len(table) == 0 and table.get("http://h/a.tar") is None


def test_demanded_shards_come_oldest_first() -> None:
    table = Shards()
    for url, at in (("b", 2.0), ("a", 3.0), ("c", 1.0)):
        table.record(url).asked_at = at
    assert table.demanded() == ["c", "b", "a"]


def download(url: str) -> Download:
    return Download(url, partial=Path("/nonexistent/p"), final=Path("/nonexistent/f"), budget=Budget(lambda *a: True))


def test_a_download_in_flight_is_in_its_shards_record_until_its_end() -> None:
    table = Shards()
    first = download("http://h/a.tar")
    slot = table.start_download(first)  # a prefetch: nobody refers to the shard otherwise
    shard = table.get("http://h/a.tar")
    assert shard is not None and shard.download is slot and slot.download is first
    table.settle(shard)
    assert table.get("http://h/a.tar") is shard  # kept: its download runs
    with pytest.raises(IllegalTransition, match="second download"):
        table.start_download(download("http://h/a.tar"))
    other = table.start_download(download("http://h/b.tar"))
    assert table.slots() == [slot, other] and table.downloads() == 2 and table.slot("http://h/b.tar") is other
    table.pin(shard, "r")
    assert table.end_download("http://h/a.tar") is slot and shard.download is None
    assert table.get("http://h/a.tar") is shard  # still held by its reader
    assert table.end_download("http://h/a.tar") is None and table.slots() == [other]
    table.unpin(shard, "r")
    table.settle(shard)
    table.end_download("http://h/b.tar")
    assert len(table) == 0 and table.downloads() == 0
