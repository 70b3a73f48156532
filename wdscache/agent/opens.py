"""The agent's opens: a reader asks for a shard, waits for it, holds it pinned, lets it go.

This part answers ``open``, ``status`` and ``release``, keeps who waits for
which shard and what each reader holds (in the shard's record,
:mod:`wdscache.agent.shards`), checks a shard cached by an earlier run against
its source before serving it (revalidation), and handles damage: a copy a read
found damaged is downloaded once more, and the shard fails (saying why) if that
new copy is damaged too. It is a policy over the records: its ops return their
replies, and a request it holds (a waiter) is answered later through
:meth:`Opens.take_answers`; the core sends both.

Guarantees:

- Main loop only. No socket here.
- A reader is answered with a path only for a shard that is cached and, when it
  was cached by an earlier run and ``--revalidate`` is on, found current; a file
  deleted behind the agent's back is downloaded again, never served missing.
- Current means: of the source's size and validator (the strongest both have); or, for a
  copy of no validator in common with its source (one adopted into a rebuilt index), of
  the source's size and of the MD5 its shard index gives or the source's ETag is, its bytes
  hashed once (:mod:`wdscache.agent.downloads`). A size, or a source's validator, alone never is.
- Every pin a reader holds is one pin in the cache (:meth:`Opens.release_all`
  gives them all back when it goes), so nothing a reader holds is evicted.
- A shard still downloading is pinned for a reader (``while_downloading``) only once its
  download holds its whole budget: a reader that held pins while it waited for a
  download that waits for budget could deadlock the cache.
- A damaged copy is replaced only when no reader holds it; readers that ask for
  it meanwhile wait for the new one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from ..shared.config import AgentConfig
from ..shared.index import ShardRecord, ShardState
from ..shared.layout import is_file
from ..shared.logs import event, get_logger
from ..shared.protocol import field as get_field
from ..shared.protocol import strings
from ..shared.redact import redact_urls
from ..shared.shard_index import ShardInfo
from .cache import ShardCache
from .control import Answer, Reply, Request
from .downloads import Downloads
from .readers import Readers, dropped_reply
from .shard_download import Fetched, Gone, Unknown
from .shards import Phase, Shard, Shards, Waiter
from .validators import common_validator, etag_md5, validator_kind

log = get_logger(__name__)

FAILED_RETRY_AFTER = 60.0  # a failed shard asked for again after this long is retried
MAX_LISTED = 100  # corrupt or changed shards remembered for stats
EXPIRED: Reply = {"ok": False, "error": "reader expired while waiting"}  # a plain client's held open, once it is gone


class Opens:
    """Opens, pins, waiters, revalidation, damage and refetch, over the shards' records."""

    def __init__(
        self, config: AgentConfig, cache: ShardCache, shards: Shards, readers: Readers, downloads: Downloads
    ) -> None:
        self._config, self._cache = config, cache
        self._readers, self._downloads = readers, downloads
        self.shards = shards  # shared with the downloads, which keep each one in flight in its record
        # With --revalidate, the cached shards known current (downloaded or checked this run):
        # one fact about idle cached shards, so kept beside the records, not in them.
        self._verified: set[str] = set()
        self._answers: list[Answer] = []  # replies to held requests, for the core to send
        self._corrupt: dict[str, str] = {}  # url -> why it could not be read (for stats)
        self._changed: dict[str, str] = {}  # url -> how it changed on the server (for stats)

    def take_answers(self) -> list[Answer]:
        """The replies to requests held earlier (waiters) that became answerable since the last call."""
        out, self._answers = self._answers, []
        return out

    # -- ops --------------------------------------------------------------------

    def op_open(self, request: Request) -> Reply | None:
        """The reply, or None: the request waits for its shard (its answer comes through :meth:`take_answers`)."""
        header = request.header
        url, name = get_field(header, "url", str), header["reader"]
        ahead = get_field(header, "ahead", list, None)
        wait = get_field(header, "wait", bool, True)
        while_downloading = get_field(header, "while_downloading", bool, False)
        # Pins the reader let go of since its last request ride on its next open: they go first.
        for gone in strings(header, "release") if "release" in header else ():
            self.release(name, gone)
        reply = self.open(request, name, url, ahead, wait, while_downloading)
        if "also" in header and reply is not None and reply.get("ok") and not reply.get("while_downloading"):
            also = strings(header, "also")
            reply["also"] = pinned = [self.pin_if_cached(name, u) for u in also]
            # Each one's count, as "samples" for the shard opened: the reader checks its plan by it.
            reply["also_samples"] = [self._readers.samples(u) if p else None for u, p in zip(also, pinned)]
        return reply

    def op_status(self, request: Request) -> Reply:
        return {
            "ok": True,
            **shard_status(self._cache, self.shards, self._downloads, get_field(request.header, "url", str)),
        }

    def op_release(self, request: Request) -> Reply:
        for url in strings(request.header, "urls"):
            self.release(request.header["reader"], url)
        return {"ok": True}

    def op_corrupt_copy(self, request: Request) -> None:
        """From one of our workers (checked before), naming the copy it read; no reply."""
        header = request.header
        url, error = get_field(header, "url", str), get_field(header, "error", str)
        self._found_corrupt(url, error, get_field(header, "identity", list), "a worker")

    def op_counted(self, request: Request) -> None:
        """From one of our workers (checked before): the count it found in the copy it read; no reply."""
        header, cache = request.header, self._cache
        url, samples = get_field(header, "url", str), get_field(header, "samples", int)
        rec, identity = cache.index.get(url), get_field(header, "identity", list)
        # Only of a copy cached here, the one the worker read (a new download may have replaced it since).
        if samples < 0 or rec is None or not is_file(cache.path(url), identity):
            return
        if rec.state is ShardState.CACHED:
            cache.index.set_count(url, samples, rec.size, rec.etag)
            self.read_fine(url)
        elif url in self._downloads and cache.path(url).exists():
            # Published a moment ago (a worker saw the file): its Downloaded event, still queued, records it.
            self._downloads.counted_early(url, samples)

    def op_corrupt(self, request: Request) -> Reply:
        url, error = get_field(request.header, "url", str), get_field(request.header, "error", str)
        self._found_corrupt(url, error, None, "a consumer")
        return {"ok": True}

    def revalidate_ahead(self, planned: list[str]) -> None:
        """With ``--revalidate``, ask the sources of the shards an earlier run cached that
        readers' windows hold next (``planned``, most urgent first; the start-up window
        while nobody reads) whether they are current, in download slots left free, so that
        a first open of one does not wait for its source's answer. A shard asked about
        is pinned until the answer comes, as when an open asks."""
        if not self._config.revalidate:
            return
        room = self._config.download_workers - self.shards.downloads()
        cache = self._cache
        for url in planned:
            if room <= 0:
                return
            if url in self._verified or not cache.is_cached(url):
                continue
            shard = self.shards.record(url)
            try:
                if shard.phase is Phase.IDLE and self.shards.slot(url) is None:
                    self.shards.move(shard, Phase.REVALIDATING)
                    self._downloads.revalidate(url)
                    room -= 1
            finally:
                self.shards.settle(shard)

    # -- opening ------------------------------------------------------------------

    def open(
        self,
        request: Request,
        name: str,
        url: str,
        ahead: list[Any] | None = None,
        wait: bool = True,
        while_downloading: bool = False,
    ) -> Reply | None:
        """Pin ``url`` for reader ``name`` once it is cached (``wait``: None now, the answer later),
        or answer that it is not.

        With ``while_downloading``, a shard not cached yet is pinned as soon as its download
        holds its whole budget (the reply says ``while_downloading``): the reader then reads
        its complete samples from the workers while it downloads, and the pin holds
        the shard once it is published. Not before (see the module's guarantees):
        until then the answer is "not cached" (or, with ``wait``, comes later).
        """
        if not self._readers.known(url, name):
            return {"ok": False, "error": f"{url} is not in the agent's URL list ({self._config.urls})"}
        self._readers.opened(name, url, ahead)
        shard = self.shards.record(url)
        try:
            return self._open(shard, request, name, wait, while_downloading)
        finally:
            self.shards.settle(shard)

    def _open(self, shard: Shard, request: Request, name: str, wait: bool, while_downloading: bool) -> Reply | None:
        cache, url = self._cache, shard.url
        rec = cache.index.get(url)
        if rec is not None and rec.state is ShardState.CACHED and not cache.path(url).exists():
            # Deleted behind our back: forget it and download it again, never serve a missing file.
            log.warning("cache file of %s vanished; downloading it again", url)
            cache.remove(url, "its cache file vanished")
            rec = None
        elif rec is not None and shard.phase is Phase.SUSPECT:
            # A read found it damaged: it is fetched once more (a bad copy is repaired; a bad source
            # is failed once its new copy is found damaged too, see _damaged), now if nobody
            # holds it, else once they let go; meanwhile it is not cached for this reader.
            self._refetch_if_corrupt(shard)
            rec = None
        if rec is not None and rec.state is ShardState.CACHED and shard.phase in (Phase.IDLE, Phase.REVALIDATING):
            unlike = self._outdated(url, rec, name)
            if unlike is not None:
                # As a damaged copy: downloaded again once no reader holds it (readers of the list
                # it was made for may), its count dropped then.
                log.error("%s %s; downloading it again once no reader holds it", url, unlike)
                _remember(self._changed, url, unlike)
                cache.index.incr("changed")
                self.shards.move(shard, Phase.SUSPECT)
                shard.outdated = unlike
                self._refetch_if_corrupt(shard)
                rec = None
        if rec is not None and rec.state is ShardState.CACHED:
            cache.index.incr("hits")
            if url in self._verified or not self._config.revalidate:
                return self._grant(name, shard)
            # Cached by an earlier run: check it is still what the source holds first.
            if shard.phase is Phase.IDLE:
                self.shards.move(shard, Phase.REVALIDATING)
            self._downloads.revalidate(url)
            if wait:
                shard.waiters.append(Waiter(request, name))
                return None
            return {"ok": False, "cached": False, "error": "revalidating"}
        cache.index.incr("misses")
        if rec is not None and rec.state is ShardState.FAILED:
            if shard.phase is Phase.FAILED and time.monotonic() - shard.failed_at < FAILED_RETRY_AFTER:
                return {"ok": False, "error": rec.error or "download failed", "corrupt": shard.corrupt}
            cache.forget_failure(url)
            shard.corrupt = False
            shard.refetched = False  # a new try from the start: one more download if damaged again
        self._demand(shard, name)
        self._downloads.demand(url)
        if while_downloading and self._downloads.readable_while_downloading(url):
            return self._grant(name, shard, while_downloading=True)
        if wait:
            shard.waiters.append(Waiter(request, name, while_downloading))
            return None
        return {"ok": False, "cached": False, "error": "not cached yet"}

    def pin_if_cached(self, name: str, url: str) -> bool:
        """Pin ``url`` for reader ``name`` if it can be served now as an open would serve it
        (cached, its file there, current, not found damaged); never waits, never asks for a
        download. True if pinned."""
        cache = self._cache
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED or not self._readers.known(url, name):
            return False
        if self._config.revalidate and url not in self._verified:
            return False
        if self._outdated(url, rec, name) is not None:
            return False  # the open of it has it downloaded again
        shard = self.shards.record(url)
        try:
            if shard.phase is Phase.SUSPECT or not cache.path(url).exists():
                return False  # the open of it says why, and what becomes of it
            cache.index.incr("hits")
            return bool(self._grant(name, shard).get("ok"))
        finally:
            self.shards.settle(shard)

    def _demand(self, shard: Shard, reader: str | None = None) -> None:
        """Readers (``reader``, or its waiters) need ``shard`` downloaded (a damaged copy still held
        stays SUSPECT until let go)."""
        if shard.asked_at is None:
            shard.asked_at = time.monotonic()
        if reader is not None:  # (a waiter is known by its Waiter)
            shard.asked_by.add(reader)
        if shard.phase in (Phase.IDLE, Phase.REVALIDATING, Phase.FAILED):
            self.shards.move(shard, Phase.WANTED)

    def _grant(self, name: str, shard: Shard, *, while_downloading: bool = False) -> Reply:
        if name not in self._readers:
            return EXPIRED
        url = shard.url
        self.shards.pin(shard, name)
        self._cache.pin(url, read=True)  # a shard still downloading stays pinned once published
        if while_downloading:
            return {"ok": True, "while_downloading": True}
        rec = self._cache.index.get(url)
        assert rec is not None  # cached: the open above found it so
        return {"ok": True, "path": str(self._cache.path(url)), "size": rec.size, "samples": self._readers.samples(url)}

    def answer_while_downloading(self, url: str) -> None:
        """The download of ``url`` got its whole budget: readers waiting to read it as it downloads may start."""
        shard = self.shards.get(url)
        if shard is None:
            return
        for w in [w for w in shard.waiters if w.while_downloading]:
            self._answers.append(Answer(w.request, self._grant(w.reader, shard, while_downloading=True)))
        shard.waiters = [w for w in shard.waiters if not w.while_downloading]
        self.shards.settle(shard)

    def _answer_waiters(self, shard: Shard, error: str | None = None) -> None:
        """Its waiters get it (``error``: are told why not); nobody waits for it any more."""
        shard.asked_at = None
        shard.asked_by.clear()
        waiting, shard.waiters = shard.waiters, []
        for w in waiting:
            body = (
                self._grant(w.reader, shard)
                if error is None
                else {"ok": False, "error": error, "corrupt": shard.corrupt}
            )
            self._answers.append(Answer(w.request, body))

    def demanded(self) -> list[str]:
        """The shards readers wait for, oldest first."""
        return self.shards.demanded()

    # -- holding ------------------------------------------------------------------

    def held(self, name: str) -> int:
        """How many shards reader ``name`` holds open."""
        return self.shards.holds(name)

    def held_by_any(self, url: str) -> bool:
        """Whether a reader holds ``url`` open or waits for it."""
        shard = self.shards.get(url)
        return shard is not None and bool(shard.pins or shard.waiters)

    def release(self, name: str, url: str) -> None:
        shard = self.shards.get(url)
        if shard is None or not self.shards.unpin(shard, name):
            return
        self._cache.unpin(url, read=True)
        self._refetch_if_corrupt(shard)
        self.shards.settle(shard)

    def release_all(self, name: str) -> None:
        """Reader ``name`` is gone: everything it held is let go, and the opens it waits on are
        answered now: ``need_hello`` to a reader that said hello (dropped as silent, it says hello
        again and opens once more), else that it expired."""
        for shard in self.shards.held_by(name):
            while self.shards.unpin(shard, name):
                self._cache.unpin(shard.url, read=True)
            self._refetch_if_corrupt(shard)
            self.shards.settle(shard)
        for shard in [s for s in self.shards if any(w.reader == name for w in s.waiters)]:
            for w in [w for w in shard.waiters if w.reader == name]:
                said_hello = w.request.header.get("said_hello") is True
                self._answers.append(Answer(w.request, dropped_reply(name) if said_hello else EXPIRED))
            shard.waiters = [w for w in shard.waiters if w.reader != name]
            self.shards.settle(shard)

    # -- what the downloads found -----------------------------------------------------

    def downloaded(self, url: str) -> None:
        """``url`` was downloaded: it is current; its waiters get it."""
        if self._config.revalidate:
            self._verified.add(url)
        shard = self.shards.get(url)
        if shard is None:
            return
        if shard.phase is not Phase.IDLE:
            self.shards.move(shard, Phase.IDLE)
        shard.corrupt = False
        self._answer_waiters(shard)
        self.shards.settle(shard)

    def failed(self, url: str, reason: str, *, corrupt: bool = False) -> None:
        """The download of ``url`` failed for good, or (``corrupt``) its bytes are a bad shard:
        its waiters are told why (a FetchError's reason, redacted), and which."""
        shard = self.shards.record(url)
        if shard.phase is not Phase.FAILED:
            self.shards.move(shard, Phase.FAILED)
        shard.failed_at = time.monotonic()
        shard.corrupt = corrupt
        self._answer_waiters(shard, error=reason)

    def unlisted(self, url: str) -> None:
        """``url`` left the agent's list and no reader's list holds it: nobody waits for it any more."""
        shard = self.shards.get(url)
        if shard is None or shard.asked_at is None:
            return
        if shard.phase is Phase.WANTED:
            self.shards.move(shard, Phase.IDLE)
        self._answer_waiters(shard, error="removed from the agent's URL list")
        self.shards.settle(shard)

    def revalidated(self, url: str, now: Fetched | Gone | Unknown, md5: str | None = None) -> None:
        """A cached shard from an earlier run was compared with its source (``now``: what it holds;
        ``md5``: the copy's MD5, when it was hashed for want of a validator in common)."""
        cache = self._cache
        cache.unpin(url, read=False)
        shard = self.shards.record(url)
        try:
            self._revalidated(shard, now, md5)
        finally:
            self.shards.settle(shard)

    def _revalidated(self, shard: Shard, now: Fetched | Gone | Unknown, md5: str | None) -> None:
        cache, url = self._cache, shard.url
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            self._demand(shard)  # gone meanwhile: its waiters need it
            return
        size, counted, info = rec.source_size or rec.size, cache.index.counts.get(url), self._readers.shard_info(url)
        if md5 is not None and isinstance(now, Fetched):
            rec = _hashed(cache, rec, md5, info, now)
        changed = unlike_index(info, size, counted, rec.md5) or _unlike_source(url, rec, now)
        unknown = None if changed else _not_comparable(rec, now, info)
        if changed is None and unknown is None:
            if self._config.revalidate:
                self._verified.add(url)
            if shard.phase is Phase.REVALIDATING:
                self.shards.move(shard, Phase.IDLE)
            self._answer_waiters(shard)
            return
        _evict_unproven(cache, self._changed, url, changed, unknown)
        self._demand(shard)  # its waiters get the new copy

    def _outdated(self, url: str, rec: ShardRecord, name: str) -> str | None:
        """How ``url``'s copy (``rec``) differs from what the agent's own shard index (its list
        file, written anew since the copy was made) says of it, when reader ``name`` reads that
        version; None: it does not. A reader whose own index differs (older, or wrong) changes
        nothing for the others: it is served, and its own check fails it."""
        listed = self._readers.list_info(url)
        if listed is None or self._readers.shard_info(url, name) != listed:
            return None
        return unlike_index(listed, rec.source_size or rec.size, self._cache.index.counts.get(url), rec.md5)

    # -- damage -----------------------------------------------------------------------

    def read_fine(self, url: str) -> None:
        """A worker read ``url``'s headers through: later damage gets one more download again."""
        shard = self.shards.get(url)
        if shard is not None:
            shard.refetched = False
            self.shards.settle(shard)

    def _found_corrupt(self, url: str, error: str, identity: list[Any] | None, who: str) -> None:
        """A read found ``url``'s cached copy damaged: it is downloaded once more when no reader
        holds it, and failed (with the reason) if that new copy is damaged too.

        ``identity`` names the file a worker read; a consumer cannot say which copy it read
        (None), so its report only ever asks for the one new download. A report about a copy
        replaced since changes nothing.
        """
        error = redact_urls(error)  # a peer's text, before it is cut (a cut may drop a URL's scheme)
        cache = self._cache
        rec = cache.index.get(url)
        if rec is None or rec.state is not ShardState.CACHED:
            return
        if identity is not None and not is_file(cache.path(url), identity):
            return
        shard = self.shards.record(url)
        try:
            if identity is None and shard.refetched:
                return
            if shard.phase not in (Phase.IDLE, Phase.REVALIDATING):
                return  # this copy was reported already (SUSPECT), or is being replaced
            event(
                log,
                "corrupt",
                "corrupt copy reported by %s: %s: %s",
                who,
                url,
                error[:500],
                level=logging.ERROR,
                url=url,
                error=error[:500],
                by=who,
            )
            cache.index.incr("corrupt")
            _remember(self._corrupt, url, error[:500])
            if not shard.refetched:
                self.shards.move(shard, Phase.SUSPECT)
                return
            reason = f"damaged again after it was downloaded once more: {error[:400]}"
            event(log, "failed", "failed %s: %s", url, reason, level=logging.ERROR, url=url, error=reason)
            cache.fail_cached(url, reason)
            self.failed(url, reason, corrupt=True)
        finally:
            self.shards.settle(shard)

    def _refetch_if_corrupt(self, shard: Shard) -> None:
        """A damaged copy nobody holds any more is dropped, and downloaded once more for the
        readers waiting for it (see :meth:`_damaged`)."""
        url = shard.url
        if shard.phase is not Phase.SUSPECT or self._cache.pins.get(url):
            return
        outdated = shard.outdated
        log.warning("downloading %s again: %s", url, outdated or self._corrupt.get(url, "found damaged"))
        self.shards.move(shard, Phase.WANTED)
        shard.refetched = True
        if shard.asked_at is None:
            shard.asked_at = time.monotonic()
        # A damaged copy's sample count stays: it was found in a copy of this very version, and
        # the ranks of a job that ask for it meanwhile must all get the same answer. An outdated
        # copy's goes: its index's count holds until the new version is counted.
        self._cache.remove(url, "found damaged, to be downloaded once more" if outdated is None else f"it {outdated}")
        if outdated is not None:
            self._cache.index.drop_count(url)

    def view(self) -> dict[str, Any]:
        """The damaged and changed shards, for the stats reply."""
        return {
            "corrupt": [{"url": u, "error": e} for u, e in self._corrupt.items()],
            "changed": [{"url": u, "error": e} for u, e in self._changed.items()],
        }


