"""A sample worker's reply frames: the runs of shard bytes a reply carries, cut into frames,
and the pages of the mapped shards they were cut from.

Runs of ``GATHER_BELOW`` bytes or more go zero-copy from the mapped shard, each a frame of its
own; shorter ones are copied together into one frame (the first) while the worker's copy
budget lasts; runs of a file the consumer reads itself become file ranges, never touched,
except those shorter than ``PREAD_BYTES``: a range costs the consumer a ``pread`` and its
checks, more than the copy of so few bytes costs both sides (a shuffled read of small
samples is a run per sample), so they are copied with the short runs while the budget lasts.

Guarantees (one worker's thread only):

- Copies are bounded: the copied bytes handed to ZeroMQ and not yet seen sent stay within
  ``GATHER_BUDGET`` (past it runs go zero-copy), each reply's within ``GATHER_MAX``, so
  neither slow consumers nor a peer that never reads can make a worker's memory grow.
- Served pages leave the worker's RSS: a zero-copy frame's pages once ZeroMQ has sent it
  (not before: they would only be faulted in again), a copied range at the next
  :meth:`ReplyFrames.drop_sent`, and the whole shard once none of its frames is left.
- A mapped shard stays mapped while a frame of it may still be queued: views are dropped,
  never closed, by the worker (their mapping goes once the frames are sent).
"""

from __future__ import annotations

from typing import Any

import zmq

from ..shared.protocol import PREAD_BYTES

# Runs shorter than this are copied into one frame per reply, at most GATHER_MAX bytes of
# them; the rest go zero-copy. pyzmq copies a frame under 64 KiB itself, but releases each
# larger zero-copy frame through its garbage-collector thread (an inproc message and a
# dict operation under the GIL): with one frame per 110 KB sample of a shuffled read, a
# worker's CPU per GB doubled. Copying a run this short costs less; a longer one goes zero-copy.
GATHER_BELOW = 256 << 10
GATHER_MAX = 8 << 20
# Copied bytes a worker may have handed to ZeroMQ and not yet seen sent. Copies are private
# memory (a mapped shard's pages are the kernel's to reclaim): past this, runs go zero-copy,
# so neither slow consumers nor a peer that never reads can make a worker's memory grow.
GATHER_BUDGET = 32 << 20


