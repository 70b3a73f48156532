"""Gzip'd shards: decompressed once, into the cache, within its budget.

Real agents (started through the CLI) download real ``.tar.gz`` files (made with
tarfile and gzip, and webdataset's own ``sample.tgz``) from the loopback server;
consumers are real processes. What is checked: the samples are byte-equal to
webdataset's reader of the original ``.tar.gz`` (``__url__`` the original URL) on a
cold cache; the cached file is the plain tar; a shard that expands beyond the budget,
or whose gzip data is damaged, fails with the reason and leaves nothing behind while
the others are served; a large expansion within budget keeps the workers' memory
bounded; a restart does not see a gzip'd shard as changed; a gzip'd file left in the
cache by an agent that kept shards compressed is forgotten and fetched again.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest

from scripts.shard_maker import make_dataset, make_shard, synth_samples, write_url_list
from tests.helpers.procs import rss_kib, worker_pids
from tests.helpers.streaming import reference, samples_of
from tests.helpers.testdata import TESTDATA
from tests.helpers.waits import wait_for
from wdscache import ShardClient
from wdscache.shared.index import Index, ShardRecord, ShardState
from wdscache.shared.layout import CacheLayout

DEADLINE = 60.0
MiB = 1 << 20


def zero_bomb(path: Path, members: int, member_size: int) -> Path:
    """A .tar.gz of ``members`` members of zeros (``key{i}.bin``), written through gzip in chunks:
    a few hundred KB that expand to ``members * member_size`` bytes of tar."""
    zeros = bytes(4 * MiB)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
        for i in range(members):
            info = tarfile.TarInfo(f"key{i:04d}.bin")
            info.size = member_size
            gz.write(info.tobuf(tarfile.USTAR_FORMAT))
            left = member_size
            while left:
                n = min(left, len(zeros))
                gz.write(zeros[:n])
                left -= n
            gz.write(bytes(-member_size % tarfile.BLOCKSIZE))
        gz.write(bytes(2 * tarfile.BLOCKSIZE))
    return path


def multi_member(path: Path, plain: bytes) -> Path:
    """``plain`` as three concatenated gzip members, then zero padding (as some tape writers leave)."""
    cuts = [0, 1000, len(plain) // 2, len(plain)]
    path.write_bytes(b"".join(gzip.compress(plain[a:b], mtime=0) for a, b in zip(cuts, cuts[1:])) + bytes(700))
    return path


def gunzipped(path: Path) -> bytes:
    """The tar inside a .tar.gz (every member, trailing zero padding dropped)."""
    data, out = path.read_bytes(), []
    while data.strip(b"\0"):
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out.append(inflater.decompress(data))
        assert inflater.eof
        data = inflater.unused_data
    return b"".join(out)


def failed_urls(stats: dict) -> dict[str, str]:
    return {f["url"]: f["error"] for f in stats["failed"]}


def no_leftovers(cache: Path, url: str) -> None:
    layout = CacheLayout.of(cache)
    assert not layout.shard_path(url).exists(), f"{url} left a file under shards/"
    assert sorted(p.name for p in layout.partial_dir.iterdir()) == [], "files left in partial/"


@pytest.mark.slow
def test_gzip_shards_stream_cold_byte_equal_to_webdataset_and_are_cached_as_plain_tars(
    tmp_path, shard_server, start_agent, consumers
):
    root = shard_server.root
    plain = make_shard(tmp_path / "m.tar", synth_samples(1, 30))
    paths = [
        make_shard(root / "made-000000.tar.gz", synth_samples(0, 40, payload=20_000), gzip=True),
        multi_member(root / "multi-000001.tgz", plain.read_bytes()),
        make_shard(root / "plain-000002.tar", synth_samples(2, 20)),
    ]
    if (TESTDATA / "sample.tgz").is_file():
        paths.append(Path(shutil.copy(TESTDATA / "sample.tgz", root / "sample.tgz")))
    urls = [shard_server.url(p.name) for p in paths]
    # webdataset (tarfile) reads only a first gzip member: the multi-member shard is held
    # against webdataset's reader of the tar it packs.
    ref = reference([plain if p.name.startswith("multi") else p for p in paths], urls)
    cache = tmp_path / "cache"
    shard_server.rate = 2e6  # bytes/s: the consumer reaches shards still downloading, and streams them
    agent = start_agent(
        cache, write_url_list(tmp_path / "lists" / "urls.txt", urls), "--prefetch", "1", "--workers", "2"
    )
    lines = samples_of(consumers(cache, "cold", "--no-shuffle").wait(DEADLINE))  # started at once: a cold cache
    shard_server.rate = None
    got = {(line["url"], line["key"]): line["fields"] for line in lines}
    assert len(got) == len(lines) == len(ref)
    assert got == ref
    layout = CacheLayout.of(cache)
    for url, path in zip(urls, paths):
        cached = layout.shard_path(url).read_bytes()
        want = gunzipped(path) if path.read_bytes()[:2] == b"\x1f\x8b" else path.read_bytes()
        assert cached == want, f"{url}: the cached file is not the plain tar\n{agent.stderr_tail()}"
    # A warm epoch reads the plain tars the same way (direct reads from the cache files).
    again = samples_of(consumers(cache, "warm", "--no-shuffle").wait(DEADLINE))
    assert {(line["url"], line["key"]): line["fields"] for line in again} == ref
    s = agent.stats()
    assert s["failed"] == [] and s["shards"]["cached"] == len(urls), s
    assert s["bytes_downloaded"] == sum(p.stat().st_size for p in paths), s  # what crossed the network
    assert s["bytes_used"] - s["table_bytes"] == sum(len(layout.shard_path(u).read_bytes()) for u in urls), s


@pytest.mark.slow
def test_a_gzip_bomb_beyond_the_budget_fails_with_the_reason_and_the_others_are_served(
    tmp_path, shard_server, start_agent, consumers
):
    good = [
        make_shard(shard_server.root / f"good-{i:06d}.tar.gz", synth_samples(i, 10, payload=5000), gzip=True)
        for i in range(2)
    ]
    bomb = zero_bomb(shard_server.root / "bomb-000000.tar.gz", 1, 200 * MiB)
    assert bomb.stat().st_size < 1 * MiB
    urls = [shard_server.url(p.name) for p in good]
    bomb_url = shard_server.url(bomb.name)
    cache = tmp_path / "cache"
    agent = start_agent(
        cache,
        write_url_list(tmp_path / "lists" / "urls.txt", [bomb_url, *urls]),
        "--cache-size",
        "40M",
        "--prefetch",
        "2",
        "--no-shuffle",
    )
    s = agent.wait_stats(lambda s: bomb_url in failed_urls(s), DEADLINE, "the bomb never failed")
    error = failed_urls(s)[bomb_url]
    assert "--cache-size 40.0M" in error and "gzip" in error, error
    assert "M decompressed" in error, error  # the size it reached
    no_leftovers(cache, bomb_url)
    wait_for(lambda: agent.stats()["agent"]["bytes_reserved"] == 0, 10, "the bomb's reservation was never given back")
    lines = samples_of(
        consumers(cache, "good", "--urls", str(write_url_list(tmp_path / "good.txt", urls)), "--no-shuffle").wait(
            DEADLINE
        )
    )
    assert {(line["url"], line["key"]): line["fields"] for line in lines} == reference(good, urls)
    assert agent.running()


@pytest.mark.slow
def test_gzip_shards_that_each_wait_for_room_the_others_hold_to_decompress_are_all_served(
    tmp_path, shard_server, start_agent, consumers
):
    """Four gzip'd shards download at once (the one read and --prefetch 3) into a budget that holds
    their compressed files but not one tar more beside them: each waits for room the others hold to
    decompress. One gives way (cancelled, and not started again until another download ends, so its
    space goes to the others) and the epoch is exactly webdataset's."""
    paths = make_dataset(shard_server.root, 5, 10, payload=50_000, gzip=True)  # ~0.5M, a little less than the tar
    urls = [shard_server.url(p.name) for p in paths]
    packed = max(p.stat().st_size for p in paths)
    cache = tmp_path / "cache"
    shard_server.rate = 100_000  # bytes/s: no body ends before all four downloads hold theirs
    agent = start_agent(
        cache,
        write_url_list(tmp_path / "lists" / "urls.txt", urls),
        "--cache-size",
        str(4 * packed + 400_000),  # four compressed files, and less than a tar beside them
        "--prefetch",
        "3",
        "--download-workers",
        "4",
    )
    consumer = consumers(cache, "epoch", "--shuffle-buffer", "1", "--timeout", "10")
    agent.wait_stats(lambda s: s["shards"]["downloading"] == 4, 10, "four downloads at once")
    shard_server.rate = None
    lines = samples_of(consumer.wait(30))
    got = {(line["url"], line["key"]): line["fields"] for line in lines}
    assert len(got) == len(lines), "a sample came twice"
    assert got == reference(paths, urls), agent.stderr_tail()
    assert agent.running()


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_damaged_gzip_data_fails_its_download_with_the_reason(tmp_path, shard_server, start_agent, damage):
    ok = make_shard(shard_server.root / "ok-000000.tar", synth_samples(0, 5))
    bad = make_shard(shard_server.root / "bad-000001.tar.gz", synth_samples(70, 30, payload=7500), gzip=True)
    data = bytearray(bad.read_bytes())
    assert len(data) > 200_000
    if damage == "corrupt":
        for i in range(150_000, 150_064):  # well past the 64 KiB the download checks first
            data[i] ^= 0x5A
        with pytest.raises((OSError, EOFError, zlib.error)):
            gzip.decompress(bytes(data))
        words = "corrupt gzip data"
    else:
        del data[len(data) * 2 // 3 :]
        words = "truncated gzip stream"
    bad.write_bytes(bytes(data))
    urls = [shard_server.url(ok.name), shard_server.url(bad.name)]
    cache = tmp_path / "cache"
    agent = start_agent(cache, write_url_list(tmp_path / "lists" / "urls.txt", urls), "--prefetch", "2")
    s = agent.wait_stats(
        lambda s: urls[1] in failed_urls(s) and s["shards"]["cached"] == 1, DEADLINE, "the damaged shard never failed"
    )
    assert words in failed_urls(s)[urls[1]], s
    no_leftovers(cache, urls[1])


@pytest.mark.slow
def test_a_large_expansion_within_budget_is_served_with_bounded_worker_memory(
    tmp_path, shard_server, start_agent, consumers
):
    bomb = zero_bomb(shard_server.root / "zeros-000000.tar.gz", 40, 10 * MiB)  # 400 MiB of tar
    url = shard_server.url(bomb.name)
    cache = tmp_path / "cache"
    agent = start_agent(
        cache, write_url_list(tmp_path / "lists" / "urls.txt", [url]), "--cache-size", "1G", "--workers", "2"
    )
    peaks = {"workers": 0, "agent": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peaks["workers"] = max([peaks["workers"], *(rss_kib(p) for p in worker_pids(agent.pid))])
            peaks["agent"] = max(peaks["agent"], rss_kib(agent.pid))

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        lines = samples_of(consumers(cache, "zeros", "--no-shuffle").wait(DEADLINE))
        # And while idle afterwards.
        wait_for(lambda: worker_pids(agent.pid), 5, "no workers")
    finally:
        done.set()
        watcher.join(5)
    assert 0 < peaks["workers"] < 150 * 1024, f"a worker's RSS reached {peaks['workers']} KiB"
    assert 0 < peaks["agent"] < 150 * 1024, f"the agent's RSS reached {peaks['agent']} KiB"
    zero_digest = reference([bomb], [url])[(url, "key0000")]
    assert [line["key"] for line in lines] == [f"key{i:04d}" for i in range(40)]
    assert all(line["fields"] == zero_digest for line in lines)
    assert CacheLayout.of(cache).shard_path(url).stat().st_size == 40 * (10 * MiB + 512) + 1024


def test_a_restart_keeps_a_gzip_shard_it_cached(tmp_path, shard_server, start_agent):
    path = make_shard(shard_server.root / "keep-000000.tar.gz", synth_samples(0, 10, payload=5000), gzip=True)
    url = shard_server.url(path.name)
    cache = tmp_path / "cache"
    lists = write_url_list(tmp_path / "lists" / "urls.txt", [url])
    agent = start_agent(cache, lists)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "never cached")
    assert agent.stop() == 0
    shard_server.reset_log()
    agent = start_agent(cache, lists)
    with ShardClient(cache, timeout=20) as client:
        assert client.open(url).read_bytes() == gunzipped(path)
        client.release(url)
        stats = client.stats()
    assert shard_server.count(path.name) == 0, f"downloaded again\n{agent.stderr_tail()}"
    assert stats["changed"] == 0, stats
    assert "changed on the server" not in agent.stderr_text()


def test_a_gzip_shard_its_server_labels_gzip_encoded_is_checked_and_fetched_again_once_changed(
    tmp_path, shard_server, start_agent
):
    """A server that sends ``Content-Encoding: gzip`` with a .tar.gz whatever is asked: its HEAD
    describes the body the GET gets (kept as sent, gunzipped by the agent), so a restarted agent
    checks its copy by it, and serves the new version once the file changed."""
    shard_server.encoding = "gzip"
    path, url, cache, lists = cached_and_stopped(tmp_path, shard_server, start_agent, "label-000000.tar.gz")
    make_shard(path, synth_samples(0, 12, payload=5000, seed=7), gzip=True)
    agent = start_agent(cache, lists)
    with ShardClient(cache, timeout=20) as client:
        assert client.open(url).read_bytes() == gunzipped(path)
        client.release(url)
    assert "changed on the server" in agent.stderr_text(), agent.stderr_tail()


def cached_and_stopped(tmp_path: Path, shard_server: Any, start_agent: Any, name: str) -> tuple[Path, str, Path, Path]:
    """A gzip'd shard ``name`` of 10 samples, cached by an agent that then stopped: its source
    file, URL, cache directory and URL list."""
    path = make_shard(shard_server.root / name, synth_samples(0, 10, payload=5000), gzip=True)
    url = shard_server.url(path.name)
    cache = tmp_path / "cache"
    lists = write_url_list(tmp_path / "lists" / "urls.txt", [url])
    agent = start_agent(cache, lists)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "never cached")
    assert agent.stop() == 0
    return path, url, cache, lists


