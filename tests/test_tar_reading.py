"""Tests for tar reading: the header walk, WebDataset grouping, sample tables,
growing shards, gzip and shard views.

WebDataset 1.0.2 is the reference: whatever it yields from a shard, wdscache
must yield too (keys, order, extensions, payload bytes).  Python's tarfile is
the reference for which members an archive holds.  Damaged archives must
raise ShardError and nothing else.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
import tempfile
import tracemalloc
import uuid
import warnings
from array import array
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import webdataset
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from scripts.shard_maker import find_gnu_tar, make_shard, synth_samples
from tests.helpers.testdata import NEEDS_TESTDATA, REAL_SHARDS, TESTDATA
from wdscache.agent.growing import WALK_STEP, GrowingShard, NotYet
from wdscache.agent.gunzip import GZIP_OUT, gunzip
from wdscache.agent.sampletable import PackedSamples, SampleTables, placed
from wdscache.agent.shardview import iter_samples, open_shard
from wdscache.shared.errors import ShardError
from wdscache.shared.samples import SampleSpan, is_meta_name, scan, split_name
from wdscache.shared.tarwalk import (
    BLOCK,
    GZIP_MAGIC,
    FileSpan,
    Member,
    cut_problem,
    header_ok,
    members,
    tar_problem,
    walk,
)

FORMATS = {"gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT, "ustar": tarfile.USTAR_FORMAT}
END = bytes(2 * BLOCK)


# --------------------------------------------------------------------------- helpers


def fields_of(sample: dict[str, Any]) -> dict[str, Any]:
    """Key and fields of a sample, payloads as bytes; the reader's own metadata dropped."""
    return {k: (v if k == "__key__" else bytes(v)) for k, v in sample.items() if k not in ("__url__", "__local_path__")}


def wds_read(path: Path, handler: Callable[[Exception], bool] = webdataset.ignore_and_continue) -> list[dict[str, Any]]:
    """What ``webdataset.WebDataset`` yields from one local shard, with a handler that goes on
    past a repeated field (as wdscache does) unless told otherwise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = webdataset.WebDataset(str(path), shardshuffle=False, empty_check=False, handler=handler)
        return [fields_of(s) for s in dataset]


def wds_read_bytes(data: bytes) -> list[dict[str, Any]]:
    """WebDataset's expander and grouper (its reading pipeline) over an in-memory tar, going on
    past a repeated field (a sample left with no field dropped, as wdscache makes none)."""
    files = tar_file_expander([{"url": "mem", "stream": io.BytesIO(data)}])
    grouped = [fields_of(s) for s in group_by_keys(files, handler=webdataset.ignore_and_continue)]
    return [s for s in grouped if len(s) > 1]


def ours_read(path: Path) -> list[dict[str, Any]]:
    """What wdscache serves from ``path``: a gzip'd file is read as the tar the cache keeps of it."""
    with open(path, "rb") as f:
        if f.read(2) == GZIP_MAGIC:
            f.seek(0)
            return ours_read_bytes(b"".join(gunzip(f.read, url=str(path))))
    return [fields_of(s) for s in iter_samples(path, url=str(path))]


def ours_read_bytes(data: bytes) -> list[dict[str, Any]]:
    return [
        {"__key__": span.key, **{ext: data[o : o + n] for ext, o, n in span.fields}} for span in scan(data, url="mem")
    ]


def regular(name: str, data: bytes = b"") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, linkname, 0
    return info, None


def tar_bytes(
    entries: Iterable[tuple[tarfile.TarInfo, bytes | None]],
    fmt: int = tarfile.PAX_FORMAT,
    **options: Any,
) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape", **options) as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def tarfile_regulars(data: bytes) -> list[tuple[str, bytes]]:
    """Names and payloads of the regular files tarfile finds (stream mode, as WebDataset)."""
    found = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tf:
        for info in tf:
            if info.isreg():
                found.append((info.name, tf.extractfile(info).read()))
    return found


def ours_members(data: bytes) -> list[tuple[str, bytes]]:
    return [(m.name, data[m.offset : m.offset + m.size]) for m in members(data, url="mem")]


def with_checksum(block: bytes | bytearray) -> bytes:
    block = bytearray(block)
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def with_signed_checksum(block: bytes) -> bytes:
    """``block`` with its checksum summed over signed bytes, as some old tars wrote it."""
    block = bytearray(block)
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(b - 256 if b > 127 else b for b in block)
    return bytes(block)


def raw_header(name: bytes, size: int | bytes, kind: bytes = b"0", *, prefix: bytes = b"") -> bytes:
    """One ustar header block; ``size`` is a number or the raw 12-byte field."""
    block = bytearray(BLOCK)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\0"
    block[124:136] = size if isinstance(size, bytes) else b"%011o\0" % size
    block[136:148] = b"00000000000\0"
    block[156:157] = kind
    block[257:265] = b"ustar\x0000"
    block[345 : 345 + len(prefix)] = prefix
    return with_checksum(block)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def pax_data(**records: str) -> bytes:
    out = b""
    for key, value in records.items():
        body = f" {key}={value}\n".encode()
        length = len(body) + 1
        while len(str(length)) + len(body) != length:
            length += 1
        out += str(length).encode() + body
    return out


def ext_member(kind: bytes, data: bytes) -> bytes:
    """An extension header (``L``, ``K``, ``x``, ``g``) with its data."""
    return raw_header(b"././@ext", len(data), kind) + padded(data)


def member(name: bytes, data: bytes, kind: bytes = b"0", **kw: bytes) -> bytes:
    return raw_header(name, len(data), kind, **kw) + padded(data)


# --------------------------------------------------------------------------- real shards


@NEEDS_TESTDATA
@pytest.mark.parametrize("name", REAL_SHARDS)
def test_real_shards_read_like_webdataset(name: str) -> None:
    path = TESTDATA / name
    expected = wds_read(path)
    assert expected
    assert ours_read(path) == expected


# --------------------------------------------------------------------------- generated shards


@pytest.mark.parametrize("packed", [False, True], ids=["tar", "gz"])
@pytest.mark.parametrize("tool", ["tarfile", "gnutar"])
def test_generated_shards_read_like_webdataset(tmp_path: Path, tool: str, packed: bool) -> None:
    if tool == "gnutar" and find_gnu_tar() is None:
        pytest.skip("GNU tar is not installed")
    samples = synth_samples(3, 25, payload=3000)
    path = make_shard(tmp_path / "shard.tar", samples, tool=tool, gzip=packed)
    got = ours_read(path)
    assert got == wds_read(path)
    assert got == [fields_of(s) for s in samples]


# --------------------------------------------------------------------------- names


