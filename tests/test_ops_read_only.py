"""A cache directory on a file system mounted read-only: what reads it works, what would change it
says so in one line.

A real tmpfs, filled by a real agent and then remounted read-only; every command runs as the
``wdscache`` process a user runs.
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from wdscache.shared.layout import CacheLayout

READ_ONLY = "is read-only (its file system is mounted read-only)"


def _remount_read_only(mnt) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_a_read_only_cache_is_read_by_ls_stats_verify_and_refused_by_the_rest(
    tmp_path, tmpfs, dataset, start_agent, run_cli
):
    data = dataset(2, samples=4, payload=300)
    fs = tmpfs("16m")
    cache, empty = fs / "cache", fs / "empty"
    empty.mkdir()
    agent = start_agent(cache, data.list_file, "--cache-size", "4M", "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    assert agent.stop() == 0
    damaged = CacheLayout.of(cache).shard_path(data.urls[1])
    with open(damaged, "r+b") as f:
        f.write(b"\x7f" * 512)
    _remount_read_only(fs)

    r = run_cli("ls", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    assert {s["url"]: s["state"] for s in json.loads(r.stdout)} == {u: "cached" for u in data.urls}
    r = run_cli("stats", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert (stats["shards"]["cached"], stats["bytes_used"] - stats["table_bytes"], stats["agent"]) == (
        2,
        sum(p.stat().st_size for p in data.paths),
        None,
    )
    # verify checks, and lists the bad shard it cannot evict.
    r = run_cli("verify", "--cache-dir", cache)
    lines = r.stdout.splitlines()
    assert (r.returncode, lines[0]) == (1, "checked 2 shard(s): 1 bad, 0 evicted"), r.stderr
    assert lines[1].startswith(f"  bad {data.urls[1]}: not a valid tar") and lines[1].endswith(
        f"(not evicted: the cache directory {READ_ONLY})"
    ), lines
    assert damaged.exists()

    # What would change the cache: one line naming it, no traceback.
    for command, args, who in (
        ("evict", [data.urls[0]], "'wdscache evict'"),
        ("clear", [], "'wdscache clear'"),
        ("prefetch", [data.urls[0]], "'wdscache prefetch'"),
    ):
        r = run_cli(command, *args, "--cache-dir", cache)
        assert (r.returncode, r.stderr) == (
            2,
            f"wdscache: error: cache directory {cache} {READ_ONLY}: {who} needs "
            "to write to it; make it writable or use another --cache-dir\n",
        ), command
    r = run_cli("agent", "--cache-dir", cache, "--urls", data.list_file, "--min-free", "1M")
    assert (r.returncode, r.stderr) == (
        2,
        f"wdscache: error: cache directory {cache} {READ_ONLY}: the agent needs "
        "to write to it; make it writable or use another --cache-dir\n",
    )

    # An empty directory there: no cache, and none can be made; it stays empty.
    no_cache = (
        f"wdscache: error: {empty} holds no wdscache cache, and it {READ_ONLY}: no agent can make one "
        "there; use a writable --cache-dir\n"
    )
    for command, args in (("ls", []), ("stats", []), ("verify", []), ("evict", [data.urls[0]]), ("clear", [])):
        r = run_cli(command, *args, "--cache-dir", empty)
        assert (r.returncode, r.stderr) == (1, no_cache), command
    r = run_cli("prefetch", data.urls[0], "--cache-dir", empty)
    assert (r.returncode, r.stderr) == (
        2,
        f"wdscache: error: cache directory {empty} {READ_ONLY}: 'wdscache "
        "prefetch' needs to write to it; make it writable or use another "
        "--cache-dir\n",
    )
    r = run_cli("agent", "--cache-dir", fs / "new", "--urls", data.list_file)
    assert (r.returncode, r.stderr) == (
        2,
        f"wdscache: error: cannot make cache directory {fs / 'new'}: Read-only file system; use a writable directory\n",
    )
    assert sorted(p.name for p in fs.iterdir()) == ["cache", "empty"] and list(empty.iterdir()) == []


@pytest.mark.slow
def test_a_read_only_cache_an_agent_was_killed_on_is_read_with_its_log(tmpfs, dataset, start_agent, run_cli):
    data = dataset(2, samples=4, payload=300)
    fs = tmpfs("16m")
    cache = fs / "cache"
    agent = start_agent(cache, data.list_file, "--cache-size", "4M", "--prefetch", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "both shards cached")
    agent.stop(signal.SIGKILL)
    assert (cache / "index" / "cache.db-wal").exists()  # what it wrote last is in SQLite's log only
    _remount_read_only(fs)
    r = run_cli("ls", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    assert {s["url"]: s["state"] for s in json.loads(r.stdout)} == {u: "cached" for u in data.urls}
    r = run_cli("verify", "--cache-dir", cache)
    assert (r.returncode, r.stdout) == (0, "checked 2 shard(s): 0 bad, 0 evicted\n"), r.stderr
