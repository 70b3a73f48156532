"""A hang-up (SIGHUP: the SSH session of an agent in its foreground closed) stops the agent cleanly.

Real agents through the CLI.
"""

from __future__ import annotations

import signal

STOP_WITHIN = 10.0  # seconds an agent gets to exit after one signal


def test_a_hang_up_stops_the_agent_cleanly(tmp_path, dataset, start_agent):
    cache = tmp_path / "cache"
    agent = start_agent(cache, dataset(1).list_file)
    assert (cache / "agent.json").exists()
    assert agent.stop(signal.SIGHUP, timeout=STOP_WITHIN) == 0 and not agent.killed, agent.stderr_tail()
    logged = agent.stderr_text()
    assert "stopping" in logged and logged.rstrip().endswith("stopped"), logged
    assert not (cache / "agent.json").exists() and not (cache / "agent.sock").exists()