def edge_entries() -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [
        special("top", tarfile.DIRTYPE),
        regular("a/b.seg.png", b"seg"),
        regular("a/b.cls", b"1"),
        regular("a/b", b"no extension: skipped, sample goes on"),
        regular("a/b.Upper.JPG", b"upper"),
        special("a/b.link", tarfile.SYMTYPE, "b.cls"),
        special("a/b.hard", tarfile.LNKTYPE, "a/b.cls"),
        regular("k1.TXT", b"k1"),
        regular("__meta__", b"skipped"),
        regular("___", b"skipped"),
        regular("__meta__/k1.json", b"skipped"),
        regular("k1.json", b"{}"),
        regular("__x__.json", b"a sample called __x__"),
        regular("dir/__y__.json", b"a sample called dir/__y__"),
        regular("dir/.hidden", b"key 'dir/', extension 'hidden'"),
        regular("dir/trailing.", b"empty extension"),
        regular("dir/sub/k2.json", b"k2"),
        regular("d" * 120 + "/k3.txt", b"long folder"),
        regular("../k4.txt", b"up"),
        regular("/abs/k5.txt", b"absolute"),
        special("fifo.txt", tarfile.FIFOTYPE),
        special("chr.txt", tarfile.CHRTYPE),
    ]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_member_names_like_webdataset(tmp_path: Path, fmt: int) -> None:
    path = tmp_path / "edge.tar"
    path.write_bytes(tar_bytes(edge_entries(), fmt))
    got = ours_read(path)
    assert got == wds_read(path)
    by_key = {s["__key__"]: s for s in got}
    # The rules, spelled out: first dot of the basename, lower-cased extensions,
    # no-extension names and __meta__ names skipped, links and dirs skipped.
    assert set(by_key["a/b"]) == {"__key__", "seg.png", "cls", "upper.jpg"}
    assert set(by_key["k1"]) == {"__key__", "txt", "json"}
    assert by_key["__x__"]["json"] == b"a sample called __x__"
    assert by_key["dir/"]["hidden"] == b"key 'dir/', extension 'hidden'"
    assert by_key["dir/trailing"][""] == b"empty extension"
    assert by_key["d" * 120 + "/k3"]["txt"] == b"long folder"
    assert [s["__key__"] for s in got] == [
        "a/b",
        "k1",
        "__x__",
        "dir/__y__",
        "dir/",
        "dir/trailing",
        "dir/sub/k2",
        "d" * 120 + "/k3",
        "../k4",
        "/abs/k5",
    ]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_long_names(tmp_path: Path, fmt: int) -> None:
    folder, base = "f" * 200, "b" * 150
    entries = [regular(f"{folder}/{base}.txt", b"x"), regular(f"{folder}/{base}.JSON", b"{}")]
    entries.append(special(f"{folder}/{base}.lnk", tarfile.SYMTYPE, "t" * 300))
    path = tmp_path / "long.tar"
    data = tar_bytes(entries, fmt)
    path.write_bytes(data)
    assert ours_read(path) == wds_read(path) == [{"__key__": f"{folder}/{base}", "txt": b"x", "json": b"{}"}]
    assert ours_members(data) == tarfile_regulars(data)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_non_utf8_names_match_webdataset(tmp_path: Path, fmt: int) -> None:
    # Latin-1 bytes in a name: tarfile (and so WebDataset) decodes them with
    # surrogateescape, giving lone surrogates in the key.
    name = os.fsdecode(b"caf\xe9/\xff\xfe.txt")
    path = tmp_path / "latin1.tar"
    entries = [regular(name, b"bytes"), regular("ok/\u00e9t\u00e9.txt", b"utf8")]
    path.write_bytes(tar_bytes(entries, fmt))
    got = ours_read(path)
    assert got == wds_read(path)
    assert [s["__key__"] for s in got] == ["caf\udce9/\udcff\udcfe", "ok/\u00e9t\u00e9"]


