"""The cache commands: prefetch, ls, verify, evict, clear, with and without an agent.

Real ``wdscache`` processes, a real HTTP server, a real agent; a reader holds a shard over the real
control socket.
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from scripts.console import wdscache_exe
from tests.helpers.disks import fill
from tests.helpers.procs import stat_fields
from tests.helpers.streaming import samples_of
from tests.helpers.waits import read_terminal, stop_process, wait_for
from wdscache import CachedMultiLoader
from wdscache.agent.cache_commands import prefetch
from wdscache.shared.client import AgentConnection
from wdscache.shared.config import AgentConfig, format_size
from wdscache.shared.errors import ConfigError
from wdscache.shared.layout import CacheLayout


def _ls(run_cli, cache) -> dict[str, dict]:
    r = run_cli("ls", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    return {s["url"]: s for s in json.loads(r.stdout)}


def test_a_prefetch_without_an_agent_asks_a_source_that_lacks_a_shard_once(tmp_path, dataset, shard_server, run_cli):
    # A 404 is a final answer: its URL is asked once (the command's own agent fetches nothing
    # on its own first, and nothing twice), and the command says the source does not have it.
    data = dataset(1, samples=2, payload=300)
    missing = shard_server.url("missing.tar")
    r = run_cli("prefetch", missing, data.urls[0], "--cache-dir", tmp_path / "cache", "--cache-size", "10M")
    assert r.returncode == 1, r.stderr
    assert sorted((q.method, q.path) for q in shard_server.requests) == [
        ("GET", "missing.tar"),
        ("GET", data.paths[0].name),
    ], shard_server.requests
    error = f"{missing}: HTTP 404 Not Found: the source does not have it"
    assert f"failed {error}" in r.stdout.splitlines() and r.stdout.splitlines()[-1] == f"  {error}", r.stdout


@pytest.mark.slow
def test_ls_without_an_agent_shows_an_interrupted_download_as_partial_and_with_one_as_downloading(
    tmp_path, dataset, shard_server, start_agent, run_cli
):
    # A download stopped midway keeps its partial copy for the next start to resume: with no
    # agent running nothing downloads it, and ls says what is there.
    data = dataset(1, samples=20, payload=20_000)  # ~400 KB at 100 KB/s: the stop comes mid-body
    cache = tmp_path / "cache"
    partial = CacheLayout.of(cache).partial_path(data.urls[0])
    shard_server.rate = 100_000
    agent = start_agent(cache, data.list_file)
    wait_for(lambda: partial.exists() and partial.stat().st_size > 0, 30, agent.stderr_tail, interval=0.02)
    assert _ls(run_cli, cache)[data.urls[0]]["state"] == "downloading"
    assert agent.stop() == 0
    assert partial.exists() and partial.stat().st_size < data.paths[0].stat().st_size
    assert _ls(run_cli, cache)[data.urls[0]]["state"] == "partial"
    assert run_cli("ls", "--cache-dir", cache).stdout.splitlines()[1].split()[0] == "partial"


@pytest.mark.slow
def test_commands_on_a_cache_no_agent_serves(tmp_path, dataset, shard_server, run_cli):
    data = dataset(3, samples=4, payload=300)
    cache = tmp_path / "cache"
    missing = shard_server.url("missing.tar")
    r = run_cli("prefetch", *data.urls, missing, "--cache-dir", cache, "--cache-size", "10M")
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert sorted(x for x in lines[:4] if not x.startswith("failed")) == sorted(f"cached {u}" for u in data.urls)
    assert [x for x in lines[:4] if x.startswith(f"failed {missing}: ") and "404" in x], lines
    assert lines[4] == f"3 of 4 shard(s) cached ({_size(data)}), 1 failed:" and lines[5].startswith(f"  {missing}: ")
    assert "404" in lines[5]
    shards = _ls(run_cli, cache)
    assert {u: (s["state"], s["size"], s["last_read"]) for u, s in shards.items() if s["state"] == "cached"} == {
        u: ("cached", p.stat().st_size, None) for u, p in zip(data.urls, data.paths)
    }
    text = run_cli("ls", "--cache-dir", cache).stdout.splitlines()
    assert text[0].split() == ["STATE", "SIZE", "LAST", "READ", "READS", "URL"] and len(text) == 5
    assert not re.search(r"\d{10}\.\d", "\n".join(text))
    # The same again: all cached already, nothing fails.
    r = run_cli("prefetch", *data.urls, "--cache-dir", cache, "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {
        "shards": 3,
        "cached": 3,
        "bytes": sum(p.stat().st_size for p in data.paths),
        "failed": [],
    }, r.stderr
    assert run_cli("verify", "--cache-dir", cache).stdout.startswith("checked 3 shard(s): 0 bad, 0 evicted")
    # A damaged copy (a header overwritten) is found and evicted.
    damaged = CacheLayout.of(cache).shard_path(data.urls[1])
    with open(damaged, "r+b") as f:
        f.write(b"\x7f" * 512)
    r = run_cli("verify", "--cache-dir", cache, "--json")
    assert r.returncode == 1, r.stderr
    result = json.loads(r.stdout)
    assert (result["checked"], [b["url"] for b in result["bad"]], result["evicted"]) == (
        3,
        [data.urls[1]],
        [data.urls[1]],
    )
    assert result["bad"][0]["problem"].startswith("not a valid tar")
    assert data.urls[1] not in _ls(run_cli, cache) and not damaged.exists()
    freed = _freed(cache, data, [0])
    r = run_cli("evict", data.urls[0], "--cache-dir", cache)
    assert (r.returncode, r.stdout.splitlines()[0]) == (0, f"evicted 1 shard(s), {freed} freed"), r.stderr
    r = run_cli("clear", "--cache-dir", cache, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["evicted"] == [data.urls[2]], r.stdout
    assert not [s for s in _ls(run_cli, cache).values() if s["state"] == "cached"]


def _size(data, which=None) -> str:
    paths = data.paths if which is None else [data.paths[i] for i in which]
    return format_size(sum(p.stat().st_size for p in paths))


def _freed(cache, data, which=None) -> str:
    """What evicting shards ``which`` (all: None) of ``data`` frees: their cache files and
    the sample table files an agent kept beside them."""
    layout = CacheLayout.of(cache)
    urls = data.urls if which is None else [data.urls[i] for i in which]
    files = [p for u in urls for p in (layout.shard_path(u), layout.table_path(u)) if p.exists()]
    return format_size(sum(p.stat().st_size for p in files))


@pytest.mark.slow
def test_verify_and_clear_on_a_cache_whose_index_is_damaged_say_so_and_clear_every_file(tmp_path, dataset, run_cli):
    data = dataset(3, samples=4, payload=300)
    cache = tmp_path / "cache"
    assert run_cli("prefetch", *data.urls, "--cache-dir", cache, "--cache-size", "10M").returncode == 0
    layout = CacheLayout.of(cache)
    (layout.index_dir / "cache.db").write_bytes(b"garbage")  # (an index no agent can read)
    for extra in layout.index_dir.glob("cache.db-*"):
        extra.unlink()
    r = run_cli("verify", "--cache-dir", cache)
    assert r.returncode == 1 and "no shard file there can be named" in r.stderr, r.stdout + r.stderr
    r = run_cli("clear", "--cache-dir", cache, "--json")
    assert r.returncode == 0, r.stderr
    cleared = json.loads(r.stdout)
    assert len(cleared["evicted"]) == 3 and cleared["bytes"] >= sum(p.stat().st_size for p in data.paths)
    assert [p for p in layout.shards_dir.rglob("*") if p.is_file()] == []
    assert run_cli("verify", "--cache-dir", cache).stdout.startswith("checked 0 shard(s)")


@pytest.mark.slow
def test_commands_go_through_the_running_agent_and_spare_what_a_reader_holds(tmp_path, dataset, start_agent, run_cli):
    data = dataset(4, samples=4, payload=300)
    cache = tmp_path / "cache"
    data.list_file.write_text(data.urls[0] + "\n")  # the agent's own list: the first shard only
    agent = start_agent(cache, data.list_file, "--prefetch", "1", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the listed shard cached")
    r = run_cli("prefetch", *data.urls[1:], "--cache-dir", cache)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == f"3 of 3 shard(s) cached ({_size(data, [1, 2, 3])})"
    s = agent.stats()
    assert (s["shards"]["cached"], s["downloads"]) == (4, 4)  # the agent downloaded them: it knows
    assert sorted(re.findall(r"cached (http\S+)", agent.stderr_text())) == sorted(data.urls)
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        assert conn.request({"op": "open", "reader": "holder", "url": data.urls[0]})["ok"]
        r = run_cli("evict", data.urls[0], data.urls[1], "--cache-dir", cache, "--json")
        assert r.returncode == 1, r.stderr
        result = json.loads(r.stdout)
        assert result["evicted"] == [data.urls[1]] and result["refused"] == [
            {"url": data.urls[0], "reason": "held by 1 reader(s); --force evicts it"}
        ]
        r = run_cli("clear", "--cache-dir", cache)
        assert r.returncode == 1 and f"  refused {data.urls[0]}: held by 1 reader(s)" in r.stdout, r.stdout
        assert agent.stats()["shards"]["cached"] == 1
        r = run_cli("clear", "--cache-dir", cache, "--force")
        assert r.returncode == 0 and r.stdout.startswith("evicted 1 shard(s)"), r.stdout
    finally:
        conn.close()
    assert sorted(re.findall(r"evicted (http\S+)", agent.stderr_text())) == sorted(data.urls)


def test_prefetch_draws_a_progress_bar_on_a_terminal(tmp_path, dataset):
    data = dataset(2, samples=4, payload=300)
    main, sub = pty.openpty()
    proc = subprocess.Popen(
        [wdscache_exe(), "prefetch", *data.urls, "--cache-dir", tmp_path / "cache", "--cache-size", "10M"],
        stdout=sub,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    os.close(sub)
    try:
        out = read_terminal(main, proc, 60)
        err = proc.communicate(timeout=60)[1]
    finally:
        os.close(main)
        stop_process(proc)
    assert proc.returncode == 0, err
    text = out.decode()
    assert "\r[" in text and f"2/2 shards, {_size(data)}/{_size(data)}," in text and "ETA" in text, text
    assert text.rstrip().endswith(f"2 of 2 shard(s) cached ({_size(data)})"), text


@pytest.mark.slow
def test_prefetch_fails_at_once_a_shard_the_budget_cannot_take_beside_what_readers_hold(
    tmp_path, dataset, start_agent, run_cli
):
    data = dataset(3, samples=4, payload=300)  # 20 KiB shards
    cache = tmp_path / "cache"
    data.list_file.write_text("".join(u + "\n" for u in data.urls[:2]))
    agent = start_agent(cache, data.list_file, "--prefetch", "1", "--no-shuffle", "--cache-size", "50K")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the first shard cached")
    assert run_cli("prefetch", data.urls[1], "--cache-dir", cache).returncode == 0
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        for url in data.urls[:2]:  # both held: nothing can be evicted for a third
            assert conn.request({"op": "open", "reader": "holder", "url": url})["ok"]
        r = run_cli("prefetch", data.urls[2], "--cache-dir", cache, "--json", timeout=60)
    finally:
        conn.close()
    assert r.returncode == 1, r.stderr
    result = json.loads(r.stdout)
    assert (result["cached"], result["failed"]) == (
        0,
        [
            {
                "url": data.urls[2],
                "error": (
                    "the cache budget (50.0K) holds 0 of the 1 shard(s) asked beside 40.0K that readers hold or read next; "
                    "raise --cache-size or prefetch fewer"
                ),
            }
        ],
    ), result


def test_prefetch_waiting_for_free_space_gives_up_after_give_up_after_and_says_why(
    tmpfs, dataset, start_agent, run_cli
):
    fs = tmpfs("6m")
    data = dataset(2, samples=4, payload=300)
    cache = fs / "cache"
    data.list_file.write_text(data.urls[0] + "\n")
    agent = start_agent(cache, data.list_file, "--prefetch", "1", "--no-shuffle", "--cache-size", "1M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the listed shard cached")
    # Another program takes all but 1 MiB (room for the index): the budget has room, the disk keeps
    # --min-free 1M plus 1 MiB for the index free, and has not that much.
    os.truncate(fs / "filler", fill(fs / "filler") - (1 << 20))
    r = run_cli("prefetch", data.urls[1], "--cache-dir", cache, "--json", "--give-up-after", "1", timeout=60)
    assert r.returncode == 1, r.stderr
    result = json.loads(r.stdout)
    assert (result["cached"], [f["url"] for f in result["failed"]]) == (0, [data.urls[1]]), result
    error = result["failed"][0]["error"]
    assert error.startswith("waiting for space: the file system keeps --min-free 1.0M"), error
    assert error.endswith("(given up after 1 s without progress)"), error


# -- a prefetch past the budget: each shard downloaded at most once, the rest fail naming the budget ----------


def _prefetch_gets(server, data) -> list[int]:
    return [server.count(p.name) for p in data.paths]


def _cached_of(run_cli, cache, urls) -> list[str]:
    shards = _ls(run_cli, cache)
    return [u for u in urls if shards.get(u, {}).get("state") == "cached"]


def _budget_failures(stdout: str, data, budget: str, held: int, beside: str = "") -> list[str]:
    """The failed shards of a prefetch's report, each failing with the budget's reason."""
    lines = stdout.splitlines()
    head = [i for i, line in enumerate(lines) if " shard(s) cached (" in line]
    assert head, stdout
    reason = (
        f"the cache budget ({budget}) holds {held} of the {len(data.urls)} shard(s) asked{beside}; "
        "raise --cache-size or prefetch fewer"
    )
    failed = lines[head[-1] + 1 :]
    assert failed and all(line.endswith(f": {reason}") for line in failed), (reason, failed)
    return [line.strip().rsplit(": the cache budget", 1)[0] for line in failed]


@pytest.mark.slow
def test_prefetch_past_the_budget_through_an_agent_downloads_each_shard_once_and_says_so(
    tmp_path, dataset, shard_server, start_agent, run_cli
):
    data = dataset(20, samples=4, payload=300)
    own = dataset(1, samples=4, payload=300, prefix="own", list_name="own.txt")
    size = data.paths[0].stat().st_size
    assert {p.stat().st_size for p in data.paths + own.paths} == {size}
    cache = tmp_path / "cache"
    budget = 6 * size + size // 2  # the agent's own shard and 5 of these
    agent = start_agent(
        cache, own.list_file, "--prefetch", "1", "--no-shuffle", "--cache-size", str(budget), "--download-workers", "1"
    )
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the listed shard cached")
    # One of them cached before: the prefetch holds it too, never evicts it for the others.
    assert run_cli("prefetch", data.urls[7], "--cache-dir", cache).returncode == 0
    r = run_cli("prefetch", *data.urls, "--cache-dir", cache, timeout=60)
    assert r.returncode == 1, r.stderr
    gets = _prefetch_gets(shard_server, data)
    # In order, one at a time: 0-3 fit, 4 is refused before its body is read, the rest never start.
    assert gets == [1] * 5 + [0, 0, 1] + [0] * 12, gets
    cached = _cached_of(run_cli, cache, data.urls)
    assert cached == [data.urls[i] for i in (0, 1, 2, 3, 7)], cached
    assert f"5 of 20 shard(s) cached ({_size(data, [0, 1, 2, 3, 7])}), 15 failed:" in r.stdout, r.stdout
    failed = _budget_failures(
        r.stdout, data, format_size(budget), 5, f" beside {format_size(size)} that readers hold or read next"
    )
    assert sorted(failed) == sorted(set(data.urls) - set(cached)), failed
    assert agent.stats()["redownloads"] == 0


def test_prefetch_past_the_budget_without_an_agent_downloads_each_shard_once_and_says_so(
    tmp_path, dataset, shard_server, run_cli
):
    data = dataset(20, samples=4, payload=300)
    size = data.paths[0].stat().st_size
    cache = tmp_path / "cache"
    budget = 5 * size + size // 2
    r = run_cli(
        "prefetch", *data.urls, "--cache-dir", cache, "--cache-size", str(budget), "--download-workers", "1", timeout=60
    )
    assert r.returncode == 1, r.stderr
    gets = _prefetch_gets(shard_server, data)
    assert gets == [1] * 6 + [0] * 14, gets
    assert _cached_of(run_cli, cache, data.urls) == data.urls[:5]
    assert f"5 of 20 shard(s) cached ({_size(data, range(5))}), 15 failed:" in r.stdout, r.stdout
    assert sorted(_budget_failures(r.stdout, data, format_size(budget), 5)) == sorted(data.urls[5:])


@pytest.mark.slow
def test_verify_with_a_shard_index_catches_a_same_size_change(tmp_path, dataset, run_cli):
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    index = tmp_path / "index.json"
    r = run_cli("index", *data.urls, "-o", index)
    assert r.returncode == 0, r.stderr
    assert run_cli("prefetch", *data.urls, "--cache-dir", cache).returncode == 0
    # One payload byte changed at the same size: the tar still walks, only its MD5 tells.
    changed = CacheLayout.of(cache).shard_path(data.urls[0])
    raw = bytearray(changed.read_bytes())
    raw[512 + 10] ^= 0xFF
    changed.write_bytes(bytes(raw))
    plain = run_cli("verify", "--cache-dir", cache)
    assert plain.returncode == 0 and plain.stdout.startswith("checked 2 shard(s): 0 bad"), plain.stdout
    r = run_cli("verify", "--cache-dir", cache, "--index", index, "--json")
    assert r.returncode == 1, r.stderr
    result = json.loads(r.stdout)
    assert [b["url"] for b in result["bad"]] == [data.urls[0]] and result["evicted"] == [data.urls[0]]
    assert result["bad"][0]["problem"].startswith("its md5 is ")
    # A plain URL list is not an index: exit 2, naming it.
    r = run_cli("verify", "--cache-dir", cache, "--index", data.list_file)
    assert r.returncode == 2 and f"{data.list_file}: not a shard index" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_cache_whose_file_names_held_a_query_opens_with_every_shard(
    tmp_path, dataset, shard_server, start_agent, run_cli
):
    data = dataset(3, samples=4, payload=300)
    urls = [
        f"{data.urls[0]}?token=TOKENSECRET",
        f"http://user:PASSWORDSECRET@{data.urls[1][len('http://') :]}",
        data.urls[2],
    ]
    cache = tmp_path / "cache"
    assert run_cli("prefetch", *urls, "--cache-dir", cache, "--cache-size", "10M").returncode == 0
    layout = CacheLayout.of(cache)

    def as_written_before() -> None:
        """The files renamed as an earlier version named them (a URL's query and user info in the name)."""
        for url in urls:
            for former in layout.former_shard_paths(url)[:1]:
                layout.shard_path(url).rename(former)
        assert any("SECRET" in p.name for p in layout.shards_dir.rglob("*"))

    def named_today() -> None:
        names = [p.name for p in layout.shards_dir.rglob("*") if p.is_file()]
        assert sorted(names) == sorted(layout.shard_path(u).name for u in urls) and "SECRET" not in "".join(names)

    as_written_before()
    r = run_cli("verify", "--cache-dir", cache)  # on the cache, no agent: opens it first
    assert r.returncode == 0 and r.stdout.startswith("checked 3 shard(s): 0 bad"), r.stdout + r.stderr
    named_today()
    as_written_before()
    data.list_file.write_text("\n".join(urls) + "\n")
    agent = start_agent(cache, data.list_file)
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 10, "every shard still cached")
    assert s["redownloads"] == 0 and [shard_server.count(p.name) for p in data.paths] == [1, 1, 1]
    named_today()
    for url, path in zip(urls, data.paths):
        assert layout.shard_path(url).read_bytes() == path.read_bytes()


