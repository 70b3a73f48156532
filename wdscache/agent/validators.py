"""Versions of a source's object: which validator names one, and whether two are the same.

A shard's version is its ETag, or, from a server that sends none, its Last-Modified date
(for ``file:`` URLs, size and mtime); a server's Last-Modified is kept beside its ETag too.
A resumed answer is continued only when it carries the very validator the partial file's
bytes came with (:meth:`Version.unlike`): so bytes of two versions are never spliced.
Revalidation (:func:`common_validator`) compares the strongest validator both the cached
copy and the source have; an ETag that is an MD5 (:func:`etag_md5`) can name a copy of no
validator by its bytes.
"""

from __future__ import annotations

import email.utils
from dataclasses import dataclass


@dataclass(frozen=True)
class Version:
    """What an answer says of the version it is of."""

    etag: str | None = None
    last_modified: str | None = None
    tag: str | None = None  # a file's size and mtime

    @property
    def validator(self) -> str | None:
        """The validator recorded for it: the ETag, else the Last-Modified date, else a file's tag."""
        return self.etag or self.last_modified or self.tag or None

    def unlike(self, held: str | None) -> str | None:
        """Why this is not version ``held`` (the validator a partial file's bytes came with);
        None when it carries that very validator: the same ETag, or for a date the same
        Last-Modified. An answer without a validator of that kind is not of that version."""
        if not held:
            return "the partial file has no validator"
        if self.validator == held:
            return None
        kind = "ETag" if is_etag(held) else "Last-Modified"
        got = self.etag if kind == "ETag" else self.last_modified
        if got == held:
            return None
        return (
            f"the answer's {kind} is {got}, the partial file's {held}"
            if got
            else f"the answer has no {kind} (the partial file's: {held})"
        )


def common_validator(
    old: str | None, old_date: str | None, new: str | None, new_date: str | None
) -> tuple[str, str, str] | None:
    """The strongest validator a cached copy (validator ``old``, Last-Modified ``old_date``)
    and the source now (``new``, ``new_date``) both have: the ETag, a file's size and mtime,
    else the Last-Modified date, as (kind, the copy's, the source's); the two are one version
    if those are equal. None when they have none in common (the server changed what it
    sends, or sends nothing): they cannot be compared."""
    mine, theirs = _validators(old, old_date), _validators(new, new_date)
    for kind in ("ETag", "size-mtime", "Last-Modified"):
        if kind in mine and kind in theirs:
            return kind, mine[kind], theirs[kind]
    return None


def _validators(tag: str | None, date: str | None) -> dict[str, str]:
    """The validators a version is known by, by kind."""
    known = {validator_kind(tag): tag} if tag else {}
    if date:
        known.setdefault("Last-Modified", date)
    return known


def validator_kind(value: str) -> str:
    """What a validator is, for messages: "ETag", "Last-Modified", or "size-mtime" (a file)."""
    if is_etag(value):
        return "ETag"
    try:
        email.utils.parsedate_to_datetime(value)
        return "Last-Modified"
    except (TypeError, ValueError):
        return "size-mtime"


def etag_md5(tag: str | None) -> str | None:
    """The MD5 (lowercase hex) an ETag of 32 hex digits may be (S3's, and other stores', for an
    object uploaded whole), else None. Not proof by itself: only bytes whose MD5 it equals are
    known to be the object it names."""
    if tag is None or len(tag) != 34 or not (tag[0] == tag[-1] == '"'):
        return None
    digits = tag[1:-1].lower()
    return digits if all(c in "0123456789abcdef" for c in digits) else None


def is_etag(value: str) -> bool:
    return value.startswith(('"', "W/"))


def strong(tag: str | None) -> bool:
    """Whether ``tag`` may name a version in a ranged part's request (a weak ETag never matches ``If-Range``)."""
    return tag is not None and tag != "" and not tag.startswith("W/")
