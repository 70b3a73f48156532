"""The ranks of a job on several nodes compare their lists over torch.distributed.

Each node's agent holds its own list, and every rank splits the shards between the
nodes from its agent's list and counts (:mod:`wdscache.shared.nodes`): ranks whose agents
hold different lists would split differently, and get unequal counts while some samples
go to no rank. The ranks cannot see each other's agents, but a job under
``torch.distributed`` has a process group: :func:`exchange` gathers every rank's
:class:`~wdscache.shared.nodes.NodeList` (or why it has none) over it, so every rank
gets the same table and raises the same error.

Guarantees:

- Used only where the default process group is this job's: initialized, of the loader's
  world size and rank, and not in a DataLoader worker (a forked copy of the group must not
  be used). Elsewhere :func:`job_group` says None and nothing is exchanged.
- Every rank calls it at the same point (a loader's construction, an epoch's start), as
  every collective of the job; it waits up to the process group's own timeout, the one the
  job set for every other collective, for the slowest rank (a rank saving a checkpoint).
- What crosses is JSON in a fixed-size byte tensor, never pickle.
- torch is imported only by a process that imported it already.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..shared.errors import ConfigError
from ..shared.nodes import NodeList, RankPlacement, check_same_list

ENTRY_BYTES = 1024  # one rank's entry: a NodeList's JSON, or why it has none (cut to fit)
WHY_CHARS = 600


def job_group(layout: RankPlacement) -> Any | None:
    """``torch.distributed`` if its default process group is this job's here, else None."""
    if sys.modules.get("torch") is None:
        return None
    import torch.distributed as dist
    from torch.utils.data import get_worker_info

    if not (dist.is_available() and dist.is_initialized()) or get_worker_info() is not None:
        return None
    if dist.get_world_size() != layout.world_size or dist.get_rank() != layout.rank:
        return None
    return dist


def exchange(dist: Any, mine: NodeList | Exception) -> list[NodeList | str]:
    """Every rank's list (or why it has none, a string), in rank order; ``mine`` is this rank's."""
    import torch

    entry = mine.to_wire() if isinstance(mine, NodeList) else {"failed": f"{type(mine).__name__}: {mine}"[:WHY_CHARS]}
    data = json.dumps(entry).encode()
    if len(data) > ENTRY_BYTES:  # a list id of another length than ours: say so rather than cut the JSON
        data = json.dumps({"failed": "its list entry does not fit the exchange"}).encode()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    buf = torch.zeros(ENTRY_BYTES, dtype=torch.uint8, device=device)
    buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
    out = [torch.zeros_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(out, buf)
    return [_entry(bytes(t.cpu().tolist()).rstrip(b"\0")) for t in out]


def _entry(raw: bytes) -> NodeList | str:
    try:
        d = json.loads(raw)
        if isinstance(d, dict) and isinstance(d.get("failed"), str):
            return d["failed"]
        return NodeList.from_wire(d)
    except ValueError as exc:  # json's errors are ValueErrors too
        return f"its entry could not be read ({exc})"


def agree(dist: Any, layout: RankPlacement, mine: NodeList | Exception) -> NodeList:
    """This rank's list (``mine``, or why it has none) compared with every rank's over ``dist``
    (:func:`job_group`): every rank raises alike when they differ, or when one has none (that
    one its own error); else the job's list."""
    lists = exchange(dist, mine)
    if isinstance(mine, Exception):
        raise mine  # the others name it
    check_same_list(lists, layout)
    return mine


def agree_on_list(layout: RankPlacement, probe: Callable[[], tuple[Any, Sequence[int | None], str]]) -> NodeList | None:
    """On several nodes, with the job's process group here (:func:`job_group`): compare this rank's
    list with every rank's, each read by ``probe`` as ``len()`` reads it (not as a rank that reads:
    the exchange may wait for a slow rank longer than the agent keeps a silent reader). Every rank
    raises alike if they differ; else the job's list. None: nothing to compare with."""
    if layout.num_nodes == 1:
        return None
    dist = job_group(layout)
    if dist is None:
        return None
    mine: NodeList | Exception
    try:
        _, counts, key = probe()
        mine = NodeList.of(key, counts)
    except Exception as exc:  # the other ranks are told, and raise too
        mine = exc
    return agree(dist, layout, mine)


def check_kept(layout: RankPlacement, mine: NodeList, kept: NodeList | None) -> None:
    """Refuse an epoch whose list (``mine``, as this node's agent holds it now) is not the one
    the job's ranks agreed on (``kept``: None if they never compared theirs). A count unknown on
    either side is not compared: the agent learns counts as it downloads."""
    if kept is None:
        return
    if (mine.list_id, mine.shards) != (kept.list_id, kept.shards) or (
        None not in (mine.counts, kept.counts) and mine.counts != kept.counts
    ):
        raise ConfigError(
            f"node {layout.node}'s agent now holds {mine.describe()}, but the nodes of this job agreed on "
            f"{kept.describe()}: the nodes would split the shards differently. Give every node's agent the job's "
            "list again, or restart the job with one list on every node"
        )
