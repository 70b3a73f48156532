"""The reads a training process's epoch stream has out: one record per read, with its state.

A read is one request to a worker for a run of the rank's samples; its sequence number
(``seq``) is its place in the rank's order, and its samples are handed out in that order.
Its whole life is one :class:`Read`, in one :class:`ReadTable` by sequence number. Its
state changes only through the table's methods, by these transitions:

========  ============================================================  ========
from      on                                                            to
========  ============================================================  ========
(batch)   made from the items batched (:meth:`ReadTable.add`)           NEW
NEW       sent to a worker                                              SENT
SENT      the reply's samples decoded                                   ANSWERED
SENT      a failure not of one shard, skipped (``on_error="skip"``)     ANSWERED
SENT      no reply in time: sent again (``resends`` + 1)                SENT
SENT      the agent restarted: sent again to its new run's workers      SENT
SENT      a direct read failed: sent again, the bytes over the socket   SENT
SENT      one of its shards failed, skipped: the rest sent again        SENT
SENT      the samples of a part of its shards came; the rest wait       REOPEN
SENT      "pending": its shard's download started over, lacks them yet  DELAYED
SENT      "missing" (the agent lost our pin), "corrupt" (first time)    REOPEN
DELAYED   its time to ask again (``retry_at``) came                     SENT
DELAYED   an open has to wait, holding no pins                          REOPEN
REOPEN    its shards pinned again (all at once, or those that could be) SENT
any       to be sent, but every item is a hole (its shard skipped)      ANSWERED
ANSWERED  its samples handed out (:meth:`ReadTable.hand_out`)           (gone)
SENT      the epoch stops at a shard's first item, which it holds after REOPEN
          items of others: cut there, the items before it kept (``cut``)
DELAYED   the same                                                      REOPEN
REOPEN    the same                                                      REOPEN
any       at or after the read the epoch stops at (``drop_from``)      (gone)
========  ============================================================  ========

A read goes to a worker whole, but for one reopened whose shards could not all be pinned
again at once (an open that has to wait lets go of the others, as it must, and the budget
may hold fewer of them than the read spans): it goes a part at a time, each part the items
of the shards pinned then (the others its ``later``), and the samples of each part are kept
(``got``) until the last comes. So a read always moves on, whatever the budget holds.

Any failure with ``on_error="raise"`` (and a worker refusing the consumer, whatever
``on_error``) ends the epoch, whatever the states; a shard's failure ends it at the shard's first
item not handed out, so a read that holds items before it is cut and asked again for them.
Only a SENT read has a request id (``rid``), a new one each time it is sent: a late reply to an
earlier send finds no read. A SENT or DELAYED read holds a pin count (:mod:`~wdscache.training.pins`)
for each item it asked for; a REOPEN read holds none.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..shared.sequence import SampleId

Item = tuple[int, SampleId]  # (position in the rank's share, sample id)


class ReadState(enum.Enum):
    NEW = "new"  # made from a batch, not sent yet
    SENT = "sent"  # at a worker, its reply awaited
    DELAYED = "delayed"  # to send again at retry_at: its shard's download does not hold the samples yet
    REOPEN = "reopen"  # to send again once its shards are pinned again
    ANSWERED = "answered"  # its samples are here, to hand out in order


@dataclass(slots=True, eq=False)
class Read:
    """One read of ``items``. ``sent`` indexes the items asked for; the others are holes
    (their shard was skipped), dropped or filled when the samples are handed out (see
    :mod:`~wdscache.training.holes`), or, for a
    read that goes a part at a time, items of an earlier part (``got``) or of a later one (their
    shards in ``later``)."""

    seq: int
    items: list[Item]
    state: ReadState = ReadState.NEW
    sent: Sequence[int] = ()  # range(len(items)) when no item is a hole
    rid: str = ""  # of the latest send
    worker: int = -1  # of the latest send
    direct: bool = False  # the latest send asked for direct reads
    sent_at: float = 0.0
    retry_at: float = 0.0  # DELAYED: when to send again
    pending_since: float | None = None  # its first "pending" answer, until samples come
    resends: int = 0  # sends after no reply in time
    samples: list[Any] = field(default_factory=list)  # ANSWERED: None for a hole
    sizes: list[int] = field(default_factory=list)  # payload bytes of each
    later: set[int] = field(default_factory=set)  # shards whose items wait for a later part
    got: dict[int, tuple[Any, int]] = field(default_factory=dict)  # item index -> (sample, size) of earlier parts

    def sent_items(self) -> list[Item]:
        """The items asked for (all but the holes)."""
        if len(self.sent) == len(self.items):
            return self.items
        return [self.items[i] for i in self.sent]

    def to_ask(self, skipped: Collection[int]) -> list[int]:
        """The items to ask for now: all but the holes (shards ``skipped``), and but those of
        earlier parts and of later ones."""
        later, got = self.later, self.got
        return [
            i
            for i, (_, (shard, _)) in enumerate(self.items)
            if shard not in skipped and shard not in later and i not in got
        ]

    def whole(self, samples: list[Any], sizes: list[int]) -> tuple[list[Any], list[int]]:
        """The samples (and sizes) of every item, from those of the latest send (of the items
        at ``sent``) and those of earlier parts: a hole (None, 0 bytes) at every other place."""
        placed = dict(self.got)
        placed.update(zip(self.sent, zip(samples, sizes)))
        pairs = [placed.get(i, (None, 0)) for i in range(len(self.items))]
        return [s for s, _ in pairs], [b for _, b in pairs]


class ReadTable:
    """The stream's reads by sequence number, each in one state (see the module docstring).

    ``by_seq`` is for reading; changes go through the methods, which keep the lookup by
    request id and the number of reads in REOPEN and DELAYED.
    """

    def __init__(self) -> None:
        self.by_seq: dict[int, Read] = {}
        self._by_rid: dict[str, Read] = {}  # the SENT reads, by the id of their latest send
        self.reopening = 0  # reads in REOPEN
        self.delayed = 0  # reads in DELAYED

    def add(self, seq: int, items: list[Item]) -> Read:
        read = self.by_seq[seq] = Read(seq, items)
        return read

    def _leave(self, read: Read) -> None:
        state = read.state
        if state is ReadState.SENT:
            self._by_rid.pop(read.rid, None)
        elif state is ReadState.REOPEN:
            self.reopening -= 1
        elif state is ReadState.DELAYED:
            self.delayed -= 1

    def send(self, read: Read, sent: Sequence[int], rid: str, worker: int, direct: bool, now: float) -> None:
        """``read`` went to ``worker`` as request ``rid`` (any earlier send's reply is ignored)."""
        self._leave(read)
        read.state, read.sent, read.rid, read.worker, read.direct, read.sent_at = (
            ReadState.SENT,
            sent,
            rid,
            worker,
            direct,
            now,
        )
        self._by_rid[rid] = read

    def answer(self, read: Read, samples: list[Any], sizes: list[int]) -> None:
        self._leave(read)
        read.state, read.samples, read.sizes = ReadState.ANSWERED, samples, sizes
        read.pending_since = None

    def delay(self, read: Read, until: float, now: float) -> None:
        """Send ``read`` again at ``until``; ``now`` is when a worker said "pending"."""
        self._leave(read)
        read.state, read.retry_at = ReadState.DELAYED, until
        if read.pending_since is None:
            read.pending_since = now
        self.delayed += 1

    def reopen(self, read: Read) -> None:
        self._leave(read)
        read.state, read.later = ReadState.REOPEN, set()  # its shards to pin are worked out anew
        self.reopening += 1

    def part_answered(self, read: Read, samples: list[Any], sizes: list[int]) -> None:
        """A part of ``read`` came (its items at ``sent``): kept, and the read reopened for the rest."""
        read.got.update(zip(read.sent, zip(samples, sizes)))
        read.pending_since = None
        self.reopen(read)

    def replied(self, rid: Any) -> Read | None:
        """The SENT read whose latest send was ``rid``, its reply taken (no other reply finds
        it; it stays SENT until the caller moves it on); None for a reply to an earlier
        send, or to none."""
        return self._by_rid.pop(str(rid), None)

    def awaiting(self) -> int:
        """Reads at a worker whose reply has not come."""
        return len(self._by_rid)

    def in_state(self, state: ReadState) -> list[Read]:
        """The reads in ``state``, oldest first (a copy: the caller may move them)."""
        return [read for read in self.by_seq.values() if read.state is state]

    def cut(self, read: Read, stop: int) -> None:
        """Keep ``read``'s items before ``stop`` (the epoch ends there), reopened: asked for again
        (those of earlier parts, in ``got``, stay), its shards pinned anew. The caller gives back the
        pin counts the read held (while SENT or DELAYED)."""
        read.items = read.items[:stop]
        read.got = {i: got for i, got in read.got.items() if i < stop}
        self.reopen(read)

    def drop_from(self, seq: int) -> None:
        """Forget every read from ``seq`` on (the epoch ends before them); late replies find none."""
        for read in [r for r in self.by_seq.values() if r.seq >= seq]:
            self._leave(read)
            del self.by_seq[read.seq]

    def hand_out(self, seq: int) -> Read | None:
        """Read ``seq``, taken out of the table, if its samples are here; else None."""
        read = self.by_seq.get(seq)
        if read is None or read.state is not ReadState.ANSWERED:
            return None
        del self.by_seq[seq]
        return read
