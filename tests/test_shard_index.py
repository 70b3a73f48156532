"""Shard indexes (webdataset's wids JSON): ``wdscache index`` writes them, the agent and the loader
read them, every download is checked against them, and ``len(loader)`` is known at once.

Real parts: the loopback shard server, agents and ``wdscache index`` through the CLI, consumer
processes (tests/consumer.py), moto's S3 server for the S3 case; webdataset's reader is the
reference for samples and counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import shutil
import socket
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import webdataset as wds
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from scripts.console import wdscache_exe
from scripts.shard_maker import make_dataset, write_url_list
from tests.helpers.agents import run_wdscache
from tests.helpers.net import free_port_range
from tests.helpers.streaming import reference, samples_of
from tests.helpers.testdata import NEEDS_TESTDATA, REAL_SHARDS, TESTDATA
from tests.helpers.waits import read_terminal, stop_process
from wdscache import CachedMultiLoader, FetchError, ShardIndexError, UrlListError
from wdscache.shared.layout import CacheLayout
from wdscache.shared.shard_index import (
    KIND,
    MAX_SAMPLES,
    ShardInfo,
    _take_entries,
    parse_shard_index,
    quick_shard_index,
    write_shard_index,
)
from wdscache.shared.urls import read_url_list

CACHED_IN = 30.0


def wds_count(path: Path) -> int:
    return sum(1 for _ in wds.WebDataset(str(path), shardshuffle=False))


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def make_index(out: Path, *urls: str | os.PathLike[str], env: dict[str, str] | None = None) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    r = run_wdscache("index", *urls, "-o", out, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def gets(server, name: str) -> int:
    return len([r for r in server.requests if r.path == name and r.method == "GET"])


def as_samples(lines: list[dict]) -> dict[tuple[str, str], dict[str, str]]:
    return {(s["url"], s["key"]): s["fields"] for s in samples_of(lines)}


# -- wdscache index ---------------------------------------------------------------------------


def test_index_gives_webdatasets_counts_and_the_files_sizes_reading_each_shard_once(tmp_path, shard_server):
    paths = make_dataset(shard_server.root, 3, 7, payload=3000)
    paths += make_dataset(shard_server.root, 1, 5, payload=3000, prefix="packed", gzip=True)
    urls = [shard_server.url(p.name) for p in paths]
    brace = urls[0].rsplit("/", 1)[0] + "/shard-{000000..000002}.tar"  # a pattern, as in a URL list
    doc = make_index(tmp_path / "index.json", brace, urls[3])
    assert doc["__kind__"] == KIND == "wids-shard-index-v1" and doc["wids_version"] == 1
    assert doc["shardlist"] == [
        {"url": url, "nsamples": wds_count(p), "filesize": p.stat().st_size, "md5sum": md5_of(p)}
        for url, p in zip(urls, paths)
    ]
    assert [e["nsamples"] for e in doc["shardlist"]] == [7, 7, 7, 5]
    assert all(gets(shard_server, p.name) == 1 for p in paths)  # each shard read once
    assert not list(tmp_path.glob(".wdscache-index-*"))  # its scratch files are gone


@NEEDS_TESTDATA
@pytest.mark.slow
def test_index_of_webdatasets_own_shards_stores_local_ones_relative_to_the_index(
    tmp_path, shard_server, start_agent, consumers
):
    data = tmp_path / "data"
    data.mkdir()
    for name in REAL_SHARDS:
        shutil.copy(TESTDATA / name, data / name)
    outside = shutil.copy(TESTDATA / REAL_SHARDS[0], tmp_path / "outside.tar")
    shutil.copy(TESTDATA / REAL_SHARDS[1], shard_server.root / REAL_SHARDS[1])
    remote = shard_server.url(REAL_SHARDS[1])
    doc = make_index(data / "index.json", *(data / n for n in REAL_SHARDS), outside, remote)
    expected = [
        {"url": n, "nsamples": wds_count(data / n), "filesize": (data / n).stat().st_size, "md5sum": md5_of(data / n)}
        for n in REAL_SHARDS
    ]
    expected.append({**expected[0], "url": str(outside)})  # outside the index's folder: absolute
    expected.append({**expected[1], "url": remote})
    assert doc["shardlist"] == expected
    assert {e["url"]: e["nsamples"] for e in expected[:5]} == {
        "compressed.tar": 3,
        "mpdata.tar": 100,
        "sample.tgz": 90,
        "tendata.tar": 100,
        "testgz.tar": 1000,
    }
    # The agent on that index: every download checked against it (sample.tgz by its compressed size,
    # and the samples of the tar inside), and an epoch byte-equal to webdataset's reader.
    paths = [data / n for n in REAL_SHARDS] + [Path(outside), shard_server.root / REAL_SHARDS[1]]
    urls = [f"file://{p}" for p in paths[:-1]] + [remote]
    cache = tmp_path / "cache"
    agent = start_agent(cache, data / "index.json", "--no-shuffle")
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == len(urls), CACHED_IN, "the index's shards were cached")
    assert s["failed"] == []
    lines = consumers(cache, "c", "--no-shuffle").wait()
    assert list(as_samples(lines).items()) == list(reference(paths, urls).items())


def test_index_shows_a_progress_bar_on_a_terminal(tmp_path, shard_server):
    paths = make_dataset(shard_server.root, 3, 2)
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [wdscache_exe(), "index", *(shard_server.url(p.name) for p in paths), "-o", tmp_path / "index.json"],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
    )
    os.close(secondary)
    try:
        out = read_terminal(primary, proc, 30)
        proc.wait(10)
    finally:
        os.close(primary)
        stop_process(proc)
    assert proc.returncode == 0, out
    text = out.decode()
    assert "indexing" in text and "3/3" in text and "[1/3]" not in text  # the bar, not the plain lines
    assert len(json.loads((tmp_path / "index.json").read_text())["shardlist"]) == 3


def test_index_that_cannot_read_a_shard_writes_nothing(tmp_path, shard_server):
    paths = make_dataset(shard_server.root, 1, 3)
    out = tmp_path / "index.json"
    r = run_wdscache("index", shard_server.url(paths[0].name), shard_server.url("missing.tar"), "-o", out)
    assert r.returncode == 1, r.stderr
    assert f"cannot fetch {shard_server.url('missing.tar')}: HTTP 404" in r.stderr
    assert "1 of 2 shards could not be read" in r.stderr and not out.exists()
    r = run_wdscache("index", "http://", "-o", out)
    assert r.returncode == 2 and "needs a host" in r.stderr
    r = run_wdscache("index", "", "-o", out)  # an index of no shard opens nowhere
    assert (r.returncode, r.stderr) == (
        2,
        f"wdscache: error: no shards to index: the arguments hold no URL; {out} not written\n",
    )
    assert not out.exists()


def test_an_index_that_cannot_be_put_in_place_names_it_and_leaves_no_temp_file(tmp_path):
    out = tmp_path / "index.json"
    out.mkdir()  # a folder where the index goes: its rename over it fails
    with pytest.raises(IsADirectoryError, match=f"Is a directory: '{out}'"):
        write_shard_index(out, [("a.tar", ShardInfo(3))])
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"] and not any(out.iterdir())


def test_index_gives_up_on_a_host_that_refuses_after_its_retries(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/a.tar"
    out = tmp_path / "index.json"
    r = run_wdscache("index", url, "-o", out, "--retries", "0")
    assert r.returncode == 1, r.stderr
    assert f"cannot fetch {url}" in r.stderr and "1 of 1 shards could not be read" in r.stderr, r.stderr
    assert not out.exists()
    r = run_wdscache("index", url, "-o", out, "--retries", "-1")
    assert r.returncode == 2 and "--retries" in r.stderr, r.stderr


@pytest.mark.parametrize("endpoint", ["http://", "http://[zz]:5399", "http://h:port"])
def test_index_refuses_an_s3_endpoint_without_a_usable_host(tmp_path, endpoint):
    r = run_wdscache("index", "--s3-endpoint-url", endpoint, "s3://bkt/k.tar", "-o", tmp_path / "i.json")
    assert r.returncode == 2 and f"--s3-endpoint-url {endpoint!r}: use http(s)://HOST[:PORT]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_index_into_a_folder_it_cannot_write_names_it(tmpfs, shard_server):
    paths = make_dataset(shard_server.root, 1, 3)
    fs = tmpfs("1m")
    r = subprocess.run(["mount", "-o", "remount,ro", str(fs)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    r = run_wdscache("index", shard_server.url(paths[0].name), "-o", fs / "i.json")
    assert r.returncode == 2 and f"cannot write {fs / 'i.json'}: Read-only file system" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # An empty -o (the current folder) is refused before any shard is read, not after.
    r = run_wdscache("index", shard_server.url(paths[0].name), "-o", "")
    assert r.returncode == 2 and "give a file's name (-o FILE), not a folder" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and shard_server.count(paths[0].name) == 0


# -- the agent and the loader on an index -------------------------------------------------------


def test_an_epoch_from_an_index_with_relative_urls_is_webdatasets(tmp_path, start_agent, consumers):
    paths = make_dataset(tmp_path / "made" / "shards", 3, 6, payload=2000)
    doc = make_index(tmp_path / "made" / "index.json", *paths)
    assert [e["url"] for e in doc["shardlist"]] == [f"shards/{p.name}" for p in paths]
    # The folder moves: its URLs resolve against the index's new place, not the working directory.
    moved = tmp_path / "moved"
    (tmp_path / "made").rename(moved)
    paths = [moved / "shards" / p.name for p in paths]
    urls = [f"file://{p}" for p in paths]
    assert read_url_list(moved / "index.json").urls == tuple(urls)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache = tmp_path / "cache"
    agent = start_agent(cache, moved / "index.json", cwd=elsewhere)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, CACHED_IN, "the index's shards were not cached")
    lines = consumers(cache, "c", "--no-shuffle").wait()
    assert list(as_samples(lines).items()) == list(reference(paths, urls).items())  # byte-equal, in order


@pytest.mark.slow
def test_len_is_known_before_any_shard_is_read(tmp_path, shard_server, start_agent, consumers):
    paths = make_dataset(shard_server.root, 3, 5, payload=1000)
    paths += make_dataset(shard_server.root, 1, 4, payload=1000, prefix="other")
    urls = [shard_server.url(p.name) for p in paths]
    make_index(tmp_path / "lists" / "index.json", *urls[:3])
    make_index(tmp_path / "job.json", *urls)
    shard_server.stop()  # no shard can be read now: the counts come from the indexes
    cache = tmp_path / "cache"
    agent = start_agent(cache, tmp_path / "lists" / "index.json")
    with (
        CachedMultiLoader(cache_dir=cache, timeout=30) as own,
        CachedMultiLoader(tmp_path / "job.json", cache_dir=cache, timeout=30) as job,
        CachedMultiLoader(
            tmp_path / "job.json", cache_dir=cache, timeout=30, world_size=2, rank=1, job="two", batch_size=4
        ) as ranked,
    ):
        assert (len(own), len(job), len(ranked)) == (15, 19, 3)  # 19 samples: 10 for each rank, 3 batches
        assert agent.stats()["shards"]["cached"] == 0
        shard_server.start()
        got = list(job)
        assert len(got) == 19
    assert {(s["__url__"], s["__key__"]) for s in got} == set(reference(paths, urls))


def changed_since_indexed(size: int, indexed: int) -> str:
    return (
        f"the source is {size} bytes, but the shard index says {indexed}: the shard changed since it was "
        "indexed; run 'wdscache index' again to make a new index"
    )


def test_a_changed_size_fails_at_once_a_wrong_md5_after_two_downloads(tmp_path, shard_server, start_agent, consumers):
    paths = make_dataset(shard_server.root, 5, 5, payload=1500)
    urls = [shard_server.url(p.name) for p in paths]
    index = tmp_path / "lists" / "index.json"
    doc = make_index(index, *urls)
    indexed, md5 = doc["shardlist"][1]["filesize"], doc["shardlist"][2]["md5sum"]
    shutil.copy(make_dataset(tmp_path / "other", 1, 8, payload=1500)[0], paths[1])  # the data changed since
    size = paths[1].stat().st_size
    assert size != indexed
    doc["shardlist"][2]["md5sum"] = "0" * 32
    doc["shardlist"][3]["nsamples"] = 6
    index.write_text(json.dumps(doc))
    requests_before = {p.name: gets(shard_server, p.name) for p in paths}  # `wdscache index` read each once
    cache = tmp_path / "cache"
    agent = start_agent(cache, index, "--no-shuffle")
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 2 and s["shards"]["failed"] == 3,
        CACHED_IN,
        "the three shards the index misdescribes did not fail",
    )
    failed = {f["url"]: f["error"] for f in s["failed"]}
    assert failed == {
        urls[1]: changed_since_indexed(size, indexed),  # the server said so first: no second copy
        urls[2]: f"MD5 {md5}, but the shard index says {'0' * 32} (downloaded twice)",
        urls[3]: "5 samples, but the shard index says 6",  # the same bytes would count the same: once
    }
    assert [gets(shard_server, p.name) - requests_before[p.name] for p in paths] == [1, 1, 2, 1, 1]
    layout = CacheLayout(cache)
    assert [layout.shard_path(u).exists() for u in urls] == [True, False, False, False, True]
    assert not [f for f in layout.partial_path(urls[1]).parent.iterdir() if f.is_file()]
    lines = consumers(cache, "c", "--on-error", "skip", "--no-shuffle").wait()
    healthy = reference([paths[0], paths[4]], [urls[0], urls[4]])
    assert as_samples(lines) == healthy  # every healthy sample, and no other
    c = consumers(cache, "raising", "--no-shuffle", "--timeout", "20")
    assert c.proc.wait(60) != 0
    assert f"cannot fetch {urls[1]}: {changed_since_indexed(size, indexed)}" in c.log.read_text()


@pytest.mark.parametrize(
    "how", [("--download-parts", "1"), ("--download-part-size", "64K")], ids=["one-get-200", "parts-206"]
)
def test_a_shard_replaced_since_indexed_fails_on_the_size_its_first_answer_gives(
    tmp_path, shard_server, start_agent, how
):
    # Over one GET the 200's Content-Length says the size; in parts, the first 206's Content-Range
    # (the plan's total): either way the shard fails before its body is read, and only once.
    paths = make_dataset(shard_server.root, 2, 4, payload=60_000)  # ~250 KB: four parts of 64K
    urls = [shard_server.url(p.name) for p in paths]
    index = tmp_path / "lists" / "index.json"
    indexed = make_index(index, *urls)["shardlist"][0]["filesize"]
    shutil.copy(make_dataset(tmp_path / "other", 1, 5, payload=60_000)[0], paths[0])
    size = paths[0].stat().st_size
    before = len(shard_server.requests)
    cache = tmp_path / "cache"
    agent = start_agent(cache, index, "--no-shuffle", *how)
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 1 and s["shards"]["failed"] == 1,
        CACHED_IN,
        "the replaced shard did not fail",
    )
    assert s["failed"] == [{"url": urls[0], "error": changed_since_indexed(size, indexed)}]
    sent = [r for r in shard_server.requests[before:] if r.path == paths[0].name and r.method == "GET"]
    assert len(sent) == 1  # one request, not a second copy nor the other parts (a HEAD probes sizes at start)
    one_get = how[0] == "--download-parts"
    assert (sent[0].range, sent[0].status) == ((None, 200) if one_get else ("bytes=0-65535", 206))
    assert sent[0].bytes_sent <= (size if one_get else 64 << 10)  # what socket buffers took; none of it kept
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=20) as loader:
        with pytest.raises(FetchError) as caught:
            list(loader)
    assert str(caught.value) == f"cannot fetch {urls[0]}: {changed_since_indexed(size, indexed)}"
    assert CacheLayout(cache).shard_path(urls[1]).exists()  # the other shard is left as it was


@pytest.mark.slow
def test_a_copy_cached_before_that_is_unlike_the_index_is_downloaded_again_and_checked(
    tmp_path, shard_server, start_agent
):
    paths = make_dataset(shard_server.root, 3, 4, payload=1000)
    urls = [shard_server.url(p.name) for p in paths]
    index = tmp_path / "lists" / "index.json"
    doc = make_index(index, *urls)
    size = doc["shardlist"][1]["filesize"]
    doc["shardlist"][1]["filesize"] = size + 1
    index.write_text(json.dumps(doc))
    cache = tmp_path / "cache"
    agent = start_agent(cache, write_url_list(tmp_path / "lists" / "plain.txt", urls))  # no index: all cached
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, CACHED_IN, "the plain list's shards were not cached")
    agent.stop()
    before = [gets(shard_server, p.name) for p in paths]
    agent = start_agent(cache, index)
    with CachedMultiLoader(cache_dir=cache, on_error="skip", shuffle=False, timeout=30) as loader:
        got = list(loader)
    s = agent.stats()
    assert [(f["url"], f["error"]) for f in s["failed"]] == [(urls[1], changed_since_indexed(size, size + 1))]
    assert s["changed"] == 1
    assert [gets(shard_server, p.name) - b for p, b in zip(paths, before)] == [0, 1, 0]  # the others revalidated
    assert f"{urls[1]} is {size} bytes in the cache, but the shard index says {size + 1}" in agent.stderr_text()
    assert {s["__url__"] for s in got} == {urls[0], urls[2]} and len(got) == 8  # one rank: the failed one's left out


def test_a_job_index_is_checked_too(tmp_path, shard_server, start_agent, consumers):
    paths = make_dataset(shard_server.root, 2, 4, payload=1000)
    urls = [shard_server.url(p.name) for p in paths]
    job = tmp_path / "job.json"
    doc = make_index(job, *urls)
    good = doc["shardlist"][0]["filesize"]
    doc["shardlist"][0]["filesize"] = good - 1
    job.write_text(json.dumps(doc))
    other = tmp_path / "lists" / "other.txt"
    other.parent.mkdir(exist_ok=True)
    other.write_text(shard_server.url(paths[1].name) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, other, "--prefetch", "1")
    lines = consumers(cache, "c", "--urls", str(job), "--on-error", "skip", "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths[1:], urls[1:])
    s = agent.stats()
    assert [(f["url"], f["error"]) for f in s["failed"]] == [(urls[0], changed_since_indexed(good, good - 1))]


# -- malformed indexes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 1}, {"url": "b.tar", "nsamples": "3"}]}',
            'shardlist[1] (\'b.tar\'): "nsamples" must be a whole number >= 0, not "3"',
        ),
        ('{"shardlist": [{"url": "a.tar"}]}', "shardlist[0] ('a.tar'): \"nsamples\" is missing"),
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 1, "filesize": -1}]}',
            "shardlist[0] ('a.tar'): \"filesize\" must be a whole number >= 0, not -1",
        ),
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 1, "md5sum": "xyz"}]}',
            'shardlist[0] (\'a.tar\'): "md5sum" must be 32 hexadecimal digits, not "xyz"',
        ),
        ('{"shardlist": [{"nsamples": 1}]}', 'shardlist[0]: "url" must be a non-empty string'),
        ('{"shardlist": [["a.tar", 1]]}', "shardlist[0]: an entry is an object"),
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 1}, {"url": "./a.tar", "nsamples": 2}]}',
            "shardlist[1] ('./a.tar'): listed before, as shardlist[0], with other facts",
        ),
        ('{"shardlist": [{"url": "ftp://h/a.tar", "nsamples": 1}]}', "shardlist[0] ('ftp://h/a.tar'): unknown scheme"),
        # JSON escapes give strings no path or URL can hold: the agent crashed naming no entry
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 1}, {"url": "b\\u0000.tar", "nsamples": 1}]}',
            "shardlist[1] ('b\\x00.tar'): a URL holds no NUL character and no lone surrogate",
        ),
        (
            '{"shardlist": [{"url": "http://h/a\\ud800.tar", "nsamples": 1}]}',
            "shardlist[0] ('http://h/a\\ud800.tar'): a URL holds no NUL character and no lone surrogate",
        ),
        ('{"shardlist": [{"url": "s3://b/train/", "nsamples": 1}]}', "names one object, not an s3:// prefix"),
        ('{"__kind__": "wids-dataset-v2", "shardlist": []}', '"__kind__" is "wids-dataset-v2"'),
        ('{"wids_version": 2, "shardlist": []}', '"wids_version" is 2'),
        ('{"wids_version": 1, "datasets": [{"source_url": "x.json"}]}', 'sub-datasets ("datasets") are not supported'),
        ('{"name": "x"}', 'no "shardlist" list'),
        ('{\n  "shardlist": [\n', "malformed JSON at line 3 column 1: Expecting value"),
        ('[\n  {"url": "a.tar", "nsamples": 1}\n]', 'a shard index is a JSON object with a "shardlist"'),
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 1000000000000000}]}',
            "shardlist[0] ('a.tar'): \"nsamples\" is 1000000000000000, more than any shard holds (at most 8589934592",
        ),
        (
            '{"shardlist": [{"url": "a.tar", "nsamples": 21, "filesize": 10}]}',
            'shardlist[0] (\'a.tar\'): "nsamples" is 21, but a shard of 10 bytes ("filesize") holds at most 20 samples',
        ),
    ],
)
def test_a_malformed_index_names_the_file_and_the_entry(tmp_path, text, message):
    path = tmp_path / "index.json"
    path.write_text(text)
    with pytest.raises(ShardIndexError) as caught:
        read_url_list(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value), str(caught.value)
    with pytest.raises(ShardIndexError, match=r"shardlist\[|JSON|kind|version|datasets|list"):
        CachedMultiLoader(path, cache_dir=tmp_path / "cache")


def test_the_agent_refuses_a_malformed_index_with_exit_2(tmp_path):
    path = tmp_path / "index.json"
    path.write_text(
        '{"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": [\n'
        '  {"url": "a.tar", "nsamples": 1, "filesize": 10240},\n'
        '  {"url": "b.tar", "nsamples": 2, "filesize": "big"}]}\n'
    )
    r = run_wdscache("agent", "--cache-dir", tmp_path / "cache", "--urls", path, "--min-free", "1M")
    assert r.returncode == 2, r.stderr
    assert (
        f'wdscache: error: {path}: shardlist[1] (\'b.tar\'): "filesize" must be a whole number >= 0, not "big"'
    ) in r.stderr
    assert not (tmp_path / "cache").exists()  # refused before anything on disk changed


TRUNCATED = '{"__kind__": "wids-shard-index-v1", "shardlist": ['


def test_a_truncated_index_is_malformed_json_to_every_reader(tmp_path, dataset):
    data = dataset(1, samples=4, payload=300)
    path = tmp_path / "index.json"
    path.write_text(TRUNCATED)
    said = (
        f"{path}: malformed JSON at line 1 column 51: Expecting value (a file starting like JSON is read as "
        "a shard index, wids JSON)"
    )
    with pytest.raises(ShardIndexError) as caught:
        read_url_list(path)
    assert str(caught.value) == said
    with pytest.raises(ShardIndexError) as caught:
        CachedMultiLoader(path, cache_dir=tmp_path / "cache")
    assert str(caught.value) == said
    for args in (
        ["agent", "--urls", path, "--min-free", "1M"],
        ["prefetch", "--urls", path],
        ["prefetch", data.urls[0], "--urls", path],
        ["verify", "--index", path],
    ):
        r = run_wdscache(*args, "--cache-dir", tmp_path / "cache")
        assert (r.returncode, r.stderr) == (2, f"wdscache: error: {said}\n"), args
    assert not (tmp_path / "cache").exists()


def test_an_index_counts_what_its_sizes_can_hold_even_of_empty_members(tmp_path):
    # A sample of one empty member is one 512-byte header: the tightest a tar packs samples.
    shard = tmp_path / "empty-members.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(40):
            tar.addfile(tarfile.TarInfo(f"{i:06d}.txt"))
    index = make_index(tmp_path / "index.json", shard)
    assert (index["shardlist"][0]["nsamples"], index["shardlist"][0]["filesize"]) == (40, shard.stat().st_size)
    assert read_url_list(tmp_path / "index.json").shards[0].nsamples == wds_count(shard) == 40


def test_a_brace_pattern_list_is_not_taken_for_an_index(tmp_path):
    path = tmp_path / "urls.txt"
    path.write_text("{a,b}.tar\n")
    assert read_url_list(path).urls == (f"file://{tmp_path}/a.tar", f"file://{tmp_path}/b.tar")
    assert read_url_list(path).shards is None


# -- S3 ---------------------------------------------------------------------------------------


@pytest.fixture
def moto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, object, object]]:
    """moto's S3 server on loopback behind the logging proxy: (proxy URL, proxy, boto3 client); fake credentials."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    from scripts.s3_proxy import S3Proxy

    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "WDSCACHE_S3_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
        ("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config")),
        ("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials")),
    ):
        monkeypatch.setenv(name, value)
    port = free_port_range(1)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proxy = S3Proxy(port).start()
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    client.create_bucket(Bucket="shards")
    try:
        yield proxy.url, proxy, client
    finally:
        proxy.stop()
        requests.post(f"http://127.0.0.1:{port}/moto-api/reset", timeout=10)
        server.stop()