def test_dangerous_names_are_only_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    target = Path("/tmp") / f"wdscache-tario-{uuid.uuid4().hex}"
    names = ["../../escape.txt", f"{target}/abs.txt", str(target) + ".txt", "./here.txt"]
    entries = [regular(n, n.encode()) for n in names]
    entries += [
        special("evil.lnk", tarfile.SYMTYPE, "/etc/passwd"),
        special("up.lnk", tarfile.LNKTYPE, "../x"),
    ]
    path = tmp_path / "evil.tar"
    path.write_bytes(tar_bytes(entries))
    got = ours_read(path)
    assert got == wds_read(path)
    assert [s["__key__"] for s in got] == ["../../escape", f"{target}/abs", str(target), "./here"]
    assert list(workdir.iterdir()) == []
    assert not target.exists() and not Path(str(target) + ".txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "evil.tar"]


def test_samples_only_group_consecutive_members(tmp_path: Path) -> None:
    path = tmp_path / "split.tar"
    entries = [regular("a.txt", b"1"), regular("b.txt", b"2"), regular("a.jpg", b"3")]
    path.write_bytes(tar_bytes(entries))
    got = ours_read(path)
    assert got == wds_read(path)
    assert [s["__key__"] for s in got] == ["a", "b", "a"]


@pytest.mark.parametrize(
    ("names", "skipped", "kept"),
    [
        (["k.txt", "k.txt"], "k.txt", [{"__key__": "k", "txt": b"0"}]),
        (["k.txt", "k.TXT", "k.cls", "k.Cls"], "k.TXT", [{"__key__": "k", "txt": b"0", "cls": b"2"}]),
        (["d/k.a.b", "d/k.A.B"], "d/k.A.B", [{"__key__": "d/k", "a.b": b"0"}]),
        (["k.cls", "k.__key__"], "k.__key__", [{"__key__": "k", "cls": b"0"}]),
        (["k.__url__", "k.txt"], "k.__url__", [{"__key__": "k", "txt": b"1"}]),
        (["a.txt", "k.__url__", "b.txt"], "k.__url__", [{"__key__": "a", "txt": b"0"}, {"__key__": "b", "txt": b"2"}]),
    ],
)
def test_a_repeated_field_keeps_its_first_member_as_webdataset_going_on_keeps_it(
    tmp_path: Path, names: list[str], skipped: str, kept: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "dup.tar"
    path.write_bytes(tar_bytes([regular(n, str(i).encode()) for i, n in enumerate(names)]))
    with pytest.raises(ValueError):  # webdataset's default handler raises
        wds_read(path, handler=webdataset.reraise_exception)
    theirs = wds_read(path)  # with a handler that goes on
    # A sample of only __key__/__url__ members is none here; webdataset yields its bare key.
    assert ours_read(path) == [s for s in theirs if len(s) > 1] == kept
    # One warning a shard, naming the sample and the first member skipped.
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 1 and f"member {skipped!r} skipped" in warned[0] and str(path) in warned[0], warned
    ours_read(path)  # read again: said once
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1


# --------------------------------------------------------------------------- header dialects


def test_header_dialects_match_tarfile() -> None:
    signed = with_signed_checksum(raw_header(b"\xe9t\xe9.txt", 3))
    archive = b"".join(
        [
            member(b"name.txt", b"ustar prefix", prefix=b"some/folder"),
            member(b"v7dir/", b"", kind=b"\0"),  # old-style directory: skipped
            raw_header(b"dir", 1024, b"5"),  # a size on a directory: no data follows
            member(b"plain.txt", b"NUL type", kind=b"\0"),
            member(b"contig.txt", b"contiguous", kind=b"7"),
            member(b"volume", b"unknown type, data skipped", kind=b"V"),
            raw_header(b"big.txt", b"\x80" + (5).to_bytes(11, "big")) + padded(b"base2"),
            ext_member(b"K", b"l" * 200) + member(b"lnk", b"", kind=b"2"),
            ext_member(b"L", b"long/" * 30 + b"name.txt\0junk") + member(b"short", b"gnu long"),
            ext_member(b"x", pax_data(path="pax/path.txt/", size="5")),
            member(b"short", b"pax size+path"),
            # In a chain of extension headers the outermost one wins, as in tarfile.
            ext_member(b"L", b"outer-l.txt") + ext_member(b"x", pax_data(path="inner.txt")),
            member(b"s", b"1"),
            ext_member(b"x", pax_data(path="outer-x.txt")) + ext_member(b"L", b"inner.txt"),
            member(b"s", b"2"),
            signed + padded(b"sgn"),
            ext_member(b"g", pax_data(comment="global", path="global.txt")),
            member(b"renamed-by-global", b"g"),
            END,
        ]
    )
    expected = tarfile_regulars(archive)
    assert len(expected) == 10
    assert ours_members(archive) == expected
    assert ours_read_bytes(archive) == wds_read_bytes(archive)


def test_global_pax_header_from_tarfile(tmp_path: Path) -> None:
    path = tmp_path / "global.tar"
    path.write_bytes(tar_bytes([regular("k.txt", b"1")], pax_headers={"comment": "made by a test"}))
    assert ours_read(path) == wds_read(path) == [{"__key__": "k", "txt": b"1"}]


def test_member_and_span_records() -> None:
    entries = [regular("k.txt", b"abc"), regular("k.cls", b"7"), special("d", tarfile.DIRTYPE)]
    data = tar_bytes(entries)
    assert members(data, url="u") == [Member("k.txt", 512, 3), Member("k.cls", 1536, 1)]
    assert scan(memoryview(data), url="u") == [SampleSpan("k", (("txt", 512, 3), ("cls", 1536, 1)))]


@pytest.mark.parametrize(
    "archive",
    [
        raw_header(b"sparse.txt", 10, b"S") + padded(b"x" * 10) + END,
        ext_member(b"x", pax_data(**{"GNU.sparse.major": "1", "GNU.sparse.minor": "0"})) + member(b"s.txt", b"x") + END,
    ],
    ids=["gnu-sparse", "pax-sparse"],
)
def test_sparse_members_are_refused(archive: bytes) -> None:
    with pytest.raises(ShardError, match="sparse"):
        scan(archive, url="u")


@pytest.mark.parametrize(
    "archive",
    [
        ext_member(b"x", b"5 path=x\n"),  # wrong record length
        ext_member(b"x", b"garbage"),
        ext_member(b"x", pax_data(size="-3")),
        ext_member(b"g", pax_data(size="3")),
    ],
    ids=["bad-length", "garbage", "negative-size", "global-size"],
)
def test_bad_pax_headers(archive: bytes) -> None:
    with pytest.raises(ShardError) as info:
        scan(archive + member(b"k.txt", b"abc") + END, url="u")
    assert info.value.offset == 0


@pytest.mark.parametrize("kind", [b"L", b"x", b"g"])
def test_extension_header_without_member(kind: bytes) -> None:
    archive = member(b"k.txt", b"1") + ext_member(kind, pax_data(path="x"))
    for tail in (END, b""):
        with pytest.raises(ShardError, match="without a member") as info:
            scan(archive + tail, url="u")
        assert info.value.offset == 2 * BLOCK


# --------------------------------------------------------------------------- damage


def two_members() -> bytes:
    entries = [regular("a.txt", b"a" * 700), regular("b.txt", b"b" * 10)]
    return tar_bytes(entries, tarfile.GNU_FORMAT)


def test_empty_archives() -> None:
    assert scan(END, url="u") == []
    assert scan(bytes(BLOCK), url="u") == []
    with pytest.raises(ShardError, match="empty"):
        scan(b"", url="u")


@pytest.mark.parametrize(
    ("cut", "offset"),
    [(512 + 300, 0), (512 + 1024 - 1, 0), (1536 + 100, 1536), (1536 + 512 + 5, 1536)],
    ids=["in-data", "in-padding", "in-header", "in-last-data"],
)
def test_truncated_archive(cut: int, offset: int) -> None:
    with pytest.raises(ShardError, match="truncated") as info:
        scan(two_members()[:cut], url="u")
    assert info.value.offset == offset


def test_archive_cut_between_members_reads_what_is_there() -> None:
    # Indistinguishable from an archive without an end marker; tarfile reads it too.
    data = two_members()[:1536]
    assert ours_members(data) == tarfile_regulars(data) == [("a.txt", b"a" * 700)]


@pytest.mark.parametrize(("position", "offset"), [(3, 0), (1536 + 3, 1536), (1536 + 150, 1536)])
def test_corrupt_header_checksum(position: int, offset: int) -> None:
    data = bytearray(two_members())
    data[position] ^= 0x40
    with pytest.raises(ShardError, match="checksum") as info:
        scan(bytes(data), url="u")
    assert info.value.offset == offset


def test_headers_summing_past_65521_are_checked_exactly() -> None:
    """The walk sums a header's bytes with Adler-32, whose remainders wrap at 65521: a header
    of many high bytes must still match tarfile, and a checksum off by the modulus is refused."""
    high = raw_header("\uffff".encode() * 33, 3, prefix="\uffff".encode() * 51)
    heavy = bytearray(high)
    heavy[265:329] = b"\xff" * 64  # uname and gname: the block now sums to over 65521
    heavy[500:512] = b"\xfe" * 12
    heavy_block = with_checksum(heavy)
    assert sum(heavy_block) > 65521
    archive = heavy_block + padded(b"abc") + member(b"next.txt", b"x") + END
    assert (
        ours_members(archive)
        == tarfile_regulars(archive)
        == [("\uffff" * 51 + "/" + "\uffff" * 33, b"abc"), ("next.txt", b"x")]
    )
    stored = int(heavy_block[148:154], 8)
    for wrong in (stored - 65521, stored + 65521):
        bad = bytearray(heavy_block)
        bad[148:156] = b"%06o\0 " % wrong
        with pytest.raises(ShardError, match="checksum") as info:
            scan(bytes(bad) + padded(b"abc") + END, url="u")
        assert info.value.offset == 0


def test_a_header_whose_checksum_field_is_all_nuls_still_ends_at_the_end_block() -> None:
    """A header with an all-NUL checksum field can match (a signed sum of 0 with high bytes in
    its name): tarfile reads it, and the zero block after it still ends the archive."""
    block = bytearray(BLOCK)
    block[0:2] = b"\x80\x80"  # signed: -256, and the checksum field as spaces +256
    assert sum(b - 256 if b > 127 else b for b in block) + 8 * 32 == 0  # the field counts as 8 spaces
    archive = bytes(block) + END
    assert ours_members(archive) == tarfile_regulars(archive) == [("\udc80\udc80", b"")]
    assert [m.name for m in members(archive + member(b"after.txt", b"x"), url="u")] == ["\udc80\udc80"]


def test_not_a_tar() -> None:
    with pytest.raises(ShardError, match="checksum") as info:
        scan(b"<!doctype html><p>Not found</p>" + bytes(1000), url="u")
    assert info.value.offset == 0


@pytest.mark.parametrize(
    "size_field",
    [b"\x80" + (1 << 40).to_bytes(11, "big"), b"77777777777\0", b"\xff" * 12, b"12x45\0      "],
    ids=["terabyte", "8GB-octal", "negative", "not-octal"],
)
def test_absurd_sizes_fail_fast_without_allocating(size_field: bytes) -> None:
    archive = raw_header(b"huge.bin", size_field) + padded(b"tiny") + END
    tracemalloc.start()
    try:
        with pytest.raises(ShardError) as info:
            scan(archive, url="u")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert info.value.offset == 0


@pytest.mark.parametrize("kind", [b"L", b"x"])
def test_huge_extension_header_fails_fast(kind: bytes) -> None:
    archive = raw_header(b"././@ext", b"\x80" + (1 << 40).to_bytes(11, "big"), kind) + END
    with pytest.raises(ShardError, match="truncated"):
        scan(archive, url="u")


# --------------------------------------------------------------------------- recognising shards


def test_header_ok_and_tar_problem() -> None:
    data = two_members()
    assert header_ok(data[:BLOCK]) and header_ok(bytes(BLOCK))
    assert not header_ok(data[:100])
    assert not header_ok(b"x" + data[1:BLOCK])
    assert header_ok(with_signed_checksum(raw_header(b"\xff\xfe.txt", 0)))
    assert tar_problem(data) is None
    assert tar_problem(gzip.compress(data)) is None
    assert tar_problem(b"<html><body>oops</body></html>" + bytes(600)) == ("got an HTML/XML page, not a tar archive")


@pytest.mark.parametrize("tool", ["tarfile", "gnutar"])
def test_a_tar_cut_at_a_members_end_or_inside_one_is_told_from_a_whole_one(tmp_path: Path, tool: str) -> None:
    # A body that comes without its length is whole only if it reaches the end-of-archive marker.
    if tool == "gnutar" and find_gnu_tar() is None:
        pytest.skip("GNU tar is not installed")
    path = make_shard(tmp_path / "whole.tar", synth_samples(0, 4, payload=3000), tool=tool)
    data = path.read_bytes()
    assert cut_problem(path, url="u") is None
    with tarfile.open(path) as tf:
        third = tf.getmembers()[2].offset  # the samples before it are whole, as webdataset reads them
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:third])
    assert len(wds_read(cut)) == 1  # webdataset reads it as a smaller shard: nothing but this check tells
    assert cut_problem(cut, url="u") == f"no end-of-archive marker after its last member ({third} bytes)"
    cut.write_bytes(data[: third + BLOCK + 100])
    assert "runs past the end" in (cut_problem(cut, url="u") or "")
    cut.write_bytes(data[: third + 100])
    assert "ends inside a header" in (cut_problem(cut, url="u") or "")
    end = len(data.rstrip(b"\0"))  # the last member's data, its padding and part of the marker kept
    cut.write_bytes(data[: -(-end // BLOCK) * BLOCK + 100])
    assert cut_problem(cut, url="u") is None  # the marker cut short: the archive had ended
    packed = tmp_path / "cut.tar.gz"
    packed.write_bytes(gzip.compress(data[:third]))
    assert cut_problem(packed, url="u") is None  # a gzip stream has its own end, checked as it is unpacked


# --------------------------------------------------------------------------- shard views


def test_shard_view_payloads_and_lifetime(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "s.tar", synth_samples(0, 5))
    with open_shard(path, url="http://x/s.tar") as shard:
        assert [span.key for span in shard.samples] == [f"s00000_{i:05d}" for i in range(5)]
        first = shard.sample(0)
        assert first["__key__"] == "s00000_00000" and first["__url__"] == "http://x/s.tar"
        assert isinstance(first["jpg"], memoryview) and first["jpg"].readonly
        copied = shard.sample(0, copy=True)
        assert isinstance(copied["jpg"], bytes) and copied["jpg"] == first["jpg"]
        assert [fields_of(s) for s in shard.iter_samples()] == wds_read(path)
        ext, offset, size = shard.samples[0].fields[1]
        assert shard.data[offset : offset + size] == first[ext]
        kept = first["jpg"]
    # A payload still alive after close stays readable (the mapping outlives it).
    assert shard.closed and kept.tobytes() == copied["jpg"]
    shard.close()
    with pytest.raises(ValueError, match="closed"):
        shard.sample(0)
    with pytest.raises(ValueError, match="closed"):
        _ = shard.data
    del first, kept


def test_shard_view_close_with_exported_buffer(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "s.tar", synth_samples(0, 2))
    shard = open_shard(path, url="u")
    exported = pickle.PickleBuffer(shard.data)  # holds a buffer of the view itself
    shard.close()
    assert shard.closed and bytes(exported.raw()[:5]) == path.read_bytes()[:5]
    exported.release()


def mapped_here(path: Path) -> int:
    """How many mappings of ``path`` this process holds."""
    return Path("/proc/self/maps").read_text().count(f" {path}\n")


def test_shard_view_closes_mapping_when_no_payload_is_alive(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "s.tar", synth_samples(0, 2))
    shard = open_shard(path, url="u")
    assert len(list(shard.iter_samples(copy=True))) == 2
    assert mapped_here(path) == 1
    shard.close()
    assert mapped_here(path) == 0


def test_a_mapped_shard_holds_no_file_descriptor_and_is_unmapped_with_its_last_payload(tmp_path: Path) -> None:
    """A worker keeps mappings alive while frames cut from them wait to be sent: each must not
    cost an open file, or a worker with slow consumers runs out of them."""
    path = make_shard(tmp_path / "s.tar", synth_samples(0, 3))
    fds = set(os.listdir("/proc/self/fd"))
    shard = open_shard(path, url="u")
    kept = shard.sample(1)["jpg"]
    assert set(os.listdir("/proc/self/fd")) - fds == set() and mapped_here(path) == 1
    shard.close()
    assert mapped_here(path) == 1 and kept.tobytes() == wds_read(path)[1]["jpg"]
    del kept
    assert mapped_here(path) == 0


def test_damage_is_found_when_a_shard_is_opened(tmp_path: Path) -> None:
    path = tmp_path / "bad.tar"
    path.write_bytes(b"x" * 2048)
    with pytest.raises(ShardError, match="checksum"):
        open_shard(path, url="u")
    path.write_bytes(gzip.compress(b"x" * 2048))
    with pytest.raises(ShardError, match="checksum"):
        ours_read(path)


def test_a_gzipd_file_is_never_opened_as_a_cached_shard(tmp_path: Path) -> None:
    path = tmp_path / "s.tar"  # gzip'd, whatever its name
    path.write_bytes(gzip.compress(make_shard(tmp_path / "src.tar", synth_samples(0, 3)).read_bytes()))
    with pytest.raises(ShardError, match="gzip'd data in the cache"):
        open_shard(path, url="u")


def test_gunzip_holds_bounded_memory_however_far_the_data_expands(tmp_path: Path) -> None:
    path = tmp_path / "zeros.gz"
    with gzip.open(path, "wb") as gz:
        for _ in range(64):
            gz.write(bytes(4 << 20))  # 256 MiB in about 256 KB
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        total = 0
        with open(path, "rb") as f:
            for piece in gunzip(f.read, url="u"):
                assert len(piece) <= GZIP_OUT
                total += len(piece)
                del piece
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == 256 << 20
    assert peak < 5 * GZIP_OUT, peak  # a few pieces at a time (zlib grows its output buffer), never the whole


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.tar"
    path.write_bytes(b"")
    with pytest.raises(ShardError, match="empty"):
        open_shard(path, url="u")


def test_gzip_is_detected_by_magic_not_name(tmp_path: Path) -> None:
    data = tar_bytes([regular("k.txt", b"hello"), regular("k.cls", b"1")])
    (tmp_path / "packed.tar").write_bytes(gzip.compress(data))
    (tmp_path / "plain.tgz").write_bytes(data)
    expected = [{"__key__": "k", "txt": b"hello", "cls": b"1"}]
    assert ours_read(tmp_path / "packed.tar") == ours_read(tmp_path / "plain.tgz") == expected


def test_concatenated_gzip_members(tmp_path: Path) -> None:
    data = tar_bytes([regular(f"k{i}.bin", os.urandom(5000)) for i in range(6)])
    parts = [data[:1000], data[1000:20000], data[20000:]]
    path = tmp_path / "multi.tar.gz"
    path.write_bytes(b"".join(gzip.compress(p) for p in parts) + bytes(300))  # zero padding too
    assert ours_read(path) == wds_read_bytes(data)


@pytest.mark.parametrize(
    "damage",
    [
        lambda z: z[: len(z) // 2],
        lambda z: z[:30] + bytes(b ^ 0x55 for b in z[30:60]) + z[60:],
        lambda z: z + b"trailing garbage",
        lambda z: z + b"\x1f\x8bnot really gzip",
    ],
    ids=["truncated", "corrupt", "trailing-garbage", "bad-second-member"],
)
def test_damaged_gzip(tmp_path: Path, damage: Any) -> None:
    data = tar_bytes([regular(f"k{i}.bin", os.urandom(3000)) for i in range(4)])
    path = tmp_path / "bad.tgz"
    path.write_bytes(damage(gzip.compress(data)))
    with pytest.raises(ShardError):
        ours_read(path)


# --------------------------------------------------------------------------- properties

SAFE = "abcxyzABC019_-"
segment = st.text(SAFE, min_size=1, max_size=40)
safe_name = st.builds(
    lambda folders, base, ext: "/".join([*folders, base]) + (f".{ext}" if ext else ""),
    st.lists(segment, max_size=4),
    segment,
    st.one_of(st.none(), st.text(SAFE + ".", min_size=1, max_size=8)),
)
entry = st.one_of(
    st.tuples(safe_name, st.integers(0, 3000)),
    st.tuples(safe_name, st.sampled_from([tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE])),
)


def build_archive(entries: list[tuple[str, int | bytes]], fmt: int) -> bytes:
    built = []
    for i, (name, what) in enumerate(entries):
        if isinstance(what, int):
            built.append(regular(name, bytes([i % 251]) * what))
        else:
            built.append(special(name, what, linkname="target"))
    try:
        return tar_bytes(built, fmt)
    except ValueError:  # a name ustar cannot store
        reject()


@settings(max_examples=150, deadline=timedelta(seconds=2))
@given(entries=st.lists(entry, max_size=12), fmt=st.sampled_from(list(FORMATS.values())))
def test_random_archives_match_tarfile_and_webdataset(entries: list, fmt: int) -> None:
    data = build_archive(entries, fmt)
    assert ours_members(data) == tarfile_regulars(data)
    assert ours_read_bytes(data) == wds_read_bytes(data)


@settings(max_examples=60, deadline=timedelta(seconds=2))
@given(
    entries=st.lists(entry, max_size=12), fmt=st.sampled_from(list(FORMATS.values())), skip=st.integers(0, 3 * BLOCK)
)
def test_a_walk_over_part_of_a_file_reads_as_one_over_its_bytes(entries: list, fmt: int, skip: int) -> None:
    data = build_archive(entries, fmt)
    with tempfile.TemporaryFile() as f:
        f.write(b"\xff" * skip + data + b"\xff" * BLOCK)  # bytes either side are not the span's
        f.flush()
        assert list(walk(FileSpan(f.fileno(), skip, skip + len(data)), "u")) == list(walk(data, "u"))


@settings(max_examples=300, deadline=timedelta(seconds=2))
@given(names=st.lists(st.text("aB_./\n\u00e9", min_size=1, max_size=12), min_size=1, max_size=4))
def test_odd_names_group_like_webdataset(names: list[str]) -> None:
    data = tar_bytes([regular(n, n.encode()) for n in names])
    assert ours_read_bytes(data) == wds_read_bytes(data)


@settings(max_examples=2000, deadline=None)
@given(st.text("ab_./\n", max_size=16))
def test_split_name_is_webdatasets(name: str) -> None:
    key, ext = base_plus_ext(name)
    assert split_name(name) == (None if key is None else (key, ext))


@pytest.mark.parametrize(
    ("name", "skipped"),
    [
        ("__meta__", True),
        ("___", True),
        ("__", True),
        ("__a__/b.json", True),
        ("____\n", True),
        ("__meta__.json", False),
        ("d/__meta__", False),
        ("___/x.json", False),
        ("_a__", False),
        ("___\n", False),
    ],
)
def test_is_meta_name_matches_webdataset(name: str, skipped: bool) -> None:
    assert is_meta_name(name) is skipped
    stream = io.BytesIO(tar_bytes([regular(name)]))
    files = list(tar_file_expander([{"url": "m", "stream": stream}]))
    assert (files == [{}]) is skipped  # only the end-of-shard marker is left


@st.composite
def damaged_archives(draw: st.DrawFn) -> bytes:
    entries = draw(st.lists(st.tuples(safe_name, st.integers(0, 1500)), min_size=1, max_size=4))
    data = bytearray(build_archive(entries, draw(st.sampled_from(list(FORMATS.values())))))
    for _ in range(draw(st.integers(0, 6))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=400, deadline=timedelta(seconds=1), suppress_health_check=[HealthCheck.too_slow])
@given(damaged_archives())
def test_damaged_archives_raise_only_shard_errors(data: bytes) -> None:
    for read in (lambda: members(data, url="mem"), lambda: scan(data, url="mem")):
        try:
            read()
        except ShardError:
            pass


@settings(max_examples=100, deadline=timedelta(seconds=2))
@given(damaged=damaged_archives(), position=st.integers(0, 10_000), value=st.integers(0, 255))
def test_damaged_gzip_raises_only_shard_errors(damaged: bytes, position: int, value: int) -> None:
    packed = bytearray(gzip.compress(damaged))
    packed[position % len(packed)] = value
    # Hypothesis tests cannot use the function-scoped tmp_path fixture.
    with tempfile.TemporaryDirectory(prefix="wdscache-tario-") as tmp:
        path = Path(tmp, "shard.tgz")
        path.write_bytes(packed)
        try:
            ours_read(path)
        except ShardError:
            pass


# --------------------------------------------------------------------------- shards still downloading


def grow(path: Path, data: bytes, cuts: Iterable[int]) -> Iterable[int]:
    """Append ``data`` to ``path`` in pieces ending at ``cuts``; yields each size reached."""
    done = 0
    for cut in [*cuts, len(data)]:
        with open(path, "ab") as f:
            f.write(data[done:cut])
        done = cut
        yield done


def sample_bytes(view: GrowingShard, i: int) -> tuple[SampleSpan, bytes, int]:
    """Sample ``i`` of ``view``: its span, and its bytes from its first field's start to its last
    field's end as a worker serves them (from the view's mapping), with the offset they start at."""
    span = view.samples[i]
    first, end = span.fields[0][1], span.fields[-1][1] + span.fields[-1][2]
    return span, bytes(view.mapped(end).data[first:end]), first


def assert_growing_matches(path: Path, data: bytes, cuts: Iterable[int]) -> None:
    """At every size, the growing view holds exactly the complete samples of the whole shard."""
    full = scan(data, url="u")
    path.write_bytes(b"")
    view = GrowingShard(path, url="u")
    known = 0
    try:
        for size in grow(path, data, cuts):
            view.refresh()
            n = len(view.samples)
            assert view.samples == full[:n]
            assert n >= known  # a sample once known stays known (consumers have taken it)
            known = n
            assert n == len(full) - 1 or size < len(data)  # the last one waits for the finished file
            for i in range(n):
                span, block, first = sample_bytes(view, i)
                assert block == data[first : span.fields[-1][1] + span.fields[-1][2]]
        assert len(view.samples) == len(full) - 1
    finally:
        view.close()


@pytest.mark.parametrize("tool", ["tarfile", "gnutar"])
def test_growing_shard_holds_the_complete_samples_at_every_size(tmp_path: Path, tool: str) -> None:
    if tool == "gnutar" and find_gnu_tar() is None:
        pytest.skip("GNU tar not installed")
    data = make_shard(tmp_path / "src.tar", synth_samples(0, 25, payload=1500), tool=tool).read_bytes()
    # Cuts at every 97 bytes: inside headers, payloads and padding.
    assert_growing_matches(tmp_path / "growing.tar", data, range(97, len(data), 97))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=1, max_value=60_000), max_size=12))
def test_growing_shard_with_long_names_and_pax_records(tmp_path: Path, cuts: list[int]) -> None:
    entries = []
    for i in range(12):
        key = f"dir/{'deep/' * (30 if i % 3 == 0 else 0)}sample{i:03d}"
        for ext in ("jpg", "cls"):
            entries.append(regular(f"{key}.{ext}", bytes([i]) * (500 * i + 3)))
    data = tar_bytes(entries, pax_headers={"comment": "a global header"})
    assert_growing_matches(tmp_path / f"g-{uuid.uuid4().hex}.tar", data, sorted(set(c % len(data) for c in cuts)))


def test_growing_shard_with_a_global_pax_header_mid_archive(tmp_path: Path) -> None:
    def samples(first: int, n: int) -> bytes:
        return b"".join(
            member(f"s{i:03d}.{ext}".encode(), bytes([i]) * (700 + i))
            for i in range(first, first + n)
            for ext in ("cls", "jpg")
        )

    # A global path renames every member after it (tarfile's reading): here the last one.
    # Walks resumed after the header must not shift the view's sample indices.
    data = samples(0, 6) + ext_member(b"g", pax_data(path="late/g.bin")) + member(b"s006.cls", b"6") + END
    assert [span.key for span in scan(data, url="u")][5:] == ["s005", "late/g"]
    assert_growing_matches(tmp_path / "mid.tar", data, range(700, len(data), 700))


def test_growing_shard_asked_for_a_sample_walks_a_step_past_it(tmp_path: Path) -> None:
    # A download well under way: a look for its first samples walks a step of headers, not all of
    # them, and the steps add up to exactly the samples a whole walk finds.
    n = 3 * WALK_STEP
    data = make_shard(tmp_path / "src.tar", synth_samples(0, n, payload=10)).read_bytes()
    full = scan(data, url="u")
    path = tmp_path / "growing.tar"
    path.write_bytes(data)  # every member there, as a partial file just before it is published
    view = GrowingShard(path, url="u")
    try:
        view.refresh(0)
        assert view.samples == full[: WALK_STEP + 1]
        view.refresh(2 * WALK_STEP)
        assert view.samples == full[: 3 * WALK_STEP + 1][: n - 1]
        view.refresh()
        assert view.samples == full[: n - 1]  # the last waits for the finished file
        with open(path, "rb") as f:
            assert view.complete(f.fileno(), "u") == full
    finally:
        view.close()
    stepped = GrowingShard(path, url="u")
    try:
        stepped.refresh(5)
        with open(path, "rb") as f:  # published after a step: the rest is walked from there
            assert stepped.complete(f.fileno(), "u") == full
    finally:
        stepped.close()


def test_a_walk_of_a_published_shard_counts_its_last_sample_once_it_reaches_the_end(tmp_path: Path) -> None:
    # A worker reads a shard published before it knew its samples as a walk of the file: the file
    # never grows, so the end of the walk ends the last sample (a download's walk cannot tell).
    n = 2 * WALK_STEP + 3
    path = make_shard(tmp_path / "published.tar", synth_samples(0, n, payload=10))
    full = scan(path.read_bytes(), url="u")
    view = GrowingShard(path, url="u", published=True)
    try:
        view.refresh(n - 1)  # asked for the last sample: the walk reaches the end
        assert view.samples == full
        assert sample_bytes(view, n - 1)[0] == full[-1]
        view.refresh()
        assert view.samples == full  # nothing found twice
        with open(path, "rb") as f:
            assert view.complete(f.fileno(), "u") == full
    finally:
        view.close()
    stepped = GrowingShard(path, url="u", published=True)
    try:
        stepped.refresh(0)  # a step, not the end: its last group may go on
        assert stepped.samples == full[: WALK_STEP + 1]
        stepped.refresh()
        assert stepped.samples == full
    finally:
        stepped.close()
    download = GrowingShard(path, url="u")
    try:
        download.refresh()
        assert download.samples == full[:-1]  # the same bytes as a download so far: the last may grow
    finally:
        download.close()
    # Cut short, a published file is damaged: its walk says so where a download's waits for more.
    cut = tmp_path / "cut.tar"
    cut.write_bytes(path.read_bytes()[: full[-1].fields[-1][1] + 5])
    for published in (True, False):
        walker = GrowingShard(cut, url="u", published=published)
        try:
            if published:
                with pytest.raises(ShardError, match="truncated"):
                    walker.refresh(n - 1)
            else:
                walker.refresh(n - 1)
                assert walker.samples == full[:-1]
        finally:
            walker.close()


def test_a_damaged_header_is_named_at_its_own_byte_however_far_the_walk_got(tmp_path: Path) -> None:
    # Walks of a download resume where the last complete sample ended; the error still names the
    # byte of the shard where the bad header is, as a walk of the whole file does.
    data = bytearray(make_shard(tmp_path / "src.tar", synth_samples(0, 6, payload=400)).read_bytes())
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tf:
        bad = tf.getmembers()[8].offset  # the third sample's second member
    data[bad] ^= 0x01
    path = tmp_path / "growing.tar"
    path.write_bytes(data[:bad])  # the download so far stops just before the bad header
    view = GrowingShard(path, url="u")
    try:
        view.refresh()
        assert len(view.samples) == 2  # the walk resumes at the third sample
        path.write_bytes(data)
        with pytest.raises(ShardError) as refreshed:
            view.refresh()
        with open(path, "rb") as f, pytest.raises(ShardError) as completed:
            view.complete(f.fileno(), "u")
    finally:
        view.close()
    with pytest.raises(ShardError) as whole:
        scan(bytes(data), url="u")
    assert refreshed.value.offset == completed.value.offset == whole.value.offset == bad
    assert f"at byte {bad}:" in str(refreshed.value)


def test_growing_shard_follows_a_download_that_starts_over(tmp_path: Path) -> None:
    data = make_shard(tmp_path / "src.tar", synth_samples(0, 10, payload=1000)).read_bytes()
    path = tmp_path / "growing.tar"
    path.write_bytes(data[: len(data) // 2])
    view = GrowingShard(path, url="u")
    view.refresh()
    known = len(view.samples)
    assert known > 2
    # Cut short behind the agent and written again: what is not there any more is "not yet",
    # never other bytes (nothing of it was mapped: the agent never cuts a file it maps).
    path.write_bytes(data[:1000])
    with pytest.raises(NotYet):
        sample_bytes(view, known - 1)
    view.refresh()
    assert len(view.samples) < known
    # A new file in its place (a new download): followed, from its start.
    os.unlink(path)
    path.write_bytes(data[: len(data) - 100])
    view.refresh()
    assert view.samples == scan(data, url="u")[: len(view.samples)] and len(view.samples) >= known
    # Published (renamed away): what was found stays readable, no more comes.
    os.rename(path, tmp_path / "final.tar")
    span, block, first = sample_bytes(view, 0)
    assert block == data[first : span.fields[-1][1] + span.fields[-1][2]]
    with pytest.raises(FileNotFoundError):
        view.refresh()
    view.close()


def test_growing_gzip_shard_shows_no_samples_until_finished(tmp_path: Path) -> None:
    data = gzip.compress(make_shard(tmp_path / "src.tar", synth_samples(0, 10)).read_bytes())
    path = tmp_path / "growing.tar.gz"
    path.write_bytes(data[:-10])
    view = GrowingShard(path, url="u")
    view.refresh()
    assert view.samples == []
    view.close()


def test_growing_shard_reports_damage(tmp_path: Path) -> None:
    data = bytearray(make_shard(tmp_path / "src.tar", synth_samples(0, 10, payload=1000)).read_bytes())
    second = members(bytes(data), url="u")[3].offset - BLOCK  # the header of sample 1's first member
    data[second + 10] ^= 0xFF
    path = tmp_path / "growing.tar"
    path.write_bytes(bytes(data[: second + 3 * BLOCK]))
    view = GrowingShard(path, url="u")
    with pytest.raises(ShardError, match="checksum"):
        view.refresh()
    view.close()


def test_a_published_download_keeps_the_samples_its_growing_view_found(tmp_path: Path) -> None:
    data = make_shard(tmp_path / "src.tar", synth_samples(0, 12, payload=1000)).read_bytes()
    full = scan(data, url="u")
    partial, final = tmp_path / "partial.tar", tmp_path / "final.tar"
    partial.write_bytes(data[: len(data) // 2])
    view = GrowingShard(partial, url="u")
    view.refresh()
    assert 0 < len(view.samples) < len(full)
    with open(partial, "ab") as f:
        f.write(data[len(data) // 2 :])
    os.rename(partial, final)  # publishing keeps the inode
    with open(final, "rb") as f:
        assert view.complete(f.fileno(), "u") == full  # the first half is not walked again
    with open_shard(final, url="u", growing=view) as shard:
        assert shard.samples == full
    # Another file under that name (not what the view read): found from scratch.
    os.unlink(final)
    final.write_bytes(data)
    with open(final, "rb") as f:
        assert view.complete(f.fileno(), "u") is None
    with open_shard(final, url="u", growing=view) as shard:
        assert shard.samples == full
    view.close()


def test_a_published_shard_walked_a_step_at_a_time_opens_with_the_samples_of_a_whole_walk(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "s.tar", synth_samples(0, 2 * WALK_STEP + 40, payload=50))
    full = scan(path.read_bytes(), url="u")
    view = GrowingShard(path, url="u")  # a finished file, as a worker walks one ahead of its reads
    steps = []
    while not steps or steps[-1] > (steps[-2] if len(steps) > 1 else 0):
        view.refresh(len(view.samples))
        steps.append(len(view.samples))
    assert steps[0] < len(full) and steps[-1] == len(full) - 1  # the last is complete only at the end
    with open_shard(path, url="u", growing=view) as shard:
        assert shard.samples == full
    view.close()


def test_damage_after_a_growing_view_is_reported_at_its_file_offset(tmp_path: Path) -> None:
    data = bytearray(make_shard(tmp_path / "src.tar", synth_samples(0, 12, payload=1000)).read_bytes())
    late = members(bytes(data), url="u")[30].offset - BLOCK  # a header well after the first half
    path = tmp_path / "shard.tar"
    path.write_bytes(bytes(data[: len(data) // 3]))
    view = GrowingShard(path, url="u")
    view.refresh()
    data[late + 10] ^= 0xFF
    path.write_bytes(bytes(data))  # same inode: written in place, as a download appends
    with pytest.raises(ShardError, match="checksum") as info:
        open_shard(path, url="u", growing=view)
    assert info.value.offset == late
    view.close()


# --------------------------------------------------------------------------- sample tables


def test_a_shard_opened_again_comes_from_its_table_for_the_same_file_only(tmp_path: Path) -> None:
    path = make_shard(tmp_path / "s.tar", synth_samples(0, 20, payload=300))
    full = scan(path.read_bytes(), url="u")
    tables = SampleTables(1000)
    with open_shard(path, url="u", tables=tables) as shard:
        assert shard.samples == full
    assert (len(tables), tables.sample_count) == (1, 20)
    # Damage the file in place but keep its identity (inode, size, mtime): a reopen that
    # walked the headers would fail, so an answer shows the walk was skipped.
    st = path.stat()
    damaged = bytearray(path.read_bytes())
    damaged[10] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(damaged)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open_shard(path, url="u", tables=tables) as shard:
        assert shard.samples == full
    with pytest.raises(ShardError, match="checksum"):
        open_shard(path, url="u")  # without the tables, the damage shows
    # The same file under another URL: an entry of its own, found by a walk (damage and all).
    with pytest.raises(ShardError, match="checksum"):
        open_shard(path, url="v", tables=tables)
    assert len(tables) == 1
    # Another file at the path (a new download) is walked: damage found, nothing stale served.
    # (Its inode number may be the old one's again: its mtime tells it apart.)
    os.unlink(path)
    path.write_bytes(bytes(damaged))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ShardError, match="checksum"):
        open_shard(path, url="u", tables=tables)


@settings(max_examples=60, deadline=timedelta(seconds=2))
@given(entries=st.lists(entry, max_size=12), fmt=st.sampled_from(list(FORMATS.values())))
def test_the_tables_give_back_exactly_the_samples_they_were_given(entries: list, fmt: int) -> None:
    data = build_archive(entries, fmt)
    try:
        samples = scan(data, url="u")
    except ShardError:
        reject()
    tables = SampleTables(1000)
    tables.put("u", (1,), samples)
    assert tables.get("u", (1,)) == samples
    assert tables.get("u", (2,)) is None


def test_the_tables_keep_the_most_recently_used_shards_within_their_bound() -> None:
    def spans(n: int, tag: str) -> list[SampleSpan]:
        return [SampleSpan(f"{tag}{i}", (("cls", 512 + 1024 * i, 1), ("jpg", 1024 + 1024 * i, 7))) for i in range(n)]

    tables = SampleTables(10)
    for url in "abc":
        tables.put(url, (0,), spans(4, url))
    assert tables.get("a", (0,)) is None  # 12 > 10: the oldest went
    assert tables.get("b", (0,)) == spans(4, "b")  # used: now the newest
    tables.put("d", (0,), spans(4, "d"))
    assert tables.get("c", (0,)) is None and tables.get("b", (0,)) is not None
    assert tables.sample_count <= 10
    tables.put("big", (0,), spans(11, "x"))  # more than the bound: not kept, nothing pushed out
    assert tables.get("big", (0,)) is None and tables.get("d", (0,)) is not None
    tables.put("b", (1,), spans(2, "b"))  # a new file for a URL replaces its entry
    assert tables.get("b", (0,)) is None and tables.get("b", (1,)) == spans(2, "b")
    assert tables.sample_count == 6


def test_packed_samples_read_like_the_list_they_pack() -> None:
    spans = [SampleSpan(f"k{i}", (("cls", 512 + 2048 * i, 1), ("jpg", 1536 + 2048 * i, 9))) for i in range(5)]
    spans.append(SampleSpan("odd", (("txt", 20_000, 3),)))  # another set of extensions
    packed = PackedSamples(spans)
    assert len(packed) == 6 and list(packed) == spans and packed == spans
    assert packed[0] == spans[0] and packed[-1] == spans[-1] and packed[1:4] == spans[1:4]
    with pytest.raises(IndexError):
        packed[6]
    assert packed != spans[:5] and PackedSamples([]) == []
    # What a worker puts on the wire, straight from the tables, is what the spans say.
    assert [placed(packed, i) for i in range(6)] == [placed(spans, i) for i in range(6)]
    assert placed(packed, 1) == ("k1", ("cls", "jpg"), [2560, 1, 3584, 9])
    assert placed(packed, 5) == ("odd", ("txt",), [20_000, 3])


def test_packed_samples_travel_as_parts_and_bad_parts_are_refused() -> None:
    spans = [SampleSpan(f"k\udcff{i}", (("cls", 512 + 2048 * i, 1), ("jpg", 1536 + 2048 * i, 9))) for i in range(5)]
    spans.append(SampleSpan("odd", (("txt", 20_000, 3),)))
    layouts, frames = PackedSamples(spans).parts()
    assert PackedSamples.from_parts(layouts, frames, 20_003) == spans  # a key that is no valid UTF-8, too
    assert PackedSamples.from_parts(*PackedSamples([]).parts(), 0) == []

    def refused(layouts: Any, frames: list[bytes], size: int = 20_003) -> str:
        with pytest.raises(ValueError) as info:
            PackedSamples.from_parts(layouts, frames, size)
        return str(info.value)

    assert "outside the file" in refused(layouts, frames, 20_002)  # the last payload ends past it
    keys, ends, kinds, starts, numbers = frames
    assert "different lengths" in refused(layouts, [keys, ends, kinds, starts[8:], numbers])
    assert "out of order" in refused(layouts, [keys + b"x", ends, kinds, starts, numbers])
    assert "do not match" in refused(layouts[:1], frames)  # a sample names a layout not sent
    assert "do not match" in refused([["cls", "jpg", "x"], ["txt"]], frames)  # more numbers than sent
    negative = array("q", [-1]).tobytes() + numbers[8:]
    assert "outside the file" in refused(layouts, [keys, ends, kinds, starts, negative])
    assert refused(layouts, [keys, ends, kinds, starts, numbers[:-1]])  # not whole numbers
    assert "layouts" in refused([["cls", 1]], frames) and "5 frames" in refused(layouts, frames[:4])
