"""Shard files adopted into a rebuilt index (the index deleted or damaged): served only once their
bytes are proved the shard's, and then never downloaded again.

Real agents (the CLI), a real HTTP shard server on 127.0.0.1 counting its requests, real consumers;
what they are served is compared with webdataset's reading of the source files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.streaming import assert_epoch_exact, reference
from tests.helpers.versions import another_version, replace
from wdscache import ShardClient
from wdscache.shared.layout import CacheLayout

ARGS = ("--prefetch", "4", "--cache-size", "10M")
CACHED_IN = 20.0
KEPT = "the cached copy has the MD5 its shard index gives; kept without downloading it"


def _lose_index(cache: Path, how: str) -> None:
    """What a crash or an operator may do to the index: delete it, or leave it unreadable."""
    index = CacheLayout.of(cache).index_dir
    if how == "deleted":
        shutil.rmtree(index)
    else:
        (index / "cache.db").write_bytes(b"this is not an SQLite database \x00\xff" * 512)


def _cached_then_index_lost(shard_server, start_agent, cache: Path, listed: Path, n: int, how: str) -> None:
    """An agent on ``listed`` caches its ``n`` shards and stops; the index is lost; the server's log cleared."""
    first = start_agent(cache, listed, *ARGS)
    first.wait_stats(lambda s: s["shards"]["cached"] == n, CACHED_IN, "the shards were not cached")
    assert first.stop() == 0, first.stderr_tail()
    _lose_index(cache, how)
    shard_server.reset_log()


def _index(run_cli, urls: list[str], out: Path) -> Path:
    r = run_cli("index", *urls, "-o", out)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "corrupt"])
def test_adopted_copies_with_their_shard_indexs_md5_are_never_downloaded_again(
    shard_server, dataset, start_agent, consumers, run_cli, tmp_path, how
):
    ds = dataset(4, samples=10, payload=2000)
    listed = _index(run_cli, ds.urls, tmp_path / "lists" / "index.json")
    cache = tmp_path / "cache"
    _cached_then_index_lost(shard_server, start_agent, cache, listed, 4, how)

    second = start_agent(cache, listed, *ARGS)
    lines = consumers(cache, "reader", "--job", "adopted").wait()
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))
    log = second.stderr_text()
    assert "adopted 4" in log, second.stderr_tail()
    # Each copy checked once against its index's MD5 (a HEAD for its size), none fetched.
    assert [shard_server.count(p.name) for p in ds.paths] == [0] * 4, second.stderr_tail()
    assert [shard_server.count(p.name, "HEAD") for p in ds.paths] == [1] * 4
    assert log.count(KEPT) == 4 and "cannot tell whether" not in log, second.stderr_tail()
    s = second.stats()
    assert s["shards"]["cached"] == 4 and s["downloads"] == 0 and s["changed"] == 0, s
    assert second.stop() == 0

    # The next run finds the copies current by the validators kept then: no hash, no download.
    third = start_agent(cache, listed, *ARGS)
    lines = consumers(cache, "reader", "--job", "again").wait()
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))
    assert [shard_server.count(p.name) for p in ds.paths] == [0] * 4, third.stderr_tail()
    assert KEPT not in third.stderr_text() and "recovered the cache: adopted" not in third.stderr_text()


@pytest.mark.slow
@pytest.mark.parametrize("listing", ["shard index", "plain list"])
def test_an_adopted_copy_whose_source_changed_at_the_same_size_is_downloaded_again(
    shard_server, dataset, start_agent, consumers, run_cli, tmp_path, listing
):
    """The source of shard 1 holds other bytes of the same size once the index is lost: its adopted
    copy is never served. With a shard index (written anew), its MD5 tells it, and only it is
    downloaded; with a plain list nothing proves any copy, and all are downloaded again."""
    ds = dataset(4, samples=10, payload=2000)
    index = tmp_path / "lists" / "index.json"
    listed = _index(run_cli, ds.urls, index) if listing == "shard index" else ds.list_file
    cache = tmp_path / "cache"
    _cached_then_index_lost(shard_server, start_agent, cache, listed, 4, "deleted")
    old = ds.paths[1].read_bytes()
    replace(ds.paths[1], another_version(old))
    assert ds.paths[1].stat().st_size == len(old)
    if listing == "shard index":
        _index(run_cli, ds.urls, index)  # (run_cli's own GETs, before the log is cleared)
    shard_server.reset_log()

    agent = start_agent(cache, listed, *ARGS)
    with ShardClient(cache, timeout=CACHED_IN) as client:
        for url, path in zip(ds.urls, ds.paths):
            assert client.open(url).read_bytes() == path.read_bytes(), agent.stderr_tail()
            client.release(url)
    gets = [shard_server.count(p.name) for p in ds.paths]
    log = agent.stderr_text()
    if listing == "shard index":
        assert gets == [0, 1, 0, 0], agent.stderr_tail()
        assert log.count(KEPT) == 3, agent.stderr_tail()
        assert f"{ds.urls[1]} has MD5 " in log and "but the shard index says" in log, agent.stderr_tail()
    else:
        assert gets == [1, 1, 1, 1], agent.stderr_tail()
        for url in ds.urls:
            assert f"cannot tell whether {url} changed on the server: its copy was cached with no validator" in log
    # What a consumer reads of it is the new version, as webdataset reads it from the source.
    lines = consumers(cache, "reader", "--job", "changed").wait()
    assert_epoch_exact(lines, reference(ds.paths, ds.urls))


@pytest.mark.slow
def test_a_copy_kept_by_a_stale_indexs_md5_is_downloaded_again_once_no_index_vouches_for_it(
    shard_server, dataset, start_agent, run_cli, tmp_path
):
    """A shard index older than the source (which now holds other bytes of the same size) keeps the
    adopted copy with the index's bytes, as documented; that proves the copy the index's shard, not
    the source's object: once the list is a plain one, the copy is the source's no longer and the
    source's bytes are downloaded (the record took the source's validators then, and served the
    old bytes as current for good)."""
    ds = dataset(2, samples=5, payload=2000)
    index = _index(run_cli, ds.urls, tmp_path / "lists" / "index.json")
    cache = tmp_path / "cache"
    _cached_then_index_lost(shard_server, start_agent, cache, index, 2, "deleted")
    old = ds.paths[1].read_bytes()
    replace(ds.paths[1], another_version(old))  # the index (now stale) still gives the old bytes' MD5

    stale = start_agent(cache, index, *ARGS)
    with ShardClient(cache, timeout=CACHED_IN) as client:
        assert client.open(ds.urls[1]).read_bytes() == old, stale.stderr_tail()
        client.release(ds.urls[1])
    assert stale.stderr_text().count(KEPT) == 2, stale.stderr_tail()
    assert stale.stop() == 0

    index.write_text("\n".join(ds.urls) + "\n")  # the same file, now a plain list
    shard_server.reset_log()
    plain = start_agent(cache, index, *ARGS)
    with ShardClient(cache, timeout=CACHED_IN) as client:
        for url, path in zip(ds.urls, ds.paths):
            assert client.open(url).read_bytes() == path.read_bytes(), plain.stderr_tail()
            client.release(url)
    assert [shard_server.count(p.name) for p in ds.paths] == [1, 1], plain.stderr_tail()
    assert plain.stop() == 0
