"""Ranks of one job on one node must read one list: the agent warns of a rank whose list differs from a live rank's."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.shard_maker import write_url_list
from tests.helpers.streaming import samples_of
from tests.helpers.waits import stop_process, wait_for
from wdscache.agent.rank_lists import numbered, relation
from wdscache.shared.urls import Urls, list_id

DEADLINE = 60.0


@pytest.mark.slow  # rank 0 reads on for 6 s, while three more ranks start and say hello
def test_a_rank_whose_list_differs_from_a_live_ranks_is_warned_about_and_the_same_list_reads(
    tmp_path: Path, dataset, start_agent, consumers
) -> None:
    # Each rank took its share of its own list: 80 of 300 samples repeated and 80 never read,
    # or one rank's count unequal to the other's (a DDP job hangs), with no word of it. The agent
    # warns (it cannot refuse: two launches of one job name look the same to it).
    data = dataset(4, samples=10, payload=300)  # 40 samples
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "4")
    backwards = write_url_list(tmp_path / "own" / "backwards.txt", data.urls[::-1])
    forwards = write_url_list(tmp_path / "own" / "forwards.txt", data.urls)
    rank = ("--job", "j", "--world-size", "2", "--timeout", "20")
    first = consumers(cache, "r0", *rank, "--rank", "0", "--urls", str(backwards), "--sleep", "0.3")
    wait_for(lambda: first.out.exists() and first.out.read_text(), DEADLINE, "rank 0 never read a sample")

    other_order = consumers(cache, "order", *rank, "--rank", "1", "--urls", str(forwards))
    agents = consumers(cache, "agents", *rank, "--rank", "1")  # the agent's list: the same URLs, forwards
    same = consumers(cache, "same", *rank, "--rank", "1", "--urls", str(backwards))
    for c in (other_order, agents):
        assert len(samples_of(c.wait(DEADLINE))) == 20
    warnings = [line for line in agent.stderr_text().splitlines() if "ranks of one job reading different" in line]
    theirs = f"rank 0 reads its urls= (list {list_id(data.urls[::-1])}, 4 URLs)"
    assert len(warnings) == 1 and "job 'j', epoch 0: rank 1 reads" in warnings[0] and theirs in warnings[0], warnings
    assert f"(list {list_id(data.urls)}, 4 URLs)" in warnings[0] and "Give every rank the same urls=" in warnings[0]

    # The first rank read on undisturbed; with the rank of the same list, every sample once.
    got = [samples_of(c.wait(DEADLINE)) for c in (first, same)]
    keys = [{(s["url"], s["key"]) for s in g} for g in got]
    assert [len(g) for g in got] == [20, 20] and not keys[0] & keys[1]
    assert len(keys[0] | keys[1]) == 40


SPLITS = {  # the two ranks' parts of four shards, split by rank before the loader
    "every other": lambda urls: [urls[r::2] for r in range(2)],  # webdataset's split_by_node, by hand
    "runs": lambda urls: [urls[r * 2 : (r + 1) * 2] for r in range(2)],  # a split_by_node of contiguous runs
    "shuffled": lambda urls: [[urls[i] for i in (2, 0, 1, 3)][r::2] for r in range(2)],  # of a shuffled list
}


@pytest.mark.slow  # rank 0 reads on for 6 s, while rank 1 starts and says hello
@pytest.mark.parametrize("split", list(SPLITS))
def test_ranks_given_a_list_split_by_rank_before_the_loader_are_warned_about(
    tmp_path: Path, dataset, start_agent, consumers, split: str
) -> None:
    # A list split by rank before a loader that splits by rank itself: each rank reads half of
    # its half, 10 of 20 samples, silently.
    data = dataset(4, samples=20, payload=300)  # rank 0 reads its 20 for 6 s: still live at rank 1's hello
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    parts = [write_url_list(tmp_path / "own" / f"part{r}.txt", p) for r, p in enumerate(SPLITS[split](data.urls))]
    rank = ("--job", "j", "--world-size", "2", "--timeout", "20")
    first = consumers(cache, "r0", *rank, "--rank", "0", "--urls", str(parts[0]), "--sleep", "0.3")
    wait_for(lambda: first.out.exists() and first.out.read_text(), DEADLINE, "rank 0 never read a sample")
    second = consumers(cache, "r1", *rank, "--rank", "1", "--urls", str(parts[1]))
    assert [len(samples_of(c.wait(DEADLINE))) for c in (first, second)] == [20, 20]  # half of each half
    warnings = [line for line in agent.stderr_text().splitlines() if "two parts of one list split by rank" in line]
    assert len(warnings) == 1 and "job 'j', epoch 0: rank 1 reads its urls=" in warnings[0], warnings
    assert "Give every rank the whole list" in warnings[0]
    said = [line for line in second.log.read_text().splitlines() if "two parts of one list split by rank" in line]
    assert len(said) == 1 and "the agent at " in said[0], said  # rank 1's process is told too


def test_a_rank_of_a_job_whose_ranks_ended_reads_another_list(tmp_path: Path, dataset, start_agent, consumers) -> None:
    # A relaunch of the job (an elastic restart, a new list after an edit) is no mismatch.
    data = dataset(2, samples=5, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file)
    rank = ("--job", "j", "--world-size", "2")
    before = consumers(
        cache, "before", *rank, "--rank", "0", "--urls", str(write_url_list(tmp_path / "a.txt", data.urls))
    )
    assert len(samples_of(before.wait(DEADLINE))) == 5
    backwards = write_url_list(tmp_path / "b.txt", data.urls[::-1])
    assert (
        len(samples_of(consumers(cache, "after", *rank, "--rank", "1", "--urls", str(backwards)).wait(DEADLINE))) == 5
    )


NESTED = """
import sys
from itertools import islice
from wdscache import CachedMultiLoader
cache, rank, train, val, val_first = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
kw = dict(cache_dir=cache, job="j", rank=rank, world_size=2, timeout=20)
if val_first:  # loaders numbered otherwise than the other rank's
    val_loader, train_loader = CachedMultiLoader(val, **kw), CachedMultiLoader(train, **kw)