@pytest.mark.slow
def test_an_s3_index_is_written_and_a_wrong_size_in_it_is_caught(tmp_path, moto, start_agent, consumers):
    endpoint, proxy, client = moto
    paths = make_dataset(tmp_path / "src", 3, 5, payload=1500)
    for p in paths:
        client.upload_file(str(p), "shards", f"train/{p.name}")
    urls = [f"s3://shards/train/{p.name}" for p in paths]
    index = tmp_path / "lists" / "index.json"
    doc = make_index(index, "s3://shards/train/", env={**os.environ, "WDSCACHE_S3_ENDPOINT_URL": endpoint})
    assert doc["shardlist"] == [
        {"url": u, "nsamples": 5, "filesize": p.stat().st_size, "md5sum": md5_of(p)} for u, p in zip(urls, paths)
    ]
    assert all(len(proxy.gets(u[len("s3://") :])) == 1 for u in urls)
    size = doc["shardlist"][0]["filesize"]
    doc["shardlist"][0]["filesize"] = size * 2
    index.write_text(json.dumps(doc))
    cache = tmp_path / "cache"
    agent = start_agent(cache, index, "--s3-endpoint-url", endpoint)
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 2 and s["shards"]["failed"] == 1,
        CACHED_IN,
        "the misdescribed object did not fail",
    )
    assert s["failed"] == [{"url": urls[0], "error": changed_since_indexed(size, size * 2)}]
    # Once by the index, then the agent's: ContentLength failed the first before its body was read.
    assert [len(proxy.gets(u[len("s3://") :])) for u in urls] == [2, 2, 2]
    lines = consumers(cache, "c", "--on-error", "skip", "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths[1:], urls[1:])


_WHOLE = st.one_of(
    st.integers(min_value=0, max_value=40),
    st.sampled_from([10_000, MAX_SAMPLES, (1 << 63) - 1]),
)
_ENTRIES = st.lists(  # entries the parse takes, mostly (a count too many for its size now and then)
    st.fixed_dictionaries(
        {"url": st.sampled_from(["a.tar", "b.tar", "x/c.tar", "s3://b/d.tar"]), "nsamples": _WHOLE},
        optional={
            "filesize": st.one_of(st.none(), _WHOLE),
            "md5sum": st.one_of(st.none(), st.sampled_from(["0" * 32, "aB" * 16])),
            "other": st.text(max_size=2),
        },
    ),
    max_size=4,
)
_WRONG = {  # values of each key the parse refuses
    "url": [" ", "\t", "", None, 3, []],
    "nsamples": [True, False, 3.0, -1, MAX_SAMPLES + 1, 1 << 64, "3", None],
    "filesize": [True, False, 1.0, -1, 1 << 63, "3", []],
    "md5sum": ["g" * 32, "ab" * 15, "", 3, True],
}


@settings(max_examples=600, deadline=None)
@given(entries=_ENTRIES, data=st.data())
def test_a_well_formed_index_is_read_a_column_at_a_time_as_entry_by_entry(entries, data):
    """The quick read of an index (its values checked a column at a time) takes exactly what the
    entry-by-entry parse takes, and refuses what that parse refuses (which then says why)."""
    if entries and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(_WRONG)))
        entries[data.draw(st.integers(0, len(entries) - 1))][key] = data.draw(st.sampled_from(_WRONG[key]))
    text = json.dumps({"__kind__": KIND, "shardlist": entries})
    try:
        slow = parse_shard_index(text, path="index.json")
    except ShardIndexError:
        slow = None
    quick = _take_entries(text)
    event("taken" if quick is not None else "refused")
    if slow is None:
        assert quick is None
    else:
        assert quick is not None and quick[0] == [url for url, _ in slow] and list(quick[1]) == [i for _, i in slow]


