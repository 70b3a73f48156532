"""Cached copies stay true to their source: revalidated after a restart, fetched again when damaged."""

from __future__ import annotations

import hashlib
import json
import logging
import re

import pytest
import webdataset as wds

from scripts.shard_maker import make_shard, synth_samples
from tests.helpers.streaming import reference
from tests.helpers.versions import another_version, replace
from wdscache import CachedMultiLoader, FetchError, ShardClient, ShardError
from wdscache.shared.layout import CacheLayout
from wdscache.shared.tarwalk import members


def restarted_after_a_change(tmp_path, shard_server, data, start_agent, changed: int) -> tuple:
    """(cache, agent): an agent that cached ``data`` and stopped, the server's copy of shard
    ``changed`` changed since (new content, new size, new ETag), the server's log cleared,
    and a new agent on the cache (its start-up window: every shard)."""
    cache = tmp_path / "cache"
    args = ("--prefetch", str(len(data.urls)), "--no-shuffle")
    agent = start_agent(cache, data.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["cached"] == len(data.urls), 20, "shards never cached")
    assert agent.stop() == 0
    make_shard(data.paths[changed], synth_samples(changed, 5 + changed, payload=1500, seed=99))
    shard_server.reset_log()
    return cache, start_agent(cache, data.list_file, *args)


@pytest.mark.slow
def test_changed_shard_is_fetched_again_unchanged_one_is_not(tmp_path, shard_server, dataset, start_agent):
    data = dataset(2, samples=3, payload=1000)
    cache, agent = restarted_after_a_change(tmp_path, shard_server, data, start_agent, 1)
    with ShardClient(cache, timeout=20) as client:
        for url, path in zip(data.urls, data.paths):
            assert client.open(url).read_bytes() == path.read_bytes()
            client.release(url)
        stats = client.stats()
    assert stats["changed"] == 1
    assert [c["url"] for c in stats["agent"]["changed"]] == [data.urls[1]]
    assert shard_server.count(data.paths[0].name) == 0  # unchanged: checked by HEAD, not fetched
    assert shard_server.count(data.paths[1].name) == 1
    assert "changed on the server" in agent.stderr_text()


@pytest.mark.slow
def test_a_restarted_agent_asks_about_the_shards_readers_want_next_before_any_open(
    tmp_path, shard_server, dataset, start_agent
):
    """The start-up window's shards cached by an earlier run are revalidated before anyone
    opens them (one changed on the server is fetched again then), so a loader's first
    opens wait for no source: its epoch sends no request to the server."""
    data = dataset(6, samples=5, payload=1000)
    cache, agent = restarted_after_a_change(tmp_path, shard_server, data, start_agent, 5)
    s = agent.wait_stats(
        lambda s: s["changed"] == 1 and s["shards"]["cached"] == 6 and s["redownloads"] == 1,
        20,
        "the start-up window revalidated and the changed shard fetched again, with no reader",
    )
    assert [shard_server.count(p.name, "HEAD") for p in data.paths] == [1] * 6, shard_server.requests
    assert [shard_server.count(p.name) for p in data.paths] == [0] * 5 + [1], shard_server.requests
    shard_server.reset_log()
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20) as loader:
        got = {(x["__url__"], x["__key__"]): {k: v for k, v in x.items() if not k.startswith("__")} for x in loader}
    assert shard_server.requests == []
    assert got == {
        (url, x["__key__"]): {k: v for k, v in x.items() if not k.startswith("__")}
        for path, url in zip(data.paths, data.urls)
        for x in wds.WebDataset(str(path), shardshuffle=False)
    }
    assert s["agent"]["changed"][0]["url"] == data.urls[5]


@pytest.mark.slow
def test_revalidating_at_start_up_is_not_a_read(tmp_path, shard_server, dataset, start_agent, run_cli):
    """Restarts revalidate every cached shard, yet count no read: a shard nobody read shows no
    reads and no last-read time, and one read before keeps its count and time (eviction's order)."""
    data = dataset(3, samples=3, payload=500)
    cache = tmp_path / "cache"
    args = ("--prefetch", "3", "--no-shuffle")
    agent = start_agent(cache, data.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "shards never cached")
    with ShardClient(cache, timeout=20) as client:
        client.open(data.urls[0])
        client.release(data.urls[0])
    assert agent.stop() == 0
    before = _reads(run_cli, cache)
    assert [(before[u][0], before[u][1] is None) for u in data.urls] == [(1, False), (0, True), (0, True)]
    for restart in (1, 2):
        shard_server.reset_log()
        agent = start_agent(cache, data.list_file, *args)
        # Each HEAD is sent once its shard is held for it (which the old code counted as a read).
        agent.wait_stats(
            lambda _: all(shard_server.count(p.name, "HEAD") == 1 for p in data.paths),
            20,
            f"restart {restart}: every shard revalidated",
        )
        assert _reads(run_cli, cache) == before, restart  # the running agent writes its read times for ls
        assert agent.stop() == 0
    assert _reads(run_cli, cache) == before


