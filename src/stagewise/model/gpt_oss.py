"""gpt-oss (`GptOssForCausalLM`) on the Llama-style decoder: biased q/k/v/o projections, attention
sinks, sliding-window layers alternating with full ones (`layer_types`; the cache holds every
position, the window is a mask), YaRN rope (`model.layers`), and a routed MLP whose router has a
bias (top-k of the logits, softmax over the k) and whose experts have biases and a clamped SwiGLU.
Experts are held as transformers stores them: `gate_up_proj` `[E, H, 2I]` with gate and up
columns interleaved, `down_proj` `[E, I, H]`; a step reads only the routed experts' slices.
"""
from __future__ import annotations

import torch
from torch import nn

from stagewise.model.attention import ForwardBatch
from stagewise.model.llama import LlamaAttention, LlamaForCausalLM
from stagewise.model.moe import RouterLinear, num_experts_of
from stagewise.model.sink_attention import sink_attention


class GptOssAttention(LlamaAttention):
    """Llama attention plus one learned sink logit per query head, and a window on sliding layers."""

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, **kwargs):
        super().__init__(hf_config, layer_id, dtype, **kwargs)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=dtype))
        kinds = getattr(hf_config, "layer_types", None) or []
        sliding = layer_id < len(kinds) and kinds[layer_id] == "sliding_attention"
        self.window: int | None = getattr(hf_config, "sliding_window", None) if sliding else None

    def attend(self, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               written: bool) -> torch.Tensor:
        return sink_attention(batch, self.layer_id, q, k, v, self.scale, self.sinks, self.window, kv_written=written)


class GptOssExperts(nn.Module):
    """A layer's experts in transformers' layout (parameter names and shapes as the checkpoint's)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, alpha: float, limit: float, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter, dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden, dtype=dtype))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        self.alpha, self.limit = alpha, limit

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert `e` on rows x `[n, H]`: the clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)`,
        gate clamped above at `limit`, up to [-limit, limit]."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]       # [n, 2I], gate/up interleaved
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e] + self.down_proj_bias[e]


@torch.compiler.disable   # data-dependent grouping: a compiled stage body runs it eagerly (a graph break)
def _run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: GptOssExperts,
                 num_experts: int) -> torch.Tensor:
    """Each token's chosen experts weighted and summed: rows grouped by expert (ascending, as
    transformers adds them), one call per active expert over all its rows."""
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
            y = experts.expert(x[rows], expert)
            out.index_add_(0, rows, (y * pair_weights[start:start + count, None]).to(x.dtype))
            start += count
    return out


class GptOssMoE(nn.Module):
    """The router (a biased linear, kept float) and the experts; top-k of the logits, softmax over the k."""

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.top_k = num_experts_of(hf_config), hf_config.num_experts_per_tok
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"A MoE layer routes each token to between 1 and its {self.num_experts} experts, "
                             f"not {self.top_k}; the config's num_experts_per_tok is wrong.")
        hidden = hf_config.hidden_size
        self.router = RouterLinear(hidden, self.num_experts, bias=True, dtype=dtype)
        self.experts = GptOssExperts(hidden, hf_config.intermediate_size, self.num_experts,
                                     float(getattr(hf_config, "swiglu_alpha", 1.702)),
                                     float(getattr(hf_config, "swiglu_limit", 7.0)), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)         # [T, k] each
        weights = torch.softmax(top, dim=-1)                                # in the logits' dtype, as transformers
        return _run_experts(x, ids, weights, self.experts, self.num_experts)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: every layer routed; sinks and windows in attention. Stages run their layers as modules
    (the one-call decode op knows neither sinks nor windows) and tensor parallelism is not offered
    (the sinks are per head)."""

    attention_class = GptOssAttention
    tensor_parallel = False

    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return bias, bias

    def make_mlp(self, hf_config, layer_id: int, dtype: torch.dtype) -> nn.Module | None:
        return GptOssMoE(hf_config, dtype)

    def _warn_sliding_window(self, hf_config) -> None:
        pass        # the window layers are masked (GptOssAttention)

    def _plan_decode_layers(self) -> dict | None:
        return None
