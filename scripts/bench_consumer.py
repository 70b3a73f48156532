"""The subprocess side of scripts/bench.py: each system under test runs here, in a process of its own.

    python scripts/bench_consumer.py MODE [options]

Modes (every one but ``serve`` and ``stats-index`` prints progress lines and a
final ``{"report": ...}`` line, as JSON, on stdout):

    serve ROOT --port-file F [--rate B/s] [--ttfb S]   the loopback object store (shard_server.py)
    wds --urls-file F [--cache-dir D] [--epochs N]     webdataset in-process (local paths or http URLs)
    multi --urls-file F --workers N [--flush]          webdataset.multi.MultiLoader over local paths
    wdscache --cache-dir D [--job J --rank R ...]      CachedMultiLoader through a running agent [--no-direct];
                                                        with --made SIZES, DataLoader workers that make
                                                        samples instead (no source: the DataLoader's cost)
    torch (--urls-file F | --cache-dir D) --workers N  a DataLoader over wds.WebDataset or wdscache.WebDataset:
                                                        decode() of .cls/.json, to_tuple, batched(64);
                                                        with --memory, over the samples each worker read
                                                        into its own memory in epoch 1 (the pipeline's own
                                                        cost, from epoch 2 on); with --pread, over the
                                                        least reader of the page cache (offsets found in
                                                        epoch 1, each payload pread into new bytes after);
                                                        with --persistent, persistent_workers=True
    random --system wids|wdscache --index F --cache-dir D   ds[i] over a random permutation of every index
                                                        (its first --max-samples)
    zmq --samples N --sizes A,B,C                       raw pyzmq IPC PUSH/PULL, multipart, copy=False
    zmq-many --samples N --sizes A,B,C --receivers R   raw pyzmq, 2 senders to R receivers copying to bytes
    urls --n N --dir D                                  parse and plan an N-entry URL list
    stats-index --cache-dir D --n N                     write an N-shard index, as tests/test_agent.py does

Every consumer does the same work per sample: count it and sum the lengths of
its payload fields (every key not starting with ``__``). Per epoch it reports
samples, payload bytes, time to first sample, wall time, CPU seconds of this
process and of its reaped children, and its resident memory (VmRSS at the start
of the epoch, VmHWM during it: the peak is reset through /proc/self/clear_refs
at the start of each epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
PROGRESS_EVERY = 1.0


# -- /proc helpers (shared with bench.py) ----------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def children_map() -> dict[int, list[int]]:
    """ppid -> [pid] for every process (this kernel has no /proc/PID/task/TID/children)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None:
            out.setdefault(int(fields[1]), []).append(int(name))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants."""
    kids = children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def tree_cpu(pid: int | None) -> float:
    """CPU seconds (user+system) of ``pid``, its live descendants and the children they reaped."""
    if not pid:
        return 0.0
    total = 0
    for p in process_tree(pid):
        fields = _stat_fields(p)
        if fields is not None:
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / TICK


def status_kb(pid: int | str, *names: str) -> dict[str, int]:
    """Fields of /proc/PID/status in kB (0 when missing)."""
    out = {n: 0 for n in names}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def self_cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# -- measuring one epoch ------------------------------------------------------------------------


_emit_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    with _emit_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def run_epoch(
    epoch: int, make: Callable[[], Iterable[dict[str, Any]]], agent_pid: int | None = None, limit: int = 0
) -> dict[str, Any]:
    """Iterate one epoch from ``make()`` (or its first ``limit`` samples), touching every payload."""
    reset_hwm()
    rss0 = status_kb("self", "VmRSS")["VmRSS"]
    cpu0, agent0 = self_cpu(), tree_cpu(agent_pid)
    t_start = time.time()
    p0 = time.perf_counter()
    n = nbytes = 0
    ttfs = t_first = None
    done = threading.Event()

    def progress() -> None:
        # From a thread, so that a consumer stuck in a receive still says how far it got.
        while not done.wait(PROGRESS_EVERY):
            emit({"progress": {"epoch": epoch, "samples": n, "bytes": nbytes, "elapsed": time.perf_counter() - p0}})

    # Started at the first sample: loaders that fork (MultiLoader) have forked by then, so no
    # child inherits the stdout lock in the middle of a write.
    reporter = threading.Thread(target=progress, daemon=True)
    for sample in make():
        if ttfs is None:
            ttfs, t_first = time.perf_counter() - p0, time.time()
            reporter.start()
        n += 1
        for k, v in sample.items():
            if not k.startswith("__"):
                nbytes += len(v)
        if n == limit:
            break
    elapsed = time.perf_counter() - p0
    t_end = time.time()
    done.set()
    if reporter.is_alive():
        reporter.join()
    cpu, agent_cpu = self_cpu() - cpu0, tree_cpu(agent_pid) - agent0
    mem = status_kb("self", "VmRSS", "VmHWM")
    report = {
        "epoch": epoch,
        "samples": n,
        "bytes": nbytes,
        "ttfs": ttfs,
        "elapsed": elapsed,
        "t_start": t_start,
        "t_first": t_first,
        "t_end": t_end,
        "cpu_s": cpu,
        "agent_cpu_s": agent_cpu if agent_pid else None,
        "rss_start_kb": rss0,
        "hwm_kb": mem["VmHWM"],
        "rss_end_kb": mem["VmRSS"],
        "rss_growth_kb": max(mem["VmHWM"] - rss0, 0),
    }
    emit({"progress": {"epoch": epoch, "samples": n, "bytes": nbytes, "elapsed": elapsed, "done": True}})
    return report


def final(epochs: list[dict[str, Any]], **extra: Any) -> None:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    emit(
        {
            "report": {
                "epochs": epochs,
                "hwm_kb": status_kb("self", "VmHWM")["VmHWM"],
                "children_maxrss_kb": kids.ru_maxrss,
                **extra,
            }
        }
    )


def read_urls(path: str) -> list[str]:
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


# -- the systems ---------------------------------------------------------------------------------


def mode_wds(args: argparse.Namespace) -> None:
    import webdataset as wds

    urls = read_urls(args.urls_file)
    holder: dict[str, Any] = {}

    def make() -> Iterable[dict[str, Any]]:
        # Built inside the first epoch's clock: constructing the pipeline is part of the first sample.
        if "ds" not in holder:
            kw: dict[str, Any] = {"shardshuffle": False}
            if args.cache_dir:
                kw["cache_dir"] = args.cache_dir
            holder["ds"] = wds.WebDataset(urls, **kw)
        return holder["ds"]

    final([run_epoch(e, make) for e in range(args.epochs)])


def _flushing_reader(original: Callable[..., None]) -> Callable[..., None]:
    """webdataset.multi.reader, then terminate the worker's ZeroMQ context.

    The worker exits through os._exit right after its target returns, so messages
    still queued in ZeroMQ (the last samples, the EOF marker) can be lost and the
    loader then waits forever. Context.term() blocks until they are sent.
    """

    def reader(*a: Any, **kw: Any) -> None:
        import zmq

        try:
            original(*a, **kw)
        finally:
            zmq.Context.instance().term()

    return reader


def mode_multi(args: argparse.Namespace) -> None:
    import webdataset as wds
    import webdataset.multi as multi

    if args.flush:
        multi.reader = _flushing_reader(multi.reader)  # looked up by MultiLoader.__iter__ at call time
    urls = read_urls(args.urls_file)
    prefix = os.path.join(args.sock_dir or "/tmp", f"_bench-multi-{os.getpid()}-")
    holder: dict[str, Any] = {}

    def make() -> Iterable[dict[str, Any]]:
        if "ml" not in holder:
            holder["ml"] = multi.MultiLoader(
                wds.WebDataset(urls, shardshuffle=False), workers=args.workers, prefix=prefix
            )
        return holder["ml"]

    final([run_epoch(e, make) for e in range(args.epochs)])


def mode_wdscache(args: argparse.Namespace) -> None:
    from wdscache import CachedMultiLoader

    if args.log:
        import logging

        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    if args.loader_workers:
        import torch.utils.data  # before the loader: CachedMultiLoader is then a torch IterableDataset

        class MadeBatches(torch.utils.data.IterableDataset):
            """No source at all: each DataLoader worker makes its part of ``n`` samples with fields
            of ``sizes`` bytes (each payload a copy, as a read makes one), in lists of
            TORCH_BATCH. What a DataLoader of this shape costs the machine by itself."""

            def __init__(self, n: int, sizes: list[int]) -> None:
                self.n, self.sizes = n, sizes

            def __iter__(self) -> Iterator[list[dict[str, Any]]]:
                info = torch.utils.data.get_worker_info()
                w, k = (info.id, info.num_workers) if info is not None else (0, 1)
                mine = range(w, self.n, k)
                blocks = [os.urandom(size * TORCH_BATCH) for size in self.sizes]
                for at in range(0, len(mine), TORCH_BATCH):
                    yield [
                        {
                            "__key__": f"{i:09d}",
                            **{
                                f"f{j}": b[size * m : size * (m + 1)]
                                for j, (b, size) in enumerate(zip(blocks, self.sizes))
                            },
                        }
                        for m, i in enumerate(mine[at : at + TORCH_BATCH])
                    ]

    class Unbatched:
        """A DataLoader's batches (lists of samples) as samples."""

        def __init__(self, batches: Iterable[list[dict[str, Any]]]) -> None:
            self.batches = batches

        def __iter__(self) -> Iterator[dict[str, Any]]:
            for batch in self.batches:
                yield from batch

    def build(job: str, shuffle: bool) -> Iterable[dict[str, Any]]:
        # Through a DataLoader, batches of TORCH_BATCH samples (one pickled message each, as a
        # training script's), left as lists: what crosses the DataLoader's queues, not a collate.
        if args.made:
            return Unbatched(
                torch.utils.data.DataLoader(
                    MadeBatches(args.made_samples, [int(x) for x in args.made.split(",")]),
                    batch_size=None,
                    num_workers=args.loader_workers,
                )
            )
        batched: dict[str, Any] = {"batch_size": TORCH_BATCH, "collate": list} if args.loader_workers else {}
        loader = CachedMultiLoader(
            cache_dir=args.cache_dir,
            job=job,
            rank=args.rank,
            world_size=args.world_size,
            node=args.node,
            num_nodes=args.num_nodes,
            shuffle=shuffle,
            timeout=args.timeout,
            direct_reads=not args.no_direct,
            **batched,
        )
        if not args.loader_workers:
            return loader
        # Each DataLoader worker reads its part of the rank's share.
        return Unbatched(torch.utils.data.DataLoader(loader, batch_size=None, num_workers=args.loader_workers))

    if args.warmup:
        # A process in its first epoch pays for every page of heap it grows, and on a VM the
        # first touch of memory the host took back costs far more than zeroing it (see the
        # README). The single consumer's warm epoch follows its cold one in the same process;
        # ranks started for one epoch read a few requests first, as a job of its own, to match.
        warm = iter(build(f"{args.job}-warmup", False))
        try:
            for _, _ in zip(range(args.warmup), warm):
                pass
        finally:
            if hasattr(warm, "close"):
                warm.close()
            del warm  # a DataLoader's workers end with their iterator
    if args.start_file:
        # Several consumers start together once every one has imported and warmed up, however
        # long that took on a loaded machine: each says it is ready, then waits for the word.
        Path(f"{args.start_file}.{os.getpid()}.ready").touch()
        wait_for_file(args.start_file)
    if args.start_at:
        # Several ranks start together, once all have imported: wait for the shared start time.
        time.sleep(max(0.0, args.start_at - time.time()))
    holder: dict[str, Any] = {}

    def loader(shuffle: bool) -> Callable[[], Iterable[dict[str, Any]]]:
        def make() -> Iterable[dict[str, Any]]:
            if shuffle not in holder:
                holder[shuffle] = build(args.job, shuffle)
            return holder[shuffle]

        return make

    final(
        [
            run_epoch(e, loader(e >= args.epochs), agent_pid=args.agent_pid, limit=args.max_samples)
            for e in range(args.epochs + args.shuffled_epochs)
        ]
    )
    if args.start_file:
        # In training a rank's process outlives its epoch: held until every consumer started
        # with it has ended its epoch, so that no process's exit (its interpreter's teardown,
        # some 20-30 ms of CPU) falls in the others' timed window.
        Path(f"{args.start_file}.{os.getpid()}.done").touch()
        wait_for_file(f"{args.start_file}.end", every=0.1)  # seldom: the others' window is still open


