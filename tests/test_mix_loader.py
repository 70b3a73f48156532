"""Mixtures (``mix=`` with ``epoch_samples=``) and ``resampled=True`` through a real agent over the
real HTTP shard server: each source's exact share, ``__source__``, a shard two sources list
downloaded once, resume on another world size, webdataset's ``with_epoch`` and ``set_epoch``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.procs import run_json_job
from wdscache import CachedMultiLoader
from wdscache.shared.errors import ConfigError, WdsCacheError
from wdscache.shared.mixture import shares

PER_SHARD = 10


def _id(sample: dict[str, Any]) -> str:
    return f"{sample['__url__']}#{sample['__key__']}"


@pytest.fixture
def two_sources(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], shard_server: Any, tmp_path: Path
) -> dict[str, Any]:
    """Source a: 3 shards; source b: 2 shards of its own and a's first. The agent starts on a's list
    only, so b's own shards are counted by the loader (downloaded) before its first epoch."""
    a = dataset(3, samples=PER_SHARD, payload=200, prefix="a", list_name="a.txt")
    b = dataset(2, samples=PER_SHARD, payload=200, prefix="b", list_name="b-own.txt")
    b_list = tmp_path / "lists" / "b.txt"
    b_list.write_text("\n".join([*b.urls, a.urls[0]]) + "\n")
    cache = tmp_path / "cache"
    start_agent(cache, a.list_file, "--workers", "2")
    return {
        "a": str(a.list_file),
        "b": str(b_list),
        "a_urls": list(a.urls),
        "b_urls": [*b.urls, a.urls[0]],
        "cache": cache,
        "server": shard_server,
        "paths": [*a.paths, *b.paths],
    }


def _loader(src: dict[str, Any], rank: int = 0, world: int = 1, **kw: Any) -> CachedMultiLoader:
    kw.setdefault("mix", {src["a"]: 2, src["b"]: 1})
    kw.setdefault("epoch_samples", 45)
    return CachedMultiLoader(
        cache_dir=src["cache"], rank=rank, world_size=world, job="mix", shuffle_buffer=16, timeout=30, **kw
    )


def test_each_source_gives_its_exact_share_to_equal_ranks_with_its_name(two_sources: dict[str, Any]) -> None:
    src = two_sources
    a_share, b_share = shares(45, [2, 1])  # 30 and 15
    epochs = []
    for epoch in range(2):
        ranks = []
        for rank in range(2):
            ld = _loader(src, rank, 2)
            ld.set_epoch(epoch)
            ranks.append(list(ld))
        assert [len(r) for r in ranks] == [23, 23]  # 45 over 2 ranks: one padding repeat
        samples = ranks[0] + ranks[1]
        by_source = Counter(s["__source__"] for s in samples)
        assert by_source[src["a"]] + by_source[src["b"]] == 46 and by_source[src["a"]] in (a_share, a_share + 1)
        for s in samples:  # a sample comes from one of its source's shards
            assert s["__url__"] in (src["a_urls"] if s["__source__"] == src["a"] else src["b_urls"])
        a_ids = Counter(_id(s) for s in samples if s["__source__"] == src["a"])
        assert len(a_ids) == 30  # a's share is its size: every sample, each once (plus the padding repeat)
        b_ids = Counter(_id(s) for s in samples if s["__source__"] == src["b"])
        assert len(b_ids) == b_share and max(b_ids.values()) <= 2
        epochs.append(samples)
    # b's walk goes on: its 30 samples once over the two epochs (but the padding's repeat)
    walked = Counter(_id(s) for e in epochs for s in e if s["__source__"] == src["b"])
    assert len(walked) == 30 and max(walked.values()) <= 2
    assert [_id(s) for s in epochs[0]] != [_id(s) for s in epochs[1]]
    # the shard both sources list crossed the network once, like every other
    server = src["server"]
    for path in src["paths"]:
        gets = [r for r in server.requests if r.path == path.name and r.method == "GET" and r.status in (200, 206)]
        assert len(gets) == 1, (path.name, gets)
    assert len(_loader(src, 0, 2)) == 23  # a mixture's length is its own


