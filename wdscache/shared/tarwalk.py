"""The tar header walk: which regular files a tar holds, and where their payloads lie.

Reads an archive the way Python's :mod:`tarfile` reads it (what WebDataset 1.0.2's
``tar_file_iterator`` sees), so that the members found here are the ones it finds:

- Only regular files count (types ``0``, NUL and ``7``); directories, links,
  devices and fifos are skipped, never followed.  GNU sparse files are refused.
- Names are read as tarfile reads them: ustar ``prefix/name``, GNU long names,
  PAX ``path`` records (global ones too), decoded as UTF-8 with
  ``surrogateescape`` (tarfile's default on a UTF-8 file system), so a
  non-UTF-8 name gives the same ``str`` as in WebDataset.

Trusts nothing in the bytes it walks.  Every header's checksum is checked; size
fields and PAX numbers are parsed from at most 20 digits; a payload is located,
never copied, and an extension header's data (a long name, PAX records) is read
only once it is known to lie inside the buffer, so nothing is allocated from a
declared size.  Where tarfile would quietly stop (it treats a bad header after
the first one as the end of the archive), the walk raises
:class:`~wdscache.shared.errors.ShardError` with the offset of the header at fault: a
cached shard that is damaged should be noticed, not silently shortened.

:func:`tar_problem` and :func:`file_problem` tell whether a download is a tar
(or a gzip'd one) before it is published; they read at most ``HEAD_BYTES``.
:func:`packing_of` tells a shard by its first bytes, whatever its name: a tar, or a tar
compressed with gzip (read here) or with bzip2, xz or zstd (named, not read: a cached shard is
read by its members' offsets, which only a plain tar has, and only gzip is decompressed on
download).
Nothing here holds state between calls: safe in any thread.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeAlias

from .errors import ShardError

BLOCK = 512
GZIP_MAGIC = b"\x1f\x8b"
HEAD_BYTES = 64 << 10  # what the tar checks read of a file's start
_USTAR_MAGIC = (b"ustar\0", b"ustar ")  # at byte 257 of a POSIX (or GNU, "ustar  \0") tar header
_USTAR_AT = 257


class Packing(Enum):
    """What a shard's first bytes say it is: a tar, or a tar compressed by one of these."""

    TAR = "tar"
    GZIP = "gzip"
    BZIP2 = "bzip2"
    XZ = "xz"
    ZSTD = "zstd"


READ_PACKINGS = frozenset((Packing.TAR, Packing.GZIP))  # what a shard may be here
# The compressions webdataset reads (Python's tarfile streams them) and wdscache does not, by magic.
# bzip2's is "BZh", the block size ("1".."9"), then a block's magic or the stream's end.
_UNREAD = (
    (re.compile(rb"BZh[1-9](?:1AY&SY|\x17rE8P\x90)"), Packing.BZIP2),
    (re.compile(re.escape(b"\xfd7zXZ\x00")), Packing.XZ),
    (re.compile(re.escape(b"\x28\xb5\x2f\xfd")), Packing.ZSTD),
)

# What a walk reads: bytes in memory, a mapping, or a file read with pread (FileSpan, below).
Buffer: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap | FileSpan"

# name, size, chksum, typeflag and prefix of a ustar header; the rest is unused.
_HEADER = struct.Struct("100s24x12s12x8sc188x155s")
_ZERO_BLOCK = bytes(BLOCK)
_NO_CHECKSUM = bytes(8)
_OCTAL_DIGITS = b"01234567"
_HIGH_BYTES = bytes(range(128, 256))
_MAX_SIZE_DIGITS = 20  # beyond any real size; keeps int() away from huge inputs

_REGULAR = frozenset((b"0", b"\0", b"7"))
# Types tarfile knows to carry no data: their size field is not skipped.
# Any other unknown type is skipped by its size, as tarfile does.
_DATALESS = frozenset((b"1", b"2", b"3", b"4", b"5", b"6"))
_LONG_NAME, _LONG_LINK, _PAX, _PAX_SOLARIS, _PAX_GLOBAL = b"L", b"K", b"x", b"X", b"g"
_EXTENSIONS = frozenset((_LONG_NAME, _LONG_LINK, _PAX, _PAX_SOLARIS, _PAX_GLOBAL))  # apply to the next header
_SPARSE = b"S"
_READ_AHEAD = 8 << 10  # the smallest read of a FileSpan
_ADLER_MOD = 65521
_PARSED_MAX = 4096  # number fields a walk keeps parsed (sizes, checksums); more start it over


@dataclass(frozen=True, slots=True)
class Member:
    """A regular file in a tar: its name and where its payload lies in the tar."""

    name: str
    offset: int
    size: int


