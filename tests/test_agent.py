"""Integration tests of the agent: real server, real shards, real agent processes.

Each test starts ``wdscache agent`` through the installed console script against
a :class:`ShardServer` on 127.0.0.1 and checks what a user relies on: which
URLs end up cached, that cached files equal the sources byte for byte, the
budget, exit codes and messages.  Fixtures live in conftest.py.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from scripts.shard_maker import find_gnu_tar, make_dataset, write_url_list
from tests.helpers.agents import FIRST_PART, AgentProc, Dataset
from tests.helpers.procs import stat_fields, worker_pids
from tests.helpers.waits import tail, wait_for
from wdscache import FetchError, ShardClient
from wdscache.agent.cache_commands import evict
from wdscache.shared.client import AgentConnection, resolve_endpoint
from wdscache.shared.index import _SHARD, Index, ShardRecord, ShardState
from wdscache.shared.layout import CacheLayout, shard_name

SHARD_100K = {"samples": 20, "payload": 2500}  # 112,640-byte shards
SHARD_200K = {"samples": 20, "payload": 7500}  # 215,040-byte shards
SHARD_300K = {"samples": 30, "payload": 7500}  # 317,440-byte shards


# -- helpers ---------------------------------------------------------------------------


def cached_files(cache_dir: Path) -> dict[str, Path]:
    """Files under CACHE/shards, by file name."""
    root = CacheLayout.of(cache_dir).shards_dir
    if not root.exists():
        return {}
    return {p.name: p for p in root.rglob("*") if p.is_file()}


def partial_files(cache_dir: Path) -> list[Path]:
    root = CacheLayout.of(cache_dir).partial_dir
    return sorted(root.iterdir()) if root.exists() else []


def cached_urls(cache_dir: Path, ds: Dataset) -> set[str]:
    """The URLs of ``ds`` whose file is in CACHE/shards."""
    names = set(cached_files(cache_dir))
    return {u for u in ds.urls if shard_name(u) in names}


def assert_cached_identical(cache_dir: Path, ds: Dataset, urls: list[str], agent: AgentProc | None = None) -> None:
    layout = CacheLayout.of(cache_dir)
    for url in urls:
        path = layout.shard_path(url)
        where = f"\n{agent.stderr_tail()}" if agent else ""
        assert path.is_file(), f"{url} is not cached at {path}{where}"
        assert path.read_bytes() == ds.source_of(url).read_bytes(), f"cached {url} differs from its source{where}"


def names_of(ds: Dataset) -> list[str]:
    return [p.name for p in ds.paths]


def new_requests(server, since: int, method: str | None = "GET") -> list:
    return [r for r in server.requests[since:] if method is None or r.method == method]


# -- prefetch ---------------------------------------------------------------------------


def test_prefetch_before_any_reader_caches_exactly_the_first_window(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(8)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--no-shuffle", "--cache-size", "10M")

    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 15, "the first 3 shards were never all cached")
    # The agent answers stats between turns of its loop, each of which schedules downloads: this
    # answer comes after a turn that saw the window cached, and a download it started would be
    # downloading now, or have reached the server.
    s = agent.stats()
    assert s["shards"] == {"cached": 3, "downloading": 0, "queued": 0, "failed": 0}, agent.stderr_tail()
    assert s["bytes_used"] - s["table_bytes"] == sum(p.stat().st_size for p in ds.paths[:3])
    beyond = {name: shard_server.count(name, method=None) for name in names_of(ds)[3:]}
    assert beyond == {name: 0 for name in beyond}, f"shards beyond the window were requested\n{agent.stderr_tail()}"
    for name in names_of(ds)[:3]:
        assert shard_server.count(name) == 1, f"{name} fetched {shard_server.count(name)} times"
    assert cached_urls(cache, ds) == set(ds.urls[:3])
    assert_cached_identical(cache, ds, ds.urls[:3], agent)
    assert partial_files(cache) == []


# -- the budget -------------------------------------------------------------------------

READER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from wdscache import ShardClient

    cache_dir, plan_file = sys.argv[1], sys.argv[2]
    plan = json.load(open(plan_file))
    bad, read = [], 0
    with ShardClient(cache_dir, timeout=30) as client:
        for url, source in plan:
            path = client.open(url)
            with open(path, "rb") as f, open(source, "rb") as g:
                if f.read() != g.read():
                    bad.append(url)
            read += 1
            client.release(url)
    print(json.dumps({"read": read, "bad": bad}))
    """
)