@pytest.mark.slow
def test_a_cache_whose_pipe_file_names_held_the_commands_words_opens_with_its_shard_renamed(
    tmp_path, dataset, shard_server, start_agent
):
    data = dataset(1, samples=4, payload=300)
    url = f"pipe:curl -s -f {data.urls[0]} -H 'Authorization: Bearer PIPEBEARERSECRET'"
    (tmp_path / "pipes.txt").write_text(url + "\n")
    cache = tmp_path / "cache"
    agent = start_agent(cache, tmp_path / "pipes.txt", "--allow-pipe")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the pipe: shard cached")
    with CachedMultiLoader(None, cache_dir=cache, shuffle=False, timeout=30) as loader:
        assert len(list(loader)) == 4  # its sample table written too
    assert agent.stop() == 0
    # Named as an earlier version named them: the command's text after its last "/".
    layout = CacheLayout.of(cache)
    former = (
        f"{hashlib.sha256(url.encode()).hexdigest()[:32]}-shard-000000.tar_-H_Authorization_Bearer_PIPEBEARERSECRET_"
    )
    for path in (layout.shard_path(url), layout.table_path(url)):
        path.rename(path.with_name(former))

    agent = start_agent(cache, tmp_path / "pipes.txt", "--allow-pipe")
    s = agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 10, "the pipe: shard still cached")
    assert s["redownloads"] == 0 and shard_server.count(data.paths[0].name) == 1
    assert layout.shard_path(url).read_bytes() == data.paths[0].read_bytes()
    names = [p.name for p in cache.rglob("*")]
    assert not [n for n in names if "Bearer" in n], names