def _byte_sum(block: bytes) -> int:
    # Adler-32's low half is (1 + sum of bytes) mod 65521; over 256 bytes the
    # sum stays below the modulus, so two C-level calls give the exact sum of a
    # block about five times faster than sum().
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


def _checksum_matches(block: bytes, stored: int) -> bool:
    """True when ``stored`` is the header checksum of ``block``, unsigned or signed."""
    # The checksum field itself counts as eight spaces.
    unsigned = _byte_sum(block) - sum(block[148:156]) + 8 * 32
    if stored == unsigned:
        return True
    # Some old writers summed signed bytes; tar readers accept either.
    rest = block[:148] + block[156:]
    return stored == unsigned - 256 * (len(rest) - len(rest.translate(None, _HIGH_BYTES)))


def header_ok(block: bytes) -> bool:
    """True when ``block`` is a tar header whose checksum matches (or the zero end block)."""
    if len(block) < BLOCK:
        return False
    block = bytes(block[:BLOCK])
    if block == _ZERO_BLOCK:
        return True
    field = block[148:156].replace(b"\0", b" ").strip()
    try:
        stored = int(field, 8)
    except ValueError:
        return False
    return _checksum_matches(block, stored)


def packing_of(head: bytes) -> Packing | None:
    """What ``head``, a file's first bytes (512 of them, or all it has), says the file is: a tar
    (the ustar magic at byte 257, or a first header whose checksum matches, as an old v7 tar's),
    a gzip stream, or a bzip2, xz or zstd one; None for anything else (a text file, say)."""
    if head.startswith(GZIP_MAGIC):
        return Packing.GZIP
    for magic, packing in _UNREAD:
        if magic.match(head):
            return packing
    if head[_USTAR_AT : _USTAR_AT + 6].startswith(_USTAR_MAGIC) or header_ok(head):
        return Packing.TAR
    return None


def shard_packing(head: bytes) -> Packing | None:
    """What ``head``, a file's first bytes (``HEAD_BYTES`` of them, or all it has), says the file
    is as a shard (:func:`packing_of`), a gzip stream only when :func:`tar_problem` finds a tar in
    it: a gzip'd text file (a URL list) is no shard."""
    packing = packing_of(head[:BLOCK])
    return None if packing is Packing.GZIP and tar_problem(head) is not None else packing


def unread_packing(packing: Packing) -> str:
    """Why a shard compressed as ``packing`` (bzip2, xz or zstd) is not read, and what to do."""
    return (
        f"a shard compressed with {packing.value}: wdscache reads plain tar and gzip'd tar; decompress it "
        f"({packing.value} -d) or recompress it with gzip"
    )


def tar_problem(head: bytes) -> str | None:
    """Why ``head`` (the first bytes of a file, ideally 64 KiB) is not a tar or gzip'd tar.

    Returns None when it looks right. Used before a download is published, so that
    an HTML error page served with status 200 never enters the cache.
    """
    packing = packing_of(head)
    if packing is not None and packing not in READ_PACKINGS:
        return unread_packing(packing)
    if packing is Packing.GZIP:
        try:
            inner = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, BLOCK)
        except zlib.error as exc:
            return f"gzip data is corrupt ({exc})"
        if len(inner) < BLOCK:
            return "gzip stream too short to hold a tar header"
        return None if header_ok(inner) else "gzip'd data is not a tar archive"
    # Sniffed first: an error page is usually shorter than a tar header.
    sniff = head[:64].lstrip().lower()
    if sniff.startswith((b"<!doctype html", b"<html", b"<?xml")):
        return "got an HTML/XML page, not a tar archive"
    if len(head) < BLOCK:
        return f"too short for a tar archive ({len(head)} bytes)"
    if header_ok(head):
        return None
    return "not a tar archive (bad header checksum)"


def file_problem(path: str | os.PathLike[str]) -> str | None:
    """:func:`tar_problem` of the file at ``path`` (its first 64 KiB)."""
    with open(path, "rb") as f:
        return tar_problem(f.read(HEAD_BYTES))


def cut_problem(path: str | os.PathLike[str], *, url: str) -> str | None:
    """Why the file at ``path``, a body that came without its length, may be a tar cut short
    (None: it ends as a whole tar does). Every tar writer ends the archive with zero blocks
    (the end-of-archive marker), so one whose data runs out at a member's end, or inside a
    member, lost its end; a gzip'd tar is left to its own check, its stream's end."""
    with open(path, "rb") as f:
        if f.read(2) == GZIP_MAGIC:
            return None
        size = os.fstat(f.fileno()).st_size
        ended: list[int] = []
        try:
            for _ in walk(FileSpan(f.fileno(), 0, size), url, ended=ended):
                pass
        except ShardError as exc:
            return exc.reason if exc.offset is None else f"{exc.reason} (byte {exc.offset})"
    return None if ended else f"no end-of-archive marker after its last member ({size} bytes)"


