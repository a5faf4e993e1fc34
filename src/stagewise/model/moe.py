"""Mixture-of-experts MLP blocks (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE): a router picks k experts per
token, the (token, expert) pairs are grouped by expert, each active expert runs once over all its
rows, and its outputs are added back per token with the routing weights. A layer's experts are held
stacked in one `[E * rows, K]` weight per projection (float, or quantized as the file stores them),
and a step reads only the active experts' slices: batch-1 decode touches k experts, not E.
"""
from __future__ import annotations

from typing import Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.kernels import quant
from stagewise.kernels.quant import QuantizedWeight
from stagewise.kernels.quant_pack import PANEL, ROW_ALIGN
from stagewise.model.cpu_gemm import Linear
from stagewise.model.cpu_gemm import linear as float_linear
from stagewise.model.layers import FusedLinear, GatedMLP, activation, eager_only
from stagewise.model.quantized import QuantLinear


def num_experts_of(hf_config) -> int:
    """Experts per MoE layer (transformers names it `num_experts` or, for Mixtral, `num_local_experts`)."""
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0)


class RouterLinear(Linear):
    """A router (or a shared expert's gate): kept float where the rest is quantized, as transformers and
    llama.cpp keep it, since it decides which experts run."""

    keep_float = True


class ExpertLinear(FusedLinear):
    """One projection of all of a layer's experts, stacked by output rows: expert e owns rows
    [e * R, (e + 1) * R) (R = the rows of its `parts`, e.g. its gate then its up rows), and
    `hf_parts` names each expert's checkpoint tensors (`experts.{e}.gate_proj`). Called per expert
    (`expert_linear`), never as a whole; never packed for the float kernels (their packed layout is
    per matrix, not per expert slice)."""

    def __init__(self, in_features: int, num_experts: int, parts: tuple[tuple[str, int], ...], dtype: torch.dtype,
                 prefix: str = "experts"):
        named = tuple((f"{prefix}.{e}.{name}", rows) for e in range(num_experts) for name, rows in parts)
        super().__init__(in_features, named, False, dtype)
        self.num_experts, self.expert_rows = num_experts, sum(rows for _, rows in parts)
        # quantized, an expert's rows must start on the kernels' panel pairs to be sliced out of the
        # stacked panels; other shapes keep float rows (a GGUF file's blocks are dequantized)
        self.keep_float = any(rows % ROW_ALIGN for _, rows in parts)

    def pack_(self) -> bool:
        return False


