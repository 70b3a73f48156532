"""The agent's sample workers: processes that read cached shards and send samples to consumers.

This module is the one place that decides what runs as a process: each worker
is a fresh interpreter (:class:`WorkerPool`: it inherits no sockets, locks or
threads from the agent) that binds its own socket, so samples go from the
worker straight to the consumer, one hop. Consumers learn the worker endpoints
from the agent.

What a worker does and answers is :mod:`wdscache.agent.worker`.

Workers never outlive the agent: they ask the kernel for SIGKILL when their
parent dies (Linux), and also exit when their parent's pid changes.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import zmq

from ..shared.errors import ConfigError
from ..shared.logs import event, get_logger
from ..shared.protocol import client_key, worker_key, zmq_context
from ..shared.redact import redact_urls
from .control import cannot_listen
from .ipc_files import ipc_path, refuse_taken, remove_stale
from .worker import WorkerSpec

log = get_logger(__name__)

# What a worker process runs: the agent's sys.path first, then the worker module.
_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); import wdscache.agent.worker as w; w.main(sys.argv[1:])"
)
RESTART_BACKOFF_MAX = 5.0  # seconds
WORKER_ADVICE = (
    "choose another --endpoint (its workers listen on the ports after its own, or on PATH-wN.sock "
    "beside ipc://PATH.sock)"
)


def check_endpoints(agent_endpoint: str, endpoints: list[str]) -> None:
    """Refuse (ConfigError) the agent's endpoint and its workers' ``endpoints`` where another
    process listens, before the workers that bind them start, and before the slow steps of a start
    (the sizes asked of sources). A TCP endpoint is bound and let go here, as ZeroMQ binds it; an
    IPC one is looked at as :mod:`wdscache.agent.ipc_files` binds it (a stale socket file passes:
    it is replaced). The agent's first: the message names the endpoint given, not a worker's."""
    ctx = zmq_context(agent_endpoint)
    try:
        if (path := ipc_path(agent_endpoint)) is not None:
            refuse_taken(agent_endpoint)
            if not os.path.isdir(os.path.dirname(path) or "."):  # (else found only as the socket binds)
                raise cannot_listen(agent_endpoint, FileNotFoundError(errno.ENOENT, "no such folder"))
        else:
            _bind_and_let_go(ctx, agent_endpoint, lambda exc: cannot_listen(agent_endpoint, exc))
        for endpoint in endpoints:
            if ipc_path(endpoint) is not None:
                refuse_taken(endpoint, role=" for a sample worker", advice=WORKER_ADVICE)
            else:
                _bind_and_let_go(ctx, endpoint, functools.partial(_worker_cannot_listen, endpoint))
    finally:
        ctx.term()


def _bind_and_let_go(ctx: zmq.Context, endpoint: str, error: Callable[[zmq.ZMQError], ConfigError]) -> None:
    """Bind a socket of ``ctx`` to TCP ``endpoint`` and close it; ``error(exc)`` raised if it cannot be bound."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise error(exc) from None
    finally:
        sock.close(0)


def _worker_cannot_listen(endpoint: str, exc: zmq.ZMQError) -> ConfigError:
    return ConfigError(
        f"cannot listen on {redact_urls(endpoint)} for a sample worker ({os.strerror(exc.errno or 0)}): {WORKER_ADVICE}"
    )


def worker_endpoints(agent_endpoint: str, n: int) -> list[str]:
    """Where workers bind, derived from the agent's endpoint (next to its socket, or next ports)."""
    if agent_endpoint.startswith("ipc://"):
        base = agent_endpoint[: -len(".sock")] if agent_endpoint.endswith(".sock") else agent_endpoint
        return [f"{base}-w{i}.sock" for i in range(n)]
    host, port = agent_endpoint.rsplit(":", 1)
    return [f"{host}:{int(port) + 1 + i}" for i in range(n)]


