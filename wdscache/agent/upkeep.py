"""The agent's side of the cache commands (``wdscache prefetch``, ``evict``, ``clear``): ops on its socket.

With an agent running, the cache is changed through it, never behind its back: it owns
the index, the pins and the budget. :func:`evict_shards` is also what the commands run
on a cache no agent serves (they hold the cache directory's lock meanwhile).

Guarantees:

- Main loop only. The ops return their replies (:class:`~wdscache.agent.control.Request` in,
  :data:`~wdscache.agent.control.Reply` out); the core sends them.
- A shard a reader holds (pinned) is evicted only with ``force``: a reader that has it
  open keeps reading its file, the cache forgets it.
- After ``clear`` the agent prefetches nothing for its start-up plan until its list file
  changes (or it restarts): what comes back is what readers ask for (their windows, their
  opens) and what a ``prefetch`` asks for.
- Shards asked to be prefetched are wanted after every reader's window, so they never
  hold up a reader, under the same budget as every download; each is downloaded at most
  once per prefetch, and a prefetch never evicts the shards it holds to make room for
  another of its own (:mod:`wdscache.agent.prefetches`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..shared.index import ShardState
from ..shared.protocol import field as get_field
from ..shared.protocol import strings
from ..shared.redact import redact_urls
from .cache import ShardCache
from .control import Reply, Request
from .prefetches import MAX_PENDING, Prefetches

if TYPE_CHECKING:
    from .readers import Readers


def evict_shards(cache: ShardCache, urls: Iterable[str], *, force: bool, why: str) -> dict[str, Any]:
    """Evict the cached shards of ``urls`` (``why``, for the cache's watcher): {evicted: [url],
    bytes (freed), refused: [{url, reason}], absent: [url] (not cached)}. Pinned shards are
    refused unless ``force``."""
    out: dict[str, Any] = {"evicted": [], "bytes": 0, "refused": [], "absent": []}
    for url in dict.fromkeys(urls):
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            out["absent"].append(url)
        elif cache.pins.get(url) and not force:
            out["refused"].append({"url": url, "reason": f"held by {cache.pins[url]} reader(s); --force evicts it"})
        else:
            out["evicted"].append(url)
            out["bytes"] += rec.disk_bytes
            cache.remove(url, why)
    return out


class Upkeep:
    """The ``evict``, ``clear`` and ``prefetch`` ops."""

    def __init__(self, cache: ShardCache, prefetches: Prefetches, readers: Readers) -> None:
        self._cache, self._prefetches = cache, prefetches
        # What this endpoint's peers may have fetched, and the start-up plan (after a clear it
        # refills nothing, after an evict none of what it evicted).
        self._readers = readers

    def op_evict(self, request: Request) -> Reply:
        """Evict ``urls``; the start-up plan then prefetches none of them (an operator evicting a
        shard wants it gone), readers still get what they ask for."""
        header = request.header
        urls = strings(header, "urls")
        out = evict_shards(
            self._cache, urls, force=self._force(header), why="evicted on request (wdscache evict or verify)"
        )
        self._readers.leave_out_of_startup(out["evicted"])
        return {"ok": True, **out}

    def op_clear(self, request: Request) -> Reply:
        """Evict every cached shard; the start-up plan then prefetches nothing (an operator clearing
        a disk wants it to stay clear), readers still get what they ask for."""
        self._readers.stop_startup()
        cached = [r.url for r in self._cache.index.records.values() if r.state is ShardState.CACHED]
        return {
            "ok": True,
            **evict_shards(self._cache, cached, force=self._force(request.header), why="evicted by wdscache clear"),
        }

    @staticmethod
    def _force(header: dict[str, Any]) -> bool:
        return bool(get_field(header, "force", bool, False))

    def op_prefetch(self, request: Request) -> Reply:
        """Add a page of ``urls`` to prefetch ``prefetch`` (made on its first page)."""
        header = request.header
        name = get_field(header, "prefetch", str)
        urls = strings(header, "urls")
        bad = [u for u in urls if not self._readers.fetchable(u)]
        if bad:
            return {
                "ok": False,
                "error": f"{redact_urls(bad[0])[:200]!r}: not a URL this agent fetches for its clients "
                "(http(s)://; file:// and s3:// over an ipc:// endpoint only)",
            }
        if not self._prefetches.room_for(len(urls)):
            return {"ok": False, "error": f"at most {MAX_PENDING} shards wait to be prefetched"}
        asked = self._prefetches.take(name, urls, retry=bool(get_field(header, "retry", bool, False)))
        return {"ok": True, "asked": asked}

    def op_prefetch_status(self, request: Request) -> Reply:
        """Where prefetch ``prefetch`` stands, and its shards whose state changed since it last asked."""
        name = get_field(request.header, "prefetch", str)
        status = self._prefetches.status(name)
        if status is None:
            return {"ok": False, "error": f"no prefetch {name[:100]!r} here (it ended, or the agent restarted)"}
        return {"ok": True, **status}

    def op_prefetch_end(self, request: Request) -> Reply:
        """Prefetch ``prefetch`` is over: its shards stay cached, held no more."""
        return {"ok": True, "ended": self._prefetches.end(get_field(request.header, "prefetch", str))}