@pytest.mark.slow
def test_evict_expands_brace_patterns_and_names_what_matched_nothing(tmp_path, dataset, start_agent, run_cli):
    data = dataset(4, samples=4, payload=300)
    cache = tmp_path / "cache"
    base = data.urls[0].rsplit("/", 1)[0]
    pattern, typo = f"{base}/shard-{{000000..000001}}.tar", f"{base}/shard-00002.tar"
    assert run_cli("prefetch", *data.urls, "--cache-dir", cache).returncode == 0
    freed = _freed(cache, data, [0, 1])
    r = run_cli("evict", pattern, typo, "--cache-dir", cache)
    assert (r.returncode, r.stdout.splitlines()) == (
        0,
        [f"evicted 2 shard(s), {freed} freed", f"  not cached: {typo}"],
    ), r.stderr
    assert sorted(u for u, s in _ls(run_cli, cache).items() if s["state"] == "cached") == data.urls[2:]
    # Nothing asked for is cached: said, and exit 1 (a typo does not pass for done).
    r = run_cli("evict", pattern, "--cache-dir", cache, "--json")
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout) == {
        "evicted": [],
        "bytes": 0,
        "refused": [],
        "absent": data.urls[:2],
        "unmatched": [pattern],
    }
    assert r.stderr == (
        "wdscache: error: nothing evicted: no shard given is cached ('wdscache ls' lists those that are)\n"
    )
    # The same through a running agent.
    data.list_file.write_text(data.urls[0] + "\n")  # the agent's own list: a shard not evicted below
    start_agent(cache, data.list_file, "--prefetch", "1")
    freed = _freed(cache, data, [2, 3])
    r = run_cli("evict", typo, f"{base}/shard-{{000002,000003}}.tar", "--cache-dir", cache)
    assert (r.returncode, r.stdout.splitlines()) == (
        0,
        [f"evicted 2 shard(s), {freed} freed", f"  not cached: {typo}"],
    ), r.stderr
    r = run_cli("evict", typo, "--cache-dir", cache)
    assert (r.returncode, r.stdout.splitlines()) == (1, ["evicted 0 shard(s), 0 freed", f"  not cached: {typo}"]), (
        r.stderr
    )
    # A malformed pattern is bad input, named as prefetch names it.
    r = run_cli("evict", data.urls[0], f"{base}/shard-{{0..1.tar", "--cache-dir", cache)
    assert (r.returncode, r.stderr) == (
        2,
        f"wdscache: error: the command line:2: unclosed '{{' at offset {len(base) + 7}: '{base}/shard-{{0..1.tar'\n",
    )


