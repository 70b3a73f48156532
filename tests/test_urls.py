"""Tests for wdscache.shared.urls: brace expansion, URL list parsing, diff and format."""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import braceexpand
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wdscache.shared.errors import ConfigError, ShardIndexError, UrlListError
from wdscache.shared.s3 import Listing, is_listing, listed_by
from wdscache.shared.shard_index import ShardInfo, format_shard_index
from wdscache.shared.urls import (
    UrlList,
    diff_urls,
    expand_braces,
    format_url_list,
    given_list,
    parse_url_list,
    read_url_list,
)


def write_list(tmp_path: Path, text: str | bytes, name: str = "urls.txt") -> Path:
    path = tmp_path / name
    if isinstance(text, str):
        text = text.encode("utf-8")
    path.write_bytes(text)
    return path


# --------------------------------------------------------------------------- braces


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("s-{000..003}.tar", ["s-000.tar", "s-001.tar", "s-002.tar", "s-003.tar"]),
        ("{0..10}", [str(i) for i in range(11)]),
        ("{00..10}", [f"{i:02d}" for i in range(11)]),
        ("{8..011}", ["008", "009", "010", "011"]),
        ("{3..1}", ["3", "2", "1"]),
        ("{10..08}", ["10", "09", "08"]),
        ("{5..5}", ["5"]),
        ("{train,val}.tar", ["train.tar", "val.tar"]),
        ("x{a,,b}", ["xa", "x", "xb"]),
        ("{a,b}{1,2}", ["a1", "a2", "b1", "b2"]),
        ("{a,b}-{0..2}", ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"]),
        ("{a,b{1..2}}c", ["ac", "b1c", "b2c"]),
        ("{x{a,b},y}", ["xa", "xb", "y"]),
        (r"a\{1,2\}", ["a{1,2}"]),
        (r"\{{a,b}\}", ["{a}", "{b}"]),
        (r"p\}q", ["p}q"]),
        ("a,b", ["a,b"]),
        (r"a\b{1,2}", ["ab1", "ab2"]),
        (r"a{1,2\,3}", ["a1", "a2,3"]),
        (r"a\,{1,2}", ["a,1", "a,2"]),
        (r"a\\{1,2}", [r"a\1", r"a\2"]),
        (r"a{1,2}\\", ["a1\\", "a2\\"]),
    ],
)
def test_expand_braces(pattern: str, expected: list[str]) -> None:
    assert expand_braces(pattern) == expected
    assert list(braceexpand.braceexpand(pattern)) == expected  # webdataset's reading


def test_a_pattern_without_braces_keeps_its_backslashes() -> None:
    # (braceexpand drops them: a pipe: command's, a path's, are taken as written)
    assert expand_braces(r"pipe:sed 's/\./x/' a.tar") == [r"pipe:sed 's/\./x/' a.tar"]
    assert parse_url_list(format_url_list([r"http://h/a\{b}.tar", r"http://h/c\d.tar"])).urls == (
        r"http://h/a\{b}.tar",
        r"http://h/c\d.tar",
    )


