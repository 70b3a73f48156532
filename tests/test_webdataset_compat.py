"""A webdataset script run with ``wdscache.WebDataset``: what it relies on behaves as with
``webdataset.WebDataset`` (the reference, run on the same shards): errors are OSErrors naming
their cause, handler= functions, ``with``, pickling, local paths' ``__url__``, pipe: sources."""

from __future__ import annotations

import copy
import gzip
import io
import pickle
import random
import shutil
import struct
import tarfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

wds = pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")

import wdscache  # noqa: E402
from tests.helpers.net import free_port_range  # noqa: E402

# The agent's retries are its defaults: an error must reach the loader well within its timeout.
FAST = 15.0


def _samples(ds: Any) -> list[dict[str, Any]]:
    return [dict(s) for s in ds]


def _raised(make: Callable[[], Any]) -> BaseException:
    try:
        for _ in make():
            pass
    except BaseException as exc:  # noqa: BLE001 - compared by the test
        return exc
    raise AssertionError("no error")


@pytest.fixture
def served(dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path) -> Any:
    data = dataset(3, samples=4, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file)
    return data, cache


def test_an_unreachable_port_raises_an_oserror_naming_connection_refused_at_once(served: Any) -> None:
    data, cache = served
    bad = f"http://127.0.0.1:{free_port_range(1)}/shard-x.tar"
    t0 = time.monotonic()
    exc = _raised(lambda: wdscache.WebDataset([bad], cache_dir=cache, shardshuffle=False))
    took = time.monotonic() - t0
    assert isinstance(exc, wdscache.FetchError) and isinstance(exc, OSError), repr(exc)
    assert "connection refused" in str(exc) and bad in str(exc), str(exc)
    assert took < FAST, took
    _raised(lambda: wds.WebDataset([bad], shardshuffle=False))  # webdataset raises too (a tarfile.ReadError)


def test_a_missing_shard_over_http_or_on_disk_is_an_oserror_as_in_webdataset(served: Any, tmp_path: Path) -> None:
    data, cache = served
    t0 = time.monotonic()
    for bad in (data.urls[0].replace("shard-", "nothing-"), str(tmp_path / "nothing.tar")):
        exc = _raised(lambda bad=bad: wdscache.WebDataset([bad], cache_dir=cache, shardshuffle=False))
        assert isinstance(exc, OSError) and isinstance(exc, wdscache.FetchError), repr(exc)
        assert ("HTTP 404" in str(exc)) if bad.startswith("http") else ("no such file" in str(exc)), str(exc)
        theirs = _raised(lambda bad=bad: wds.WebDataset([bad], shardshuffle=False))
        assert isinstance(theirs, OSError if not bad.startswith("http") else Exception), repr(theirs)
        try:  # what a webdataset script writes
            list(wdscache.WebDataset([bad], cache_dir=cache, shardshuffle=False))
        except OSError:
            pass
    assert time.monotonic() - t0 < FAST  # a 404 is final: never retried


def test_handlers_skip_stop_or_raise_as_in_webdataset(served: Any) -> None:
    data, cache = served
    bad = data.urls[0].replace("shard-", "nothing-")
    urls = [data.urls[0], bad, data.urls[1]]
    seen: list[BaseException] = []

    def mine(exc: BaseException) -> bool:
        seen.append(exc)
        return True

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for handler in (wds.ignore_and_stop, wds.warn_and_continue, wds.ignore_and_continue, mine):
            ours = _samples(wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False, handler=handler))
            theirs = _samples(wds.WebDataset(urls, shardshuffle=False, handler=handler))
            assert ours == theirs, handler
            assert len(ours) == (4 if handler is wds.ignore_and_stop else 8), handler
    assert len(seen) == 2 and isinstance(seen[0], wdscache.FetchError) and bad in str(seen[0]), seen
    exc = _raised(lambda: wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False, handler=wds.reraise_exception))
    assert isinstance(exc, wdscache.FetchError) and "HTTP 404" in str(exc)


