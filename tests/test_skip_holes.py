"""The holes a skipped shard leaves (``on_error="skip"``, or a webdataset handler that goes on):
one rank drops them, as webdataset does; several ranks fill them with repeats spread over
their recent samples, keeping the planned count. Real agent, real HTTP server (the skipped
shard answers 404, its count known from the index), real loaders."""

from __future__ import annotations

import json
import logging
import math
import threading
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

wds = pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")

import wdscache  # noqa: E402
from tests.helpers.procs import run_json_job  # noqa: E402
from tests.helpers.streaming import delivered, fields_of, reference  # noqa: E402
from wdscache import CachedMultiLoader  # noqa: E402
from wdscache.training.holes import POOL_SAMPLES  # noqa: E402
from wdscache.training.look_back import LOOK_BACK_SHARDS  # noqa: E402

GONE = 500  # samples the index declares for the shard that answers 404


@pytest.fixture
def holed(dataset: Any, start_agent: Any, shard_server: Any, tmp_path: Path) -> Any:
    """An index of two healthy shards of 20 samples with a 404 shard of 500 between them, an
    agent serving it; returns (index, cache, reference of the healthy shards, their paths, URLs)."""
    data = dataset(2, samples=20, payload=300, prefix="a")
    gone = shard_server.url("gone.tar")  # never written: 404
    index = tmp_path / "lists" / "gone.json"
    entries = [
        {"url": data.urls[0], "nsamples": 20},
        {"url": gone, "nsamples": GONE},
        {"url": data.urls[1], "nsamples": 20},
    ]
    index.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    cache = tmp_path / "cache"
    start_agent(cache, index)
    return index, cache, reference(data.paths, data.urls), data


def _loader(cache: Path, **kw: Any) -> CachedMultiLoader:
    kw.setdefault("timeout", 30)
    kw.setdefault("on_error", "skip")
    return CachedMultiLoader(cache_dir=cache, job=kw.pop("job", "j"), **kw)


def _keys(samples: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(s["__url__"], s["__key__"]) for s in samples]


def _heads(cache: Path, job: str, at: int, **kw: Any) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """Each of two ranks' first ``at`` samples (rank 0's loader, then rank 1's), and rank 0's
    state then (the job's: every rank delivered as many)."""
    heads = []
    for r in range(2):
        loader = _loader(cache, job=job, rank=r, **kw)
        it = iter(loader)
        heads.append([next(it) for _ in range(at)])
        if r == 0:
            state = loader.state_dict()
        it.close()
    return heads, state


def _rests(cache: Path, job: str, state: dict[str, Any], **kw: Any) -> list[list[dict[str, Any]]]:
    """Each of two ranks' rest of the epoch, resumed from ``state`` on new loaders."""
    rests = [_loader(cache, job=job, rank=r, **kw) for r in range(2)]
    for loader in rests:
        loader.load_state_dict(state)
    return [list(loader) for loader in rests]


@pytest.mark.parametrize("shuffled", [False, True])
def test_one_rank_drops_the_holes_and_yields_each_real_sample_once_as_webdataset(holed: Any, shuffled: bool) -> None:
    index, cache, ref, data = holed
    theirs = {(data.urls[i], s["__key__"]) for i, p in enumerate(data.paths) for s in wds.WebDataset(str(p))}
    assert theirs == set(ref) and len(theirs) == 40
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = wdscache.WebDataset(str(index), cache_dir=cache, handler=wds.warn_and_continue, shardshuffle=shuffled)
        ours = list(ds.shuffle(100) if shuffled else ds)
    assert Counter(_keys(ours)) == Counter(theirs)  # each once: no repeat in place of the 500
    assert delivered(ours) == ref  # and their bytes
    with _loader(cache, shuffle=shuffled, shuffle_buffer=100) as loader:
        assert delivered(list(loader)) == ref


def test_one_rank_resumed_after_the_hole_yields_exactly_the_rest(holed: Any) -> None:
    _, cache, ref, _ = holed
    for shuffle, taken in ((False, 25), (True, 7), (True, 33)):
        first = _loader(cache, job=f"r{shuffle}{taken}", shuffle=shuffle, shuffle_buffer=100, request_size=4)
        it = iter(first)
        head = [next(it) for _ in range(taken)]
        state = first.state_dict()
        it.close()
        rest = _loader(cache, job=f"r{shuffle}{taken}", shuffle=shuffle, shuffle_buffer=100)
        rest.load_state_dict(state)
        tail = list(rest)
        assert delivered(head + tail) == ref, (shuffle, taken, len(head), len(tail))
        if not shuffle:  # in order: the hole lies between the two shards, behind the 25th sample
            assert _keys(tail) == sorted(_keys(tail)) and len(tail) == 15
        # The state once the rest is out: the next epoch, from its start.
        again = rest.state_dict()
        assert again["epoch"] == 1 and again["position"] == 0, again


