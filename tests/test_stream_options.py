"""Streaming with options: endpoints, back-pressure, loader options, errors, stats.

Real agents (through the CLI), a real HTTP shard server, real consumer processes
or in-process ``CachedMultiLoader``s; nothing is mocked. Every wait has a
deadline and a message; every process started here is stopped and reaped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.shard_maker import make_shard, synth_samples, write_url_list
from tests.helpers.agents import run_wdscache
from tests.helpers.net import free_port_range
from tests.helpers.procs import alive, children_of, cmdline, kill_left, rss_kib, worker_pids
from tests.helpers.streaming import delivered, reference
from tests.helpers.waits import stop_process, wait_for
from wdscache import CachedMultiLoader, FetchError, ShardError, WdsCacheError
from wdscache.agent.worker import REPORT_EVERY
from wdscache.shared.layout import CacheLayout

ROOT = Path(__file__).resolve().parents[1]

LOADER_TIMEOUT = 20.0
PROC_DEADLINE = 60.0

# A consumer process that reads ``pause_after`` samples, says so in ``marker``,
# then waits (not reading) until the test creates ``go``, then reads the rest.
SLOW_CONSUMER = r"""
import hashlib, json, logging, sys, time
from pathlib import Path
from wdscache import CachedMultiLoader, Tuning

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

cfg = json.loads(sys.argv[1])
out, marker, go = Path(cfg.pop("out")), Path(cfg.pop("marker")), Path(cfg.pop("go"))
pause_after = cfg.pop("pause_after")
if "tuning" in cfg:
    cfg["tuning"] = Tuning(**cfg["tuning"])
loader = CachedMultiLoader(**cfg)
n = 0
with open(out, "w") as f:
    for sample in loader:
        fields = {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}
        nbytes = sum(len(v) for k, v in sample.items() if not k.startswith("__"))
        f.write(json.dumps({"key": sample["__key__"], "url": sample["__url__"], "fields": fields,
                            "nbytes": nbytes}) + "\n")
        f.flush()
        n += 1
        if n == pause_after:
            marker.write_text(str(n))
            deadline = time.monotonic() + 120
            while not go.exists():
                if time.monotonic() > deadline:
                    sys.exit("never told to go on")
                time.sleep(0.02)
    f.write(json.dumps({"done": n}) + "\n")
"""


# -- helpers -----------------------------------------------------------------------


def lines_delivered(lines: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, str]]:
    out: dict[tuple[str, str], dict[str, str]] = {}
    for line in lines:
        if "key" in line:
            uk = (line["url"], line["key"])
            assert uk not in out, f"sample {uk} delivered twice"
            out[uk] = line["fields"]
    return out


def loader(cache: Path | None, job: str, **kw: Any) -> CachedMultiLoader:
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    kw.setdefault("timeout", LOADER_TIMEOUT)
    return CachedMultiLoader(kw.pop("urls", None), cache_dir=cache, job=job, **kw)


def corrupt_later_member(path: Path, member_index: int) -> int:
    """Flip a byte in the name of member ``member_index``'s header (its checksum no longer matches)."""
    import tarfile

    with tarfile.open(path) as tf:
        infos = tf.getmembers()
    offset = infos[member_index].offset
    assert offset >= 512 * 4, "corrupt a member well after the head the download checks"
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return offset


class SlowConsumer:
    def __init__(self, tmp: Path, script: Path, name: str, cfg: dict[str, Any]) -> None:
        self.name = name
        self.out, self.log = tmp / f"{name}.jsonl", tmp / f"{name}.log"
        self.marker, self.go = tmp / f"{name}.paused", tmp / f"{name}.go"
        cfg = {**cfg, "out": str(self.out), "marker": str(self.marker), "go": str(self.go)}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), json.dumps(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        return f"--- consumer {self.name} log ---\n{self.log.read_text(errors='replace')[-3000:]}"

    def wait_paused(self, timeout: float = 30.0) -> None:
        def paused() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"consumer {self.name} exited {self.proc.returncode} before pausing\n{self.log_tail()}",
                    pytrace=False,
                )
            return self.marker.exists()

        wait_for(paused, timeout, lambda: f"consumer {self.name} never paused\n{self.log_tail()}")

    def resume(self) -> None:
        self.go.write_text("go")

    def finish(self, timeout: float = PROC_DEADLINE) -> list[dict[str, Any]]:
        self.resume()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_process(self.proc, signal.SIGKILL, 5)
            pytest.fail(f"consumer {self.name} did not finish in {timeout}s\n{self.log_tail()}", pytrace=False)
        assert rc == 0, f"consumer {self.name} exited {rc}\n{self.log_tail()}"
        lines = [json.loads(line) for line in self.out.read_text().splitlines()]
        assert lines and "done" in lines[-1], f"consumer {self.name} output has no end line"
        return lines


