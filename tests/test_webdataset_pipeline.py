"""wdscache.WebDataset as a drop-in for webdataset.WebDataset: webdataset's
own stages and decoders (decode("pil") on real JPEGs made with Pillow) over samples served by
a real agent, compared with webdataset reading the same shards over HTTP."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

wds = pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed (scripts/test.sh installs it)")
torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")

import wdscache  # noqa: E402

SHARDS, PER_SHARD = 4, 9


def _jpeg(shard: int, i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (40 * shard, 20 * i, 200)).save(out, format="JPEG", quality=95)
    return out.getvalue()


@pytest.fixture
def jpeg_shards(shard_server: Any, start_agent: Callable[..., Any], tmp_path: Path) -> tuple[list[str], Path]:
    urls = []
    for s in range(SHARDS):
        name = f"img-{s:03d}.tar"
        with wds.TarWriter(str(shard_server.root / name)) as sink:
            for i in range(PER_SHARD):
                sink.write(
                    {
                        "__key__": f"s{s}_{i:03d}",
                        "jpg": _jpeg(s, i),
                        "cls": str(s * 10 + i).encode(),
                        "json": json.dumps({"shard": s, "i": i}).encode(),
                    }
                )
        urls.append(shard_server.url(name))
    list_file = tmp_path / "lists" / "urls.txt"
    list_file.parent.mkdir()
    list_file.write_text("\n".join(urls) + "\n")
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--workers", "2")
    return urls, cache


def _pixels(item: tuple[Any, ...]) -> tuple[Any, ...]:
    key, img, cls, meta = item
    return key, img.size, img.mode, img.tobytes(), cls, meta


def test_samples_and_decoded_tuples_are_webdatasets(jpeg_shards: tuple[list[str], Path]) -> None:
    urls, cache = jpeg_shards
    pattern = urls[0].replace("img-000.tar", "img-{000..003}.tar")
    ours = list(wdscache.WebDataset(pattern, cache_dir=cache, shardshuffle=False))
    theirs = list(wds.WebDataset(urls, shardshuffle=False))
    assert ours == theirs and len(ours) == SHARDS * PER_SHARD
    stages: Callable[[Any], Any] = lambda ds: ds.decode("pil").to_tuple("__key__", "jpg", "cls", "json")  # noqa: E731
    ours_t = [_pixels(t) for t in stages(wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False))]
    theirs_t = [_pixels(t) for t in stages(wds.WebDataset(urls, shardshuffle=False))]
    assert ours_t == theirs_t
    # webdataset's DataPipeline stages can follow it too
    chained = wds.DataPipeline(
        wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False),
        wds.decode("pil"),
        wds.to_tuple("__key__", "jpg", "cls", "json"),
    )
    assert [_pixels(t) for t in chained] == theirs_t
    assert ours_t[0][1:3] == ((8, 6), "RGB") and ours_t[3][4] == 3 and ours_t[3][5] == {"shard": 0, "i": 3}


def test_fluid_stages_in_a_dataloader_with_workers(jpeg_shards: tuple[list[str], Path]) -> None:
    urls, cache = jpeg_shards
    ds = (
        wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=True, job="fluid")
        .shuffle(20)
        .decode("torchrgb")
        .rename(image="jpg", label="cls")
        .map_dict(label=lambda c: c + 1000)
        .select(lambda s: s["label"] != 1000 + 11)  # drops one sample
        .to_tuple("image", "label", "__key__")
        .batched(4)
    )
    assert isinstance(ds, torch.utils.data.IterableDataset)
    labels: list[int] = []
    for images, batch_labels, _keys in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
        assert images.shape[1:] == (3, 6, 8) and images.dtype == torch.float32
        labels += batch_labels.tolist()
    expected = {1000 + s * 10 + i for s in range(SHARDS) for i in range(PER_SHARD)} - {1011}
    assert Counter(labels) == Counter(expected)
    # One that batches and filters has no length, as webdataset's (a schedule sized by it would
    # be wrong); its source alone has, and with_length gives one.
    with pytest.raises(TypeError, match="stages after its source"):
        len(ds)
    assert len(ds.with_length(7, silent=True)) == 7
    source = wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=True, job="fluid")
    assert len(source) == SHARDS * PER_SHARD  # known once every shard was read
    in_order = [x for x in sorted(expected)]
    assert labels != in_order  # shuffled
    # with_epoch is webdataset's: epochs of a fixed length, the source running on into the next epoch
    five = wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False, job="five").to_tuple("cls").with_epoch(50)
    assert len(list(five)) == 50


@pytest.mark.parametrize("partial", [True, False])
def test_a_resampled_source_batched_then_cut_yields_webdatasets_batches(
    jpeg_shards: tuple[list[str], Path], partial: bool
) -> None:
    # webdataset's resampled source is endless within an iteration: its batches never end short
    # where one of the loader's epochs (of with_epoch's n samples) ends and the next begins.
    urls, cache = jpeg_shards

    def sizes(module: Any, **kw: Any) -> list[list[int]]:
        ds = module.WebDataset(urls, resampled=True, **kw).to_tuple("__key__").batched(6, partial=partial)
        ds = ds.with_epoch(5)  # 5 batches, 30 samples, each iteration (the loader's epochs: 8 samples)
        return [[len(keys) for (keys,) in ds] for _ in range(2)]

    assert sizes(wds, shardshuffle=False) == [[6] * 5] * 2
    assert sizes(wdscache, cache_dir=cache, job=f"batched-{partial}") == [[6] * 5] * 2
    endless = wdscache.WebDataset(urls, resampled=True, cache_dir=cache, job="endless-batched")
    batches = itertools.islice(endless.to_tuple("__key__").batched(100), 84)  # past ENDLESS_EPOCH samples
    assert [len(keys) for (keys,) in batches] == [100] * 84


def test_a_cut_or_repeated_dataset_has_no_length_as_webdatasets(jpeg_shards: tuple[list[str], Path]) -> None:
    urls, cache = jpeg_shards
    for module, kw in ((wds, {"shardshuffle": False}), (wdscache, {"cache_dir": cache, "job": "len-cut"})):
        for ds in (module.WebDataset(urls, **kw).with_epoch(5), module.WebDataset(urls, **kw).repeat(2)):
            with pytest.raises(TypeError):
                len(ds)
    with pytest.raises(TypeError, match="with_epoch"):
        len(wdscache.WebDataset(urls, cache_dir=cache, job="len-cut").repeat(nbatches=25))
    assert len(list(wdscache.WebDataset(urls, cache_dir=cache, job="len-cut").repeat(2))) == 2 * SHARDS * PER_SHARD


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_workers_without_samples_of_their_own_end_quietly_where_webdatasets_have_shards(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # 8 shards of 2 samples over 4 workers: webdataset gives each worker 2 shards; the share's
    # blocks of 8 samples go to two workers, and the other two have none. An empty worker is no
    # empty dataset: only a rank whose whole share is empty raises.
    urls, _, list_file = dataset(8, samples=2, payload=100)
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--workers", "2")
    keys = lambda ds: sorted(s["__key__"] for s in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=4))  # noqa: E731
    theirs = keys(wds.WebDataset(urls, shardshuffle=False))
    assert len(theirs) == 16 and keys(wdscache.WebDataset(urls, cache_dir=cache, job="few")) == theirs
    # A rank with no sample at all still raises, as webdataset's worker without shards does.
    with pytest.raises(ValueError, match="no samples found in dataset"):
        list(wdscache.WebDataset(urls, cache_dir=cache, job="none", rank=1, world_size=17, drop_last=True))


def test_without_webdataset_the_error_says_what_to_install() -> None:
    code = "import sys; sys.modules['webdataset'] = None\nimport wdscache\nwdscache.WebDataset"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "ImportError: wdscache.WebDataset builds on webdataset, which is not installed: "
        "pip install webdataset (the package's wds extra)"
    )


def test_a_checkpoint_taken_after_the_epochs_last_sample_resumes_an_empty_rest(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # A per-step save after the last step, before the loop meets the epoch's end: its rest is
    # empty, which is no empty dataset (empty_check), and the next iteration is the next epoch.
    urls, _, list_file = dataset(3, samples=10, payload=100)
    cache = tmp_path / "cache"
    start_agent(cache, list_file)
    ds = wdscache.WebDataset(urls, cache_dir=cache, job="ends")
    it = iter(ds)
    first = [next(it)["__key__"] for _ in range(30)]
    state = ds.state_dict()
    it.close()
    resumed = wdscache.WebDataset(urls, cache_dir=cache, job="ends")
    resumed.load_state_dict(state)
    assert list(resumed) == []
    again = [s["__key__"] for s in resumed]
    assert sorted(again) == sorted(first)  # epoch 1, whole
    assert resumed.state_dict()["epoch"] == 2


def test_set_epoch_of_the_epoch_a_loaded_state_resumes_keeps_its_rest(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # The usual loop sets every epoch at its top, the resumed one too (as DistributedSampler's
    # set_epoch leaves torchdata's resumed sampler): that epoch's rest, not the whole of it again.
    urls, _, list_file = dataset(3, samples=10, payload=100)
    cache = tmp_path / "cache"
    start_agent(cache, list_file)
    for make in (
        lambda: wdscache.CachedMultiLoader(urls, cache_dir=cache, job="loop"),
        lambda: wdscache.WebDataset(urls, cache_dir=cache, job="loop"),
    ):
        first = make()
        first.set_epoch(0)
        it = iter(first)
        out = [next(it)["__key__"] for _ in range(12)]
        state = first.state_dict()
        it.close()
        whole = [s["__key__"] for s in first]  # epoch 1, after the first left unfinished
        resumed = make()
        resumed.load_state_dict(state)
        seen = []
        for epoch in range(state["epoch"], 2):
            resumed.set_epoch(epoch)
            seen.append([s["__key__"] for s in resumed])
        assert len(seen[0]) == 18 and sorted(out + seen[0]) == sorted(whole)  # the rest of epoch 0, each once
        assert len(seen[1]) == 30 and seen[1] == whole  # then epoch 1, whole, in its order
        # Another epoch set after the load is that epoch from its start, as before.
        other = make()
        other.load_state_dict(state)
        other.set_epoch(1)
        assert [s["__key__"] for s in other] == whole


def test_set_epoch_and_load_state_dict_name_the_next_epoch_in_a_checkpoint(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # A loop that stops its epochs early (a fixed number of steps), then sets the next one and
    # saves: the checkpoint is that epoch's start, not the rest of the one left unfinished.
    urls, _, list_file = dataset(3, samples=10, payload=100)
    cache = tmp_path / "cache"
    start_agent(cache, list_file)
    loader = wdscache.CachedMultiLoader(urls, cache_dir=cache, job="steps")
    assert len(list(itertools.islice(loader, 12))) == 12
    loader.set_epoch(1)
    state = loader.state_dict()
    assert (state["epoch"], state["position"], state["done"]) == (1, 0, [])
    resumed = wdscache.CachedMultiLoader(urls, cache_dir=cache, job="steps")
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 30
    # And once a checkpoint is loaded, it is the position, whatever was read before.
    assert len(list(itertools.islice(loader, 5))) == 5
    loader.load_state_dict({**state, "epoch": 3})
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (3, 0)


def _cut_source(kind: str) -> dict[str, Any]:
    """A plain list in the loader's seeded order (each epoch another), or resampled=True with an
    epoch of 40 samples: with_epoch(n) cuts the loader's epochs, it does not make them."""
    return {"shardshuffle": True} if kind == "list" else {"resampled": True, "epoch_samples": 40}


