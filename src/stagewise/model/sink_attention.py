"""Paged attention with optional attention sinks and an optional sliding window (gpt-oss's sinks and
window layers, Gemma 3's window layers).

A sink is a learned logit per query head that joins the softmax's denominator and is then dropped:
computed here as one extra key whose k and v are zero and whose additive mask is the sink, so one
SDPA call per batch of pieces gives transformers' numbers. A window layer attends to the last
`window` positions (itself included); the cache still holds every position (the window is a mask).
The index plan (which rows, which cache slots, what mask) is built once per step and window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stagewise.model.attention import AttentionMetadata, ForwardBatch, write_kv
from stagewise.model.layers import eager_only

QUERY_CHUNK = 256      # query rows of one sequence per SDPA call at most
MASK_BUDGET = 1 << 24  # mask elements (heads x rows x keys) per call a long prompt's chunk is cut to


@dataclass
class _Call:
    """One padded SDPA call over N pieces (a sequence's run of query rows)."""

    q_index: torch.Tensor      # [N, qmax] rows of q (T = the zero pad row)
    slots: torch.Tensor        # [N, L] flat cache slots of the keys each piece sees (0-padded)
    allowed: torch.Tensor      # [N, 1, qmax, L] True = may attend
    out_index: torch.Tensor    # [n_rows] flat (piece * qmax + r) of each live row
    row_ids: torch.Tensor      # [n_rows] which of the T live rows these are


def _pieces(meta: AttentionMetadata, window: int | None, heads: int) -> list[tuple[int, int, int, int]]:
    """(sequence, first row, rows, first query position) of every run of at most QUERY_CHUNK rows,
    fewer where its mask would pass MASK_BUDGET (a long prompt's full-attention layers)."""
    out, row = [], 0
    for seq, (q_len, s_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        keys = min(s_len, window + QUERY_CHUNK) if window else s_len
        chunk = max(1, min(QUERY_CHUNK, MASK_BUDGET // (heads * (keys + 1))))
        for first in range(0, q_len, chunk):
            n = min(chunk, q_len - first)
            out.append((seq, row + first, n, s_len - q_len + first))
        row += q_len
    return out


def _call(meta: AttentionMetadata, pieces: list[tuple[int, int, int, int]], window: int | None,
          device) -> _Call:
    bs, T = meta.block_size, meta.num_tokens
    qmax = max(n for _, _, n, _ in pieces)
    spans = []      # (first key position, keys) per piece
    for _, _, n, pos in pieces:
        lo = max(0, pos - window + 1) if window else 0
        spans.append((lo, pos + n - lo))
    width = max(keys for _, keys in spans)
    q_index = torch.full((len(pieces), qmax), T, dtype=torch.long)
    slots = torch.zeros(len(pieces), width, dtype=torch.long)
    key_pos = torch.full((len(pieces), width), -1, dtype=torch.long)        # -1: padding, never attended
    query_pos = torch.zeros(len(pieces), qmax, dtype=torch.long)
    for i, ((seq, row, n, pos), (lo, keys)) in enumerate(zip(pieces, spans)):
        q_index[i, :n] = torch.arange(row, row + n)
        positions = torch.arange(lo, lo + keys)
        table = torch.tensor(meta.block_tables[seq], dtype=torch.long)
        slots[i, :keys] = table[positions // bs] * bs + positions % bs
        key_pos[i, :keys] = positions
        query_pos[i] = (pos + torch.arange(qmax)).clamp(max=pos + n - 1)    # padded rows: finite, discarded
    kp, qp = key_pos[:, None, :], query_pos[:, :, None]
    allowed = (kp >= 0) & (kp <= qp)
    if window:
        allowed &= kp > qp - window
    live = q_index.flatten() < T
    out_index = live.nonzero().squeeze(1)
    to = dict(device=device)
    return _Call(q_index.to(**to), slots.to(**to), allowed[:, None].to(**to), out_index.to(**to),
                 q_index.flatten()[out_index].to(**to))


def _plan(meta: AttentionMetadata, window: int | None, heads: int, device) -> list[_Call]:
    """The step's calls for `window`, cached on the metadata (every layer of that kind shares them):
    one-row pieces (decode rows) together, each longer piece alone."""
    cache = meta.__dict__.setdefault("_sink_plans", {})
    if (window, heads) not in cache:
        pieces = _pieces(meta, window, heads)
        single = [p for p in pieces if p[2] == 1]
        groups = ([single] if single else []) + [[p] for p in pieces if p[2] > 1]
        cache[window, heads] = [_call(meta, g, window, device) for g in groups]
    return cache[window, heads]


@eager_only      # data-dependent indexing on the live metadata: a compiled body breaks here
def sink_attention(batch: ForwardBatch, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float, sinks: torch.Tensor | None, window: int | None, *, kv_written: bool = False
                   ) -> torch.Tensor:
    """q `[rows, Hq, D]`, k/v `[rows, Hkv, D]` (rows >= T; padding rows get zeros), `sinks` `[Hq]` (None:
    no sink) -> `[rows, Hq, D]`. `kv_written`: the live rows' k and v are in the cache already."""
    if hasattr(batch, "static"):
        raise ValueError("Attention with sinks or a sliding window (gpt-oss, Gemma 3) reads the step's live "
                         "metadata, which full graphs freeze; run this model with graphs whose attention stays "
                         "live (breakable) or off.")
    meta, cache = batch.meta, batch.kv_caches[layer_id]
    if cache is None or meta is None:
        raise RuntimeError(f"Layer {layer_id} has no KV cache or no step metadata on this stage.")
    if cache.dtype != q.dtype:
        raise ValueError("Attention with sinks or a sliding window (gpt-oss, Gemma 3) reads a KV cache of the "
                         "model's dtype only; run this model with --kv-cache-dtype auto.")
    T = meta.num_tokens
    rows, hq, d = q.shape
    hkv = k.shape[1]
    if not kv_written:
        write_kv(cache, meta.slot_mapping, k[:T], v[:T])
    out = q.new_zeros(rows, hq, d)
    if T == 0:
        return out
    _, nb, bs, _, _ = cache.shape
    keys, values = cache[0].view(nb * bs, hkv, d), cache[1].view(nb * bs, hkv, d)
    q_pad = torch.cat([q[:T], q.new_zeros(1, hq, d)])                       # [T + 1, Hq, D]
    sink_col = None if sinks is None else sinks.to(q.dtype).view(1, hq, 1, 1)
    for call in _plan(meta, window, hq, q.device):
        n, qmax = call.q_index.shape
        kg, vg = keys[call.slots], values[call.slots]                        # [N, L, Hkv, D]
        if sink_col is not None:
            zero = q.new_zeros(n, 1, hkv, d)                                 # the sink's key and value
            kg, vg = torch.cat([kg, zero], 1), torch.cat([vg, zero], 1)      # [N, L + 1, Hkv, D]
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
        qg = q_pad[call.q_index].transpose(1, 2)                             # [N, Hq, qmax, D]
        bias = torch.zeros(call.allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~call.allowed,
                                                                                            float("-inf"))
        mask = bias.expand(n, hq, qmax, -1)
        if sink_col is not None:
            mask = torch.cat([mask, sink_col.expand(n, hq, qmax, 1)], -1)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
        og = og.transpose(1, 2).reshape(n * qmax, hq, d)
        out.index_copy_(0, call.row_ids, og.index_select(0, call.out_index))
    return out
