"""A real, threaded HTTP/1.1 file server that stands in for an object store.

Tests and benchmarks point wdscache at :class:`ShardServer` instead of a cloud
bucket.  It speaks enough of HTTP to exercise a real client (keep-alive, byte
ranges, validators) and can be told to misbehave on purpose: throttle
bandwidth, delay the first byte, or inject faults into the next requests of a
given file (a broken body, an error status, a response head that never ends).  Everything it did is kept in a request log for assertions.

Only the standard library is used, and it binds to 127.0.0.1 only.  It lives in
scripts/ because the benchmark and demo scripts serve their shards with it too:
tests import it as ``scripts.shard_server``, scripts as their sibling ``shard_server``,
and nothing here imports from tests/.
"""

from __future__ import annotations

import collections
import email.utils
import gzip
import http.server
import os
import re
import socket
import socketserver
import struct
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

__all__ = ["FAULT_KINDS", "Request", "ShardServer"]

#: Fault kinds accepted by :meth:`ShardServer.fail`.
FAULT_KINDS = frozenset({"status", "cut", "short", "stall", "html", "no_range", "change", "trickle"})
# The kinds that also apply to (and are consumed by) HEAD requests.
_HEAD_FAULTS = frozenset({"status", "trickle"})

# Which keyword parameters each fault kind understands; anything else is a typo.
_FAULT_PARAMS: dict[str, frozenset[str]] = {
    "status": frozenset({"status", "retry_after", "body", "headers", "reason"}),
    "cut": frozenset({"after"}),
    "short": frozenset({"after"}),
    "stall": frozenset({"after", "seconds", "then", "until"}),
    "html": frozenset({"body"}),
    "no_range": frozenset({"after"}),
    "change": frozenset({"after", "content", "etags"}),
    "trickle": frozenset({"every"}),
}

_RANGE_RE = re.compile(r"\s*bytes\s*=\s*([0-9]*)\s*-\s*([0-9]*)\s*", re.IGNORECASE)
_CHUNK = 64 * 1024
_JOIN_TIMEOUT = 5.0  # upper bound for stop(); a healthy server needs milliseconds
_DEFAULT_HTML = (
    b"<!DOCTYPE html>\n<html><head><title>Service Unavailable</title></head>"
    b"<body><h1>Service Unavailable</h1><p>Please try again later.</p></body></html>\n"
)


@dataclass
class Request:
    """One handled request, as seen by the server.

    ``path`` is the file name relative to the root (URL-decoded, as accepted by
    :meth:`ShardServer.url`), or the raw request path if it was rejected.
    ``bytes_sent`` counts body bytes and grows while the body is being sent.
    ``fault`` names the injected fault kind, if one was applied; ``at`` is when
    the request was handled (``time.monotonic()``), ``sent_at`` when its last body bytes
    so far went out, ``if_range`` its If-Range header.
    """

    method: str
    path: str
    range: str | None
    status: int
    bytes_sent: int = 0
    fault: str | None = None
    at: float = 0.0
    if_range: str | None = None
    sent_at: float = 0.0


@dataclass(frozen=True)
class _Fault:
    kind: str
    params: dict[str, Any]


