"""An epoch's shard order: as listed it holds nothing, shuffled it is the seeded permutation,
and a shard's position is found without a scan."""

from __future__ import annotations

import tracemalloc

from wdscache.shared.plan import Reader, ShardOrder, epoch_rng, shard_order


def test_the_order_as_listed_costs_nothing_whatever_the_lists_length():
    tracemalloc.start()
    try:
        order = shard_order(10**9, seed=0, epoch=0, shuffle=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"{peak} bytes allocated for an order as listed: it holds no shard numbers"
    assert len(order) == 10**9 and order[5] == 5 and order[3:6] == (3, 4, 5)
    assert order.position(123_456_789) == 123_456_789 and order.position(10**9) == -1


def test_the_shuffled_order_is_the_seeded_permutation_with_positions_looked_up():
    expected = list(range(1000))
    epoch_rng(7, 3, "shards").shuffle(expected)
    order = shard_order(1000, seed=7, epoch=3, shuffle=True)
    assert order == tuple(expected) and list(order) == expected
    assert order[10:13] == tuple(expected[10:13])
    assert all(order.position(s) == expected.index(s) for s in (0, 1, 500, 999))
    assert order.index(expected[40], 40) == 40 and order.position(1000) == -1


def test_a_nodes_part_is_read_in_the_order_of_its_own_shards():
    part = (9, 4, 7, 2)
    reader = Reader("r", 10, seed=1, shuffle=True, shards=part)
    mine = [part[i] for i in shard_order(len(part), seed=1, epoch=0, shuffle=True)]
    assert reader.order(0) == tuple(mine) and reader.window(3) == mine[:3]
    reader.advance_to(mine[2])
    assert reader.position == 2
    assert ShardOrder.of(part).position(7) == 2


def test_a_window_makes_the_next_epochs_order_only_when_it_reaches_it():
    """A shuffled order of a million shards takes about half a second: the agent plans its
    start-up window from one epoch's, and only a window across the epoch's end makes the next."""
    shard_order.cache_clear()
    reader = Reader("r", n_shards=1000, seed=3)
    first = reader.window(8)
    assert first == list(shard_order(1000, seed=3, epoch=0, shuffle=True)[:8])
    assert shard_order.cache_info().misses == 1
    reader.position = 996
    across = reader.window(8)
    assert across == list(shard_order(1000, seed=3, epoch=0, shuffle=True)[996:]) + list(
        shard_order(1000, seed=3, epoch=1, shuffle=True)[:4]
    )
    assert shard_order.cache_info().misses == 2
