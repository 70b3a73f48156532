"""WebDataset's shard index (wids): a JSON file naming each shard with its size and sample count.

The format, as webdataset's ``wids`` reads and writes it::

    {"__kind__": "wids-shard-index-v1", "wids_version": 1,
     "shardlist": [{"url": "train-000000.tar", "nsamples": 1000, "filesize": 104857600,
                    "md5sum": "9e107d9d372bb6826bd81d3542a419d6"}, ...]}

``url`` and ``nsamples`` are required (as in wids); ``filesize`` and ``md5sum`` are optional.
``nsamples`` must fit the shard: at most one sample per 512-byte tar block of ``filesize`` (not
checked for a ``.gz``/``.tgz`` URL, whose size is of compressed bytes), and never more than a
4 TiB shard could hold; a count beyond that is an error in the index, not an epoch that long.
A relative ``url`` names a shard relative to the index file's folder, as wids resolves it
(the resolution itself is :func:`wdscache.shared.urls.read_url_list`'s). Other keys (``name``,
``info``, ``base``) are ignored, as wids ignores ``base`` at the top level; sub-datasets
(``datasets``) are refused rather than silently dropped.

:func:`parse_shard_index` checks every entry and names the file and the entry in its error;
:func:`write_shard_index` publishes one atomically; :func:`file_facts`, :func:`count_samples` and
:meth:`ShardInfo.mismatch` are what a download is verified with.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, cast

import msgspec

from .errors import ShardIndexError
from .layout import write_atomic
from .samples import scan
from .tarwalk import FileSpan

__all__ = [
    "KIND",
    "ShardFacts",
    "ShardInfo",
    "count_samples",
    "file_facts",
    "format_shard_index",
    "looks_like_index",
    "parse_shard_entries",
    "parse_shard_index",
    "quick_shard_index",
    "read_shard_index",
    "write_shard_index",
]

KIND = "wids-shard-index-v1"
WIDS_VERSION = 1
_MD5 = re.compile(r"[0-9a-fA-F]{32}")
_READ = 1 << 20  # bytes hashed per read
_STARTS_LIKE_JSON = re.compile(r'\s*(\{(\s|"|\}|$)|\[(\s|"|\{|\[|\]|$))')
MIN_SAMPLE_BYTES = 512  # a sample's least bytes in a tar: one member's header (an empty member has no data block)
MAX_SHARD_BYTES = 1 << 42  # 4 TiB: more than any shard; bounds "nsamples" when no "filesize" does
MAX_SAMPLES = MAX_SHARD_BYTES // MIN_SAMPLE_BYTES
# Any shard may be gzip'd (it is told by its bytes, whatever its name): its "filesize" is then of its
# compressed bytes, which deflate makes at most 1032 times fewer (a sample of zeros comes close).
DEFLATE_MOST = 1032
_MAX_WHOLE = (1 << 63) - 1  # what an array of shards' sizes holds
_MD5_SLOT = 17  # bytes of a shard's MD5 in ShardFacts: given or not, and the digest


@dataclass(frozen=True)
class ShardInfo:
    """What an index says of one shard: its samples, and its size and MD5 when it gives them.
    ``nsamples`` is None only in a mixture's list, for a shard of a source given without an index."""

    nsamples: int | None
    filesize: int | None = None
    md5: str | None = None  # lowercase hex

    def mismatch(self, size: int, md5: str | None) -> str | None:
        """Why a copy of ``size`` bytes and digest ``md5`` is not this shard (None: it is)."""
        if self.filesize is not None and size != self.filesize:
            return f"size {size} bytes, but the shard index says {self.filesize}"
        if self.md5 is not None and md5 is not None and md5 != self.md5:
            return f"MD5 {md5}, but the shard index says {self.md5}"
        return None

    def count_mismatch(self, samples: int) -> str | None:
        """Why a tar of ``samples`` samples is not this shard (None: it is, or no count is given)."""
        if self.nsamples is not None and samples != self.nsamples:
            return f"{samples} samples, but the shard index says {self.nsamples}"
        return None

    def to_wire(self) -> list[Any]:
        """``[nsamples, filesize, md5]`` (None for what the index does not give): a put_urls page's entry."""
        return [self.nsamples, self.filesize, self.md5]

    @classmethod
    def from_wire(cls, value: Any) -> ShardInfo:
        """The inverse of :meth:`to_wire`; ValueError for anything else."""
        if not (isinstance(value, list) and len(value) == 3):
            raise ValueError("a shard's facts are [nsamples, filesize, md5]")
        if value == [None, None, None]:  # a mixture's shard from a source without an index
            return UNKNOWN
        return _info(*value)


