"""Reading a shard while it downloads: the first sample does not wait for the whole shard.

A real agent (started through the CLI) downloads from the rate-capped loopback
server; the loader reads in this process over real sockets. "Before the
download finished" is observed on disk, never timed: the shard is not under
``shards/`` yet when the first sample arrives, and the file that is published
later is the source, byte for byte.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from scripts.shard_maker import make_shard, synth_samples
from tests.helpers.streaming import reference
from tests.helpers.waits import wait_for
from wdscache import CachedMultiLoader, FetchError, ShardError
from wdscache.shared.layout import CacheLayout

RATE = 120_000  # bytes/s per connection: a ~600 KB shard takes about 5 s


def fields_of(sample: dict) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}


@pytest.mark.slow
def test_first_sample_arrives_before_its_shard_is_downloaded_and_the_epoch_is_exact(
    tmp_path, shard_server, dataset, start_agent
):
    data = dataset(2, samples=30, payload=20_000)
    ref = reference(data.paths, data.urls)
    shard_server.rate = RATE
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "2", "--download-workers", "1")
    layout = CacheLayout.of(cache)
    first_url = data.urls[0]
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        it = iter(loader)
        first = next(it)
        # Served from the download in progress, which is not in the cache yet.
        assert first["__url__"] == first_url
        assert not layout.shard_path(first_url).exists()
        assert layout.partial_path(first_url).exists()
        got = [first, *it]
    assert [(s["__url__"], s["__key__"]) for s in got] == list(ref)
    for s in got:
        assert fields_of(s) == ref[(s["__url__"], s["__key__"])]
    # What was published is the whole source file; nothing partial is left behind.
    for url, path in zip(data.urls, data.paths):
        wait_for(lambda url=url: layout.shard_path(url).exists(), 30, f"{url} published")
        assert layout.shard_path(url).read_bytes() == path.read_bytes()
    assert not any(layout.partial_dir.iterdir())


@pytest.mark.slow
def test_a_download_that_starts_over_while_read_still_gives_exact_samples(tmp_path, shard_server, dataset, start_agent):
    data = dataset(1, samples=30, payload=20_000)
    ref = reference(data.paths, data.urls)
    shard_server.rate = RATE
    # No Range support: the broken connection makes the download start again from byte 0,
    # truncating the file that the workers are reading.
    shard_server.accept_ranges = False
    shard_server.fail(data.paths[0].name, "cut", after=300_000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "1")
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
        got = list(loader)
    assert [(s["__url__"], s["__key__"]) for s in got] == list(ref)
    for s in got:
        assert fields_of(s) == ref[(s["__url__"], s["__key__"])]
    assert "retrying" in agent.stderr_text()


def test_a_download_that_fails_while_read_raises_a_clear_error(tmp_path, shard_server, dataset, start_agent):
    data = dataset(1, samples=30, payload=20_000)
    shard_server.rate = RATE
    # The download stops short after 200 KB, once the loader has a sample of it (on a busy
    # machine the loader may start later than a fixed cut would come).
    first = threading.Event()
    shard_server.fail(data.paths[0].name, "stall", after=200_000, seconds=60, until=first, then="close")
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "1", "--retries", "0")
    delivered = []
    try:
        with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30) as loader:
            with pytest.raises(FetchError) as info:
                for sample in loader:
                    delivered.append(sample)
                    first.set()
    finally:
        first.set()
    assert data.urls[0] in str(info.value)
    assert "gave up" in str(info.value)
    # Samples came while the shard downloaded, before the failure, and they were right.
    assert delivered
    ref = reference(data.paths, data.urls)
    for s in delivered:
        assert fields_of(s) == ref[(s["__url__"], s["__key__"])]


def test_reads_of_a_shard_still_downloading_go_to_one_worker(tmp_path, shard_server, dataset, start_agent):
    """Each worker asked for samples of a download walks its headers so far: while it
    downloads, a shard's reads and counts all go to the one worker that walks it."""
    data = dataset(1, samples=30, payload=20_000)
    ref = reference(data.paths, data.urls)
    shard_server.rate = RATE
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle", "--workers", "2")
    layout = CacheLayout.of(cache)
    url = data.urls[0]
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30, request_size=1) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(4)]
        # Every read so far went out before this: with the shard not published yet.
        assert not layout.shard_path(url).exists()
    assert [(s["__url__"], s["__key__"]) for s in got] == list(ref)[:4]
    for s in got:
        assert fields_of(s) == ref[(s["__url__"], s["__key__"])]
    stats = agent.wait_stats(
        lambda s: sum(w.get("samples", 0) for w in s["agent"]["workers"]) >= 4,
        30,
        "the workers' reports of their reads",
    )
    workers = {w["index"]: w for w in stats["agent"]["workers"]}
    assert workers[0]["samples"] >= 4 and workers[0]["requests"] >= 4, workers
    assert workers[1].get("requests", 0) == 0 and workers[1].get("samples", 0) == 0, workers


@pytest.mark.slow
def test_a_shard_that_starts_over_on_a_shorter_version_while_read_fails_naming_both_counts(
    tmp_path, shard_server, dataset, start_agent
):
    """Its source replaced mid-download by a version of fewer samples than the epoch gave out
    already: the epoch cannot end that shard where it planned to, so it fails there, saying why."""
    data = dataset(1, samples=30, payload=20_000)
    url = data.urls[0]
    new = make_shard(tmp_path / "new.tar", synth_samples(0, 3, payload=20_000, seed=7)).read_bytes()
    shard_server.rate = RATE
    shard_server.fail(data.paths[0].name, "change", after=400_000, content=new)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--no-shuffle", "--prefetch", "1")
    old = reference(data.paths, data.urls)
    delivered = []
    with CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=30, request_size=1) as loader:
        with pytest.raises(ShardError) as info:
            delivered.extend(loader)
    message = str(info.value)
    assert url in message and "changed at its source since this epoch was planned: it holds 3 samples now" in message
    planned = int(message.split("samples now, ")[1].split(" then")[0])
    assert planned > 3 and len(delivered) <= planned
    assert all(fields_of(s) == old[(s["__url__"], s["__key__"])] for s in delivered[:3])
