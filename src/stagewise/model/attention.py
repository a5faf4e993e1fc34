"""Paged attention: per-step metadata, the `batch` object models receive, and the SDPA reference.

Models call `batch.attention(layer_id, q, k, v, scale)`; they never see requests or block
tables. The KV cache is one tensor per *global* layer id, `[2, num_blocks, block_size, Hkv, D]`.
Rows of q beyond `meta.num_tokens` are padding (graph buckets): they write KV to the reserved
dummy slot and get zero output.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels import attention as cpu_attention
from ..kernels import kv_quant


@dataclass
class _Group:
    """Sequences attended in one padded SDPA call against KV gathered from the cache (prefills
    that continue a cached prefix or an earlier chunk)."""

    q_index: torch.Tensor      # [G, qmax] rows of q (T = the zero pad row)
    block_ids: torch.Tensor    # [G, nblk] KV blocks to gather (0-padded; masked out)
    mask: torch.Tensor         # [G, 1, qmax, nblk * block_size] True = may attend
    out_index: torch.Tensor    # [n_rows] flat (g * qmax + r) for each live row
    row_ids: torch.Tensor      # [n_rows] which of the T live rows these are


@dataclass
class _DecodeGroup:
    """One-token sequences: the query heads sharing a KV head become the query rows of one SDPA
    call, so GQA needs no key expansion.

    NOTE: every field is one row per sequence; graph/dummy.py slices them `[:bucket]`.
    """

    row_ids: torch.Tensor      # [G] which of the T live rows these are
    block_ids: torch.Tensor    # [G, nblk] KV blocks to gather (0-padded; masked out)
    mask: torch.Tensor         # [G, 1, 1, nblk * block_size] True = may attend
    seq_lens: torch.Tensor     # [G] int64 keys each sequence attends (the in-place kernel's bound)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch; built once per step, shared by all layers."""

    num_tokens: int
    slot_mapping: torch.Tensor            # [T] int64 flat KV slot of each live token
    query_lens: list[int]
    seq_lens: list[int]                   # cached + new tokens per sequence
    block_tables: list[list[int]]
    block_size: int
    groups: list[_Group | _DecodeGroup] = field(default_factory=list)
    # (first row, length) of each prefill with no cached prefix: causal SDPA on its own rows
    causal_spans: list[tuple[int, int]] = field(default_factory=list)
    # with INVARIANT, for steps that are not plain decode, the invariant path's arguments: the live rows cut
    # into spans of at most SPAN_ROWS rows of one sequence (`span_rows` [S + 1] row offsets), each
    # span's block table (`span_block_ids` [S, nblk], 0-padded) and each row's keys (`row_lens`
    # [T], its position + 1)
    span_rows: torch.Tensor | None = None
    span_block_ids: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None
    # a CPU step that is not plain decode whose every sequence continues its cache by at most SPAN_ROWS
    # rows (verify steps, decode rows beside them): the spans above are built whatever INVARIANT,
    # for the one-call layers (model/llama.py), whose rows then get decode rows' bits
    short_rows: bool = False
    # the blocks of `block_tables`, once, for caches stored quantized (`_dense_cache`)
    used_blocks: torch.Tensor | None = None
    # each sequence's recurrent-state slot (models with linear-attention layers; set by the stage)
    state_slots: list[int] | None = None

    @property
    def is_plain_decode(self) -> bool:
        """All rows are one-token sequences in one decode group, in batch order (see _split_by_length)."""
        return len(self.groups) == 1 and not self.causal_spans and isinstance(self.groups[0], _DecodeGroup)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        n, bs = len(query_lens), block_size
        tables = _padded_tables(seq_lens, block_tables, bs)            # [N, MB]
        q_lens = torch.tensor(query_lens, dtype=torch.long)            # [N]
        s_lens = torch.tensor(seq_lens, dtype=torch.long)              # [N]
        starts = torch.cumsum(q_lens, 0) - q_lens                      # [N] first row of each sequence
        seq_of_row = torch.repeat_interleave(torch.arange(n), q_lens)  # [T]
        pos = torch.arange(seq_of_row.numel()) - starts[seq_of_row] + (s_lens - q_lens)[seq_of_row]
        slots = tables[seq_of_row, pos // bs] * bs + pos % bs          # [T]
        meta = cls(num_tokens=slots.numel(), slot_mapping=slots.to(device),
                   query_lens=list(query_lens), seq_lens=list(seq_lens),
                   block_tables=[list(t) for t in block_tables], block_size=bs)
        row = 0
        decode, cached_prefill = [], []
        for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
            if q_len == 1:
                decode.append(i)
            elif q_len == s_len:
                meta.causal_spans.append((row, q_len))
            else:
                cached_prefill.append(i)
            row += q_len
        for members in _split_by_length(decode, seq_lens, bs):
            meta.groups.append(_decode_group(members, starts, s_lens, tables, bs, device))
        if cached_prefill:
            meta.groups.append(_prefill_group(cached_prefill, starts, q_lens, s_lens, tables, bs, meta.num_tokens,
                                              device))
        meta.short_rows = (torch.device(device).type == "cpu" and not meta.is_plain_decode and not meta.causal_spans
                           and meta.num_tokens > 0 and max(query_lens) <= SPAN_ROWS)
        if meta.short_rows or (INVARIANT and not meta.is_plain_decode and meta.num_tokens):   # the spans
            per_seq = -(-q_lens // SPAN_ROWS)                                 # [N] spans of each sequence
            seq_of_span = torch.repeat_interleave(torch.arange(n), per_seq)   # [S]
            first = torch.arange(seq_of_span.numel()) - (torch.cumsum(per_seq, 0) - per_seq)[seq_of_span]
            begin = starts[seq_of_span] + first * SPAN_ROWS                   # [S] first row of each span
            meta.span_rows = torch.cat([begin, torch.tensor([meta.num_tokens])]).to(device)
            meta.span_block_ids = tables[seq_of_span].to(device)              # [S, MB]
            meta.row_lens = (pos + 1).to(device)                              # [T]
        return meta


def _padded_tables(seq_lens: list[int], block_tables: list[list[int]], bs: int) -> torch.Tensor:
    """The blocks each sequence needs, right-padded with block 0: `[N, MB]`."""
    need = [-(-s // bs) for s in seq_lens]
    width = max(need, default=0)
    rows = []
    for table, k in zip(block_tables, need):
        if len(table) < k:
            raise ValueError(f"A block table holds {len(table)} blocks but its sequence needs {k}.")
        rows.append(list(table[:k]) + [0] * (width - k))
    return torch.tensor(rows, dtype=torch.long).view(len(rows), width)


SPAN_ROWS = 16                 # rows of one sequence sharing the invariant kernel's key tiles (<= 64)
MAX_DECODE_GROUPS = 4          # decode SDPA calls per layer at most
MIN_SPLIT_SAVING = 0.2         # split a decode group only if it cuts the padded key area by this much


def _split_by_length(members: list[int], seq_lens: list[int], bs: int) -> list[list[int]]:
    """Decode sequences sorted by length and cut into at most MAX_DECODE_GROUPS groups where that
    saves much padding: every sequence of a group is gathered and attended at the group's longest
    length, so one group of 16..400-token sequences would do twice the work it needs."""
    if not members:
        return []
    blocks = {i: -(-seq_lens[i] // bs) for i in members}
    if len(set(blocks.values())) == 1:
        return [members]     # nothing to cut; batch order keeps the all-decode fast path open
    groups = [sorted(members, key=blocks.__getitem__)]
    area = len(members) * max(blocks.values())                  # padded key blocks gathered
    while len(groups) < MAX_DECODE_GROUPS:
        best = (0, 0, 0)                                         # (saving, group, cut)
        for gi, g in enumerate(groups):
            longest = blocks[g[-1]]
            for cut in range(1, len(g)):
                saving = cut * (longest - blocks[g[cut - 1]])   # the first `cut` shrink to their own longest
                if saving > best[0]:
                    best = (saving, gi, cut)
        saving, gi, cut = best
        if saving < MIN_SPLIT_SAVING * area:
            break
        g = groups.pop(gi)
        groups[gi:gi] = [g[:cut], g[cut:]]
        area -= saving
    return groups if len(groups) > 1 else [members]


def _decode_group(members: list[int], starts, s_lens, tables, bs: int, device) -> _DecodeGroup:
    idx = torch.tensor(members, dtype=torch.long)
    sl = s_lens[idx]                                                   # [G]
    nblk = -(-int(sl.max()) // bs)
    mask = torch.arange(nblk * bs)[None, :] < sl[:, None]              # [G, L]
    return _DecodeGroup(starts[idx].to(device), tables[idx, :nblk].to(device), mask[:, None, None, :].to(device),
                        sl.to(device))


def _prefill_group(members: list[int], starts, q_lens, s_lens, tables, bs: int, T: int, device) -> _Group:
    idx = torch.tensor(members, dtype=torch.long)
    ql, sl = q_lens[idx], s_lens[idx]                                  # [G]
    qmax, nblk = int(ql.max()), -(-int(sl.max()) // bs)
    r = torch.arange(qmax)[None, :]                                    # [1, qmax]
    live = r < ql[:, None]                                             # [G, qmax]
    q_index = torch.where(live, starts[idx][:, None] + r, T)           # [G, qmax]
    # the last key each query row sees; padded rows see the sequence's keys so SDPA stays finite
    last = torch.minimum(sl[:, None] - ql[:, None] + r, sl[:, None] - 1)   # [G, qmax]
    mask = torch.arange(nblk * bs)[None, None, :] <= last[:, :, None]      # [G, qmax, L]
    out_index = live.flatten().nonzero().squeeze(1)                    # [n_rows]
    to = dict(device=device)
    return _Group(q_index.to(**to), tables[idx, :nblk].to(**to), mask[:, None].to(**to), out_index.to(**to),
                  q_index.flatten()[out_index].to(**to))


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter k/v rows `[n, Hkv, D]` into the paged cache at flat slots `[n]` (quantized or cast
    first where the cache stores another format: `--kv-cache-dtype`)."""
    _, nb, bs, h, last = kv_cache.shape
    if kv_cache.dtype != k.dtype:
        k, v = _stored(kv_cache, k), _stored(kv_cache, v)
    kv_cache[0].view(nb * bs, h, last).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(nb * bs, h, last).index_copy_(0, slot_mapping, v)


def _stored(kv_cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    qtype = kv_quant.format_of(kv_cache, x.shape[-1])
    return x.to(kv_cache.dtype) if qtype is None else kv_quant.quantize_rows(x, qtype)


def _as_stored(meta: AttentionMetadata, half: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The step's live k (or v) rows `x` as the cache holds them (`half`: the dense K or V pool),
    so a fresh prompt, which attends its own k and v without reading the cache, sees what a later
    chunk or a cached prefix of it sees."""
    nb, bs, hkv, d = half.shape
    out = x.clone()
    out[:meta.num_tokens] = half.view(nb * bs, hkv, d).index_select(0, meta.slot_mapping)
    return out


_scratch = threading.local()   # .pools: {(shape, dtype): dense pool}; one per thread (stages may share a process)


def _dense_cache(meta: AttentionMetadata, kv_cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A cache stored in another format than q's (`--kv-cache-dtype` q8_0/q4_0, or bf16 under an
    fp32 model) as a dense `[2, NB, BS, Hkv, D]` pool of q's dtype, holding (dequantized) only the
    blocks this step's sequences use; the attention paths then read it as any cache. The pool is
    one per thread and shape, shared by the layers (they run one after another), and its pages
    become resident only as blocks are first written."""
    _, nb, bs, hkv, _ = kv_cache.shape
    d = q.shape[-1]
    key = ((2, nb, bs, hkv, d), q.dtype, kv_cache.device)
    pools = getattr(_scratch, "pools", None)
    if pools is None:
        pools = _scratch.pools = {}
    dense = pools.get(key)
    if dense is None:
        dense = pools[key] = kv_quant.lazy_zeros(key[0], q.dtype, kv_cache.device)
    if meta.used_blocks is None:
        used = sorted({b for table in meta.block_tables for b in table})
        meta.used_blocks = torch.tensor(used, dtype=torch.long, device=kv_cache.device)
    raw = kv_cache.index_select(1, meta.used_blocks)                    # [2, U, BS, Hkv, row]
    qtype = kv_quant.format_of(kv_cache, d)
    values = raw.to(q.dtype) if qtype is None else kv_quant.dequantize_rows(raw, qtype, d, q.dtype)
    dense.index_copy_(1, meta.used_blocks, values)
    return dense


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `block_ids` `[G, nblk]` -> each `[G, Hkv, nblk * bs, D]` (one index_select of whole
    blocks: several times faster than gathering slot by slot)."""
    _, _, bs, hkv, d = kv_cache.shape
    g, nblk = block_ids.shape
    kv = kv_cache.index_select(1, block_ids.reshape(-1)).view(2, g, nblk * bs, hkv, d)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


# True: every live row through the one per-row kernel (see `invariant_paged_attention`): a row's
# bits depend only on its query, the keys at positions 0..pos and the model, never on how the
# prompt was cut into chunks. False (the default): the split paths (SDPA within a fresh prompt's
# chunk, the bf16 prefill kernel, SDPA over gathered KV for continued prefills), which sum in other
# orders but are faster on long prompts. Set per process from EngineConfig.invariant_attention
# when a stage is built (runtime/setup.py).
INVARIANT = False


def paged_attention(meta: AttentionMetadata, kv_cache: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, scale: float, *, kv_written: bool = False) -> torch.Tensor:
    """What the engine runs. Where the CPU kernel serves the dtype and head size: one-token
    sequences are attended in place (no KV gather), and with `INVARIANT` (the engine's
    `invariant_attention`) every other row too (`invariant_paged_attention`). Elsewhere
    `sdpa_paged_attention`, with fresh prompts on the CPU prefill kernel where it is available.
    `kv_written`: the caller already wrote the live rows' k and v into the cache (the rope op).
    A cache stored in another format (`--kv-cache-dtype`) is written quantized; a plain decode step
    reads its q8_0/q4_0 blocks in place (`cpu_attention.decode_attention_stored`), other steps
    through a dense copy of the blocks the step uses (`_dense_cache`)."""
    if kv_cache.dtype != q.dtype:
        if meta.is_plain_decode and cpu_attention.supports_stored(q, kv_cache):
            return _stored_decode(meta, kv_cache, q, k, v, scale, kv_written)
        if not kv_written:
            write_kv(kv_cache, meta.slot_mapping, k[:meta.num_tokens], v[:meta.num_tokens])
        kv_cache, kv_written = _dense_cache(meta, kv_cache, q), True
        k, v = _as_stored(meta, kv_cache[0], k), _as_stored(meta, kv_cache[1], v)
    in_place = cpu_attention.supports(q, kv_cache)
    if in_place and INVARIANT and meta.span_rows is not None:      # spans: built with INVARIANT on
        return invariant_paged_attention(meta, kv_cache, q, k, v, scale, kv_written=kv_written)
    return sdpa_paged_attention(meta, kv_cache, q, k, v, scale, in_place_decode=in_place,
                                prefill_kernel=bool(meta.causal_spans) and cpu_attention.prefill_supports(q, k),
                                kv_written=kv_written)


def _stored_decode(meta: AttentionMetadata, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, scale: float, kv_written: bool) -> torch.Tensor:
    """One-token sequences over a q8_0/q4_0 cache, its blocks dequantized tile by tile in the kernel:
    the bits the dense copy's decode gives (so `INVARIANT` holds too), without the copy."""
    T = meta.num_tokens
    if not kv_written:
        write_kv(kv_cache, meta.slot_mapping, k[:T], v[:T])
    grp = meta.groups[0]
    assert isinstance(grp, _DecodeGroup)
    live = cpu_attention.decode_attention_stored(q[:T], kv_cache, grp.block_ids, grp.seq_lens, scale)
    if q.shape[0] == T:
        return live
    out = q.new_zeros(q.shape)
    out[:T] = live
    return out


def invariant_paged_attention(meta: AttentionMetadata, kv_cache: torch.Tensor, q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, scale: float, *,
                              kv_written: bool = False) -> torch.Tensor:
    """Paged attention whose every live row is one query of the in-place decode kernel: the step's
    K/V are written to the cache first, then row r at position p attends the keys at positions
    0..p through its sequence's block table. The kernel's reduction over keys runs in chunks of 8
    aligned to position 0, in order, whatever the task split, so a row gives the same bits in a
    one-chunk prefill, a later chunk, over a cached prefix, in a verify step or as a decode row.
    q/k/v: `[rows, H, D]`, rows >= T; padding rows get zeros."""
    T = meta.num_tokens
    if T == 0:
        return q.new_zeros(q.shape)
    if not kv_written:
        write_kv(kv_cache, meta.slot_mapping, k[:T], v[:T])
    if meta.is_plain_decode:               # one decode group, rows in batch order
        grp = meta.groups[0]
        assert isinstance(grp, _DecodeGroup)
        live = cpu_attention.decode_attention(q[:T], kv_cache, grp.block_ids, grp.seq_lens, scale)
    elif meta.span_rows is None or meta.span_block_ids is None or meta.row_lens is None:
        raise ValueError("invariant_paged_attention: the metadata has no per-row spans (built with INVARIANT off).")
    else:
        live = cpu_attention.rows_attention(q[:T], kv_cache, meta.span_block_ids, meta.span_rows, meta.row_lens,
                                            scale)
    if q.shape[0] == T:
        return live
    out = q.new_zeros(q.shape)
    out[:T] = live
    return out


def sdpa_paged_attention(meta: AttentionMetadata, kv_cache: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, scale: float, *,
                         in_place_decode: bool = False, prefill_kernel: bool = False,
                         kv_written: bool = False) -> torch.Tensor:
    """Reference paged attention for mixed prefill/decode batches. q/k/v: `[rows, H, D]`, rows >= T.
    `in_place_decode`: decode groups read the cache in place (`cpu_attention`) instead of SDPA;
    `prefill_kernel`: prompts with no cached prefix go to `cpu_attention.prefill_attention`;
    `kv_written`: the live rows' k and v are in the cache already."""
    T = meta.num_tokens
    rows, hq, d = q.shape
    hkv = k.shape[1]
    if not kv_written:
        write_kv(kv_cache, meta.slot_mapping, k[:T], v[:T])
    if rows == T and meta.is_plain_decode:
        grp = meta.groups[0]
        assert isinstance(grp, _DecodeGroup)
        if in_place_decode:
            return cpu_attention.decode_attention(q, kv_cache, grp.block_ids, grp.seq_lens, scale)
        return _decode_in_order(grp, kv_cache, q, scale)
    out = q.new_empty(rows, hq, d)  # [rows, Hq, D]; every live row is written below
    out[T:].zero_()                 # padding rows
    for start, n in meta.causal_spans:
        # NOTE: a prefill with no cached prefix attends to exactly its own rows: no cache gather.
        if prefill_kernel:
            out[start:start + n] = cpu_attention.prefill_attention(q[start:start + n], k[start:start + n],
                                                                   v[start:start + n], scale)
            continue
        qs, ks, vs = (x[start:start + n].transpose(0, 1)[None] for x in (q, k, v))   # [1, H, n, D]
        os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=hq != hkv)
        out[start:start + n] = os_[0].transpose(0, 1)
    for grp in meta.groups:
        if isinstance(grp, _DecodeGroup) and in_place_decode:
            og = cpu_attention.decode_attention(q.index_select(0, grp.row_ids), kv_cache, grp.block_ids,
                                                grp.seq_lens, scale)
            out.index_copy_(0, grp.row_ids, og)
            continue
        kg, vg = _gather_kv(kv_cache, grp.block_ids)                  # [G, Hkv, L, D]
        if isinstance(grp, _DecodeGroup):
            g = grp.row_ids.numel()
            qg = q.index_select(0, grp.row_ids).view(g, hkv, hq // hkv, d)   # [G, Hkv, Hq/Hkv, D]
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=grp.mask, scale=scale)
            out.index_copy_(0, grp.row_ids, og.reshape(g, hq, d))
            continue
        q_pad = torch.cat([q[:T], q.new_zeros(1, hq, d)])             # [T+1, Hq, D]
        qg = q_pad[grp.q_index].transpose(1, 2)                        # [G, Hq, qmax, D]
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=grp.mask, scale=scale, enable_gqa=hq != hkv)
        og = og.transpose(1, 2).reshape(-1, hq, d)                     # [G*qmax, Hq, D]
        out.index_copy_(0, grp.row_ids, og.index_select(0, grp.out_index))
    return out


def _decode_in_order(grp: _DecodeGroup, kv_cache: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Every row is a one-token sequence, in batch order: q and the output need no row gather or scatter."""
    rows, hq, d = q.shape
    hkv = kv_cache.shape[3]
    kg, vg = _gather_kv(kv_cache, grp.block_ids)                      # [G, Hkv, L, D]
    og = F.scaled_dot_product_attention(q.reshape(rows, hkv, hq // hkv, d), kg, vg, attn_mask=grp.mask, scale=scale)
    return og.reshape(rows, hq, d)


class ForwardBatch:
    """The `batch` argument of every model forward: live attention metadata + the stage's KV cache.

    `meta` is swapped each step (graph runners keep one ForwardBatch for the life of a graph).
    `kv_caches` is indexed by global layer id; other stages' slots are None.
    """

    def __init__(self, meta: AttentionMetadata | None, kv_caches: list[torch.Tensor | None],
                 states: list | None = None):
        self.meta = meta
        self.kv_caches = kv_caches
        # per global layer id, a recurrent layer's state pools (tensors `[slots, ...]`; kvcache/state.py), else None
        self.states = states

    def attention(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float, *, kv_written: bool = False) -> torch.Tensor:
        """q: `[rows, Hq, D]`, k/v: `[rows, Hkv, D]` -> `[rows, Hq, D]`. `kv_written`: the caller
        wrote the live rows' k and v at `kv_target`'s slots itself."""
        cache = self.kv_caches[layer_id]
        if cache is None:
            raise RuntimeError(f"Layer {layer_id} has no KV cache on this stage.")
        if self.meta is None:
            raise RuntimeError("Attention ran before the step's metadata was set.")
        return paged_attention(self.meta, cache, q, k, v, scale, kv_written=kv_written)

    def kv_target(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the layer's KV cache, the live rows' flat slots `[T]`) for a model that writes the
        step's k and v itself (the eager rope op) and then calls `attention(..., kv_written=True)`;
        None where attention must write them (graph batches)."""
        cache = self.kv_caches[layer_id]
        if cache is None or self.meta is None:
            return None
        return cache, self.meta.slot_mapping
