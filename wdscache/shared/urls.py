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
A line whose glob characters are each escaped in a class of their own (``s3://b/x[[]1].tar``,
``[*]``, ``[?]``: how :func:`format_url_list` writes a key holding them) names that one object.
Where a URL stands alone (an index's entry, a job's URL) its key is taken literally, glob
characters included: only an empty key or one ending in ``/`` is a prefix there.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import ipaddress
import itertools
import operator
import os
import re
import stat
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from wdscache.shared.errors import ConfigError, ShardIndexError, UrlListError
from wdscache.shared.redact import redact_urls
from wdscache.shared.s3 import SHARD_SUFFIXES, is_prefix, literal_entry, named_object
from wdscache.shared.shard_index import ShardFacts, ShardInfo, looks_like_index, quick_shard_index, read_shard_index
from wdscache.shared.tarwalk import GZIP_MAGIC, HEAD_BYTES, shard_packing

__all__ = [
    "DEFAULT_LIMIT",
    "TEXT_SOURCE",
    "UrlList",
    "Urls",
    "diff_urls",
    "expand_braces",
    "format_url_list",
    "given_list",
    "index_list",
    "list_id",
    "list_of_bytes",
    "names_shard",
    "normalize_url",
    "parse_url_list",
    "read_list_bytes",
    "read_url_list",
    "repeated_urls",
    "whitespace_problem",
]

DEFAULT_LIMIT = 10_000_000  # URLs a list may hold: the agent's, a job's own, an index's
_HASHED = 1 << 20  # characters of a list's text encoded at once to fingerprint it
TEXT_SOURCE = "<urls>"
"""The ``path`` shown in errors for a list that did not come from a file."""

