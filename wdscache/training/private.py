"""A private agent: started by a loader that finds none, for its own use (a notebook, a script).

It is an ordinary ``wdscache agent`` in a subprocess of its own session (a
Ctrl-C aimed at one loader does not reach it), on the loader's cache directory
and list. The cache it fills stays for the next run, or for a real agent.

Lifetime guarantee: a private agent lives while any loader uses it, whichever
loader started it, and stops by itself within about a second once none does,
however they ended: ``close()``, a ``with`` block, interpreter exit, garbage
collection, or SIGKILL. No loader stops a running one. How:

- every loader using it holds a shared ``flock`` on ``private-users`` in the
  cache directory, taken before it starts or joins the agent and dropped by the
  kernel when the process dies, however it dies;
- the agent tries an exclusive lock on that file once a second; holding it
  means no loader is left, and it keeps it until it has stopped, so a loader
  arriving meanwhile waits (up to its ``timeout``) for it to be gone and starts
  a new one instead of joining an agent that is going away;
- starting is serialized by an exclusive lock on ``private-start.lock``, so two
  loaders starting at once start one agent and both use it.

A cache directory that does not exist is refused at once (:func:`check_cache_dir`), unless
a private agent may make it: a loader with a list makes one, but only in a folder that
exists; a missing parent is taken for a typo.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..shared.errors import ConfigError, WdsCacheError
from ..shared.layout import CacheLayout, write_atomic
from ..shared.logs import get_logger
from ..shared.protocol import process_identity, still_runs
from ..shared.stats import ask_agent
from ..shared.urls import format_url_list

log = get_logger(__name__)

USERS_FILE = "private-users"
START_LOCK = "private-start.lock"
LOCK_POLL = 0.05  # seconds between tries of a lock held by another process
# Seconds between looks for the state file of the agent we started: a look is one stat while
# there is none, and the loader's first sample waits for the first look after it appears.
START_POLL = 0.01


def _serving(layout: CacheLayout, timeout: float = 1.0) -> dict[str, Any] | None:
    """The state file (agent.json) of the agent serving ``layout`` now, or None."""
    try:
        state = json.loads(layout.state_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or ask_agent(layout, timeout) is None:
        return None
    return state


def check_cache_dir(cache_dir: str | os.PathLike[str], *, may_start: bool) -> None:
    """Refuse at once, naming it, a ``cache_dir`` no agent can be serving: one that does not
    exist, unless a private agent may start there (``may_start``: the loader has a list) and
    its parent exists. Else a typo would only show as no agent answering, ``timeout`` later."""
    path = Path(cache_dir)
    if path.is_dir():
        return
    if path.exists():
        raise ConfigError(f"cache_dir={os.fspath(cache_dir)!r} is not a directory")
    if not may_start:
        raise ConfigError(
            f"cache_dir={os.fspath(cache_dir)!r} does not exist, so no agent serves it: check the path, start "
            f"one with 'wdscache agent --cache-dir {os.fspath(cache_dir)} --urls FILE', or give urls= to have "
            "the loader start a private one"
        )
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ConfigError(
            f"cache_dir={os.fspath(cache_dir)!r} does not exist, nor does its folder {parent}: a cache "
            "directory for a private agent is made only in a folder that exists; check the path"
        )


class PrivateAgent:
    """One loader's use of the private agent on a cache directory: :meth:`use` joins or starts it."""

    def __init__(self, users_fd: int, pid: int, proc: subprocess.Popen[bytes] | None) -> None:
        self.pid = pid  # the agent's
        self.proc = proc  # when this loader started it
        self._process = process_identity(pid)  # a pid reused later is another process
        # Closing the descriptor drops our shared lock; also when this object is garbage, or at exit.
        self._release = weakref.finalize(self, os.close, users_fd)

    @classmethod
    def use(cls, cache_dir: str | os.PathLike[str], urls: Sequence[str], *, timeout: float) -> PrivateAgent | None:
        """Use the private agent on ``cache_dir``, starting one on ``urls`` if none runs;
        None when a real agent serves it (nothing to hold: it runs until its owner stops it)."""
        layout = CacheLayout.of(cache_dir)
        state = _serving(layout)
        if state is not None and not state.get("private_users"):
            return None
        _warn_of_foreign_files(layout)
        layout.prepare()  # ours and private before anything is written into it
        deadline = time.monotonic() + timeout
        start_fd = _lock(
            layout.root / START_LOCK, fcntl.LOCK_EX, deadline, "another loader is starting a private agent there"
        )
        try:
            users_fd = _lock(layout.root / USERS_FILE, fcntl.LOCK_SH, deadline, "its private agent is still stopping")
            try:
                proc = None
                state = _serving(layout) or _answer_of_running(layout, deadline)
                if state is None:
                    proc, state = _start(layout, urls, deadline)
                if not state.get("private_users"):  # a real agent came up meanwhile
                    os.close(users_fd)
                    return None
                return cls(users_fd, int(state["pid"]), proc)
            except BaseException:
                os.close(users_fd)
                raise
        finally:
            os.close(start_fd)  # drops the lock

    def alive(self) -> bool:
        """Whether the agent still runs (one killed, by the OOM killer say, is started anew by the
        next use): not once it is a zombie, which it is while its threads end, before it can be reaped."""
        if self.proc is not None and self.proc.poll() is not None:
            return False
        return still_runs(self._process)

    def release(self) -> None:
        """Stop using the agent; it stops by itself once no other loader uses it."""
        self._release()
        if self.proc is not None:
            self.proc.poll()  # reap it if it has already exited


