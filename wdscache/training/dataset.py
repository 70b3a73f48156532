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
- ``state_dict()`` in a worker (torchdata's ``StatefulDataLoader`` asks each) is that
  worker's slice; see :meth:`~.loader.CachedMultiLoader.load_state_dict` for resuming with
  another ``num_workers`` or world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen
from multiprocessing.sharedctypes import RawArray
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from .worker_slices import WorkerSlice

L = TypeVar("L")


def torch_loader(loader: type[L], name: str) -> type[L]:
    """``loader`` (the loader's class) as a torch iterable dataset: a class called ``name`` in
    ``loader``'s module (which must hold it under that name, for pickle)."""
    return type(name, (InDataLoader, loader, IterableDataset), {"__module__": loader.__module__, "__qualname__": name})


class InDataLoader:
    """What a loader does differently in torch's ``DataLoader`` (mixed in before the loader's class)."""

    _epoch_box: Any
    _box_seen: int

    def _loader(self) -> Any:
        """The loader's own methods (the class after this one)."""
        return super()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loader().__init__(*args, **kwargs)
        # [times set_epoch was called, its epoch]: read by workers made before the call.
        self._epoch_box = RawArray("q", 2)
        self._box_seen = 0
        self._loader()._ensure_agent()

    def set_epoch(self, epoch: int) -> None:
        self._loader().set_epoch(epoch)
        self._epoch_box[1] = epoch
        self._epoch_box[0] += 1
        self._box_seen = self._epoch_box[0]

    def _worker_slice(self) -> WorkerSlice:
        info = get_worker_info()
        return WorkerSlice() if info is None else WorkerSlice(info.id, info.num_workers)

    def _in_worker(self) -> bool:
        return get_worker_info() is not None

    def __iter__(self) -> Iterator[Any]:
        told = self._epoch_box[0]
        if told != self._box_seen:  # set_epoch was called in the main process since this copy was made
            self._box_seen = told
            self._loader().set_epoch(self._epoch_box[1])
        return self._loader().__iter__()

    def __getstate__(self) -> dict[str, Any]:
        # Sent to a worker started by "spawn" or "forkserver", the box goes along (multiprocessing
        # shares it); any other copy (pickle.dumps, copy.deepcopy) takes its values, in a box of its own.
        if get_spawning_popen() is not None:
            self._loader()._check_world()  # the last place the rank's process group is seen
        state = self._loader().__getstate__()
        if get_spawning_popen() is None:
            state["_epoch_box"] = list(self._epoch_box)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["_epoch_box"], list):
            state["_epoch_box"] = RawArray("q", state["_epoch_box"])
        self.__dict__.update(state)
