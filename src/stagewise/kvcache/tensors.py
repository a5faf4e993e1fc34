"""KV cache tensors for one stage: one `[2, num_blocks, block_size, Hkv, D]` tensor per own layer,
in a list indexed by global layer id (other stages' slots are None). With `--kv-cache-dtype`
q8_0/q4_0 the last dimension is a row's bytes in ggml's block layout (uint8; kernels/kv_quant.py).

On CPU the pool is anonymous memory the kernel hands out zeroed on first touch, so a process holds
only the blocks its requests have used: a few prompts cost their own KV, not the planned pool.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..kernels import kv_quant
from ..parallel.partition import StageInfo


def allocate_kv_caches(stage: StageInfo, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device, kv_dtype: str = "auto",
                       layers: Iterable[int] | None = None) -> list[torch.Tensor | None]:
    """`dtype`: the model's; `kv_dtype`: how the cache stores it (auto: as `dtype`); `layers`: the own
    layers that hold KV (default all; a hybrid model's recurrent layers hold none)."""
    kv_quant.check_head_dim(kv_dtype, head_dim)
    caches: list[torch.Tensor | None] = [None] * stage.num_layers
    last, stored = kv_quant.last_dim(kv_dtype, head_dim), kv_quant.storage_dtype(kv_dtype, dtype)
    for layer_id in range(stage.start, stage.end) if layers is None else layers:
        caches[layer_id] = _zeros((2, num_blocks, block_size, num_kv_heads, last), stored,
                                  torch.device(device))  # [2, NB, BS, Hkv, D or row bytes]
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on Linux CPUs backed by pages that become resident only when written."""
    return kv_quant.lazy_zeros(shape, dtype, device)
