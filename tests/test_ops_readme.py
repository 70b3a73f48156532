"""Every ``wdscache`` command the README and the docs/ pages show is run here, as written, against a real
agent and a real HTTP server; every command of the CLI is shown somewhere; and every metric a page names is
one the agent exports."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.console import wdscache_exe
from tests.helpers.agents import AgentProc
from tests.helpers.net import free_port_range
from tests.helpers.waits import stop_process
from tests.helpers.watch import read_frames

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
# The README first (a newcomer's order), then the reference pages.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _commands(page: Path) -> list[str]:
    """The ``wdscache`` lines of a page's sh blocks, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", page.read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("wdscache ")]


def test_every_command_of_the_cli_is_shown_in_the_readme_or_the_docs():
    from wdscache.cli import main

    shown = {c.split()[1] for page in PAGES for c in _commands(page)}
    assert shown == set(main.commands), sorted(shown ^ set(main.commands))
    assert {"agent", "stats"} <= {c.split()[1] for c in _commands(README)}


@pytest.mark.slow
def test_every_command_in_the_readme_and_the_docs_runs_as_shown(tmp_path, dataset, run_cli):
    data = dataset(4, samples=4, payload=300, prefix="train")
    base = data.urls[0].rsplit("/", 1)[0] + "/"
    cache = tmp_path / "cache"
    port = str(free_port_range(1))
    swap = {
        "/scratch/wdscache": str(cache),
        "urls.txt": str(data.list_file),
        "https://data.example/": base,
        "9400": port,
        "wdscache.prom": str(tmp_path / "wdscache.prom"),
        "train.json": str(tmp_path / "train.json"),
    }
    commands = [c for page in PAGES for c in _commands(page)]
    agents: list[AgentProc] = []  # every agent a page starts, each stopped below whatever happens
    try:
        for i, line in enumerate(commands):
            for old, new in swap.items():
                line = line.replace(old, new)
            args = shlex.split(line, comments=True)[1:]
            out_file = None
            if ">" in args:
                out_file = Path(args[args.index(">") + 1])
                args = args[: args.index(">")]
            if args[0] == "agent":
                if agents:
                    assert agents[-1].stop() == 0, agents[-1].stderr_tail()
                log = tmp_path / f"agent-{i}.log"
                with open(log, "wb") as f:
                    proc = subprocess.Popen(
                        [wdscache_exe(), *args], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                    )
                agent = AgentProc(proc, cache, log, args)
                agents.append(agent)
                agent.wait_up()
                agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 20, f"{line}: the shards cached")
            elif "--watch" in args:
                proc = subprocess.Popen(
                    [wdscache_exe(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
                )
                try:
                    read_frames(proc, 2, 20)
                    proc.send_signal(signal.SIGINT)
                    assert proc.wait(10) == 0, (line, proc.stderr.read())
                finally:
                    stop_process(proc)
            else:
                r = run_cli(*args)
                assert r.returncode == 0, (line, r.stdout, r.stderr)
                if out_file is not None:
                    out_file.write_text(r.stdout)
        assert agents
        # With the last agent shown still running: every metric a page names is exported.
        with_job = _samples_with_a_job(cache, run_cli)
    finally:
        for agent in agents:
            agent.stop()
    named = set(re.findall(r"\b(wdscache_[a-z_]+)", "".join(page.read_text() for page in PAGES)))
    assert named and named <= with_job, sorted(named - with_job)


def _samples_with_a_job(cache: Path, run_cli) -> set[str]:
    import json

    from wdscache.shared.client import AgentConnection
    from wdscache.shared.messages import Requests

    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        assert conn.request(Requests("r").hello("j", 0, 1))["ok"]
        assert conn.request(
            {
                "op": "report",
                "reader": "r",
                "samples": 1,
                "bytes": 1,
                "rate": 1.0,
                "wait_s": 0.0,
                "epoch": 0,
                "position": 1,
            }
        )["ok"]
        text = run_cli("stats", "--cache-dir", cache, "--prometheus").stdout
    finally:
        conn.close()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_commands_exit_statuses_are_in_their_help(run_cli):
    for command in ("agent", "prefetch", "ls", "index", "verify", "evict", "clear", "stats"):
        r = run_cli(command, "--help")
        assert r.returncode == 0 and "Exit status: 0" in r.stdout, (command, r.stdout)