PIPE_REFUSED = "pipe: sources run a shell command; start the agent with --allow-pipe to allow them"
#: The same, where no option allows one (a cache command's URLs, a loader's own list).
PIPE_AGENT_ONLY = (
    "this command takes no pipe: command: only the agent runs them, for its --urls file's lines (with --allow-pipe)"
)
_SUPPORTED = (
    "supported: http://, https://, s3://bucket/key (or a prefix or glob), file:///path, a plain path, "
    "pipe:CMD (with --allow-pipe)"
)
_UNLISTED = "an s3:// prefix or glob is listed only where a list is read: give it in the list itself"
Lister = Callable[[str], Sequence[str]]
"""Given an ``s3://`` entry, the URLs it stands for; raises ValueError saying why it cannot."""
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# Capturing split keeps the delimiters; escapes come first so "\{" never opens a group. As
# braceexpand (webdataset's) reads a pattern, a backslash makes any character after it literal.
_BRACE_TOKENS = re.compile(r"(\\.|[{},])", re.DOTALL)
_COMMENT_START = re.compile(r"\s#")
_AUTHORITY_END = re.compile(r"[/?#]")
# An http(s) line of a list whose host, with no user info before it, has a port that is no number.
_PORT_NOT_A_NUMBER = re.compile(r"\nhttps?://(?=[^/?#\n@]*[/?#\n])[^/?#\n:]*:[0-9]*[^0-9/?#\n]")
_SPACE = re.compile(r"\s")
# _plain_lines: white space inside a line.
_ASCII_SPACE = " \t\r\x0b\x0c\x1c\x1d\x1e\x1f"  # what str.split splits an ASCII line at
_SPACE_IN_LINE = re.compile(r"[^\S\n]|[\0\ud800-\udfff]")  # (and what no URL holds: see _normalize)
# A NUL ends a path where the OS reads it, and a lone surrogate (from a JSON escape) is no text:
# neither can name a shard.
_NOT_TEXT = re.compile(r"[\0\ud800-\udfff]")
# A path with one of these (each line between "\n"s) is not its own os.path.normpath: an empty,
# "." or ".." part, or a "/" at its end.
_UNCLEAN = ("/./", "/../", "/.\n", "/..\n", "\n./", "\n../", "\n.\n", "\n..\n")  # and "//", "/\n"
_FIRST, _LAST = operator.itemgetter(0), operator.itemgetter(-1)  # a line's first and last character
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
        elif len(token) == 2 and token[0] == "\\":
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

    Groups multiply out with the leftmost varying slowest; in a pattern with braces a
    backslash makes the character after it literal (``\\{``, ``\\,``, ``\\\\``), as braceexpand
    reads it; a text without braces is taken as it is.  Raises ValueError for malformed
    braces, or - before building anything - when the result would hold more than ``limit``
    entries.
    """
    if "{" not in pattern and "}" not in pattern:
        return [pattern]
    tree = _parse(pattern)
    count = _count(tree)
    if count > limit:
        raise ValueError(_too_many(count, limit))
    return _expand(tree)


# --------------------------------------------------------------------------- compact sequences


REPR_URLS = 8  # URLs a list's repr shows


class Urls(Sequence[str]):
    """URLs in order, held compactly: one string of them all (each ended by ``"\\n"``, which no URL
    holds) and an array of where each ends, rather than an object per URL.

    A million URLs of 80 characters take about 100 MB here (text, ends, lookup table), against
    about 140 MB as a tuple of strings and 110 MB more for a dict of their positions. Lookups
    (``in``, :meth:`index`, :meth:`position`) go through an open-addressing table of positions
    by hash, made on the first lookup, a step at a time by :meth:`make_lookups`, or at once by
    :meth:`distinct`. Lookups are safe from several threads: one makes (or finishes) the table,
    the others wait for it. Equal to any sequence of the same URLs in the same order.
    """

    __slots__ = ("_text", "_ends", "_table", "_making", "_id")

    def __init__(self, urls: Iterable[str] = ()) -> None:
        urls = urls if isinstance(urls, (list, tuple)) else list(urls)
        self._text = "\n".join(urls) + "\n" if urls else ""
        # _ends[i]: the end of URL i in the text without separators (URL i starts at _ends[i - 1] + i).
        self._ends = array("q", itertools.accumulate(map(len, urls)))
        if self._text.count("\n") != len(urls):
            raise ValueError("a URL holds no line break")
        self._table: array | None = None
        self._making: tuple[array, int] | None = None  # a table being made, and how many URLs it holds
        self._id: str | None = None  # list_id of these URLs, once worked out

    @classmethod
    def distinct(cls, urls: list[str]) -> tuple[Urls, int]:
        """The URLs of ``urls`` without repeats (the first of each kept, in order), and how many were
        dropped; its lookup table made at once, while ``urls`` still hold their hashes."""
        kept = urls if len(set(urls)) == len(urls) else list(dict.fromkeys(urls))  # (a set is the cheaper check)
        made = cls(kept)
        made._table = _positions_table(kept)
        return made, len(urls) - len(kept)

    @classmethod
    def _of_text(cls, text: str, ends: array) -> Urls:
        """The URLs of ``text`` (each ended by ``"\\n"``) that end at ``ends`` (as ``_ends`` holds
        them), their lookup table not made yet."""
        made = cls.__new__(cls)
        made._text, made._ends, made._table, made._making, made._id = text, ends, None, None, None
        return made

    def make_lookups(self, count: int | None = None) -> bool:
        """Make the lookup table now, as the first lookup would, or only ``count`` more URLs'
        share of it; True once it is whole. (The agent makes a long list's table a step at a
        time between requests: see :meth:`position` for a lookup meanwhile.)"""
        if self._table is not None:
            return True
        with _MAKING_TABLE:  # one thread at a time adds to it; another asking meanwhile waits
            if self._table is not None:
                return True
            table, done = self._making or (_empty_table(len(self)), 0)
            stop = len(self) if count is None else min(len(self), done + count)
            try:
                _place(table, self[done:stop], done)
            except BaseException:
                self._making = None  # part of this step placed: the next call starts over
                raise
            if stop < len(self):
                self._making = (table, stop)
                return False
            self._table, self._making = table, None
            return True

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return tuple(self[k] for k in range(start, stop, step))
            if start >= stop:
                return ()
            return tuple(self._text[self._start(start) : self._ends[stop - 1] + stop - 1].split("\n"))
        ends, i = self._ends, operator.index(i)
        if i < 0:
            i += len(ends)
        if not 0 <= i < len(ends):
            raise IndexError("URL index out of range")
        return self._text[self._start(i) : ends[i] + i]

    def _start(self, i: int) -> int:
        """Where URL ``i`` starts in the text."""
        return self._ends[i - 1] + i if i else 0

    def __iter__(self) -> Iterator[str]:
        text, start = self._text, 0
        for end, i in zip(self._ends, itertools.count()):
            yield text[start + i : end + i]
            start = end

    def __contains__(self, url: object) -> bool:
        return isinstance(url, str) and self.position(url) >= 0

    def index(self, url: Any, start: int = 0, stop: int | None = None) -> int:
        """The position of ``url``; ValueError if it is not here."""
        at = self.position(url) if isinstance(url, str) else -1
        if at < 0 or not start <= at < (len(self) if stop is None else stop):
            shown = redact_urls(url) if isinstance(url, str) else url  # (a URL may hold a secret)
            raise ValueError(f"{shown!r} is not in the list")
        return at

    def count(self, url: Any) -> int:
        return 1 if url in self else 0  # distinct URLs (a list's are)

    def position(self, url: str) -> int:
        """Where ``url`` is (-1: not here). While the table is made a step at a time, a URL it
        holds already is found there; any other finishes it."""
        table = self._table
        if table is None:
            making = self._making
            if making is not None and (at := self._probe(making[0], url)) >= 0:
                return at  # (a URL found is right even in a table another thread adds to)
            self.make_lookups()
            table = self._table
            assert table is not None
        return self._probe(table, url)

    def _probe(self, table: array, url: str) -> int:
        """Where ``url`` is among the URLs placed in ``table`` (-1: not among them)."""
        mask = len(table) - 1
        slot = hash(url) & mask
        while at := table[slot]:  # position + 1; 0: an empty slot, the end of the probe
            if self[at - 1] == url:
                return at - 1
            slot = (slot + 1) & mask
        return -1

    def page(self, start: int, budget: int) -> list[str]:
        """The URLs from ``start`` on that :func:`wdscache.shared.protocol.pages` puts in one page of
        ``budget`` bytes (each URL counted with 8 more; at least one URL), found by bisection."""
        ends, n = self._ends, len(self._ends)
        if start >= n:
            return []
        before = ends[start - 1] if start else 0
        lo, hi = start + 1, n  # the page ends at the last j in [start + 1, n] whose URLs fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ends[mid - 1] - before + 8 * (mid - start) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return list(self[start:lo])

    def leading(self, chars: int) -> int:
        """How many URLs lie wholly (with their ``"\\n"``) in the first ``chars`` characters of :meth:`text`."""
        ends, lo, hi = self._ends, 0, len(self._ends)
        while lo < hi:  # the first URL that does not: ends[i] + i + 1 > chars
            mid = (lo + hi) // 2
            if ends[mid] + mid + 1 <= chars:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def trailing(self, chars: int) -> int:
        """How many URLs, with the ``"\\n"`` before them, lie wholly in the last ``chars`` characters
        of :meth:`text` (so that they are URLs of any text that ends with those characters)."""
        ends, lo, hi, first = self._ends, 1, len(self._ends), len(self._text) - chars
        if not ends:
            return 0
        while lo < hi:  # the first URL i >= 1 whose "\n" before it is in: ends[i - 1] + i - 1 >= first
            mid = (lo + hi) // 2
            if ends[mid - 1] + mid - 1 >= first:
                hi = mid
            else:
                lo = mid + 1
        return len(ends) - lo

    def text(self) -> str:
        """The URLs, each ended by ``"\\n"`` (a list file of them, without escaping braces)."""
        return self._text

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Urls):
            return self._text == other._text
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        # Shown as the tuple of URLs it stands for (as lists were shown before they were held
        # compactly), cut short past REPR_URLS.
        if len(self) <= REPR_URLS:
            return repr(tuple(self))
        return f"({', '.join(map(repr, self[:REPR_URLS]))}, ... {len(self) - REPR_URLS} more)"

    def __reduce__(self) -> tuple[Any, ...]:
        # The table holds this process's string hashes: the other side makes its own.
        return (Urls._of_text, (self._text, self._ends))


_MAKING_TABLE = threading.Lock()  # held while a lookup table is made or added to (rare: a long list's)


def _new_lock() -> None:
    global _MAKING_TABLE
    _MAKING_TABLE = threading.Lock()  # a child forked while another thread held it would wait forever


os.register_at_fork(after_in_child=_new_lock)


def _positions_table(urls: Sequence[str]) -> array:
    """The lookup table of ``urls``: open addressing, linear probing: slot ``hash(url) & mask`` or
    the next free one holds ``position + 1``."""
    table = _empty_table(len(urls))
    _place(table, urls, 0)
    return table


def _empty_table(n: int) -> array:
    """A lookup table for ``n`` URLs, none placed: at least twice as many slots keep probes short."""
    return array("i" if n < 1 << 31 else "q", [0]) * (1 << max(3, (2 * n).bit_length()))


def _place(table: array, urls: Iterable[str], first: int) -> None:
    """Place ``urls``, the list's from position ``first`` on, in ``table``."""
    mask = len(table) - 1
    for k, url in enumerate(urls, first + 1):
        slot = hash(url) & mask
        while table[slot]:
            slot = (slot + 1) & mask
        table[slot] = k


# --------------------------------------------------------------------------- lists


@dataclass(frozen=True)
class UrlList:
    """The ordered, de-duplicated URLs of a list.

    ``path`` is the file it came from (None when parsed from bare text) and
    ``duplicates`` how many repeated entries were dropped while reading it. ``shards``, for a
    list read from a shard index, holds what the index says of each URL (by position).
    ``urls`` and ``shards`` are held compactly (:class:`Urls`, :class:`ShardFacts`): given as
    tuples, they are made so.
    """

    path: str | None
    urls: Urls
    duplicates: int = 0
    shards: ShardFacts | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.urls, Urls):
            object.__setattr__(self, "urls", Urls(self.urls))
        if self.shards is not None and not isinstance(self.shards, ShardFacts):
            object.__setattr__(self, "shards", ShardFacts(self.shards))

    def __len__(self) -> int:
        return len(self.urls)

    def __iter__(self) -> Iterator[str]:
        return iter(self.urls)

    def __contains__(self, url: object) -> bool:
        return url in self.urls

    def index(self, url: str) -> int:
        """Return the position of ``url``; ValueError if it is not in the list."""
        try:
            return self.urls.index(url)
        except ValueError:
            raise ValueError(f"{redact_urls(url)!r} is not in the URL list") from None

    def info(self, url: str) -> ShardInfo | None:
        """What the shard index this list came from says of ``url`` (None: nothing)."""
        if self.shards is None:
            return None
        at = self.urls.position(url)
        return None if at < 0 else self.shards[at]

    @functools.cached_property
    def local(self) -> bool:
        """Whether some URL names a local file (``file://``)."""
        text = self.urls.text()
        return text.startswith("file://") or "\nfile://" in text

    @property
    def list_id(self) -> str:
        """The list's identity for an agent that holds it: its :func:`list_id`, which covers the
        shards' facts too when it came from an index (the same URLs with other facts are another list)."""
        return list_id(self.urls, self.shards)


