"""The Slurm recipe (agent/slurm/) on a real single-node cluster, by scripts/slurm_check.sh.

Opt-in: it needs root, installs Debian's slurm-wlm and munge when missing, and runs slurmctld and
slurmd for about 20 s. Set ``WDSCACHE_SLURM_CHECK=1`` to run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "slurm_check.sh"
UNAVAILABLE = 3  # the script's status when Slurm cannot run on this machine

pytestmark = pytest.mark.slow


def test_the_launcher_starts_the_agent_before_the_training_and_stops_it_after():
    if not os.environ.get("WDSCACHE_SLURM_CHECK"):
        pytest.skip("set WDSCACHE_SLURM_CHECK=1 to run the Slurm recipe on a real cluster (root; installs slurm-wlm)")
    env = {**os.environ, "WDSCACHE_VENV": sys.prefix}
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900, check=False)
    if r.returncode == UNAVAILABLE:
        reason = [line for line in r.stderr.splitlines() if "UNAVAILABLE:" in line]
        pytest.skip(f"Slurm cannot run here: {reason[-1] if reason else r.stderr[-500:]}")
    assert r.returncode == 0, r.stderr[-6000:]
    assert "slurm_check: OK: agent ready before the training, 400 samples on 2 ranks" in r.stderr
