"""KV cache tensors for one stage: one `[2, num_blocks, block_size, Hkv, D]` tensor per own layer,
in a list indexed by global layer id (other stages' slots are None)."""
from __future__ import annotations

import torch

from ..parallel.partition import StageInfo


def kv_bytes_per_block(stage: StageInfo, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_dim * itemsize * (stage.end - stage.start)


def allocate_kv_caches(stage: StageInfo, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device) -> list[torch.Tensor | None]:
    caches: list[torch.Tensor | None] = [None] * stage.num_layers
    for layer_id in range(stage.start, stage.end):
        caches[layer_id] = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim,
                                       dtype=dtype, device=device)  # [2, NB, BS, Hkv, D]
    return caches
