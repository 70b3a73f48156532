"""Keeping the C allocator from handing received sample memory back to the kernel.

Each streamed reply from a worker is a message of up to ``request_size`` samples
(a few MB of images), which libzmq receives into memory it ``malloc``s, and the loader
copies each payload out into a ``bytes``. glibc serves such sizes from fresh
``mmap``s or trims them off the heap as soon as they are freed, so the next
message faults every page in again: measured on 110 KB images, a consumer spent
two thirds of its CPU in the kernel, zeroing and mapping pages (about 100,000
page faults per GB). Raising the two thresholds below makes freed message memory
stay in the process for the next one: no page faults, and the consumer's CPU per
GB fell by a third. Payloads read straight from the cache files (direct reads,
the default) are such fresh blocks too: there the consumer's CPU per GB halves.

The cost: blocks below :data:`MMAP_THRESHOLD` come from the heaps, and freed
memory goes back to the kernel only when more than :data:`TRIM_THRESHOLD` of it
lies free at the top of a heap (per allocator arena); freed blocks in the middle
of a heap stay in the process for reuse, as for any heap allocation. Fixing the
thresholds also turns off glibc's own adjustment of them. The settings are
process-wide, so :class:`~wdscache.CachedMultiLoader` applies them only with
``tune_malloc=True`` (the default), once, and only where the C library is glibc.
The agent's workers apply them too (they own their process): a reply whose short
runs are copied together is a buffer of up to 8 MiB, made and freed per reply.
"""

from __future__ import annotations

import ctypes

from .logs import get_logger

log = get_logger(__name__)

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks above it are mmap'd (and unmapped on free)
TRIM_THRESHOLD = 32 << 20  # free memory at a heap's top kept for the next message

_tuned = False


def tune_malloc() -> bool:
    """Apply the thresholds above to this process, once; True if they are in effect."""
    global _tuned
    if _tuned:
        return True
    try:
        libc = ctypes.CDLL(None)
        _ = libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt means something else
        mallopt = libc.mallopt
    except Exception:  # not glibc, or no C library to load this way (Windows)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _tuned:
        log.debug("mallopt refused the thresholds; received messages will page-fault as before")
    return _tuned


def release_freed() -> None:
    """Hand the memory this process freed back to the kernel, where glibc holds it (a no-op
    elsewhere): after a large transient, such as parsing a long URL list, freed blocks between
    live ones would otherwise stay in the process, and each later parse would leave more."""
    try:
        libc = ctypes.CDLL(None)
        _ = libc.gnu_get_libc_version  # glibc only
        trim = libc.malloc_trim
    except Exception:
        return
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
