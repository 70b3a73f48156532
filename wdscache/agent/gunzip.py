"""Decompressing a gzip'd shard into the tar inside it.

The agent caches a gzip'd shard as the tar inside it, decompressed by
:func:`gunzip` when its download completes (see :mod:`wdscache.agent.fetch`), so a
cached shard is always a plain tar.

Trusts nothing in the compressed bytes.  Memory stays bounded however far the
data expands (a gzip bomb): each step reads at most 256 KiB of input and makes
at most ``GZIP_OUT`` bytes of output.  Corrupt, truncated or trailing non-gzip
data raises :class:`~wdscache.shared.errors.ShardError` with an offset in the ``.gz``
file.  The agent's download threads use it; it shares no state between calls.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

from ..shared.errors import ShardError
from ..shared.tarwalk import GZIP_MAGIC

# Compressed bytes read, and decompressed bytes made, per step: small input pieces keep
# the copies of zlib's unconsumed input cheap when the data expands a lot.
_GZIP_IN = 256 << 10
GZIP_OUT = 4 << 20


def gunzip(read: Callable[[int], bytes], *, url: str) -> Iterator[bytes]:
    """The tar inside a gzip file read with ``read(n)``, in pieces of at most ``GZIP_OUT``
    bytes. All members are joined; trailing zero padding is allowed. Corrupt or truncated
    data: ShardError (offsets in the .gz file)."""
    inflater = None
    compressed, pos, full = b"", 0, False
    while True:
        if inflater is None:
            if len(compressed) < 2:
                compressed += read(_GZIP_IN)
            if not compressed:
                return
            if compressed[:2] != GZIP_MAGIC:
                while compressed:
                    if compressed.strip(b"\0"):
                        raise ShardError(url, "data after the gzip stream is not gzip", offset=pos)
                    pos += len(compressed)
                    compressed = read(_GZIP_IN)
                return
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif not compressed and not full:  # a full piece may leave output inside zlib: ask again first
            compressed = read(_GZIP_IN)
            if not compressed:
                raise ShardError(url, "truncated gzip stream", offset=pos)
        try:
            out = inflater.decompress(compressed, GZIP_OUT)
        except zlib.error as exc:
            raise ShardError(url, f"corrupt gzip data ({exc}); the offset is in the .gz file", offset=pos) from None
        rest = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
        pos += len(compressed) - len(rest)
        compressed, full = rest, len(out) >= GZIP_OUT
        if inflater.eof:
            inflater, full = None, False
        if out:
            yield out