@pytest.fixture
def slow_consumer(tmp_path: Path):
    script = tmp_path / "slow_consumer.py"
    script.write_text(SLOW_CONSUMER)
    started: list[SlowConsumer] = []

    def start(name: str, **cfg: Any) -> SlowConsumer:
        c = SlowConsumer(tmp_path, script, name, cfg)
        started.append(c)
        return c

    yield start
    for c in started:
        if c.proc.poll() is None:
            stop_process(c.proc, signal.SIGKILL, 5)


def _tag(sample: dict[str, Any]) -> tuple[str, str, str, int]:
    """The map function of the map test: module level, so the pool's processes can be sent it."""
    return sample["__key__"], sample["__url__"], hashlib.sha256(sample["jpg"]).hexdigest(), os.getpid()


_SET_AT_RUN_TIME: str | None = None  # set by a test in its own process only


def _run_time_mark(sample: dict[str, Any]) -> tuple[str, str | None]:
    """What a map worker sees of a global the test process set at run time (a fork would see it)."""
    return sample["__key__"], _SET_AT_RUN_TIME


def _dies(sample: dict[str, Any]) -> None:
    """A map function whose process dies (as one killed for memory): its item never comes back."""
    os._exit(9)


def _keys_collate(batch: list[dict[str, Any]]) -> tuple[str, ...]:
    return tuple(s["__key__"] for s in batch)


def wait_cached(agent, n: int, timeout: float = 30.0) -> dict[str, Any]:
    return agent.wait_stats(lambda s: s["shards"]["cached"] == n, timeout, f"{n} shards cached")


# -- 1. a cache directory too deep for a Unix socket path ---------------------------------


def test_long_cache_dir_gets_private_socket_under_tmp(tmp_path, dataset, start_agent):
    data = dataset(3, samples=4, payload=500)
    cache = tmp_path / ("d" * 40) / ("e" * 40) / "cache"
    assert len(os.fsencode(cache / "agent.sock")) > 108
    agent = start_agent(cache, data.list_file, "--prefetch", "3", "--workers", "2")

    endpoint = CacheLayout.of(cache).default_endpoint()
    folder = Path(f"/tmp/wdscache-{os.getuid()}")
    assert endpoint.startswith(f"ipc://{folder}/") and endpoint.endswith(".sock"), endpoint
    assert agent.stats()["agent"]["endpoint"] == endpoint
    assert not (cache / "agent.sock").exists()
    sock = Path(endpoint[len("ipc://") :])
    st = sock.stat()
    assert stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid()
    assert stat.S_IMODE(st.st_mode) == 0o600, f"agent socket {sock} has mode {stat.S_IMODE(st.st_mode):o}"
    for i in range(2):
        wsock = Path(f"{str(sock)[: -len('.sock')]}-w{i}.sock")
        wst = wsock.stat()
        assert stat.S_ISSOCK(wst.st_mode) and stat.S_IMODE(wst.st_mode) == 0o600, (
            f"worker socket {wsock} has mode {stat.S_IMODE(wst.st_mode):o}"
        )
    fst = folder.stat()
    assert fst.st_uid == os.getuid() and stat.S_IMODE(fst.st_mode) == 0o700, (
        f"{folder} has mode {stat.S_IMODE(fst.st_mode):o}"
    )

    got = delivered(list(loader(cache, "long")))
    assert got == reference(data.paths, data.urls)
    assert len(got) == 12
    # Through a short symlink to it, the same agent (its socket is named by the real path).
    link = tmp_path / "c"
    link.symlink_to(cache)
    assert delivered(list(loader(link, "link"))) == got