def _abs_path(path: str) -> str:
    if "/.." in path:
        return _up_as_the_system_goes(path)
    path = os.path.normpath(path)
    # POSIX keeps a leading "//" as implementation-defined; make it one slash.
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return path


def _up_as_the_system_goes(path: str) -> str:
    """The absolute ``path`` without ``.``, ``..`` and empty parts: a ``..`` after a symbolic link
    is the folder above the link's target, as the system opens it (not the folder the text names);
    any other part keeps its spelling (``top/sub/..`` is ``top``, a link or not), so that two
    spellings of one file stay one URL. One look at the file system for each ``..``."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts and os.path.islink(here := "/" + "/".join(parts)):
                parts = [p for p in os.path.realpath(here).split("/") if p]
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts)


def file_path(url: str) -> str:
    """The local path a ``file://`` URL of a list names: the rest of it, as written. As webdataset
    reads it, nothing is percent-decoded: a plain path becomes ``file://`` and its own characters
    (a ``%41`` in a file's name is that file's, not an ``A``)."""
    return url[len("file://") :]


def normalize_url(url: str, base_dir: str, *, allow_pipe: bool = False) -> str:
    """The canonical form of one URL as a list line gives it (a relative path against ``base_dir``);
    ValueError says why it is unusable."""
    return _normalize(url, base_dir, allow_pipe)


def _normalize(url: str, base_dir: str, allow_pipe: bool) -> str:
    """Return the canonical form of one expanded entry; ValueError says why it is unusable."""
    if "\0" in url or (not url.isascii() and _NOT_TEXT.search(url) is not None):
        raise ValueError("a URL holds no NUL character and no lone surrogate (\\ud800-\\udfff)")
    # Fast path for the common case: plain string checks, no regex.
    if url.startswith("https://"):
        host_at = 8
    elif url.startswith("http://"):
        host_at = 7
    else:
        return _normalize_other(url, base_dir, allow_pipe)
    if len(url) == host_at or url[host_at] in "/?#@:":
        raise ValueError("an http(s) URL needs a host, like http://host/path")
    if url[host_at] == "[":  # checked here: urllib refuses a malformed one only where it is fetched
        try:
            ipaddress.IPv6Address(urlsplit(url).hostname or "")
        except ValueError:
            raise ValueError("a host in brackets is an IPv6 address, like http://[::1]:8000/path") from None
    if "@" in url:
        _check_user_info(url, host_at)
    return url


def _check_user_info(url: str, host_at: int) -> None:
    """Refuse a URL whose password holds a ``/``, ``?`` or ``#`` as it is: the host would end
    there, and the rest of the password would show in logs as the URL's port and path."""
    end = _AUTHORITY_END.search(url, host_at)
    host = url[host_at : end.start() if end else len(url)].rpartition("@")[2]
    port = "" if host.endswith("]") else host.rpartition(":")[2] if ":" in host else ""
    if port and not port.isdigit():
        raise ValueError(
            "the host's port is not a number: a user name or password with '/', '?' or '#' in it "
            "must be percent-encoded (%2F, %3F, %23)"
        )


