"""WebDataset samples: how tar members become samples, exactly as WebDataset makes them.

Samples are found the way WebDataset 1.0.2 finds them (``tar_file_iterator``
over Python's :mod:`tarfile`, then ``group_by_keys``), so that a training job
sees the same keys and fields whether it reads through wdscache or not:

- Members named like ``__meta__`` are skipped (:func:`is_meta_name`), as are
  names without an extension (:func:`split_name` gives None).
- The key is the name up to the first dot of its basename, the extension the
  rest, lower-cased (WebDataset's default ``lcase=True``).
- Consecutive members with the same key form one sample; an extension repeated
  within a sample (or one named ``__key__`` or ``__url__``) is a
  :class:`~wdscache.shared.errors.ShardError`, as WebDataset reports it.

Trusts the members the header walk (:mod:`wdscache.shared.tarwalk`) gives, which has
checked every header; names may hold any bytes (newlines, non-UTF-8) and are
matched as WebDataset's patterns match them.  Holds no state: safe in any thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ShardError
from .tarwalk import BLOCK, Buffer, walk

Sample = dict[str, Any]  # "__key__" and "__url__" -> str, extension -> payload

# A member with one of these extensions would overwrite the sample's metadata;
# WebDataset reports it as a duplicate.
_RESERVED_EXTS = frozenset(("__key__", "__url__"))


@dataclass(frozen=True, slots=True)
class SampleSpan:
    """Where one sample's fields lie: ``(extension, offset, size)`` in archive order."""

    key: str
    fields: tuple[tuple[str, int, int], ...]


def split_name(name: str) -> tuple[str, str] | None:
    """WebDataset's ``(key, extension)`` of a member name, or None when it has no extension.

    The extension starts at the first dot of the basename.  Matches
    ``webdataset.tariterators.base_plus_ext`` exactly, corner cases included:
    ``a/.b`` gives key ``a/`` (the key may run back over a slash when the
    basename starts with a dot), and a directory part holding a newline counts
    as if the key started at the name's beginning.
    """
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= 0:
        return None
    # The key must end in a dot-free run of at least one character that starts
    # at the name's beginning or just after a slash; WebDataset's pattern can
    # only start that run after a slash when no newline comes before it.
    newline = name.find("\n")
    limit = dot - 1 if newline < 0 else min(dot - 1, newline)
    start = name.rfind("/", 0, limit) + 1
    if name.find(".", start, dot) >= 0:
        return None
    return name[:dot], name[dot + 1 :]


def is_meta_name(name: str) -> bool:
    """True for names WebDataset skips as metadata: a first component ``__like_this__``.

    That is ``__x__`` alone or as the leading folder (``__x__/y.json``), or a
    slash-free name that merely starts and ends with ``__`` (``___`` too).
    ``__x__.json`` is *not* skipped: it is the sample ``__x__``.
    """
    first, slash, _ = name.partition("/")
    if not first.startswith("__"):
        return False
    if slash:
        return len(first) >= 4 and first.endswith("__")
    # The pattern's "$" also matches before a final newline.
    return first.endswith("__") or (len(first) >= 5 and first.endswith("__\n"))


def scan(buf: Buffer, *, url: str) -> list[SampleSpan]:
    """The samples of the uncompressed tar ``buf``, grouped by WebDataset's rules.

    Reads headers only: payloads are located, never copied, and nothing is
    allocated from a declared size.  ``buf`` is any bytes-like object with byte
    items (an mmap of a shard, or decompressed bytes); ``url`` names the shard
    in errors.  Raises :class:`ShardError` for a damaged or unreadable shard.
    """
    return [span for span, _ in group_samples(walk(buf, url), url)]


def group_samples(
    files: Iterator[tuple[str, int, int, int]], url: str, base: int = 0
) -> Iterator[tuple[SampleSpan, int]]:
    """The samples of a :func:`~wdscache.shared.tarwalk.walk`'s regular ``files``, each with the
    header offset of its first member; offsets shifted by ``base``."""
    key: str | None = None
    fields: list[tuple[str, int, int]] = []
    seen: set[str] = set()
    first_at = 0
    for name, offset, size, at in files:
        slash = name.rfind("/")
        dot = name.find(".", slash + 1)
        if dot > slash + 1 and name[:2] != "__" and "\n" not in name:
            # The common name, "dir/key.ext": what split_name gives, without its corner cases.
            member_key, ext = name[:dot], name[dot + 1 :].lower()
        else:
            split = None if is_meta_name(name) else split_name(name)
            if split is None:
                continue
            member_key, ext = split[0], split[1].lower()
        if member_key != key:
            if key is not None:
                yield SampleSpan(key, tuple(fields)), first_at
            key, fields, seen, first_at = member_key, [], set(), base + at
        if ext in seen or ext in _RESERVED_EXTS:
            raise ShardError(
                url,
                f"member {name!r}: extension {ext!r} repeated in sample {key!r}",
                offset=base + offset - BLOCK,
            )
        seen.add(ext)
        fields.append((ext, base + offset, size))
    if key is not None:
        yield SampleSpan(key, tuple(fields)), first_at