def test_a_start_that_fails_leaves_the_cache_directory_as_it_was(tmp_path, dataset, tmpfs, run_cli):
    data = dataset(1, samples=4, payload=300)
    fs = tmpfs("8m")  # smaller than the default --min-free: no shard could ever be cached
    (fs / "empty").mkdir()
    r = run_cli("prefetch", data.urls[0], "--cache-dir", fs / "empty")
    assert r.returncode == 2 and r.stderr.startswith("wdscache: error: no shard can ever be cached"), r.stderr
    assert list((fs / "empty").iterdir()) == []
    r = run_cli("agent", "--cache-dir", fs / "new" / "cache", "--urls", data.list_file)
    assert r.returncode == 2 and r.stderr.startswith("wdscache: error: no shard can ever be cached"), r.stderr
    assert sorted(p.name for p in fs.iterdir()) == ["empty"]


@pytest.mark.slow
def test_prefetch_beside_a_reader_gives_way_to_it_downloads_each_shard_once_and_says_so(
    tmp_path, dataset, shard_server, start_agent, run_cli
):
    data = dataset(20, samples=4, payload=300)
    reads = dataset(2, samples=4, payload=300, prefix="read", list_name="read.txt")
    size = data.paths[0].stat().st_size
    cache = tmp_path / "cache"
    budget = 5 * size + size // 2
    agent = start_agent(
        cache,
        reads.list_file,
        "--prefetch",
        "1",
        "--no-shuffle",
        "--cache-size",
        str(budget),
        "--download-workers",
        "1",
    )
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the reader's first shard cached")
    shard_server.fail(data.paths[3].name, "stall", after=1000, seconds=5)  # a reader comes meanwhile
    prefetch = subprocess.Popen(
        [wdscache_exe(), "prefetch", *data.urls, "--cache-dir", cache],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    conn = AgentConnection(json.loads((cache / "agent.json").read_text())["endpoint"], timeout=10, cache_dir=cache)
    try:
        agent.wait_stats(
            lambda s: s["shards"]["cached"] == 4 and s["agent"]["bytes_reserved"] == size,
            20,
            "3 shards prefetched and the 4th downloading",
        )
        # The reader holds its first shard and waits for its second: the budget is full, and the
        # reader wins: one of the 3 prefetched goes (and is not downloaded again).
        assert conn.request({"op": "open", "reader": "reader", "url": reads.urls[0]})["ok"]
        assert conn.request({"op": "open", "reader": "reader", "url": reads.urls[1]})["ok"]
        out, err = prefetch.communicate(timeout=60)
    finally:
        conn.close()
        if prefetch.poll() is None:
            prefetch.kill()
            prefetch.wait(5)
    assert prefetch.returncode == 1, err
    assert _prefetch_gets(shard_server, data) == [1] * 5 + [0] * 15
    cached = _cached_of(run_cli, cache, data.urls)
    [evicted] = set(data.urls[:3]) - set(cached)
    assert cached == [u for u in data.urls[:4] if u != evicted], cached
    lines = out.splitlines()
    assert f"3 of 20 shard(s) cached ({_size(data, [data.urls.index(u) for u in cached])}), 17 failed:" in lines, out
    assert f"  {evicted}: cached, then evicted to make room for a shard readers need" in lines, out
    failed = _budget_failures(
        "\n".join(line for line in lines if evicted not in line),
        data,
        format_size(budget),
        3,
        f" beside {format_size(2 * size)} that readers hold or read next",
    )
    assert sorted(failed) == sorted(data.urls[4:]), failed


@pytest.mark.slow
def test_ls_shows_a_shard_read_a_moment_ago_as_read_with_and_without_an_agent(
    tmp_path, dataset, start_agent, consumers, run_cli
):
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "the listed shards cached")
    assert {u: s["last_read"] for u, s in _ls(run_cli, cache).items()} == {u: None for u in data.urls}
    consumers(cache, "c", "--no-shuffle").wait()
    read = _ls(run_cli, cache)  # at once: the agent holds the read times, ls asks it to write them
    assert all(read[u]["last_read"] is not None and read[u]["reads"] >= 1 for u in data.urls), read
    text = run_cli("ls", "--cache-dir", cache).stdout
    assert "never" not in text, text
    assert agent.stop() == 0
    assert _ls(run_cli, cache) == read  # without an agent: the index, as the agent left it