def test_a_mixture_resumes_mid_epoch_on_another_world_size(two_sources: dict[str, Any]) -> None:
    src = two_sources
    whole = Counter(_id(s) + "@" + s["__source__"] for s in _loader(src, drop_last=True))
    assert sum(whole.values()) == 45
    states, first = [], Counter()
    for rank in range(2):
        ld = _loader(src, rank, 2, drop_last=True)
        it = iter(ld)
        for _ in range(9):
            s = next(it)
            first[_id(s) + "@" + s["__source__"]] += 1
        states.append(ld.state_dict())
        del it
    rest = Counter()
    for rank in range(3):
        ld = _loader(src, rank, 3, drop_last=True)
        ld.load_state_dict(states[rank % 2])
        got = list(ld)
        assert len(got) == 9  # 45 - 18 = 27 over 3 ranks
        rest.update(_id(s) + "@" + s["__source__"] for s in got)
    assert first + rest == whole
    other = _loader(src, mix={src["a"]: 1, src["b"]: 1}, drop_last=True)
    with pytest.raises(ValueError, match="another mixture"):
        other.load_state_dict(states[0])


def test_resampled_draws_shards_with_replacement_seeded_per_epoch(two_sources: dict[str, Any]) -> None:
    wds = pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    del wds
    import wdscache

    src = two_sources
    pattern = src["a_urls"][0].replace("a-000000", "a-{000000..000002}")
    assert pattern != src["a_urls"][0]

    def run(seed: int = 0, epoch: int | None = None) -> list[str]:
        ds = wdscache.WebDataset(pattern, cache_dir=src["cache"], resampled=True, seed=seed, job="resampled")
        ds = ds.with_epoch(25)
        if epoch is not None:
            ds.set_epoch(epoch)
        return [_id(s) for s in ds]

    first = run()
    assert len(first) == 25 and "__source__" not in next(
        iter(wdscache.WebDataset(pattern, cache_dir=src["cache"], resampled=True).with_epoch(3))
    )
    assert run() == first and run(seed=1) != first and run(epoch=1) != first
    # whole shards in order, drawn with replacement: runs of PER_SHARD from one shard
    for k in range(0, 20, PER_SHARD):
        assert len({i.split("#")[0] for i in first[k : k + PER_SHARD]}) == 1
    draws = [run(epoch=e)[0::PER_SHARD] for e in range(6)]
    assert any(len({d.split("#")[0] for d in draw}) < len(draw) for draw in draws)  # a shard drawn twice
    # the loader's next iteration is the next epoch: another draw
    ds = wdscache.WebDataset(pattern, cache_dir=src["cache"], resampled=True, job="resampled").with_epoch(25)
    one, two = [_id(s) for s in ds], [_id(s) for s in ds]
    assert one == first and two == run(epoch=1)
    # or the job's epoch_samples=, shared by ranks
    ranks = [
        [
            _id(s)
            for s in wdscache.WebDataset(
                pattern, cache_dir=src["cache"], resampled=True, epoch_samples=40, rank=r, world_size=2, job="resampled"
            )
        ]
        for r in range(2)
    ]
    assert [len(r) for r in ranks] == [20, 20]
    # a loader's iteration is one epoch: it needs the epoch's length (the WebDataset is endless)
    with pytest.raises(ConfigError, match="needs an epoch length: give epoch_samples=N"):
        list(CachedMultiLoader(pattern, cache_dir=src["cache"], resampled=True, job="resampled"))


def test_resampled_with_epoch_resumes_the_rest_of_its_iteration_then_the_next_epoch(
    two_sources: dict[str, Any],
) -> None:
    # with_epoch(25) cuts the loader's epoch, 25 rounded up to whole blocks (32): a checkpoint
    # names the loader's position, and the cut must be resumed too, or the resumed iteration
    # gives the 7 samples past the cut and runs on into the next epoch.
    pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    import wdscache

    src = two_sources
    pattern = src["a_urls"][0].replace("a-000000", "a-{000000..000002}")

    def made() -> Any:
        return wdscache.WebDataset(pattern, cache_dir=src["cache"], resampled=True, job="cut").with_epoch(25)

    ds = made()
    whole = [[_id(s) for s in ds] for _ in range(3)]
    ds = made()
    it = iter(ds)
    first = [_id(next(it)) for _ in range(5)]
    state = ds.state_dict()
    it.close()
    resumed = made()
    resumed.load_state_dict(state)
    assert first + [_id(s) for s in resumed] == whole[0]
    assert [_id(s) for s in resumed] == whole[1]  # then the next epoch, from its start
    # A checkpoint taken once an iteration's 25 are out resumes at the next epoch.
    ds = made()
    assert [_id(s) for s in ds] == whole[0]
    after = made()
    after.load_state_dict(ds.state_dict())
    assert [_id(s) for s in after] == whole[1] and [_id(s) for s in after] == whole[2]
    # set_epoch names that epoch's start, none of it out; a checkpoint loaded is the position as it says.
    ds = made()
    it = iter(ds)
    assert [_id(next(it)) for _ in range(5)] == whole[0][:5]
    it.close()
    ds.set_epoch(1)
    resumed = made()
    resumed.load_state_dict(ds.state_dict())
    assert [_id(s) for s in resumed] == whole[1]
    ds.load_state_dict(state)  # (5 of epoch 0 out)
    resumed = made()
    resumed.load_state_dict(ds.state_dict())
    assert [_id(s) for s in resumed] == whole[0][5:]