def wait_for_file(path: str, seconds: float = 600.0, every: float = 0.005) -> None:
    """Wait until ``path`` exists (the bench's word to the consumers it started together),
    looking ``every`` seconds."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {seconds:.0f} s")
        time.sleep(every)


def mode_mix(args: argparse.Namespace) -> None:
    """One source against a mixture of two of the same total size: a cold epoch of the one source
    (warming the cache), then ``--pairs`` warm epochs of each, in turns (one, mix, mix, one, ...). Both shuffle (a
    mixture always interleaves its sources at random); the mixture's weights are the sources'
    sizes, its epoch the one source's length."""
    from wdscache import CachedMultiLoader

    lists = args.mix.split(",")
    sizes = [len(read_urls(path)) for path in lists]
    common = {"cache_dir": args.cache_dir, "timeout": args.timeout}
    one = CachedMultiLoader(args.urls_file, job="one", **common)
    mix = CachedMultiLoader(mix=dict(zip(lists, sizes)), epoch_samples=args.epoch_samples, job="mix", **common)
    cold = run_epoch(0, lambda: one, agent_pid=args.agent_pid)
    ones, mixes = [], []
    for k in range(args.pairs):  # one, mix, mix, one, ...: neither always goes first
        for loader, out in ((one, ones), (mix, mixes))[:: 1 if k % 2 == 0 else -1]:
            out.append(run_epoch(1 + len(ones) + len(mixes), lambda loader=loader: loader, agent_pid=args.agent_pid))
    final([cold, *ones, *mixes])  # the one source's warm epochs, then the mixture's


