"""Corrupt copies: a corrupt cached copy is found by reads, fetched once more, then failed;
``on_error="skip"`` skips only the corrupt shard, and the ranks keep equal counts. A copy the
agent's worker cannot open is a FetchError instead, and no corrupt copy."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from webdataset.handlers import reraise_exception

from tests.helpers.streaming import reference, samples_of
from tests.helpers.waits import wait_for
from wdscache import CachedMultiLoader, FetchError, ShardClient, ShardError, WdsCacheError, WebDataset
from wdscache.shared.layout import CacheLayout


def clobber_header(path: Path, member: int = 3, *, keep_mtime: bool = False) -> None:
    """Overwrite the tar header of member ``member`` (well past the head the download
    checks) with junk of the same size: the file keeps its size, a reader meets a bad header.
    ``keep_mtime`` keeps its modification time too, so a server's ETag stays the same:
    damage at a source that no validator sees."""
    st = path.stat()
    with tarfile.open(path) as tf:
        offset = tf.getmembers()[member].offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 512] = bytes((i * 7 + 3) % 251 for i in range(512))
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def loader(cache: Path, **kw) -> CachedMultiLoader:
    kw.setdefault("timeout", 20)
    return CachedMultiLoader(
        cache_dir=cache,
        job=kw.pop("job", "j"),
        rank=kw.pop("rank", 0),
        world_size=kw.pop("world_size", 1),
        shuffle_buffer=50,
        **kw,
    )


def gets(server, name: str) -> int:
    return sum(1 for r in server.requests if r.method == "GET" and r.path == name)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["second-epoch", "after-restart"])
def test_a_copy_damaged_on_disk_is_found_by_a_read_fetched_again_and_the_epoch_completes(
    shard_server, dataset, start_agent, tmp_path, when
):
    ds = dataset(4, samples=20, payload=3000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "4", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 20, "the 4 shards were not cached")
    ref = reference(ds.paths, ds.urls)
    if when == "second-epoch":
        first = list(loader(cache))  # every shard read once: the agent knows their counts
        assert len(first) == len(ref)
    victim = ds.urls[1]
    clobber_header(CacheLayout.of(cache).shard_path(victim))  # the source stays healthy
    if when == "after-restart":
        agent.stop()
        agent = start_agent(cache, ds.list_file, "--prefetch", "4", "--cache-size", "10M")
        assert agent.stats()["shards"]["cached"] == 4  # same size: recovery keeps it

    got = list(loader(cache, seed=3))
    assert sorted((s["__url__"], s["__key__"]) for s in got) == sorted(ref)
    for s in got:
        fields = {k: v for k, v in s.items() if not k.startswith("__")}
        assert {k: hashlib.sha256(v).hexdigest() for k, v in fields.items()} == ref[(s["__url__"], s["__key__"])]
    s = agent.stats()
    assert s["corrupt"] >= 1 and victim in [c["url"] for c in s["agent"]["corrupt"]], s
    assert gets(shard_server, ds.paths[1].name) == 2  # fetched once more, the others once
    assert all(gets(shard_server, p.name) == 1 for i, p in enumerate(ds.paths) if i != 1)
    assert s["failed"] == [] and s["shards"]["cached"] == 4


def test_a_shard_damaged_at_its_source_fails_after_one_more_download_with_the_reason(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(3, samples=20, payload=3000)
    clobber_header(ds.paths[2], keep_mtime=True)  # damaged at the source, past the head the download checks
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "the 3 shards were not cached")
    with pytest.raises(ShardError) as info:
        list(loader(cache))
    assert info.value.url == ds.urls[2], info.value
    assert "bad tar header" in str(info.value), info.value
    s = agent.wait_stats(lambda s: s["failed"], 10, "the damaged shard was not failed")
    assert [f["url"] for f in s["failed"]] == [ds.urls[2]], s["failed"]
    assert "damaged again" in s["failed"][0]["error"] and "bad tar header" in s["failed"][0]["error"], s["failed"]
    assert gets(shard_server, ds.paths[2].name) == 2  # once more, then no retry storm


@pytest.mark.parametrize("counts", ["known", "unknown"])
@pytest.mark.slow
def test_skip_delivers_every_sample_of_every_healthy_shard_and_the_ranks_keep_equal_counts(
    shard_server, dataset, start_agent, consumers, tmp_path, counts
):
    ds = dataset(8, samples=25, payload=1500)
    bad = ds.urls[5]
    if counts == "unknown":
        clobber_header(ds.paths[5], keep_mtime=True)  # damaged at the source: no copy of it was ever read
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "8", "--cache-size", "20M", "--workers", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 8, 20, "the 8 shards were not cached")
    ref = reference(ds.paths, ds.urls)
    if counts == "known":
        assert len(list(loader(cache))) == 200  # one healthy epoch: the agent knows every count
        clobber_header(ds.paths[5], keep_mtime=True)  # then the source and the cached copy go bad alike
        clobber_header(CacheLayout.of(cache).shard_path(bad))

    ranks = [
        consumers(
            cache,
            f"r{r}",
            "--job",
            "skip",
            "--rank",
            str(r),
            "--world-size",
            "2",
            "--shuffle-buffer",
            "100",
            "--on-error",
            "skip",
        )
        for r in range(2)
    ]
    results = [samples_of(c.wait()) for c in ranks]
    got = Counter((s["url"], s["key"]) for r in results for s in r)
    healthy = {k for k in ref if k[0] != bad}
    assert healthy <= set(got), sorted(healthy - set(got))[:5]
    assert not [k for k in got if k[0] == bad]
    if counts == "known":
        # The sequence holds the bad shard's 25 positions: each rank fills those it cannot
        # read with repeats, so both keep the count of a healthy epoch.
        assert [len(r) for r in results] == [100, 100]
        assert sum(got.values()) - len(healthy) == 25
    else:
        # Never counted, the shard adds no position: 175 samples, 88 per rank (one padding repeat).
        assert [len(r) for r in results] == [88, 88]
        assert sum(got.values()) - len(healthy) == 1
    for r in results:
        for s in r:
            assert s["fields"] == ref[(s["url"], s["key"])]
    s = agent.wait_stats(lambda s: s["failed"], 10, "the damaged shard was not failed")
    assert [f["url"] for f in s["failed"]] == [bad], s["failed"]


def test_a_damaged_copy_another_reader_holds_is_fetched_again_once_it_lets_go(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(4, samples=20, payload=3000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "4", "--cache-size", "10M", "--workers", "2")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 20, "the 4 shards were not cached")
    assert len(list(loader(cache))) == 80  # the counts are known
    clobber_header(CacheLayout.of(cache).shard_path(ds.urls[2]))  # the source stays healthy
    with ShardClient(cache, timeout=20, name="holder") as holder:
        holder.open(ds.urls[2])  # another reader holds the damaged copy: it cannot go yet
        c = consumers(cache, "reader", "--job", "j2", "--timeout", "20")
        wait_for(
            lambda: "reading it again from a new copy" in c.log.read_text(),
            20,
            lambda: f"the consumer never found the damage\n{c.log.read_text()[-2000:]}",
        )
        assert c.proc.poll() is None  # it waits for a good copy, not for an error
    results = samples_of(c.wait())  # the holder let go: the copy is fetched again, the epoch ends
    ref = reference(ds.paths, ds.urls)
    assert sorted((s["url"], s["key"]) for s in results) == sorted(ref)
    for s in results:
        assert s["fields"] == ref[(s["url"], s["key"])]
    s = agent.stats()
    assert s["failed"] == [] and gets(shard_server, ds.paths[2].name) == 2, s["failed"]


@pytest.mark.parametrize("fault", ["damaged", "missing"])
@pytest.mark.parametrize("on_error", ["stop", "raise"])
def test_a_failed_shard_ends_the_epoch_after_every_sample_before_it_then_raises_or_stops(
    shard_server, dataset, start_agent, tmp_path, fault, on_error
):
    ds = dataset(5, samples=30, payload=500)
    urls = list(ds.urls)
    if fault == "damaged":
        clobber_header(ds.paths[3], member=20)  # damaged at its source: the copy fetched again is too
        last = sorted(k for _, k in reference(ds.paths[3:4], ds.urls[3:4]))
    else:
        urls[3] = shard_server.url("missing-000003.tar")  # a 404: its download fails when it is opened
        last = []
    list_file = tmp_path / "urls.txt"
    list_file.write_text("".join(f"{u}\n" for u in urls))
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--workers", "2", "--prefetch", "5")
    ref = reference(ds.paths[:3], ds.urls[:3])
    told: list[Exception] = []

    def stop(exc: Exception) -> bool:
        told.append(exc)
        return False

    # Small reads, many at once: the failed shard is opened while reads of the ones before are out.
    it = iter(
        loader(cache, shuffle=False, on_error=stop if on_error == "stop" else "raise", request_size=4, inflight=64)
    )
    got = []
    error = ShardError if fault == "damaged" else FetchError
    with contextlib.ExitStack() as stack:
        raised = stack.enter_context(pytest.raises(error)) if on_error == "raise" else None
        got.extend(it)
    failure = raised.value if raised is not None else told[0]
    assert isinstance(failure, error) and failure.url == urls[3], failure
    keys = [(s["__url__"], s["__key__"]) for s in got]
    assert keys[: len(ref)] == sorted(ref, key=lambda k: (ds.urls.index(k[0]), k[1]))
    # then at most the failed shard's samples before its damage, in order, and nothing after it
    rest = keys[len(ref) :]
    assert rest == [(urls[3], key) for key in last[: len(rest)]]


def test_skip_raises_on_a_rank_whose_every_sample_lies_in_failed_shards(
    shard_server, dataset, start_agent, tmp_path, caplog
):
    # 40 samples in a shard that fails (gone from the server: its count is known from the index),
    # 1 in a healthy one, over 2 ranks in order: rank 0 reads the healthy sample and repeats it in
    # its holes; rank 1's 20 positions are all holes, with no sample to repeat. It must not end
    # quietly with fewer samples (the other rank would wait on it forever): it raises, naming why.
    big = dataset(1, samples=40, payload=200, prefix="big")
    small = dataset(1, samples=1, payload=200, prefix="small", list_name="small.txt")
    index = tmp_path / "lists" / "index.json"
    entries = [{"url": big.urls[0], "nsamples": 40}, {"url": small.urls[0], "nsamples": 1}]
    index.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    big.paths[0].unlink()
    cache = tmp_path / "cache"
    start_agent(cache, index)
    ranks = [loader(cache, job="holes", rank=r, world_size=2, on_error="skip", shuffle=False) for r in range(2)]
    assert [s["__url__"] for s in ranks[0]] == [small.urls[0]] * 21 and len(ranks[0]) == 21
    with pytest.raises(ShardError) as info:
        list(ranks[1])
    assert info.value.url == big.urls[0]
    assert "every sample rank 1 reads here in epoch 0 lies in shards that failed" in str(info.value), info.value
    # A rest resumed from a checkpoint whose samples since lie in failed shards: its samples before
    # were read then, so that is no empty share; it ends short, saying so, rather than raising.
    healthy_first = tmp_path / "lists" / "healthy-first.json"
    healthy_first.write_text(json.dumps({"wids_version": 1, "shardlist": entries[::-1]}))
    one = loader(cache, urls=str(healthy_first), job="rest", on_error="skip", shuffle=False)
    it = iter(one)
    assert next(it)["__url__"] == small.urls[0]
    state = one.state_dict()
    it.close()
    rest = loader(cache, urls=str(healthy_first), job="rest", on_error="skip", shuffle=False)
    rest.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="wdscache"):
        assert list(rest) == []  # 40 holes, and nothing read since the checkpoint to repeat
    assert "rest of epoch 0 since its checkpoint lies in shards that failed" in caplog.text, caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["loader", "webdataset"])
@pytest.mark.parametrize("damage", ["not-a-file", "not-a-file-counted", "corrupt"])
def test_a_copy_the_worker_cannot_open_is_a_fetch_error_and_a_corrupt_one_a_shard_error(
    shard_server, dataset, start_agent, tmp_path, reader, damage
):
    """One rule for a worker's failed answer, as random access has it: a copy found damaged
    blames the shard (ShardError), one the worker cannot open or read does not (FetchError,
    and the agent is not told of a corrupt copy); raised, and given to ``on_error``, alike."""
    ds = dataset(3, samples=20, payload=3000)
    victim = ds.urls[1]
    if damage == "corrupt":
        clobber_header(ds.paths[1], keep_mtime=True)  # at its source: the copy fetched again is damaged too
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "the 3 shards were not cached")
    if damage == "not-a-file-counted":  # every count known: reads of samples meet it, not a walk
        assert len(list(loader(cache, job="first"))) == 60
    if damage != "corrupt":
        # A directory in place of the cache file: the worker fails to open it, and no bytes are
        # damaged (a file mode would not do: the tests may run as root, whom none keeps out).
        copy = CacheLayout.of(cache).shard_path(victim)
        copy.unlink()
        copy.mkdir()

    def samples(job: str, on_error) -> list[dict]:
        if reader == "loader":
            return list(loader(cache, job=job, shuffle=False, on_error=on_error))
        given = reraise_exception if on_error == "raise" else on_error  # (webdataset's default)
        return list(WebDataset(ds.urls, cache_dir=cache, shardshuffle=False, timeout=20, handler=given))

    expected = ShardError if damage == "corrupt" else FetchError
    with pytest.raises(WdsCacheError) as info:
        samples("raise", "raise")
    assert type(info.value) is expected, repr(info.value)
    assert info.value.url == victim, info.value  # a read of several shards blames the one that failed
    if damage != "corrupt":
        assert "a sample worker of the agent could not read its cache file" in str(info.value), info.value
    seen: list[BaseException] = []

    def handler(exc: BaseException) -> bool:
        seen.append(exc)
        return False  # the epoch ends there, without raising

    samples("handler", handler)
    assert [type(e) for e in seen] == [expected], seen
    s = agent.stats()
    if damage == "corrupt":
        assert [c["url"] for c in s["agent"]["corrupt"]] == [victim], s["agent"]["corrupt"]
    else:
        assert s["corrupt"] == 0 and s["agent"]["corrupt"] == [] and s["failed"] == [], s


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_read_of_several_shards_blames_only_the_one_its_worker_cannot_open(
    shard_server, dataset, start_agent, tmp_path, caplog, shuffle
):
    """A read spanning three shards whose middle one's cache file the worker cannot open (a
    directory in its place) fails that shard alone: the worker's reply names it, so
    ``on_error="skip"`` keeps the other two shards' samples of the read, and "raise" hands out
    every sample before it and names it. (The reply named no shard: the whole read was dropped,
    and its first shard blamed.)"""
    ds = dataset(3, samples=20, payload=3000)
    victim = ds.urls[1]
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "the 3 shards were not cached")
    first = [s["__key__"] for s in loader(cache, job="first", shuffle=False)]  # every count known
    assert len(first) == 60
    copy = CacheLayout.of(cache).shard_path(victim)
    copy.unlink()
    copy.mkdir()
    ref = reference(ds.paths, ds.urls)

    with caplog.at_level(logging.WARNING, logger="wdscache"):
        got = list(loader(cache, job="skip", shuffle=shuffle, on_error="skip"))
    assert sorted((s["__url__"], s["__key__"]) for s in got) == sorted(k for k in ref if k[0] != victim)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipping {victim}: "), skipped

    handed: list[str] = []
    with pytest.raises(FetchError) as info:
        for s in loader(cache, job="raise", shuffle=False):
            handed.append(s["__key__"])
    assert info.value.url == victim, info.value
    assert handed == first[:20]  # shard 0's, every one, in order
    assert agent.stats()["failed"] == [], agent.stats()["failed"]
