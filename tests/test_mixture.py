"""A mixture's epoch arithmetic (wdscache.shared.mixture), pure: shares by largest remainder,
what repeats when, walks continued across epochs, draws with replacement, and every rank's
share and resume on positions, over random weights, sizes, world sizes and resume points."""

from __future__ import annotations

import itertools
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wdscache.shared.errors import ConfigError
from wdscache.shared.mixture import LIST, MixSpec, Mixture, check_mix_arg, shares
from wdscache.shared.sequence import RankShare, rank_length
from wdscache.training.mixing import read_mix_arg


def test_shares_round_by_largest_remainder() -> None:
    assert shares(100, [0.7, 0.3]) == [70, 30]
    assert shares(10, [1, 1, 1]) == [4, 3, 3]  # a tie: the source listed first
    assert shares(10, [2, 1]) == [7, 3]  # 6.67 and 3.33
    assert shares(7, [0.5, 0.25, 0.25]) == [3, 2, 2]  # 3.5, 1.75, 1.75: the largest remainders get one
    assert shares(3, [0.1, 0.2, 0.7]) == [0, 1, 2]  # 0.3, 0.6, 2.1: as written in decimal
    assert shares(3, [1, 1000]) == [0, 3]


@given(total=st.integers(0, 10_000), weights=st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=6))
def test_shares_sum_to_the_total_each_within_one_of_its_quota(total: int, weights: list[float]) -> None:
    got = shares(total, weights)
    assert sum(got) == total
    whole = sum(Fraction(repr(w)) for w in weights)
    for n, w in zip(got, weights):
        assert abs(n - total * Fraction(repr(w)) / whole) < 1


def _spec(
    sizes: list[list[int]],
    weights: list[float],
    total: int,
    *,
    epoch: int = 0,
    replacement: bool = False,
    shuffle_buffer: int = 20,
    seed: int = 3,
    shared: bool = False,
    shuffle: bool = True,
) -> MixSpec:
    """Sources of the given shard sizes; ``shared``: the last source lists the first source's first shard too."""
    places, counts = [], []
    for shard_sizes in sizes:
        places.append(tuple(range(len(counts), len(counts) + len(shard_sizes))))
        counts += shard_sizes
    if shared and len(sizes) > 1:
        places[-1] = places[-1] + (0,)
    mix = Mixture(tuple(f"src{i}" for i in range(len(sizes))), tuple(weights), tuple(places), total, replacement)
    return MixSpec(mix, tuple(counts), seed=seed, epoch=epoch, shuffle=shuffle, shuffle_buffer=shuffle_buffer)