def _warn_of_foreign_files(layout: CacheLayout) -> None:
    """Warn, naming the folder, when a cache directory no agent has used yet holds files: say,
    webdataset's own download cache (its ``WebDataset(cache_dir=)``), given again as wdscache's.
    The agent takes the folder as it is (private, mode 0700) and leaves what it did not write
    at its top as it is, neither read, counted nor deleted: unseen, outside its budget."""
    root = layout.root
    if os.path.lexists(layout.index_dir) or os.path.lexists(layout.token_path):
        return  # a cache already: what else it holds is the agent's to judge
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return  # not there yet (the agent makes it), or unreadable (prepare() says why)
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        log.warning(
            "cache_dir %s is no wdscache cache yet but holds files (%s): a private agent makes its cache "
            "there beside them (the folder made private, mode 0700) and leaves them as they are, unread "
            "and outside its budget; webdataset's download cache (its WebDataset(cache_dir=)) is not "
            "wdscache's: give wdscache a folder of its own",
            root,
            shown,
        )


def _lock(path: Path, how: int, deadline: float, busy: str) -> int:
    """A descriptor of ``path`` holding an flock of kind ``how``, waited for until ``deadline``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise WdsCacheError(
                    f"could not use a private agent on {path.parent}: {busy} ({path} stayed locked "
                    "for the loader's whole timeout); try again, or start 'wdscache agent' there yourself"
                ) from None
            time.sleep(LOCK_POLL)


def _answer_of_running(layout: CacheLayout, deadline: float) -> dict[str, Any] | None:
    """The state of an agent that runs on ``layout`` but has not answered yet (busy, or starting),
    once it answers; None if none runs. An agent that still has not answered at ``deadline`` is a
    WdsCacheError: a second one could not start there anyway."""
    state = layout.agent_state()
    if state is None or not layout.agent_holds_lock(state["pid"]):
        return None
    while (answered := _serving(layout, 0.5)) is None:
        if time.monotonic() > deadline:
            who = layout.starting_note() or f"the agent (pid {state['pid']}) on {layout.root} runs"
            raise WdsCacheError(
                f"{who} but did not answer within the loader's timeout; try again, or give the loader a longer timeout="
            )
        if not layout.agent_holds_lock(state["pid"]):
            return None  # it stopped meanwhile
    return answered


def _start(layout: CacheLayout, urls: Sequence[str], deadline: float) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start a private agent (the caller holds the start lock and a shared users lock); its state once it answers."""
    list_file = layout.root / "private-urls.txt"
    write_atomic(list_file, format_url_list(urls).encode())
    log_file = layout.root / "private-agent.log"
    cmd = [
        sys.executable,
        "-m",
        "wdscache",
        "agent",
        "--cache-dir",
        str(layout.root),
        "--urls",
        str(list_file),
        "--workers",
        str(min(os.cpu_count() or 1, 4)),
        "--private-users",
        str(layout.root / USERS_FILE),
    ]
    log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True)
    finally:
        os.close(log_fd)
    log.info("started a private wdscache agent (pid %d) on %s", proc.pid, layout.root)
    while (state := _serving(layout, 0.5)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise WdsCacheError(
                f"could not start a private agent on {layout.root}; its log {log_file} ends with:\n" + _tail(log_file)
            )
        time.sleep(START_POLL)
    return proc, state


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End an agent that never came up (no loader can be using it: we hold the start lock)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
