"""The download policy without threads: which shards download now, budget grants, preemption, cancels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.policy import URLS, Loop
from wdscache.agent import downloads as downloads_module
from wdscache.agent import grants as grants_module
from wdscache.agent.events import Grant

U0, U1, U2, U3 = URLS[:4]


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    loop = Loop(tmp_path, limit=10_000)  # download_workers 1
    try:
        yield loop
    finally:
        loop.close()


def ask(loop: Loop, url: str, total: int) -> Grant:
    """The download of ``url`` asks for ``total`` bytes of budget, as its thread would."""
    grant = Grant(loop.cache.inflight[url], total)
    loop.downloads.asked(grant)
    return grant


def test_prefetches_take_download_workers_slots_and_a_demanded_shard_as_many_again(loop: Loop) -> None:
    loop.downloads.schedule([U0, U1], {U0, U1}, set())
    assert loop.downloads.running() == [U0]  # --download-workers 1
    loop.downloads.schedule([U2, U0, U1], {U0, U1, U2}, {U2})
    assert sorted(loop.downloads.running()) == [U0, U2]  # a reader waits for U2: it does not queue


def test_cached_and_failed_shards_are_not_downloaded(loop: Loop) -> None:
    loop.cached(U0)
    loop.schedule([U1])
    loop.fail(U1, "404 Not Found")
    loop.downloads.schedule([U0, U1], {U0, U1}, set())
    assert loop.downloads.running() == []


def test_budget_goes_to_the_demanded_download_first_and_the_other_waits_saying_why(loop: Loop) -> None:
    loop.downloads.schedule([U0], {U0}, set())
    loop.downloads.schedule([U1, U0], {U0, U1}, {U1})
    prefetch, demanded = ask(loop, U0, 6000), ask(loop, U1, 6000)
    readable = loop.downloads.schedule([U1, U0], {U0, U1}, {U1})
    assert demanded.event.is_set() and not prefetch.event.is_set()
    assert readable == []  # its size is not known yet (no partial reads)
    (wait,) = loop.downloads.space_waits({U1})
    assert wait["url"] == U0 and wait["reason"].startswith("waiting for space")
    assert loop.status(U0)["state"] == "queued"


def test_a_grant_too_large_for_the_whole_cache_fails_the_download_at_once(loop: Loop) -> None:
    loop.downloads.schedule([U0], {U0}, set())
    grant = ask(loop, U0, 20_000)
    loop.downloads.schedule([U0], {U0}, set())
    assert grant.event.is_set() and grant.error is not None and "larger than the whole cache" in str(grant.error)


def test_a_demanded_shard_preempts_a_prefetch_waiting_for_budget(loop: Loop) -> None:
    loop.downloads.schedule([U0], {U0}, set())
    loop.downloads.schedule([U1, U0], {U0, U1}, {U1})
    ask(loop, U1, 9000)
    ask(loop, U0, 9000)
    loop.downloads.schedule([U1, U0], {U0, U1}, {U1})  # U1 granted; U0 waits for budget
    loop.downloads.schedule([U2, U1, U0], {U0, U1, U2}, {U1, U2})  # slots full: U2 needs one
    assert loop.cache.inflight[U0].cancel.is_set()
    assert not loop.cache.inflight[U1].cancel.is_set()


def test_a_download_out_of_every_window_is_cancelled_at_once_for_a_demanded_shard(loop: Loop) -> None:
    loop.downloads.schedule([U0], {U0}, set())
    loop.downloads.schedule([U1, U0], {U0, U1}, {U1})
    loop.downloads.schedule([U2, U1], {U1, U2}, {U1, U2})  # U0 left every window; U2 needs its slot
    assert loop.cache.inflight[U0].cancel.is_set()


def test_a_download_out_of_every_window_is_cancelled_only_after_cancel_after(
    loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(downloads_module.time, "monotonic", lambda: now[0])
    loop.downloads.schedule([U0], {U0}, set())
    loop.downloads.schedule([], set(), set())
    now[0] += downloads_module.CANCEL_AFTER - 0.5
    loop.downloads.schedule([], set(), set())
    assert not loop.cache.inflight[U0].cancel.is_set()  # windows flicker: not yet
    loop.downloads.schedule([U0], {U0}, set())  # back in a window: the clock starts over
    now[0] += downloads_module.CANCEL_AFTER
    loop.downloads.schedule([], set(), set())
    assert not loop.cache.inflight[U0].cancel.is_set()
    now[0] += downloads_module.CANCEL_AFTER
    loop.downloads.schedule([], set(), set())
    assert loop.cache.inflight[U0].cancel.is_set()


def test_a_reader_waiting_to_read_as_it_downloads_is_answered_once_the_whole_size_is_granted(loop: Loop) -> None:
    request, reply = loop.open("r", U3, while_downloading=True)
    assert reply is None
    loop.schedule()
    d = loop.cache.inflight[U3]
    d.progress.total = 4000
    ask(loop, U3, 4000)
    loop.schedule()
    (answer,) = loop.opens.take_answers()
    assert answer.request == request and answer.body == {"ok": True, "while_downloading": True}
    assert loop.cache.pins == {U3: 1}


def test_a_download_cancelled_for_a_growth_deadlock_waits_until_another_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two downloads each hold budget and wait for more the other holds (gzip'd shards to decompress):
    the one that wrote least is cancelled, and neither it nor a newcomer no reader waits for takes its
    space back (a demanded shard may start); once the other ends, it starts again."""
    monkeypatch.setattr(grants_module, "GROWTH_GRACE", 0.0)
    loop = Loop(tmp_path, limit=10_000, download_workers=2)
    try:
        want = [U0, U1, U2]
        loop.downloads.schedule(want, set(want), set())
        assert sorted(loop.downloads.running()) == [U0, U1]
        for url, written in ((U0, 4000), (U1, 3000)):
            ask(loop, url, 4000)
            loop.cache.inflight[url].progress.written = written
        loop.downloads.schedule(want, set(want), set())  # both granted their bodies
        grants = []
        for url in (U0, U1):
            loop.cache.inflight[url].budget.needed = 8000  # the tar beside the compressed file
            grants.append(ask(loop, url, 8000))
        loop.downloads.schedule(want, set(want), set())  # both wait: the deadlock is seen
        loop.downloads.schedule(want, set(want), set())  # ... and broken
        victim = loop.cache.inflight[U1]
        assert victim.cancel.is_set() and not loop.cache.inflight[U0].cancel.is_set()
        grants[1].withdrawn = True  # as its thread does, then posts that it was cancelled
        loop.downloads.record_cancel(victim, keep_partial=False)
        loop.downloads.ended(victim)
        loop.downloads.schedule(want, set(want), set())
        assert grants[0].event.is_set()  # the space it held goes to the other
        assert loop.downloads.running() == [U0]  # neither it nor U2 started in its place
        loop.downloads.schedule([U3, *want], {U3, *want}, {U3})
        assert sorted(loop.downloads.running()) == [U0, U3]  # a shard a reader waits for starts
        loop.finish(U0)
        loop.downloads.schedule(want, set(want), set())
        assert sorted(loop.downloads.running()) == [U1, U3]  # another ended: it starts again
    finally:
        loop.close()


