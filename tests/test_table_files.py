"""Sample tables kept on disk: an agent started again reads them instead of walking every
cached shard; a damaged, stale or missing one is walked again; they count in the budget
and go with their shards."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.streaming import reference
from tests.helpers.waits import json_lines, wait_for
from wdscache import CachedMultiLoader
from wdscache.agent.sampletable import TABLE_MAGIC, PackedSamples, read_table_file, table_file
from wdscache.shared.layout import CacheLayout, file_identity
from wdscache.shared.samples import scan


def files_in(root: Path) -> dict[str, int]:
    """Files in ``root``'s folders (as under CACHE/shards and CACHE/tables): name -> size;
    a file removed while they are listed is left out."""
    out = {}
    for folder in root.iterdir() if root.exists() else ():
        for p in folder.iterdir() if folder.is_dir() else ():
            try:
                out[p.name] = p.stat().st_size
            except FileNotFoundError:
                pass
    return out


def table_files(cache: Path) -> dict[str, int]:
    return files_in(CacheLayout.of(cache).tables_dir)


def disk_bytes(cache: Path) -> int:
    """Bytes of the cache's shard files and table files on disk."""
    return sum(files_in(CacheLayout.of(cache).shards_dir).values()) + sum(table_files(cache).values())


def digest(x: dict) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in x.items() if not k.startswith("__")}


def read_all(cache: Path) -> dict:
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        return {(x["__url__"], x["__key__"]): digest(x) for x in loader}


def identity_of(layout: CacheLayout, url: str) -> tuple[int, ...]:
    return file_identity(os.stat(layout.shard_path(url)))


def test_a_table_file_is_read_back_only_whole_and_for_its_file(tmp_path: Path) -> None:
    from scripts.shard_maker import make_shard, synth_samples

    shard = tmp_path / "s.tar"
    make_shard(shard, synth_samples(0, 30, payload=300))
    packed = PackedSamples(scan(shard.read_bytes(), url="s"))
    identity = file_identity(os.stat(shard))
    layouts, frames = packed.parts()
    data = table_file(identity, layouts, frames)
    path = tmp_path / "table"
    path.write_bytes(data)
    assert read_table_file(path, identity) == packed
    assert read_table_file(tmp_path / "none", identity) is None
    # Written for another copy of the shard (another inode, size or mtime): not this file's.
    assert read_table_file(path, (*identity[:3], identity[3] + 1)) is None
    for bad, why in (
        (data[:-1], "cut short"),
        (data + b"x", "too long"),
        (data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "digest does not match"),
        (b"x" + data[1:], "not a sample table file"),
        (data[: len(TABLE_MAGIC) + 3], "not a sample table file"),
        (b"", "not a sample table file"),  # (what a power loss may leave: table files are not fsynced)
    ):
        path.write_bytes(bad)
        with pytest.raises(ValueError, match=why):
            read_table_file(path, identity)
    # A table whose digest matches but whose payloads lie outside the file is refused too.
    numbers = bytearray(frames[4])
    numbers[:8] = (identity[2] + 1).to_bytes(8, "little", signed=True)
    path.write_bytes(table_file(identity, layouts, [*frames[:4], bytes(numbers)]))
    with pytest.raises(ValueError, match="outside the file"):
        read_table_file(path, identity)