class DiskSampler(threading.Thread):
    """Samples the bytes of all files under CACHE/shards and CACHE/partial every ~20 ms.

    A directory walk is not atomic: a file deleted (evicted) after it was counted
    and a partial created after that would both be counted.  So each sample lists
    and stats every file, then stats them all again, and counts only the files
    (by inode, which a rename from partial/ to shards/ keeps) present both times:
    all of those existed together at the end of the first pass, with at least the
    first-pass size (files only grow), so the sum is a lower bound of the real
    usage at that moment and never a false alarm.
    """

    def __init__(self, cache_dir: Path, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        layout = CacheLayout.of(cache_dir)
        self.dirs = [layout.shards_dir, layout.partial_dir]
        self.interval = interval
        self.done = threading.Event()
        self.max_bytes = 0
        self.max_files: list[tuple[str, int]] = []
        self.samples = 0

    def _scan(self) -> dict[int, tuple[str, int]]:
        seen: dict[int, tuple[str, int]] = {}
        for top in self.dirs:
            for folder, _dirs, files in os.walk(top):
                for name in files:
                    try:
                        st = os.stat(os.path.join(folder, name))
                    except FileNotFoundError:
                        continue
                    seen[st.st_ino] = (os.path.join(folder, name), st.st_size)
        return seen

    def run(self) -> None:
        while not self.done.is_set():
            first = self._scan()
            second = self._scan()
            both = {ino: first[ino] for ino in first.keys() & second.keys()}
            total = sum(min(size, second[ino][1]) for ino, (_p, size) in both.items())
            self.samples += 1
            if total > self.max_bytes:
                self.max_bytes = total
                self.max_files = sorted(both.values())
            self.done.wait(self.interval)


def test_budget_never_exceeded_while_three_budgets_of_shards_stream_through(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(24, **SHARD_100K)
    shard_size = max(p.stat().st_size for p in ds.paths)
    total = sum(p.stat().st_size for p in ds.paths)
    budget = total // 3
    assert budget >= 3 * shard_size  # (prefetch + 1) shards fit
    cache = tmp_path / "cache"
    agent = start_agent(
        cache, ds.list_file, "--prefetch", "2", "--no-shuffle", "--cache-size", str(budget), "--download-workers", "4"
    )
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([[u, str(p)] for u, p in zip(ds.urls, ds.paths)]))
    script = tmp_path / "reader.py"
    script.write_text(READER_SCRIPT)

    sampler = DiskSampler(cache, interval=0.002)  # the whole run takes about a second
    sampler.start()
    try:
        reader = subprocess.run(
            [sys.executable, str(script), str(cache), str(plan)],
            capture_output=True,
            text=True,
            timeout=45,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the reader did not finish in 45 s: {tail(str(exc.stderr))}\n{agent.stderr_tail()}")
    finally:
        sampler.done.set()
        sampler.join(5)
    assert reader.returncode == 0, f"reader failed:\n{tail(reader.stderr)}\n{agent.stderr_tail()}"
    result = json.loads(reader.stdout)
    assert result == {"read": 24, "bad": []}
    print(f"max on disk {sampler.max_bytes} of budget {budget} in {sampler.samples} samples")
    assert sampler.samples > 10, "the sampler hardly ran"
    assert sampler.max_bytes <= budget, (
        f"cache held {sampler.max_bytes} bytes on disk, budget {budget}: {sampler.max_files}\n{agent.stderr_tail()}"
    )
    s = agent.stats()
    assert s["bytes_used"] <= budget
    assert s["bytes_limit"] == budget
    assert s["hits"] + s["misses"] == 24
    assert s["shards"]["failed"] == 0
    # It really streamed: more was downloaded than the budget holds.
    assert s["bytes_downloaded"] >= total, s


# -- restarts and locks ------------------------------------------------------------------


@pytest.mark.slow
def test_restart_downloads_nothing_already_cached(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(5)
    cache = tmp_path / "cache"
    args = ("--prefetch", "8", "--no-shuffle", "--cache-size", "10M")
    first = start_agent(cache, ds.list_file, *args)
    first.wait_stats(lambda s: s["shards"]["cached"] == 5, 15, "not all 5 shards were cached")
    assert first.stop() == 0, f"SIGTERM did not give exit 0\n{first.stderr_tail()}"

    before = len(shard_server.requests)
    second = start_agent(cache, ds.list_file, *args)
    # Once its start-up plan settled (its first answers may count the plan's shards queued while
    # it takes them up), nothing downloads and nothing waits; the server says none was fetched.
    s = second.wait_stats(
        lambda s: s["shards"]["downloading"] == s["shards"]["queued"] == 0, 15, "the start-up plan settled"
    )
    assert s["shards"]["cached"] == 5, s
    assert new_requests(shard_server, before) == [], f"the restarted agent downloaded again\n{second.stderr_tail()}"
    hits, misses = s["hits"], s["misses"]
    with ShardClient(cache, timeout=10) as client:
        for url in ds.urls:
            path = client.open(url)
            assert path.read_bytes() == ds.source_of(url).read_bytes()
            client.release(url)
        s = client.stats()
    assert (s["hits"] - hits, s["misses"] - misses) == (5, 0)
    assert new_requests(shard_server, before) == []


def test_second_agent_on_same_cache_dir_is_refused_naming_the_running_pid(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(2)
    cache = tmp_path / "cache"
    first = start_agent(cache, ds.list_file, "--cache-size", "10M")
    second = start_agent(cache, ds.list_file, "--cache-size", "10M", wait=False)
    try:
        rc = second.proc.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the second agent kept running\n{second.stderr_tail()}")
    err = second.stderr_text()
    assert rc == 1, err
    assert f"pid {first.pid}" in err, err
    assert "already running" in err, err
    assert first.running()
    s = first.stats()
    assert s["agent"]["pid"] == first.pid


@pytest.mark.slow
def test_stale_lock_of_a_killed_agent_does_not_block_and_complete_shards_survive(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(6, **SHARD_100K)
    cache = tmp_path / "cache"
    shard_server.rate = 300_000  # about 0.4 s per shard: some done, one in flight when killed
    args = ("--prefetch", "6", "--no-shuffle", "--cache-size", "10M", "--download-workers", "1")
    first = start_agent(cache, ds.list_file, *args)
    wait_for(
        lambda: len(cached_urls(cache, ds)) >= 2, 15, lambda: f"2 shards never reached shards/\n{first.stderr_tail()}"
    )
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    done = cached_urls(cache, ds)
    layout = CacheLayout.of(cache)
    assert layout.lock_path.exists() and layout.state_path.exists(), "nothing stale left to test"
    assert json.loads(layout.state_path.read_text())["pid"] == first.pid

    s = first.stats()  # a dead agent's state file must not make stats hang or lie
    assert s["agent"] is None, s

    shard_server.rate = None
    before = len(shard_server.requests)
    second = start_agent(cache, ds.list_file, *args)
    s = second.wait_stats(lambda s: s["shards"]["cached"] == 6, 15, "the new agent did not cache all 6 shards")
    assert s["agent"]["pid"] == second.pid
    again = {r.path for r in new_requests(shard_server, before)}
    assert not again & {ds.source_of(u).name for u in done}, (
        f"complete shards {sorted(again)} were downloaded again after the crash\n{second.stderr_tail()}"
    )
    assert_cached_identical(cache, ds, ds.urls, second)
    assert cached_urls(cache, ds) == set(ds.urls)
    assert len(cached_files(cache)) == 6
    assert partial_files(cache) == []
    assert s["bytes_used"] - s["table_bytes"] == sum(p.stat().st_size for p in ds.paths)


# -- configuration errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_line, lineno, words",
    [
        ("gs://bucket/x.tar", 3, ["gs"]),
        ("http://127.0.0.1:9/shard-{000..003.tar", 2, ["unclosed", "{"]),
        ("shards/b\0.tar", 3, ["no NUL character", "'shards/b\\x00.tar'"]),  # the agent crashed at its start
        ("http://[zz]/x.tar", 1, ["a host in brackets is an IPv6 address"]),  # and so did this one
    ],
    ids=["unsupported-scheme", "malformed-brace", "nul-in-a-path", "bad-ipv6-host"],
)
def test_bad_url_list_line_is_refused_with_its_line_number(
    shard_server, dataset, run_cli, tmp_path, bad_line, lineno, words
):
    ds = dataset(1)
    lines = [ds.urls[0], "# a comment", ds.urls[0]]
    lines[lineno - 1] = bad_line
    ds.list_file.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    r = run_cli("agent", "--cache-dir", cache, "--urls", ds.list_file, "--cache-size", "10M", timeout=20)
    assert r.returncode == 2, r.stderr
    assert f"urls.txt:{lineno}" in r.stderr, r.stderr
    for word in words:
        assert word in r.stderr, r.stderr
    assert not cache.exists(), f"the cache dir was created: {list(cache.rglob('*'))}"
    assert shard_server.requests == []


def test_a_shard_given_as_the_url_list_is_named_a_shard_not_dumped(shard_server, dataset, run_cli, tmp_path):
    # Its bytes were read as lines: the error quoted a line of NULs and tar header fields.
    ds = dataset(1)
    cache = tmp_path / "cache"
    misnamed = tmp_path / "shard.txt"
    misnamed.write_bytes(ds.paths[0].read_bytes())
    for shard in (ds.paths[0], misnamed):
        said = f"URL list {shard} looks like a shard (a tar file), not a URL list (a text file of URLs, one a line)"
        for args in (
            ("agent", "--cache-dir", cache, "--urls", shard),
            ("prefetch", "--cache-dir", cache, "--urls", shard),
        ):
            r = run_cli(*args, timeout=20)
            assert r.returncode == 2 and said in r.stderr and "\\x00" not in r.stderr, (args, r.stderr)
    assert not cache.exists(), f"the cache dir was created: {list(cache.rglob('*'))}"
    assert shard_server.requests == []


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("--reader-timeout", "nan", "--reader-timeout nan: use a positive number of seconds"),  # was: never timed out
        ("--read-timeout", "inf", "--read-timeout inf: use a positive number of seconds"),
        ("--endpoint", "tcp://127.0.0.1:abc", "endpoint 'tcp://127.0.0.1:abc': use tcp://HOST:PORT with a port in"),
        ("--endpoint", "tcp://127.0.0.1", "endpoint 'tcp://127.0.0.1': use tcp://HOST:PORT with a port in"),
        # The workers listen on the ports after it: the last one's was 65536, and they crashed in a loop.
        (
            "--endpoint",
            "tcp://127.0.0.1:65535",
            "endpoint 'tcp://127.0.0.1:65535': use tcp://HOST:PORT with a port in [1, 65534] (its 1 worker(s) listen",
        ),
        ("--endpoint", "ipc://", "endpoint 'ipc://': give the socket's path"),
        # ZeroMQ took "::1" for an interface's name, and the agent exited as it bound ("No such device").
        ("--endpoint", "tcp://::1:5555", "endpoint 'tcp://::1:5555': write an IPv6 address in brackets"),
        # ZeroMQ binds "*" but dials nothing there: the workers' reports to the agent failed for ever.
        ("--endpoint", "tcp://*:5555", "endpoint 'tcp://*:5555': name an address, tcp://0.0.0.0:5555"),
        # Past any need: the agent spun on a window of 10**12 and ignored SIGTERM; threads ran out.
        ("--prefetch", "1000000000000", "--prefetch 1000000000000: use at most 100000"),
        ("--download-workers", "100000000000", "--download-workers 100000000000: use at most 1024"),
    ],
)
def test_a_bad_option_value_is_refused_naming_it(dataset, run_cli, tmp_path, option, value, says):
    ds = dataset(1)
    cache = tmp_path / "cache"
    r = run_cli("agent", "--cache-dir", cache, "--urls", ds.list_file, "--workers", "1", option, value, timeout=20)
    assert r.returncode == 2 and f"wdscache: error: {says}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not cache.exists()


@pytest.mark.slow
def test_an_endpoint_that_cannot_be_bound_is_refused_naming_it(dataset, run_cli, tmp_path):
    ds = dataset(1)
    with socket.socket() as taken:  # a port someone else listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for endpoint, says in [
            (f"tcp://127.0.0.1:{port}", f"cannot listen on tcp://127.0.0.1:{port} (Address already in use)"),
            # A folder that is not there; a signature in it is never printed.
            (
                f"ipc://{tmp_path}/none/agent.sock?sig=SIGNED",
                f"cannot listen on ipc://{tmp_path}/none/agent.sock?sig=*** (No such file",
            ),
        ]:
            cache = tmp_path / "cache"
            r = run_cli("agent", "--cache-dir", cache, "--urls", ds.list_file, "--endpoint", endpoint, timeout=20)
            assert r.returncode == 2, r.stderr
            assert f"wdscache: error: {says}" in r.stderr and "choose another --endpoint" in r.stderr, r.stderr
            assert not any(word in r.stderr for word in ("Traceback", "SIGNED")), r.stderr
        # The port after the agent's, where its first sample worker listens.
        endpoint = f"tcp://127.0.0.1:{port - 1}"
        r = run_cli(
            "agent", "--cache-dir", tmp_path / "cache", "--urls", ds.list_file, "--endpoint", endpoint, timeout=20
        )
        assert r.returncode == 2, r.stderr
        says = f"wdscache: error: cannot listen on tcp://127.0.0.1:{port} for a sample worker (Address already in use)"
        assert says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_socket_file_left_in_a_read_only_folder_is_refused_naming_the_endpoint(dataset, run_cli, tmpfs, tmp_path):
    # As under a service's sandbox (systemd's ProtectSystem=strict) with an earlier run's socket left.
    ds = dataset(1)
    folder = tmpfs("1m")
    with socket.socket(socket.AF_UNIX) as dead:  # its agent gone: a socket file nobody listens on
        dead.bind(str(folder / "agent.sock"))
    r = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    endpoint = f"ipc://{folder}/agent.sock"
    r = run_cli("agent", "--cache-dir", tmp_path / "cache", "--urls", ds.list_file, "--endpoint", endpoint, timeout=20)
    assert r.returncode == 2, r.stderr
    assert f"wdscache: error: cannot listen on {endpoint} (Read-only file system)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_budget_too_small_for_the_prefetch_window_is_refused(shard_server, dataset, run_cli, start_agent, tmp_path):
    ds = dataset(6, **SHARD_100K)
    shard_size = max(p.stat().st_size for p in ds.paths)
    cache = tmp_path / "cache"
    r = run_cli(
        "agent",
        "--cache-dir",
        cache,
        "--urls",
        ds.list_file,
        "--prefetch",
        "4",
        "--no-shuffle",
        "--cache-size",
        "200K",
        "--min-free",
        "1M",
        timeout=20,
    )
    assert r.returncode == 2, r.stderr
    assert "smallest budget" in r.stderr, r.stderr
    m = re.search(r"smallest budget that works is (\d+) bytes", r.stderr)
    assert m, r.stderr
    need = int(m.group(1))
    assert need >= 5 * shard_size, r.stderr
    assert cached_files(cache) == {}

    # The budget it names does work.
    agent = start_agent(cache, ds.list_file, "--prefetch", "4", "--no-shuffle", "--cache-size", str(need))
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 15, f"a budget of {need} did not hold 4 shards")
    assert s["bytes_limit"] == need
    assert cached_urls(cache, ds) == set(ds.urls[:4])

    # Restarted with a budget it refuses (too small, or 0 taken for "no limit"): nothing is evicted first.
    assert agent.stop() == 0
    for size, says in (("200K", "smallest budget"), ("0", "give --cache-size a size above 0")):
        r = run_cli("agent", "--cache-dir", cache, "--urls", ds.list_file, "--prefetch", "4", "--cache-size", size)
        assert r.returncode == 2 and says in r.stderr and "evicted" not in r.stderr, r.stderr
        assert cached_urls(cache, ds) == set(ds.urls[:4]), r.stderr