def test_the_disk_is_short_while_a_shard_waited_for_waits_for_min_free_or_starts_are_paused(loop: Loop) -> None:
    # Stats named no full disk: a rank waiting for it was told to raise --download-workers.
    loop.cache.min_free = loop.cache.fs_free() + (1 << 40)  # more than the file system has free
    loop.downloads.schedule([U0], {U0}, set())
    prefetch = ask(loop, U0, 6000)
    loop.downloads.schedule([U0], {U0}, set())
    assert not prefetch.event.is_set()
    # A prefetch waiting for space: listed, but no reader waits for it.
    assert [w["url"] for w in loop.downloads.space_waits(())] == [U0]
    assert loop.downloads.disk()["short"] is None
    loop.downloads.schedule([U1, U0], {U0, U1}, {U1})
    demanded = ask(loop, U1, 6000)
    loop.downloads.schedule([U1, U0], {U0, U1}, {U1})
    assert not demanded.event.is_set()
    disk = loop.downloads.disk()
    assert disk["short"] == "min_free" and disk["min_free"] == loop.cache.min_free, disk
    assert disk["error"].startswith("waiting for space: the file system keeps --min-free"), disk
    assert 0 <= disk["free_bytes"] < loop.cache.min_free, disk

    # A refused write pauses every start: the shards readers wait for that have no download wait for it.
    loop.downloads.pause("cannot write the index: database or disk is full")
    disk = loop.downloads.disk()
    assert (disk["short"], disk["error"]) == ("full", "cannot write the index: database or disk is full"), disk
    waits = {w["url"]: w["reason"] for w in loop.downloads.space_waits({U1, U2})}
    assert waits[U2] == (
        "waiting for space: the file system refused a write (cannot write the index: database or disk is full); "
        "no download starts until it has room"
    ), waits
    assert waits[U1].startswith("waiting for space: the file system keeps --min-free"), waits  # its own wait
