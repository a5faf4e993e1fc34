"""How many of a CPU stage's torch threads a step uses: one for the steps of few rows where the
model's linear layers run on the kernel team, all of them otherwise.

The quantized layers' and attention's C kernels split every call over the stage's kernel team
(kernels/team.py) by the bytes it reads, whatever torch's setting: its threads stay awake through
a step, so a second thread pays on a small model too. What torch itself runs in such a step
(norms, rotary, residual adds, sampling; Inductor's fused loops) is a few microseconds per op at
a few rows, less than waking an idle OpenMP thread costs (tens of microseconds on a VM), so the
steps of up to DECODE_ROWS rows run torch on one thread, and the decode graph is compiled for one
(Dynamo guards the thread count: a graph called with another compiles again). A model with
unquantized linear layers (their kernels split over OpenMP) keeps the older rule: one thread only
where its matrices are small (under 2 MiB on average). Prefill, and captured prefill graphs, keep
the whole team. `STAGEWISE_ADAPT_THREADS=0` keeps the whole team for every step.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from .. import envs
from ..kernels import team as kernel_team
from ..model.quantized import QuantEmbedding, QuantLinear

DECODE_ROWS = 32                # an eager step of up to this many rows runs torch on the decode threads
SMALL_MATRIX_BYTES = 2 << 20    # mean bytes per linear layer below which decode steps run on one thread


def decode_threads(model: Any, weights_bytes: int, full: int) -> int:
    """Torch threads for the few-row steps of `model` (its weights as held: `weights_bytes`) on a team of `full`."""
    linears = [m for m in model.modules() if hasattr(m, "in_features")]
    if full < 2 or not linears or not envs.STAGEWISE_ADAPT_THREADS:
        return full
    if all(isinstance(m, (QuantLinear, QuantEmbedding)) for m in linears) and kernel_team.size() > 1:
        return 1
    return 1 if weights_bytes / len(linears) < SMALL_MATRIX_BYTES else full


class StepTeam:
    """Sets the calling thread's team for each step (`scope(verdict, rows)`), touching torch only on a change."""

    def __init__(self, full: int, decode: int, set_threads):
        self.full, self.decode, self._set = full, decode, set_threads
        self.current = full

    def threads_for(self, verdict: Any, rows: int) -> int:
        if verdict is not None and verdict.kind == "decode":
            return self.decode
        if verdict is not None and verdict.bucket is not None:
            return self.full        # a captured prefill graph: compiled for the whole team
        return self.decode if rows <= DECODE_ROWS else self.full

    @contextmanager
    def scope(self, verdict: Any, rows: int) -> Iterator[int]:
        want = self.threads_for(verdict, rows)
        if want != self.current:
            self._set(want)
            self.current = want
        yield want
