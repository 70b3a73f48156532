"""Edits of the agent's list file while jobs read: what each epoch reads, and what the cache holds."""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
from collections import Counter

import pytest

from scripts.shard_maker import make_shard, synth_samples, write_url_list
from wdscache import CachedMultiLoader, ShardError, ShardListDataset, WdsCacheError


def _replace_list(list_file, urls) -> None:
    tmp = list_file.with_name(".urls.tmp")
    write_url_list(tmp, urls)
    os.replace(tmp, list_file)


def _keys(samples) -> list[tuple[str, str]]:
    return [(s["__url__"], s["__key__"]) for s in samples]


def _samples_of(ds, urls) -> Counter:
    """Each sample of the shards ``urls`` once, as (URL, key)."""
    return Counter(list(_contents(ds, urls)))


def _contents(ds, urls) -> dict[tuple[str, str], dict[str, bytes]]:
    """The samples of the shards ``urls`` on the server: (URL, key) -> {".ext": bytes}."""
    found: dict[tuple[str, str], dict[str, bytes]] = {}
    for url in urls:
        with tarfile.open(ds.source_of(url)) as tar:
            for m in tar:
                key, ext = m.name.split(".", 1)
                found.setdefault((url, key), {})[f".{ext}"] = tar.extractfile(m).read()
    return found


def test_ranks_that_start_an_epoch_across_an_edit_read_the_list_its_first_rank_read(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(10, samples=10)
    old, new = ds.urls[:4], ds.urls[4:]
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--cache-size", "10M")
    assert len(list(CachedMultiLoader(cache_dir=cache, job="warm"))) == 100  # every shard counted: len() known
    _replace_list(ds.list_file, old)
    agent.wait_stats(lambda s: s["agent"]["urls"] == 4, 15, "the old list")
    ranks = [CachedMultiLoader(cache_dir=cache, job="j", rank=r, world_size=2, shuffle=False) for r in range(2)]

    first = iter(ranks[0])
    got = [_keys([next(first)])]  # rank 0 has started epoch 0 on the old list
    _replace_list(ds.list_file, new)
    agent.wait_stats(lambda s: "URL list changed: 6 added, 4 removed" in agent.stderr_text(), 15, "the edit")
    assert len(ranks[1]) == 20  # its epoch 0's share, of the old list
    got.append(_keys(ranks[1]))  # rank 1 starts epoch 0 after the edit
    got[0] += _keys(first)
    assert [len(g) for g in got] == [20, 20]
    assert Counter(k for g in got for k in g) == _samples_of(ds, old)

    # The next epoch, whoever starts it first, reads the edited list.
    assert len(ranks[1]) == 30
    later = [_keys(rank) for rank in reversed(ranks)]
    assert [len(g) for g in later] == [30, 30]
    assert Counter(k for g in later for k in g) == _samples_of(ds, new)


@pytest.mark.slow
def test_a_shard_index_written_anew_for_a_new_version_of_a_shard_has_its_copy_downloaded_again(
    shard_server, dataset, start_agent, run_cli, tmp_path
):
    ds = dataset(3, samples=10)
    index = ds.list_file.with_name("shards.json")
    assert run_cli("index", *ds.urls, "-o", index).returncode == 0
    cache = tmp_path / "cache"
    agent = start_agent(cache, index, "--cache-size", "10M")
    assert len(list(CachedMultiLoader(cache_dir=cache, shuffle=False))) == 30  # every shard cached, counted

    stale = index.with_name("stale.json")
    stale.write_bytes(index.read_bytes())
    make_shard(ds.paths[1], synth_samples(1, 15, payload=2000, seed=7))  # a new version, 15 samples
    st = ds.paths[1].stat()
    os.utime(ds.paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert run_cli("index", *ds.urls, "-o", index).returncode == 0  # the index written anew, as sources.md says
    agent.wait_stats(lambda s: "URL list changed: 0 added, 0 removed" in agent.stderr_text(), 15, "the index edit")
    want = _contents(ds, ds.urls)

    by_index = ShardListDataset(str(index), cache_dir=cache, timeout=20, transformations=[])
    try:
        assert len(by_index) == 35
        sample = by_index[12]  # shard 1's third sample
        assert {k: v.getvalue() for k, v in sample.items() if k.startswith(".")} == want[
            (ds.urls[1], sample["__key__"])
        ]
    finally:
        by_index.close()
    got = list(CachedMultiLoader(cache_dir=cache, shuffle=False))
    assert Counter(_keys(got)) == Counter(list(want))
    assert all({f".{k}": v for k, v in s.items() if not k.startswith("__")} == want[_keys([s])[0]] for s in got)
    assert "is 51200 bytes in the cache, but the shard index says" in agent.stderr_text(), agent.stderr_tail()

    # A reader of the index as it was: its own check fails the shard, which is not downloaded again
    # for it (a new copy would be checked against the agent's index, and be as unlike its own).
    fetched = shard_server.count(ds.paths[1].name)
    by_stale = ShardListDataset(str(stale), cache_dir=cache, timeout=20, transformations=[])
    try:
        for _ in range(3):
            with pytest.raises(ShardError, match="15 samples, but the shard index says 10"):
                by_stale[12]
    finally:
        by_stale.close()
    assert shard_server.count(ds.paths[1].name) == fetched


def test_a_configmap_update_by_the_kubelets_symlink_swap_is_taken_up_live(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(4)
    mount = tmp_path / "configmap"  # as the kubelet lays out a mounted ConfigMap
    (mount / "..v1").mkdir(parents=True)
    write_url_list(mount / "..v1" / "urls.txt", ds.urls[:2])
    (mount / "..data").symlink_to("..v1")
    (mount / "urls.txt").symlink_to("..data/urls.txt")
    agent = start_agent(tmp_path / "cache", mount / "urls.txt", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 15, "the first list cached")

    (mount / "..v2").mkdir()
    write_url_list(mount / "..v2" / "urls.txt", ds.urls)
    (mount / "..data_tmp").symlink_to("..v2")
    os.replace(mount / "..data_tmp", mount / "..data")  # the kubelet's atomic swap: urls.txt itself never changes
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 15, "the swapped list taken up")
    assert s["agent"]["urls"] == 4 and "URL list changed: 2 added, 0 removed" in agent.stderr_text()


def test_a_jobs_own_wrong_shard_index_changes_nothing_for_the_other_jobs(
    shard_server, dataset, start_agent, run_cli, tmp_path
):
    ds = dataset(2, samples=10)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--cache-size", "10M")  # a plain list: no facts of its own
    assert len(list(CachedMultiLoader(cache_dir=cache, job="a", shuffle=False))) == 20
    wrong = tmp_path / "wrong.json"
    assert run_cli("index", *ds.urls, "-o", wrong).returncode == 0
    doc = json.loads(wrong.read_text())
    doc["shardlist"][1]["nsamples"], doc["shardlist"][1]["filesize"] = 12, None  # a job's index, wrong
    wrong.write_text(json.dumps(doc))
    fetched = [shard_server.count(p.name) for p in ds.paths]
    with contextlib.suppress(WdsCacheError):  # (what it gets is its own affair)
        list(CachedMultiLoader(str(wrong), cache_dir=cache, job="b", shuffle=False, timeout=20))
    got = list(CachedMultiLoader(cache_dir=cache, job="c", shuffle=False, timeout=20))
    assert Counter(_keys(got)) == _samples_of(ds, ds.urls)
    assert [shard_server.count(p.name) for p in ds.paths] == fetched
    assert agent.stats()["shards"] == {"cached": 2, "downloading": 0, "queued": 0, "failed": 0}
