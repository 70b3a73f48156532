"""A loader's rank, world size and node: given, or from the launcher's environment (torchrun's,
Slurm's), or from torch.distributed's process group when the script initialised it itself
(``torch.multiprocessing.spawn``); checked, and kept with where the world size came from, so
that a loader made before its job's process group refuses to read as the one rank of a job
of several (:func:`check_world`). The environment is read here and in
:func:`wdscache.training.loader._env_places` only.
"""

from __future__ import annotations

import enum
import operator
import os
import sys
from collections.abc import Callable, Collection
from typing import Any

from ..shared.errors import ConfigError
from ..shared.nodes import RankPlacement


class RankSource(enum.Enum):
    """Where a loader's ``world_size`` came from (a loader made before its job's process group
    has the default, and must not read the whole dataset on every rank: see
    :func:`check_world`)."""

    ARGUMENT = "argument"  # world_size= given
    ENVIRONMENT = "environment"  # WORLD_SIZE (torchrun) or SLURM_NTASKS (srun)
    GROUP = "process group"  # torch.distributed's default group, initialised by the script
    DEFAULT = "default"  # none of them: 1


def group_ranks() -> tuple[int, int] | None:
    """This process's rank and world size in torch.distributed's default process group, when
    this process imported torch.distributed and the group is initialised (a script that calls
    ``init_process_group(rank=..., world_size=...)`` itself, as under ``torch.multiprocessing.spawn``,
    sets no launcher's variable); else None. torch is never imported here: a process without
    it does not pay for it. A DataLoader worker forked from a rank sees the rank's group too
    (reading its rank and size uses no collective)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def env_ranks(wanted: Collection[str]) -> tuple[dict[str, int], RankSource]:
    """The defaults a training launcher provides of ``wanted`` (of rank, world_size, node,
    num_nodes), and where world_size's came from: torchrun sets RANK, WORLD_SIZE, GROUP_RANK,
    LOCAL_WORLD_SIZE; Slurm sets SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID, SLURM_NNODES.
    torchrun's win where both are set: it runs inside a Slurm step. Without either, rank and
    world_size are torch.distributed's default process group's when the script initialised it
    (:func:`group_ranks`), else 0 and 1. A variable read that is no whole number (or a
    LOCAL_WORLD_SIZE below 1) is a ConfigError naming it; one for a value given is not read."""
    env = os.environ
    # Slurm's only in a task of a step (srun sets SLURM_STEP_ID): a batch script is one process,
    # although it sees the job's SLURM_NTASKS and SLURM_PROCID=0.
    slurm = bool(env.get("SLURM_STEP_ID"))

    def whole(name: str, slurm_name: str | None, least: int = 0) -> int | None:
        for var in (name, slurm_name if slurm else None):
            if var and env.get(var):
                try:
                    value = int(env[var])
                except ValueError:
                    value = least - 1
                if value < least:
                    raise ConfigError(
                        f"the environment's {var}={env[var]!r} is no whole number of at least {least}: "
                        "check what the launcher sets, or pass the value to the loader"
                    )
                return value
        return None

    def or_default(value: int | None, default: int) -> int:
        return default if value is None else value

    def num_nodes() -> int:
        if env.get("LOCAL_WORLD_SIZE"):  # torchrun: nodes of LOCAL_WORLD_SIZE ranks
            ranks = or_default(whole("WORLD_SIZE", "SLURM_NTASKS", least=1), 1)
            return max(1, ranks // or_default(whole("LOCAL_WORLD_SIZE", None, least=1), 1))
        return or_default(whole("SLURM_NNODES", None, least=1), 1) if slurm else 1

    group = group_ranks() if {"rank", "world_size"} & set(wanted) else None
    world = whole("WORLD_SIZE", "SLURM_NTASKS", least=1) if "world_size" in wanted else None
    read: dict[str, Callable[[], int]] = {
        "rank": lambda: or_default(whole("RANK", "SLURM_PROCID"), group[0] if group else 0),
        "world_size": lambda: or_default(world, group[1] if group else 1),
        "node": lambda: or_default(whole("GROUP_RANK", "SLURM_NODEID"), 0),
        "num_nodes": num_nodes,
    }
    if "world_size" not in wanted:
        source = RankSource.ARGUMENT
    elif world is not None:
        source = RankSource.ENVIRONMENT
    else:
        source = RankSource.GROUP if group else RankSource.DEFAULT
    return {name: read[name]() for name in wanted}, source


def checked_ranks(rank: Any, world_size: Any, world_from: RankSource) -> tuple[int, int]:
    """``rank`` and ``world_size`` as ints (numpy's too); a ConfigError naming one that is no whole
    number, or a rank outside the world."""
    both = []
    for name, value in (("rank", rank), ("world_size", world_size)):
        try:
            both.append(operator.index(value))
        except TypeError:
            raise ConfigError(
                f"{name}={value!r}: give a whole number (a launcher's variable is a string: int(os.environ[...]))"
            ) from None
    if not 0 <= both[0] < both[1]:
        unset = (
            " (WORLD_SIZE is not set in the environment, nor a torch.distributed process group "
            "initialised: pass world_size=)"
            if world_from is RankSource.DEFAULT
            else ""
        )
        raise ConfigError(f"rank {both[0]} is not in [0, world_size={both[1]}){unset}")
    return both[0], both[1]


def placement(
    rank: int | None, world_size: int | None, node: int | None, num_nodes: int | None
) -> tuple[RankPlacement, RankSource]:
    """Where this rank runs, each value given or else the launcher's (see :func:`env_ranks`),
    and where its world size came from. ``world_size=1`` given without ``rank`` is rank 0 of
    its own world (every rank reading everything): no launcher's rank is read then."""
    if rank is None and world_size == 1:
        rank = 0
    given = {"rank": rank, "world_size": world_size, "node": node, "num_nodes": num_nodes}
    env, source = env_ranks([name for name, value in given.items() if value is None])
    values = {name: env[name] if value is None else value for name, value in given.items()}
    checked_rank, checked_world = checked_ranks(values["rank"], values["world_size"], source)
    return RankPlacement(checked_rank, checked_world, values["node"], values["num_nodes"]), source


def check_world(source: RankSource) -> None:
    """Refuse to read when a loader's ``world_size`` is the default 1 (no argument, no launcher's
    variable, no process group when it was made) while torch.distributed's default group,
    initialised since, has several ranks: every rank would read the whole dataset. Called
    where the group is seen: the rank's process, a DataLoader worker forked from it, and as
    the loader is sent to a worker started afresh (which has no group)."""
    group = group_ranks() if source is RankSource.DEFAULT else None
    if group is not None and group[1] > 1:
        raise ConfigError(
            f"this loader was made before torch.distributed.init_process_group, so it reads as the "
            f"one rank of the job (world_size=1), but the process group now has {group[1]} ranks "
            f"(this is rank {group[0]}): every rank would read the whole dataset. Make the loader "
            "after init_process_group (it then takes the group's rank and world size), or pass "
            "rank= and world_size="
        )
