"""The ``urls=`` argument of the Python API, read by the URL-list rules (:mod:`wdscache.shared.urls`).

- a string with a scheme (``http://``, ``s3://``, ``file://``), a ``pipe:`` command or a brace
  pattern is a URL pattern, expanded as one line of a list would be:
  ``"http://h/shard-{000..099}.tar"``;
- a string or path object naming a tar file is that one local shard, as webdataset takes it: a
  name ending in ``.tar``, ``.tar.gz`` or ``.tgz`` (in any case), or a file whose first bytes
  are a shard's, whatever its name (:func:`~wdscache.shared.urls.names_shard`);
- any other string or path object is a list file (or a shard index, wids JSON);
- a list's items are expanded like the lines of a list file; any other iterable of strings
  (a generator, ``map(...)``) is read once, as a list (:func:`taken_once`); an empty one is refused;
- a string of patterns joined by ``::`` is those patterns, in order, as webdataset splits it
  (not inside an IPv6 host's brackets).

A shard named more than once (a list's item repeated, say) is refused with a
:class:`~wdscache.shared.errors.ConfigError`, where a list file drops the repeats: webdataset
would read it again, and the loader reads each shard once (``mix=`` weights a source).

Errors name the Python argument (``urls=``, ``urls[3]``), not the command line's flags.

A local path keeps the name it was given in samples (``__url__``), as webdataset keeps it,
beside the ``file://`` URL the agent knows it by, and so does a URL whose scheme is not in lower
case (``HTTP://h/a.tar``, which the agent knows as ``http://h/a.tar``): :func:`given_names`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence

from ..shared.errors import ConfigError, UrlListError
from ..shared.redact import redact_urls
from ..shared.s3 import Listing
from ..shared.urls import (
    UrlList,
    expand_braces,
    names_shard,
    normalize_url,
    parse_url_list,
    read_url_list,
    repeated_urls,
)

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_BRACKETED_OR_JOIN = re.compile(r"\[[^\]]*\]|::")  # an IPv6 host's brackets (kept whole), or a "::"
PIPE = "pipe:"
_SPEC_SUFFIXES = (".yaml", ".yml")  # webdataset's mixture spec files

UrlsArg = str | os.PathLike[str] | Sequence[str]


def taken_once(urls: str | os.PathLike[str] | Iterable[str] | None) -> UrlsArg | None:
    """``urls=`` as given, but an iterator or another one-pass iterable of URLs made a list, so that
    each later look at it sees every URL (webdataset takes any iterable). webdataset's mixture spec,
    a dict or a YAML file (which webdataset 1.0 refuses as obsolete too), is refused, naming ``mix=``."""
    if isinstance(urls, Mapping) or (
        isinstance(urls, (str, os.PathLike)) and os.fspath(urls).lower().endswith(_SPEC_SUFFIXES)
    ):
        shown = f"a {type(urls).__name__}" if isinstance(urls, Mapping) else repr(redact_urls(os.fspath(urls)))
        raise ConfigError(
            f"urls= is {shown}: webdataset's mixture spec (a dict or YAML of datasets) is not read here; "
            "give mix={urls_or_list_file: weight, ...} with epoch_samples= (see docs/mixtures.md), or a "
            "URL list file, one URL a line"
        )
    if urls is None or isinstance(urls, (str, os.PathLike, Sequence)):
        return urls
    return list(urls)


def resolve_urls(urls: UrlsArg) -> Sequence[str]:
    """The URLs that ``urls=`` stands for (see the module's rules)."""
    return read_urls_arg(urls).urls


def read_urls_arg(urls: UrlsArg) -> UrlList:
    """The list that ``urls=`` stands for, with a shard index's facts when it names one."""
    if isinstance(urls, os.PathLike):
        path = os.fspath(urls)
        return _items([path], single=True) if names_shard(path) else _list_file(path)
    if isinstance(urls, str):
        parts = split_patterns(urls) if "::" in urls else [urls]
        if len(parts) > 1:
            return _items(parts, single=False)
        if _SCHEME.match(urls) or urls.startswith(PIPE) or "{" in urls or names_shard(urls):
            return _items([urls], single=True)
        return _list_file(urls)
    if isinstance(urls, bytes):
        raise TypeError("urls= takes str, not bytes: decode it first")
    items = list(urls)
    if not items:
        raise ConfigError("urls= is empty: give it at least one URL, or leave it out to read the agent's list")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"urls[{i}] is a {type(item).__name__}; the items of urls= are URL strings")
    return _items(items, single=False)


