"""The URL lists the agent keeps for its readers: uploaded in pages, checked, bounded, freed."""

from __future__ import annotations

from wdscache.agent.job_lists import MAX_JOB_LISTS, JobLists
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


def test_lists_are_bounded_and_one_nobody_reads_makes_room() -> None:
    lists = JobLists("ipc:///agent", idle=60.0)
    keys = []
    for n in range(MAX_JOB_LISTS):
        upload(lists, f"c{n}", urls_of(n))
        keys.append(list_id(urls_of(n)))
        assert lists.take(f"c{n}", keys[-1], read=keys) is None
    extra = urls_of(MAX_JOB_LISTS)
    upload(lists, "late", extra)
    refused = lists.take("late", list_id(extra), read=keys)  # every list is read: none goes
    assert refused is not None and f"holds {MAX_JOB_LISTS} URL lists" in str(refused["error"])
    upload(lists, "late", extra)
    assert lists.take("late", list_id(extra), read=keys[1:]) is None  # the unread one made room
    assert keys[0] not in lists and list_id(extra) in lists and len(lists) == MAX_JOB_LISTS


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
