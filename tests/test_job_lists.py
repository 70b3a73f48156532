"""The URL lists the agent keeps for its readers: uploaded in pages, checked, bounded, freed."""

from __future__ import annotations

from wdscache.agent.job_lists import MAX_JOB_LIST_BYTES, MAX_UPLOADS, JobLists
from wdscache.shared.urls import list_id


def upload(lists: JobLists, name: str, urls: list[str]) -> dict[str, object] | None:
    return lists.put_page(name, {"offset": 0, "urls": urls})


def urls_of(n: int, scheme: str = "http://127.0.0.1:9/") -> list[str]:
    return [f"{scheme}l{n}-{i}.tar" for i in range(3)]


def test_a_list_is_kept_only_as_the_list_id_its_hello_claims() -> None:
    lists = JobLists("ipc:///agent", idle=60.0)
    urls = urls_of(0)
    assert upload(lists, "c0", urls) is None
    assert lists.take("c0", "another-id", read=()) == {
        "ok": False,
        "error": "the list sent does not match its list_id",
    }
    assert len(lists) == 0
    # The upload went with the refusal: a hello claiming the list again must send it again.
    assert lists.take("c0", list_id(urls), read=())["need_urls"] is True
    assert upload(lists, "c0", urls) is None
    assert lists.take("c0", list_id(urls), read=()) is None and list_id(urls) in lists


def test_a_peer_over_tcp_may_name_only_http_urls() -> None:
    local = urls_of(0, "file:///data/")
    for endpoint, kept in (("tcp://127.0.0.1:5555", False), ("ipc:///agent", True)):
        lists = JobLists(endpoint, idle=60.0)
        upload(lists, "c0", local)
        refused = lists.take("c0", list_id(local), read=())
        assert (refused is None) == kept, refused
        if not kept:
            assert refused is not None and "a job's URLs must be absolute http:///https:// URLs" in str(
                refused["error"]
            )


def test_a_refused_url_shows_no_part_of_a_long_secret() -> None:
    # A JWT as the user name: the message is cut at 200 characters, which must not come before
    # the redaction (the "@" cut off, nothing would say where the secret ends).
    token = "eyJ" + "x" * 300
    url = f"file://{token}@host/data/a.tar"
    lists = JobLists("tcp://127.0.0.1:5555", idle=60.0)
    upload(lists, "c0", [url])
    refused = lists.take("c0", list_id([url]), read=())
    assert refused is not None and "must be absolute" in refused["error"], refused
    assert "xxxxxxxx" not in refused["error"], refused["error"]


def long_urls(n: int, size: int) -> list[str]:
    """About ``size`` bytes of URLs (of 1 KiB each), the n-th list of them."""
    return [f"http://127.0.0.1:9/l{n}-{i:08d}-{'x' * 990}.tar" for i in range(size >> 10)]


def test_lists_are_bounded_by_their_bytes_and_one_nobody_reads_makes_room() -> None:
    lists = JobLists("ipc:///agent", idle=60.0)
    third = MAX_JOB_LIST_BYTES * 3 // 8  # two fit, not three
    keys = []
    for n in range(2):
        urls = long_urls(n, third)
        upload(lists, f"c{n}", urls)
        keys.append(list_id(urls))
        assert lists.take(f"c{n}", keys[-1], read=keys) is None
    extra = long_urls(2, third)
    upload(lists, "late", extra)
    refused = lists.take("late", list_id(extra), read=keys)  # every list is read: none goes
    assert refused is not None and refused["retry"] is True, refused
    assert "would take them past 64.0M; try again once one ends" in str(refused["error"]), refused
    assert lists.take("late", "another-id", read=keys) == {
        "ok": False,
        "error": "the list sent does not match its list_id",
    }
    upload(lists, "late", extra)
    assert lists.take("late", list_id(extra), read=keys)["retry"] is True  # type: ignore[index]
    # Its upload was kept for the hello asked again: taken as soon as an unread list makes room.
    assert lists.take("late", list_id(extra), read=keys[1:]) is None
    assert keys[0] not in lists and list_id(extra) in lists and len(lists) == 2


def test_many_jobs_of_ordinary_lists_are_kept_at_once() -> None:
    lists = JobLists("ipc:///agent", idle=60.0)
    keys = []
    for n in range(200):  # 200 jobs of 1,000 shards each
        urls = [f"https://data.example.com/datasets/job-{n}/train/shard-{i:06d}.tar" for i in range(1000)]
        keys.append(list_id(urls))
        upload(lists, f"c{n}", urls)
        assert lists.take(f"c{n}", keys[-1], read=keys) is None
    assert len(lists) == 200


def test_a_list_nobody_reads_is_freed_after_the_grace() -> None:
    lists = JobLists("ipc:///agent", idle=60.0)
    a, b = urls_of(0), urls_of(1)
    for name, urls in (("c0", a), ("c1", b)):
        upload(lists, name, urls)
        lists.take(name, list_id(urls), read=())
    lists.free(read={list_id(a)}, grace=0.0)
    assert list_id(a) in lists and list_id(b) not in lists
    lists.free(read=(), grace=60.0)  # unread from now on, but within the grace
    assert list_id(a) in lists


def test_an_upload_beyond_those_under_way_is_refused_to_be_sent_again() -> None:
    lists = JobLists("ipc:///agent", idle=60.0)
    for n in range(MAX_UPLOADS):
        assert upload(lists, f"c{n}", urls_of(n)) is None
    assert upload(lists, "late", urls_of(99)) == {
        "ok": False,
        "retry": True,
        "error": "too many lists being uploaded at once; try again",
    }
    assert lists.take("c0", list_id(urls_of(0)), read=()) is None  # a hello frees its place
    assert upload(lists, "late", urls_of(99)) is None