class WorkerPool:
    """Starts, watches and stops the worker processes.

    A worker is a fresh interpreter running :func:`wdscache.agent.worker.main` with the agent's
    ``sys.path``, not a multiprocessing child: it imports the package and what
    serving needs, not the agent's command line as ``spawn`` would, and needs no
    resource tracker process, which keeps each worker's memory near Python's own.
    It writes a byte to its ready pipe once its socket is bound.
    """

    def __init__(self, *, n: int, agent_endpoint: str, cache_dir: str, token: str, run: str, log_format: str) -> None:
        self.endpoints = worker_endpoints(agent_endpoint, n)
        self._specs = [
            WorkerSpec(i, ep, cache_dir, agent_endpoint, os.getpid(), log_format) for i, ep in enumerate(self.endpoints)
        ]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._ready: list[int | None] = [None] * n  # the read end of each worker's ready pipe, until it says so
        self._started = [0.0] * n
        self._backoff = [0.0] * n  # a worker that dies at once (say, it cannot import) is not restarted in a loop
        self.restarts = 0
        # Proves a report comes from one of our workers (see the module's docstring).
        self.secret = secrets.token_hex(16)
        # The key of the workers' reports (the agent's door), and what a consumer's request to
        # worker i must carry (see the module's docstring).
        self.key = client_key(token, run)
        self._keys = [worker_key(token, run, i) for i in range(n)]

    def start(self) -> None:
        for i in range(len(self._specs)):
            self._start(i)

    def _start(self, i: int) -> None:
        r, w = os.pipe()
        try:
            # The agent's sys.path, as multiprocessing's spawn would hand it on: the worker
            # imports this very copy of the package, not one its working directory holds.
            self._procs[i] = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(sys.path), json.dumps(asdict(self._specs[i])), str(w)],
                pass_fds=(w,),
                stdin=subprocess.PIPE,
            )
            stdin = self._procs[i].stdin  # type: ignore[union-attr]
            assert stdin is not None
            try:
                with stdin:  # not argv: any local user may read a command line
                    stdin.write(f"{self.secret}\n{self.key}\n{self._keys[i]}\n".encode())
            except OSError:
                pass  # it died at once: check() starts another
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self._close_ready(i)
        self._ready[i] = r
        self._started[i] = time.monotonic()

    def _close_ready(self, i: int) -> None:
        fd, self._ready[i] = self._ready[i], None
        if fd is not None:
            os.close(fd)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every worker has bound its socket (a process takes a while to start);
        False at the timeout, or at once if a worker died meanwhile (:meth:`check` replaces it)."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = {fd: i for i, fd in enumerate(self._ready) if fd is not None}
            if not waiting:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            readable, _, _ = select.select(list(waiting), [], [], left)
            for fd in readable:
                if not os.read(fd, 1):
                    return False  # it exited before saying it was ready
                self._close_ready(waiting[fd])

    def check(self) -> None:
        """Replace any worker that died (its consumers retry their requests)."""
        now = time.monotonic()
        for i, p in enumerate(self._procs):
            if p is None or p.poll() is None:
                continue
            if self._backoff[i] == 0.0 or now - self._started[i] > RESTART_BACKOFF_MAX:
                event(
                    log,
                    "worker_restarted",
                    "worker %d (pid %s) died with exit code %s; starting a new one",
                    i,
                    p.pid,
                    p.returncode,
                    level=logging.ERROR,
                    worker=i,
                    pid=p.pid,
                    exit_code=p.returncode,
                )
                # Lived long: restart at once. Died young: wait longer each time.
                young = now - self._started[i] < RESTART_BACKOFF_MAX
                self._backoff[i] = min(2 * self._backoff[i] or 0.1, RESTART_BACKOFF_MAX) if young else 0.0
                self.restarts += 1
                self._start(i)
            elif now - self._started[i] >= self._backoff[i]:
                event(
                    log,
                    "worker_restarted",
                    "worker %d exited again (code %s) soon after starting; retrying",
                    i,
                    p.returncode,
                    level=logging.ERROR,
                    worker=i,
                    exit_code=p.returncode,
                )
                self._backoff[i] = min(2 * self._backoff[i], RESTART_BACKOFF_MAX)
                self.restarts += 1
                self._start(i)

    def stop(self, timeout: float = 5.0) -> None:
        for p in self._procs:
            if p is not None and p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self._procs:
            if p is not None:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    try:
                        p.wait(1.0)
                    except subprocess.TimeoutExpired:  # stuck in the kernel (a hung mount, say)
                        log.error("worker pid %d did not exit after SIGKILL", p.pid)
        for i in range(len(self._ready)):
            self._close_ready(i)
        for ep in self.endpoints:
            if ipc_path(ep) is not None:
                # A worker removes its own file as it exits; one killed leaves it, stale now that its
                # process is gone. Another process's socket (one listens there) is left alone.
                with contextlib.suppress(OSError):  # (a folder we may not write: nothing of ours to remove)
                    remove_stale(ep)
