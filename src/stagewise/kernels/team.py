"""The kernel team (csrc/team.c): one set of threads per process that every kernel library splits
its work over, awake (spinning, yielding to any other runnable thread) through a step and asleep
between steps, so a parallel kernel call costs a cache line instead of a thread's wake-up.

`start(threads, cpus)` starts it once per process (the stage's thread count: runtime/cpu_pool.py);
`hand_to(lib, prefix)` gives a kernel library the team's entry point at load. Until a team starts,
or where the library cannot be built, the kernels split their work over OpenMP as before.
"""
from __future__ import annotations

import ctypes
import functools

from . import build

SOURCES = ("threads.c", "team.c")        # one library with the keepers (runtime/cpu_pool.py)


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = build.library("threads", list(SOURCES))
    if lib is not None:
        lib.sw_keepers_awake.argtypes = [ctypes.c_int, ctypes.c_longlong]
        lib.sw_keepers_awake.restype = None
        lib.sw_keepers_start.restype = lib.sw_pin_team.restype = ctypes.c_int
        lib.sw_team_start.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.sw_team_start.restype = lib.sw_team_size.restype = ctypes.c_int
        lib.sw_team_late_jobs.restype = ctypes.c_longlong
    return lib


def start(threads: int, cpus: list[int] | tuple[int, ...] = ()) -> int:
    """Start this process's team of `threads` (the caller is one; its workers may run on `cpus`,
    anywhere when empty). Returns the team's size (the first start's), 0 where there is none."""
    lib = library()
    if lib is None or threads < 2:
        return size()
    array = (ctypes.c_int * max(len(cpus), 1))(*cpus)
    return max(lib.sw_team_start(threads, array, len(cpus)), 0)


def size() -> int:
    lib = library()
    return lib.sw_team_size() if lib is not None else 0


def late_jobs() -> int:
    """Jobs so far whose worker was descheduled (each made the team run on its caller alone for a
    while: on a busy machine a step costs no more than one thread's)."""
    lib = library()
    return lib.sw_team_late_jobs() if lib is not None else 0


def hand_to(lib: ctypes.CDLL, prefix: str) -> None:
    """Give a kernel library (which declares `<prefix>_set_team`) the team's entry point."""
    team = library()
    if team is not None:
        setter = getattr(lib, f"{prefix}_set_team")
        setter.argtypes, setter.restype = [ctypes.c_void_p], None
        setter(ctypes.cast(team.sw_team_for, ctypes.c_void_p))
