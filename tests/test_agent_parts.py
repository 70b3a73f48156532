"""The agent's parts built on their own: a real cache, real file: shards, a real control socket.

No agent process and no fake ``self``: each test wires the few parts it needs, as
``Agent.start`` does, and drives the main loop's side itself.
"""

from __future__ import annotations

import dataclasses
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from scripts.shard_maker import make_dataset
from tests.helpers.net import free_port_range
from wdscache.agent.cache import ShardCache
from wdscache.agent.control import ControlSocket, Request
from wdscache.agent.downloads import Downloads
from wdscache.agent.events import BudgetAsked, DownloadCancelled, Downloaded, DownloadFailed, Mailbox, ValidatorFound
from wdscache.agent.fetch import Fetcher
from wdscache.agent.opens import Opens
from wdscache.agent.readers import Readers
from wdscache.agent.shards import Shards
from wdscache.shared.config import AgentConfig
from wdscache.shared.layout import CacheLayout
from wdscache.shared.protocol import client_key, pack, unpack
from wdscache.shared.urls import UrlList, parse_url_list

TIMEOUT = 20.0  # seconds any one wait of these tests may take


@dataclasses.dataclass
class Parts:
    config: AgentConfig
    urls: UrlList
    cache: ShardCache
    mailbox: Mailbox
    shards: Shards
    downloads: Downloads


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    paths = make_dataset(tmp_path / "src", 3, 5)
    urls = parse_url_list("\n".join(p.as_uri() for p in paths))
    config = AgentConfig(
        cache_dir=tmp_path / "cache",
        urls=tmp_path / "urls.txt",
        cache_size="64M",
        min_free="0",
        prefetch=2,
        download_workers=1,
        workers=1,
        retries=0,
    )
    layout = CacheLayout.of(config.cache_dir)
    layout.prepare()
    cache = ShardCache(layout, limit=64 << 20, min_free=0)
    mailbox = Mailbox()
    shards = Shards()
    downloads = Downloads(config, cache, shards, Fetcher(retries=0), mailbox)
    downloads.start_threads()
    try:
        yield Parts(config, urls, cache, mailbox, shards, downloads)
    finally:
        downloads.stop()
        assert not downloads.threads_alive()
        mailbox.close()
        cache.close()