# -- download failures ----------------------------------------------------------------


def test_404_shard_fails_while_the_rest_are_cached(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(4)
    missing = shard_server.url("missing-000099.tar")
    urls = ds.urls[:2] + [missing] + ds.urls[2:]
    write_url_list(ds.list_file, urls)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "8", "--no-shuffle", "--cache-size", "10M")
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 4 and s["shards"]["failed"] == 1, 15, "expected 4 cached and 1 failed"
    )
    assert [f["url"] for f in s["failed"]] == [missing]
    assert shard_server.count("missing-000099.tar") == 1, "a 404 was retried"
    assert "404" in s["failed"][0]["error"], s["failed"]
    assert s["shards"]["downloading"] == 0 and s["shards"]["queued"] == 0, s
    assert_cached_identical(cache, ds, ds.urls, agent)
    # A reader asking for it gets the error at once, not a hang.
    with ShardClient(cache, timeout=10) as client:
        with pytest.raises(FetchError, match="404"):
            client.open(missing)
    assert agent.running()
    assert agent.stats()["agent"]["pid"] == agent.pid


LONG_HTML = (
    b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head><body>"
    + b"<p>The upstream object store did not answer in time.</p>" * 40
    + b"</body></html>\n"
)


@pytest.mark.parametrize("body", [None, LONG_HTML], ids=["short-page", "2K-page"])
def test_html_error_page_with_status_200_never_enters_the_cache(shard_server, dataset, start_agent, tmp_path, body):
    ds = dataset(2)
    if body is None:
        shard_server.fail(ds.paths[1].name, "html")  # the server's default 148-byte page
    else:
        shard_server.fail(ds.paths[1].name, "html", body=body)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--no-shuffle", "--cache-size", "10M")
    s = agent.wait_stats(
        lambda s: s["shards"]["cached"] == 1 and s["shards"]["failed"] == 1, 15, "expected 1 cached and 1 failed"
    )
    assert [f["url"] for f in s["failed"]] == [ds.urls[1]]
    assert "HTML" in s["failed"][0]["error"], s["failed"]
    assert cached_urls(cache, ds) == {ds.urls[0]}
    assert_cached_identical(cache, ds, ds.urls[:1], agent)
    assert partial_files(cache) == []


