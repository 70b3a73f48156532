"""URL lists: the set of shards an agent serves, read from a text file.

A list holds one URL or brace pattern per line (``http://h/train-{0000..0999}.tar``).
Blank lines and ``#`` comments are ignored; entries are expanded, normalized
(plain paths become absolute ``file://`` URLs) and de-duplicated in order.

A list file that starts like JSON is a shard index, webdataset's wids JSON (:mod:`wdscache.shared.shard_index`):
its shards in order, each with its sample count and, when the index gives them, its size and
MD5 (``UrlList.shards``); a relative URL in it names a path relative to the index's folder.

An ``s3://`` key is taken literally, as ``aws s3`` takes it: ``s3://b/key%20x.tar`` names the key
``key%20x.tar``, and a key with spaces is written with its spaces (``s3://b/key with space.tar``; the
line's comment, if any, starts at `` #``). Spaces in an http(s) URL are percent-encoded (``%20``).

An ``s3://`` prefix or glob (``s3://b/train/``, ``s3://b/train/shard-*.tar``) stands for the
objects it lists: parsing does no I/O itself, so a list holding one is read with a ``lister``
(:class:`wdscache.shared.s3.Listing`) that lists it when the list is read, and without one is refused.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from wdscache.shared.errors import ConfigError, ShardIndexError, UrlListError
from wdscache.shared.redact import redact_urls
from wdscache.shared.s3 import is_listing
from wdscache.shared.shard_index import ShardInfo, looks_like_index, parse_shard_index

__all__ = [
    "DEFAULT_LIMIT",
    "TEXT_SOURCE",
    "UrlList",
    "diff_urls",
    "expand_braces",
    "format_url_list",
    "index_list",
    "list_id",
    "normalize_url",
    "parse_url_list",
    "read_url_list",
]

DEFAULT_LIMIT = 10_000_000
TEXT_SOURCE = "<urls>"
"""The ``path`` shown in errors for a list that did not come from a file."""

_PIPE_REFUSED = (
    "pipe: sources run a shell command; start the agent with --allow-pipe to allow them"
)
_SUPPORTED = (
    "supported: http://, https://, s3://bucket/key (or a prefix or glob), file:///path, a plain path, "
    "pipe:CMD (with --allow-pipe)"
)
_UNLISTED = "an s3:// prefix or glob is listed only where a list is read: give it in the list itself"
Lister = Callable[[str], Sequence[str]]
"""Given an ``s3://`` entry, the URLs it stands for; raises ValueError saying why it cannot."""
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# Capturing split keeps the delimiters; escapes come first so "\{" never opens a group.
_BRACE_TOKENS = re.compile(r"(\\[{}]|[{},])")
_COMMENT_START = re.compile(r"\s#")
# Nesting is parsed with an explicit stack, but counting and expanding recurse.
_MAX_DEPTH = 100


# --------------------------------------------------------------------------- braces


@dataclass(frozen=True)
class _Range:
    start: int
    stop: int  # inclusive; may be below start (descending)
    width: int  # zero-pad to this many digits; 0 = no padding

    def count(self) -> int:
        return abs(self.stop - self.start) + 1

    def values(self) -> list[str]:
        step = 1 if self.stop >= self.start else -1
        numbers = range(self.start, self.stop + step, step)
        if self.width:
            pattern = f"%0{self.width}d"  # %-formatting is the fastest way to pad here
            return [pattern % n for n in numbers]
        return list(map(str, numbers))


# A parsed pattern is a sequence: a list of parts, each a literal str, a _Range,
# or a group, i.e. a tuple of alternative sequences (a tuple, so that it is told
# apart from a sequence).  Spelled as an alias to keep the signatures readable.
_Seq = list


def _make_group(alts: list[_Seq], text: str) -> tuple[_Seq, ...] | _Range:
    if len(alts) > 1:
        return tuple(alts)
    (only,) = alts
    if not only:
        raise ValueError(f"empty braces {text!r}: a group needs a list {{a,b}} or a range {{0..9}}")
    if len(only) == 1 and isinstance(only[0], str) and ".." in only[0]:
        return _make_range(only[0], text)
    raise ValueError(
        f"braces {text!r} hold a single item: use {{a,b}} for a list, {{0..9}} for a range, "
        "or write \\{ and \\} for literal braces"
    )


