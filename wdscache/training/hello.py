"""A reader's hello to the agent: who it is, and the URL list it reads, exchanged in pages.

- A reader with a list of its own (the loader's ``urls=`` or ``mix=``) names it by its key;
  only when the agent does not hold it under that key (``need_urls``) is it sent, in pages
  with each shard's facts from a shard index, and the hello asked again. So a list is sent
  once per agent, however many readers and epochs use it.
- A reader without one reads the agent's list a block at a time as its epoch reaches it
  (:class:`~wdscache.training.agent_list.AgentList`), every page of the same list id: a list
  that changes while it is read is an error to try again, never a mix of two lists. The
  caller passes the list back (``known``): its blocks are kept while the agent's list stays.
- A refusal (of the reader, or of its list) raises :class:`~wdscache.shared.errors.WdsCacheError`
  naming the agent's endpoint and its reason; one marked ``retry`` (no room yet for the list) is
  asked again first, within the connection's timeout (:meth:`AgentConnection.request`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..shared.client import AgentConnection
from ..shared.errors import WdsCacheError
from ..shared.logs import get_logger
from ..shared.messages import Requests
from ..shared.protocol import pages, process_identity
from ..shared.shard_index import ShardFacts
from .agent_list import AgentList

log = get_logger(__name__)


@dataclass(frozen=True)
class ReaderHello:
    """Who says hello: rank ``rank`` of ``world_size`` of ``job``, the shuffle buffer its reads
    span (0: unshuffled), the agent it talks to, and its own list (None: the agent's) with its
    shards' facts (from a shard index, else None) and the key the agent holds it by; ``loader``:
    the loader's number in its process (the agent compares the lists of ranks of one loader)."""

    job: str
    rank: int
    world_size: int
    shuffle_buffer: int
    endpoint: str
    urls: Sequence[str] | None = None
    shards: ShardFacts | None = None
    list_id: str | None = None
    loader: int = 0
    launch: str | None = None  # the script's run the loader was made in (shared.protocol.launch_id)


def say_hello(
    conn: AgentConnection,
    name: str,
    reader: ReaderHello,
    known: AgentList | None = None,
    *,
    epoch: int | None = None,
    probe: bool = False,
) -> tuple[dict[str, Any], Sequence[str]]:
    """Say hello to the agent as ``reader`` named ``name``; returns the reply and the URL list in
    use. ``known``: the agent's list as read before (its blocks kept if it is still in use); the
    agent's list is an :class:`AgentList`, asked a block at a time as the epoch reaches it.
    ``epoch``: the job's epoch it starts (the agent gives every reader of a job's epoch one list);
    ``probe``: only to learn the list and its counts, not as a rank that reads."""
    requests = Requests(name)
    request = requests.hello(
        reader.job,
        reader.rank,
        reader.world_size,
        # The process, so that an agent on this machine notices at once when it ends (a SIGKILL).
        process=process_identity(),
        # the agent warns when pins on the shards it spans outgrow the budget
        shuffle_buffer=reader.shuffle_buffer,
        probe=probe,
        list_id=reader.list_id if reader.urls is not None else None,
        epoch=epoch,
        loader=reader.loader,
        launch=reader.launch,
    )
    hello = conn.request(request)
    if hello.get("need_urls") and reader.urls is not None:
        for offset, chunk in pages(reader.urls):
            infos = reader.shards
            shards = None if infos is None else [info.to_wire() for info in infos[offset : offset + len(chunk)]]
            page = conn.request(requests.put_urls(offset, chunk, shards))
            if not page.get("ok"):
                raise WdsCacheError(f"the agent at {reader.endpoint} refused the URL list: {page.get('error')}")
        hello = conn.request(request)
    if not hello.get("ok"):
        raise WdsCacheError(f"the agent at {reader.endpoint} refused this consumer: {hello.get('error')}")
    if isinstance(hello.get("warning"), str):  # (the agent logs it too, where the job may not look)
        log.warning("the agent at %s warns: %s", reader.endpoint, hello["warning"])
    if reader.urls is not None:
        return hello, reader.urls
    key = str(hello.get("list_id"))
    listed = known if known is not None and known.list_id == key else AgentList(key, int(hello.get("n_urls", 0)))
    return hello, listed.through(lambda offset: conn.request(requests.get_urls(offset, key)))
