"""``pipe:`` sources: a shell command's output (listed only when the agent runs with
``--allow-pipe``). Its size is unknown until it ends and it cannot be resumed: every
request runs the command again, from byte 0. A command that exits with another status
than 0 fails the download, with the end of what it wrote to stderr."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ...shared.errors import FetchError
from ...shared.redact import redact_urls
from ..validators import Version
from .base import CHUNK, Source, SourceResponse

STDERR_TAIL = 500  # characters of a failed command's stderr its error quotes (redacted)
STDERR_KEPT = 65536  # bytes of its stderr kept to find them in
EXIT_WAIT = 10.0  # seconds a command gets to exit once its output ends


class PipeSource(Source):
    @contextmanager
    def open(
        self, url: str, start: int, end: int | None, held: str | None, cancel: threading.Event | None = None
    ) -> Iterator[SourceResponse]:
        # The command's stderr is drained as it comes (its tail kept for the error), not put in a
        # temp file: an agent may have no writable temp folder (systemd's ProtectSystem=strict).
        proc = subprocess.Popen(
            url[len("pipe:") :], shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
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
        try:
            yield SourceResponse(iter(lambda: stdout.read(CHUNK), b""), 0, False, None, Version())
        finally:
            if proc.poll() is None:
                proc.kill()
            stdout.close()
            rc = proc.wait(EXIT_WAIT)
            drainer.join(EXIT_WAIT)  # (a child of the command may hold its stderr open: not for ever)
        # Once its output was taken whole (an error in between is the error).
        if rc != 0:
            raise FetchError(url, f"command exited with status {rc}: {_stderr_tail(bytes(tail), cut)}")


def _stderr_tail(kept: bytes, cut: bool) -> str:
    """The end of a command's stderr, as its error quotes it: redacted before it is cut, since a
    cut inside a URL drops the scheme the redaction knows the URL's user info by. A line whose
    start was not ``kept`` is left out, for the same reason."""
    text = kept.decode(errors="replace")
    if cut:
        text = text.partition("\n")[2]
    text = redact_urls(text).strip()
    return text if len(text) <= STDERR_TAIL else "..." + text[-STDERR_TAIL:]
