"""A small client for the agent's control socket: stats, and opening cached shards.

``ShardClient.open(url)`` returns the local path of a complete cached shard and
pins it (the agent will not evict it) until ``release(url)``; the agent moves
this client's prefetch window to the shards after it. Pins of a client that
stops talking to the agent are dropped after the agent's reader timeout.

A client's socket belongs to the process that created it: after a fork the
child opens its own.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import zmq

from .errors import AgentUnavailableError, FetchError, ProtocolError
from .layout import CacheLayout
from .protocol import pack, unpack

RETRY_PAUSE = 0.1  # seconds between asking again after a reply marked "retry"


def resolve_endpoint(cache_dir: str | os.PathLike[str] | None, endpoint: str | None) -> str:
    """The endpoint to talk to: given, or the private socket of ``cache_dir``."""
    if endpoint:
        return endpoint
    if cache_dir is None:
        raise ValueError("give cache_dir (or endpoint) to find the agent")
    return CacheLayout.of(cache_dir).default_endpoint()


def start_hint(cache_dir: str | os.PathLike[str] | None) -> str:
    where = cache_dir if cache_dir is not None else "DIR"
    return f"start one with 'wdscache agent --cache-dir {where} --urls URLS.txt'"


class AgentConnection:
    """Request/reply over a DEALER socket; every wait is bounded by ``timeout``."""

    def __init__(self, endpoint: str, *, timeout: float = 30.0, hint: str = "") -> None:
        self.endpoint, self.timeout, self.hint = endpoint, timeout, hint
        self._ids = itertools.count(1)
        self._pid = -1
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._pid != os.getpid():
            # Created in the process that uses it; a forked child must not touch its parent's.
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
            self._pid = os.getpid()
        assert self._sock is not None
        return self._sock

    def request(self, header: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        """Send ``header`` and return the reply's header; raises if none comes in time.

        A reply marked ``retry`` (the agent could not write its index for a moment) is
        asked again until the timeout; the last such reply is returned then.
        """
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            reply = self._exchange(header, deadline, wait)
            left = deadline - time.monotonic()
            if not reply.get("retry") or left <= 0:
                return reply
            time.sleep(min(RETRY_PAUSE, left))

    def _exchange(self, header: dict[str, Any], deadline: float, wait: float) -> dict[str, Any]:
        sock = self._socket()
        rid = next(self._ids)
        sock.send_multipart(pack({**header, "id": rid}))
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise AgentUnavailableError(self.endpoint, wait, self.hint)
            reply, _ = unpack(sock.recv_multipart())
            if reply.get("id") == rid:
                return reply
            # A late reply to an earlier request that timed out: skip it.

    def request_patiently(
        self, header: dict[str, Any], *, liveness: float, probe: dict[str, Any] | None = None,
        on_probe: Callable[[dict[str, Any]], None] | None = None, every: float | None = None,
    ) -> dict[str, Any]:
        """Like :meth:`request`, for requests that may take long (a shard being downloaded).

        Every ``every`` seconds (default ``liveness / 2``) it sends ``probe`` (default a
        ping) and hands the answer to ``on_probe``, which may raise to give up (a consumer
        that sees no progress, say). Raises AgentUnavailableError once a probe goes
        unanswered for ``liveness`` seconds.
        """
        sock = self._socket()
        rid = next(self._ids)
        sock.send_multipart(pack({**header, "id": rid}))
        probe = probe or {"op": "ping", "reader": str(header.get("reader", ""))}
        every = liveness / 2 if every is None else every
        probe_id, probe_sent = None, time.monotonic()
        while True:
            if sock.poll(int(min(every, liveness) * 1000 / 4) + 1):
                reply, _ = unpack(sock.recv_multipart())
                if reply.get("id") == rid:
                    return reply
                if reply.get("id") == probe_id:
                    probe_id = None
                    if on_probe is not None:
                        on_probe(reply)
                continue
            now = time.monotonic()
            if probe_id is not None and now - probe_sent > liveness:
                raise AgentUnavailableError(self.endpoint, liveness, self.hint)
            if probe_id is None and now - probe_sent > every:
                probe_id, probe_sent = next(self._ids), now
                sock.send_multipart(pack({**probe, "id": probe_id}))

    def close(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close(0)
            assert self._ctx is not None
            self._ctx.term()
        self._sock = self._ctx = None
        self._pid = -1


class ShardClient:
    """Open cached shards by URL through the agent of ``cache_dir`` (or at ``endpoint``)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        endpoint: str | None = None,
        timeout: float = 300.0,
        name: str | None = None,
    ) -> None:
        self.name = name or f"client-{uuid.uuid4().hex[:12]}"
        self._conn = AgentConnection(
            resolve_endpoint(cache_dir, endpoint), timeout=timeout, hint=start_hint(cache_dir)
        )

    def open(self, url: str, *, timeout: float | None = None) -> Path:
        """Wait until ``url`` is cached and pin it; returns the shard's local path."""
        header = {"op": "open", "reader": self.name, "url": url}
        if timeout is None:
            # A download may take long; the agent's answers to pings show it is alive (and keep us).
            reply = self._conn.request_patiently(header, liveness=min(self._conn.timeout, 30.0))
        else:
            reply = self._conn.request(header, timeout=timeout)
        if not reply.get("ok"):
            raise FetchError(url, str(reply.get("error", "unknown error")), permanent=True)
        return Path(reply["path"])

    def release(self, url: str) -> None:
        """Unpin ``url``: the agent may evict it again."""
        self._check(self._conn.request({"op": "release", "reader": self.name, "url": url}))

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The agent's live statistics (the object ``wdscache stats --json`` prints)."""
        return self._check(self._conn.request({"op": "stats"}, timeout=timeout))["stats"]

    def close(self) -> None:
        """Say goodbye (the agent drops this client's pins) and close the socket."""
        try:
            self._conn.request({"op": "bye", "reader": self.name}, timeout=2.0)
        except AgentUnavailableError:
            pass
        finally:
            self._conn.close()

    def __enter__(self) -> "ShardClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _check(reply: dict[str, Any]) -> dict[str, Any]:
        if not reply.get("ok"):
            raise ProtocolError(str(reply.get("error", "request refused")))
        return reply