def _reads(run_cli, cache) -> dict[str, tuple[int, str | None]]:
    """``wdscache ls``: each shard's (reads, last read)."""
    r = run_cli("ls", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    return {s["url"]: (s["reads"], s["last_read"]) for s in json.loads(r.stdout)}


# What the test server sends: its ETag and Last-Modified, one of them, or the other.
SENDS = {
    "both": {"etags": True, "last_modified": True},
    "etag": {"etags": True, "last_modified": False},
    "date": {"etags": False, "last_modified": True},
}


@pytest.mark.parametrize(
    "cached_with, now, compared",
    [
        ("both", "date", "Last-Modified"),
        ("both", "etag", "ETag"),
        ("date", "both", "Last-Modified"),
        ("etag", "both", "ETag"),
    ],
)
@pytest.mark.slow
def test_a_server_that_switched_validator_kind_is_compared_by_the_validator_both_have(
    tmp_path, shard_server, dataset, start_agent, cached_with, now, compared
):
    data = dataset(2, samples=3, payload=1000)
    cache = tmp_path / "cache"
    vars(shard_server).update(SENDS[cached_with])
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "shards never cached")
    assert agent.stop() == 0
    old = data.paths[1].read_bytes()
    replace(data.paths[1], another_version(old))  # the same size, new bytes, a new date
    vars(shard_server).update(SENDS[now])
    shard_server.reset_log()
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    with ShardClient(cache, timeout=20) as client:
        for url, path in zip(data.urls, data.paths):
            assert client.open(url).read_bytes() == path.read_bytes()
            client.release(url)
        stats = client.stats()
    assert data.paths[1].read_bytes() != old
    assert stats["changed"] == 1 and [c["url"] for c in stats["agent"]["changed"]] == [data.urls[1]]
    assert shard_server.count(data.paths[0].name) == 0  # unchanged, told so by the validator both have
    assert shard_server.count(data.paths[1].name) == 1
    assert f"{data.urls[1]} changed on the server ({compared} " in agent.stderr_text(), agent.stderr_tail()


@pytest.mark.slow
def test_a_copy_without_a_validator_in_common_with_its_server_is_fetched_again(
    tmp_path, shard_server, dataset, start_agent
):
    data = dataset(2, samples=3, payload=1000)
    cache = tmp_path / "cache"
    vars(shard_server).update(SENDS["etag"])
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "shards never cached")
    assert agent.stop() == 0
    replace(data.paths[1], another_version(data.paths[1].read_bytes()))
    vars(shard_server).update(SENDS["date"])  # Last-Modified only: nothing to compare the ETag with
    shard_server.reset_log()
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    with ShardClient(cache, timeout=20) as client:
        for url, path in zip(data.urls, data.paths):
            assert client.open(url).read_bytes() == path.read_bytes()
            client.release(url)
    assert [shard_server.count(p.name) for p in data.paths] == [1, 1]  # neither served unchecked
    log = agent.stderr_text()
    assert sum("WARNING" in line and "cannot tell whether" in line for line in log.splitlines()) == 2, log
    assert "cached with ETag, the server now sends Last-Modified: no validator in common" in log


def test_a_damaged_cached_copy_is_fetched_again_and_the_epoch_reads_the_new_copy(tmp_path, dataset, start_agent):
    data = dataset(2, samples=6, payload=2000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "shards never cached")
    copy = CacheLayout.of(cache).shard_path(data.urls[1])
    raw = bytearray(copy.read_bytes())
    header = members(bytes(raw), url="x")[6].offset - 512
    raw[header + 5] ^= 0xFF  # a later member's header: the copy still starts like a tar
    copy.write_bytes(bytes(raw))

    def epoch(job: str) -> list:
        loader = CachedMultiLoader(cache_dir=cache, job=job, rank=0, world_size=1, shuffle=False, timeout=20)
        return list(loader)

    assert len(epoch("first")) == 12  # the read that found the damage waited for a good copy
    assert "downloading " + data.urls[1] + " again" in agent.stderr_text()
    assert copy.read_bytes() == data.paths[1].read_bytes()


