"""Random valid GGUF blocks of every type stagewise runs quantized: random bytes with finite fp16
scales (MXFP4: E8M0 scale bytes of a realistic size; K-quants cannot be quantized by gguf-py, so
blocks are built directly; random codes and 6-bit scale codes are all valid)."""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES

from stagewise.kernels.quant_formats import SUPPORTED, T, row_bytes

TYPES = SUPPORTED
# byte offsets of each block's fp16 scales
_HALVES = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2),
           T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype: T, n: int, k: int, gen: torch.Generator, scale: float = 0.05) -> torch.Tensor:
    """`[n, row_bytes]` uint8 rows of random blocks whose fp16 scales lie in (-scale, scale)
    (minimums too): values of a realistic size, so products and sums stay well inside fp32."""
    data = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=gen)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = data.view(n, k // block, size)
    if qtype == T.MXFP4:           # E8M0 scale bytes 2^(e - 127), e in [118, 123]: |values| <= 6 / 16
        blocks[..., 0] = torch.randint(118, 124, blocks.shape[:-1], dtype=torch.uint8, generator=gen)
    for at in _HALVES.get(qtype, ()):
        half = ((torch.rand(n, k // block, generator=gen) * 2 - 1) * scale).half()
        blocks[..., at:at + 2] = half.unsqueeze(-1).view(torch.uint8)
    return data