def shard_status(cache: ShardCache, shards: Shards, downloads: Downloads, url: str) -> dict[str, Any]:
    """Where ``url`` stands: cached; downloading (with its budget); queued (for a download
    slot or budget); failed (with the error); or unknown (nobody asked for it)."""
    rec = cache.index.get(url)
    shard = shards.get(url)
    if shard is not None and shard.phase is Phase.SUSPECT:
        return {
            "state": "queued",
            "reason": "its cached copy is damaged: it is downloaded again once the readers that hold it let go",
        }
    if rec is not None and rec.state is ShardState.CACHED:
        return {"state": "cached"}
    progress = downloads.progress(url)
    waits = downloads.space_wait(url)
    if waits is not None:  # before "downloading": a read while downloading that waits for space should say why
        return {"state": "queued", "reason": waits, **progress}
    if downloads.readable_while_downloading(url):
        return {"state": "downloading", **progress}
    if rec is not None and rec.state is ShardState.FAILED:
        # "corrupt": the shard is bad (its copies found corrupt, or unlike its index), not its download.
        corrupt = shard is not None and shard.corrupt
        return {"state": "failed", "error": rec.error or "download failed", "corrupt": corrupt}
    asked = shard is not None and shard.asked_at is not None
    return {"state": "queued" if url in downloads or asked else "unknown", **progress}