class ReplyFrames:
    """The frames of a worker's replies, the copies still queued, and the pages to drop."""

    def __init__(self) -> None:
        # Mapped shards served from lately, each with the ranges of it we copied (tracker None)
        # or that ZeroMQ may still be sending ((tracker, start, end)). Their pages must leave
        # our RSS, else a worker would keep every shard it served resident, up to OPEN_SHARDS
        # of them. ZeroMQ's I/O thread faults in what it sends, with many consumers tens of
        # ms after we hand it over: so a frame's pages are dropped once it has gone.
        self.served: dict[Any, list[tuple[zmq.MessageTracker | None, int, int]]] = {}
        self.copies: list[tuple[zmq.MessageTracker, int]] = []  # replies' copied frames not yet sent

    def of(
        self, runs: list[list[Any]], files: dict[Any, list[int]], *, ranges_only: bool = False
    ) -> tuple[list[Any], list[list[int]], list[tuple[int, int]]]:
        """A reply's frames, file ranges and runs' places for ``runs`` (see :meth:`make`), within the copy
        budget left; with ``ranges_only``, every run of ``files`` a file range, however short."""
        frames, ranges, places = self.make(runs, self.room(), files, ranges_only=ranges_only)
        if frames and isinstance(frames[0], zmq.Frame):
            self.copies.append((frames[0].tracker, len(frames[0])))
        return frames, ranges, places

    def room(self) -> int:
        """The bytes a reply may copy now: at most ``GATHER_MAX``, within what the copy budget has left."""
        self.copies = [(tracker, n) for tracker, n in self.copies if not tracker.done]
        return min(GATHER_MAX, GATHER_BUDGET - sum(n for _, n in self.copies))

    def gathered(self, pieces: list[memoryview], views: list[Any]) -> zmq.Frame:
        """One frame of ``pieces`` copied together (fitting in :meth:`room`), counted against the
        copy budget until ZeroMQ has sent it; ``views`` are the mapped shards they were cut
        from, whose pages go at the next :meth:`drop_sent`."""
        frame = zmq.Frame(b"".join(pieces), track=True)
        self.copies.append((frame.tracker, len(frame)))
        for view in views:
            self.served.setdefault(view, []).append((None, 0, len(view.data)))
        return frame

    def forget(self, view: Any) -> None:
        """``view`` was let go (its file evicted or replaced): its pages go with its mapping."""
        self.served.pop(view, None)

    def drop_sent(self) -> None:
        """Drop from our RSS the served pages whose frames have gone."""
        for view, frames in list(self.served.items()):
            gone: list[Any] = []
            sending: list[Any] = []
            for frame in frames:
                (sending if frame[0] is not None and not frame[0].done else gone).append(frame)
            if not sending:  # one call for all of it (a shuffled read copies many scattered runs)
                view.drop_pages(0, len(view.data))
                del self.served[view]
                continue
            for _, start, end in gone:
                view.drop_pages(start, end)
            self.served[view] = sending

    def zero_copy(self, view: Any, start: int, piece: memoryview) -> Any:
        """``piece`` (at ``start`` in ``view``) as a frame sent from the mapping, tracked until
        it has gone (see ``served``)."""
        if len(piece) < zmq.COPY_THRESHOLD:
            self.served[view].append((None, start, start + len(piece)))  # pyzmq copies it as we send
            return piece
        frame = zmq.Frame(piece, copy=False, track=True)
        self.served[view].append((frame.tracker, start, start + len(piece)))
        return frame

    def make(
        self, runs: list[list[Any]], room: int, files: dict[Any, list[int]], *, ranges_only: bool = False
    ) -> tuple[list[Any], list[list[int]], list[tuple[int, int]]]:
        """The reply's frames and file ranges for ``runs`` (``[view, start, end]``: bytes of a
        mapped shard, :class:`~wdscache.agent.shardview.ShardView`), and
        each run's place: the number of the frame that holds it (file ranges numbered after
        the frames) and where in that frame its first byte lies.

        Runs of ``files`` (views the consumer reads itself) of ``PREAD_BYTES`` or more become
        file ranges; short runs (two or more) are copied together, up to ``room`` bytes, into
        the first frame (a tracked :class:`zmq.Frame`); the others go as they are (zero-copy,
        unless pyzmq copies a small one itself), or as file ranges if of ``files``. With
        ``ranges_only``, every run of ``files`` is a file range.
        """
        frames: list[Any] = []
        ranges: list[list[int]] = []
        short: list[Any] = []
        copied = 0
        where: list[tuple[str, int]] = []  # run -> ("frame", number), ("file", number) or ("short", offset)
        for source, start, end in runs:
            ref = files.get(source) if files else None
            # A range worth its pread, or one the room left cannot copy.
            if ref is not None and (ranges_only or end - start >= PREAD_BYTES or copied + end - start > room):
                where.append(("file", len(ranges)))
                ranges.append([ref[0], start, end - start, *ref[1:]])  # never touched here
                continue
            piece = source.data[start:end]
            self.served.setdefault(source, [])  # its pages are mapped in as we copy or send
            if len(piece) < GATHER_BELOW and copied + len(piece) <= room:
                where.append(("short", copied))
                short.append((source, start, piece))
                copied += len(piece)
            else:
                where.append(("frame", len(frames)))
                frames.append(self.zero_copy(source, start, piece))
        if len(short) == 1:  # nothing to save by copying: it goes as it is
            where = [("frame", len(frames)) if kind == "short" else (kind, n) for kind, n in where]
            source, start, piece = short[0]
            frames.append(self.zero_copy(source, start, piece))
        elif short:
            # Tracked: the copy counts against the budget until ZeroMQ has sent it.
            frames.insert(0, zmq.Frame(b"".join(piece for _, _, piece in short), track=True))
            for source, start, piece in short:  # copied from the mapping: its pages can go at the next drop
                self.served[source].append((None, start, start + len(piece)))
        first = {"frame": int(len(short) > 1), "file": len(frames)}
        return frames, ranges, [(0, n) if kind == "short" else (first[kind] + n, 0) for kind, n in where]