def _normalize_other(url: str, base_dir: str, allow_pipe: bool) -> str:
    colon = url.find(":")
    if colon < 0 and _clean_path(url):  # the common case, without normpath's cost
        return "file://" + (url if url[0] == "/" else (base_dir if base_dir != "/" else "") + "/" + url)
    if colon > 0 and _SCHEME_RE.fullmatch(url, 0, colon):
        scheme = url[:colon].lower()
        if scheme == "pipe":
            if not allow_pipe:
                raise ValueError(PIPE_REFUSED)
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
                if _SPACE.search(rest.split("/", 1)[0]):
                    raise ValueError("an S3 bucket's name holds no whitespace (a key may: s3://bucket/a key.tar)")
                if "@" in rest.split("/", 1)[0]:  # boto3 would take it for the bucket's name, and quote it
                    raise ValueError(
                        "an s3:// URL holds no credentials: give them as boto3 takes them "
                        "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, an instance role)"
                    )
                return "s3://" + rest
            raise ValueError(f"unknown scheme {scheme!r}; {_SUPPORTED}")
        if scheme == "file":  # file:rel/a.tar, file:/abs/a.tar: the path after the colon, as webdataset opens it
            if not url[colon + 1 :]:
                raise ValueError("a file: URL needs a path, like file:///data/shard.tar")
            return "file://" + _abs_path(os.path.join(base_dir, url[colon + 1 :]))
    if "://" in url:  # (not a path anyone means: an invisible character before a scheme, say)
        raise ValueError("a URL's scheme is letters, digits, '+', '-' and '.' only, at the line's start")
    # Anything else is a local path (a "name:" without "//" included, e.g. "a:b.tar").
    return "file://" + _abs_path(os.path.join(base_dir, url))


def _clean_path(path: str) -> bool:
    """Whether ``path`` is its own :func:`os.path.normpath`: no empty, ``.`` or ``..`` part, no
    ``/`` at its end."""
    return not (
        "//" in path
        or "/./" in path
        or "/../" in path
        or path.endswith(("/", "/.", "/.."))
        or path.startswith(("./", "../"))
        or path in (".", "..")
    )


def _line_entry(raw: str, parts: list[str], comments: bool = True) -> str:
    """The entry of a line whose first word is followed by another (not a comment's, with ``comments``)."""
    # Only a shell command, an S3 key (taken literally, as `aws s3` takes it) and a local path may
    # contain whitespace; the comment starts at " #". A line with a second URL is two entries on one line.
    first = parts[0][:7].lower()
    literal = first.startswith(("s3://", "file://")) or "://" not in parts[0]
    if first.startswith("pipe:") or (literal and not any("://" in word for word in parts[1:])):
        line = raw.strip()
        match = _COMMENT_START.search(line) if comments else None
        return line[: match.start()].rstrip() if match else line
    raise ValueError(
        "a line holds one URL, but this one has whitespace inside (percent-encode a space in an http(s) URL: %20)"
    )