def test_expand_braces_keeps_duplicates() -> None:
    assert expand_braces("{a,a}") == ["a", "a"]


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("{a,b", "unclosed '{' at offset 0"),
        ("x{a,{b,c}", "unclosed '{' at offset 1"),
        ("a}", "unmatched '}' at offset 1"),
        ("{a,b}}", "unmatched"),
        ("{}", "empty braces"),
        ("{1..}", "empty range bound"),
        ("{..5}", "empty range bound"),
        ("{a..c}", "non-negative integers"),
        ("{-1..3}", "non-negative integers"),
        ("{1...3}", "non-negative integers"),
        ("{abc}", "single item"),
        ("{" * 200 + "a,b" + "}" * 200, "nested more than"),
    ],
)
def test_expand_braces_errors(pattern: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        expand_braces(pattern)
    assert fragment in str(info.value)


def _peak_bytes(call: Callable[[], object]) -> int:
    """The most memory ``call`` held at once (it may raise: the peak is taken all the same)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(Exception):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_huge_expansion_refused_before_building() -> None:
    # Refused from the count alone: a billion URLs are never built, not even in part.
    assert _peak_bytes(lambda: expand_braces("http://h/{0..999999999}.tar")) < 1 << 20
    with pytest.raises(ValueError) as info:
        expand_braces("http://h/{0..999999999}.tar")
    assert "1000000000" in str(info.value)
    assert "10000000" in str(info.value)


def test_expansion_limit_counts_the_product() -> None:
    assert len(expand_braces("{0..9}{0..9}", limit=100)) == 100
    assert len(expand_braces("{0..9}{0..9}{a,b{c,d}}", limit=300)) == 300
    with pytest.raises(ValueError, match="101 entries.*limit of 100"):
        expand_braces("{0..100}", limit=100)
    # Nested counts multiply inside a group and add across alternatives.
    with pytest.raises(ValueError, match="would expand to 1000000000000 entries"):
        expand_braces("{{0..999999},{0..999999}}{0..499999}")


def test_expand_braces_gives_a_million_entries() -> None:
    urls = expand_braces("http://h/shard-{000000..999999}.tar")
    assert len(urls) == 1_000_000
    assert urls[0] == "http://h/shard-000000.tar"
    assert urls[-1] == "http://h/shard-999999.tar"


# --------------------------------------------------------------------------- parsing


def test_comments_and_blank_lines() -> None:
    text = "# header\n\n   \n  # indented comment\nhttp://h/a.tar\n\t\nhttps://h/b.tar\n"
    assert parse_url_list(text).urls == ("http://h/a.tar", "https://h/b.tar")


def test_trailing_comments_and_hash_inside_url() -> None:
    text = (
        "http://h/a.tar  # train\n"
        "http://h/b.tar\t#val\n"
        "http://h/c.tar#frag\n"
        "  http://h/d.tar   \r\n"
        "http://h/e.tar # two words # more\n"
    )
    assert parse_url_list(text).urls == (
        "http://h/a.tar",
        "http://h/b.tar",
        "http://h/c.tar#frag",
        "http://h/d.tar",
        "http://h/e.tar",
    )


def test_internal_whitespace_is_an_error() -> None:
    with pytest.raises(UrlListError) as info:
        parse_url_list("http://h/a.tar\n\nhttp://h/b.tar http://h/c.tar\n")
    err = info.value
    assert (err.path, err.lineno, err.line) == ("<urls>", 3, "http://h/b.tar http://h/c.tar")
    assert "<urls>:3" in str(err) and "one URL" in str(err)


def test_an_s3_key_with_spaces_is_one_entry_taken_literally() -> None:
    text = "s3://b/key with space.tar\ns3://b/two  spaces.tar   # a comment\ns3://b/key%20x.tar\n"
    assert parse_url_list(text, lister=lambda url: (url,)).urls == (
        "s3://b/key with space.tar",
        "s3://b/two  spaces.tar",
        "s3://b/key%20x.tar",
    )
    for line in ("s3://b/a.tar s3://b/b.tar", "http://h/a b.tar"):
        with pytest.raises(UrlListError, match="one URL"):
            parse_url_list(line, lister=lambda url: (url,))


def test_an_s3_key_with_spaces_given_alone_is_taken_as_written(tmp_path: Path) -> None:
    """In a shard index and a job's own list each URL stands alone: an s3:// key keeps its spaces
    and its " #" (no comment there). White space in another URL, and a line break in any, are
    still refused, naming the URL."""
    urls = ["s3://b/key with space.tar", "s3://b/c #1.tar", "s3://b/{x}.tar"]
    index = write_list(tmp_path, format_shard_index((u, ShardInfo(3)) for u in urls), "index.json")
    assert read_url_list(index).urls == tuple(urls)
    assert given_list(urls).urls == tuple(urls)
    for url, reason in (
        ("http://h/a b.tar", "a URL holds no whitespace"),
        ("file:///data/a\nb.tar", "a path holds no line break"),
        ("s3://b/a\nb.tar", "an s3:// key holds no line break"),
        ("s3://my bucket/k.tar", "an S3 bucket's name holds no whitespace"),
    ):
        with pytest.raises(ShardIndexError, match=reason) as info:
            given_list([urls[0], url])
        assert (info.value.entry, info.value.url) == (1, url)
        with pytest.raises(ShardIndexError, match=reason):
            read_url_list(write_list(tmp_path, format_shard_index([(url, ShardInfo(3))]), "bad.json"))
    # In a list's line too: a bucket with a space is refused when the list is read, not when fetched.
    with pytest.raises(UrlListError, match="an S3 bucket's name holds no whitespace"):
        parse_url_list("s3://my bucket/k.tar\n", lister=lambda url: [url])


def test_braces_expand_in_order_with_line_errors() -> None:
    text = "http://h/{train,val}-{0..1}.tar\nhttp://h/x.tar\n"
    assert parse_url_list(text).urls == (
        "http://h/train-0.tar",
        "http://h/train-1.tar",
        "http://h/val-0.tar",
        "http://h/val-1.tar",
        "http://h/x.tar",
    )


def test_brace_error_names_file_and_line(tmp_path: Path) -> None:
    path = write_list(tmp_path, "# shards\nhttp://h/a.tar\nhttp://h/b-{000..009.tar\n")
    with pytest.raises(UrlListError) as info:
        read_url_list(path)
    assert "urls.txt:3" in str(info.value)
    assert "unclosed" in info.value.reason
    assert info.value.lineno == 3


def test_unknown_scheme_names_scheme_and_line(tmp_path: Path) -> None:
    path = write_list(tmp_path, "http://h/a.tar\n\ngs://bucket/b.tar\n")
    with pytest.raises(UrlListError) as info:
        read_url_list(path)
    message = str(info.value)
    assert "urls.txt:3" in message
    assert "unknown scheme 'gs'" in message
    assert "http://" in message and "file://" in message


@pytest.mark.parametrize("url", ["ftp://h/a.tar", "gs://b/a.tar", "GS://b/a.tar"])
def test_other_schemes_rejected(url: str) -> None:
    with pytest.raises(UrlListError, match="unknown scheme"):
        parse_url_list(url)


def test_s3_objects_stand_for_themselves_and_need_a_bucket() -> None:
    assert parse_url_list("S3://bkt/a.tar\ns3://bkt/b-{0..1}.tar").urls == (
        "s3://bkt/a.tar",
        "s3://bkt/b-0.tar",
        "s3://bkt/b-1.tar",
    )
    for url in ("s3://", "s3:///key.tar"):
        with pytest.raises(UrlListError, match="needs a bucket"):
            parse_url_list(url)


@pytest.mark.parametrize(
    "url",
    [
        "s3://bkt",
        "s3://bkt/",
        "s3://bkt/train/",
        "s3://bkt/train/shard-*.tar",
        "s3://bkt/shard-?.tar",
        "s3://bkt/shard-[01].tar",
    ],
)
def test_s3_prefixes_and_globs_need_a_lister(url: str) -> None:
    with pytest.raises(UrlListError, match="prefix or glob is listed only where"):
        parse_url_list(url)


def test_a_lister_expands_s3_entries_in_place_counted_and_deduplicated() -> None:
    listed = {"s3://bkt/t/": ["s3://bkt/t/a.tar", "s3://bkt/t/b.tar"]}
    seen: list[str] = []

    def lister(url: str) -> list[str]:
        seen.append(url)
        return listed.get(url, [url])

    text = "http://h/0.tar\ns3://bkt/t/a.tar\ns3://bkt/t/\nhttp://h/1.tar\n"
    parsed = parse_url_list(text, lister=lister)
    assert parsed.urls == ("http://h/0.tar", "s3://bkt/t/a.tar", "s3://bkt/t/b.tar", "http://h/1.tar")
    assert parsed.duplicates == 1 and seen == ["s3://bkt/t/a.tar", "s3://bkt/t/"]
    with pytest.raises(UrlListError, match="limit of 3") as info:
        parse_url_list(text, lister=lister, limit=3)
    assert info.value.lineno == 3

    def refusing(url: str) -> list[str]:
        raise ValueError("cannot list it: S3 NoSuchBucket")

    with pytest.raises(UrlListError, match="NoSuchBucket") as info:
        parse_url_list(text, lister=refusing)
    assert info.value.lineno == 2


@pytest.mark.parametrize("url", ["http://", "https:///path", "http://?q", "http://:80/a"])
def test_http_needs_a_host(url: str) -> None:
    with pytest.raises(UrlListError, match="needs a host"):
        parse_url_list(url)


@pytest.mark.parametrize("url", ["http://[zz]/x.tar", "http://[::1/x.tar", "https://[1.2.3.4]/x.tar"])
def test_a_host_in_brackets_is_an_ipv6_address(url: str) -> None:
    for text in (url, f"http://h/a.tar\n{url}"):  # alone, and among plain URLs (their fast path)
        with pytest.raises(UrlListError, match="a host in brackets is an IPv6 address"):
            parse_url_list(text)
    assert parse_url_list("http://[::1]:8000/x.tar\nhttp://h/a.tar").urls == (
        "http://[::1]:8000/x.tar",
        "http://h/a.tar",
    )


def test_scheme_case_is_normalized() -> None:
    assert parse_url_list("HTTP://h/a.tar\nHttps://h/b.tar").urls == (
        "http://h/a.tar",
        "https://h/b.tar",
    )


def test_pipe_refused_by_default() -> None:
    with pytest.raises(UrlListError) as info:
        parse_url_list("http://h/a.tar\npipe:curl -s http://h/b.tar\n")
    assert info.value.lineno == 2
    assert "start the agent with --allow-pipe" in str(info.value)
    with pytest.raises(UrlListError, match="--allow-pipe"):
        parse_url_list("pipe:cat")


def test_pipe_allowed_keeps_command_and_expands_braces() -> None:
    text = "pipe:curl -s http://h/s-{0..1}.tar  # fetch via curl\nPIPE:cat /x.tar\n"
    assert parse_url_list(text, allow_pipe=True).urls == (
        "pipe:curl -s http://h/s-0.tar",
        "pipe:curl -s http://h/s-1.tar",
        "pipe:cat /x.tar",
    )
    with pytest.raises(UrlListError, match="needs a shell command"):
        parse_url_list("pipe:", allow_pipe=True)


def test_relative_paths_resolve_against_list_folder(tmp_path: Path) -> None:
    folder = tmp_path / "lists"
    folder.mkdir()
    path = write_list(folder, "shards/a.tar\n./b.tar\n../c.tar\n/abs/d.tar\n")
    urls = read_url_list(path).urls
    base = os.path.abspath(folder)
    assert urls == (
        f"file://{base}/shards/a.tar",
        f"file://{base}/b.tar",
        f"file://{os.path.dirname(base)}/c.tar",
        "file:///abs/d.tar",
    )


def test_relative_paths_without_base_use_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_url_list("a.tar").urls == (f"file://{os.getcwd()}/a.tar",)
    assert parse_url_list("a.tar", base_dir="/data").urls == ("file:///data/a.tar",)


def test_file_urls_are_normalized() -> None:
    text = "file:///data/./x/../a.tar\nfile://localhost/data/b.tar\nfile:////data//c.tar\n"
    assert parse_url_list(text).urls == (
        "file:///data/a.tar",
        "file:///data/b.tar",
        "file:///data/c.tar",
    )
    with pytest.raises(UrlListError, match="file:///absolute/path"):
        parse_url_list("file://server/share/a.tar")
    with pytest.raises(UrlListError, match="needs a path"):
        parse_url_list("file://")


def test_a_file_url_without_slashes_is_its_path_as_webdataset_opens_it() -> None:
    assert parse_url_list("file:shards/a.tar\nFILE:/data/b.tar\nfile:../c.tar", base_dir="/d/e").urls == (
        "file:///d/e/shards/a.tar",
        "file:///data/b.tar",
        "file:///d/c.tar",
    )
    with pytest.raises(UrlListError, match="needs a path"):
        parse_url_list("file:")


def test_a_local_path_may_hold_spaces_as_a_file_name_may(tmp_path: Path) -> None:
    text = "my data/a b.tar\nfile:///d/c  d.tar # a comment\n/d/e\tf.tar\n"
    assert parse_url_list(text, base_dir="/base").urls == (
        "file:///base/my data/a b.tar",
        "file:///d/c  d.tar",
        "file:///d/e\tf.tar",
    )
    index = write_list(tmp_path, format_shard_index([("/d/g h.tar", ShardInfo(3))]), "index.json")
    assert read_url_list(index).urls == ("file:///d/g h.tar",)
    with pytest.raises(UrlListError, match="one URL"):  # two entries on one line
        parse_url_list("a.tar http://h/b.tar")


def test_a_dotdot_after_a_symlink_is_the_folder_above_its_target(tmp_path: Path) -> None:
    (tmp_path / "other" / "deep").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "link").symlink_to(tmp_path / "other" / "deep")
    real = os.path.realpath(tmp_path)
    assert parse_url_list("data/link/../x.tar", base_dir=str(tmp_path)).urls == (f"file://{real}/other/x.tar",)
    assert parse_url_list("data/none/../x.tar", base_dir=str(tmp_path)).urls == (f"file://{tmp_path}/data/x.tar",)
    # A link before any other part keeps its spelling: one file, one URL, however it is written.
    (tmp_path / "top").symlink_to(tmp_path / "data")
    (tmp_path / "data" / "sub").mkdir()
    assert parse_url_list("top/x.tar\ntop/sub/../x.tar\ntop/./sub/../../top/x.tar", base_dir=str(tmp_path)).urls == (
        f"file://{tmp_path}/top/x.tar",
    )
    # The list's own folder as it was opened: its lines relative to where the list is.
    (tmp_path / "other" / "deep" / "urls.txt").write_text("a.tar\n")
    assert read_url_list(tmp_path / "data" / "link" / ".." / "deep" / "urls.txt").urls == (
        f"file://{real}/other/deep/a.tar",
    )


def test_a_password_with_a_slash_or_hash_as_it_is_is_refused_and_never_shown() -> None:
    for line in ("http://AKIAUSER:wJalr/XUtnFEMI+K7@127.0.0.1:8000/x.tar", "http://bob:pa#SECRETTAIL@h/x.tar"):
        with pytest.raises(UrlListError, match="must be percent-encoded") as info:
            parse_url_list(line)
        assert "wJalr" not in str(info.value) and "XUtnFEMI" not in str(info.value) and "SECRET" not in str(info.value)
        assert "pa#" not in str(info.value), str(info.value)
    assert parse_url_list("http://u:p%2Fq@h:80/x.tar\nhttp://[::1]/y@z.tar\nhttp://h/m@v2.tar").urls == (
        "http://u:p%2Fq@h:80/x.tar",
        "http://[::1]/y@z.tar",
        "http://h/m@v2.tar",
    )


def test_a_line_with_an_invisible_character_before_its_scheme_is_refused_showing_it() -> None:
    with pytest.raises(UrlListError, match="scheme") as info:
        parse_url_list("http://h/a.tar\n\ufeffhttp://h/b.tar\n")
    assert info.value.lineno == 2 and "\\ufeff" in str(info.value)


def test_colon_without_slashes_is_a_path() -> None:
    assert parse_url_list("data/a:b.tar\nabc:def.tar", base_dir="/d").urls == (
        "file:///d/data/a:b.tar",
        "file:///d/abc:def.tar",
    )


def test_non_utf8_line_is_named(tmp_path: Path) -> None:
    path = write_list(tmp_path, b"http://h/a.tar\nhttp://h/b.tar\nhttp://h/\xff.tar\nhttp://h/d\n")
    with pytest.raises(UrlListError) as info:
        read_url_list(path)
    assert "urls.txt:3" in str(info.value)
    assert "UTF-8" in str(info.value)
    assert info.value.line == "http://h/\ufffd.tar"


def test_utf8_bom_is_ignored(tmp_path: Path) -> None:
    path = write_list(tmp_path, b"\xef\xbb\xbfhttp://h/a.tar\n")
    assert read_url_list(path).urls == ("http://h/a.tar",)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError) as info:
        read_url_list(missing)
    assert not isinstance(info.value, UrlListError)
    assert str(missing) in str(info.value)


def test_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read URL list"):
        read_url_list(tmp_path)


def test_read_sets_path_and_parse_does_not(tmp_path: Path) -> None:
    path = write_list(tmp_path, "http://h/a.tar\n")
    assert read_url_list(str(path)).path == str(path)
    assert parse_url_list("http://h/a.tar").path is None
    assert parse_url_list("http://h/a.tar", path="conf/urls.txt").path == "conf/urls.txt"


def test_duplicates_dropped_and_counted() -> None:
    text = "http://h/a.tar\nhttp://h/{a,b}.tar\nhttp://h/a.tar\n/d/x.tar\nfile:///d/./x.tar\n"
    result = parse_url_list(text)
    assert result.urls == ("http://h/a.tar", "http://h/b.tar", "file:///d/x.tar")
    assert result.duplicates == 3


def test_limit_names_the_crossing_line() -> None:
    text = "http://h/a.tar\nhttp://h/b.tar\nhttp://h/c.tar\n"
    assert len(parse_url_list(text, limit=3)) == 3
    with pytest.raises(UrlListError) as info:
        parse_url_list(text, limit=2)
    assert info.value.lineno == 3 and "limit of 2" in str(info.value)
    assert _peak_bytes(lambda: parse_url_list("http://h/a.tar\nhttp://h/{0..999999999}.tar\n")) < 1 << 20
    with pytest.raises(UrlListError) as info:
        parse_url_list("http://h/a.tar\nhttp://h/{0..999999999}.tar\n")
    assert info.value.lineno == 2 and "limit of 10000000" in str(info.value)


def test_url_list_protocol() -> None:
    result = parse_url_list("http://h/a.tar\nhttp://h/b.tar\n")
    assert len(result) == 2
    assert list(result) == ["http://h/a.tar", "http://h/b.tar"]
    assert result.index("http://h/b.tar") == 1
    assert "http://h/a.tar" in result and "http://h/z.tar" not in result
    with pytest.raises(ValueError, match="not in the URL list"):
        result.index("http://h/z.tar")
    assert result == UrlList(None, ("http://h/a.tar", "http://h/b.tar"))
    assert hash(result) == hash(UrlList(None, ("http://h/a.tar", "http://h/b.tar")))


def _looked_up(urls: UrlList) -> list[int]:
    """Each URL's position found by lookup, and that of one not listed (-1)."""
    return [urls.urls.position(url) for url in urls] + [urls.urls.position("http://h/not-listed.tar")]


@pytest.mark.parametrize(
    "lines",
    [
        [f"http://h/train/shard-{i:04d}.tar" for i in range(300)],  # http(s): taken as written
        [f"https://h/v{i % 3}/shard-{i:04d}.tar" for i in range(300)],
        [f"/data/train/shard-{i:04d}.tar" for i in range(300)],  # absolute paths: file:// before each
        [f"train/shard-{i:04d}.tar" for i in range(300)],  # relative: the list's folder too
        [f"http://h/shard-{i % 7}.tar" for i in range(50)],  # repeats: dropped and counted
        ["/d/a.tar", "/d/b.tar", "/d/a.tar"],
        ["http://h/only.tar"],
    ],
)
def test_plain_lists_are_what_the_line_by_line_parse_gives(tmp_path: Path, lines: list[str]) -> None:
    """A list of plain lines (no brace, comment or space) is made from its text at once; with a
    comment it goes line by line. Both give the same URLs, repeats, lookups and pickled form."""
    text = "\n".join(lines) + "\n"
    fast = parse_url_list(text, base_dir=str(tmp_path))
    slow = parse_url_list("# a comment: the line-by-line parse\n" + text, base_dir=str(tmp_path))
    assert list(fast.urls) == list(slow.urls) and fast.duplicates == slow.duplicates
    assert _looked_up(fast) == _looked_up(slow) == [*range(len(slow)), -1]
    again = pickle.loads(pickle.dumps(fast))
    assert list(again.urls) == list(slow.urls) and _looked_up(again) == _looked_up(slow)
    if lines[0].startswith("/"):
        assert fast.urls[0] == "file://" + lines[0]
    elif not lines[0].startswith("http"):
        assert fast.urls[0] == f"file://{tmp_path}/{lines[0]}"


_PART = st.sampled_from(["a", "b", ".", "..", "", "x.tar", ".h", "http:", "é"])
_LINE = st.one_of(
    st.lists(_PART, min_size=1, max_size=4).map("/".join),  # relative, or absolute when it starts with ""
    st.tuples(st.sampled_from(["http://", "https://", "HTTP://", "http:/"]), st.lists(_PART, max_size=3)).map(
        lambda t: t[0] + "/".join(t[1])
    ),
    st.sampled_from(["", "./a", "../b", "a/", "/a/", "//a", "a//b", "/.", "/..", "a/.", "/a/.b"]),
)


@given(
    st.lists(_LINE, max_size=6),
    st.sampled_from(["", "\n", "\n\n"]),
    st.sampled_from(["/tmp/x", "/", "/tmp/a b"]),
)
def test_any_plain_list_is_what_the_line_by_line_parse_gives(lines: list[str], end: str, base: str) -> None:
    """Whatever its lines (blank, relative, absolute, http(s), with "." or ".." parts, a "/" at an
    end), a list the plain check takes is the list the line-by-line parse gives, and one it does
    not take goes line by line."""

    def parsed(text: str) -> object:
        try:
            urls = parse_url_list(text, base_dir=base)
        except (UrlListError, ValueError) as exc:
            return type(exc)
        return list(urls.urls), urls.duplicates, _looked_up(urls)

    text = "\n".join(lines) + end
    assert parsed(text) == parsed("# the line-by-line parse\n" + text)


@pytest.mark.parametrize("repeat", [False, True])
@pytest.mark.parametrize("prefix", ["http://h/", "/data/", "rel/"])
def test_plain_index_entries_are_what_the_entry_by_entry_parse_gives(tmp_path: Path, prefix: str, repeat: bool) -> None:
    """An index's URLs, plain or not (a ``./`` or an upper-case scheme makes the check go entry by
    entry), give the same list, facts and lookups; a URL listed twice with the same facts is a repeat."""
    names = [f"shard-{i:04d}.tar" for i in range(200)] + (["shard-0003.tar"] if repeat else [])
    entries = [(prefix + name, ShardInfo(7, 10_240)) for name in names]
    fast = read_url_list(write_list(tmp_path, format_shard_index(entries), "fast.json"))
    slow_entries = [
        (url.replace("shard-0199", "./shard-0199") if not url.startswith("http") else url, info)
        for url, info in entries
    ]
    if prefix.startswith("http"):
        slow_entries.append(("HTTP://h/not-plain.tar", ShardInfo(7, 10_240)))  # to normalize: one by one
    slow = read_url_list(write_list(tmp_path, format_shard_index(slow_entries), "slow.json"))
    n = len(fast)
    assert list(fast.urls) == list(slow.urls)[:n] and fast.duplicates == slow.duplicates == int(repeat)
    assert list(fast.shards or ()) == list(slow.shards or ())[:n] == [ShardInfo(7, 10_240)] * n
    assert _looked_up(fast) == [*range(n), -1] and _looked_up(slow)[:n] == [*range(n)]
    assert fast.info(fast.urls[5]) == ShardInfo(7, 10_240)


def test_a_lookup_table_made_a_step_at_a_time_finds_what_one_made_at_once_finds() -> None:
    """The agent makes a long list's table a step a turn of its loop; a lookup before the last step
    finishes it. Either way every URL is found where it is, and one not listed is not."""
    lines = [f"/data/shard-{i:05d}.tar" for i in range(10_000)]
    stepped = parse_url_list("\n".join(lines))
    steps = 0
    while not stepped.urls.make_lookups(3_000):
        steps += 1
    assert steps == 3 and stepped.urls.make_lookups(3_000)
    early = parse_url_list("\n".join(lines))
    assert early.urls.make_lookups(4_000) is False
    assert early.urls.position("file:///data/shard-03999.tar") == 3_999  # placed already
    assert early.urls.make_lookups(4_000) is False  # (found without finishing the table)
    assert _looked_up(early) == _looked_up(stepped) == [*range(10_000), -1]
    assert early.urls.make_lookups(4_000)  # (a lookup of a URL not placed yet made the rest)


def test_a_lookup_while_another_thread_makes_the_table_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup (a download thread's, say) while another thread adds to the table waits for it,
    rather than adding the same URLs again, and finds what a lookup after it finds."""
    from wdscache.shared import urls as urls_module

    waiting = threading.Event()  # set once a lookup waits for the table being made

    class SeenLock:
        """The module's lock, noting when a thread has to wait for it."""

        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __enter__(self) -> None:
            if not self.lock.acquire(blocking=False):
                waiting.set()
                assert self.lock.acquire(timeout=10)

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    made: list[int] = []
    making = threading.Event()
    place = urls_module._place

    def placed_once_the_lookup_waits(table: Any, urls: Sequence[str], first: int) -> None:
        made.append(len(urls))
        making.set()
        assert waiting.wait(10), "the lookup did not wait for the table being made"
        place(table, urls, first)

    monkeypatch.setattr(urls_module, "_MAKING_TABLE", SeenLock())
    monkeypatch.setattr(urls_module, "_place", placed_once_the_lookup_waits)
    listed = parse_url_list("".join(f"http://h/shard-{i:05d}.tar\n" for i in range(20_000)))
    found: list[int] = []
    maker = threading.Thread(target=listed.urls.make_lookups)
    maker.start()
    looker = threading.Thread(target=lambda: found.append(listed.urls.position("http://h/shard-12345.tar")))
    try:
        assert making.wait(10)  # the maker holds the lock: the lookup has to wait for it
        looker.start()
        looker.join(10)
    finally:
        maker.join(10)
    assert not maker.is_alive() and not looker.is_alive()
    assert made == [20_000] and found == [12_345]
    assert listed.index("http://h/shard-00000.tar") == 0 and "http://h/shard-20000.tar" not in listed


@pytest.mark.slow
def test_a_million_line_file_is_read_whole(tmp_path: Path) -> None:
    lines = (f"http://data.example.com/train/shard-{i:07d}.tar\n" for i in range(1_000_000))
    path = write_list(tmp_path, "".join(lines))
    result = read_url_list(path)
    assert len(result) == 1_000_000 and result.duplicates == 0


def test_a_million_entry_brace_line_expands_in_order_with_its_padding() -> None:
    # How fast: scripts/bench.py's 1,000,000-entry list row.
    result = parse_url_list("http://h/shard-{000000..999999}.tar")
    assert len(result) == 1_000_000
    assert (result.urls[0], result.urls[123_456], result.urls[-1]) == (
        "http://h/shard-000000.tar",
        "http://h/shard-123456.tar",
        "http://h/shard-999999.tar",
    )


# --------------------------------------------------------------------------- diff/format


def test_diff_urls_preserves_order() -> None:
    old = UrlList(None, ("http://h/a", "http://h/b", "http://h/c", "http://h/d"))
    new = UrlList(None, ("http://h/e", "http://h/c", "http://h/a", "http://h/f"))
    assert diff_urls(old, new) == (["http://h/e", "http://h/f"], ["http://h/b", "http://h/d"])
    assert diff_urls(old, old) == ([], [])


def test_format_url_list_escapes_braces() -> None:
    urls = ("http://h/a{1,2}.tar", "http://h/b}.tar", "http://h/c\\{.tar", "file:///d/x.tar")
    text = format_url_list(urls)
    assert text.count("\n") == 4
    assert parse_url_list(text).urls == urls
    assert format_url_list([]) == ""


def test_s3_keys_with_glob_characters_read_back_as_the_objects_format_url_list_wrote() -> None:
    """A key holding [, * or ? is written with each escaped in a class of its own, which names
    that one object (no listing: a lister is not needed); a glob a user writes stays a glob."""
    urls = ("s3://b/p/b[1].tar", "s3://b/p/a*?.tar", "s3://b/[[]]{x}.tar", "s3://b/p/a.tar")
    text = format_url_list(urls)
    assert text == "s3://b/p/b[[]1].tar\ns3://b/p/a[*][?].tar\ns3://b/[[][[]]]\\{x\\}.tar\ns3://b/p/a.tar\n"
    assert parse_url_list(text).urls == urls
    assert Listing()("s3://b/p/b[[]1].tar") == ("s3://b/p/b[1].tar",)  # (no client: none is made)
    for line in ("s3://b/p/b[1].tar", "s3://b/p/*.tar", "s3://b/p/[[]*"):
        assert is_listing(line)
        with pytest.raises(UrlListError, match="prefix or glob is listed only where"):
            parse_url_list(line)
    assert [k for k in ("p/b[1].tar", "p/b1.tar", "p/b[[]1].tar") if listed_by("s3://b/p/b[[]1].tar")(k)] == [
        "p/b[1].tar"
    ]
    assert [k for k in ("p/b[1].tar", "p/b1.tar") if listed_by("s3://b/p/b[1].tar")(k)] == ["p/b1.tar"]


def test_an_s3_url_given_alone_names_one_object_whatever_glob_characters_its_key_holds(tmp_path: Path) -> None:
    """In a shard index and a job's own list a key is taken literally; only a prefix is refused."""
    urls = ["s3://b/p/b[1].tar", "s3://b/p/*.tar", "s3://b/p/a?.tar"]
    seen: list[str] = []
    index = write_list(tmp_path, format_shard_index((u, ShardInfo(3)) for u in urls), "index.json")
    assert read_url_list(index, lister=lambda entry: seen.append(entry) or Listing()(entry)).urls == tuple(urls)
    assert seen == ["s3://b/p/b[[]1].tar", "s3://b/p/[*].tar", "s3://b/p/a[?].tar"]  # each names its one object
    assert given_list(urls).urls == tuple(urls)
    for prefix in ("s3://b/p/", "s3://b"):
        with pytest.raises(ShardIndexError, match="names one object, not an s3:// prefix") as info:
            given_list([urls[0], prefix])
        assert (info.value.entry, info.value.url) == (1, prefix)


_S3_KEYS = st.text(alphabet="abc019-._~%!$&'()+,;=:@/{}\\[]*?# ", min_size=1, max_size=30).filter(
    lambda key: not key.endswith("/") and " #" not in key and key.strip() == key
)


@given(st.lists(_S3_KEYS, unique=True, max_size=20))
def test_format_parse_round_trip_of_s3_keys(keys: list[str]) -> None:
    urls = [f"s3://b/{key}" for key in keys]
    assert parse_url_list(format_url_list(urls)).urls == tuple(urls)


_URL_CHARS = st.text(
    alphabet="abcXYZ019-._~%!$&'()*+,;=:@/?#{}\\",
    min_size=0,
    max_size=30,
)
_HTTP_URLS = st.builds(
    lambda scheme, host, rest: f"{scheme}://{host}/{rest}",
    st.sampled_from(["http", "https"]),
    st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,20}[a-z0-9])?(:[0-9]{1,5})?", fullmatch=True),
    _URL_CHARS,
)


@given(st.lists(_HTTP_URLS, unique=True, max_size=20))
def test_format_parse_round_trip(urls: list[str]) -> None:
    result = parse_url_list(format_url_list(urls))
    assert result.urls == tuple(urls)
    assert result.duplicates == 0


@given(st.text().filter(lambda s: "{" not in s and "}" not in s))
def test_expand_without_braces_is_identity(pattern: str) -> None:
    assert expand_braces(pattern) == [pattern]
