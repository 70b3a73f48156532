"""Bytes cross the network once: resumes after a restart or a cancel, several jobs at once;
validators without ETags, pipe: reservations under a small budget, Retry-After on a HEAD."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.agents import FIRST_PART
from tests.helpers.streaming import reference, samples_of
from tests.helpers.waits import wait_for
from wdscache import ShardClient
from wdscache.shared.errors import FetchError
from wdscache.shared.layout import CacheLayout

ROOT = Path(__file__).resolve().parents[1]

# A cancelled connection loses what the server wrote before it saw the close (what was in
# the sockets' buffers: one paced slice here): bytes no client can keep. Nothing more.
IN_FLIGHT = 64 << 10


def body_bytes(server, path: Path) -> int:
    """Body bytes the server sent for ``path`` by GET, over all requests."""
    return sum(r.bytes_sent for r in server.requests if r.path == path.name and r.method == "GET")


def sent_once(server, path: Path) -> bool:
    """The body of ``path`` crossed once: all of it, and beyond it only bytes in flight at a cancel."""
    gets = [r for r in server.requests if r.path == path.name and r.method == "GET"]
    size = path.stat().st_size
    return size <= body_bytes(server, path) <= size + IN_FLIGHT * (len(gets) - 1)


def partial_bytes(cache: Path) -> int:
    folder = CacheLayout.of(cache).partial_dir
    return sum(e.stat().st_size for e in os.scandir(folder)) if folder.exists() else 0


@pytest.mark.slow
def test_a_restart_mid_download_resumes_and_sends_each_body_once(tmp_path, shard_server, dataset, start_agent):
    data = dataset(2, samples=8, payload=150_000)  # ~1.2 MB each
    shard_server.rate = 400_000  # ~3 s a shard: the restart comes in the middle
    cache = tmp_path / "cache"
    args = ("--prefetch", "2", "--download-workers", "2", "--no-shuffle")
    agent = start_agent(cache, data.list_file, *args)
    wait_for(lambda: partial_bytes(cache) > 200_000, 20, lambda: f"no download under way\n{agent.stderr_tail()}")
    assert agent.stop() == 0
    assert partial_bytes(cache) > 0, "a clean stop removed partial files the server gave validators for"
    agent = start_agent(cache, data.list_file, *args)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 30, "shards never cached after the restart")
    for path in data.paths:
        ranges = shard_server.ranges(path.name)
        assert sent_once(shard_server, path), (path.name, ranges, body_bytes(shard_server, path))
        assert ranges[0] == FIRST_PART and ranges[-1] is not None and ranges[-1].startswith("bytes="), ranges
        resumed = [r for r in shard_server.requests if r.path == path.name and r.range][-1]
        assert resumed.if_range and resumed.status == 206
    layout = CacheLayout.of(cache)
    for url, path in zip(data.urls, data.paths):
        assert layout.shard_path(url).read_bytes() == path.read_bytes()
    assert partial_bytes(cache) == 0


@pytest.mark.slow
def test_consumers_of_several_jobs_starting_together_fetch_each_shard_once(
    tmp_path, shard_server, dataset, start_agent, consumers
):
    data = dataset(6, samples=8, payload=150_000)  # ~1.2 MB each
    shard_server.rate = 400_000  # downloads overlap the consumers' hellos and first opens
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "2", "--download-workers", "3")
    started = [
        consumers(
            cache,
            f"{job}-{rank}",
            "--job",
            job,
            "--rank",
            str(rank),
            "--world-size",
            "2",
            "--seed",
            str(seed),
            "--timeout",
            "60",
        )
        for job, seed in (("a", 1), ("b", 2), ("c", 3))
        for rank in range(2)
    ]
    got: dict[str, set] = {}
    for c in started:
        job = c.out.stem.split("-")[0]
        got.setdefault(job, set()).update((s["url"], s["key"]) for s in samples_of(c.wait(120)))
    expected = set(reference(data.paths, data.urls))
    assert all(keys == expected for keys in got.values()), {j: len(k) for j, k in got.items()}
    assert all(sent_once(shard_server, p) for p in data.paths), [
        (r.path, r.range, r.bytes_sent) for r in shard_server.requests if r.method == "GET"
    ]


@pytest.mark.slow
def test_a_cancelled_download_resumes_from_its_partial(tmp_path, shard_server, dataset, start_agent):
    data = dataset(3, samples=8, payload=150_000)
    shard_server.rate = 200_000  # ~6 s a shard
    cache = tmp_path / "cache"
    # A window of one: the start-up plan downloads shard 0 until a reader wants shard 2 (on a
    # connection of its own); shard 0 then leaves every window and is cancelled 3 s later.
    agent = start_agent(cache, data.list_file, "--prefetch", "1", "--download-workers", "1", "--no-shuffle")
    wait_for(lambda: partial_bytes(cache) > 200_000, 20, lambda: f"no download under way\n{agent.stderr_tail()}")
    with ShardClient(cache, timeout=30) as client:
        assert client.open(data.urls[2], timeout=30).read_bytes() == data.paths[2].read_bytes()
        client.release(data.urls[2])
        wait_for(
            lambda: f"abandoning {data.urls[0]}" in agent.stderr_text(),
            10,
            lambda: f"shard 0's download was not cancelled\n{agent.stderr_tail()}",
        )
        assert client.open(data.urls[0], timeout=30).read_bytes() == data.paths[0].read_bytes()
        client.release(data.urls[0])
    ranges = shard_server.ranges(data.paths[0].name)
    assert len(ranges) == 2 and ranges[0] == FIRST_PART and ranges[1].startswith("bytes="), ranges
    assert sent_once(shard_server, data.paths[0]), body_bytes(shard_server, data.paths[0])


@pytest.mark.slow
def test_a_server_without_etags_is_revalidated_by_last_modified(tmp_path, shard_server, dataset, start_agent):
    shard_server.etags = False
    data = dataset(2, samples=3, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "shards never cached")
    assert agent.stop() == 0
    # The same size, other bytes (a payload byte, not a header), a later mtime.
    path = data.paths[1]
    raw = bytearray(path.read_bytes())
    raw[512 + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + 10))
    shard_server.reset_log()
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    with ShardClient(cache, timeout=20) as client:
        for url, p in zip(data.urls, data.paths):
            assert client.open(url, timeout=30).read_bytes() == p.read_bytes(), url
            client.release(url)
        stats = client.stats()
    assert [c["url"] for c in stats["agent"]["changed"]] == [data.urls[1]]
    assert "Last-Modified" in stats["agent"]["changed"][0]["error"]
    assert shard_server.count(data.paths[0].name) == 0
    assert shard_server.count(data.paths[1].name) == 1


def test_pipe_shards_fit_a_small_budget_and_one_too_large_names_its_size(tmp_path, dataset, start_agent):
    data = dataset(4, samples=4, payload=30_000)  # ~130 KB each
    big = dataset(1, samples=12, payload=250_000, prefix="big", list_name="big.txt").paths[0]  # ~3 MB
    lines = [f"pipe:cat {p}" for p in data.paths] + [f"pipe:cat {big}"]
    urls_file = tmp_path / "lists" / "pipes.txt"
    urls_file.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    start_agent(cache, urls_file, "--allow-pipe", "--cache-size", "2M", "--prefetch", "2", "--no-shuffle")
    with ShardClient(cache, timeout=30) as client:
        for url, path in zip(lines, data.paths):
            assert client.open(url, timeout=30).read_bytes() == path.read_bytes(), url
            client.release(url)
        with pytest.raises(FetchError) as info:
            client.open(lines[-1], timeout=30)
    message = str(info.value)
    assert lines[-1] in message and "reached 2." in message and "--cache-size 2.0M" in message, message


def test_retry_after_on_a_size_probe_holds_the_next_request(tmp_path, shard_server, dataset, start_agent):
    data = dataset(1, samples=3, payload=1000)
    name = data.paths[0].name
    shard_server.fail(name, "status", status=503, retry_after=2)  # taken by the start-up HEAD
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "1")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "shard never cached")
    log = [r for r in shard_server.requests if r.path == name]
    assert [(r.method, r.status) for r in log][:2] == [("HEAD", 503), ("GET", 206)], log
    assert log[1].at - log[0].at >= 2.0, log


def test_a_head_held_by_a_retry_after_is_not_sent_and_knows_nothing_at_once(shard_server, dataset):
    """A revalidation's HEAD (a download slot, and maybe a reader's open, wait on it) to a URL a
    Retry-After holds is not sent: it knows nothing now (the cached copy is served), rather than
    an answer once the hold is over (up to 600 s, deaf to the agent's stop)."""
    from wdscache.agent.fetch import Fetcher
    from wdscache.agent.shard_download import Unknown

    data = dataset(1, samples=3, payload=1000)
    name = data.paths[0].name
    shard_server.fail(name, "status", status=503, retry_after=30, times=2)
    fetcher = Fetcher()
    assert fetcher.describe(data.urls[0]) == Unknown("HTTP 503 Service Unavailable")
    t = time.monotonic()
    held = fetcher.describe(data.urls[0])
    took = time.monotonic() - t
    assert isinstance(held, Unknown) and took < 5.0, (held, took)
    m = re.fullmatch(r"not asked: its source's Retry-After holds it (\d+\.\d)s more", held.reason)
    assert m is not None and 20.0 < float(m[1]) <= 30.0, held.reason
    assert [(r.method, r.status) for r in shard_server.requests] == [("HEAD", 503)], shard_server.requests
    assert shard_server.pending_faults(name) == ["status"]


@pytest.mark.slow
def test_a_kept_partial_counts_against_the_budget_and_is_removed_first_for_space(
    tmp_path, shard_server, dataset, start_agent
):
    data = dataset(3, samples=8, payload=150_000)  # ~1.2 MB each
    shard_server.rate = 400_000
    cache = tmp_path / "cache"
    args = ("--prefetch", "1", "--download-workers", "1", "--no-shuffle")
    agent = start_agent(cache, data.list_file, *args, "--cache-size", "2700K")
    wait_for(lambda: partial_bytes(cache) > 200_000, 20, lambda: f"no download under way\n{agent.stderr_tail()}")
    assert agent.stop() == 0
    kept = partial_bytes(cache)  # how far the download came before the stop took effect: more on a busy machine
    assert 0 < kept < data.paths[0].stat().st_size
    # Shard 0 moves to the end of the list: nobody wants it now, its partial stays counted.
    data.list_file.write_text("\n".join([data.urls[1], data.urls[2], data.urls[0]]) + "\n")
    shard_server.rate = None
    # A budget that holds shards 1 and 2, or one of them and the partial, whatever the partial's size.
    budget = data.paths[1].stat().st_size + data.paths[2].stat().st_size + kept // 2
    agent = start_agent(cache, data.list_file, *args, "--cache-size", str(budget))
    with ShardClient(cache, timeout=30) as client:
        assert client.open(data.urls[1], timeout=30).read_bytes() == data.paths[1].read_bytes()
        assert partial_bytes(cache) == kept  # 1.2 MB cached + the partial fit the budget
        # Shard 2 does not fit beside shard 1 (pinned) and the partial: the partial goes, nothing else.
        assert client.open(data.urls[2], timeout=30).read_bytes() == data.paths[2].read_bytes()
        stats = client.stats()
    assert partial_bytes(cache) == 0
    assert f"removing the partial download of {data.urls[0]} to make room" in agent.stderr_text()
    assert stats["shards"]["cached"] == 2


@pytest.mark.slow
def test_the_partial_of_a_shard_removed_from_the_list_is_removed(tmp_path, shard_server, dataset, start_agent):
    data = dataset(2, samples=8, payload=150_000)
    shard_server.rate = 150_000  # ~8 s a shard: still downloading when it has been out of the list 3 s
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    wait_for(lambda: partial_bytes(cache) > 100_000, 20, lambda: f"no download under way\n{agent.stderr_tail()}")
    data.list_file.write_text(data.urls[1] + "\n")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 30, "shard 1 never cached")
    wait_for(
        lambda: partial_bytes(cache) == 0,
        10,
        lambda: f"the partial of the delisted shard stayed\n{agent.stderr_tail()}",
    )
    assert f"no longer wanted, abandoning {data.urls[0]}" in agent.stderr_text()