@pytest.mark.parametrize("shuffled", [False, True])
def test_two_ranks_keep_the_planned_count_with_repeats_spread_over_their_samples(holed: Any, shuffled: bool) -> None:
    _, cache, ref, _ = holed
    planned = (40 + GONE) // 2
    ranks = [
        _loader(cache, job=f"two{shuffled}", rank=r, world_size=2, shuffle=shuffled, shuffle_buffer=100)
        for r in range(2)
    ]
    got = [list(loader) for loader in ranks]
    assert [len(g) for g in got] == [planned, planned]
    counts = [Counter(_keys(g)) for g in got]
    assert not set(counts[0]) & set(counts[1])  # a rank repeats only samples it read
    assert set(counts[0]) | set(counts[1]) == set(ref)  # every real sample, on one rank
    for g, c in zip(got, counts):
        real, holes = len(c), planned - len(c)
        bound = math.ceil(holes / min(POOL_SAMPLES, real)) + 1
        assert max(c.values()) <= bound, (c.most_common(3), bound)
        for s in g:  # a repeat is the sample's own bytes
            assert fields_of(s) == ref[(s["__url__"], s["__key__"])]
    # The same inputs, the same repeats.
    again = [
        list(_loader(cache, job=f"again{shuffled}", rank=r, world_size=2, shuffle=shuffled, shuffle_buffer=100))
        for r in range(2)
    ]
    assert [_keys(g) for g in again] == [_keys(g) for g in got]


def test_one_rank_whose_every_sample_failed_raises_and_a_resumed_empty_rest_warns(
    dataset: Any, start_agent: Any, shard_server: Any, tmp_path: Path, caplog: Any
) -> None:
    data = dataset(1, samples=4, payload=300, prefix="a")
    gone = shard_server.url("gone.tar")
    index = tmp_path / "lists" / "gone.json"
    entries = [{"url": data.urls[0], "nsamples": 4}, {"url": gone, "nsamples": 30}]
    index.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    only_gone = tmp_path / "lists" / "only.json"
    only_gone.write_text(json.dumps({"wids_version": 1, "shardlist": entries[1:]}))
    cache = tmp_path / "cache"
    start_agent(cache, index)
    with pytest.raises(wdscache.ShardError, match="every sample of epoch 0 lies in shards that failed") as info:
        list(_loader(cache, urls=str(only_gone)))
    assert info.value.url == gone
    one = _loader(cache, urls=str(index), shuffle=False)
    it = iter(one)
    assert [s["__key__"] for s in (next(it) for _ in range(4))] == sorted(
        k for _, k in reference(data.paths, data.urls)
    )
    state = one.state_dict()  # the 30 holes after the last sample are not out yet
    it.close()
    rest = _loader(cache, urls=str(index), shuffle=False)
    rest.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="wdscache"):
        assert list(rest) == []
    assert "rest of epoch 0 since its checkpoint lies in shards that failed" in caplog.text, caplog.text
    assert "it yields none of its 30 samples" in caplog.text, caplog.text


@pytest.fixture
def tailed(dataset: Any, start_agent: Any, shard_server: Any, tmp_path: Path) -> Any:
    """As ``holed``, but the 404 shard of GONE samples comes last: the tail of every rank's
    share is holes. Returns (cache, reference of the healthy shards)."""
    data = dataset(2, samples=20, payload=300, prefix="t")
    index = tmp_path / "lists" / "tail.json"
    entries = [{"url": u, "nsamples": 20} for u in data.urls] + [
        {"url": shard_server.url("gone.tar"), "nsamples": GONE}
    ]
    index.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    cache = tmp_path / "cache"
    start_agent(cache, index)
    return cache, reference(data.paths, data.urls)