def unlike_index(info: ShardInfo | None, size: int, counted: int | None, md5: str | None = None) -> str | None:
    """How a cached copy of ``size`` bytes holding ``counted`` samples (None: not counted) and of
    MD5 ``md5`` (None: not known) differs from what a shard index says of it, ``info`` (None: it
    does not, or there is no index): it is downloaded again then, and that download is checked."""
    if info is None:
        return None
    if info.filesize is not None and size != info.filesize:
        return f"is {size} bytes in the cache, but the shard index says {info.filesize}"
    if counted is not None and info.nsamples is not None and counted != info.nsamples:
        return f"holds {counted} samples in the cache, but the shard index says {info.nsamples}"
    if md5 is not None and info.md5 is not None and md5 != info.md5:
        return f"has MD5 {md5} in the cache, but the shard index says {info.md5}"
    return None


def _unlike_source(url: str, rec: ShardRecord, now: Fetched | Gone | Unknown) -> str | None:
    """How the source of a cached copy changed since (None: it did not, or cannot be asked)."""
    if isinstance(now, Gone):
        return f"is gone from its source ({now.reason})"
    if isinstance(now, Unknown):
        log.info("could not revalidate %s (%s); serving the cached copy", url, now.reason)
        return None
    if now.size != (rec.source_size or rec.size):
        return f"size changed on the server ({rec.source_size or rec.size} -> {now.size} bytes)"
    common = common_validator(rec.etag, rec.last_modified, now.etag, now.last_modified)
    if common is not None and common[1] != common[2]:
        return f"changed on the server ({common[0]} {common[1]} -> {common[2]})"
    return None


