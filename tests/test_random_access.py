"""wdscache.ShardListDataset: ds[i] is what wids.ShardListDataset gives for i, read through a real
agent (over the real HTTP shard server, or from local paths), in this process and in DataLoader
workers under torch's samplers; wids 0.1.11 is the byte reference."""

from __future__ import annotations

import contextlib
import fractions
import gzip
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scripts.shard_maker import make_shard
from tests.helpers.agents import kill_agent
from tests.helpers.procs import run_json_job
from tests.helpers.testdata import TESTDATA
from tests.helpers.waits import wait_for
from wdscache import (
    CachedMultiLoader,
    ConfigError,
    FetchError,
    ShardClient,
    ShardError,
    ShardIndexError,
    ShardListDataset,
)
from wdscache.shared.stats import collect
from wdscache.training import direct
from wdscache.training.random_access import _Session

wids = pytest.importorskip("wids", reason="wids is not installed (scripts/test.sh installs it)")
webdataset = pytest.importorskip("webdataset", reason="webdataset is not installed (scripts/test.sh installs it)")
pytest.importorskip("PIL", reason="pillow is not installed (scripts/test.sh installs it)")

ROOT = Path(__file__).resolve().parents[1]


def _image(kind: str, seed: int) -> bytes:
    import PIL.Image

    rng = random.Random(seed)
    image = PIL.Image.new("RGB", (5, 4), tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, format=kind)
    return out.getvalue()


def _shards(folder: Path, n: int, per_shard: int) -> list[Path]:
    """Shards whose samples every default decoder of wids touches: images, text, a class, JSON,
    a gzip'd text, a numpy array, and an extension it leaves alone."""
    import numpy as np

    paths = []
    for s in range(n):
        samples = []
        for i in range(per_shard):
            arr = io.BytesIO()
            np.save(arr, np.arange(i + 3, dtype=np.int16))
            samples.append(
                {
                    "__key__": f"s{s}/{i:03d}",
                    "jpg": _image("JPEG", 10 * s + i),
                    "png": _image("PNG", 10 * s + i + 1),
                    "txt": f"text {s} {i} é".encode(),
                    "cls": str(i % 5).encode(),
                    "json": json.dumps({"s": s, "i": i}).encode(),
                    "txt.gz": gzip.compress(f"zipped {s} {i}".encode(), mtime=0),
                    "npy": arr.getvalue(),
                    "bin": bytes(range(i, i + 40)),
                }
            )
        paths.append(make_shard(folder / f"part-{s:04d}.tar", samples))
    return paths


def _index(path: Path, urls: list[str], per_shard: int) -> Path:
    path.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": u, "nsamples": per_shard} for u in urls]}))
    return path