def test_a_dataset_is_a_context_manager_and_closes_as_webdatasets(served: Any) -> None:
    data, cache = served
    with wdscache.WebDataset(data.urls, cache_dir=cache, shardshuffle=False) as ds:
        ours = _samples(ds)
    with wds.WebDataset(data.urls, shardshuffle=False) as theirs_ds:
        theirs = _samples(theirs_ds)
    assert ours == theirs and len(ours) == 12
    assert not hasattr(ds, "pipeline") and not hasattr(theirs_ds, "pipeline")  # closed, as webdataset's
    ds.close()  # a second close does nothing


def test_a_dataset_pickles_and_deep_copies_before_and_after_iterating(served: Any) -> None:
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    data, cache = served
    ds = wdscache.WebDataset(data.urls, cache_dir=cache, shardshuffle=False).map(_with_size)
    assert isinstance(ds.loader, __import__("torch").utils.data.IterableDataset)  # with its epoch box
    ds.set_epoch(0)
    copies = [pickle.loads(pickle.dumps(ds)), copy.deepcopy(ds)]
    first = _samples(ds)
    it = iter(ds)
    next(it)  # an epoch open: its sockets and files stay with the original
    copies += [pickle.loads(pickle.dumps(ds)), copy.deepcopy(ds)]
    assert len(first) == 12 and first[0]["size"] > 0
    for other in copies:
        assert _samples(other) == first
    rest = list(it)
    assert len(rest) == 11


def _with_size(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "size": sum(len(v) for k, v in sample.items() if not k.startswith("__"))}


def test_local_paths_keep_their_names_in_url_and_local_path(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    data, cache = served
    root = data.paths[0].parent
    monkeypatch.chdir(root.parent)
    rel = f"{root.name}/shard-{{000000..000002}}.tar"
    absolute = [str(p) for p in data.paths]
    # webdataset's file: URLs as written: its own forms, and spellings the agent's canonical URL cleans up
    opaque = [f"file:{root.name}/{data.paths[0].name}"] + [f"file:{p}" for p in absolute[1:]]
    unclean = [f"file://{root}/./{data.paths[0].name}", f"file://{root}//{data.paths[1].name}"]
    unclean.append(f"file://localhost{absolute[2]}")
    for urls in (rel, absolute, [f"file://{p}" for p in absolute], opaque, unclean):
        ours = _samples(wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False))
        theirs = _samples(wds.WebDataset(urls, shardshuffle=False))
        assert ours == theirs and len(ours) == 12, urls
        assert (
            "__local_path__" in ours[0] and not ours[0]["__url__"].startswith("file://") or urls[0].startswith("file:")
        ), ours[0]["__url__"]
        assert ours[-1]["__local_path__"] == (f"{root.name}/{data.paths[2].name}" if urls is rel else absolute[2])


def test_a_url_with_an_upper_case_scheme_keeps_its_spelling_in_url(served: Any) -> None:
    # The agent knows the shard by its canonical URL (http://...): a sample names it as written.
    data, cache = served
    written = ["HTTP" + data.urls[0][4:], "Http" + data.urls[1][4:]]
    pattern = "HTTP" + data.urls[0][4:].replace("000000", "{000000..000001}")
    for urls in (written, pattern):
        theirs = _samples(wds.WebDataset(urls, shardshuffle=False))
        assert _samples(wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False)) == theirs, urls
        with wdscache.CachedMultiLoader(urls, cache_dir=cache, shuffle=False) as loader:
            assert [dict(s) for s in loader] == theirs, urls
        assert {s["__url__"] for s in theirs} == set(
            written if urls is written else [pattern.replace("{000000..000001}", n) for n in ("000000", "000001")]
        )