class ShardFacts(Sequence[ShardInfo]):
    """What an index says of each shard of a list, by position, held as arrays (a :class:`ShardInfo`
    is made on access): about 33 bytes a shard with MD5s, 16 without, rather than an object each."""

    __slots__ = ("_nsamples", "_filesizes", "_md5s")

    def __init__(self, infos: Iterable[ShardInfo] = ()) -> None:
        self._nsamples = array("q")
        self._filesizes = array("q")  # -1: not given
        self._md5s: bytearray | None = None  # per shard: 1 and the digest, or 17 zeros (not given); None: no MD5 at all
        for info in infos:
            self.append(info)

    @classmethod
    def of_columns(cls, nsamples: array, filesizes: array, md5s: Sequence[tuple[int, str]] = ()) -> ShardFacts:
        """The facts of shards whose checked counts and sizes (-1: not given) are ``nsamples`` and
        ``filesizes`` (taken, not copied), and whose MD5s are ``md5s`` (position, lowercase hex)."""
        made = cls()
        made._nsamples, made._filesizes = nsamples, filesizes
        if md5s:
            made._md5s = bytearray(_MD5_SLOT * len(nsamples))
            for at, md5 in md5s:
                made._md5s[_MD5_SLOT * at : _MD5_SLOT * (at + 1)] = b"\1" + bytes.fromhex(md5)
        return made

    def append(self, info: ShardInfo) -> None:
        self.add(info.nsamples, info.filesize, info.md5)

    def add(self, nsamples: int | None, filesize: int | None, md5: str | None) -> None:
        """Append a shard's checked facts (see :func:`_info`)."""
        if md5 is not None and self._md5s is None:
            self._md5s = bytearray(_MD5_SLOT * len(self._nsamples))
        self._nsamples.append(-1 if nsamples is None else nsamples)
        self._filesizes.append(-1 if filesize is None else filesize)
        if self._md5s is not None:
            self._md5s += b"\1" + bytes.fromhex(md5) if md5 is not None else bytes(_MD5_SLOT)

    def __len__(self) -> int:
        return len(self._nsamples)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        nsamples = self._nsamples[i]  # IndexError past the end, as a tuple's
        i = operator.index(i) % len(self)
        filesize = self._filesizes[i]
        md5s, at = self._md5s, _MD5_SLOT * i
        md5 = md5s[at + 1 : at + _MD5_SLOT].hex() if md5s is not None and md5s[at] else None
        return ShardInfo(None if nsamples < 0 else nsamples, None if filesize < 0 else filesize, md5)

    def described(self) -> Iterator[str]:
        """``"nsamples filesize md5\\n"`` of each shard (``None`` for what is not given), as a list's
        fingerprint covers them (:func:`wdscache.shared.urls.list_id`)."""
        md5s = self._md5s
        for i, (nsamples, filesize) in enumerate(zip(self._nsamples, self._filesizes)):
            md5 = (
                md5s[_MD5_SLOT * i + 1 : _MD5_SLOT * (i + 1)].hex()
                if md5s is not None and md5s[_MD5_SLOT * i]
                else None
            )
            yield f"{nsamples if nsamples >= 0 else None} {filesize if filesize >= 0 else None} {md5}\n"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardFacts):  # (MD5s are held only once one is given)
            return (
                self._nsamples == other._nsamples and self._filesizes == other._filesizes and self._md5s == other._md5s
            )
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._nsamples.tobytes(), self._filesizes.tobytes()))

    def __repr__(self) -> str:
        return f"ShardFacts({list(self[:3])}{'...' if len(self) > 3 else ''}, {len(self)} shards)"


