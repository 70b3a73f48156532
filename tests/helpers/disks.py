"""Disks for tests: a file system filled by another program."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def fill(path: Path) -> int:
    """Write ``path`` until the file system refuses (ENOSPC); returns the bytes written."""
    n = 0
    chunk = b"\xa5" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                n += os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return n
    finally:
        os.close(fd)