def _evict_unproven(
    cache: ShardCache, changes: dict[str, str], url: str, changed: str | None, unknown: str | None
) -> None:
    """Evict the cached copy of ``url`` that revalidation found ``changed`` (how; remembered in
    ``changes`` and counted) or could not tell current (``unknown``: why), to be downloaded again."""
    if changed is not None:
        log.error("%s %s; downloading it again", url, changed)
        _remember(changes, url, changed)
        cache.index.incr("changed")
        cache.remove(url, f"evicted: it {changed}")
    else:
        log.warning("cannot tell whether %s changed on the server: %s; downloading it again", url, unknown)
        cache.remove(url, f"evicted: cannot tell whether it changed on the server ({unknown})")
    cache.index.drop_count(url)


def _hashed(cache: ShardCache, rec: ShardRecord, md5: str, info: ShardInfo | None, now: Fetched) -> ShardRecord:
    """The record of the cached copy ``rec`` once its bytes were found of MD5 ``md5``, the source
    (``now``) of its size: proved its shard (:func:`_proof`), it is kept with its MD5 (later runs
    hash nothing while the index gives it), stored; else, unlike its index's MD5, it carries its
    own for :func:`unlike_index` to tell."""
    proof = _proof(md5, info, now)
    if proof is None:
        return dataclasses.replace(rec, md5=md5) if info is not None and info.md5 is not None else rec
    log.info("%s: the cached copy has the MD5 %s; kept without downloading it", rec.url, proof)
    rec = dataclasses.replace(rec, md5=md5)
    # The source's validators join it only when they name these bytes (its ETag is their MD5): an
    # index's MD5 proves the copy its shard, not the source's object now, which may be another (a
    # stale index); tied to it, the copy would stay served once the index no longer gives the MD5.
    if etag_md5(now.etag) == md5:
        rec = dataclasses.replace(rec, etag=now.etag, last_modified=now.last_modified)
    cache.put(rec)
    return rec