def _make_range(body: str, text: str) -> _Range:
    lo, _, hi = body.partition("..")
    if not lo or not hi:
        raise ValueError(f"empty range bound in {text!r}: write {{first..last}}")
    if not (lo.isascii() and lo.isdigit() and hi.isascii() and hi.isdigit()):
        raise ValueError(f"range {text!r} needs two non-negative integers, like {{000..099}}")
    # Padding follows braceexpand/webdataset: a written leading zero on either bound
    # pads every value to the wider bound's width.
    padded = (len(lo) > 1 and lo[0] == "0") or (len(hi) > 1 and hi[0] == "0")
    return _Range(int(lo), int(hi), max(len(lo), len(hi)) if padded else 0)


def _parse(pattern: str) -> _Seq:
    """Parse a brace pattern into a sequence tree; ValueError on malformed braces."""
    top: _Seq = []
    current = top
    literal: list[str] = []
    # Each open group: (enclosing sequence, alternatives so far, offset of its "{").
    stack: list[tuple[_Seq, list[_Seq], int]] = []
    pos = 0
    for token in _BRACE_TOKENS.split(pattern):
        if token == "{":
            if len(stack) >= _MAX_DEPTH:
                raise ValueError(f"braces nested more than {_MAX_DEPTH} deep")
            if literal:
                current.append("".join(literal))
                literal = []
            stack.append((current, [], pos))
            current = []
        elif token == "," and stack:
            if literal:
                current.append("".join(literal))
                literal = []
            stack[-1][1].append(current)
            current = []
        elif token == "}":
            if not stack:
                raise ValueError(f"unmatched '}}' at offset {pos}")
            if literal:
                current.append("".join(literal))
                literal = []
            parent, alts, opened = stack.pop()
            alts.append(current)
            parent.append(_make_group(alts, pattern[opened : pos + 1]))
            current = parent
        elif len(token) == 2 and token[0] == "\\" and token[1] in "{}":
            literal.append(token[1])
        elif token:
            literal.append(token)
        pos += len(token)
    if stack:
        raise ValueError(f"unclosed '{{' at offset {stack[-1][2]}")
    if literal:
        current.append("".join(literal))
    return top


def _count(seq: _Seq) -> int:
    total = 1
    for part in seq:
        if isinstance(part, _Range):
            total *= part.count()
        elif isinstance(part, tuple):
            total *= sum(_count(alt) for alt in part)
    return total


def _expand(seq: _Seq) -> list[str]:
    # Fold left to right so the leftmost group varies slowest; the intermediate
    # lists never outgrow the final one because every part yields >= 1 string.
    acc = [""]
    for part in seq:
        if isinstance(part, str):
            acc = [a + part for a in acc]
            continue
        if isinstance(part, _Range):
            values = part.values()
        else:
            values = [v for alt in part for v in _expand(alt)]
        if len(acc) == 1:
            head = acc[0]
            acc = values if not head else [head + v for v in values]
        else:
            acc = [a + v for a in acc for v in values]
    return acc


def _too_many(count: int, limit: int) -> str:
    return f"the pattern would expand to {count} entries, more than the limit of {limit}"


def expand_braces(pattern: str, *, limit: int = DEFAULT_LIMIT) -> list[str]:
    """Expand WebDataset-style braces: ``{000..099}`` ranges, ``{a,b}`` lists, nesting.

    Groups multiply out with the leftmost varying slowest; ``\\{`` and ``\\}`` are
    literal braces.  Raises ValueError for malformed braces, or - before building
    anything - when the result would hold more than ``limit`` entries.
    """
    if "{" not in pattern and "}" not in pattern:
        return [pattern]
    tree = _parse(pattern)
    count = _count(tree)
    if count > limit:
        raise ValueError(_too_many(count, limit))
    return _expand(tree)