def test_a_mixtures_samples_name_their_shards_as_webdatasets_reader_of_each_source_does(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mix= source is anything urls= takes: a shard written with an upper-case scheme, or as a
    # local path (relative, absolute), keeps that name, not the agent's canonical URL.
    data, cache = served
    root = data.paths[0].parent
    monkeypatch.chdir(root.parent)
    sources = ["HTTP" + data.urls[0][4:], f"{root.name}/{data.paths[1].name}", str(data.paths[2])]
    named = ("__url__", "__local_path__")
    theirs = {
        s["__key__"]: [s.get(k) for k in named] for src in sources for s in wds.WebDataset(src, shardshuffle=False)
    }
    with wdscache.CachedMultiLoader(mix=dict.fromkeys(sources, 1), epoch_samples=12, cache_dir=cache) as loader:
        ours = {s["__key__"]: [s.get(k) for k in named] for s in loader}
    assert ours == theirs and len(ours) == 12


def test_a_local_shard_whose_name_holds_spaces_is_read_as_webdataset_reads_it(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, cache = served
    folder = data.paths[0].parent.parent / "my data"
    folder.mkdir()
    shutil.copy(data.paths[0], folder / "a b.tar")
    monkeypatch.chdir(folder.parent)
    for urls in ("my data/a b.tar", ["my data/a b.tar"], [f"file://{folder}/a b.tar"]):
        ours = _samples(wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False))
        theirs = _samples(wds.WebDataset(urls, shardshuffle=False))
        assert ours == theirs and len(ours) == 4, urls


def _v7_tar(members: dict[str, bytes]) -> bytes:
    """A tar as Unix v7 wrote it (no ustar magic: only its headers' checksums say it is a tar),
    which tarfile reads and does not write."""
    out = bytearray()
    for name, data in members.items():
        header = bytearray(
            struct.pack(
                "100s8s8s8s12s12s8sc",
                name.encode(),
                b"0000644\0",
                b"0\0",
                b"0\0",
                b"%011o\0" % len(data),
                b"0\0",
                b" " * 8,
                b"0",
            )
        )
        header += bytes(512 - len(header))
        header[148:156] = b"%06o\0 " % sum(header)
        out += header + data + bytes(-len(data) % 512)
    return bytes(out + bytes(1024))


def test_a_local_shard_of_any_name_is_read_as_webdataset_reads_it(served: Any, tmp_path: Path) -> None:
    # webdataset reads any local path as a tar; a name that did not end in .tar, .tar.gz or .tgz
    # (in lower case) was read as a URL list, and failed with a dump of the tar's bytes.
    data, cache = served
    folder = tmp_path / "named"
    folder.mkdir()
    plain = data.paths[0].read_bytes()
    v7 = {"a.cls": b"1", "a.txt": b"one", "b.cls": b"2", "b.txt": b"two"}
    bodies = {"s.TAR": plain, "s.shard": plain, "s.Tar.Gz": gzip.compress(plain), "v7": _v7_tar(v7)}
    for name, body in bodies.items():
        path = folder / name
        path.write_bytes(body)
        theirs = _samples(wds.WebDataset(str(path), shardshuffle=False))
        assert len(theirs) == (2 if name == "v7" else 4), name
        ours = _samples(wdscache.WebDataset(str(path), cache_dir=cache, shardshuffle=False))
        assert ours == theirs, name
        with wdscache.CachedMultiLoader(path, cache_dir=cache, shuffle=False) as loader:  # a path object
            assert [s["__key__"] for s in loader] == [s["__key__"] for s in theirs], name


def test_a_binary_file_that_is_no_shard_is_named_not_dumped(served: Any, tmp_path: Path) -> None:
    data, cache = served
    png = tmp_path / "cat.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    with pytest.raises(wdscache.ConfigError) as info:
        wdscache.WebDataset(str(png), cache_dir=cache, shardshuffle=False)
    assert str(info.value) == (
        f"URL list {png} looks like a binary file, not a URL list (a UTF-8 text file of URLs, one a line)"
    )


def _zstd_frame(data: bytes) -> bytes:
    """``data`` as one zstd frame of one raw (stored) block, as ``zstd`` writes data it cannot shrink:
    the standard library has no zstd writer."""
    assert len(data) < 1 << 17  # one block's most
    return b"\x28\xb5\x2f\xfd\xa0" + struct.pack("<I", len(data)) + ((len(data) << 3) | 1).to_bytes(3, "little") + data


@pytest.mark.parametrize("packing", ["bz2", "xz", "zst"])
def test_a_shard_compressed_otherwise_than_gzip_fails_naming_its_compression(
    served: Any, shard_server: Any, tmp_path: Path, packing: str
) -> None:
    # webdataset reads .tar.bz2 and .tar.xz (tarfile streams them); a cached shard is read by its
    # members' offsets, so wdscache reads plain and gzip'd tars only, and says so.
    data, cache = served
    plain = data.paths[0].read_bytes()
    name = f"s.tar.{packing}"
    if packing == "zst":
        body = _zstd_frame(plain)
    else:
        out = io.BytesIO()
        with tarfile.open(data.paths[0]) as src, tarfile.open(fileobj=out, mode=f"w:{packing}") as dst:
            for member in src:
                dst.addfile(member, src.extractfile(member))
        body = out.getvalue()
    (shard_server.root / name).write_bytes(body)
    local = tmp_path / name
    local.write_bytes(body)
    if packing != "zst":
        assert _samples(wds.WebDataset(str(local), shardshuffle=False)) == [
            {**s, "__url__": str(local), "__local_path__": str(local)}
            for s in wds.WebDataset(str(data.paths[0]), shardshuffle=False)
        ]
    tool = {"bz2": "bzip2", "xz": "xz", "zst": "zstd"}[packing]
    why = (
        f"a shard compressed with {tool}: wdscache reads plain tar and gzip'd tar; decompress it ({tool} -d) "
        "or recompress it with gzip"
    )
    t0 = time.monotonic()
    for urls, url in ((shard_server.url(name), shard_server.url(name)), (str(local), f"file://{local}")):
        exc = _raised(lambda urls=urls: wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False))
        # (read while it downloads, its first header's walk may say it first, as a ShardError)
        assert (isinstance(exc, wdscache.FetchError) and str(exc) == f"cannot fetch {url}: {why}") or (
            isinstance(exc, wdscache.ShardError) and str(exc) == f"bad shard {url} at byte 0: {why}"
        ), repr(exc)
    assert time.monotonic() - t0 < FAST  # final: never retried