# -- 2. TCP endpoints ------------------------------------------------------------------------


def test_loopback_tcp_endpoint_streams_and_remote_bind_needs_allow_remote(tmp_path, dataset, start_agent, monkeypatch):
    data = dataset(3, samples=5, payload=700)
    port = free_port_range(3)  # the agent on PORT, its 2 workers on PORT+1, PORT+2
    endpoint = f"tcp://127.0.0.1:{port}"
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--workers", "2", "--prefetch", "3", "--endpoint", endpoint)
    assert agent.stats()["agent"]["endpoint"] == endpoint

    # A consumer that does not see the cache directory (another machine) holds its token all the same.
    with pytest.raises(WdsCacheError, match="WDSCACHE_TOKEN"):
        iter(loader(None, "no-token", endpoint=endpoint))
    monkeypatch.setenv("WDSCACHE_TOKEN", (cache / "token").read_text())
    got = delivered(list(loader(None, "tcp", endpoint=endpoint)))
    assert got == reference(data.paths, data.urls)
    assert len(got) == 15
    # Over TCP a peer may be another machine: it must not make the agent read local files.
    with pytest.raises(WdsCacheError) as info:
        iter(loader(None, "tcp-file", endpoint=endpoint, urls=[f"file://{data.paths[0]}"]))
    assert f"file://{data.paths[0]}" in str(info.value) and "http://" in str(info.value), str(info.value)

    remote_cache = tmp_path / "remote-cache"
    r = run_wdscache(
        "agent",
        "--cache-dir",
        remote_cache,
        "--urls",
        data.list_file,
        "--min-free",
        "1M",
        "--endpoint",
        f"tcp://0.0.0.0:{port + 10}",
    )
    assert r.returncode == 2, f"exit {r.returncode}; stderr: {r.stderr}"
    assert "--allow-remote" in r.stderr and f"tcp://0.0.0.0:{port + 10}" in r.stderr, r.stderr
    assert not remote_cache.exists(), "a refused agent must not create its cache directory"
    assert agent.running()


# -- 3. back-pressure and bounded memory ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["keywords", "tuning"])
def test_paused_consumer_stops_asking_and_memory_stays_flat(tmp_path, dataset, start_agent, slow_consumer, spelling):
    data = dataset(8, samples=20, payload=50_000)  # 160 samples, ~8 MB
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--workers", "2", "--prefetch", "8")
    wait_cached(agent, 8)
    request_size, inflight, pause_after = 4, 2, 6
    # The knobs as keywords of their own (as callers always could) or as one Tuning.
    knobs = {"request_size": request_size, "inflight": inflight}
    c = slow_consumer(
        "slow",
        cache_dir=str(cache),
        job="slow",
        rank=0,
        world_size=1,
        timeout=LOADER_TIMEOUT,
        pause_after=pause_after,
        **(knobs if spelling == "keywords" else {"tuning": knobs}),
    )
    c.wait_paused()
    workers = worker_pids(agent.pid)
    assert len(workers) == 2, f"agent children: {[(p, cmdline(p)) for p in children_of(agent.pid)]}"
    watched = {"agent": agent.pid, "consumer": c.pid, **{f"worker{i}": p for i, p in enumerate(workers)}}

    def served(s: dict[str, Any]) -> int:
        return sum(w.get("samples", 0) for w in s["agent"]["workers"])

    # Settled: two snapshots a worker report period apart count the same samples (no report was in transit).
    last: list[Any] = [None, 0.0]  # the oldest snapshot with the latest count, and when it was taken

    def settled(s: dict[str, Any]) -> bool:
        now = time.monotonic()
        if last[0] is None or served(s) != served(last[0]):
            last[:] = [s, now]
            return False
        return now - last[1] >= REPORT_EVERY

    before = agent.wait_stats(settled, 20, "the workers' counts of samples served did not settle")
    rss: dict[str, list[int]] = {name: [] for name in watched}
    for _ in range(7):  # ~3 s
        for name, pid in watched.items():
            rss[name].append(rss_kib(pid))
        time.sleep(0.5)
    after = agent.stats()

    assert c.proc.poll() is None, f"consumer exited while paused\n{c.log_tail()}"
    assert served(before) == served(after), f"workers served samples to a paused consumer: {before} -> {after}"
    bound = pause_after + inflight * request_size
    assert pause_after <= served(after) <= bound, (
        f"workers served {served(after)} samples to a consumer that read {pause_after} "
        f"(at most {inflight} requests of {request_size} may be outstanding: bound {bound}); "
        f"workers: {after['agent']['workers']}\n{c.log_tail()}"
    )
    for name, values in rss.items():
        growth = max(values) - values[0]
        assert growth < 30 * 1024, f"{name} RSS grew by {growth} KiB while the consumer slept: {values}"

    got = lines_delivered(c.finish())
    assert got == reference(data.paths, data.urls)
    assert len(got) == 160


