"""A rank's share batched into reads and sent to the agent's workers, in the training process
(one :class:`ReadBatcher` per epoch stream).

The share's items (a position and its sample id) join the batch in order; the batch goes out
as one read when it holds ``request_limit`` items, when the share has no more items for now
(a shard still downloading) or has ended, and before an open waits. Guarantees:

- a batch only ever holds items of pinned shards (an item's shard is opened before the item
  joins, and an open that must wait sends what is batched first, holding no pins meanwhile):
  a request never needs more shards at once than are already pinned, so consumers competing
  for a small budget always make progress;
- reads are numbered 0, 1, 2, ... in the share's order, which is the order the stream hands
  their samples out in, whatever order the replies arrive in;
- the size of a read (about :data:`REQUEST_BYTES` of payload) changes how many items go to
  one read, never which samples the share holds or their order. The sample size is the
  replies' once there are some, before that the largest of the shards opened so far (a cached
  file's size over its count): a consumer of large samples holds a few of them, not
  :data:`FIRST_REQUEST`, before its first sample. Reads start at :data:`FIRST_REQUEST`
  samples at most and double with each reply up to ``request_size``: the first sample waits
  for the stream's first window of reads to be made, which for a list of small shards whose
  counts are not known yet means opening and counting every shard the window reaches;
- the items of a shard skipped with ``on_error="skip"`` are not asked for: they stay holes
  in their read, which the stream fills;
- a read that holds items of a shard the sequence is still counting (downloading, or walked
  a step at a time, until the sequence goes past its final count) goes to the worker that
  counts the shard (:meth:`~wdscache.training.epoch_shards.EpochShards.worker_of`), which
  walks its headers for them; any other read goes to the workers in turn.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from ..shared.messages import Requests
from ..shared.protocol import pack_numbers
from .reads import Item, Read

if TYPE_CHECKING:
    from .stream import EpochStream

# Payload a request asks for: each request costs messaging on both sides, so small samples go
# many to a request, while the bytes in flight bound a consumer's memory.
REQUEST_BYTES = 4 << 20
FIRST_REQUEST = 32  # samples a request asks for at most before any reply
SHARE_ENDED = object()  # what fill() returns once the share has no more items


class ReadBatcher:
    """The reads of one epoch stream as they are made: the batch being filled, the next read's
    number, and how many samples a read asks for."""

    def __init__(self, stream: EpochStream) -> None:
        self.stream = stream
        self.batch: list[Item] = []  # items of the next read, their shards pinned
        self.seq_next = 0  # the next read's number
        self.request_limit = min(stream.settings.request_size, FIRST_REQUEST)  # samples per read, see sized
        self.ramp = self.request_limit  # samples a read may ask for so far: doubles with each reply
        self.per_sample = 0.0  # payload bytes per sample of the latest replies, see sized
        self.measured = False  # a reply sized the reads (before that, the shards opened do: presized)

    def fill(self, owned: Iterator[Item | None]) -> object:
        """Batch items of ``owned`` until a read goes out (returns its number), the share ends
        (:data:`SHARE_ENDED`) or a shard still downloading has no more samples yet (None); at
        either of those, what was batched goes out."""
        opened, seq = self.stream.pins.opened, self.seq_next
        for item in owned:  # per sample: the usual case (its shard pinned) kept to a few operations
            if item is None:
                self.flush()
                return None
            shard = item[1][0]
            if shard in opened:
                opened[shard] += 1
                batch = self.batch
                batch.append(item)
                if len(batch) >= self.request_limit:
                    self.flush()
                    return seq
            else:
                self.add(item)
                if self.seq_next != seq:
                    return seq
        self.flush()
        return SHARE_ENDED

    def add(self, item: Item) -> None:
        """Batch ``item``, its shard pinned first (an open may flush the batch and wait, holding
        no pins meanwhile); a skipped shard's item joins as a hole."""
        shard = item[1][0]
        stream = self.stream
        opened = stream.pins.opened
        if shard in opened:
            opened[shard] += 1
        elif shard not in stream.shards.skipped:
            stream.shards.open(shard)
            if shard not in stream.shards.skipped:
                opened[shard] += 1
        self.batch.append(item)  # a skipped shard's item is a hole (see holes.py)
        if len(self.batch) >= self.request_limit:
            self.flush()

    def flush(self) -> None:
        """Send what is batched as the next read."""
        if self.batch:
            batch, self.batch = self.batch, []
            self.dispatch(self.stream.reads.add(self.seq_next, batch))
            self.seq_next += 1

    def dispatch(self, read: Read, direct: bool = True) -> None:
        """Send ``read`` (with direct reads if on and ``direct``); its holes, and the items of its
        other parts if it goes a part at a time, are not asked for."""
        stream = self.stream
        items, skipped = read.items, stream.shards.skipped
        # Per request, on the hot path: no skipped shard and a whole read (the usual case), no filtering.
        sent: Sequence[int] = read.to_ask(skipped) if skipped or read.later or read.got else range(len(items))
        if not sent:
            if read.later:  # the shards of this part were skipped: the rest go once pinned
                stream.reads.reopen(read)
            else:
                stream.reads.answer(read, *read.whole([], []))
            return
        urls: list[str] = []
        url_at: dict[int, int] = {}  # shard -> its place in the request's urls
        wire: list[int] = []  # per item: the place of its URL, its sample index
        walking = stream.shards.walking
        w: int | None = None  # the worker that counts a shard of the read, if any
        for i in sent:
            shard, j = items[i][1]
            k = url_at.get(shard)
            if k is None:
                k = url_at[shard] = len(urls)
                urls.append(stream.urls[shard])
                if w is None and shard in walking:
                    w = stream.shards.worker_of(shard)
            wire += (k, j)
        if w is None:
            w = stream.workers.next_worker()
        direct = direct and stream.pins.files is not None
        rid = stream.workers.send(w, Requests.read(urls, direct=direct), "r", pack_numbers(wire))
        stream.reads.send(read, sent, rid, w, direct, time.monotonic())

    def presized(self, per_sample: float) -> None:
        """Size the reads by a shard just opened whose samples span ``per_sample`` bytes of its
        cache file, until a reply shows their payloads (see :meth:`sized`)."""
        if not self.measured and per_sample > self.per_sample:
            self.per_sample = per_sample
            self.request_limit = self._by_bytes()

    def sized(self, sizes: list[int]) -> None:
        """Size the next reads by the payload per sample of the latest replies (about
        REQUEST_BYTES each, and at most ``FIRST_REQUEST`` samples doubled once per reply so far,
        up to ``request_size``): larger samples count at once, smaller ones as the estimate decays."""
        if sizes:
            self.measured = True
            self.per_sample = max(sum(sizes) / len(sizes), 0.75 * self.per_sample, 1.0)
            self.ramp = min(2 * self.ramp, self.stream.settings.request_size)
            self.request_limit = self._by_bytes()

    def _by_bytes(self) -> int:
        """Samples a read may ask for: about REQUEST_BYTES of ``per_sample`` each, at most ``ramp``."""
        return max(1, min(self.ramp, int(REQUEST_BYTES // self.per_sample)))