def test_bad_mixtures_are_refused_naming_the_argument(two_sources: dict[str, Any]) -> None:
    src = two_sources
    with pytest.raises(ConfigError, match="epoch_samples="):
        CachedMultiLoader(mix={src["a"]: 1}, cache_dir=src["cache"])
    with pytest.raises(ConfigError, match="epoch_samples= sets"):
        CachedMultiLoader(src["a"], epoch_samples=10, cache_dir=src["cache"])
    with pytest.raises(ConfigError, match="urls= or mix="):
        CachedMultiLoader(src["a"], mix={src["b"]: 1}, epoch_samples=10, cache_dir=src["cache"])
    with pytest.raises(ConfigError, match="positive finite"):
        CachedMultiLoader(mix={src["a"]: 0}, epoch_samples=10, cache_dir=src["cache"])
    with pytest.raises(ConfigError, match=r"mix\['nope.txt'\].*not a URL list file"):
        CachedMultiLoader(mix={"nope.txt": 1}, epoch_samples=10, cache_dir=src["cache"])
    with pytest.raises(ConfigError, match="num_nodes=2"):
        CachedMultiLoader(
            mix={src["a"]: 1}, epoch_samples=10, cache_dir=src["cache"], rank=0, world_size=2, node=0, num_nodes=2
        )


def _need_torch_jobs() -> None:
    """Skip a test whose torch scenario needs torch, torchdata and webdataset, if one is missing."""
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    pytest.importorskip(
        "torchdata.stateful_dataloader", reason="torchdata is not installed (scripts/test.sh installs it)"
    )
    pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")


@pytest.mark.slow
def test_mixtures_and_resampled_in_dataloader_workers(two_sources: dict[str, Any]) -> None:
    _need_torch_jobs()
    src = two_sources
    pattern = src["a_urls"][0].replace("a-000000", "a-{000000..000002}")
    out = run_json_job("tests.helpers.torch_mix_job", str(src["cache"]), src["a"], src["b"], pattern)
    a_share, b_share = shares(61, [3, 1])
    for epoch in range(2):
        ranks = [out["ranks"][rank][epoch] for rank in range(2)]
        assert [len(got) for got in ranks] == [31, 31]  # 61 over 2 ranks, whatever the workers
        by_source = Counter(i.rsplit("@", 1)[1] for got in ranks for i in got)
        assert sorted(by_source.values()) in ([b_share, a_share + 1], [b_share + 1, a_share])  # one padding repeat
    whole = Counter(out["whole"])
    assert sum(whole.values()) == 61
    assert Counter(i.rsplit("@", 1)[1] for i in out["whole"]) == {src["a"]: a_share, src["b"]: b_share}
    assert Counter(out["first"]) + Counter(out["rest"]) == whole and len(out["first"]) == 12
    assert Counter(out["ranks"][0][0] + out["ranks"][1][0]) - whole in ({}, Counter(out["whole"][:1]))
    draws = out["resampled"]
    for epoch in range(2):
        assert Counter(w for _, w in draws[epoch]) == {0: 12, 1: 12}  # each worker its with_epoch(12)
        assert all(u.split("#")[0] in src["a_urls"] for u, _ in draws[epoch])
    assert [u for u, _ in draws[0]] != [u for u, _ in draws[1]]


def test_webdataset_takes_a_mixture_too(two_sources: dict[str, Any]) -> None:
    pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    import wdscache

    src = two_sources
    ds = wdscache.WebDataset(mix={src["a"]: 1, src["b"]: 3}, epoch_samples=20, cache_dir=src["cache"], job="wds-mix")
    got = list(ds.to_tuple("__source__", "__url__"))
    assert Counter(s for s, _ in got) == {src["a"]: 5, src["b"]: 15} and len(ds) == 20


