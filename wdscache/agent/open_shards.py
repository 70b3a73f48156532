"""The shards a sample worker holds: what it has open, and what it knows of each one's samples.

A worker reads a URL's cache file in one of three ways:

- A **view** of a published shard (:class:`~wdscache.agent.shardview.ShardView`), kept for
  the :data:`OPEN_SHARDS` latest. The sample tables it walked stay in the worker's index
  after the view closes (:class:`~wdscache.agent.sampletable.SampleTables`), so each epoch
  does not walk every tar header again.
- A **download under way**, read from its partial file
  (:class:`~wdscache.agent.growing.GrowingShard`): only its complete samples, never past the
  bytes written.
- A **walk** of a shard not yet in the index, a :data:`~wdscache.agent.growing.WALK_STEP`
  of samples at a time: the agent names such shards (its hints: each shard it publishes, and
  each cached shard as readers come to want it), and the worker walks them while no request
  waits. A read of one takes the walk over, so a first read waits for a step of a walk, never
  for a whole walk of another shard. At most :data:`WALKS` walks are under way (each holds its
  file open); a read of another such shard walks it whole as it opens it.

Guarantees:

- A view, download or walk is used only while its file is the one it opened (same identity):
  a replaced, published or evicted file is let go at the next sweep, within
  :data:`SWEEP_EVERY` (its mapping once ZeroMQ has sent the frames still queued from it),
  so no deleted shard's disk space stays held past what consumers have yet to take, and
  no sample of one version is served from another's bytes.
- A table walked here is reported to the agent, which passes it on to the other workers and
  keeps it on disk (:mod:`wdscache.agent.table_files`); a table passed on,
  or read from the table file the agent kept, is taken only if it is of the file this worker
  sees (same identity, every payload inside it, a table file's digest matching its bytes),
  and then not walked here. A worker reading a shard before that table comes walks it too,
  as far as its reads need.
- A published shard found damaged (by a read, a view or a walk) is reported with the identity
  of the copy read (``corrupt_copy``); the agent downloads it once more or fails it.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..shared.errors import ShardError
from ..shared.layout import CacheLayout, file_identity
from ..shared.logs import get_logger
from ..shared.messages import Reports
from .growing import GrowingShard
from .sampletable import PackedSamples, SampleTables, read_table_file
from .shardview import open_shard

log = get_logger(__name__)

__all__ = ["INDEX_AHEAD", "OPEN_SHARDS", "SWEEP_EVERY", "WALKS", "OpenShards"]

OPEN_SHARDS = 8  # shard views a worker keeps open: mapped pages count in its RSS until dropped
# Samples whose place a worker remembers after their shard's view is closed (about 100 bytes
# each): each epoch would otherwise walk every tar header again, half a worker's time on
# warm 110 KB samples.
INDEX_SAMPLES = 250_000
INDEX_AHEAD = 64  # shards hinted that a worker may have still to walk ahead of their reads
# Published shards a worker walks a step at a time at once, each with its file open: past
# these, a read of a shard whose samples are not known opens it whole (its walk done at once).
WALKS = OPEN_SHARDS
SWEEP_EVERY = 0.05  # seconds between looks for evicted files a worker still holds open
# A walked table larger than this is not passed on (the agent takes messages up to 1 MiB):
# about 7,000 samples of three fields; each worker walks a bigger shard itself.
SHARE_MAX = 768 << 10

Send = Callable[[Mapping[str, Any], Sequence[bytes]], None]
"""Sends a report (and its frames) to the agent; never blocks."""


class OpenShards:
    """Worker ``worker``'s shards of the cache at ``layout``; reports go out through ``send``,
    views let go through ``dropped`` (whose pages queued frames may still point into)."""

    def __init__(
        self, layout: CacheLayout, reports: Reports, send: Send, dropped: Callable[[Any], None], worker: int
    ) -> None:
        self.layout, self.reports, self.send, self.dropped, self.worker = layout, reports, send, dropped, worker
        self.views: OrderedDict[str, tuple[tuple[int, ...], Any]] = OrderedDict()
        self.index = SampleTables(INDEX_SAMPLES)
        self.growing: OrderedDict[str, GrowingShard] = OrderedDict()  # downloads being read
        # Downloads let go of past OPEN_SHARDS, closed at the next sweep: the read that let go
        # of one (it names more downloads than that) may still be serving it.
        self.let_go: list[GrowingShard] = []
        # Shards the agent told us of (just published, or cached and wanted next): walked while
        # no request waits, so that the first read of one does not wait for a walk of its headers.
        self.to_index: deque[str] = deque(maxlen=INDEX_AHEAD)
        # The one being walked, a step at a time between requests: a read of it takes the walk over.
        self.walking: dict[str, GrowingShard] = {}
        # Shards walked here; tables taken from another worker; tables read from table files.
        self.walked = self.adopted = self.loaded = 0

    def held(self) -> bool:
        """Whether files are held open (to be swept for evicted ones on time)."""
        return bool(self.views or self.growing or self.let_go)

    def sweep(self) -> None:
        """Let go of files evicted or replaced: an open descriptor or mapping would keep a
        deleted shard's disk space in use, and the agent counts on getting it back."""
        for growing in self.let_go:
            growing.close()
        self.let_go.clear()
        for url, growing in list(self.growing.items()):
            if not growing.current():  # published or abandoned: give its descriptor back
                self.growing.pop(url).close()
        for url, walker in list(self.walking.items()):
            # Evicted or replaced while walked ahead, or no longer to be walked ahead (pushed out
            # of to_index): a later read opens it whole, or walks it afresh.
            if not walker.current() or url not in self.to_index:
                self.walking.pop(url).close()
        for url, (identity, _) in list(self.views.items()):
            try:
                gone = file_identity(os.stat(self.layout.shard_path(url))) != identity
            except OSError:
                gone = True
            if gone:
                self.index.discard(url)
                # Dropped, not closed: frames still queued in ZeroMQ may point into its mapping,
                # which goes once they are sent.
                self.dropped(self.views.pop(url)[1])

    def adopt(self, url: str, header: dict[str, Any], frames: list[bytes]) -> None:
        """Take the table another worker walked, if it is of the file we see now."""
        try:
            identity = file_identity(os.stat(self.layout.shard_path(url)))
            if header.get("identity") != list(identity) or self.index.get(url, identity) is not None:
                return  # replaced or gone since, or walked here too
            samples = PackedSamples.from_parts(header.get("layouts"), frames, identity[2])
        except OSError:
            return  # evicted meanwhile
        except ValueError as exc:  # a bug of ours: the walk is done here when first needed
            log.warning("worker %d: a table passed on for %s was not taken: %s", self.worker, url, exc)
            return
        self.index.put(url, identity, samples)
        self.adopted += 1
        if url in self.walking:
            self.walking.pop(url).close()
        if url in self.to_index:
            self.to_index.remove(url)

    def _open(self, path: Path, url: str, growing: GrowingShard | None) -> Any:
        """Open the shard at ``path``; a table walked here (not in the index before) is
        reported, for the agent to pass on to the other workers."""
        identity = file_identity(os.stat(path))
        # A table file is looked for once, before a walk or a download view is made.
        known = self.index.get(url, identity) is not None if growing is not None else self._known(url, identity)
        try:
            view = open_shard(path, url=url, growing=growing, tables=self.index)
        except ShardError as exc:
            # A published file is whole and was checked, so it was damaged on disk (or its
            # source is bad): the agent fetches it once more, or fails it. The identity says
            # which copy we read, so a report about a copy replaced since changes nothing.
            self.send(self.reports.corrupt_copy(url, list(identity), str(exc)), ())
            raise
        samples = None if known else self.index.get(url, identity)
        if isinstance(samples, PackedSamples):
            self.walked += 1
            layouts, frames = samples.parts()
            header = self.reports.walked(url, list(identity), layouts)
            if sum(map(len, frames)) + len(json.dumps(header)) <= SHARE_MAX:
                self.send(header, frames)  # if it does not go, the others walk it themselves
        return view

    def index_ahead(self) -> None:
        """Walk the next shard the agent told us of (just published, or cached and wanted
        next), so that its samples are known before it is read (only the rest, if a view
        of its download walked the start; none of it, if its table is held already or read
        from its table file).
        Only the index keeps it: the views open for reads stay as they are.

        A shard is walked :data:`~wdscache.agent.growing.WALK_STEP` samples a call, the
        requests that came meanwhile served between calls: a read never waits for a whole
        walk of a shard it does not read (a read of this one takes the walk over)."""
        url = self.to_index[0]
        if url in self.views:
            self.to_index.popleft()
            return  # open already
        walker = self.walking.get(url)
        growing = None
        try:
            if walker is None:
                growing = self.growing.pop(url, None)
                if growing is None:
                    path = self.layout.shard_path(url)
                    if self._known(url, file_identity(os.stat(path))):
                        self.to_index.popleft()
                        return  # its table is here: walked before, passed on, or read from its file
                    walker = self.walking[url] = GrowingShard(path, url=url, published=True)
            if walker is not None:
                before = len(walker.samples)
                self.walk(url, walker, before)
                if len(walker.samples) > before:
                    return  # more next time
                # Walked to its end: the view takes the samples found over.
                growing = self.walking.pop(url)
            self.to_index.popleft()
            self._open(self.layout.shard_path(url), url, growing).close()
        except (OSError, ShardError):
            # Evicted meanwhile, or damaged: a read will say so to whoever asks.
            if self.to_index and self.to_index[0] == url:
                self.to_index.popleft()
            if url in self.walking:
                self.walking.pop(url).close()
        except Exception:  # speculative work must never take the worker down
            log.exception("worker %d: error indexing %s ahead", self.worker, url)
            if self.to_index and self.to_index[0] == url:
                self.to_index.popleft()
        finally:
            if growing is not None:
                growing.close()

    def view(self, url: str) -> Any:
        """The cached shard's view; FileNotFoundError while it is not (or no longer) cached."""
        path = self.layout.shard_path(url)
        identity = file_identity(os.stat(path))  # FileNotFoundError: evicted or never cached
        cached = self.views.get(url)
        if cached is not None and cached[0] == identity:
            self.views.move_to_end(url)
            return cached[1]
        growing, walker = self.growing.pop(url, None), self.walking.pop(url, None)
        try:
            # Neither what its download showed, nor what a walk ahead found, nor a shard
            # opened before is walked again.
            view = self._open(path, url, growing or walker)
        finally:
            for seen in (growing, walker):
                if seen is not None:
                    seen.close()  # its mapping stays while frames of it are queued
        # The identity of the file opened, not of the path a moment before: a reply names it.
        self.views[url] = (view.identity, view)
        while len(self.views) > OPEN_SHARDS:
            # Dropped, not closed: frames still queued in ZeroMQ may point into its mmap.
            self.views.popitem(last=False)
        return view

    def downloading(self, url: str, *, refresh: bool) -> GrowingShard:
        """The shard's download so far; FileNotFoundError when none is under way.

        A view whose file was replaced (a new download), published or removed is not
        used again: it could hold another version's bytes, and its descriptor would
        keep a deleted file's disk space.
        """
        view = self.growing.get(url)
        if view is not None and not view.current():
            self.growing.pop(url).close()
            view = None
        if view is None:
            view = self.growing[url] = GrowingShard(self.layout.partial_path(url), url=url)
            refresh = True
            while len(self.growing) > OPEN_SHARDS:
                self.let_go.append(self.growing.popitem(last=False)[1])
        self.growing.move_to_end(url)
        if refresh:
            view.refresh(len(view.samples))  # a step further: a look at the download answers soon
        return view

    def readable(self, url: str) -> Any:
        """The cached shard (the walk of it so far, if it was just published), or else its download so far."""
        try:
            walker = self.unwalked(url)
            return walker if walker is not None else self.view(url)
        except FileNotFoundError:
            return self.downloading(url, refresh=False)

    def walk(self, url: str, view: GrowingShard, needed: int) -> None:
        """``view.refresh(needed)``; a published shard found damaged is reported, as opening it does."""
        try:
            view.refresh(needed)
        except ShardError as exc:
            if self.walking.get(url) is view:
                self.walking.pop(url).close()
                try:
                    identity = file_identity(os.stat(self.layout.shard_path(url)))
                except OSError:
                    raise exc from None
                self.send(self.reports.corrupt_copy(url, list(identity), str(exc)), ())
            raise

    def unwalked(self, url: str) -> GrowingShard | None:
        """A published shard whose samples are not known here yet, read as its walk so far (a
        step past the sample asked for), the rest walked next while idle: its first read waits
        for a step of the walk, not the whole of it. None if its samples are known, or if a
        view of its download found them so far (opening it walks only the rest).
        FileNotFoundError if it is not published."""
        if url in self.views or url in self.growing:
            return None
        path = self.layout.shard_path(url)
        if self._known(url, file_identity(os.stat(path))):
            return None
        walker = self.walking.get(url)
        if walker is None:
            if len(self.walking) >= WALKS:
                return None  # opened whole instead: a read may name hundreds of such shards
            walker = self.walking[url] = GrowingShard(path, url=url, published=True)
        if not self.to_index or self.to_index[0] != url:
            if url in self.to_index:
                self.to_index.remove(url)
            self.to_index.appendleft(url)
        return walker

    def _known(self, url: str, identity: tuple[int, ...]) -> bool:
        """Whether the table of ``url``'s file of ``identity`` is in the index: held, or read
        now from the table file the agent kept (not looked for again while a walk of it runs)."""
        if self.index.get(url, identity) is not None:
            return True
        if url in self.walking:
            return False
        try:
            samples = read_table_file(self.layout.table_path(url), identity)
        except OSError:
            return False  # evicted meanwhile, or unreadable: walked
        except ValueError as exc:
            log.warning("worker %d: the sample table kept for %s was not used: %s", self.worker, url, exc)
            return False
        if samples is None or self.index.put(url, identity, samples) is None:
            return False
        self.loaded += 1
        return True

    def close(self) -> None:
        for walker in [*self.walking.values(), *self.growing.values(), *self.let_go]:
            walker.close()
        self.walking.clear()
        self.growing.clear()
        self.let_go.clear()
