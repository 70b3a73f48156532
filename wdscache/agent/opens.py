"""The agent's opens: a reader asks for a shard, waits for it, holds it pinned, lets it go.

This part answers ``open``, ``status`` and ``release``, keeps who waits for
which shard and what each reader holds, checks a shard cached by an earlier run
against its source before serving it (revalidation), and handles damage: a copy a
read found damaged is downloaded once more, and the shard fails (saying why) if
that new copy is damaged too.

Guarantees:

- Main loop only.
- A reader is answered with a path only for a shard that is cached and, when it
  was cached by an earlier run and ``--revalidate`` is on, found current; a file
  deleted behind the agent's back is downloaded again, never served missing.
- Every pin a reader holds is one pin in the cache (:meth:`Opens.release_all`
  gives them all back when it goes), so nothing a reader holds is evicted.
- A shard still downloading is pinned for a reader (``partial``) only once its
  download holds its whole budget: a reader that held pins while it waited for a
  download that waits for budget could deadlock the cache.
- A damaged copy is replaced only when no reader holds it; readers that ask for
  it meanwhile wait for the new one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from ..shared.config import AgentConfig
from ..shared.index import ShardRecord, ShardState
from ..shared.layout import file_identity
from ..shared.logs import event, get_logger
from ..shared.protocol import field as get_field
from .cache import ShardCache
from .control import ControlSocket
from .downloads import Downloads
from .readers import Readers
from .shard_download import Fetched
from .validators import common_validator, validator_kind

log = get_logger(__name__)

FAILED_RETRY_AFTER = 60.0  # a failed shard asked for again after this long is retried
MAX_LISTED = 100  # corrupt or changed shards remembered for stats


@dataclass
class _Waiter:
    """A client waiting for a shard to be cached (or, with ``partial``, to be readable as it downloads)."""

    ident: bytes
    rid: Any
    reader: str
    partial: bool = False


class Opens:
    """Opens, pins, waiters, revalidation, damage and refetch."""

    def __init__(self, config: AgentConfig, cache: ShardCache, socket: ControlSocket, readers: Readers,
                 downloads: Downloads) -> None:
        self._config, self._cache, self._socket = config, cache, socket
        self._readers, self._downloads = readers, downloads
        self._pins: dict[str, dict[str, int]] = {}  # reader -> url -> how many times it holds it open
        self._waiters: dict[str, list[_Waiter]] = {}
        self._demanded: dict[str, float] = {}  # url -> when first asked for (and not answered yet)
        self._verified: set[str] = set()  # cached shards known current (downloaded or checked this run)
        self._failed_at: dict[str, float] = {}  # url -> when its download (or its copies) failed
        self._suspect: set[str] = set()  # cached shards a read found damaged: fetched again once nobody holds them
        self._refetched: set[str] = set()  # damaged shards downloaded once more, not yet read fine since
        self._failed_damaged: set[str] = set()  # failed because their copies were damaged, not their downloads
        self._corrupt: dict[str, str] = {}  # url -> why it could not be read (for stats)
        self._changed: dict[str, str] = {}  # url -> how it changed on the server (for stats)

    # -- ops --------------------------------------------------------------------

    def op_open(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        ahead = get_field(header, "ahead", list, None)
        wait = get_field(header, "wait", bool, True)
        partial = get_field(header, "stream", bool, False)  # the wire's name for "readable while it downloads"
        self.open(ident, rid, header["reader"], get_field(header, "url", str), ahead, wait, partial)

    def op_status(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        self._socket.reply(ident, rid, ok=True, **self.status(get_field(header, "url", str)))

    def op_release(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        self.release(header["reader"], get_field(header, "url", str))
        self._socket.reply(ident, rid, ok=True)

    def op_damaged(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        # From one of our workers (checked before), naming the copy it read.
        url, error = get_field(header, "url", str), get_field(header, "error", str)
        self._damaged(url, error, get_field(header, "identity", list), "a worker")

    def op_corrupt(self, ident: bytes, rid: Any, header: dict[str, Any]) -> None:
        url, error = get_field(header, "url", str), get_field(header, "error", str)
        self._damaged(url, error, None, "a consumer")
        self._socket.reply(ident, rid, ok=True)

    # -- opening ------------------------------------------------------------------

    def open(
        self, ident: bytes, rid: Any, name: str, url: str, ahead: list[Any] | None = None, wait: bool = True,
        partial: bool = False,
    ) -> None:
        """Pin ``url`` for reader ``name`` once it is cached (``wait``), or answer that it is not.

        With ``partial``, a shard not cached yet is pinned as soon as its download
        holds its whole budget (the reply says ``partial``): the reader then reads
        its complete samples from the workers while it downloads, and the pin holds
        the shard once it is published. Not before (see the module's guarantees):
        until then the answer is "not cached" (or, with ``wait``, comes later).
        """
        reply, cache = self._socket.reply, self._cache
        if not self._readers.known(url, name):
            reply(ident, rid, ok=False, error=f"{url} is not in the agent's URL list ({self._config.urls})")
            return
        self._readers.opened(name, url, ahead)
        rec = cache.index.get(url)
        if rec is not None and rec.state is ShardState.CACHED and not cache.path(url).exists():
            # Deleted behind our back: forget it and download it again, never serve a missing file.
            log.warning("cache file of %s vanished; downloading it again", url)
            cache.remove(url, "its cache file vanished")
            rec = None
        elif rec is not None and url in self._suspect:
            # A read found it damaged: it is fetched once more (a bad copy is repaired; a bad source
            # is failed once its new copy is found damaged too, see _damaged), now if nobody
            # holds it, else once they let go; meanwhile it is not cached for this reader.
            self._refetch_if_damaged(url)
            rec = None
        if rec is not None and rec.state is ShardState.CACHED:
            cache.index.incr("hits")
            if url in self._verified or not self._config.revalidate:
                self._grant(ident, rid, name, url)
                return
            # Cached by an earlier run: check it is still what the source holds first.
            self._downloads.revalidate(url)
            if wait:
                self._waiters.setdefault(url, []).append(_Waiter(ident, rid, name))
            else:
                reply(ident, rid, ok=False, cached=False, error="revalidating")
            return
        cache.index.incr("misses")
        if rec is not None and rec.state is ShardState.FAILED:
            if time.monotonic() - self._failed_at.get(url, 0.0) < FAILED_RETRY_AFTER:
                reply(ident, rid, ok=False, error=rec.error or "download failed", damaged=url in self._failed_damaged)
                return
            cache.forget_failure(url)
            self._failed_damaged.discard(url)
            self._refetched.discard(url)  # a new try from the start: one more download if damaged again
        self._demanded.setdefault(url, time.monotonic())
        self._downloads.demand(url)
        if partial and self._downloads.readable_partial(url):
            self._grant(ident, rid, name, url, partial=True)
        elif wait:
            self._waiters.setdefault(url, []).append(_Waiter(ident, rid, name, partial))
        else:
            reply(ident, rid, ok=False, cached=False, error="not cached yet")

    def _grant(self, ident: bytes, rid: Any, name: str, url: str, *, partial: bool = False) -> None:
        if name not in self._readers:
            self._socket.reply(ident, rid, ok=False, error="reader expired while waiting")
            return
        held = self._pins.setdefault(name, {})
        held[url] = held.get(url, 0) + 1
        self._cache.pin(url)  # a shard still downloading stays pinned once published
        if partial:
            self._socket.reply(ident, rid, ok=True, partial=True)
            return
        rec = self._cache.index.get(url)
        assert rec is not None  # cached: the open above found it so
        self._socket.reply(ident, rid, ok=True, path=str(self._cache.path(url)), size=rec.size,
                           samples=self._readers.samples(url))

    def status(self, url: str) -> dict[str, Any]:
        """Where ``url`` stands: cached; downloading (with its budget); queued (for a download
        slot or budget); failed (with the error); or unknown (nobody asked for it)."""
        rec = self._cache.index.get(url)
        if url in self._suspect:
            return {"state": "queued", "reason": "its cached copy is damaged: it is downloaded again once the "
                                                 "readers that hold it let go"}
        if rec is not None and rec.state is ShardState.CACHED:
            return {"state": "cached"}
        progress = self._downloads.progress(url)
        waits = self._downloads.space_wait(url)
        if waits is not None:  # before "downloading": a partial read that waits for space should say why
            return {"state": "queued", "reason": waits, **progress}
        if self._downloads.readable_partial(url):
            return {"state": "downloading", **progress}
        if rec is not None and rec.state is ShardState.FAILED:
            # "damaged": its copies were found damaged (the shard is bad, not its download).
            return {"state": "failed", "error": rec.error or "download failed", "damaged": url in self._failed_damaged}
        return {"state": "queued" if url in self._downloads or url in self._demanded else "unknown", **progress}

    def answer_partial(self, url: str) -> None:
        """The download of ``url`` got its whole budget: readers waiting to read it as it downloads may start."""
        waiting = self._waiters.get(url, [])
        for w in [w for w in waiting if w.partial]:
            self._grant(w.ident, w.rid, w.reader, url, partial=True)
        rest = [w for w in waiting if not w.partial]
        if rest:
            self._waiters[url] = rest
        else:
            self._waiters.pop(url, None)

    def _answer_waiters(self, url: str, error: str | None = None) -> None:
        self._demanded.pop(url, None)
        for w in self._waiters.pop(url, []):
            if error is None:
                self._grant(w.ident, w.rid, w.reader, url)
            else:
                self._socket.reply(w.ident, w.rid, ok=False, error=error)

    def demanded(self) -> list[str]:
        """The shards readers wait for, oldest first."""
        return sorted(self._demanded, key=self._demanded.__getitem__)

    # -- holding ------------------------------------------------------------------

    def held(self, name: str) -> int:
        """How many shards reader ``name`` holds open."""
        return len(self._pins.get(name, ()))

    def release(self, name: str, url: str) -> None:
        held = self._pins.get(name, {})
        if held.get(url, 0) <= 0:
            return
        held[url] -= 1
        if not held[url]:
            del held[url]
        self._cache.unpin(url)
        self._refetch_if_damaged(url)

    def release_all(self, name: str) -> None:
        """Reader ``name`` is gone: everything it held is let go."""
        for url, count in self._pins.pop(name, {}).items():
            for _ in range(count):
                self._cache.unpin(url)
            self._refetch_if_damaged(url)

    # -- what the downloads found -----------------------------------------------------

    def downloaded(self, url: str) -> None:
        """``url`` was downloaded: it is current; its waiters get it."""
        self._verified.add(url)
        self._failed_at.pop(url, None)
        self._answer_waiters(url)

    def failed(self, url: str, reason: str) -> None:
        """The download of ``url`` failed for good: its waiters are told why."""
        self._failed_at[url] = time.monotonic()
        self._answer_waiters(url, error=reason)

    def unlisted(self, url: str) -> None:
        """``url`` left the agent's list and no reader's list holds it: nobody waits for it any more."""
        if self._demanded.pop(url, None) is not None:
            self._answer_waiters(url, error="removed from the agent's URL list")

    def revalidated(self, url: str, now: Fetched | None) -> None:
        """A cached shard from an earlier run was compared with its source (``now``: what it holds)."""
        cache = self._cache
        cache.unpin(url)
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            self._demanded.setdefault(url, time.monotonic())  # gone meanwhile: its waiters need it
            return
        changed = self._unlike_index(url, rec.source_size or rec.size) or _unlike_source(url, rec, now)
        unknown = None if changed else _not_comparable(rec, now)
        if changed is None and unknown is None:
            self._verified.add(url)
            self._answer_waiters(url)
            return
        if changed is not None:
            log.error("%s %s; downloading it again", url, changed)
            _remember(self._changed, url, changed)
            cache.index.incr("changed")
            cache.remove(url, f"evicted: it {changed}")
        else:
            log.warning("cannot tell whether %s changed on the server: %s; downloading it again", url, unknown)
            cache.remove(url, f"evicted: cannot tell whether it changed on the server ({unknown})")
        cache.index.drop_count(url)
        self._demanded.setdefault(url, time.monotonic())  # its waiters get the new copy

    def _unlike_index(self, url: str, size: int) -> str | None:
        """How a copy cached by an earlier run (its source was ``size`` bytes) differs from what
        its shard index says now (None: it does not, or there is no index): it is downloaded
        again then, and that download is checked."""
        info = self._readers.shard_info(url)
        if info is None:
            return None
        counted = self._cache.index.counts.get(url)
        if info.filesize is not None and size != info.filesize:
            return f"is {size} bytes in the cache, but the shard index says {info.filesize}"
        if counted is not None and counted != info.nsamples:
            return f"holds {counted} samples in the cache, but the shard index says {info.nsamples}"
        return None

    # -- damage -----------------------------------------------------------------------

    def read_fine(self, url: str) -> None:
        """A worker read ``url``'s headers through: later damage gets one more download again."""
        self._refetched.discard(url)

    def _damaged(self, url: str, error: str, identity: list[Any] | None, who: str) -> None:
        """A read found ``url``'s cached copy damaged: it is downloaded once more when no reader
        holds it, and failed (with the reason) if that new copy is damaged too.

        ``identity`` names the file a worker read; a consumer cannot say which copy it read
        (None), so its report only ever asks for the one new download. A report about a copy
        replaced since changes nothing.
        """
        cache = self._cache
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            return
        if identity is not None:
            try:
                if list(file_identity(os.stat(cache.path(url)))) != identity:
                    return
            except OSError:
                return
        elif url in self._refetched:
            return
        if url in self._suspect:
            return  # this copy was reported already
        event(log, "damaged", "damaged shard reported by %s: %s: %s", who, url, error[:500], level=logging.ERROR,
              url=url, error=error[:500], by=who)
        cache.index.incr("corrupt")
        _remember(self._corrupt, url, error[:500])
        if url not in self._refetched:
            self._suspect.add(url)
            return
        reason = f"damaged again after it was downloaded once more: {error[:400]}"
        event(log, "failed", "failed %s: %s", url, reason, level=logging.ERROR, url=url, error=reason)
        self._suspect.discard(url)
        self._failed_damaged.add(url)
        cache.fail_cached(url, reason)
        self.failed(url, reason)

    def _refetch_if_damaged(self, url: str) -> None:
        """A damaged copy nobody holds any more is dropped, and downloaded once more for the
        readers waiting for it (see :meth:`_damaged`)."""
        if url not in self._suspect or self._cache.pins.get(url):
            return
        log.warning("downloading %s again: %s", url, self._corrupt.get(url, "found damaged"))
        self._suspect.discard(url)
        self._refetched.add(url)
        # Its sample count stays: it was found in a copy of this very version, and the ranks
        # of a job that ask for it meanwhile must all get the same answer.
        self._cache.remove(url, "found damaged, to be downloaded once more")
        self._demanded.setdefault(url, time.monotonic())

    def view(self) -> dict[str, Any]:
        """The damaged and changed shards, for the stats reply."""
        return {"corrupt": [{"url": u, "error": e} for u, e in self._corrupt.items()],
                "changed": [{"url": u, "error": e} for u, e in self._changed.items()]}


def _unlike_source(url: str, rec: ShardRecord, now: Fetched | None) -> str | None:
    """How the source of a cached copy changed since (None: it did not, or cannot be asked)."""
    if now is None:
        log.info("could not revalidate %s; serving the cached copy", url)
        return None
    if now.size != (rec.source_size or rec.size):
        return f"size changed on the server ({rec.source_size or rec.size} -> {now.size} bytes)"
    common = common_validator(rec.etag, rec.last_modified, now.etag, now.last_modified)
    if common is not None and common[1] != common[2]:
        return f"changed on the server ({common[0]} {common[1]} -> {common[2]})"
    return None


def _not_comparable(rec: ShardRecord, now: Fetched | None) -> str | None:
    """Why a cached copy cannot be told current although its source answered (None: it can,
    or the source could not be asked): the copy and the source have no validator in common,
    so the copy is downloaded again rather than served unchecked."""
    if now is None or common_validator(rec.etag, rec.last_modified, now.etag, now.last_modified) is not None:
        return None
    return (f"its copy was cached with {_kinds(rec.etag, rec.last_modified)}, the server now sends "
            f"{_kinds(now.etag, now.last_modified)}: no validator in common")


def _kinds(tag: str | None, date: str | None) -> str:
    """The kinds of validator a version is known by, for messages ("ETag and Last-Modified")."""
    kinds = [validator_kind(tag)] if tag else []
    if date and "Last-Modified" not in kinds:
        kinds.append("Last-Modified")
    return " and ".join(kinds) or "no validator"


def _remember(listed: dict[str, str], url: str, error: str) -> None:
    """Note ``url``'s error for stats, forgetting the oldest beyond ``MAX_LISTED``."""
    listed[url] = error
    while len(listed) > MAX_LISTED:
        listed.pop(next(iter(listed)))
