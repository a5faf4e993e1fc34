"""Sliding-window attention over the paged KV cache, for the window layers of families that mix them
with full-attention ones (Gemma 3). The cache holds every position, as for full attention; a window
layer's rows attend the last `window` keys (their own included) by a mask, per sequence, with SDPA.
A cache that frees the blocks behind the window is a later piece of work.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stagewise.model.attention import ForwardBatch, write_kv


def window_attention(batch: ForwardBatch, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float, window: int, *, kv_written: bool = False) -> torch.Tensor:
    """q `[rows, Hq, D]`, k/v `[rows, Hkv, D]` -> `[rows, Hq, D]`: each live row at position p attends
    the keys at positions max(0, p - window + 1)..p of its sequence; padding rows get zeros.
    `kv_written`: the live rows' k and v are in the cache already."""
    if type(batch) is not ForwardBatch:
        raise ValueError("Sliding-window layers run eagerly only; turn off captured graphs "
                         "(--prefill-graph and decode graphs) for this model.")
    meta, cache = batch.meta, batch.kv_caches[layer_id]
    if meta is None or cache is None:
        raise RuntimeError(f"Layer {layer_id} attended without its KV cache or the step's metadata.")
    rows, bs = meta.num_tokens, meta.block_size
    if not kv_written:
        write_kv(cache, meta.slot_mapping, k[:rows], v[:rows])
    out = q.new_zeros(q.shape)
    first = 0
    for q_len, s_len, table in zip(meta.query_lens, meta.seq_lens, meta.block_tables):
        lo = max(0, s_len - q_len - window + 1)            # the first key any of these rows sees
        blocks = torch.tensor(table[lo // bs:-(-s_len // bs)], dtype=torch.long, device=cache.device)
        start = (lo // bs) * bs
        kv = cache.index_select(1, blocks).flatten(1, 2)[:, lo - start:s_len - start]    # [2, S, Hkv, D]
        q_pos = torch.arange(s_len - q_len, s_len, device=q.device)[:, None]
        k_pos = torch.arange(lo, s_len, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)                               # [q_len, S]
        o = F.scaled_dot_product_attention(q[first:first + q_len].transpose(0, 1), kv[0].transpose(0, 1),
                                           kv[1].transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
        out[first:first + q_len] = o.transpose(0, 1)
        first += q_len
    return out
