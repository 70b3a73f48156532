"""Tar reading: recognising tar shards (and, for streaming, reading their samples)."""

from __future__ import annotations

import zlib

BLOCK = 512
GZIP_MAGIC = b"\x1f\x8b"


def header_ok(block: bytes) -> bool:
    """True when ``block`` is a tar header whose checksum matches (or the zero end block)."""
    if len(block) < BLOCK:
        return False
    block = block[:BLOCK]
    if block.count(0) == BLOCK:
        return True
    field = block[148:156].replace(b"\0", b" ").strip()
    try:
        stored = int(field, 8)
    except ValueError:
        return False
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    # Some old writers summed signed bytes; accept either, as tar readers do.
    signed = sum(b - 256 if b > 127 else b for b in block[:148] + b" " * 8 + block[156:])
    return stored in (unsigned, signed)


def tar_problem(head: bytes) -> str | None:
    """Why ``head`` (the first bytes of a file, ideally 64 KiB) is not a tar or gzip'd tar.

    Returns None when it looks right. Used before a download is published, so that
    an HTML error page served with status 200 never enters the cache.
    """
    if head.startswith(GZIP_MAGIC):
        try:
            inner = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, BLOCK)
        except zlib.error as exc:
            return f"gzip data is corrupt ({exc})"
        if len(inner) < BLOCK:
            return "gzip stream too short to hold a tar header"
        return None if header_ok(inner) else "gzip'd data is not a tar archive"
    if len(head) < BLOCK:
        return f"too short for a tar archive ({len(head)} bytes)"
    if header_ok(head):
        return None
    sniff = head[:64].lstrip().lower()
    if sniff.startswith((b"<!doctype html", b"<html", b"<?xml")):
        return "got an HTML/XML page, not a tar archive"
    return "not a tar archive (bad header checksum)"