# -- 4. map, batches, collate, len -----------------------------------------------------------------


@pytest.mark.slow
def test_map_batch_collate_and_len(tmp_path, dataset, start_agent):
    data = dataset(3, samples=5, payload=300)  # 15 samples
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "3", "--workers", "2")
    fresh = loader(cache, "lenjob", rank=1, world_size=2, seed=7)
    with pytest.raises(TypeError, match="length unknown"):
        len(fresh)

    plain = list(loader(cache, "plain", rank=1, world_size=2, seed=7))
    assert len(plain) == 8  # ceil(15 / 2)
    assert len(fresh) == 8
    assert len(loader(cache, "lenjob", rank=1, world_size=2, seed=7, batch_size=3)) == 3
    assert len(loader(cache, "lenjob", rank=0, world_size=2, seed=7, drop_last=True)) == 7

    mapped = list(loader(cache, "mapped", rank=1, world_size=2, seed=7, map=_tag, workers=2))
    assert [m[:3] for m in mapped] == [_tag(s)[:3] for s in plain]
    pids = {m[3] for m in mapped}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2, f"map ran in {pids} (test is {os.getpid()})"

    whole = list(loader(cache, "whole", seed=7))
    batches = list(loader(cache, "batched", seed=7, batch_size=4))
    assert [len(b["__key__"]) for b in batches] == [4, 4, 4, 3]
    for b in batches:
        assert set(b) == {"__key__", "__url__", "cls", "jpg", "json"}
        assert {len(v) for v in b.values()} == {len(b["__key__"])}
    flat = [{k: b[k][i] for k in b} for b in batches for i in range(len(b["__key__"]))]
    assert flat == whole
    b_loader = loader(cache, "batched", seed=7, batch_size=4)
    assert len(b_loader) == 4

    keyed = list(loader(cache, "collated", seed=7, batch_size=4, collate=_keys_collate))
    assert keyed == [tuple(s["__key__"] for s in whole[i : i + 4]) for i in range(0, 15, 4)]


def test_counts_a_consumer_found_are_the_agents_when_its_epoch_ends(tmp_path, dataset, start_agent):
    """len() right after an epoch must not depend on when the workers' reports of the counts
    they found reach the agent: a consumer waits for them before it says goodbye."""
    from wdscache.shared.client import AgentConnection, resolve_endpoint

    data = dataset(3, samples=5, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "3", "--workers", "2")
    wait_cached(agent, 3)
    conn = AgentConnection(resolve_endpoint(cache, None), timeout=10, cache_dir=cache)
    try:
        assert conn.request({"op": "counts", "urls": data.urls})["counts"] == [None] * 3
        with loader(cache, "count", seed=7) as whole:
            assert len(list(whole)) == 15
        # At once: before the fix, this lost the race about one time in twenty.
        assert conn.request({"op": "counts", "urls": data.urls})["counts"] == [5, 5, 5]
    finally:
        conn.close()