@pytest.mark.parametrize(
    "shape, cut_at",
    [(SHARD_300K, 150_000), ({"samples": 100, "payload": 25_000}, 1_600_000)],
    ids=["300K-shard-cut-at-150K", "2.7M-shard-cut-at-1.6M"],
)
def test_cut_connection_resumes_with_a_range_request(shard_server, dataset, start_agent, tmp_path, shape, cut_at):
    ds = dataset(1, **shape)
    name, size = ds.paths[0].name, ds.paths[0].stat().st_size
    assert cut_at < size
    shard_server.fail(name, "cut", after=cut_at)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "1", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the cut shard was never cached")
    assert_cached_identical(cache, ds, ds.urls, agent)
    ranges = shard_server.ranges(name)
    gets = [r for r in shard_server.requests if r.path == name and r.method == "GET"]
    assert ranges[0] == FIRST_PART and gets[0].fault == "cut", ranges
    starts = [int(m.group(1)) for r in ranges[1:] if r and (m := re.fullmatch(r"bytes=(\d+)-\d*", r))]
    assert any(0 < s <= cut_at for s in starts), (
        f"no resume with Range after {cut_at} bytes were received; GET ranges: {ranges}\n{agent.stderr_tail()}"
    )
    sent = sum(r.bytes_sent for r in gets)
    assert sent < size + cut_at, f"{sent} bytes sent for a {size}-byte shard cut at {cut_at}"
    assert agent.stats()["shards"]["failed"] == 0


def test_no_partial_shard_is_ever_visible_under_shards(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(6, **SHARD_200K)
    sources = {shard_name(u): ds.source_of(u).read_bytes() for u in ds.urls}
    shard_server.rate = 200_000  # ~1 s per shard, three at once
    cache = tmp_path / "cache"
    layout = CacheLayout.of(cache)
    problems: list[str] = []
    partial_seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for path in list(layout.shards_dir.rglob("*")) if layout.shards_dir.exists() else []:
                try:
                    data = path.read_bytes()
                except (FileNotFoundError, IsADirectoryError):
                    continue
                expected = sources.get(path.name)
                if expected is None:
                    problems.append(f"unknown file {path}")
                elif data != expected:
                    problems.append(f"{path.name}: {len(data)} bytes visible, source has {len(expected)}")
            if layout.partial_dir.exists():
                for p in layout.partial_dir.iterdir():
                    try:
                        partial_seen.append(p.stat().st_size)
                    except FileNotFoundError:
                        pass
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        agent = start_agent(cache, ds.list_file, "--prefetch", "6", "--cache-size", "10M", "--download-workers", "3")
        agent.wait_stats(lambda s: s["shards"]["cached"] == 6, 25, "not all 6 shards were cached")
    finally:
        stop.set()
        watcher.join(5)
    assert problems == [], problems[:10]
    assert partial_seen, "the watcher never saw a download in progress"
    assert_cached_identical(cache, ds, ds.urls, agent)
    assert partial_files(cache) == []


@pytest.mark.parametrize("status", [503, 429])
@pytest.mark.slow
def test_retry_after_is_honoured_and_the_download_succeeds(shard_server, dataset, start_agent, tmp_path, status):
    ds = dataset(3)
    cache = tmp_path / "cache"
    agent = start_agent(
        cache, ds.list_file, "--prefetch", "1", "--no-shuffle", "--cache-size", "10M", "--download-workers", "1"
    )
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 15, "shard 0 was never cached")
    name = ds.paths[2].name
    shard_server.fail(name, "status", status=status, retry_after=1)
    with ShardClient(cache, timeout=20) as client:
        t0 = time.monotonic()
        path = client.open(ds.urls[2])
        waited = time.monotonic() - t0
        assert path.read_bytes() == ds.paths[2].read_bytes()
        client.release(ds.urls[2])
    gets = [r for r in shard_server.requests if r.path == name and r.method == "GET"]
    assert [r.status for r in gets] == [status, 206], gets
    assert 1.0 <= waited < 10.0, f"the retry came after {waited:.2f}s, Retry-After said 1 s\n{agent.stderr_tail()}"
    assert f"HTTP {status}" in agent.stderr_text() and "retrying" in agent.stderr_text(), agent.stderr_tail()
    s = agent.stats()
    assert s["shards"]["failed"] == 0
    assert shard_server.count(ds.paths[1].name) == 0  # never in any window