def test_patterns_joined_by_double_colons_are_read_as_webdataset_splits_them(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, cache = served
    root = data.paths[0].parent
    monkeypatch.chdir(root.parent)
    http = data.urls[2]
    for urls in (f"{root.name}/shard-000002.tar::{root.name}/shard-{{000000..000001}}.tar", f"{http}::{data.paths[0]}"):
        ours = _samples(wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False))
        theirs = _samples(wds.WebDataset(urls, shardshuffle=False))
        assert ours == theirs and len(ours) in (12, 8), urls


def test_a_shard_listed_twice_is_refused_naming_it_where_webdataset_reads_it_again(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, cache = served
    root = data.paths[0].parent
    monkeypatch.chdir(root.parent)
    a, b = (f"{root.name}/{p.name}" for p in data.paths[:2])
    urls = [a] * 2 + [b]  # webdataset's way to weight a source
    assert len(_samples(wds.WebDataset(urls, shardshuffle=False))) == 12  # a's 4 samples twice, then b's
    for make, shown in (
        (lambda: wdscache.WebDataset(urls, cache_dir=cache), a),
        (lambda: wdscache.CachedMultiLoader(urls=urls, cache_dir=cache), a),
        (lambda: wdscache.WebDataset([data.urls[1], data.urls[0], data.urls[1]], cache_dir=cache), data.urls[1]),
    ):
        with pytest.raises(wdscache.ConfigError) as info:
            make()
        message = str(info.value)
        assert message.startswith(f"urls= names the shard {shown!r} more than once: "), message
        assert "mix={source: weight, ...}" in message and "docs/mixtures.md" in message, message
    # Without a repeat, the samples are webdataset's.
    ours = _samples(wdscache.WebDataset([a, b], cache_dir=cache, shardshuffle=False))
    assert ours == _samples(wds.WebDataset([a, b], shardshuffle=False)) and len(ours) == 8


def test_urls_given_as_a_generator_or_map_are_read_as_webdataset_reads_them(served: Any) -> None:
    # A one-pass iterable was used up by the loader's first look at it (for pipe: commands): the agent
    # then got an empty list and refused "send the list first (put_urls)". An empty list did too.
    data, cache = served
    theirs = _samples(wds.WebDataset(iter(data.urls), shardshuffle=False))
    assert len(theirs) == 12
    for given in ((u for u in data.urls), map(str, data.urls), iter(data.urls)):
        assert _samples(wdscache.WebDataset(given, cache_dir=cache, shardshuffle=False)) == theirs
    assert len(_samples(wdscache.CachedMultiLoader(iter(data.urls), cache_dir=cache, shuffle=False))) == 12
    for empty in ([], iter(())):
        with pytest.raises(wdscache.ConfigError, match=r"^urls= is empty: give it at least one URL"):
            wdscache.WebDataset(empty, cache_dir=cache)
    # A path object naming a tar file is that shard (webdataset takes no path object).
    assert len(_samples(wdscache.WebDataset(data.paths[0], cache_dir=cache, shardshuffle=False))) == 4


def test_webdatasets_other_constructor_keywords_are_taken_or_refused_by_name(served: Any) -> None:
    # They were all refused as "CachedMultiLoader() got unexpected keyword arguments".
    data, cache = served
    theirs = _samples(wds.WebDataset(data.urls, wds.reraise_exception, shardshuffle=False, verbose=True))
    ours = wdscache.WebDataset(
        data.urls,
        wds.reraise_exception,  # webdataset's second positional argument
        cache_dir=cache,
        shardshuffle=False,
        repeat=True,
        verbose=True,
        detshuffle=True,
        cache_size=10**9,
        url_to_name=lambda url: "x",
    )
    assert _samples(ours) == theirs
    resampled = wdscache.WebDataset(data.urls, mode="resampled", cache_dir=cache).with_epoch(8)
    assert len(_samples(resampled)) == 8
    for name in ("select_files", "rename_files"):
        with pytest.raises(ValueError, match=rf"^wdscache.WebDataset\({name}=...\): the agent serves whole samples"):
            wdscache.WebDataset(data.urls, cache_dir=cache, **{name: lambda f: f})
    with pytest.raises(ValueError, match=r"mode='stream'\): the one mode is 'resampled'"):
        wdscache.WebDataset(data.urls, mode="stream", cache_dir=cache)
    # with_epoch(nbatches=N) is with_epoch(N), as in webdataset: it was refused under resampled=True.
    batches = wdscache.WebDataset(data.urls, cache_dir=cache, resampled=True).batched(4).with_epoch(nbatches=5)
    theirs_batches = wds.WebDataset(data.urls, resampled=True, shardshuffle=False).batched(4).with_epoch(nbatches=5)
    assert [len(b["__key__"]) for b in batches] == [len(b["__key__"]) for b in theirs_batches] == [4] * 5


def test_a_local_name_with_a_percent_or_a_question_mark_names_that_file(served: Any, tmp_path: Path) -> None:
    # "x%41.tar" is that file, as webdataset opens it, not "xA.tar" (the agent read the other
    # file's samples); "q?v.tar" is a name, not a query (webdataset's own reader cuts it at "?").
    data, cache = served
    folder = tmp_path / "odd"
    folder.mkdir()
    named, decoded, queried = folder / "x%41.tar", folder / "xA.tar", folder / "q?v.tar"
    named.write_bytes(data.paths[0].read_bytes())
    decoded.write_bytes(data.paths[1].read_bytes())
    queried.write_bytes(data.paths[2].read_bytes())
    for path, same in ((named, named), (queried, data.paths[2])):
        ours = _samples(wdscache.WebDataset(str(path), cache_dir=cache, shardshuffle=False))
        theirs = _samples(wds.WebDataset(str(same), shardshuffle=False))
        assert len(ours) == 4 and ours[0]["__local_path__"] == str(path), path
        assert [{k: v for k, v in s.items() if not k.startswith("__")} for s in ours] == [
            {k: v for k, v in s.items() if not k.startswith("__")} for s in theirs
        ], path


def test_pipe_shards_run_in_this_process_as_webdataset_runs_them(served: Any, tmp_path: Path) -> None:
    data, cache = served
    cmds = [f"pipe:cat {p}" for p in data.paths]
    whole = f"pipe:dd if={data.paths[1]} bs=1M count=10 status=none"  # no .tar at the end
    # A string is split at "::" and its braces expanded, as webdataset does: they were run as one command.
    braces = f"pipe:cat {data.paths[0].parent}/shard-{{000000..000002}}.tar"
    joined = f"{cmds[0]}::{cmds[2]}"
    for urls, n in ((cmds, 12), (whole, 4), (braces, 12), (joined, 8)):
        ours = _samples(wdscache.WebDataset(urls, cache_dir=cache, shardshuffle=False).map(_with_size))
        theirs = _samples(wds.WebDataset(urls, shardshuffle=False).map(_with_size))
        assert ours == theirs and len(ours) == n, urls
    failing = ["pipe:echo this is no tar", cmds[0]]
    exc, theirs_exc = (
        _raised(lambda make=make: make(failing, shardshuffle=False)) for make in (wdscache.WebDataset, wds.WebDataset)
    )
    assert type(exc) is type(theirs_exc) and exc.args[0] == theirs_exc.args[0] and exc.args[-1] == failing[0]
    with pytest.raises(TypeError, match="rank=.*pipe:"):
        wdscache.WebDataset(cmds, cache_dir=cache, rank=0)
    with pytest.raises(wdscache.ConfigError, match="mixes pipe:"):
        wdscache.WebDataset([cmds[0], data.urls[0]], cache_dir=cache)
    # The agent runs only the commands of its own list: a loader refuses them, saying what runs them.
    with pytest.raises(wdscache.ConfigError, match="wdscache.WebDataset reads pipe: shards in this process"):
        wdscache.CachedMultiLoader(whole, cache_dir=cache)


def test_pipe_shards_take_webdatasets_resampled_select_files_and_rename_files(dataset: Callable[..., Any]) -> None:
    # webdataset's own pipeline reads pipe: shards, so its keywords apply: resampled=True was
    # refused as "takes shards the agent caches", select_files= and rename_files= as "the agent
    # serves whole samples". (No agent: pipe: shards never reach it.)
    data = dataset(2, samples=4, payload=300)
    cmds = [f"pipe:cat {p}" for p in data.paths]
    # One shard, so that webdataset's unseeded draws of shards all draw it: the two must agree.
    for keywords in ({"resampled": True}, {"mode": "resampled"}):
        ours = _samples(wdscache.WebDataset(cmds[:1], shardshuffle=False, **keywords).with_epoch(10))
        theirs = _samples(wds.WebDataset(cmds[:1], shardshuffle=False, **keywords).with_epoch(10))
        assert ours == theirs and len(ours) == 10, keywords
        assert [s["__key__"] for s in ours] == [s["__key__"] for s in ours[:4]] * 2 + [s["__key__"] for s in ours[:2]]
    drawn = _samples(wdscache.WebDataset(cmds, resampled=True, shardshuffle=False).with_epoch(50))
    keys = {s["__key__"] for s in _samples(wds.WebDataset(cmds, shardshuffle=False))}
    assert len(drawn) == 50 and {s["__key__"] for s in drawn} <= keys
    chosen = {"select_files": lambda name: ".cls" not in name, "rename_files": lambda name: name + ".x"}
    for keywords in ({"select_files": chosen["select_files"]}, {"rename_files": chosen["rename_files"]}, chosen):
        ours = _samples(wdscache.WebDataset(cmds, shardshuffle=False, **keywords))
        theirs = _samples(wds.WebDataset(cmds, shardshuffle=False, **keywords))
        assert ours == theirs and len(ours) == 8, keywords
        fields = {k for s in ours for k in s if not k.startswith("__")}
        assert any(k.startswith("cls") for k in fields) is ("select_files" not in keywords), fields
        assert all(k.endswith(".x") is ("rename_files" in keywords) for k in fields), fields


def test_a_shuffle_given_webdatasets_keywords_after_the_source_is_webdatasets_and_says_so(served: Any) -> None:
    # .shuffle(n, seed=/initial=/rng=) right after the source became webdataset's shuffle stage
    # in silence, where the docs promise the loader's seeded buffer (an exact resume).
    data, cache = served
    for given in (lambda: {"seed": 1}, lambda: {"initial": 2, "seed": 1}, lambda: {"rng": random.Random(1)}):
        keywords = given()  # (each dataset its own generator)
        with pytest.warns(UserWarning) as caught:
            ours = wdscache.WebDataset(data.urls, cache_dir=cache, shardshuffle=False).shuffle(5, **keywords)
        assert len(caught) == 1, [str(w.message) for w in caught]
        named = ", ".join(f"{k}=" for k in sorted(keywords))
        assert str(caught[0].message) == (
            f"wdscache.WebDataset.shuffle(5, {named}...) is webdataset's shuffle stage, not the loader's "
            "seeded buffer: a checkpoint counts the samples it holds as delivered, its order is random "
            "unless seed= or rng= fixes it, and shards are shuffled by shardshuffle= alone; .shuffle(n) "
            "without keywords is the loader's"
        )
        assert caught[0].filename == __file__  # the line that called shuffle()
        theirs = _samples(wds.WebDataset(data.urls, shardshuffle=False).shuffle(5, **given()))
        assert _samples(ours) == theirs and len(theirs) == 12, keywords
    # Without keywords it is the loader's, and later in the pipeline webdataset's: nothing to say.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = wdscache.WebDataset(data.urls, cache_dir=cache, shardshuffle=False).shuffle(5)
        later = wdscache.WebDataset(data.urls, cache_dir=cache, shardshuffle=False).map(dict).shuffle(5, seed=1)
        assert len(plain.pipeline) == 1 and plain.loader.shuffle_buffer == 5 and len(later.pipeline) == 3
        assert sorted(s["__key__"] for s in plain) == sorted(s["__key__"] for s in later)


def test_a_cache_dir_that_does_not_exist_is_refused_at_once_naming_it(served: Any, tmp_path: Path) -> None:
    data, cache = served
    typo = tmp_path / "cahce"
    t0 = time.monotonic()
    with pytest.raises(wdscache.ConfigError, match=f"cache_dir='{typo}' does not exist"):
        wdscache.CachedMultiLoader(cache_dir=typo)  # the agent's own list: no private agent can start
    with pytest.raises(wdscache.ConfigError, match=f"nor does its folder {tmp_path / 'nope'}"):
        wdscache.WebDataset(data.urls, cache_dir=tmp_path / "nope" / "cache", shardshuffle=False)
    assert time.monotonic() - t0 < 30  # at once: not after the 60 s a loader waits for an agent
    assert not typo.exists() and not (tmp_path / "nope").exists()
    # A new folder in one that exists is a private agent's cache, made for it
    with wdscache.WebDataset(data.urls[:1], cache_dir=tmp_path / "fresh", shardshuffle=False) as ds:
        assert len(_samples(ds)) == 4


def test_https_to_a_plain_http_port_fails_at_once_naming_tls(served: Any) -> None:
    data, cache = served
    bad = data.urls[0].replace("http://", "https://")
    t0 = time.monotonic()
    exc = _raised(lambda: wdscache.WebDataset([bad], cache_dir=cache, shardshuffle=False))
    assert isinstance(exc, wdscache.FetchError) and "TLS handshake failed" in str(exc), str(exc)
    assert time.monotonic() - t0 < FAST


@pytest.mark.slow
def test_a_server_down_after_it_answered_is_named_when_the_wait_runs_out(
    shard_server: Any, dataset: Callable[..., Any], start_agent: Callable[..., Any], tmp_path: Path
) -> None:
    data = dataset(2, samples=4, payload=300)
    cache = tmp_path / "cache"
    start_agent(cache, data.list_file, "--prefetch", "1")
    assert len(list(wdscache.CachedMultiLoader(data.urls[:1], cache_dir=cache, shuffle=False))) == 4
    shard_server.stop()  # an outage: the host answered before, so the agent keeps retrying
    other = data.urls[1].replace("shard-", "later-")
    t0 = time.monotonic()
    exc = _raised(lambda: wdscache.CachedMultiLoader([other], cache_dir=cache, timeout=3.0))
    assert isinstance(exc, wdscache.FetchError) and isinstance(exc, OSError), repr(exc)
    assert "no progress for 3s" in str(exc) and "failed: connection refused" in str(exc), str(exc)
    assert time.monotonic() - t0 < FAST
