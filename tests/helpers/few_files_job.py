"""A training process with few open files free, in a process of its own (ZeroMQ may abort it):

    python -m tests.helpers.few_files_job CACHE_DIR FREE TIMEOUT

Lowers its limit on open files to LIMIT, imports the loader's modules, then opens ``/dev/null``
until only FREE files are left and reads one epoch of the cache directory's agent with a
``CachedMultiLoader`` (``timeout=TIMEOUT``); prints ``read N``. An error ends it with its
traceback on stderr (exit status 1).
"""

from __future__ import annotations

import os
import resource
import sys

LIMIT = 256


def main() -> None:
    cache, free, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, hard))
    # Imported before the files are taken: an import opens files too, and is not what is tested.
    import wdscache.training.stream  # noqa: F401
    from wdscache import CachedMultiLoader

    loader = CachedMultiLoader(cache_dir=cache, shuffle=False, timeout=timeout)
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(free):
        os.close(held.pop())
    print("read", sum(1 for _ in loader), flush=True)


if __name__ == "__main__":
    main()
