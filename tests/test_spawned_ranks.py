"""Ranks whose script starts torch.distributed's process group itself (``torch.multiprocessing.spawn``
scripts: ``init_process_group(rank=r, world_size=n)``, no launcher's variable): real rank
processes in a gloo group on loopback, a real agent over the loopback shard server. A loader
made after the group takes its ranks from it; one made before refuses to read rather than
give every rank the whole dataset."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.net import free_port_range
from tests.helpers.procs import json_outputs, kill_left
from wdscache import CachedMultiLoader

SHARDS, PER_SHARD = 6, 10
# What a launcher sets: none of it reaches these ranks, as none reaches a spawned script's.
LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def spawned_ranks(cache: Path, world: int) -> list[dict[str, Any]]:
    """``world`` rank processes (tests/helpers/spawned_rank.py) started here, no launcher; what each printed."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHERS and not k.startswith(("SLURM_", "TORCHELASTIC_", "WDSCACHE_"))
    }
    port = free_port_range(1)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.spawned_rank", str(cache), str(rank), str(world), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
        for rank in range(world)
    ]
    try:
        return json_outputs(procs, 150)
    finally:
        kill_left(procs)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_ranks_of_a_group_the_script_initialised_split_the_data_and_an_earlier_loader_refuses(
    dataset, start_agent, tmp_path: Path
) -> None:
    data = dataset(SHARDS, samples=PER_SHARD, payload=200)
    start_agent(tmp_path / "cache", data.list_file, "--workers", "2")
    whole = [f"{s['__url__']}#{s['__key__']}" for s in CachedMultiLoader(cache_dir=tmp_path / "cache", world_size=1)]
    every = sorted(whole)
    assert len(set(every)) == len(every) == SHARDS * PER_SHARD
    outs = spawned_ranks(tmp_path / "cache", 2)

    assert [out["layout"] for out in outs] == [[0, 2], [1, 2]]
    for read in ("loader", "dataloader", "wds"):
        shares = [out[read] for out in outs]
        assert [len(s) for s in shares] == [len(every) // 2] * 2, read
        assert not set(shares[0]) & set(shares[1]), read
        assert sorted(shares[0] + shares[1]) == every, read
    assert [sorted(out["whole"].get("ids", [])) for out in outs] == [every, every], [o["whole"] for o in outs]
    for rank, out in enumerate(outs):
        for how, got in out["early"].items():  # alone, in a wdscache.WebDataset, in a forked or spawned worker
            assert got.get("error") == "ConfigError", (rank, how, got)
            message = got["message"]
            assert "made before torch.distributed.init_process_group" in message, (how, message)
            assert f"the process group now has 2 ranks (this is rank {rank})" in message, (how, message)
            assert "pass rank= and world_size=" in message, (how, message)