def _spelled(value: object, ascii_only: bool) -> str:
    """``value`` as JSON text; NaN and the infinities as Python's json spells them."""
    return json.dumps(value, ensure_ascii=ascii_only)


def _object(pairs: list[tuple[str, str]], gap: str) -> str:
    """A JSON object of ``pairs`` (key, value's text), a key repeated as written."""
    return "{" + f",{gap}".join(f"{json.dumps(k)}:{gap}{v}" for k, v in pairs) + "}"


_ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=2), inner, max_size=2),
    max_leaves=4,
)
_ENTRY_VALUES = {  # what an entry's key may hold: mostly what the parse takes, sometimes not
    "url": st.sampled_from(["a.tar", "b c.tar", "é.tar", "\ud800.tar", "x\\y.tar", " ", "\u2003", ""])
    | st.text(max_size=4),
    "nsamples": st.sampled_from([0, 3, 1.0, 3e0, -0.0, True, MAX_SAMPLES, MAX_SAMPLES + 1, 1 << 64, None]),
    "filesize": st.sampled_from([None, 0, 512, 1 << 30, 1.5, False, (1 << 63) - 1, 1 << 63]),
    "md5sum": st.sampled_from([None, "0" * 32, "aB" * 16, "0" * 31 + "\n", "0" * 32 + "\n", "g" * 32, 3]),
    "other": _ANY_VALUE,
}