# --------------------------------------------------------------------------- lists


@dataclass(frozen=True)
class UrlList:
    """The ordered, de-duplicated URLs of a list.

    ``path`` is the file it came from (None when parsed from bare text) and
    ``duplicates`` how many repeated entries were dropped while reading it. ``shards``, for a
    list read from a shard index, holds what the index says of each URL (by position).
    """

    path: str | None
    urls: tuple[str, ...]
    duplicates: int = 0
    shards: tuple[ShardInfo, ...] | None = None

    def __len__(self) -> int:
        return len(self.urls)

    def __iter__(self) -> Iterator[str]:
        return iter(self.urls)

    def __contains__(self, url: object) -> bool:
        return url in self._positions

    def index(self, url: str) -> int:
        """Return the position of ``url``; ValueError if it is not in the list."""
        try:
            return self._positions[url]
        except KeyError:
            raise ValueError(f"{redact_urls(url)!r} is not in the URL list") from None

    def info(self, url: str) -> ShardInfo | None:
        """What the shard index this list came from says of ``url`` (None: nothing)."""
        if self.shards is None:
            return None
        at = self._positions.get(url)
        return None if at is None else self.shards[at]

    @property
    def key(self) -> str:
        """The list's identity for an agent that holds it: its :func:`list_id`, which covers the
        shards' facts too when it came from an index (the same URLs with other facts are another list)."""
        return list_id(self.urls, self.shards)

    @cached_property
    def _positions(self) -> dict[str, int]:
        # Built on first lookup: tuple.index would be linear per call on huge lists.
        return {url: i for i, url in enumerate(self.urls)}


def _abs_path(path: str) -> str:
    path = os.path.normpath(path)
    # POSIX keeps a leading "//" as implementation-defined; make it one slash.
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return path


def normalize_url(url: str, base_dir: str, *, allow_pipe: bool = False) -> str:
    """The canonical form of one URL as a list line gives it (a relative path against ``base_dir``);
    ValueError says why it is unusable."""
    return _normalize(url, base_dir, allow_pipe)


def _normalize(url: str, base_dir: str, allow_pipe: bool) -> str:
    """Return the canonical form of one expanded entry; ValueError says why it is unusable."""
    # Fast path for the common case: plain string checks, no regex.
    if url.startswith("https://"):
        host_at = 8
    elif url.startswith("http://"):
        host_at = 7
    else:
        return _normalize_other(url, base_dir, allow_pipe)
    if len(url) == host_at or url[host_at] in "/?#@:":
        raise ValueError("an http(s) URL needs a host, like http://host/path")
    return url


def _normalize_other(url: str, base_dir: str, allow_pipe: bool) -> str:
    colon = url.find(":")
    if colon > 0 and _SCHEME_RE.fullmatch(url, 0, colon):
        scheme = url[:colon].lower()
        if scheme == "pipe":
            if not allow_pipe:
                raise ValueError(_PIPE_REFUSED)
            if not url[colon + 1 :].strip():
                raise ValueError("pipe: needs a shell command after the colon")
            return "pipe:" + url[colon + 1 :]
        if url.startswith("//", colon + 1):
            rest = url[colon + 3 :]
            if scheme in ("http", "https"):
                return _normalize(scheme + "://" + rest, base_dir, allow_pipe)
            if scheme == "file":
                host, slash, path = rest.partition("/")
                if host not in ("", "localhost"):
                    raise ValueError("file: URLs name a local path: write file:///absolute/path")
                if not slash:
                    raise ValueError("a file: URL needs a path, like file:///data/shard.tar")
                return "file://" + _abs_path("/" + path)
            if scheme == "s3":
                if not rest or rest[0] in "/?#":
                    raise ValueError("an s3:// URL needs a bucket, like s3://bucket/key")
                return "s3://" + rest
            raise ValueError(f"unknown scheme {scheme!r}; {_SUPPORTED}")
    # Anything else is a local path (a "name:" without "//" included, e.g. "a:b.tar").
    return "file://" + _abs_path(os.path.join(base_dir, url))


