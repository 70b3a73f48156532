"""Other local users stay out, on every endpoint: tried as a real second user.

The test creates a user with ``useradd`` and drops to it in a forked child, after
the imports (``os.setgroups``/``os.setgid``/``os.setuid``), so the child needs no
Python of its own: it attacks with raw ZeroMQ sockets and plain file opens, and
reports what it got to the parent through a pipe, as JSON. The agent runs as the
owner (root here) on ``tcp://127.0.0.1:PORT``, its workers on the next ports.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import pwd
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import wdscache.agent.core  # noqa: F401 (imported before the fork: the child runs the CLI without reading the disk)
from tests.helpers.net import free_port_range
from tests.helpers.procs import worker_pids
from tests.helpers.streaming import reference, samples_of
from tests.helpers.waits import wait_for
from wdscache import NotTrustedError, WdsCacheError, cli
from wdscache.agent.pool import worker_endpoints
from wdscache.shared.client import AgentConnection, ShardClient
from wdscache.shared.layout import CacheLayout
from wdscache.shared.messages import Requests
from wdscache.shared.protocol import (
    PROTOCOL,
    pack,
    pack_numbers,
    proof,
    reply_proof,
    request_proof,
    unpack,
    unpack_numbers,
)
from wdscache.shared.urls import list_id
from wdscache.training.loader import CachedMultiLoader

# tests.helpers.streaming imports webdataset, and so torch where installed: a loader is then a
# torch dataset, whose modules the child (another user, who cannot read the interpreter's own
# library under /root) must find imported.
if sys.modules.get("torch") is not None:
    # (and a loader's epoch box: an Array and its lock, whose modules its first one imports)
    import multiprocessing.sharedctypes  # noqa: F401
    import multiprocessing.synchronize  # noqa: F401

    import wdscache.training.dataset  # noqa: F401

CHILD_DEADLINE = 60.0


@pytest.fixture
def other_user():
    """A fresh local user (removed at teardown): not root, not the owner, no groups of ours."""
    if os.getuid() != 0:
        pytest.skip("needs root to create a second user")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are missing")
    name = f"wdst{secrets.token_hex(3)}"
    r = subprocess.run(
        ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, f"useradd failed: {r.stderr}"
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)


@pytest.fixture
def open_base():
    """A folder every user may enter (tmp_path's parents are root's own, 0700): the cache
    directory inside it is then protected by its own mode, not by its parents'."""
    base = Path(tempfile.mkdtemp(prefix="wdscache-trust-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def fork_as(pw: pwd.struct_passwd, fn: Callable[[], Any]) -> tuple[int, int]:
    """Start ``fn`` in a forked child as user ``pw`` (after the imports, so the child needs
    nothing from disk); returns its pid and the pipe its JSON result (or traceback) comes on."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only modules imported already, no pytest machinery
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            out = {"result": fn()}
        except BaseException:
            out = {"error": traceback.format_exc()}
        data = json.dumps(out).encode()
        while data:
            data = data[os.write(w, data) :]
        os._exit(0)
    os.close(w)
    return pid, r


def as_user(pw: pwd.struct_passwd, fn: Callable[[], Any], timeout: float = CHILD_DEADLINE) -> Any:
    """Run ``fn`` in a forked child as user ``pw``; its JSON result (or its traceback, re-raised here)."""
    pid, r = fork_as(pw, fn)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the child as {pw.pw_name} did not finish within {timeout:g}s", pytrace=False)
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b"{}")
    if "result" not in out:
        pytest.fail(f"the child as {pw.pw_name} failed:\n{out.get('error', '(no output)')}", pytrace=False)
    return out["result"]


FIRST_SAMPLE = pack_numbers([0, 0])  # a read's items: sample 0 of its first URL


def ask(endpoint: str, header: dict[str, Any], *frames: bytes, timeout: float = 3.0) -> dict[str, Any] | None:
    """One raw request (a fresh DEALER socket), with its payload ``frames``; the reply's header,
    or None if none came."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([json.dumps(header).encode(), *frames])
        if not sock.poll(int(timeout * 1000)):
            return None
        return json.loads(sock.recv_multipart()[0])
    finally:
        sock.close(0)
        ctx.term()


def _errno_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except OSError as exc:
        return type(exc).__name__
    return "allowed"


def attack(agent_ep: str, worker_eps: list[str], urls: list[str], evil: str, cache: Path) -> dict[str, Any]:
    """Everything another local user tries; runs in the child as that user."""
    out: dict[str, Any] = {"uid": os.getuid()}
    guess = "0" * 64
    read = {"op": "read", "id": 1, "urls": urls[:1]}
    guesses: list[dict[str, str]] = [{}, {"key": guess}, {"auth": guess}]
    out["read"] = [ask(ep, {**read, **guessed}, FIRST_SAMPLE) for ep in worker_eps for guessed in guesses]
    out["scan"] = [ask(ep, {"op": "scan", "id": 2, "url": urls[0]}) for ep in worker_eps]
    out["stats"] = ask(agent_ep, {"op": "stats", "id": 3})
    # Anyone may ask the agent to prove itself; what it answers is no key.
    proved = ask(agent_ep, {"op": "auth", "id": 4, "nonce": "ab" * 16}) or {}
    out["auth"] = proved
    keys = [None, guess, proved.get("proof"), proved.get("run")]
    hello = {"op": "hello", "job": "thief", "rank": 0, "world_size": 1}
    out["hello"] = [ask(agent_ep, {**hello, "id": 5, "reader": "thief", **({"key": k} if k else {})}) for k in keys]
    # Pin every shard, under many names, so the owner's consumer would find no room.
    out["open"] = [
        ask(
            agent_ep,
            {"op": "open", "id": 6, "reader": f"thief-{i}", "url": u, "wait": False, **({"key": k} if k else {})},
        )
        for i, (u, k) in enumerate(itertools.product(urls, keys))
    ]
    # A list of the attacker's URLs, for the agent to fetch: sent, taken up for a job, opened.
    out["evil"] = []
    for i, k in enumerate(keys):
        with_key = {"key": k} if k else {}
        reader = f"evil-{i}"
        out["evil"] += [
            ask(agent_ep, {"op": "put_urls", "id": 7, "reader": reader, "offset": 0, "urls": [evil], **with_key}),
            ask(agent_ep, {**hello, "id": 8, "reader": reader, "list_id": list_id([evil]), **with_key}),
            ask(agent_ep, {"op": "open", "id": 9, "reader": reader, "url": evil, "wait": False, **with_key}),
        ]
    layout = CacheLayout.of(cache)
    out["files"] = {
        "listdir": _errno_of(lambda: os.listdir(cache)),
        "token": _errno_of(lambda: open(cache / "token", "rb").close()),
        "shard": _errno_of(lambda: open(layout.shard_path(urls[0]), "rb").close()),
        "index": _errno_of(lambda: open(layout.index_dir / "cache.db", "rb").close()),
    }
    try:
        loader = CachedMultiLoader(cache_dir=cache, endpoint=agent_ep, rank=0, world_size=1, timeout=5)
        out["loader"] = f"got {len(list(itertools.islice(iter(loader), 10)))} samples"
    except WdsCacheError as exc:
        out["loader"] = f"{type(exc).__name__}: {exc}"
    return out


def refused(reply: dict[str, Any] | None) -> bool:
    return reply is None or (reply.get("ok") is False and not reply.get("keys") and "stats" not in reply)


def test_another_user_gets_no_sample_no_pin_no_fetch_and_no_file_over_tcp(
    other_user, open_base, shard_server, dataset, start_agent, consumers, monkeypatch
):
    ds = dataset(4, samples=25, payload=1000)
    cache = open_base / "cache"
    port = free_port_range(3)
    endpoint = f"tcp://127.0.0.1:{port}"
    agent = start_agent(
        cache, ds.list_file, "--endpoint", endpoint, "--workers", "2", "--prefetch", "4", "--cache-size", "10M"
    )
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 20, "4 shards cached")
    workers = worker_endpoints(endpoint, 2)
    assert workers == [f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port + 2}"]
    evil = shard_server.url("evil-000.tar")

    monkeypatch.setenv("WDSCACHE_ENDPOINT", endpoint)  # the owner's consumer finds the agent, and its token
    owner = consumers(cache, "owner", "--no-shuffle", "--job", "owner")
    got = as_user(other_user, lambda: attack(endpoint, workers, ds.urls, evil, cache))
    lines = owner.wait()

    assert got["uid"] == other_user.pw_uid
    assert all(map(refused, got["read"])), got["read"]
    assert all(map(refused, got["scan"])), got["scan"]
    assert refused(got["stats"]), got["stats"]
    assert all(map(refused, got["hello"])), got["hello"]
    assert all(map(refused, got["open"])), got["open"]
    assert all(map(refused, got["evil"])), got["evil"]
    # No refusal proves its id (of the asker's choice): proofs of chosen ids would let a process that
    # takes a dead worker's port answer the owner's consumers as that worker.
    assert not [r for r in got["read"] + got["scan"] if r and "proof" in r], got["read"][:2]
    # Each refusal says what to do.
    assert "token" in got["read"][0]["error"] and "token" in got["open"][0]["error"], (got["read"][0], got["open"][0])
    assert got["files"] == {
        "listdir": "PermissionError",
        "token": "PermissionError",
        "shard": "PermissionError",
        "index": "PermissionError",
    }, got["files"]
    assert (
        got["loader"].startswith("ConfigError")
        and str(cache) in got["loader"]
        and f"uid {os.getuid()}" in got["loader"]
    ), got["loader"]

    # The owner's consumer got every sample, byte for byte, while that went on.
    ref = reference(ds.paths, ds.urls)
    mine = {(s["url"], s["key"]): s["fields"] for s in samples_of(lines)}
    assert len(samples_of(lines)) == len(ref) == 100 and mine == ref
    # The agent knows no job of the other user's, and fetched nothing it asked for.
    s = agent.stats()
    assert not {"thief", "evil"} & set(s["jobs"]), s["jobs"]
    # Every ask was answered, so a download one had started would be downloading or queued now,
    # or have reached the server (on the code before the token, the evil URL was requested
    # within milliseconds).
    assert s["shards"]["downloading"] == s["shards"]["queued"] == 0, s["shards"]
    assert shard_server.count("evil-000.tar", method=None) == 0, shard_server.requests
    assert agent.running(), agent.stderr_tail()
    assert "Traceback" not in agent.stderr_text(), agent.stderr_tail()
    token = cache / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.stat().st_uid == os.getuid()

    # Each key opens one door: a process that took a dead worker's port learns nothing else.
    conn = AgentConnection(endpoint, timeout=10, cache_dir=cache)
    try:
        conn.request({"op": "ping"})
        agent_key, w0, w1 = conn.key, conn.worker_key(0), conn.worker_key(1)
    finally:
        conn.close()
    read = {"op": "read", "id": 1, "urls": ds.urls[:1]}
    assert len({agent_key, w0, w1}) == 3
    answer = ask(workers[0], {**read, "auth": request_proof(w0, 1)}, FIRST_SAMPLE)
    assert answer["keys"] == ["s00000_00000"] and answer["proof"] == reply_proof(w0, 1), answer
    for where, key in ((workers[1], w0), (workers[0], agent_key), (workers[0], w1)):
        assert refused(ask(where, {**read, "auth": request_proof(key, 1)}, FIRST_SAMPLE)), (where, key)
    other = ask(workers[0], {**read, "auth": request_proof(w0, 2)}, FIRST_SAMPLE)  # the proof of another id
    assert refused(other) and other is not None and "proof" not in other, other
    odd = ask(workers[0], {"id": "r7", "auth": "00" * 32})  # nor does an error answering a request without it
    assert odd is not None and odd["ok"] is False and "proof" not in odd, odd
    assert refused(ask(workers[0], {**read, "key": w0}, FIRST_SAMPLE))  # the key itself is no proof: it never travels
    assert refused(ask(endpoint, {"op": "stats", "id": 1, "key": w0}))
    assert ask(endpoint, {"op": "stats", "id": 1, "key": agent_key})["ok"] is True


def fake_agent(endpoint: str, seconds: float, run: str = "ab" * 16) -> list[dict[str, Any]]:
    """Another user's process on a port a loader is told to use: answers everything, naming ``run``
    as its own; returns what it got."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            ident, raw, *_ = sock.recv_multipart()
            header = json.loads(raw)
            if header.get("op") == "quit":
                break
            got.append(header)
            reply = {
                "op": "reply",
                "id": header.get("id"),
                "ok": True,
                "proof": "00" * 32,
                "protocol": PROTOCOL,  # as the agent's: only the proof gives it away
                "run": run,
                "path": "/etc/hostname",
                "size": 1,
                "workers": [],
                "list_id": "x",
                "n_urls": 0,
            }
            sock.send_multipart([ident, json.dumps(reply).encode()])
    finally:
        sock.close(0)
        ctx.term()
    return got


@contextlib.contextmanager
def listening_as(pw: pwd.struct_passwd, endpoint: str, serve: Callable[[], list[Any]]) -> Iterator[list[Any]]:
    """``serve`` in a child as user ``pw``, once it listens on TCP ``endpoint``; on leaving the block
    it is asked to quit (an ``op`` of "quit"), and the list yielded gets what it returned (the
    messages it was sent)."""
    pid, r = fork_as(pw, serve)
    try:
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)

        def bound() -> bool:
            with socket.socket() as s:
                return s.connect_ex((host, int(port))) == 0

        wait_for(bound, 10, f"the other user's process never bound {endpoint}")
        got: list[Any] = []
        yield got
        assert ask(endpoint, {"op": "quit"}, timeout=0.2) is None
        if not select.select([r], [], [], 20)[0]:
            pytest.fail("the other user's process did not report", pytrace=False)
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        out = json.loads(b"".join(chunks))
        assert "result" in out, out.get("error")
        got.extend(out["result"])
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_loader_never_talks_to_another_users_agent(other_user, open_base, tmp_path, dataset, start_agent):
    ds = dataset(1, samples=3, payload=100)
    cache = open_base / "cache"
    start_agent(cache, ds.list_file)
    fake = f"tcp://127.0.0.1:{free_port_range(1)}"
    with listening_as(other_user, fake, lambda: fake_agent(fake, 30.0)) as seen:
        with pytest.raises(NotTrustedError) as info:
            with ShardClient(cache, endpoint=fake, timeout=5) as client:
                client.open(ds.urls[0], timeout=5)
        assert fake in str(info.value), str(info.value)
        with pytest.raises(NotTrustedError) as info:
            iter(CachedMultiLoader(cache_dir=cache, endpoint=fake, rank=0, world_size=1, timeout=5))
        assert fake in str(info.value), str(info.value)
    token = (cache / "token").read_text().strip()
    # It was asked to prove itself, and learnt nothing it could use against the real agent.
    assert seen and all(h["op"] == "auth" for h in seen), seen
    assert token not in json.dumps(seen) and not any("key" in h for h in seen), seen


def test_a_process_on_a_stopped_agents_port_cannot_answer_a_client_for_it(other_user, open_base, dataset, start_agent):
    """Over TCP a port is anyone's once the agent is gone. A client that proved the agent keeps
    its key, and its next requests reach whoever binds the port: that process knows the run's
    name (any peer may ask) but not the agent's proof of a reply, so the client takes none of
    its answers (a path it names, above all) and says who may be listening."""
    ds = dataset(2, samples=3, payload=100)
    cache = open_base / "cache"
    endpoint = f"tcp://127.0.0.1:{free_port_range(2)}"
    agent = start_agent(cache, ds.list_file, "--endpoint", endpoint, "--workers", "1")
    with ShardClient(cache, endpoint=endpoint, timeout=5) as client:
        assert cache in client.open(ds.urls[0], timeout=10).parents
        hello = ask(endpoint, {"op": "auth", "id": 1, "nonce": "n" * 16})
        assert hello is not None and hello["run"] == client._conn.run
        agent.stop(signal.SIGKILL)
        with listening_as(other_user, endpoint, lambda: fake_agent(endpoint, 30.0, run=hello["run"])) as seen:
            for ask_it in (lambda: client.open(ds.urls[1], timeout=5), lambda: client.open(ds.urls[1]), client.stats):
                with pytest.raises(NotTrustedError) as info:
                    ask_it()
                assert endpoint in str(info.value) and "another process taken its endpoint" in str(info.value)
            client.close()
    assert {h["op"] for h in seen} >= {"open", "stats"}, seen  # it was asked: the client's key of a dead run
    assert (cache / "token").read_text().strip() not in json.dumps(seen)


def relay(listen: str, upstream: str, seconds: float) -> list[dict[str, Any]]:
    """Another user's process on a port a client dials, the agent listening on ``upstream``:
    passes every message on to it and its answer back, but answers an ``open`` with a path of
    its own under the agent's proof of the client's id (asked with the client's key, in a
    ``ping`` of that id). Returns the headers it got from the client."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (front, back):
        sock.setsockopt(zmq.LINGER, 0)
    front.bind(listen)
    back.connect(upstream)
    got: list[dict[str, Any]] = []

    def passed(header: dict[str, Any]) -> dict[str, Any]:
        back.send_multipart(pack(header))
        return unpack(back.recv_multipart())[0] if back.poll(5000) else {}

    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not front.poll(100):
                continue
            ident, *frames = front.recv_multipart()
            header, _ = unpack(frames)
            if header["op"] == "quit":
                break
            got.append(header)
            answer = passed(header)
            if header["op"] == "open" and "key" in header:
                pinged = passed({"op": "ping", "reader": "r", "id": header["id"], "key": header["key"]})
                if "proof" in pinged:
                    answer = {"op": "reply", "id": header["id"], "ok": True, "path": "/etc/hostname", "size": 1}
                    answer["proof"] = pinged["proof"]
            front.send_multipart([ident, *pack(answer)])
    finally:
        front.close(0)
        back.close(0)
        ctx.term()
    return got


@pytest.mark.slow
def test_a_process_on_a_port_a_client_dials_cannot_pass_its_proof_on_from_the_agent_on_another(
    other_user, open_base, dataset, start_agent
):
    """The agent restarted on another port (its old one was taken, say): whoever holds the old
    port and passes a client's ``auth`` on to the agent gets back a proof, but one naming the
    agent's port, which the client did not dial. So the client sends it no key of the live run
    (with which it could get the agent's proof of any id) and takes none of its answers."""
    ds = dataset(2, samples=3, payload=100)
    cache = open_base / "cache"
    old, new = (f"tcp://127.0.0.1:{port}" for port in (free_port_range(2), free_port_range(2)))
    agent = start_agent(cache, ds.list_file, "--endpoint", old, "--workers", "1")
    with ShardClient(cache, endpoint=old, timeout=5) as client:
        assert cache in client.open(ds.urls[0], timeout=10).parents
        agent.stop()
        start_agent(cache, ds.list_file, "--endpoint", new, "--workers", "1")
        with listening_as(other_user, old, lambda: relay(old, new, 30.0)) as seen:
            with pytest.raises(NotTrustedError) as info:
                client.open(ds.urls[1], timeout=5)
            assert f"answering at {old} proved it listens on {new}" in str(info.value), str(info.value)
            client.close()
    live = AgentConnection(new, timeout=5, cache_dir=cache)
    try:
        live.request(Requests.stats())
        live_key = live.key
    finally:
        live.close()
    # The dead run's key (on the client's open, or a ping: its own before the open, or its keepalive's),
    # then its proof asked.
    keyed = [i for i, h in enumerate(seen) if "key" in h and h["op"] in ("open", "ping")]
    assert keyed and any(h["op"] == "auth" for h in seen[keyed[0] :]), seen
    assert live_key is not None and live_key not in json.dumps(seen), seen


def test_a_socket_folder_under_tmp_that_is_not_ours_is_a_clear_error(other_user, open_base, dataset):
    """``wdscache agent`` runs as the other user, in the child (the test's interpreter may lie
    in root's home, which that user cannot enter): its socket belongs under /tmp, in a folder
    someone else made."""
    ds = dataset(1, samples=1, payload=100)
    folder = Path(f"/tmp/wdscache-{other_user.pw_uid}")
    home = open_base / "home"
    home.mkdir()
    os.chown(home, other_user.pw_uid, other_user.pw_gid)
    deep = home / ("d" * 60) / ("e" * 60) / "cache"  # its socket path is too long: it goes under /tmp
    urls = open_base / "urls.txt"
    shutil.copy(ds.list_file, urls)
    urls.chmod(0o644)
    try:
        for owner, mode in ((0, 0o700), (other_user.pw_uid, 0o777)):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            os.chown(folder, owner, -1)
            folder.chmod(mode)
            got = as_user(
                other_user,
                lambda: _run_cli(
                    ["agent", "--cache-dir", str(deep), "--urls", str(urls), "--min-free", "1M", "--workers", "1"]
                ),
            )
            assert got["code"] == 2, got
            assert "Traceback" not in got["stderr"] and got["stderr"].startswith("wdscache: error: "), got
            assert str(folder) in got["stderr"], got
            # A loader gets the same error, as a WdsCacheError.
            got = as_user(other_user, lambda: _endpoint_error(deep))
            assert got.startswith("ConfigError") and str(folder) in got, got
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_cli(args: list[str]) -> dict[str, Any]:
    """``wdscache ARGS`` in this process: its exit code and stderr (a traceback if it raised)."""
    err = io.StringIO()
    code: Any = None
    with contextlib.redirect_stderr(err):
        try:
            cli.main(args, prog_name="wdscache")
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            err.write(traceback.format_exc())
    return {"code": code, "stderr": err.getvalue()}


def _endpoint_error(cache: Path) -> str:
    try:
        return "no error: " + CacheLayout.of(cache).default_endpoint()
    except WdsCacheError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


class Impostor:
    """A process's socket bound on a worker's port while the worker is down (its new one then
    cannot bind it): answers every read with fake samples and every scan with a count, in a
    thread of this test; keeps the headers it was sent."""

    FAKE = b"FAKE" * 16

    def __init__(self, endpoint: str) -> None:
        import threading

        self.endpoint = endpoint
        self.got: list[dict[str, Any]] = []
        self.stop = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close(0)
            self.ctx.term()
            raise
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            if not self.sock.poll(50):
                continue
            ident, raw, *frames = self.sock.recv_multipart()
            header = json.loads(raw)
            self.got.append(header)
            if header.get("op") == "read":
                numbers = unpack_numbers(frames[0])
                items = list(zip(numbers[0::2], numbers[1::2]))
                reply = {
                    "op": "samples",
                    "id": header.get("id"),
                    "ok": True,
                    "keys": [f"fake_{k}_{j}" for k, j in items],
                    "layouts": [["cls"]],
                }
                table = pack_numbers([x for _ in items for x in (0, 0, 0, len(self.FAKE))])
                self.sock.send_multipart([ident, json.dumps(reply).encode(), table, self.FAKE])
            else:
                reply = {"op": "scanned", "id": header.get("id"), "ok": True, "count": 5, "final": True}
                self.sock.send_multipart([ident, json.dumps(reply).encode()])

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def _bound(endpoint: str) -> Impostor | None:
    """An impostor on ``endpoint`` once it is free (a killed worker's port a moment after)."""
    try:
        return Impostor(endpoint)
    except zmq.ZMQError:
        return None


@pytest.mark.slow
def test_a_process_on_a_workers_port_cannot_hand_a_consumer_samples(open_base, dataset, start_agent, caplog):
    """Whoever binds a worker's port while its worker is down gets that worker's requests: no key
    in them, and a consumer drops its replies (they lack the worker's proof), so it never yields a
    fake sample. (A port taken before the agent starts is refused at its start.)"""
    ds = dataset(2, samples=5, payload=100)
    cache = open_base / "cache"
    port = free_port_range(2)
    endpoint = f"tcp://127.0.0.1:{port}"
    agent = start_agent(cache, ds.list_file, "--endpoint", endpoint, "--workers", "1")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "2 shards cached")
    (worker,) = worker_pids(agent.pid)
    os.kill(agent.pid, signal.SIGSTOP)  # so that it starts no new worker before the impostor binds
    try:
        os.kill(worker, signal.SIGKILL)
        impostor = wait_for(lambda: _bound(worker_endpoints(endpoint, 1)[0]), 10, "the worker's port free")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    try:
        loader = CachedMultiLoader(cache_dir=cache, endpoint=endpoint, rank=0, world_size=1, shuffle=False, timeout=4)
        got: list[dict[str, Any]] = []
        error: WdsCacheError | None = None
        with caplog.at_level("WARNING", logger="wdscache.training.worker_links"):
            try:
                for sample in loader:
                    got.append(sample)
            except WdsCacheError as exc:
                error = exc
    finally:
        impostor.close()
    assert got == [], [s["__key__"] for s in got]
    assert error is not None and "did not answer" in str(error) and endpoint in str(error), error
    warned = [r.getMessage() for r in caplog.records if "without the worker's proof" in r.getMessage()]
    assert len(warned) == 1 and impostor.endpoint in warned[0], warned
    # It was asked, and learnt nothing it could use: no key, only proofs of its own request ids.
    token = (cache / "token").read_text().strip()
    assert impostor.got and all("key" not in h and "auth" in h for h in impostor.got), impostor.got
    assert token not in json.dumps(impostor.got)
    # The agent's new worker, which cannot bind, says so in one line each time, no traceback.
    log = agent.stderr_text()
    assert "worker 0 cannot listen on tcp://127.0.0.1" in log and "Traceback" not in log, agent.stderr_tail()


