"""What an operator is told for small mistakes: a cache directory given as a symbolic link, a
command's output piped into ``head``, a token or endpoint of another cache.

Real agents, the real ``wdscache`` command and real clients; a broken pipe is a real pipe whose
reading end is closed before the command writes.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from scripts.console import wdscache_exe


def test_a_cache_directory_given_as_a_symbolic_link_is_refused_naming_its_target(tmp_path, dataset, run_cli):
    data = dataset(1, samples=2, payload=100)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    r = run_cli("agent", "--cache-dir", link, "--urls", data.list_file, "--min-free", "1M")
    assert (r.returncode, r.stderr) == (
        2,
        f"wdscache: error: cache directory {link} is a symbolic link to {real}, not a directory: give the "
        f"directory itself (--cache-dir {real})\n",
    )
    assert os.listdir(real) == []


def _into_a_closed_pipe(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """The command run with its standard output a pipe nobody reads any more (as ``| head -1``
    once head has exited): its first write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [wdscache_exe(), *map(os.fspath, args)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.slow
def test_a_command_whose_output_is_no_longer_read_stops_quietly_as_one_killed_by_sigpipe(
    tmp_path, dataset, start_agent
):
    data = dataset(2, samples=3, payload=200)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    assert agent.stop() == 0
    for args in (
        ["ls"],
        ["ls", "--json"],
        ["stats"],
        ["stats", "--json"],
        ["verify"],
        ["verify", "--json"],
    ):
        r = _into_a_closed_pipe(*args, "--cache-dir", cache)
        assert (r.returncode, r.stderr) == (141, ""), args