def _text(raw: bytes) -> str:
    """A NUL-terminated name field as tarfile decodes it on a UTF-8 file system."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _octal(field: bytes) -> int | None:
    """An octal number field (NUL-terminated, blank-padded), or None if malformed."""
    digits = field.split(b"\0", 1)[0].strip()
    if digits.translate(None, _OCTAL_DIGITS):
        return None
    return int(digits, 8) if digits else 0


def _size_field(field: bytes) -> int | None:
    """The size field: octal, or GNU base-256 (first byte 0x80); None if malformed or negative."""
    if field[0] == 0x80:
        return int.from_bytes(field[1:], "big")
    if field[0] & 0x80:  # 0xff marks a negative base-256 number; the rest is garbage
        return None
    return _octal(field)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _pax_records(data: bytes, *, is_global: bool, url: str, offset: int) -> dict[str, Any]:
    """The ``path`` and ``size`` records of a PAX header's data; other keywords are ignored."""
    found: dict[str, Any] = {}
    pos, end = 0, len(data)
    while pos < end and data[pos] != 0:  # some writers pad the records with NULs
        space = data.find(b" ", pos, pos + _MAX_SIZE_DIGITS + 1)
        length = data[pos:space] if space > pos else b""
        stop = pos + int(length) if length.isdigit() else pos
        equals = data.find(b"=", space + 1, stop - 1) if pos < stop <= end else -1
        if equals <= space + 1 or data[stop - 1] != 0x0A:
            raise ShardError(url, "malformed PAX header record", offset=offset)
        keyword = data[space + 1 : equals]
        value = data[equals + 1 : stop - 1]
        if keyword.startswith(b"GNU.sparse."):
            raise ShardError(url, "GNU sparse members are not supported", offset=offset)
        if keyword == b"path":
            found["path"] = value.decode("utf-8", "surrogateescape")
        elif keyword == b"size":
            if is_global:
                raise ShardError(url, "a global PAX header may not set a size", offset=offset)
            if not value.isdigit() or len(value) > _MAX_SIZE_DIGITS:
                raise ShardError(url, f"bad PAX size {value[:40]!r}", offset=offset)
            found["size"] = int(value)
        pos = stop
    return found


