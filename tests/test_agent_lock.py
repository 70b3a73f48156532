"""The agent's lock on its cache directory against a look by another process (as ``wdscache
stats`` takes one: the lock shared, for a moment)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from wdscache.agent import lock
from wdscache.shared.errors import AgentRunningError

# A look: the lock file shared until a line comes on stdin (or stdin closes).
LOOK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def look(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``tmp_path/agent.lock`` shared; it lets go on a line to its stdin."""
    path = tmp_path / "agent.lock"
    path.write_text("4242\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOK, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_a_start_during_a_look_takes_the_lock_once_the_look_is_over(tmp_path, look, monkeypatch) -> None:
    monkeypatch.setattr(lock, "LOOK_GRACE", 30.0)  # the look ends long before: no race with a loaded host
    held = lock.AgentLock(tmp_path / "agent.lock")
    taken = threading.Event()
    failed: list[BaseException] = []

    def take() -> None:
        try:
            held.acquire()
            taken.set()
        except BaseException as exc:  # reported below
            failed.append(exc)

    taker = threading.Thread(target=take)
    taker.start()
    try:
        assert not taken.wait(0.3), "taken while another process held the lock"
        assert look.stdin is not None
        look.stdin.write("done\n")
        look.stdin.flush()
        assert taken.wait(20), f"not taken after the look ended: {failed}"
    finally:
        taker.join(30)
        held.release()
    assert (tmp_path / "agent.lock").read_text() == ""  # released: the pid it wrote is gone


def test_a_lock_held_past_the_grace_is_another_agents(tmp_path, look, monkeypatch) -> None:
    monkeypatch.setattr(lock, "LOOK_GRACE", 0.2)
    with pytest.raises(AgentRunningError) as info:
        lock.AgentLock(tmp_path / "agent.lock").acquire()
    assert info.value.pid == 4242 and "pid 4242" in str(info.value) and str(tmp_path) in str(info.value)