def _shown(value: Any) -> str:
    """``value`` as an index file spells it (JSON), or its repr when JSON has no spelling for it
    (a shard list given as Python objects may hold anything)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _whole(value: Any, name: str) -> int:
    """``value`` as an int: an integer of any type (numpy's, as pandas gives them) but a bool."""
    try:
        whole = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        whole = None
    if whole is None or whole < 0:
        raise ValueError(f'"{name}" must be a whole number >= 0, not {_shown(value)}')
    if whole > _MAX_WHOLE:
        raise ValueError(f'"{name}" is {whole}, more than any shard holds')
    return whole


#: A shard nothing is known of: in a mixture's list, one of a source given without an index.
UNKNOWN = ShardInfo(None)


def _info(nsamples: Any, filesize: Any, md5: Any) -> ShardInfo:
    if md5 is not None and not (isinstance(md5, str) and _MD5.fullmatch(md5)):
        raise ValueError(f'"md5sum" must be 32 hexadecimal digits, not {_shown(md5)}')
    return ShardInfo(
        _whole(nsamples, "nsamples"),
        None if filesize is None else _whole(filesize, "filesize"),
        md5.lower() if md5 is not None else None,
    )


def looks_like_index(text: str) -> bool:
    """Whether ``text`` is meant as a shard index rather than a URL list: it starts like JSON.

    That is: its first character other than white space is ``{`` or ``[`` followed by white space,
    a quote, a bracket or the end (``{"shardlist": ...``, ``[{...``). A URL list line may start
    with ``{`` too, as a brace pattern (``{train,val}-{0..9}.tar``), but never with one of
    those: no URL holds white space or a quote. So a truncated or otherwise malformed index is
    still read as one, and its error says where its JSON breaks.
    """
    return _STARTS_LIKE_JSON.match(text) is not None


def _samples_problem(info: ShardInfo) -> str | None:
    """Why ``info.nsamples`` cannot be the count of the shard ``info`` describes (None: it can be, or none is given)."""
    if info.nsamples is None:
        return None
    if info.nsamples > MAX_SAMPLES:
        return (
            f'"nsamples" is {info.nsamples}, more than any shard holds (at most {MAX_SAMPLES}: '
            f"{MIN_SAMPLE_BYTES} bytes a sample in a shard of {MAX_SHARD_BYTES >> 40} TiB)"
        )
    if info.filesize is None:
        return None
    most = info.filesize * DEFLATE_MOST // MIN_SAMPLE_BYTES
    if info.nsamples > most:
        return (
            f'"nsamples" is {info.nsamples}, but a shard of {info.filesize} bytes ("filesize") holds at most '
            f"{most} samples ({MIN_SAMPLE_BYTES} bytes of tar each at the least, gzip'd {DEFLATE_MOST} times "
            "smaller at the most)"
        )
    return None


def read_shard_index(text: str, *, path: str) -> tuple[list[str], ShardFacts]:
    """The entries of a shard index, as :func:`parse_shard_index` gives them: each ``url`` as
    written, and their facts, held compactly (as arrays, not an object each).
    Raises :class:`ShardIndexError` as :func:`parse_shard_index` does."""
    taken = _take_entries(text)
    if taken is not None:
        return taken
    entries = parse_shard_index(text, path=path)  # raises the error that says what is wrong, and where
    return [url for url, _ in entries], ShardFacts(info for _, info in entries)


class _Entry(msgspec.Struct, gc=False):
    """An entry as :func:`_take_entries` decodes it: each value of the type and within the bounds
    the parse takes (else the quick read gives way to the parse), other keys skipped."""

    url: Annotated[str, msgspec.Meta(min_length=1)]
    nsamples: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAMPLES)]
    filesize: Annotated[int, msgspec.Meta(ge=0, le=_MAX_WHOLE)] | None = None
    md5sum: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{32}\Z")] | None = None


class _Index(msgspec.Struct, gc=False):
    """An index as :func:`_take_entries` decodes it: its entries, and the fields it is checked by."""

    shardlist: list[_Entry]
    kind: Any = msgspec.field(default=KIND, name="__kind__")
    wids_version: Any = WIDS_VERSION
    datasets: Any = msgspec.UNSET  # (refused by the parse whatever its value, null too)


