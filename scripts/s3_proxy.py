"""A small proxy in front of a real S3 API on loopback (moto's server) for the tests and the
benchmark: it logs every request, injects faults (a body cut short, an S3 error reply) and can
cap each connection's rate and delay its first byte, as a distant object store would.

The proxy forwards each request's bytes as they came (headers in order, so SigV4 signatures
still match) to moto and answers one request per connection (``Connection: close``), so
every request the agent makes is one line of :attr:`S3Proxy.requests`.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

_JOIN_TIMEOUT = 5.0
_IO_TIMEOUT = 30.0
_PACE = 64 << 10  # a capped body is sent in pieces of this size


@dataclass
class ProxiedRequest:
    """One request as the proxy saw it: ``key`` is ``bucket/key`` (path-style), ``query`` the
    raw query string; ``status`` what the client got; ``sent`` the body bytes it got; ``began`` and
    ``ended`` when (``time.monotonic()``) its request line came and its answer's last byte went."""

    method: str
    key: str
    query: str
    range: str | None
    if_match: str | None
    status: int = 0
    sent: int = 0
    fault: str | None = None
    began: float = 0.0
    ended: float = 0.0


@dataclass
class _Fault:
    kind: str  # "cut" (send `after` body bytes, then close) or "error" (an S3 error reply)
    after: int = 0
    status: int = 503
    code: str = "SlowDown"
    then: Callable[[], None] | None = None  # run once a cut's bytes are sent, before the connection closes


class S3Proxy:
    """A threaded loopback proxy in front of an S3 API server on ``upstream_port``."""

    def __init__(self, upstream_port: int, *, rate: float = 0.0, ttfb: float = 0.0, if_match: bool = True) -> None:
        """``rate``: bytes a second per connection (0: no cap); ``ttfb``: seconds before each answer;
        ``if_match`` False: requests reach the store without their If-Match header (a store that
        ignores it). Each may be changed while the proxy runs."""
        self.upstream_port = upstream_port
        self.rate, self.ttfb, self.if_match = rate, ttfb, if_match
        self.sent = 0  # body bytes sent, all requests
        self.requests: list[ProxiedRequest] = []
        self._faults: dict[str, list[_Fault]] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def start(self) -> S3Proxy:
        t = threading.Thread(target=self._accept, name="s3-proxy", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in list(self._threads):
            t.join(_JOIN_TIMEOUT)
        self._sock.close()

    def cut(self, key: str, *, after: int, then: Callable[[], None] | None = None) -> None:
        """The next GET of ``bucket/key`` sends ``after`` body bytes, runs ``then`` (say, to
        replace the object), and closes the connection."""
        with self._lock:
            self._faults.setdefault(key, []).append(_Fault("cut", after=after, then=then))

    def error(self, key: str, *, status: int, code: str, times: int = 1) -> None:
        """The next ``times`` GETs of ``bucket/key`` get an S3 error reply (``code``, ``status``)."""
        with self._lock:
            self._faults.setdefault(key, []).extend(_Fault("error", status=status, code=code) for _ in range(times))

    def gets(self, key: str) -> list[ProxiedRequest]:
        """The GETs of one object (not listings), in order."""
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and r.key == key and not r.query]

    def of(self, key: str) -> list[ProxiedRequest]:
        """Every request naming ``bucket/key`` (HEAD and GET)."""
        with self._lock:
            return [r for r in self.requests if r.key == key]

    # -- serving ----------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(_IO_TIMEOUT)
        try:
            with conn, conn.makefile("rb") as rfile:
                record = self._one(conn, rfile)
                if record is not None:
                    record.ended = time.monotonic()
        except OSError:
            pass  # the client went away

    def _one(self, conn: socket.socket, rfile) -> ProxiedRequest | None:
        """Answer one request; its record (None: the client sent none)."""
        line = rfile.readline(65537).decode("latin-1")
        began = time.monotonic()
        if not line.strip():
            return None
        method, target, _ = line.split(" ", 2)
        headers: list[tuple[str, str]] = []
        while (h := rfile.readline(65537).decode("latin-1")) not in ("\r\n", "\n", ""):
            name, _, value = h.partition(":")
            headers.append((name.strip(), value.strip()))
        lower = {k.lower(): v for k, v in headers}
        body = rfile.read(int(lower.get("content-length", "0") or 0))
        parts = urlsplit(target)
        record = ProxiedRequest(
            method, unquote(parts.path).lstrip("/"), parts.query, lower.get("range"), lower.get("if-match"), began=began
        )
        with self._lock:
            self.requests.append(record)
            queue = self._faults.get(record.key) if method == "GET" and not parts.query else None
            fault = queue.pop(0) if queue else None
        if fault is not None:
            record.fault = fault.kind
            if fault.kind == "error":
                self._error(conn, record, fault)
                return record
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=_IO_TIMEOUT)
        try:
            upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if self.if_match or name.lower() != "if-match":
                    upstream.putheader(name, value)
            upstream.endheaders(body or None)
            resp = upstream.getresponse()
            record.status = resp.status
            out = [f"HTTP/1.1 {resp.status} {resp.reason}\r\n"]
            for name, value in resp.getheaders():
                if name.lower() not in ("connection", "transfer-encoding", "content-length"):
                    out.append(f"{name}: {value}\r\n")
            if method == "HEAD":
                out.append(f"Content-Length: {resp.getheader('Content-Length')}\r\nConnection: close\r\n\r\n")
                if self.ttfb:
                    time.sleep(self.ttfb)
                conn.sendall("".join(out).encode("latin-1"))
                return record
            length = resp.getheader("Content-Length")
            data = b"" if length is not None else resp.read()  # a body of unknown length: read first
            out.append(f"Content-Length: {length if length is not None else len(data)}\r\nConnection: close\r\n\r\n")
            if self.ttfb:
                time.sleep(self.ttfb)
            conn.sendall("".join(out).encode("latin-1"))
            limit = fault.after if fault is not None and fault.kind == "cut" else None
            record.sent = self._relay(conn, resp, data, limit)
            if fault is not None:
                if fault.then is not None:
                    fault.then()
                conn.shutdown(socket.SHUT_RDWR)  # a reset mid-body
        finally:
            upstream.close()
        return record

    def _relay(self, conn: socket.socket, resp: http.client.HTTPResponse, data: bytes, limit: int | None) -> int:
        """Send the body (``data``, else read from ``resp`` as it comes), at most ``limit`` bytes,
        at ``rate`` if capped; the bytes sent."""
        start, sent = time.monotonic(), 0
        while limit is None or sent < limit:
            want = _PACE if limit is None else min(_PACE, limit - sent)
            piece = data[sent : sent + want] if data else resp.read(want)
            if not piece:
                break
            conn.sendall(piece)
            sent += len(piece)
            with self._lock:
                self.sent += len(piece)
            if self.rate:
                ahead = start + sent / self.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        return sent

    @staticmethod
    def _error(conn: socket.socket, record: ProxiedRequest, fault: _Fault) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
            f"<Message>injected by the test proxy</Message><Key>{record.key}</Key></Error>"
        ).encode()
        record.status = fault.status
        conn.sendall(
            f"HTTP/1.1 {fault.status} Injected\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
