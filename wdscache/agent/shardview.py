"""The shard view: a cached shard's tar mapped read-only, and its samples.

A cached shard is always a plain tar (a gzip'd download is cached decompressed,
see :mod:`wdscache.agent.gunzip`); :func:`open_shard` refuses gzip data.  Its samples
come from a walk over its headers (:mod:`wdscache.shared.samples`), from the download
that was read while it grew (:class:`~wdscache.agent.growing.GrowingShard`), or from
the tables of shards opened before (:class:`~wdscache.agent.sampletable.SampleTables`),
looked up by the identity of the file opened (:func:`file_identity`), never by a
path that a new download may take meanwhile.  Headers are walked with ``pread``,
not through the mapping, so a shard's payload pages are mapped in only when
read.  Payloads are memoryviews into the read-only mapping: nobody can write
through them, and closing a view never invalidates one still alive.  A view is
not locked: it belongs to one thread.

A mapping holds no file descriptor (:func:`map_file`): a worker's mappings stay alive while
frames cut from them wait in ZeroMQ for slow consumers, and a read may name hundreds of small
shards at once, so a descriptor per mapping (what Python's ``mmap`` keeps, a ``dup()`` of the
file's) would make a worker's open files grow with its consumers and the shards they read.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..shared.errors import ShardError
from ..shared.layout import file_identity
from ..shared.samples import Sample, SampleSpan, group_samples
from ..shared.tarwalk import GZIP_MAGIC, FileSpan, walk

if TYPE_CHECKING:
    from .growing import GrowingShard
    from .sampletable import SampleTables


_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True)
class FileMap:
    """A file mapped whole, read-only and shared (:func:`map_file`): its bytes ``data``, mapped
    at ``address``. The mapping lasts while any memoryview of it is alive (``data``, a slice of
    it, a frame ZeroMQ still sends), and is unmapped when the last one goes."""

    data: memoryview
    address: int

    def drop_pages(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` leave our RSS (read again, they come back from the page cache)."""
        first = start - start % mmap.PAGESIZE
        end = min(end, len(self.data))
        if end > first:
            _madvise(self.address + first, end - first, mmap.MADV_DONTNEED)


def map_file(fd: int) -> FileMap:
    """The file open as ``fd``, mapped whole, read-only and shared, holding no descriptor: the
    caller may close ``fd`` at once. (Python's ``mmap`` keeps a ``dup()`` of the file's
    descriptor for the mapping's life; its ``trackfd=False`` comes only with Python 3.13.)

    ValueError for an empty file, which cannot be mapped; OSError if the kernel refuses."""
    size = os.fstat(fd).st_size
    if size == 0:
        raise ValueError("cannot map an empty file")
    if size > sys.maxsize:  # (a 32-bit process: c_size_t would map a cut length)
        raise OSError(errno.EFBIG, f"cannot map a file of {size} bytes in this process")
    address = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map the file: {os.strerror(err)}")
    try:
        pages = (ctypes.c_char * size).from_address(address)
        # Every memoryview of the mapping, slices too, holds ``pages``: unmapped once the last is
        # freed. Not at exit: a frame ZeroMQ's thread still sends would read unmapped memory.
        weakref.finalize(pages, _munmap, address, size).atexit = False
    except BaseException:  # (nothing will unmap it else)
        _munmap(address, size)
        raise
    return FileMap(memoryview(pages).cast("B").toreadonly(), address)