def _plain(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample's values compared as they are (PIL images by pixels, arrays by items)."""
    import numpy as np

    out = {}
    for key, value in sample.items():
        if isinstance(value, io.BytesIO):
            value = ("bytes", value.getvalue(), value.tell())
        elif hasattr(value, "getdata"):
            value = ("image", value.format, value.mode, value.size, value.tobytes())
        elif isinstance(value, np.ndarray):
            value = ("array", value.dtype.str, value.tolist())
        elif isinstance(value, np.integer):
            value = int(value)
        out[key] = value
    return out


@pytest.fixture
def local_index(tmp_path: Path) -> Path:
    """An index of 3 local shards of 6 samples, its URLs relative to its folder (as wids writes them)."""
    data = tmp_path / "data"
    data.mkdir()
    paths = _shards(data, 3, 6)
    return _index(data / "index.json", [p.name for p in paths], 6)


@pytest.mark.parametrize("transformations", ["PIL", "raw"])
def test_every_sample_is_what_wids_returns(
    local_index: Path,
    start_agent: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    transformations: str,
) -> None:
    monkeypatch.chdir(tmp_path)  # the index named relative to here: wids' __shard__ keeps it so
    kw: dict[str, Any] = {} if transformations == "PIL" else {"transformations": []}
    cache = tmp_path / "cache"
    start_agent(cache, local_index, "--workers", "2")
    kw["lru_size"] = 2  # fewer than the shards: get_stats() counts misses as wids' LRU does
    ours = ShardListDataset("data/index.json", cache_dir=cache, **kw)
    with pytest.warns(UserWarning) if transformations == "PIL" else contextlib.nullcontext():
        reference = wids.ShardListDataset("data/index.json", cache_dir=str(tmp_path / "wids"), **kw)
    assert len(ours) == len(reference) == 18
    order = list(range(18))
    random.Random(7).shuffle(order)
    try:
        for i in order:
            mine, theirs = ours[i], reference[i]
            assert list(mine) == list(theirs)  # the same keys, in the same order
            assert _plain(mine) == _plain(theirs), i
        accesses, misses = ours.get_stats()
        assert (accesses, misses) == reference.get_stats() and accesses == 18 and misses > 3
        assert ours.cum_lengths == list(reference.cum_lengths) == [6, 12, 18]
        sample = ours[13]
        assert (sample["__key__"], sample["__index__"], sample["__shard__"], sample["__shardindex__"]) == (
            "s2/001",
            13,
            "data/part-0002.tar",
            1,
        )
    finally:
        ours.close()


def test_an_index_file_keeps_each_entrys_own_keys_as_wids_does(start_agent: Callable[..., Any], tmp_path: Path) -> None:
    # An entry's "dataset" is its samples' __dataset__ in wids, read from a file as from a list.
    data = tmp_path / "data"
    data.mkdir()
    paths = _shards(data, 2, 3)
    entries = [
        {"url": paths[0].name, "nsamples": 3, "dataset": "laion", "split": "train"},
        {"split": "val", "url": paths[1].name, "dataset": "coco", "nsamples": 3, "weight": 0.5},
    ]
    index = data / "index.json"
    # The index's own name and weight go to each entry without its own, and name the dataset.
    index.write_text(json.dumps({"wids_version": 1, "name": "mixed", "weight": 2.0, "shardlist": entries}))
    cache = tmp_path / "cache"
    start_agent(cache, index)
    reference = wids.ShardListDataset(str(index), cache_dir=str(tmp_path / "wids"), transformations=[])
    with ShardListDataset(index, cache_dir=cache, transformations=[]) as ours:
        assert ours.shards == reference.shards
        assert [list(e) for e in ours.shards] == [list(e) for e in reference.shards]  # keys in their order
        assert ours.shards[0]["weight"] == 2.0 and ours.dataset_name == reference.dataset_name == "mixed"
        assert ours.shards[1] == {**entries[1], "url": str(paths[1]), "name": "mixed"}  # its own weight kept
        datasets = [ours[i]["__dataset__"] for i in range(6)]
        assert datasets == [reference[i]["__dataset__"] for i in range(6)] == ["laion"] * 3 + ["coco"] * 3


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_small_shards_and_short_runs_are_what_wids_returns(start_agent: Callable[..., Any], tmp_path: Path) -> None:
    # A table is asked of a worker 2048 samples at a time, as the places of their bytes in the
    # cache file, however few those bytes: a shard of a few hundred bytes, the last sample of
    # 2049 tiny ones, and a short run past a member webdataset skips (no extension).
    data = tmp_path / "data"
    data.mkdir()
    shards = [
        _tar(data / "tiny.tar", [(f"t{i}.txt", f"tiny {i}".encode()) for i in range(3)]),
        _tar(data / "many.tar", [(f"{i:06d}.txt", b"x" * 10) for i in range(2049)]),
        _tar(
            data / "gap.tar",
            [*((f"{i:03d}.bin", bytes([i]) * 2000) for i in range(10)), ("README", bytes(20000)), ("zzz.txt", b"tail")],
        ),
    ]
    if (TESTDATA / "compressed.tar").is_file():  # webdataset's own: 3 samples of ~100 bytes
        shards.append(Path(shutil.copy(TESTDATA / "compressed.tar", data / "compressed.tar")))
    counts = [len(list(webdataset.WebDataset(str(p), shardshuffle=False, empty_check=False))) for p in shards]
    index = data / "index.json"
    index.write_text(
        json.dumps({"wids_version": 1, "shardlist": [{"url": p.name, "nsamples": n} for p, n in zip(shards, counts)]})
    )
    cache = tmp_path / "cache"
    start_agent(cache, index)
    ours = ShardListDataset(index, cache_dir=cache, transformations=[])
    reference = wids.ShardListDataset(str(index), cache_dir=str(tmp_path / "wids"), transformations=[])
    try:
        assert len(ours) == len(reference) == sum(counts)
        for i in reversed(range(len(ours))):  # the last shard's table first
            assert _plain(ours[i]) == _plain(reference[i]), i
    finally:
        ours.close()


@pytest.mark.slow
def test_dataloader_workers_under_torch_samplers_read_what_wids_reads(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], shard_server: Any, tmp_path: Path
) -> None:
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    urls, _, list_file = dataset(4, samples=11, payload=700)
    index = _index(tmp_path / "index.json", urls, 11)
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--workers", "2")
    out = run_json_job("tests.helpers.random_access_job", str(index), str(cache), str(tmp_path / "wids"))
    reference = out["wids"]
    assert out["len"] == len(reference) == 44

    def check(got: list[list[Any]]) -> list[int]:
        indices = [dict(d)["__index__"] for d in got]
        assert got == [reference[i] for i in indices]  # byte for byte, every key in order
        return indices

    ranks = [check(got) for got in out["distributed"]]
    assert sorted(ranks[0] + ranks[1]) == list(range(44))  # 22 each, together every index once
    assert len(ranks[0]) == len(ranks[1]) == 22
    assert len(check(out["weighted"])) == 40
    assert sorted(check(out["chunked"])) == list(range(44))
    assert sorted(check(out["spawned"])) == list(range(44))
    assert out["is_dataset"] is True
    assert out["concat"][0] == 88 and out["concat"][1] == out["concat"][2]
    # Every shard downloaded once, however many processes indexed it (and wids once more for itself).
    for url in urls:
        name = url.rsplit("/", 1)[1]
        gets = [r for r in shard_server.requests if r.path.endswith(name) and r.method == "GET"]
        assert len(gets) == 2, (name, [(g.range, g.status) for g in gets])


