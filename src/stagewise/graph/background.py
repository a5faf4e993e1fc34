"""Compile a stage's compiled-backend graphs on a background thread while its steps run eager.

Nobody waits for a compiler: the stage serves from its first step, eagerly, and each kind of
graph (decode first, the steps a user waits on token by token) switches on once compiled (from
Inductor's cache when warm). The runner reads a kind's `ready` once per step, so the switch falls
between steps. The compile works on scratch inputs and the dummy metadata it is handed, never on
what the step in flight reads.

The compile runs while the engine is idle, never inside a step (`CompileGate`). Compiling is Python
holding the interpreter lock, and an eager step gives the lock up at every op (every PyTorch op and
C kernel call releases it); a compile thread free to take it each time held the step for a switch
interval (5 ms) per op, and made a 20 ms decode step 5-10x slower.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .dummy import DummyMetadata

log = logging.getLogger("stagewise.graph")


class CompileGate:
    """When a background compile's thread may run Python: not during a step, nor in the short gap
    before the next one (`GRACE_S`), so an engine stepping back to back runs at eager speed and the
    compile uses idle time. An engine kept busy for `FOREGROUND_AFTER_S` (a long job, a loaded
    server: work that wins a compile back) stops once and lets the compile finish at full speed.

    The compile thread checks at each Python call (a trace function on that thread only, which
    slows the compile ~1.7x; it is taken off for the foreground finish)."""

    GRACE_S = 0.02
    FOREGROUND_AFTER_S = 10.0
    FOREGROUND_MAX_S = 30.0

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self._busy = False            # read by the compile thread at every call: its fast path
        self._in_step = self._foreground = False
        self._changed = threading.Condition()
        self._last_end = self._streak_start = 0.0
        self.held_s = 0.0             # how long the compile waited for the engine (for the log)

    @contextmanager
    def step(self) -> Iterator[None]:
        t0 = time.monotonic()
        if t0 - self._last_end > self.GRACE_S:
            self._streak_start = t0
        self._busy = self._in_step = True
        try:
            yield
        finally:
            end = time.monotonic()
            with self._changed:
                self._in_step, self._last_end = False, end
                waits = not self._foreground and end - self._streak_start > self.FOREGROUND_AFTER_S
                self._foreground = self._foreground or waits
                self._changed.notify_all()
            if waits and self.thread is not None:           # once: afterwards the compile is no longer held
                log.info("compiling in the foreground: the engine has been busy for %.0f s, and the compiled "
                         "graphs win that time back", end - self._streak_start)
                # NOTE: bounded, so a cold compile cannot make this stage miss --dist-timeout-s; the
                # compile then goes on beside the steps, no longer held
                self.thread.join(self.FOREGROUND_MAX_S)

    def enter(self) -> None:
        """Called on the compile thread: from now on its Python calls obey the gate."""
        sys.settrace(self._trace)               # this thread only

    def _trace(self, frame, event: str, arg) -> None:
        if self._busy:
            self._hold()
        # None: no line events for the frame

    def _hold(self) -> None:
        t0 = time.monotonic()
        with self._changed:
            while True:
                now = time.monotonic()
                if self._foreground:
                    sys.settrace(None)          # the engine waits for us: full speed from here
                    break
                if self._in_step:
                    self._changed.wait()
                elif now - self._last_end >= self.GRACE_S:
                    self._busy = False
                    break
                else:
                    self._changed.wait(self.GRACE_S - (now - self._last_end))
        self.held_s += time.monotonic() - t0


def compile_in_background(runner: Any, kinds: list, gate: CompileGate) -> threading.Thread:
    """Start compiling `kinds` (runner `_Kind`s, in order) on a daemon thread that `gate` holds during
    steps; each is marked not ready until its compile is done. A compile that fails leaves its kind
    eager and logs why."""
    for kind in kinds:
        kind.ready = False
    dummy = DummyMetadata(runner._block_size(), runner.device)
    thread = gate.thread = threading.Thread(target=_compile, args=(runner, kinds, dummy, gate), daemon=True,
                                            name=f"stagewise-compile-{runner.stage.rank}")
    log.info("stage %d: compiling %s graphs in the background; steps run eager until each is ready",
             runner.stage.rank, " and ".join(k.kind for k in kinds))
    thread.start()
    return thread


def _compile(runner: Any, kinds: list, dummy: DummyMetadata, gate: CompileGate) -> None:
    t0 = time.perf_counter()
    gate.enter()
    try:
        _compile_kinds(runner, kinds, dummy, t0)
    finally:
        sys.settrace(None)
    log.info("stage %d: background compile done in %.1f s (%.1f s of it waiting for steps)",
             runner.stage.rank, time.perf_counter() - t0, gate.held_s)


def _compile_kinds(runner: Any, kinds: list, dummy: DummyMetadata, t0: float) -> None:
    with torch.inference_mode():
        for kind in kinds:
            try:
                runner._capture_kind(kind, dummy, background=True)
            except Exception:  # noqa: BLE001 (the eager path keeps serving; the log says why)
                log.exception("stage %d: compiling the %s graph failed; its steps stay eager",
                              runner.stage.rank, kind.kind)
                continue
            kind.ready = True
            log.info("stage %d: %s steps replay the compiled graph from now on (%.1f s after start-up)",
                     runner.stage.rank, kind.kind, time.perf_counter() - t0)
