"""Where the ``wdscache`` command is, for the scripts and the tests that start it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def wdscache_exe() -> str:
    """The ``wdscache`` console script of the running interpreter's environment, else on PATH."""
    exe = Path(sys.executable).with_name("wdscache")
    if exe.is_file() and os.access(exe, os.X_OK):
        return str(exe)
    found = shutil.which("wdscache")
    if found is None:
        raise RuntimeError(
            f"no wdscache console script next to {sys.executable} or on PATH; install the package (pip install -e .)"
        )
    return found