@pytest.mark.parametrize("shuffled, at", [(False, 24), (True, 24), (False, 23)])
def test_two_ranks_resumed_where_the_rest_is_all_holes_keep_the_planned_count(
    tailed: Any, shuffled: bool, at: int
) -> None:
    """A checkpoint taken where a rank's rest lies in the failed shard (or but one sample of it,
    ``at`` 23): the rank fills its rest with repeats of its own samples from before the
    checkpoint (read again) too, so both ranks yield the count the epoch planned, with the same
    repeats each time, spread over all the rank's samples; every real sample is still handed
    out once, before the checkpoint or after it."""
    cache, ref = tailed
    kw: dict[str, Any] = {"world_size": 2, "shuffle": shuffled, "shuffle_buffer": 100, "request_size": 4}
    planned = (40 + GONE) // 2
    # Unshuffled, rank 0's first 24 samples are positions 0-7, 16-23 and 32-39 (blocks of 8 in
    # rows of 16), rank 1's are 8-15 and 24-31, and 40-47 is the first hole: from the
    # checkpoint after 24, each rank's rest is the failed shard's alone (after 23, rank 0's holds
    # position 39 too). Shuffled, a rest may hold a few real samples too.
    heads, state = _heads(cache, f"b{shuffled}", at, **kw)
    runs = [_rests(cache, f"r{shuffled}{attempt}", state, **kw) for attempt in range(2)]
    tails = runs[0]
    assert [len(t) for t in tails] == [planned - at] * 2
    mine = [set(_keys(head + tail)) for head, tail in zip(heads, tails)]
    assert not mine[0] & mine[1]  # a rank repeats only samples it read
    assert mine[0] | mine[1] == set(ref)  # every real sample, on one rank
    for tail in tails:
        for s in tail:  # a repeat is the sample's own bytes
            assert fields_of(s) == ref[(s["__url__"], s["__key__"])]
        counts = Counter(_keys(tail))
        assert max(counts.values()) <= math.ceil(len(tail) / min(POOL_SAMPLES, len(counts))) + 1, counts.most_common(3)
    if not shuffled:  # every real sample of the rank comes back in its rest
        assert [len(m) for m in mine] == [24, 16]
        assert [set(_keys(t)) for t in tails] == mine
    assert [_keys(t) for t in runs[1]] == [_keys(t) for t in tails]  # the same repeats