def _line_entry(raw: str, parts: list[str]) -> str:
    """The entry of a line whose first word is followed by a non-comment word."""
    # Only a shell command and an S3 key (taken literally, as `aws s3` takes it) may contain
    # whitespace; the comment starts at " #". An S3 line with a second URL is two entries on one line.
    first = parts[0][:5].lower()
    if first == "pipe:" or (first == "s3://" and not any("://" in word for word in parts[1:])):
        line = raw.strip()
        match = _COMMENT_START.search(line)
        return line[: match.start()].rstrip() if match else line
    raise ValueError("a line holds one URL, but this one has whitespace inside "
                     "(percent-encode a space in an http(s) URL: %20)")


def parse_url_list(
    text: str,
    *,
    path: str = TEXT_SOURCE,
    base_dir: str | None = None,
    allow_pipe: bool = False,
    limit: int = DEFAULT_LIMIT,
    lister: Lister | None = None,
) -> UrlList:
    """Parse the text of a URL list.

    Relative paths resolve against ``base_dir`` (default: the current directory).
    ``limit`` bounds the entries after brace and prefix expansion, counted before
    duplicates are dropped.  Every ``s3://`` entry goes through ``lister``, when given,
    and becomes the URLs it returns; without one, an ``s3://`` prefix or glob is refused.
    Any unusable line raises UrlListError naming ``path`` and the line.
    """
    base = os.path.abspath(base_dir) if base_dir is not None else os.getcwd()
    urls: list[str] = []
    seen: set[str] = set()
    duplicates = 0
    total = 0
    # Split on "\n" only so line numbers match what an editor shows.
    for lineno, raw in enumerate(text.split("\n"), 1):
        parts = raw.split()
        if not parts or parts[0][0] == "#":
            continue
        try:
            entry = parts[0]
            if len(parts) > 1 and parts[1][0] != "#":
                entry = _line_entry(raw, parts)
            if "{" in entry or "}" in entry:
                tree = _parse(entry)
                total += _count(tree)
                if total > limit:
                    raise ValueError(
                        f"the list would hold {total} URLs, more than the limit of {limit}"
                    )
                expanded: Iterable[str] = _expand(tree)
            else:
                total += 1
                if total > limit:
                    raise ValueError(f"the list holds more than the limit of {limit} URLs")
                expanded = (entry,)
            for url in expanded:
                url = _normalize(url, base, allow_pipe)
                objects: Sequence[str] = (url,)
                if url.startswith("s3://"):
                    objects = lister(url) if lister is not None else _unlisted(url)
                    total += len(objects) - 1
                    if total > limit:
                        raise ValueError(f"the list would hold {total} URLs, more than the limit of {limit}")
                for url in objects:
                    if url in seen:
                        duplicates += 1
                    else:
                        seen.add(url)
                        urls.append(url)
        except ValueError as exc:
            raise UrlListError(path, lineno, raw.strip(), str(exc)) from None
    return UrlList(None if path == TEXT_SOURCE else path, tuple(urls), duplicates)