class _Abort(Exception):
    """Ends a response early; the connection is closed afterwards."""


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves GET/HEAD for files under the owner's root."""

    protocol_version = "HTTP/1.1"
    server_version = "wdscache-test-server/1"
    # Idle keep-alive connections give up on their own even if stop() is never
    # called, so a forgotten server cannot pin threads forever.
    timeout = 60
    # Headers and body go out in separate writes; with Nagle on, the body waits
    # for the client's delayed ACK and every small response costs ~40 ms.
    disable_nagle_algorithm = True

    server: _HTTPServer
    _reset_on_close = False

    # -- quiet logging: tests assert on the request log, not on stderr ------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Discard the default per-request stderr line."""

    # -- entry points ------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 (name fixed by BaseHTTPRequestHandler)
        """Serve a file body, a range of it, or an injected fault."""
        self._respond(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        """Serve the headers a GET would get ("status" and "trickle" faults apply)."""
        self._respond(head=True)

    def finish(self) -> None:
        """Flush as usual, then reset the TCP connection if a "cut" asked for it."""
        super().finish()
        if self._reset_on_close:
            # SO_LINGER with a zero timeout turns close() into an RST, which is
            # what a crashed peer or a dropped load balancer looks like.
            try:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
            except OSError:
                pass

    # -- the response ------------------------------------------------------

    def _respond(self, head: bool) -> None:
        owner = self.server.owner
        try:
            self._dispatch(owner, head)
        except _Abort:
            self.close_connection = True
        except OSError:
            # The client went away mid-response: routine in tests, never noisy.
            self.close_connection = True

    def _dispatch(self, owner: ShardServer, head: bool) -> None:
        method = "HEAD" if head else "GET"
        range_header = self.headers.get("Range")
        name = owner._name_from_request_path(self.path)
        if name is None:
            self._simple(owner, method, self.path, range_header, 403, b"forbidden\n", head)
            return
        fault = owner._take_fault(name, head, range_header)
        kind = fault.kind if fault else None

        if fault is not None and kind == "status":
            params = fault.params
            status = int(params["status"])
            body = params.get("body")
            if body is None:
                body = b"" if status in (204, 304) else f"injected status {status}\n".encode()
            extra = dict(params.get("headers") or {})
            if params.get("retry_after") is not None:
                extra["Retry-After"] = str(params["retry_after"])
            self._simple(owner, method, name, range_header, status, body, head, extra, kind, params.get("reason"))
            return
        if fault is not None and kind == "trickle":
            self._trickle(owner, method, name, range_header, float(fault.params.get("every", 0.5)))
            return
        if fault is not None and kind == "html":
            body = fault.params.get("body", _DEFAULT_HTML)
            self._simple(
                owner,
                method,
                name,
                range_header,
                200,
                body,
                head,
                {"Content-Type": "text/html; charset=utf-8"},
                kind,
            )
            return

        target = owner._file_for(name)
        try:
            f = open(target, "rb") if target is not None else None
        except OSError:
            f = None
        if f is None:
            self._simple(owner, method, name, range_header, 404, b"not found\n", head, None, kind)
            return
        with f:
            st = os.fstat(f.fileno())
            size = st.st_size
            etag = f'"{size:x}-{st.st_mtime_ns:x}"'
            last_modified = email.utils.formatdate(st.st_mtime, usegmt=True)
            headers = {"Content-Type": _content_type(name)}
            if owner.last_modified:
                headers["Last-Modified"] = last_modified
            if owner.etags:
                headers["ETag"] = etag
            if owner.encoding:
                headers["Content-Encoding"] = owner.encoding
            if owner.gzip and "gzip" in (self.headers.get("Accept-Encoding") or ""):
                body = gzip.compress(f.read(), mtime=0)
                headers.update({"Content-Encoding": "gzip", "ETag": f'"{len(body):x}-gz"'})
                self._simple(owner, method, name, range_header, 200, body, head, headers, kind)
                return
            # If-Range names the version the client holds bytes of: any other gets the whole body
            # (unless the server ignores If-Range, as some do).
            if_range = self.headers.get("If-Range") if owner.if_range else None
            stale = if_range is not None and if_range not in (
                (etag if owner.etags else None),
                (last_modified if owner.last_modified else None),
            )
            ranges_ok = owner.accept_ranges and kind != "no_range"
            if ranges_ok:
                headers["Accept-Ranges"] = "bytes"
            start, length, status = 0, size, 200
            if ranges_ok and range_header is not None and not stale:
                parsed = _parse_range(range_header, size)
                if parsed == "unsatisfiable":
                    headers["Content-Range"] = f"bytes */{size}"
                    self._simple(owner, method, name, range_header, 416, b"", head, headers, kind)
                    return
                if parsed is not None:
                    start, end = parsed
                    length = end - start + 1
                    status = 206
                    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            if status == 206 or owner.lengths:
                headers["Content-Length"] = str(length)
            else:
                headers["Connection"] = "close"  # the body ends with the connection
                self.close_connection = True
            record = self._begin(owner, method, name, range_header, status, headers, kind)
            if head:
                return
            f.seek(start)
            self._send_file_body(owner, f, length, record, fault)
            if kind == "change":
                owner._replace(target, fault.params["content"], st.st_mtime, fault.params.get("etags"))

    def _send_file_body(
        self, owner: ShardServer, f: BinaryIO, length: int, record: Request, fault: _Fault | None
    ) -> None:
        kind = fault.kind if fault else None
        params = fault.params if fault else {}
        if kind in ("cut", "short", "change") or (kind == "no_range" and "after" in params):
            after = _clamp(params.get("after", length // 2), length)
            self._copy(owner, f, after, record)
            self.close_connection = True
            if kind in ("cut", "change"):
                owner._wait_unsent_drained(self.connection)
                self._reset_on_close = True
            else:
                # A clean FIN: the client sees EOF before Content-Length (if sent) is met.
                self.connection.shutdown(socket.SHUT_WR)
            return
        if kind == "stall":
            after = _clamp(params.get("after", 0), length)
            self._copy(owner, f, after, record)
            owner._stall(float(params["seconds"]), params.get("until"))
            if params.get("then", "continue") == "close":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_WR)
                return
            self._copy(owner, f, length - after, record)
            return
        self._copy(owner, f, length, record)

    def _copy(self, owner: ShardServer, f: BinaryIO, n: int, record: Request) -> None:
        """Send ``n`` bytes from ``f``, paced to ``owner.rate`` when set.

        Paced from the start of the body (or from the last change of the rate): the
        bytes sent never exceed rate x time, and a slice that went out late (a busy
        machine) is made up for, so a connection gets its cap, not less.
        """
        remaining = n
        paced_rate, paced_from, paced_sent = None, 0.0, 0
        while remaining > 0:
            rate = owner.rate
            # Small slices at low rates keep pacing smooth instead of bursty.
            chunk = _CHUNK if not rate else max(1024, min(_CHUNK, int(rate / 20)))
            data = f.read(min(chunk, remaining))
            if not data:
                raise _Abort  # file shrank under us; Content-Length is now a lie
            if rate:
                if rate != paced_rate:
                    paced_rate, paced_from, paced_sent = rate, time.monotonic(), 0
                # Sleep *before* sending so no prefix of the body ever beats the cap.
                paced_sent += len(data)
                owner._sleep(paced_from + paced_sent / rate - time.monotonic())
            self.wfile.write(data)
            remaining -= len(data)
            record.bytes_sent += len(data)
            record.sent_at = time.monotonic()

    def _trickle(self, owner: ShardServer, method: str, name: str, range_header: str | None, every: float) -> None:
        """A status line, then one byte of a header every ``every`` seconds, never ending (until
        the client hangs up or the server stops): a broken server or proxy no read timeout sees."""
        owner._log(
            Request(method, name, range_header, 200, 0, "trickle", time.monotonic(), self.headers.get("If-Range"))
        )
        self.close_connection = True
        self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Trickle: ")
        while True:
            owner._sleep(every)
            self.wfile.write(b"a")

    def _begin(
        self,
        owner: ShardServer,
        method: str,
        name: str,
        range_header: str | None,
        status: int,
        headers: dict[str, str],
        fault: str | None,
        reason: str | None = None,
    ) -> Request:
        """Wait out ttfb, log the request, and send status line (``reason``: its phrase, else the
        status's own) and headers."""
        owner._sleep(owner.ttfb)
        record = Request(method, name, range_header, status, 0, fault, time.monotonic(), self.headers.get("If-Range"))
        owner._log(record)
        self.send_response(status, reason)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        return record

    def _simple(
        self,
        owner: ShardServer,
        method: str,
        name: str,
        range_header: str | None,
        status: int,
        body: bytes,
        head: bool,
        headers: dict[str, str] | None = None,
        fault: str | None = None,
        reason: str | None = None,
    ) -> None:
        """Send a small in-memory response (errors, injected pages)."""
        all_headers = {"Content-Type": "text/plain; charset=utf-8"}
        all_headers.update(headers or {})
        all_headers["Content-Length"] = str(len(body))
        record = self._begin(owner, method, name, range_header, status, all_headers, fault, reason)
        if not head and body:
            self.wfile.write(body)
            record.bytes_sent = len(body)


class _HTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """ThreadingHTTPServer that tracks its connections so stop() can end them."""

    daemon_threads = True
    block_on_close = False  # we join our own threads, with a bound
    request_queue_size = 128  # many parallel clients connect at once in benchmarks

    def __init__(self, address: tuple[str, int], owner: ShardServer) -> None:
        self.owner = owner
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self.accepted = 0
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls getfqdn(), which can stall on odd DNS setups.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"ShardServer-conn-{client_address[1]}",
            daemon=True,
        )
        with self._conns_lock:
            self._conns[request] = thread
            self.accepted += 1
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:
            with self._conns_lock:
                self._conns.pop(request, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Record instead of printing a traceback to stderr.
        exc = sys.exc_info()[1]
        if exc is not None:
            self.owner._record_error(exc)

    def drop_connections(self) -> list[threading.Thread]:
        """Shut down every client socket; return the threads serving them."""
        with self._conns_lock:
            items = list(self._conns.items())
        for sock, _thread in items:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked in recv/send
            except OSError:
                pass
        return [thread for _sock, thread in items]


class ShardServer:
    """Serve files under ``root`` over HTTP on 127.0.0.1, with fault injection.

    ``rate`` caps bandwidth per connection (bytes/s), ``ttfb`` delays response
    headers (seconds), ``accept_ranges=False`` makes the server ignore Range,
    ``etags=False`` sends no ETag (Last-Modified only, as plain file servers do),
    ``last_modified=False`` sends no Last-Modified, ``if_range=False`` ignores
    If-Range (a Range is served from whatever version the file is now, as some
    servers do), ``lengths=False`` sends no Content-Length with a whole body (200): the body
    ends where the server closes the connection, as HTTP/1.0 servers and some proxies send
    it. ``gzip=True`` answers a client whose Accept-Encoding names gzip with the whole file gzip'd
    (``Content-Encoding: gzip``, the compressed size and an ETag of its own, no Range), as a server
    that negotiates compression does; ``encoding="gzip"`` labels every file's answer ``Content-Encoding:
    gzip`` whatever was asked, as a server told that ``.gz`` files are gzip-encoded does (Apache's
    AddEncoding; an object stored with that metadata). All of them may be changed while the server runs.  Use as a context manager,
    or call :meth:`start` and :meth:`stop`.  After a stop, :meth:`start` binds
    the same port again, which lets tests simulate an outage.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rate: float | None = None,
        ttfb: float = 0.0,
        accept_ranges: bool = True,
        etags: bool = True,
        last_modified: bool = True,
        if_range: bool = True,
        lengths: bool = True,
        gzip: bool = False,
        encoding: str | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        self.rate = rate
        self.ttfb = ttfb
        self.accept_ranges = accept_ranges
        self.etags = etags
        self.last_modified = last_modified
        self.if_range = if_range
        self.lengths = lengths
        self.gzip = gzip
        self.encoding = encoding
        self._lock = threading.Lock()
        self._faults: dict[str, collections.deque[_Fault]] = {}
        self._requests: list[Request] = []
        self._errors: list[BaseException] = []
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> ShardServer:
        """Bind (reusing the previous port after a stop) and serve in a daemon thread."""
        if self._httpd is not None:
            raise RuntimeError("ShardServer is already running")
        self._stopping = threading.Event()
        httpd = _HTTPServer(("127.0.0.1", self._port or 0), self)
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},  # stop() returns quickly
            name=f"ShardServer-{self._port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the listening socket and all client connections.

        Sleeps (ttfb, pacing, stalls) are interrupted.  Waits at most a few
        seconds in total for handler threads.  Calling it twice is harmless.
        """
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        self._stopping.set()
        deadline = time.monotonic() + _JOIN_TIMEOUT
        httpd.shutdown()
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
        httpd.server_close()
        for handler in httpd.drop_connections():
            handler.join(max(0.0, deadline - time.monotonic()))
        self._httpd = None
        self._thread = None

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True between start() and stop()."""
        return self._httpd is not None

    # -- addresses -----------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port (assigned by the OS at the first start)."""
        if self._port is None:
            raise RuntimeError("ShardServer has not been started")
        return self._port

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` without a trailing slash."""
        return f"http://127.0.0.1:{self.port}"

    def url(self, name: str | os.PathLike[str]) -> str:
        """The URL of ``name``, a path relative to root (or an absolute path inside it)."""
        return f"{self.base_url}/{urllib.parse.quote(self._norm(name))}"

    # -- faults --------------------------------------------------------------

    def fail(self, name: str | os.PathLike[str], kind: str, *, times: int = 1, **params: Any) -> None:
        """Queue fault ``kind`` for the next ``times`` GETs of ``name``.

        Kinds and their parameters:

        - ``status``: ``status`` (required), ``retry_after``, ``body``, ``headers``, ``reason`` (the
          status line's reason phrase, else the status's own).
          Also applies to (and is consumed by) HEAD.
        - ``cut``: full headers, then a TCP reset after ``after`` body bytes
          (default half the body).
        - ``short``: only ``after`` bytes (of a body its Content-Length, if sent, says is
          longer), then a clean close.
        - ``stall``: ``after`` bytes (default 0), a pause of ``seconds`` (required; ended
          sooner once ``until``, a :class:`threading.Event`, is set), then the rest, or a
          clean close if ``then="close"``.
        - ``html``: a 200 text/html error page (``body`` overrides it).
        - ``no_range``: ignore Range for this request and send 200 with the full file (with
          ``after``: only that many bytes of it, then a clean close, as ``short``).
        - ``change``: ``after`` body bytes (default half the body), then the file becomes a
          new version, ``content`` (bytes, required; its mtime a second later, so both its
          ETag and its Last-Modified change), the server's ``etags`` becomes ``etags`` if
          given, and the connection is reset: an object replaced mid-download.
        - ``trickle``: a status line, then one byte of a header every ``every`` seconds
          (default 0.5), until the client hangs up or the server stops: a head that never
          ends, though the connection is never silent. Also applies to (and is consumed by) HEAD.

        Any kind also takes ``range``: it then applies only to a GET whose Range header is
        exactly that (say, one part of a download in parallel parts).
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {sorted(FAULT_KINDS)}")
        unknown = set(params) - _FAULT_PARAMS[kind] - {"range"}
        if unknown:
            raise TypeError(f"fault {kind!r} does not take {sorted(unknown)}")
        if kind == "status" and "status" not in params:
            raise TypeError("fault 'status' needs status=<int>")
        if kind == "stall" and "seconds" not in params:
            raise TypeError("fault 'stall' needs seconds=<float>")
        if kind == "change" and not isinstance(params.get("content"), bytes):
            raise TypeError("fault 'change' needs content=<bytes>")
        if kind == "stall" and params.get("then", "continue") not in ("continue", "close"):
            raise ValueError("stall then= must be 'continue' or 'close'")
        if times < 1:
            raise ValueError("times must be >= 1")
        fault = _Fault(kind, dict(params))
        with self._lock:
            self._faults.setdefault(self._norm(name), collections.deque()).extend([fault] * times)

    def clear_faults(self) -> None:
        """Drop every queued fault."""
        with self._lock:
            self._faults.clear()

    def pending_faults(self, name: str | os.PathLike[str]) -> list[str]:
        """Kinds of the faults still queued for ``name``, in order."""
        with self._lock:
            return [f.kind for f in self._faults.get(self._norm(name), ())]

    # -- request log ---------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        """A snapshot of the request log, oldest first."""
        with self._lock:
            return list(self._requests)

    @property
    def errors(self) -> list[BaseException]:
        """Exceptions raised outside a response (mostly clients hanging up)."""
        with self._lock:
            return list(self._errors)

    @property
    def connections_accepted(self) -> int:
        """TCP connections accepted since the last start (checks connection reuse)."""
        return self._httpd.accepted if self._httpd is not None else 0

    def count(self, name: str | os.PathLike[str], method: str | None = "GET") -> int:
        """How many requests for ``name`` were logged (any method if ``method`` is None)."""
        key = self._norm(name)
        return sum(1 for r in self.requests if r.path == key and (method is None or r.method == method))

    def ranges(self, name: str | os.PathLike[str]) -> list[str | None]:
        """The Range header of each GET of ``name``, in order (None when absent)."""
        key = self._norm(name)
        return [r.range for r in self.requests if r.path == key and r.method == "GET"]

    def reset_log(self) -> None:
        """Forget logged requests and errors."""
        with self._lock:
            self._requests.clear()
            self._errors.clear()

    # -- internals used by the handler ----------------------------------------

    def _norm(self, name: str | os.PathLike[str]) -> str:
        raw = os.fspath(name)
        if os.path.isabs(raw):
            real = os.path.realpath(raw)
            if os.path.commonpath([real, str(self.root)]) == str(self.root):
                raw = os.path.relpath(real, self.root)
        raw = raw.replace(os.sep, "/")
        return "/".join(p for p in raw.split("/") if p not in ("", "."))

    def _name_from_request_path(self, request_path: str) -> str | None:
        """Decode the URL path to a root-relative name; None if it escapes root."""
        path = request_path.split("?", 1)[0].split("#", 1)[0]
        name = urllib.parse.unquote(path)
        if "\x00" in name or "\\" in name:
            return None
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            return None
        return "/".join(parts)

    def _file_for(self, name: str) -> Path | None:
        """The regular file for ``name``, or None (missing, a directory, or outside root)."""
        real = os.path.realpath(self.root / name)
        # A symlink inside root must not lead outside it.
        if os.path.commonpath([real, str(self.root)]) != str(self.root):
            return None
        return Path(real) if os.path.isfile(real) else None

    def _take_fault(self, name: str, head: bool, range_header: str | None) -> _Fault | None:
        with self._lock:
            queue = self._faults.get(name)
            if not queue:
                return None
            # A fault for one Range waits for that request; the others pass it by.
            fault = next((f for f in queue if f.params.get("range") in (None, range_header)), None)
            if fault is None or (head and fault.kind not in _HEAD_FAULTS):
                return None
            queue.remove(fault)
            if not queue:
                del self._faults[name]
            return fault

    def _log(self, record: Request) -> None:
        with self._lock:
            self._requests.append(record)

    def _replace(self, path: Path, content: bytes, mtime: float, etags: bool | None) -> None:
        """Make ``path`` a new version: ``content``, written aside and renamed over it, dated a
        second after ``mtime`` (a new Last-Modified even within the same second)."""
        aside = path.with_name(f".{path.name}.new")
        aside.write_bytes(content)
        later = int(mtime) + 1.0
        os.utime(aside, (later, later))
        os.replace(aside, path)
        if etags is not None:
            self.etags = etags

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def _stall(self, seconds: float, until: threading.Event | None) -> None:
        """Pause ``seconds``, or until ``until`` is set if that comes first (a test's say-so)."""
        if until is None:
            self._sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while not until.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return
            self._sleep(0)  # (raises if the server is stopping)

    def _sleep(self, seconds: float | None) -> None:
        """Sleep, but raise _Abort at once if the server is stopping."""
        if self._stopping.is_set():
            raise _Abort
        if seconds and seconds > 0 and self._stopping.wait(seconds):
            raise _Abort

    def _wait_unsent_drained(self, sock: socket.socket, limit: float = 1.0) -> None:
        """Wait until the peer has acknowledged everything we sent.

        A reset discards unsent data, so without this a "cut" after N bytes
        would deliver an unpredictable amount.  Linux reports the unacked
        byte count via TIOCOUTQ; elsewhere a short pause does nearly as well.
        """
        try:
            import fcntl
            import termios

            query = termios.TIOCOUTQ
        except (ImportError, AttributeError):
            self._sleep(0.05)
            return
        deadline = time.monotonic() + limit
        buf = bytearray(4)
        while time.monotonic() < deadline:
            try:
                fcntl.ioctl(sock.fileno(), query, buf)
            except OSError:
                self._sleep(0.05)
                return
            if struct.unpack("i", bytes(buf))[0] == 0:
                return
            self._sleep(0.002)


def _content_type(name: str) -> str:
    lower = name.lower()
    if lower.endswith((".gz", ".tgz")):
        return "application/gzip"
    return "application/x-tar"


def _clamp(value: Any, upper: int) -> int:
    return max(0, min(int(value), upper))


def _parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """Parse a single ``bytes=`` range against ``size``.

    Returns ``(first, last)`` inclusive, ``"unsatisfiable"``, or None when the
    header is malformed or asks for several ranges: RFC 9110 lets a server
    ignore such a header and send the whole file.
    """
    match = _RANGE_RE.fullmatch(header)
    if match is None:
        return None
    first_s, last_s = match.group(1), match.group(2)
    if first_s == "":
        if last_s == "":
            return None
        suffix = int(last_s)
        if suffix == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - suffix), size - 1
    first = int(first_s)
    if last_s and int(last_s) < first:
        return None
    if first >= size:
        return "unsatisfiable"
    last = min(int(last_s), size - 1) if last_s else size - 1
    return first, last
