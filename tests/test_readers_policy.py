"""Readers as a policy over their records: hello, lists, reports, bye and expiry, without sockets or threads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.policy import URLS, Loop
from wdscache.agent.ended import ENDED_KEPT
from wdscache.agent.rank_totals import RANK_TOTALS_KEPT
from wdscache.agent.readers import IDLE_LET_GO, IDLE_LET_GO_EVERY, Readers
from wdscache.shared.errors import ProtocolError
from wdscache.shared.messages import Requests
from wdscache.shared.urls import list_id


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    loop = Loop(tmp_path, reader_timeout=5.0)
    try:
        yield loop
    finally:
        loop.close()


def _latency(job: str) -> str:
    """What the agent tells a starved rank of ``job`` waits for, when nothing else holds it up."""
    return "latency"


def hello(readers: Readers, name: str, loop: Loop, **fields: object) -> dict[str, object]:
    header = {**Requests(name).hello("j", 0, 2), **fields}
    return readers.op_hello(loop.request(**header))


def test_hello_answers_the_workers_and_the_agents_list(loop: Loop) -> None:
    reply = hello(loop.readers, "c0", loop, shuffle_buffer=100)
    assert reply["ok"] and reply["workers"] == ["ipc:///w0"] and reply["n_urls"] == len(URLS)
    assert reply["list_id"] == list_id(URLS) and reply["prefetch"] == 2
    assert "c0" in loop.readers
    assert loop.readers.view(_latency)["consumers"] == 1


def test_hello_with_a_rank_outside_the_world_is_refused(loop: Loop) -> None:
    reply = hello(loop.readers, "c0", loop, rank=2)
    assert reply == {"ok": False, "error": "rank 2 is not in [0, 2)"} and "c0" not in loop.readers


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"world_size": 10**30, "rank": 0}, f"world_size {10**30} is not in [0, 2147483647]"),
        ({"epoch": -5}, "epoch -5 is not in [0, 2147483647]"),
        ({"shuffle_buffer": 10**40}, f"shuffle_buffer {10**40} is not in [0, 2147483647]"),
    ],
)
def test_hello_with_figures_out_of_range_is_refused(loop: Loop, fields: dict[str, int], error: str) -> None:
    # They were taken, and logged as given ("rank 0 of 1000000000000000000000000000000").
    reply = hello(loop.readers, "c0", loop, **fields)
    assert reply == {"ok": False, "error": error} and "c0" not in loop.readers
    assert hello(loop.readers, "", loop) == {"ok": False, "error": "a reader's name is empty"}


def test_a_report_is_answered_ok_alone_and_one_of_negative_figures_refused(loop: Loop) -> None:
    # A known reader's report was answered {"ok": True, "error": "unknown reader; ..."}, and negative
    # figures were taken into stats ("samples": -7).
    hello(loop.readers, "c0", loop)
    assert loop.readers.op_report(loop.request("report", reader="c0", samples=1)) == {"ok": True}
    with pytest.raises(ProtocolError, match="'samples' is out of range"):
        loop.readers.op_report(loop.request("report", reader="c0", samples=-7))
    assert loop.readers.op_report(loop.request("report", reader="c9", samples=1)) == {
        "ok": False,
        "error": "unknown reader; say hello first",
    }


def test_the_need_of_a_cache_that_thrashes_is_known_while_nothing_is_cached(loop: Loop) -> None:
    # A thrashing cache is often empty at the moment stats asks: the need fell to 0 ("nothing known
    # yet"), stats blamed downloads or the source, and the thrash alert (need > budget) never held.
    hello(loop.readers, "c0", loop, shuffle_buffer=100)
    for url in URLS[:2]:
        loop.cached(url, b"x" * 4096)
        loop.cache.index.set_count(url, 10, 4096, None)
    known = loop.readers.need(lambda name: 0)
    for url in URLS[:2]:
        loop.cache.remove(url, "evicted for another")
    assert loop.cache.index.get(URLS[0]) is None
    assert loop.readers.need(lambda name: 0) == known and known[0] == len(URLS) * 4096, known  # all 8 at once
    # A shard no list read names (an earlier job's) says nothing of these shards' size.
    loop.cache.index.set_count("http://127.0.0.1:9/other-job-big.tar", 10, 3 << 20, None)
    assert loop.readers.need(lambda name: 0) == known


def test_a_job_list_is_sent_in_pages_before_hello_and_read_back_in_pages(loop: Loop) -> None:
    mine = [f"http://127.0.0.1:9/mine-{i}.tar" for i in range(5)]
    key = list_id(mine)
    assert hello(loop.readers, "c0", loop, list_id=key)["need_urls"] is True
    for offset in (0, 3):
        page = mine[offset : offset + 3]
        reply = loop.readers.op_put_urls(loop.request("put_urls", reader="c0", offset=offset, urls=page))
        assert reply == {"ok": True, "error": None}
    assert hello(loop.readers, "c0", loop, list_id=key)["ok"]
    got = loop.readers.op_get_urls(loop.request("get_urls", reader="c0", offset=0))
    assert got == {"ok": True, "list_id": key, "urls": mine}
    assert loop.readers.known(mine[0], "c0") and not loop.readers.known(URLS[0], "c0")


def test_a_page_out_of_order_is_refused(loop: Loop) -> None:
    reply = loop.readers.op_put_urls(loop.request("put_urls", reader="c0", offset=3, urls=["http://h/a.tar"]))
    assert reply == {"ok": False, "error": "list page at 3 does not follow the 0 URLs received"}


def test_ranks_of_one_job_must_agree_on_its_world_size(loop: Loop) -> None:
    hello(loop.readers, "c0", loop)
    loop.readers.op_report(loop.request("report", reader="c0", samples=1))
    reply = hello(loop.readers, "c1", loop, world_size=4, rank=1)
    assert not reply["ok"] and "runs with world_size 2, but rank 1 says 4" in str(reply["error"])


def test_reports_are_kept_for_stats_and_bye_leaves_them_in_ended_jobs(loop: Loop) -> None:
    assert loop.readers.op_report(loop.request("report", reader="c0", samples=1)) == {
        "ok": False,
        "error": "unknown reader; say hello first",
    }
    hello(loop.readers, "c0", loop)
    loop.readers.op_report(loop.request("report", reader="c0", samples=10, bytes=100))
    assert list(loop.readers.view(_latency)["jobs"]) == ["j"]
    assert loop.readers.op_bye(loop.request("bye", reader="c0", samples=12)) == {"ok": True}
    assert "c0" not in loop.readers and loop.gone == ["c0"]
    view = loop.readers.view(_latency)
    assert view["consumers"] == 0 and view["ended_jobs"]


def test_ended_ranks_leave_stats_a_while_after_their_latest_exit_oldest_first(loop: Loop) -> None:
    """A rank whose consumer leaves again (its next epoch) counts from its latest end."""
    for name, job in (("c0", "a"), ("c1", "b"), ("c2", "a")):
        hello(loop.readers, name, loop, job=job)
        loop.readers.op_bye(loop.request("bye", reader=name, samples=1))
    assert set(loop.readers.view(_latency)["ended_jobs"]) == {"a", "b"}
    loop.readers._ended.ranks[("b", "0")]["_ended"] -= ENDED_KEPT  # b's rank left long ago; a's just now
    loop.readers.expire()
    assert set(loop.readers.view(_latency)["ended_jobs"]) == {"a"}
    loop.readers._ended.ranks[("a", "0")]["_ended"] -= ENDED_KEPT
    loop.readers.expire()
    assert not loop.readers.view(_latency)["ended_jobs"]


def test_an_ended_ranks_totals_hold_every_epoch_however_many(loop: Loop) -> None:
    # Kept per consumer (each epoch, each DataLoader worker is one), the 256 kept were 256 epochs:
    # a long job's totals were its last 256 epochs', and every other job that ended was gone.
    hello(loop.readers, "other", loop, job="other")
    loop.readers.op_bye(loop.request("bye", reader="other", samples=5))
    for epoch in range(300):
        hello(loop.readers, f"e{epoch}", loop, job="long", epoch=epoch)
        loop.readers.op_bye(loop.request("bye", reader=f"e{epoch}", samples=128, epoch=epoch))
    ended = loop.readers.view(_latency)["ended_jobs"]
    assert ended["long"]["0"]["samples"] == 300 * 128 and ended["long"]["0"]["epochs"] == 300
    assert ended["other"]["0"]["samples"] == 5


def test_a_ranks_totals_add_up_its_epochs_and_readers_and_never_go_down(loop: Loop) -> None:
    """Each epoch is a new consumer (a new name, or a hello again under its name) whose figures
    start at zero; a rank's readers add up; a report lower than its consumer's last adds nothing."""
    readers = loop.readers

    def totals() -> dict[str, object]:
        return dict(readers.view(_latency)["rank_totals"])

    def report(name: str, op: str = "report", **figures: float) -> None:
        getattr(readers, f"op_{op}")(loop.request(op, reader=name, **figures))

    hello(readers, "e0", loop)
    assert totals() == {"j": {"0": {"samples": 0, "bytes": 0, "wait_s": 0.0}}}  # shown from its hello
    report("e0", samples=5, bytes=50, wait_s=0.5)
    report("e0", samples=4, bytes=40)  # lower: nothing (and wait_s absent: nothing either)
    report("e0", "bye", samples=8, bytes=80, wait_s=0.75)  # its last figures come with its bye
    hello(readers, "e1", loop)  # the next epoch, with a second reader of the rank
    hello(readers, "e1w", loop)
    report("e1", samples=3, bytes=30, wait_s=0.25)
    report("e1w", samples=2, bytes=20)
    hello(readers, "e1", loop)  # a hello again: its figures start again
    report("e1", samples=1, bytes=10)
    hello(readers, "p", loop, probe=True)
    report("p", samples=100)  # a probe's report is no rank's
    assert totals() == {"j": {"0": {"samples": 14, "bytes": 140, "wait_s": 1.0}}}
    assert readers.view(_latency)["jobs"]["j"]["0"]["samples"] == 3  # the current epoch's, its readers together


def test_a_ranks_totals_go_an_hour_after_its_last_consumer_left(loop: Loop) -> None:
    readers = loop.readers
    for name, job in (("a0", "a"), ("b0", "b")):
        hello(readers, name, loop, job=job)
        readers.op_report(loop.request("report", reader=name, samples=1))
    readers.op_bye(loop.request("bye", reader="a0"))
    for totals in readers._totals._ranks.values():
        totals.touched -= RANK_TOTALS_KEPT  # both silent an hour: b0 still connected, a0 gone
    readers.expire()
    assert set(readers.view(_latency)["rank_totals"]) == {"b"}


@pytest.mark.parametrize("comes_back", [True, False])
def test_a_consumer_dropped_as_silent_counts_each_sample_once_whether_it_says_hello_again_or_not(
    loop: Loop, comes_back: bool
) -> None:
    # Stopped past --reader-timeout, it reports cumulative figures: said hello again, its totals
    # counted the reports before the stop twice; gone straight to its bye (it held what it had left
    # to hand out), its bye counted nothing.
    readers = loop.readers
    hello(readers, "c0", loop, job="j")
    readers.op_report(loop.request("report", reader="c0", samples=10, epoch=0))
    readers._readers["c0"].plan.last_seen -= 10.0  # silent longer than --reader-timeout
    readers.expire()
    assert "c0" not in readers and readers.view(_latency)["ended_jobs"]["j"]["0"]["samples"] == 10
    if comes_back:
        hello(readers, "c0", loop, job="j")
        assert "j" not in readers.view(_latency)["ended_jobs"]  # live again
        readers.op_report(loop.request("report", reader="c0", samples=30, epoch=0))
    readers.op_bye(loop.request("bye", reader="c0", samples=40, epoch=0))
    view = readers.view(_latency)
    assert view["rank_totals"]["j"]["0"]["samples"] == 40 and view["ended_jobs"]["j"]["0"]["samples"] == 40, view
    assert view["ended_jobs"]["j"]["0"]["epochs"] == 1


def test_a_consumer_dropped_as_silent_whose_bye_has_no_figures_stays_in_ended_jobs(loop: Loop) -> None:
    readers = loop.readers
    hello(readers, "c0", loop, job="j")
    readers.op_report(loop.request("report", reader="c0", samples=10, epoch=0))
    readers._readers["c0"].plan.last_seen -= 10.0
    readers.expire()
    readers.op_bye(loop.request("bye", reader="c0"))  # a random-access reader's bye names no totals
    assert readers.view(_latency)["ended_jobs"]["j"]["0"]["samples"] == 10


def test_a_probe_neither_joins_nor_counts_as_a_consumer(loop: Loop) -> None:
    assert hello(loop.readers, "p", loop, probe=True)["ok"]
    assert "p" in loop.readers and loop.readers.view(_latency)["consumers"] == 0
    loop.readers.drop("p")
    assert not loop.readers.view(_latency)["ended_jobs"]


def test_a_silent_reader_is_dropped_and_its_pins_go_with_it(loop: Loop) -> None:
    loop.cached(URLS[0])
    _, reply = loop.open("plain", URLS[0])
    assert reply is not None and reply["ok"] and loop.cache.pins == {URLS[0]: 1}
    loop.readers.expire()
    assert "plain" in loop.readers
    loop.readers.seen("plain")
    loop.readers._readers["plain"].plan.last_seen -= 10.0  # silent longer than --reader-timeout
    loop.readers.expire()
    assert "plain" not in loop.readers and loop.gone == ["plain"] and loop.cache.pins == {}


def test_only_random_access_readers_idle_past_the_grace_and_holding_pins_are_let_go(loop: Loop) -> None:
    # While a reader waits for room pins hold: a stream answers the agent's ask itself (its
    # reporter), and a random-access session that read lately may be reading its pins now.
    for name, url, random_access in [("ra-idle", 0, True), ("ra-reading", 1, True), ("stream", 2, False)]:
        hello(loop.readers, name, loop, job=name, rank=0, world_size=1, random_access=random_access)
        loop.cached(URLS[url])
        _, reply = loop.open(name, URLS[url], said_hello=True)
        assert reply is not None and reply["ok"], reply
    hello(loop.readers, "ra-pinless", loop, job="ra-pinless", rank=0, world_size=1, random_access=True)
    for name in ("ra-idle", "stream", "ra-pinless"):
        loop.readers._readers[name].plan.last_seen -= IDLE_LET_GO + 1
    loop.readers._readers["ra-reading"].plan.last_seen -= IDLE_LET_GO - 1
    loop.readers.let_go_idle(loop.opens.held)
    assert loop.gone == ["ra-idle"] and loop.cache.pins == {URLS[1]: 1, URLS[2]: 1}
    assert {"ra-reading", "stream", "ra-pinless"} <= set(loop.readers._readers)
    assert loop.readers.view(_latency)["ended_jobs"]["ra-idle"]  # kept as one dropped as silent
    hello(loop.readers, "ra-idle", loop, job="ra-idle", rank=0, world_size=1, random_access=True)
    assert "ra-idle" not in loop.readers.view(_latency)["ended_jobs"]  # back as the same reader


def test_idle_random_access_readers_are_let_go_of_the_longest_silent_first_one_at_a_time(loop: Loop) -> None:
    # A dataset read to its end goes before a DataLoader worker silent between its batches: the
    # room one frees may be enough.
    for name, url, silent in [("ra-worker", 0, IDLE_LET_GO + 2), ("ra-done", 1, IDLE_LET_GO + 30)]:
        hello(loop.readers, name, loop, job=name, rank=0, world_size=1, random_access=True)
        loop.cached(URLS[url])
        _, reply = loop.open(name, URLS[url], said_hello=True)
        assert reply is not None and reply["ok"], reply
        loop.readers._readers[name].plan.last_seen -= silent
    loop.readers.let_go_idle(loop.opens.held)
    loop.readers.let_go_idle(loop.opens.held)  # at once again: none more
    assert loop.gone == ["ra-done"] and loop.cache.pins == {URLS[0]: 1}
    loop.readers._idle_dropped_at -= IDLE_LET_GO_EVERY  # the wait lasts
    loop.readers.let_go_idle(loop.opens.held)
    assert loop.gone == ["ra-done", "ra-worker"] and loop.cache.pins == {}


def test_a_hello_whose_random_access_is_no_flag_is_refused_unchanged(loop: Loop) -> None:
    with pytest.raises(ProtocolError, match="random_access"):
        hello(loop.readers, "c0", loop, random_access="yes")
    assert "c0" not in loop.readers


def test_an_open_moves_a_plain_clients_window(loop: Loop) -> None:
    loop.opens.op_open(loop.request("open", reader="plain", url=URLS[3], wait=False))
    assert loop.readers.planned()[:2] == URLS[3:5]
