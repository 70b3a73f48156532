"""Tar reading: recognising tar shards and reading their WebDataset samples.

Samples are found the way WebDataset 1.0.2 finds them (``tar_file_iterator``
over Python's :mod:`tarfile`, then ``group_by_keys``), so that a training job
sees the same keys and fields whether it reads through wdscache or not:

- Only regular files count (types ``0``, NUL and ``7``); directories, links,
  devices and fifos are skipped, never followed.  GNU sparse files are refused.
- Names are read as tarfile reads them: ustar ``prefix/name``, GNU long names,
  PAX ``path`` records (global ones too), decoded as UTF-8 with
  ``surrogateescape`` (tarfile's default on a UTF-8 file system), so a
  non-UTF-8 name gives the same ``str`` key as in WebDataset.
- Members named like ``__meta__`` are skipped (:func:`is_meta_name`), as are
  names without an extension (:func:`split_name` gives None).
- The key is the name up to the first dot of its basename, the extension the
  rest, lower-cased (WebDataset's default ``lcase=True``).
- Consecutive members with the same key form one sample; an extension repeated
  within a sample is an error, as in WebDataset.

Where WebDataset would quietly stop reading (tarfile treats a bad header after
the first one as the end of the archive), :func:`scan` raises
:class:`~wdscache.errors.ShardError` instead: a cached shard that is damaged
should be noticed, not silently shortened.

A gzip'd shard is cached as the tar inside it (decompressed by :func:`gunzip` in
bounded pieces, when its download completes: see :mod:`wdscache.fetch`), so a
cached shard is always a plain tar, mapped by :func:`open_shard`.
"""

from __future__ import annotations

import mmap
import operator
import os
import struct
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from .errors import ShardError

BLOCK = 512
GZIP_MAGIC = b"\x1f\x8b"
HEAD_BYTES = 64 << 10  # what the tar checks read of a file's start

Buffer = bytes | bytearray | memoryview | mmap.mmap
Sample = dict[str, Any]  # "__key__" and "__url__" -> str, extension -> payload

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
_SPARSE = b"S"
# A member with one of these extensions would overwrite the sample's metadata;
# WebDataset reports it as a duplicate.
_RESERVED_EXTS = frozenset(("__key__", "__url__"))

# Compressed bytes read, and decompressed bytes made, per step of gunzip: small input
# pieces keep the copies of zlib's unconsumed input cheap when the data expands a lot.
_GZIP_IN = 256 << 10
GZIP_OUT = 4 << 20
_READ_AHEAD = 8 << 10


@dataclass(frozen=True, slots=True)
class Member:
    """A regular file in a tar: its name and where its payload lies in the tar stream."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class SampleSpan:
    """Where one sample's fields lie: ``(extension, offset, size)`` in archive order."""

    key: str
    fields: tuple[tuple[str, int, int], ...]


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


def tar_problem(head: bytes) -> str | None:
    """Why ``head`` (the first bytes of a file, ideally 64 KiB) is not a tar or gzip'd tar.

    Returns None when it looks right. Used before a download is published, so that
    an HTML error page served with status 200 never enters the cache.
    """
    if head.startswith(GZIP_MAGIC):
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


def split_name(name: str) -> tuple[str, str] | None:
    """WebDataset's ``(key, extension)`` of a member name, or None when it has no extension.

    The extension starts at the first dot of the basename.  Matches
    ``webdataset.tariterators.base_plus_ext`` exactly, corner cases included:
    ``a/.b`` gives key ``a/`` (the key may run back over a slash when the
    basename starts with a dot), and a directory part holding a newline counts
    as if the key started at the name's beginning.
    """
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= 0:
        return None
    # The key must end in a dot-free run of at least one character that starts
    # at the name's beginning or just after a slash; WebDataset's pattern can
    # only start that run after a slash when no newline comes before it.
    newline = name.find("\n")
    limit = dot - 1 if newline < 0 else min(dot - 1, newline)
    start = name.rfind("/", 0, limit) + 1
    if name.find(".", start, dot) >= 0:
        return None
    return name[:dot], name[dot + 1 :]


