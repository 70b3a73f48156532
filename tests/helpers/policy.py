"""The agent's deciding parts (readers, opens, downloads) on a real cache, without sockets or threads.

The test plays the main loop: it sends requests to the parts' ops and takes their
replies, and ends downloads itself (a shard's file written where the download would
publish it), so every step is deterministic and fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wdscache.agent.cache import ShardCache
from wdscache.agent.control import Reply, Request
from wdscache.agent.downloads import Downloads
from wdscache.agent.events import Mailbox
from wdscache.agent.fetch import Fetcher
from wdscache.agent.opens import Opens, shard_status
from wdscache.agent.readers import Readers
from wdscache.agent.shard_download import Fetched
from wdscache.agent.shards import Shards
from wdscache.shared.config import AgentConfig
from wdscache.shared.errors import FetchError
from wdscache.shared.layout import CacheLayout
from wdscache.shared.shard_index import ShardInfo
from wdscache.shared.urls import UrlList

# Never fetched: no download thread runs; the test ends each download itself.
URLS = [f"http://127.0.0.1:9/shard-{i:03d}.tar" for i in range(8)]


class Loop:
    """The parts of one agent, driven by hand."""

    def __init__(
        self, root: Path, *, limit: int = 64 << 20, index: Sequence[ShardInfo] | None = None, **settings: Any
    ) -> None:
        """``index``: what the agent's list (a shard index, then) says of each of :data:`URLS`."""
        options: dict[str, Any] = {
            "cache_size": str(limit),
            "min_free": "0",
            "prefetch": 2,
            "download_workers": 1,
            "workers": 1,
            "retries": 0,
            **settings,
        }
        self.config = AgentConfig(cache_dir=root / "cache", urls=root / "urls.txt", **options)
        layout = CacheLayout.of(self.config.cache_dir)
        layout.prepare()
        self.cache = ShardCache(layout, limit=limit, min_free=0)
        self.mailbox = Mailbox()
        self.shards = Shards()
        self.downloads = Downloads(self.config, self.cache, self.shards, Fetcher(retries=0), self.mailbox)
        self.gone: list[str] = []
        self.readers = Readers(
            self.config,
            self.cache,
            UrlList(None, tuple(URLS), shards=None if index is None else tuple(index)),
            endpoint="ipc:///none",
            workers=["ipc:///w0"],
            cache_root=[0, 0],
            gone=self._gone,
        )
        self.opens = Opens(self.config, self.cache, self.shards, self.readers, self.downloads)
        self._rid = 0

    def _gone(self, name: str) -> None:
        self.gone.append(name)
        self.opens.release_all(name)

    def close(self) -> None:
        self.downloads.stop()
        self.mailbox.close()
        self.cache.close()

    def request(self, op: str, **header: Any) -> Request:
        self._rid += 1
        return Request(b"client", self._rid, {"op": op, **header})

    def status(self, url: str) -> dict[str, Any]:
        """What a ``status`` request of ``url`` is answered."""
        return shard_status(self.cache, self.shards, self.downloads, url)

    def open(self, reader: str, url: str, **header: Any) -> tuple[Request, Reply | None]:
        request = self.request("open", reader=reader, url=url, **header)
        return request, self.opens.op_open(request)

    def schedule(self, want: list[str] | None = None) -> None:
        """One turn of scheduling: what readers asked for first, then ``want``."""
        asked = self.opens.demanded()
        want = asked + [u for u in want or [] if u not in asked]
        for url in self.downloads.schedule(want, set(want), set(asked)):
            self.opens.answer_while_downloading(url)

    def finish(self, url: str, data: bytes = b"x" * 1024) -> None:
        """The download of ``url`` (started by :meth:`schedule`) publishes ``data``."""
        d = self.cache.inflight[url]
        d.final.parent.mkdir(parents=True, exist_ok=True)
        d.final.write_bytes(data)
        self.downloads.record_download(d, Fetched(len(data), etag='"v1"'))
        self.opens.downloaded(url)
        self.downloads.ended(d)

    def fail(self, url: str, reason: str) -> None:
        d = self.cache.inflight[url]
        self.downloads.record_failure(d, FetchError(url, reason, permanent=True))
        self.opens.failed(url, reason)
        self.downloads.ended(d)

    def cached(self, url: str, data: bytes = b"x" * 1024) -> None:
        """``url`` downloaded for nobody in particular (a prefetch)."""
        self.schedule([url])
        self.finish(url, data)
