"""A node's warm process (zygote.py) imports torch, the engine and the checkpoint's config (seconds
of CPU) beside the running stages of its node. It imports at idle priority (SCHED_IDLE: it runs only
on CPU time no other thread of the machine wants), so a pipeline on one-CPU nodes does not lose
those seconds mid-run, and every thread of it returns to normal priority before it forks a stage.
Where the process could not return (leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE), it
imports at normal priority, as a fresh stage would.
"""
from __future__ import annotations

import os


def warm_at_idle_priority() -> bool:
    """Move this process to SCHED_IDLE if it may come back later; whether it did."""
    if not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task") or not _may_raise_priority():
        return False
    _every_thread(os.SCHED_IDLE)
    return True


def back_to_normal() -> None:
    """Every thread of this process at normal priority (threads started while idle inherited it)."""
    _every_thread(os.SCHED_OTHER)


def _every_thread(policy: int) -> None:
    """sched_setscheduler holds for one thread: each of this process's."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError:      # a thread that ended meanwhile
            pass


def _may_raise_priority() -> bool:
    """Whether this process may lower its nice value (what leaving SCHED_IDLE needs): try it by one."""
    try:
        now = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, now - 1)
        os.setpriority(os.PRIO_PROCESS, 0, now)
    except OSError:
        return False
    return True