def test_a_resumed_rank_reads_again_the_samples_of_its_latest_shards_only(
    dataset: Any, start_agent: Any, shard_server: Any, tmp_path: Path
) -> None:
    """Each shard read again for a resumed rank's repeats may need a download of its own: the
    look-back takes the rank's latest samples in LOOK_BACK_SHARDS shards at most."""
    data = dataset(20, samples=4, payload=300, prefix="m")
    index = tmp_path / "lists" / "many.json"
    entries = [{"url": u, "nsamples": 4} for u in data.urls] + [{"url": shard_server.url("gone.tar"), "nsamples": GONE}]
    index.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    cache = tmp_path / "cache"
    start_agent(cache, index)
    kw: dict[str, Any] = {"world_size": 2, "shuffle": False, "request_size": 4}
    # each rank's 40 samples: blocks of 8 positions (2 shards) in rows of 16
    heads, state = _heads(cache, "m", 40, **kw)
    tails = _rests(cache, "mr", state, **kw)
    assert [len(t) for t in tails] == [(80 + GONE) // 2 - 40] * 2
    for head, tail in zip(heads, tails):  # the latest 8 of the rank's 10 shards, all their samples
        assert set(_keys(tail)) == set(_keys(head[8:])) and len({url for url, _ in _keys(tail)}) == LOOK_BACK_SHARDS


def test_a_resumed_ranks_look_back_goes_past_shards_that_failed_before_its_checkpoint(
    dataset: Any, start_agent: Any, shard_server: Any, tmp_path: Path
) -> None:
    """A shard that failed before the checkpoint is not known to the resumed run: the look-back's
    reads of it fail too, and it looks further back, to the rank's samples before it."""
    data = dataset(1, samples=100, payload=300, prefix="f")
    index = tmp_path / "lists" / "failed.json"
    gone = [{"url": shard_server.url(f"gone{i}.tar"), "nsamples": 200} for i in range(2)]
    index.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": data.urls[0], "nsamples": 100}, *gone]}))
    cache = tmp_path / "cache"
    start_agent(cache, index)
    kw: dict[str, Any] = {"world_size": 2, "shuffle": False, "request_size": 4}
    heads, state = _heads(cache, "f", 170, **kw)  # the rank's real samples, then repeats of them
    tails = _rests(cache, "fr", state, **kw)  # the rest: the second 404 shard's
    assert [len(t) for t in tails] == [250 - 170] * 2
    assert [len(set(_keys(h))) for h in heads] == [52, 48]  # blocks of 8 in rows of 16 over 100 samples
    for head, tail in zip(heads, tails):  # every one of the rank's real samples, repeated
        assert set(_keys(tail)) == set(_keys(head))


@pytest.mark.slow  # the look-back waits out the loaders' timeout
def test_a_look_back_whose_shard_stalls_gives_up_and_the_rest_fills_from_what_it_read(
    dataset: Any, start_agent: Any, shard_server: Any, tmp_path: Path
) -> None:
    """The look-back's reads only widen the pool: one whose shard makes no progress is given up
    after the loader's timeout, and the holes are filled from the samples read since."""
    sizes = [16, 8, 8]  # shard 0 holds what each rank read before the checkpoint
    data = dataset(1, samples=16, payload=300, prefix="s0"), dataset(2, samples=8, payload=300, prefix="s1")
    urls = data[0].urls + data[1].urls
    index = tmp_path / "lists" / "stalled.json"
    entries = [{"url": u, "nsamples": n} for u, n in zip(urls, sizes)]
    entries.append({"url": shard_server.url("gone.tar"), "nsamples": GONE})
    index.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    kw: dict[str, Any] = {"world_size": 2, "shuffle": False, "request_size": 4}
    start_agent(tmp_path / "cache", index)
    # rank 0 reads shard 0's 0-7, then shard 1; rank 1 shard 0's 8-15, then shard 2
    heads, state = _heads(tmp_path / "cache", "s", 8, **kw)
    released = threading.Event()
    shard_server.fail(data[0].paths[0].name, "stall", seconds=60, until=released, times=50)
    try:
        start_agent(tmp_path / "fresh", index)  # shard 0 must be downloaded again: it stalls
        tails = _rests(tmp_path / "fresh", "s", state, **{**kw, "timeout": 4})
    finally:
        released.set()
    assert [len(t) for t in tails] == [(32 + GONE) // 2 - 8] * 2
    assert [{url for url, _ in _keys(t)} for t in tails] == [{urls[1]}, {urls[2]}]  # the 8 read since, repeated
    assert [len(set(_keys(t))) for t in tails] == [8, 8]


@pytest.mark.slow
def test_dataloader_workers_resumed_where_their_rest_is_all_holes_keep_the_ranks_counts(tailed: Any) -> None:
    """The same in StatefulDataLoaders of 2 workers: a worker resumed from its own state whose
    rest is all holes repeats its samples before it; resumed from a rank's whole state, every
    worker whose rest is all holes repeats the rank's. Each rank yields the planned count."""
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    cache, ref = tailed
    out = run_json_job("tests.helpers.torch_job", str(cache), "holes_resumed")
    planned = (40 + GONE) // 2
    real = {f"{u}#{k}" for u, k in ref}
    first, rest, whole = out["first"], out["rest"], out["whole"]
    assert [len(f) for f in first] == [16, 16]
    # Unshuffled, each rank's first 16 samples are 8 of each worker (blocks of 8 positions); after
    # them, rank 0's worker 1 and both of rank 1's have holes alone.
    assert [len(f) + len(r) for f, r in zip(first, rest)] == [planned, planned]
    assert [len(w) for w in whole] == [planned - 16] * 2
    since = real - set(first[0]) - set(first[1])  # rank 0's 8 real samples after the first 16
    assert len(since) == 8
    # Each worker repeats its own samples: rank 0's worker 1 those before its checkpoint, worker 0
    # those it read since (8, fewer than a pool's worth) and those before it too; rank 1's two
    # workers those before theirs.
    assert set(rest[0]) == since | set(first[0])
    assert set(rest[1]) == set(first[1])
    # From rank 0's whole state, the job delivered 32 positions: rank 0's rest holds 8 real ones
    # since, all in its worker 0's slice; its worker 1 and rank 1's workers hold holes alone, and
    # repeat their rank's samples before the checkpoint.
    assert set(whole[0]) == since | set(first[0]) and set(whole[1]) == set(first[1])


@pytest.mark.slow
def test_a_dataloader_worker_whose_slice_is_holes_alone_repeats_its_fellows_samples(tailed: Any) -> None:
    """Three ranks of DataLoaders of 2 workers, unshuffled: rank 2's 8 real samples lie in its
    worker 0's slice, its worker 1's slice is holes alone. That worker repeats its fellow's first
    samples (read again), so every rank yields the planned count, as ``on_error="skip"`` asks."""
    pytest.importorskip("torch", reason="torch is not installed")
    cache, ref = tailed
    out = run_json_job("tests.helpers.torch_job", str(cache), "holes_workers")
    ranks = out["ranks"]
    assert [len(r) for r in ranks] == [(40 + GONE) // 3] * 3
    mine = [set(r) for r in ranks]
    assert [len(m) for m in mine] == [16, 16, 8]  # each rank's own real samples, and only those
    assert set().union(*mine) == {f"{u}#{k}" for u, k in ref} and not (
        mine[0] & mine[1] or mine[2] & (mine[0] | mine[1])
    )
