"""A loader's checkpoints: ``state_dict()`` taken from where its epoch stands, checked, and read
back into where its next epoch starts (:class:`NextEpoch`).

Guarantees:

- exact resume: a state names the epoch and the positions of its global sequence delivered
  (every one before ``position``, and the ``done`` runs after it; on several nodes, each
  part's), as if every rank had delivered as many as the one it was taken on. A loader with
  the same sequence settings resumes it at exactly the positions not delivered, with any world
  size, number of nodes or (from all its workers' states together, see
  :mod:`wdscache.training.worker_slices`) number of DataLoader workers;
- a state is plain data (whole numbers, booleans, strings, and lists and dicts of them): it
  survives ``json`` and ``torch.save``, and is safe to carry to another process or machine;
  reading one runs nothing it holds;
- a state that cannot resume exactly (another seed, ``shuffle``, ``shuffle_buffer``,
  ``drop_last`` or mixture; a malformed entry; a worker's own state on another layout) is
  refused with a ``ValueError`` naming what differs, and the loader's next epoch stays as it
  was. The list a state was taken on is checked when the epoch starts (the agent's list is
  known only then: see ``CachedMultiLoader.__iter__``);
- taking a state changes nothing (torchdata's ``StatefulDataLoader`` asks every worker for
  one at every batch): it reads the epoch stream's counts and needs no agent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..shared.nodes import NodeShare, parts_state, read_parts_state
from ..shared.sequence import RankShare, Resume
from .stream import EpochStream
from .worker_slices import Delivered, WorkerSlice, check_worker, combine

STATE_VERSION = 2  # 2 added "done"; a version 1 state is read as one without it
# A state with "parts" (a job on several nodes): an older loader, which would not see them, refuses it.
PARTS_VERSION = 3
# A StatefulDataLoader state's count of batches delivered since its workers' states were taken.
STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"


@dataclass(frozen=True)
class NextEpoch:
    """Where the loader's next epoch starts: from its beginning, or a checkpoint's position."""

    epoch: int = 0
    start: Resume = Resume()  # positions delivered already
    skip: int = 0  # pairs of this DataLoader worker's slice delivered already (its own checkpoint's)...
    full_rows: int = 0  # ...and how the rank's rows were dealt then (on one node, see worker_slices.combine)
    tail: int | None = None
    # A job on several nodes: the epoch's parts, with ``start`` empty and each part's positions
    # delivered already, and what every rank delivered since (a DataLoader's workers' checkpoint).
    parts: list[list[int]] | None = None
    part_resumes: tuple[Resume, ...] = ()
    delivered: Delivered | None = None
    # A DataLoader worker's own checkpoint of a slice that was over: the epoch's iteration gives
    # nothing of it (its fellows give their rests), and the next is the next epoch.
    over: bool = False


@dataclass(frozen=True)
class Checkpoints:
    """How one loader's checkpoints are taken and read: the settings of its sequence (a
    checkpoint must have the same), its mixture's fingerprint, its layout and the list it reads."""

    seed: int
    shuffle: bool
    shuffle_buffer: int
    drop_last: bool
    mix: str | None  # the mixture's fingerprint; None: no mix= nor resampled=
    world_size: int
    num_nodes: int
    list_id: str | None  # the list of the epoch being read, else the loader's own (None: the agent's)

    def taken(self, stream: EpochStream | None, nxt: NextEpoch, worker: WorkerSlice) -> dict[str, Any]:
        """The state of a loader reading ``stream`` (None: none yet), its next epoch ``nxt``; in a
        DataLoader worker (``worker.count > 1``), that worker's own."""
        if worker.count > 1:
            return self._worker_state(stream, nxt, worker)
        if stream is not None and not stream.complete:
            resume = stream.resume()
            if isinstance(resume, tuple):  # on several nodes: each part's positions (see wdscache.shared.nodes)
                share = stream.share
                assert isinstance(share, NodeShare)
                at = NextEpoch(stream.spec.epoch, parts=[list(p) for p in share.job.parts], part_resumes=resume)
            else:
                at = NextEpoch(stream.spec.epoch, resume)
            return self.state(at)
        return self.state(nxt)

    def _worker_state(self, stream: EpochStream | None, nxt: NextEpoch, worker: WorkerSlice) -> dict[str, Any]:
        if stream is not None and isinstance(stream.share, NodeShare):
            # The worker's pairs of its node's share; placed in the parts' positions when the
            # counts are known (see worker_slices.combine).
            job = stream.share.job
            state = self.state(
                NextEpoch(stream.spec.epoch, parts=[list(p) for p in job.parts], part_resumes=job.resumes)
            )
            state["worker"] = {
                "part": worker.index,
                "of": worker.count,
                "world_size": self.world_size,
                "num_nodes": self.num_nodes,
                "pairs": stream.worker_slice.skip + stream.delivered,
                "complete": stream.complete or stream.worker_slice.over,
                "started": True,
            }
            return state
        if stream is None and (self.num_nodes > 1 or nxt.parts is not None):  # not begun, on several nodes
            state = self.state(nxt)
            state["worker"] = {
                "part": worker.index,
                "of": worker.count,
                "world_size": self.world_size,
                "num_nodes": self.num_nodes,
                "pairs": nxt.skip,
                "complete": nxt.over,
                "started": False,
            }
            return state
        if stream is None:  # before the first epoch of this worker
            epoch, start, pairs, complete, full_rows, tail = (
                nxt.epoch,
                nxt.start,
                nxt.skip,
                nxt.over,
                nxt.full_rows,
                nxt.tail,
            )
        else:
            share = stream.share
            assert isinstance(share, RankShare)  # a NodeShare's workers took the branch above
            epoch, start, complete = stream.spec.epoch, share.resume, stream.complete or stream.worker_slice.over
            pairs, full_rows, tail = stream.worker_slice.skip + stream.delivered, share.full_rows, share.tail
        state = self.state(NextEpoch(epoch, start))
        state["worker"] = {
            "part": worker.index,
            "of": worker.count,
            "world_size": self.world_size,
            "pairs": pairs,
            "complete": complete,
            "full_rows": full_rows,
            "tail": tail,
        }
        return state

    def state(self, at: NextEpoch) -> dict[str, Any]:
        """The checkpoint of ``at`` (its ``skip`` is the caller's, for a worker's state)."""
        state: dict[str, Any] = {
            "version": STATE_VERSION if at.parts is None else PARTS_VERSION,
            "epoch": at.epoch,
            "position": at.start.position,  # every position before it was delivered...
            "done": [list(run) for run in at.start.done],  # ...and these runs after it
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "urls": self.list_id,
        }
        if self.mix is not None:  # which mixture: another would deal other samples to the positions
            state["mix"] = self.mix
        if at.parts is not None:
            state.update(parts_state(at.parts, at.part_resumes))
        if at.delivered is not None:
            state["delivered"] = at.delivered.to_state()
        return state

    def loaded(self, state: dict[str, Any], worker: WorkerSlice) -> tuple[NextEpoch, dict[str, Any]]:
        """Where the next epoch of a loader given ``state`` starts (``worker``: its slice), and the
        state it came from (whose list the epoch checks): from ``state_dict()`` of any rank, or a
        whole ``StatefulDataLoader.state_dict()`` (all its workers' states)."""
        behind = state.get(STEPS_SINCE_SNAPSHOT) if isinstance(state, dict) else None
        if type(behind) is int and behind > 0:
            raise ValueError(
                f"this StatefulDataLoader state was taken {behind} batch(es) after its workers' last snapshot "
                "(snapshot_every_n_steps > 1): their states do not count those batches, which a load into the "
                "dataset would deliver again. Load it into a StatefulDataLoader of the same num_workers "
                "(dl.load_state_dict(state)), or take states with snapshot_every_n_steps=1"
            )
        ours = list(_our_states(state))
        if not ours:
            raise ValueError(
                "no wdscache loader state in this dict: pass a CachedMultiLoader.state_dict() "
                "or a StatefulDataLoader.state_dict() of a loader over one"
            )
        if len(ours) > 1 or (ours[0] is not state and "worker" in ours[0]):
            for one in ours:
                self.checked(one)
            if not all("worker" in one for one in ours):
                raise ValueError("a loader's state holds both whole and per-worker wdscache states")
            epoch, at, nodes = combine(ours)
            if nodes is None:
                return NextEpoch(epoch, at), ours[0]
            return NextEpoch(epoch, parts=nodes[0], part_resumes=nodes[1], delivered=nodes[2]), ours[0]
        state = ours[0]
        done = self.checked(state)
        entry = state.get("worker")
        if entry is not None:
            theirs = (entry["part"], entry["of"], entry["world_size"], entry.get("num_nodes", 1))
            if theirs != (worker.index, worker.count, self.world_size, self.num_nodes):
                raise ValueError(
                    f"this state is worker {theirs[0]}'s of {theirs[1]} with world_size {theirs[2]} on {theirs[3]} "
                    f"node(s), but this is worker {worker.index} of {worker.count} with world_size "
                    f"{self.world_size} on {self.num_nodes}: to resume with another num_workers, world size or "
                    "number of nodes, load the whole StatefulDataLoader.state_dict() into the dataset "
                    "(dataset.load_state_dict(state)) and give the new DataLoader no state"
                )
        parts, resumes = read_parts_state(state) if state["version"] == PARTS_VERSION else (None, ())
        delivered = state.get("delivered")
        w = entry or {}
        nxt = NextEpoch(
            state["epoch"],
            Resume.of(state["position"], done),
            w.get("pairs", 0),
            w.get("full_rows", 0),
            w.get("tail"),
            parts,
            resumes,
            Delivered.from_state(delivered) if delivered is not None else None,
            over=entry is not None and entry["complete"],
        )
        return nxt, state

    def checked(self, state: dict[str, Any]) -> list[list[int]]:
        """``state``'s runs "done", once it is checked (see :func:`check_state`)."""
        sequence = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
        }
        return check_state(state, sequence, self.mix)


