"""Keep freed activation memory in the process (glibc malloc settings, once per stage process).

glibc hands blocks above its mmap threshold straight back to the kernel on free and trims the
heap top, so every large temporary (a [512, 1536] activation is 3 MiB) comes back as fresh pages
that fault on first touch: an RMSNorm over 512x576 fp32 takes ~1 ms instead of ~0.1 ms. Raising
both thresholds keeps those pages mapped for the next step (vLLM gets the same by preloading
tcmalloc). A no-op where the C library is not glibc.

Raised while the weights load, they would also keep what loading freed (file bytes read, unpacking
temporaries: ~40 MiB for the default model), and so would glibc's defaults, whose thresholds grow
with the first large block freed (a 30 MiB embedding). So a stage loads under low fixed thresholds
(`return_freed_memory`), hands back the free heap pages once its weights are in place
(`release_load_temporaries`), and only then raises them (runtime/setup.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("stagewise.runtime")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20      # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD_BYTES = 512 << 20     # freed memory a process may keep before trimming
LOAD_MMAP_THRESHOLD_BYTES = 256 << 10   # while loading: blocks above this are mapped, and unmapped on free
LOAD_TRIM_THRESHOLD_BYTES = 1 << 20
_done = False


def keep_freed_memory() -> bool:
    """Apply the settings once; True if the C library took them."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                     TRIM_THRESHOLD_BYTES))
    if not _done:
        log.debug("mallopt refused the thresholds; large temporaries keep faulting fresh pages")
    return _done


def return_freed_memory() -> bool:
    """While the weights load: fixed low thresholds (no growth), so what is freed goes back at once.
    False where the C library is not glibc or refused them (or `keep_freed_memory` already ran)."""
    if _done:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                     LOAD_TRIM_THRESHOLD_BYTES))


def release_load_temporaries() -> bool:
    """Hand the free pages of the C heap back to the kernel (glibc's malloc_trim; what step
    temporaries later need faults in once and is kept). True if the C library released any."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
