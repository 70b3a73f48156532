"""A loader's report clock: the rate its streams report adds up to the loader's, however many
streams (epochs) of it are read at once, and never goes below zero as streams end."""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest

from wdscache.training.reporter import REPORT_EVERY, ReportClock


def _due_since(clock: ReportClock, seconds: float) -> None:
    """Make the clock's latest report ``seconds`` old (a report due now)."""
    clock.at = time.monotonic() - seconds


def test_two_streams_read_at_once_report_shares_that_add_up_to_the_loaders_rate() -> None:
    clock = ReportClock()
    counts = {"a": 0, "b": 0}
    a, b = object(), object()
    clock.start(a, lambda: counts["a"])
    clock.start(b, lambda: counts["b"])
    _due_since(clock, 2.0)
    counts["a"], counts["b"] = 100, 200  # 300 samples in 2 s between them
    share_a = clock.tick()
    share_b = clock.tick()  # the other stream, in the same report period: the same share
    assert share_a == share_b
    assert share_a + share_b == pytest.approx(150.0, rel=0.01)


def test_a_stream_that_ends_keeps_its_samples_in_the_loaders_count() -> None:
    clock = ReportClock()
    counts = {"a": 0, "b": 0}
    a, b = object(), object()
    clock.start(a, lambda: counts["a"])
    _due_since(clock, 2.0)
    counts["a"] = 400
    assert clock.tick() == pytest.approx(200.0, rel=0.01)
    clock.ended(a, 500)  # its last 100 samples came after that report
    clock.start(b, lambda: counts["b"])  # the next epoch
    counts["b"] = 100
    _due_since(clock, 1.0)
    clock.samples = 400  # (the report above, moved back with the clock)
    assert clock.tick() == pytest.approx(200.0, rel=0.02)  # 100 of a's and 100 of b's in 1 s
    clock.ended(b, 100)
    clock.ended(b, 100)  # (a second end of one stream counts nothing)
    assert clock.done == 600 and clock.due() <= REPORT_EVERY


def test_a_copy_of_the_clock_in_another_process_starts_anew() -> None:
    clock = ReportClock()
    clock.start(object(), lambda: 7)
    copy = pickle.loads(pickle.dumps(clock))
    assert copy.rate is None and copy.done == 0 and copy.pid == 0


def test_a_clock_forked_while_a_thread_held_its_lock_starts_in_the_child() -> None:
    # A DataLoader forks its workers while the parent's reporter thread may hold the clock's lock:
    # the child's copy of that lock stays held, and its reports would wait for it for ever.
    clock = ReportClock()
    clock.start(object(), lambda: 0)
    with clock._lock:
        pid = os.fork()
        if pid == 0:  # the child: its first stream's reporter starts
            done = threading.Event()
            threading.Thread(target=lambda: (clock.start(object(), lambda: 0), done.set()), daemon=True).start()
            os._exit(0 if done.wait(10) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