def _quantized_pieces(proj: QuantLinear, first: int, rows: int) -> list[QuantizedWeight | torch.Tensor]:
    """Rows [first, first + rows) of a QuantLinear as slices of its segments' buffers: packed panels
    (a QuantizedWeight) or float rows."""
    pieces: list[QuantizedWeight | torch.Tensor] = []
    for i, seg in enumerate(proj.segments):
        lo, hi = max(first, seg.start), min(first + rows, seg.start + seg.rows)
        if lo >= hi:
            continue
        data, local = getattr(proj, f"segment{i}"), lo - seg.start
        if seg.qtype is None:
            pieces.append(data[local:local + hi - lo])
        else:
            panels = -(-(hi - lo) // ROW_ALIGN) * (ROW_ALIGN // PANEL)
            start = local // PANEL
            pieces.append(QuantizedWeight(seg.qtype, (hi - lo, proj.in_features),
                                          data[start:start + panels], packed=True))
    return pieces


def expert_linear(x: torch.Tensor, proj: nn.Module, expert: int, rows: int) -> torch.Tensor:
    """`x @ W_e.T` for expert `expert`'s `rows` rows of a stacked projection (an `ExpertLinear`, or
    the `QuantLinear` that replaced it), reading only that expert's weights."""
    first = expert * rows
    if not isinstance(proj, QuantLinear):
        return float_linear(x, cast(Linear, proj).weight[first:first + rows])
    pieces = _quantized_pieces(proj, first, rows)
    if all(isinstance(p, QuantizedWeight) for p in pieces):
        weights = cast(list[QuantizedWeight], pieces)
        if len(weights) == 1:
            return quant.linear(x, weights[0], exact=proj.exact)
        return quant.linear_cat(x, weights, exact=proj.exact)     # x quantized once for every part
    outs = [quant.linear(x, p, exact=proj.exact) if isinstance(p, QuantizedWeight) else float_linear(x, p)
            for p in pieces]
    return torch.cat(outs, -1)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E]` -> (weights `[T, k]` in the logits' dtype, expert ids `[T, k]`): softmax
    over all experts in float32, the top k, renormalised to sum to 1 when `normalize` (Mixtral;
    Qwen-MoE with `norm_topk_prob`), as transformers' routers compute them."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


# One token's chosen experts at once: `up_fn(x, experts)` -> each expert's activation (its gate/up
# projections of the one row, every expert's in one kernel call), `down_fn(act, e)` -> its output.
OneRow = tuple[Callable[[torch.Tensor, list[int]], list[torch.Tensor]], Callable[[torch.Tensor, int], torch.Tensor]]


@eager_only   # data-dependent grouping: a compiled stage body runs it eagerly (a graph break)
def grouped_by_expert(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                      expert_fn: Callable[[torch.Tensor, int], torch.Tensor], one_row: OneRow | None = None
                      ) -> torch.Tensor:
    """The weighted sum of each token's chosen experts: (token, expert) pairs sorted by expert
    (ascending, as transformers adds them), `expert_fn(rows, e)` once per active expert over all its
    rows, outputs added back per token. One row (batch-1 decode) with `one_row`: the k experts' gate/up
    projections in one call (the row quantized once, the threads started once), the same bits."""
    if one_row is not None and x.shape[0] == 1:
        return _one_row(x, ids, weights, one_row)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens, pair_weights = order // k, weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start:start + count]
            y = expert_fn(x[rows], expert)
            out.index_add_(0, rows, (y * pair_weights[start:start + count, None]).to(x.dtype))
            start += count
    return out


def _one_row(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, one_row: OneRow) -> torch.Tensor:
    """`grouped_by_expert` for one row, in its order and arithmetic (ascending experts, each output
    times its weight in the weights' dtype, added to a zero row in x's dtype)."""
    up_fn, down_fn = one_row
    pairs = sorted((e, j) for j, e in enumerate(ids[0].tolist()))
    acts = up_fn(x, [e for e, _ in pairs])
    out = torch.zeros_like(x)
    for (e, j), a in zip(pairs, acts):
        out += (down_fn(a, e) * weights[0, j].view(1, 1)).to(x.dtype)
    return out


def run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: nn.Module, down: nn.Module,
                act: Callable[[torch.Tensor], torch.Tensor], num_experts: int, inter: int) -> torch.Tensor:
    """Gated experts stacked per projection: gate/up then down per active expert."""
    hidden = x.shape[1]

    def one(rows: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = expert_linear(rows, gate_up, expert, 2 * inter).chunk(2, dim=-1)
        return expert_linear(act(gate) * up, down, expert, hidden)

    def ups(row: torch.Tensor, experts: list[int]) -> list[torch.Tensor]:
        both = experts_linear(row, gate_up, experts, 2 * inter)
        return [act(g) * u for g, u in (y.chunk(2, dim=-1) for y in both)]
    return grouped_by_expert(x, ids, weights, num_experts, one,
                             (ups, lambda a, e: expert_linear(a, down, e, hidden)))


def experts_linear(x: torch.Tensor, proj: nn.Module, experts: list[int], rows: int) -> list[torch.Tensor]:
    """`expert_linear` of the same `x` through several experts: one kernel call where every piece is
    quantized panels (x quantized once), else one call per expert."""
    if isinstance(proj, QuantLinear):
        pieces = [_quantized_pieces(proj, e * rows, rows) for e in experts]
        if all(len(p) == 1 and isinstance(p[0], QuantizedWeight) for p in pieces):
            both = quant.linear_cat(x, [cast(QuantizedWeight, p[0]) for p in pieces], exact=proj.exact)
            return list(both.split(rows, dim=-1))
    return [expert_linear(x, proj, e, rows) for e in experts]


class SparseMoE(nn.Module):
    """A routed MLP: `gate` (the router, kept float), the experts' stacked `gate_up_exps` and
    `down_exps`, and optionally a shared expert whose output a sigmoid gate scales (Qwen2-MoE).
    `names`: the checkpoint's (gate, up, down) names of an expert's projections."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, normalize: bool, act: str,
                 dtype: torch.dtype, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 shared_inter: int = 0):
        super().__init__()
        self.num_experts, self.top_k, self.normalize, self.inter = num_experts, top_k, normalize, inter
        if not 0 < top_k <= num_experts:
            raise ValueError(f"A MoE layer routes each token to between 1 and its {num_experts} experts, "
                             f"not {top_k}; the config's num_experts_per_tok is wrong.")
        self.gate = RouterLinear(hidden, num_experts, bias=False, dtype=dtype)
        gate, up, down = names
        self.gate_up_exps = ExpertLinear(hidden, num_experts, ((gate, inter), (up, inter)), dtype)
        self.down_exps = ExpertLinear(inter, num_experts, ((down, hidden),), dtype)
        self.act = activation(act)
        self.shared_expert = GatedMLP(hidden, shared_inter, act, False, dtype) if shared_inter else None
        self.shared_expert_gate = RouterLinear(hidden, 1, bias=False, dtype=dtype) if shared_inter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.normalize)        # [T, k] each
        out = run_experts(x, ids, weights, self.gate_up_exps, self.down_exps, self.act, self.num_experts, self.inter)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None   # built together
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
