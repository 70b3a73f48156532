"""Soak: several jobs for several epochs through faults, agent kills and a worker kill.

Run by scripts/soak.sh (kept out of the default suite). Bounded to a few minutes.
Prints its figures: samples checked, faults injected, restarts survived, peak memory.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter

from tests.helpers.procs import children_of, rss_kib, worker_pids
from tests.helpers.streaming import Consumer, reference, samples_of
from tests.helpers.waits import wait_for

SEED = int(os.environ.get("WDSCACHE_SOAK_SEED", "1234"))
EPOCHS = int(os.environ.get("WDSCACHE_SOAK_EPOCHS", "10"))
JOBS, RANKS = 3, 2
FAULTS_PER_EPOCH = 6


def rss_mb(pids: list[int]) -> float:
    return sum(rss_kib(p) for p in pids) / 1024


def inject(server, names: list[str], rng: random.Random) -> int:
    kinds = ["503", "cut", "short", "stall"]
    for _ in range(FAULTS_PER_EPOCH):
        name, kind = rng.choice(names), rng.choice(kinds)
        if kind == "503":
            server.fail(name, "status", status=503, retry_after=0)
        elif kind == "stall":
            server.fail(name, "stall", seconds=2.0, after=rng.randrange(1, 20000))
        else:
            server.fail(name, kind, after=rng.randrange(1, 20000))
    return FAULTS_PER_EPOCH


def test_soak(tmp_path, shard_server, dataset, start_agent):
    rng = random.Random(SEED)
    data = dataset(12, samples=20, payload=5000)
    names = [p.name for p in data.paths]
    shard_size = max(p.stat().st_size for p in data.paths)
    ref = reference(data.paths, data.urls)
    cache = tmp_path / "cache"
    args = (
        "--workers",
        "2",
        "--prefetch",
        "3",
        "--read-timeout",
        "1",
        "--reader-timeout",
        "5",
        "--cache-size",
        str(8 * shard_size),
    )
    agent = start_agent(cache, data.list_file, *args)
    figures = Counter()
    memory: list[float] = []
    for epoch in range(EPOCHS):
        figures["faults injected"] += inject(shard_server, names, rng)
        runs = {
            (job, rank): Consumer(
                tmp_path,
                cache,
                f"e{epoch}j{job}r{rank}",
                "--job",
                f"job{job}",
                "--rank",
                str(rank),
                "--world-size",
                str(RANKS),
                "--epoch",
                str(epoch),
                "--seed",
                str(job),
                "--timeout",
                "60",
            )
            for job in range(JOBS)
            for rank in range(RANKS)
        }
        if epoch == 2:
            # Kill one worker mid-epoch: its requests go to its replacement.
            wait_for(
                lambda runs=runs: any(r.out.exists() and r.out.stat().st_size > 0 for r in runs.values()),
                60,
                "no consumer started reading",
            )
            os.kill(worker_pids(agent.pid)[0], signal.SIGKILL)
            figures["workers killed"] += 1
        results = {k: samples_of(r.wait(timeout=240)) for k, r in runs.items()}
        for job in range(JOBS):
            per_rank = [results[(job, r)] for r in range(RANKS)]
            assert len({len(p) for p in per_rank}) == 1, f"epoch {epoch} job {job}: unequal counts"
            got = Counter((s["url"], s["key"]) for p in per_rank for s in p)
            assert set(got) == set(ref), f"epoch {epoch} job {job}: wrong sample set"
            assert sum(got.values()) - len(ref) < RANKS, f"epoch {epoch} job {job}: too many repeats"
            for p in per_rank:
                for s in p:
                    assert s["fields"] == ref[(s["url"], s["key"])], f"payload differs: {s['url']} {s['key']}"
                    figures["samples checked"] += 1
        memory.append(rss_mb([agent.pid, *children_of(agent.pid)]))
        if epoch in (0, 1):
            # SIGKILL the agent between epochs and start a new one on the same cache.
            agent.stop(signal.SIGKILL)
            agent = start_agent(cache, data.list_file, *args)
            figures["agent restarts survived"] += 1
    figures["peak agent memory (MB)"] = round(max(memory))
    print("\nsoak figures:", dict(figures), "agent RSS per epoch (MB):", [round(m, 1) for m in memory])
    # Flat: no growth across epochs beyond noise (the first epochs after a restart set the level).
    assert memory[-1] - min(memory) < 30, f"agent memory grew: {memory}"