def check_state(state: dict[str, Any], sequence: dict[str, Any], mix: str | None) -> list[list[int]]:
    """Refuse a checkpoint ``state`` a loader whose sequence settings are ``sequence`` (seed,
    shuffle, shuffle_buffer, drop_last) and whose mixture's fingerprint is ``mix`` cannot resume
    exactly, saying why; its runs "done"."""
    if state.get("version") not in (1, STATE_VERSION, PARTS_VERSION):
        raise ValueError(f"unsupported wdscache state version {state.get('version')!r}")
    if "worker" in state:
        check_worker(state["worker"])
    for name, ours in sequence.items():
        if state[name] != ours:
            raise ValueError(
                f"checkpoint has {name}={state[name]!r} but this loader {name}={ours!r}; "
                "the sequence would differ, so resuming would repeat or skip samples"
            )
    if (mix is not None or "mix" in state) and state.get("mix") != mix:
        raise ValueError(
            "the checkpoint was taken on another mixture (mix=, its weights, epoch_samples "
            "or resampled=) than this loader reads: resuming would repeat or skip samples"
        )
    epoch, position = state.get("epoch"), state.get("position")
    if not (_natural(epoch) and _natural(position)):
        raise ValueError(f"checkpoint needs whole numbers >= 0 for 'epoch' and 'position', not {epoch!r}, {position!r}")
    done = state.get("done", []) if state["version"] > 1 else []
    if not (
        isinstance(done, list)
        and all(isinstance(run, list) and len(run) == 2 and all(map(_natural, run)) and run[0] < run[1] for run in done)
    ):
        raise ValueError(f"checkpoint 'done' must be a list of [start, end] position pairs, start < end; got {done!r}")
    return done


def _our_states(state: Any) -> Iterator[dict[str, Any]]:
    """The wdscache loader states in ``state``: itself, or those nested in a torchdata
    ``StatefulDataLoader`` state (one per worker, or the dataset's)."""
    if not isinstance(state, dict):
        return
    if "version" in state and "position" in state and "seed" in state:
        yield state
        return
    for value in state.values():
        yield from _our_states(value)


def _natural(x: Any) -> bool:
    return type(x) is int and x >= 0
