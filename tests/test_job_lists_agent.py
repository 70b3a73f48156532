"""Jobs with lists of their own sharing one agent: uploads of consumers that died, many jobs at once.

Real agents started through the CLI, real consumer processes (tests/consumer.py) and raw
protocol clients, a real HTTP server; samples are compared with webdataset's own reader.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.helpers.streaming import delivered, reference, samples_of
from wdscache import CachedMultiLoader
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
    # Told to try again, the job's loader does (within its timeout) until the dead ones, idle past
    # --reader-timeout, make room for its list.
    job = consumers(cache, "own", "--job", "own", "--urls", str(own.list_file), "--timeout", "30")
    got = samples_of(job.wait())
    assert Counter((s["url"], s["key"]) for s in got) == Counter(reference(own.paths, own.urls).keys())


def test_more_jobs_with_lists_of_their_own_than_there_once_were_places_all_read_their_epochs(
    tmp_path, dataset, start_agent
):
    # The agent held 16 such lists at most: the 17th job was refused "the agent holds 16 URL lists
    # of running jobs", although any number of jobs share one agent.
    data = dataset(1, samples=2, payload=200)
    jobs = [dataset(1, samples=3, payload=200, prefix=f"j{n}", list_name=f"j{n}.txt") for n in range(20)]
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "1")
    loaders = [
        CachedMultiLoader(ds.urls, cache_dir=cache, job=f"j{n}", timeout=30, shuffle=False) for n, ds in enumerate(jobs)
    ]
    streams = [iter(loader) for loader in loaders]
    firsts = [next(stream) for stream in streams]  # every job reads at once, none has ended
    agent.wait_stats(lambda s: s["agent"]["job_lists"] == len(jobs), 10, "every job's list held at once")
    for ds, first, stream in zip(jobs, firsts, streams):
        assert delivered([first, *stream]) == reference(ds.paths, ds.urls)
