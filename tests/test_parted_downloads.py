"""A large shard downloads as ranged parts in parallel (wdscache.agent.parts), against the real
shard server and moto's S3 server: byte-equal results and epochs, each byte fetched once, a cut
part resumed alone, a changed object fetched anew, no Range support, SIGKILL, a tight budget.

Parts are small here (``--download-part-size 256K``) so that shards of a few MB come in many.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest

from scripts.shard_maker import make_shard, synth_samples
from tests.helpers.streaming import reference, samples_of
from tests.helpers.versions import another_version, replace
from tests.helpers.waits import wait_for
from wdscache.agent.parts import SIDE
from wdscache.shared.layout import CacheLayout

try:
    from tests.test_s3 import CACHED_IN, seaweed, start_on, store  # noqa: F401 (seaweed, store: fixtures)
except pytest.skip.Exception:  # no boto3 or moto: the S3 tests skip, the others run
    store = None

PART = 256 << 10
PARTS = ("--download-parts", "4", "--download-part-size", "256K")
SHAPE = {"samples": 8, "payload": 150_000}  # about 1.2 MB: 5 parts
DEADLINE = 30.0


def spans(ranges: list[str | None]) -> list[tuple[int, int]]:
    """(first, last) byte of each ``bytes=A-B`` Range header; a GET without one fails the test."""
    out = []
    for value in ranges:
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", value or "")
        assert m, f"not a bounded range: {value!r} in {ranges}"
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def assert_tiles(pieces: list[tuple[int, int]], size: int) -> None:
    """The pieces cover bytes 0 to ``size`` - 1 exactly once."""
    at = 0
    for first, last in sorted(pieces):
        assert first == at, f"byte {at} {'fetched twice' if first < at else 'never asked for'}: {sorted(pieces)}"
        at = last + 1
    assert at == size, f"asked up to byte {at} of {size}: {sorted(pieces)}"


def gets(server, name: str) -> list:
    return [r for r in server.requests if r.path == name and r.method == "GET"]


def cached(cache: Path, url: str) -> bytes:
    return CacheLayout.of(cache).shard_path(url).read_bytes()


def partial_files(cache: Path) -> list[Path]:
    root = CacheLayout.of(cache).partial_dir
    return sorted(root.iterdir()) if root.exists() else []


def usable_bytes(cache: Path) -> int:
    """Bytes a resume keeps: the partial file, and the side files that start at or past its end
    (one a kill caught while it was appended overlaps the partial file and is fetched again)."""
    files = partial_files(cache)
    prefix = sum(p.stat().st_size for p in files if SIDE not in p.name)
    sides = [(side_span(p)[0], p.stat().st_size) for p in files if SIDE in p.name]
    return prefix + sum(n for start, n in sides if start >= prefix)


def side_span(path: Path) -> tuple[int, int]:
    """(start, end) of a side file, from its name."""
    m = re.search(r"(\d+)-(\d+)$", path.name)
    assert m, path
    return int(m.group(1)), int(m.group(2))


def as_samples(lines: list[dict]) -> dict[tuple[str, str], dict[str, str]]:
    return {(s["url"], s["key"]): s["fields"] for s in samples_of(lines)}


def most_at_once(server, name: str) -> int:
    """The most GETs of ``name`` whose bodies were under way at one moment (from the server's
    records of when each began and last sent, so a late look misses nothing)."""
    edges = sorted(e for r in gets(server, name) if r.bytes_sent for e in ((r.at, 1), (r.sent_at, -1)))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_large_shard_comes_in_concurrent_parts_each_byte_once(
    shard_server, dataset, start_agent, consumers, tmp_path
):
    ds = dataset(1, **SHAPE)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    assert size > 4 * PART
    shard_server.rate = 400_000  # per connection: the parts run side by side for a while
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, *PARTS, "--prefetch", "1", "--cache-size", "20M")
    c = consumers(cache, "reader", "--no-shuffle")  # reads the shard while it downloads
    lines = c.wait()
    assert as_samples(lines) == reference(ds.paths, ds.urls)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the shard was never cached")
    assert cached(cache, ds.urls[0]) == ds.paths[0].read_bytes()
    reqs = gets(shard_server, name)
    assert all(r.status == 206 for r in reqs), reqs
    assert_tiles(spans([r.range for r in reqs]), size)
    assert sum(r.bytes_sent for r in reqs) == size, reqs  # no byte sent twice
    assert all(r.if_range for r in reqs[1:]) and reqs[0].if_range is None, reqs  # the version of the first answer
    assert partial_files(cache) == []
    assert most_at_once(shard_server, name) >= 3, f"never 3 parts under way at once: {reqs}"


def test_a_cut_part_resumes_alone(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(1, **SHAPE)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    second = f"bytes={PART}-{2 * PART - 1}"
    shard_server.fail(name, "cut", after=100_000, range=second)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, *PARTS, "--prefetch", "1", "--cache-size", "20M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the shard was never cached")
    assert cached(cache, ds.urls[0]) == ds.paths[0].read_bytes()
    reqs = gets(shard_server, name)
    cut = [r for r in reqs if r.fault == "cut"]
    assert len(cut) == 1 and cut[0].range == second and cut[0].bytes_sent == 100_000, reqs
    resumes = [
        r for r in reqs if r.fault is None and spans([r.range])[0][1] == 2 * PART - 1 and spans([r.range])[0][0] > PART
    ]
    assert len(resumes) == 1, f"the cut part was not resumed from its bytes: {reqs}\n{agent.stderr_tail()}"
    start = spans([resumes[0].range])[0][0]
    assert PART < start <= PART + 100_000
    others = [r for r in reqs if r not in cut and r not in resumes]
    # every other byte was asked for once; only what the cut lost in flight came twice
    assert_tiles(spans([r.range for r in others]) + [(PART, start - 1), (start, 2 * PART - 1)], size)
    assert sum(r.bytes_sent for r in reqs) == size + (PART + 100_000 - start)
    assert "retrying bytes" in agent.stderr_text(), agent.stderr_tail()


def test_an_object_changed_mid_download_is_fetched_whole_never_spliced(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(1, **SHAPE)
    src = ds.paths[0]
    name = src.name
    replacement = make_shard(
        tmp_path / "v2" / name, synth_samples(0, SHAPE["samples"], payload=SHAPE["payload"], seed=7)
    )
    assert replacement.read_bytes() != src.read_bytes()
    # The first part stops after 100 KB until the object is replaced, then its answer ends short:
    # its rest is asked for again, of a version the server no longer has, whatever the other
    # parts did meanwhile.
    replaced, first = threading.Event(), f"bytes=0-{PART - 1}"
    shard_server.fail(name, "stall", after=100_000, seconds=DEADLINE, until=replaced, then="close", range=first)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, *PARTS, "--download-parts", "2", "--prefetch", "1", "--cache-size", "20M")
    wait_for(
        lambda: any(r.range == first for r in gets(shard_server, name)),
        DEADLINE,
        lambda: f"the first part never started\n{agent.stderr_tail()}",
    )
    os.replace(replacement, src)  # bodies under way go on with the old file; new requests see the new one
    replaced.set()
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the changed shard was never cached")
    assert cached(cache, ds.urls[0]) == src.read_bytes()  # the new version, whole
    reqs = gets(shard_server, name)
    stale = [i for i, r in enumerate(reqs) if r.if_range and r.status == 200]
    assert stale, f"no part was refused for its old version: {reqs}"
    # after the refusal, the download starts over from byte 0 without naming a version
    restart = next(i for i, r in enumerate(reqs) if i > stale[0] and r.range and r.range.startswith("bytes=0-"))
    assert reqs[restart].if_range is None and reqs[restart].status == 206, reqs
    assert_tiles(
        spans([r.range for r in reqs[restart:]]), src.stat().st_size
    )  # the new version, in parts, each byte once
    assert "the object changed during the download, starting over" in agent.stderr_text(), agent.stderr_tail()
    assert partial_files(cache) == []


def test_a_part_answered_without_the_first_answers_etag_starts_the_shard_over(
    shard_server, dataset, start_agent, tmp_path
):
    # The server ignores If-Range, and after the change sends Last-Modified only: a part's answer
    # then has no ETag at all, which is not the version the first answer named.
    ds = dataset(1, **SHAPE)
    src = ds.paths[0]
    name, size = src.name, src.stat().st_size
    new = another_version(src.read_bytes())
    second = f"bytes={PART}-{2 * PART - 1}"
    shard_server.if_range = False
    shard_server.fail(name, "change", after=100_000, content=new, etags=False, range=second)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, *PARTS, "--prefetch", "1", "--cache-size", "20M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the changed shard was never cached")
    assert cached(cache, ds.urls[0]) == new  # one version, whole
    reqs = gets(shard_server, name)
    restart = max(i for i, r in enumerate(reqs) if r.range == f"bytes=0-{PART - 1}")
    assert restart > 0 and reqs[restart].if_range is None, reqs
    assert_tiles(spans([r.range for r in reqs[restart:]]), size)  # the new version, in parts, each byte once
    assert all(r.if_range and "GMT" in r.if_range for r in reqs[restart + 1 :]), reqs  # named by its date now
    assert "a part's answer is for another version" in agent.stderr_text(), agent.stderr_tail()
    assert partial_files(cache) == []


def test_a_server_without_range_support_gets_one_connection(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(1, **SHAPE)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    shard_server.accept_ranges = False
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, *PARTS, "--prefetch", "1", "--cache-size", "20M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the shard was never cached")
    assert cached(cache, ds.urls[0]) == ds.paths[0].read_bytes()
    reqs = gets(shard_server, name)
    assert [(r.status, r.bytes_sent) for r in reqs] == [(200, size)], reqs


@pytest.mark.slow
def test_sigkill_mid_download_then_restart_fetches_only_what_was_not_on_disk(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(1, samples=12, payload=200_000)  # about 2.4 MB: 10 parts
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    shard_server.rate = 200_000
    cache = tmp_path / "cache"
    args = (*PARTS, "--prefetch", "1", "--cache-size", "20M")
    first = start_agent(cache, ds.list_file, *args)

    def sides_under_way() -> bool:
        files = partial_files(cache)
        return sum(SIDE in p.name and p.stat().st_size > 0 for p in files) >= 2 and any(
            SIDE not in p.name and p.stat().st_size > PART for p in files
        )

    wait_for(sides_under_way, DEADLINE, lambda: f"no parts under way: {partial_files(cache)}\n{first.stderr_tail()}")
    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(10) == -signal.SIGKILL
    held = usable_bytes(cache)
    assert 0 < held < size
    shard_server.rate = None
    before = len(shard_server.requests)
    second = start_agent(cache, ds.list_file, *args)
    second.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the restarted agent did not cache the shard")
    assert cached(cache, ds.urls[0]) == ds.paths[0].read_bytes()
    after = [r for r in shard_server.requests[before:] if r.path == name and r.method == "GET"]
    assert all(r.if_range and r.status == 206 for r in after), after  # resumed, each of the version it holds
    assert sum(r.bytes_sent for r in after) == size - held, (held, after)  # nothing on disk fetched again
    assert partial_files(cache) == []


@pytest.mark.slow
def test_a_kept_partial_resumed_from_a_server_that_ignores_if_range_is_never_spliced(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(1, samples=12, payload=200_000)  # about 2.4 MB: 10 parts
    src = ds.paths[0]
    name, size = src.name, src.stat().st_size
    shard_server.rate = 200_000
    cache = tmp_path / "cache"
    args = (*PARTS, "--prefetch", "1", "--cache-size", "20M")
    first = start_agent(cache, ds.list_file, *args)

    def sides_under_way() -> bool:
        files = partial_files(cache)
        return any(SIDE in p.name and p.stat().st_size > 0 for p in files) and any(
            SIDE not in p.name and p.stat().st_size > PART for p in files
        )

    wait_for(sides_under_way, DEADLINE, lambda: f"no parts under way: {partial_files(cache)}\n{first.stderr_tail()}")
    assert first.stop() == 0  # the partial file and its side files are kept for a resume
    assert any(SIDE in p.name for p in partial_files(cache)), partial_files(cache)
    new = another_version(src.read_bytes())
    replace(src, new)
    shard_server.rate = None
    shard_server.if_range = False  # the resume's answer comes from the new version, as a 206
    shard_server.reset_log()
    second = start_agent(cache, ds.list_file, *args)
    second.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the restarted agent did not cache the shard")
    assert cached(cache, ds.urls[0]) == new  # one version, whole
    reqs = gets(shard_server, name)
    assert reqs[0].if_range and reqs[0].status == 206 and spans([reqs[0].range])[0][0] > PART, reqs
    restart = next(i for i, r in enumerate(reqs) if r.range.startswith("bytes=0-"))
    assert reqs[restart].if_range is None, reqs
    assert_tiles(spans([r.range for r in reqs[restart:]]), size)  # the new version, each byte once
    assert "a resumed answer is for another version" in second.stderr_text(), second.stderr_tail()
    assert partial_files(cache) == []


def test_a_budget_without_room_for_parts_downloads_over_one_connection(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(1, **SHAPE)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    cache = tmp_path / "cache"
    budget = size + PART // 2  # the shard fits; the shard and a part's append do not
    agent = start_agent(cache, ds.list_file, *PARTS, "--prefetch", "1", "--cache-size", str(budget))
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the shard was never cached")
    assert s["bytes_used"] - s["table_bytes"] == size <= budget
    assert cached(cache, ds.urls[0]) == ds.paths[0].read_bytes()
    reqs = gets(shard_server, name)
    assert [r.range for r in reqs] == [f"bytes=0-{PART - 1}", f"bytes={PART}-"], reqs
    assert sum(r.bytes_sent for r in reqs) == size, reqs
    assert "using one connection" in agent.stderr_text(), agent.stderr_tail()


# -- S3 ---------------------------------------------------------------------------------------

needs_s3 = pytest.mark.skipif(store is None, reason="boto3 and moto are needed for the S3 server")


@pytest.mark.slow
@needs_s3
def test_an_s3_object_comes_in_parts_each_byte_once(store, tmp_path, start_agent, consumers):
    urls, paths = store.put_shards("big/", 1, payload=200_000, samples=10)  # about 2 MB: 8 parts
    key, size = urls[0][len("s3://") :], paths[0].stat().st_size
    agent = start_on(start_agent, store, tmp_path, urls, *PARTS)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the object was not cached")
    assert cached(tmp_path / "cache", urls[0]) == paths[0].read_bytes()
    lines = consumers(tmp_path / "cache", "c", "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths, urls)
    got = store.proxy.gets(key)
    assert len(got) == -(-size // PART) and all(g.status == 206 for g in got), got
    assert_tiles(spans([g.range for g in got]), size)
    assert sum(g.sent for g in got) == size
    etag = store.etag("big/" + paths[0].name)
    assert got[0].if_match is None and all(g.if_match == etag for g in got[1:]), got


@pytest.mark.slow
@needs_s3
def test_an_s3_object_replaced_mid_download_is_fetched_anew_in_parts(store, tmp_path, start_agent):
    urls, paths = store.put_shards("big/", 1, payload=200_000, samples=10)
    key = urls[0][len("s3://") :]
    replacement = make_shard(tmp_path / "v2" / paths[0].name, synth_samples(0, 10, payload=200_000, seed=9))
    old = store.etag("big/" + paths[0].name)
    store.proxy.cut(key, after=100_000, then=lambda: store.put("big/" + paths[0].name, replacement))
    agent = start_on(start_agent, store, tmp_path, urls, *PARTS)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the replaced object was not cached")
    assert cached(tmp_path / "cache", urls[0]) == replacement.read_bytes()
    got = store.proxy.gets(key)
    refused = [g for g in got if g.status == 412]
    assert refused and all(g.if_match == old for g in refused), got
    new = store.etag("big/" + paths[0].name)
    restart = max(i for i, g in enumerate(got) if g.range == f"bytes=0-{PART - 1}")
    assert got[restart].if_match is None and all(g.if_match == new for g in got[restart + 1 :]), got
    assert_tiles(spans([g.range for g in got[restart:]]), replacement.stat().st_size)


def test_a_shard_whose_parts_cannot_name_its_version_comes_over_one_connection_without_a_retry(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(1, **SHAPE)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    # A server that honours Range but names no version (some object stores and proxies): no
    # part could be asked for the first answer's version, so none is asked for.
    shard_server.etags = shard_server.last_modified = False
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, *PARTS, "--prefetch", "1", "--cache-size", "20M", "--retries", "0")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, DEADLINE, "the shard was never cached")
    assert cached(cache, ds.urls[0]) == ds.paths[0].read_bytes()
    reqs = gets(shard_server, name)
    assert len(reqs) == 2 and reqs[-1].range in (None, "bytes=0-") and reqs[-1].bytes_sent == size, reqs
    assert partial_files(cache) == []
