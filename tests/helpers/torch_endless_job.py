"""An endless ``wdscache.WebDataset(urls, resampled=True)`` in torch DataLoaders with workers,
cut outside as OpenCLIP cuts it, in one process (torch's import is slow, and must not leak into
the pytest process):

    python -m tests.helpers.torch_endless_job CACHE_DIR PATTERN

Prints one JSON object: what each rank and DataLoader epoch got (``url#key@worker``), with
persistent workers and with workers made anew each epoch; and a ``StatefulDataLoader``'s
resume.
"""

from __future__ import annotations

import json
import sys
from itertools import islice
from typing import Any

import webdataset as wds
from torch.utils.data import DataLoader, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import wdscache
from wdscache.training.pipeline import ENDLESS_EPOCH

CUT = 40  # each worker's samples per DataLoader epoch (the outer with_epoch)


def tagged(sample: dict[str, Any]) -> str:
    info = get_worker_info()
    return f"{sample['__url__']}#{sample['__key__']}@{info.id if info is not None else -1}"


def endless(cache: str, pattern: str, rank: int = 0, world: int = 1) -> Any:
    return wdscache.WebDataset(
        pattern, cache_dir=cache, resampled=True, rank=rank, world_size=world, job=f"endless-w{world}"
    )


def main(cache: str, pattern: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for persistent in (True, False):
        ranks = []
        for rank in range(2):
            # OpenCLIP's pipeline: the source, per-sample stages, with_epoch on the outer DataPipeline
            pipeline = wds.DataPipeline(endless(cache, pattern, rank, 2), wds.map(tagged)).with_epoch(CUT)
            dl = DataLoader(pipeline, batch_size=None, num_workers=2, persistent_workers=persistent)
            ranks.append([list(dl) for _ in range(3)])
        out[f"persistent={persistent}"] = ranks
    # wds.WebLoader(...).with_epoch(n): n an iteration of the loader (its workers' together)
    loader = wds.WebLoader(endless(cache, pattern).map(tagged), batch_size=None, num_workers=2).with_epoch(CUT)
    out["webloader"] = [list(loader) for _ in range(2)]

    # A StatefulDataLoader stopped past each worker's first epoch (batches of 4 from 2 workers in
    # turn): its state, loaded into a new one, resumes the worker's second epoch, then the third.
    def stateful() -> StatefulDataLoader:
        return StatefulDataLoader(endless(cache, pattern).map(tagged), batch_size=4, num_workers=2)

    dl = stateful()
    it = iter(dl)
    out["stateful_first"] = [i for batch in islice(it, 2 * ENDLESS_EPOCH // 4 + 4) for i in batch]
    state = dl.state_dict()
    out["stateful_then"] = [i for batch in islice(it, ENDLESS_EPOCH // 2) for i in batch]
    again = stateful()
    again.load_state_dict(state)
    out["stateful_resumed"] = [i for batch in islice(again, ENDLESS_EPOCH // 2) for i in batch]
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
