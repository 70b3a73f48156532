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
from tests.helpers.procs import kill_left
from wdscache import NotTrustedError
from wdscache.shared.client import ShardClient
from wdscache.shared.index import Index, ShardRecord, ShardState
from wdscache.shared.layout import CacheLayout


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


@pytest.mark.slow
def test_a_wrong_token_or_another_caches_endpoint_is_named_in_the_not_trusted_error(tmp_path, dataset, start_agent):
    data = dataset(1, samples=2, payload=100)
    ours, other = tmp_path / "ours", tmp_path / "other"
    start_agent(ours, data.list_file)
    start_agent(other, data.list_file)
    other_endpoint = CacheLayout.of(other).agent_state()["endpoint"]

    # Our cache directory, with the endpoint of the other's agent (WDSCACHE_ENDPOINT set for another job).
    with pytest.raises(NotTrustedError) as info:
        with ShardClient(ours, endpoint=other_endpoint, timeout=10) as client:
            client.open(data.urls[0], timeout=10)
    assert str(info.value) == (
        f"the agent at {other_endpoint} cannot prove it holds the token of {ours}: the endpoint may be that of "
        "another cache directory's agent (WDSCACHE_ENDPOINT, or endpoint=, not the one this directory's "
        "agent.json names), or another user's process may listen there; check the endpoint and who runs the "
        "agent on it"
    )

    # The other's endpoint with our token (WDSCACHE_TOKEN copied from the wrong cache).
    with pytest.raises(NotTrustedError) as info:
        with ShardClient(endpoint=other_endpoint, token=(ours / "token").read_text().strip(), timeout=10) as client:
            client.open(data.urls[0], timeout=10)
    assert str(info.value) == (
        f"the agent at {other_endpoint} cannot prove it holds the token given (WDSCACHE_TOKEN): the token may "
        "be wrong (not the token file of the cache directory that agent serves), the endpoint that of another "
        "cache's agent, or another user's process may listen there; check the token, the endpoint and who "
        "runs the agent on it"
    )


def test_a_json_document_cut_by_its_reader_going_away_exits_as_one_killed_by_sigpipe(tmp_path):
    # One large write into a pipe whose reader leaves midway is taken in part, and Python's stdout
    # counted it done: the document cut, exit 0.
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    index = Index(CacheLayout.of(cache).index_dir)
    try:
        with index._db.transact():
            for i in range(1500):
                index.put(ShardRecord(f"http://127.0.0.1:9/d/shard-{i:06d}.tar", ShardState.CACHED, size=1000))
    finally:
        index.close()
    ls = subprocess.Popen(
        [wdscache_exe(), "ls", "--cache-dir", cache, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert ls.stdout is not None and ls.stdout.read(100).startswith(b"[")
        ls.stdout.close()  # (a reader that took what it wanted: head -c 100)
        _, err = ls.communicate(timeout=30)
    finally:
        kill_left([ls])
    assert (ls.returncode, err) == (141, b"")
