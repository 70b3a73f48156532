#!/usr/bin/env python3
"""Benchmark wdscache against webdataset on the same synthetic shards, in one run.

    python scripts/bench.py [--quick] [--profiles images,tiny] [--reps 3] [--out bench-results/latest.json]

What it does:

- Makes deterministic WebDataset shards (scripts/shard_maker.py) in two profiles:
  ``images`` (~110 KB ``.jpg`` + ``.cls`` + a small ``.json`` per sample, ~64 MB
  shards, 1 GB by default) and ``tiny`` (~1 KB per sample, ~16 MB shards,
  256 MB by default). Sizes are on-disk tar bytes; MB and GB are 10^6 and 10^9
  bytes everywhere.
- Serves them from scripts/shard_server.py's ShardServer on 127.0.0.1, in a process of
  its own, with a per-connection cap (``--rate-mb``, default 25 MB/s) and a
  fixed time to first byte (``--ttfb-ms``, default 30 ms), standing in for an
  object store. The server's CPU is not counted: it is the remote side.
- Runs every system in its own subprocess (scripts/bench_consumer.py) with a
  deadline, alternating systems within each repetition (the order rotates
  from one repetition to the next), and reports medians with min-max:

  ======================  ================================================================
  wds local               ``wds.WebDataset(paths)`` in-process, shards on local disk
  wds MultiLoader         ``webdataset.multi.MultiLoader`` with as many workers as the agent,
                          its worker wrapped so that it terminates its ZeroMQ context (which
                          flushes) before exiting. The stock one (1.0.2) runs too, in every
                          repetition, with a deadline of 2x the wrapped one's time + 10 s: its
                          workers exit through os._exit with messages still queued, so the last
                          samples and the end-of-stream marker can be lost and it waits forever;
                          such a run is reported as a hang, with how many samples arrived
  wds HTTP                ``wds.WebDataset(http urls)`` streaming from the capped server (curl)
  wds cache_dir           ``wds.WebDataset(http urls, cache_dir=fresh dir)``: epoch 1 cold, 2 warm
  wdscache                a fresh ``wdscache agent`` on a fresh cache dir (its list: the same
                          http urls; ``--prefetch 8 --download-workers 4 --workers 2``), ready
                          once what ``wdscache stats --json`` reports (wdscache.shared.stats.collect,
                          polled in-process every 20 ms) has an agent; then one consumer
                          iterating ``CachedMultiLoader(shuffle=False)`` twice: epoch 1 cold,
                          epoch 2 warm; then a third, warm, epoch with ``shuffle=True``
                          (for information: what training reads by default, each sample
                          somewhere else in the shards); then one warm epoch streamed
                          (``direct_reads=False``: every byte sent by a worker); then many
                          consumers read one more unshuffled epoch each from the warm cache,
                          all at once (once every one has read an epoch of its share as a
                          job of its own: warm, as the single consumer's epoch 2 is; on a VM
                          the first touch of fresh memory costs far more than zeroing it): 8
                          (two jobs of four ranks), 64 (eight jobs of eight ranks), 8 through
                          DataLoaders (two jobs of one rank in DataLoader(num_workers=4),
                          batches of 64), and the same DataLoaders whose workers make the
                          samples (their limit); then the first 8 streamed; then, the
                          agent stopped, a new one on the same (warm) cache and one epoch of
                          a new consumer (the workers' sample tables live in memory: a new
                          agent walks the cached shards' headers again, ahead of the reads)
  DataLoader              the pipeline of a training script, ``decode()`` (of .cls/.json),
                          ``to_tuple``, ``batched(64)``, in ``DataLoader(num_workers=2)``: over
                          ``wds.WebDataset`` streaming HTTP, over ``wds.WebDataset`` on local
                          files, and over ``wdscache.WebDataset`` from a fresh agent (as above):
                          epoch 1 cold, epoch 2 warm, then on the same warm agent with
                          ``persistent_workers=True`` (as the README's recipe has it), its workers
                          started in an untimed first epoch; and over samples each worker holds in
                          its own memory (read in an untimed first epoch, persistent workers): the
                          pipeline's own cost, which no source can beat
  wdscache nodes          a job on several nodes, one agent each (a fresh cache, ``--node-rank K
                          --num-nodes N``, the list a shard index made once by ``wdscache index``),
                          on the profile's data cut into shards a quarter the size (64 shards: a
                          node reads whole shards, so its bytes are within one shard of dataset/N),
                          two ranks each: for N = 2 and 3, cold, the nodes one after the other, so
                          the server's byte counter between two is what one node downloaded (target:
                          within 10% of dataset/N); then 2 nodes x 2 ranks warm, all four at once,
                          against 1 node x 4 ranks warm on one agent (target: ≥ 0.8x samples/s)
  wdscache, loader first  a consumer started first; 1 s later an agent with every default:
                          its cold first sample from the agent's launch and from its ready
  wdscache mix            a two-source mixture (``mix=`` of the list's two halves, weighted by their
                          sizes, ``epoch_samples`` the list's length) against the whole list as one
                          source, both shuffled, warm, in one consumer of a fresh agent: a cold
                          epoch of the one source, then two warm epochs of each (one, mix, mix,
                          one), the better of each (target: the mixture ≥ 0.9x the one source's samples/s)
  random access           ``ds[i]`` for a seeded random permutation of every index, in one process,
                          raw (``transformations=[]``), four epochs (another permutation each),
                          over the profile's HTTP shards named by a shard index: with
                          ``wids.ShardListDataset`` and its own download folder (epoch 1 cold,
                          curl; epochs 2-4 warm, from its folder on local disk), and with
                          ``wdscache.ShardListDataset`` through a fresh agent (as above):
                          epoch 1 cold, epochs 2-4 warm, the fastest of those the warm
                          row (an epoch takes a fraction of a second: one slice of
                          another process's time on a busy machine shows); both with
                          their default ``lru_size``; each epoch the first 4,000 indices
                          of its permutation (on tiny, wids would take half an hour for
                          all 71,000)
  cat                     ``cat shards > /dev/null`` from the page cache (a machine limit)
  pyzmq IPC               PUSH/PULL over ipc://, one multipart message per sample with frames
                          of the profile's field sizes, ``copy=False``, timed from the first
                          message (a machine limit: nothing is copied out of the frames, while
                          the loaders hand out ``bytes``); then the same with two senders
                          and 1, 8 or 64 receivers, 32 samples to a message (a request's reply)
                          and every frame copied into ``bytes``: the machine's own cost of
                          many consumers, for target 7
  ======================  ================================================================

  At the start of the 8-consumer phase the bench logs how much of the cached
  shards the page cache holds (``page_cached_found`` in the JSON). The
  one-consumer warm epoch finds them in memory, just downloaded; the eight
  would read from disk what the kernel dropped meanwhile (some kernels page out
  file pages they see as idle: DAMON's "pageout" scheme, as on the VM the
  README's figures come from), and the ratio would compare disk with memory.

  Shuffling is off on every side but wdscache's epoch 3 (the webdataset
  baselines do not shuffle, so wdscache runs ``shuffle=False`` and its agent
  ``--no-shuffle``, which makes the agent's start-up prefetch follow the order
  the consumer reads). Every consumer does the same work per sample: count it
  and sum the lengths of its payloads.
- Figures: samples/s and payload MB/s delivered to the consumer; wall time of
  epoch 1 (cold) and epoch 2 (warm) for systems with a cache; time to first
  sample (from building the loader; for wdscache also from launching the
  agent); CPU seconds per GB delivered, summed over every process involved
  (consumer and its children such as MultiLoader workers and curl, measured
  with getrusage in the consumer per epoch; the agent and its worker processes
  from /proc/PID/stat); peak RSS of the
  consumer (VmHWM, reset at each epoch start through /proc/self/clear_refs, and
  its growth over the epoch) and of the agent (sum of VmHWM over the agent's
  process tree, plus the sampled peak of its anonymous memory: VmHWM counts the
  pages of shards the workers mmap, which are page cache, not private memory).
- Scale checks: parsing and planning a 1,000,000-entry URL list with the
  library (read_url_list, the position map, shard_order for two epochs, a
  window and the first 10,000 ids of global_sequence); ``wdscache stats --json``
  on a 100,000-shard index (wall time of the command); and end to end, an agent
  on a 1,000,000-entry list and a consumer's first sample.
- One large shard (``--size-parts``, 256 MB by default) from the capped server: the time
  from an agent's start to the shard cached, with parallel ranged parts (the agent's
  defaults, ``--download-parts``) and with ``--download-parts 1``, side by side
  (``parts`` in ``--skip`` leaves it out).
- Every cold run also records what the server sent (``fetched`` in the JSON, as
  a multiple of the dataset): more than 1x means downloads were abandoned and
  started again. Consumer logs are kept under ``--work``/logs; a consumer that
  had to resend a worker request after its 10 s timeout is flagged.
- Prints progress on stderr; at the end prints the markdown tables on stdout
  (headed by a line naming the machine) and writes every raw number as JSON to
  ``--out``. Targets are reported as PASS/FAIL, never asserted. A target that divides
  two rows measured minutes apart (many consumers by one, the DataLoader pipeline by
  samples in memory, a mixture by one source) also gives its ratio in each repetition
  (``per_rep`` in the JSON): the host's speed drifts between repetitions, which moves
  both rows of one repetition alike.

Nothing here touches the network beyond 127.0.0.1. Data lives under ``--work``
(default /tmp/wdscache-bench): shards are reused when present, caches are
deleted after each run, and the shards too unless ``--keep-data``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONSUMER = REPO / "scripts" / "bench_consumer.py"
sys.path.insert(0, str(REPO / "scripts"))

from bench_consumer import process_tree, status_kb, tree_cpu  # noqa: E402
from console import wdscache_exe  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def page_cached(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore(2)); None where it cannot be known."""
    import ctypes
    import mmap

    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    total = held = 0
    for path in paths:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue  # evicted meanwhile
        with f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                continue
            # A private mapping (ctypes wants a writable buffer); nothing is written, so its
            # pages are the page cache's.
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            try:
                buf = (ctypes.c_char * size).from_buffer(m)
                try:
                    pages = -(-size // mmap.PAGESIZE)
                    vec = (ctypes.c_ubyte * pages)()
                    failed = mincore(ctypes.addressof(buf), size, vec) != 0
                finally:
                    del buf  # else closing the mapping raises BufferError
            finally:
                m.close()
            if failed:
                return None
            total += pages
            held += sum(b & 1 for b in bytes(vec))  # the other bits are reserved
    return held / total if total else None


MB, GB = 1e6, 1e9
BLOCK = 512
AGENT_WORKERS = 2
DOWNLOAD_WORKERS = 4
PREFETCH = 8
CONSUMER_TIMEOUT = 60.0  # CachedMultiLoader(timeout=...)
RANDOM_LIMIT = 4_000  # indices of each epoch's permutation the random-access rows read
RANDOM_WARM_EPOCHS = 3  # warm epochs each random-access system reads; its row is the fastest
SCALE_ROWS = ("url-list", "stats-100k", "big-list", "million-lists")  # --only/--skip names of the scale rows
MILLION = 1_000_000  # shards of the million-lists row's list and index
MILLION_REAL = 128  # of which real (the first: more than a loader opens before its first sample)
MILLION_SAMPLES = 16  # samples of each real shard
MILLION_EDITS = 3  # live edits of the list file, memory measured after each
MILLION_REPS = 2  # agents started on each list (medians)
T0 = time.monotonic()


@dataclass(frozen=True)
class Profile:
    name: str
    payload: int  # bytes of the .jpg field (+/- 10 %)
    shard_bytes: float
    default_bytes: float
    quick_bytes: float

    def per_sample_on_disk(self) -> int:
        # Three members (cls, jpg, json), each a 512-byte header plus data padded to 512.
        def padded(n: int) -> int:
            return -(-n // BLOCK) * BLOCK

        return 3 * BLOCK + padded(self.payload) + padded(3) + padded(60)


PROFILES = {
    "images": Profile("images", 110_000, 64 * MB, 1 * GB, 192 * MB),
    "tiny": Profile("tiny", 1_000, 16 * MB, 256 * MB, 48 * MB),
}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_bytes(text: str) -> float:
    """``1G``, ``256M``, ``192MB``, ``5e8`` -> bytes (decimal units)."""
    t = text.strip().upper().removesuffix("B")
    for unit, mult in (("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        if t.endswith(unit):
            return float(t[:-1]) * mult
    return float(t)


# -- child processes ---------------------------------------------------------------------------


class Child:
    """A subprocess in a session of its own, its stdout lines collected, reaped with os.wait4."""

    live: list[Child] = []  # not yet reaped: killed by cleanup() if the bench is interrupted

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        with open(log_path, "ab") as err:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True, env=env
            )
        self.pid = self.proc.pid
        Child.live.append(self)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.timed_out = False
        self.rusage: Any = None
        self.returncode: int | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def _kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the session we created for this child
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, deadline: float) -> Child:
        """Reap within ``deadline`` seconds, else SIGKILL its process group and report a timeout."""

        def expire() -> None:
            self.timed_out = True
            self._kill_group()

        timer = threading.Timer(deadline, expire)
        timer.daemon = True
        timer.start()
        try:
            _, status, self.rusage = os.wait4(self.pid, 0)
        finally:
            timer.cancel()
        self.returncode = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.returncode  # Popen must not wait for it again
        if self in Child.live:
            Child.live.remove(self)
        self._kill_group()  # leftovers (a stuck MultiLoader worker) die with the run
        self._reader.join(5)
        return self

    def messages(self) -> list[dict[str, Any]]:
        out = []
        for line in self.lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def report(self) -> dict[str, Any] | None:
        for m in reversed(self.messages()):
            if "report" in m:
                return m["report"]
        return None

    def last_progress(self) -> dict[str, Any] | None:
        for m in reversed(self.messages()):
            if "progress" in m:
                return m["progress"]
        return None

    def total_cpu(self) -> float | None:
        if self.rusage is None:
            return None
        return self.rusage.ru_utime + self.rusage.ru_stime

    def stderr_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def resends(child: Child) -> int:
    """How many worker requests a CachedMultiLoader consumer had to resend after its 10 s timeout."""
    try:
        return child.log_path.read_text(errors="replace").count("timed out; resending")
    except OSError:
        return 0


# -- the bench -----------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work).resolve()
        self.runs_dir = self.work / "runs"
        self.logs = self.work / "logs"
        self.py = sys.executable
        self.rate = args.rate_mb * MB
        self.ttfb = args.ttfb_ms / 1000.0
        self.server: Child | None = None
        self.port = 0
        self.agents: list[Agent] = []
        self.datasets: dict[str, dict[str, Any]] = {}
        self.runs: list[dict[str, Any]] = []
        self.scale: dict[str, Any] = {}
        self.parts: dict[str, Any] = {}  # one large shard, with parallel parts and with one connection
        self._seq = 0

    # -- data and server -------------------------------------------------------------------------

    def make_data(self, prof: Profile, total: float, label: str = "") -> dict[str, Any]:
        """The profile's shards, ``total`` bytes in all, made once; ``label`` names their lists
        (default: the profile's name)."""
        from shard_maker import make_dataset

        label = label or prof.name
        spp = max(1, round(prof.shard_bytes / prof.per_sample_on_disk()))
        n = max(1, round(total / prof.shard_bytes))
        name = f"{prof.name}-p{prof.payload}-s{spp}-n{n}"
        root = self.work / "data" / name
        marker = root / ".complete"
        if not marker.exists():
            log(f"making {n} {prof.name} shards of {spp} samples in {root}")
            shutil.rmtree(root, ignore_errors=True)
            make_dataset(root, n, spp, payload=prof.payload, prefix=prof.name)
            marker.write_text("ok\n")
        else:
            log(f"reusing {n} {prof.name} shards in {root}")
        paths = sorted(root.glob(f"{prof.name}-*.tar"))
        disk = sum(p.stat().st_size for p in paths)
        local = self.work / f"urls-{label}-local.txt"
        local.write_text("".join(f"{p}\n" for p in paths))
        http = self.work / "lists" / label / "urls.txt"  # a folder per list: the agent watches it
        http.parent.mkdir(parents=True, exist_ok=True)
        http.write_text("".join(f"http://127.0.0.1:{self.port}/{name}/{p.name}\n" for p in paths))
        return {
            "profile": prof.name,
            "dir": str(root),
            "shards": n,
            "samples_per_shard": spp,
            "samples": n * spp,
            "disk_bytes": disk,
            "payload": prof.payload,
            "paths": [str(p) for p in paths],
            "local_list": str(local),
            "http_list": str(http),
        }

    def start_server(self) -> None:
        port_file = self.work / "server.port"
        port_file.unlink(missing_ok=True)
        (self.work / "data").mkdir(parents=True, exist_ok=True)
        self.counters = self.work / "server.counters"
        self.counters.unlink(missing_ok=True)
        self.server = Child(
            [
                self.py,
                str(CONSUMER),
                "serve",
                str(self.work / "data"),
                "--port-file",
                str(port_file),
                "--rate",
                str(self.rate),
                "--ttfb",
                str(self.ttfb),
                "--counters",
                str(self.counters),
            ],
            self.logs / "server.log",
        )
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if self.server.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the shard server did not start:\n{self.server.stderr_tail()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        log(
            f"shard server on 127.0.0.1:{self.port}: {self.args.rate_mb:g} MB/s per connection, "
            f"{self.args.ttfb_ms:g} ms to first byte"
        )

    def fetched(self) -> dict[str, int]:
        """The server's running totals: GET and HEAD requests, body bytes sent."""
        time.sleep(0.25)  # the server writes them every 0.1 s
        try:
            return json.loads(self.counters.read_text())
        except (OSError, ValueError):
            return {"gets": 0, "heads": 0, "bytes": 0}

    def fetch_note(self, before: dict[str, int], ds: dict[str, Any]) -> dict[str, Any]:
        after = self.fetched()
        return {k: after.get(k, 0) - before.get(k, 0) for k in ("gets", "heads", "bytes")} | {
            "x_dataset": (after.get("bytes", 0) - before.get("bytes", 0)) / ds["disk_bytes"]
        }

    def stop_server(self) -> None:
        if self.server is not None and self.server.returncode is None:
            try:
                os.kill(self.server.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.server.wait(10)

    # -- helpers -----------------------------------------------------------------------------------

    def consumer(self, mode: str, *extra: str, tag: str) -> Child:
        self._seq += 1
        log_path = self.logs / f"{self._seq:03d}-{tag}.log"
        return Child([self.py, str(CONSUMER), mode, *extra], log_path)

    def wdscache_consumer(self, cache: Path, job: str, agent: Agent, *extra: str, tag: str) -> Child:
        """One ``CachedMultiLoader`` consumer (bench_consumer's ``wdscache`` mode) of ``agent`` on
        ``cache``, as job ``job``, wdscache's log on its stderr; ``extra``: more of its options."""
        return self.consumer(
            "wdscache",
            "--cache-dir",
            str(cache),
            "--job",
            job,
            *extra,
            "--agent-pid",
            str(agent.pid),
            "--timeout",
            str(CONSUMER_TIMEOUT),
            "--log",
            tag=tag,
        )

    def fresh_dir(self, tag: str) -> Path:
        d = self.runs_dir / f"{tag}-{self._seq}-{os.getpid()}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True, mode=0o700)
        return d

    def local_deadline(self, ds: dict[str, Any]) -> float:
        return 60 + ds["disk_bytes"] / (20 * MB)

    def http_deadline(self, ds: dict[str, Any], epochs: int = 1) -> float:
        return 60 + epochs * 3 * ds["disk_bytes"] / self.rate

    @staticmethod
    def epoch_row(e: dict[str, Any], extra_cpu: float = 0.0) -> dict[str, Any]:
        """Table metrics of one consumer epoch."""
        gbytes = e["bytes"] / GB
        cpu = (e["cpu_s"] or 0.0) + extra_cpu
        return {
            "samples": e["samples"],
            "bytes": e["bytes"],
            "wall_s": e["elapsed"],
            "samples_s": e["samples"] / e["elapsed"],
            "mb_s": e["bytes"] / MB / e["elapsed"],
            "ttfs_ms": 1000 * e["ttfs"] if e["ttfs"] is not None else None,
            "cpu_s": cpu,
            "cpu_s_per_gb": cpu / gbytes if gbytes else None,
            "consumer_hwm_mb": e["hwm_kb"] / 1024,
            "consumer_growth_mb": e["rss_growth_kb"] / 1024,
        }

    def finish_run(
        self,
        profile: str,
        rep: int,
        system: str,
        child: Child | None,
        rows: dict[str, Any],
        status: str = "ok",
        **extra: Any,
    ) -> dict[str, Any]:
        run = {"profile": profile, "rep": rep, "system": system, "status": status, "rows": rows, **extra}
        if child is not None:
            run["process_cpu_s"] = child.total_cpu()
            run["returncode"] = child.returncode
        self.runs.append(run)
        for label, r in rows.items():
            log(
                f"  {label}: {fmt(r['samples_s'])} samples/s, {r['mb_s']:,.1f} MB/s, {r['wall_s']:.2f} s"
                + (f", first sample {r['ttfs_ms']:.0f} ms" if r.get("ttfs_ms") is not None else "")
                + (f", {r['cpu_s_per_gb']:.2f} CPU s/GB" if r.get("cpu_s_per_gb") is not None else "")
            )
        if status != "ok":
            log(f"  {system}: {status}")
        if extra.get("fetched"):
            f = extra["fetched"]
            log(
                f"  fetched from the server: {f['bytes'] / MB:,.0f} MB ({f['x_dataset']:.2f}x the dataset) "
                f"in {f['gets']} GETs and {f['heads']} HEADs"
            )
        if extra.get("resends"):
            log(f"  the consumer resent {extra['resends']} worker request(s) after its 10 s timeout")
        return run

    def check(self, child: Child, ds: dict[str, Any], epochs: int, copies: int = 1) -> tuple[str, dict | None]:
        """(status, report): "ok", "hang (...)", "error (...)", "short (...)"."""
        rep = child.report()
        want = ds["samples"] * copies
        if child.timed_out:
            prog = child.last_progress() or {}
            return (
                f"hang: killed at its deadline after {prog.get('samples', 0)} of {want} samples"
                f" (epoch {prog.get('epoch', 0) + 1})",
                rep,
            )
        if child.returncode != 0 or rep is None:
            return f"error: exit {child.returncode}: {child.stderr_tail(5)}", rep
        got = [e["samples"] for e in rep["epochs"]]
        if any(g != want for g in got) or len(got) != epochs:
            return f"short: {got} samples per epoch, expected {want}", rep
        return "ok", rep

    # -- systems -------------------------------------------------------------------------------------

    def run_cat(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        import resource

        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run(
            ["cat", *ds["paths"]], stdout=subprocess.DEVNULL, timeout=self.local_deadline(ds), check=True
        )
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        del proc
        e = {
            "samples": ds["samples"],
            "bytes": ds["disk_bytes"],
            "elapsed": wall,
            "ttfs": None,
            "cpu_s": cpu,
            "hwm_kb": after.ru_maxrss,
            "rss_growth_kb": 0,
        }
        row = self.epoch_row(e)
        row["consumer_hwm_mb"] = row["consumer_growth_mb"] = None
        row["samples_s"] = None  # cat knows no samples
        self.finish_run(prof, rep, "cat", None, {"cat shards > /dev/null (page cache; MB are tar bytes)": row})

    def run_zmq(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        sizes = f"{ds['payload']},3,60"
        c = self.consumer(
            "zmq", "--samples", str(ds["samples"]), "--sizes", sizes, "--sock-dir", str(self.work), tag=f"{prof}-zmq"
        ).wait(self.local_deadline(ds))
        status, rep_ = self.check(c, ds, 1)
        rows = {}
        if rep_ is not None and status == "ok":
            e = dict(rep_["epochs"][0])
            # Throughput of the channel: from the first message on (the sender's start-up is not the channel's).
            e["elapsed"] = e["elapsed"] - e["ttfs"]
            row = self.epoch_row(e)
            row["ttfs_ms"] = None
            rows["pyzmq IPC PUSH/PULL, multipart, copy=False"] = row
            for n, label in ((1, RAW_ONE), (8, RAW_EIGHT), (64, RAW_64)):
                many = self.consumer(
                    "zmq-many",
                    "--samples",
                    str(ds["samples"]),
                    "--sizes",
                    sizes,
                    "--receivers",
                    str(n),
                    "--per-message",
                    str(REQUEST_SIZE),
                    "--sock-dir",
                    str(self.work),
                    tag=f"{prof}-zmq-many-{n}",
                )
                many.wait(self.local_deadline(ds))
                many_status, many_rep = self.check(many, ds, 1)
                if many_rep is not None and many_status == "ok":
                    e = many_rep["epochs"][0]
                    row = self.epoch_row(e)
                    row["ttfs_ms"] = row["consumer_hwm_mb"] = row["consumer_growth_mb"] = None
                    row["receiver_cpu_s_per_gb"] = e["receiver_cpu_s"] / (e["bytes"] / GB)  # in the JSON only
                    rows[label] = row
                elif status == "ok":
                    status = many_status
        self.finish_run(prof, rep, "zmq", c, rows, status)

    def run_wds_local(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        c = self.consumer("wds", "--urls-file", ds["local_list"], tag=f"{prof}-wds-local").wait(self.local_deadline(ds))
        status, r = self.check(c, ds, 1)
        rows = {"wds local, in-process": self.epoch_row(r["epochs"][0])} if status == "ok" else {}
        self.finish_run(prof, rep, "wds-local", c, rows, status)

    def run_multi(
        self, prof: str, rep: int, ds: dict[str, Any], flush: bool = True, deadline: float | None = None
    ) -> dict[str, Any]:
        args = ["--urls-file", ds["local_list"], "--workers", str(AGENT_WORKERS), "--sock-dir", str(self.work)]
        if flush:
            args.append("--flush")
        name = "wds-multi" if flush else "wds-multi-stock"
        c = self.consumer("multi", *args, tag=f"{prof}-{name}").wait(deadline or self.local_deadline(ds))
        status, r = self.check(c, ds, 1)
        rows = {}
        if status == "ok":
            row = self.epoch_row(r["epochs"][0])
            row["helper_hwm_mb"] = r["children_maxrss_kb"] / 1024  # the largest worker (ru_maxrss of children)
            label = (
                f"wds MultiLoader, {AGENT_WORKERS} workers (worker flushes ZeroMQ on exit)"
                if flush
                else f"wds MultiLoader, {AGENT_WORKERS} workers, stock 1.0.2"
            )
            rows[label] = row
        return self.finish_run(prof, rep, name, c, rows, status)

    def run_multi_stock(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        """The unwrapped MultiLoader: its deadline is 2x the wrapped one's time (or a size-based guess) + 10 s."""
        walls = [
            row["wall_s"]
            for r in self.runs
            if r["profile"] == prof and r["system"] == "wds-multi"
            for row in r["rows"].values()
        ]
        guess = max(walls) if walls else ds["disk_bytes"] / (20 * MB)
        deadline = 2 * guess + 10
        log(f"  deadline {deadline:.0f} s")
        self.run_multi(prof, rep, ds, flush=False, deadline=deadline)

    def run_wds_http(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        before = self.fetched()
        c = self.consumer("wds", "--urls-file", ds["http_list"], tag=f"{prof}-wds-http").wait(self.http_deadline(ds))
        status, r = self.check(c, ds, 1)
        rows = {"wds HTTP streaming (no cache)": self.epoch_row(r["epochs"][0])} if status == "ok" else {}
        self.finish_run(prof, rep, "wds-http", c, rows, status, fetched=self.fetch_note(before, ds))

    def run_wds_cachedir(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        cache = self.fresh_dir(f"{prof}-wdscachedir")
        before = self.fetched()
        try:
            c = self.consumer(
                "wds",
                "--urls-file",
                ds["http_list"],
                "--cache-dir",
                str(cache),
                "--epochs",
                "2",
                tag=f"{prof}-wds-cachedir",
            ).wait(self.http_deadline(ds) + 60)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        status, r = self.check(c, ds, 2)
        rows = {}
        if status == "ok":
            rows["wds cache_dir, epoch 1 (cold)"] = self.epoch_row(r["epochs"][0])
            rows["wds cache_dir, epoch 2 (warm)"] = self.epoch_row(r["epochs"][1])
        self.finish_run(prof, rep, "wds-cachedir", c, rows, status, fetched=self.fetch_note(before, ds))

    def run_wdscache(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        cache = self.fresh_dir(f"{prof}-wdscache")
        budget = int(max(1.5 * ds["disk_bytes"], (PREFETCH + 2) * max(os.path.getsize(p) for p in ds["paths"])))
        agent = Agent(self, cache, Path(ds["http_list"]), budget, tag=f"{prof}-agent")
        self.agents.append(agent)
        rows: dict[str, Any] = {}
        status = "ok"
        extra: dict[str, Any] = {}
        before = self.fetched()
        try:
            agent.start()
            c = self.consumer(
                "wdscache",
                "--cache-dir",
                str(cache),
                "--job",
                "single",
                "--epochs",
                "2",
                "--shuffled-epochs",
                "1",
                "--agent-pid",
                str(agent.pid),
                "--timeout",
                str(CONSUMER_TIMEOUT),
                "--log",
                tag=f"{prof}-wdscache",
            )
            c.wait(self.http_deadline(ds) + 120)
            status, r = self.check(c, ds, 3)
            extra["fetched"] = self.fetch_note(before, ds)
            extra["resends"] = resends(c)
            if r is not None and len(r["epochs"]) == 3:
                cold, warm, shuffled = r["epochs"]
                row = self.epoch_row(cold, cold["agent_cpu_s"] or 0.0)
                row["ttfs_from_agent_launch_ms"] = (
                    1000 * (cold["t_first"] - agent.t_launch) if cold["t_first"] else None
                )
                row["agent_ready_s"] = agent.ready_s
                rows["wdscache, epoch 1 (cold)"] = row
                rows["wdscache, epoch 2 (warm)"] = self.epoch_row(warm, warm["agent_cpu_s"] or 0.0)
                rows[SHUFFLED] = self.epoch_row(shuffled, shuffled["agent_cpu_s"] or 0.0)
            if status == "ok":
                rows.update(self.run_wdscache_streamed(prof, ds, agent, cache))
            if status == "ok" and not self.args.no_multi_consumer:
                for shape in MANY_SHAPES:
                    rows.update(self.run_wdscache_many(prof, ds, agent, cache, True, shape))
                rows.update(self.run_wdscache_many(prof, ds, agent, cache, True, DL_MADE_SHAPE))
                rows.update(self.run_wdscache_many(prof, ds, agent, cache, False, MANY_SHAPES[0]))
            hwm, anon = agent.memory()
            for row in rows.values():
                row["helper_hwm_mb"], row["helper_anon_mb"] = hwm, anon
            extra["agent_stats"] = agent.stats()
            if status == "ok":
                agent.stop()  # the cache stays, for an agent started again on it
                rows.update(self.run_wdscache_restarted(prof, ds, cache, budget))
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)
        self.finish_run(prof, rep, "wdscache", None, rows, status, **extra)

    def run_wdscache_mix(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        """A mixture of two sources (the list's halves, weighted by their sizes, an epoch of the whole
        list's length) against the whole list as one source, warm, in one consumer: a cold epoch of
        the one source first, then two warm epochs of each in turns (one, mix, mix, one); each row is
        the better of its two."""
        cache = self.fresh_dir(f"{prof}-wdscache-mix")
        budget = int(max(1.5 * ds["disk_bytes"], (PREFETCH + 2) * max(os.path.getsize(p) for p in ds["paths"])))
        agent = Agent(self, cache, Path(ds["http_list"]), budget, tag=f"{prof}-mix-agent")
        self.agents.append(agent)
        urls = Path(ds["http_list"]).read_text().splitlines()
        halves = []
        for k, part in enumerate((urls[: len(urls) // 2], urls[len(urls) // 2 :])):
            path = self.work / f"urls-{prof}-mix-{k}.txt"
            path.write_text("".join(f"{u}\n" for u in part))
            halves.append(str(path))
        rows: dict[str, Any] = {}
        status = "ok"
        c: Child | None = None
        try:
            agent.start()
            c = self.consumer(
                "mix",
                "--cache-dir",
                str(cache),
                "--urls-file",
                ds["http_list"],
                "--mix",
                ",".join(halves),
                "--epoch-samples",
                str(ds["samples"]),
                "--agent-pid",
                str(agent.pid),
                "--timeout",
                str(CONSUMER_TIMEOUT),
                tag=f"{prof}-wdscache-mix",
            )
            c.wait(self.http_deadline(ds) + 120 + 4 * self.local_deadline(ds))
            status, r = self.check(c, ds, 5)
            if r is not None and status == "ok":
                warm = r["epochs"][1:]  # the one source's, then the mixture's
                one = max(warm[:2], key=lambda e: e["samples"] / e["elapsed"])
                two = max(warm[2:], key=lambda e: e["samples"] / e["elapsed"])
                rows[MIX_ONE] = self.epoch_row(one, one["agent_cpu_s"] or 0.0)
                rows[MIX_TWO] = self.epoch_row(two, two["agent_cpu_s"] or 0.0)
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)
        self.finish_run(prof, rep, "wdscache-mix", c, rows, status)

    def run_torch_wds(self, prof: str, rep: int, ds: dict[str, Any], where: str) -> None:
        """The DataLoader pipeline over ``wds.WebDataset``: ``where`` "http" (the capped server) or
        "local"; or, "memory", over the samples held in memory (the pipeline's own cost); or,
        "pread", over the least reader of the page cache (a machine limit)."""
        http = where == "http"
        before = self.fetched()
        held = where in ("memory", "pread")
        epochs = 2 if held else 1  # the first reads the shards into the workers' memory (or indexes them)
        c = self.consumer(
            "torch",
            "--urls-file",
            ds["http_list" if http else "local_list"],
            "--workers",
            str(TORCH_WORKERS),
            "--epochs",
            str(epochs),
            *([f"--{where}"] if held else []),
            tag=f"{prof}-torch-wds-{where}",
        ).wait(self.http_deadline(ds) if http else self.local_deadline(ds) * epochs + 60)
        status, r = self.check(c, ds, epochs)
        label = {"http": TORCH_WDS_HTTP, "local": TORCH_WDS_LOCAL, "memory": TORCH_MEMORY, "pread": TORCH_PREAD}[where]
        rows = {label: self.epoch_row(r["epochs"][-1])} if status == "ok" else {}
        if held and rows:  # its persistent workers are reaped after the epoch: no CPU figure
            rows[label].update(cpu_s=None, cpu_s_per_gb=None)
        extra = {"fetched": self.fetch_note(before, ds)} if http else {}
        self.finish_run(prof, rep, f"torch-{where}" if held else f"torch-wds-{where}", c, rows, status, **extra)

    def run_torch_wdscache(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        """The DataLoader pipeline over ``wdscache.WebDataset``, a fresh agent: epoch 1 cold, epoch 2 warm."""
        cache = self.fresh_dir(f"{prof}-torch-wdscache")
        budget = int(max(1.5 * ds["disk_bytes"], (PREFETCH + 2) * max(os.path.getsize(p) for p in ds["paths"])))
        agent = Agent(self, cache, Path(ds["http_list"]), budget, tag=f"{prof}-torch-agent")
        self.agents.append(agent)
        rows: dict[str, Any] = {}
        before = self.fetched()
        c: Child | None = None
        status = "error: the agent did not start"
        try:
            agent.start()
            c = self.consumer(
                "torch",
                "--cache-dir",
                str(cache),
                "--workers",
                str(TORCH_WORKERS),
                "--epochs",
                "2",
                "--agent-pid",
                str(agent.pid),
                "--timeout",
                str(CONSUMER_TIMEOUT),
                tag=f"{prof}-torch-wdscache",
            ).wait(self.http_deadline(ds) + 120)
            status, r = self.check(c, ds, 2)
            if status == "ok":
                cold, warm = r["epochs"]
                rows[TORCH_COLD] = self.epoch_row(cold, cold["agent_cpu_s"] or 0.0)
                rows[TORCH_WARM] = self.epoch_row(warm, warm["agent_cpu_s"] or 0.0)
                # As the memory row runs: persistent workers, their start in an untimed first epoch.
                c = self.consumer(
                    "torch",
                    "--cache-dir",
                    str(cache),
                    "--workers",
                    str(TORCH_WORKERS),
                    "--epochs",
                    "2",
                    "--persistent",
                    "--job",
                    "bench-torch-persistent",
                    "--agent-pid",
                    str(agent.pid),
                    "--timeout",
                    str(CONSUMER_TIMEOUT),
                    tag=f"{prof}-torch-wdscache-persistent",
                ).wait(self.local_deadline(ds) * 2 + 60)
                status, r = self.check(c, ds, 2)
                if status == "ok":
                    rows[TORCH_PERSISTENT] = self.epoch_row(r["epochs"][-1])
                    rows[TORCH_PERSISTENT].update(cpu_s=None, cpu_s_per_gb=None)  # its workers are reaped after
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)
        self.finish_run(prof, rep, "torch-wdscache", c, rows, status, fetched=self.fetch_note(before, ds))

    def run_wdscache_other_order(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        """A cold first sample from an agent started with every default (its start-up plan in
        seeded shuffle order, prefetching at once) and a consumer reading in list order: its first
        shard is one nobody prefetched, which must not wait for a download slot behind them."""
        cache = self.fresh_dir(f"{prof}-wdscache-other")
        agent = Agent(self, cache, Path(ds["http_list"]), 0, tag=f"{prof}-agent-defaults", defaults=True)
        self.agents.append(agent)
        rows: dict[str, Any] = {}
        try:
            agent.start()
            time.sleep(0.5)  # its prefetches under way, as when a job starts after its agent
            c = self.consumer(
                "wdscache",
                "--cache-dir",
                str(cache),
                "--job",
                "other",
                "--max-samples",
                "1",
                "--agent-pid",
                str(agent.pid),
                "--timeout",
                str(CONSUMER_TIMEOUT),
                "--log",
                tag=f"{prof}-wdscache-other",
            ).wait(self.http_deadline(ds))
            r = c.report()
            status = (
                "ok"
                if c.returncode == 0 and r is not None and r["epochs"][0]["samples"] == 1
                else f"error: exit {c.returncode}: {c.stderr_tail(5)}"
            )
            if status == "ok":
                rows[OTHER_ORDER] = self.epoch_row(r["epochs"][0])
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)
        self.finish_run(prof, rep, "wdscache-other-order", None, rows, status)

    def run_wdscache_loader_first(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        """A cold first sample when the loader starts first and the agent (every option at its
        default) comes up after it, as when a job and its node's agent start together: the
        loader waits for the agent's token and socket; its first sample is timed from the
        agent's launch (the agent's own start-up counted in, the loader's not)."""
        cache = self.fresh_dir(f"{prof}-wdscache-first")
        agent = Agent(self, cache, Path(ds["http_list"]), 0, tag=f"{prof}-agent-after-loader", defaults=True)
        self.agents.append(agent)
        rows: dict[str, Any] = {}
        c: Child | None = None
        status = "error: the agent did not start"
        try:
            c = self.consumer(
                "wdscache",
                "--cache-dir",
                str(cache),
                "--job",
                "first",
                "--max-samples",
                "1",
                "--timeout",
                str(CONSUMER_TIMEOUT),
                "--log",
                tag=f"{prof}-wdscache-loader-first",
            )
            time.sleep(1.0)  # it has imported and waits for the agent
            agent.start()
            c.wait(self.http_deadline(ds))
            r = c.report()
            status = (
                "ok"
                if c.returncode == 0 and r is not None and r["epochs"][0]["samples"] == 1
                else f"error: exit {c.returncode}: {c.stderr_tail(5)}"
            )
            if status == "ok" and r is not None:
                row = self.epoch_row(r["epochs"][0])
                row["ttfs_ms"] = 1000 * (r["epochs"][0]["t_first"] - agent.t_launch)
                # from when the agent answered stats (polled every 20 ms: up to 20 ms late)
                row["ttfs_after_ready_ms"] = row["ttfs_ms"] - 1000 * agent.ready_s
                row["agent_ready_s"] = agent.ready_s
                rows[LOADER_FIRST] = row
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)
        self.finish_run(prof, rep, "wdscache-loader-first", c, rows, status)

    def http_index(self, ds: dict[str, Any]) -> Path:
        """A shard index of the profile's HTTP shards, written from the shards made (every one
        holds ``samples_per_shard`` samples): nothing is downloaded to make it."""
        out = Path(ds["http_list"]).parent / "random-access.json"
        urls = Path(ds["http_list"]).read_text().split()
        out.write_text(
            json.dumps(
                {
                    "wids_version": 1,
                    "shardlist": [
                        {"url": u, "nsamples": ds["samples_per_shard"], "filesize": os.path.getsize(p)}
                        for u, p in zip(urls, ds["paths"])
                    ],
                }
            )
        )
        return out

    def run_random_access(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        """``ds[i]`` over a random permutation of every index: wids with its own download folder,
        then wdscache through a fresh agent; each epoch 1 cold (over HTTP), then the fastest of
        RANDOM_WARM_EPOCHS warm epochs (the same permutations for both)."""
        index = self.http_index(ds)
        # wids walks a shard's headers again each time it opens one its LRU let go: on 1 KB samples
        # (thousands a shard) that is tens of ms, a third of the time. Both read the same first
        # RANDOM_LIMIT indices of each epoch's permutation.
        limit = min(ds["samples"], RANDOM_LIMIT)
        read = {**ds, "samples": limit}
        deadline = self.http_deadline(ds) + 60 + limit / 10 * RANDOM_WARM_EPOCHS
        epochs = 1 + RANDOM_WARM_EPOCHS

        def fastest(warm: list[dict[str, Any]]) -> dict[str, Any]:
            return max(warm, key=lambda e: e["samples"] / e["elapsed"])

        folder = self.fresh_dir(f"{prof}-wids")
        before = self.fetched()
        try:
            c = self.consumer(
                "random",
                "--system",
                "wids",
                "--index",
                str(index),
                "--cache-dir",
                str(folder),
                "--epochs",
                str(epochs),
                "--max-samples",
                str(limit),
                tag=f"{prof}-random-wids",
            ).wait(deadline)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        status, r = self.check(c, read, epochs)
        rows = (
            {
                RANDOM_WIDS_COLD: self.epoch_row(r["epochs"][0]),
                RANDOM_WIDS_WARM: self.epoch_row(fastest(r["epochs"][1:])),
            }
            if status == "ok"
            else {}
        )
        self.finish_run(prof, rep, "random-wids", c, rows, status, fetched=self.fetch_note(before, ds))
        cache = self.fresh_dir(f"{prof}-random-wdscache")
        budget = int(max(1.5 * ds["disk_bytes"], (PREFETCH + 2) * max(os.path.getsize(p) for p in ds["paths"])))
        agent = Agent(self, cache, Path(ds["http_list"]), budget, tag=f"{prof}-random-agent")
        self.agents.append(agent)
        rows, w = {}, None
        before = self.fetched()
        status = "error: the agent did not start"
        try:
            agent.start()
            w = self.consumer(
                "random",
                "--system",
                "wdscache",
                "--index",
                str(index),
                "--cache-dir",
                str(cache),
                "--epochs",
                str(epochs),
                "--agent-pid",
                str(agent.pid),
                "--timeout",
                str(CONSUMER_TIMEOUT),
                "--max-samples",
                str(limit),
                tag=f"{prof}-random-wdscache",
            ).wait(deadline)
            status, r = self.check(w, read, epochs)
            if status == "ok":
                cold, warm = r["epochs"][0], fastest(r["epochs"][1:])
                rows[RANDOM_COLD] = self.epoch_row(cold, cold["agent_cpu_s"] or 0.0)
                rows[RANDOM_WARM] = self.epoch_row(warm, warm["agent_cpu_s"] or 0.0)
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)
        self.finish_run(prof, rep, "random-wdscache", w, rows, status, fetched=self.fetch_note(before, ds))

    def shard_index(self, prof: str, ds: dict[str, Any]) -> Path:
        """A shard index of the profile's HTTP shards (a job on several nodes needs the counts), made once."""
        out = Path(ds["http_list"]).parent / "shards.json"
        if not out.exists():
            urls = Path(ds["http_list"]).read_text().split()
            r = subprocess.run(
                [wdscache_exe(), "index", *urls, "-o", str(out)],
                capture_output=True,
                text=True,
                timeout=self.http_deadline(ds),
                check=False,
            )
            if r.returncode != 0:
                raise RuntimeError(f"wdscache index failed: {r.stderr[-2000:]}")
        return out

    def ranks_at_once(
        self,
        prof: str,
        ds: dict[str, Any],
        placed: list[tuple[int, Agent]],
        nodes: int,
        per_node: int,
        tag: str,
        *,
        warmup: bool,
    ) -> list[dict[str, Any]] | None:
        """One epoch of the ranks of the nodes ``placed`` (node k on its agent), ``per_node`` each, of a
        job on ``nodes``, every rank started at once; each rank's epoch, or None if one failed."""
        start_at = time.time() + 3.0  # all import (and warm up) first, then start together
        kids = [
            self.consumer(
                "wdscache",
                "--cache-dir",
                str(agent.cache),
                "--job",
                tag,
                "--rank",
                str(k * per_node + j),
                "--world-size",
                str(nodes * per_node),
                "--node",
                str(k),
                "--num-nodes",
                str(nodes),
                "--epochs",
                "1",
                "--start-at",
                str(start_at),
                "--timeout",
                str(CONSUMER_TIMEOUT),
                "--log",
                *(["--warmup", str(WARMUP_SAMPLES)] if warmup else []),
                tag=f"{prof}-{tag}-n{k}r{j}",
            )
            for k, agent in placed
            for j in range(per_node)
        ]
        for k in kids:
            k.wait(self.http_deadline(ds) + 120)
        reports = [k.report() for k in kids]
        bad = [k for k, r in zip(kids, reports) if k.timed_out or k.returncode != 0 or r is None]
        if bad:
            log(f"  {tag}: {len(bad)} rank(s) failed: {bad[0].stderr_tail(5)}")
            return None
        return [r["epochs"][0] for r in reports if r is not None]

    @staticmethod
    def aggregate_row(epochs: list[dict[str, Any]]) -> dict[str, Any]:
        samples, nbytes = sum(e["samples"] for e in epochs), sum(e["bytes"] for e in epochs)
        t0 = min(e["t_start"] for e in epochs)
        wall = max(e["t_end"] for e in epochs) - t0
        return {
            "samples": samples,
            "bytes": nbytes,
            "wall_s": wall,
            "samples_s": samples / wall,
            "mb_s": nbytes / MB / wall,
            "ttfs_ms": 1000 * max(e["ttfs"] for e in epochs),
            "equal_counts": len({e["samples"] for e in epochs}) == 1,
        }

    def run_wdscache_nodes(self, prof: str, rep: int, ds: dict[str, Any]) -> None:
        """Several nodes on this machine: one agent per node (own cache), two ranks each. Cold, the
        nodes run one after the other, so the server's byte counter between two is one node's
        download; then 2 nodes x 2 ranks and 1 node x 4 ranks, warm, all ranks at once."""
        profile = PROFILES[prof]
        ds = self.make_data(replace(profile, shard_bytes=profile.shard_bytes / 4), ds["disk_bytes"], f"{prof}-nodes")
        subprocess.run(["cat", *ds["paths"]], stdout=subprocess.DEVNULL, check=True)  # into the page cache
        index = self.shard_index(prof, ds)
        budget = int(max(1.5 * ds["disk_bytes"], (PREFETCH + 2) * max(os.path.getsize(p) for p in ds["paths"])))
        rows: dict[str, Any] = {}
        status, extra = "ok", {"shards": ds["shards"]}
        started: list[Agent] = []
        try:
            for n in (2, 3):
                agents = [
                    Agent(
                        self,
                        self.fresh_dir(f"{prof}-node{k}of{n}"),
                        index,
                        budget,
                        tag=f"{prof}-agent-node{k}of{n}",
                        extra=["--node-rank", str(k), "--num-nodes", str(n)],
                    )
                    for k in range(n)
                ]
                started += agents
                self.agents += agents
                shares = []
                for k, agent in enumerate(agents):
                    before = self.fetched()
                    agent.start()
                    epochs = self.ranks_at_once(prof, ds, [(k, agent)], n, 2, f"nodes{n}-cold-{k}", warmup=False)
                    if epochs is None:
                        status = f"error: a rank of node {k} of {n} failed"
                        break
                    shares.append((self.fetched()["bytes"] - before.get("bytes", 0)) / (ds["disk_bytes"] / n))
                extra[f"bytes_per_node_x_share_{n}"] = shares
                log(
                    f"  {n} nodes x 2 ranks, cold: each node downloaded "
                    + ", ".join(f"{x:.3f}" for x in shares)
                    + f"x dataset/{n}"
                )
                if status == "ok" and n == 2:
                    warm = self.ranks_at_once(prof, ds, list(enumerate(agents)), 2, 2, "nodes2-warm", warmup=True)
                    if warm:
                        rows[NODES_WARM] = self.aggregate_row(warm)
                for agent in agents:
                    agent.stop()
            if status == "ok":
                one = Agent(self, self.fresh_dir(f"{prof}-node-all"), index, budget, tag=f"{prof}-agent-one-node")
                started.append(one)
                self.agents.append(one)
                one.start()
                if self.ranks_at_once(prof, ds, [(0, one)], 1, 4, "node1-cold", warmup=False) is not None:
                    warm = self.ranks_at_once(prof, ds, [(0, one)], 1, 4, "node1-warm", warmup=True)
                    if warm:
                        rows[ONE_NODE_WARM] = self.aggregate_row(warm)
                one.stop()
        finally:
            for agent in started:
                agent.stop()
                shutil.rmtree(agent.cache, ignore_errors=True)
        self.finish_run(prof, rep, "wdscache-nodes", None, rows, status, **extra)

    def run_wdscache_streamed(self, prof: str, ds: dict[str, Any], agent: Agent, cache: Path) -> dict[str, Any]:
        """One warm epoch with ``direct_reads=False``: the workers send every byte over ZeroMQ."""
        c = self.wdscache_consumer(cache, "streamed", agent, "--no-direct", tag=f"{prof}-wdscache-streamed")
        c.wait(self.local_deadline(ds) * 2 + 60)
        status, r = self.check(c, ds, 1)
        if status != "ok":
            log(f"  streamed: {status}")
            return {}
        e = r["epochs"][0]
        return {STREAMED: {**self.epoch_row(e, e["agent_cpu_s"] or 0.0), "resends": resends(c)}}

    def run_wdscache_restarted(self, prof: str, ds: dict[str, Any], cache: Path, budget: int) -> dict[str, Any]:
        """One epoch of a new consumer from an agent started again on the warm cache: the
        shards and their table files are there, but each shard is revalidated against its
        source before it is first served, and no worker has opened it yet."""
        agent = Agent(self, cache, Path(ds["http_list"]), budget, tag=f"{prof}-agent-restarted")
        self.agents.append(agent)
        try:
            agent.start()
            c = self.wdscache_consumer(cache, "restarted", agent, tag=f"{prof}-wdscache-restarted")
            c.wait(self.local_deadline(ds) * 2 + 60)
            status, r = self.check(c, ds, 1)
        finally:
            agent.stop()
        if status != "ok":
            log(f"  restarted: {status}")
            return {}
        e = r["epochs"][0]
        return {RESTARTED: self.epoch_row(e, e["agent_cpu_s"] or 0.0)}

    def run_wdscache_many(
        self, prof: str, ds: dict[str, Any], agent: Agent, cache: Path, direct: bool, shape: ManyShape
    ) -> dict[str, Any]:
        """``shape``'s jobs of ranks (each through a DataLoader's workers, if it says so), all from
        the warm cache at once; aggregate samples/s and MB/s, every process's CPU."""
        what = shape.label if direct else f"{shape.label}, streamed"
        # The DataLoader reference reads nothing: its workers make samples sized like the profile's.
        made = ["--made", f"{ds['payload']},3,60", "--made-samples", str(ds["samples"])] if shape.made else []
        # Each consumer first reads one epoch of its share as a job of its own, as the single
        # consumer's warm epoch follows its cold one: measured warm, not growing a fresh heap (on
        # this VM the first touch of a page costs tens of µs, and 64 fresh consumers touch 1 GB).
        share = -(-ds["samples"] // shape.ranks)
        found = page_cached(sorted(p for p in (cache / "shards").rglob("*") if p.is_file()))
        if found is not None:
            log(f"  {what}: the page cache holds {100 * found:.0f}% of the cached shards")
        go = self.work / f"go-{self._seq}-{os.getpid()}"  # the consumers start once it exists
        kids = []
        mode = "direct" if direct else "streamed"
        for job in range(shape.jobs):
            for rank in range(shape.ranks):
                kids.append(
                    self.consumer(
                        "wdscache",
                        "--cache-dir",
                        str(cache),
                        "--job",
                        f"{shape.tag}{job}-{mode}",
                        "--rank",
                        str(rank),
                        "--world-size",
                        str(shape.ranks),
                        "--epochs",
                        "1",
                        "--start-file",
                        str(go),
                        "--warmup",
                        str(share),
                        "--loader-workers",
                        str(shape.loader_workers),
                        "--timeout",
                        str(CONSUMER_TIMEOUT),
                        "--log",
                        *([] if direct else ["--no-direct"]),
                        *made,
                        tag=f"{prof}-wdscache-{shape.tag}{job}-{rank}-{mode}",
                    )
                )
        deadline = time.monotonic() + 120 + 2 * len(kids)  # imports and warm-ups, timesharing the cores
        ready = [Path(f"{go}.{k.pid}.ready") for k in kids]
        while not all(r.exists() for r in ready):
            if time.monotonic() > deadline or any(k.proc.poll() is not None for k in kids):
                break  # the waits below report the failure
            time.sleep(0.01)
        cpu0 = agent.cpu()  # from the word on: the warm-ups' reads are not the row's
        t_go = time.time()
        go.touch()
        deadline_s = self.local_deadline(ds) * 2 + 60
        # Each consumer, its epoch ended, waits for the word to exit (a rank's process outlives
        # its epoch): no exit's CPU falls in the timed window of the others.
        done = [Path(f"{go}.{k.pid}.done") for k in kids]
        deadline = time.monotonic() + deadline_s
        while not all(d.exists() for d in done):
            if time.monotonic() > deadline or any(k.proc.poll() is not None for k in kids):
                break  # the waits below report the failure
            time.sleep(0.01)
        agent_cpu = agent.cpu() - cpu0
        end = Path(f"{go}.end")
        end.touch()
        for k in kids:
            k.wait(deadline_s)
        for path in (go, end, *ready, *done):
            path.unlink(missing_ok=True)
        reports = [k.report() for k in kids]
        bad = [k for k, r in zip(kids, reports) if k.timed_out or k.returncode != 0 or r is None]
        if bad:
            log(f"  {what}: {len(bad)} failed: {bad[0].stderr_tail(5)}")
            return {}
        epochs = [r["epochs"][0] for r in reports]
        samples = sum(e["samples"] for e in epochs)
        nbytes = sum(e["bytes"] for e in epochs)
        t0 = min(e["t_start"] for e in epochs)
        wall = max(e["t_end"] for e in epochs) - t0
        late = max(e["t_start"] for e in epochs) - t_go
        if late > 0.05:
            log(f"  {what}: the last started {late:.2f} s after the word (timesharing {len(kids)} processes)")
        cpu = sum(e["cpu_s"] for e in epochs) + agent_cpu
        many_resends = sum(resends(k) for k in kids)
        if many_resends:
            log(f"  {what}: {many_resends} worker request(s) timed out and were resent")
        expected = shape.jobs * (ds["samples"] + (-ds["samples"]) % shape.ranks)  # each job: the dataset, padded
        if samples != expected:
            log(f"  {what} delivered {samples} samples, expected {expected}")
        return {
            shape.label if direct else shape.streamed_label: {
                "samples": samples,
                "bytes": nbytes,
                "wall_s": wall,
                "samples_s": samples / wall,
                "mb_s": nbytes / MB / wall,
                "ttfs_ms": 1000 * max(e["ttfs"] for e in epochs),
                "cpu_s": cpu,
                "cpu_s_per_gb": cpu / (nbytes / GB),
                "consumer_cpu_s": cpu - agent_cpu,
                "agent_cpu_s": agent_cpu,
                "cpu_busy": cpu / wall / (os.cpu_count() or 1),
                "consumer_hwm_mb": max(e["hwm_kb"] for e in epochs) / 1024,
                "consumer_growth_mb": max(e["rss_growth_kb"] for e in epochs) / 1024,
                "complete": samples == expected,
                "resends": many_resends,
                "page_cached_found": found,
                "start_spread_s": late,
                # each consumer: [its start, first sample, end] in s from the earliest start, and its CPU s
                "consumers": [
                    [
                        round(e["t_start"] - t0, 3),
                        round(e["t_first"] - t0, 3) if e["t_first"] else None,
                        round(e["t_end"] - t0, 3),
                        round(e["cpu_s"], 3),
                    ]
                    for e in epochs
                ],
            }
        }

    # -- one large shard in parallel parts ----------------------------------------------------------

    def run_parts(self) -> None:
        """One large shard cached by an agent with parallel ranged parts (its defaults) and by one
        with ``--download-parts 1``: seconds from the agent's start to the shard cached."""
        from shard_maker import make_dataset

        from wdscache.shared.stats import collect

        size = parse_bytes(self.args.size_parts)
        payload = 1 << 20
        n = max(1, round(size / (payload + 2048)))
        name = f"parts-p{payload}-s{n}"
        root = self.work / "data" / name
        if not (root / ".complete").exists():
            log(f"parts: making one shard of {n} samples of 1 MiB in {root}")
            shutil.rmtree(root, ignore_errors=True)
            make_dataset(root, 1, n, payload=payload, prefix="big")
            (root / ".complete").write_text("ok\n")
        [path] = sorted(root.glob("big-*.tar"))
        shard = path.stat().st_size
        lst = self.work / "lists" / "parts" / "urls.txt"
        lst.parent.mkdir(parents=True, exist_ok=True)
        lst.write_text(f"http://127.0.0.1:{self.port}/{name}/{path.name}\n")
        self.parts = {"shard_bytes": shard}
        for label, extra in (("parallel parts", ()), ("one connection", ("--download-parts", "1"))):
            log(f"parts: one {shard / MB:.0f} MB shard, {label}")
            cache = self.fresh_dir("parts")
            agent = Agent(self, cache, lst, 2 * shard, tag=f"parts-{extra[-1] if extra else 'default'}", extra=extra)
            self.agents.append(agent)
            before = self.fetched()
            try:
                agent.start()
                deadline = time.monotonic() + 60 + 2 * shard / self.rate
                while (collect(cache, timeout=2.0).get("shards") or {}).get("cached") != 1:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the shard was not cached in time: {agent.child.stderr_tail()}")
                    time.sleep(0.05)
                seconds = time.time() - agent.t_launch - agent.ready_s
                after = self.fetched()
                self.parts[label] = {
                    "seconds": seconds,
                    "mb_s": shard / MB / seconds,
                    "gets": after["gets"] - before["gets"],
                    "bytes": after["bytes"] - before["bytes"],
                }
                log(
                    f"  {seconds:.2f} s ({shard / MB / seconds:.1f} MB/s) in {self.parts[label]['gets']} GETs, "
                    f"{self.parts[label]['bytes'] / shard:.2f}x the shard fetched"
                )
            except Exception as exc:  # one failing must not lose the others' numbers
                log(f"  parts, {label} failed: {exc!r}")
                self.parts[label] = {"error": repr(exc)}
            finally:
                agent.stop()
                shutil.rmtree(cache, ignore_errors=True)

    # -- S3 ---------------------------------------------------------------------------------------------

    def run_s3(self, prof: str, ds: dict[str, Any]) -> None:
        """A cold epoch of ``ds`` from a real S3 server (SeaweedFS's ``weed mini``, in its own process
        group, every port on 127.0.0.1) behind a proxy with the HTTP server's cap per connection and
        time to first byte: wdscache on an ``s3://`` prefix, and webdataset reading each object
        through a ``pipe:`` boto3 stream, one at a time."""
        from s3_proxy import S3Proxy

        sys.path.insert(0, str(REPO))
        from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed

        fake = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}
        saved = {k: os.environ.get(k) for k in (*fake, "AWS_ENDPOINT_URL")}
        server = Seaweed(self.work / "seaweedfs")
        proxy: S3Proxy | None = None
        try:
            server.start()
            server.create_bucket("bench")
            for path in ds["paths"]:
                server.upload("bench", f"{prof}/{Path(path).name}", Path(path))
            proxy = S3Proxy(server.ports["s3.port"], rate=self.rate, ttfb=self.ttfb).start()
            os.environ.update(fake)
            os.environ["AWS_ENDPOINT_URL"] = proxy.url  # the agent, the consumers and s3_cat.py
            prefix = self.work / "lists" / f"{prof}-s3" / "urls.txt"
            prefix.parent.mkdir(parents=True, exist_ok=True)
            prefix.write_text(f"s3://bench/{prof}/\n")
            piped = self.work / f"urls-{prof}-s3-pipe.txt"
            piped.write_text(
                "".join(
                    f"pipe:{self.py} {REPO / 'scripts' / 's3_cat.py'} s3://bench/{prof}/{Path(p).name}\n"
                    for p in ds["paths"]
                )
            )
            log(
                f"{prof}: S3 (SeaweedFS on {server.endpoint}, behind a proxy at {self.args.rate_mb:g} MB/s "
                "per connection)"
            )
            for rep in range(self.args.reps):
                for system in ("wdscache-s3", "wds-s3") if rep % 2 == 0 else ("wds-s3", "wdscache-s3"):
                    log(f"{prof} S3 rep {rep + 1}/{self.args.reps}: {system}")
                    sent = proxy.sent
                    try:
                        if system == "wds-s3":
                            c = self.consumer("wds", "--urls-file", str(piped), tag=f"{prof}-wds-s3").wait(
                                self.http_deadline(ds) + 120
                            )
                            status, r = self.check(c, ds, 1)
                            rows = {S3_WDS: self.epoch_row(r["epochs"][0])} if status == "ok" else {}
                        else:
                            c, status, rows = self._wdscache_s3(prof, ds, prefix)
                        self.finish_run(prof, rep, system, c, rows, status, s3_bytes_sent=proxy.sent - sent)
                    except Exception as exc:  # one failing must not lose the others' numbers
                        log(f"  {system} failed: {exc!r}")
                        self.runs.append(
                            {"profile": prof, "rep": rep, "system": system, "status": f"error: {exc!r}", "rows": {}}
                        )
        except Exception as exc:  # SeaweedFS did not start: the other rows go on
            log(f"{prof}: S3 failed: {exc!r}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if proxy is not None:
                proxy.stop()
            server.stop()

    def _wdscache_s3(self, prof: str, ds: dict[str, Any], urls: Path) -> tuple[Child, str, dict[str, Any]]:
        cache = self.fresh_dir(f"{prof}-wdscache-s3")
        budget = int(max(1.5 * ds["disk_bytes"], (PREFETCH + 2) * max(os.path.getsize(p) for p in ds["paths"])))
        agent = Agent(self, cache, urls, budget, tag=f"{prof}-agent-s3")
        self.agents.append(agent)
        try:
            agent.start()
            c = self.wdscache_consumer(cache, "s3", agent, tag=f"{prof}-wdscache-s3").wait(self.http_deadline(ds) + 120)
            status, r = self.check(c, ds, 1)
            return c, status, ({S3_WDSCACHE: self.epoch_row(r["epochs"][0])} if status == "ok" else {})
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)

    # -- scale checks ---------------------------------------------------------------------------------

    def run_scale(self) -> None:
        skip = {s.strip() for s in self.args.skip.split(",") if s.strip()}
        only = {s.strip() for s in self.args.only.split(",") if s.strip()}
        picked = [name for name in SCALE_ROWS if name not in skip and (not only or name in only)]
        if "url-list" in picked:
            log("scale: parse and plan a 1,000,000-entry URL list")
            c = self.consumer("urls", "--n", "1000000", "--dir", str(self.work), tag="urls").wait(300)
            self.scale["url_list_1m"] = c.report() or {
                "error": c.stderr_tail(5) or f"exit status {c.returncode}",
                "timed_out": c.timed_out,
            }
            log(f"  {self.scale['url_list_1m']}")
        if "stats-100k" in picked:
            self.run_stats_100k()
        if "big-list" in picked and self.datasets:
            self.run_big_list(next(iter(self.datasets.values())))
        if "million-lists" in picked:
            self.run_million_lists()

    def run_stats_100k(self) -> None:
        log("scale: wdscache stats --json on a 100,000-shard index")
        cache = self.fresh_dir("stats100k")
        try:
            w = self.consumer("stats-index", "--cache-dir", str(cache), "--n", "100000", tag="stats-index").wait(300)
            if w.returncode != 0:
                self.scale["stats_100k"] = {"error": w.stderr_tail(5)}
                return
            walls = []
            for _ in range(3):
                t = time.perf_counter()
                p = subprocess.run(
                    [wdscache_exe(), "stats", "--cache-dir", str(cache), "--json"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                walls.append(time.perf_counter() - t)
                if p.returncode != 0:
                    self.scale["stats_100k"] = {"error": p.stderr[-500:]}
                    return
            shards = json.loads(p.stdout)["shards"]["cached"]
            t = time.perf_counter()
            subprocess.run([self.py, "-c", "import wdscache.cli"], check=True, timeout=60)
            import_s = time.perf_counter() - t
            self.scale["stats_100k"] = {
                "seconds": statistics.median(walls),
                "runs": walls,
                "shards": shards,
                "python_import_wdscache_cli_s": import_s,
            }
            log(f"  {self.scale['stats_100k']}")
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def run_big_list(self, ds: dict[str, Any]) -> None:
        """End to end with a 1,000,000-entry list: agent start-up, and a consumer's first sample.

        The list starts with the profile's real shards; the rest name shards the server does not
        have (never read: the consumer stops at its first sample, in list order).
        """
        log("scale: agent and consumer on a 1,000,000-entry list (first entries real)")
        real = Path(ds["http_list"]).read_text().splitlines()
        lst = self.work / "lists" / "big" / "urls.txt"
        lst.parent.mkdir(parents=True, exist_ok=True)
        base = real[0].rsplit("/", 1)[0]
        with open(lst, "w") as f:
            f.write("\n".join(real) + "\n")
            f.write(f"{base}/missing-{{{len(real):07d}..{999_999:07d}}}.tar\n")
        cache = self.fresh_dir("biglist")
        size = max(os.path.getsize(p) for p in ds["paths"])
        agent = Agent(self, cache, lst, int((PREFETCH + 2) * size * 1.5), tag="biglist-agent")
        self.agents.append(agent)
        try:
            agent.start()
            c = self.consumer(
                "wdscache",
                "--cache-dir",
                str(cache),
                "--job",
                "big",
                "--max-samples",
                "1",
                "--timeout",
                str(CONSUMER_TIMEOUT),
                "--log",
                tag="biglist-consumer",
            ).wait(180)
            r = c.report()
            if r is None or c.returncode != 0:
                last = c.stderr_tail(1).strip() or f"exit {c.returncode}"
                self.scale["big_list_1m"] = {
                    "error": ("timed out: " if c.timed_out else "") + last,
                    "agent_ready_s": agent.ready_s,
                    "stderr_tail": c.stderr_tail(15),
                }
            else:
                e = r["epochs"][0]
                self.scale["big_list_1m"] = {
                    "agent_ready_s": agent.ready_s,
                    "first_sample_s": e["ttfs"],
                    "first_sample_from_agent_launch_s": e["t_first"] - agent.t_launch,
                    "consumer_cpu_s": e["cpu_s"],
                    "consumer_hwm_mb": e["hwm_kb"] / 1024,
                    "agent_hwm_mb": agent.memory()[0],
                    "agent_anon_mb": agent.memory()[1],
                }
            log(f"  {self.scale['big_list_1m'].get('error') or self.scale['big_list_1m']}")
        except Exception as exc:
            self.scale["big_list_1m"] = {"error": repr(exc)}
            log(f"  failed: {exc!r}")
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)

    def run_million_lists(self) -> None:
        """A 1,000,000-shard list and a 1,000,000-shard index against a 1-line list: the agent's readiness,
        its private memory (RssAnon of its main process) at start and after live edits of the list file,
        the time to a ``wdscache stats`` answer and to a loader's first sample once it is ready.

        The first entries are real shards on local disk (``file://``); the rest name files that do not
        exist (never read: the loader stops at its first sample, in list order).
        """
        log("scale: agent on a 1,000,000-shard list and index (vs a 1-line list)")
        folder = self.work / "lists" / "million"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        real = [folder / f"real-{i}.tar" for i in range(MILLION_REAL)]
        for path in real:
            write_tiny_shard(path, MILLION_SAMPLES)
        size = real[0].stat().st_size
        missing = [str(folder / f"missing-{i:07d}.tar") for i in range(MILLION_REAL, MILLION)]
        lists = {"one": [str(real[0])], "list": [str(p) for p in real] + missing}
        files = {"one": folder / "one.txt", "list": folder / "million.txt", "index": folder / "million.json"}
        files["one"].write_text(lists["one"][0] + "\n")
        files["list"].write_text("\n".join(lists["list"]) + "\n")

        def index_text(urls: list[str]) -> str:
            entries = (json.dumps({"url": u, "nsamples": MILLION_SAMPLES, "filesize": size}) for u in urls)
            return (
                '{"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": [\n'
                + ",\n".join(entries)
                + "\n]}\n"
            )

        files["index"].write_text(index_text(lists["list"]))
        out: dict[str, Any] = {}
        for kind in ("one", "list", "index"):
            runs = [
                self._million_run(
                    kind,
                    files[kind],
                    lists["list"] if kind != "one" else lists["one"],
                    index_text if kind == "index" else None,
                )
                for _ in range(MILLION_REPS)
            ]
            ok = [r for r in runs if "error" not in r]
            out[kind] = {"runs": runs}
            for k in ok[0] if ok else ():  # medians; a list (memory after each edit) from the last run
                out[kind][k] = ok[-1][k] if isinstance(ok[0][k], list) else statistics.median(r[k] for r in ok)
            log(f"  {kind}: {({k: v for k, v in out[kind].items() if k != 'runs'}) or runs[0]}")
        one = out["one"].get("ready_s")
        for kind in ("list", "index"):
            if one is not None and "ready_s" in out[kind]:
                out[kind]["ready_delta_s"] = out[kind]["ready_s"] - one
                out[kind]["anon_mb_per_million"] = out[kind]["anon_mb"] - out["one"]["anon_mb"]
        self.scale["million_lists"] = out
        shutil.rmtree(folder, ignore_errors=True)

    def _million_run(
        self, kind: str, path: Path, urls: list[str], index_text: Callable[[list[str]], str] | None
    ) -> dict[str, Any]:
        """One agent on ``path``: readiness, memory, stats, first sample; for a long list, 3 live edits."""
        from wdscache.shared.stats import collect

        cache = self.fresh_dir(f"million-{kind}")
        agent = Agent(self, cache, path, 64 << 20, tag=f"million-{kind}-agent", ready_within=180)
        self.agents.append(agent)
        try:
            agent.start()
            ready_at = agent.t_launch + agent.ready_s
            t = time.perf_counter()
            subprocess.run(
                [wdscache_exe(), "stats", "--cache-dir", str(cache), "--json"],
                capture_output=True,
                check=True,
                timeout=60,
            )
            stats_cli_s = time.perf_counter() - t
            c = self.consumer(
                "wdscache",
                "--cache-dir",
                str(cache),
                "--job",
                "million",
                "--max-samples",
                "1",
                "--timeout",
                str(CONSUMER_TIMEOUT),
                tag=f"million-{kind}-consumer",
            ).wait(120)
            r = c.report()
            if r is None or c.returncode != 0:
                return {"error": c.stderr_tail(3) or f"consumer exit {c.returncode}", "ready_s": agent.ready_s}
            e = r["epochs"][0]
            row: dict[str, Any] = {
                "ready_s": agent.ready_s,
                "stats_cli_s": stats_cli_s,
                "first_sample_s": e["ttfs"],
                "first_sample_after_ready_s": e["t_first"] - ready_at,
                "anon_mb": status_kb(agent.pid, "RssAnon")["RssAnon"] / 1024,
            }
            if index_text is not None or len(urls) > 1:
                after = []
                for edit in range(1, MILLION_EDITS + 1):
                    edited = urls + [str(path.parent / f"edit-{edit}-{i}.tar") for i in range(edit)]
                    tmp = path.with_name(path.name + ".tmp")
                    tmp.write_text(index_text(edited) if index_text else "\n".join(edited) + "\n")
                    os.replace(tmp, path)
                    deadline = time.monotonic() + 60
                    while (collect(cache, timeout=5.0).get("agent") or {}).get("urls") != len(edited):
                        if time.monotonic() > deadline:
                            return {**row, "error": f"edit {edit} not taken within 60 s"}
                        time.sleep(0.1)
                    after.append(status_kb(agent.pid, "RssAnon")["RssAnon"] / 1024)
                row["anon_mb_after_edits"] = after
                row["anon_mb_after_3_edits"] = after[-1]
                # A rewrite of every line (each missing shard renamed, one more added): how long the
                # agent's answers wait while it takes the new list.
                rewritten = [u.replace("missing-", "moved-") for u in urls] + [str(path.parent / "rewrite.tar")]
                row["rewrite_stall_s"] = _longest_answer_while(
                    cache,
                    lambda: _replace_text(path, index_text(rewritten) if index_text else "\n".join(rewritten) + "\n"),
                    len(rewritten),
                )
                path.write_text(index_text(urls) if index_text else "\n".join(urls) + "\n")  # as it was
            return row
        except Exception as exc:
            return {"error": repr(exc)}
        finally:
            agent.stop()
            shutil.rmtree(cache, ignore_errors=True)

    # -- the whole run --------------------------------------------------------------------------------

    def run(self) -> None:
        a = self.args
        shutil.rmtree(self.logs, ignore_errors=True)  # this run's logs only
        for d in (self.work, self.runs_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        log(f"logs of every process: {self.logs}")
        self.start_server()
        profiles = [p.strip() for p in a.profiles.split(",") if p.strip()]
        for name in profiles:
            prof = PROFILES[name]
            size = (
                parse_bytes(getattr(a, f"size_{name}"))
                if getattr(a, f"size_{name}")
                else (prof.quick_bytes if a.quick else prof.default_bytes)
            )
            ds = self.make_data(prof, size)
            self.datasets[name] = ds
            subprocess.run(["cat", *ds["paths"]], stdout=subprocess.DEVNULL, check=True)  # into the page cache
            log(f"{name}: {ds['shards']} shards, {ds['samples']} samples, {ds['disk_bytes'] / MB:.0f} MB on disk")
            systems: list[tuple[str, Callable[[str, int, dict[str, Any]], Any]]] = [
                ("wds-local", self.run_wds_local),
                ("wds-multi", self.run_multi),
                ("wdscache", self.run_wdscache),
                ("wds-http", self.run_wds_http),
                ("wds-multi-stock", self.run_multi_stock),
                ("wds-cachedir", self.run_wds_cachedir),
                ("cat", self.run_cat),
                ("zmq", self.run_zmq),
                ("wdscache-other-order", self.run_wdscache_other_order),
                ("wdscache-loader-first", self.run_wdscache_loader_first),
                ("torch-wds-http", functools.partial(self.run_torch_wds, where="http")),
                ("torch-wds-local", functools.partial(self.run_torch_wds, where="local")),
                ("torch-memory", functools.partial(self.run_torch_wds, where="memory")),
                ("torch-pread", functools.partial(self.run_torch_wds, where="pread")),
                ("torch-wdscache", self.run_torch_wdscache),
                ("wdscache-nodes", self.run_wdscache_nodes),
                ("wdscache-mix", self.run_wdscache_mix),
                ("random-access", self.run_random_access),
            ]
            skip = {s.strip() for s in a.skip.split(",") if s.strip()}
            only = {s.strip() for s in a.only.split(",") if s.strip()}
            systems = [s for s in systems if s[0] not in skip and (not only or s[0] in only)]
            for rep in range(a.reps if systems else 0):
                k = rep % len(systems)
                for sname, fn in systems[k:] + systems[:k]:
                    log(f"{name} rep {rep + 1}/{a.reps}: {sname}")
                    try:
                        fn(name, rep, ds)
                    except Exception as exc:  # one system failing must not lose the others' numbers
                        log(f"  {sname} failed: {exc!r}")
                        self.runs.append(
                            {"profile": name, "rep": rep, "system": sname, "status": f"error: {exc!r}", "rows": {}}
                        )
        skip = {s.strip() for s in a.skip.split(",") if s.strip()}
        only = {s.strip() for s in a.only.split(",") if s.strip()}
        if "parts" not in skip and (not only or "parts" in only):
            self.run_parts()
        if "s3" not in skip and (not only or "s3" in only) and "tiny" in self.datasets:
            self.run_s3("tiny", self.datasets["tiny"])
        if not a.no_scale:
            self.run_scale()

    def cleanup(self) -> None:
        for agent in self.agents:
            agent.stop()
        self.stop_server()
        for child in list(Child.live):  # consumers still running after an interrupt
            child._kill_group()
            child.wait(10)
        shutil.rmtree(self.runs_dir, ignore_errors=True)
        shutil.rmtree(self.work / "lists", ignore_errors=True)
        for pattern in ("_bench-*", "server.*"):  # sockets MultiLoader leaves behind, server files
            for f in self.work.glob(pattern):
                f.unlink(missing_ok=True)
        if not self.args.keep_data:
            shutil.rmtree(self.work / "data", ignore_errors=True)
            for f in self.work.glob("urls-*.txt"):
                f.unlink()


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once (a temporary file renamed over it), as an operator's tool does."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _longest_answer_while(cache: Path, edit: Callable[[], None], urls: int) -> float:
    """The longest a ``stats`` request to the agent of ``cache`` waited for its answer (one every 20 ms)
    from ``edit()`` until the agent lists ``urls`` URLs (its edited list taken), in seconds."""
    from wdscache.shared.client import AgentConnection, resolve_endpoint

    conn = AgentConnection(resolve_endpoint(cache, None), timeout=60, cache_dir=cache)
    try:
        edit()
        longest, deadline = 0.0, time.monotonic() + 120
        while time.monotonic() < deadline:
            t = time.perf_counter()
            reply = conn.request({"op": "stats"})
            longest = max(longest, time.perf_counter() - t)
            if (reply["stats"].get("agent") or {}).get("urls") == urls:
                return longest
            time.sleep(0.02)
        raise RuntimeError(f"the rewritten list ({urls} URLs) not taken within 120 s")
    finally:
        conn.close()


class Agent:
    """A ``wdscache agent`` subprocess, its readiness, CPU and memory."""

    def __init__(
        self,
        bench: Bench,
        cache: Path,
        urls: Path,
        budget: int,
        tag: str,
        *,
        defaults: bool = False,
        extra: Sequence[str] = (),
        ready_within: float = 30.0,
    ) -> None:
        self.bench, self.cache, self.urls, self.budget, self.tag = bench, cache, urls, budget, tag
        self.ready_within = ready_within  # seconds it may take to answer stats
        self.extra = list(extra)  # more agent options (a node's --node-rank, --num-nodes)
        self.defaults = defaults  # every option at its default (the start-up plan in seeded shuffle order)
        self.child: Child | None = None
        self.pid = 0
        self.t_launch = 0.0
        self.ready_s = 0.0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self.peak_rss_kb = self.peak_anon_kb = 0
        self.last_hwm_kb = 0
        self._stats: dict[str, Any] | None = None

    def start(self) -> None:
        b = self.bench
        b._seq += 1
        cmd = [wdscache_exe(), "agent", "--cache-dir", str(self.cache), "--urls", str(self.urls)]
        if not self.defaults:
            cmd += [
                "--cache-size",
                str(self.budget),
                "--prefetch",
                str(PREFETCH),
                "--download-workers",
                str(DOWNLOAD_WORKERS),
                "--workers",
                str(AGENT_WORKERS),
                "--min-free",
                "1M",
                "--no-shuffle",
            ]
        cmd += self.extra
        self.t_launch = time.time()
        self.child = Child(cmd, b.logs / f"{b._seq:03d}-{self.tag}.log")
        self.pid = self.child.pid
        self._wait_ready()
        self.ready_s = time.time() - self.t_launch
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _wait_ready(self) -> None:
        # What `wdscache stats --cache-dir D --json` runs, in-process: polling the CLI would add
        # its interpreter start-up to every poll.
        from wdscache.shared.errors import WdsCacheError
        from wdscache.shared.stats import collect

        deadline = time.monotonic() + self.ready_within
        while True:
            assert self.child is not None
            if self.child.proc.poll() is not None:
                raise RuntimeError(f"the agent exited: {self.child.stderr_tail()}")
            try:
                if (collect(self.cache, timeout=0.5).get("agent") or {}).get("answering"):
                    return
            except WdsCacheError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the agent did not answer stats within {self.ready_within:.0f} s: {self.child.stderr_tail()}"
                )
            time.sleep(0.02)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            rss = anon = hwm = 0
            for p in process_tree(self.pid):
                s = status_kb(p, "VmRSS", "RssAnon", "VmHWM")
                rss, anon, hwm = rss + s["VmRSS"], anon + s["RssAnon"], hwm + s["VmHWM"]
            self.peak_rss_kb = max(self.peak_rss_kb, rss)
            self.peak_anon_kb = max(self.peak_anon_kb, anon)
            self.last_hwm_kb = max(self.last_hwm_kb, hwm)

    def cpu(self) -> float:
        return tree_cpu(self.pid)

    def memory(self) -> tuple[float, float]:
        """(sum of VmHWM over the agent's processes, sampled peak of their summed RssAnon), in MB."""
        hwm = sum(status_kb(p, "VmHWM")["VmHWM"] for p in process_tree(self.pid))
        self.last_hwm_kb = max(self.last_hwm_kb, hwm)
        return self.last_hwm_kb / 1024, self.peak_anon_kb / 1024

    def stats(self) -> dict[str, Any] | None:
        from wdscache.shared.stats import collect

        try:
            s = collect(self.cache, timeout=2.0)
        except Exception:
            return None
        return {k: s.get(k) for k in ("bytes_used", "shards", "hits", "misses", "bytes_downloaded")}

    def stop(self) -> None:
        self._stop.set()
        if self.child is None or self.child.returncode is not None:
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.child.wait(15)


def write_tiny_shard(path: Path, samples: int) -> None:
    """A small plain tar shard of ``samples`` samples (a ``.txt`` and a ``.cls`` each)."""
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            for ext, data in (("txt", f"sample {i} of {path.name}".encode()), ("cls", str(i % 10).encode())):
                info = tarfile.TarInfo(f"{path.stem}-{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


# -- summary and tables ----------------------------------------------------------------------------

METRICS = (
    "samples_s",
    "mb_s",
    "wall_s",
    "ttfs_ms",
    "ttfs_from_agent_launch_ms",
    "ttfs_after_ready_ms",
    "cpu_s_per_gb",
    "consumer_hwm_mb",
    "consumer_growth_mb",
    "helper_hwm_mb",
    "helper_anon_mb",
    "agent_ready_s",
)


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """profile -> row label -> metric -> {median, min, max, n}; plus statuses per system."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        prof = out.setdefault(run["profile"], {})
        for label, row in run["rows"].items():
            entry = prof.setdefault(label, {"_system": run["system"], "_values": {}})
            for m in METRICS:
                v = row.get(m)
                if isinstance(v, (int, float)):
                    entry["_values"].setdefault(m, []).append(float(v))
    for prof in out.values():
        for entry in prof.values():
            entry["metrics"] = {
                m: {"median": statistics.median(vs), "min": min(vs), "max": max(vs), "n": len(vs)}
                for m, vs in entry.pop("_values").items()
            }
    return out


def med(summary: dict, profile: str, label: str, metric: str) -> float | None:
    try:
        return summary[profile][label]["metrics"][metric]["median"]
    except KeyError:
        return None


def fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100 and digits <= 1:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def cell(entry: dict[str, Any], metric: str, digits: int = 0) -> str:
    m = entry["metrics"].get(metric)
    if m is None:
        return "-"
    s = fmt(m["median"], digits)
    if m["n"] > 1 and fmt(m["min"], digits) != fmt(m["max"], digits):
        s += f" ({fmt(m['min'], digits)}–{fmt(m['max'], digits)})"
    return s


SHUFFLED = "wdscache, epoch 3 (warm, shuffled)"
STREAMED = "wdscache, warm, streamed (direct_reads=False)"
RESTARTED = "wdscache, agent started again on the warm cache, its first epoch (a new consumer)"


@dataclass(frozen=True)
class ManyShape:
    """Consumers reading the warm cache at once: ``jobs`` jobs of ``ranks`` ranks, each rank
    through a DataLoader with ``loader_workers`` workers (0: in its own process)."""

    jobs: int
    ranks: int
    loader_workers: int
    label: str
    tag: str
    made: bool = False  # no agent read: the DataLoaders' workers make the samples (the shape's own cost)

    @property
    def readers(self) -> int:
        return self.jobs * self.ranks * max(1, self.loader_workers)

    @property
    def streamed_label(self) -> str:
        return f"wdscache, {self.readers} consumers, warm, streamed (direct_reads=False), aggregate"


MANY_SHAPES = (
    ManyShape(2, 4, 0, "wdscache, 8 consumers (2 jobs x 4 ranks), warm, aggregate", "j"),
    ManyShape(8, 8, 0, "wdscache, 64 consumers (8 jobs x 8 ranks), warm, aggregate", "k"),
    ManyShape(2, 1, 4, "wdscache, 8 consumers (2 jobs x 1 rank x 4 DataLoader workers), warm, aggregate", "d"),
)
MANY, MANY_64, MANY_DL = (shape.label for shape in MANY_SHAPES)
DL_MADE = "2 processes x 4 DataLoader workers, samples made in the workers (no source), batches of 64, aggregate"
DL_MADE_SHAPE = ManyShape(2, 1, 4, DL_MADE, "m", made=True)
MANY_STREAMED = MANY_SHAPES[0].streamed_label
ROW_ORDER = [
    "wds local, in-process",
    f"wds MultiLoader, {AGENT_WORKERS} workers (worker flushes ZeroMQ on exit)",
    f"wds MultiLoader, {AGENT_WORKERS} workers, stock 1.0.2",
    "wds HTTP streaming (no cache)",
    "wds cache_dir, epoch 1 (cold)",
    "wds cache_dir, epoch 2 (warm)",
    "wdscache, epoch 1 (cold)",
    "wdscache, epoch 2 (warm)",
    SHUFFLED,
    STREAMED,
    MANY,
    MANY_64,
    MANY_DL,
    DL_MADE,
    MANY_STREAMED,
    "wdscache, 2 nodes x 2 ranks (an agent each), warm, aggregate",
    "wdscache, 1 node x 4 ranks, warm, aggregate",
    "cat shards > /dev/null (page cache; MB are tar bytes)",
    "pyzmq IPC PUSH/PULL, multipart, copy=False",
]
S3_WDSCACHE = "wdscache, S3 (SeaweedFS behind a capped proxy), epoch 1 (cold)"
S3_WDS = "wds, S3 through pipe: (a boto3 stream per shard, one at a time)"
OTHER_ORDER = "wdscache, agent with default options, loader in list order: first sample (cold)"
FIRST_SAMPLE_SLACK_MS = 20  # a cold first sample's target: wds HTTP streaming's, plus this
LOADER_FIRST = (
    "wdscache, loader first, agent with default options started after it: first sample from agent launch (cold)"
)
TORCH_WORKERS = 2
_TORCH = f"DataLoader({TORCH_WORKERS} workers): decode, to_tuple, batched(64), "
TORCH_WDS_HTTP = _TORCH + "wds.WebDataset HTTP streaming"
TORCH_WDS_LOCAL = _TORCH + "wds.WebDataset local files"
TORCH_COLD = _TORCH + "wdscache.WebDataset, epoch 1 (cold)"
TORCH_WARM = _TORCH + "wdscache.WebDataset, epoch 2 (warm)"
TORCH_PERSISTENT = _TORCH + "wdscache.WebDataset, warm, persistent workers (started in an untimed epoch)"
TORCH_MEMORY = _TORCH + "samples held in each worker's memory (the pipeline's own cost)"
TORCH_PREAD = _TORCH + "read from the page cache by pread, offsets known (the least any reader costs)"
ROW_ORDER += [TORCH_WDS_HTTP, TORCH_WDS_LOCAL, TORCH_COLD, TORCH_WARM, TORCH_PERSISTENT, TORCH_MEMORY, TORCH_PREAD]
NODES_WARM = "wdscache, 2 nodes x 2 ranks (an agent each), warm, aggregate"
MIX_ONE = "wdscache, one source, warm, shuffled"
MIX_TWO = "wdscache, mixture of two sources (mix=, same total), warm"
ONE_NODE_WARM = "wdscache, 1 node x 4 ranks, warm, aggregate"
REQUEST_SIZE = 32  # samples a message in the raw rows: what the loader's first requests ask for
# Samples each rank of the nodes rows reads before the measured epoch (twice what its first
# four requests ask for), so that it is measured warm.
WARMUP_SAMPLES = 256
RAW_ONE = f"pyzmq IPC, 2 senders -> 1 receiver, {REQUEST_SIZE} samples a message, copied to bytes"
RAW_EIGHT = f"pyzmq IPC, 2 senders -> 8 receivers, {REQUEST_SIZE} samples a message, copied to bytes, aggregate"
RAW_64 = f"pyzmq IPC, 2 senders -> 64 receivers, {REQUEST_SIZE} samples a message, copied to bytes, aggregate"
ROW_ORDER += [RAW_ONE, RAW_EIGHT, RAW_64]
RANDOM_WIDS_COLD = "random access ds[i]: wids.ShardListDataset, own download folder, epoch 1 (cold)"
RANDOM_WIDS_WARM = "random access ds[i]: wids.ShardListDataset, warm (local disk), fastest of epochs 2-4"
RANDOM_COLD = "random access ds[i]: wdscache.ShardListDataset, epoch 1 (cold)"
RANDOM_WARM = "random access ds[i]: wdscache.ShardListDataset, warm, fastest of epochs 2-4"
ROW_ORDER += [RANDOM_WIDS_COLD, RANDOM_WIDS_WARM, RANDOM_COLD, RANDOM_WARM]


SYSTEM_LABELS = {
    "wds-local": "wds local, in-process",
    "wds-multi": f"wds MultiLoader, {AGENT_WORKERS} workers (worker flushes ZeroMQ on exit)",
    "wds-multi-stock": f"wds MultiLoader, {AGENT_WORKERS} workers, stock 1.0.2",
    "wds-http": "wds HTTP streaming (no cache)",
    "wds-cachedir": "wds cache_dir",
    "wdscache": "wdscache",
    "cat": "cat shards > /dev/null",
    "zmq": "pyzmq IPC PUSH/PULL",
    "torch-wds-http": TORCH_WDS_HTTP,
    "torch-wds-local": TORCH_WDS_LOCAL,
    "torch-wdscache": _TORCH + "wdscache.WebDataset",
    "torch-memory": TORCH_MEMORY,
    "torch-pread": TORCH_PREAD,
    "wdscache-nodes": "wdscache on several nodes (an agent each)",
    "random-wids": "random access ds[i]: wids.ShardListDataset",
    "random-wdscache": "random access ds[i]: wdscache.ShardListDataset",
}


def tables(bench: Bench, summary: dict, targets: list[dict[str, Any]]) -> str:
    a = bench.args
    out = []
    for prof, ds in bench.datasets.items():
        rows = summary.get(prof, {})
        warm = med(summary, prof, "wdscache, epoch 2 (warm)", "mb_s")
        out.append(
            f"**{prof}**: {ds['shards']} shards x {ds['samples_per_shard']} samples "
            f"({ds['samples']:,} samples, {ds['disk_bytes'] / MB:,.0f} MB of tar, ~{ds['payload']:,} B "
            f".jpg per sample), {a.reps} repetition(s); median (min–max). Cold runs fetch over HTTP "
            f"from 127.0.0.1 capped at {a.rate_mb:g} MB/s per connection with {a.ttfb_ms:g} ms to first "
            f"byte; wdscache: agent with {DOWNLOAD_WORKERS} download workers, {AGENT_WORKERS} workers, "
            f"prefetch {PREFETCH}.\n"
        )
        out.append(
            "| system | samples/s | MB/s | wdscache warm ÷ this | epoch wall s | first sample ms "
            "| CPU s/GB | consumer RSS peak MB (growth) | agent/worker RSS MB | status |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        labels = [r for r in ROW_ORDER if r in rows] + [r for r in rows if r not in ROW_ORDER]
        for label in labels:
            e = rows[label]
            mb = med(summary, prof, label, "mb_s")
            ratio = f"{warm / mb:.2f}x" if warm and mb else "-"
            ttfs = cell(e, "ttfs_ms")
            if "ttfs_from_agent_launch_ms" in e["metrics"]:
                ttfs += f"; {cell(e, 'ttfs_from_agent_launch_ms')} from agent launch"
            cons = cell(e, "consumer_hwm_mb")
            if "consumer_growth_mb" in e["metrics"] and cons != "-":
                cons += f" (+{cell(e, 'consumer_growth_mb')})"
            helper = "-"
            if "helper_anon_mb" in e["metrics"]:
                helper = f"{cell(e, 'helper_hwm_mb')} VmHWM, {cell(e, 'helper_anon_mb')} anon"
            elif "helper_hwm_mb" in e["metrics"]:
                helper = f"{cell(e, 'helper_hwm_mb')} (largest worker)"
            out.append(
                f"| {label} | {cell(e, 'samples_s')} | {cell(e, 'mb_s', 1)} | {ratio} | "
                f"{cell(e, 'wall_s', 2)} | {ttfs} | {cell(e, 'cpu_s_per_gb', 2)} | {cons} | {helper} | "
                f"{status_cell(bench, prof, e['_system'], label)} |"
            )
        # Systems without a single complete run (a hang every time) still get their line.
        shown = {e["_system"] for e in rows.values()}
        for system in dict.fromkeys(r["system"] for r in bench.runs if r["profile"] == prof):
            if system not in shown:
                out.append(
                    f"| {SYSTEM_LABELS.get(system, system)} | - | - | - | - | - | - | - | - | {status_cell(bench, prof, system, '')} |"
                )
        out.append("")
    big = bench.scale.get("big_list_1m")
    if big and "first_sample_s" in big:
        out.append(
            f"A 1,000,000-entry list end to end (its first entries real shards, capped server): the agent "
            f"answers stats {big['agent_ready_s']:.1f} s after launch; a consumer then gets its first "
            f"sample {big['first_sample_s']:.1f} s after building its loader ({big['consumer_cpu_s']:.1f} CPU s, "
            f"{big['consumer_hwm_mb']:.0f} MB peak RSS; agent {big['agent_anon_mb']:.0f} MB anon).\n"
        )
    elif big:
        ready = (
            f" (the agent itself answered stats {big['agent_ready_s']:.1f} s after launch)"
            if big.get("agent_ready_s")
            else ""
        )
        out.append(f"A 1,000,000-entry list end to end: **the consumer failed**: `{big.get('error')}`{ready}\n")
    if bench.parts:
        cells = [
            f"{label}: "
            + (
                f"{r['seconds']:.2f} s ({r['mb_s']:.1f} MB/s, {r['gets']} GETs, "
                f"{r['bytes'] / bench.parts['shard_bytes']:.2f}x fetched)"
                if "seconds" in r
                else f"**failed**: `{r.get('error')}`"
            )
            for label, r in bench.parts.items()
            if label != "shard_bytes"
        ]
        out.append(
            f"One {bench.parts['shard_bytes'] / MB:.0f} MB shard from the capped server, agent start to "
            f"cached: " + "; ".join(cells) + "\n"
        )
    out.append("Targets (reported, not asserted):\n")
    out.append("| # | target | measured | PASS/FAIL |")
    out.append("|---|---|---|---|")
    for t in targets:
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        out.append(f"| {t['id']} | {t['target']} | {t['measured']} | {verdict} |")
    out.append("")
    return "\n".join(out)


def status_cell(bench: Bench, prof: str, system: str, label: str) -> str:
    """Outcomes of a system's runs (``ok x3``, ``hang: ... x1``), plus what cold rows fetched and resent."""
    runs = [r for r in bench.runs if r["profile"] == prof and r["system"] == system]
    counts: dict[str, int] = {}
    for r in runs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    parts = [f"{'**' + st + '**' if st != 'ok' else st} x{n}" for st, n in counts.items()]
    cold = "epoch 1" in label or "streaming" in label
    fetched = [r["fetched"]["x_dataset"] for r in runs if r.get("fetched")]
    if cold and fetched:
        parts.append(f"fetched {statistics.median(fetched):.2f}x the dataset")
    if "epoch 1" in label and system == "wdscache":
        stalls = [r.get("resends", 0) for r in runs]
        if any(stalls):
            parts.append(f"**{statistics.median(stalls):g} worker request(s) resent after 10 s** (median per run)")
    if " consumers" in label and "aggregate" in label:
        many = [r["rows"][label].get("resends", 0) for r in runs if label in r["rows"]]
        if any(many):
            parts.append(f"**{sum(many)} request(s) resent**")
    return "; ".join(parts)


def evaluate(bench: Bench, summary: dict) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(
        tid: str,
        target: str,
        value: float | None,
        limit: float | None,
        ok: Callable[[float, float], bool],
        measured: str,
        per_rep: list[float] | None = None,
    ) -> None:
        passed = None if value is None or limit is None else bool(ok(value, limit))
        if passed is not None and per_rep and len(per_rep) > 1:
            measured += f"; per repetition {min(per_rep):.2f}–{max(per_rep):.2f}x"
        entry = {
            "id": tid,
            "target": target,
            "value": value,
            "limit": limit,
            "pass": passed,
            "measured": measured if passed is not None else "not measured",
        }
        if per_rep:
            entry["per_rep"] = per_rep
        targets.append(entry)

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    def per_rep(prof: str, top: str, bottom: str, metric: str) -> list[float]:
        """Row ``top`` over row ``bottom`` (``metric``) in each repetition that has both: the
        two were measured minutes apart, so a host whose speed drifts moves both."""
        got: dict[int, dict[str, float]] = {}
        for run in bench.runs:
            if run["profile"] != prof:
                continue
            for label in (top, bottom):
                v = run["rows"].get(label, {}).get(metric)
                if isinstance(v, (int, float)):
                    got.setdefault(run["rep"], {})[label] = float(v)
        return [round(v[top] / v[bottom], 3) for _, v in sorted(got.items()) if top in v and v.get(bottom)]

    W = "wdscache, epoch 2 (warm)"
    C = "wdscache, epoch 1 (cold)"
    ML = f"wds MultiLoader, {AGENT_WORKERS} workers (worker flushes ZeroMQ on exit)"
    ge = lambda v, limit: v >= limit  # noqa: E731
    le = lambda v, limit: v <= limit  # noqa: E731
    s = summary
    w_img = med(s, "images", W, "mb_s")
    for name, other, need in (
        ("MultiLoader", ML, 2.0),
        ("wds in-process", "wds local, in-process", 1.0),
        ("raw pyzmq IPC", "pyzmq IPC PUSH/PULL, multipart, copy=False", 0.6),
    ):
        r = ratio(w_img, med(s, "images", other, "mb_s"))
        streamed = ratio(med(s, "images", STREAMED, "mb_s"), med(s, "images", other, "mb_s"))
        add(
            "1",
            f"warm images, 1 consumer: wdscache MB/s ≥ {need:g}x {name}",
            r,
            need,
            ge,
            (f"{r:.2f}x ({fmt(w_img, 1)} vs {fmt(med(s, 'images', other, 'mb_s'), 1)} MB/s)" if r else "")
            + (f"; streamed (direct_reads=False): {streamed:.2f}x" if r and streamed else ""),
        )
    r = ratio(med(s, "tiny", W, "samples_s"), med(s, "tiny", ML, "samples_s"))
    add(
        "2",
        "warm tiny: wdscache samples/s ≥ 2x MultiLoader",
        r,
        2.0,
        ge,
        f"{r:.2f}x ({fmt(med(s, 'tiny', W, 'samples_s'))} vs {fmt(med(s, 'tiny', ML, 'samples_s'))} samples/s)"
        if r
        else "",
    )
    for prof, ds in bench.datasets.items():
        cold, warm = med(s, prof, C, "wall_s"), med(s, prof, W, "wall_s")
        links = min(DOWNLOAD_WORKERS, ds["shards"])
        net = ds["disk_bytes"] / (bench.rate * links)
        bound = max(net, warm) if warm is not None else None
        r = ratio(cold, bound)
        add(
            "3",
            f"{prof} cold: epoch 1 ≤ 1.25x max(network bound, warm epoch)",
            r,
            1.25,
            le,
            f"{r:.2f}x ({fmt(cold, 2)} s; network bound {net:.2f} s = {ds['disk_bytes'] / MB:.0f} MB / "
            f"({bench.args.rate_mb:g} MB/s x {links}), warm {fmt(warm, 2)} s)"
            if r
            else "",
        )
        http = med(s, prof, "wds HTTP streaming (no cache)", "wall_s")
        r = ratio(http, cold)
        add(
            "3",
            f"{prof} cold: epoch 1 ≥ 3x faster than wds HTTP streaming",
            r,
            3.0,
            ge,
            f"{r:.2f}x ({fmt(http, 2)} s vs {fmt(cold, 2)} s)" if r else "",
        )
        r = ratio(http, warm)
        add(
            "3",
            f"{prof}: epoch 2 ≥ 5x faster than wds HTTP streaming",
            r,
            5.0,
            ge,
            f"{r:.2f}x ({fmt(http, 2)} s vs {fmt(warm, 2)} s)" if r else "",
        )
        t_w = med(s, prof, C, "ttfs_ms")
        t_h = med(s, prof, "wds HTTP streaming (no cache)", "ttfs_ms")
        t_c = med(s, prof, "wds cache_dir, epoch 1 (cold)", "ttfs_ms")
        t_launch = med(s, prof, C, "ttfs_from_agent_launch_ms")
        slack = FIRST_SAMPLE_SLACK_MS
        add(
            "4",
            f"{prof} cold first sample: wdscache ≤ wds HTTP streaming + {slack} ms",
            t_w,
            t_h + slack if t_h is not None else None,
            le,
            f"{fmt(t_w)} ms vs {fmt(t_h)} + {slack} ms (from agent launch: {fmt(t_launch)} ms)",
        )
        r = ratio(t_c, t_w)
        add(
            "4",
            f"{prof} cold first sample: wdscache ≥ 10x sooner than wds cache_dir",
            r,
            10.0,
            ge,
            f"{r:.2f}x ({fmt(t_w)} ms vs {fmt(t_c)} ms)" if r else "",
        )
        t_o = med(s, prof, OTHER_ORDER, "ttfs_ms")
        add(
            "4",
            f"{prof} cold first sample, agent with default options, loader in another order: "
            f"≤ wds HTTP streaming + {slack} ms",
            t_o,
            t_h + slack if t_h is not None else None,
            le,
            f"{fmt(t_o)} ms vs {fmt(t_h)} + {slack} ms",
        )
        t_f = med(s, prof, LOADER_FIRST, "ttfs_after_ready_ms")
        t_fl = med(s, prof, LOADER_FIRST, "ttfs_ms")
        add(
            "4",
            f"{prof} cold first sample, loader first, agent (default options) after it: from the agent "
            f"ready, ≤ wds HTTP streaming + {slack} ms",
            t_f,
            t_h + slack if t_h is not None else None,
            le,
            f"{fmt(t_f)} ms vs {fmt(t_h)} + {slack} ms (from agent launch: {fmt(t_fl)} ms)",
        )
    cw, cm = med(s, "images", W, "cpu_s_per_gb"), med(s, "images", ML, "cpu_s_per_gb")
    r = ratio(cw, cm)
    add(
        "5",
        "warm images: CPU s/GB ≤ 0.5x MultiLoader (all processes)",
        r,
        0.5,
        le,
        f"{r:.2f}x ({fmt(cw, 2)} vs {fmt(cm, 2)} CPU s/GB)" if r else "",
    )
    hwm = [
        m["max"]
        for p in s.values()
        for lab, e in p.items()
        if lab.startswith("wdscache")
        for k, m in e["metrics"].items()
        if k == "helper_hwm_mb"
    ]
    anon = [
        m["max"]
        for p in s.values()
        for lab, e in p.items()
        if lab.startswith("wdscache")
        for k, m in e["metrics"].items()
        if k == "helper_anon_mb"
    ]
    add(
        "6",
        "agent RSS ≤ 250 MB: sum of VmHWM over agent + workers (counts mmapped shard pages)",
        max(hwm) if hwm else None,
        250,
        le,
        f"{max(hwm):.0f} MB (worst run)" if hwm else "",
    )
    add(
        "6",
        "agent RSS ≤ 250 MB: peak of summed RssAnon (private memory only)",
        max(anon) if anon else None,
        250,
        le,
        f"{max(anon):.0f} MB (worst run)" if anon else "",
    )
    growth = [
        m["max"]
        for p in s.values()
        for lab, e in p.items()
        if lab in (W, C)
        for k, m in e["metrics"].items()
        if k == "consumer_growth_mb"
    ]
    add(
        "6",
        "consumer RSS growth ≤ 64 MB over an epoch",
        max(growth) if growth else None,
        64,
        le,
        f"{max(growth):.1f} MB (worst epoch)" if growth else "",
    )
    for prof in bench.datasets:
        single = med(s, prof, W, "samples_s")
        for label, raw_label, what in (
            (MANY, RAW_EIGHT, "8 consumers (2 jobs x 4 ranks)"),
            (MANY_64, RAW_64, "64 consumers (8 jobs x 8 ranks)"),
            (MANY_DL, DL_MADE, "8 consumers (2 jobs x 1 rank x 4 DataLoader workers)"),
        ):
            agg = med(s, prof, label, "samples_s")
            r = ratio(agg, single)
            # The limit: raw pyzmq, many receivers against one; for DataLoaders, the same DataLoaders
            # over samples their workers make, against the one consumer.
            limit_ref = single if raw_label == DL_MADE else med(s, prof, RAW_ONE, "samples_s")
            raw = ratio(med(s, prof, raw_label, "samples_s"), limit_ref)
            streamed = (
                ratio(med(s, prof, MANY_STREAMED, "samples_s"), med(s, prof, STREAMED, "samples_s"))
                if label == MANY
                else None
            )
            add(
                "7",
                f"{prof}: {what} aggregate samples/s ≥ 0.9x one consumer (warm)",
                r,
                0.9,
                ge,
                (f"{r:.2f}x ({fmt(agg)} vs {fmt(single)} samples/s)" if r else "")
                + (f"; streamed (direct_reads=False): {streamed:.2f}x" if r and streamed else "")
                + (
                    f"; raw pyzmq, {raw_label.split('-> ')[1].split(' ')[0]} receivers vs 1: {raw:.2f}x"
                    if r and raw and raw_label != DL_MADE
                    else ""
                )
                + (
                    f"; the same DataLoaders over samples made in their workers: {raw:.2f}x"
                    if r and raw and raw_label == DL_MADE
                    else ""
                ),
                per_rep(prof, label, W, "samples_s"),
            )
    par, one = (bench.parts.get(k, {}).get("seconds") for k in ("parallel parts", "one connection"))
    r = ratio(one, par)
    add(
        "15",
        f"one {bench.parts.get('shard_bytes', 0) / MB:.0f} MB shard, {bench.args.rate_mb:g} MB/s per connection: "
        "parallel parts ≥ 3x faster than one connection",
        r,
        3.0,
        ge,
        f"{r:.2f}x ({fmt(par, 2)} s vs {fmt(one, 2)} s)" if r else "",
    )
    for prof, ds in bench.datasets.items():
        cold, piped = med(s, prof, S3_WDSCACHE, "wall_s"), med(s, prof, S3_WDS, "wall_s")
        if cold is None and piped is None:
            continue
        links = min(DOWNLOAD_WORKERS, ds["shards"])
        net = ds["disk_bytes"] / (bench.rate * links)
        r = ratio(cold, net)
        add(
            "15",
            f"{prof} cold from S3: epoch 1 ≤ 1.15x the network bound",
            r,
            1.15,
            le,
            f"{r:.2f}x ({fmt(cold, 2)} s; network bound {net:.2f} s = {ds['disk_bytes'] / MB:.0f} MB / "
            f"({bench.args.rate_mb:g} MB/s x {links}))"
            if r
            else "",
        )
        r = ratio(piped, cold)
        add(
            "15",
            f"{prof} cold from S3: epoch 1 ≥ 4x faster than wds over a pipe: boto3 stream",
            r,
            4.0,
            ge,
            f"{r:.2f}x ({fmt(piped, 2)} s vs {fmt(cold, 2)} s)" if r else "",
        )
    for prof in bench.datasets:
        http, local = med(s, prof, TORCH_WDS_HTTP, "wall_s"), med(s, prof, TORCH_WDS_LOCAL, "mb_s")
        floor = ratio(http, med(s, prof, TORCH_MEMORY, "wall_s"))  # the most any source could reach
        for label, need in ((TORCH_COLD, 3.0), (TORCH_WARM, 5.0)):
            r = ratio(http, med(s, prof, label, "wall_s"))
            add(
                "9",
                f"{prof}, DataLoader pipeline: wdscache epoch {1 if label == TORCH_COLD else 2} ≥ {need:g}x "
                "as fast as wds.WebDataset streaming HTTP",
                r,
                need,
                ge,
                f"{r:.2f}x ({fmt(med(s, prof, label, 'wall_s'), 2)} vs {fmt(http, 2)} s)"
                + (f"; samples in memory: {floor:.2f}x" if floor else "")
                if r
                else "",
            )
        memory, persistent = med(s, prof, TORCH_MEMORY, "wall_s"), med(s, prof, TORCH_PERSISTENT, "wall_s")
        r, least = ratio(persistent, memory), ratio(med(s, prof, TORCH_PREAD, "wall_s"), memory)
        add(
            "9",
            f"{prof}, DataLoader pipeline: wdscache warm, persistent workers ≤ 1.1x the time over samples in memory",
            r,
            1.1,
            le,
            f"{r:.2f}x ({fmt(persistent, 2)} vs {fmt(memory, 2)} s)"
            + (f"; the least reader of the page cache: {least:.2f}x" if least else "")
            if r
            else "",
            per_rep(prof, TORCH_PERSISTENT, TORCH_MEMORY, "wall_s"),
        )
        r = ratio(med(s, prof, TORCH_WARM, "mb_s"), local)
        cpu = ratio(med(s, prof, TORCH_WARM, "cpu_s_per_gb"), med(s, prof, TORCH_WDS_LOCAL, "cpu_s_per_gb"))
        add(
            "9",
            f"{prof}, DataLoader pipeline: wdscache warm MB/s ≥ 1x wds.WebDataset on local files",
            r,
            1.0,
            ge,
            f"{r:.2f}x ({fmt(med(s, prof, TORCH_WARM, 'mb_s'), 1)} vs {fmt(local, 1)} MB/s)" if r else "",
        )
        add(
            "9",
            f"{prof}, DataLoader pipeline: wdscache warm CPU s/GB ≤ 0.7x wds.WebDataset on local files",
            cpu,
            0.7,
            le,
            f"{cpu:.2f}x ({fmt(med(s, prof, TORCH_WARM, 'cpu_s_per_gb'), 2)} vs "
            f"{fmt(med(s, prof, TORCH_WDS_LOCAL, 'cpu_s_per_gb'), 2)} CPU s/GB)"
            if cpu
            else "",
        )
    for prof in bench.datasets:
        for ours, theirs, need, what in (
            (RANDOM_WARM, RANDOM_WIDS_WARM, 2.0, "warm (wids on local disk)"),
            (RANDOM_COLD, RANDOM_WIDS_COLD, 3.0, "cold (wids with its own download folder)"),
        ):
            a, b = med(s, prof, ours, "samples_s"), med(s, prof, theirs, "samples_s")
            r = ratio(a, b)
            add(
                "RA",
                f"{prof} random access, {what}: wdscache.ShardListDataset samples/s ≥ {need:g}x wids.ShardListDataset",
                r,
                need,
                ge,
                f"{r:.2f}x ({fmt(a)} vs {fmt(b)} samples/s)" if r else "",
            )
    u = bench.scale.get("url_list_1m", {})
    add(
        "8",
        "1,000,000-entry URL list parsed and planned < 5 s",
        u.get("seconds"),
        5.0,
        lambda v, limit: v < limit,
        f"{u['seconds']:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in u.get("parts", {}).items()) + ")"
        if "seconds" in u
        else "",
    )
    st = bench.scale.get("stats_100k", {})
    add(
        "8",
        "`wdscache stats --json` on a 100,000-shard index < 1 s (wall, with interpreter start-up)",
        st.get("seconds"),
        1.0,
        lambda v, limit: v < limit,
        f"{st['seconds']:.2f} s (import of wdscache.cli alone: {st['python_import_wdscache_cli_s']:.2f} s)"
        if "seconds" in st
        else "",
    )
    for prof in bench.datasets:
        for n in (2, 3):
            runs = [r for r in bench.runs if r.get("profile") == prof and r.get("system") == "wdscache-nodes"]
            shares = [r.get(f"bytes_per_node_x_share_{n}") for r in runs]
            worst = max((abs(x - 1) for run in shares if run for x in run), default=None)
            add(
                "9",
                f"{prof}: bytes each of {n} nodes downloads in one epoch within 10% of dataset/{n}",
                worst,
                0.1,
                le,
                f"worst node {100 * worst:.1f}% off ({runs[0].get('shards')} shards)" if worst is not None else "",
            )
        r = ratio(med(s, prof, NODES_WARM, "samples_s"), med(s, prof, ONE_NODE_WARM, "samples_s"))
        add(
            "9",
            f"{prof}: 2 nodes x 2 ranks aggregate samples/s ≥ 0.8x 1 node x 4 ranks, warm",
            r,
            0.8,
            ge,
            f"{r:.2f}x ({fmt(med(s, prof, NODES_WARM, 'samples_s'))} vs "
            f"{fmt(med(s, prof, ONE_NODE_WARM, 'samples_s'))} samples/s)"
            if r
            else "",
        )
    for prof in bench.datasets:
        r = ratio(med(s, prof, MIX_TWO, "samples_s"), med(s, prof, MIX_ONE, "samples_s"))
        add(
            "mix",
            f"{prof}: a two-source mixture, warm, samples/s ≥ 0.9x one source of the same total size",
            r,
            0.9,
            ge,
            f"{r:.2f}x ({fmt(med(s, prof, MIX_TWO, 'samples_s'))} vs "
            f"{fmt(med(s, prof, MIX_ONE, 'samples_s'))} samples/s)"
            if r
            else "",
            per_rep(prof, MIX_TWO, MIX_ONE, "samples_s"),
        )
    return targets


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def machine() -> dict[str, Any]:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for mod in ("webdataset", "zmq"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    try:
        total_mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        total_mem = None
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "mem_bytes": total_mem,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **versions,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="192 MB images, 48 MB tiny, 1 repetition")
    ap.add_argument("--profiles", default="images,tiny", help="comma-separated: images, tiny")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    ap.add_argument("--size-images", default=None, help="tar bytes of the images profile (default 1G)")
    ap.add_argument("--size-tiny", default=None, help="tar bytes of the tiny profile (default 256M)")
    ap.add_argument("--rate-mb", type=float, default=25.0, help="server cap per connection, MB/s")
    ap.add_argument("--ttfb-ms", type=float, default=30.0, help="server time to first byte, ms")
    ap.add_argument(
        "--skip",
        default="",
        help="systems to leave out: wds-local,wds-multi,wdscache,wds-http,"
        "wds-multi-stock,wds-cachedir,cat,zmq,wdscache-other-order,wdscache-loader-first,parts,s3,"
        "torch-wds-http,torch-wds-local,torch-wdscache,torch-memory,torch-pread,"
        "wdscache-nodes,wdscache-mix,random-access; scale rows: " + ",".join(SCALE_ROWS),
    )
    ap.add_argument("--size-parts", default="256M", help="bytes of the one shard of the parallel-parts row")
    ap.add_argument(
        "--only",
        default="",
        help="systems to run, the others left out (e.g. torch-wds-http,torch-wds-local,torch-wdscache)",
    )
    ap.add_argument("--no-scale", action="store_true", help="skip the 1M-URL and 100k-shard checks")
    ap.add_argument("--no-multi-consumer", action="store_true", help="skip the many-consumer runs")
    ap.add_argument("--work", default="/tmp/wdscache-bench", help="shards, caches and logs")
    ap.add_argument("--keep-data", action="store_true", help="keep the shards for the next run")
    ap.add_argument("--out", default="bench-results/latest.json", help="JSON results")
    a = ap.parse_args()
    if a.reps is None:
        a.reps = 1 if a.quick else 3
    for p in a.profiles.split(","):
        if p.strip() and p.strip() not in PROFILES:
            ap.error(f"unknown profile {p!r}; choose from {', '.join(PROFILES)}")
    info = machine()
    load0 = loadavg()
    if load0 > 0.5:
        log(f"warning: load average {load0:.2f} before starting: other work on this machine skews the figures")
    bench = Bench(a)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.monotonic()
    try:
        bench.run()
    except KeyboardInterrupt:
        log("interrupted; cleaning up and reporting what was measured")
    finally:
        bench.cleanup()
    info["loadavg_start"], info["loadavg_end"] = load0, loadavg()
    summary = summarise(bench.runs)
    targets = evaluate(bench, summary)
    header = (
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), {((info['mem_bytes'] or 0) / GB):.0f} GB RAM, "
        f"Python {info['python']}, Linux {info['kernel']}, webdataset {info['webdataset']}, "
        f"pyzmq {info['zmq']}; {info['date']}; `scripts/bench.py "
        f"{' '.join(sys.argv[1:])}`; total {time.monotonic() - t_start:.0f} s; 1-min load average "
        f"{info['loadavg_start']:.2f} before, {info['loadavg_end']:.2f} after"
        + (" (**the machine was busy before the run: figures are skewed**)" if load0 > 0.5 else "")
        + "."
    )
    text = header + "\n\n" + tables(bench, summary, targets)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for ds in bench.datasets.values():
        ds.pop("paths", None)
    out.write_text(
        json.dumps(
            {
                "machine": info,
                "args": vars(a),
                "datasets": bench.datasets,
                "runs": bench.runs,
                "summary": summary,
                "targets": targets,
                "scale": bench.scale,
                "parts": bench.parts,
                "seconds": time.monotonic() - t_start,
            },
            indent=1,
            default=str,
        )
    )
    log(f"wrote {out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