def mode_random(args: argparse.Namespace) -> None:
    """``ds[i]`` for a seeded random permutation of every index, each epoch another, over
    ``wids.ShardListDataset`` (its own download folder) or ``wdscache.ShardListDataset`` (the
    agent's cache); both raw (``transformations=[]``), every payload touched."""
    import io
    import random

    holder: dict[str, Any] = {}

    def make(epoch: int) -> Callable[[], Iterable[dict[str, Any]]]:
        def samples() -> Iterable[dict[str, Any]]:
            if "ds" not in holder:  # built inside the first epoch's clock, as the other systems are
                if args.system == "wids":
                    import wids

                    holder["ds"] = wids.ShardListDataset(args.index, cache_dir=args.cache_dir, transformations=[])
                else:
                    from wdscache import ShardListDataset

                    holder["ds"] = ShardListDataset(
                        args.index, cache_dir=args.cache_dir, transformations=[], timeout=args.timeout
                    )
            ds = holder["ds"]
            order = list(range(len(ds)))
            random.Random(epoch).shuffle(order)
            for i in order:
                sample = ds[i]
                yield {k: v.getbuffer() if isinstance(v, io.BytesIO) else v for k, v in sample.items()}

        return samples

    final([run_epoch(e, make(e), agent_pid=args.agent_pid, limit=args.max_samples) for e in range(args.epochs)])