def parse_url_list(
    text: str,
    *,
    path: str = TEXT_SOURCE,
    base_dir: str | None = None,
    allow_pipe: bool = False,
    limit: int = DEFAULT_LIMIT,
    lister: Lister | None = None,
    comments: bool = True,
) -> UrlList:
    """Parse the text of a URL list.

    Relative paths resolve against ``base_dir`` (default: the current directory).
    Without ``comments`` (a command line's argument: one entry, as the shell gave it), ``#``
    starts no comment.
    ``limit`` bounds the entries after brace and prefix expansion, counted before
    duplicates are dropped.  Every ``s3://`` entry goes through ``lister``, when given,
    and becomes the URLs it returns; without one, an ``s3://`` prefix or glob is refused.
    Any unusable line raises UrlListError naming ``path`` and the line.
    """
    base = os.path.abspath(base_dir) if base_dir is not None else os.getcwd()
    plain = _plain_lines(text, base, limit)  # (none with a "#": see _not_plain)
    if plain is not None:
        distinct, duplicates = plain
        return UrlList(None if path == TEXT_SOURCE else path, distinct, duplicates)
    distinct, duplicates = Urls.distinct(_listed(text, path, base, allow_pipe, limit, lister, comments))
    return UrlList(None if path == TEXT_SOURCE else path, distinct, duplicates)


def repeated_urls(
    text: str, *, base_dir: str | None = None, allow_pipe: bool = False, lister: Lister | None = None
) -> list[str]:
    """The URLs that the list ``text`` names more than once (those :func:`parse_url_list` drops
    the repeats of), each once, in the order of their first repeat. Its ``s3://`` prefixes are
    listed again."""
    base = os.path.abspath(base_dir) if base_dir is not None else os.getcwd()
    seen: set[str] = set()
    repeated: dict[str, None] = {}
    for url in _listed(text, TEXT_SOURCE, base, allow_pipe, DEFAULT_LIMIT, lister):
        if url in seen:
            repeated[url] = None
        seen.add(url)
    return list(repeated)


def _listed(
    text: str, path: str, base: str, allow_pipe: bool, limit: int, lister: Lister | None, comments: bool = True
) -> list[str]:
    """The URLs of the list ``text``, line by line, with their repeats (see :func:`parse_url_list`)."""
    urls: list[str] = []
    total = 0
    # Split on "\n" only so line numbers match what an editor shows.
    for lineno, raw in enumerate(text.split("\n"), 1):
        parts = raw.split()
        if not parts or (comments and parts[0][0] == "#"):
            continue
        try:
            entry = parts[0]
            if len(parts) > 1 and not (comments and parts[1][0] == "#"):
                entry = _line_entry(raw, parts, comments)
            if "{" in entry or "}" in entry:
                tree = _parse(entry)
                total += _count(tree)
                if total > limit:
                    raise ValueError(f"the list would hold {total} URLs, more than the limit of {limit}")
                expanded: Iterable[str] = _expand(tree)
            else:
                total += 1
                if total > limit:
                    raise ValueError(f"the list holds more than the limit of {limit} URLs")
                expanded = (entry,)
            for url in expanded:
                url = _normalize(url, base, allow_pipe)
                if url.startswith("s3://"):
                    objects = lister(url) if lister is not None else _unlisted(url)
                    total += len(objects) - 1
                    if total > limit:
                        raise ValueError(f"the list would hold {total} URLs, more than the limit of {limit}")
                    urls.extend(objects)
                else:
                    urls.append(url)
        except ValueError as exc:
            raise UrlListError(path, lineno, raw.strip(), str(exc)) from None
    return urls


def _plain_lines(text: str, base: str, limit: int) -> tuple[Urls, int] | None:
    """The URLs of a list whose every line is what the line-by-line parse would take as it is
    (an http(s) URL with a host), or a path it would only prefix (all absolute, or all relative,
    none with a part normpath changes), found with substring scans of the whole text, without
    repeats, and how many were dropped; else None."""
    if _not_plain(text):
        return None  # braces, comments, white space in a line: the line-by-line parse
    lines = text.split("\n")
    if lines and not lines[-1]:
        lines.pop()  # (the end of the last line)
    blank = "" in lines  # (a scan of the list for one object: cheaper than one of the text for "\n\n")
    if blank:
        lines = [line for line in lines if line]
    if len(lines) > limit:
        return None
    # (each a copy of the text made once: a million lines' texts are tens of MB)
    joined = "\n".join(["", *lines, ""]) if blank else "\n" + text if text.endswith("\n") else f"\n{text}\n"
    prefix = _plain(joined, lines, base)
    if prefix is None:
        return None
    if _distinct(lines):
        return _prefixed(joined, lines, prefix), 0
    return Urls.distinct([prefix + line for line in lines])


def _distinct(lines: list[str]) -> bool:
    """Whether no two of ``lines`` are alike: at once if they are in strictly increasing order, as
    a list or an index of numbered shards usually is (a quarter of the time a set of them takes)."""
    return all(map(operator.lt, lines, itertools.islice(lines, 1, None))) or len(set(lines)) == len(lines)


def _not_plain(text: str) -> bool:
    """Whether ``text`` holds a brace, a ``#``, white space other than ``"\n"``, or what no URL
    holds (a NUL, a lone surrogate)."""
    return (
        "{" in text
        or "}" in text
        or "#" in text
        or "\0" in text
        or (any(c in text for c in _ASCII_SPACE) if text.isascii() else _SPACE_IN_LINE.search(text) is not None)
    )