_DECODER = msgspec.json.Decoder(_Index)
_URL, _NSAMPLES = operator.attrgetter("url"), operator.attrgetter("nsamples")
_FILESIZE, _MD5SUM = operator.attrgetter("filesize"), operator.attrgetter("md5sum")


def quick_shard_index(data: bytes) -> tuple[list[str], ShardFacts] | None:
    """:func:`read_shard_index` of the bytes of an index, without their text, when it is ASCII
    and well formed in every way; else None (then read its text). (msgspec does not check the
    UTF-8 of the strings it skips, which the text's decoding refuses: ASCII has none to check.)"""
    return _take_entries(data) if data.isascii() else None


def _take_entries(text: str | bytes) -> tuple[list[str], ShardFacts] | None:
    """:func:`read_shard_index` of an index that is well formed in every way, else None.

    msgspec decodes the index into typed records in C (a third of the time the standard
    library's parser takes, with Python called for each entry), the entries are checked a
    column at a time (:func:`_well_formed`), and anything else (a value of another type, a JSON
    spelling msgspec refuses such as ``NaN`` or a lone surrogate) gives way to the parse, which
    takes what it takes and says what is wrong. What msgspec takes the standard library's parser
    takes alike: the same JSON grammar, the last of a repeated key, the same strings.
    """
    try:
        index = _DECODER.decode(text)
    # (a lone surrogate: msgspec reads the text as UTF-8; nesting deeper than it goes: RecursionError)
    except (msgspec.MsgspecError, UnicodeEncodeError, RecursionError):
        return None
    if index.kind != KIND or index.wids_version != WIDS_VERSION or index.datasets is not msgspec.UNSET:
        return None
    shards = index.shardlist
    del index
    urls = list(map(_URL, shards))
    columns = _well_formed(urls, list(map(_NSAMPLES, shards)), list(map(_FILESIZE, shards)), list(map(_MD5SUM, shards)))
    if columns is None:
        return None
    return urls, ShardFacts.of_columns(*columns)


def _well_formed(
    urls: list[str], nsamples: list[int], filesizes: list[int | None], md5s: list[str | None]
) -> tuple[array, array, list[tuple[int, str]]] | None:
    """The facts' columns (see :meth:`ShardFacts.of_columns`) of entries whose every value
    :func:`parse_shard_index` takes as it is (each as :class:`_Entry` bounds it), else None: each
    URL with something other than white space, each ``filesize`` given large enough for its
    ``nsamples``."""
    if not urls:
        return array("q"), array("q"), []
    if any(map(str.isspace, urls)):
        return None
    given: list[int] = (
        cast("list[int]", filesizes) if None not in filesizes else [size for size in filesizes if size is not None]
    )
    # Enough room for the most samples in the smallest shard: then every entry has it.
    if given and max(nsamples) > min(given) * DEFLATE_MOST // MIN_SAMPLE_BYTES:
        for count, size in zip(nsamples, filesizes):
            if size is not None and count > size * DEFLATE_MOST // MIN_SAMPLE_BYTES:
                return None
    named = [] if md5s.count(None) == len(md5s) else [(at, md5) for at, md5 in enumerate(md5s) if md5 is not None]
    sizes = array("q", given) if given is filesizes else array("q", [-1 if s is None else s for s in filesizes])
    return array("q", nsamples), sizes, [(at, md5.lower()) for at, md5 in named]


def parse_shard_index(text: str, *, path: str) -> list[tuple[str, ShardInfo]]:
    """The entries of a shard index, in file order: each ``url`` as written, with its facts.

    Raises :class:`ShardIndexError` naming ``path`` (and the entry at fault) for text that is
    not JSON, another kind of file, or an entry without a usable ``url`` or ``nsamples``.
    """
    return [(entry["url"], info) for entry, info in parse_shard_entries(text, path=path)[1]]


