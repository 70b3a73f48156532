"""A shard still being downloaded: the samples complete so far, read from its partial file.

Lets a worker serve a shard's first samples before its download ends.  The file
belongs to the download and changes under the reader: it grows, and it may be
replaced by a new file (the download started over) or renamed away (published).
So only complete samples are shown; a replaced file is followed, its samples
never mixed with the old one's; and its headers get the same checks as a
finished shard's (:mod:`wdscache.shared.tarwalk`).  The same class walks a
published shard a step at a time (``published``).  Payloads are served from a
mapping of the file (:meth:`GrowingShard.mapped`), never copied: the agent never
shortens a file in place (a download that starts over does so in a new file,
:func:`~wdscache.agent.shard_download.truncate`; a parted download's partial file
only ever grows, :mod:`wdscache.agent.parts`), so bytes below the size a mapping
was made at stay there.  A :class:`GrowingShard` is not locked: it belongs to one
thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from typing import Any

from ..shared.errors import ShardError
from ..shared.layout import file_identity
from ..shared.samples import SampleSpan, group_samples
from ..shared.tarwalk import BLOCK, GZIP_MAGIC, HEAD_BYTES, FileSpan, tar_problem, walk
from .shardview import FileMap, ShardView, map_file

# Samples a look walks past the one it needs: a download well under way is taken in a step
# at a time, so the first reads of it wait for a short walk, not for all its headers so far.
WALK_STEP = 256


class NotYet(Exception):
    """A growing shard does not hold the sample asked for (its file was cut short)."""


class GrowingShard:
    """The complete samples so far of a plain tar that is still being downloaded.

    A sample is complete once a member of the next sample has arrived, so the
    last one is known only from the finished file (read that with
    :func:`~wdscache.agent.shardview.open_shard`), or, for a walk of a file already
    published (``published``: it never grows, and cut short it is damaged), once
    the walk reaches its end.  Each :meth:`refresh` walks only the headers that
    arrived since the last complete sample.  Headers are read with ``pread``;
    payloads from :meth:`mapped`.  A gzip'd download shows no samples: it is read
    once decompressed and published.
    """

    def __init__(self, path: str | os.PathLike[str], *, url: str, published: bool = False) -> None:
        self.url, self.path, self.published = url, os.fspath(path), published
        self._fd = os.open(self.path, os.O_RDONLY)  # FileNotFoundError: no download under way
        self._map: ShardView | None = None  # the file's latest mapping, made by mapped()
        self._reset()

    def _reset(self) -> None:
        self.samples: list[SampleSpan] = []
        self._resume = 0  # header offset of the first sample not known complete
        self._from_start = False  # global PAX headers seen: walk from the start every time
        self._size = 0
        self._gzip: bool | None = None

    def current(self) -> bool:
        """True while the download's file is still the one we read (not replaced, published or gone)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def refresh(self, needed: int | None = None) -> None:
        """Take in what the download has written since the last call: with ``needed``, only
        until sample ``needed`` is known complete and :data:`WALK_STEP` more (or all that
        arrived, if fewer); without it, all.

        FileNotFoundError when the file is gone (published, or the download ended):
        the samples already found stay readable, but no more will come here.
        """
        if os.stat(self.path).st_ino != os.fstat(self._fd).st_ino:
            # A new download of the shard started in a new file: follow it.
            fd = os.open(self.path, os.O_RDONLY)
            os.close(self._fd)
            self._fd, self._map = fd, None
            self._reset()
        size = os.fstat(self._fd).st_size
        if size < self._size:  # cut short behind the agent: what we knew of it is gone
            self._map = None
            self._reset()
        self._size = size
        if self._gzip is None and size >= 2:
            self._gzip = os.pread(self._fd, 2, 0) == GZIP_MAGIC
        if self._gzip is not False:
            return
        start = 0 if self._from_start else self._resume
        if size - start < 2 * BLOCK:
            return
        pax: dict[str, Any] = {}
        # Samples up to needed + WALK_STEP, and one more group: the last one taken may not be complete.
        most = None if needed is None or self._from_start else max(needed - len(self.samples), 0) + WALK_STEP + 2
        try:
            # A published file is whole: cut short, it is damaged (a download's is only not there yet).
            members = walk_from(self._fd, start, size, self.url, prefix=not self.published, global_pax=pax)
            groups = list(islice(group_samples(members, self.url, base=start), most))
        except ShardError as exc:
            problem = tar_problem(os.pread(self._fd, HEAD_BYTES, 0)) if start == 0 and exc.offset == 0 else None
            if problem:  # say what came instead of a tar (an HTML page served with status 200, say)
                raise ShardError(self.url, problem, offset=0) from None
            raise
        # The last may not be complete, unless the walk took every member of a published file.
        ended = self.published and (most is None or len(groups) < most)
        complete = [span for span, _ in (groups if ended else groups[:-1])]
        if pax or self._from_start:
            # A global PAX header: where exactly it took effect is not tracked, so from now
            # on every look walks from the start (rare in WebDataset shards).
            self._from_start = True
            if start > 0:
                self.refresh()  # this walk began after it: its indices would be shifted
                return
            self.samples = complete
        elif groups:
            self.samples.extend(complete)
            self._resume = size if ended else groups[-1][1]

    def complete(self, fd: int, url: str) -> list[SampleSpan] | None:
        """All samples of the finished file open as ``fd``, if it is the file we have been
        reading (a published download keeps its inode): those found so far, plus a walk
        of the rest. None if it is another file, or if we kept no usable place to resume."""
        if self._gzip is not False or self._from_start or os.fstat(fd).st_ino != os.fstat(self._fd).st_ino:
            return None
        size = os.fstat(fd).st_size
        if self._resume >= size:  # a published file walked to its end
            return list(self.samples)
        members = walk_from(fd, self._resume, size, url)
        return self.samples + [span for span, _ in group_samples(members, url, base=self._resume)]

    def mapped(self, end: int) -> ShardView:
        """The file read, mapped read-only as long as it is now, and at least ``end`` bytes
        (the end of a sample :meth:`refresh` found complete): a sample's payloads lie at their
        offsets in it. One mapping while it holds what is asked, a new one past it (a download
        grows); a published file's is the whole file. NotYet if the file is shorter than
        ``end``: cut short behind the agent, which starts a download over in a new file. A
        file cut short in place while mapped would fault (SIGBUS) wherever its mapping is read."""
        if self._map is None or len(self._map.data) < end:
            try:
                mapped: FileMap | None = map_file(self._fd)
            except ValueError:  # an empty file cannot be mapped
                mapped = None
            if mapped is None or len(mapped.data) < end:
                if mapped is not None:
                    mapped.data.release()
                raise NotYet(f"{self.url}: {end} bytes are not in the file any more")
            self._map = ShardView(mapped, url=self.url, samples=(), identity=file_identity(os.fstat(self._fd)))
        return self._map

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        # Dropped, not closed: frames still queued in ZeroMQ may point into the mapping.
        self._map = None


def walk_from(fd: int, start: int, end: int, url: str, **options: Any) -> Iterator[tuple[str, int, int, int]]:
    """:func:`~wdscache.shared.tarwalk.walk` over bytes ``[start, end)`` of the file open as
    ``fd`` (headers read in blocks, payloads skipped), offsets counted from where that walk
    began: as ``group_samples(..., base=start)`` counts them, so must an error's offset."""
    try:
        yield from walk(FileSpan(fd, start, end), url, **options)
    except ShardError as exc:
        raise ShardError(url, exc.reason, offset=None if exc.offset is None else exc.offset + start) from None