def is_meta_name(name: str) -> bool:
    """True for names WebDataset skips as metadata: a first component ``__like_this__``.

    That is ``__x__`` alone or as the leading folder (``__x__/y.json``), or a
    slash-free name that merely starts and ends with ``__`` (``___`` too).
    ``__x__.json`` is *not* skipped: it is the sample ``__x__``.
    """
    first, slash, _ = name.partition("/")
    if not first.startswith("__"):
        return False
    if slash:
        return len(first) >= 4 and first.endswith("__")
    # The pattern's "$" also matches before a final newline.
    return first.endswith("__") or (len(first) >= 5 and first.endswith("__\n"))


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


def _walk(
    buf: Buffer, url: str, *, prefix: bool = False, global_pax: dict[str, Any] | None = None
) -> Iterator[tuple[str, int, int, int]]:
    """``(name, payload offset, size, header offset)`` of each regular file, in archive order.

    The header offset is where the member's headers begin, extension headers
    included: a walk started there reads the member again.  Follows tarfile's
    reading of extension headers: a chain of them applies to the next real
    header, and where two set the same thing the first one in the archive wins.

    With ``prefix``, ``buf`` is the start of a tar still being written: the walk
    stops quietly where the data runs out instead of calling it truncated.
    ``global_pax``, if given, receives the global PAX records the walk meets.
    """
    end = len(buf)
    if end == 0:
        if prefix:
            return
        raise ShardError(url, "empty file, not a tar archive", offset=0)
    pos = 0
    global_pax = {} if global_pax is None else global_pax
    # Extension headers waiting for their member, and where the chain began.
    pending: list[tuple[bytes, Any]] = []
    chain_at = -1
    while pos < end:
        block = bytes(buf[pos : pos + BLOCK])
        if len(block) < BLOCK:
            if prefix or block.count(0) == len(block):
                break  # zero padding cut short: the archive had ended anyway
            raise ShardError(url, "truncated: archive ends inside a header", offset=pos)
        raw_name, raw_size, raw_sum, kind, raw_prefix = _HEADER.unpack_from(block)
        if raw_sum == _NO_CHECKSUM and block == _ZERO_BLOCK:
            break  # end-of-archive marker; tarfile stops at the first zero block too
        stored = _octal(raw_sum)
        if stored is None or not _checksum_matches(block, stored):
            raise ShardError(url, "bad tar header checksum", offset=pos)
        size = _size_field(raw_size)
        if size is None:
            raise ShardError(url, f"bad size field {raw_size!r}", offset=pos)
        data = pos + BLOCK

        if kind in (_LONG_NAME, _LONG_LINK, _PAX, _PAX_SOLARIS, _PAX_GLOBAL):
            stop = data + _padded(size)
            if stop > end:
                if prefix:
                    return
                raise ShardError(url, "truncated: extended header runs past the end", offset=pos)
            if chain_at < 0:
                chain_at = pos
            payload = bytes(buf[data : data + size])
            if kind == _LONG_NAME:
                pending.append((kind, _text(payload)))
            elif kind == _LONG_LINK:
                pending.append((kind, None))  # link targets are of no use here
            elif kind == _PAX_GLOBAL:
                global_pax.update(_pax_records(payload, is_global=True, url=url, offset=pos))
                pending.append((kind, None))  # tarfile wants a member after it too
            else:
                local = _pax_records(payload, is_global=False, url=url, offset=pos)
                pending.append((_PAX, {**global_pax, **local}))
            pos = stop
            continue

        if kind == _SPARSE:
            raise ShardError(url, "GNU sparse members are not supported", offset=pos)
        name = _text(raw_name)
        if kind == b"\0" and name.endswith("/"):
            kind = b"5"  # the old V7 way of writing a directory
        if raw_prefix[0]:
            name = _text(raw_prefix) + "/" + name
        if "path" in global_pax:
            name = global_pax["path"].rstrip("/")
        # Innermost first, so the outermost extension header has the last word.
        for ext_kind, value in reversed(pending):
            if ext_kind == _LONG_NAME:
                name = value
            elif ext_kind == _PAX:
                if "path" in value:
                    name = value["path"].rstrip("/")
                size = value.get("size", size)
        pending.clear()
        at, chain_at = (chain_at if chain_at >= 0 else pos), -1

        if kind in _DATALESS:
            pos = data
            continue
        stop = data + _padded(size)
        if stop > end:
            if prefix:
                return
            raise ShardError(
                url, f"truncated: member {name!r} ({size} bytes) runs past the end", offset=pos
            )
        if kind in _REGULAR:
            yield name, data, size, at
        pos = stop
    if pending and not prefix:
        raise ShardError(url, "extended header without a member after it", offset=chain_at)


