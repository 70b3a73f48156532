"""Jobs with lists of their own sharing one agent: uploads of consumers that died, many jobs at once.

Real agents started through the CLI, real consumer processes (tests/consumer.py) and raw
protocol clients, a real HTTP server; samples are compared with webdataset's own reader.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.helpers.streaming import reference, samples_of
from tests.helpers.waits import wait_for
from wdscache.agent.job_lists import MAX_UPLOADS
from wdscache.shared.client import AgentConnection, resolve_endpoint
from wdscache.shared.messages import Requests


def _put_first_page(cache: Path, reader: str, urls: list[str]) -> dict[str, object]:
    """A client that sends the first page of its own list and is gone before its hello (killed)."""
    conn = AgentConnection(resolve_endpoint(cache, None), timeout=10, cache_dir=cache)
    try:
        return conn.request(Requests(reader).put_urls(0, urls))
    finally:
        conn.close()


def test_uploads_of_consumers_that_died_before_their_hello_are_forgotten(
    tmp_path, dataset, start_agent, consumers, shard_server
):
    # Each upload stayed for good: after MAX_UPLOADS such deaths every job with urls= was refused
    # "too many lists being uploaded at once; try again" until the agent restarted.
    data = dataset(2, samples=5, payload=500)
    own = dataset(2, samples=5, payload=500, prefix="own", list_name="own.txt")
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--reader-timeout", "2")
    never = [shard_server.url(f"never-{i}.tar") for i in range(1000)]
    for n in range(MAX_UPLOADS):
        reply = _put_first_page(cache, f"dead/{n}", never)
        assert reply["ok"] is True, reply
    # Idle past --reader-timeout, they make room for a new upload.
    wait_for(
        lambda: _put_first_page(cache, "late", never)["ok"],
        15,
        "a new upload is still refused after the dead ones were idle past --reader-timeout",
    )
    got = samples_of(consumers(cache, "own", "--job", "own", "--urls", str(own.list_file)).wait())
    assert Counter((s["url"], s["key"]) for s in got) == Counter(reference(own.paths, own.urls).keys())