@pytest.mark.slow
def test_clear_with_an_agent_running_stays_clear_until_a_reader_asks(
    tmp_path, dataset, shard_server, start_agent, consumers, run_cli
):
    data = dataset(3, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "the start-up prefetch cached the list")
    layout = CacheLayout.of(cache)
    wait_for(lambda: all(layout.table_path(u).exists() for u in data.urls), 20, "the 3 sample tables kept")
    shard_server.reset_log()
    freed = _freed(cache, data)
    r = run_cli("clear", "--cache-dir", cache)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"evicted 3 shard(s), {freed} freed",
        "the agent fetches again only what its readers ask for",
    ]
    assert json.loads(run_cli("clear", "--cache-dir", cache, "--json").stdout)["agent"] is True
    # A prefetch of one shard runs through the agent's loop to its end: the start-up plan refilled nothing.
    assert run_cli("prefetch", data.urls[0], "--cache-dir", cache).returncode == 0
    assert agent.stats()["shards"]["cached"] == 1
    assert _prefetch_gets(shard_server, data) == [1, 0, 0]
    # A reader asks: it gets every sample, and the shards come back.
    lines = consumers(cache, "c", "--no-shuffle").wait()
    assert len(samples_of(lines)) == 12
    assert agent.stats()["shards"]["cached"] == 3


