"""``python clock_shift.py OFFSET_FILE ARGS...``: ``wdscache ARGS...`` with this process's wall clock
(``time.time``, ``time.time_ns``) shifted by the seconds OFFSET_FILE holds, as an NTP step or a
VM resumed shifts it; the monotonic clock is left alone. The file is read at the start and again
every POLL seconds; each offset taken is written to OFFSET_FILE.taken, so that a test knows the
step happened (:class:`ShiftedClock`). Only this process's clock moves: the agent's workers, its
consumers and the test keep the real one."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

POLL = 0.05


class ShiftedClock:
    """The wall clock of an agent started with ``exe`` in place of ``wdscache``: real + offset."""

    def __init__(self, path: Path, offset: float = 0.0) -> None:
        self.path, self.taken = path, path.with_name(path.name + ".taken")
        self.exe = [sys.executable, os.path.abspath(__file__), str(path)]
        self._write(offset)

    def step(self, offset: float, timeout: float = 10.0) -> None:
        """Set the agent's clock to real + ``offset``; returns once the agent took it."""
        from tests.helpers.waits import wait_for  # (here: the agent runs this file with no tests package)

        self._write(offset)
        wait_for(
            lambda: self.taken.exists() and self.taken.read_text() == repr(float(offset)),
            timeout,
            f"the agent never took the clock offset {offset}",
        )

    def _write(self, offset: float) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(repr(float(offset)))
        os.replace(tmp, self.path)  # whole: never read half written


def main() -> None:
    path = Path(sys.argv[1])
    taken = path.with_name(path.name + ".taken")
    real_time, real_time_ns = time.time, time.time_ns
    offset = [0.0]

    def take() -> None:
        try:
            value = float(path.read_text())
        except (OSError, ValueError):  # (not an offset: the one taken holds)
            return
        if value != offset[0] or not taken.exists():
            offset[0] = value
            taken.write_text(repr(value))  # (after the offset is set: what comes next has it)

    def poll() -> None:
        while True:
            time.sleep(POLL)
            take()

    del sys.path[0]  # this script's folder: its modules (tests.helpers) must not shadow the agent's imports
    take()
    time.time = lambda: real_time() + offset[0]
    time.time_ns = lambda: real_time_ns() + int(offset[0] * 1e9)
    threading.Thread(target=poll, name="clock-shift", daemon=True).start()
    sys.argv = ["wdscache", *sys.argv[2:]]
    from wdscache.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
