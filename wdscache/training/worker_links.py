"""A training process's sockets to the agent's sample workers (one DEALER each), for one
epoch stream: requests go out proved, and replies come in only proved.

Every request carries ``auth``, the proof of its id under that worker's key (the worker
refuses a request without it), and every reply must carry ``proof``, the proof of the id it
answers (see :mod:`wdscache.shared.protocol`). A reply without it is dropped before anything of it
is used, as if lost (the request is sent again in time), and counted (``dropped``): the stream
asks the agent then whether it restarted (its new workers prove with new keys), and if not,
has it warned of once (:meth:`WorkerLinks.warn_dropped`): another process may hold that port. Request ids are unique within the
links (their own sockets).

The links belong to the thread that made them, as ZeroMQ sockets do. Links dropped without
``close()`` close their sockets when collected (see :func:`~wdscache.shared.client.zmq_closer`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from ..shared.client import connect_dealer, send_now, zmq_closer
from ..shared.errors import ProtocolError
from ..shared.logs import get_logger
from ..shared.messages import WorkerRequest
from ..shared.protocol import Proofs, pack, same_secret, unpack

log = get_logger(__name__)


class WorkerLinks:
    """Sockets to the workers at ``endpoints``, whose keys are ``keys`` (in the same order)."""

    def __init__(self, endpoints: Sequence[str], keys: Sequence[str], ids: Iterator[int] | None = None) -> None:
        """``ids``: the request numbers to go on with (the links replaced, as when the agent
        restarted), so that no id repeats within the stream."""
        self.endpoints = list(endpoints)
        self.proofs = [Proofs(key) for key in keys]
        self.sockets: list[zmq.Socket] = []
        self._closer = zmq_closer(self, self.sockets)  # closes those in the list when called
        self.sockets.extend(connect_dealer(ep) for ep in self.endpoints)
        self.poller = zmq.Poller()
        for sock in self.sockets:
            self.poller.register(sock, zmq.POLLIN)
        self._turns = itertools.count()
        self.ids = ids if ids is not None else itertools.count()
        self.dropped = 0  # replies dropped without their proof, since the stream last looked
        self._dropped_from = ""  # the endpoint of the latest
        self._warned = False

    def __len__(self) -> int:
        return len(self.sockets)

    def next_worker(self) -> int:
        """The worker whose turn it is (round robin)."""
        return next(self._turns) % len(self.sockets)

    def send(self, worker: int, request: WorkerRequest, kind: str, *frames: bytes) -> str:
        """Send ``request`` (and its payload ``frames``) to ``worker`` with a new id (``kind`` and
        a number) and its proof; returns the id. Never waits: a worker that takes no request (gone,
        or stopped) loses it once its queue is full (see :func:`~wdscache.shared.client.send_now`),
        and its sender's wait for the reply ends as for any request not answered."""
        rid = f"{kind}{next(self.ids)}"
        request["id"] = rid
        request["auth"] = self.proofs[worker].request(rid)
        send_now(self.sockets[worker], pack(request, *frames))
        return rid

    def replies(self, timeout: float) -> Iterator[tuple[dict[str, Any], list[Any]]]:
        """The proved replies that arrived (header and payload frames), waiting up to
        ``timeout`` seconds for the first."""
        events = dict(self.poller.poll(int(timeout * 1000)))
        for w, sock in enumerate(self.sockets):
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                reply = self._proved(frames, w)
                if reply is not None:
                    yield reply

    def _proved(self, frames: list[Any], worker: int) -> tuple[dict[str, Any], list[Any]] | None:
        try:
            header, payload = unpack(frames)
            if same_secret(header.get("proof"), self.proofs[worker].reply(header.get("id"))):
                return header, payload
        except ProtocolError:
            pass
        self.dropped += 1
        self._dropped_from = self.endpoints[worker]
        return None

    def warn_dropped(self) -> None:
        """Warn (once) of replies dropped without their proof that no restart of the agent explains."""
        if not self._warned:
            self._warned = True
            log.warning(
                "a reply from %s without the worker's proof was dropped: another process may hold that port",
                self._dropped_from,
            )

    def close(self) -> None:
        self._closer()
