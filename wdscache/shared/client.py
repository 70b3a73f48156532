"""A small client for the agent's control socket: stats, and opening cached shards.

``ShardClient.open(url)`` returns the local path of a complete cached shard and
pins it (the agent will not evict it) until ``release(url)``; the agent moves
this client's prefetch window to the shards after it. While it holds pins, a thread of
the client (with a connection of its own) pings the agent every :data:`KEEPALIVE`
seconds, so that they last however long the program works on a shard; a process stopped
past the agent's reader timeout loses them (the agent drops silent readers), and the
client takes them again at its next request, as after a restart (below).

When the agent restarts (a new run proves itself on the connection: see
:attr:`AgentConnection.on_new_run`), a client pins again, before its next request goes
on, the shards it holds (downloaded again if the new run lost one); one it cannot pin is a
:class:`~wdscache.shared.errors.FetchError` at once (its path may be gone).

A client's socket belongs to the process that created it: after a fork the
child opens its own. A client dropped without ``close()`` closes its socket when it is
collected (see :func:`zmq_closer`). The sockets a process makes to the agent and its workers
(clients', loaders') share one ZeroMQ context, the process's (:func:`connect_dealer`); one made
where too few open files are free for it is a :class:`~wdscache.shared.errors.WdsCacheError`
that names the process's limit, never an abort of the process by ZeroMQ.

A client made before its agent has started waits (up to its timeout) for the agent's token
and socket, and connects only then: its first request goes as soon as the agent listens.

A client talks only to an agent that proves it holds the token of the cache
directory (see :mod:`wdscache.shared.protocol`), and sends its key to no other: a
cache directory of another user, or an agent that cannot prove itself, is a
:class:`~wdscache.shared.errors.ConfigError` or :class:`~wdscache.shared.errors.NotTrustedError`.
It takes a reply only with the proof of the agent it proved (or a refusal, which makes
whoever listens prove itself again): a process that takes the endpoint after the agent
stopped answers nothing a client uses.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from .errors import (
    AgentUnavailableError,
    ConfigError,
    FetchError,
    NotTrustedError,
    ProtocolError,
    WdsCacheError,
    failed_shard,
    files_free,
    out_of_files,
    short_of_files,
)
from .layout import CacheLayout
from .messages import Requests
from .protocol import (
    PROTOCOL,
    SAME_INSTALL,
    Proofs,
    agent_key,
    client_key,
    pack,
    proof,
    same_endpoint,
    same_secret,
    speaks,
    unpack,
    worker_key,
)

RETRY_PAUSE = 0.1  # seconds between asking again after a reply marked "retry"
BYE_TIMEOUT = 2.0  # seconds a goodbye waits for the agent's answer (it lets our pins go either way, in time)
# Seconds a consumer (a loader, a random-access dataset) waits with no progress by default.
CONSUMER_TIMEOUT = 60.0
# Seconds the process's ZeroMQ context keeps trying to send a message told without waiting for an
# answer (:meth:`AgentConnection.tell_and_close`) once its socket is closed: the agent's end
# takes it at once; one that is gone never will.
TELL_LINGER = 0.5
KEEPALIVE = 1.0  # seconds between a ShardClient's pings while it holds pins (a reader timeout is longer)
# Seconds a request waits for its reply before asking (an "auth", which any run answers
# with its run id) whether the agent restarted meanwhile: then the request was lost with
# the run before, and goes again to the new one.
RUN_CHECK = 1.0
AGENT_POLL = 0.01  # seconds between looks for the token and socket of an agent not started yet
# A socket connected before its endpoint is bound (a sample worker still starting, an agent
# restarting) is tried again by ZeroMQ after RECONNECT_IVL, 100 ms by default, and its first
# request waits for that tick: here the first try again comes after RECONNECT_FIRST_MS, the
# interval doubling up to the default while the endpoint stays away.
RECONNECT_FIRST_MS = 10
RECONNECT_MOST_MS = 100
# Open files a socket of connect_dealer takes: its mailbox and its connection's descriptor; and
# the first socket of a process's context starts the context's reaper and I/O thread, each with a
# mailbox and an epoll descriptor (and the context's own mailbox, made with it): 7 in all, as
# measured with libzmq 4.3. ZeroMQ aborts the process when the start cannot make an epoll
# descriptor, and a connection that cannot make its descriptor is tried again silently, for ever.
SOCKET_FILES = 2
CONTEXT_FILES = 5


def weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called only while its object lives: held by the object's own parts, it
    keeps the object from being collected as soon as it is dropped."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _ping_while_held(client: weakref.ref[ShardClient], conn: AgentConnection, stop: threading.Event) -> None:
    """A ShardClient's keepalive: ping as it every KEEPALIVE seconds while it holds pins, on a
    connection of this thread (ZeroMQ sockets belong to one thread); each answer that knows it
    is noted (``_heard_at``), so that its next request asks the agent only when none came for a
    while. Ends at close, or once the client is gone."""
    try:
        while not stop.wait(KEEPALIVE):
            held = client()
            if held is None:
                return
            idle, ping, run = not held._held, held._requests.ping(), held._conn.run
            del held  # (not held across the wait)
            if idle:  # (it runs on, idle, rather than end just as an open counts on it)
                continue
            try:
                known = conn.request(ping).get("known")
            except (AgentUnavailableError, NotTrustedError):
                continue  # a restart is the client's own connection's to take up
            held = client()
            if held is not None and conn.run == run:  # (a new run's answer: the client's connection sees it)
                held._heard_at = time.monotonic() if known is True else 0.0  # not known: its next request asks
            del held
    finally:
        conn.close()


@dataclass
class ProcessContext:
    """The ZeroMQ context of the process ``pid`` (never used in another: a forked child makes its
    own), and whether a socket of it started it (its reaper and I/O thread run)."""

    pid: int
    ctx: zmq.Context
    started: bool = False


_context: ProcessContext | None = None
_context_lock = threading.Lock()


def _context_lock_anew() -> None:
    # A fork while another thread held the lock would leave it held for ever in the child.
    global _context_lock
    _context_lock = threading.Lock()


os.register_at_fork(after_in_child=_context_lock_anew)


def connect_dealer(endpoint: str) -> zmq.Socket:
    """A DEALER socket of this process's context connected to ``endpoint``, bound yet or not (see
    RECONNECT_FIRST_MS). The context is made at the first call in a process and lives as long;
    its sockets are closed by their owners (:func:`zmq_closer`). A WdsCacheError when too few
    open files are free for the socket (:data:`SOCKET_FILES`, and :data:`CONTEXT_FILES` at the
    process's first), checked before ZeroMQ could abort the process for want of them."""
    global _context
    need = SOCKET_FILES + CONTEXT_FILES
    try:
        with _context_lock:
            if _context is None or _context.pid != os.getpid():
                _context = ProcessContext(os.getpid(), zmq.Context())
            need = SOCKET_FILES if _context.started else need
            _check_files(endpoint, need)
            sock = _context.ctx.socket(zmq.DEALER)
            _context.started = True
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_FIRST_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MOST_MS)
        if endpoint.startswith("tcp://["):  # an IPv6 address: see wdscache.shared.protocol.zmq_context
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        if out_of_files(exc) is None:
            raise
        raise _short_of_files(endpoint, need) from exc
    return sock