# -- stopping ---------------------------------------------------------------------------


def test_sigterm_during_a_download_exits_0_and_keeps_only_resumable_partials(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(2, **SHARD_300K)
    shard_server.rate = 50_000  # ~6 s per shard: certainly in flight when stopped
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--cache-size", "10M", "--download-workers", "2")
    # In flight: the partial file exists and the server is sending its body.
    wait_for(
        lambda: partial_files(cache) and any(r.bytes_sent > 0 for r in shard_server.requests if r.method == "GET"),
        15,
        lambda: f"no download got under way\n{agent.stderr_tail()}",
    )
    assert agent.stats()["shards"]["downloading"] >= 1
    rc = agent.stop(signal.SIGTERM, timeout=15)
    assert not agent.killed, f"SIGTERM did not stop the agent\n{agent.stderr_tail()}"
    assert rc == 0, f"exit {rc} after SIGTERM\n{agent.stderr_tail()}"
    # The server gave validators: what arrived stays, each a prefix of its source, for a Range resume.
    layout = CacheLayout.of(cache)
    sources = {layout.partial_path(u).name: p for u, p in zip(ds.urls, ds.paths)}
    kept = partial_files(cache)
    assert kept, "no partial file kept: the agent finished its downloads before it stopped"
    for p in kept:
        assert 0 < p.stat().st_size and sources[p.name].read_bytes().startswith(p.read_bytes()), p
    s = agent.stats()
    assert s["agent"] is None
    assert s["shards"]["downloading"] == 0 and s["shards"]["queued"] == 0
    files = cached_files(cache)
    assert s["shards"]["cached"] == len(files), (s, files)
    assert s["bytes_used"] - s["table_bytes"] == sum(p.stat().st_size for p in files.values())
    assert_cached_identical(cache, ds, sorted(cached_urls(cache, ds)))


def test_sigterm_while_the_list_file_cannot_be_read_exits_0_and_leaves_the_cache_dir_as_it_was(start_agent, tmp_path):
    """A list on a hung mount (here a FIFO nobody writes to: its open never returns) blocks the
    start: one SIGTERM still stops the agent, promptly and cleanly."""
    fifo = tmp_path / "urls.txt"
    os.mkfifo(fifo)
    cache = tmp_path / "cache"
    agent = start_agent(cache, fifo, wait=False)
    # Its workers start while the list is read: once they run, the agent waits for the list.
    wait_for(lambda: worker_pids(agent.pid), 20, lambda: f"no worker started\n{agent.stderr_tail()}")
    rc = agent.stop(signal.SIGTERM, timeout=10)
    assert not agent.killed, f"SIGTERM did not stop the agent\n{agent.stderr_tail()}"
    assert rc == 0, f"exit {rc} after SIGTERM\n{agent.stderr_tail()}"
    assert "stopped before the URL list was read" in agent.stderr_text(), agent.stderr_tail()
    assert not cache.exists()  # made by this start, removed as it ended


@pytest.mark.slow
def test_second_sigterm_exits_at_once_and_the_next_agent_cleans_up(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(2, **SHARD_300K)
    for p in ds.paths:  # a body that stops coming: the first SIGTERM's shutdown waits for its thread
        shard_server.fail(p.name, "stall", after=64 << 10, seconds=30)
    cache = tmp_path / "cache"
    args = ("--prefetch", "2", "--cache-size", "10M", "--download-workers", "2")
    first = start_agent(cache, ds.list_file, *args)
    wait_for(
        lambda: len([p for p in partial_files(cache) if p.stat().st_size >= 64 << 10]) == 2,
        15,
        lambda: f"no download got under way\n{first.stderr_tail()}",
    )
    first.proc.send_signal(signal.SIGTERM)
    wait_for(
        lambda: "stopping: abandoning" in first.stderr_text(),  # its shutdown under way, waiting for the stall
        20,
        lambda: f"the first SIGTERM did not start a shutdown\n{first.stderr_tail()}",
    )
    # At once: exit 128+15 (the clean stop under way, which waits on the stalled downloads, would exit 0).
    rc = first.stop(signal.SIGTERM, timeout=10)
    assert not first.killed, f"the second SIGTERM did not stop the agent\n{first.stderr_tail()}"
    assert rc == 128 + signal.SIGTERM, f"exit {rc}\n{first.stderr_tail()}"

    shard_server.rate = None
    second = start_agent(cache, ds.list_file, *args)
    s = second.wait_stats(lambda s: s["shards"]["cached"] == 2, 15, "the next agent did not cache both shards")
    assert_cached_identical(cache, ds, ds.urls, second)
    assert partial_files(cache) == []
    assert len(cached_files(cache)) == 2
    assert s["bytes_used"] - s["table_bytes"] == sum(p.stat().st_size for p in ds.paths)


# -- privacy ----------------------------------------------------------------------------


def test_cache_is_private_and_a_world_writable_cache_dir_is_refused(
    shard_server, dataset, start_agent, run_cli, tmp_path
):
    ds = dataset(3)
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o755)  # readable by others, but not writable: made private, not refused
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--cache-size", "10M")
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 15, "not all 3 shards were cached")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    wrong = []
    for path in [cache, *cache.rglob("*")]:
        st = path.lstat()
        mode = stat.S_IMODE(st.st_mode)
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if mode != want:
            wrong.append(f"{path.relative_to(cache)}: {mode:o}")
    assert wrong == [], f"not private: {wrong}"
    endpoint = s["agent"]["endpoint"]
    assert endpoint.startswith("ipc://"), endpoint
    sock = Path(endpoint[len("ipc://") :])
    st = sock.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, f"{sock}: {stat.S_IMODE(st.st_mode):o}"

    shared = tmp_path / "shared-cache"
    shared.mkdir()
    shared.chmod(0o777)
    r = run_cli("agent", "--cache-dir", shared, "--urls", ds.list_file, "--cache-size", "10M", timeout=20)
    assert r.returncode == 2, r.stderr
    assert "chmod 700" in r.stderr, r.stderr
    assert list(shared.iterdir()) == []
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777


