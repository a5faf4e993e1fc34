"""How many of a CPU stage's threads a step uses: all of them, except the decode steps of a model
whose matrices are small, which run on one.

Idle OpenMP threads wait passively (runtime/threads.py), so each parallel region pays a thread's
wake-up (tens of microseconds on a VM), once per linear layer and attention call. A one-row step of
the default model (SmolLM2-135M, ~0.8 MB per quantized matrix) reads each matrix in well under
100 us: half of that saved by a second thread does not pay the wake-up, and batch-1 decode ran
11.4 ms/token on one thread against 19.3 on two (benchmarks/RESULTS.md). A 1B model's matrices
(~10 MB each) pay it many times over (39.7 against 68.2 ms/token); and on the small model a
16-request decode batch made as many tokens per second on one thread as on two. So the steps of the
decode kind (up to `--decode-graph-max-bs` tokens) of a small model run on one thread, and its
decode graph is compiled for one (Dynamo guards the thread count: a graph called with another
compiles again); prefill keeps the whole team. `STAGEWISE_ADAPT_THREADS=0` keeps the whole team.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from .. import envs

DECODE_ROWS = 32                # a step of up to this many tokens counts as decode when no graph decides
SMALL_MATRIX_BYTES = 2 << 20    # mean bytes per linear layer below which decode steps run on one thread


def decode_threads(model: Any, weights_bytes: int, full: int) -> int:
    """Threads for the decode steps of `model` (its weights as held: `weights_bytes`) on a team of `full`."""
    linears = sum(1 for m in model.modules() if hasattr(m, "in_features"))
    if full < 2 or not linears or not envs.STAGEWISE_ADAPT_THREADS:
        return full
    return 1 if weights_bytes / linears < SMALL_MATRIX_BYTES else full


class StepTeam:
    """Sets the calling thread's team for each step (`scope(verdict, rows)`), touching torch only on a change."""

    def __init__(self, full: int, decode: int, set_threads):
        self.full, self.decode, self._set = full, decode, set_threads
        self.current = full

    def threads_for(self, verdict: Any, rows: int) -> int:
        is_decode = verdict.kind == "decode" if verdict is not None else rows <= DECODE_ROWS
        return self.decode if is_decode else self.full

    @contextmanager
    def scope(self, verdict: Any, rows: int) -> Iterator[int]:
        want = self.threads_for(verdict, rows)
        if want != self.current:
            self._set(want)
            self.current = want
        yield want