def walk(
    buf: Buffer,
    url: str,
    *,
    prefix: bool = False,
    global_pax: dict[str, Any] | None = None,
    ended: list[int] | None = None,
) -> Iterator[tuple[str, int, int, int]]:
    """``(name, payload offset, size, header offset)`` of each regular file, in archive order.

    The header offset is where the member's headers begin, extension headers
    included: a walk started there reads the member again.  Follows tarfile's
    reading of extension headers: a chain of them applies to the next real
    header, and where two set the same thing the first one in the archive wins.

    With ``prefix``, ``buf`` is the start of a tar still being written: the walk
    stops quietly where the data runs out instead of calling it truncated.
    ``global_pax``, if given, receives the global PAX records the walk meets; ``ended``
    the offset of the end-of-archive marker, if the walk reaches one (a tar whose data
    runs out at a member's end has none).
    """
    end = len(buf)
    if end == 0:
        if prefix:
            return
        raise ShardError(url, "empty file, not a tar archive", offset=0)
    pos = 0
    global_pax = {} if global_pax is None else global_pax
    # Extension headers waiting for their member, and where their chain began.
    chain: list[tuple[bytes, Any]] = []
    chain_at = -1
    # Headers are sliced from a window read ahead: a FileSpan's reads cost a system call each,
    # so it is read _READ_AHEAD at a time; other buffers are sliced a block at a time.
    reach = _READ_AHEAD if isinstance(buf, FileSpan) else BLOCK
    window, window_at = b"", 0
    # The number fields seen in this walk, parsed once: a shard repeats few sizes and checksums.
    sums: dict[bytes, tuple[int, int]] = {}  # checksum field -> (its value, the sum of its bytes)
    sizes: dict[bytes, int] = {}
    while pos < end:
        i = pos - window_at  # pos only moves on: the window is read again once it is past it
        if i + BLOCK > len(window):
            window, window_at, i = bytes(buf[pos : pos + reach]), pos, 0
        block = window[i : i + BLOCK]
        if len(block) < BLOCK:
            if prefix or block.count(0) == len(block):
                if ended is not None and not prefix:
                    ended.append(pos)
                break  # zero padding cut short: the archive had ended anyway
            raise ShardError(url, "truncated: archive ends inside a header", offset=pos)
        raw_name, raw_size, raw_sum, kind, raw_prefix = _HEADER.unpack_from(block)
        parsed = sums.get(raw_sum)
        if parsed is None:
            if raw_sum == _NO_CHECKSUM and block == _ZERO_BLOCK:
                if ended is not None:
                    ended.append(pos)
                break  # end-of-archive marker; tarfile stops at the first zero block too
            stored = _octal(raw_sum)
            if stored is None:
                raise ShardError(url, "bad tar header checksum", offset=pos)
            parsed = (stored, sum(raw_sum))
            if raw_sum != _NO_CHECKSUM:  # kept out, so that the end block is always looked for
                if len(sums) >= _PARSED_MAX:
                    sums.clear()
                sums[raw_sum] = parsed
        # The byte sum: Adler-32's low half is (1 + sum of bytes) mod 65521, exact for the
        # first 256 bytes (their sum stays below the modulus), and so the rest's sum, also
        # below it, is the whole block's remainder less theirs.
        head = zlib.adler32(block[:256]) & 0xFFFF
        total = head - 1 + ((zlib.adler32(block) & 0xFFFF) - head) % _ADLER_MOD
        # The checksum field itself counts as eight spaces.
        if total - parsed[1] + 8 * 32 != parsed[0] and not _checksum_matches(block, parsed[0]):
            raise ShardError(url, "bad tar header checksum", offset=pos)
        size = sizes.get(raw_size)
        if size is None:
            size = _size_field(raw_size)
            if size is None:
                raise ShardError(url, f"bad size field {raw_size!r}", offset=pos)
            if len(sizes) >= _PARSED_MAX:
                sizes.clear()
            sizes[raw_size] = size
        data = pos + BLOCK

        if kind in _EXTENSIONS:
            stop = data + _padded(size)
            if stop > end:
                if prefix:
                    return
                raise ShardError(url, "truncated: extended header runs past the end", offset=pos)
            if chain_at < 0:
                chain_at = pos
            payload = bytes(buf[data : data + size])
            if kind == _LONG_NAME:
                chain.append((kind, _text(payload)))
            elif kind == _LONG_LINK:
                chain.append((kind, None))  # link targets are of no use here
            elif kind == _PAX_GLOBAL:
                global_pax.update(_pax_records(payload, is_global=True, url=url, offset=pos))
                chain.append((kind, None))  # tarfile wants a member after it too
            else:
                local = _pax_records(payload, is_global=False, url=url, offset=pos)
                chain.append((_PAX, {**global_pax, **local}))
            pos = stop
            continue

        if kind == _SPARSE:
            raise ShardError(url, "GNU sparse members are not supported", offset=pos)
        # _text, inlined: a call per header counts on shards of small members.
        name = raw_name.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if kind == b"\0" and name.endswith("/"):
            kind = b"5"  # the old V7 way of writing a directory
        if raw_prefix[0]:
            name = _text(raw_prefix) + "/" + name
        if "path" in global_pax:
            name = global_pax["path"].rstrip("/")
        if chain:
            # Innermost first, so the outermost extension header has the last word.
            for ext_kind, value in reversed(chain):
                if ext_kind == _LONG_NAME:
                    name = value
                elif ext_kind == _PAX:
                    if "path" in value:
                        name = value["path"].rstrip("/")
                    size = value.get("size", size)
            chain.clear()
            at, chain_at = chain_at, -1
        else:
            at = pos

        if kind in _DATALESS:
            pos = data
            continue
        stop = data + _padded(size)
        if stop > end:
            if prefix:
                return
            raise ShardError(url, f"truncated: member {name!r} ({size} bytes) runs past the end", offset=pos)
        if kind in _REGULAR:
            yield name, data, size, at
        pos = stop
    if chain and not prefix:
        raise ShardError(url, "extended header without a member after it", offset=chain_at)


def members(buf: Buffer, *, url: str) -> list[Member]:
    """Every regular file in the uncompressed tar ``buf``, in archive order (no grouping)."""
    return [Member(name, offset, size) for name, offset, size, _ in walk(buf, url)]


class FileSpan:
    """Bytes ``[start, end)`` of an open file as a sliceable buffer, read with ``pread``.

    Reads go in blocks of at least ``_READ_AHEAD`` bytes, so walking the headers
    of small members costs one call per block, not one per header.  Keeps the
    last block read: it belongs to one walk, never shared between threads.
    """

    def __init__(self, fd: int, start: int, end: int) -> None:
        self.fd, self.start, self.end = fd, start, end
        self._at, self._block = 0, b""

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, part: slice) -> bytes:
        first, stop, _ = part.indices(len(self))
        if not (self._at <= first and stop <= self._at + len(self._block)):
            size = max(stop - first, min(_READ_AHEAD, len(self) - first))
            self._at, self._block = first, os.pread(self.fd, max(0, size), self.start + first)
        return self._block[first - self._at : stop - self._at]
