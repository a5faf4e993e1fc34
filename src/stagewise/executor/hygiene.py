"""Process hygiene: no stage process outlives the process that started it, every one has a name in
ps/top, and a stagewise process that loaded torch ends without seconds of interpreter teardown.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
import weakref
from typing import NoReturn

_local_stages: weakref.WeakSet = weakref.WeakSet()     # every stage process this process started
_forked_from: list[int] = []     # the warm process that forked this one (executor/zygote.py), if any


def track(process) -> None:
    """Count `process` among this process's stage processes (kill_local_stages ends it)."""
    _local_stages.add(process)


def forked_from(pid: int) -> None:
    """This process was forked by the warm process `pid`: that is the parent it dies with (the warm
    process dies with the one that started it)."""
    _forked_from[:] = [pid]


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no stage outlives its driver."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        return
    parent = mp.parent_process()
    expected = _forked_from[0] if _forked_from else parent.pid if parent is not None else None
    if expected is not None and os.getppid() != expected:   # the parent died before prctl took effect
        os._exit(1)


def name_process(name: str) -> None:
    """Linux: the process's name in ps/top (/proc/PID/comm, at most 15 bytes), e.g. stagewise-st1."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)   # PR_SET_NAME
    except OSError:
        return


def freeze_heap() -> None:
    """Once a process has loaded what it keeps (modules, weights, tokenizer): collect, then move every
    object into the collector's permanent generation. A full collection scans every tracked object:
    with the ~500k a loaded process holds it stalls the event loop or a decode step 100-250 ms; after
    this it scans only what was made since."""
    gc.collect()
    gc.freeze()


def kill_local_stages() -> None:
    """SIGKILL every stage process this process started and is still running."""
    for p in list(_local_stages):
        if p.is_alive():
            p.kill()


def exit_now(code: int) -> NoReturn:
    """Kill this process's stage processes, flush, and exit without the seconds of torch teardown:
    the one way a stagewise process that loaded torch ends (the CLI's, the engine process)."""
    kill_local_stages()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