@pytest.mark.slow
def test_map_workers_start_fresh_not_as_forks_of_the_training_process(tmp_path, dataset, start_agent):
    # The training process has ZeroMQ threads (the loader's sockets): a fork copies their locks
    # in whatever state they are, and a forked worker can hang on one. The pool's processes start
    # from a clean interpreter instead, so they do not see what this process set at run time.
    global _SET_AT_RUN_TIME
    data = dataset(2, samples=3, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "2")
    _SET_AT_RUN_TIME = "set in the training process"
    try:
        seen = list(loader(cache, "fresh", shuffle=False, map=_run_time_mark, workers=2))
    finally:
        _SET_AT_RUN_TIME = None
    assert len(seen) == 6, seen
    assert [mark for _, mark in seen] == [None] * 6, "the map workers are forks of the training process"

    # Such workers must be sent the function: one that cannot be pickled is refused at once, by name.
    with pytest.raises(TypeError, match=r"map=<function .*<lambda>.* picklable callable"):
        loader(cache, "lambda", map=lambda sample: sample, workers=2)
    assert len(list(loader(cache, "inline", map=lambda sample: sample, workers=0))) == 6  # in this process


@pytest.mark.slow
def test_a_map_worker_that_dies_ends_the_epoch_with_an_error_naming_map(tmp_path, dataset, start_agent, monkeypatch):
    # multiprocessing.Pool replaces a dead process but loses its item: waited for with a bound,
    # the user is told what happened and where, not left with a bare multiprocessing.TimeoutError.
    from wdscache.training import loader as loader_module

    data = dataset(1, samples=2, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file)
    monkeypatch.setattr(loader_module, "MAP_TIMEOUT", 2.0)
    with pytest.raises(TimeoutError, match=r"^map=<function _dies .*> gave no result for an item within 2 s: .*died"):
        list(loader(cache, "dies", shuffle=False, map=_dies, workers=1))


@pytest.mark.slow
def test_a_ctrl_c_of_a_loader_with_map_workers_shows_one_traceback(tmp_path, dataset, start_agent):
    # A terminal's Ctrl-C reaches the whole process group: the map pool's processes included.
    data = dataset(2, samples=20, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file)
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.map_interrupted_job", str(cache)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert job.stdout is not None
        assert job.stdout.readline() == "reading\n", job.stderr.read() if job.stderr else ""
        os.killpg(job.pid, signal.SIGINT)
        try:
            _, err = job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(job.pid, signal.SIGUSR1)  # (its threads' stacks, to stderr)
            time.sleep(1)
            job.kill()
            pytest.fail(f"still running 60 s after SIGINT:\n{job.communicate()[1]}")
    finally:
        kill_left([job])
    assert job.returncode != 0 and err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err


def test_tuning_knobs_are_one_record_and_keywords_still_work(tmp_path):
    from wdscache import Tuning

    cache = tmp_path / "cache"
    cache.mkdir()  # no agent needed: nothing is read
    assert loader(cache, "t").tuning == Tuning()
    tuned = loader(cache, "t", tuning=Tuning(request_size=16, direct_reads=False), inflight=3)
    assert tuned.tuning == Tuning(request_size=16, inflight=3, direct_reads=False)  # a keyword joins tuning
    assert loader(cache, "t", tuning=Tuning(request_size=16), request_size=8).tuning.request_size == 8
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['request_sise'\].*'request_size'"):
        loader(cache, "t", request_sise=8)


# -- 5. on_error ---------------------------------------------------------------------------------------


