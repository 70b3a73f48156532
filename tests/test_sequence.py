"""How an epoch's positions are dealt to ranks, and how a checkpoint resumes them.

Pure functions, so checked here over many shapes: every rank the same count,
every sample exactly once (plus the padding), through any chain of checkpoints
taken at any point and resumed with any world size.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Iterable
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wdscache import CachedMultiLoader
from wdscache.shared.plan import epoch_rng
from wdscache.shared.sequence import (
    BLOCK,
    INITIAL,
    EpochSpec,
    IdRun,
    RankShare,
    Resume,
    SampleId,
    ShardFeed,
    buffered,
    rank_length,
    slice_of,
)


def ids(n: int) -> list[SampleId]:
    return [(0, i) for i in range(n)]


def deal(
    total: int, world: int, resume: Resume, drop_last: bool, block: int, stop: int | None = None, ahead: int = 0
) -> tuple[list[RankShare], list[list[SampleId]]]:
    """Every rank's share, each cut after ``stop`` samples if given; rank r has read
    ``r * ahead`` pairs past those (as a loader's requests run ahead of its user)."""
    shares = [RankShare(world, r, resume=resume, drop_last=drop_last, block=block) for r in range(world)]
    got: list[list[SampleId]] = []
    for r, share in enumerate(shares):
        pairs = [
            sid for _, sid in itertools.islice(share.pairs(ids(total)), None if stop is None else stop + r * ahead)
        ]
        got.append(pairs[:stop])
    return shares, got


def test_each_rank_takes_blocks_of_neighbouring_positions_then_one_at_a_time() -> None:
    share = RankShare(4, 1)
    positions = [pos for pos, _ in share.pairs(ids(100))]
    # rows of 4 * 8: rank 1 takes the second block of each; the 4 left over are dealt singly
    assert positions == [*range(8, 16), *range(40, 48), *range(72, 80), 97]
    assert BLOCK == 8


def test_last_row_is_padded_from_the_start_or_cut() -> None:
    padded = [sid for _, sid in RankShare(4, 3, block=2).pairs(ids(10))]
    # 8 positions in one row of blocks; 2 left for ranks 0 and 1; ranks 2 and 3 wrap around
    assert padded == [(0, 6), (0, 7), (0, 1)]
    cut = [sid for _, sid in RankShare(4, 3, drop_last=True, block=2).pairs(ids(10))]
    assert cut == [(0, 6), (0, 7)]


def stalling(n: int) -> Iterable[SampleId | None]:
    """The ids of a shard still downloading: each one after a "no more yet"."""
    for sid in ids(n):
        yield None
        yield sid


def test_one_rank_gets_each_sample_as_it_arrives() -> None:
    out = list(RankShare(1, 0).pairs(stalling(3)))
    assert out == [None, (0, (0, 0)), None, (1, (0, 1)), None, (2, (0, 2))]


def test_with_more_ranks_a_block_waits_for_its_row() -> None:
    out = list(RankShare(2, 0, block=2).pairs(stalling(4)))
    assert out == [None, None, None, None, (0, (0, 0)), (1, (0, 1))]


def test_checkpoint_inside_blocks_names_the_delivered_positions() -> None:
    shares, got = deal(40, 3, Resume(), False, 8, stop=5)
    at = shares[0].resume_after(5)
    assert at == Resume(5, ((8, 13), (16, 21)))
    assert all(s.resume_after(5) == at for s in shares)  # any rank's checkpoint is the job's
    assert {sid for mine in got for sid in mine} == {(0, p) for p in range(40) if at.skips(p)}
    assert [at.real(v) for v in range(5)] == [5, 6, 7, 13, 14]


def test_resume_normal_form() -> None:
    assert Resume.of(3, [[5, 7], [3, 4], [6, 9], [12, 12]]) == Resume(4, ((5, 9),))
    assert Resume.of(0, [[0, 2], [2, 5]]) == Resume(5, ())
    assert Resume.of(10, [[2, 4]]) == Resume(10, ())
    assert Resume(5, ((8, 13),)).delivered() == 10


@settings(max_examples=400, deadline=timedelta(seconds=2))
@given(
    total=st.integers(0, 120),
    block=st.integers(1, 6),
    drop_last=st.booleans(),
    hops=st.lists(st.tuples(st.integers(1, 7), st.floats(0, 1), st.integers(0, 6)), max_size=3),
    last_world=st.integers(1, 7),
    ahead=st.sampled_from([0, 1, 9]),
)
def test_any_chain_of_checkpoints_delivers_each_sample_once_with_equal_counts(
    total: int, block: int, drop_last: bool, hops: list[tuple[int, float, int]], last_world: int, ahead: int
) -> None:
    resume = Resume()
    delivered: Counter[SampleId] = Counter()
    for world, fraction, who in hops:
        per_rank = rank_length(total - resume.delivered(), world, drop_last)
        stop = int(fraction * per_rank)
        shares, got = deal(total, world, resume, drop_last, block, stop, ahead)
        assert [len(mine) for mine in got] == [stop] * world
        for mine in got:
            delivered.update(mine)
        resume = shares[who % world].resume_after(stop)
        assert all(s.resume_after(stop) == resume for s in shares)  # any rank's checkpoint is the job's
        if stop < per_rank:  # no padding yet: what was delivered is exactly what resume names
            assert set(delivered) == {(0, p) for p in range(total) if resume.skips(p)}
            assert sum(delivered.values()) == resume.delivered()
        state = json.loads(json.dumps({"position": resume.position, "done": [list(r) for r in resume.done]}))
        assert Resume.of(state["position"], state["done"]) == resume  # it travels as JSON
    before = sum(delivered.values())
    shares, got = deal(total, last_world, resume, drop_last, block)
    assert [len(mine) for mine in got] == [rank_length(total - resume.delivered(), last_world, drop_last)] * last_world
    for mine in got:
        delivered.update(mine)
    if drop_last:
        assert max(delivered.values(), default=1) == 1
    elif resume.delivered() < total:  # the last run finishes the epoch: it alone pads, by less than W
        assert set(delivered) == set(ids(total))
        assert 0 <= sum(delivered.values()) - before - (total - resume.delivered()) < last_world


def test_loader_reads_a_version_1_checkpoint_and_refuses_a_malformed_one(tmp_path) -> None:
    loader = CachedMultiLoader(["http://127.0.0.1:9/a.tar"], cache_dir=tmp_path, shuffle=False)
    loader.load_state_dict(
        {
            "version": 1,
            "epoch": 2,
            "position": 7,
            "seed": 0,
            "shuffle": False,
            "shuffle_buffer": 1000,
            "drop_last": False,
            "urls": None,
        }
    )
    state = loader.state_dict()
    assert (state["version"], state["epoch"], state["position"], state["done"]) == (2, 2, 7, [])
    loader.load_state_dict({**state, "done": [[9, 12]]})
    assert loader.state_dict()["done"] == [[9, 12]]
    for done in ([[1, "x"]], [[-5, 3]], [[4, 4]], [[1.5, 3]], [[True, 3]], [[1, 2, 3]], {"a": 1}):
        with pytest.raises(ValueError, match="'done'"):
            loader.load_state_dict({**state, "done": done})
    for bad in ({"position": -1}, {"position": "7"}, {"epoch": None}):
        with pytest.raises(ValueError, match="'epoch' and 'position'"):
            loader.load_state_dict({**state, **bad})
    # a version 1 checkpoint has no runs: any "done" in it is not ours to read
    loader.load_state_dict({**state, "version": 1, "done": [[9, 12]]})
    assert loader.state_dict()["done"] == []


def test_resume_counts_only_positions_in_the_epoch() -> None:
    assert Resume.of(5, [[8, 20]]).delivered(10) == 7
    with pytest.raises(ValueError, match="Resume.of"):
        Resume(5, ((3, 8),))


def test_settled_ids_are_those_no_longer_waiting_in_a_row() -> None:
    share = RankShare(2, 1, block=2)
    pairs = share.pairs(ids(6))
    assert next(pairs) == (2, (0, 2))  # the row of ids 0..3 is full: our block is 2, 3
    assert share.settled == 0  # our block is being handed out
    assert next(pairs) == (3, (0, 3))
    assert list(pairs) == [(5, (0, 5))]
    assert share.settled == 6


def dealt_plainly(
    epoch: list[SampleId], world: int, rank: int, resume: Resume, drop_last: bool, block: int
) -> list[tuple[int, SampleId]]:
    """A rank's pairs by the rule itself: the positions not delivered, cut into rows of
    ``world * block`` (the rank's block of each), the rest one at a time, padded from the start."""
    left = [sid for p, sid in enumerate(epoch) if not resume.skips(p)]
    row = world * block
    full = len(left) // row if world > 1 else 0
    out = [(k * row + j, left[k * row + j]) for k in range(full) for j in range(rank * block, rank * block + block)]
    base = full * row
    tail = left[base:]
    cut = len(tail) - len(tail) % world
    out += [(base + j, tail[j]) for j in range(rank, cut, world)]
    if len(tail) > cut and not drop_last:
        first = epoch[:world]  # the epoch's first ids, delivered or not
        fill = tail[cut:] + [first[i % len(first)] for i in range(world - (len(tail) - cut))]
        out.append((base + cut + rank, fill[rank]))
    return out


PIECES = st.sampled_from(["ids", "run", "list"])


def fed_in_pieces(
    counts: list[int], cuts: list[tuple[int, str]]
) -> tuple[list[SampleId | IdRun | list[SampleId] | None], list[SampleId | None]]:
    """The ids of shards of ``counts`` samples as a shard feed supplies them: pieces of the
    lengths ``cuts`` cycles through, each (as the cut says) single ids, a run of one shard's
    neighbouring samples, or a list of ids (as the shuffle buffer gives them out), then "no
    more yet"; and the same ids one by one."""
    fed: list[SampleId | IdRun | list[SampleId] | None] = []
    one_by_one: list[SampleId | None] = []
    step = itertools.cycle(cuts)
    for s, n in enumerate(counts):
        j = 0
        while j < n:
            size, kind = next(step)
            size = min(size, n - j)
            ids = [(s, i) for i in range(j, j + size)]
            fed += [IdRun(s, j, j + size)] if kind == "run" else [ids] if kind == "list" else ids
            one_by_one += [(s, i) for i in range(j, j + size)]
            fed.append(None)
            one_by_one.append(None)
            j += size
    return fed, one_by_one


@settings(max_examples=300, deadline=timedelta(seconds=2))
@given(
    counts=st.lists(st.integers(0, 40), max_size=6),
    world=st.integers(1, 70),
    block=st.integers(1, 9),
    drop_last=st.booleans(),
    position=st.integers(0, 60),
    runs=st.lists(st.tuples(st.integers(0, 240), st.integers(1, 30)), max_size=5),
    cuts=st.lists(st.tuples(st.integers(1, 12), PIECES), min_size=1, max_size=8),
    seed=st.integers(0, 3),
)
def test_runs_and_lists_of_ids_are_dealt_as_the_same_ids_one_by_one(
    counts: list[int],
    world: int,
    block: int,
    drop_last: bool,
    position: int,
    runs: list[tuple[int, int]],
    cuts: list[tuple[int, str]],
    seed: int,
) -> None:
    epoch = [(s, j) for s, n in enumerate(counts) for j in range(n)]
    resume = Resume.of(min(position, len(epoch)), [(a, a + n) for a, n in runs])
    fed, one_by_one = fed_in_pieces(counts, cuts[seed % len(cuts) :] + cuts[: seed % len(cuts)])
    for rank in {0, world // 2, world - 1}:
        want = dealt_plainly(epoch, world, rank, resume, drop_last, block)
        by_runs = RankShare(world, rank, resume=resume, drop_last=drop_last, block=block)
        by_ids = RankShare(world, rank, resume=resume, drop_last=drop_last, block=block)
        seen_runs = [(p, by_runs.settled) for p in by_runs.pairs(fed) if p is not None]
        seen_ids = [(p, by_ids.settled) for p in by_ids.pairs(one_by_one) if p is not None]
        assert [p for p, _ in seen_runs] == want
        assert seen_runs == seen_ids  # what was settled when each pair came out too
        assert (by_runs.full_rows, by_runs.tail, by_runs.settled) == (by_ids.full_rows, by_ids.tail, len(epoch))
        assert by_runs.count == by_ids.count == len(want)
        for n in {0, 1, len(want) // 2, len(want)}:
            assert by_runs.resume_after(n) == by_ids.resume_after(n)


@settings(max_examples=300, deadline=timedelta(seconds=2))
@given(
    counts=st.lists(st.integers(0, 60), max_size=6),
    world=st.sampled_from([1, 1, 2, 3, 5]),
    block=st.integers(1, 9),
    drop_last=st.booleans(),
    position=st.integers(0, 60),
    runs=st.lists(st.tuples(st.integers(0, 240), st.integers(1, 30)), max_size=4),
    cuts=st.lists(st.tuples(st.integers(1, 40), PIECES), min_size=1, max_size=6),
    parts=st.integers(1, 9),
    skip=st.integers(0, 40),
)
def test_a_slice_made_by_the_share_is_the_slice_of_the_whole_share(
    counts: list[int],
    world: int,
    block: int,
    drop_last: bool,
    position: int,
    runs: list[tuple[int, int]],
    cuts: list[tuple[int, str]],
    parts: int,
    skip: int,
) -> None:
    """A DataLoader worker's slice, made by the share (only its pairs, runs by arithmetic), is
    the slice filter over the whole share: the same pairs, the same Nones between them, the
    same record of what was settled at each pair and of how the rows were dealt."""
    epoch = [(s, j) for s, n in enumerate(counts) for j in range(n)]
    resume = Resume.of(min(position, len(epoch)), [(a, a + n) for a, n in runs])
    fed, _ = fed_in_pieces(counts, cuts)
    for rank in {0, world - 1}:
        for part in {0, parts // 2, parts - 1}:
            made = RankShare(world, rank, resume=resume, drop_last=drop_last, block=block)
            whole = RankShare(world, rank, resume=resume, drop_last=drop_last, block=block)
            got = [(p, made.settled) for p in made.pairs(fed, part=part, parts=parts, skip=skip)]
            want = [(p, whole.settled) for p in slice_of(whole.pairs(fed), part, parts, skip, block)]
            assert got == want
            assert (made.full_rows, made.tail, made.settled) == (whole.full_rows, whole.tail, whole.settled)
            assert made.count == whole.count  # the whole share's pairs, whichever slice was made


def shuffled_one_by_one(ids: Iterable[SampleId], rng: random.Random, size: int) -> Iterable[SampleId]:
    """The shuffle buffer as :func:`~wdscache.shared.sequence.global_sequence` documents it,
    an id at a time with ``randrange``: the reference the epochs' sequences must keep to."""
    initial = min(size, INITIAL)
    buf: list[SampleId] = []
    for arrived, sid in enumerate(ids, 1):
        buf.append(sid)
        if len(buf) >= size or (len(buf) >= initial and arrived % 2 == 0):
            k = rng.randrange(len(buf))
            buf[k], buf[-1] = buf[-1], buf[k]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


@settings(max_examples=200, deadline=timedelta(seconds=2))
@given(
    counts=st.lists(st.integers(0, 300), min_size=1, max_size=5),
    size=st.sampled_from([2, 3, 7, 100, 101, 1000]),
    cuts=st.lists(st.integers(0, 90), min_size=1, max_size=6).filter(any),
    seed=st.integers(0, 3),
)
def test_the_shuffle_buffer_gives_one_sequence_however_its_ids_arrive(
    counts: list[int], size: int, cuts: list[int], seed: int
) -> None:
    spec = EpochSpec(len(counts), seed=seed, epoch=seed, shuffle=True, shuffle_buffer=size)
    order = list(spec.order())
    every = [(s, j) for s in order for j in range(counts[s])]
    want = list(shuffled_one_by_one(every, epoch_rng(seed, seed, "samples"), size))
    assert sorted(want) == sorted(every)
    # in pieces of any length, "no more yet" (None) between them: the same ids, the Nones passed on
    step = itertools.cycle(cuts)
    pieces: list[list[SampleId] | None] = []
    at = 0
    while at < len(every):
        n = next(step)
        pieces += [every[at : at + n], None]
        at += n
    out = list(buffered(pieces, epoch_rng(seed, seed, "samples"), size))
    assert [sid for got in out if got is not None for sid in got] == want
    assert out.count(None) == pieces.count(None) and len(out) == len(pieces) + 1  # a list per piece, then the rest
    # the epoch's ids one by one, and as the lists an epoch's stream deals, fed as a shard feed supplies them
    assert list(spec.ids(lambda s: range(counts[s]))) == want
    feed, dealt, given = ShardFeed(), [], dict.fromkeys(order, 0)
    for got in spec.runs(feed):
        if got is not None:
            assert isinstance(got, list) and got
            dealt += got
            continue
        shard = feed.wanted
        assert shard is not None
        if given[shard] == counts[shard]:
            feed.end()
        else:
            given[shard] = min(counts[shard], given[shard] + next(step))
            feed.grow(given[shard])
    assert dealt == want