@pytest.mark.slow
def test_a_cold_mixture_counted_for_longer_than_the_agent_keeps_a_silent_reader_delivers_its_shares(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], shard_server: Any, tmp_path: Path
) -> None:
    a = dataset(1, samples=PER_SHARD, payload=200, prefix="ca", list_name="ca.txt")
    b = dataset(2, samples=PER_SHARD, payload=20_000, prefix="cb", list_name="cb.txt")
    cache = tmp_path / "cache"
    agent = start_agent(cache, a.list_file, "--workers", "2", "--reader-timeout", "2")
    shard_server.rate = 60_000  # b's shards (about 200 kB each) take about 3 s to count: longer than 2 s
    ld = CachedMultiLoader(
        mix={str(a.list_file): 1, str(b.list_file): 3}, epoch_samples=20, cache_dir=cache, job="cold", timeout=30
    )
    got = list(ld)
    assert Counter(s["__source__"] for s in got) == {str(a.list_file): 5, str(b.list_file): 15}
    assert "--reader-timeout" not in agent.stderr_text(), agent.stderr_tail()  # no reader of the epoch went silent


def test_a_handler_that_says_stop_while_a_mixture_is_counted_skips_that_shard(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    from tests.test_corrupt_copies import clobber_header

    a = dataset(1, samples=PER_SHARD, payload=200, prefix="sa", list_name="sa.txt")
    b = dataset(2, samples=PER_SHARD, payload=200, prefix="sb", list_name="sb.txt")
    clobber_header(b.paths[1])  # damaged at its source: every copy is
    cache = tmp_path / "cache"
    start_agent(cache, a.list_file, "--workers", "2")
    told: list[Exception] = []

    def stop(exc: Exception) -> bool:
        told.append(exc)
        return False

    ld = CachedMultiLoader(
        mix={str(a.list_file): 1, str(b.list_file): 1},
        epoch_samples=20,
        cache_dir=cache,
        job="stop",
        timeout=30,
        on_error=stop,
    )
    got = list(ld)
    assert told and b.urls[1] in str(told[0])
    assert len(got) == 20 and b.urls[1] not in {s["__url__"] for s in got}
    assert Counter(s["__source__"] for s in got) == {str(a.list_file): 10, str(b.list_file): 10}


def test_len_under_resampled_with_epoch_is_unknown_outside_a_worker(two_sources: dict[str, Any]) -> None:
    pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    import wdscache

    src = two_sources
    ds = wdscache.WebDataset(src["a"], cache_dir=src["cache"], resampled=True, job="len").with_epoch(25)
    with pytest.raises(TypeError, match="with_epoch"):
        len(ds)
    both = wdscache.WebDataset(src["a"], cache_dir=src["cache"], resampled=True, epoch_samples=40, job="len")
    assert len(both) == 40


@pytest.mark.slow
def test_resampled_without_an_epoch_length_is_endless_cut_outside_as_in_webdataset(
    two_sources: dict[str, Any],
) -> None:
    # OpenCLIP's way: the resampled source inside webdataset's DataPipeline (or WebLoader), the
    # cut on the outer one, or a loop that stops after its steps. The source is endless: the
    # loader's epochs of ENDLESS_EPOCH samples one after another, each another draw.
    wds = pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    import wdscache
    from wdscache.training.pipeline import ENDLESS_EPOCH

    src = two_sources
    pattern = src["a_urls"][0].replace("a-000000", "a-{000000..000002}")

    def made(**kw: Any) -> Any:
        return wdscache.WebDataset(pattern, cache_dir=src["cache"], resampled=True, job="endless", **kw)

    chunks = made().with_epoch(ENDLESS_EPOCH)
    epochs = [[_id(s) for s in chunks] for _ in range(2)]  # epochs 0 and 1, ENDLESS_EPOCH each
    assert [len(e) for e in epochs] == [ENDLESS_EPOCH] * 2 and epochs[0] != epochs[1]
    whole = epochs[0] + epochs[1]
    assert [_id(s) for s in islice(made(), 2 * ENDLESS_EPOCH)] == whole
    with pytest.raises(TypeError, match="endless"):  # webdataset's resampled dataset has no length either
        len(made())
    # An outer cut yields its n; the next iteration begins the epoch after the last one begun.
    n = 100
    loader = wds.WebLoader(made(), batch_size=None).with_epoch(n)
    assert [[_id(s) for s in loader] for _ in range(2)] == [whole[:n], epochs[1][:n]]
    outer = wds.DataPipeline(made(), wds.shuffle(100), wds.to_tuple("__url__", "__key__")).with_epoch(n)
    runs = [[f"{u}#{k}" for u, k in outer] for _ in range(2)]
    assert [len(r) for r in runs] == [n, n]
    for run, epoch in zip(runs, epochs):  # (webdataset's shuffle of 100: from the first n + 100 of its epoch)
        assert not Counter(run) - Counter(epoch[: n + 100])
    assert [_id(s) for s in islice(made(), n)] == whole[:n]
    # every rank the same counts: its share of epochs of ENDLESS_EPOCH for each rank
    ranks = [[_id(s) for s in islice(made(rank=r, world_size=2), ENDLESS_EPOCH + 8)] for r in range(2)]
    for r, got in enumerate(ranks):
        share = made(rank=r, world_size=2).with_epoch(ENDLESS_EPOCH)
        assert got == [_id(s) for _ in range(2) for s in share][: ENDLESS_EPOCH + 8]
    assert ranks[0] != ranks[1]


@pytest.mark.slow
def test_an_endless_resampled_dataset_in_dataloader_workers_cut_outside(two_sources: dict[str, Any]) -> None:
    # OpenCLIP's pipeline in a DataLoader of 2 workers: each worker yields its cut, and the next
    # DataLoader epoch is the loader's next epoch in each worker (another draw), whether the
    # workers persist or are made anew from the dataset each epoch; two ranks, equal counts.
    _need_torch_jobs()
    src = two_sources
    pattern = src["a_urls"][0].replace("a-000000", "a-{000000..000002}")
    out = run_json_job("tests.helpers.torch_endless_job", str(src["cache"]), pattern)
    cut = 40
    ranks = out["persistent=True"]
    assert out["persistent=False"] == ranks  # workers made anew begin the epoch after their last one too
    for epochs in ranks:
        for got in epochs:
            assert Counter(i.rsplit("@", 1)[1] for i in got) == {"0": cut, "1": cut}
            assert all(i.split("#")[0] in src["a_urls"] for i in got)
        assert len({tuple(e) for e in epochs}) == 3  # each DataLoader epoch another draw
    assert ranks[0] != ranks[1]
    first, second = out["webloader"]
    assert len(first) == len(second) == cut and first != second
    # a StatefulDataLoader's state, loaded into a new one with the same workers, resumes exactly
    # (taken in each worker's second epoch; the rest runs into their third)
    from wdscache.training.pipeline import ENDLESS_EPOCH

    assert len(out["stateful_first"]) == 2 * ENDLESS_EPOCH + 16
    assert len(out["stateful_then"]) == 2 * ENDLESS_EPOCH and out["stateful_resumed"] == out["stateful_then"]


def test_an_endless_resampled_dataset_resumes_the_rest_of_its_epoch_then_the_next_ones(
    two_sources: dict[str, Any],
) -> None:
    pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    import wdscache
    from wdscache.training.pipeline import ENDLESS_EPOCH

    src = two_sources
    pattern = src["a_urls"][0].replace("a-000000", "a-{000000..000002}")

    def made() -> Any:
        return wdscache.WebDataset(pattern, cache_dir=src["cache"], resampled=True, job="endless-resume")

    whole = [_id(s) for s in islice(made(), 2 * ENDLESS_EPOCH + 50)]
    for stop in (100, ENDLESS_EPOCH):  # in an epoch; at its end, before the next one began
        ds = made()
        it = iter(ds)
        first = [_id(next(it)) for _ in range(stop)]
        state = ds.state_dict()
        it.close()
        resumed = made()
        resumed.load_state_dict(state)
        assert first + [_id(s) for s in islice(resumed, len(whole) - stop)] == whole, stop


def test_a_pipe_source_in_a_mixture_is_refused_as_a_loader_refuses_it(two_sources: dict[str, Any]) -> None:
    src = two_sources
    with pytest.raises(ConfigError, match=r"mix\['pipe:cat x.tar'\]: a loader does not run pipe: commands"):
        CachedMultiLoader(mix={src["a"]: 1, "pipe:cat x.tar": 1}, epoch_samples=10, cache_dir=src["cache"])


def test_an_indexed_source_mixed_with_a_plain_list_keeps_its_index_checked(
    two_sources: dict[str, Any], dataset: Callable[..., Any], run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    src = two_sources
    c = dataset(2, samples=PER_SHARD, payload=200, prefix="c", list_name="c-own.txt")
    index = tmp_path / "lists" / "c.json"
    assert run_cli("index", *c.urls, "-o", index).returncode == 0
    doc = json.loads(index.read_text())
    doc["shardlist"][1]["nsamples"] += 1  # the index says one sample more than the shard holds
    index.write_text(json.dumps(doc))
    with pytest.raises(WdsCacheError) as raised:
        list(_loader(src, mix={str(index): 1, src["b"]: 1}, epoch_samples=20))
    assert c.urls[1] in str(raised.value) and "but the shard index says" in str(raised.value), raised.value