@pytest.mark.parametrize("kind", ["list", "resampled"])
@pytest.mark.slow
def test_with_epoch_resumes_from_a_checkpoint_as_the_uninterrupted_run_goes_on(
    kind: str, dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    # with_epoch(n) cuts each iteration at n, and the next iteration is the loader's next epoch,
    # whether n is shorter than the epoch (40 samples) or runs past its end into the next one. A
    # checkpoint taken after a whole iteration resumes at that next epoch; one taken in the middle
    # resumes the rest of its n (an empty rest once the n are out), then the next epoch.
    urls, _, list_file = dataset(8, samples=5, payload=100)
    cache = tmp_path / "cache"
    start_agent(cache, list_file)

    def made(n: int) -> Any:
        return wdscache.WebDataset(urls, cache_dir=cache, job=f"cut{n}", **_cut_source(kind)).with_epoch(n)

    def keys(ds: Any) -> list[str]:
        return [s["__key__"] for s in ds]

    for n, middles in ((6, (1, 3, 5, 6)), (50, (1, 25, 40, 45, 50))):  # 40: the end of the loader's epoch
        ds = made(n)
        whole = [keys(ds) for _ in range(3)]
        assert [len(w) for w in whole] == [n] * 3 and whole[0] != whole[1] != whole[2]
        ds = made(n)
        assert keys(ds) == whole[0]
        after = made(n)
        after.load_state_dict(json.loads(json.dumps(ds.state_dict())))
        assert [keys(after), keys(after)] == whole[1:], n
        for k in middles:
            ds = made(n)
            it = iter(ds)
            first = [next(it)["__key__"] for _ in range(k)]
            state = json.loads(json.dumps(ds.state_dict()))
            it.close()
            resumed = made(n)
            resumed.load_state_dict(state)
            assert first + keys(resumed) == whole[0], (n, k)
            assert keys(resumed) == whole[1], (n, k)


@pytest.fixture
def stateful_source(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> tuple[Any, Any, Path]:
    """torchdata's stateful_dataloader module, and the URLs of 8 shards of 5 samples with the cache
    of an agent serving them."""
    stateful = pytest.importorskip(
        "torchdata.stateful_dataloader", reason="torchdata is not installed (scripts/test.sh installs it)"
    )
    urls, _, list_file = dataset(8, samples=5, payload=100)
    cache = tmp_path / "cache"
    start_agent(cache, list_file)
    return stateful, urls, cache


def test_with_epoch_state_of_a_stateful_dataloader_without_workers_loaded_into_the_dataset_keeps_its_cut(
    stateful_source: tuple[Any, Any, Path],
) -> None:
    # Without workers the StatefulDataLoader holds the dataset's own state (its "dataset_state"):
    # loaded into the dataset, as train_example.py loads every state, the cut resumes too.
    stateful, urls, cache = stateful_source

    def made() -> Any:
        return wdscache.WebDataset(urls, cache_dir=cache, job="sdl0").with_epoch(10)

    def batches(dl: Any) -> list[list[str]]:
        return [list(batch["__key__"]) for batch in dl]

    dl = stateful.StatefulDataLoader(made(), batch_size=5)
    whole = [batches(dl), batches(dl)]
    dl = stateful.StatefulDataLoader(made(), batch_size=5)
    first = [list(next(iter(dl))["__key__"])]
    resumed = made()
    resumed.load_state_dict(json.loads(json.dumps(dl.state_dict())))
    dl = stateful.StatefulDataLoader(resumed, batch_size=5)
    assert [first + batches(dl), batches(dl)] == whole


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "resampled"])
def test_with_epoch_in_stateful_dataloader_workers_resumes_as_the_uninterrupted_run_goes_on(
    kind: str, stateful_source: tuple[Any, Any, Path]
) -> None:
    # In DataLoader(num_workers=2) each worker cuts its own iteration at n: a per-step checkpoint
    # (StatefulDataLoader's, of each worker) resumes the rest of each worker's n, an empty rest
    # after the last batch, and then the next epoch, as the uninterrupted loop goes on. n=25 runs
    # past the end of a worker's slice of the epoch (20 samples) into the next epoch's.
    stateful, urls, cache = stateful_source

    def made(n: int) -> tuple[Any, Any]:
        ds = wdscache.WebDataset(urls, cache_dir=cache, job=f"dl{n}", **_cut_source(kind)).with_epoch(n)
        return ds, stateful.StatefulDataLoader(ds, batch_size=2, num_workers=2)

    def epochs(ds: Any, dl: Any) -> list[list[list[str]]]:
        out = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            out.append([list(batch["__key__"]) for batch in dl])
        return out

    for n, steps in ((6, (3, 6)), (25, (11, 20, 26))):  # 6 and 26: after the last batch (each worker's 13th)
        whole = epochs(*made(n))
        assert sum(map(len, whole[0])) == 2 * n and whole[0] != whole[1]  # each worker its n
        for step in steps:
            ds, dl = made(n)
            ds.set_epoch(0)
            it = iter(dl)
            first = [list(next(it)["__key__"]) for _ in range(step)]
            state = dl.state_dict()
            del it
            resumed, resumed_dl = made(n)
            resumed_dl.load_state_dict(state)
            rest, then = epochs(resumed, resumed_dl)
            assert first + rest == whole[0] and then == whole[1], (n, step)


