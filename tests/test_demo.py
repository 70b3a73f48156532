"""``scripts/demo.sh`` as a newcomer runs it: a real shard server, agent and two training processes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT = 180.0  # seconds; it takes about 15 on an idle machine


def _section(out: str, title: str) -> str:
    """The lines the demo printed under its heading ``== title`` (up to the next heading)."""
    match = re.search(rf"^== {re.escape(title)}[^\n]*\n(.*?)(?=^== |\Z)", out, re.M | re.S)
    assert match, out
    return match.group(1)


@pytest.mark.slow
def test_the_demo_shows_the_cache_filling_and_the_job_while_it_runs():
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    early = _section(r.stdout, "wdscache stats once the first shards are cached")
    assert re.search(r"^shards     [1-9]\d* cached", early, re.M), early
    running = _section(r.stdout, "wdscache stats while the job runs")
    # The job's ranks at that moment, one of them reading (on a busy machine the other may not
    # have started yet, or be done already).
    assert re.search(r"^job demo: .*\n(  rank [01]: .*\n)+", running, re.M), running  # (its verdict: any)
    assert re.search(r"^  rank [01]: [1-9]\d* samples", running, re.M), running
    after = _section(r.stdout, "wdscache stats after the epoch")
    assert re.search(r"^job demo: ended \S+: 1024 samples, waited", after, re.M), after
