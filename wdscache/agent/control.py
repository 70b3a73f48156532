"""The agent's control socket: one ROUTER socket, its door (the token) and its replies.

A message that passed the door is a :class:`Request`; the part that handles its op
returns the :data:`Reply` (or None: a one-way report, or a request held to answer
later, whose :class:`Answer` the part hands back when it can). Only the core sends,
through :meth:`ControlSocket.reply`: no part writes to the socket.

Guarantees:

- Only the main loop touches the socket and its poller (ZeroMQ sockets are not
  thread-safe); download threads wake the loop through a descriptor it polls too.
- Only holders of the cache directory's token (``CACHE_DIR/token``, 0600: its
  owner) are served, on every endpoint, IPC or TCP: a message without this run's
  key (see :mod:`wdscache.shared.protocol`) reaches no handler and gets an error saying
  what to do; the only op taken without it, ``auth``, answers a proof and runs
  nothing else. The key is taken out of the header before any handler sees it, so
  it is never passed on to workers.
- Every reply to a message with the key carries this run's proof of the message's id;
  a refusal carries none (its id is the sender's choice).
- A peer that sends a frame of more than ``MAX_HEADER`` bytes (no message part may be larger than
  a header can be) is disconnected; one that does
  not read its replies loses them rather than blocking the agent.
- An ``ipc://`` socket file is created 0600 where no process listens (a stale one is replaced, a live
  one refused), and removed on close if it is still the one bound (:mod:`wdscache.agent.ipc_files`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from ..shared.errors import ConfigError, ProtocolError
from ..shared.logs import get_logger
from ..shared.protocol import (
    MAX_HEADER,
    PROTOCOL,
    Proofs,
    agent_key,
    client_key,
    pack,
    proof,
    same_secret,
    unpack,
    zmq_context,
)
from ..shared.redact import redact_urls
from .ipc_files import BoundFile, ipc_path
from .ipc_files import bind as bind_ipc

log = get_logger(__name__)

MAX_BATCH = 1000  # messages taken per turn, so a flood cannot starve the rest of the loop
REFUSED = (
    "refused: this agent serves only clients that hold the token in its cache directory "
    "(CACHE_DIR/token, readable by the directory's owner only); run as that user and give the loader "
    "cache_dir, or set WDSCACHE_TOKEN to the token (a consumer that cannot see the cache directory)"
)

Reply = dict[str, Any]  # a reply's body: "ok" and the fields of the op's reply


def cannot_listen(endpoint: str, exc: zmq.ZMQError | OSError) -> ConfigError:
    """The error of an agent that cannot bind ``endpoint``, and what to do: over TCP a port in use
    (or an address not this machine's), over IPC also a folder that is not there, or a stale
    socket file that cannot be replaced (a folder read-only in a service's sandbox)."""
    if ipc_path(endpoint) is not None:
        advice = "choose another --endpoint, or let the agent write to its folder"
    else:
        advice = "choose another --endpoint: a port no other process listens on, at an address of this machine"
    # os.strerror: ZeroMQ's own message repeats the endpoint, unredacted.
    return ConfigError(f"cannot listen on {redact_urls(endpoint)} ({os.strerror(exc.errno or 0)}): {advice}")


@dataclass(frozen=True, slots=True)
class Request:
    """One admitted message: its sender (``ident``), its id (``rid``) and its header."""

    ident: bytes
    rid: Any
    header: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Answer:
    """The reply to a request a part held (a reader waiting for a shard), given once it could be answered."""

    request: Request
    body: Reply


class ControlSocket:
    """Bound on construction; :meth:`close` unbinds. ``run`` names this agent process."""

    def __init__(self, endpoint: str, *, token: str, run: str) -> None:
        self.endpoint = endpoint
        self._token, self._run = token, run
        self._key = client_key(token, run)
        self._proofs = Proofs(agent_key(token, run))  # on every reply to a message with the key
        self._ctx = zmq_context(endpoint)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER)  # a peer sending more is disconnected
        sock.setsockopt(zmq.SNDHWM, 10_000)
        self._file: BoundFile | None = None
        try:
            if ipc_path(endpoint) is not None:
                # Not only under the cache directory's lock: --endpoint may name another agent's socket.
                self._file = bind_ipc(sock, endpoint)
            else:
                sock.bind(endpoint)
        except BaseException as exc:
            sock.close(0)
            self._ctx.term()
            if isinstance(exc, (zmq.ZMQError, OSError)):  # the option's fault, or the folder's
                raise cannot_listen(endpoint, exc) from None
            raise
        self._sock = sock
        self._bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # as bound: a TCP port chosen by the system too
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    def watch(self, fd: int) -> None:
        """Also wake :meth:`poll` when ``fd`` is readable (the events pipe, a consumer's pidfd)."""
        self._poller.register(fd, zmq.POLLIN)

    def unwatch(self, fd: int) -> None:
        self._poller.unregister(fd)

    def poll(self, timeout: float) -> set[Any]:
        """Wait up to ``timeout`` seconds; the descriptors (and this socket) ready."""
        return {s for s, _ in self._poller.poll(int(timeout * 1000))}

    @property
    def readable(self) -> zmq.Socket:
        """What :meth:`poll` returns when messages wait."""
        return self._sock

    def receive(self) -> Iterator[tuple[bytes, dict[str, Any], list[Any]]]:
        """The admitted messages waiting now: (sender, header, frames), at most ``MAX_BATCH``.

        A message that cannot be decoded, or comes without this run's key, is
        answered here and not yielded.
        """
        for _ in range(MAX_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, body = frames[0], frames[1:]
            try:
                header, payload = unpack(body)
            except ProtocolError as exc:
                self._send_reply(ident, None, ok=False, error=str(exc))
                continue
            if self._admitted(ident, header):
                yield ident, header, payload

    def _admitted(self, ident: bytes, header: dict[str, Any]) -> bool:
        """The one door, before any op runs: True for a message with this run's key."""
        rid = header.get("id")
        if header["op"] == "auth":
            nonce = header.get("nonce")
            if isinstance(nonce, str) and nonce.isascii() and 16 <= len(nonce) <= 256:
                self._send_reply(
                    ident,
                    rid,
                    ok=True,
                    run=self._run,
                    endpoint=self._bound,
                    proof=proof(self._token, nonce, self._run, self._bound),
                    protocol=PROTOCOL,
                )
            else:
                self._send_reply(ident, rid, ok=False, error="'auth' needs a 'nonce' of 16 to 256 ASCII characters")
            return False
        if same_secret(header.pop("key", None), self._key):  # popped: never passed on to workers
            return True
        # No proof: the id is the sender's choice, and proofs of chosen ids are what an impostor needs.
        self._send_reply(ident, rid, ok=False, need_token=True, error=REFUSED)
        return False

    def reply(self, ident: bytes, rid: Any, **body: Any) -> None:
        """Answer request ``rid`` of ``ident``, an admitted message, with this run's proof of ``rid``."""
        self._send_reply(ident, rid, **body, proof=self._proofs.reply(rid))

    def _send_reply(self, ident: bytes, rid: Any, **body: Any) -> None:
        try:
            self._sock.send_multipart([ident, *pack({"op": "reply", "id": rid, **body})], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropping a reply to a client that does not read")

    def answer(self, answer: Answer) -> None:
        """Send the reply to a request held earlier."""
        self.reply(answer.request.ident, answer.request.rid, **answer.body)

    def send(self, ident: bytes, message: list[Any]) -> bool:
        """Send packed ``message`` to ``ident`` if it can go at once; False if not (a hint is lost)."""
        try:
            self._sock.send_multipart([ident, *message], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.remove()  # while it still listens (see wdscache.agent.ipc_files)
        self._sock.close(0)
        self._ctx.term()
