"""Toy stage models for graph tests: the stagewise model contract in a few linear layers.

Weights are seeded by global layer id, so any partition of the same toy computes the same
function; every layer calls `batch.attention` on a real paged KV cache.
"""
from __future__ import annotations

import torch
from torch import nn

from stagewise.model.attention import AttentionMetadata, ForwardBatch
from stagewise.parallel.partition import StageInfo, stage_infos
from stagewise.parallel.proxy import FULL_CONTRACT, HIDDEN_ONLY_CONTRACT, ProxyTensors

H, HEADS, KV_HEADS, HEAD_DIM, VOCAB, MAX_POS = 16, 2, 1, 8, 50, 128
BLOCK_SIZE, NUM_BLOCKS = 4, 64


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


class ToyLayer(nn.Module):
    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.qkv = nn.Linear(H, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, H)
        self.mlp = nn.Linear(H, H)
        self.pos = nn.Embedding(MAX_POS, H)
        _seeded(self, 100 + layer_id)

    def attend(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        T = x.shape[0]
        x = x + self.pos(positions)
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        out = batch.attention(self.layer_id, q.reshape(T, HEADS, HEAD_DIM), k.reshape(T, KV_HEADS, HEAD_DIM),
                              v.reshape(T, KV_HEADS, HEAD_DIM), HEAD_DIM ** -0.5)   # [T, Hq, D]
        return self.o(out.reshape(T, -1))


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ToyStage(nn.Module):
    """Layers `[stage.start, stage.end)` of a toy; full contract (hidden + residual) or hidden-only."""

    def __init__(self, stage: StageInfo, full_contract: bool = True):
        super().__init__()
        self.stage, self.full_contract = stage, full_contract
        self.hidden_size = H
        self.proxy_keys = FULL_CONTRACT if full_contract else HIDDEN_ONLY_CONTRACT
        self.embed = _seeded(nn.Embedding(VOCAB, H), 7) if stage.is_first else None
        self.layers = nn.ModuleList(ToyLayer(i) for i in range(stage.start, stage.end))

    def forward(self, input_ids, positions, batch, *, input_embeds=None, pp_proxy_tensors=None):
        if self.stage.is_first:
            h = input_embeds if input_embeds is not None else self.embed(input_ids)
            res = torch.zeros_like(h)
        else:
            h = pp_proxy_tensors["hidden_states"]
            res = pp_proxy_tensors["residual"] if self.full_contract else None
        for layer in self.layers:
            h, res = self._layer(layer, h, res, positions, batch)
        if self.stage.is_last:
            return _norm(h + res) if res is not None else _norm(h)
        if self.full_contract:
            return ProxyTensors({"hidden_states": h, "residual": res})
        return ProxyTensors({"hidden_states": h})

    def _layer(self, layer, h, res, positions, batch):
        if res is None:       # hidden-only: the residual stream lives inside the block
            h = h + layer.attend(_norm(h), positions, batch)
            return h + torch.tanh(layer.mlp(_norm(h))), None
        res = h + res          # fused add + norm, as in pre-norm families
        h = layer.attend(_norm(res), positions, batch)
        res = h + res
        return torch.tanh(layer.mlp(_norm(res))), res


def kv_caches(stage: StageInfo, device="cpu") -> list:
    return [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device) if stage.owns(i) else None
            for i in range(stage.num_layers)]


def clone_batch(batch: ForwardBatch) -> ForwardBatch:
    return ForwardBatch(batch.meta, [None if c is None else c.clone() for c in batch.kv_caches])


def toy_pipeline(num_layers: int, pp_size: int, full_contract: bool = True, device="cpu"):
    """[(model, batch)] per stage."""
    return [(ToyStage(info, full_contract).eval().to(device), ForwardBatch(None, kv_caches(info, device)))
            for info in stage_infos(num_layers, pp_size)]


class Step:
    """One step's live inputs: sequences as (num_new_tokens, num_cached_tokens), each in its own blocks."""

    def __init__(self, seqs: list[tuple[int, int]], seed: int = 0, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        per_seq = 6   # blocks per sequence slot (24 tokens); block 0 stays the scratch block
        self.query_lens = [q for q, _ in seqs]
        self.seq_lens = [q + c for q, c in seqs]
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(seqs))]
        self.meta = AttentionMetadata.build(self.query_lens, self.seq_lens, tables, BLOCK_SIZE, device)
        self.num_tokens = self.meta.num_tokens
        self.positions = torch.cat([torch.arange(c, c + q) for q, c in seqs]).to(device)
        self.input_ids = torch.randint(0, VOCAB, (self.num_tokens,), generator=gen).to(device)
        self.is_decode_only = all(q == 1 for q in self.query_lens)


def fill_history(batches: list[ForwardBatch], seed: int = 1) -> None:
    """Random KV everywhere but scratch block 0: cached prefixes have something to attend to."""
    gen = torch.Generator().manual_seed(seed)
    for batch in batches:
        for cache in batch.kv_caches:
            if cache is not None:
                cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.device))
                cache[:, 0].zero_()