def test_corrupt_shard_raises_or_is_skipped_and_shows_in_stats(tmp_path, dataset, start_agent, shard_server):
    data = dataset(3, samples=6, payload=400)
    bad_path = make_shard(shard_server.root / "corrupt-000000.tar", synth_samples(90, 6, payload=400))
    # The second sample's first header: no sample of the shard is ever complete before it, so
    # however a copy is read (cached, or while it downloads) none of its positions is dealt.
    # (Damage further in lets the samples before it be dealt while the shard downloads; with
    # "skip" those not read yet become holes, filled with repeats.)
    offset = corrupt_later_member(bad_path, 3)
    bad_url = shard_server.url(bad_path.name)
    urls = [*data.urls, bad_url]
    list_file = write_url_list(tmp_path / "lists2" / "urls.txt", urls)
    cache = tmp_path / "cache"
    agent = start_agent(cache, list_file, "--prefetch", "4")
    wait_cached(agent, 4)  # the download's head check passes: the damage is further in

    got = delivered(list(loader(cache, "skipper", on_error="skip")))
    assert got == reference(data.paths, data.urls)
    assert len(got) == 18
    s = agent.wait_stats(lambda s: s["failed"], 10, "the damaged shard was not failed")
    assert [c["url"] for c in s["agent"]["corrupt"]] == [bad_url], s["agent"]["corrupt"]
    assert "checksum" in s["agent"]["corrupt"][0]["error"] and bad_url in s["agent"]["corrupt"][0]["error"]
    # Damaged at its source: fetched once more, found damaged again, failed with the reason.
    assert [f["url"] for f in s["failed"]] == [bad_url] and "checksum" in s["failed"][0]["error"], s["failed"]
    assert s["shards"]["cached"] == 3
    assert shard_server.count(bad_path.name) == 2

    with pytest.raises(ShardError) as info:
        list(loader(cache, "raiser"))
    assert info.value.url == bad_url and bad_url in str(info.value), str(info.value)
    assert "checksum" in str(info.value) and str(offset) in str(info.value), str(info.value)
    s = agent.stats()
    assert [c["url"] for c in s["agent"]["corrupt"]] == [bad_url], s["agent"]["corrupt"]
    assert s["shards"]["cached"] == 3 and [f["url"] for f in s["failed"]] == [bad_url]
    assert shard_server.count(bad_path.name) == 2  # no retry storm


def test_missing_shard_raises_fetch_error_or_is_skipped(tmp_path, dataset, start_agent, shard_server):
    data = dataset(2, samples=6, payload=400)
    missing_url = shard_server.url("missing-000000.tar")
    list_file = write_url_list(tmp_path / "lists2" / "urls.txt", [*data.urls, missing_url])
    cache = tmp_path / "cache"
    agent = start_agent(cache, list_file, "--prefetch", "3")
    agent.wait_stats(
        lambda s: s["shards"]["cached"] == 2 and s["shards"]["failed"] == 1,
        30,
        "2 shards cached and the missing one failed",
    )

    got = delivered(list(loader(cache, "skipper", on_error="skip")))
    assert got == reference(data.paths, data.urls)
    assert len(got) == 12

    with pytest.raises(FetchError) as info:
        list(loader(cache, "raiser"))
    assert info.value.url == missing_url and missing_url in str(info.value), str(info.value)
    assert "404" in str(info.value), str(info.value)

    s = agent.stats()
    assert s["failed"] == [{"url": missing_url, "error": s["failed"][0]["error"]}] and "404" in s["failed"][0]["error"]
    # A shard that could not be downloaded is a failed shard, not a corrupt one.
    assert s["agent"]["corrupt"] == [], f"a 404 shard is listed as corrupt: {s['agent']['corrupt']}"


# -- 6. stats while a job runs ----------------------------------------------------------------------


