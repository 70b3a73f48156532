"""A rank's share split between DataLoader workers (wdscache.training.worker_parts), without torch:
the parts are disjoint and whole, and the job's position from all workers' counts is exact."""

from __future__ import annotations

import random

import pytest

from wdscache.shared.sequence import RankShare, Resume
from wdscache.training.worker_parts import Part, job_resume, part_of


def _shares(n: int, world: int, start: Resume) -> list[tuple[RankShare, list[tuple[int, tuple[int, int]]]]]:
    ids = [(0, i) for i in range(n)]
    out = []
    for rank in range(world):
        share = RankShare(world, rank, resume=start)
        out.append((share, list(share.pairs(ids))))
    return out


@pytest.mark.parametrize("n,world,workers", [(78, 1, 2), (203, 2, 3), (500, 4, 2), (37, 3, 4)])
def test_parts_are_disjoint_and_make_the_share(n: int, world: int, workers: int) -> None:
    for share, pairs in _shares(n, world, Resume()):
        parts = [list(part_of(iter(pairs), Part(k, workers))) for k in range(workers)]
        assert sorted(p for part in parts for p in part) == sorted(pairs)


@pytest.mark.parametrize("seed", range(40))
def test_job_resume_is_the_union_of_what_every_worker_delivered(seed: int) -> None:
    rng = random.Random(seed)
    n, world, workers = rng.randrange(1, 400), rng.randrange(1, 5), rng.randrange(1, 5)
    start = Resume.of(rng.randrange(0, 30), [(40, 45), (60, 70)]) if rng.random() < 0.5 else Resume()
    shares = _shares(n, world, start)
    parts = [[list(part_of(iter(pairs), Part(k, workers))) for k in range(workers)] for _, pairs in shares]
    lengths = [len(p) for p in parts[0]]
    # Workers near each other (a DataLoader deals batches round robin), but any counts must work.
    counts = [rng.randrange(0, length + 1) for length in lengths]
    expected = {p for p in range(n) if start.skips(p)}
    left = n - start.delivered(n)  # positions in the share's numbering; those past them are padding
    for rank_parts in parts:
        for k, part in enumerate(rank_parts):
            expected |= {sid[1] for pos, sid in part[:counts[k]] if pos < left}
    share = shares[0][0]
    got = job_resume(start, share, counts)
    assert {p for p in range(n) if got.skips(p)} == expected