else:
    train_loader, val_loader = CachedMultiLoader(train, **kw), CachedMultiLoader(val, **kw)
it = iter(train_loader)
n = len(list(islice(it, 2)))
m = len(list(val_loader))  # validation within the training epoch: another list, the same epoch number
print(n + len(list(it)), m)
"""


def _halves(tmp_path: Path, urls: list[str]) -> tuple[str, str]:
    """List files of the first and the second half of ``urls`` (a training and a validation list)."""
    half = len(urls) // 2
    return str(write_url_list(tmp_path / "a.txt", urls[:half])), str(write_url_list(tmp_path / "b.txt", urls[half:]))


def _assert_no_list_warning(agent) -> None:
    assert "ranks of one job" not in agent.stderr_text() and "split by rank" not in agent.stderr_text()


@pytest.mark.parametrize("rank0_val_first", [False, True])
def test_a_validation_loader_reads_its_list_within_a_training_epoch(
    tmp_path: Path, dataset, start_agent, rank0_val_first: bool
) -> None:
    # Loaders of one job are told apart by their number in their process: the ranks' validation
    # loaders (list B) are compared with each other, not with the training loaders (list A); and
    # lists that share no shard are no mismatch, however the ranks numbered their loaders.
    data = dataset(4, samples=5, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    train, val = _halves(tmp_path, data.urls)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", NESTED, str(cache), str(r), train, val, str(int(rank0_val_first and r == 0))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        for p in ranks:
            out, err = p.communicate(timeout=DEADLINE)
            assert p.returncode == 0 and out.split() == ["5", "5"], err
    finally:  # a rank left over by a failure (or a hang past DEADLINE) is killed and reaped
        for p in ranks:
            stop_process(p)
    _assert_no_list_warning(agent)


HELD = """
import sys, time
from pathlib import Path
from wdscache import CachedMultiLoader
cache, rank, train, val, here = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
kw = dict(cache_dir=cache, job="j", rank=rank, world_size=2, timeout=20)
if rank == 0:  # loaders numbered otherwise than rank 1's: its validation loader is its loader 0
    val_loader, train_loader = CachedMultiLoader(val, **kw), CachedMultiLoader(train, **kw)
else:
    train_loader, val_loader = CachedMultiLoader(train, **kw), CachedMultiLoader(val, **kw)
its = [iter(train_loader), iter(val_loader)]
first = [next(it) for it in its]  # both loaders said hello and read
(here / f"ready{rank}").touch()
deadline = time.monotonic() + 30
while not (here / "go").exists():  # both loaders live until the test has seen the other rank's hellos
    assert time.monotonic() < deadline, "never told to go on"
    time.sleep(0.05)
