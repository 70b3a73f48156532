"""Decoding a worker's answer to a read, in the training process: a pure function of the
reply's header and frames, the items asked for and, for direct reads, a file reader.

A reply (see :mod:`wdscache.agent.worker`) carries, per item asked for, its key and, in its
sample table (a frame of numbers), its member extensions (an index into the reply's
``layouts``) and a span: the index of the frame that holds it, then an offset and a size per
extension. With direct reads some "frames" are byte ranges of the agent's cache files,
named by the header's ``files`` and read here through the injected reader (a
:class:`~wdscache.training.direct.CacheFiles` in the loader).

Why no reply can make the consumer read outside what it was sent: every span is checked
against the length of its frame (or file range, which :class:`~wdscache.training.direct.CacheFiles`
checks against the file's size) before a byte is copied, and anything that is not a
well-formed number fails the reply as a :class:`~wdscache.shared.errors.ProtocolError`.
"""

from __future__ import annotations

import errno
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from operator import attrgetter, itemgetter
from typing import Any, Protocol

from ..shared.errors import ProtocolError
from ..shared.protocol import PREAD_BYTES, unpack_numbers
from .direct import StaleFile
from .reads import Item

_ID = itemgetter(1)  # an item's sample id
_SOURCE = attrgetter("source")  # a mixture's id's source (SourcedId.source)


class ReadableRange(Protocol):
    """Bytes of a cache file, read on demand (:class:`~wdscache.training.direct.FileRange`)."""

    def __len__(self) -> int: ...

    def read(self, offset: int, size: int) -> bytes: ...


class FileReader(Protocol):
    """Where a direct reply's file ranges are read (:class:`~wdscache.training.direct.CacheFiles`)."""

    def range(self, url: str, identity: Sequence[int], start: int, size: int) -> ReadableRange: ...


def decode_reply(
    header: dict[str, Any],
    payload: list[Any],
    items: list[Item],
    urls: Sequence[str],
    *,
    zero_copy: bool = False,
    direct: bool = False,
    files: FileReader | None = None,
    labelled: bool = False,
) -> tuple[list[dict[str, Any]], list[int]]:
    """The samples of a worker's reply to a read of ``items``, and the payload bytes of each.

    ``payload`` holds the reply's frames after the header (objects with a ``buffer``, as
    ZeroMQ's frames are): the sample table, then the runs; ``urls`` is the list the items'
    shards index. A reply naming file ranges is accepted only for a read sent with
    ``direct``, and read through ``files``: None there (direct reads were turned off since
    the read went out) raises :class:`~wdscache.training.direct.StaleFile`, as a file
    replaced since the worker read it does; the caller then asks for those samples over the
    socket.

    Payloads are ``bytes`` (webdataset's decoders want bytes), or read-only memoryviews into
    the received message with ``zero_copy``. With ``labelled`` (a mixture's read: every id a
    :class:`~wdscache.shared.mixture.SourcedId`), each sample names its source, ``__source__``.
    """
    keys, table, layouts = header.get("keys"), sample_table(payload), reply_layouts(header)
    if not (isinstance(keys, list) and len(keys) == len(items)):
        raise ProtocolError("worker reply does not match the request")
    frames: list[Any] = [memoryview(f.buffer).toreadonly() for f in payload[1:]]
    samples: list[dict[str, Any]] = []
    sizes: list[int] = []
    # Each shard's URL looked up once a reply (a list's lookup is a Python call), a dict's per sample.
    url_of = {shard: urls[shard] for shard in {sid[0] for _, sid in items}}
    # The per-sample loop: local names only, no call but the copy (or the file read).
    try:
        if "files" in header:
            if not direct:
                raise ProtocolError("worker reply names file ranges this consumer did not ask for")
            first = len(frames)
            frames += file_ranges(header["files"], items, urls, files)
            read_dense(frames, table, layouts, first)
        at = 0  # where the sample's numbers start in the table (none is negative: see unpack_numbers)
        for (_, (shard, _)), key in zip(items, keys):
            # Checked enough that no reply can make us read outside its frames: an index past
            # a list or the table fails the reply (IndexError).
            names = layouts[table[at]]
            frame = frames[table[at + 1]]
            limit = len(frame)
            sample: dict[str, Any] = {"__key__": key, "__url__": url_of[shard]}
            nbytes = 0
            i = at + 2
            if type(frame) is memoryview:
                for ext in names:
                    offset = table[i]
                    size = table[i + 1]
                    end = offset + size
                    i += 2
                    if end > limit:
                        raise ProtocolError("worker reply has a span past its frame")
                    sample[ext] = frame[offset:end] if zero_copy else frame[offset:end].tobytes()
                    nbytes += size
            else:  # a file range read payload by payload: its samples are large, or few and far apart
                for ext in names:
                    offset = table[i]
                    size = table[i + 1]
                    i += 2
                    if offset + size > limit:
                        raise ProtocolError("worker reply has a span past its frame")
                    sample[ext] = frame.read(offset, size)
                    nbytes += size
            at = i
            samples.append(sample)
            sizes.append(nbytes)
    except IndexError:
        raise ProtocolError("worker reply has a bad span") from None
    if at != len(table):
        raise ProtocolError("worker reply's sample table does not match its samples")
    if labelled:  # the last key, as it always was; map and zip run in C, leaving one store a sample
        for sample, source in zip(samples, map(_SOURCE, map(_ID, items))):
            sample["__source__"] = source
    return samples, sizes


