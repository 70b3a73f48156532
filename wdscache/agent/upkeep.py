"""The agent's side of the cache commands (``wdscache prefetch``, ``evict``, ``clear``): ops on its socket.

With an agent running, the cache is changed through it, never behind its back: it owns
the index, the pins and the budget. :func:`evict_shards` is also what the commands run
on a cache no agent serves (they hold the cache directory's lock meanwhile).

Guarantees:

- Main loop only.
- A shard a reader holds (pinned) is evicted only with ``force``: a reader that has it
  open keeps reading its file, the cache forgets it.
- Shards asked to be prefetched are wanted after every reader's window, so they never
  hold up a reader; each is fetched once (a failed one again only when asked with ``retry``),
  under the same budget as every download, and dropped from the wish list once cached or failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..shared.index import ShardState
from ..shared.protocol import field as get_field
from ..shared.protocol import strings
from .cache import ShardCache
from .control import ControlSocket
from .downloads import Downloads

MAX_WARM = 1_000_000  # shards waiting to be prefetched at most


def evict_shards(cache: ShardCache, urls: Iterable[str], *, force: bool) -> dict[str, Any]:
    """Evict the cached shards of ``urls``: {evicted: [url], bytes (freed), refused: [{url, reason}],
    absent: [url] (not cached)}. Pinned shards are refused unless ``force``."""
    out: dict[str, Any] = {"evicted": [], "bytes": 0, "refused": [], "absent": []}
    for url in dict.fromkeys(urls):
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            out["absent"].append(url)
        elif cache.pins.get(url) and not force:
            out["refused"].append({"url": url, "reason": f"held by {cache.pins[url]} reader(s); --force evicts it"})
        else:
            out["evicted"].append(url)
            out["bytes"] += rec.size
            cache.remove(url)
    return out


class Upkeep:
    """The ``evict``, ``clear`` and ``prefetch`` ops, and the shards asked to be prefetched."""

    def __init__(self, cache: ShardCache, socket: ControlSocket, downloads: Downloads,
                 fetchable: Callable[[str], bool]) -> None:
        self._cache, self._socket, self._downloads = cache, socket, downloads
        self._fetchable = fetchable  # may this endpoint's peers have this URL fetched
        self._warm: dict[str, None] = {}  # shards to prefetch, in the order asked

    def op_evict(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        urls = strings(header, "urls")
        self._socket.reply(ident, rid, ok=True, **evict_shards(self._cache, urls, force=self._force(header)))

    def op_clear(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        cached = [r.url for r in self._cache.index.records.values() if r.state is ShardState.CACHED]
        self._socket.reply(ident, rid, ok=True, **evict_shards(self._cache, cached, force=self._force(header)))

    @staticmethod
    def _force(header: dict[str, Any]) -> bool:
        return bool(get_field(header, "force", bool, False))

    def op_prefetch(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        """Take ``urls`` up (once: asking again reports progress) and say where each stands."""
        urls = strings(header, "urls")
        retry = bool(get_field(header, "retry", bool, False))
        bad = [u for u in urls if not self._fetchable(u)]
        if bad:
            self._socket.reply(ident, rid, ok=False, error=f"{bad[0][:200]!r}: not a URL this agent fetches "
                               "for its clients (http(s)://; file:// and s3:// over an ipc:// endpoint only)")
            return
        if len(self._warm) + len(urls) > MAX_WARM:
            self._socket.reply(ident, rid, ok=False, error=f"at most {MAX_WARM} shards wait to be prefetched")
            return
        for url in urls:
            if retry:
                self._cache.forget_failure(url)
            rec = self._cache.index.get(url)
            if rec is None or rec.state not in (ShardState.CACHED, ShardState.FAILED):
                self._warm.setdefault(url)
        self._socket.reply(ident, rid, ok=True, shards=[self._where(u) for u in urls])

    def _where(self, url: str) -> dict[str, Any]:
        rec = self._cache.index.get(url)
        if rec is not None and rec.state is ShardState.CACHED:
            return {"state": "cached", "size": rec.size}
        if rec is not None and rec.state is ShardState.FAILED:
            return {"state": "failed", "error": rec.error or "unknown error"}
        if url in self._downloads:
            where = {"state": "downloading", **self._downloads.progress(url)}
        else:
            where = {"state": "queued"}
        reason = self._downloads.space_wait(url)
        return {**where, "waiting_for_space": reason} if reason else where

    def wanted(self) -> list[str]:
        """The shards still to prefetch (those cached or failed meanwhile are dropped)."""
        for url in [u for u in self._warm if self._cache.index.get(u) is not None
                    and self._cache.index.get(u).state in (ShardState.CACHED, ShardState.FAILED)]:
            del self._warm[url]
        return list(self._warm)