def _paused_job(tmp_path, dataset, start_agent, slow_consumer, job: str):
    data = dataset(4, samples=10, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--workers", "2", "--prefetch", "4")
    c = slow_consumer(
        job,
        cache_dir=str(cache),
        job=job,
        rank=0,
        world_size=1,
        timeout=LOADER_TIMEOUT,
        request_size=4,
        inflight=2,
        pause_after=7,
    )
    c.wait_paused()
    return data, cache, agent, c


@pytest.mark.slow
def test_stats_json_shows_job_ranks_and_worker_busy_time(tmp_path, dataset, start_agent, slow_consumer):
    data, cache, agent, c = _paused_job(tmp_path, dataset, start_agent, slow_consumer, "stats-job")

    def settled(s: dict[str, Any]) -> bool:
        r = s.get("jobs", {}).get("stats-job", {}).get("0", {})
        return r.get("samples") == 7 and r.get("rate") == 0 and all("busy_s" in w for w in s["agent"]["workers"])

    s = agent.wait_stats(settled, 15, "stats-job rank 0 reported 7 samples at rate 0 and workers busy_s")
    assert list(s["jobs"]) == ["stats-job"] and list(s["jobs"]["stats-job"]) == ["0"]
    r = s["jobs"]["stats-job"]["0"]
    for name in ("samples", "bytes", "rate", "wait_s"):
        assert isinstance(r[name], (int, float)) and r[name] >= 0, (name, r)
    assert r["epoch"] == 0 and r["position"] == 7
    workers = s["agent"]["workers"]
    assert [w["index"] for w in workers] == [0, 1]
    assert all(isinstance(w["busy_s"], (int, float)) and w["busy_s"] >= 0 for w in workers), workers
    assert sum(w["samples"] for w in workers) >= 7
    assert s["agent"]["consumers"] == 1

    lines = [json.loads(line) for line in c.out.read_text().splitlines()]
    assert len(lines) == 7
    # bytes counts the same samples as samples: those delivered to the rank.
    assert r["bytes"] == sum(line["nbytes"] for line in lines), (r, [line["nbytes"] for line in lines])

    got = lines_delivered(c.finish())
    assert got == reference(data.paths, data.urls)
    agent.wait_stats(lambda s: s["jobs"] == {} and s["agent"]["consumers"] == 0, 10, "the finished job gone from stats")


def test_a_rank_reading_local_shards_counts_the_samples_it_took_not_whole_reads(
    tmp_path, dataset, start_agent, slow_consumer
):
    # file:// shards' samples are named as given (__url__, __local_path__) a read at a time; the
    # rank's count still follows what it took, as over http, not each read whole as it comes.
    data = dataset(2, samples=20, payload=1000)
    uris = [p.as_uri() for p in data.paths]
    cache = tmp_path / "cache"
    agent = start_agent(cache, write_url_list(tmp_path / "local" / "urls.txt", uris))
    c = slow_consumer("local", cache_dir=str(cache), job="local", timeout=LOADER_TIMEOUT, pause_after=7)
    c.wait_paused()

    s = agent.wait_stats(
        lambda s: s["jobs"].get("local", {}).get("0", {}).get("samples", 0) >= 7, 15, "rank 0 of job local reported"
    )
    lines = [json.loads(line) for line in c.out.read_text().splitlines()]
    r = s["jobs"]["local"]["0"]
    assert (r["samples"], r["position"], r["bytes"]) == (7, 7, sum(line["nbytes"] for line in lines)), r
    assert {line["url"] for line in lines} <= set(uris)
    assert len(lines_delivered(c.finish())) == 40


@pytest.mark.slow
def test_stats_human_readable_names_running_job(tmp_path, dataset, start_agent, slow_consumer):
    data, cache, agent, c = _paused_job(tmp_path, dataset, start_agent, slow_consumer, "human-job")
    agent.wait_stats(
        lambda s: s.get("jobs", {}).get("human-job", {}).get("0", {}).get("samples") == 7,
        15,
        "human-job rank 0 reported",
    )
    r = run_wdscache("stats", "--cache-dir", cache)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    at = [i for i, line in enumerate(lines) if "human-job" in line]
    assert at, f"`wdscache stats` does not mention the running job:\n{r.stdout}"
    # The rank on the job's line, or on the indented lines of the job's block just below it.
    block = [lines[at[0]]]
    for line in lines[at[0] + 1 :]:
        if not line.startswith((" ", "\t")):
            break
        block.append(line)
    assert any(re.search(r"\brank\s*0\b|human-job/0\b|human-job\[0\]", line) for line in block), (
        f"no line of the job's block names its rank 0:\n{r.stdout}"
    )
    assert len(lines_delivered(c.finish())) == 40


# -- 7. job consistency -------------------------------------------------------------------------------


def test_second_consumer_with_other_world_size_is_refused(tmp_path, dataset, start_agent, slow_consumer):
    data = dataset(4, samples=5, payload=500)  # 20 samples
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "4")
    first = slow_consumer(
        "first", cache_dir=str(cache), job="shared-job", rank=0, world_size=2, timeout=LOADER_TIMEOUT, pause_after=2
    )
    first.wait_paused()
    with pytest.raises(WdsCacheError) as info:
        iter(loader(cache, "shared-job", rank=0, world_size=5))
    msg = str(info.value)
    assert "shared-job" in msg and "world_size 2" in msg and re.search(r"\b5\b", msg), msg

    assert len(lines_delivered(first.finish())) == 10
    # Once the job's ranks left, the name may be used again with another world size.
    assert len(list(loader(cache, "shared-job", rank=0, world_size=5))) == 4


