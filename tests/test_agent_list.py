"""The agent's list as a loader reads it: each block asked of the agent once, when first read;
a page of another list refused; a copy keeps the blocks read, not the connection."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from wdscache.shared.errors import WdsCacheError
from wdscache.shared.protocol import PAGE_BYTES
from wdscache.shared.urls import Urls
from wdscache.training.agent_list import BLOCK, AgentList, LocalPaths

N = 5 * BLOCK + 17
URLS = Urls(f"http://h/shard-{i:07d}.tar" for i in range(N))


class Agent:
    """Answers get_urls as the agent does (pages of PAGE_BYTES), counting the pages asked."""

    def __init__(self, list_id: str = "L", urls: Urls = URLS) -> None:
        self.list_id, self.urls, self.asked = list_id, urls, [0]

    def ask(self, offset: int) -> dict[str, Any]:
        self.asked[0] += 1
        return {"ok": True, "list_id": self.list_id, "urls": self.urls.page(offset, PAGE_BYTES)}


def test_a_position_asks_only_for_its_block_and_reads_the_url_at_it():
    agent = Agent()
    listed = AgentList("L", N).through(agent.ask)
    assert len(listed) == N
    assert listed[3 * BLOCK + 5] == URLS[3 * BLOCK + 5]
    assert listed[-1] == URLS[N - 1]
    asked = agent.asked[0]
    assert asked == 2  # two blocks, each in one page
    assert listed[3 * BLOCK : 3 * BLOCK + 3] == tuple(URLS[3 * BLOCK : 3 * BLOCK + 3])
    assert agent.asked[0] == asked  # read again from the blocks kept
    assert list(listed) == list(URLS)
    with pytest.raises(IndexError):
        listed[N]


def test_the_blocks_read_serve_every_session_on_the_list_and_go_with_a_copy():
    first = Agent()
    listed = AgentList("L", N)
    assert listed.through(first.ask)[0] == URLS[0]
    later = Agent()
    assert listed.through(later.ask)[1] == URLS[1] and later.asked[0] == 0
    copy = pickle.loads(pickle.dumps(listed))
    assert copy[2] == URLS[2]
    with pytest.raises(WdsCacheError, match="through a session"):
        copy[N - 1]  # a block nobody read: the copy has no connection of its own yet


def test_a_page_of_another_list_is_refused():
    listed = AgentList("L", N).through(Agent(list_id="other").ask)
    with pytest.raises(WdsCacheError, match="changed while it was being read"):
        listed[0]


def test_local_paths_are_made_from_file_urls_alone():
    assert LocalPaths().get("file:///data/a.tar") == ("file:///data/a.tar", "/data/a.tar")
    assert LocalPaths().get("http://h/a.tar") is None
