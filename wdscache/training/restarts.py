"""An epoch stream across restarts of the agent, in the training process.

A new run of the agent knows nothing of the stream's reader. The connection tells us when one
proved itself (``on_new_run``, :meth:`AgentRuns.new_run`): we say hello again at once, as the
same reader, and check that it serves the list we read (another list ends the epoch with an
error). Then the stream's links move to the new run's workers, every read that was at a
worker going again (:meth:`AgentRuns.relink`), and its shards are pinned again at the main
loop's next turn (:meth:`AgentRuns.repin`).

An agent that dropped the reader (silent past its ``--reader-timeout``: this process was
stopped, say) knows nothing of it either, and had let its pins go: it answers the reader's
open, ping or report ``need_hello`` (the report's on the reporter's connection, which has us
ping), and the stream takes it up the same way (``on_forgotten``, :meth:`AgentRuns.forgotten`).

Nothing here keeps a copy of what the stream read: the read table
(:mod:`wdscache.training.reads`) stays the one record of each read's state, and what was
delivered or received stays, so the epoch goes on at exactly the samples not here yet and
delivers each sample once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..shared.errors import WdsCacheError
from ..shared.logs import get_logger
from .reads import ReadState
from .worker_links import WorkerLinks

if TYPE_CHECKING:
    from .stream import EpochStream

log = get_logger(__name__)

CHECK_EVERY = 0.5  # seconds between pings asked for by unproved replies or the reporter's run


class AgentRuns:
    """The agent run a stream's links and pins belong to, and taking up a new one."""

    def __init__(self, stream: EpochStream) -> None:
        self.stream = stream
        self.run = stream.conn.run
        self.new_hello: dict[str, Any] | None = None  # a new run's answer to our hello, not linked yet
        self.repinning: set[int] = set()  # shards pinned at an earlier run, to pin at this one
        self.checked_at = 0.0  # when we last asked the agent because a worker's reply was not proved
        self.why = ""  # what the agent did that had us say hello again, for the log
        stream.conn.on_new_run = self.new_run
        stream.conn.on_forgotten = self.forgotten

    def check(self) -> None:
        """Take up a new run of the agent, if one proved itself (on our connection, or on the
        reporter's: it asks every second); a worker's reply without its proof (from a new
        run's worker, say) has us ask the agent at once."""
        stream = self.stream
        if self.new_hello is None and time.monotonic() - self.checked_at > CHECK_EVERY:
            dropped, seen, forgotten = stream.workers.dropped, stream.reporter.run, stream.reporter.forgotten
            if dropped or (seen and seen != self.run) or forgotten:
                self.checked_at = time.monotonic()
                stream.workers.dropped = 0
                stream.reporter.forgotten = False
                stream.ping()
                if self.new_hello is None and dropped:
                    stream.workers.warn_dropped()
        if self.new_hello is not None:
            self.relink()

    def new_run(self) -> None:
        """A new run of the agent proved itself on our connection: it knows nothing of us. Say
        hello again as the same reader (at once, before the request that found it goes on) and
        check that it serves the list we read; the links move later (:meth:`relink`)."""
        self._hello_again("restarted")

    def forgotten(self) -> None:
        """The agent answered ``need_hello``: it dropped us and our pins. As after a restart."""
        self._hello_again("dropped this reader after its --reader-timeout of silence (was this process stopped?)")

    def _hello_again(self, why: str) -> None:
        session = self.stream.session
        hello, listed = session.hello_again(self.stream.conn, self.stream.name)
        if listed != session.list_id:  # (a loader's own list is sent again: only the agent's can change)
            raise WdsCacheError(
                f"the agent at {self.stream.settings.endpoint} {why}, and now serves a URL list other than the one "
                "this epoch reads, so it cannot go on exactly: start the epoch again, or load the last state_dict() "
                "into a loader of the new list's job"
            )
        self.new_hello, self.why = hello, why

    def relink(self) -> None:
        """Move to the new run's workers: every read at an earlier run's worker goes again (the
        reply of one that had answered is dropped unproved), and our pins are taken again at
        the main loop's next turn (:meth:`repin`). What was delivered and what came back stay."""
        hello, self.new_hello = self.new_hello, None
        assert hello is not None
        stream = self.stream
        old, conn, endpoint = stream.workers, stream.conn, stream.settings.endpoint
        endpoints = hello["workers"]
        old.close()  # (first: its sockets' files free for the new links)
        stream.workers = WorkerLinks(endpoints, [conn.worker_key(i) or "" for i in range(len(endpoints))], ids=old.ids)
        if not stream.workers:
            raise WdsCacheError(f"the agent at {endpoint} restarted with no workers")
        self.run = conn.run
        sent = stream.reads.in_state(ReadState.SENT)
        log.warning(
            "the agent at %s %s: said hello to it again; sending %d reads again and pinning %d shards again",
            endpoint,
            self.why,
            len(sent),
            len(stream.pins.opened),
        )
        for read in sent:
            stream.batches.dispatch(read, direct=read.direct)
        self.repinning = set(stream.pins.opened)

    def repin(self) -> None:
        """Pin again, at the agent's new run, the shards we held at the one before, as any open
        (a new run checks a shard against its source before it serves it; one it no longer
        holds is downloaded again, or fails by ``on_error``)."""
        shards, self.repinning = self.repinning, set()
        pins = self.stream.pins
        for shard in shards:
            if shard in pins.opened:  # (an open that had to wait let go of the others)
                self.stream.shards.open(shard, again=True, while_downloading=shard in pins.while_downloading)
