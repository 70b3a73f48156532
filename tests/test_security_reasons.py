"""Secrets a source's own text carries (a library's error quoting the endpoint's user info, a server's
reason phrase quoting a signed query) reach no error's ``reason``, no failure the agent records or
answers, no stats object and no log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import wdscache
from wdscache import FetchError, ShardClient


def _index_bytes(cache: Path) -> str:
    """Every file of the cache's index (the database and its journal), as text: what it records."""
    return "".join(p.read_bytes().decode("latin-1") for p in (cache / "index").rglob("*") if p.is_file())


@pytest.mark.slow
def test_an_s3_endpoints_user_info_reaches_no_reason_record_or_stats(tmp_path, start_agent, run_cli) -> None:
    pytest.importorskip("boto3")
    secret = "SECRETXYZEP"
    urls_file = tmp_path / "s3.txt"
    urls_file.write_text("s3://bkt/train/a.tar\n")
    cache = tmp_path / "cache"
    # Nothing listens on port 1: botocore's error quotes the endpoint URL it could not reach.
    agent = start_agent(
        cache,
        urls_file,
        "--s3-endpoint-url",
        f"http://eu:{secret}@127.0.0.1:1",
        "--retries",
        "1",
        env={"AWS_ACCESS_KEY_ID": "AKIAFAKE", "AWS_SECRET_ACCESS_KEY": "FAKEKEY", "AWS_DEFAULT_REGION": "us-east-1"},
    )
    agent.wait_stats(lambda s: s["shards"]["failed"] == 1, 60, "the s3:// shard failed")
    with ShardClient(cache, timeout=30) as client:
        with pytest.raises(FetchError) as info:
            client.open("s3://bkt/train/a.tar", timeout=30)
        live = client.stats()
    assert "http://***@127.0.0.1:1" in info.value.reason, info.value.reason
    shown = [info.value.reason, str(info.value), json.dumps(live), json.dumps(wdscache.collect_stats(cache))]
    assert agent.stop() == 0
    shown += [json.dumps(wdscache.collect_stats(cache)), _index_bytes(cache), agent.stderr_text()]
    assert [t for t in shown if secret in t] == []


@pytest.mark.slow
def test_a_reason_phrase_quoting_a_signed_query_reaches_no_reason_record_or_stats(
    tmp_path, dataset, shard_server, start_agent
) -> None:
    secret, token = "SECRETXYZ9", "SECRETTOKENQ"
    data = dataset(1, samples=1, payload=100)
    name = data.paths[0].name
    url = f"{data.urls[0]}?token={token}"  # (the server ignores the query)
    data.list_file.write_text(url + "\n")
    shard_server.fail(name, "status", status=403, reason=f"Denied /{name}?X-Amz-Signature={secret}", times=50)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--retries", "0")
    agent.wait_stats(lambda s: s["shards"]["failed"] == 1, 20, "the refused shard failed")
    with ShardClient(cache, timeout=30) as client:
        with pytest.raises(FetchError) as info:
            client.open(url, timeout=30)
        live = client.stats()
    assert info.value.reason == f"HTTP 403 Denied /{name}?X-Amz-Signature=***", info.value.reason
    # The stats object as `wdscache stats --json` prints it: the URL redacted too.
    failed = [{"url": f"{data.urls[0]}?token=***", "error": info.value.reason}]
    assert live["failed"] == failed, live["failed"]
    assert wdscache.collect_stats(cache)["failed"] == failed
    shown = [str(info.value), json.dumps(live)]
    assert agent.stop() == 0
    assert wdscache.collect_stats(cache)["failed"] == failed  # from the index, no agent running
    assert [t for t in [*shown, agent.stderr_text()] if secret in t or token in t] == []
    assert secret not in _index_bytes(cache)  # (which keys the shard by its full URL, token included)