@st.composite
def _index_texts(draw: st.DrawFn) -> str:
    """Index texts spelled every way JSON allows: keys repeated, escapes or not, any spacing,
    values of any type in and around the entries, the index's own fields of any value."""
    ascii_only = draw(st.booleans())
    gap = draw(st.sampled_from(["", " ", "\n  ", "\t"]))
    entries = []
    for _ in range(draw(st.integers(0, 3))):
        keys = draw(st.lists(st.sampled_from(["url", "nsamples", "filesize", "md5sum", "other"]), max_size=6))
        keys = draw(st.permutations(["url", "nsamples", *keys]))
        pairs = [(k, _spelled(draw(_ENTRY_VALUES[k]), ascii_only)) for k in keys]
        entries.append(_object(pairs, gap) if draw(st.integers(0, 9)) else _spelled(draw(_ANY_VALUE), ascii_only))
    top = [("shardlist", "[" + f",{gap}".join(entries) + "]")]
    for key, values in (
        ("__kind__", st.sampled_from([KIND, "other", True])),
        ("wids_version", st.sampled_from([1, 1.0, True, 2])),
        ("datasets", st.sampled_from([None, []])),
        ("name", _ANY_VALUE),
        ("shardlist", st.sampled_from([[], None])),
    ):
        if draw(st.integers(0, 4)) == 0:
            top.append((key, _spelled(draw(values), ascii_only)))
    return gap + _object(draw(st.permutations(top)), gap) + gap


