"""Another version of a shard: the same size and members, other payload bytes, and a later date."""

from __future__ import annotations

import os
from pathlib import Path

from wdscache.shared.tarwalk import members


def another_version(data: bytes) -> bytes:
    """The tar ``data`` with every payload's bytes inverted: a valid tar of the same size (and
    the same sample keys), so only a validator can tell it from ``data``; no sample is in both."""
    out = bytearray(data)
    for m in members(data, url="another_version"):
        out[m.offset : m.offset + m.size] = bytes(b ^ 0xFF for b in data[m.offset : m.offset + m.size])
    return bytes(out)


def replace(path: Path, data: bytes, *, seconds_later: float = 10.0) -> None:
    """Make ``path`` hold ``data`` (renamed over it), dated ``seconds_later`` than it was: a
    new ETag at the test server and, even within the same second, a new Last-Modified."""
    when = path.stat().st_mtime + seconds_later
    aside = path.with_name(f".{path.name}.new")
    aside.write_bytes(data)
    os.utime(aside, (when, when))
    os.replace(aside, path)