def members(buf: Buffer, *, url: str) -> list[Member]:
    """Every regular file in the uncompressed tar ``buf``, in archive order (no grouping)."""
    return [Member(name, offset, size) for name, offset, size, _ in _walk(buf, url)]


def scan(buf: Buffer, *, url: str) -> list[SampleSpan]:
    """The samples of the uncompressed tar ``buf``, grouped by WebDataset's rules.

    Reads headers only: payloads are located, never copied, and nothing is
    allocated from a declared size.  ``buf`` is any bytes-like object with byte
    items (an mmap of a shard, or decompressed bytes); ``url`` names the shard
    in errors.  Raises :class:`ShardError` for a damaged or unreadable shard.
    """
    return [span for span, _ in _group(_walk(buf, url), url)]


def _group(walk: Iterator[tuple[str, int, int, int]], url: str, base: int = 0) -> Iterator[tuple[SampleSpan, int]]:
    """Samples of a walk, each with the header offset of its first member; offsets shifted by ``base``."""
    key: str | None = None
    fields: list[tuple[str, int, int]] = []
    seen: set[str] = set()
    first_at = 0
    for name, offset, size, at in walk:
        if is_meta_name(name):
            continue
        split = split_name(name)
        if split is None:
            continue
        member_key, ext = split[0], split[1].lower()
        if member_key != key:
            if key is not None:
                yield SampleSpan(key, tuple(fields)), first_at
            key, fields, seen, first_at = member_key, [], set(), base + at
        if ext in seen or ext in _RESERVED_EXTS:
            raise ShardError(
                url, f"member {name!r}: extension {ext!r} repeated in sample {key!r}",
                offset=base + offset - BLOCK,
            )
        seen.add(ext)
        fields.append((ext, base + offset, size))
    if key is not None:
        yield SampleSpan(key, tuple(fields)), first_at