sources = st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=4), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(sizes=sources, data=st.data())
def test_each_source_gives_its_share_and_repeats_only_past_its_size(
    sizes: list[list[int]], data: st.DataObject
) -> None:
    weights = data.draw(st.lists(st.floats(0.01, 100), min_size=len(sizes), max_size=len(sizes)))
    total = data.draw(st.integers(1, 150))
    shared, shuffle = data.draw(st.booleans()), data.draw(st.booleans())
    epochs = [list(_spec(sizes, weights, total, epoch=e, shared=shared, shuffle=shuffle).ids()) for e in range(3)]
    spec = _spec(sizes, weights, total, shared=shared, shuffle=shuffle)
    want = shares(total, weights)
    walked: dict[str, list[tuple[int, int]]] = {}
    for ids in epochs:
        assert len(ids) == total
        by_source = Counter(i.source for i in ids)
        assert [by_source[f"src{i}"] for i in range(len(sizes))] == want
        for i, size in enumerate(spec.sizes()):
            mine = [tuple(x) for x in ids if x.source == f"src{i}"]
            times = Counter(mine)
            assert all(shard in spec.mixture.shards[i] for shard, _ in mine)
            if want[i] <= size:
                assert set(times.values()) <= {1}
            else:
                assert set(times.values()) <= {want[i] // size, -(-want[i] // size)} and len(times) == size
            walked.setdefault(f"src{i}", []).extend(mine)
    # Successive epochs continue one walk: every sample once before any twice.
    for i, size in enumerate(spec.sizes()):
        walk = walked[f"src{i}"]
        for start in range(0, len(walk) - size + 1, size):
            assert len(set(walk[start : start + size])) == size
    assert epochs[0] == list(_spec(sizes, weights, total, shared=shared, shuffle=shuffle).ids())  # deterministic


@settings(max_examples=150, deadline=None)
@given(sizes=sources, data=st.data())
def test_every_rank_gets_an_equal_share_and_a_checkpoint_resumes_on_any_world_size(
    sizes: list[list[int]], data: st.DataObject
) -> None:
    weights = data.draw(st.lists(st.floats(0.01, 100), min_size=len(sizes), max_size=len(sizes)))
    total = data.draw(st.integers(1, 200))
    world, world2 = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    drop_last = data.draw(st.booleans())
    replacement = data.draw(st.booleans())
    spec = _spec(sizes, weights, total, replacement=replacement, epoch=data.draw(st.integers(0, 3)))
    ids = list(spec.ids())
    whole = Counter(tuple(x) for x in ids)
    per_rank = rank_length(total, world, drop_last)
    stop = data.draw(st.integers(0, per_rank))
    shares_ = [RankShare(world, r, drop_last=drop_last) for r in range(world)]
    got = [list(share.pairs(iter(ids))) for share in shares_]
    assert all(len(g) == per_rank for g in got)
    first = Counter(tuple(sid) for g in got for _, sid in g[:stop])
    resume = shares_[0].resume_after(stop)
    rest_len = total - resume.delivered(total)
    after = [list(RankShare(world2, r, resume=resume, drop_last=drop_last).pairs(iter(ids))) for r in range(world2)]
    assert all(len(a) == rank_length(rest_len, world2, drop_last) for a in after)
    rest = Counter(tuple(sid) for a in after for _, sid in a)
    # Without padding, the two parts are the epoch exactly; padding only repeats what the epoch holds.
    delivered = first + rest
    if drop_last:
        assert delivered <= whole and sum(delivered.values()) >= total - (world - 1) - (world2 - 1)
    else:
        assert not (whole - delivered) and sum((delivered - whole).values()) <= (world - 1) + (world2 - 1)
    labelled = Counter(x.source for x in ids)
    assert [labelled[f"src{i}"] for i in range(len(sizes))] == shares(total, weights)


def test_sources_are_mixed_throughout_the_epoch_in_runs_of_eight() -> None:
    labels = [x.source for x in _spec([[50, 50], [60]], [1, 1], 160).ids()]
    runs = [len(list(g)) for _, g in itertools.groupby(labels)]
    assert len(runs) > 8 and all(n % 8 == 0 for n in runs)  # whole runs of 8 (80 each: no short run)
    even = [x.source for x in _spec([[50, 50], [60]], [1, 1], 160, shuffle=False).ids()]
    assert [len(list(g)) for _, g in itertools.groupby(even)] == [8] * 20  # unshuffled: taking turns


def test_draws_with_replacement_are_seeded_per_epoch_and_whole_shards() -> None:
    def one(epoch: int, seed: int = 0) -> list[tuple[int, int]]:
        spec = _spec([[5, 5, 5, 5]], [1], 40, epoch=epoch, replacement=True, shuffle_buffer=0, seed=seed)
        return [tuple(x) for x in spec.ids()]

    assert one(0) == one(0) and one(0) != one(1) and one(0) != one(0, seed=1)
    draw = one(0)
    for k in range(0, 40, 5):  # unshuffled: each drawn shard's samples in order
        assert [j for _, j in draw[k : k + 5]] == list(range(5)) and len({s for s, _ in draw[k : k + 5]}) == 1
    assert len({s for s, _ in draw}) < 4 or Counter(s for s, _ in draw).most_common(1)[0][1] > 10  # with replacement


def test_a_source_without_samples_and_bad_weights_are_refused() -> None:
    with pytest.raises(ConfigError, match="src1.*no samples"):
        _spec([[3], [0]], [1, 1], 10)
    for bad in (0, -1, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ConfigError, match="positive finite"):
            check_mix_arg({"a.txt": bad})
    with pytest.raises(ConfigError, match="dict"):
        check_mix_arg(["a.txt"])
    with pytest.raises(ConfigError, match="at least one"):
        check_mix_arg({})


def test_a_weight_is_any_real_number_but_a_bool() -> None:
    np = pytest.importorskip("numpy")
    read = np.array([3, 1])  # weights a config gave as numpy's
    assert check_mix_arg({"a.txt": read[0], "b.txt": read[1]}) == [("a.txt", 3.0), ("b.txt", 1.0)]
    pairs = check_mix_arg({"a.txt": np.float32(0.75), "b.txt": Fraction(1, 4)})
    assert pairs == [("a.txt", 0.75), ("b.txt", 0.25)] and all(type(w) is float for _, w in pairs)
    mixture = Mixture(("a", "b", "c"), (np.int64(2), np.float32(1.5), Fraction(1, 2)), ((0,), (1,), (2,)), 8)
    assert mixture.weights == (2.0, 1.5, 0.5)
    assert mixture.shares() == [4, 3, 1]
    with pytest.raises(ConfigError, match="positive finite"):
        check_mix_arg({"a.txt": np.bool_(True)})
    # Real numbers that no float holds: refused, naming the source, not an OverflowError.
    for bad in (10**400, Fraction(10**400, 3), Fraction(1, 10**400)):
        with pytest.raises(ConfigError, match=r"mix\['a.txt'\]=.*within a float's range"):
            check_mix_arg({"a.txt": bad})
        with pytest.raises(ConfigError, match=r"mix\['a'\]=.*within a float's range"):
            Mixture(("a",), (bad,), ((0,),), 8)


def test_epoch_samples_is_any_integer_but_a_bool() -> None:
    np = pytest.importorskip("numpy")
    _, arg = read_mix_arg("http://h/a-{0..1}.tar", None, np.int64(10), True)
    assert arg is not None and arg.epoch_samples == 10 and type(arg.epoch_samples) is int
    for bad in (True, 2.5, np.float64(10), 0):
        with pytest.raises(ConfigError, match=r"epoch_samples=.* must be a whole number >= 1"):
            read_mix_arg("http://h/a-{0..1}.tar", None, bad, True)


@settings(max_examples=50, deadline=None)
@given(sizes=sources, data=st.data())
def test_the_counts_per_shard_and_the_order_name_the_epochs_shards(sizes: list[list[int]], data: st.DataObject) -> None:
    weights = data.draw(st.lists(st.floats(0.01, 100), min_size=len(sizes), max_size=len(sizes)))
    spec = _spec(
        sizes,
        weights,
        data.draw(st.integers(1, 150)),
        epoch=data.draw(st.integers(0, 5)),
        replacement=data.draw(st.booleans()),
        shared=data.draw(st.booleans()),
    )
    ids = [x[0] for x in spec.ids()]
    assert spec.totals() == Counter(ids)  # what lets the stream let go of a shard's pin
    assert sorted(spec.order()) == sorted(set(ids))  # the prefetch window's shards, each once


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_mixtures_ids_come_in_lists_that_ranks_deal_as_they_deal_its_ids_one_by_one(shuffle: bool) -> None:
    spec = _spec([[50, 50, 7], [60, 3]], [2, 1], 1500, shuffle=shuffle)
    lists = list(spec.runs())
    assert [len(ids) >= LIST for ids in lists] == [True] * (len(lists) - 1) + [False]  # the rest at the end
    one_by_one = list(spec.ids())
    assert [sid for ids in lists for sid in ids] == one_by_one and len(one_by_one) == 1500
    assert [type(sid) for ids in lists for sid in ids] == [type(sid) for sid in one_by_one]  # each names its source
    for world in (1, 3, 8):
        for rank in {0, world - 1}:
            assert list(RankShare(world, rank).pairs(lists)) == list(RankShare(world, rank).pairs(one_by_one))
