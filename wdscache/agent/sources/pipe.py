"""``pipe:`` sources: a shell command's output (listed only when the agent runs with
``--allow-pipe``). Its size is unknown until it ends and it cannot be resumed: every
request runs the command again, from byte 0. A command that exits with another status
than 0 fails the download, with the end of what it wrote to stderr."""

from __future__ import annotations

import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ...shared.errors import FetchError
from ..validators import Version
from .base import CHUNK, Source, SourceResponse

STDERR_TAIL = 500  # bytes of a failed command's stderr its error quotes
EXIT_WAIT = 10.0  # seconds a command gets to exit once its output ends


class PipeSource(Source):
    @contextmanager
    def open(
        self, url: str, start: int, end: int | None, held: str | None, cancel: threading.Event | None = None
    ) -> Iterator[SourceResponse]:
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                url[len("pipe:") :], shell=True, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL
            )
            stdout = proc.stdout
            assert stdout is not None
            try:
                yield SourceResponse(iter(lambda: stdout.read(CHUNK), b""), 0, False, None, Version())
            finally:
                if proc.poll() is None:
                    proc.kill()
                stdout.close()
                rc = proc.wait(EXIT_WAIT)
            # Once its output was taken whole (an error in between is the error).
            if rc != 0:
                err.seek(0)
                msg = err.read()[-STDERR_TAIL:].decode(errors="replace").strip()
                raise FetchError(url, f"command exited with status {rc}: {msg}")
