"""One shard downloaded as several ranged parts at once, assembled into its partial file.

A shard larger than one part (``--download-part-size``), from a source that answers
ranged requests with a validator (an HTTP server's 206 with an ETag or Last-Modified;
S3 always), is fetched as parts of that size, up to ``--download-parts`` of them at
once, each over its own connection. The partial file stays what readers of a growing
shard (:mod:`wdscache.agent.growing`) and a restart rely on: a contiguous prefix of the
shard, nothing else. So:

- The part that starts where the partial file ends (the first one, then each next
  one taken once its predecessors are in) is written straight into the partial file,
  as it arrives: a reader of the shard is served from the first bytes on.
- Every other part goes to a side file, ``partial/<name>~part-<start>-<end>``, that
  holds bytes ``start`` onwards of the range ``start``-``end``. When the prefix
  reaches a complete side file, its bytes are appended to the partial file in the
  kernel (``os.copy_file_range``), written back, and the side file is removed. The
  partial file never holds a hole, and never grows past bytes not yet received.
- Every ranged request names the version the first answer came with (``If-Range``,
  S3's ``If-Match``) and must come back as that range of that version, with its
  validator: any other answer (a 200, a 412, a 416, another ETag or size, no
  validator) means the object changed, and the
  download starts over from byte 0 with every side file removed, never spliced.
- A cut connection retries its own part from the bytes it holds; a side file kept at a
  cancel or a crash is resumed by its name (which says its range), and one that does
  not fit the shard's plan is removed.
- Budget: the parts hold at most the shard's size between them; an append briefly
  holds a part's bytes twice, so a parted download reserves its size plus its largest
  part (the caller falls back to one connection when the budget cannot hold that).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

SIDE = "~part-"  # "~" is in no partial file's name (see wdscache.shared.layout)


def side_path(partial: Path, start: int, end: int) -> Path:
    """The side file of the part ``start``-``end`` (end exclusive) of ``partial``'s shard."""
    return partial.with_name(f"{partial.name}{SIDE}{start}-{end}")


def owner_name(name: str) -> str:
    """The partial file name a side file belongs to (``name`` itself for any other file)."""
    return name.split(SIDE, 1)[0]


def side_files(partial: Path) -> list[tuple[int, int, Path]]:
    """The side files of ``partial``'s shard, as (start, end, path), by start. A file with a
    side file's prefix but no valid range in its name is removed."""
    prefix = partial.name + SIDE
    found = []
    try:
        entries = list(os.scandir(partial.parent))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        start, _, end = entry.name[len(prefix) :].partition("-")
        if start.isdigit() and end.isdigit() and int(start) < int(end):
            found.append((int(start), int(end), Path(entry.path)))
        else:
            _unlink(Path(entry.path))
    return sorted(found)


def side_bytes(partial: Path) -> int:
    """Bytes held in ``partial``'s side files."""
    return sum(file_size(path) for _, _, path in side_files(partial))


def remove_side_files(partial: Path) -> None:
    for _, _, path in side_files(partial):
        _unlink(path)


@dataclass
class ByteRange:
    """A byte range of a parted download, one part: bytes ``start`` to ``end`` (exclusive) of the
    shard; ``have`` of them are written."""

    start: int
    end: int
    side: Path | None = None  # None: written straight into the partial file
    have: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start


class Stopped(Exception):
    """Another part failed, or the download was cancelled: this part stops."""