def _ids(batch: dict[str, Any]) -> list[str]:
    return [f"{url}#{key}" for url, key in zip(batch["__url__"], batch["__key__"])]


def _persistent_source(kind: str, urls: Any, cache: Path, job: str) -> Any:
    """The shards in the loader's seeded order, or resampled=True cut by with_epoch(10) (each of
    the two workers' 10 an epoch)."""
    if kind == "list":
        return wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=True, seed=5, job=job)
    return wdscache.WebDataset(urls, cache_dir=cache, resampled=True, seed=5, job=job).with_epoch(10)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "cut"])
def test_a_state_taken_before_every_persistent_worker_handed_out_a_batch_of_the_epoch_resumes_it_exactly(
    kind: str, stateful_source: tuple[Any, Any, Path]
) -> None:
    # The README's loop: set_epoch at the top of every epoch, persistent workers. At step 1 of
    # epoch 1 only worker 0 has handed out a batch; torchdata took worker 1's state right after
    # its iter(), before its first item: it must name epoch 1 (not "epoch 0, complete"), so that
    # the state resumes the rest of epoch 1, in a new StatefulDataLoader or loaded into the dataset.
    stateful, urls, cache = stateful_source

    def made() -> tuple[Any, Any]:
        ds = _persistent_source(kind, urls, cache, f"pers-{kind}")
        return ds, stateful.StatefulDataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True)

    ds, dl = made()
    reference = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        reference.append([i for batch in dl for i in _ids(batch)])
    if kind == "list":
        assert Counter(reference[1]) == Counter(reference[0]) and len(set(reference[1])) == 40  # every sample once
    assert reference[0] != reference[1] and len(reference[1]) == (40 if kind == "list" else 20)

    ds, dl = made()
    ds.set_epoch(0)
    assert [i for batch in dl for i in _ids(batch)] == reference[0]
    ds.set_epoch(1)
    it = iter(dl)
    first = _ids(next(it))
    state = json.loads(json.dumps(dl.state_dict()))
    del it
    assert first == reference[1][:3]

    resumed, resumed_dl = made()
    resumed_dl.load_state_dict(state)
    resumed.set_epoch(1)
    rest = [i for batch in resumed_dl for i in _ids(batch)]
    assert first + rest == reference[1]

    into = _persistent_source(kind, urls, cache, f"pers-{kind}")
    into.load_state_dict(state)  # the workers' states, of one epoch
    assert into.state_dict()["epoch"] == 1
    if kind == "cut":  # loaded whole into the dataset, workers' states resume without their cuts (docs/api.md)
        return
    into.set_epoch(1)
    rest = [i for batch in stateful.StatefulDataLoader(into, batch_size=3, num_workers=2) for i in _ids(batch)]
    assert Counter(first + rest) == Counter(reference[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "cut"])
