"""A shard cached by an earlier agent is checked against its source before it is served."""

from __future__ import annotations


from shards import make_shard, synth_samples

from wdscache import ShardClient


def test_changed_shard_is_fetched_again_unchanged_one_is_not(tmp_path, shard_server, dataset, start_agent):
    data = dataset(2, samples=3, payload=1000)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "shards never cached")
    assert agent.stop() == 0
    # The server's copy of shard 1 changes (new content, new size, new ETag).
    make_shard(data.paths[1], synth_samples(1, 5, payload=1500, seed=99))
    shard_server.reset_log()
    agent = start_agent(cache, data.list_file, "--prefetch", "2", "--no-shuffle")
    with ShardClient(cache, timeout=20) as client:
        for url, path in zip(data.urls, data.paths):
            assert client.open(url).read_bytes() == path.read_bytes()
            client.release(url)
        stats = client.stats()
    assert stats["changed"] == 1
    assert [c["url"] for c in stats["agent"]["changed"]] == [data.urls[1]]
    assert shard_server.count(data.paths[0].name) == 0  # unchanged: checked by HEAD, not fetched
    assert shard_server.count(data.paths[1].name) == 1
    assert "changed on the server" in agent.stderr_text()