def _proof(md5: str, info: ShardInfo | None, now: Fetched) -> str | None:
    """What a cached copy of MD5 ``md5`` is proved by (None: nothing): the shard index ``info``
    giving that MD5, or the source's ETag being it (an S3 object uploaded whole: the copy is that
    very object). Its size was found the source's before it was hashed."""
    if info is not None and info.md5 is not None:
        return "its shard index gives" if md5 == info.md5 else None
    return "its source's ETag names" if md5 == etag_md5(now.etag) else None


def _not_comparable(rec: ShardRecord, now: Fetched | Gone | Unknown, info: ShardInfo | None) -> str | None:
    """Why a cached copy cannot be told current although its source answered (None: it can,
    or the source could not be asked): the copy and the source have no validator in common,
    and the copy is not known to have the MD5 its shard index (``info``) gives, so it is
    downloaded again rather than served unchecked. (The source's size was compared before.)"""
    if not isinstance(now, Fetched) or common_validator(rec.etag, rec.last_modified, now.etag, now.last_modified):
        return None
    if rec.md5 is not None and info is not None and info.md5 == rec.md5:
        return None
    return (
        f"its copy was cached with {_kinds(rec.etag, rec.last_modified)}, the server now sends "
        f"{_kinds(now.etag, now.last_modified)}: no validator in common"
    )


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