# -- stats ------------------------------------------------------------------------------


@pytest.mark.slow
def test_stats_without_a_cache_exits_1_and_without_an_agent_shows_agent_null(
    shard_server, dataset, start_agent, run_cli, tmp_path
):
    for where in (tmp_path / "nothing-here", tmp_path / "lists"):
        r = run_cli("stats", "--cache-dir", where, "--json", timeout=20)
        assert r.returncode == 1, (where, r.stdout, r.stderr)
        assert "holds no wdscache cache" in r.stderr and str(where) in r.stderr, r.stderr
        assert r.stdout == ""

    ds = dataset(2)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "2", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 15, "not all shards cached")
    assert agent.stop() == 0, agent.stderr_tail()
    r = run_cli("stats", "--cache-dir", cache, "--json", timeout=20)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["agent"] is None
    assert s["shards"] == {"cached": 2, "downloading": 0, "queued": 0, "failed": 0}
    assert s["bytes_limit"] == 10 << 20
    assert s["download_rate"] == 0
    r = run_cli("stats", "--cache-dir", cache, timeout=20)
    assert r.returncode == 0, r.stderr
    assert "not running" in r.stdout, r.stdout
    assert "2 cached" in r.stdout, r.stdout


@pytest.mark.slow
def test_stats_on_a_100000_shard_index_counts_every_shard(run_cli, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    layout = CacheLayout.of(cache)
    n = 100_000
    index = Index(layout.index_dir)
    try:
        # One transaction: records written as the index stores them, summary kept by Summary.
        with index._db.transact():
            for i in range(n):
                rec = ShardRecord(
                    f"http://127.0.0.1:9/big/shard-{i:06d}.tar", ShardState.CACHED, size=1000 + i % 7, cached_at=1.0
                )
                index._db.set(_SHARD + rec.url, rec.to_json())
                index.summary.apply(None, rec)
                index.records[rec.url] = rec
            index.put(rec)  # persists the summary like any change does
        index.set_meta({"bytes_limit": 1 << 30})
    finally:
        index.close()
    r = run_cli("stats", "--cache-dir", cache, "--json", timeout=60)  # (a hang fails; its speed: scripts/bench.py)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["shards"]["cached"] == n
    assert s["bytes_used"] - s["table_bytes"] == sum(1000 + i % 7 for i in range(n))
    assert s["agent"] is None


# -- the URL list -----------------------------------------------------------------------


def test_url_file_is_watched_and_added_shards_are_cached(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(5)
    write_url_list(ds.list_file, ds.urls[:3])
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "10", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 15, "the first 3 shards were not cached")
    assert shard_server.count(ds.paths[3].name) == 0
    with open(ds.list_file, "a") as f:
        f.write(f"{ds.urls[3]}\n{ds.urls[4]}\n")
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 5, 15, "appended shards were not cached")
    assert s["agent"]["pid"] == agent.pid and s["agent"]["urls"] == 5
    assert cached_urls(cache, ds) == set(ds.urls)
    assert_cached_identical(cache, ds, ds.urls, agent)
    log = agent.stderr_text()
    assert "URL list changed: 2 added, 0 removed" in log, agent.stderr_tail()
    assert ds.urls[3] in log and ds.urls[4] in log

    # Editors and config tools replace the file by a rename; that is a change too.
    extra = make_dataset(shard_server.root, 1, 10, payload=2000, prefix="late")[0]
    late = shard_server.url(extra.name)
    tmp = ds.list_file.with_name(".urls.txt.tmp")
    write_url_list(tmp, [*ds.urls, late])
    os.replace(tmp, ds.list_file)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 6, 15, "a shard added by a rename was not cached")
    assert CacheLayout.of(cache).shard_path(late).read_bytes() == extra.read_bytes()
    assert "URL list changed: 1 added, 0 removed" in agent.stderr_text(), agent.stderr_tail()