def test_an_agent_that_refuses_the_key_it_just_gave_is_not_asked_again_and_again(tmp_path: Path) -> None:
    """A run that proved itself and refuses the key of its own proof is a NotTrustedError at once
    (a refusal by a new run is answered by proving that run; this one is the same run)."""
    token, run, endpoint = secrets.token_hex(32), secrets.token_hex(16), f"ipc://{tmp_path}/fake.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    asked: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, *frames = sock.recv_multipart()
            header, _ = unpack(frames)
            asked.append(header["op"])
            if header["op"] == "auth":
                reply = {"ok": True, "run": run, "endpoint": endpoint, "protocol": PROTOCOL}
                reply["proof"] = proof(token, header["nonce"], run, endpoint)
            else:
                reply = {"ok": False, "need_token": True, "error": "refused: no"}
            sock.send_multipart([ident, *pack({"op": "reply", "id": header["id"], **reply})])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    conn = AgentConnection(endpoint, timeout=60, token=token)
    try:
        t0 = time.monotonic()
        with pytest.raises(NotTrustedError, match="refused this client: refused: no"):
            conn.request(Requests.stats())
        assert time.monotonic() - t0 < 30  # at once: not after the 60 s a client waits for an answer
        assert asked == ["auth", "stats", "auth"], asked
    finally:
        conn.close()
        stop.set()
        server.join(5)
        sock.close(0)
        ctx.term()
