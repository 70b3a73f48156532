"""Tests of the test infrastructure itself: ShardServer and the shard makers.

If these fail, every wdscache test built on them is suspect, so they check the
server from the client's side with requests and raw sockets.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import random
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts.shard_maker import (
    find_gnu_tar,
    make_dataset,
    make_shard,
    read_samples_reference,
    synth_samples,
    write_url_list,
)
from scripts.shard_server import ShardServer
from tests.helpers.waits import wait_for

TIMEOUT = 5.0  # every network wait in this file is bounded
SIZE = 256 * 1024


# -- helpers -------------------------------------------------------------------


def raw_get(
    port: int, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes, OSError | None]:
    """GET over a bare socket; return status, headers, every body byte received, and the error.

    requests buffers and hides how many bytes arrived before a failure, which
    is exactly what the fault tests need to see.
    """
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    buf = bytearray()
    error: OSError | None = None
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            while chunk := sock.recv(65536):
                buf += chunk
        except OSError as exc:  # includes socket.timeout, so a hang fails loudly below
            error = exc
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {}
    for line in header_lines:
        key, _, value = line.partition(":")
        parsed[key.strip().lower()] = value.strip()
    return int(status_line.split()[1]), parsed, body, error


def server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ShardServer")]


def extra_nondaemon_threads() -> list[threading.Thread]:
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


# -- fixtures ------------------------------------------------------------------


@pytest.fixture
def data() -> bytes:
    return random.Random(1234).randbytes(SIZE)


@pytest.fixture
def root(tmp_path: Path, data: bytes) -> Path:
    root = tmp_path / "root"
    (root / "sub dir").mkdir(parents=True)
    (root / "data.tar").write_bytes(data)
    (root / "sub dir" / "x y#1.tar").write_bytes(data[:1000])
    (root / "data.tar.gz").write_bytes(b"\x1f\x8b" + data[:100])
    (root / "empty.tar").write_bytes(b"")
    (tmp_path / "secret.tar").write_bytes(b"outside the root")
    return root


@pytest.fixture
def server(root: Path) -> Iterator[ShardServer]:
    with ShardServer(root) as srv:
        yield srv
        # Client hang-ups are expected; anything else is a server bug.
        assert [e for e in srv.errors if not isinstance(e, OSError)] == []


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


# -- plain serving -------------------------------------------------------------


def test_full_get_matches_file(server: ShardServer, http: requests.Session, data: bytes) -> None:
    r = http.get(server.url("data.tar"), timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.content == data
    assert r.headers["Content-Length"] == str(SIZE)
    assert r.headers["Content-Type"] == "application/x-tar"
    assert r.headers["Accept-Ranges"] == "bytes"
    assert r.headers["ETag"].startswith('"') and r.headers["ETag"].endswith('"')
    assert r.headers["Last-Modified"].endswith("GMT")
    assert server.base_url == f"http://127.0.0.1:{server.port}"


def test_etag_changes_with_content(server: ShardServer, http: requests.Session, root: Path) -> None:
    before = http.head(server.url("data.tar"), timeout=TIMEOUT).headers["ETag"]
    (root / "data.tar").write_bytes(b"different and shorter")
    after = http.head(server.url("data.tar"), timeout=TIMEOUT).headers["ETag"]
    assert before != after


def test_gzip_type_and_quoted_names(server: ShardServer, http: requests.Session, data: bytes) -> None:
    assert http.get(server.url("data.tar.gz"), timeout=TIMEOUT).headers["Content-Type"] == ("application/gzip")
    url = server.url("sub dir/x y#1.tar")
    assert "%20" in url and "%23" in url
    r = http.get(url, timeout=TIMEOUT)
    assert r.status_code == 200 and r.content == data[:1000]
    assert server.count("sub dir/x y#1.tar") == 1


@pytest.mark.parametrize(
    ("spec", "first", "last"),
    [
        ("bytes=0-99", 0, 99),
        ("bytes=1000-", 1000, SIZE - 1),
        ("bytes=-500", SIZE - 500, SIZE - 1),
        ("bytes=-999999999", 0, SIZE - 1),
        ("bytes=100-99999999", 100, SIZE - 1),
        (f"bytes={SIZE - 1}-{SIZE - 1}", SIZE - 1, SIZE - 1),
    ],
)
def test_range_206(server: ShardServer, http: requests.Session, data: bytes, spec: str, first: int, last: int) -> None:
    r = http.get(server.url("data.tar"), headers={"Range": spec}, timeout=TIMEOUT)
    assert r.status_code == 206
    assert r.headers["Content-Range"] == f"bytes {first}-{last}/{SIZE}"
    assert r.headers["Content-Length"] == str(last - first + 1)
    assert r.content == data[first : last + 1]


@pytest.mark.parametrize(
    ("name", "spec"),
    [("data.tar", f"bytes={SIZE}-"), ("data.tar", "bytes=-0"), ("empty.tar", "bytes=0-"), ("empty.tar", "bytes=-5")],
)
def test_range_416(server: ShardServer, http: requests.Session, name: str, spec: str) -> None:
    r = http.get(server.url(name), headers={"Range": spec}, timeout=TIMEOUT)
    size = SIZE if name == "data.tar" else 0
    assert r.status_code == 416
    assert r.headers["Content-Range"] == f"bytes */{size}"


@pytest.mark.parametrize("spec", ["bytes=0-1,5-6", "items=0-5", "bytes=9-3", "bytes=x-"])
def test_malformed_or_multi_range_gets_full_body(
    server: ShardServer, http: requests.Session, data: bytes, spec: str
) -> None:
    r = http.get(server.url("data.tar"), headers={"Range": spec}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.content == data


def test_accept_ranges_false_and_settable(root: Path, data: bytes, http: requests.Session) -> None:
    with ShardServer(root, accept_ranges=False) as srv:
        r = http.get(srv.url("data.tar"), headers={"Range": "bytes=0-9"}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.content == data
        assert "Accept-Ranges" not in r.headers and "Content-Range" not in r.headers
        srv.accept_ranges = True
        r = http.get(srv.url("data.tar"), headers={"Range": "bytes=0-9"}, timeout=TIMEOUT)
        assert r.status_code == 206 and r.content == data[:10]


def test_head(server: ShardServer, http: requests.Session) -> None:
    r = http.head(server.url("data.tar"), timeout=TIMEOUT)
    assert r.status_code == 200 and r.content == b""
    assert r.headers["Content-Length"] == str(SIZE)
    assert r.headers["Accept-Ranges"] == "bytes"
    assert http.head(server.url("nope.tar"), timeout=TIMEOUT).status_code == 404
    assert server.count("data.tar", method="HEAD") == 1 and server.count("data.tar") == 0


def test_missing_and_outside_root(server: ShardServer, http: requests.Session, root: Path) -> None:
    assert http.get(server.url("nope.tar"), timeout=TIMEOUT).status_code == 404
    assert http.get(server.url("sub dir"), timeout=TIMEOUT).status_code == 404  # a directory
    # Raw requests, because clients normalise ".." away before sending.
    for path in ("/../secret.tar", "/%2e%2e/secret.tar", "/sub%20dir/../../secret.tar", "/..%2fsecret.tar"):
        status, _, body, _ = raw_get(server.port, path)
        assert status == 403, path
        assert b"outside" not in body
    try:
        os.symlink(root.parent / "secret.tar", root / "link.tar")
    except OSError:
        return
    assert http.get(server.url("link.tar"), timeout=TIMEOUT).status_code == 404


def test_keep_alive_reuses_one_connection(server: ShardServer, http: requests.Session) -> None:
    for spec in (None, "bytes=0-9", "bytes=-5"):
        headers = {"Range": spec} if spec else {}
        http.get(server.url("data.tar"), headers=headers, timeout=TIMEOUT).raise_for_status()
    http.get(server.url("nope.tar"), timeout=TIMEOUT)
    http.get(server.url("data.tar"), timeout=TIMEOUT).raise_for_status()
    assert server.connections_accepted == 1


def test_many_concurrent_clients(server: ShardServer, data: bytes) -> None:
    def fetch(i: int) -> bytes:
        start = i * 1000
        r = requests.get(
            server.url("data.tar"),
            headers={"Range": f"bytes={start}-{start + 4999}"},
            timeout=TIMEOUT,
        )
        return r.content

    with concurrent.futures.ThreadPoolExecutor(max_workers=48) as pool:
        results = list(pool.map(fetch, range(96), timeout=30))
    assert all(got == data[i * 1000 : i * 1000 + 5000] for i, got in enumerate(results))
    assert server.count("data.tar") == 96


def test_ranges_match_a_model(tmp_path: Path) -> None:
    body = bytes(range(256)) * 4  # 1024 bytes, every offset distinguishable
    (tmp_path / "m.tar").write_bytes(body)
    bound = st.one_of(st.none(), st.integers(0, 1100))

    # One server for all examples; database=None keeps .hypothesis/ out of the repo.
    with ShardServer(tmp_path) as srv, requests.Session() as http:

        @settings(max_examples=80, deadline=None, database=None)
        @given(first=bound, last=bound)
        def check(first: int | None, last: int | None) -> None:
            spec = f"bytes={'' if first is None else first}-{'' if last is None else last}"
            r = http.get(srv.url("m.tar"), headers={"Range": spec}, timeout=TIMEOUT)
            if (first is None and last is None) or (first is not None and last is not None and last < first):
                assert r.status_code == 200 and r.content == body  # invalid: ignored
            elif first is None:
                assert last is not None
                if last == 0:
                    assert r.status_code == 416
                else:
                    assert r.status_code == 206 and r.content == body[-last:]
            elif first >= len(body):
                assert r.status_code == 416
            else:
                end = len(body) if last is None else min(last + 1, len(body))
                assert r.status_code == 206 and r.content == body[first:end]

        check()


# -- pacing ----------------------------------------------------------------------


def test_rate_cap(root: Path, data: bytes, http: requests.Session) -> None:
    with ShardServer(root, rate=10_000) as srv:
        t0 = time.monotonic()
        r = http.get(srv.url("data.tar"), headers={"Range": "bytes=0-3999"}, timeout=TIMEOUT)
        assert r.content == data[:4000]
        assert time.monotonic() - t0 >= 0.25  # 4 KB in 1 KB slices at 10 KB/s: the cap held it back
        srv.rate = None  # settable while running
        t0 = time.monotonic()
        assert http.get(srv.url("data.tar"), timeout=TIMEOUT).content == data
        assert time.monotonic() - t0 < SIZE / 10_000 / 2  # uncapped: not the 26 s the cap would take


def test_ttfb(server: ShardServer, http: requests.Session) -> None:
    server.ttfb = 0.2
    t0 = time.monotonic()
    r = http.get(server.url("data.tar"), stream=True, timeout=TIMEOUT)
    assert time.monotonic() - t0 >= 0.18
    r.close()


# -- faults ----------------------------------------------------------------------


def test_fault_status_with_retry_after(server: ShardServer, http: requests.Session, data: bytes) -> None:
    server.fail("data.tar", "status", times=2, status=503, retry_after=7)
    for _ in range(2):
        r = http.get(server.url("data.tar"), timeout=TIMEOUT)
        assert r.status_code == 503 and r.headers["Retry-After"] == "7"
        assert len(r.content) < 100
    assert http.get(server.url("data.tar"), timeout=TIMEOUT).content == data
    # Only "status" faults reach HEAD, and HEAD consumes them.
    server.fail("data.tar", "status", status=403)
    assert http.head(server.url("data.tar"), timeout=TIMEOUT).status_code == 403
    assert server.pending_faults("data.tar") == []


def test_fault_status_on_missing_file(server: ShardServer, http: requests.Session) -> None:
    server.fail("later.tar", "status", status=429)
    assert http.get(server.url("later.tar"), timeout=TIMEOUT).status_code == 429
    assert http.get(server.url("later.tar"), timeout=TIMEOUT).status_code == 404


def test_fault_cut(server: ShardServer, http: requests.Session, data: bytes) -> None:
    server.fail("data.tar", "cut")
    got = b""
    with pytest.raises((requests.exceptions.ChunkedEncodingError, requests.ConnectionError)):
        r = http.get(server.url("data.tar"), stream=True, timeout=TIMEOUT)
        assert r.headers["Content-Length"] == str(SIZE)
        for chunk in r.iter_content(4096):
            got += chunk
    assert len(got) < SIZE and got == data[: len(got)]
    # The pool drops the broken connection; the next request works.
    assert http.get(server.url("data.tar"), timeout=TIMEOUT).content == data
    # Byte-exact view: the body stops at "after" and ends in a reset, not a clean EOF.
    server.fail("data.tar", "cut", after=12345)
    status, headers, body, error = raw_get(server.port, "/data.tar")
    assert status == 200 and headers["content-length"] == str(SIZE)
    assert len(body) <= 12345 and body == data[: len(body)]
    assert isinstance(error, ConnectionResetError)


def test_fault_cut_applies_to_ranges(server: ShardServer, data: bytes) -> None:
    server.fail("data.tar", "cut", after=10)
    status, headers, body, _ = raw_get(server.port, "/data.tar", {"Range": "bytes=100-"})
    assert status == 206 and headers["content-length"] == str(SIZE - 100)
    assert len(body) <= 10 and body == data[100 : 100 + len(body)]


def test_fault_short(server: ShardServer, http: requests.Session, data: bytes) -> None:
    server.fail("data.tar", "short", after=5000)
    status, headers, body, error = raw_get(server.port, "/data.tar")
    assert status == 200 and int(headers["content-length"]) == SIZE
    assert body == data[:5000] and error is None  # clean EOF, wrong length
    server.fail("data.tar", "short")
    with pytest.raises((requests.exceptions.ChunkedEncodingError, requests.ConnectionError)):
        http.get(server.url("data.tar"), timeout=TIMEOUT)


def test_fault_stall(server: ShardServer, http: requests.Session, data: bytes) -> None:
    server.fail("data.tar", "stall", after=1000, seconds=0.3)
    t0 = time.monotonic()
    r = http.get(server.url("data.tar"), timeout=TIMEOUT)
    assert r.content == data and time.monotonic() - t0 >= 0.28
    # A read timeout shorter than the stall fires on the client.
    server.fail("data.tar", "stall", seconds=2.0)
    with pytest.raises(requests.exceptions.ConnectionError):  # ReadTimeoutError while streaming
        http.get(server.url("data.tar"), timeout=(TIMEOUT, 0.2)).content  # noqa: B018
    # then="close" ends the body early with a clean close.
    server.fail("data.tar", "stall", after=2000, seconds=0.05, then="close")
    _, _, body, error = raw_get(server.port, "/data.tar")
    assert body == data[:2000] and error is None
    # until= ends the stall when the test sets it (seconds stays its bound).
    go, before = threading.Event(), server.count("data.tar")
    server.fail("data.tar", "stall", after=1000, seconds=60, until=go)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(http.get(server.url("data.tar"), timeout=TIMEOUT).content))
    reader.start()
    wait_for(lambda: server.count("data.tar") > before, 10, "the GET arrived")
    assert reader.is_alive() and not got
    go.set()
    reader.join(TIMEOUT)
    assert got == [data]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_fault_trickle_sends_a_head_that_never_ends_yet_is_never_silent(
    server: ShardServer, data: bytes, method: str
) -> None:
    server.fail("data.tar", "trickle", every=0.05)
    got = bytearray()
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(f"{method} /data.tar HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            got += sock.recv(100)  # (each read within TIMEOUT: a read timeout never fires)
    start = b"HTTP/1.1 200 OK\r\nX-Trickle: "
    assert got.startswith(start) and set(got[len(start) :]) == {ord("a")} and len(got) >= len(start) + 3, got
    assert [(r.method, r.fault) for r in server.requests] == [(method, "trickle")]
    _, _, body, error = raw_get(server.port, "/data.tar")  # consumed: the next request is served
    assert body == data and error is None


def test_fault_html(server: ShardServer, http: requests.Session, data: bytes) -> None:
    server.fail("data.tar", "html")
    # HEAD neither sees nor consumes a non-status fault.
    assert http.head(server.url("data.tar"), timeout=TIMEOUT).headers["Content-Type"] == ("application/x-tar")
    r = http.get(server.url("data.tar"), headers={"Range": "bytes=0-9"}, timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/html")
    assert r.content.lstrip().lower().startswith(b"<!doctype html")
    assert http.get(server.url("data.tar"), timeout=TIMEOUT).content == data


def test_fault_no_range(server: ShardServer, http: requests.Session, data: bytes) -> None:
    server.fail("data.tar", "no_range")
    r = http.get(server.url("data.tar"), headers={"Range": "bytes=10-19"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.content == data
    r = http.get(server.url("data.tar"), headers={"Range": "bytes=10-19"}, timeout=TIMEOUT)
    assert r.status_code == 206 and r.content == data[10:20]
    server.fail("data.tar", "no_range", after=3000)  # and cut short, cleanly
    status, _, body, error = raw_get(server.port, "/data.tar", {"Range": "bytes=10-19"})
    assert status == 200 and body == data[:3000] and error is None


def test_lengths_false_ends_a_whole_body_with_the_connection(
    server: ShardServer, http: requests.Session, data: bytes
) -> None:
    server.lengths = False
    status, headers, body, error = raw_get(server.port, "/data.tar")
    assert status == 200 and "content-length" not in headers and headers["connection"] == "close"
    assert body == data and error is None
    r = http.get(server.url("data.tar"), headers={"Range": "bytes=10-19"}, timeout=TIMEOUT)
    assert r.status_code == 206 and r.headers["Content-Length"] == "10" and r.content == data[10:20]
    server.fail("data.tar", "short", after=4000)  # nothing tells the client it is cut short
    status, headers, body, error = raw_get(server.port, "/data.tar")
    assert status == 200 and "content-length" not in headers and body == data[:4000] and error is None


def test_fault_change_replaces_the_file_mid_body(
    server: ShardServer, http: requests.Session, data: bytes, root: Path
) -> None:
    before = http.head(server.url("data.tar"), timeout=TIMEOUT).headers
    new = bytes(b ^ 0xFF for b in data)
    server.fail("data.tar", "change", after=5000, content=new, etags=False)
    status, _, body, error = raw_get(server.port, "/data.tar")
    assert status == 200 and len(body) <= 5000 and body == data[: len(body)]
    assert isinstance(error, ConnectionResetError)
    assert (root / "data.tar").read_bytes() == new
    after = http.head(server.url("data.tar"), timeout=TIMEOUT).headers
    assert "ETag" not in after and after["Last-Modified"] != before["Last-Modified"]  # a new date, to the second
    with pytest.raises(TypeError):
        server.fail("data.tar", "change")


def test_validators_and_if_range_are_switchable(
    server: ShardServer, http: requests.Session, data: bytes, root: Path
) -> None:
    etag = http.head(server.url("data.tar"), timeout=TIMEOUT).headers["ETag"]
    stale = {"Range": "bytes=10-19", "If-Range": '"another"'}
    assert http.get(server.url("data.tar"), headers=stale, timeout=TIMEOUT).status_code == 200
    server.if_range = False  # a server that ignores If-Range serves the range of what it has now
    r = http.get(server.url("data.tar"), headers=stale, timeout=TIMEOUT)
    assert r.status_code == 206 and r.content == data[10:20] and r.headers["ETag"] == etag
    server.last_modified = False
    assert "Last-Modified" not in http.head(server.url("data.tar"), timeout=TIMEOUT).headers
    server.etags = False
    assert not {"ETag", "Last-Modified"} & set(http.head(server.url("data.tar"), timeout=TIMEOUT).headers)


def test_faults_in_order_and_clear(server: ShardServer, http: requests.Session) -> None:
    server.fail("data.tar", "status", status=500)
    server.fail("data.tar", "status", status=429, times=2)
    server.fail("data.tar", "html")
    assert server.pending_faults("data.tar") == ["status", "status", "status", "html"]
    codes = [http.get(server.url("data.tar"), timeout=TIMEOUT).status_code for _ in range(3)]
    assert codes == [500, 429, 429]
    server.clear_faults()
    r = http.get(server.url("data.tar"), timeout=TIMEOUT)
    assert r.headers["Content-Type"] == "application/x-tar"
    assert [rec.fault for rec in server.requests] == ["status"] * 3 + [None]


def test_fail_rejects_bad_arguments(server: ShardServer) -> None:
    with pytest.raises(ValueError):
        server.fail("data.tar", "explode")
    with pytest.raises(TypeError):
        server.fail("data.tar", "status")
    with pytest.raises(TypeError):
        server.fail("data.tar", "stall")
    with pytest.raises(TypeError):
        server.fail("data.tar", "cut", aftr=3)
    with pytest.raises(ValueError):
        server.fail("data.tar", "html", times=0)
    assert server.pending_faults("data.tar") == []


# -- request log -----------------------------------------------------------------


def test_request_log(server: ShardServer, http: requests.Session, root: Path) -> None:
    http.get(server.url("data.tar"), timeout=TIMEOUT)
    http.get(server.url("data.tar"), headers={"Range": "bytes=0-9"}, timeout=TIMEOUT)
    http.head(server.url("data.tar"), timeout=TIMEOUT)
    http.get(server.url("nope.tar"), timeout=TIMEOUT)
    assert server.count("data.tar") == 2
    assert server.count(root / "data.tar") == 2  # absolute paths inside root work too
    assert server.count("/data.tar", method="HEAD") == 1
    assert server.count("data.tar", method=None) == 3
    assert server.ranges("data.tar") == [None, "bytes=0-9"]
    # The client has the last body once the server wrote it, a moment before the server counts it.
    wait_for(lambda: server.requests[-1].bytes_sent, TIMEOUT, "the 404's body was never counted as sent")
    log = server.requests
    assert [(r.method, r.path, r.status, r.bytes_sent) for r in log] == [
        ("GET", "data.tar", 200, SIZE),
        ("GET", "data.tar", 206, 10),
        ("HEAD", "data.tar", 200, 0),
        ("GET", "nope.tar", 404, len(b"not found\n")),
    ]
    server.reset_log()
    assert server.requests == [] and server.count("data.tar") == 0


# -- robustness and shutdown -----------------------------------------------------


def test_early_disconnects_are_quiet(server: ShardServer, data: bytes, capfd: pytest.CaptureFixture[str]) -> None:
    for _ in range(5):
        r = requests.get(server.url("data.tar"), stream=True, timeout=TIMEOUT)
        next(r.iter_content(1024))
        r.close()  # hang up with most of the body unsent
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT):
        pass  # connect and leave without a request
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"GET /data.tar HTT")  # half a request line
    assert requests.get(server.url("data.tar"), timeout=TIMEOUT).content == data
    server.stop()
    assert capfd.readouterr().err == ""


def test_stop_releases_sockets_and_threads(root: Path, data: bytes) -> None:
    srv = ShardServer(root)
    with pytest.raises(RuntimeError):
        _ = srv.port
    srv.start()
    port = srv.port
    with pytest.raises(RuntimeError):
        srv.start()
    idle = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    session = requests.Session()
    session.get(srv.url("data.tar"), timeout=TIMEOUT).raise_for_status()
    srv.fail("data.tar", "stall", after=100, seconds=30)
    outcome: list[object] = []

    def fetch_stalled() -> None:
        try:
            outcome.append(session.get(srv.url("data.tar"), timeout=TIMEOUT).content)
        except requests.RequestException as exc:
            outcome.append(exc)

    stalled = threading.Thread(target=fetch_stalled, daemon=True)
    stalled.start()
    deadline = time.monotonic() + TIMEOUT
    while srv.pending_faults("data.tar") and time.monotonic() < deadline:
        time.sleep(0.01)

    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 15  # the 30 s stall was interrupted
    srv.stop()  # idempotent
    assert not srv.running

    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
    idle.settimeout(TIMEOUT)
    try:
        assert idle.recv(1) == b""  # the server closed our idle connection
    except ConnectionResetError:
        pass
    idle.close()
    stalled.join(TIMEOUT)
    session.close()
    assert not stalled.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], requests.RequestException)
    assert server_threads() == []
    assert extra_nondaemon_threads() == []

    # Restart binds the same port, so URLs handed out earlier work again.
    with srv:
        assert srv.port == port
        assert requests.get(srv.url("data.tar"), timeout=TIMEOUT).content == data
    assert server_threads() == []


# -- shard makers ----------------------------------------------------------------


def _payloads(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


@pytest.mark.parametrize("gzip", [False, True], ids=["tar", "tgz"])
@pytest.mark.parametrize("tool", ["tarfile", "gnutar"])
def test_shard_tools_round_trip(tmp_path: Path, tool: str, gzip: bool) -> None:
    if tool == "gnutar" and find_gnu_tar() is None:
        pytest.skip("GNU tar is not installed")
    import webdataset as wds

    samples = synth_samples(7, 12, payload=3000)
    samples.append({"__key__": "nested/dir/k", "TXT": b"upper-case extension", "a.b": b"x"})
    path = make_shard(tmp_path / ("s.tar.gz" if gzip else "s.tar"), samples, tool=tool, gzip=gzip)
    expected = [{k.lower(): v for k, v in s.items()} for s in samples]
    expected[-1]["__key__"] = "nested/dir/k"
    assert read_samples_reference(path) == expected

    # webdataset leaves the shard file for the GC to close; keep its
    # ResourceWarning from surfacing later, in some unrelated test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        got = list(wds.WebDataset(str(path), shardshuffle=False))
        gc.collect()
    assert [s["__key__"] for s in got] == [s["__key__"] for s in expected]
    assert [_payloads(s) for s in got] == [_payloads(s) for s in expected]


def test_shards_are_reproducible(tmp_path: Path) -> None:
    samples = synth_samples(0, 5)
    assert samples == synth_samples(0, 5)
    assert samples != synth_samples(0, 5, seed=1) and samples != synth_samples(1, 5)
    assert [s["__key__"] for s in samples] == [f"s00000_{i:05d}" for i in range(5)]
    sizes = {len(s["jpg"]) for s in samples}
    assert len(sizes) > 1 and all(900 <= n <= 1100 for n in sizes)
    for gzip in (False, True):
        a = make_shard(tmp_path / f"a{gzip}.tar", samples, gzip=gzip).read_bytes()
        b = make_shard(tmp_path / f"b{gzip}.tar", samples, gzip=gzip).read_bytes()
        assert a == b
    if find_gnu_tar() is not None:
        a = make_shard(tmp_path / "g1.tar", samples, tool="gnutar").read_bytes()
        b = make_shard(tmp_path / "g2.tar", samples, tool="gnutar").read_bytes()
        assert a == b
        # Different header dialects, same content.
        assert a != (tmp_path / "aFalse.tar").read_bytes()


def test_make_dataset_served_and_listed(tmp_path: Path, http: requests.Session) -> None:
    paths = make_dataset(tmp_path / "ds", 3, 4, payload=200, gzip=True, prefix="train")
    assert [p.name for p in paths] == [f"train-{i:06d}.tar.gz" for i in range(3)]
    assert read_samples_reference(paths[2]) == synth_samples(2, 4, payload=200)
    assert not [p for p in (tmp_path / "ds").iterdir() if p not in paths]  # no temp leftovers
    with ShardServer(tmp_path / "ds") as srv:
        urls = [srv.url(p.name) for p in paths]
        listing = write_url_list(tmp_path / "lists" / "urls.txt", urls)
        assert listing.read_text() == "".join(u + "\n" for u in urls)
        for p, u in zip(paths, urls):
            r = http.get(u, timeout=TIMEOUT)
            assert r.content == p.read_bytes()
            assert r.headers["Content-Type"] == "application/gzip"


@pytest.mark.parametrize(
    "sample",
    [
        {"cls": b"1"},
        {"__key__": "a.b", "cls": b"1"},
        {"__key__": "../k", "cls": b"1"},
        {"__key__": "k", "cls": "not bytes"},
        {"__key__": "k", "": b"1"},
    ],
)
def test_make_shard_rejects_unreadable_samples(tmp_path: Path, sample: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        make_shard(tmp_path / "bad.tar", [sample])
    with pytest.raises(ValueError):
        make_shard(tmp_path / "dup.tar", [{"__key__": "k", "x": b""}, {"__key__": "k", "x": b""}])