def test_a_state_taken_before_a_fresh_worker_handed_out_a_batch_resumes_the_next_epoch_without_set_epoch(
    kind: str, stateful_source: tuple[Any, Any, Path]
) -> None:
    # Without set_epoch, workers made anew each iteration: the second iteration is epoch 1. A state
    # at its first batch, before worker 1 handed out one, resumes epoch 1's rest, not worker 1's
    # slice of epoch 0 again.
    stateful, urls, cache = stateful_source

    def made() -> Any:
        ds = _persistent_source(kind, urls, cache, f"fresh-{kind}")
        return stateful.StatefulDataLoader(ds, batch_size=3, num_workers=2)

    dl = made()
    reference = [[i for batch in dl for i in _ids(batch)] for _ in range(2)]
    assert reference[0] != reference[1]
    dl = made()
    assert [i for batch in dl for i in _ids(batch)] == reference[0]
    it = iter(dl)
    first = _ids(next(it))
    state = json.loads(json.dumps(dl.state_dict()))
    del it
    assert first == reference[1][:3]
    resumed = made()
    resumed.load_state_dict(state)
    assert first + [i for batch in resumed for i in _ids(batch)] == reference[1]


@pytest.mark.slow
def test_the_dataset_state_in_the_main_process_is_refused_once_plain_dataloader_workers_read_its_epoch(
    stateful_source: tuple[Any, Any, Path],
) -> None:
    # torch's DataLoader keeps no state: what its workers delivered is theirs, and the dataset in
    # this process still names the epoch before (or its start). Its state_dict() says so rather
    # than send a resumed job back over the epoch; set_epoch(e) names epoch e's start again.
    _, urls, cache = stateful_source
    for ds in (
        wdscache.CachedMultiLoader(urls, cache_dir=cache, job="plain"),
        wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=True, job="plain"),
        wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=True, job="plain").with_epoch(15),
    ):
        dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
        ds.set_epoch(0)
        assert ds.state_dict()["epoch"] == 0
        assert len([i for batch in dl for i in _ids(batch)]) == (
            40 if isinstance(ds, wdscache.CachedMultiLoader) or ds.nsamples < 0 else 30
        )
        with pytest.raises(RuntimeError, match="StatefulDataLoader"):
            ds.state_dict()
        ds.set_epoch(1)
        assert (ds.state_dict()["epoch"], ds.state_dict()["position"]) == (1, 0)
        batches = iter(dl)
        next(batches)
        with pytest.raises(RuntimeError, match="DataLoader workers read"):
            ds.state_dict()
        del batches