def sample_table(payload: list[Any]) -> array[int]:
    """A ``samples`` reply's sample table, the first of its ``payload`` frames (see
    :mod:`wdscache.agent.worker`)."""
    if not payload:
        raise ProtocolError("worker reply has no sample table")
    return unpack_numbers(payload[0])


def reply_layouts(header: dict[str, Any]) -> list[tuple[str, ...]]:
    """A ``samples`` reply's ``layouts``: its samples' distinct tuples of extensions."""
    layouts = header.get("layouts")
    if not (
        isinstance(layouts, list)
        and all(isinstance(names, list) and names and all(type(e) is str for e in names) for names in layouts)
    ):
        raise ProtocolError("worker reply has bad layouts")
    return [tuple(names) for names in layouts]


def table_rows(table: array[int], layouts: list[tuple[str, ...]]) -> Iterator[tuple[tuple[str, ...], int, int]]:
    """Each sample's row of a reply's sample table: its extensions, its frame, and where its
    ``(offset, size)`` pairs start in ``table`` (a row cut short has fewer: the caller checks).
    IndexError for a row that names no layout or ends before its frame. :func:`decode_reply`
    walks the rows inline: a generator's step a sample is what the table saves."""
    at, end = 0, len(table)
    while at < end:
        names = layouts[table[at]]
        yield names, table[at + 1], at + 2
        at += 2 + 2 * len(names)


def read_dense(frames: list[Any], table: array[int], layouts: list[tuple[str, ...]], first: int) -> None:
    """Read whole, with one ``pread`` each, the file ranges among ``frames`` (from ``first``
    on) that are short next to the payloads they hold: at most :data:`PREAD_BYTES` per
    payload but one. One syscall per payload would cost more than copying the range once
    more (small samples in archive order, every other one of them for one of two DataLoader
    workers, or the few payloads of one small sample). The others (large samples, or a few
    scattered over a long range, as a shuffled read makes) stay ranges, read payload by
    payload. The table is only read here (a bad one can only make a range read whole or not):
    the caller checks each sample."""
    members = [0] * (len(frames) - first)
    widths = {len(names) for names in layouts}
    if len(widths) == 1:  # rows of one length: the column of frames is a slice, counted in C
        width = widths.pop()
        per_frame = Counter(table[1 :: 2 + 2 * width])
        for k in range(len(members)):
            members[k] = per_frame[first + k] * width
    else:
        for names, frame, _ in table_rows(table, layouts):
            k = frame - first
            if 0 <= k < len(members):
                members[k] += len(names)
    for k, m in enumerate(members):
        whole = len(frames[first + k])
        if m > 1 and whole <= PREAD_BYTES * (m - 1):
            frames[first + k] = memoryview(frames[first + k].read(0, whole))


def file_ranges(ranges: Any, items: list[Item], urls: Sequence[str], files: FileReader | None) -> list[ReadableRange]:
    """The byte ranges of cache files a reply names (its ``files``: per range the index of
    its shard among the read's shards, in the order the request named them, then start,
    size and the file's identity: device, inode, size, mtime)."""
    if files is None:  # a read sent before direct reads were turned off: asked again
        raise StaleFile(errno.ESTALE, "direct reads are off")
    if not isinstance(ranges, list):
        raise ProtocolError("worker reply has a bad file range")
    named_urls = [urls[shard] for shard in dict.fromkeys(sid[0] for _, sid in items)]  # as the request named them
    views = []
    named: dict[int, list[int]] = {}  # shard (its place in the request) -> its file's identity
    n_named = len(named_urls)
    for entry in ranges:  # per range: one per sample of a shuffled read, so kept to a few checks
        if type(entry) is not list or len(entry) != 7:
            raise ProtocolError("worker reply has a bad file range")
        k, start, size = entry[0], entry[1], entry[2]
        if not (type(k) is int and type(start) is int and type(size) is int and 0 <= k < n_named):
            raise ProtocolError("worker reply has a bad file range")
        if start < 0 or size < 0:
            raise ProtocolError("worker reply has a bad file range")
        identity = entry[3:]
        known = named.get(k)
        if known is None:  # each shard's identity checked once a reply; mtime may be before 1970
            if not all(type(x) is int for x in identity) or min(identity[:3]) < 0:
                raise ProtocolError("worker reply has a bad file range")
            named[k] = identity
        elif known != identity:  # equal lists of ints: the same file
            raise ProtocolError("worker reply names two files for one shard")
        views.append(files.range(named_urls[k], identity, start, size))
    return views
