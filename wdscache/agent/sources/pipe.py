"""``pipe:`` sources: a shell command's output (listed only when the agent runs with
``--allow-pipe``). Its size is unknown until it ends and it cannot be resumed: every
request runs the command again, from byte 0.

Guarantees:

- A command that exits with another status than 0 fails the attempt, with the end of what
  it wrote to stderr, whether its output was long, short or no tar at all; the attempt is
  retried as a failed connection is (``--retries``, with backoff), the command run anew.
- A command that writes nothing for ``--read-timeout`` seconds, or whose download is
  cancelled (the agent stops), is killed with every process it started (its own process
  group), and the attempt fails (retried as above, unless cancelled).
- A command whose output ended gets ``EXIT_WAIT`` seconds to exit before it is killed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ...shared.errors import FetchError
from ...shared.redact import redact_urls
from ..shard_download import Cancelled, Retry
from ..validators import Version
from .base import CHUNK, Source, SourceResponse

STDERR_TAIL = 500  # characters of a failed command's stderr its error quotes (redacted)
STDERR_KEPT = 65536  # bytes of its stderr kept to find them in
EXIT_WAIT = 10.0  # seconds a command gets to exit once its output ends
FAILED_EXIT_WAIT = 1.0  # seconds a command whose output was refused gets to exit (and say why)
LOOK_EVERY = 0.5  # seconds between looks at the cancel flag while a command is silent


class PipeSource(Source):
    @contextmanager
    def open(
        self, url: str, start: int, end: int | None, held: str | None, cancel: threading.Event | None = None
    ) -> Iterator[SourceResponse]:
        # The command's stderr is drained as it comes (its tail kept for the error), not put in a
        # temp file: an agent may have no writable temp folder (systemd's ProtectSystem=strict).
        # Its own session: the command and whatever it starts are killed together.
        proc = subprocess.Popen(
            url[len("pipe:") :],
            shell=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        stdout, stderr = proc.stdout, proc.stderr
        assert stdout is not None and stderr is not None
        tail = bytearray()
        cut = False

        def drain() -> None:  # (its thread closes the pipe once the command, and any child, let go)
            nonlocal cut
            try:
                for chunk in iter(lambda: os.read(stderr.fileno(), CHUNK), b""):
                    tail.extend(chunk)
                    if len(tail) > STDERR_KEPT:
                        del tail[:-STDERR_KEPT]
                        cut = True
            finally:
                stderr.close()

        drainer = threading.Thread(target=drain, daemon=True, name="pipe-stderr")
        drainer.start()
        output = _output(url, stdout.fileno(), self.settings.read_timeout, cancel)
        try:
            yield SourceResponse(output, 0, False, None, Version())
            rc = _ended(url, proc, EXIT_WAIT, cancel)  # its output taken whole: its status says whether it was
        except FetchError:
            # Its output was refused (none, short, a page): a failed command's status and stderr,
            # raised below, say more.
            rc = _ended(url, proc, FAILED_EXIT_WAIT, cancel)
            if rc is None or rc == 0:
                raise
        finally:
            # What it started goes too, even once the shell exited (a "cmd &"): the group's id is
            # not given to another process while one of the group lives.
            _kill(proc)
            stdout.close()
            drainer.join(EXIT_WAIT)  # (a child of the command may hold its stderr open: not for ever)
        if rc is None:
            raise Retry(f"command did not exit within {EXIT_WAIT:g}s of its output's end")
        if rc != 0:
            raise Retry(_exit_reason(rc, tail, cut, drainer))


def _output(url: str, fd: int, read_timeout: float, cancel: threading.Event | None) -> Iterator[bytes]:
    """The command's stdout, a chunk at a time; Cancelled once ``cancel`` is set, TimeoutError after
    ``read_timeout`` seconds without a byte."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    last = time.monotonic()
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled(url)
        if not poller.poll(int(LOOK_EVERY * 1000)):
            if time.monotonic() - last > read_timeout:
                raise TimeoutError(f"the command wrote nothing for {read_timeout:g}s (--read-timeout)")
            continue
        chunk = os.read(fd, CHUNK)
        if not chunk:
            return
        last = time.monotonic()
        yield chunk


def _ended(url: str, proc: subprocess.Popen[bytes], wait: float, cancel: threading.Event | None) -> int | None:
    """The command's exit status once it exits within ``wait`` seconds; else None (it is killed).
    Cancelled once ``cancel`` is set meanwhile (the agent stops: its caller kills the command)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return proc.wait(max(0.0, min(LOOK_EVERY, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if cancel is not None and cancel.is_set():
                raise Cancelled(url) from None
            if time.monotonic() >= deadline:
                _kill(proc)
                return None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the command and every process of its session (what it started), and reap it (once it
    ended, what it started)."""
    with contextlib.suppress(ProcessLookupError):  # (every one of them gone already)
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # (stuck in the kernel: a hung mount, say)
        proc.wait(EXIT_WAIT)


def _exit_reason(rc: int, tail: bytearray, cut: bool, drainer: threading.Thread) -> str:
    """Why the attempt failed: the command's status, and the end of its stderr."""
    drainer.join(EXIT_WAIT)
    how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
    said = _stderr_tail(bytes(tail), cut)
    return f"command {how}" + (f": {said}" if said else "")


def _stderr_tail(kept: bytes, cut: bool) -> str:
    """The end of a command's stderr, as its error quotes it: redacted before it is cut, since a
    cut inside a URL drops the scheme the redaction knows the URL's user info by. A line whose
    start was not ``kept`` is left out, for the same reason."""
    text = kept.decode(errors="replace")
    if cut:
        text = text.partition("\n")[2]
    text = redact_urls(text).strip()
    return text if len(text) <= STDERR_TAIL else "..." + text[-STDERR_TAIL:]