# -- 8. a consumer's own URL list ---------------------------------------------------------------------


def test_consumer_own_url_lists(tmp_path, dataset, start_agent):
    data = dataset(4, samples=4, payload=400)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "4")

    subset = [data.urls[1], data.urls[3]]
    got = delivered(list(loader(cache, "subset", urls=subset)))
    assert got == reference([data.paths[1], data.paths[3]], subset)
    assert len(got) == 8

    local = make_shard(tmp_path / "local" / "local-000000.tar", synth_samples(50, 5, payload=400))
    file_url = f"file://{local}"
    mixed = loader(cache, "mixed", urls=[file_url, data.urls[2]])
    assert len(mixed.urls) == 2
    got = delivered(list(mixed))
    assert got == reference([local, data.paths[2]], list(mixed.urls))
    assert len(got) == 9
    assert {url for url, _ in got} == set(mixed.urls)

    list_path = write_url_list(tmp_path / "own" / "list.txt", [data.urls[0], file_url])
    from_file = loader(cache, "listfile", urls=str(list_path))
    assert len(from_file.urls) == 2
    got = delivered(list(from_file))
    assert got == reference([data.paths[0], local], list(from_file.urls))
    assert len(got) == 9


# -- 9. epochs ----------------------------------------------------------------------------------------------


def test_epochs_reshuffle_and_set_epoch_repeats(tmp_path, dataset, start_agent):
    data = dataset(3, samples=6, payload=300)  # 18 samples
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "3")
    ld = loader(cache, "epochs", seed=3)
    e0 = [(s["__url__"], s["__key__"]) for s in ld]
    e1 = [(s["__url__"], s["__key__"]) for s in ld]
    assert len(e0) == len(e1) == 18 and len(set(e0)) == 18
    assert set(e0) == set(e1) == set(reference(data.paths, data.urls))
    assert e0 != e1
    ld.set_epoch(0)
    assert [(s["__url__"], s["__key__"]) for s in ld] == e0
    assert [(s["__url__"], s["__key__"]) for s in ld] == e1  # and on to epoch 1 again


# -- 10. workers die with the agent ----------------------------------------------------------------------


def test_workers_do_not_outlive_a_killed_agent(tmp_path, dataset, start_agent):
    data = dataset(2, samples=3, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--workers", "3")
    workers = wait_for(
        lambda: (lambda w: w if len(w) == 3 else None)(worker_pids(agent.pid)),
        10,
        lambda: f"agent children: {[(p, cmdline(p)) for p in children_of(agent.pid)]}",
    )
    starts = children_of(agent.pid)  # pid -> start time
    assert set(workers) <= set(starts)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(10)
    try:
        wait_for(
            lambda: not any(alive(p, t) for p, t in starts.items()),
            10,
            lambda: (
                "still alive after the agent was SIGKILLed: "
                f"{[(p, cmdline(p)) for p, t in starts.items() if alive(p, t)]}"
            ),
        )
    finally:
        for p, t in starts.items():  # leave nothing behind if the test failed
            if alive(p, t):
                os.kill(p, signal.SIGKILL)


def test_zero_copy_gives_read_only_views_of_the_same_bytes(tmp_path, dataset, start_agent):
    data = dataset(2, samples=6, payload=3000)
    ref = reference(data.paths, data.urls)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "2")
    with CachedMultiLoader(cache_dir=cache, shuffle=False, zero_copy=True, timeout=30) as loader:
        got = list(loader)
    assert [(s["__url__"], s["__key__"]) for s in got] == list(ref)
    for s in got:
        payloads = {k: v for k, v in s.items() if not k.startswith("__")}
        assert all(isinstance(v, memoryview) and v.readonly for v in payloads.values())
        assert {k: hashlib.sha256(v).hexdigest() for k, v in payloads.items()} == ref[(s["__url__"], s["__key__"])]