def index_list(
    entries: Sequence[tuple[str, ShardInfo]],
    *,
    path: str = TEXT_SOURCE,
    base_dir: str | None = None,
    allow_pipe: bool = False,
    limit: int = DEFAULT_LIMIT,
    lister: Lister | None = None,
) -> UrlList:
    """The list of a shard index's ``entries`` (see :func:`parse_shard_index`).

    Each URL is taken as written (no brace expansion) and normalized as a list line is, a
    relative one against ``base_dir`` (the index's folder); an ``s3://`` object goes through
    ``lister`` when given, and a prefix or glob is refused (an entry names one shard). A URL
    listed twice with the same facts counts as a duplicate; with other facts it is an error.
    Raises ShardIndexError naming ``path`` and the entry.
    """
    if len(entries) > limit:
        raise ShardIndexError(path, None, f"the index lists {len(entries)} shards, more than the limit of {limit}")
    base = os.path.abspath(base_dir) if base_dir is not None else os.getcwd()
    urls: list[str] = []
    infos: list[ShardInfo] = []
    seen: dict[str, int] = {}
    duplicates = 0
    for i, (written, info) in enumerate(entries):
        try:
            if any(c.isspace() for c in written) and not written.startswith("pipe:"):
                raise ValueError("a URL holds no whitespace")
            url = _normalize(written, base, allow_pipe)
            if url.startswith("s3://"):
                if is_listing(url):
                    raise ValueError("an index entry names one object, not an s3:// prefix or glob")
                if lister is not None:
                    lister(url)  # the agent checks here that it can fetch from S3 at all
            if url in seen:
                if infos[seen[url]] != info:
                    raise ValueError(f"listed before, as shardlist[{seen[url]}], with other facts")
                duplicates += 1
                continue
        except ValueError as exc:
            raise ShardIndexError(path, i, str(exc), url=written) from None
        seen[url] = len(urls)
        urls.append(url)
        infos.append(info)
    return UrlList(None if path == TEXT_SOURCE else path, tuple(urls), duplicates, tuple(infos))


def _unlisted(url: str) -> tuple[str]:
    if is_listing(url):
        raise ValueError(_UNLISTED)
    return (url,)


def read_url_list(
    path: str | os.PathLike[str],
    *,
    allow_pipe: bool = False,
    limit: int = DEFAULT_LIMIT,
    lister: Lister | None = None,
) -> UrlList:
    """Read and parse a URL list file (see :func:`parse_url_list`) or a shard index (see
    :func:`index_list`: a file that starts like JSON, see :func:`~wdscache.shared.shard_index.looks_like_index`);
    relative paths in it resolve against its folder.

    Raises ConfigError if the file cannot be read, UrlListError for a bad line
    (including bytes that are not UTF-8), ShardIndexError for a bad index.
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"URL list {name} does not exist; check the --urls path") from None
    except OSError as exc:
        raise ConfigError(f"cannot read URL list {name}: {exc.strerror or exc}") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        start = data.rfind(b"\n", 0, exc.start) + 1
        end = data.find(b"\n", exc.start)
        line = data[start : end if end >= 0 else len(data)].decode("utf-8", "replace").strip()
        reason = f"not valid UTF-8 (bad byte at offset {exc.start}); save the list as UTF-8"
        raise UrlListError(name, lineno, line, reason) from None
    base_dir = os.path.dirname(os.path.abspath(name))
    if looks_like_index(text):
        return index_list(parse_shard_index(text, path=name), path=name, base_dir=base_dir, allow_pipe=allow_pipe,
                          limit=limit, lister=lister)
    return parse_url_list(text, path=name, base_dir=base_dir, allow_pipe=allow_pipe, limit=limit, lister=lister)


def list_id(urls: Iterable[str], shards: Iterable[ShardInfo] | None = None) -> str:
    """A short fingerprint of a list: the same URLs in the same order give the same id (and,
    given ``shards``, the same facts of each: then the id differs from the URLs' alone)."""
    h = hashlib.sha256()
    for url in urls:
        h.update(url.encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    if shards is not None:
        h.update(b"\0shards\n")
        for info in shards:
            h.update(f"{info.nsamples} {info.filesize} {info.md5}\n".encode())
    return h.hexdigest()[:16]


def diff_urls(old: UrlList, new: UrlList) -> tuple[list[str], list[str]]:
    """Return ``(added, removed)``: URLs only in ``new`` and only in ``old``, each in list order."""
    old_set, new_set = set(old.urls), set(new.urls)
    added = [url for url in new.urls if url not in old_set]
    removed = [url for url in old.urls if url not in new_set]
    return added, removed


def format_url_list(urls: Iterable[str]) -> str:
    """Write URLs one per line, escaping braces, so that parse_url_list reads them back."""
    return "".join(url.replace("{", "\\{").replace("}", "\\}") + "\n" for url in urls)