def _plain(joined: str, lines: list[str], base: str) -> str | None:
    """What goes before each of ``lines`` (a list's or an index's: non-empty, none holding a brace,
    ``#`` or white space) to make it its URL: nothing for http(s) URLs, ``file://`` and a folder
    for paths; None if they are not all of one plain kind. ``lines`` are given also as ``joined``:
    each line between two ``"\n"``, so that a pattern at a line's start or end is one substring."""
    n = len(lines)
    # Each line's first and last character, as strings: one-character scans of these are
    # memchr's, where a two-character pattern ("\n/") scans the whole text 20 times slower.
    firsts = "".join(map(_FIRST, lines))
    lasts = "".join(map(_LAST, lines))
    if (
        firsts.count("h") == n
        and joined.count("\nhttp://") + joined.count("\nhttps://") == n
        and not any(f"\n{scheme}://{c}" in joined for scheme in ("http", "https") for c in "/?#@:\n[")
        and ("@" not in joined or _PORT_NOT_A_NUMBER.search(joined) is None)  # (see _check_user_info)
    ):
        return ""
    if ":" in joined or "//" in joined or "/" in lasts:
        return None
    if ("/." in joined or "." in firsts) and any(part in joined for part in _UNCLEAN):
        return None  # (a dot after a "/" or at a line's start is rare: the exact parts are looked for then)
    absolute = firsts.count("/") == n
    if not absolute and ("/" in firsts or "\n" in base):
        return None  # some of each: each its own way (or a folder no URL can name: refused there)
    return "file://" if absolute else "file://" + (base if base != "/" else "") + "/"


def _prefixed(joined: str, lines: list[str], prefix: str) -> Urls:
    """The URLs ``prefix`` + line of ``lines`` (distinct, given also as ``joined``, as :func:`_plain`
    takes them), made from the text at once rather than from a prefixed copy of each line (their
    lookup table is made on the first lookup)."""
    if not lines:
        return Urls()
    if not prefix:
        return Urls._of_text(joined[1:], array("q", itertools.accumulate(map(len, lines))))
    text = joined.replace("\n", "\n" + prefix)[1 : -len(prefix)]  # ("\nP" + a + ... + "\nP": two copies, not four)
    lengths = map(operator.add, map(len, lines), itertools.repeat(len(prefix)))
    return Urls._of_text(text, array("q", itertools.accumulate(lengths)))


def index_list(
    entries: Sequence[tuple[str, ShardInfo]],
    *,
    path: str = TEXT_SOURCE,
    base_dir: str | None = None,
    allow_pipe: bool = False,
    limit: int = DEFAULT_LIMIT,
    lister: Lister | None = None,
) -> UrlList:
    """The list of a shard index's ``entries``: each URL as written, with its facts.

    Each URL is taken as written (no brace expansion) and normalized as a list line is, a
    relative one against ``base_dir`` (the index's folder); an ``s3://`` object goes through
    ``lister`` when given (its key taken literally, glob characters included), and a prefix is
    refused (an entry names one shard). A URL
    listed twice with the same facts counts as a duplicate; with other facts it is an error.
    Raises ShardIndexError naming ``path`` and the entry.
    """
    return _index_list(
        [url for url, _ in entries],
        ShardFacts(info for _, info in entries),
        path=path,
        base_dir=base_dir,
        allow_pipe=allow_pipe,
        limit=limit,
        lister=lister,
    )


def given_list(urls: Sequence[str], *, limit: int = DEFAULT_LIMIT) -> UrlList:
    """The list of absolute ``urls`` given one by one (a job's own list), not as a list's text:
    each taken as written and normalized as a shard index's URLs are (:func:`index_list`), so
    that no brace or ``#`` in an ``s3://`` key is read as a pattern or a comment. Raises
    ShardIndexError naming the URL at fault (its ``url`` and ``reason``)."""
    return _index_list(list(urls), None, path=TEXT_SOURCE, base_dir="/", allow_pipe=False, limit=limit, lister=None)


def _index_list(
    written: list[str],
    facts: ShardFacts | None,
    *,
    path: str,
    base_dir: str | None,
    allow_pipe: bool,
    limit: int,
    lister: Lister | None,
) -> UrlList:
    """:func:`index_list` of the URLs ``written`` with their ``facts`` (by position; None: none known)."""
    if len(written) > limit:
        raise ShardIndexError(path, None, f"the index lists {len(written)} shards, more than the limit of {limit}")
    base = os.path.abspath(base_dir) if base_dir is not None else os.getcwd()
    # Each one plain, as a list's lines can be (none empty, none with a line break)?
    joined = "\n".join(["", *written, ""])
    # (With no line break inside a URL, an empty one is the only way to two in a row.)
    plain = not _not_plain(joined) and joined.count("\n") == len(written) + 1 and all(written)
    prefix = _plain(joined, written, base) if plain else None
    if prefix is not None and _distinct(written):
        return UrlList(None if path == TEXT_SOURCE else path, _prefixed(joined, written, prefix), 0, facts)
    del joined
    if prefix is not None:
        urls = [prefix + url for url in written]
    else:
        urls = []
        for i, url in enumerate(written):
            try:
                urls.append(_index_url(url, base, allow_pipe, lister))
            except ValueError as exc:
                raise ShardIndexError(path, i, str(exc), url=url) from None
    distinct, duplicates = Urls.distinct(urls)
    if duplicates and facts is not None:
        facts = _distinct_facts(urls, facts, distinct, path, written)
    return UrlList(None if path == TEXT_SOURCE else path, distinct, duplicates, facts)


def _index_url(written: str, base: str, allow_pipe: bool, lister: Lister | None) -> str:
    """The canonical form of an index entry's URL other than http(s); ValueError says why it is unusable."""
    problem = whitespace_problem(written)
    if problem is not None:
        raise ValueError(problem)
    url = _normalize(written, base, allow_pipe)
    if url.startswith("s3://"):
        if is_prefix(url):
            raise ValueError(
                "a URL given alone names one object, not an s3:// prefix (its key is taken literally, "
                "glob characters included): give the prefix in a URL list instead"
            )
        if lister is not None:
            lister(literal_entry(url))  # the agent checks here that it can fetch from S3 at all
    return url


