"""The agent's URL list as a loader reads it: asked of the agent a block at a time, as the epoch reaches it.

A loader given no ``urls=`` reads the agent's list, which hello names (its ``list_id``) and sizes
(``n_urls``). The first sample needs only the URLs of the first shards of the rank's order, so the
list is not fetched whole at the start of an epoch: :class:`AgentList` asks the agent for the block
of :data:`BLOCK` URLs holding a position the first time that position is read (``get_urls``, as the
reader that said hello on the list), and keeps the blocks compactly
(:class:`~wdscache.shared.urls.Urls`) for the loader's later epochs on the same list.

Guarantees:

- A position reads the URL at that position of the list ``list_id`` names: the agent answers a
  reader with the list it said hello on, whatever edits of the list file happen meanwhile, and a
  page of any other list (an agent restarted on another list) raises :class:`WdsCacheError`.
- Blocks are kept by the loader across epochs and shared by its sessions (each asks through its
  own connection); a copy of the loader (pickle) keeps the blocks, not the connection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from ..shared.errors import WdsCacheError
from ..shared.urls import Urls, file_path

__all__ = ["BLOCK", "AgentList", "LocalPaths"]

BLOCK = 2048  # URLs asked of the agent at once: about one page of URLs of 100 characters
Ask = Callable[[int], dict[str, Any]]
"""The agent's ``get_urls`` reply for the page at an offset, asked as the reader of a session."""


class AgentList(Sequence[str]):
    """The agent's list ``list_id`` of ``n`` URLs, each block asked (through ``ask``) when first read."""

    __slots__ = ("list_id", "_n", "_blocks", "_ask")

    def __init__(self, list_id: str, n: int, ask: Ask | None = None, blocks: dict[int, Urls] | None = None) -> None:
        self.list_id = list_id
        self._n = n
        self._blocks: dict[int, Urls] = {} if blocks is None else blocks  # block number -> its URLs
        self._ask = ask

    def through(self, ask: Ask) -> AgentList:
        """The same list (its blocks shared) read through ``ask``: a session's connection and reader."""
        return AgentList(self.list_id, self._n, ask, self._blocks)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(self._n)))
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("URL index out of range")
        return self._block(i // BLOCK)[i % BLOCK]

    def __iter__(self) -> Iterator[str]:
        for b in range(-(-self._n // BLOCK)):
            yield from self._block(b)

    def _block(self, b: int) -> Urls:
        got = self._blocks.get(b)
        if got is None:
            got = self._blocks[b] = Urls(self._fetch(b * BLOCK, min((b + 1) * BLOCK, self._n)))
        return got

    def _fetch(self, start: int, stop: int) -> list[str]:
        """The URLs at ``[start, stop)``, in as many pages as the agent sends them."""
        if self._ask is None:
            raise WdsCacheError("the agent's URL list is read only through a session with the agent")
        urls: list[str] = []
        while start + len(urls) < stop:
            page = self._ask(start + len(urls))
            got = page.get("urls")
            if page.get("list_id") != self.list_id or not isinstance(got, list) or not got:
                raise WdsCacheError("the agent's URL list changed while it was being read; try again")
            urls.extend(got[: stop - start - len(urls)])
        return urls

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (a DataLoader worker's) reads through its own sessions: no connection goes with it.
        return (AgentList, (self.list_id, self._n, None, self._blocks))

    def __repr__(self) -> str:
        return f"AgentList({self.list_id!r}, {self._n} URLs, {len(self._blocks) * BLOCK} at most read)"


class LocalPaths:
    """Each local shard's ``__url__`` and ``__local_path__`` in the agent's list, made from its URL
    when a sample of it is handed out (the list is not read whole for them)."""

    def get(self, url: str) -> tuple[str, str] | None:
        return (url, file_path(url)) if url.startswith("file://") else None