print(*(1 + len(list(it)) for it in its))
"""


@pytest.mark.slow
def test_halves_of_a_list_that_ranks_read_with_loaders_numbered_otherwise_are_no_split(
    tmp_path: Path, dataset, start_agent
) -> None:
    # Rank 0's loader 1 reads the first half (its training list), rank 1's loader 1 the second (its
    # validation list): as contiguous runs in rank order would be. But rank 1 reads the first half
    # too, with its loader 0: the lists are whole lists of the job, and no warning is given.
    data = dataset(4, samples=5, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file)
    train, val = _halves(tmp_path, data.urls)
    ranks: list[subprocess.Popen[str]] = []
    try:
        for r in range(2):  # rank 0's loaders both live before rank 1's say hello
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "-c", HELD, str(cache), str(r), train, val, str(tmp_path)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            wait_for(lambda r=r: (tmp_path / f"ready{r}").exists(), DEADLINE, f"rank {r} never read from both loaders")
        (tmp_path / "go").touch()
        for p in ranks:
            out, err = p.communicate(timeout=DEADLINE)
            assert p.returncode == 0 and out.split() == ["5", "5"], err
    finally:  # a rank left over by a failure (or a hang past DEADLINE) is killed and reaped
        for p in ranks:
            stop_process(p)
    _assert_no_list_warning(agent)


def split_or_not(a: list[str], b: list[str], ranks: tuple[int, int] = (0, 1), world: int = 2, own: bool = True) -> str:
    return relation(Urls(a), Urls(b), own=own, ranks=ranks, world=world, numbering=numbered).name


def test_a_list_split_by_rank_is_told_from_another_loaders_list() -> None:
    u = [f"http://h/s-{i:02d}.tar" for i in range(12)]
    assert split_or_not(u[0::2], u[1::2]) == "SPLIT"
    assert split_or_not(u[1::2], u[0:-1:2]) == "SPLIT"
    assert split_or_not(u[:8], u[8:]) == "APART"  # a training and a validation list
    assert split_or_not(u[6:], u[:6]) == "APART"  # as long: rank 0's the later, rank 1 making its loaders otherwise
    assert split_or_not(u[:1], u[1:2]) == "APART"  # a URL each: no telling
    assert split_or_not(u[:1], u[1:3]) == "APART"
    assert split_or_not(u[0::2], u[1::2], own=False) == "APART"  # not both the loaders' own (the agent's list)
    assert split_or_not(u, u[::-1]) == "SHARE"  # two ranks with the whole list, in other orders


def test_a_split_of_an_unsorted_list_or_into_runs_is_told_by_the_shards_numbers() -> None:
    u = [f"s3://b/train/shard-{i:06d}.tar" for i in range(40)]
    shuffled = random.Random(7).sample(u, len(u))
    assert split_or_not(shuffled[0::2], shuffled[1::2]) == "SPLIT"
    assert split_or_not(shuffled[1::4], shuffled[3::4], ranks=(1, 3), world=4) == "SPLIT"
    unpadded = [f"http://h/d/{i}.tar" for i in range(1, 21)]  # {1..20}: "10" sorts before "2"
    assert split_or_not(unpadded[0::2], unpadded[1::2]) == "SPLIT"
    assert split_or_not(unpadded[2::4], unpadded[1::4], ranks=(2, 1), world=4) == "SPLIT"
    runs = [u[r * 10 : (r + 1) * 10] for r in range(4)]  # urls[r * k:(r + 1) * k]
    assert split_or_not(runs[0], runs[1], world=4) == "SPLIT"
    assert split_or_not(runs[3], runs[1], ranks=(3, 1), world=4) == "SPLIT"  # a run of 10 between them
    uneven = [u[0:10], u[10:20], u[20:30], u[30:39]]  # array_split of 39: 10, 10, 10, 9
    assert split_or_not(uneven[1], uneven[3], ranks=(1, 3), world=4) == "SPLIT"
    assert split_or_not(uneven[2], uneven[3], ranks=(2, 3), world=4) == "SPLIT"


def test_lists_of_other_loaders_or_jobs_are_not_taken_for_a_split() -> None:
    u = [f"s3://b/train/shard-{i:06d}.tar" for i in range(40)]
    assert split_or_not(u[:20], u[20:], ranks=(1, 0)) == "APART"  # rank 0 the later half: a train and a val list
    assert split_or_not(u[:10], u[10:20], ranks=(2, 3), world=4) == "APART"  # rank 2's part starts at 0
    assert split_or_not(u[:10], u[20:30], ranks=(0, 1), world=4) == "APART"  # a gap where no rank's part lies
    mixture = [f"s3://b/{name}/shard-{i:06d}.tar" for name in ("laion", "coyo") for i in range(20)]
    assert split_or_not(mixture[:20], mixture[20:]) == "APART"  # two datasets of a mixture, numbered alike
    assert split_or_not(u[:20], [v.replace("train", "other") for v in u[20:]]) == "APART"  # another job's data
    picked = random.Random(3).sample(range(1000), 40)  # two subsets of a large dataset, as long
    subset = [f"http://h/s-{i:06d}.tar" for i in picked]
    assert split_or_not(subset[:20], subset[20:]) == "APART"
    assert split_or_not(subset[:20], subset[20:], ranks=(0, 7), world=8) == "APART"
    assert split_or_not(u[:1], u[1:2], world=4) == "APART"  # a URL each
    assert split_or_not(u[:20], u[20:], own=False) == "APART"  # the agent's own list
