"""A CPU stage's threads at run time (`threads.py` sizes them): OpenMP's team pinned to the
stage's share of the affinity mask, and those CPUs kept awake while a step runs, asleep between
steps (kernels/csrc/threads.c).

Idle OpenMP threads still wait passively (robust when another process wants a core), so what a
step pays per parallel region is the wake-up of a sleeping thread; on a VM whose idle CPUs halt
that is tens of microseconds per region. Keepers at SCHED_IDLE priority spin on the stage's CPUs
within a step only, so a CPU never halts mid-step and yields at once to any thread that wants it
(`STAGEWISE_KEEP_AWAKE=0`: none). Pinning is opt-in (`STAGEWISE_PIN_THREADS=1`): a pinned thread
cannot leave a core another process keeps busy (2.5x slower batch-1 decode on a loaded machine).
"""
from __future__ import annotations

import ctypes
import logging
import os
from contextlib import contextmanager
from typing import Iterable, Iterator

from .. import envs

log = logging.getLogger("stagewise.threads")

MAX_STEP_SPIN_S = 2.0      # a keeper stops spinning after this long even if a step never ended
_pool: list["CpuPool | None"] = [None]     # one per process: OpenMP's team and the keepers are per process


def stage_cpus(affinity: Iterable[int], threads: int, local_index: int = 0, stages: int = 1) -> list[int]:
    """The CPUs for a stage's `threads`: stage `local_index` of the `stages` on this node takes the
    same-sized slice of the affinity mask (so stages never share a core), and its first `threads` CPUs.
    Empty where the mask cannot give every stage its own CPUs (then nothing is pinned)."""
    cpus = sorted(affinity)
    share = len(cpus) // max(stages, 1)
    if share < 1 or threads < 1 or not 0 <= local_index < stages:
        return []
    mine = cpus[local_index * share:(local_index + 1) * share]
    return mine[:threads] if threads <= len(mine) else mine


class CpuPool:
    """The pinned team and the keepers of this process; `step()` scopes one step."""

    def __init__(self, lib, cpus: list[int], pinned: bool, keepers: int):
        self.cpus, self.pinned, self.keepers = cpus, pinned, keepers
        self._awake = lib.sw_keepers_awake if keepers > 0 else None
        self._max_ns = int(MAX_STEP_SPIN_S * 1e9)

    @contextmanager
    def step(self) -> Iterator[None]:
        if self._awake is None:
            yield
            return
        self._awake(1, self._max_ns)
        try:
            yield
        finally:
            self._awake(0, 0)

    def describe(self) -> str:
        where = ",".join(map(str, self.cpus))
        return (f"pinned to CPU{'s' * (len(self.cpus) != 1)} {where}" if self.pinned else "not pinned") + \
            (f"; kept awake within steps ({self.keepers} SCHED_IDLE keeper{'s' * (self.keepers != 1)})"
             if self.keepers else "; idle CPUs may halt within steps")


def for_stage(config, stage_rank: int, threads: int, tp_rank: int = 0) -> CpuPool | None:
    """The pool of a stage (its tensor-parallel rank `tp_rank`) running in this process with `threads`
    threads (its slice of this node's CPUs)."""
    k, slot = config.ranks_per_node, config.local_slot(stage_rank) * config.parallel.tp_size + tp_rank
    cpus = stage_cpus(os.sched_getaffinity(0), threads, slot, k) if hasattr(os, "sched_getaffinity") else []
    # NOTE: one thread opens no parallel region, so there is no wake-up to save
    pool = start(cpus, keep_awake=None if threads > 1 else False)
    _start_team(threads, cpus)
    log.info("stage %d: CPU threads %s", stage_rank, pool.describe() if pool is not None else
             "not pinned; idle CPUs may halt within steps (one thread, STAGEWISE_KEEP_AWAKE=0, or no C compiler)")
    return pool


def _start_team(threads: int, cpus: list[int]) -> None:
    """The kernel team of this process (kernels/team.py): the stage's threads, whatever a step's
    torch setting (the kernels choose per call, by the bytes they read and the rows)."""
    from ..kernels import team
    if threads > 1:
        size = team.start(threads, cpus)
        log.info("kernel team: %s", f"{size} threads, awake within steps" if size > 1 else "none (OpenMP splits)")


def start(cpus: list[int], pin: bool | None = None, keep_awake: bool | None = None) -> CpuPool | None:
    """Pin the calling thread's OpenMP team to `cpus` and start keepers on them (once per process:
    a second call returns the first pool). None where the thread library is unavailable."""
    if _pool[0] is not None:
        return _pool[0]
    pin = envs.STAGEWISE_PIN_THREADS if pin is None else pin
    keep_awake = envs.STAGEWISE_KEEP_AWAKE if keep_awake is None else keep_awake
    if not cpus or not (pin or keep_awake):
        return None
    lib = _library()
    if lib is None:
        return None
    array = (ctypes.c_int * len(cpus))(*cpus)
    pinned = pin and lib.sw_pin_team(array, len(cpus)) > 0
    keepers = max(lib.sw_keepers_start(array, len(cpus)), 0) if keep_awake else 0
    _pool[0] = CpuPool(lib, cpus, pinned, keepers)
    return _pool[0]


def _library():
    from ..kernels import team  # lazy: builds csrc/threads.c and team.c once per cache
    return team.library()