class _FileSpan:
    """Bytes ``[start, end)`` of an open file as a sliceable buffer, read with ``pread``.

    Reads go in blocks of at least ``_READ_AHEAD`` bytes, so walking the headers
    of small members costs one call per block, not one per header.
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


class NotYet(Exception):
    """A growing shard does not hold the sample asked for (its download started over)."""


class GrowingShard:
    """The complete samples so far of a plain tar that is still being downloaded.

    A sample is complete once a member of the next sample has arrived, so the
    last one is known only from the finished file (read that with
    :func:`open_shard`).  Each :meth:`refresh` walks only the headers that
    arrived since the last complete sample.  Payloads are read with ``pread``,
    never mapped: the download may truncate the file to start over, which would
    fault a mapping; here it only gives a short read (:class:`NotYet`).  A
    gzip'd download shows no samples: it is read once decompressed and published.
    """

    def __init__(self, path: str | os.PathLike[str], *, url: str) -> None:
        self.url, self.path = url, os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)  # FileNotFoundError: no download under way
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

    def refresh(self) -> None:
        """Take in what the download has written since the last call.

        FileNotFoundError when the file is gone (published, or the download ended):
        the samples already found stay readable, but no more will come here.
        """
        if os.stat(self.path).st_ino != os.fstat(self._fd).st_ino:
            # A new download of the shard started in a new file: follow it.
            fd = os.open(self.path, os.O_RDONLY)
            os.close(self._fd)
            self._fd = fd
            self._reset()
        size = os.fstat(self._fd).st_size
        if size < self._size:
            self._reset()  # truncated: the download started over
        self._size = size
        if self._gzip is None and size >= 2:
            self._gzip = os.pread(self._fd, 2, 0) == GZIP_MAGIC
        if self._gzip is not False:
            return
        start = 0 if self._from_start else self._resume
        if size - start < 2 * BLOCK:
            return
        pax: dict[str, Any] = {}
        buf = _FileSpan(self._fd, start, size)  # headers are read in blocks: payloads are skipped
        try:
            groups = list(_group(_walk(buf, self.url, prefix=True, global_pax=pax), self.url, base=start))
        except ShardError as exc:
            problem = tar_problem(os.pread(self._fd, HEAD_BYTES, 0)) if start == 0 and exc.offset == 0 else None
            if problem:  # say what came instead of a tar (an HTML page served with status 200, say)
                raise ShardError(self.url, problem, offset=0) from None
            raise
        done = [span for span, _ in groups[:-1]]
        if pax or self._from_start:
            # A global PAX header: where exactly it took effect is not tracked, so from now
            # on every look walks from the start (rare in WebDataset shards).
            self._from_start = True
            if start > 0:
                self.refresh()  # this walk began after it: its indices would be shifted
                return
            self.samples = done
        elif groups:
            self.samples.extend(done)
            self._resume = groups[-1][1]

    def complete(self, fd: int, url: str) -> list[SampleSpan] | None:
        """All samples of the finished file open as ``fd``, if it is the file we have been
        reading (a published download keeps its inode): those found so far, plus a walk
        of the rest. None if it is another file, or if we kept no usable place to resume."""
        if self._gzip is not False or self._from_start or os.fstat(fd).st_ino != os.fstat(self._fd).st_ino:
            return None
        size = os.fstat(fd).st_size
        try:
            rest = [span for span, _ in _group(_walk(_FileSpan(fd, self._resume, size), url), url,
                                               base=self._resume)]
        except ShardError as exc:  # its offset counted from where this walk began
            raise ShardError(url, exc.reason, offset=None if exc.offset is None else exc.offset + self._resume)
        return self.samples + rest

    def read(self, i: int) -> tuple[SampleSpan, bytes, int]:
        """Sample ``i`` (complete by :meth:`refresh`): its span, and the bytes from its first
        field's start to its last field's end, read in one call, with the offset they start at."""
        span = self.samples[i]
        first = span.fields[0][1]
        last = span.fields[-1][1] + span.fields[-1][2]
        data = os.pread(self._fd, last - first, first)
        if len(data) < last - first:
            raise NotYet(f"{self.url}: sample {i} is not in the file any more (its download started over)")
        return span, data, first

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PackedSamples(Sequence[SampleSpan]):
    """A shard's samples in about a tenth of the memory of their :class:`SampleSpan` list:
    the keys joined in one string, each sample's extensions as an index into the shard's
    distinct extension tuples, and every (offset, size) in one flat array. A read-only
    sequence: each :class:`SampleSpan` is built when asked for, so opening a shard does
    not rebuild them all."""

    __slots__ = ("keys", "key_ends", "layouts", "layout_of", "starts", "numbers")

    def __init__(self, samples: Sequence[SampleSpan]) -> None:
        layouts: dict[tuple[str, ...], int] = {}
        self.keys = "".join(span.key for span in samples)
        self.key_ends = array("q")
        self.layout_of = array("i")
        self.starts = array("q")  # where each sample's numbers begin
        self.numbers = array("q")
        end = 0
        for span in samples:
            end += len(span.key)
            self.key_ends.append(end)
            exts = tuple(ext for ext, _, _ in span.fields)
            self.layout_of.append(layouts.setdefault(exts, len(layouts)))
            self.starts.append(len(self.numbers))
            for _, offset, size in span.fields:
                self.numbers.append(offset)
                self.numbers.append(size)
        self.layouts = list(layouts)

    def parts(self) -> tuple[list[list[str]], list[bytes]]:
        """The packed form as JSON-able layouts and raw frames, for another process of the agent."""
        frames = [self.keys.encode("utf-8", "surrogatepass"), self.key_ends.tobytes(),
                  self.layout_of.tobytes(), self.starts.tobytes(), self.numbers.tobytes()]
        return [list(exts) for exts in self.layouts], frames

    @classmethod
    def from_parts(cls, layouts: Any, frames: Sequence[bytes], file_size: int) -> PackedSamples:
        """Samples rebuilt from :meth:`parts`. ValueError unless they are consistent and every
        payload lies inside a file of ``file_size`` bytes: a bad table must not make anyone
        read outside the shard."""
        if not (isinstance(layouts, list)
                and all(isinstance(exts, list) and exts and all(isinstance(e, str) for e in exts) for exts in layouts)):
            raise ValueError("layouts must be non-empty lists of extensions")
        if len(frames) != 5:
            raise ValueError(f"expected 5 frames, got {len(frames)}")
        self = cls.__new__(cls)
        self.keys = bytes(frames[0]).decode("utf-8", "surrogatepass")
        self.layouts = [tuple(exts) for exts in layouts]
        self.key_ends, self.layout_of, self.starts, self.numbers = array("q"), array("i"), array("q"), array("q")
        for arr, raw in zip((self.key_ends, self.layout_of, self.starts, self.numbers), frames[1:]):
            arr.frombytes(bytes(raw))  # ValueError unless a whole number of items
        n = len(self.key_ends)
        if len(self.layout_of) != n or len(self.starts) != n:
            raise ValueError("tables of different lengths")
        if n and (self.key_ends[0] < 0 or self.key_ends[-1] != len(self.keys)
                  or any(a > b for a, b in zip(self.key_ends, self.key_ends[1:]))):
            raise ValueError("key ends out of order")
        at = 0
        for start, layout in zip(self.starts, self.layout_of):
            if start != at or not 0 <= layout < len(self.layouts):
                raise ValueError("sample tables do not match")
            at += 2 * len(self.layouts[layout])
        numbers = self.numbers
        if at != len(numbers) or (numbers and (min(numbers) < 0 or max(map(operator.add, numbers[::2],
                                                                            numbers[1::2])) > file_size)):
            raise ValueError("payloads outside the file")
        return self

    def __len__(self) -> int:
        return len(self.key_ends)

    @overload
    def __getitem__(self, i: int) -> SampleSpan: ...
    @overload
    def __getitem__(self, i: slice) -> list[SampleSpan]: ...
    def __getitem__(self, i: int | slice) -> SampleSpan | list[SampleSpan]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("sample index out of range")
        exts = self.layouts[self.layout_of[i]]
        at, numbers = self.starts[i], self.numbers
        return SampleSpan(
            self.keys[self.key_ends[i - 1] if i else 0 : self.key_ends[i]],
            tuple(zip(exts, numbers[at : at + 2 * len(exts) : 2], numbers[at + 1 : at + 2 * len(exts) : 2])),
        )

    def placed(self, i: int) -> tuple[str, tuple[str, ...], list[int]]:
        """Sample ``i`` (``0 <= i < len(self)``) as :func:`placed` gives it, read straight
        from the tables: a worker serving a read needs no :class:`SampleSpan`."""
        exts = self.layouts[self.layout_of[i]]
        at = self.starts[i]
        return self.keys[self.key_ends[i - 1] if i else 0 : self.key_ends[i]], exts, \
            self.numbers[at : at + 2 * len(exts)].tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # compared by content, like a list


def placed(samples: Sequence[SampleSpan], i: int) -> tuple[str, tuple[str, ...], list[int]]:
    """Sample ``i`` of ``samples``: its key, its extensions and ``[offset, size, ...]`` of
    its fields, in archive order."""
    if isinstance(samples, PackedSamples):
        return samples.placed(i)
    span = samples[i]
    return span.key, tuple(ext for ext, _, _ in span.fields), [x for _, off, size in span.fields for x in (off, size)]


class SampleIndex:
    """Where the samples lie in shards opened before, so that opening one again is not a
    walk over all its tar headers (for a shard of 1 KB samples, the bulk of serving it).

    Entries are keyed by URL and by the identity of the file (device, inode, size,
    modification time): a shard downloaded again is a new file and is walked again,
    never served with another version's offsets.  Holds at most ``max_samples``
    samples, about 100 bytes each; the least recently used shards go first.  Belongs
    to one process (nothing here is shared or locked).
    """

    def __init__(self, max_samples: int) -> None:
        self.max_samples = max_samples
        self._entries: OrderedDict[str, tuple[tuple[int, ...], PackedSamples]] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def samples(self) -> int:
        """How many samples the index holds, over all its shards."""
        return self._held

    def get(self, url: str, identity: tuple[int, ...]) -> PackedSamples | None:
        """The samples of ``url`` if they were found in the file with this identity."""
        entry = self._entries.get(url)
        if entry is None or entry[0] != identity:
            return None
        self._entries.move_to_end(url)
        return entry[1]

    def discard(self, url: str) -> None:
        """Forget ``url`` (its file is gone: the entry would only push live ones out)."""
        old = self._entries.pop(url, None)
        if old is not None:
            self._held -= len(old[1])

    def put(self, url: str, identity: tuple[int, ...], samples: Sequence[SampleSpan]) -> PackedSamples | None:
        """Remember ``samples`` as those of ``url`` in the file with this identity; returns
        them packed, or None if they are more than the index may hold."""
        self.discard(url)
        if len(samples) > self.max_samples:
            return None
        packed = samples if isinstance(samples, PackedSamples) else PackedSamples(samples)
        self._entries[url] = (identity, packed)
        self._held += len(packed)
        while self._held > self.max_samples:
            self._held -= len(self._entries.popitem(last=False)[1][1])
        return packed


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one file from another at the same path: a new download is a new inode
    (an inode number can be reused after a delete, so size and mtime count too)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def gunzip(read: Callable[[int], bytes], *, url: str) -> Iterator[bytes]:
    """The tar inside a gzip file read with ``read(n)``, in pieces of at most ``GZIP_OUT``
    bytes, so that memory stays bounded however far the data expands. All members are
    joined; trailing zero padding is allowed. Corrupt or truncated data: ShardError
    (offsets in the .gz file)."""
    inflater = None
    pending, pos, full = b"", 0, False
    while True:
        if inflater is None:
            if len(pending) < 2:
                pending += read(_GZIP_IN)
            if not pending:
                return
            if pending[:2] != GZIP_MAGIC:
                while pending:
                    if pending.strip(b"\0"):
                        raise ShardError(url, "data after the gzip stream is not gzip", offset=pos)
                    pos += len(pending)
                    pending = read(_GZIP_IN)
                return
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif not pending and not full:  # a full piece may leave output inside zlib: ask again first
            pending = read(_GZIP_IN)
            if not pending:
                raise ShardError(url, "truncated gzip stream", offset=pos)
        try:
            out = inflater.decompress(pending, GZIP_OUT)
        except zlib.error as exc:
            raise ShardError(url, f"corrupt gzip data ({exc}); the offset is in the .gz file", offset=pos) from None
        rest = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
        pos += len(pending) - len(rest)
        pending, full = rest, len(out) >= GZIP_OUT
        if inflater.eof:
            inflater, full = None, False
        if out:
            yield out


class ShardView:
    """A cached shard's tar, mapped read-only, and its samples.

    Payloads are memoryviews into that memory unless ``copy=True`` asks for
    ``bytes``: use them before :meth:`close`.  Closing never invalidates a view
    still alive (the mapping then lasts until the last one is freed), but it is
    the only point where the file's memory is given back promptly.
    """

    def __init__(self, data: mmap.mmap, *, url: str, samples: Sequence[SampleSpan],
                 identity: tuple[int, ...] = ()) -> None:
        self.url = url
        self.identity = identity  # of the file opened (file_identity), when opened from one
        self._data: mmap.mmap | None = data
        self._view: memoryview | None = memoryview(data).toreadonly()
        self._samples = samples

    def __enter__(self) -> ShardView:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._view is None

    @property
    def data(self) -> memoryview:
        """The whole uncompressed tar, read-only: the offsets of :attr:`samples` index into it."""
        if self._view is None:
            raise ValueError("shard view is closed")
        return self._view

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
        if self._data is not None and end > start:
            first = start - start % mmap.PAGESIZE
            self._data.madvise(mmap.MADV_DONTNEED, first, min(end, len(self._data)) - first)

    def close(self) -> None:
        """Give back the shard's memory; idempotent."""
        view, self._view = self._view, None
        if view is None:
            return
        try:
            view.release()
            self._data.close()
        except BufferError:
            pass  # buffers handed out are still alive: the memory stays until they go
        self._data = None

    def _build(self, span: SampleSpan, copy: bool) -> Sample:
        view = self.data
        sample: Sample = {"__key__": span.key, "__url__": self.url}
        for ext, offset, size in span.fields:
            payload = view[offset : offset + size]
            sample[ext] = payload.tobytes() if copy else payload
        return sample