@pytest.mark.slow
def test_evict_with_an_agent_running_keeps_the_shard_out_until_a_reader_asks(
    tmp_path, dataset, shard_server, start_agent, consumers, run_cli
):
    # The start-up plan downloaded an evicted shard again within milliseconds (and counted it a
    # re-download): "evicted" and exit 0 said none of them is cached any more.
    data = dataset(3, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 3, 20, "the start-up prefetch cached the list")
    shard_server.reset_log()
    r = run_cli("evict", data.urls[0], "--cache-dir", cache)
    assert r.returncode == 0 and r.stdout.startswith("evicted 1 shard(s)"), r.stdout + r.stderr
    # A prefetch of another shard runs through the agent's loop to its end: nothing came back meanwhile.
    assert run_cli("prefetch", data.urls[1], "--cache-dir", cache).returncode == 0
    s = agent.stats()
    assert s["shards"]["cached"] == 2 and s["redownloads"] == 0, s
    assert _prefetch_gets(shard_server, data) == [0, 0, 0]
    lines = consumers(cache, "c", "--no-shuffle").wait()  # a reader asks: it comes back
    assert len(samples_of(lines)) == 12 and agent.stats()["shards"]["cached"] == 3


def test_prefetch_refuses_download_workers_below_one_and_leaves_the_cache_directory_alone(tmp_path, dataset, run_cli):
    data = dataset(1, samples=4, payload=300)
    r = run_cli("prefetch", data.urls[0], "--cache-dir", tmp_path / "cache", "--download-workers", "0")
    assert r.returncode == 2 and "'--download-workers': 0 is not in the range x>=1" in r.stderr, r.stderr
    assert not (tmp_path / "cache").exists()
    # The prefetch function (the library's) refuses it too, rather than taking the default.
    with pytest.raises(ConfigError, match="--download-workers 0: use at least 1"):
        prefetch(tmp_path / "cache", data.urls, report=lambda progress: None, download_workers=0)
    with pytest.raises(ConfigError, match="--retries -1: use 0 or more"):  # (an agent's configuration)
        AgentConfig(cache_dir=tmp_path / "cache", urls=data.list_file, retries=-1)
    # A wait that never gives up (nan compares false to every time).
    r = run_cli("prefetch", data.urls[0], "--cache-dir", tmp_path / "cache", "--give-up-after", "nan")
    assert r.returncode == 2 and "--give-up-after nan: use a number of seconds" in r.stderr, r.stderr
    assert not (tmp_path / "cache").exists()
    # No option of prefetch's would allow a pipe: command (it said to start the agent with --allow-pipe).
    listed = tmp_path / "pipes.txt"
    listed.write_text("pipe:cat x.tar\n")
    for given in (["pipe:cat x.tar"], ["--urls", listed]):
        r = run_cli("prefetch", *given, "--cache-dir", tmp_path / "cache")
        assert r.returncode == 2 and "this command takes no pipe: command: only the agent runs them" in r.stderr
    assert not (tmp_path / "cache").exists()


