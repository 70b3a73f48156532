"""Direct reads: a consumer copies payloads from the agent's cache files itself.

A worker answering a read with ``direct`` names the runs of a published shard as
byte ranges of its cache file (see :mod:`wdscache.agent.worker`) instead of sending them.
:class:`CacheFiles` opens those files in the consumer and reads each payload with
``pread`` into a new ``bytes``: one copy per payload byte, straight from the page
cache, where streaming costs three (into the socket, out of it, into ``bytes``).

Why no wrong byte can come out of it:

- a file under ``shards/`` is published whole, by rename, and never written again
  (:mod:`wdscache.agent.fetch`), so the bytes at an offset never change;
- the file opened must have the identity the worker read (device, inode, size,
  mtime): a file replaced since (evicted and downloaded again) is refused with
  :class:`StaleFile`, and the loader then asks for those bytes over the socket;
- the consumer holds its pin on the shard while it reads, so the agent does not
  evict it meanwhile; and a file deleted later stays readable through the open
  descriptor.

Reads, not a mapping: a disk error, or a cache file cut short by another process,
is then an ``OSError`` or a short read (the loader falls back to streaming), where
touching a mapping would kill the training process with SIGBUS; nothing counts in
the consumer's RSS but the payloads. An open descriptor keeps a deleted file's disk
space in use, so the loader closes it as soon as it lets go of its pin
(:meth:`CacheFiles.close`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from io import BytesIO

from ..shared.errors import ProtocolError
from ..shared.layout import CacheLayout, file_identity

# Bytes one pread asks for: Linux returns at most 2,147,479,552 bytes a call, so a field of
# 2 GiB or more takes several.
PREAD_MAX = 1 << 30


class StaleFile(OSError):
    """The cache file is not the one the worker read (replaced, or gone)."""


def pread_whole(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes of ``fd`` at ``offset``, read in calls of at most :data:`PREAD_MAX` bytes;
    fewer only if the file ends first (the caller checks the length)."""
    chunk = PREAD_MAX
    if size <= chunk:
        return os.pread(fd, size, offset)
    # Read into a BytesIO's own buffer, which getvalue() then hands out as the bytes returned
    # (CPython copies none of it): a payload's size once in memory, not twice.
    out = BytesIO()
    out.seek(size - 1)
    out.write(b"\0")
    got = 0
    with out.getbuffer() as view:
        while got < size:
            n = os.preadv(fd, [view[got : got + chunk]], offset + got)
            if n == 0:  # the end of the file
                break
            got += n
    out.truncate(got)
    return out.getvalue()


class FileRange:
    """Bytes ``[start, start + size)`` of an open cache file, read on demand."""

    __slots__ = ("fd", "start", "size")

    def __init__(self, fd: int, start: int, size: int) -> None:
        self.fd, self.start, self.size = fd, start, size

    def __len__(self) -> int:
        return self.size

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` in the range (the caller checked they lie inside it)."""
        data = pread_whole(self.fd, size, self.start + offset)
        if len(data) != size:  # the file was cut short behind the agent's back
            raise StaleFile(errno.ESTALE, f"short read: {len(data)} of {size} bytes at {self.start + offset}")
        return data


class CacheFiles:
    """The cache files one consumer reads from, open while it holds their pins."""

    def __init__(self, cache_dir: str) -> None:
        self.layout = CacheLayout.of(cache_dir)
        self.fds: dict[str, tuple[tuple[int, ...], int]] = {}  # url -> (identity, descriptor)

    def range(self, url: str, identity: Sequence[int], start: int, size: int) -> FileRange:
        """Bytes ``[start, start + size)`` of ``url``'s cache file, if it is the file of ``identity``.

        Raises :class:`StaleFile` if the file there is another one (or none), any other
        ``OSError`` if it cannot be read, ProtocolError for a range outside it.
        """
        identity = tuple(identity)
        known = self.fds.get(url)
        if known is None or known[0] != identity:
            self.close(url)
            known = self.fds[url] = (identity, self._open(url, identity))
        if start + size > identity[2]:
            raise ProtocolError(f"worker reply names bytes past the end of {url}'s cache file")
        return FileRange(known[1], start, size)

    def _open(self, url: str, identity: tuple[int, ...]) -> int:
        path = self.layout.shard_path(url)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StaleFile(errno.ESTALE, "no longer cached", str(path)) from None
        try:
            if file_identity(os.fstat(fd)) != identity:  # of the file opened, not of the path
                raise StaleFile(errno.ESTALE, "replaced since the worker read it", str(path))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self, url: str | None = None) -> None:
        """Close ``url``'s file (every file without one)."""
        for key in list(self.fds) if url is None else [url]:
            known = self.fds.pop(key, None)
            if known is not None:
                os.close(known[1])
