"""KV cache tensors for one stage: one `[2, num_blocks, block_size, Hkv, D]` tensor per own layer,
in a list indexed by global layer id (other stages' slots are None).

On CPU the pool is anonymous memory the kernel hands out zeroed on first touch, so a process holds
only the blocks its requests have used: a few prompts cost their own KV, not the planned pool.
"""
from __future__ import annotations

import mmap
import sys

import torch

from ..parallel.partition import StageInfo


def allocate_kv_caches(stage: StageInfo, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device) -> list[torch.Tensor | None]:
    caches: list[torch.Tensor | None] = [None] * stage.num_layers
    for layer_id in range(stage.start, stage.end):
        caches[layer_id] = _zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype,
                                  torch.device(device))  # [2, NB, BS, Hkv, D]
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on Linux CPUs backed by pages that become resident only when written."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)   # keeps `pages` alive