def test_prefetch_refuses_options_for_its_own_agent_when_an_agent_runs_too(
    tmp_path, dataset, shard_server, start_agent, run_cli
):
    """--cache-size and --download-workers are used only when no agent runs, yet a wrong one is
    refused either way (exit 2, naming it), rather than ignored because an agent runs."""
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    data.list_file.write_text(data.urls[0] + "\n")
    agent = start_agent(cache, data.list_file, "--prefetch", "1", "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "the listed shard cached")
    shard_server.reset_log()
    r = run_cli("prefetch", data.urls[1], "--cache-dir", cache, "--cache-size", "bogus")
    assert r.returncode == 2 and "--cache-size 'bogus' is not a size" in r.stderr, r.stdout + r.stderr
    with pytest.raises(ConfigError, match="--download-workers 0: use at least 1"):
        prefetch(cache, data.urls[1:], report=lambda progress: None, download_workers=0)
    assert shard_server.requests == [] and agent.stats()["shards"]["cached"] == 1


@pytest.mark.slow  # each command waits out the answer that does not come (5 s)
def test_a_busy_agent_is_not_taken_for_absent_by_the_cache_commands(tmp_path, dataset, start_agent, run_cli):
    # A change through an agent silent for 2 s tried the directory's lock and said "an agent is already
    # running; stop it first": the agent was running, only busy (as re-reading a huge list).
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    agent = start_agent(cache, data.list_file, "--no-shuffle")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 2, 20, "the start-up prefetch cached the list")
    os.kill(agent.pid, signal.SIGSTOP)  # it keeps its lock and answers nothing
    try:
        wait_for(lambda: stat_fields(agent.pid)[0] == "T", 10, "the agent never stopped")
        with ThreadPoolExecutor(4) as pool:
            runs = {
                what: pool.submit(run_cli, *args, "--cache-dir", cache)
                for what, args in {
                    "evict": ("evict", data.urls[0]),
                    "clear": ("clear",),
                    "prefetch": ("prefetch", data.urls[1]),
                    "ls": ("ls", "--json"),
                }.items()
            }
            got = {what: run.result() for what, run in runs.items()}
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    for what in ("evict", "clear", "prefetch"):
        r = got[what]
        assert r.returncode == 1, (what, r.stdout, r.stderr)
        assert f"the agent (pid {agent.pid}) runs on {cache} but did not answer" in r.stderr, (what, r.stderr)
        assert "already running" not in r.stderr, (what, r.stderr)
    assert got["ls"].returncode == 0, got["ls"].stderr  # a read takes the index as it is
    assert {s["url"]: s["state"] for s in json.loads(got["ls"].stdout)} == dict.fromkeys(data.urls, "cached")
    assert agent.stats()["shards"]["cached"] == 2  # nothing was changed behind its back
    r = run_cli("evict", data.urls[0], "--cache-dir", cache)  # answering again, it takes the change
    assert r.returncode == 0 and r.stdout.startswith("evicted 1 shard(s)"), r.stdout + r.stderr