def test_a_private_agent_serves_it_and_pins_go_with_the_lru(local_index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[], lru_size=1)
    try:
        keys = [ds[i]["__key__"] for i in (0, 17, 6, 1)]
        assert keys == ["s0/000", "s2/005", "s1/000", "s0/001"]
        stats = collect(cache, timeout=5.0)
        assert stats["agent"]
        assert stats["agent"]["pinned"] == 1  # lru_size=1: one shard held at a time
    finally:
        ds.close()


def test_bad_indices_raise_index_error(local_index: Path, start_agent: Callable[..., Any], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[])
    try:
        for bad in (-1, 18, 10**12):
            with pytest.raises(IndexError, match=f"index {bad} is out of range: the dataset has 18 samples"):
                ds[bad]
        with pytest.raises(TypeError):
            ds["3"]
        assert ds[17]["__key__"] == "s2/005"
    finally:
        ds.close()


def test_a_shard_that_cannot_be_fetched_is_named(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], shard_server: Any, tmp_path: Path
) -> None:
    urls, paths, list_file = dataset(2, samples=4, payload=300)
    paths[1].unlink()  # the server answers 404 for it
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--retries", "0")
    ds = ShardListDataset([{"url": u, "nsamples": 4} for u in urls], cache_dir=cache, transformations=[])
    try:
        assert ds[3]["__key__"] == "s00000_00003"
        with pytest.raises(FetchError, match=urls[1].rsplit("/", 1)[1]) as info:
            ds[5]
        assert info.value.url == urls[1]
        assert ds[0]["__key__"] == "s00000_00000"  # the others read on
    finally:
        ds.close()


def test_it_pickles_without_its_sockets(local_index: Path, start_agent: Callable[..., Any], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[])
    try:
        first = ds[4]["__key__"]
        copy = pickle.loads(pickle.dumps(ds))
        try:
            assert copy[4]["__key__"] == first
        finally:
            copy.close()
    finally:
        ds.close()


def test_an_index_that_is_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="shard index"):
        ShardListDataset({"shardlist": []}, cache_dir=tmp_path)
    with pytest.raises(ShardIndexError, match=r"shardlist\[1\] \('b.tar'\): \"nsamples\" is missing"):
        ShardListDataset([{"url": "a.tar", "nsamples": 1}, {"url": "b.tar"}], cache_dir=tmp_path)