class ShardView:
    """A cached shard's tar, mapped read-only, and its samples.

    Payloads are memoryviews into that memory unless ``copy=True`` asks for
    ``bytes``: use them before :meth:`close`.  Closing never invalidates a view
    still alive (the mapping then lasts until the last one is freed), but it is
    the only point where the file's memory is given back promptly.
    """

    def __init__(
        self, mapped: FileMap, *, url: str, samples: Sequence[SampleSpan], identity: tuple[int, ...] = ()
    ) -> None:
        self.url = url
        self.identity = identity  # of the file opened (file_identity), when opened from one
        self._map: FileMap | None = mapped
        self._samples = samples

    def __enter__(self) -> ShardView:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._map is None

    @property
    def data(self) -> memoryview:
        """The whole uncompressed tar, read-only: the offsets of :attr:`samples` index into it."""
        if self._map is None:
            raise ValueError("shard view is closed")
        return self._map.data

    @property
    def samples(self) -> Sequence[SampleSpan]:
        """Where each sample lies (found when the shard was opened)."""
        return self._samples

    def sample(self, i: int, *, copy: bool = False) -> Sample:
        """Sample ``i``: ``{"__key__", "__url__", ext: payload, ...}``."""
        return self._build(self.samples[i], copy)

    def iter_samples(self, *, copy: bool = False) -> Iterator[Sample]:
        """Every sample in archive order (see :meth:`sample`)."""
        for span in self.samples:
            yield self._build(span, copy)

    def drop_pages(self, start: int, end: int) -> None:
        """Done with bytes ``[start, end)`` for now: the shard's pages there leave the RSS.

        Safe while payloads there are still in use: the mapping is shared and
        read-only, so a page touched again is read back from the page cache.
        """
        if self._map is not None and end > start:
            self._map.drop_pages(start, end)

    def close(self) -> None:
        """Give back the shard's memory (unmapped at once unless payloads of it are alive); idempotent."""
        mapped, self._map = self._map, None
        if mapped is None:
            return
        try:
            mapped.data.release()
        except BufferError:
            pass  # buffers handed out are still alive: the memory stays until they go

    def _build(self, span: SampleSpan, copy: bool) -> Sample:
        view = self.data
        sample: Sample = {"__key__": span.key, "__url__": self.url}
        for ext, offset, size in span.fields:
            payload = view[offset : offset + size]
            sample[ext] = payload.tobytes() if copy else payload
        return sample


def open_shard(
    path: str | os.PathLike[str], *, url: str, growing: GrowingShard | None = None, tables: SampleTables | None = None
) -> ShardView:
    """Open a cached shard, a plain tar, for reading (the agent caches a gzip'd shard
    decompressed: see :mod:`wdscache.agent.gunzip`; a gzip'd file here is a ShardError).

    ``growing``: the view of this shard's download, whose samples need not be found again.
    ``tables``: the sample tables of shards opened before; the file opened here is looked
    up by its identity (not by its path, which a new download may take meanwhile).
    """
    with open(path, "rb") as f:
        identity = file_identity(os.fstat(f.fileno()))
        samples: Sequence[SampleSpan] | None = tables.get(url, identity) if tables is not None else None
        tabled = samples is not None
        try:
            mapped = map_file(f.fileno())
        except ValueError:  # an empty file cannot be mapped
            raise ShardError(url, "empty file, not a tar archive", offset=0) from None
        try:
            if os.pread(f.fileno(), 2, 0) == GZIP_MAGIC:
                raise ShardError(url, "gzip'd data in the cache (shards are cached decompressed)", offset=0)
            # Scanned with pread, not through the mapping: faulting in every header page
            # would bring most of the file into our RSS (the kernel maps pages around each fault).
            if samples is None and growing is not None:
                samples = growing.complete(f.fileno(), url)
            if samples is None:
                samples = [span for span, _ in group_samples(walk(FileSpan(f.fileno(), 0, len(mapped.data)), url), url)]
        except BaseException:
            mapped.data.release()
            raise
    if tables is not None and not tabled:
        samples = tables.put(url, identity, samples) or samples  # kept packed, unless too many
    return ShardView(mapped, url=url, samples=samples, identity=identity)


def iter_samples(path: str | os.PathLike[str], *, url: str) -> Iterator[Sample]:
    """Every sample of the shard at ``path``, with ``bytes`` payloads (copies)."""
    with open_shard(path, url=url) as shard:
        yield from shard.iter_samples(copy=True)
