"""The process's memory allocator: glibc malloc settings that keep freed activation memory (once per
stage process), and tcmalloc for the command line where the machine has it.

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

The command line goes further where the machine has tcmalloc (or jemalloc): it re-executes itself
once with that allocator preloaded (`reexec`). A decode step creates and frees hundreds of small
tensors (each op's output and its handles); under glibc a request of 1 KiB or more first merges the
freed small chunks and the next small requests split them again, up to ~1 ms of the default model's
6-10 ms batch-1 step, which tcmalloc's per-thread caches do not pay (benchmarks/RESULTS.md, "CPU at
the hardware's limit", third round: 16 served clients 6-9% more tokens/s). A preload must be in place
when the process starts, so it happens before torch loads; the processes the command starts (engine
cores, stages) inherit it. `STAGEWISE_MALLOC`: `auto` (the default), `system` (glibc's malloc), or the
path of a library. Python programs (`LLM`) choose their own:
`LD_PRELOAD=libtcmalloc_minimal.so.4 python app.py`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import envs

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
    """Hand the free pages of the C heap back to the kernel (glibc's malloc_trim, or tcmalloc's
    ReleaseFreeMemory where the command line preloaded it; what step temporaries later need faults
    in once and is kept). True if the C library released any (tcmalloc does not say: True)."""
    try:
        process = ctypes.CDLL(None)
        if hasattr(process, "MallocExtension_ReleaseFreeMemory"):      # tcmalloc's C interface
            process.MallocExtension_ReleaseFreeMemory()
            return True
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


# by preference: gperftools' tcmalloc (Debian/Ubuntu libtcmalloc-minimal4, Fedora gperftools-libs), then jemalloc
LIBRARIES = ("tcmalloc_minimal", "tcmalloc", "jemalloc")
KNOWN = ("tcmalloc", "jemalloc", "mimalloc")
# tcmalloc's settings (a user's own win): no report on stderr of each allocation over 1 GiB (a large
# checkpoint's tensors are not news). Its freed pages stay for the next step, as glibc's raised thresholds
# keep them: TCMALLOC_AGGRESSIVE_DECOMMIT=true cut the default model's peak RSS from ~400 to 377 MiB (glibc
# 369) at batch 1, but served 16 clients 10% slower than glibc's malloc (a batch's temporaries faulted in anew
# every step), where without it 9% faster.
TCMALLOC_ENV = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def loaded(maps: str = "/proc/self/maps") -> str | None:
    """The replacement allocator mapped into this process (its file name), None under glibc's malloc."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name = line.rsplit("/", 1)[-1]
        if any(name.startswith(f"lib{k}") for k in KNOWN):
            return name
    return None


def preload_env(environ: Mapping[str, str], find: Callable[[str], str | None] = ctypes.util.find_library
                ) -> dict[str, str] | None:
    """`environ` with the allocator added to LD_PRELOAD, or None where nothing should change:
    STAGEWISE_MALLOC=system, an allocator preloaded already, none found."""
    choice = envs.value_in("STAGEWISE_MALLOC", environ)
    preload = environ.get("LD_PRELOAD", "")
    if choice == "system" or any(k in preload for k in KNOWN):
        return None
    if choice != "auto" and not Path(choice).is_file():
        raise ValueError(f"STAGEWISE_MALLOC names {choice}, which is not a file; give the path of an allocator "
                         "library (e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), auto or system.")
    library = choice if choice != "auto" else next((lib for name in LIBRARIES if (lib := find(name))), None)
    if not library or library in preload.split():
        return None
    return {**TCMALLOC_ENV, **environ, "LD_PRELOAD": f"{library} {preload}".strip()}


def reexec() -> None:
    """Re-execute this command line with the allocator preloaded; returns where nothing changes (see
    `preload_env`, or an allocator mapped already). Call it first, before torch loads."""
    env = preload_env(os.environ)
    if env is not None and loaded() is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def describe() -> str:
    """For the start-up log: the allocator this process runs on."""
    name = loaded()
    if name:
        return f"memory allocator: {name}"
    if envs.STAGEWISE_MALLOC == "system":
        return "memory allocator: glibc malloc (STAGEWISE_MALLOC=system)"
    return ("memory allocator: glibc malloc; with tcmalloc installed (Debian/Ubuntu: apt install "
            "libtcmalloc-minimal4) the command line preloads it: 5-10% faster CPU steps")
