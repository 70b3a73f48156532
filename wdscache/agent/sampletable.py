"""Sample tables: where each sample's fields lie in a shard's file, packed small.

A :class:`PackedSamples` is one shard's table (its keys, extensions and
``(offset, size)`` of every field) in about a tenth of the memory of a list of
:class:`~wdscache.shared.samples.SampleSpan`; :class:`SampleTables` keeps the tables of
shards opened before, so that opening one again is not a walk over its headers.

A table passed from another process of the agent is not trusted:
:meth:`PackedSamples.from_parts` checks that its parts agree and that every
payload lies inside the file, so a bad table cannot make anyone read outside the
shard.  A kept table is tied to the identity of the file it was found in
(device, inode, size, modification time), never only to a URL or path, so a
shard downloaded again is never served with another version's offsets.  A
:class:`PackedSamples` is read-only once built; :class:`SampleTables` is not
locked: it belongs to one process (a worker's).

A table also outlives the agent in a **table file** (:func:`table_file`, kept by
:mod:`wdscache.agent.table_files` under ``CACHE_DIR/tables/``), so an
agent started again does not walk every cached shard once more. A table file is read
(:func:`read_table_file`) only if it names the identity of the cache file as it is now and
its digest matches its bytes, and then checked as a table passed on is: a torn, stale,
damaged or foreign file is walked again, never served.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain
from typing import Any, overload

from ..shared.samples import SampleSpan

TABLE_MAGIC = b"wdscache sample table 1\n"
_HEADER_MAX = 1 << 20  # a table file's JSON line (identity, layouts, frame sizes) is shorter


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
        frames = [
            self.keys.encode("utf-8", "surrogatepass"),
            self.key_ends.tobytes(),
            self.layout_of.tobytes(),
            self.starts.tobytes(),
            self.numbers.tobytes(),
        ]
        return [list(exts) for exts in self.layouts], frames

    @classmethod
    def from_parts(cls, layouts: Any, frames: Sequence[bytes], file_size: int) -> PackedSamples:
        """Samples rebuilt from :meth:`parts`. ValueError unless they are consistent and every
        payload lies inside a file of ``file_size`` bytes: a bad table must not make anyone
        read outside the shard."""
        if not (
            isinstance(layouts, list)
            and all(isinstance(exts, list) and exts and all(isinstance(e, str) for e in exts) for exts in layouts)
        ):
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
        if n and (
            self.key_ends[0] < 0
            or self.key_ends[-1] != len(self.keys)
            or any(a > b for a, b in zip(self.key_ends, self.key_ends[1:]))
        ):
            raise ValueError("key ends out of order")
        at = 0
        for start, layout in zip(self.starts, self.layout_of):
            if start != at or not 0 <= layout < len(self.layouts):
                raise ValueError("sample tables do not match")
            at += 2 * len(self.layouts[layout])
        numbers = self.numbers
        if at != len(numbers) or (
            numbers and (min(numbers) < 0 or max(map(operator.add, numbers[::2], numbers[1::2])) > file_size)
        ):
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
        return (
            self.keys[self.key_ends[i - 1] if i else 0 : self.key_ends[i]],
            exts,
            self.numbers[at : at + 2 * len(exts)].tolist(),
        )

    def run_of(self, i: int, n: int) -> tuple[list[str], int, array[int]] | None:
        """Samples ``i`` to ``i + n - 1`` (``0 <= i``, ``i + n <= len(self)``, ``n >= 1``) at
        once, if they have one tuple of extensions: their keys, its index in ``layouts``, and
        their ``[offset, size, ...]`` one after another (a worker serving them in archive
        order builds its reply from these slices, not sample by sample). None if they differ."""
        layout = self.layout_of[i]
        if n > 1 and self.layout_of[i : i + n].count(layout) != n:
            return None
        ends, keys = self.key_ends, self.keys
        firsts = ends[i - 1 : i + n - 1] if i else chain((0,), ends[: n - 1])
        at = self.starts[i]
        return (
            [keys[a:b] for a, b in zip(firsts, ends[i : i + n])],
            layout,
            self.numbers[at : at + 2 * len(self.layouts[layout]) * n],
        )

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


class SampleTables:
    """The sample tables of shards opened before, so that opening one again is not a
    walk over all its tar headers (for a shard of 1 KB samples, the bulk of serving it).

    Tables are keyed by URL and by the identity of the file (device, inode, size,
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
    def sample_count(self) -> int:
        """How many samples the tables hold, over all their shards."""
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
        them packed, or None if they are more than the tables may hold."""
        self.discard(url)
        if len(samples) > self.max_samples:
            return None
        packed = samples if isinstance(samples, PackedSamples) else PackedSamples(samples)
        self._entries[url] = (identity, packed)
        self._held += len(packed)
        while self._held > self.max_samples:
            self._held -= len(self._entries.popitem(last=False)[1][1])
        return packed


def table_file(identity: Sequence[int], layouts: Any, frames: Sequence[bytes]) -> bytes:
    """The bytes of a table file: :data:`TABLE_MAGIC`, a JSON line (the cache file's
    ``identity``, the ``layouts`` and frame sizes of :meth:`PackedSamples.parts`), the
    BLAKE2b digest of that line and the frames in hex on a line, then the frames."""
    line = json.dumps(
        {"identity": list(identity), "layouts": layouts, "sizes": [len(f) for f in frames]}, separators=(",", ":")
    ).encode()
    digest = hashlib.blake2b(line, digest_size=16)
    for frame in frames:
        digest.update(frame)
    return b"".join([TABLE_MAGIC, line, b"\n", digest.hexdigest().encode(), b"\n", *frames])


def read_table_file(path: str | os.PathLike[str], identity: tuple[int, ...]) -> PackedSamples | None:
    """The table kept at ``path`` for the cache file of ``identity``: None if there is
    none, or if it was written for another file (a copy downloaded since). ValueError if
    it is not a whole table file, its digest does not match, or its table is not consistent
    with a file of that size (see :meth:`PackedSamples.from_parts`)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    header, end = _header(data)
    if header.get("identity") != list(identity):
        return None
    line = data[len(TABLE_MAGIC) : end]
    digest_end = end + 1 + 32
    sizes = header["sizes"]
    if not all(type(n) is int and n >= 0 for n in sizes) or sum(sizes) != len(data) - digest_end - 1:
        raise ValueError("a sample table file cut short, or too long")
    frames, at = [], digest_end + 1
    for n in sizes:
        frames.append(data[at : at + n])
        at += n
    digest = hashlib.blake2b(line, digest_size=16)
    for frame in frames:
        digest.update(frame)
    if data[end + 1 : digest_end] != digest.hexdigest().encode() or data[digest_end : digest_end + 1] != b"\n":
        raise ValueError("a sample table file whose digest does not match its bytes")
    return PackedSamples.from_parts(header.get("layouts"), frames, identity[2])


def table_file_holds(path: str | os.PathLike[str], identity: tuple[int, ...]) -> bool:
    """Whether the table file at ``path`` is one :func:`read_table_file` takes for ``identity``."""
    try:
        return read_table_file(path, identity) is not None
    except (OSError, ValueError):
        return False


def _header(data: bytes) -> tuple[dict[str, Any], int]:
    """A table file's JSON line, and where it ends; ValueError if ``data`` is not a table file."""
    end = data.find(b"\n", len(TABLE_MAGIC), len(TABLE_MAGIC) + _HEADER_MAX)
    if not data.startswith(TABLE_MAGIC) or end < 0:
        raise ValueError("not a sample table file")
    header = json.loads(data[len(TABLE_MAGIC) : end])
    if not isinstance(header, dict) or not isinstance(header.get("sizes"), list):
        raise ValueError("not a sample table file")
    return header, end
