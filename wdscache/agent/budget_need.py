"""What the readers need of the budget at once, and the warning when the budget cannot hold it.

A consumer pins every shard whose samples are still in its shuffle buffer, the shard it
opens, and its window of ``--prefetch`` shards ahead; the ranks of a job share one shuffle
buffer's span. When the readers need more than the budget (or the file system, less its
free-space margin) can hold, shards they still need are evicted and downloaded again: the
agent says so, with the budget that would stop it.

Guarantees (main loop only): a pure estimate from the index's counts and sizes, of copies
cached or counted before, of shards a list read names (nothing is changed); the warning is logged once, and again only for a larger need.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from ..shared.config import format_size
from ..shared.index import ShardState
from ..shared.logs import get_logger
from .cache import ShardCache

log = get_logger(__name__)

SAMPLED = 10_000  # shards whose counts and sizes the estimate looks at (a million listed cost no more)
EULER = 0.5772156649015329  # Euler's constant, of the sum in buffer_span


def buffer_span(buffer: int, per_shard: int) -> int:
    """The shards a full shuffle buffer of ``buffer`` ids holds ids of at once, at ``per_shard``
    ids a shard, and the one being read. An id leaves the buffer at random (one out for each one
    in), so a shard's last ids linger long after it was read: of the shard read k shards back, an
    id is still there with probability about exp(-k * per_shard / buffer), and the shards with any
    id left number about buffer / per_shard * (ln a + Euler's constant), a = buffer * (1 - exp(-per_shard
    / buffer)), which is about per_shard for shards small next to the buffer (a simulation agrees to a
    few percent: 30 shards for 1,000 ids of shards of 200, where buffer / per_shard is 5)."""
    a = buffer * -math.expm1(-per_shard / buffer)
    return max(-(-buffer // per_shard), math.ceil(buffer / per_shard * (math.log(a) + EULER))) + 1


def distinct_shards(lists: Collection[Sequence[str]], enough: int) -> int:
    """How many shards ``lists`` name together, or at least ``enough``: counted one by one only
    when every list is shorter than that (a few shards each), else the longest list's length."""
    longest = max((len(urls) for urls in lists), default=0)
    if longest >= enough or len(lists) <= 1:
        return longest
    return len(set().union(*lists))


class BudgetNeed:
    """The readers' need of the budget, and its warning (warned once per larger need)."""

    def __init__(self, cache: ShardCache, prefetch: int) -> None:
        self._cache, self._prefetch = cache, prefetch
        self._warned_need = 0  # the need named by the last warning that readers need more

    def of(
        self,
        readers: Iterable[tuple[str, str, int, str]],
        lists: Mapping[str, Sequence[str]],
        held: Callable[[str], int],
        listed: Callable[[str], bool],
    ) -> tuple[int, str]:
        """Bytes the readers hold at once, and how. ``readers``: (name, job, shuffle buffer in samples,
        the id of the list it reads) of each (a plain client is a job of its own); ``lists``: those
        lists by id; ``held(name)``: how many shards reader ``name`` holds open; ``listed(url)``: a
        list read names it (the cache may hold, and its counts name, shards of lists nobody reads now)."""
        index, prefetch = self._cache.index, self._prefetch
        samples = [c for u, c in itertools.islice(index.counts.items(), SAMPLED) if c > 0 and listed(u)]
        # The copies cached now, and those counted before (a count keeps its copy's size): a cache
        # that thrashes is often empty, and its need must not drop to nothing then.
        records = itertools.islice(index.records.values(), SAMPLED)
        sizes = [r.size for r in records if r.state is ShardState.CACHED and r.size and listed(r.url)]
        counted = itertools.islice(index.counted_from.items(), SAMPLED)
        sizes += [size for u, (size, _) in counted if size > 0 and listed(u)]
        if not samples or not sizes:
            return 0, "nothing known yet"
        per_shard = max(1, sum(samples) // len(samples))
        spans: dict[str, tuple[int, int]] = {}  # job (or reader) -> (shuffle buffer, shards it holds)
        for name, job, buffer, key in readers:
            shards_held = max(buffer_span(buffer, per_shard) if buffer > 1 else 1, held(name))
            spans[job] = max(spans.get(job, (0, 0)), (buffer, min(len(lists[key]), shards_held + prefetch)))
        # Jobs on other lists hold other shards: together, as many as those lists name.
        wanted = sum(h for _, h in spans.values())
        shards = min(wanted, distinct_shards(lists.values(), wanted))
        need = shards * max(sizes)
        jobs = ", ".join(f"job {j!r} (shuffle_buffer {b}) holds up to {h}" for j, (b, h) in sorted(spans.items()))
        return need, (
            f"{jobs} shard(s) at once (the shards its shuffle buffer spans at about {per_shard} samples "
            f"a shard, the one it opens and --prefetch {prefetch} ahead), of up to "
            f"{format_size(max(sizes))} each: {format_size(need)}"
        )

    def warn(self, need: int, why: str, again: str | None = None) -> None:
        """Warn if ``need`` bytes (``why``: how) are more than the budget holds, unless a warning
        named as much already (``again``: the shard just downloaded again, if that is the occasion)."""
        cache = self._cache
        st = os.statvfs(cache.layout.root)
        usable = min(cache.limit, st.f_blocks * st.f_frsize - cache.margin)
        if need <= usable or need <= self._warned_need:
            return
        self._warned_need = need
        seen = f" ({again} was just downloaded again)" if again else ""
        log.warning(
            "readers need more than the budget holds: %s; %s of it can be used (--cache-size %s), so shards they "
            "still need are evicted and downloaded again%s; a budget of %d bytes (%s) stops it, or lower "
            "shuffle_buffer or --prefetch",
            why,
            format_size(usable),
            format_size(cache.limit),
            seen,
            need,
            format_size(need),
        )