@pytest.mark.slow
def test_recovery_forgets_a_gzip_file_in_the_cache_and_fetches_the_shard_again(tmp_path, shard_server, start_agent):
    path, url, cache, lists = cached_and_stopped(tmp_path, shard_server, start_agent, "old-000000.tar.gz")
    # What an agent that kept shards compressed left: the .tar.gz itself, recorded at its size.
    layout = CacheLayout.of(cache)
    layout.shard_path(url).write_bytes(path.read_bytes())
    index = Index(layout.index_dir)
    rec = index.get(url)
    index.put(type(rec)(url, rec.state, size=path.stat().st_size, etag=rec.etag, cached_at=rec.cached_at))
    index.close()
    shard_server.reset_log()
    agent = start_agent(cache, lists)
    with ShardClient(cache, timeout=20) as client:
        assert client.open(url).read_bytes() == gunzipped(path)
        client.release(url)
    assert shard_server.count(path.name) == 1, agent.stderr_tail()
    assert "gzip" in agent.stderr_text()


@pytest.mark.slow
def test_a_gzip_shard_published_just_before_a_crash_is_kept_not_downloaded_again(tmp_path, shard_server, start_agent):
    """Killed after the tar is renamed into place and before the index says so: the restart
    adopts the tar with the gzip'd file's size as its source's (the gzip'd file stays until the
    index records the shard), so revalidation finds the source unchanged; with the tar's size it
    called the shard changed on the server and downloaded it again."""
    path, url, cache, lists = cached_and_stopped(tmp_path, shard_server, start_agent, "kept-000000.tar.gz")
    # What the kill leaves: the tar in shards/, the gzip'd file in partial/, the DOWNLOADING record.
    layout = CacheLayout.of(cache)
    index = Index(layout.index_dir)
    rec = index.get(url)
    index.put(ShardRecord(url, ShardState.DOWNLOADING, etag=rec.etag))
    index.close()
    shutil.copyfile(path, layout.partial_path(url))
    shard_server.reset_log()
    agent = start_agent(cache, lists)  # revalidates every cached shard at its start
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the adopted shard not cached")
    with ShardClient(cache, timeout=20) as client:
        assert client.open(url).read_bytes() == gunzipped(path)
        client.release(url)
    assert "adopted 1" in agent.stderr_text(), agent.stderr_tail()
    assert "changed on the server" not in agent.stderr_text(), agent.stderr_tail()
    assert shard_server.count(path.name) == 0, agent.stderr_tail()  # a HEAD at most, no GET
    assert not layout.partial_path(url).exists()