@pytest.mark.parametrize("kind", ["http", "file"])
def test_a_shard_gone_from_its_source_is_not_served_from_the_cache(tmp_path, shard_server, dataset, start_agent, kind):
    # Its source says there is no such object now (HTTP 404, no such file): a final answer, not a
    # source that cannot be asked, so the cached copy is no longer the source's.
    data = dataset(2, samples=3, payload=1000)
    urls = data.urls if kind == "http" else [f"file://{p}" for p in data.paths]
    listed = tmp_path / "urls.txt"
    listed.write_text("".join(u + "\n" for u in urls))
    cache = tmp_path / "cache"
    agent = start_agent(cache, listed, "--prefetch", "2", "--no-shuffle", "--retries", "0")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "shards never cached")
    assert agent.stop() == 0
    data.paths[1].unlink()
    again = start_agent(cache, listed, "--prefetch", "2", "--no-shuffle", "--retries", "0")
    with ShardClient(cache, timeout=20) as client:
        assert client.open(urls[0]).read_bytes() == data.paths[0].read_bytes()
        with pytest.raises(FetchError) as info:
            client.open(urls[1])
    assert info.value.url == urls[1] and ("404" in str(info.value) or "no such file" in str(info.value))
    assert "is gone from its source" in again.stderr_text(), again.stderr_tail()


@pytest.mark.slow
def test_local_shards_whose_folder_is_missing_are_served_as_cached(tmp_path, dataset, start_agent):
    # A folder missing (a file system not mounted yet) is no answer about its files: their copies stay.
    data = dataset(2, samples=3, payload=1000)
    urls = [f"file://{p}" for p in data.paths]
    listed = tmp_path / "urls.txt"
    listed.write_text("".join(u + "\n" for u in urls))
    cache = tmp_path / "cache"
    agent = start_agent(cache, listed, "--prefetch", "2", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "shards never cached")
    assert agent.stop() == 0
    wanted = [p.read_bytes() for p in data.paths]
    folder = data.paths[0].parent
    folder.rename(folder.with_name(folder.name + "-unmounted"))
    again = start_agent(cache, listed, "--prefetch", "2", "--no-shuffle")
    with ShardClient(cache, timeout=20) as client:
        assert [client.open(u).read_bytes() for u in urls] == wanted
    assert "gone from its source" not in again.stderr_text() and "could not revalidate" in again.stderr_text()


@pytest.mark.parametrize(
    "now, on_error",
    [
        pytest.param(2, "raise", id="fewer-samples-raise"),
        pytest.param(7, "skip", id="more-samples-skip"),
    ],
)
def test_a_shard_overwritten_at_its_source_mid_epoch_fails_that_epoch_and_the_next_reads_it_whole(
    tmp_path, shard_server, dataset, start_agent, run_cli, caplog, now, on_error
):
    """A shard whose source gets another sample count while an epoch is under way, its copy
    evicted and downloaded again, cannot be read by the plan that epoch made: it fails there
    (naming the URL and both counts) and no sample of the new content is served under the old
    plan; the next epoch reads exactly the new content."""
    data = dataset(6, samples=4, payload=1000)
    changed, url = data.paths[5], data.urls[5]
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "6", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 6, 20, "shards never cached")
    old = reference(data.paths, data.urls)
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20, request_size=1, on_error=on_error) as loader:
        assert {(s["__url__"], s["__key__"]): fields(s) for s in loader} == old  # every shard counted
        it = iter(loader)
        got = [next(it)]  # the epoch is planned with 4 samples in the last shard, not pinned yet
        overwrite_and_read_on(it, got, (changed, url, now), cache, on_error, 24 - 4, tmp_path, run_cli, caplog)
        new = reference([changed], [url])
        assert not [
            s for s in got if (s["__url__"], s["__key__"]) in new and fields(s) == new[s["__url__"], s["__key__"]]
        ]
        assert {(s["__url__"], s["__key__"]): fields(s) for s in got} == {k: v for k, v in old.items() if k[0] != url}
        again = [(s["__url__"], s["__key__"], fields(s)) for s in loader]  # the next epoch: the new content, whole
    assert again == [(u, k, f) for (u, k), f in {**{k: v for k, v in old.items() if k[0] != url}, **new}.items()]


