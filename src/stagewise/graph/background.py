"""Compile a stage's compiled-backend graphs on a background thread while its steps run eager.

Nobody waits for a compiler: the stage serves from its first step, eagerly, and each kind of
graph (decode first, the steps a user waits on token by token) switches on once compiled (from
Inductor's cache when warm). The runner reads a kind's `ready` once per step, so the switch falls
between steps. The compile works on scratch inputs and the dummy metadata it is handed, never on
what the step in flight reads.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from .dummy import DummyMetadata

log = logging.getLogger("stagewise.graph")


def compile_in_background(runner: Any, kinds: list) -> threading.Thread:
    """Start compiling `kinds` (runner `_Kind`s, in order) on a daemon thread; each is marked not
    ready until its compile is done. A compile that fails leaves its kind eager and logs why."""
    for kind in kinds:
        kind.ready = False
    dummy = DummyMetadata(runner._block_size(), runner.device)
    thread = threading.Thread(target=_compile, args=(runner, kinds, dummy), daemon=True,
                              name=f"stagewise-compile-{runner.stage.rank}")
    log.info("stage %d: compiling %s graphs in the background; steps run eager until each is ready",
             runner.stage.rank, " and ".join(k.kind for k in kinds))
    thread.start()
    return thread


def _compile(runner: Any, kinds: list, dummy: DummyMetadata) -> None:
    t0 = time.perf_counter()
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