def whitespace_problem(url: str) -> str | None:
    """Why ``url``, given alone (an index's entry, a job's URL, a prefetch's), may not hold the
    white space it holds; None if it holds none or may. An ``s3://`` key is taken literally (as a
    list's line takes it: keys may hold spaces) and a ``pipe:`` command is a shell's; neither
    holds a line break, which ends a URL in a list."""
    if _SPACE.search(url) is None:
        return None
    kind = url[:5].lower()
    if kind in ("http:", "https") or (kind not in ("s3://", "pipe:", "file:") and "://" in url):
        return "a URL holds no whitespace (percent-encode a space in an http(s) URL: %20)"
    if "\n" in url:
        held = {"s3://": "an s3:// key", "pipe:": "a pipe: command"}.get(kind, "a path")
        return f"{held} holds no line break"
    return None


def _distinct_facts(urls: list[str], facts: ShardFacts, distinct: Urls, path: str, written: list[str]) -> ShardFacts:
    """The facts of the first entry of each URL of ``distinct``; ShardIndexError for a URL listed again
    with other facts."""
    kept = ShardFacts()
    for i, url in enumerate(urls):
        first = distinct.position(url)
        if first == len(kept):
            kept.append(facts[i])
        elif kept[first] != facts[i]:
            earlier = urls.index(url)
            raise ShardIndexError(path, i, f"listed before, as shardlist[{earlier}], with other facts", url=written[i])
    return kept


def _unlisted(url: str) -> tuple[str]:
    named = named_object(url)
    if named is None:
        raise ValueError(_UNLISTED)
    return (named,)


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
    return list_of_bytes(read_list_bytes(name), path=name, allow_pipe=allow_pipe, limit=limit, lister=lister)


def read_list_bytes(path: str) -> bytes:
    """The bytes of the list file ``path``; ConfigError if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"URL list {path} does not exist; check the --urls path") from None
    except OSError as exc:
        raise ConfigError(f"cannot read URL list {path}: {exc.strerror or exc}") from None


def list_of_bytes(
    data: bytes, *, path: str, allow_pipe: bool = False, limit: int = DEFAULT_LIMIT, lister: Lister | None = None
) -> UrlList:
    """:func:`read_url_list` of the bytes ``data`` read from the file ``path``."""
    packing = shard_packing(data[:HEAD_BYTES])
    if packing is not None:  # its bytes read as lines would be a dump of binary in the error
        raise ConfigError(
            f"URL list {path} looks like a shard (a {packing.value} file), not a URL list (a text file of "
            "URLs, one a line)"
        )
    if data.startswith(GZIP_MAGIC):
        raise ConfigError(f"URL list {path} is gzip'd: URL lists are read as text; decompress it (gzip -d)")
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    base_dir = os.path.dirname(_abs_path(os.path.join(os.getcwd(), path)))  # (its "..": as it was opened)
    # An index well formed in every way is read from its bytes: a text of them is one more copy.
    taken = quick_shard_index(data)
    if taken is None:
        text = _text_of(data, path)
        if not looks_like_index(text):
            return parse_url_list(text, path=path, base_dir=base_dir, allow_pipe=allow_pipe, limit=limit, lister=lister)
        taken = read_shard_index(text, path=path)
        del text
    return _index_list(*taken, path=path, base_dir=base_dir, allow_pipe=allow_pipe, limit=limit, lister=lister)


_SNIFFED = 8000  # the bytes looked at for a NUL, as git tells a binary file


def _text_of(data: bytes, path: str) -> str:
    """The text of the list file ``path``'s bytes ``data``; UrlListError naming the line of a byte
    that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if b"\0" in data[:_SNIFFED]:  # no text holds a NUL: its "line" would be a dump of binary
            raise ConfigError(
                f"URL list {path} looks like a binary file, not a URL list (a UTF-8 text file of URLs, one a line)"
            ) from None
        lineno = data.count(b"\n", 0, exc.start) + 1
        start = data.rfind(b"\n", 0, exc.start) + 1
        end = data.find(b"\n", exc.start)
        line = data[start : end if end >= 0 else len(data)].decode("utf-8", "replace").strip()
        reason = f"not valid UTF-8 (bad byte at offset {exc.start}); save the list as UTF-8"
        raise UrlListError(path, lineno, line, reason) from None


def names_shard(path: str) -> bool:
    """Whether the local path ``path``, given alone (a loader's ``urls=``), names one shard rather
    than a URL list: a name that ends like a tar (``.tar``, ``.tar.gz``, ``.tgz``, in any case), or
    a regular file whose first bytes are a shard's, whatever its name
    (:func:`~wdscache.shared.tarwalk.shard_packing`: webdataset reads ``s.TAR`` or ``s.shard`` as
    a tar too). A path that cannot be read names no shard."""
    if path.lower().endswith(SHARD_SUFFIXES):
        return True
    try:
        # Only a regular file is looked into: what is read from a pipe (bash's <(...)) is gone
        # for the list it carries.
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return shard_packing(f.read(HEAD_BYTES)) is not None
    except OSError:
        return False