@pytest.mark.parametrize("mode", ["mix", "resampled"])
@pytest.mark.parametrize(
    "now, on_error",
    [
        pytest.param(2, "raise", id="fewer-samples-raise"),
        pytest.param(7, "skip", id="more-samples-skip"),
    ],
)
@pytest.mark.slow
def test_a_shard_overwritten_at_its_source_mid_epoch_fails_a_mixtures_epoch_too(
    tmp_path, shard_server, dataset, start_agent, run_cli, caplog, mode, now, on_error
):
    """A mixture's epoch (mix=, resampled=True) is planned with every shard's count up front: a
    shard overwritten at its source with another count while it runs, its copy evicted and
    downloaded again, fails it as in a plain epoch (naming both counts, the new copy not
    reported corrupt), none of its new samples served by the old plan; the next epoch plans
    with the new count."""
    data = dataset(8, samples=4, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "8", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 8, 20, "shards never cached")
    halves = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for half, urls in zip(halves, (data.urls[:4], data.urls[4:])):
        half.write_text("\n".join(urls) + "\n")
    kw: dict = {"mix": {str(h): 1 for h in halves}} if mode == "mix" else {"urls": data.urls, "resampled": True}
    old = reference(data.paths, data.urls)
    with CachedMultiLoader(
        cache_dir=cache, epoch_samples=32, shuffle=False, timeout=20, request_size=1, on_error=on_error, **kw
    ) as loader:
        first = [s["__url__"] for s in loader]
        url = list(dict.fromkeys(first))[-1]  # the shard the epoch reaches last: pinned only as reads reach it
        assert first.index(url) >= 24, first
        changed = data.paths[data.urls.index(url)]
        loader.set_epoch(0)  # that epoch again, planned by the counts it was planned with
        it = iter(loader)
        got = [next(it)]
        skipped = first.count(url)  # its places in the epoch: one rank leaves them out
        overwrite_and_read_on(it, got, (changed, url, now), cache, on_error, 32 - skipped, tmp_path, run_cli, caplog)
        assert all(s["__url__"] != url and fields(s) == old[s["__url__"], s["__key__"]] for s in got)
        again = list(loader)  # the next epoch, planned with the new count
    new = reference([changed], [url])
    assert all(fields(s) == {**old, **new}[s["__url__"], s["__key__"]] for s in again)
    read_now = {s["__key__"] for s in again if s["__url__"] == url}
    assert read_now and read_now <= {k for _, k in new}
    assert agent.stats()["agent"]["corrupt"] == []


def overwrite_and_read_on(it, got, change, cache, on_error, left, tmp_path, run_cli, caplog) -> None:
    """Overwrite a shard of 4 samples at its source (``change``: its path, URL and new count) and
    evict its copy, then read the rest of the epoch from ``it`` into ``got``: the shard fails
    naming both counts, raised or (``on_error="skip"``) skipped, the epoch then ``left`` samples
    (one rank leaves the skipped shard's places out)."""
    changed, url, now = change
    replace(changed, make_shard(tmp_path / "new.tar", synth_samples(5, now, payload=1000, seed=7)).read_bytes())
    r = run_cli("evict", url, "--cache-dir", cache)
    assert r.returncode == 0, r.stdout + r.stderr
    expected = f"changed at its source since this epoch was planned: it holds {now} samples now, 4 then"
    if on_error == "raise":
        with pytest.raises(ShardError, match=re.escape(expected)) as info:
            got.extend(it)
        assert info.value.url == url and url in str(info.value)
    else:
        with caplog.at_level(logging.WARNING, logger="wdscache"):
            got.extend(it)
        assert any(url in r.getMessage() and expected in r.getMessage() for r in caplog.records)
        assert len(got) == left  # none in place of its samples


def fields(sample: dict) -> dict[str, str]:
    """A sample's fields as :func:`reference` gives them."""
    return {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}


@pytest.mark.parametrize("status", [403, 500])
@pytest.mark.slow
def test_a_failed_revalidation_logs_its_cause(tmp_path, shard_server, dataset, start_agent, status):
    # An expired signature (403) or a failing server (500) on the restart's HEAD: the cached copy
    # is served, and the log says why the source could not tell, its URL's secrets masked.
    data = dataset(1, samples=3, payload=500)
    url = f"{data.urls[0]}?X-Amz-Signature=SIGSECRET&X-Amz-Expires=60"
    listed = tmp_path / "urls.txt"
    listed.write_text(url + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, listed, "--prefetch", "1", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the shard never cached")
    assert agent.stop() == 0
    shard_server.fail(data.paths[0].name, "status", status=status)
    again = start_agent(cache, listed, "--prefetch", "1", "--no-shuffle")
    with ShardClient(cache, timeout=20) as client:
        assert client.open(url).read_bytes() == data.paths[0].read_bytes()
    assert shard_server.pending_faults(data.paths[0].name) == []  # the restart's HEAD got it
    reason = {403: "HTTP 403 Forbidden", 500: "HTTP 500 Internal Server Error"}[status]
    shown = f"{data.urls[0]}?X-Amz-Signature=***&X-Amz-Expires=60"
    log = again.stderr_text()
    assert f"could not revalidate {shown} ({reason}); serving the cached copy" in log, again.stderr_tail()
    assert "SIGSECRET" not in log