@pytest.mark.slow
def test_two_pipe_shards_that_do_not_fit_together_do_not_wait_for_each_other(tmp_path, dataset, start_agent):
    data = dataset(2, samples=8, payload=190_000)  # ~1.5 MB each: one fits a 2M budget, both do not
    # Half of each, a pause, the rest: both downloads hold part of the budget when they need more.
    lines = [f"pipe:(head -c 900000 {p}; sleep 0.5; tail -c +900001 {p})" for p in data.paths]
    urls_file = tmp_path / "lists" / "pipes.txt"
    urls_file.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(
        cache,
        urls_file,
        "--allow-pipe",
        "--cache-size",
        "2M",
        "--prefetch",
        "2",
        "--download-workers",
        "2",
        "--no-shuffle",
    )
    with ShardClient(cache, timeout=30) as client:
        for url, path in zip(lines, data.paths):
            assert client.open(url, timeout=30).read_bytes() == path.read_bytes(), f"{url}\n{agent.stderr_tail()}"
            client.release(url)


def test_a_kept_partial_that_is_already_whole_is_published_without_sending_its_body_again(
    tmp_path, shard_server, dataset
):
    """A download cancelled after its last byte came (while a gzip'd shard was being
    decompressed, say) keeps a whole partial file: the resume's Range lies past the end,
    the server answers 416 for that very version, and no byte is fetched again."""
    from wdscache.agent.fetch import Fetcher
    from wdscache.agent.shard_download import Budget, Download, Progress

    data = dataset(1, samples=8, payload=20_000)
    path = data.paths[0]
    fetcher = Fetcher()
    etag = fetcher.describe(data.urls[0]).etag
    partial = tmp_path / "whole.partial"
    partial.write_bytes(path.read_bytes())
    d = Download(
        data.urls[0],
        partial=partial,
        final=tmp_path / "shard.tar",
        progress=Progress(etag=etag),
        budget=Budget(lambda d, total, timeout: True),
    )
    fetcher.fetch(d)
    assert d.final.read_bytes() == path.read_bytes()
    gets = [r for r in shard_server.requests if r.method == "GET"]
    assert [(r.status, r.bytes_sent) for r in gets] == [(416, 0)], gets


