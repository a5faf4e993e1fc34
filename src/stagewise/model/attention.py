"""Paged attention: per-step metadata, the `batch` object models receive, and the SDPA reference.

Models call `batch.attention(layer_id, q, k, v, scale)`; they never see requests or block
tables. The KV cache is one tensor per *global* layer id, `[2, num_blocks, block_size, Hkv, D]`.
Rows of q beyond `meta.num_tokens` are padding (graph buckets): they write KV to the reserved
dummy slot and get zero output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class _Group:
    """Sequences attended in one padded SDPA call (decodes apart from prefills)."""

    q_index: torch.Tensor      # [G, qmax] rows of q (T = the zero pad row)
    kv_slots: torch.Tensor     # [G, Lmax] flat KV slots to gather
    mask: torch.Tensor         # [G, 1, qmax, Lmax] True = may attend
    out_index: torch.Tensor    # [n_rows] flat (g * qmax + r) for each live row
    row_ids: torch.Tensor      # [n_rows] which of the T live rows these are


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch; built once per step, shared by all layers."""

    num_tokens: int
    slot_mapping: torch.Tensor            # [T] int64 flat KV slot of each live token
    query_lens: list[int]
    seq_lens: list[int]                   # cached + new tokens per sequence
    block_tables: list[list[int]]
    block_size: int
    groups: list[_Group] = field(default_factory=list)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        meta = cls(num_tokens=len(slots),
                   slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                   query_lens=list(query_lens), seq_lens=list(seq_lens),
                   block_tables=[list(t) for t in block_tables], block_size=block_size)
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        prefill = [i for i, q in enumerate(query_lens) if q > 1]
        for members in (decode, prefill):
            if members:
                meta.groups.append(_build_group(meta, members, starts, device))
        return meta


def _build_group(meta: AttentionMetadata, members: list[int], starts: list[int], device) -> _Group:
    T, bs = meta.num_tokens, meta.block_size
    qmax = max(meta.query_lens[i] for i in members)
    lmax = max(meta.seq_lens[i] for i in members)
    q_index = torch.full((len(members), qmax), T, dtype=torch.long)
    kv_slots = torch.zeros((len(members), lmax), dtype=torch.long)
    mask = torch.zeros((len(members), 1, qmax, lmax), dtype=torch.bool)
    out_index, row_ids = [], []
    for g, i in enumerate(members):
        q_len, s_len, table = meta.query_lens[i], meta.seq_lens[i], meta.block_tables[i]
        q_index[g, :q_len] = torch.arange(starts[i], starts[i] + q_len)
        pos = torch.arange(s_len)
        blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
        kv_slots[g, :s_len] = blocks * bs + pos % bs
        first_q = s_len - q_len
        causal = pos[None, :] <= (first_q + torch.arange(q_len))[:, None]  # [q_len, s_len]
        mask[g, 0, :q_len, :s_len] = causal
        mask[g, 0, q_len:, 0] = True  # padded query rows see one key so SDPA stays finite
        out_index.extend(g * qmax + r for r in range(q_len))
        row_ids.extend(range(starts[i], starts[i] + q_len))
    to = dict(device=device)
    return _Group(q_index.to(**to), kv_slots.to(**to), mask.to(**to),
                  torch.tensor(out_index, dtype=torch.long, device=device),
                  torch.tensor(row_ids, dtype=torch.long, device=device))


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter k/v rows `[n, Hkv, D]` into the paged cache at flat slots `[n]`."""
    _, nb, bs, h, d = kv_cache.shape
    kv_cache[0].view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def sdpa_paged_attention(meta: AttentionMetadata, kv_cache: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference paged attention for mixed prefill/decode batches. q/k/v: `[rows, H, D]`, rows >= T."""
    T = meta.num_tokens
    rows, hq, d = q.shape
    write_kv(kv_cache, meta.slot_mapping, k[:T], v[:T])
    _, nb, bs, hkv, _ = kv_cache.shape
    k_flat = kv_cache[0].view(nb * bs, hkv, d)
    v_flat = kv_cache[1].view(nb * bs, hkv, d)
    out = q.new_zeros(rows, hq, d)  # [rows, Hq, D]; padding rows stay zero
    q_pad = torch.cat([q[:T], q.new_zeros(1, hq, d)])  # [T+1, Hq, D]
    for grp in meta.groups:
        qg = q_pad[grp.q_index].transpose(1, 2)          # [G, Hq, qmax, D]
        kg = k_flat[grp.kv_slots].transpose(1, 2)        # [G, Hkv, Lmax, D]
        vg = v_flat[grp.kv_slots].transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=grp.mask, scale=scale,
                                            enable_gqa=hq != hkv)
        og = og.transpose(1, 2).reshape(-1, hq, d)       # [G*qmax, Hq, D]
        out[grp.row_ids] = og[grp.out_index]
    return out


class ForwardBatch:
    """The `batch` argument of every model forward: live attention metadata + the stage's KV cache.

    `meta` is swapped each step (graph runners keep one ForwardBatch for the life of a graph).
    `kv_caches` is indexed by global layer id; other stages' slots are None.
    """

    def __init__(self, meta: AttentionMetadata | None, kv_caches: list[torch.Tensor | None]):
        self.meta = meta
        self.kv_caches = kv_caches

    def attention(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """q: `[rows, Hq, D]`, k/v: `[rows, Hkv, D]` -> `[rows, Hq, D]`."""
        cache = self.kv_caches[layer_id]
        if cache is None:
            raise RuntimeError(f"Layer {layer_id} has no KV cache on this stage.")
        return sdpa_paged_attention(self.meta, cache, q, k, v, scale)