def list_id(urls: Iterable[str], shards: Iterable[ShardInfo] | None = None) -> str:
    """A short fingerprint of a list: the same URLs in the same order give the same id (and,
    given ``shards``, the same facts of each: then the id differs from the URLs' alone). That of
    :class:`Urls` alone is worked out once (a million URLs take a tenth of a second)."""
    if isinstance(urls, Urls) and shards is None and urls._id is not None:
        return urls._id
    h = hashlib.sha256()
    if isinstance(urls, Urls):
        text = urls.text()  # each URL and "\n", as below: hashed in slices, not copied whole
        for at in range(0, len(text), _HASHED):
            h.update(text[at : at + _HASHED].encode("utf-8", "surrogateescape"))
        if shards is None:
            urls._id = h.hexdigest()[:16]
            return urls._id
    else:
        for url in urls:
            h.update(url.encode("utf-8", "surrogateescape"))
            h.update(b"\n")
    if shards is not None:
        h.update(b"\0shards\n")
        described = (
            shards.described()
            if isinstance(shards, ShardFacts)
            else (f"{info.nsamples} {info.filesize} {info.md5}\n" for info in shards)
        )
        for lines in _batched(iter(described)):
            h.update("".join(lines).encode())
    return h.hexdigest()[:16]


def _batched(items: Iterator[str], n: int = 4096) -> Iterator[tuple[str, ...]]:
    while batch := tuple(itertools.islice(items, n)):
        yield batch


def diff_urls(old: UrlList, new: UrlList) -> tuple[list[str], list[str]]:
    """Return ``(added, removed)``: URLs only in ``new`` and only in ``old``, each in list order.

    The URLs both lists start and end with are found by comparing their texts, so an edit of a
    long list costs (in time and memory) about what it changed. What differs is taken a slice at
    a time: a thread working it out (the agent's list reader) holds the interpreter's lock only
    for a slice's worth at once, so that the thread serving requests meanwhile is not held up."""
    a, b = old.urls, new.urls
    if a == b:
        return [], []
    x, y = a.text(), b.text()
    head = a.leading(_common_prefix(x, y))
    tail = min(a.trailing(_common_suffix(x, y)), min(len(a), len(b)) - head)
    old_mid, new_mid = range(head, len(a) - tail), range(head, len(b) - tail)
    old_set, new_set = _set_of(a, old_mid), _set_of(b, new_mid)
    return _not_in(b, new_mid, old_set), _not_in(a, old_mid, new_set)


_COMPARED = 1 << 16  # characters of two lists' texts compared at once
_SLICE = 1 << 14  # URLs of a list taken at once by diff_urls (a few ms of work)


def _slices(urls: Urls, at: range) -> Iterator[tuple[str, ...]]:
    """The URLs of ``urls`` at positions ``at``, :data:`_SLICE` of them at a time."""
    for start in range(at.start, at.stop, _SLICE):
        yield urls[start : min(at.stop, start + _SLICE)]


def _set_of(urls: Urls, at: range) -> set[str]:
    out: set[str] = set()
    for part in _slices(urls, at):
        out.update(part)
    return out


def _not_in(urls: Urls, at: range, other: set[str]) -> list[str]:
    """The URLs of ``urls`` at positions ``at`` that ``other`` does not hold, in order."""
    out: list[str] = []
    for part in _slices(urls, at):
        out.extend(url for url in part if url not in other)
    return out


def _common_prefix(x: str, y: str) -> int:
    """How many characters ``x`` and ``y`` start with alike."""
    n, at = min(len(x), len(y)), 0
    while at < n and x[at : at + _COMPARED] == y[at : at + _COMPARED]:
        at += _COMPARED
    return min(n, at + len(os.path.commonprefix([x[at : at + _COMPARED], y[at : at + _COMPARED]])))


def _common_suffix(x: str, y: str) -> int:
    """How many characters ``x`` and ``y`` end with alike."""
    return _common_prefix(x[::-1], y[::-1]) if len(x) + len(y) <= 2 * _COMPARED else _long_suffix(x, y)


def _long_suffix(x: str, y: str) -> int:
    n, at = min(len(x), len(y)), 0
    while at + _COMPARED <= n and x[len(x) - at - _COMPARED : len(x) - at] == y[len(y) - at - _COMPARED : len(y) - at]:
        at += _COMPARED
    rest = min(_COMPARED, n - at)
    return at + _common_prefix(x[len(x) - at - rest : len(x) - at][::-1], y[len(y) - at - rest : len(y) - at][::-1])


def _literal(url: str) -> str:
    """``url`` as a list line that :func:`expand_braces` gives back whole, and an ``s3://`` key's
    glob characters escaped so that the line names that one object."""
    if url.startswith("s3://"):
        url = literal_entry(url)
    if "{" not in url and "}" not in url:
        return url  # (taken as it is)
    return url.replace("\\", "\\\\").replace("{", "\\{").replace("}", "\\}")


def format_url_list(urls: Iterable[str]) -> str:
    """Write URLs one per line, escaping braces (and an ``s3://`` key's glob characters), so that
    parse_url_list reads them back. Raises
    ConfigError for one it cannot write so (an S3 key whose " #" a list reads as a comment's start)."""
    text = "".join(_literal(url) + "\n" for url in urls)
    cut = _COMMENT_START.search(text)  # one scan of the text (no URL begins with "#" after its "\n")
    if cut is not None:
        line = text[text.rfind("\n", 0, cut.start()) + 1 : text.find("\n", cut.start())]
        raise ConfigError(
            f'{line!r} cannot go in a URL list, where a line\'s " #" starts a comment: '
            "fetch it through a running agent whose own list names its prefix"
        )
    return text