@pytest.mark.slow
def test_a_restarted_agent_reads_the_tables_it_kept_and_walks_only_those_not_whole(
    tmp_path, shard_server, dataset, start_agent
):
    """Each shard's table is kept beside it as it is walked; an agent started again takes
    them (no walk) and walks again only a shard whose table file is damaged or of another
    copy of the file, whose table it then keeps in place of the old. Every byte served is
    webdataset's."""
    data = dataset(6, samples=20, payload=2000)
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    args = ("--no-shuffle", "--prefetch", "6", "--workers", "2")
    first = start_agent(cache, data.list_file, *args)
    first.wait_stats(lambda s: s["shards"]["cached"] == 6, 20, "the 6 shards cached")
    wait_for(lambda: len(table_files(cache)) == 6, 20, lambda: f"6 table files kept: {table_files(cache)}")
    first.wait_stats(lambda s: s["bytes_used"] == disk_bytes(cache), 20, "shards and tables counted")
    assert first.stop() == 0, first.stderr_tail()
    for url in data.urls:
        assert read_table_file(layout.table_path(url), identity_of(layout, url)) is not None

    damaged, moved = data.urls[1], data.urls[4]
    path = layout.table_path(damaged)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # a payload's size in the table, under the digest
    path.write_bytes(bytes(raw))
    st = os.stat(layout.shard_path(moved))
    os.utime(layout.shard_path(moved), ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the same bytes, another file

    again = start_agent(cache, data.list_file, *args, "--log-format", "json")
    s = again.wait_stats(
        lambda s: (
            sum(w.get("loaded", 0) for w in s["agent"]["workers"]) == 4
            and sum(w.get("walked", 0) for w in s["agent"]["workers"]) == 2
        ),
        20,
        "the 4 whole tables read, the 2 others walked",
    )
    assert all(w["requests"] == 0 for w in s["agent"]["workers"]), s["agent"]["workers"]
    # Every line of the log one JSON record, the sample workers' too (their stderr is the agent's).
    records = json_lines(again.stderr_text())
    damaged_table = [r for r in records if r["message"].startswith("worker") and "sample table kept" in r["message"]]
    assert damaged_table and "digest does not match" in damaged_table[0]["message"], again.stderr_tail()
    assert damaged_table[0]["level"] == "WARNING" and damaged_table[0]["logger"] == "wdscache.agent.open_shards"
    assert read_all(cache) == reference(data.paths, data.urls)
    s = again.wait_stats(
        lambda s: all(w.get("requests") for w in s["agent"]["workers"]), 20, "the reads counted by both workers"
    )
    assert sum(w["walked"] for w in s["agent"]["workers"]) == 2, s["agent"]["workers"]  # reads walked nothing
    for url in (damaged, moved):  # kept again, for the file as it is now
        wait_for(
            lambda url=url: read_table_file(layout.table_path(url), identity_of(layout, url)) is not None,
            20,
            lambda url=url: f"the table of {url} not kept again",
        )
    again.wait_stats(lambda s: s["bytes_used"] == disk_bytes(cache), 20, "shards and tables counted")
    assert again.running(), again.stderr_tail()


def test_table_files_count_in_the_budget_and_go_with_their_shards(tmp_path, shard_server, dataset, start_agent):
    """Under a budget that evicts, shards and table files on disk never exceed it (a download
    removes tables before it evicts a shard), and no table outlives its shard."""
    data = dataset(8, samples=20, payload=2500)
    size = max(p.stat().st_size for p in data.paths)
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    budget = 4 * size + (32 << 10)  # room for shards' tables: a table never evicts a shard
    args = ("--no-shuffle", "--prefetch", "2", "--workers", "2", "--cache-size", str(budget), "--min-free", "0")
    agent = start_agent(cache, data.list_file, *args)
    seen: list[int] = []
    tables_kept = 0
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        got = {}
        for x in loader:
            got[(x["__url__"], x["__key__"])] = digest(x)
            seen.append(disk_bytes(cache))
            tables_kept = max(tables_kept, len(table_files(cache)))
    assert got == reference(data.paths, data.urls)
    assert max(seen) <= budget, f"{max(seen)} bytes on disk, over the budget of {budget}"
    assert tables_kept, "no table file was kept"
    s = agent.wait_stats(lambda s: s["bytes_used"] == disk_bytes(cache), 20, "shards and tables counted")
    assert s["bytes_used"] <= budget, s
    # (Prefetches for the next epoch may have made room by removing every table by now.)
    cached = {layout.shard_path(u).name for u in data.urls if layout.shard_path(u).exists()}
    assert set(table_files(cache)) <= cached, (table_files(cache), cached)


@pytest.mark.slow
def test_a_start_removes_table_files_no_record_counts(tmp_path, shard_server, dataset, start_agent):
    """At the next start a table left without its shard, a temp file of a write cut short, and
    a record counting a table file that is gone are made right."""
    data = dataset(4, samples=20, payload=2500)
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    args = ("--no-shuffle", "--prefetch", "3", "--workers", "2")
    agent = start_agent(cache, data.list_file, *args)
    wait_for(lambda: len(table_files(cache)) == 3, 20, lambda: f"3 table files kept: {table_files(cache)}")
    assert agent.stop() == 0, agent.stderr_tail()
    orphan = layout.table_path(data.urls[3])  # its shard was never cached
    orphan.parent.mkdir(exist_ok=True)
    shutil.copy(layout.table_path(data.urls[0]), orphan)
    temp = orphan.with_name(f".{orphan.name}.123.tmp")
    temp.write_bytes(b"half")
    layout.table_path(data.urls[1]).unlink()
    again = start_agent(cache, data.list_file, *args)
    again.wait_stats(lambda s: s["bytes_used"] == disk_bytes(cache), 20, "shards and tables counted")
    assert not orphan.exists() and not temp.exists()
    assert "tables_removed 2" in again.stderr_text(), again.stderr_tail()


def test_a_table_that_cannot_be_written_is_not_counted_and_the_shard_serves(
    tmp_path, shard_server, dataset, start_agent
):
    data = dataset(4, samples=20, payload=2000)
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    list_file = tmp_path / "urls.txt"
    list_file.write_text("".join(f"{u}\n" for u in data.urls[:2]))
    agent = start_agent(cache, list_file, "--no-shuffle", "--workers", "2")
    wait_for(lambda: len(table_files(cache)) == 2, 20, lambda: f"2 table files kept: {table_files(cache)}")
    # A file where the folder of a shard's table would be: its write fails.
    blocked = next(u for u in data.urls[2:] if not layout.table_path(u).parent.exists())
    layout.table_path(blocked).parent.write_bytes(b"")
    list_file.write_text("".join(f"{u}\n" for u in data.urls))
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 20, "the 4 shards cached")
    wait_for(lambda: "the sample table of" in agent.stderr_text(), 20, lambda: agent.stderr_tail())
    wait_for(lambda: len(table_files(cache)) == 3, 20, lambda: f"3 table files kept: {table_files(cache)}")
    assert not layout.table_path(blocked).exists()
    assert read_all(cache) == reference(data.paths, data.urls)
    s = agent.wait_stats(lambda s: s["bytes_used"] == disk_bytes(cache), 20, "shards and kept tables counted")
    assert s["shards"]["cached"] == 4 and agent.running(), agent.stderr_tail()


def test_the_tables_of_shards_read_while_they_download_are_kept_too(tmp_path, shard_server, dataset, start_agent):
    """A worker reading a download may see its file published, and report its table, before
    the agent's main loop has heard the download ended: the table is kept all the same."""
    data = dataset(6, samples=40, payload=2000)
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    shard_server.rate = 400_000  # about 0.2 s a shard: each is read while it downloads
    agent = start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "1", "--workers", "2")
    assert read_all(cache) == reference(data.paths, data.urls)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 6, 20, "the 6 shards cached")
    wait_for(
        lambda: all(read_table_file(layout.table_path(u), identity_of(layout, u)) for u in data.urls),
        20,
        lambda: f"the tables of {[u for u in data.urls if not layout.table_path(u).exists()]} not kept",
    )
    agent.wait_stats(lambda s: s["bytes_used"] == disk_bytes(cache), 20, "shards and tables counted")