def test_a_shard_list_of_numpy_integers_reads_as_wids_reads_it(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    import numpy as np

    # As pandas' to_dict("records") gives a table's counts and sizes.
    paths = sorted(local_index.parent.glob("*.tar"))
    shards = [{"url": str(p), "nsamples": np.int64(6), "filesize": np.uint64(p.stat().st_size)} for p in paths]
    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    reference = wids.ShardListDataset(shards, cache_dir=str(tmp_path / "wids"), transformations=[])
    with ShardListDataset(shards, cache_dir=cache, transformations=[]) as ours:
        assert len(ours) == len(reference) == 18
        assert ours.lengths == [6, 6, 6]
        for i in (0, 7, 17):
            assert _plain(ours[i]) == _plain(reference[i]), i


@pytest.mark.parametrize(
    ("value", "shown"), [(2.5, "2.5"), ("3", '"3"'), (True, "true"), (fractions.Fraction(5, 2), "Fraction(5, 2)")]
)
def test_a_shard_list_entry_whose_count_is_no_whole_number_is_named(tmp_path: Path, value: Any, shown: str) -> None:
    shards = [{"url": "a.tar", "nsamples": 1}, {"url": "b.tar", "nsamples": value}]
    with pytest.raises(ShardIndexError) as info:
        ShardListDataset(shards, cache_dir=tmp_path)
    assert str(info.value) == f"shards: shardlist[1] ('b.tar'): \"nsamples\" must be a whole number >= 0, not {shown}"


@pytest.mark.slow
def test_it_reads_on_across_a_restarted_agent(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    agent = start_agent(cache, local_index, "--workers", "2")
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[])
    try:
        before = {i: ds[i][".bin"].getvalue() for i in (0, 1)}
        agent.stop()
        again = start_agent(cache, local_index, "--workers", "2")
        assert ds[7]["__key__"] == "s1/001"  # a new shard: the new run is met, hello again
        assert {i: ds[i][".bin"].getvalue() for i in (0, 1)} == before
        # Shard 0 pinned at the new run, and shard 1 too unless an open waited for the new run
        # to check a shard against its source (it does so ahead of the opens, as it can): while
        # we wait, we hold no other pin.
        assert again.stats()["agent"]["pinned"] in (1, 2)
    finally:
        ds.close()


def test_a_shard_that_does_not_hold_the_samples_the_index_says_is_named(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    urls, _, list_file = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, list_file)
    ds = ShardListDataset(
        [{"url": urls[0], "nsamples": 4}, {"url": urls[1], "nsamples": 5}], cache_dir=cache, transformations=[]
    )
    try:
        assert len(ds) == 9
        assert ds[3]["__key__"] == "s00000_00003"
        with pytest.raises(ShardError, match="4 samples, but the shard index says 5") as info:
            ds[8]
        assert urls[1] in str(info.value)
    finally:
        ds.close()


@pytest.mark.parametrize("where", ["file", "http"])
def test_a_download_whose_count_is_not_the_indexs_is_a_shard_error_naming_both(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path, where: str
) -> None:
    # The agent reads the index too, so it counts the download against it before publishing
    # it, and fails the shard: readers hear the shard is bad (ShardError), not that it could
    # not be fetched (FetchError, an OSError).
    urls, paths, _ = dataset(2, samples=4, payload=300)
    if where == "file":
        urls = [p.as_uri() for p in paths]
    entries = [{"url": urls[0], "nsamples": 4}, {"url": urls[1], "nsamples": 5}]
    index = tmp_path / "lists" / "index.json"
    index.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    cache = tmp_path / "cache"
    start_agent(cache, index, "--no-shuffle")
    expected = f"bad shard {urls[1]}: 4 samples, but the shard index says 5"
    with ShardListDataset(entries, cache_dir=cache, transformations=[]) as ds:
        assert ds[3]["__key__"] == "s00000_00003"
        for _ in range(2):  # as the agent fails it, and as it answers for a failed shard
            with pytest.raises(ShardError) as info:
                ds[6]
            assert type(info.value) is ShardError and not isinstance(info.value, OSError)
            assert (str(info.value), info.value.url) == (expected, urls[1])
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20) as loader:
        with pytest.raises(ShardError) as caught:
            list(loader)
    assert type(caught.value) is ShardError and str(caught.value) == expected
    with ShardClient(cache, timeout=20) as client:  # shard by shard, the same
        with pytest.raises(ShardError) as caught:
            client.open(urls[1])
    assert type(caught.value) is ShardError and str(caught.value) == expected


def test_a_cache_dir_whose_folder_does_not_exist_is_refused_at_once(local_index: Path, tmp_path: Path) -> None:
    typo = tmp_path / "scrach" / "wdscache"
    with pytest.raises(ConfigError, match=f"cache_dir='{typo}' does not exist, nor does its folder"):
        ShardListDataset(local_index, cache_dir=typo, transformations=[])
    assert not (tmp_path / "scrach").exists()  # no agent was started, no folder made


