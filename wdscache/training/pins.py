"""The shards one epoch stream holds pinned in the agent, in the training process, and the
cache files it reads of them directly.

A pinned shard stays in the agent's cache until we release it. ``opened`` maps each pinned
shard to the number of our reads of it outstanding (items batched or sent); a shard is let
go once none is and the sequence needs it no more (``remaining``, the ids of it the
sequence has still to give out, is 0, and the share has dealt the last of them: a run of
ids comes out of the sequence at once, and is batched a read at a time), or when we must
wait for another shard.

The agent hears of a pin let go with our next open (``letting_go`` rides on it, and the
agent lets go first), or in a release of its own (:meth:`Pins.flush`): before the stream
hands out a read's samples, since the user may keep it there as long as it likes (a
DataLoader's full queue, a collective waiting for another rank), and while the stream waits
for its reads, once the oldest has waited :data:`RELEASE_AFTER`; our bye lets go of
everything. So the pins let go while the stream batches and sends its reads ride on the
opens it makes meanwhile, and a stream held by its user holds no pin it let go of.

Why pins never deadlock the budget: a consumer that has to wait for a download (or for its
budget) first lets go of every pin it is not reading (:meth:`Pins.open`), in the very open
that waits, so consumers cannot fill the budget with pins while each waits for room for its
next shard. A request only ever names shards already pinned, so it never needs more at once.
An open may pin the shards we read next too (``also``), only those cached at that moment:
never a wait, and let go like any other pin. A stream held by its user keeps the pins of
shards it reads later, though, and a rank held there may wait for another rank (a collective,
a DataLoader taking its workers' batches in turn) that waits for room those pins hold: so while
a reader waits for room that pins hold, the agent asks every consumer to let go of the pins it
does not read now, and a stream held by its user does (:meth:`Pins.let_go_parked`).

A cache file is open only while its shard is pinned (:mod:`wdscache.training.direct`): each release
closes it first, so its disk space comes back once the agent evicts it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..shared.client import AgentConnection
from ..shared.errors import AgentUnavailableError, NotTrustedError
from ..shared.messages import Requests
from .direct import CacheFiles

STATUS_EVERY = 1.0  # seconds between asking the agent how a download we wait for is going
# Seconds a pin let go may wait to ride on our next open before it is sent alone: short next
# to a download, long next to reading a small shard's share (many ranks or workers).
RELEASE_AFTER = 0.5
LET_GO_TIMEOUT = 1.0  # seconds the release of a held stream's pins waits for the agent (else it goes later)


class Pins:
    """Pins of reader ``reader`` on the shards of ``urls``, and the files of those read directly
    (``files``: None once direct reads are off)."""

    def __init__(
        self, conn: AgentConnection, reader: str, urls: Sequence[str], *, timeout: float, files: CacheFiles | None
    ) -> None:
        self.conn, self.urls, self.timeout = conn, urls, timeout
        self.requests = Requests(reader, said_hello=True)
        self.files = files
        self.opened: dict[int, int] = {}  # pinned shard -> our reads of it outstanding
        self.while_downloading: set[int] = set()  # pinned while downloading: read as the download goes
        # shard -> ids the sequence has not given out yet (its count minus those given out;
        # negative while a shard streams and its count is not known yet)
        self.remaining: dict[int, int] = {}
        self.given = 0  # ids the sequence gave out
        # (ids given out, shard) once its last id is out: let go once the share dealt that many
        self.unneeded: deque[tuple[int, int]] = deque()
        # shard -> its entries in unneeded: its last id is out but the share has not dealt it
        # yet (a run of ids is given out at once, and dealt an item at a time)
        self.undealt: dict[int, int] = {}
        self.waits = 0  # opens that had to wait, letting go of our other pins
        self.letting_go: list[str] = []  # pins let go that the agent has not heard of yet, oldest first
        self._letting_go_since = 0.0  # when the oldest of them was let go
        # Held at its user's hands (set by the stream's thread before it hands out samples, cleared
        # through unpark): the reporter's thread may let go of our pins meanwhile, under _parking.
        self.parked = False
        self._parking = threading.Lock()

    def open(
        self,
        shard: int,
        ahead: list[str],
        *,
        again: bool = False,
        while_downloading: bool = False,
        also: Sequence[int] = (),
        before_wait: Callable[[], None],
        on_status: Callable[[dict[str, Any]], None],
    ) -> dict[str, Any]:
        """Pin ``shard``, waiting for its download if need be; returns the agent's answer (not
        ok: the shard failed). ``ahead`` is our window: the shards we read next. ``also``:
        shards we read soon, pinned in the same request where they are cached now (one request
        for several shards: a rank of many reads a few samples of each shard); never waited
        for, and let go with the others before a wait.

        ``while_downloading``: a shard not cached yet is pinned as soon as its download holds
        its budget (the answer says ``while_downloading``). ``again``: the agent lost the shard
        (restarted, or its file went): the pin we think we hold is given back first.
        Before a wait, ``before_wait`` lets the caller finish its reads of the other pins,
        which are then let go; ``on_status`` hears what the agent says of the download meanwhile.
        """
        url = self.urls[shard]
        if again and shard in self.opened:
            self.close_file(shard)  # its file may be replaced before we read it again
            self._let_go(url)  # the agent lets go first, then pins it afresh
        request = self.requests.open(
            url,
            ahead=ahead,
            wait=False,
            while_downloading=while_downloading,
            release=self._take_letting_go(),
            also=[self.urls[s] for s in also],
        )
        reply = self.conn.request(request)
        for pinned, soon in zip(reply.get("also") or (), also):
            if pinned is True:
                self.opened.setdefault(soon, 0)
        if not reply.get("ok") and reply.get("cached") is False:
            # We wait, for the download or for its budget: hold no other pins meanwhile (see
            # the module docstring). Once a download holds its budget, pins cannot hold it up.
            before_wait()
            self.close_file(shard)  # a reply taken in may have opened it: we hold no pin while we wait
            for held in list(self.opened):
                if held != shard:
                    self.release(held, force=True)
            self.waits += 1
            request = self.requests.open(
                url, ahead=ahead, while_downloading=while_downloading, release=self._take_letting_go()
            )
            reply = self.conn.request_patiently(
                request,
                liveness=self.timeout,
                probe=self.requests.status(url),
                every=min(STATUS_EVERY, self.timeout / 4),
                on_probe=on_status,
            )
        if reply.get("ok"):
            self.opened.setdefault(shard, 0)
        return reply

    def release(self, shard: int, *, force: bool = False) -> None:
        """Unpin ``shard`` once we have no read of it outstanding and (unless forced) need it no
        more: the sequence gave out its last id and the share dealt it."""
        if self.opened.get(shard) == 0 and (force or (self.remaining.get(shard, 1) == 0 and shard not in self.undealt)):
            self._unpin(shard)
        elif shard not in self.opened:
            self.close_file(shard)  # let go of while a read of it was out (let_go_parked), which opened it

    def _unpin(self, shard: int) -> None:
        del self.opened[shard]
        self.close_file(shard)  # before the agent may evict it: its space comes back
        self._let_go(self.urls[shard])

    def unpark(self) -> None:
        """The stream reads on: its pins are its thread's alone again (once a let-go under way ends)."""
        with self._parking:
            self.parked = False

    def let_go_parked(self, conn: AgentConnection) -> None:
        """If the stream is held at its user's hands (``parked``), let go of all its pins and tell
        the agent over ``conn`` (the reporter's; not told in time, they go with our next request).
        A read of them batched or out still gets its samples if their copy stays; else it comes
        back "missing" (or a direct read finds the file gone, and is sent again) and is pinned and
        asked again, as after a restart of the agent; a shard being counted (as it downloads, or
        walked) is pinned again when its worker finds it gone; a shard read later is pinned as it
        comes. From the reporter's thread, when the agent asks."""
        with self._parking:
            if not self.parked:
                return
            for shard in list(self.opened):
                self._unpin(shard)
            urls = self._take_letting_go()
            if urls:
                try:
                    conn.request(self.requests.release(*urls), timeout=LET_GO_TIMEOUT)
                except (AgentUnavailableError, NotTrustedError):
                    self.letting_go[:0] = urls

    def drop(self, shard: int, timeout: float) -> None:
        """Unpin a shard that failed, whatever reads of it are still out (they keep their holes)."""
        self.close_file(shard)
        if self.opened.pop(shard, None) is not None:
            self.conn.request(self.requests.release(self.urls[shard], *self._take_letting_go()), timeout=timeout)

    def flush(self, *, now: bool = False) -> None:
        """Tell the agent of the pins let go: ``now``, or once the oldest has waited
        :data:`RELEASE_AFTER` for an open to ride on."""
        if self.letting_go and (now or time.monotonic() - self._letting_go_since >= RELEASE_AFTER):
            self.conn.request(self.requests.release(*self._take_letting_go()))

    def _let_go(self, url: str) -> None:
        if not self.letting_go:
            self._letting_go_since = time.monotonic()
        self.letting_go.append(url)

    def _take_letting_go(self) -> list[str]:
        """The pins let go, now told to the agent with the request that takes them."""
        urls, self.letting_go = self.letting_go, []
        return urls

    def counted(self, shard: int, count: int) -> None:
        """``shard``'s count is final: once the sequence has given out that many of its ids,
        it can go."""
        left = self.remaining[shard] = self.remaining.get(shard, 0) + count
        if not left:
            self.all_out(shard)

    def all_out(self, shard: int) -> None:
        """The sequence gave out ``shard``'s last id: once the share dealt it, let go."""
        self.unneeded.append((self.given, shard))
        self.undealt[shard] = self.undealt.get(shard, 0) + 1

    def release_settled(self, settled: int) -> None:
        """Let go of the shards whose last id was among the first ``settled`` the share dealt."""
        undealt = self.undealt
        while self.unneeded and self.unneeded[0][0] <= settled:
            shard = self.unneeded.popleft()[1]
            if undealt[shard] == 1:
                del undealt[shard]
            else:
                undealt[shard] -= 1
            self.release(shard)

    def close_file(self, shard: int) -> None:
        if self.files is not None:
            self.files.close(self.urls[shard])

    def stop_direct(self) -> None:
        """Read no cache file any more: the workers send every byte from now on."""
        if self.files is not None:
            self.files.close()
            self.files = None
