"""Which CPU GEMM kernels a step uses. One-row bf16 steps (batch-1 decode, a prefill's single LM-head
row) run on torch's native bf16 GEMV instead of oneDNN: oneDNN pays ~12 us per call and streams
weights that do not fit the cache far more slowly at one row (SmolLM2-135M, one thread: 49 -> 31 ms
per decode token). From two rows up oneDNN wins (native cost grows with every row), so it stays on.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def prefers_native_gemv(rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    return rows == 1 and dtype == torch.bfloat16 and device.type == "cpu"


@contextmanager
def gemm_kernels(rows: int, dtype: torch.dtype, device: torch.device):
    """Run the block with the kernels that suit a `rows`-row step (the oneDNN switch is process-wide;
    a stage runs one step at a time, and the previous setting comes back afterwards)."""
    if not prefers_native_gemv(rows, dtype, device) or not torch.backends.mkldnn.enabled:
        yield
        return
    # NOTE: the module is a ContextProp descriptor at runtime; its stub types the attribute as one
    torch.backends.mkldnn.enabled = False   # type: ignore[assignment]
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True   # type: ignore[assignment]
