"""Opens as a policy over the shards' records: requests in, replies out, no socket, no thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.policy import URLS, Loop
from wdscache.agent.shards import Phase
from wdscache.shared.layout import file_identity
from wdscache.shared.shard_index import ShardInfo


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    loop = Loop(tmp_path)
    try:
        yield loop
    finally:
        loop.close()


def test_an_open_of_a_cached_shard_replies_its_path_and_pins_it_until_released(loop: Loop) -> None:
    url = URLS[0]
    loop.cached(url, b"y" * 2048)
    _, reply = loop.open("r", url)
    assert reply is not None and reply["ok"] and reply["size"] == 2048
    assert Path(reply["path"]) == loop.cache.path(url)
    assert loop.cache.pins == {url: 1} and loop.opens.held("r") == 1
    assert loop.opens.op_release(loop.request("release", reader="r", urls=[url])) == {"ok": True}
    assert loop.cache.pins == {} and loop.opens.held("r") == 0
    assert loop.opens.take_answers() == []


def test_an_open_pins_the_shards_read_next_that_are_cached_now_and_waits_for_none(loop: Loop) -> None:
    first, cached, downloading, damaged, unknown = URLS[0], URLS[1], URLS[2], URLS[3], URLS[4]
    for url in (first, cached, damaged):
        loop.cached(url)
    loop.opens.op_corrupt(loop.request("corrupt", url=damaged, error="bad header"))  # its open says why
    loop.schedule([downloading])
    also = [cached, downloading, damaged, unknown, "http://127.0.0.1:9/not-listed.tar"]
    _, reply = loop.open("r", first, also=also)
    assert reply is not None and reply["ok"] and reply["also"] == [True, False, False, False, False]
    assert loop.cache.pins == {first: 1, cached: 1} and loop.opens.held("r") == 2
    assert loop.opens.demanded() == []  # nothing asked for: the ones not cached are opened when reached
    loop.opens.op_release(loop.request("release", reader="r", urls=[first, cached]))
    assert loop.cache.pins == {} and loop.opens.held("r") == 0
    # An open that waits pins nothing more: its answer comes later, alone.
    _, reply = loop.open("r", unknown, also=[cached])
    assert reply is None and loop.cache.pins == {}


def test_idle_cached_shards_keep_no_record(loop: Loop) -> None:
    for url in URLS:
        loop.cached(url)
    for url in URLS:
        loop.open("r", url)
    assert len(loop.opens.shards) == len(URLS)  # held: each has its pins
    for url in URLS:
        loop.opens.release("r", url)
    assert len(loop.opens.shards) == 0


def test_an_open_of_a_shard_not_cached_waits_and_is_answered_once_it_is_downloaded(loop: Loop) -> None:
    url = URLS[3]
    request, reply = loop.open("r", url)
    assert reply is None  # held: answered later
    assert loop.opens.demanded() == [url]
    assert loop.status(url)["state"] == "queued"
    loop.schedule()
    assert url in loop.downloads
    loop.finish(url)
    answers = loop.opens.take_answers()
    assert [a.request for a in answers] == [request]
    assert answers[0].body["ok"] and Path(answers[0].body["path"]) == loop.cache.path(url)
    assert loop.opens.demanded() == [] and loop.cache.pins == {url: 1}
    assert loop.opens.take_answers() == []  # answered once


def test_an_open_that_does_not_wait_is_told_the_shard_is_not_cached_yet(loop: Loop) -> None:
    _, reply = loop.open("r", URLS[1], wait=False)
    assert reply == {"ok": False, "cached": False, "error": "not cached yet"}
    assert loop.opens.demanded() == [URLS[1]]  # still downloaded for it


def test_a_url_not_listed_is_refused(loop: Loop) -> None:
    _, reply = loop.open("r", "http://127.0.0.1:9/other.tar")
    assert reply is not None and not reply["ok"] and "not in the agent's URL list" in reply["error"]


def test_a_failed_download_tells_its_waiters_and_later_opens_until_the_retry_time(loop: Loop) -> None:
    url = URLS[2]
    request, _ = loop.open("r", url)
    loop.schedule()
    loop.fail(url, "404 Not Found")
    answers = loop.opens.take_answers()
    assert [(a.request, a.body) for a in answers] == [
        (request, {"ok": False, "error": "404 Not Found", "corrupt": False})  # (a download's failure: a FetchError)
    ]
    _, reply = loop.open("r", url)
    assert reply == {"ok": False, "error": "404 Not Found", "corrupt": False}
    assert loop.status(url) == {"state": "failed", "error": "404 Not Found", "corrupt": False}
    assert url not in loop.downloads and loop.opens.demanded() == []


def test_a_waiter_whose_reader_went_is_answered_that_it_expired(loop: Loop) -> None:
    url = URLS[4]
    request, _ = loop.open("r", url)
    loop.readers.drop("r")
    loop.schedule()
    loop.finish(url)
    answers = loop.opens.take_answers()
    assert [(a.request, a.body) for a in answers] == [(request, {"ok": False, "error": "reader expired while waiting"})]
    assert loop.cache.pins == {}


def test_a_damaged_copy_is_downloaded_once_more_after_its_readers_let_go_then_failed_if_damaged_again(
    loop: Loop,
) -> None:
    url = URLS[5]
    loop.cached(url)
    loop.open("r", url)
    assert loop.opens.op_corrupt(loop.request("corrupt", url=url, error="bad header")) == {"ok": True}
    assert loop.opens.shards.get(url).phase is Phase.SUSPECT  # type: ignore[union-attr]
    assert loop.status(url)["state"] == "queued" and "damaged" in loop.status(url)["reason"]
    assert loop.cache.is_cached(url)  # held: not replaced under its reader
    request, reply = loop.open("other", url)
    assert reply is None  # waits for the new copy
    loop.opens.release("r", url)
    assert not loop.cache.is_cached(url) and loop.opens.demanded() == [url]
    loop.schedule()
    loop.finish(url)
    (answer,) = loop.opens.take_answers()
    assert answer.request == request and answer.body["ok"]
    loop.opens.release("other", url)
    # A consumer cannot say which copy it read: after the one new download, its report changes nothing.
    loop.opens.op_corrupt(loop.request("corrupt", url=url, error="bad again"))
    assert loop.cache.is_cached(url)
    _, reply = loop.open("r", url)
    assert reply is not None and reply["ok"]
    shard = loop.opens.shards.get(url)
    assert shard is not None and shard.refetched


def test_a_copy_damaged_again_after_its_new_download_fails_the_shard(loop: Loop) -> None:
    url = URLS[6]
    loop.cached(url)
    loop.opens.op_corrupt(loop.request("corrupt", url=url, error="bad header"))  # nobody holds it: refetched
    loop.open("r", url)
    loop.schedule()
    loop.finish(url)
    loop.opens.take_answers()
    loop.opens.release("r", url)
    identity = list(file_identity(loop.cache.path(url).stat()))
    loop.opens.op_corrupt_copy(loop.request("corrupt_copy", url=url, error="bad again", identity=identity))
    status = loop.status(url)
    assert status["state"] == "failed" and status["corrupt"] is True and "damaged again" in status["error"]
    _, reply = loop.open("r", url)
    assert reply is not None and reply["corrupt"] is True


def test_a_shard_read_fine_after_its_refetch_gets_one_more_download_if_damaged_later(loop: Loop) -> None:
    url = URLS[7]
    loop.cached(url)
    loop.opens.op_corrupt(loop.request("corrupt", url=url, error="bad"))
    loop.open("r", url, wait=False)
    loop.schedule()
    loop.finish(url)
    assert loop.opens.shards.get(url) is not None  # refetched: remembered until a read goes through
    loop.opens.read_fine(url)
    assert loop.opens.shards.get(url) is None


def test_an_unlisted_shard_answers_its_waiters(loop: Loop) -> None:
    url = URLS[1]
    request, _ = loop.open("r", url)
    loop.opens.unlisted(url)
    assert [(a.request, a.body["error"]) for a in loop.opens.take_answers()] == [
        (request, "removed from the agent's URL list")
    ]
    assert loop.opens.demanded() == [] and len(loop.opens.shards) == 0


def test_a_copy_found_unlike_its_index_then_downloaded_anew_leaves_no_reason_for_a_later_damage(
    tmp_path: Path,
) -> None:
    """A copy found unlike its index while held is downloaded anew another way (its file vanished):
    the reason goes with it. Found damaged later, that copy is downloaded once more keeping the count
    a worker took of it (a damaged copy's count stays), not dropped as an outdated copy's is."""
    loop = Loop(tmp_path, index=[ShardInfo(3) for _ in URLS])
    try:
        url = URLS[0]
        loop.cached(url)
        _, reply = loop.open("r", url)
        assert reply is not None and reply["ok"]
        loop.cache.index.set_count(url, 5, 1024, '"v1"')  # a worker counted 5: unlike the index's 3
        _, reply = loop.open("other", url)
        assert reply is None and loop.opens.shards.get(url).phase is Phase.SUSPECT  # type: ignore[union-attr]
        loop.cache.path(url).unlink()  # (its file vanished: the next open has it downloaded anew)
        loop.open("third", url)
        loop.schedule()
        loop.finish(url, b"x" * 2048)
        assert loop.opens.shards.get(url).phase is Phase.IDLE  # type: ignore[union-attr]
        loop.opens.take_answers()
        for reader in ("r", "other", "third"):
            loop.opens.release(reader, url)
        loop.cache.index.set_count(url, 3, 2048, '"v1"')  # the new copy holds what the index says
        loop.opens.op_corrupt(loop.request("corrupt", url=url, error="bad header"))
        _, reply = loop.open("r", url, wait=False)
        assert reply == {"ok": False, "cached": False, "error": "not cached yet"}
        assert loop.opens.demanded() == [url] and not loop.cache.is_cached(url)
        assert loop.cache.index.counts.get(url) == 3
    finally:
        loop.close()


def test_a_count_of_a_copy_replaced_since_is_not_taken_for_the_new_copy(loop: Loop) -> None:
    # A worker counts the copy it read; by the time its report comes the shard may have been
    # evicted and downloaded again from a source that changed: that count is not the new copy's.
    url = URLS[0]
    loop.cached(url, b"a" * 1024)
    old = list(file_identity(loop.cache.path(url).stat()))
    loop.cache.remove(url, "evicted for the test")
    loop.cached(url, b"b" * 2048)
    assert loop.readers.samples(url) is None
    loop.opens.op_counted(loop.request("counted", url=url, samples=4, identity=old))
    assert loop.readers.samples(url) is None
    new = list(file_identity(loop.cache.path(url).stat()))
    loop.opens.op_counted(loop.request("counted", url=url, samples=7, identity=new))
    assert loop.readers.samples(url) == 7