def _unclosed(mode: str, index: Path, cache: Path) -> list[str]:
    """Run :mod:`tests.helpers.unclosed_job`; its lines. It must end well within its deadline:
    a context collected with sockets left open waits in ZeroMQ's term() forever."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "tests.helpers.unclosed_job", mode, str(index), str(cache), "30"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{mode}: still running after 60 s: {exc.stdout!r} {exc.stderr!r}")
    assert r.returncode == 0, f"{mode}: {r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout.splitlines()


def test_datasets_dropped_without_close_are_collected_without_a_hang(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    start_agent(cache, local_index, "--workers", "2")
    lines = _unclosed("dataset", local_index, cache)
    assert lines == ["0 s0/000", "collected", "1 s0/001", "collected", "2 s0/002", "collected", "done"]
    # A forked child drops its copy of the parent's session (whose sockets it must not close)
    # and its own; the parent reads on over its sockets.
    lines = _unclosed("fork", local_index, cache)
    assert lines == ["parent s0/000", "child s1/001", "parent s0/001", "collected", "done"]


@pytest.mark.parametrize(
    "mode, expected",
    [
        # An epoch left after its first sample, its iterator held in a reference cycle.
        ("loader", ["0 s0/000", "collected", "1 s0/000", "collected", "done"]),
        # An iterator dropped before its first sample: its report thread held the stream, reported
        # on forever, and the agent kept its reader. Then a loader dropped with it. (3 shards of 6)
        ("unstarted", ["samples 18", "reporters 0", "reporters 0", "done"]),
    ],
)
def test_a_loader_left_unclosed_is_collected_without_a_hang_and_stops_reporting(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path, mode: str, expected: list[str]
) -> None:
    cache = tmp_path / "cache"
    start_agent(cache, local_index, "--no-shuffle")
    assert _unclosed(mode, local_index, cache) == expected


def test_its_errors_show_no_secret_of_a_url(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    data = dataset(2, samples=4, payload=300)
    urls = [u.replace("://", "://USERSECRET:PASSWORDSECRET@", 1) + "?token=TOKENSECRET&v=1" for u in data.urls]
    data.list_file.write_text("\n".join(urls) + "\n")
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file)
    ds = ShardListDataset([{"url": u, "nsamples": 4} for u in urls], cache_dir=cache, transformations=[])
    try:
        assert ds[0]["__key__"] == "s00000_00000"
        # Its cache file cut short behind the agent's back, while pinned and open.
        shards = cache / "shards"
        (cached,) = [Path(d) / n for d, _, names in os.walk(shards) for n in names if n.endswith("-shard-000000.tar")]
        os.truncate(cached, 0)
        with pytest.raises(ShardError, match="shorter than when its table was made") as info:
            ds[1]
        shown = str(info.value) + repr(info.value)
        assert "shard-000000.tar" in shown and "***" in shown
        assert not [s for s in ("USERSECRET", "PASSWORDSECRET", "TOKENSECRET") if s in shown], shown
        assert info.value.url == urls[0]  # the attribute keeps the full URL
        assert ds[5]["__key__"] == "s00001_00001"  # the other shard reads on
    finally:
        ds.close()


def test_a_field_longer_than_one_pread_is_read_whole_and_a_file_cut_short_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linux returns at most 2,147,479,552 bytes a pread: the bound made small here (tests/test_direct.py reads 2.2 GB).
    monkeypatch.setattr(direct, "PREAD_MAX", 100_000)
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(2)
    fields = [rng.randbytes(1_000_000 + i) for i in range(3)]
    shard = make_shard(data / "big.tar", [{"__key__": f"k{i}", "bin": f, "txt": b"t"} for i, f in enumerate(fields)])
    ds = ShardListDataset(
        _index(data / "index.json", [shard.name], 3), cache_dir=tmp_path / "cache", transformations=[]
    )
    try:
        assert [ds[i][".bin"].getvalue() for i in (2, 0, 1)] == [fields[2], fields[0], fields[1]]
        (cached,) = [Path(d) / n for d, _, names in os.walk(tmp_path / "cache" / "shards") for n in names]
        os.truncate(cached, 1_500_000)  # behind the agent's back, while pinned and open
        with pytest.raises(ShardError, match="shorter than when its table was made"):
            ds[1]
    finally:
        ds.close()


@pytest.mark.slow
def test_a_new_shard_read_as_the_agent_restarts_is_read_whole(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    agent = start_agent(cache, local_index, "--workers", "2")
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[], lru_size=1)
    reference = wids.ShardListDataset(str(local_index), cache_dir=str(tmp_path / "wids"), transformations=[])
    restarted: list[Any] = []
    table = _Session._table

    def table_then_restart(session: _Session, shard: int, identity: tuple[int, ...]) -> Any:
        """The agent SIGKILLed and started again right after a new shard's table came: the next
        request to it (a release, say) finds the new run."""
        made = table(session, shard, identity)
        if shard == 1 and not restarted:
            kill_agent(agent)
            restarted.append(start_agent(cache, local_index, "--workers", "2"))
        return made

    monkeypatch.setattr(_Session, "_table", table_then_restart)
    try:
        assert _plain(ds[0]) == _plain(reference[0])
        for i in (7, 8, 13, 2):  # shard 1 opened across the restart, then shard 2, then 0 again
            assert _plain(ds[i]) == _plain(reference[i]), i
        assert restarted and restarted[0].stats()["agent"]["pinned"] == 1
    finally:
        ds.close()


@pytest.mark.slow
@pytest.mark.parametrize("parent_read_in", ["main", "thread"])
def test_a_forked_dataloader_worker_keeps_none_of_its_parents_cache_files_open(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path, parent_read_in: str
) -> None:
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    cache = tmp_path / "cache"
    start_agent(cache, local_index, "--workers", "2")
    job = [sys.executable, "-m", "tests.helpers.random_access_fork_job", str(local_index), str(cache), "0", "7"]
    r = subprocess.run(
        job + ([] if parent_read_in == "main" else ["thread"]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    parent, worker = out["parent"], out["worker"]
    assert (parent["key"], worker["key"]) == ("s0/000", "s1/001")
    assert worker["pid"] != out["parent_pid"] == parent["pid"]
    assert [Path(f).name.endswith("-part-0000.tar") for f in parent["files"]] == [True]
    # The worker holds its own shard's file alone: the parent's pin stays the parent's.
    assert [Path(f).name.endswith("-part-0001.tar") for f in worker["files"]] == [True], worker["files"]


@pytest.mark.slow
def test_a_process_reading_only_shards_it_holds_keeps_them_and_one_dropped_as_silent_pins_anew(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    """The agent drops a reader silent for --reader-timeout and lets go of its pins. One that
    reads only the shards it holds pins no other, but says it is there (a ping every PING_EVERY),
    so it keeps them; one that read nothing for that long is dropped, and at its next read it
    pins its shard again rather than read a file the agent may have evicted meanwhile."""
    import time

    cache = tmp_path / "cache"
    # A timeout of 4 pings: a loaded machine may hold the agent's loop up a while.
    agent = start_agent(cache, local_index, "--reader-timeout", "4")
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[])
    try:
        first = [ds[i][".bin"].getvalue() for i in range(6)]
        until = time.monotonic() + 5.0  # longer than the timeout, on shard 0 alone
        while time.monotonic() < until:
            assert [ds[i][".bin"].getvalue() for i in range(6)] == first
            time.sleep(0.05)
        assert "silent for" not in agent.stderr_text(), agent.stderr_tail()
        assert agent.stats()["agent"]["pinned"] == 1
        wait_for(lambda: "silent for" in agent.stderr_text(), 20, "the idle reader was never dropped")
        wait_for(lambda: agent.stats()["agent"]["pinned"] == 0, 10, "its pin was kept")
        assert [ds[i][".bin"].getvalue() for i in range(6)] == first
        assert agent.stats()["agent"]["pinned"] == 1  # pinned again, its file opened anew
    finally:
        ds.close()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ShardListDataset.*read latest")  # random reads, lru_size=1: as meant
def test_threads_of_a_process_read_at_once_each_over_a_session_of_its_own(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    """A thread pool reading one dataset: each thread has its own sockets (ZeroMQ's are one
    thread's), pins and files, so every sample is its bytes; those of threads that ended go at
    the next thread's first read, and close() ends them all."""
    from concurrent.futures import ThreadPoolExecutor

    cache = tmp_path / "cache"
    agent = start_agent(cache, local_index)
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[], lru_size=1)
    try:
        want = [ds[i][".bin"].getvalue() for i in range(len(ds))]

        def read(seed: int) -> list[int]:
            rng = random.Random(seed)
            order = [rng.randrange(len(ds)) for _ in range(200)]
            return [i for i in order if ds[i][".bin"].getvalue() != want[i]]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(read, range(8))) == [[]] * 8
        # The pool's threads ended: a new thread's first read lets go of their pins and files.
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(read, 9).result() == []
        held = [f for f in os.listdir("/proc/self/fd") if _target(f).startswith(f"{cache}{os.sep}shards")]
        assert 1 <= len(held) <= 2, held  # the main thread's file, and the new thread's
    finally:
        ds.close()
    wait_for(lambda: agent.stats()["agent"]["pinned"] == 0, 10, "the threads' pins outlived close()")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ShardListDataset.*read latest")  # random reads, lru_size=1: as meant