@pytest.mark.slow
def test_a_gzip_bomb_from_a_pipe_source_fails_within_the_budget(tmp_path, shard_server, start_agent):
    """A ``pipe:`` body has no size up front: its tar's growth is held to the budget all the same."""
    bomb = zero_bomb(shard_server.root / "pbomb-000000.tar.gz", 1, 120 * MiB)
    line = f"pipe:cat {bomb}"
    urls_file = tmp_path / "lists" / "pipes.txt"
    urls_file.parent.mkdir(parents=True, exist_ok=True)
    urls_file.write_text(line + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, urls_file, "--allow-pipe", "--cache-size", "40M", "--prefetch", "1")
    peak = [0]

    def failed() -> str | None:
        peak[0] = max(peak[0], sum(p.stat().st_size for p in (cache / "partial").glob("*")))
        return failed_urls(agent.stats()).get(line)

    error = wait_for(failed, DEADLINE, "the pipe: bomb never failed")
    assert "--cache-size 40.0M" in error and "gzip" in error, error
    assert peak[0] <= 40 * MiB, f"its files reached {peak[0]} bytes under a 40 MiB budget"
    no_leftovers(cache, line)


@pytest.mark.slow
def test_a_gzip_expansion_that_fits_only_without_a_step_ahead_is_not_held_up(tmp_path, shard_server, start_agent):
    """The tar is granted what it needs when the budget cannot also hold a step ahead: three
    pinned shards leave 65 MiB of 128; the compressed file (8 MiB) and its tar (56 MiB) fit,
    a step ahead beside them would not."""
    import random

    held = [
        make_shard(shard_server.root / f"held-{i:06d}.tar", synth_samples(i, 21, payload=MiB - 1536)) for i in range(3)
    ]
    noise = random.Random(0).randbytes(8 * MiB)  # does not compress: the .tar.gz stays 8 MiB
    big = shard_server.root / "fit-000000.tar.gz"
    with open(big, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for name, payload in (("a.bin", noise), ("b.bin", bytes(48 * MiB))):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            gz.write(info.tobuf(tarfile.USTAR_FORMAT) + payload)
        gz.write(bytes(2 * tarfile.BLOCKSIZE))
    held_urls, url = [shard_server.url(p.name) for p in held], shard_server.url(big.name)
    cache = tmp_path / "cache"
    agent = start_agent(
        cache,
        write_url_list(tmp_path / "lists" / "urls.txt", [*held_urls, url]),
        "--cache-size",
        "128M",
        "--prefetch",
        "3",
        "--no-shuffle",
    )
    with ShardClient(cache, timeout=30) as client:
        for u in held_urls:
            client.open(u)  # pinned: not evictable while the tar grows
        path = client.open(url, timeout=30)
        assert path.stat().st_size == 56 * MiB + 4 * 512  # two headers, two end blocks
    assert agent.running()


def test_an_index_of_a_gzip_shard_under_a_tar_name_loads_and_serves_it(tmp_path, shard_server, start_agent, run_cli):
    # Gzip is told by a shard's bytes, not its name: the index's "filesize" is then of the
    # compressed bytes, which hold far more samples than a plain tar of that size could.
    plain = tmp_path / "plain.tar"
    make_shard(plain, [{"__key__": f"k{i:03d}", "txt": b"0" * 100} for i in range(200)])
    data = tmp_path / "srv"
    (data / "z.tar").write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    url = shard_server.url("z.tar")
    index = tmp_path / "index.json"
    done = run_cli("index", url, "-o", str(index))
    assert done.returncode == 0, done.stderr
    assert json.loads(index.read_text())["shardlist"][0]["nsamples"] == 200
    assert (data / "z.tar").stat().st_size < 200 * 512  # more samples than a plain tar of this size holds
    cache = tmp_path / "cache"
    agent = start_agent(cache, index)
    with ShardClient(cache, timeout=DEADLINE) as client:
        path = client.open(url)
        assert path.read_bytes() == plain.read_bytes()
    assert agent.running()
