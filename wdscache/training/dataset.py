"""``CachedMultiLoader`` as a ``torch.utils.data.IterableDataset``: what a loader made in a
process that uses torch is (this module imports torch; :mod:`.loader` imports it only
there). This module does not import :mod:`.loader`: :func:`torch_loader` makes the class
from the loader's class it is given.

In a ``DataLoader`` with ``num_workers=K``, each worker process reads its own slice of the
rank's share (:mod:`.worker_slices`), found with ``get_worker_info()``: the rank still gets
its exact share, each sample once, and every rank the same count, whatever ``K``.

- The private agent, when one is needed, starts in the process that makes the dataset, so
  that it outlives the workers of one epoch.
- ``set_epoch`` reaches workers that outlive an epoch (``persistent_workers=True``) through
  a value in shared memory; workers made anew each epoch copy it anyway.
- Without ``set_epoch``, each iteration is the next epoch, in this process or in a
  ``DataLoader``'s workers, whatever their number: torch's default workers are made anew each
  epoch from the dataset, whose epoch does not move (it is not iterated in this process), so
  each worker keeps, in the same shared memory, the epoch after the one it began, and a copy
  made anew begins that one; a DataLoader of another number of workers than the last (or an
  iteration in this process) begins the epoch after the latest any copy began.
  ``set_epoch`` and ``load_state_dict`` in this process say again where the next starts.
- ``state_dict()`` in a worker (torchdata's ``StatefulDataLoader`` asks each) is that
  worker's slice; see :meth:`~.loader.CachedMultiLoader.load_state_dict` for resuming with
  another ``num_workers`` or world size. In the process that made the dataset, once
  DataLoader workers began an epoch since ``set_epoch`` or ``load_state_dict`` last said
  where the next starts, it raises: what they delivered is theirs, and this copy's state
  would name a position they left behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from enum import IntEnum
from multiprocessing import get_context
from multiprocessing.context import get_spawning_popen
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from ..shared.logs import get_logger
from .ranks import RankSource, check_world
from .worker_slices import WorkerSlice

log = get_logger(__name__)

L = TypeVar("L")

# DataLoader worker ids whose next epoch the box keeps (a worker of a higher id begins the epoch
# its copy was made with, as before set_epoch is called).
BOX_WORKERS = 1024
# Seconds a start waits for the box's lock (held for microseconds): a process killed while it
# held it must not hang every later start.
BOX_LOCK_WAIT = 5.0


class Began(IntEnum):
    """Where an epoch was last begun since this process last said where the next one starts."""

    NOWHERE = 0
    HERE = 1  # in the process that made the dataset
    IN_WORKERS = 2  # in DataLoader workers


# The box: times set_epoch was called here, its epoch; the number of workers of the DataLoader
# that read last (0: this process itself, -1: none yet); where an epoch was last begun (a Began);
# then, for each worker id and last for this process's own iterations, 1 + the epoch the next
# copy begins (0: none begun since the epoch was last said).
_SET, _EPOCH, _LAYOUT, _BEGAN, _SLOTS = 0, 1, 2, 3, 4
_MAIN = _SLOTS + BOX_WORKERS
_BOX = (0, 0, -1, Began.NOWHERE) + (0,) * (BOX_WORKERS + 1)


def _new_box(values: Any) -> Any:
    """The box (see _BOX), shared with the workers made before or after a call. Its lock orders
    the workers of a DataLoader of another number of them than the last; made in the "spawn"
    context, it goes to workers started by any method (a lock of the "fork" context refuses to
    be sent to a process started afresh)."""
    return get_context("spawn").Array("q", values)


def torch_loader(loader: type[L], name: str) -> type[L]:
    """``loader`` (the loader's class) as a torch iterable dataset: a class called ``name`` in
    ``loader``'s module (which must hold it under that name, for pickle)."""
    return type(name, (InDataLoader, loader, IterableDataset), {"__module__": loader.__module__, "__qualname__": name})


class InDataLoader:
    """What a loader does differently in torch's ``DataLoader`` (mixed in before the loader's class)."""

    _epoch_box: Any
    _box_seen: int
    _chosen_in: int  # the process in which this copy's epoch was last set (set_epoch, load_state_dict)
    _read_in: int  # the process in which this copy last began an epoch
    _next: Any  # the loader's next epoch (see checkpoints.NextEpoch)
    _world_from: RankSource  # where the loader's world size came from

    def _loader(self) -> Any:
        """The loader's own methods (the class after this one)."""
        return super()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loader().__init__(*args, **kwargs)
        self._epoch_box = _new_box(_BOX)
        self._box_seen = 0
        self._chosen_in = self._read_in = 0
        self._loader()._ensure_agent()

    def set_epoch(self, epoch: int) -> None:
        self._loader().set_epoch(epoch)
        self._chose()
        box = self._epoch_box.get_obj()
        box[_EPOCH] = epoch
        box[_SET] += 1  # (this process alone writes it)
        self._box_seen = box[_SET]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loader().load_state_dict(state)
        self._chose()

    def _chose(self) -> None:
        """This copy's next epoch was said here: copies made from now on in workers begin it
        (they forget what earlier copies read)."""
        self._chosen_in = os.getpid()
        if get_worker_info() is None:
            self._epoch_box.get_obj()[_LAYOUT:] = _BOX[_LAYOUT:]

    def _worker_slice(self) -> WorkerSlice:
        info = get_worker_info()
        return WorkerSlice() if info is None else WorkerSlice(info.id, info.num_workers)

    def _in_worker(self) -> bool:
        return get_worker_info() is not None

    def _settle_next(self) -> None:
        self._choose_epoch()
        self._loader()._settle_next()

    def _choose_epoch(self) -> int | None:
        """Say this copy's next epoch as its iteration begins: the one set_epoch said in the main
        process since this copy was made, or, unsaid here, the epoch after the latest one begun.
        Begins nothing, and once said, saying it again changes nothing. Its slot in the box (None:
        a worker id beyond BOX_WORKERS)."""
        box = self._epoch_box.get_obj()  # its values, without the lock each access of the box itself takes
        told = box[_SET]
        if told != self._box_seen:  # set_epoch was called in the main process since this copy was made
            self._box_seen = told
            self._loader().set_epoch(box[_EPOCH])
            self._chosen_in = os.getpid()
        info = get_worker_info()
        slot = _MAIN if info is None else _SLOTS + info.id if info.id < BOX_WORKERS else None
        if slot is not None and (info is None or os.getpid() not in (self._chosen_in, self._read_in)):
            # This process's own iteration, or a copy made anew for a worker (torch's default
            # workers) whose epoch was not said there: the epoch after the latest one begun.
            lock = self._epoch_box.get_lock()
            locked = lock.acquire(timeout=BOX_LOCK_WAIT)
            if not locked:  # held by a process killed while it held it (for microseconds, at a start)
                log.warning("the epoch box's lock was not free in %.0f s: going on without it", BOX_LOCK_WAIT)
            try:
                layout = 0 if info is None else info.num_workers
                if box[_LAYOUT] != layout:
                    # Not the workers that read last (another number of them, or this process):
                    # each begins the epoch after the latest any copy began (epochs only move
                    # on between two set_epoch calls, which start the box again).
                    latest, box[_LAYOUT] = max(box[_SLOTS:]), layout
                    for k in [_MAIN] if info is None else range(_SLOTS, _SLOTS + min(layout, BOX_WORKERS)):
                        box[k] = latest
                if box[slot] - 1 > self._next.epoch:
                    self._loader().set_epoch(box[slot] - 1)
            finally:
                if locked:
                    lock.release()
        return slot

    def __iter__(self) -> Iterator[Any]:
        slot = self._choose_epoch()
        self._read_in = os.getpid()
        samples = self._loader().__iter__()
        box = self._epoch_box.get_obj()
        if slot is not None:
            box[slot] = self._next.epoch + 1  # the next epoch, as begun now
        box[_BEGAN] = Began.HERE if get_worker_info() is None else Began.IN_WORKERS
        return samples

    def state_dict(self) -> dict[str, Any]:
        self._check_state_here()
        return self._loader().state_dict()

    def _state_after_current(self) -> dict[str, Any]:
        self._check_state_here()
        return self._loader()._state_after_current()

    def _check_state_here(self) -> None:
        """Refuse a state in the process that made the dataset once DataLoader workers began an
        epoch since it last said where the next starts: this copy does not know what they
        delivered (its own position would send a resumed job back over what they read)."""
        if get_worker_info() is None and self._epoch_box.get_obj()[_BEGAN] == Began.IN_WORKERS:
            raise RuntimeError(
                "state_dict() of a dataset whose epoch DataLoader workers read: what they delivered is "
                "theirs, and this process's copy does not know it. Take the state of torchdata's "
                "StatefulDataLoader (dl.state_dict(), which asks each worker; load it into the dataset "
                "to resume), or say the next epoch first (dataset.set_epoch(e): the state is then "
                "epoch e from its start)"
            )

    def __getstate__(self) -> dict[str, Any]:
        # Sent to a worker started by "spawn" or "forkserver", the box goes along (multiprocessing
        # shares it); any other copy (pickle.dumps, copy.deepcopy) takes its values, in a box of its own.
        if get_spawning_popen() is not None:
            check_world(self._world_from)  # the last place the rank's process group is seen
        state = self._loader().__getstate__()
        if get_spawning_popen() is None:
            state["_epoch_box"] = list(self._epoch_box.get_obj())  # (the box's own items wait for its lock)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["_epoch_box"], list):
            state["_epoch_box"] = _new_box(state["_epoch_box"])
        self.__dict__.update(state)