def run_until_end(p: Parts, url: str) -> Any:
    """Drive the main loop's side of one download of ``url`` to its end; that end's event."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        p.downloads.schedule([url], {url}, {url})
        select.select([p.mailbox.fileno()], [], [], 0.05)
        p.mailbox.clear()
        while (event := p.mailbox.take()) is not None:
            if isinstance(event, BudgetAsked):
                p.downloads.asked(event.grant)
            elif isinstance(event, ValidatorFound):
                p.cache.set_validator(event.download.url, event.etag)
            else:
                if isinstance(event, Downloaded):
                    p.downloads.record_download(event.download, event.fetched)
                p.downloads.ended(event.download)
                return event
    raise AssertionError(f"no end of the download of {url} within {TIMEOUT}s")


def test_the_mailbox_wakes_the_loop_and_keeps_the_order() -> None:
    mailbox = Mailbox()
    sent = [DownloadCancelled(object()) for _ in range(3)]  # type: ignore[arg-type]
    try:
        poster = threading.Thread(target=lambda: [mailbox.post(e) for e in sent])
        poster.start()
        poster.join(TIMEOUT)
        assert select.select([mailbox.fileno()], [], [], TIMEOUT)[0]
        mailbox.clear()
        assert not select.select([mailbox.fileno()], [], [], 0)[0]  # the wake-up is gone, the events are not
        first = mailbox.take()
        mailbox.put_back(first)  # type: ignore[arg-type]
        assert [mailbox.take() for _ in range(4)] == [sent[1], sent[2], sent[0], None]
    finally:
        mailbox.close()


def test_a_download_runs_in_its_thread_and_ends_as_one_typed_record(parts: Parts) -> None:
    url = parts.urls.urls[0]
    event = run_until_end(parts, url)
    assert isinstance(event, Downloaded) and event.download.url == url
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.fetched = None  # type: ignore[misc]
    assert parts.cache.is_cached(url) and url not in parts.downloads
    assert parts.downloads.count() == 0


def test_a_missing_shard_fails_as_its_own_record(parts: Parts, tmp_path: Path) -> None:
    url = (tmp_path / "src" / "missing.tar").as_uri()
    event = run_until_end(parts, url)
    assert isinstance(event, DownloadFailed) and event.download.url == url, event


def test_an_open_waits_for_its_download_and_a_reader_that_goes_lets_go(parts: Parts) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port_range(1)}"
    socket = ControlSocket(endpoint, token="t" * 64, run="r" * 32)
    opens: list[Opens] = []
    readers = Readers(
        parts.config,
        parts.cache,
        parts.urls,
        endpoint=endpoint,
        workers=[],
        cache_root=[0, 0],
        gone=lambda name: opens[0].release_all(name),
    )
    opens.append(Opens(parts.config, parts.cache, parts.shards, readers, parts.downloads))
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(endpoint)
    url = parts.urls.urls[1]

    def reply(timeout: float) -> dict[str, Any] | None:
        if not client.poll(int(timeout * 1000)):
            return None
        return unpack(client.recv_multipart())[0]

    try:
        key = client_key("t" * 64, "r" * 32)
        client.send_multipart(pack({"op": "open", "id": 1, "reader": "plain", "url": url, "key": key}))
        assert socket.readable in socket.poll(TIMEOUT)
        for ident, header, _ in socket.receive():
            assert opens[0].op_open(Request(ident, header["id"], header)) is None  # not cached yet: it waits
        assert reply(0.2) is None
        assert opens[0].demanded() == [url] and "plain" in readers
        assert isinstance(run_until_end(parts, url), Downloaded)
        opens[0].downloaded(url)
        for answer in opens[0].take_answers():
            socket.answer(answer)
        got = reply(TIMEOUT)
        assert got is not None and got["ok"] and got["id"] == 1, got
        assert Path(got["path"]) == parts.cache.path(url)
        assert parts.cache.pins == {url: 1} and opens[0].held("plain") == 1
        readers.drop("plain")
        assert parts.cache.pins == {} and opens[0].held("plain") == 0
        assert len(opens[0].shards) == 0  # nothing refers to the shard any more: no record
    finally:
        client.close(0)
        ctx.term()
        socket.close()


def test_the_start_up_window_is_known_by_position_before_the_lookup_table(
    parts: Parts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long list is served before its lookup table is whole: the start-up window's URLs, whose
    downloads start with the agent, are placed and checked against the index by position. Any other
    URL is looked up, and a new list's window is its own."""
    from wdscache.shared import urls as urls_module
    from wdscache.shared.shard_index import ShardInfo, format_shard_index
    from wdscache.shared.urls import read_url_list

    placed: list[int] = []
    place = urls_module._place
    monkeypatch.setattr(
        urls_module, "_place", lambda table, urls, first: (placed.append(first), place(table, urls, first))
    )

    def index(name: str, order: list[int]) -> UrlList:
        path = tmp_path / name
        path.write_text(format_shard_index([(f"/data/shard-{i:04d}.tar", ShardInfo(i + 1, 1 << 30)) for i in order]))
        return read_url_list(path)

    first = index("first.json", list(range(2_000)))
    readers = Readers(
        parts.config, parts.cache, first, endpoint="ipc:///nowhere", workers=[], cache_root=[0, 0], gone=lambda n: None
    )
    window = readers.planned()
    as_listed = list(first.urls)
    assert len(window) == parts.config.prefetch
    for url in window:
        at = as_listed.index(url)
        assert readers.position(url) == at and readers.shard_info(url) == ShardInfo(at + 1, 1 << 30)
        assert readers.known(url) and readers.fetchable(url)
    assert placed == []  # no lookup table yet
    other = next(u for u in as_listed if u not in window)
    assert readers.position(other) == as_listed.index(other) and placed  # looked up: the table made
    assert readers.position("file:///data/not-listed.tar") is None and not readers.known("file:///data/not-listed.tar")

    second = index("second.json", list(reversed(range(2_000))))  # the same URLs, other positions and facts
    readers.replace_list(second)
    url = window[0]
    assert readers.position(url) == 1_999 - as_listed.index(url)
    assert readers.shard_info(url) == ShardInfo(as_listed.index(url) + 1, 1 << 30)
    readers.planned()
    assert all(readers.position(u) == list(second.urls).index(u) for u in readers.planned())
