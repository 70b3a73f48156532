"""Partial downloads kept for a resume that no list names: removed after a while, never left forever.

A partial file kept for a Range resume (:meth:`~wdscache.agent.cache.ShardCache.abandon`, or
found at start by :func:`~wdscache.agent.recovery.recover`) counts against the budget and is the
first thing removed when a reservation needs room. A restart keeps every one with a validator,
whatever shard it is: a job's own list does not outlive the agent, so the new run cannot tell
which of them a job will name again when it comes back.

Guarantees (main loop only; :class:`~wdscache.agent.readers.Readers` owns one):

- A kept partial that no list the agent holds names (its own, or one a reader reads) for
  ``UNNAMED_GRACE`` seconds of the agent's run is removed
  (:meth:`~wdscache.agent.cache.ShardCache.drop_partial`);
  one named again in time is resumed when a reader wants its shard. It goes between
  ``UNNAMED_GRACE`` and ``UNNAMED_GRACE + CHECK_EVERY`` seconds after it was first seen unnamed.
- A look every ``CHECK_EVERY`` seconds at the kept partials alone, never at every shard.
"""

from __future__ import annotations

from collections.abc import Callable

from ..shared.logs import get_logger
from .cache import ShardCache

log = get_logger(__name__)

# A job requeued after a restart (its node's agent's, or its own) is usually back within minutes;
# a partial waiting longer costs nothing the budget needs (it goes first when room is needed).
UNNAMED_GRACE = 3600.0
CHECK_EVERY = 30.0  # seconds between looks: a partial's name is looked up in every list held


class UnnamedPartials:
    """When each kept partial of ``cache`` was first seen that ``named`` (a URL) said no list names."""

    def __init__(self, cache: ShardCache, named: Callable[[str], bool], now: float) -> None:
        self._cache, self._named = cache, named
        self._since: dict[str, float] = {}  # url of a kept partial -> when it was first seen unnamed
        self._next = now + CHECK_EVERY

    def check(self, now: float) -> list[str]:
        """Remove the kept partials unnamed for ``UNNAMED_GRACE`` by ``now`` (at most a look every
        ``CHECK_EVERY`` seconds); the URLs removed."""
        if now < self._next:
            return []
        self._next = now + CHECK_EVERY
        kept = self._cache.kept
        # Resumed or removed meanwhile: if it is kept again later, its clock starts again.
        self._since = {url: t for url, t in self._since.items() if url in kept}
        removed = []
        for url in list(kept):
            if self._named(url):
                self._since.pop(url, None)
            elif now - self._since.setdefault(url, now) >= UNNAMED_GRACE:
                log.info("removing the partial download of %s: no list named it for %.0f s", url, UNNAMED_GRACE)
                self._cache.drop_partial(url)
                self._since.pop(url)
                removed.append(url)
        return removed