def open_shard(
    path: str | os.PathLike[str], *, url: str, known: GrowingShard | None = None, index: SampleIndex | None = None
) -> ShardView:
    """Open a cached shard, a plain tar, for reading (the agent caches a gzip'd shard
    decompressed: see :mod:`wdscache.fetch`; a gzip'd file here is a ShardError).

    ``known``: the view of this shard's download, whose samples need not be found again.
    ``index``: where the samples of shards opened before are kept; the file opened here
    is looked up by its identity (not by its path, which a new download may take meanwhile).
    """
    with open(path, "rb") as f:
        identity = file_identity(os.fstat(f.fileno()))
        samples: Sequence[SampleSpan] | None = index.get(url, identity) if index is not None else None
        indexed = samples is not None
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ShardError(url, "empty file, not a tar archive", offset=0) from None
        try:
            if os.pread(f.fileno(), 2, 0) == GZIP_MAGIC:
                raise ShardError(url, "gzip'd data in the cache (shards are cached decompressed)", offset=0)
            # Scanned with pread, not through the mapping: faulting in every header page
            # would bring most of the file into our RSS (the kernel maps pages around each fault).
            if samples is None and known is not None:
                samples = known.complete(f.fileno(), url)
            if samples is None:
                samples = [span for span, _ in _group(_walk(_FileSpan(f.fileno(), 0, len(mapped)), url), url)]
        except BaseException:
            mapped.close()
            raise
    if index is not None and not indexed:
        samples = index.put(url, identity, samples) or samples  # kept packed, unless too many
    return ShardView(mapped, url=url, samples=samples, identity=identity)


def iter_samples(path: str | os.PathLike[str], *, url: str) -> Iterator[Sample]:
    """Every sample of the shard at ``path``, with ``bytes`` payloads (copies)."""
    with open_shard(path, url=url) as shard:
        yield from shard.iter_samples(copy=True)
