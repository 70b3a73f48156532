"""Direct reads: a consumer copies payloads from the agent's cache files itself.

A worker answering a read with ``direct`` names the long runs of a published shard
as byte ranges of its cache file (see :mod:`wdscache.pool`) instead of sending
them. :class:`CacheFiles` maps those files read-only in the consumer and hands
out views of the ranges, which the loader copies into ``bytes``: one copy per
payload byte, straight from the page cache.

Why no wrong byte can come out of it:

- a file under ``shards/`` is published whole, by rename, and never written again
  (:mod:`wdscache.cache`), so the bytes at an offset never change;
- the file mapped must have the identity the worker read (device, inode, size,
  mtime): a file replaced since (evicted and downloaded again) is refused with
  :class:`StaleFile`, and the loader then asks for the bytes over the socket;
- the consumer holds its pin on the shard while it reads, so the agent does not
  evict it meanwhile; and a file deleted later stays readable through the mapping.

A mapping keeps a deleted file's disk space in use, so the loader closes it as
soon as it lets go of its pin (:meth:`CacheFiles.close`). Pages read leave the
consumer's RSS every DROP_AFTER bytes read from a file (:meth:`CacheFiles.drop_read`):
they stay in the page cache, which the kernel may reclaim, and never count as more
than a few MiB of our memory.
"""

from __future__ import annotations

import errno
import os
from typing import Sequence

from .errors import ProtocolError
from .layout import CacheLayout
from .tario import ShardView, map_file


FAULT_AROUND = 64 << 10  # Linux's default fault_around_bytes
# Bytes mapped in from a file between drops of its pages from our RSS (each read counts
# FAULT_AROUND more, what a fault may map beyond it): a drop per reply was 5% of a consumer's
# CPU on 1 KB samples (the call, and faulting the next reply's pages in anew).
DROP_AFTER = 4 << 20


class StaleFile(OSError):
    """The cache file is not the one the worker read (replaced, or gone)."""


class CacheFiles:
    """The cache files one consumer reads from, mapped while it holds their pins."""

    def __init__(self, cache_dir: str) -> None:
        self.layout = CacheLayout.of(cache_dir)
        self.views: dict[str, tuple[tuple[int, ...], ShardView]] = {}  # url -> (identity, mapping)
        self.read: dict[str, list[int]] = {}  # url -> [start, end, bytes mapped in at most] since its last drop

    def range(self, url: str, identity: Sequence[int], start: int, size: int) -> memoryview:
        """Bytes ``[start, start + size)`` of ``url``'s cache file, if it is the file of ``identity``.

        Raises :class:`StaleFile` if the file there is another one (or none), any other
        ``OSError`` if it cannot be read, ProtocolError for a range outside it.
        """
        identity = tuple(identity)
        known = self.views.get(url)
        if known is None or known[0] != identity:
            self.close(url)
            known = self.views[url] = (identity, self._map(url, identity))
        view = known[1]
        if start + size > len(view.data):
            raise ProtocolError(f"worker reply names bytes past the end of {url}'s cache file")
        read = self.read.setdefault(url, [start, start, 0])
        read[0], read[1] = min(read[0], start), max(read[1], start + size)
        read[2] += size + FAULT_AROUND  # what its faults may map in: scattered reads map more than they read
        return view.data[start : start + size]

    def _map(self, url: str, identity: tuple[int, ...]) -> ShardView:
        path = self.layout.shard_path(url)
        try:
            found, view = map_file(path, url=url)  # the identity of the file opened, not of the path
        except (FileNotFoundError, ValueError):  # gone; or empty, which no worker names a range of
            raise StaleFile(errno.ESTALE, "no longer the cached shard", str(path)) from None
        if found != identity:
            view.close()
            raise StaleFile(errno.ESTALE, "replaced since the worker read it", str(path))
        return view

    def drop_read(self) -> None:
        """Take the pages of each file read DROP_AFTER bytes from out of our RSS (they stay in
        the page cache); views handed out stay valid (a page touched again comes back)."""
        for url, (start, end, size) in list(self.read.items()):
            if size < DROP_AFTER:
                continue
            del self.read[url]
            known = self.views.get(url)
            if known is not None:
                # A fault maps the pages around it too (Linux maps up to 64 KiB): those go as well.
                known[1].drop_pages(max(0, start - FAULT_AROUND), end + FAULT_AROUND)

    def close(self, url: str | None = None) -> None:
        """Unmap ``url``'s file (every file without one)."""
        for key in list(self.views) if url is None else [url]:
            known = self.views.pop(key, None)
            self.read.pop(key, None)
            if known is not None:
                known[1].close()