def test_threads_switching_at_every_step_share_the_datasets_bookkeeping_without_an_error(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    """The LRU count of get_stats() and the sessions by thread are the dataset's, shared by its
    threads: with the interpreter switching threads as often as it can, new threads starting while
    others read, no read raises (a check-then-act on them raised KeyError or "dictionary changed
    size during iteration" when another thread changed them in between)."""
    from concurrent.futures import ThreadPoolExecutor

    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    ds = ShardListDataset(local_index, cache_dir=cache, transformations=[], lru_size=1)
    interval = sys.getswitchinterval()
    try:
        want = [ds[i][".bin"].getvalue() for i in range(len(ds))]

        def read(seed: int) -> int:
            rng = random.Random(seed)
            return sum(ds[i][".bin"].getvalue() == want[i] for i in (rng.randrange(len(ds)) for _ in range(300)))

        sys.setswitchinterval(1e-6)
        for round_ in range(4):  # new threads each round: their first reads make sessions while others read
            with ThreadPoolExecutor(6) as pool:
                assert list(pool.map(read, range(6 * round_, 6 * round_ + 6))) == [300] * 6
    finally:
        sys.setswitchinterval(interval)
        ds.close()


def test_a_dataset_of_an_unnamed_open_index_has_one_name_in_every_process(local_index: Path, tmp_path: Path) -> None:
    """An io.BytesIO's str is its address, another in each process: named by it, the ranks of a
    job (a process each) would be a dataset each in stats. Its name comes from its URLs."""
    data = local_index.read_bytes()
    names = [
        ShardListDataset(io.BytesIO(data), cache_dir=tmp_path, base=str(local_index.parent)).dataset_name
        for _ in range(2)
    ]
    code = (
        "import io, sys; from wdscache import ShardListDataset; "
        "print(ShardListDataset(io.BytesIO(open(sys.argv[1], 'rb').read()), cache_dir=sys.argv[2], "
        "base=sys.argv[3]).dataset_name)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(local_index), str(tmp_path), str(local_index.parent)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert names[0] == names[1] == other, (names, other)


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        return ""


def test_get_shard_gives_the_shard_the_place_and_the_entry_wids_gives(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    ours = ShardListDataset(local_index, cache_dir=cache, transformations=[], lru_size=2)
    reference = wids.ShardListDataset(
        str(local_index), cache_dir=str(tmp_path / "wids"), transformations=[], lru_size=2
    )
    try:
        for index in (7, 0, 17, 6, 12, 5):
            mine, inner, entry = ours.get_shard(index)
            theirs, their_inner, their_entry = reference.get_shard(index)
            assert (inner, entry) == (their_inner, their_entry) and entry is ours.shards[index // 6]
            assert len(mine) == len(theirs) == 6
            assert [_plain(mine[j]) for j in range(6)] == [_plain(theirs[j]) for j in range(6)]
            assert _plain(mine[-1]) == _plain(theirs[-1]) and mine[-1]["__key__"] == f"s{index // 6}/005"
            assert ours.get_stats() == reference.get_stats()  # one access a call; the reads count none
            with pytest.raises(IndexError):
                theirs[6]
            with pytest.raises(IndexError, match=r"index 6 is out of range: the shard .*part-000\d.tar has 6 samples"):
                mine[6]
        assert ours.get_stats() == reference.get_stats() == (6, 5)
        assert _plain(ours[13]) == _plain(reference[13]) and ours.get_stats() == reference.get_stats() == (7, 5)
        with pytest.raises(IndexError):
            reference.get_shard(18)
        with pytest.raises(IndexError, match="index 18 is out of range: the dataset has 18 samples"):
            ours.get_shard(18)
    finally:
        ours.close()
        reference.close()


def test_a_negative_index_is_refused_saying_where_indexes_count_from(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # wids reads ds[-1] from the end of its first shard (np.searchsorted gives shard 0, inner -1):
    # neither that nor the dataset's last sample can be what a script meant, so it is refused.
    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    reference = wids.ShardListDataset(str(local_index), cache_dir=str(tmp_path / "wids"), transformations=[])
    assert (reference[-1]["__key__"], reference[-1]["__index__"]) == ("s0/005", -1)
    with ShardListDataset(local_index, cache_dir=cache, transformations=[]) as ours:
        for call in (ours.__getitem__, ours.get_shard):
            with pytest.raises(IndexError, match=r"index -1 is out of range: .* count from 0, .* the last is 17\)"):
                call(-1)
        assert ours[17]["__key__"] == "s2/005"


def test_a_high_miss_rate_is_warned_of_once_at_the_read_wids_warns_at(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    ours = ShardListDataset(local_index, cache_dir=cache, transformations=[], lru_size=1)
    reference = wids.ShardListDataset(
        str(local_index), cache_dir=str(tmp_path / "wids"), transformations=[], lru_size=1
    )
    capsys.readouterr()
    theirs, mine = [], []
    try:
        for n in range(1, 121):
            index = (n % 3) * 6 + n % 6  # every read of another shard than the last: a miss
            reference[index]
            if "cache miss rate" in capsys.readouterr().out:
                theirs.append(n)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ours[index]
            mine += [n for w in caught if "were of a shard not among the 1 read latest" in str(w.message)]
        assert mine == theirs == [101]
        assert ours.get_stats() == reference.get_stats() == (120, 120)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours.check_cache_misses()  # once only, as wids
    finally:
        ours.close()
        reference.close()


def test_the_attributes_and_options_of_wids_are_wids_values(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    data = local_index.parent
    listed = json.loads(local_index.read_text())["shardlist"]
    absolute = [{**e, "url": str(data / e["url"])} for e in listed]
    wdir = str(tmp_path / "wids")
    monkeypatch.chdir(data)  # an open file's relative URLs resolve here, in wids and in ours
    cases: list[tuple[Any, Any, dict[str, Any]]] = [
        (local_index, str(local_index), {}),
        (local_index, str(local_index), {"options": {"name": "renamed", "weight": 3.0}}),
        (local_index, str(local_index), {"localname": lambda url: str(tmp_path / "elsewhere"), "keep": True}),
        (absolute, absolute, {"options": {"note": 1}}),
        (absolute, absolute, {"dataset_name": "mine"}),
        (open(local_index), open(local_index), {}),  # noqa: SIM115 (read whole by both)
        (open(local_index, "rb"), open(local_index, "rb"), {"base": str(data)}),  # noqa: SIM115
    ]
    for shards, their_shards, kw in cases:
        reference = wids.ShardListDataset(their_shards, cache_dir=wdir, transformations=[], **kw)
        with ShardListDataset(shards, cache_dir=cache, transformations=[], **kw) as ours:
            seen = {a: getattr(ours, a) for a in ("shards", "spec", "base", "dataset_name", "lengths", "total_length")}
            want = {a: getattr(reference, a) for a in seen}
            assert seen == want, kw
            assert ours.cum_lengths == list(reference.cum_lengths) == [6, 12, 18]
            assert ours.transformations == reference.transformations == []
            assert _plain(ours[8]) == _plain(reference[8]), kw
            ours.close()  # as in wids, a closed dataset reads on
            reference.close()
            assert _plain(ours[9]) == _plain(reference[9]), kw
        reference.close()


def test_wids_samplers_give_the_same_indexes_over_it_as_over_wids(
    local_index: Path, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    import warnings

    cache = tmp_path / "cache"
    start_agent(cache, local_index)
    reference = wids.ShardListDataset(str(local_index), cache_dir=str(tmp_path / "wids"), transformations=[])

    def orders(ds: Any) -> list[list[int]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without distributed initialized"
            samplers = [
                wids.ShardedSampler(ds, seed=3),
                wids.ChunkedSampler(ds, chunksize=5, seed=2),
                wids.DistributedChunkedSampler(ds, chunksize=4, seed=1),
            ]
        return [[int(i) for i in sampler] for sampler in samplers for _ in range(2)]  # two epochs each

    with ShardListDataset(local_index, cache_dir=cache, transformations=[]) as ours:
        got = orders(ours)
        assert got == orders(reference)
        assert all(sorted(order) == list(range(18)) for order in got) and got[0] != got[1]
        assert [ours[i]["__key__"] for i in got[2]] == [reference[i]["__key__"] for i in got[2]]
    reference.close()
