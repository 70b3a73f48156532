"""A sample with a repeated field (``img1.jpg`` then ``img1.JPG``, ``s1.txt`` twice, a member
named ``k.__key__``) is data, not damage: the sample keeps its first member, as webdataset keeps it
with a handler that goes on; the shard is downloaded once, never reported corrupt, and the agent
warns once a shard. ``wdscache index`` counts such a sample once, and random access reads it as
our stream does (where wids differs, docs/api.md says how).

Real parts: the loopback shard server, an agent and ``wdscache index`` through the CLI, a
``wdscache.WebDataset`` and a ``wdscache.ShardListDataset`` reading through the agent."""

from __future__ import annotations

import io
import json
import tarfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
import wids

import wdscache
from tests.helpers.agents import run_wdscache

# Shard "a": a field repeated in another case; "b": a field repeated as it is; "c": a member whose
# extension would overwrite the sample's metadata.
MEMBERS = {
    "a.tar": [
        ("img1.jpg", b"first jpg"),
        ("img1.JPG", b"second JPG"),
        ("img1.cls", b"1"),
        ("img2.jpg", b"jpg 2"),
        ("img2.cls", b"2"),
    ],
    "b.tar": [
        ("s1.txt", b"first txt"),
        ("s1.txt", b"second txt"),
        ("s1.json", b"{}"),
    ],
    "c.tar": [
        ("k.cls", b"3"),
        ("k.__key__", b"not a key"),
        ("s2.txt", b"last"),
    ],
}


def _write(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _fields(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}


def _webdataset(path: Path, url: str) -> list[tuple[str, str, dict[str, bytes]]]:
    """What webdataset yields with ``warn_and_continue``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its warn_and_continue's own warnings
        ds = wds.WebDataset(str(path), shardshuffle=False, handler=wds.warn_and_continue, empty_check=False)
        return [(url, s["__key__"], _fields(s)) for s in ds]


def _gets(server: Any, name: str) -> int:
    return sum(1 for r in server.requests if r.method == "GET" and r.path == name)


@pytest.mark.slow
def test_a_repeated_field_keeps_its_first_member_without_a_second_download(
    shard_server: Any, start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    paths = [_write(shard_server.root / name, members) for name, members in MEMBERS.items()]
    urls = [shard_server.url(p.name) for p in paths]
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "urls.txt").write_text("".join(u + "\n" for u in urls))
    expected = [s for p, u in zip(paths, urls) for s in _webdataset(p, u)]
    assert [(k, f) for _, k, f in expected] == [
        ("img1", {"jpg": b"first jpg", "cls": b"1"}),
        ("img2", {"jpg": b"jpg 2", "cls": b"2"}),
        ("s1", {"txt": b"first txt", "json": b"{}"}),
        ("k", {"cls": b"3"}),
        ("s2", {"txt": b"last"}),
    ]

    cache = tmp_path / "cache"
    agent = start_agent(cache, lists / "urls.txt", "--prefetch", "2")
    for handler in (wds.warn_and_continue, wds.reraise_exception):  # nothing to handle: no error
        got = wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False, handler=handler, timeout=30)
        assert [(s["__url__"], s["__key__"], _fields(s)) for s in got] == expected
    stats = agent.stats()
    assert stats["corrupt"] == 0 and stats["failed"] == [] and stats["shards"]["cached"] == 3, stats
    assert [_gets(shard_server, p.name) for p in paths] == [1, 1, 1]  # no download again

    warned = [line for line in agent.stderr_text().splitlines() if "skipped, its field is" in line]
    assert len(warned) == 3, warned  # one a shard, naming its first repeat
    assert any(urls[0] in w and "'img1'" in w and "'img1.JPG'" in w for w in warned), warned
    assert any(urls[1] in w and "'s1'" in w and "'s1.txt'" in w for w in warned), warned
    assert any(urls[2] in w and "'k'" in w and "'k.__key__'" in w for w in warned), warned
    assert "corrupt" not in agent.stderr_text()

    # wdscache index counts each such sample once, as the agent does.
    out = tmp_path / "index.json"
    r = run_wdscache("index", *urls, "-o", out)
    assert r.returncode == 0, r.stderr
    assert [e["nsamples"] for e in json.loads(out.read_text())["shardlist"]] == [2, 1, 2]
    assert "'img1.JPG'" in r.stderr and "'s1.txt'" in r.stderr and "'k.__key__'" in r.stderr, r.stderr

    # Random access reads what the stream reads. wids keeps both spellings of .jpg and a
    # ".__key__" field (docs/api.md, "Where it differs from wids"); of a name repeated as it is
    # (shard "b") its index keeps one member, and its samples after it read the wrong members.
    local = tmp_path / "local.json"
    entries = [{"url": str(paths[i]), "nsamples": n} for i, n in ((0, 2), (2, 2))]
    local.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))
    theirs = wids.ShardListDataset(str(local), cache_dir=str(tmp_path / "wids"), transformations=[])
    reference = [{k: v.getvalue() for k, v in theirs[i].items() if k[0] == "."} for i in range(4)]
    assert reference == [
        {".jpg": b"first jpg", ".JPG": b"second JPG", ".cls": b"1"},
        {".jpg": b"jpg 2", ".cls": b"2"},
        {".cls": b"3", ".__key__": b"not a key"},
        {".txt": b"last"},
    ]
    with wdscache.ShardListDataset(out, cache_dir=cache, transformations=[], timeout=30) as ours:
        assert len(ours) == 5
        mine = [
            (ours[i]["__key__"], {k[1:]: v.getvalue() for k, v in ours[i].items() if k[0] == "."}) for i in range(5)
        ]
        assert mine == [(k, f) for _, k, f in expected]
        assert [mine[i][1] for i in (1, 4)] == [{k[1:]: v for k, v in reference[i].items()} for i in (1, 3)]
    assert [_gets(shard_server, p.name) for p in paths] == [2, 2, 2]  # wdscache index's own read, and no other
    assert agent.stats()["corrupt"] == 0