def _check_files(endpoint: str, need: int) -> None:
    free = files_free()
    if free is not None and free[0] < need:
        raise _short_of_files(endpoint, need, free)


def _short_of_files(endpoint: str, need: int, free: tuple[int, int] | None = None) -> WdsCacheError:
    """The error of a connection to ``endpoint`` this process cannot make for want of open files."""
    return short_of_files(f"to connect to {endpoint} (a connection takes up to {need})", free)


def send_now(sock: zmq.Socket, frames: Sequence[bytes | memoryview]) -> None:
    """Queue ``frames`` on ``sock`` without waiting. A DEALER queues up to SNDHWM messages for a
    peer that is gone (or stopped), and a send past that blocks until the peer takes one, which
    may be never: such a message is dropped here instead, as one the peer died with would be, and
    the sender's wait for its answer ends at its own deadline."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _close_zmq(pid: int, sockets: list[zmq.Socket]) -> None:
    if os.getpid() != pid:
        return  # a forked child's copies: they are its parent's
    for sock in sockets:
        sock.close(0)


def zmq_closer(owner: object, sockets: list[zmq.Socket]) -> weakref.finalize:
    """Closes ``sockets`` (the list as it is then, of :func:`connect_dealer`) once called, or once
    ``owner`` is collected, in the process that called this only: each socket's descriptors go
    at once (its linger is 0), not whenever the collector reaches its Python object."""
    closer = weakref.finalize(owner, _close_zmq, os.getpid(), sockets)
    closer.atexit = False  # at exit a daemon thread may still use them: the process's end closes them
    return closer


def resolve_endpoint(cache_dir: str | os.PathLike[str] | None, endpoint: str | None) -> str:
    """The endpoint to talk to: given, or where the agent of ``cache_dir`` listens now
    (:meth:`CacheLayout.agent_endpoint`: the ``--endpoint`` it was given, else the directory's socket)."""
    if endpoint:
        return endpoint
    if cache_dir is None:
        raise ConfigError("give cache_dir (or endpoint) to find the agent")
    return CacheLayout.of(cache_dir).agent_endpoint()


def start_hint(cache_dir: str | os.PathLike[str] | None) -> str:
    where = cache_dir if cache_dir is not None else "DIR"
    return f"start one with 'wdscache agent --cache-dir {where} --urls URLS.txt'"


def _received(sock: zmq.Socket) -> dict[str, Any] | None:
    """The header of the message waiting on ``sock``; None if it cannot be read (no agent sends
    such: it is not a reply to anything of ours)."""
    try:
        return unpack(sock.recv_multipart())[0]
    except ProtocolError:
        return None


class AgentConnection:
    """Request/reply over a DEALER socket; every wait is bounded by ``timeout``, sends included
    (:func:`send_now`), and a request that goes unanswered leaves a new socket to the next.

    The token comes from ``cache_dir`` (refused if another user owns it), or is
    given (a consumer that cannot see the cache directory). Before the first
    request the agent must prove it holds it; every request then carries the key.

    ``endpoint`` None: the agent of ``cache_dir``, wherever it listens (its ``--endpoint``, which
    agent.json names), looked up each time the socket opens (after a fork too), while the
    first request waits for an agent to start, and every :data:`RUN_CHECK` seconds while a request
    waits for its answer: an agent that restarted on another endpoint is followed there (see
    :meth:`_agent_moved`).
    """

    def __init__(
        self,
        endpoint: str | None,
        *,
        timeout: float = 30.0,
        hint: str = "",
        cache_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> None:
        self._follow = endpoint is None  # (then the endpoint is the cache directory's agent's)
        self.endpoint, self.timeout, self.hint = resolve_endpoint(cache_dir, endpoint), timeout, hint
        self._cache_dir, self._token = cache_dir, token
        self._token_given = token is not None  # (else read from cache_dir: which the NotTrustedError names)
        self.key: str | None = None  # our requests' key, once the agent proved it holds the token
        self._run = ""
        self._replies: Proofs | None = None  # the proofs of the agent run proved last, on its replies
        # Called once a new run of the agent has proved itself on this connection (it restarted:
        # it knows nothing of us), before the request that found it goes again; it may send
        # requests of its own (a hello) and raise to give up.
        self.on_new_run: Callable[[], None] | None = None
        # Called when the agent answers ``need_hello``: it dropped our reader (silent past its
        # --reader-timeout: this process was stopped, say); it says hello again, and the request
        # that found it goes again, once.
        self.on_forgotten: Callable[[], None] | None = None
        self._ids = itertools.count(1)
        self._pid = -1
        self._sock: zmq.Socket | None = None
        self._sockets: list[zmq.Socket] = []  # [_sock], as the closer closes it (see _renew_socket)
        self._closer: weakref.finalize | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (in another process, say) connects and proves the agent anew at its first request;
        # the callbacks belong to the owner, which sets them again on its copy.
        kept = {k: v for k, v in self.__dict__.items() if k not in ("_ids", "_replies", "_sock", "_sockets", "_closer")}
        return {**kept, "key": None, "_pid": -1, "on_new_run": None, "on_forgotten": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _ids=itertools.count(1), _replies=None, _sock=None, _sockets=[], _closer=None)

    def _socket(self) -> zmq.Socket:
        # Closed already when collected in a cycle whose other objects' finalizers still use us:
        # opened again, as after close().
        if self._pid != os.getpid() or self._closer is None or not self._closer.alive:
            if self._cache_dir is not None:  # before connecting: never to another user's agent
                CacheLayout.of(self._cache_dir).check_owner()
            self.key = None
            self._find_agent()
            # Created in the process that uses it; a forked child must not touch its parent's.
            self._sock = connect_dealer(self.endpoint)
            self._sockets = [self._sock]
            self._closer = zmq_closer(self, self._sockets)
            self._pid = os.getpid()
        assert self._sock is not None
        return self._sock

    def request(self, header: Mapping[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        """Send ``header`` and return the reply's header; raises if none comes in time.

        A reply marked ``retry`` (the agent could not write its index for a moment, or has no
        room yet for a job's own list) is asked again until the timeout; the last such reply is
        returned then. One marked ``fault`` (the agent failed for a fault of its own: out of open
        files) raises WdsCacheError, whatever the request: no shard is to blame.
        """
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        try:
            while True:
                reply = self._exchange(header, deadline)
                if reply.get("fault") is True:
                    raise WdsCacheError(f"the agent at {self.endpoint} cannot serve: {reply.get('error')}")
                left = deadline - time.monotonic()
                if not reply.get("retry") or left <= 0:
                    return reply
                time.sleep(min(RETRY_PAUSE, left))
        except AgentUnavailableError:
            self._renew_socket()
            raise

    def _renew_socket(self) -> None:
        """A new socket in place of ours, after a request went unanswered: what ours still queued
        for an agent that is gone or stopped (that request, its run checks or probes) goes with
        it, so that requests in a row to an agent that is away do not fill a queue (see
        :func:`send_now`), and an agent that comes back is not sent requests their senders gave
        up on. The key stays: it is the run's, not the socket's. An agent followed that now runs
        on another endpoint gets a new connection instead (:meth:`_move`)."""
        if not self.connected:
            return
        if self._agent_moved():
            self._move()
            return
        assert self._sock is not None
        old, self._sock = self._sock, connect_dealer(self.endpoint)
        self._sockets[:] = [self._sock]
        old.close(0)

    def _agent_moved(self) -> bool:
        """Following the cache directory's agent (no endpoint given), whether an agent runs there
        now (it holds the directory's lock) on another endpoint than ours: it restarted with
        another ``--endpoint``, and ours has nobody, or someone else, behind it. While none runs
        (it is restarting) we stay: it may come back where it was."""
        if not self._follow or self._cache_dir is None:
            return False
        layout = CacheLayout.of(self._cache_dir)
        return layout.running_agent() is not None and layout.agent_endpoint() != self.endpoint

    def _move(self) -> dict[str, Any]:
        """Drop the connection to an agent that moved (:meth:`_agent_moved`): the next request opens
        a new one where it listens now, and its run proves itself there (a new run: :attr:`on_new_run`, as after any
        restart). Returns what a request that waited on the old one is answered: refused for the
        run's key, which :meth:`_refused` takes for the new run it is."""
        self.close()
        return {"ok": False, "need_token": True, "moved": True, "error": "the agent restarted on another endpoint"}

    def _exchange(self, header: Mapping[str, Any], deadline: float) -> dict[str, Any]:
        greeted = False  # said hello again since the request first went
        while True:
            sock = self._proved(max(0.0, deadline - time.monotonic()))
            run, rid = self._run, next(self._ids)
            send_now(sock, pack({**header, "id": rid, "key": self.key}))
            reply = self._reply(sock, rid, max(0.0, deadline - time.monotonic()))
            if self._refused(reply, run, max(0.0, deadline - time.monotonic())):
                continue
            if self._greeted_again(reply, greeted):
                greeted = True
                continue
            return reply

    def _greeted_again(self, reply: dict[str, Any], greeted: bool) -> bool:
        """True when ``reply`` says the agent dropped our reader (``need_hello``) and we said hello
        again (:attr:`on_forgotten`), so the request goes again: once a request (``greeted``: done)."""
        if reply.get("need_hello") is not True or self.on_forgotten is None or greeted:
            return False
        self.on_forgotten()
        return True

    def _reply(self, sock: zmq.Socket, rid: int, timeout: float | None, *, keyed: bool = True) -> dict[str, Any]:
        """The reply to ``rid``, one with our key (``keyed``: :meth:`_genuine`) or an ``auth``.
        While a keyed request's reply does not come, every RUN_CHECK seconds we ask which run the
        agent is: a new one (it restarted) never got the request, which is answered then as
        refused for the run's key (see :meth:`_refused`)."""
        wait = self.timeout if timeout is None else timeout
        now = time.monotonic()
        deadline, check_at = now + wait, now + RUN_CHECK
        checks: set[int] = set()
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise AgentUnavailableError(self.endpoint, wait, self._why_silent())
            if now >= check_at:
                check_at = now + RUN_CHECK
                if self._agent_moved():
                    return {**self._move(), "id": rid}  # (the request went with the run before)
                if keyed and self._run:
                    check = next(self._ids)
                    checks.add(check)
                    send_now(sock, pack({**Requests.auth(secrets.token_hex(16)), "id": check}))
            if not sock.poll(int(min(left, max(0.0, check_at - now)) * 1000) + 1):
                continue
            reply = _received(sock)
            if reply is None:
                continue
            if reply.get("id") == rid:
                return self._genuine(reply, rid) if keyed else reply
            if reply.get("id") in checks and isinstance(reply.get("run"), str) and reply["run"] != self._run:
                return {"id": rid, "ok": False, "need_token": True, "error": "the agent restarted"}
            # A late reply to an earlier request that timed out, or the same run's answer: skip it.

    def _untrusted(self) -> str:
        """Why an agent's proof of the token may have failed, for the NotTrustedError: the likely
        mistakes first (a token or endpoint of another cache), then someone else's process."""
        where = f"the agent at {self.endpoint}"
        if self._token_given or self._cache_dir is None:  # (WDSCACHE_TOKEN, ShardClient: token=)
            return (
                f"{where} cannot prove it holds the token given (WDSCACHE_TOKEN): the token may be wrong (not "
                "the token file of the cache directory that agent serves), the endpoint that of another cache's "
                "agent, or another user's process may listen there; check the token, the endpoint and who runs "
                "the agent on it"
            )
        return (
            f"{where} cannot prove it holds the token of {self._cache_dir}: the endpoint may be that of another "
            "cache directory's agent (WDSCACHE_ENDPOINT, or endpoint=, not the one this directory's agent.json "
            "names), or another user's process may listen there; check the endpoint and who runs the agent on it"
        )

    def _proved(self, timeout: float | None) -> zmq.Socket:
        """The socket, once the agent behind it has proved it holds the token (asked once per run)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if self._token is None and self._cache_dir is not None:  # before connecting: see _wait_agent
            self._token = self._wait_agent(self.timeout if timeout is None else timeout)
        self._socket()  # (opened anew, after close() say, it holds no key: the run proves itself again)
        while self.key is None:
            sock = self._socket()
            if self._token is None:  # we would take anyone's answers, and the agent refuses us anyway
                raise NotTrustedError(
                    f"no token for the agent at {self.endpoint}: give the cache directory (its token file is "
                    "read there, by its owner) or, where it cannot be seen, WDSCACHE_TOKEN (ShardClient: token=)"
                )
            nonce, rid = secrets.token_hex(16), next(self._ids)
            send_now(sock, pack({**Requests.auth(nonce), "id": rid}))  # no key: not proved yet
            reply = self._reply(sock, rid, max(0.0, deadline - time.monotonic()), keyed=False)
            if reply.get("moved"):
                continue  # to where the agent listens now: it proves itself there
            said = reply.get("protocol")  # first: an agent of another protocol proves itself otherwise
            if said != PROTOCOL:
                raise ProtocolError(
                    f"the agent at {self.endpoint} speaks {speaks(said)}, this client {speaks(PROTOCOL)}; "
                    f"{SAME_INSTALL}"
                )
            run, bound = reply.get("run"), reply.get("endpoint")
            if not (
                isinstance(run, str)
                and isinstance(bound, str)
                and same_secret(reply.get("proof"), proof(self._token, nonce, run, bound))
            ):
                raise NotTrustedError(self._untrusted())
            if not same_endpoint(self.endpoint, bound):
                raise NotTrustedError(
                    f"the agent answering at {self.endpoint} proved it listens on {bound}: a process on "
                    f"{self.endpoint} passes messages on to it; connect to {bound}, and check who listens on "
                    f"{self.endpoint}"
                )
            previous = self._run
            self.key, self._run = client_key(self._token, run), run
            self._replies = Proofs(agent_key(self._token, run))
            if previous and previous != run and self.on_new_run is not None:
                self.on_new_run()
        return self._socket()  # (a new one if the agent moved again while on_new_run asked it)

    def _genuine(self, reply: dict[str, Any], rid: int) -> dict[str, Any]:
        """``reply`` to our keyed request ``rid``, if the agent we proved sent it: it carries that
        run's proof of ``rid``, or refuses our key (answered by proving whoever listens again, see
        :meth:`_refused`). Anything else comes from a process that took the endpoint."""
        if reply.get("need_token") or (
            self._replies is not None and same_secret(reply.get("proof"), self._replies.reply(rid))
        ):
            return reply
        raise NotTrustedError(
            f"a process at {self.endpoint} answered without the proof of the agent this client proved: "
            "the agent may have stopped and another process taken its endpoint; check who listens there"
        )

    @property
    def connected(self) -> bool:
        """Whether this process has the connection's socket open (made at the first request)."""
        return self._sock is not None and self._pid == os.getpid()

    @property
    def run(self) -> str:
        """The agent run proved last ("" before any): a restarted agent is a new run."""
        return self._run

    def _wait_agent(self, timeout: float) -> str:
        """The cache directory's token, once the agent's socket is there too (an ``ipc://`` one).

        An agent makes its token as it starts, so without one, no agent runs; it binds its socket
        a moment later, and a socket connected before that waits for ZeroMQ's next try.
        """
        assert self._cache_dir is not None
        layout = CacheLayout.of(self._cache_dir)
        deadline = time.monotonic() + timeout
        while True:
            token = layout.read_token()
            if token is not None:
                self._find_agent()  # (an agent starting names its endpoint in agent.json)
                bound = Path(self.endpoint[len("ipc://") :]) if self.endpoint.startswith("ipc://") else None
                if bound is None or bound.exists():
                    return token
            if time.monotonic() >= deadline:
                raise AgentUnavailableError(self.endpoint, timeout, self._why_silent())
            time.sleep(AGENT_POLL)

    def _find_agent(self) -> None:
        """Following the cache directory's agent (no endpoint given): take the endpoint it listens on now."""
        if self._follow and self._cache_dir is not None:
            self.endpoint = CacheLayout.of(self._cache_dir).agent_endpoint()

    def _why_silent(self) -> str:
        """What to tell of an agent that did not answer in time: that it is still starting, when
        the agent of our cache directory is (not to be started again); that it runs (its pid and
        endpoint), when it does, another endpoint than ours named; else :attr:`hint`."""
        if self._cache_dir is None:
            return self.hint
        layout = CacheLayout.of(self._cache_dir)
        note = layout.starting_note()
        if note is not None:
            return f"{note}; it answers once started: wait for it (see 'wdscache stats'), or give a longer timeout"
        running = layout.running_agent()
        if running is None:
            return self.hint
        agent, named = f"the agent (pid {running['pid']}) on {layout.root}", running["endpoint"]
        if named == self.endpoint:
            return f"{agent} runs there but did not answer: it may be busy (see 'wdscache stats'); try again"
        if self._follow:  # (it moved as we waited: the next request goes there, see _renew_socket)
            return f"{agent} listens on {named} now (it restarted there): try again"
        return (
            f"{agent} listens on {named}, not on {self.endpoint}: give endpoint={named!r} (or set "
            "WDSCACHE_ENDPOINT to it), or neither, to reach the cache directory's agent wherever it listens"
        )

    def worker_key(self, index: int) -> str | None:
        """The key of worker ``index`` of the agent run proved last (None before): requests and
        replies carry proofs made with it (:class:`~wdscache.shared.protocol.Proofs`), never the key."""
        if self.key is None or self._token is None:
            return None
        return worker_key(self._token, self._run, index)

    def _refused(self, reply: dict[str, Any], run: str, timeout: float) -> bool:
        """True when the agent refused our key, made for run ``run``, because it is a new run (it
        restarted, once or more): the new run has proved itself now, so ask again. Raises when
        run ``run`` itself refuses the key it gave us."""
        if not reply.get("need_token"):
            return False
        self.key = None  # whichever run listens now proves itself, and so names itself
        self._proved(timeout)
        if self._run == run:
            raise NotTrustedError(f"the agent at {self.endpoint} refused this client: {reply.get('error')}")
        return True

    def request_patiently(
        self,
        header: Mapping[str, Any],
        *,
        liveness: float,
        probe: Mapping[str, Any] | None = None,
        on_probe: Callable[[dict[str, Any]], None] | None = None,
        every: float | None = None,
    ) -> dict[str, Any]:
        """Like :meth:`request`, for requests that may take long (a shard being downloaded).

        Every ``every`` seconds (default ``liveness / 2``) it sends ``probe`` (default a
        ping) and hands the answer to ``on_probe``, which may raise to give up (a consumer
        that sees no progress, say). Raises AgentUnavailableError once a probe goes
        unanswered for ``liveness`` seconds. A reply marked ``retry`` is asked again, for
        up to ``liveness`` seconds.
        """
        retry_until = time.monotonic() + liveness  # replies marked "retry" are asked again this long
        greeted = False  # said hello again since the request first went
        try:
            while True:
                sock = self._proved(liveness)
                run, rid = self._run, next(self._ids)
                send_now(sock, pack({**header, "id": rid, "key": self.key}))
                reply = self._wait_patiently(sock, rid, header, liveness, probe, on_probe, every)
                if self._refused(reply, run, liveness):
                    continue  # a new run, which never got the request
                if self._greeted_again(reply, greeted):
                    greeted = True  # dropped while it waited: the agent let the request go
                    continue
                if not reply.get("retry") or time.monotonic() >= retry_until:
                    return reply
                time.sleep(RETRY_PAUSE)
        except AgentUnavailableError:
            self._renew_socket()
            raise

    def _wait_patiently(
        self,
        sock: zmq.Socket,
        rid: int,
        header: Mapping[str, Any],
        liveness: float,
        probe: Mapping[str, Any] | None,
        on_probe: Callable[[dict[str, Any]], None] | None,
        every: float | None,
    ) -> dict[str, Any]:
        probe = probe or Requests(str(header.get("reader", ""))).ping()
        every = liveness / 2 if every is None else every
        # Probes go every ``every`` seconds, answered or not (one sent as the agent died is lost,
        # and a restarted agent answers the next); the wait ends once none is answered for ``liveness``.
        probes: set[int] = set()
        unanswered_since: float | None = None  # the first probe sent since the last answer
        probe_sent = move_checked = time.monotonic()
        while True:
            if sock.poll(int(min(every, liveness, RUN_CHECK) * 1000 / 4) + 1):
                reply = _received(sock)
                if reply is None:
                    continue
                if reply.get("id") == rid:
                    return self._genuine(reply, rid)
                if reply.get("id") in probes:
                    reply = self._genuine(reply, reply["id"])
                    if reply.get("need_token"):
                        return reply  # a new run of the agent: it never got our request (see _refused)
                    probes.clear()
                    unanswered_since = None
                    if on_probe is not None:
                        on_probe(reply)
                continue
            now = time.monotonic()
            if now - move_checked > RUN_CHECK:
                move_checked = now
                if self._agent_moved():
                    return {**self._move(), "id": rid}  # (the request went with the run before)
            if unanswered_since is not None and now - unanswered_since > liveness:
                raise AgentUnavailableError(self.endpoint, liveness, self._why_silent())
            if now - probe_sent > every:
                probe_id, probe_sent = next(self._ids), now
                probes.add(probe_id)
                if unanswered_since is None:
                    unanswered_since = now
                send_now(sock, pack({**probe, "id": probe_id, "key": self.key}))

    def tell_and_close(self, header: Mapping[str, Any]) -> None:
        """Send ``header`` without waiting for its answer, then close: for a finalizer (a
        ``ShardListDataset`` session collected unclosed), which must neither block nor raise, in
        whatever thread the collector runs it. It goes only on this process's socket, to the run
        the agent proved (nothing is asked first: never connected, the agent holds nothing of
        ours); the socket closes with a linger of :data:`TELL_LINGER`, so that the process's
        ZeroMQ context sends it after the close, as its owner goes on."""
        sock = self._sock
        if sock is not None and self.connected and self.key is not None:
            self._sockets.remove(sock)  # closed here, with a linger; the closer's close drops what is queued
            try:
                send_now(sock, pack({**header, "id": next(self._ids), "key": self.key}))
            except zmq.ZMQError:
                pass  # (its context is ending with the process: nothing more can go, nor be waited for)
            finally:
                sock.close(linger=int(TELL_LINGER * 1000))
        self.close()

    def close(self) -> None:
        if self._closer is not None:
            self._closer()  # closes nothing in a forked child: the socket is its parent's
        self._sock = self._closer = None
        self._sockets = []
        self._pid = -1


class ShardClient:
    """Open cached shards by URL through the agent of ``cache_dir`` (or at ``endpoint``).

    Threads may share a client: its requests take turns (a lock). A forked child's copy, or an
    unpickled one, is a client of its own, under a name of its own: it holds none of the
    original's pins, and its ``close()`` lets go of none of them."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        endpoint: str | None = None,
        timeout: float = 300.0,
        name: str | None = None,
        token: str | None = None,
    ) -> None:
        self._given_name = name
        self.name = name or f"client-{uuid.uuid4().hex[:12]}"
        # token: the agent's (CACHE_DIR/token), for a client that cannot read cache_dir.
        self._conn = AgentConnection(
            endpoint,  # None: the agent of cache_dir, wherever it listens
            timeout=timeout,
            hint=start_hint(cache_dir),
            cache_dir=cache_dir,
            token=token,
        )
        self._conn.on_new_run = weakly(self._pin_again)  # (a bound method would make a cycle: see _keep_alive)
        self._requests = Requests(self.name)
        self._held: Counter[str] = Counter()  # url -> our pins on it (opens not yet released)
        self._endpoint, self._cache_dir, self._token = endpoint, cache_dir, token
        self._keepalive: threading.Thread | None = None  # pings while we hold pins (see the module)
        self._stop = threading.Event()
        self._heard_at = 0.0  # when the agent last showed it knows us (monotonic; the keepalive's pings too)
        self._lock = threading.RLock()  # one request at a time (a ZeroMQ socket is not for two threads)
        self._pid = os.getpid()

    def open(self, url: str, *, timeout: float | None = None) -> Path:
        """Wait until ``url`` is cached and pin it; returns the shard's local path. Raises
        FetchError if it cannot be downloaded, ShardError if it is known bad itself (unlike its
        shard index, or damaged again after one more download): its tar headers are not all
        checked before it is served."""
        with self._own():
            self._take_up_drop()
            header = self._requests.open(url)
            if timeout is None:
                # A download may take long; the agent's answers to pings show it is alive (and keep us).
                reply = self._conn.request_patiently(header, liveness=min(self._conn.timeout, 30.0))
            else:
                reply = self._conn.request(header, timeout=timeout)
            if not reply.get("ok"):
                raise failed_shard(url, reply, permanent=True)  # (a ShardError for a shard that is bad itself)
            self._held[url] += 1
            self._heard_at = time.monotonic()
            self._keep_alive()
            return Path(reply["path"])

    def release(self, url: str) -> None:
        """Unpin ``url``: the agent may evict it again."""
        with self._own():
            self._take_up_drop()
            self._check(self._conn.request(self._requests.release(url)))
            self._held[url] -= 1
            if self._held[url] <= 0:
                del self._held[url]

    def _own(self) -> threading.RLock:
        """This client's lock, taken for a request; in a forked child, first made a client of its own."""
        if self._pid != os.getpid():
            self._renew()
        return self._lock

    def _renew(self) -> None:
        """Make this copy (a forked child's, or unpickled) a client of its own: a name of its own,
        no pins, no keepalive; its connection opens anew at its first request."""
        self.name = f"{self._given_name or 'client'}-{uuid.uuid4().hex[:12]}"
        self._requests = Requests(self.name)
        self._held = Counter()
        self._keepalive, self._stop, self._heard_at = None, threading.Event(), 0.0
        self._lock, self._pid = threading.RLock(), os.getpid()

    def _pin_again(self, why: str = "restarted") -> None:
        """The agent restarted (or dropped us, ``why``) and holds none of our pins: take them again
        (a new run checks a shard against its source first, and downloads again one it no longer holds)."""
        for url, n in list(self._held.items()):
            for _ in range(n):
                reply = self._conn.request(self._requests.open(url))
                if not reply.get("ok"):
                    del self._held[url]
                    raise FetchError(
                        url,
                        f"the agent at {self._conn.endpoint} {why} and cannot pin it again "
                        f"({reply.get('error')}); its path may be gone",
                        permanent=True,
                    )

    def _take_up_drop(self) -> None:
        """Holding pins, with no word from the agent that it knows us for a while (this process
        was stopped, say, past its reader timeout: it dropped us and our pins), ask it; dropped,
        take our pins again before anything else."""
        if not self._held or time.monotonic() - self._heard_at <= 2 * KEEPALIVE:
            return
        if self._conn.request(self._requests.ping()).get("known") is False:
            self._pin_again("dropped this client after its --reader-timeout of silence")
        self._heard_at = time.monotonic()

    def _keep_alive(self) -> None:
        """Start the keepalive thread of this process, if it does not run (it holds the client
        weakly: a client dropped unclosed is collected, and the agent then lets its pins go)."""
        if self._keepalive is None or not self._keepalive.is_alive():
            self._stop.clear()
            conn = AgentConnection(self._endpoint, timeout=KEEPALIVE * 2, cache_dir=self._cache_dir, token=self._token)
            self._keepalive = threading.Thread(
                target=_ping_while_held,
                args=(weakref.ref(self), conn, self._stop),
                name="wdscache-keepalive",
                daemon=True,
            )
            self._keepalive.start()

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The agent's live statistics (the object ``wdscache stats --json`` prints)."""
        with self._own():
            return self._check(self._conn.request(Requests.stats(), timeout=timeout))["stats"]

    def close(self) -> None:
        """Say goodbye (the agent drops this client's pins) and close the socket, if open."""
        with self._own():
            self._stop.set()
            if self._keepalive is not None:
                self._keepalive.join(KEEPALIVE * 2 + 1.0)
            self._held.clear()  # the bye lets them go: a request after close() pins none of them again
            if not self._conn.connected:
                return  # never asked anything, or closed already: the agent holds nothing of ours
            try:
                self._conn.request(self._requests.bye(), timeout=BYE_TIMEOUT)
            except (AgentUnavailableError, NotTrustedError):
                pass
            finally:
                self._conn.close()

    def __enter__(self) -> ShardClient:
        return self

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickled for another process, say) is a client of its own: see _renew.
        return {k: v for k, v in self.__dict__.items() if k not in ("_keepalive", "_stop", "_lock", "_held")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._renew()
        self._conn.on_new_run = weakly(self._pin_again)

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _check(reply: dict[str, Any]) -> dict[str, Any]:
        if not reply.get("ok"):
            raise ProtocolError(str(reply.get("error", "request refused")))
        return reply
