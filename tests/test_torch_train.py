"""A real ``torchrun --nproc-per-node 2`` job: scripts/train_example.py trains
a tiny model in DistributedDataParallel over gloo on the CPU, fed by wdscache.WebDataset in a
StatefulDataLoader with 2 workers per rank; it is killed (SIGKILL, the whole job) inside its
second epoch and restarted from its checkpoint on 1 rank with 1 worker, and each epoch still sees every sample once,
with the same number of steps on both ranks while there were two."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.procs import alive, children_of
from tests.helpers.waits import json_lines, wait_for

pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed (scripts/test.sh installs it)")

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
SHARDS, PER_SHARD = 6, 10  # 60 samples: 30 per rank, no padding


def _steps(log: Path) -> list[dict[str, Any]]:
    try:
        return json_lines(log.read_text())
    except FileNotFoundError:
        return []


def _kill_job(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun and every process under it: its ranks run in sessions of their own, so
    a signal to its process group would not reach them (nor their DataLoader workers)."""
    tree: dict[int, str] = {}
    todo = [proc.pid]
    while todo:
        kids = children_of(todo.pop())
        tree.update(kids)
        todo.extend(kids)
    for pid in [proc.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)
    wait_for(
        lambda: not any(alive(pid, start) for pid, start in tree.items()),
        30,
        lambda: f"processes of the killed job still run: {[p for p, t in tree.items() if alive(p, t)]}",
    )


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder for the jobs' temporary files (torchrun's log folders, multiprocessing's sockets,
    which a killed job leaves): short, as a socket's path must be (the test's folder is too long)."""
    folder = Path(tempfile.mkdtemp(prefix="wdscache-torchrun-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _torchrun(
    tmp: Path, cache: Path, name: str, *extra: str, ranks: int = 2, temp: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp / f"{name}.log"
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(ROOT / "scripts" / "train_example.py"),
        "--cache-dir",
        str(cache),
        "--epochs",
        "2",
        "--num-workers",
        "2",
        "--batch-size",
        "4",
        "--checkpoint",
        str(tmp / "ckpt.pt"),
        "--seen-log",
        str(tmp / "seen"),
        *extra,
    ]
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "TMPDIR": str(temp)},
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
    return proc, out


@pytest.mark.slow
def test_torchrun_job_killed_and_restarted_sees_every_sample_once_per_epoch(
    dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path, short_tmp: Path
) -> None:
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun beside {sys.executable}")
    urls, _, list_file = dataset(SHARDS, samples=PER_SHARD, payload=200)
    cache = tmp_path / "cache"
    start_agent(cache, list_file, "--workers", "2")
    seen = tmp_path / "seen"
    proc, out = _torchrun(tmp_path, cache, "first", "--step-sleep", "0.3", temp=short_tmp)
    try:
        # Inside epoch 1 (epoch 0 takes 8 steps a rank), once a checkpoint of it was written.
        wait_for(
            lambda: len([s for s in _steps(seen / "rank-0.jsonl") if s.get("epoch") == 1]) >= 3,
            120,
            lambda: f"the job never reached epoch 1:\n{out.read_text()[-3000:]}",
            interval=0.05,
        )
    finally:
        _kill_job(proc)
    assert "epoch 1:" not in out.read_text()  # killed inside epoch 1
    # The restart runs rank 0 alone, which drops the steps of its own log past the checkpoint's; rank
    # 1's log may hold one more (it logs a step before rank 0's save of the one before is done).
    import torch

    saved_step = torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"]
    # Resumed on one rank (the model saved without DDP's wrapper loads there) with another num_workers.
    proc, out = _torchrun(tmp_path, cache, "second", "--num-workers", "1", ranks=1, temp=short_tmp)
    try:
        assert proc.wait(180) == 0, out.read_text()[-4000:]
    finally:
        _kill_job(proc)
    per_epoch: dict[int, Counter[str]] = defaultdict(Counter)
    steps: dict[tuple[int, int], int] = Counter()
    for rank in (0, 1):
        for line in _steps(seen / f"rank-{rank}.jsonl"):
            if "ids" in line and (rank == 0 or line["step"] <= saved_step):
                per_epoch[line["epoch"]].update(line["ids"])
                steps[(rank, line["epoch"])] += 1
    for epoch in (0, 1):
        assert len(per_epoch[epoch]) == SHARDS * PER_SHARD and set(per_epoch[epoch].values()) == {1}, epoch
    assert steps[(0, 0)] == steps[(1, 0)] == 8  # 2 workers: 16 + 14 samples of the rank, in batches of 4
    assert {key.split("#")[0] for key in per_epoch[0]} == set(urls)
