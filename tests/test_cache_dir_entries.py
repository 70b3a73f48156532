"""Entries where the cache keeps its own files that are none (a directory, a link, a named pipe;
an operator's mistake, a restore gone wrong): the agent starts anyway, moves each aside under
``aside/`` (kept as found, never followed or opened) with a warning naming it, and downloads
its shard again, whose bytes it then serves.

Real agents through the CLI and the real shard server; the damage is made on disk between two
runs, as an operator would.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.helpers.agents import AgentProc, Dataset
from wdscache import ShardClient
from wdscache.shared.index import Index, ShardRecord, ShardState
from wdscache.shared.layout import CacheLayout

ARGS = ("--prefetch", "6", "--cache-size", "10M")


def cached_run(start_agent, ds: Dataset, cache: Path) -> None:
    """Run an agent on ``cache`` until every shard of ``ds`` is cached, then stop it."""
    agent = start_agent(cache, ds.list_file, *ARGS)
    agent.wait_stats(lambda s: s["shards"]["cached"] == len(ds.urls), 30, "every shard cached")
    assert agent.stop() == 0, agent.stderr_tail()


def record(layout: CacheLayout, url: str, state: ShardState) -> None:
    index = Index(layout.index_dir)
    try:
        index.put(ShardRecord(url, state, etag='"v1"'))
    finally:
        index.close()


def moved_aside(agent: AgentProc, layout: CacheLayout, path: Path, kind: str) -> Path:
    """Where the agent says it moved ``path``, a ``kind`` (its warning names both)."""
    rel = path.relative_to(layout.root)
    said = [line for line in agent.stderr_text().splitlines() if f"found {kind} at {rel}," in line]
    assert len(said) == 1 and "WARNING" in said[0], agent.stderr_tail()
    aside = Path(said[0].split(": moved it to ", 1)[1].split(" (", 1)[0])
    assert aside.relative_to(layout.root / "aside").parts[1:] == rel.parts, aside
    return aside


def served_bytes(cache: Path, ds: Dataset) -> list[bytes]:
    with ShardClient(cache, timeout=30) as client:
        return [client.open(url, timeout=30).read_bytes() for url in ds.urls]


@pytest.mark.slow
def test_a_directory_a_link_a_pipe_where_the_cache_keeps_its_files_are_moved_aside_and_the_shards_served_again(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(6, samples=4, payload=1000)
    cache = tmp_path / "cache"
    cached_run(start_agent, ds, cache)
    layout = CacheLayout.of(cache)
    paths = [layout.shard_path(url) for url in ds.urls]
    # The fan folder made a file is one no other shard's file is in (names are hashes of URLs).
    alone = next(i for i, p in enumerate(paths) if [q.parent for q in paths].count(p.parent) == 1)
    order = [alone] + [i for i in range(6) if i != alone]
    folder_file, dir_cached, loop, pipe, partial_dir, dir_unknown = order
    planted: list[tuple[Path, str]] = []  # (where, what the warning calls it)

    # A file where a fan folder of shards/ belongs (stat of the shard's path: not a directory).
    shutil.rmtree(paths[folder_file].parent)
    paths[folder_file].parent.write_bytes(b"an operator's notes")
    planted.append((paths[folder_file].parent, "a file"))
    # A directory, holding a file, where a cached shard's file belongs (unlink: is a directory).
    paths[dir_cached].unlink()
    paths[dir_cached].mkdir()
    (paths[dir_cached] / "restored.tar").write_bytes(b"not ours")
    planted.append((paths[dir_cached], "a directory"))
    # A link to itself (stat: too many levels of symbolic links).
    paths[loop].unlink()
    paths[loop].symlink_to(paths[loop].name)
    planted.append((paths[loop], "a symbolic link"))
    # A named pipe where a download's file belongs, its record of unknown size: opened to see
    # whether it was renamed into place, it blocked the start for good.
    paths[pipe].unlink()
    os.mkfifo(paths[pipe], 0o600)
    record(layout, ds.urls[pipe], ShardState.DOWNLOADING)
    planted.append((paths[pipe], "a named pipe"))
    # A directory where a resumable download's partial file belongs (unlink: is a directory).
    paths[partial_dir].unlink()
    record(layout, ds.urls[partial_dir], ShardState.DOWNLOADING)
    layout.partial_path(ds.urls[partial_dir]).mkdir()
    planted.append((layout.partial_path(ds.urls[partial_dir]), "a directory"))
    # A directory where a shard's file belongs that the index does not know: in the way of its download.
    index = Index(layout.index_dir)
    try:
        index.delete(ds.urls[dir_unknown])
    finally:
        index.close()
    paths[dir_unknown].unlink()
    paths[dir_unknown].mkdir()
    planted.append((paths[dir_unknown], "a directory"))

    shard_server.reset_log()
    again = start_agent(cache, ds.list_file, *ARGS)  # (fails the test if it exits before it answers)
    assert served_bytes(cache, ds) == [p.read_bytes() for p in ds.paths]
    fetched = {r.path for r in shard_server.requests if r.method == "GET"}
    assert fetched == {ds.paths[i].name for i in order}, shard_server.requests
    asides = [moved_aside(again, layout, path, kind) for path, kind in planted]
    assert again.stop() == 0, again.stderr_tail()
    assert "Traceback" not in again.stderr_text(), again.stderr_tail()

    # Each is kept as it was found: nothing in it read, deleted or followed.
    assert asides[0].read_bytes() == b"an operator's notes"
    assert (asides[1] / "restored.tar").read_bytes() == b"not ours"
    assert os.readlink(asides[2]) == paths[loop].name
    assert stat.S_ISFIFO(os.lstat(asides[3]).st_mode)
    assert asides[4].is_dir() and asides[5].is_dir()
    # In place of each, the shard's own file (and no partial left in the way).
    assert all(p.is_file() and not p.is_symlink() for p in paths)
    assert not os.path.lexists(layout.partial_path(ds.urls[partial_dir]))


@pytest.mark.slow
def test_a_directory_and_a_pipe_where_shards_of_a_lost_index_would_be_adopted_are_moved_aside(
    shard_server, dataset, start_agent, tmp_path
):
    # With the index gone every shard file the list names is adopted as found: its head was opened
    # to check it is a tar (a directory: IsADirectoryError; a pipe: blocked for good).
    ds = dataset(3, samples=4, payload=1000)
    cache = tmp_path / "cache"
    cached_run(start_agent, ds, cache)
    layout = CacheLayout.of(cache)
    shutil.rmtree(layout.index_dir)
    paths = [layout.shard_path(url) for url in ds.urls]
    paths[0].unlink()
    paths[0].mkdir()
    paths[1].unlink()
    os.mkfifo(paths[1], 0o600)

    shard_server.reset_log()
    again = start_agent(cache, ds.list_file, *ARGS)
    assert served_bytes(cache, ds) == [p.read_bytes() for p in ds.paths]
    # (the adopted copy too, maybe: its bytes are proved by an MD5 this server's ETag is not)
    assert {r.path for r in shard_server.requests if r.method == "GET"} >= {ds.paths[0].name, ds.paths[1].name}
    assert moved_aside(again, layout, paths[0], "a directory").is_dir()
    assert stat.S_ISFIFO(os.lstat(moved_aside(again, layout, paths[1], "a named pipe")).st_mode)
    assert again.stop() == 0, again.stderr_tail()


def test_clear_on_an_unreadable_index_removes_the_shard_files_and_moves_aside_what_else_lies_there(
    shard_server, dataset, start_agent, run_cli, tmp_path
):
    ds = dataset(3, samples=2, payload=1000)
    cache = tmp_path / "cache"
    cached_run(start_agent, ds, cache)
    layout = CacheLayout.of(cache)
    paths = [layout.shard_path(url) for url in ds.urls]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"outside the cache")
    planted = {
        paths[0].parent / "restored": "a directory",  # holding an operator's file
        paths[1].parent / "link-to-a-file": "a symbolic link",
        paths[1].parent / "link-to-a-folder": "a symbolic link",
        layout.shards_dir / fan_free(paths): "a file",  # where a fan folder belongs
    }
    (paths[0].parent / "restored").mkdir()
    (paths[0].parent / "restored" / "mine.txt").write_bytes(b"an operator's file")
    (paths[1].parent / "link-to-a-file").symlink_to(outside / "keep.txt")
    (paths[1].parent / "link-to-a-folder").symlink_to(outside)
    (layout.shards_dir / fan_free(paths)).write_bytes(b"an operator's notes")
    backup = layout.shards_dir / "my-backup"  # named as no folder of the cache's: left as it is
    backup.mkdir()
    (backup / "precious.tar").write_bytes(b"an operator's backup")
    layout.index_db.write_bytes(b"not a database")

    r = run_cli("clear", "--cache-dir", cache)

    assert r.returncode == 0, r.stderr
    assert f"evicted {len(ds.urls)} shard(s)" in r.stdout, r.stdout
    assert not any(p.exists() for p in paths)
    assert (outside / "keep.txt").read_bytes() == b"outside the cache"  # never followed
    for path, kind in planted.items():
        rel = path.relative_to(layout.root)
        said = [line for line in r.stderr.splitlines() if f"found {kind} at {rel}," in line]
        assert len(said) == 1, r.stderr
        aside = Path(said[0].split(": moved it to ", 1)[1].split(" (", 1)[0])
        assert aside.relative_to(layout.root / "aside").parts[1:] == rel.parts and not path.exists()
    aside_dir = next((layout.root / "aside").iterdir())
    restored = aside_dir / (paths[0].parent / "restored" / "mine.txt").relative_to(layout.root)
    assert restored.read_bytes() == b"an operator's file"
    assert (backup / "precious.tar").read_bytes() == b"an operator's backup" and "my-backup" not in r.stderr


def fan_free(paths: list[Path]) -> str:
    """A fan folder's name that none of ``paths`` lies in."""
    taken = {p.parent.name for p in paths}
    return next(name for name in (f"{i:02x}" for i in range(256)) if name not in taken)