TORCH_BATCH = 64


def mode_torch(args: argparse.Namespace) -> None:
    """The pipeline training scripts have, in a DataLoader with ``--workers`` workers: webdataset's
    (``--urls-file``: local paths or http URLs) or wdscache's (``--cache-dir``: the agent's list)."""
    import torch.utils.data
    import webdataset as wds

    holder: dict[str, Any] = {}

    class Held(torch.utils.data.IterableDataset):
        """Each worker's shards (webdataset splits them by worker), read in its first epoch and
        held in its own memory: later epochs (persistent workers) cost the pipeline alone."""

        def __init__(self, urls: list[str]) -> None:
            self.urls, self.held = urls, None

        def __iter__(self) -> Iterable[dict[str, Any]]:
            if self.held is None:
                self.held = list(wds.WebDataset(self.urls, shardshuffle=False))
            return iter(self.held)

    class Pread(torch.utils.data.IterableDataset):
        """Each worker's shards (the same split), their members' offsets found in its first epoch
        (with tarfile); each epoch then reads each small sample with one pread and slices its payloads
        into new bytes (a large one's payloads a pread each), as a source with its offsets known costs
        at the least: the limit of any reader of the page cache."""

        def __init__(self, paths: list[str]) -> None:
            self.paths, self.tables = paths, None

        def __iter__(self) -> Iterable[dict[str, Any]]:
            info = torch.utils.data.get_worker_info()
            mine = self.paths[info.id :: info.num_workers] if info is not None else self.paths
            if self.tables is None:
                self.tables = [(path, _member_table(path)) for path in mine]
            for path, table in self.tables:
                fd = os.open(path, os.O_RDONLY)
                try:
                    for key, fields in table:
                        sample: dict[str, Any] = {"__key__": key, "__url__": path}
                        start = fields[0][1]
                        span = fields[-1][1] + fields[-1][2] - start
                        if span <= SAMPLE_PREAD:  # one read a small sample, sliced (a syscall costs more)
                            data = os.pread(fd, span, start)
                            for ext, offset, size in fields:
                                sample[ext] = data[offset - start : offset - start + size]
                        else:
                            for ext, offset, size in fields:
                                sample[ext] = os.pread(fd, size, offset)
                        yield sample
                finally:
                    os.close(fd)

    def samples() -> Iterable[dict[str, Any]]:
        if "dl" not in holder:
            if args.memory or args.pread:
                source = Held(read_urls(args.urls_file)) if args.memory else Pread(read_urls(args.urls_file))
                ds = type("Pipeline", (wds.DataPipeline, wds.FluidInterface), {})(source)
            elif args.cache_dir:
                import wdscache

                ds = wdscache.WebDataset(
                    cache_dir=args.cache_dir, job=args.job, shardshuffle=False, timeout=args.timeout
                )
            else:
                ds = wds.WebDataset(read_urls(args.urls_file), shardshuffle=False)
            ds = ds.decode().to_tuple("jpg", "cls", "json").batched(TORCH_BATCH)
            holder["dl"] = torch.utils.data.DataLoader(
                ds,
                batch_size=None,
                num_workers=args.workers,
                persistent_workers=args.memory or args.pread or args.persistent,
            )
        for jpgs, _, _ in holder["dl"]:
            for jpg in jpgs:  # run_epoch counts samples and payload bytes: the images'
                yield {"jpg": jpg}

    final([run_epoch(e, samples, agent_pid=args.agent_pid) for e in range(args.epochs)])