def _one_entry(entry: str) -> str:
    return '{"shardlist": [' + entry + "]}"


@settings(max_examples=500, deadline=None)
@given(text=_index_texts())
@example(text=_one_entry('{"url": "a", "nsamples": 1, "md5sum": "' + "0" * 32 + '\\n"}'))  # ("$" before a "\n")
@example(text=_one_entry('{"url": "\\u2003", "nsamples": 1}'))  # (white space of Unicode's)
@example(text=_one_entry('{"url": "a", "nsamples": 1, "nsamples": -1}'))  # (the last of a key counts)
@example(text=_one_entry('{"url": "a", "nsamples": 1}], "x": [NaN'))
@example(text=_one_entry('{"url": "a", "nsamples": 2000, "filesize": 512}'))  # (more than its size holds)
def test_the_quick_read_of_an_index_takes_only_what_the_standard_parse_takes_alike(text):
    """Whatever JSON spelling an index uses, the quick read (msgspec) either takes exactly what
    the standard library's parse takes, or gives way to it; it never takes what the parse refuses."""
    try:
        slow = parse_shard_index(text, path="index.json")
    except ShardIndexError:
        slow = None
    quick = _take_entries(text)
    event("refused" if slow is None else "taken quickly" if quick is not None else "taken by the parse")
    if quick is not None:
        assert slow is not None and quick[0] == [url for url, _ in slow] and list(quick[1]) == [i for _, i in slow]
    of_bytes = quick_shard_index(text.encode("utf-8", "surrogatepass"))  # (the read of a file's bytes)
    assert of_bytes == (quick if text.isascii() else None)


def test_an_index_nested_deeper_than_a_parser_goes_is_a_malformed_index(tmp_path):
    """Values nested 5,000 deep (deeper than msgspec and json go) are an index error naming the
    file, not a RecursionError: a live edit to such a file would otherwise stop the agent."""
    deep = 5000
    index = tmp_path / "index.json"
    index.write_text('{"shardlist": [{"url": "a.tar", "nsamples": 1, "info": ' + "[" * deep + "]" * deep + "}]}")
    with pytest.raises(ShardIndexError, match=r"index.json: malformed JSON"):
        read_url_list(index)


def test_an_index_with_a_byte_that_is_not_utf8_where_no_entry_reads_it_is_refused_all_the_same(tmp_path):
    """A file's bytes are read as an index without their text only when ASCII: msgspec skips the
    strings of fields no entry has without checking their UTF-8, which the text's read refuses."""
    data = b'{"name": "caf\xe9", "shardlist": [{"url": "a.tar", "nsamples": 1}]}'
    (tmp_path / "index.json").write_bytes(data)
    assert quick_shard_index(data) is None
    with pytest.raises(UrlListError, match=r"index.json:1: not valid UTF-8 \(bad byte at offset 13\)"):
        read_url_list(tmp_path / "index.json")
