"""A private agent: started by a loader that finds none, for its own use (a notebook, a script).

It is an ordinary ``wdscache agent`` in a subprocess, on the loader's cache
directory and list; the loader stops it on ``close()`` or at interpreter exit.
The cache it fills stays for the next run, or for a real agent.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from .errors import WdsCacheError
from .layout import CacheLayout, write_private
from .stats import ask_agent
from .urls import format_url_list

log = logging.getLogger(__name__)


def agent_answers(cache_dir: str | os.PathLike[str], timeout: float = 1.0) -> bool:
    """True when an agent serves ``cache_dir`` now."""
    layout = CacheLayout.of(cache_dir)
    return layout.state_path.exists() and ask_agent(layout, timeout) is not None


class PrivateAgent:
    def __init__(self, cache_dir: str | os.PathLike[str], urls: Sequence[str], *, timeout: float) -> None:
        layout = CacheLayout.of(cache_dir)
        layout.prepare()  # ours and private before anything is written into it
        self.list_file = layout.root / "private-urls.txt"
        write_private(self.list_file, format_url_list(urls).encode())
        self.log_file = layout.root / "private-agent.log"
        cmd = [sys.executable, "-m", "wdscache", "agent", "--cache-dir", str(layout.root),
               "--urls", str(self.list_file), "--workers", str(min(os.cpu_count() or 1, 4))]
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd)
        finally:
            os.close(log_fd)
        atexit.register(self.stop)
        log.info("started a private wdscache agent (pid %d) on %s", self.proc.pid, layout.root)
        deadline = time.monotonic() + timeout
        while not agent_answers(layout.root, 0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise WdsCacheError(
                    f"could not start a private agent on {layout.root}; its log {self.log_file} ends with:\n"
                    + _tail(self.log_file)
                )
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        atexit.unregister(self.stop)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