def _writer(fifo: Path) -> int | None:
    """The write end of ``fifo`` if a reader has it open, else None."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # (ENXIO: no reader)
            raise
        return None


def test_the_agent_answers_while_it_reads_an_edited_list(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(2)
    write_url_list(ds.list_file, ds.urls[:1])
    agent = start_agent(tmp_path / "cache", ds.list_file)
    # The edit: a list whose read lasts until the test writes it (a FIFO), as a read of a huge
    # list, or on a stalled network file system, lasts.
    fifo = ds.list_file.with_name(".urls.fifo")
    os.mkfifo(fifo)
    os.replace(fifo, ds.list_file)
    data = "".join(f"{url}\n" for url in ds.urls).encode()

    fd = wait_for(lambda: _writer(ds.list_file), 15, lambda: f"the edit never read\n{agent.stderr_tail()}")
    try:  # the agent reads the list now, and waits for its bytes
        s = agent.stats()
        assert s["agent"]["answering"] is True, f"an agent reading its list does not answer: {s['agent']}"
        assert s["agent"]["urls"] == 1  # (its list so far)
        os.write(fd, data)
    finally:
        os.close(fd)

    def taken() -> bool:  # each further read of the list gets the same bytes
        fed = _writer(ds.list_file)
        if fed is not None:
            os.write(fed, data)
            os.close(fed)
        s = agent.try_stats()
        return s is not None and (s["agent"] or {}).get("urls") == 2

    wait_for(taken, 15, lambda: f"the edit never taken\n{agent.stderr_tail()}")
    write_url_list(ds.list_file.with_name(".urls.tmp"), ds.urls)
    os.replace(ds.list_file.with_name(".urls.tmp"), ds.list_file)  # a plain file again
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 15, "the added shard cached")
    assert "URL list changed: 1 added, 0 removed (2 shards now)" in agent.stderr_text(), agent.stderr_tail()


def test_gnu_tar_shards_are_cached_byte_identical(shard_server, dataset, start_agent, tmp_path):
    if find_gnu_tar() is None:
        pytest.skip("GNU tar is not installed")
    ds = dataset(3, tool="gnutar", prefix="gnu", **SHARD_100K)
    with open(ds.paths[0], "rb") as f:
        assert f.read(512)[257:265] == b"ustar  \0"  # really the GNU header dialect
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3", "--cache-size", "10M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 15, "GNU tar shards were not cached")
    assert_cached_identical(cache, ds, ds.urls, agent)
    with ShardClient(cache, timeout=10) as client:
        for url in ds.urls:
            path = client.open(url)
            with tarfile.open(path) as tf:
                assert len(tf.getmembers()) == 60
            client.release(url)


def test_local_paths_and_file_urls_resolve_against_the_list_folder(start_agent, tmp_path):
    lists = tmp_path / "lists"
    paths = make_dataset(lists / "data", 4, 10, payload=2000)
    write_url_list(
        lists / "urls.txt",
        [
            "data/shard-000000.tar",
            "./data/../data/shard-000001.tar",
            str(paths[2]),
            "file://" + str(paths[3]),
        ],
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    urls = ["file://" + os.path.normpath(p) for p in paths]
    ds = Dataset(urls, paths, lists / "urls.txt")
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "4", "--cache-size", "10M", cwd=elsewhere)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, 15, "local shards were not cached")
    assert cached_urls(cache, ds) == set(urls)
    assert_cached_identical(cache, ds, urls, agent)
    with ShardClient(cache, timeout=10) as client:
        path = client.open(urls[0])
        assert path.read_bytes() == paths[0].read_bytes()
        client.release(urls[0])


def test_a_refused_pipe_line_names_an_option_the_agent_has(dataset, run_cli, tmp_path):
    ds = dataset(1)
    ds.list_file.write_text(f"{ds.urls[0]}\npipe:curl -s http://127.0.0.1:9/x.tar\n")
    r = run_cli("agent", "--cache-dir", tmp_path / "cache", "--urls", ds.list_file, "--cache-size", "10M", timeout=20)
    assert r.returncode == 2, r.stderr
    assert "urls.txt:2" in r.stderr and "pipe:" in r.stderr, r.stderr
    advised = re.findall(r"--[a-z][a-z-]+", r.stderr)
    assert advised, r.stderr
    help_text = run_cli("agent", "--help", timeout=20).stdout
    missing = [opt for opt in advised if opt not in help_text]
    assert missing == [], f"the message advises {missing}, which 'wdscache agent' does not accept: {r.stderr}"


def test_the_agent_defaults_are_stated_once_in_agent_config(run_cli):
    import dataclasses
    import inspect

    from wdscache import AgentConfig, cli
    from wdscache.agent.fetch import Fetcher

    defaults = {f.name: f.default for f in dataclasses.fields(AgentConfig) if f.default is not dataclasses.MISSING}
    options = {p.name: p.default for p in cli.agent.params if p.name in defaults}
    # Every option that sets a field has that field's default; the others are not options.
    assert options == {name: defaults[name] for name in options}
    assert set(defaults) - set(options) == {"connect_timeout", "backoff", "backoff_max", "startup_prefetch"}
    fetcher = {name: p.default for name, p in inspect.signature(Fetcher).parameters.items()}
    assert fetcher == {name: defaults[name] for name in fetcher}
    # ...and the help shows them as the agent uses them.
    shown = run_cli("agent", "--help").stdout
    assert f"[env var: WDSCACHE_PREFETCH; default: {defaults['prefetch']}]" in " ".join(shown.split())


def test_a_list_edit_answers_who_waits_for_a_removed_shard_and_retries_a_failed_one_listed_again(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(4)
    a, b, c, d = ds.urls
    shard_server.fail(ds.paths[1].name, "status", status=404, times=50)  # b fails for good
    released = threading.Event()
    shard_server.fail(ds.paths[2].name, "stall", seconds=60, until=released)  # c never comes
    write_url_list(ds.list_file, [a, b, c])
    agent = start_agent(tmp_path / "cache", ds.list_file, "--no-shuffle")
    conn = None
    try:
        agent.wait_stats(lambda s: (s["shards"]["cached"], s["shards"]["failed"]) == (1, 1), 20, "a cached, b failed")
        conn = AgentConnection(resolve_endpoint(tmp_path / "cache", None), timeout=30, cache_dir=tmp_path / "cache")
        replies: list[dict] = []
        opening = threading.Thread(target=lambda: replies.append(conn.request({"op": "open", "reader": "r", "url": c})))
        opening.start()
        agent.wait_stats(lambda s: s["misses"] == 1, 20, "the open of c waiting")

        write_url_list(ds.list_file.with_name(".urls.tmp"), [a, d])  # b and c removed
        os.replace(ds.list_file.with_name(".urls.tmp"), ds.list_file)
        opening.join(20)
        assert not opening.is_alive(), "the open of a removed shard is never answered"
        assert replies[0]["ok"] is False and "removed from the agent's URL list" in replies[0]["error"], replies
        assert "URL list changed: 1 added, 2 removed (2 shards now)" in agent.stderr_text(), agent.stderr_tail()
        shown = agent.stats()
        assert shown["shards"]["failed"] == 0 and not shown["failed"], "a shard no list names is shown failed"

        shard_server.clear_faults()  # b is served now: listed again, it is fetched again
        write_url_list(ds.list_file.with_name(".urls.tmp"), [a, b, d])
        os.replace(ds.list_file.with_name(".urls.tmp"), ds.list_file)
        agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "b listed again and cached, d cached")
        assert shard_server.count(ds.paths[1].name) >= 2
    finally:
        released.set()
        if conn is not None:
            conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_cache_directory_removed_under_the_agent_stops_it_with_a_line_saying_so(
    shard_server, dataset, start_agent, tmp_path, how
):
    """A cleaner of old files removes the cache directory (or it is replaced by a new, empty one):
    the agent stops within seconds, exit status 1, with one line that says what happened and what
    to do, not a traceback; downloads in flight go with it."""
    ds = dataset(3, samples=20, payload=50_000)
    shard_server.rate = 200_000  # downloads still running when the directory goes
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file)
    if how == "removed":
        subprocess.run(["rm", "-rf", str(cache)], check=True, timeout=30)
    else:
        cache.rename(tmp_path / "old")
        cache.mkdir()
    try:
        rc = agent.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agent kept running without its cache directory\n{agent.stderr_tail()}")
    err = agent.stderr_text()
    assert rc == 1, err
    assert f"wdscache: error: {cache} was removed or replaced while the agent ran on it" in err, err
    assert "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("removed", "named"),
    [
        (["agent.lock", "index", "shards", "token"], "agent.lock and index/cache.db in {cache} were"),
        (["index"], "index/cache.db in {cache} was"),
    ],
    ids=["lock-index-shards-token", "index"],
)
def test_the_files_of_a_cache_directory_removed_under_the_agent_stop_it_with_a_line_saying_so(
    shard_server, dataset, start_agent, tmp_path, removed, named
):
    """A cleaner of old files removes the files in the cache directory but not the directory (an
    ``rm -rf`` that fails on one folder, systemd-tmpfiles): the lock file a new agent could lock
    anew, the index's database a new agent would write. The agent stops within seconds, exit
    status 1, with one line naming what went, not a traceback; a new agent then starts there."""
    ds = dataset(3, samples=20, payload=50_000)
    shard_server.rate = 200_000  # downloads still running when the files go
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file)
    subprocess.run(["rm", "-rf", *(str(cache / name) for name in removed)], check=True, timeout=30)
    try:
        rc = agent.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agent kept running with its cache directory's files removed\n{agent.stderr_tail()}")
    err = agent.stderr_text()
    assert rc == 1, err
    said = f"wdscache: error: {named.format(cache=cache)} removed or replaced while the agent ran on it: "
    assert said + "the cache directory's files were removed under it" in err, err
    assert "Traceback" not in err, err
    again = start_agent(cache, ds.list_file)  # the directory is free again: a new cache there
    assert again.stats()["agent"]["pid"] == again.pid


@pytest.mark.slow
def test_an_agent_started_where_the_running_agents_lock_file_was_removed_waits_for_it_to_stop(
    shard_server, dataset, start_agent, tmp_path
):
    """A cleaner removed the lock file (and more) under a running agent, and a second agent starts
    on the directory before the first has found so (it is held stopped here): the second locks a
    new lock file, but waits for the first (which agent.json names) to stop before it takes the
    cache, saying so; it serves once the first is gone."""
    ds = dataset(3, samples=20, payload=50_000)
    shard_server.rate = 200_000  # downloads still running when the files go
    cache = tmp_path / "cache"
    first = start_agent(cache, ds.list_file)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        subprocess.run(["rm", "-rf", *(str(cache / n) for n in ("agent.lock", "index", "shards", "token"))], timeout=30)
        second = start_agent(cache, ds.list_file, "--endpoint", f"ipc://{tmp_path}/second.sock", wait=False)
        waiting = f"the agent (pid {first.pid}) on {cache} still runs though its lock file was removed under it"
        wait_for(lambda: waiting in second.stderr_text(), 30, lambda: f"no wait said\n{second.stderr_tail()}")
        assert second.running() and " serving " not in second.stderr_text(), second.stderr_tail()
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.proc.wait(30) == 1, first.stderr_tail()
    assert "the cache directory's files were removed under it" in first.stderr_text(), first.stderr_tail()
    assert second.wait_up()["agent"]["pid"] == second.pid


def test_an_agent_killed_but_not_yet_reaped_does_not_hold_up_a_new_agent_on_its_directory(
    shard_server, dataset, start_agent, tmp_path
):
    """An agent SIGKILLed that its parent has not reaped (a supervisor that has not waited for it
    yet, a loader that started a private agent) is a zombie: its pid and start time are still to
    be seen, but its lock and files went with it. A new agent on the directory starts at once:
    it neither waits for the dead one to stop nor refuses to start as if it still ran."""
    ds = dataset(2, samples=3, payload=100)
    cache = tmp_path / "cache"
    first = start_agent(cache, ds.list_file)
    os.kill(first.pid, signal.SIGKILL)  # (not first.proc.send_signal, whose poll might reap it)
    wait_for(lambda: (stat_fields(first.pid) or ["gone"])[0] == "Z", 10, "the killed agent never became a zombie")
    second = start_agent(cache, ds.list_file, wait=False)
    assert second.wait_up()["agent"]["pid"] == second.pid
    assert "still runs though its lock file was removed" not in second.stderr_text(), second.stderr_tail()
    assert (stat_fields(first.pid) or ["gone"])[0] == "Z"  # (the dead agent was a zombie all along)


def test_a_shard_client_used_again_after_close_lets_go_at_its_next_close(shard_server, dataset, start_agent, tmp_path):
    ds = dataset(2, samples=3, payload=100)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file)
    client = ShardClient(cache, timeout=10)
    client.close()  # never connected: nothing to say
    for url in ds.urls:  # open, close; open again (a new connection), close again
        client.open(url)
        assert agent.stats()["agent"]["pinned"] == 1
        client.close()
        wait_for(lambda: agent.stats()["agent"]["pinned"] == 0, 10, "a pin outlived close()")
    client.close()  # closed already: nothing to say


def test_a_shard_client_shared_by_threads_or_copied_by_fork_keeps_each_ones_pins(
    shard_server, dataset, start_agent, tmp_path
):
    ds = dataset(3, samples=2, payload=100)
    cache = tmp_path / "cache"
    agent = start_agent(cache, ds.list_file, "--prefetch", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "the shards cached")
    expected = [CacheLayout.of(cache).shard_path(url) for url in ds.urls]
    with ShardClient(cache, timeout=10) as client:
        # Threads share one client: their requests take turns, each answered as its own.
        urls = ds.urls * 8
        got: list[Path | BaseException] = [RuntimeError("not run")] * len(urls)

        def open_at(k: int) -> None:
            try:
                got[k] = client.open(urls[k])
            except BaseException as exc:
                got[k] = exc

        threads = [threading.Thread(target=open_at, args=(k,)) for k in range(len(urls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert got == expected * 8
        for url in urls[1:]:
            client.release(url)
        assert agent.stats()["agent"]["pinned"] == 1  # the first shard's one pin left
        # So is an unpickled copy of a client that has asked the agent things (its connection's proofs).
        copy = pickle.loads(pickle.dumps(client))
        assert copy.name != client.name and copy.open(ds.urls[2]) == expected[2]
        copy.close()
        assert agent.stats()["agent"]["pinned"] == 1
        # A forked child's copy is a client of its own: its close() lets go of its own pins, not ours.
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                assert client.open(ds.urls[1]) == expected[1]
                client.close()
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        wait_for(lambda: agent.stats()["agent"]["pinned"] == 1, 10, "the child's pin outlived its close()")
        evicted = evict(cache, [ds.urls[0], ds.urls[1]])
        assert [r["url"] for r in evicted["refused"]] == [ds.urls[0]] and evicted["evicted"] == [ds.urls[1]]
        client.release(ds.urls[0])  # still ours to let go
        assert agent.stats()["agent"]["pinned"] == 0


def test_the_index_database_the_agent_watches_is_the_one_diskcache_writes(tmp_path):
    import diskcache.core

    from wdscache.shared.index import Index
    from wdscache.shared.layout import INDEX_DB, CacheLayout

    layout = CacheLayout.of(tmp_path / "cache")
    layout.index_dir.mkdir(parents=True)
    Index(layout.index_dir).close()
    assert INDEX_DB == diskcache.core.DBNAME and layout.index_db.is_file()
