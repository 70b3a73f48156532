"""WebDataset samples: how tar members become samples, exactly as WebDataset makes them.

Samples are found the way WebDataset 1.0.2 finds them (``tar_file_iterator``
over Python's :mod:`tarfile`, then ``group_by_keys``), so that a training job
sees the same keys and fields whether it reads through wdscache or not:

- Members named like ``__meta__`` are skipped (:func:`is_meta_name`), as are
  names without an extension (:func:`split_name` gives None).
- The key is the name up to the first dot of its basename, the extension the
  rest, lower-cased (WebDataset's default ``lcase=True``).
- Consecutive members with the same key form one sample.  A member whose
  extension the sample holds already (``a.jpg`` then ``a.JPG``, or ``a.txt``
  twice), or one named ``__key__`` or ``__url__``, is skipped: the sample keeps
  its first member, as WebDataset keeps it with a handler that goes on
  (``warn_and_continue``); its default handler raises.  A repeat is a property
  of the data, which no download can change, so it is not damage: the first one
  met in a shard is logged (:func:`skipped_member`) once per process.  A sample
  left with no field at all (its only members named ``__key__`` or ``__url__``)
  is no sample: WebDataset would yield its bare ``__key__`` and ``__url__``.

Trusts the members the header walk (:mod:`wdscache.shared.tarwalk`) gives, which has
checked every header; names may hold any bytes (newlines, non-UTF-8) and are
matched as WebDataset's patterns match them.  Safe in any thread: its one state, the
shards whose skipped member was logged, is kept under a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .logs import get_logger
from .tarwalk import Buffer, walk

log = get_logger(__name__)

Sample = dict[str, Any]  # "__key__" and "__url__" -> str, extension -> payload

# A member with one of these extensions would overwrite the sample's metadata;
# WebDataset sees a duplicate, and skips the member as it skips a repeat.
_RESERVED_EXTS = frozenset(("__key__", "__url__"))

# Shards whose skipped member this process logged: a shard is walked again (a download read
# as it grows, a walk resumed, a worker that opens it anew), and one line a shard says enough.
_WARNED_MAX = 4096
_warned: OrderedDict[str, None] = OrderedDict()
_warned_lock = threading.Lock()  # (``wdscache index`` walks shards in several threads)


def skipped_member(url: str, key: str, name: str) -> None:
    """Log the member ``name`` of sample ``key`` of ``url`` as skipped (its field repeated):
    a warning for the first one of a shard in this process (of the latest :data:`_WARNED_MAX`
    shards), nothing for the rest."""
    with _warned_lock:
        if url in _warned:
            _warned.move_to_end(url)
            return
        _warned[url] = None
        if len(_warned) > _WARNED_MAX:
            _warned.popitem(last=False)
    log.warning(
        "%s: sample %r: member %r skipped, its field is the sample's already (the first member kept, as "
        "webdataset keeps it with a handler that goes on); later repeats in this shard are skipped unsaid",
        url,
        key,
        name,
    )


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
    in errors and in the warning of a skipped member (:func:`skipped_member`).  Raises
    :class:`~wdscache.shared.errors.ShardError` for a damaged or unreadable shard.
    """
    return [span for span, _ in group_samples(walk(buf, url), url)]


def group_samples(
    files: Iterator[tuple[str, int, int, int]], url: str, base: int = 0
) -> Iterator[tuple[SampleSpan, int]]:
    """The samples of a :func:`~wdscache.shared.tarwalk.walk`'s regular ``files``, each with the
    header offset of its first member; offsets shifted by ``base``. A member whose field its
    sample holds already is left out (:func:`skipped_member` logs it); a sample left with no
    field is none."""
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
            if fields and key is not None:
                yield SampleSpan(key, tuple(fields)), first_at
            key, fields, seen, first_at = member_key, [], set(), base + at
        if ext in seen or ext in _RESERVED_EXTS:
            skipped_member(url, member_key, name)
            continue
        seen.add(ext)
        fields.append((ext, base + offset, size))
    if fields and key is not None:
        yield SampleSpan(key, tuple(fields)), first_at