_NO_TEMP = """
import sys, tempfile
from wdscache.agent.sources.base import Settings
from wdscache.agent.sources.pipe import PipeSource
from wdscache.agent.shard_download import Retry
source = PipeSource(Settings(10.0, 10.0))
try:
    tempfile.TemporaryFile()
    sys.exit("a temp folder is writable here")
except FileNotFoundError:
    pass  # no usable temporary directory, as under ProtectSystem=strict
with source.open("pipe:cat " + sys.argv[1], 0, None, None) as answer:
    body = b"".join(answer.chunks)
assert body == open(sys.argv[1], "rb").read(), len(body)
try:
    with source.open("pipe:echo 'curl: (6) no host' >&2; exit 6", 0, None, None) as answer:
        b"".join(answer.chunks)
    sys.exit("a failing command was taken")
except Retry as exc:  # (the download's attempts run it again)
    assert "exited with status 6: curl: (6) no host" in str(exc), exc
print("ok")
"""


def test_a_pipe_source_needs_no_writable_temp_folder(tmp_path, dataset):
    # systemd's ProtectSystem=strict leaves the agent no writable temp folder: the command's stderr
    # went to a temp file, and every pipe: shard failed ("No usable temporary directory").
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    data = dataset(1, samples=4, payload=3000)
    read_only = " && ".join(
        f"mount --bind {d} {d} && mount -o remount,bind,ro {d}" for d in ("/tmp", "/var/tmp", str(tmp_path))
    )
    script = tmp_path / "no_temp.py"
    script.write_text(_NO_TEMP)
    r = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'{read_only} && cd {tmp_path} && exec "$0" "$@"',
            sys.executable,
            str(script),
            str(data.paths[0]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    if r.returncode != 0 and "unshare failed" in r.stderr:
        pytest.skip(f"cannot make a mount namespace here: {r.stderr.strip()}")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
