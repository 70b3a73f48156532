"""``wdscache stats`` on an agent that runs but does not answer (busy, or stuck): shown running, with its
pid, and not answering, never as not running."""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.procs import stat_fields
from tests.helpers.waits import wait_for


def _metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _at_once(calls: dict[str, tuple]) -> dict[str, object]:
    """``{name: f(*args)}`` of ``calls`` (``{name: (f, *args)}``), all run at once."""
    with ThreadPoolExecutor(len(calls)) as pool:
        runs = {name: pool.submit(*call) for name, call in calls.items()}
        return {name: run.result() for name, run in runs.items()}


@pytest.mark.slow  # its stats calls wait out the reply that does not come (5 s)
def test_an_agent_that_does_not_answer_is_shown_running_but_not_answering(tmp_path, dataset, start_agent, run_cli):
    cache = tmp_path / "cache"
    agent = start_agent(cache, dataset(1).list_file)
    endpoint = json.loads((cache / "agent.json").read_text())["endpoint"]

    # Stopped, the agent keeps its lock but answers nothing, as a core busy with a huge list edit.
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stat_fields(agent.pid)[0] == "T", 10, "the agent never stopped")
        got = _at_once(  # each waits for the agent's reply first
            {
                "json": (run_cli, "stats", "--cache-dir", cache, "--json"),
                "text": (run_cli, "stats", "--cache-dir", cache),
                "prometheus": (run_cli, "stats", "--cache-dir", cache, "--prometheus"),
            }
        )
    finally:
        os.kill(agent.pid, signal.SIGCONT)

    for form in ("json", "text", "prometheus"):
        assert got[form].returncode == 0, (form, got[form].stderr)
    shown = json.loads(got["json"].stdout)["agent"]
    assert shown is not None, f"a live agent shown as not running:\n{got['text'].stdout}"
    assert shown.pop("uptime_s") >= 0
    assert shown == {"pid": agent.pid, "endpoint": endpoint, "answering": False}
    assert re.search(
        rf"^agent      pid {agent.pid}, up \d+s, running but not answering, endpoint {re.escape(endpoint)}$",
        got["text"].stdout,
        re.M,
    ), got["text"].stdout
    metrics = _metrics(got["prometheus"].stdout)
    assert (metrics["wdscache_agent_up"], metrics["wdscache_agent_answering"]) == (1, 0)

    # Going on, it answers again: running and answering, with what only its answer tells.
    again = agent.stats()["agent"]
    assert (again["pid"], again["answering"], len(again["workers"])) == (agent.pid, True, 1)