def pipe_urls(urls: UrlsArg) -> list[str]:
    """The ``pipe:`` commands among ``urls=`` given as a string or a list of them (a list
    file's are its own business: the agent's ``--allow-pipe``)."""
    items = (
        split_patterns(urls) if isinstance(urls, str) else [] if isinstance(urls, (os.PathLike, bytes)) else list(urls)
    )
    return [item for item in items if isinstance(item, str) and item.startswith(PIPE)]


def pipe_refusal(where: str) -> str:
    """Why a loader refuses the ``pipe:`` command ``where`` names (``urls='pipe:...'``, say)."""
    return (
        f"{where}: a loader does not run pipe: commands (the agent runs only those of its own --urls list, "
        "started with --allow-pipe: give urls=None to read that list); wdscache.WebDataset reads pipe: shards "
        "in this process, uncached, as webdataset does"
    )


def given_names(urls: UrlsArg) -> dict[str, str]:
    """The local paths among ``urls=`` as given (braces expanded), by the ``file://`` URL they
    stand for, and the URLs written with a scheme not in lower case, by their canonical URL: a
    sample's ``__url__`` is the name the user wrote, as in webdataset. (The shards an ``s3://``
    prefix or glob stands for are named by their URLs: webdataset reads no such pattern.)"""
    if isinstance(urls, os.PathLike) or isinstance(urls, bytes):
        return {}
    items = split_patterns(urls) if isinstance(urls, str) else list(urls)
    names: dict[str, str] = {}
    for item in items:
        if not isinstance(item, str) or item.startswith(PIPE):
            continue
        scheme = _SCHEME.match(item)
        if scheme is not None and item[:5].lower() != "file:":
            if not scheme.group().islower():
                for name in expand_braces(item):
                    names.setdefault(normalize_url(name, os.getcwd()), name)
            continue
        if len(items) == 1 and isinstance(urls, str) and not ("{" in item or names_shard(item)):
            continue  # a list file
        for name in expand_braces(item):
            if ":" in name.split("/", 1)[0] and name[:5].lower() != "file:":
                continue  # "name:..." is some scheme, not a path (file:rel/a.tar is one)
            for url in parse_url_list(name, base_dir=os.getcwd()).urls:
                names.setdefault(url, name)
    return names


def split_patterns(urls: str) -> list[str]:
    """The patterns of a string, as webdataset splits it at each ``::`` (webdataset's
    ``"a.tar::b-{0..9}.tar"``), but for one inside an IPv6 host's brackets (``http://[::1]/``);
    in one pass, however long the string."""
    if "[" not in urls:
        return urls.split("::")
    parts, start = [], 0
    for token in _BRACKETED_OR_JOIN.finditer(urls):
        if token.group() == "::":
            parts.append(urls[start : token.start()])
            start = token.end()
    parts.append(urls[start:])
    return parts


def _list_file(path: str) -> UrlList:
    if not os.path.exists(path):
        raise ConfigError(
            f"urls={path!r} is not a URL list file that exists; for shards, pass a URL with its "
            "scheme (http://host/shard-{000..099}.tar, s3://bucket/prefix/, file:///data/a.tar), "
            "a brace pattern, a .tar path, or a list of them"
        )
    return read_url_list(path, lister=Listing())


def _items(items: list[str], *, single: bool) -> UrlList:
    for i, item in enumerate(items):
        if "\n" in item or not item.strip():
            raise ConfigError(f"{_name(i, single)}={item!r} must be one URL or pattern, on one line")
    text = "\n".join(items)
    try:
        listed = parse_url_list(text, base_dir=os.getcwd(), lister=Listing())
    except UrlListError as exc:
        # parse_url_list counts lines from 1: line k is item k-1.
        name = _name(exc.lineno - 1, single)
        err = UrlListError(name, exc.lineno, exc.line, exc.reason)
        err.args = (redact_urls(f"{name}={exc.line!r}: {exc.reason}"),)  # (args set here skip the redaction)
        raise err from None
    if listed.duplicates:
        # webdataset reads a shard listed twice twice (a way to weight it); the agent keys shards
        # by URL and reads each once, so a repeat would silently lose those samples.
        url = repeated_urls(text, base_dir=os.getcwd(), lister=Listing())[0]
        shown = given_names(items).get(url, url)
        where = f"urls={items[0]!r}" if single else "urls="
        raise ConfigError(
            f"{where} names the shard {shown!r} more than once: wdscache reads each "
            "shard of a list once, where webdataset reads a repeat again; to weight a source, give "
            "mix={source: weight, ...} with epoch_samples= (see docs/mixtures.md)"
        )
    return listed


def _name(index: int, single: bool) -> str:
    return "urls" if single else f"urls[{index}]"
