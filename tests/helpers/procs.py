"""Looking at processes through /proc, for tests that kill agents, workers and consumers; and
running a scenario in a process of its own (:func:`run_json_job`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: state [0], ppid [1], starttime [19]."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def children_of(pid: int) -> dict[int, str]:
    """pid -> start time of every live (not zombie) process whose parent is ``pid``."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = stat_fields(int(d))
            if f is not None and int(f[1]) == pid and f[0] != "Z":
                out[int(d)] = f[19]
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pids(agent_pid: int) -> list[int]:
    """The agent's sample workers: the children :class:`wdscache.agent.pool.WorkerPool` starts as
    ``python -c _BOOT ...``, a command line that imports ``wdscache.agent.worker``."""
    return sorted(p for p in children_of(agent_pid) if "wdscache.agent.worker" in cmdline(p))


def alive(pid: int, starttime: str) -> bool:
    """True while the very process (same start time) exists and is not a zombie."""
    f = stat_fields(pid)
    return f is not None and f[19] == starttime and f[0] != "Z"


def rss_kib(pid: int, kind: str = "VmRSS") -> int:
    """Resident memory of ``pid`` (0 once it is gone): all of it, or ``RssFile``, ``RssAnon``."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{kind}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def files_held(pid: int | str, under: Path) -> tuple[list[str], list[str]]:
    """Files under ``under`` that process ``pid`` (or "self") holds open, and those it maps
    (a deleted one's path ends with " (deleted)"); none once the process is gone."""
    fds: list[str] = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile (as is the one listdir itself used)
            if target.startswith(str(under)):
                fds.append(target)
        maps = [
            line.split(None, 5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if str(under) in line
        ]
    except FileNotFoundError:
        return [], []
    return fds, maps


def run_json_job(module: str, *args: str, timeout: float = 240) -> dict[str, Any]:
    """Run ``python -m module args...`` from the repository (a torch scenario in a process of its
    own: torch's import is slow, and must not leak into the pytest process); its last line of
    output, a JSON object. Fails the test with its stderr's end if it exits non-zero. It runs in
    a session of its own, killed whole past ``timeout``: DataLoader workers go with it."""
    p = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def json_outputs(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    """Each process's last line of output, a JSON object, once it exits (within ``timeout`` each);
    fails the test with a process's stderr's end if it exits non-zero."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def kill_left(procs: list[subprocess.Popen[str]]) -> None:
    """Kill (and reap) those of ``procs`` still running: none is left behind by a failed test."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