SAMPLE_PREAD = 64 << 10  # a sample spanning at most this is read with one pread, its payloads sliced


def _member_table(path: str) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """A tar's samples as webdataset groups them (key: the name to its basename's first dot),
    each with its fields: extension, offset of the data, size."""
    import tarfile

    table: list[tuple[str, list[tuple[str, int, int]]]] = []
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, _, base = member.name.rpartition("/")
            stem, dot, ext = base.partition(".")
            if not dot:
                continue
            key = f"{folder}/{stem}" if folder else stem
            if not table or table[-1][0] != key:
                table.append((key, []))
            table[-1][1].append((ext, member.offset_data, member.size))
    return table


def mode_zmq(args: argparse.Namespace) -> None:
    """One message per sample, frames sized like the profile's fields, PUSH -> PULL over IPC."""
    import zmq

    sizes = [int(s) for s in args.sizes.split(",")]
    endpoint = f"ipc://{args.sock_dir or '/tmp'}/_bench-zmq-{os.getpid()}.sock"
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    pid = os.fork()  # before any ZeroMQ context exists in this process
    if pid == 0:
        code = 1
        try:
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(endpoint)
            frames = [os.urandom(s) for s in sizes]
            for _ in range(args.samples):
                push.send_multipart(frames, copy=False)
            push.send(b"")
            push.close()
            ctx.term()  # flushes
            code = 0
        finally:
            os._exit(code)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)

    def make() -> Iterable[dict[str, Any]]:
        while True:
            frames = pull.recv_multipart(copy=False)
            if len(frames) == 1 and len(frames[0]) == 0:
                return
            yield {str(i): f for i, f in enumerate(frames)}  # len(Frame) is its size: no copy

    epoch = run_epoch(0, make)
    os.waitpid(pid, 0)
    pull.close(0)
    ctx.term()
    Path(endpoint[len("ipc://") :]).unlink(missing_ok=True)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The receiver's CPU during the epoch plus all of the sender's (reaped only now).
    epoch["cpu_s"] += (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    final([epoch])


def mode_zmq_many(args: argparse.Namespace) -> None:
    """The machine's limit for many consumers: ``--senders`` processes send ``--samples``
    samples (frames sized like the profile's fields, copy=False; ``--per-message`` samples
    to a message, as a worker's reply holds a request's) over IPC, each to every one of
    ``--receivers`` processes, which copy each frame into ``bytes`` as the loader does.
    No wdscache code at all: what the 8-consumer row costs the machine itself."""
    n, senders = args.receivers, args.senders
    sizes = [int(x) for x in args.sizes.split(",")]
    base = f"{args.sock_dir or '/tmp'}/_bench-zmqm-{os.getpid()}"
    # share[i][j]: messages sender i sends to receiver j (every receiver gets its share of the total)
    k = args.per_message
    messages, rest = divmod(args.samples, k)  # the rest: one short message, sender 0 to receiver 0
    per = [messages // n + (j < messages % n) for j in range(n)]
    share = [[per[j] // senders + (i < per[j] % senders) for j in range(n)] for i in range(senders)]
    start_at = time.time() + 1.0  # all bound and connected by then
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    pids, pipes = [], []
    for j in range(n):  # forked before this process has any ZeroMQ context
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            code = 1
            try:
                import zmq

                ctx = zmq.Context()
                pull = ctx.socket(zmq.PULL)
                pull.bind(f"ipc://{base}-{j}.sock")
                nbytes = count = ends = 0
                t_first = None
                cpu0 = time.process_time()
                while ends < senders:
                    if not pull.poll(120_000):
                        raise TimeoutError("no message for 120 s")
                    frames = pull.recv_multipart(copy=False)
                    if len(frames) == 1 and len(frames[0]) == 0:
                        ends += 1
                        continue
                    if t_first is None:
                        t_first = time.time()
                    count += len(frames) // len(sizes)
                    nbytes += sum(len(f.buffer.tobytes()) for f in frames)
                os.write(
                    wfd,
                    json.dumps(
                        {
                            "samples": count,
                            "bytes": nbytes,
                            "t_first": t_first,
                            "t_end": time.time(),
                            "cpu_s": time.process_time() - cpu0,
                        }
                    ).encode(),
                )
                pull.close(0)
                ctx.term()
                code = 0
            finally:
                os._exit(code)
        os.close(wfd)
        pids.append(pid)
        pipes.append(rfd)
    for i in range(senders):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                import zmq

                ctx = zmq.Context()
                pushes = []
                for j in range(n):
                    sock = ctx.socket(zmq.PUSH)
                    # A receiver that died must not hold a sender (and so this run) for ever.
                    sock.setsockopt(zmq.SNDTIMEO, 120_000)
                    sock.setsockopt(zmq.LINGER, 120_000)
                    sock.connect(f"ipc://{base}-{j}.sock")
                    pushes.append(sock)
                frames = [os.urandom(x) for x in sizes] * k
                time.sleep(max(0.0, start_at - time.time()))
                left = list(share[i])
                while any(left):  # round robin over the receivers, as workers serve consumers
                    for j, sock in enumerate(pushes):
                        if left[j]:
                            sock.send_multipart(frames, copy=False)
                            left[j] -= 1
                if i == 0 and rest:
                    pushes[0].send_multipart(frames[: rest * len(sizes)], copy=False)
                for sock in pushes:
                    sock.send(b"")
                    sock.close()
                ctx.term()  # flushes
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    reports = []
    try:
        for fd in pipes:
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
            reports.append(json.loads(raw) if raw else None)
    finally:
        for pid in pids:
            os.waitpid(pid, 0)
        for j in range(n):
            Path(f"{base}-{j}.sock").unlink(missing_ok=True)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # A receiver whose share is no message at all (fewer messages than receivers) has no first.
    idle = [j for j, r in enumerate(reports) if r is not None and r["t_first"] is None and per[j] > 0]
    if any(r is None for r in reports) or idle:
        raise SystemExit(
            f"{sum(r is None for r in reports)} receiver(s) failed, {len(idle)} got none of their messages"
        )
    t0 = min(r["t_first"] for r in reports if r["t_first"] is not None)
    epoch = {
        "epoch": 0,
        "samples": sum(r["samples"] for r in reports),
        "bytes": sum(r["bytes"] for r in reports),
        "ttfs": None,
        "elapsed": max(r["t_end"] for r in reports) - t0,
        # every process's CPU: the senders' and the receivers' (reaped above)
        "cpu_s": (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime),
        "receiver_cpu_s": sum(r["cpu_s"] for r in reports),
        "hwm_kb": 0,
        "rss_growth_kb": 0,
    }
    final([epoch])


def mode_urls(args: argparse.Namespace) -> None:
    """Parse an N-entry URL list and plan an epoch the way the agent and a loader do."""
    from wdscache.shared.plan import Reader, shard_order
    from wdscache.shared.sequence import EpochSpec, global_sequence
    from wdscache.shared.urls import read_url_list

    path = Path(args.dir) / f"urls-{args.n}.txt"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for i in range(args.n):
                f.write(f"http://data.example/train/part-{i // 10000:03d}/shard-{i:07d}.tar\n")
        os.replace(tmp, path)
    times: dict[str, float] = {}
    t = time.perf_counter()
    urls = read_url_list(path)
    times["parse"] = time.perf_counter() - t
    t = time.perf_counter()
    assert urls.urls[-1] in urls  # membership builds the position map the agent uses
    times["positions"] = time.perf_counter() - t
    t = time.perf_counter()
    n = len(urls)
    order = shard_order(n, seed=0, epoch=0, shuffle=True)
    nxt = shard_order(n, seed=0, epoch=1, shuffle=True)
    pos = {s: i for i, s in enumerate(order)}  # CachedMultiLoader keeps this map
    times["shard_order"] = time.perf_counter() - t
    t = time.perf_counter()
    window = Reader("bench", n, seed=0, shuffle=True).window(8)
    seq = global_sequence(EpochSpec(n, 0, 0, True, 1000), lambda s: range(100))
    first = [next(seq) for _ in range(10_000)]
    times["first_10k_samples"] = time.perf_counter() - t
    total = sum(times.values())
    assert len(order) == len(nxt) == len(pos) == n and window and first
    emit({"report": {"n": n, "seconds": total, "parts": times}})


def mode_stats_index(args: argparse.Namespace) -> None:
    """Write an N-record index in one transaction, as tests/test_agent.py does for its stats test."""
    from wdscache.shared.index import _SHARD, Index, ShardRecord, ShardState
    from wdscache.shared.layout import CacheLayout

    cache = Path(args.cache_dir)
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    index = Index(CacheLayout.of(cache).index_dir)
    try:
        rec = None
        with index._db.transact():
            for i in range(args.n):
                rec = ShardRecord(
                    f"http://127.0.0.1:9/big/shard-{i:06d}.tar", ShardState.CACHED, size=1000 + i % 7, cached_at=1.0
                )
                index._db.set(_SHARD + rec.url, rec.to_json())
                index.summary.apply(None, rec)
                index.records[rec.url] = rec
            if rec is not None:
                index.put(rec)  # persists the summary like any change does
        index.set_meta({"bytes_limit": 1 << 30})
    finally:
        index.close()


def mode_serve(args: argparse.Namespace) -> None:
    import signal

    from shard_server import ShardServer  # a sibling: this folder is first on sys.path

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def write(path: Path, text: str) -> None:
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    with ShardServer(args.root, rate=args.rate or None, ttfb=args.ttfb) as server:
        write(Path(args.port_file), str(server.port))
        while not stop.wait(0.1):
            if args.counters:
                # What clients fetched so far, for the bench to compare with the dataset size.
                reqs = server.requests
                write(
                    Path(args.counters),
                    json.dumps(
                        {
                            "gets": sum(1 for r in reqs if r.method == "GET"),
                            "heads": sum(1 for r in reqs if r.method == "HEAD"),
                            "bytes": sum(r.bytes_sent for r in reqs if r.method == "GET"),
                        }
                    ),
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("serve")
    p.add_argument("root")
    p.add_argument("--port-file", required=True)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--ttfb", type=float, default=0.0)
    p.add_argument("--counters", help="file the request counters are written to, every 0.1 s")
    p = sub.add_parser("wds")
    p.add_argument("--urls-file", required=True)
    p.add_argument("--cache-dir")
    p.add_argument("--epochs", type=int, default=1)
    p = sub.add_parser("multi")
    p.add_argument("--urls-file", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--flush", action="store_true")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--sock-dir")
    p = sub.add_parser("wdscache")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--job", default="bench")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--node", type=int, default=0)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--agent-pid", type=int)
    p.add_argument("--start-at", type=float, default=0.0)
    p.add_argument("--log", action="store_true", help="wdscache's log on stderr")
    p.add_argument("--max-samples", type=int, default=0, help="stop each epoch after this many samples")
    p.add_argument(
        "--shuffled-epochs",
        type=int,
        default=0,
        help="after --epochs, this many more with a shuffling loader (its own job)",
    )
    p.add_argument("--no-direct", action="store_true", help="direct_reads=False: the workers send every byte")
    p.add_argument(
        "--warmup", type=int, default=0, help="samples to read first, before --start-at, as a job of its own"
    )
    p.add_argument(
        "--start-file", help="after the warm-up, touch START_FILE.PID.ready and wait for START_FILE to exist"
    )
    p.add_argument(
        "--loader-workers",
        type=int,
        default=0,
        help="read through torch's DataLoader(num_workers=N), each worker a part of the rank's share",
    )
    p.add_argument(
        "--made",
        help="SIZES (comma-separated bytes): with --loader-workers, read nothing; the DataLoader's "
        "workers make --made-samples samples with fields of these sizes (the DataLoader's own cost)",
    )
    p.add_argument("--made-samples", type=int, default=0)
    p = sub.add_parser("mix")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--urls-file", required=True, help="the one source")
    p.add_argument("--mix", required=True, help="the two sources' list files, comma-separated")
    p.add_argument("--epoch-samples", type=int, required=True)
    p.add_argument("--pairs", type=int, default=2, help="warm epochs of each")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--agent-pid", type=int)
    p = sub.add_parser("torch")
    p.add_argument("--urls-file")
    p.add_argument("--cache-dir")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--job", default="bench-torch")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--agent-pid", type=int)
    p.add_argument(
        "--persistent",
        action="store_true",
        help="persistent_workers=True (--memory implies it): epoch 2 on costs no worker start",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="each worker's --urls-file shards read into its memory in epoch 1, served from it after",
    )
    p.add_argument(
        "--pread",
        action="store_true",
        help="each worker's --urls-file shards indexed in epoch 1, each payload pread from the page cache after",
    )
    p = sub.add_parser("random")
    p.add_argument("--system", choices=("wids", "wdscache"), required=True)
    p.add_argument("--index", required=True, help="the shard index (wids JSON)")
    p.add_argument("--cache-dir", required=True, help="wids' download folder, or the agent's cache directory")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--agent-pid", type=int)
    p.add_argument("--max-samples", type=int, default=0, help="stop each epoch after this many samples")
    p = sub.add_parser("zmq")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--sock-dir")
    p = sub.add_parser("zmq-many")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--receivers", type=int, required=True)
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--per-message", type=int, default=1)
    p.add_argument("--sock-dir")
    p = sub.add_parser("urls")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--dir", required=True)
    p = sub.add_parser("stats-index")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()
    {
        "serve": mode_serve,
        "wds": mode_wds,
        "multi": mode_multi,
        "wdscache": mode_wdscache,
        "torch": mode_torch,
        "zmq": mode_zmq,
        "zmq-many": mode_zmq_many,
        "urls": mode_urls,
        "stats-index": mode_stats_index,
        "mix": mode_mix,
        "random": mode_random,
    }[args.mode](args)


if __name__ == "__main__":
    main()
