"""``urls=`` in Python follows the URL-list rules (wdscache.training.urls_arg), as webdataset users write it."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from wdscache.shared.errors import ConfigError, UrlListError
from wdscache.training.urls_arg import resolve_urls


def test_a_string_with_a_scheme_is_a_pattern_and_is_expanded() -> None:
    assert resolve_urls("http://h/shard-{000..002}.tar") == (
        "http://h/shard-000.tar",
        "http://h/shard-001.tar",
        "http://h/shard-002.tar",
    )
    assert resolve_urls("https://h/one.tar") == ("https://h/one.tar",)


def test_a_brace_pattern_without_a_scheme_is_a_local_pattern(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_urls("data/s-{0..1}.tar") == (f"file://{tmp_path}/data/s-0.tar", f"file://{tmp_path}/data/s-1.tar")


def test_a_tar_path_is_one_shard(tmp_path: Path) -> None:
    assert resolve_urls(str(tmp_path / "a.tar")) == (f"file://{tmp_path}/a.tar",)


def test_a_list_read_from_a_pipe_is_read_whole() -> None:
    # bash's <(...) hands a list as /dev/fd/N: what is read of it to tell a shard is gone for the list.
    urls = [f"http://h/shard-{i:04d}.tar" for i in range(200)]
    r, w = os.pipe()
    try:
        os.write(w, "".join(f"{u}\n" for u in urls).encode())  # (7 KB: within a pipe's buffer)
        os.close(w)
        assert resolve_urls(f"/dev/fd/{r}") == tuple(urls)
    finally:
        os.close(r)


def test_a_gzipd_tar_of_any_name_is_a_shard_and_a_gzipd_list_is_named_so(tmp_path: Path) -> None:
    shard = tmp_path / "s.data"
    with tarfile.open(shard, "w:gz") as tar:
        member = tarfile.TarInfo("k.txt")
        member.size = 3
        tar.addfile(member, io.BytesIO(b"abc"))
    assert resolve_urls(str(shard)) == (f"file://{shard}",)
    listed = tmp_path / "urls.txt.gz"
    listed.write_bytes(gzip.compress(b"http://h/a.tar\nhttp://h/b.tar\n"))
    with pytest.raises(ConfigError) as info:
        resolve_urls(str(listed))
    assert str(info.value) == f"URL list {listed} is gzip'd: URL lists are read as text; decompress it (gzip -d)"


def test_list_items_are_expanded_too() -> None:
    assert resolve_urls(["http://h/a-{0..1}.tar", "http://h/b.tar", "http://h/a-2.tar"]) == (
        "http://h/a-0.tar",
        "http://h/a-1.tar",
        "http://h/b.tar",
        "http://h/a-2.tar",
    )


WEIGHT_WITH_MIX = (
    "wdscache reads each shard of a list once, where webdataset reads a repeat again; to weight a "
    "source, give mix={source: weight, ...} with epoch_samples= (see docs/mixtures.md)"
)


def test_a_shard_named_twice_is_refused_naming_it_but_a_list_files_repeats_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # webdataset reads a repeated shard again (urls_a * 2 + urls_b weights a source); the loader
    # reads each shard once, so a repeat would lose samples without a word.
    monkeypatch.chdir(tmp_path)
    for urls, shown in (
        (["data/a.tar", "data/a.tar", "data/b.tar"], "'data/a.tar'"),  # as the user wrote it
        (("http://h/a-{0..1}.tar", "http://h/b.tar", "http://h/a-1.tar"), "'http://h/a-1.tar'"),
        (["data/b.tar", "./data/b.tar"], "'data/b.tar'"),  # one file
    ):
        with pytest.raises(ConfigError) as info:
            resolve_urls(urls)
        assert str(info.value) == f"urls= names the shard {shown} more than once: {WEIGHT_WITH_MIX}", urls
    with pytest.raises(ConfigError) as info:
        resolve_urls("http://h/x-{a,b,a}.tar")  # braceexpand repeats it, as webdataset expands it
    assert str(info.value) == (
        f"urls='http://h/x-{{a,b,a}}.tar' names the shard 'http://h/x-a.tar' more than once: {WEIGHT_WITH_MIX}"
    )
    listing = tmp_path / "train.txt"
    listing.write_text("http://h/a.tar\nhttp://h/b.tar\nhttp://h/a.tar\n")
    assert resolve_urls(str(listing)) == ("http://h/a.tar", "http://h/b.tar")


def test_other_strings_and_paths_are_list_files(tmp_path: Path) -> None:
    listing = tmp_path / "train.txt"
    listing.write_text("http://h/x-{0..1}.tar\n# a comment\nshards/y.tar\n")
    expected = ("http://h/x-0.tar", "http://h/x-1.tar", f"file://{tmp_path}/shards/y.tar")
    assert resolve_urls(str(listing)) == expected
    assert resolve_urls(listing) == expected


def test_a_missing_list_file_names_the_python_argument(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_urls(str(tmp_path / "nope.txt"))
    message = str(info.value)
    assert message.startswith(f"urls={str(tmp_path / 'nope.txt')!r} is not a URL list file that exists")
    assert "--urls" not in message and "http://host/shard-{000..099}.tar" in message


def test_bad_items_name_their_index() -> None:
    with pytest.raises(UrlListError) as info:
        resolve_urls(["http://h/a.tar", "http://h/b-{1..}.tar"])
    assert str(info.value) == "urls[1]='http://h/b-{1..}.tar': empty range bound in '{1..}': write {first..last}"
    with pytest.raises(UrlListError) as info:
        resolve_urls("ftp://h/a.tar")
    assert str(info.value).startswith("urls='ftp://h/a.tar': unknown scheme 'ftp'")
    with pytest.raises(ConfigError, match=r"urls\[0\]='http://h/a.tar\\nhttp://h/b.tar' must be one URL"):
        resolve_urls(["http://h/a.tar\nhttp://h/b.tar"])
    with pytest.raises(TypeError, match=r"urls\[1\] is a int"):
        resolve_urls(["http://h/a.tar", 3])  # type: ignore[list-item]


def test_without_torch_the_loader_is_a_plain_class(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import wdscache\n"
        f"loader = wdscache.CachedMultiLoader(['http://h/a-{{0..1}}.tar'], cache_dir={str(tmp_path)!r})\n"
        "print(type(loader).__name__, loader.urls, 'torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "CachedMultiLoader ('http://h/a-0.tar', 'http://h/a-1.tar') False"


def test_patterns_joined_by_double_colons_are_split_but_not_inside_an_ipv6_host() -> None:
    assert resolve_urls("http://h/a-{0..1}.tar::http://[::1]:8080/b.tar::http://h/c.tar") == (
        "http://h/a-0.tar",
        "http://h/a-1.tar",
        "http://[::1]:8080/b.tar",
        "http://h/c.tar",
    )
    assert resolve_urls("http://[::1]/x.tar") == ("http://[::1]/x.tar",)
    many = [f"http://h/s-{i}.tar" for i in range(20_000)]  # "::".join of a long list: split in one pass
    assert resolve_urls("::".join([*many, "http://[::1]/x.tar"])) == (*many, "http://[::1]/x.tar")


def test_without_webdataset_star_import_and_help_work_and_webdataset_says_what_to_install() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pydoc; sys.modules['webdataset'] = None\n"
        "from wdscache import *\n"
        "import wdscache\n"
        "assert 'CachedMultiLoader' in pydoc.render_doc(wdscache)\n"
        "try:\n"
        "    wdscache.WebDataset\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install" in r.stdout and "webdataset" in r.stdout, r.stdout


def test_without_pillow_the_random_access_decoder_reads_other_fields_and_names_pillow_for_an_image() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['PIL'] = None\n"
        "from wdscache.training.random_access import default_decoder\n"
        "print(default_decoder({'__key__': 'k', '.txt': b'hi', '.cls': b'3'}))\n"
        "default_decoder({'__key__': 'k', '.jpg': b'not read'})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "{'__key__': 'k', '.txt': 'hi', '.cls': 3}" in r.stdout, r.stdout + r.stderr
    assert "ImportError: ShardListDataset's default decoder opens the image '.jpg' with Pillow: pip install pillow" in (
        r.stderr
    )


@pytest.mark.parametrize("spec", ["dict", "mix.yaml", "MIX.YML"])
def test_webdatasets_mixture_spec_is_refused_naming_mix(tmp_path: Path, spec: str) -> None:
    pytest.importorskip("webdataset", reason="webdataset is not installed (the package's wds extra)")
    import wdscache

    given: object = {"prefix": "http://h/", "datasets": [{"shards": "a-{0..3}.tar"}]}
    if spec != "dict":
        given = tmp_path / spec
        given.write_text("prefix: http://h/\ndatasets:\n  - shards: a-{0..3}.tar\n")
    for make in (wdscache.CachedMultiLoader, wdscache.WebDataset):
        for urls in (given, str(given)) if spec != "dict" else (given,):
            with pytest.raises(ConfigError, match=r"^urls=.*webdataset's mixture spec .* give mix=\{"):
                make(urls, cache_dir=tmp_path / "cache")
