"""Capture-time attention metadata: B one-token requests, every one on reserved scratch block 0,
so the (meaningless) capture run writes KV nowhere a live request reads.

`AttentionMetadata.build` is Python per request (about 2 s for 8192 rows), so the largest bucket
is built once and smaller ones are row slices of it.
"""
from __future__ import annotations

from dataclasses import fields

import torch

from ..model.attention import AttentionMetadata


class DummyMetadata:
    def __init__(self, block_size: int, device: torch.device | str = "cpu"):
        self.block_size, self.device = block_size, device
        self._largest: AttentionMetadata | None = None

    def build(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata.build([1] * bucket, [1] * bucket, [[0]] * bucket, self.block_size, self.device)

    def get(self, bucket: int) -> AttentionMetadata:
        big = self._largest
        if big is None or big.num_tokens < bucket:
            self._largest = big = self.build(bucket)
        if big.num_tokens == bucket:
            return big
        # NOTE: relies on an all-decode batch having one group whose tensors are all row-major
        # (one row per request); tests/graph checks the slice equals a fresh build.
        groups = [type(g)(**{f.name: getattr(g, f.name)[:bucket] for f in fields(g)}) for g in big.groups]
        return AttentionMetadata(num_tokens=bucket, slot_mapping=big.slot_mapping[:bucket],
                                 query_lens=[1] * bucket, seq_lens=[1] * bucket, block_tables=[[0]] * bucket,
                                 block_size=self.block_size, groups=groups)