@pytest.mark.slow
def test_prefetch_without_an_agent_keeps_the_last_agents_free_space_or_the_one_given(
    tmp_path, dataset, run_cli, start_agent, tmpfs
):
    """On a 40 MB file system an agent keeps --min-free 1M; a prefetch run after it, with no agent,
    keeps the same (the agent's default, 1G, is more than the file system holds), or what it is given."""
    data = dataset(3, samples=4, payload=300)
    disk = tmpfs("40m")
    cache = disk / "cache"
    first = tmp_path / "first.txt"
    first.write_text(data.urls[0] + "\n")
    agent = start_agent(cache, first, "--cache-size", "20M", "--min-free", "1M")
    agent.wait_stats(lambda s: s["shards"]["cached"] == 1, 20, "its list cached")
    agent.stop()
    r = run_cli("prefetch", data.urls[1], "--cache-dir", cache, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _cached_of(run_cli, cache, data.urls) == data.urls[:2]
    fresh = disk / "fresh"
    r = run_cli("prefetch", data.urls[2], "--cache-dir", fresh, "--min-free", "2M", timeout=60)
    assert r.returncode == 0, r.stderr
    assert _cached_of(run_cli, fresh, data.urls) == data.urls[2:]
    r = run_cli("prefetch", data.urls[0], "--cache-dir", fresh, "--min-free", "39M", timeout=60)
    assert r.returncode == 2 and "--min-free 39.0M" in r.stderr, (r.stdout, r.stderr)
    r = run_cli("prefetch", data.urls[0], "--cache-dir", fresh, "--min-free", "lots", timeout=60)
    assert r.returncode == 2 and "--min-free" in r.stderr, r.stderr


@pytest.mark.slow
def test_evict_of_a_redacted_url_that_shows_two_cached_urls_says_to_give_the_whole_url(tmp_path, dataset, run_cli):
    data = dataset(1, samples=4, payload=300)
    urls = [f"{data.urls[0]}?token=ONE", f"{data.urls[0]}?token=TWO"]  # ls shows both alike
    cache = tmp_path / "cache"
    assert run_cli("prefetch", *urls, "--cache-dir", cache, "--cache-size", "10M").returncode == 0
    shown = [s["url"] for s in json.loads(run_cli("ls", "--cache-dir", cache, "--json").stdout)]
    assert shown == [f"{data.urls[0]}?token=***"] * 2
    r = run_cli("evict", f"{data.urls[0]}?token=***", "--cache-dir", cache)
    assert r.returncode == 1 and "as shown redacted it names no single cached URL: give the whole URL" in r.stdout
    assert "ONE" not in r.stdout + r.stderr and "TWO" not in r.stdout + r.stderr


def test_prefetch_without_an_agent_names_its_argument_not_its_own_list_file(tmp_path, run_cli):
    pytest.importorskip("boto3", reason="boto3 is not installed (scripts/test.sh installs it)")
    env = {**os.environ, "AWS_PROFILE": "no-such-profile"}
    r = run_cli("prefetch", "--cache-dir", tmp_path / "cache", "s3://b/k.tar", env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("wdscache: error: the command line:1: cannot make an S3 client"), r.stderr