class Plan:
    """The parts of one download and where their bytes are; shared by its threads.

    ``prefix`` is the length of the partial file's complete prefix; parts are taken in
    order of their start by :meth:`take` and handed back by :meth:`finish`.
    """

    def __init__(
        self, partial: Path, total: int, head: ByteRange, part_size: int, on_bytes: Callable[[int], None]
    ) -> None:
        self.partial, self.total = partial, total
        self.prefix = head.start
        self.head = head  # the first part, from the request that found the shard's size
        self._head_busy = True
        self._on_bytes = on_bytes
        self._lock = threading.Lock()
        self._todo: list[ByteRange] = []
        self._done: dict[int, ByteRange] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None
        at = head.end
        for start, end, path in side_files(partial):
            have = file_size(path)
            if start < at or end > total or have > end - start:
                _unlink(path)  # not a part of this plan (overlaps, or of another size): fetched again
                continue
            self._todo.extend(_split(at, start, part_size))
            part = ByteRange(start, end, path, have)
            if have == part.size:
                self._done[start] = part
            else:
                self._todo.append(part)
            at = end
        self._todo.extend(_split(at, total, part_size))

    @property
    def held(self) -> int:
        """Bytes of the shard on disk when the plan is made: the prefix and the side files kept."""
        return self.prefix + sum(p.have for p in self._todo) + sum(p.have for p in self._done.values())

    @property
    def largest(self) -> int:
        """The largest part still to be appended from a side file."""
        return max([p.size for p in self._todo] + [p.size for p in self._done.values()] + [0])

    @property
    def pending(self) -> int:
        return len(self._todo)

    def take(self) -> ByteRange | None:
        """The next part to fetch (None: none left, or the download stops)."""
        with self._lock:
            if self.stop.is_set() or not self._todo:
                return None
            part = self._todo.pop(0)
            if part.side is None:
                if part.start == self.prefix and not self._head_busy:
                    self._head_busy = True
                else:
                    part.side = side_path(self.partial, part.start, part.end)
            return part

    def wrote(self, part: ByteRange, n: int) -> None:
        """``n`` more bytes of ``part`` are written."""
        with self._lock:
            part.have += n
            self._on_bytes(n)

    def finish(self, part: ByteRange) -> None:
        """``part`` is complete: append whatever the prefix now reaches."""
        with self._lock:
            if part.side is None:
                self.prefix = part.end
                self._head_busy = False
            else:
                self._done[part.start] = part
            while self.prefix in self._done and not self.stop.is_set():
                done = self._done.pop(self.prefix)
                assert done.side is not None  # only parts written to side files wait in _done
                _append(self.partial, done.side, self.prefix, done.size)
                self.prefix = done.end

    def abort(self, exc: BaseException) -> None:
        """Stop every part; the first reason is kept."""
        with self._lock:
            if self.error is None:
                self.error = exc
            self.stop.set()

    @property
    def complete(self) -> bool:
        return self.prefix == self.total


def _split(start: int, end: int, size: int) -> Iterable[ByteRange]:
    return [ByteRange(s, min(s + size, end)) for s in range(start, end, size)]


def append_side(partial: Path, side: Path, at: int) -> int:
    """Append what ``side`` holds to ``partial`` (whose size is ``at``) and remove it; its size."""
    n = file_size(side)
    _append(partial, side, at, n)
    return n


def _append(partial: Path, side: Path, at: int, n: int) -> None:
    """Append the ``n`` bytes of ``side`` to ``partial`` (whose size is ``at``), write them
    back, then remove ``side``: a crash in between leaves both, and the side file is
    dropped as overlapping at the resume."""
    with open(side, "rb") as src, open(partial, "r+b") as dst:
        if os.fstat(dst.fileno()).st_size != at or os.fstat(src.fileno()).st_size != n:
            raise OSError(errno.EIO, f"{partial.name}: the partial file or its part changed under the download")
        copied = 0
        try:
            while copied < n:
                step = os.copy_file_range(src.fileno(), dst.fileno(), n - copied, copied, at + copied)
                if step == 0:
                    raise OSError(errno.EIO, f"{side.name} ended early")
                copied += step
        except (AttributeError, OSError) as exc:  # no copy_file_range here (macOS), or not across these files
            if isinstance(exc, OSError) and exc.errno not in (
                errno.ENOSYS,
                errno.EXDEV,
                errno.EINVAL,
                errno.EOPNOTSUPP,
                errno.EBADF,
            ):
                raise
            while copied < n:
                data = os.pread(src.fileno(), min(n - copied, 1 << 20), copied)
                os.pwrite(dst.fileno(), data, at + copied)
                copied += len(data)
        os.fsync(dst.fileno())
    side.unlink()


def file_size(path: Path) -> int:
    """``path``'s size; 0 when there is no such file."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