def parse_shard_entries(
    text: str, *, path: str, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], ShardInfo]]]:
    """:func:`parse_shard_index`, each entry given as its whole JSON object (every key as
    written, such as wids' ``dataset``) rather than its ``url``; and first the index's own
    fields but its ``shardlist`` (wids' ``name`` and ``weight``, say). ``overrides`` replace the
    index's own fields before they are read, as wids' ``options=`` do."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShardIndexError(
            path,
            None,
            f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg} "
            "(a file starting like JSON is read as a shard index, wids JSON)",
        ) from None
    except (ValueError, RecursionError) as exc:  # nested too deep for the parser
        raise ShardIndexError(path, None, f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ShardIndexError(path, None, 'a shard index is a JSON object with a "shardlist"')
    doc.update(overrides or {})
    kind, version = doc.get("__kind__", KIND), doc.get("wids_version", WIDS_VERSION)
    if kind != KIND:
        raise ShardIndexError(path, None, f'"__kind__" is {json.dumps(kind)}; wdscache reads {KIND!r}')
    if version != WIDS_VERSION:
        raise ShardIndexError(path, None, f'"wids_version" is {json.dumps(version)}; wdscache reads version 1')
    if "datasets" in doc:
        raise ShardIndexError(
            path, None, 'sub-datasets ("datasets") are not supported: list every shard in "shardlist"'
        )
    shards = doc.get("shardlist")
    if not isinstance(shards, list):
        raise ShardIndexError(
            path,
            None,
            'no "shardlist" list: a shard index lists its shards in "shardlist": [{"url": ..., "nsamples": ...}, ...]',
        )
    entries = []
    for i, entry in enumerate(shards):
        url = entry.get("url") if isinstance(entry, dict) else None
        try:
            if not isinstance(entry, dict):
                raise ValueError('an entry is an object {"url": ..., "nsamples": ..., "filesize": ...}')
            if not isinstance(url, str) or not url.strip():
                raise ValueError('"url" must be a non-empty string')
            if "nsamples" not in entry:
                raise ValueError('"nsamples" is missing')
            info = _info(entry["nsamples"], entry.get("filesize"), entry.get("md5sum"))
            problem = _samples_problem(info)
            if problem is not None:
                raise ValueError(problem)
            entries.append((entry, info))
        except ValueError as exc:
            raise ShardIndexError(path, i, str(exc), url=url if isinstance(url, str) else None) from None
    return {k: v for k, v in doc.items() if k != "shardlist"}, entries


def format_shard_index(entries: Iterable[tuple[str, ShardInfo]]) -> str:
    """The JSON text of an index of ``entries`` (one shard a line), as wids writes its fields."""
    lines = []
    for url, info in entries:
        item: dict[str, Any] = {"url": url, "nsamples": info.nsamples}
        if info.filesize is not None:
            item["filesize"] = info.filesize
        if info.md5 is not None:
            item["md5sum"] = info.md5
        lines.append("    " + json.dumps(item))
    body = ",\n".join(lines)
    return (
        f'{{\n  "__kind__": "{KIND}",\n  "wids_version": {WIDS_VERSION},\n  "shardlist": [\n{body}\n  ]\n}}\n'
        if lines
        else f'{{"__kind__": "{KIND}", "wids_version": {WIDS_VERSION}, "shardlist": []}}\n'
    )


def write_shard_index(path: Path, entries: Iterable[tuple[str, ShardInfo]]) -> None:
    """Publish the index of ``entries`` at ``path`` atomically (:func:`~wdscache.shared.layout.write_atomic`,
    as readable as the umask lets a new file be): a reader sees the old file or the new one."""
    write_atomic(path, format_shard_index(entries).encode(), mode=0o666)


def file_facts(path: str | os.PathLike[str], *, md5: bool) -> tuple[int, str | None]:
    """The size of the file at ``path`` and, with ``md5``, its MD5 (lowercase hex), in one read."""
    if not md5:
        return os.stat(path).st_size, None
    digest = hashlib.md5(usedforsecurity=False)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def count_samples(path: str | os.PathLike[str], *, url: str) -> int:
    """The samples of the plain tar at ``path``, grouped as the agent and webdataset group them
    (a walk of its headers only); ShardError, naming ``url``, if it is damaged."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return len(scan(FileSpan(fd, 0, os.fstat(fd).st_size), url=url))
    finally:
        os.close(fd)
