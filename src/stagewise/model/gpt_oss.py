"""gpt-oss (`GptOssForCausalLM`) on the Llama-style decoder: biased q/k/v/o projections, attention
sinks, sliding-window layers alternating with full ones (`layer_types`; the cache holds every
position, the window is a mask), YaRN rope (`model.layers`), and a routed MLP whose router has a
bias (top-k of the logits, softmax over the k) and whose experts have biases and a clamped SwiGLU.
Experts are held as their checkpoint stores them: from a directory as transformers does
(`gate_up_proj` `[E, H, 2I]` with gate and up columns interleaved, `down_proj` `[E, I, H]`, or the
released MXFP4 `*_blocks` / `*_scales`), from a GGUF file as llama.cpp stacks them
(`ffn_{gate,up,down}_exps` `[E, rows, K]`). MXFP4 stays in its bytes: either layout is packed per
expert at load into the MXFP4 kernels' panels and run through them, so a step reads only the
routed experts.
"""
from __future__ import annotations

import torch
from torch import nn

from stagewise.checkpoint.gguf_meta import GGMLType
from stagewise.kernels import quant, quant_pack
from stagewise.kernels.quant import QuantizedWeight
from stagewise.kernels.quant_formats import Fields
from stagewise.model.attention import ForwardBatch
from stagewise.model.llama import LlamaAttention, LlamaForCausalLM
from stagewise.model.moe import RouterLinear, grouped_by_expert, num_experts_of
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


def _hf_mxfp4_pack(target: torch.Tensor, value: torch.Tensor, scales: bool) -> None:
    """One expert's transformers MXFP4 `*_blocks` `[R, G, 16]` (low nibble element 2j, high 2j + 1:
    not GGUF's j and j + 16) or `*_scales` `[R, G]` (E8M0: its value is GGUF's) into its part of
    the expert's packed panels `target` `[P, G * 272]` (per chunk: 16 scale bytes, 256 of codes)."""
    rows, groups = value.shape[:2]
    if scales:
        fields = Fields(GGMLType.MXFP4, torch.zeros(rows, groups * 32, dtype=torch.uint8), value)
    else:
        codes = torch.stack([value & 15, value >> 4], -1).reshape(rows, groups * 32)
        fields = Fields(GGMLType.MXFP4, codes, torch.zeros(rows, groups, dtype=torch.uint8))
    part = slice(0, 16) if scales else slice(16, None)
    chunks = target.view(target.shape[0], groups, -1)
    chunks[..., part] = quant_pack.encode(fields).view(chunks.shape)[..., part]


class GptOssExperts(nn.Module):
    """A layer's experts in transformers' layout (parameter names as the checkpoint's): float, or
    MXFP4 (`mxfp4`: the released checkpoints' `*_blocks` and `*_scales`, packed per expert at load
    into the MXFP4 kernels' panels, held in `*_blocks`: the same bytes, no float copy)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, alpha: float, limit: float, dtype: torch.dtype,
                 mxfp4: bool = False):
        super().__init__()
        self.mxfp4, self.alpha, self.limit = mxfp4, alpha, limit
        self.exact = True                                 # its mode set with the quantized layers'
        self.held_qtype = GGMLType.MXFP4 if mxfp4 else None
        if mxfp4:
            if hidden % 32 or inter % 32:
                raise ValueError(f"MXFP4 experts hold blocks of 32 values, but hidden_size {hidden} or "
                                 f"intermediate_size {inter} is not a multiple of 32; config.json is wrong.")
            self.shapes = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
            for proj, (rows, k) in self.shapes.items():
                packed = (num_experts, quant_pack.num_panels(rows), quant_pack.panel_bytes(GGMLType.MXFP4, k))
                setattr(self, f"{proj}_blocks", nn.Parameter(torch.empty(packed, dtype=torch.uint8), False))
            self.checkpoint_shapes: dict[str, tuple[int, ...]] = {}
            for proj, (rows, k) in self.shapes.items():
                self.checkpoint_shapes.update({f"{proj}_blocks": (num_experts, rows, k // 32, 16),
                                               f"{proj}_scales": (num_experts, rows, k // 32)})
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter, dtype=dtype))
            self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden, dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter, dtype=dtype))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))

    def held_weights(self) -> dict[str, tuple[int, ...]]:
        return self.checkpoint_shapes if self.mxfp4 else {}

    def load_rows(self, name: str, start: int, value) -> None:
        """A checkpoint's `*_blocks` or `*_scales` (uint8, its shape), packed expert by expert."""
        leaf = name.rpartition(".")[2]
        want = self.checkpoint_shapes[leaf]
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or tuple(value.shape) != want:
            raise ValueError(f"Checkpoint tensor {name} must be uint8 of shape {want} (MXFP4 experts), not "
                             f"{getattr(value, 'dtype', type(value).__name__)} {tuple(getattr(value, 'shape', ()))}.")
        proj, _, part = leaf.rpartition("_")
        target = getattr(self, f"{proj}_blocks")
        with torch.no_grad():
            for e in range(want[0]):
                _hf_mxfp4_pack(target[e], value[e], part == "scales")

    def expert_weight(self, proj: str, e: int) -> QuantizedWeight:
        """Expert e's packed rows of `proj` (a view: nothing copied)."""
        return QuantizedWeight(GGMLType.MXFP4, self.shapes[proj], getattr(self, f"{proj}_blocks")[e], packed=True)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert `e` on rows x `[n, H]`: the clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)`,
        gate clamped above at `limit`, up to [-limit, limit]."""
        if self.mxfp4:
            gate_up = _mxfp4_linear(x, [self.expert_weight("gate_up_proj", e)], self.gate_up_proj_bias[e], self.exact)
        else:
            gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]     # [n, 2I], gate/up interleaved
        act = _swiglu(gate_up[..., ::2], gate_up[..., 1::2], self.alpha, self.limit)
        if self.mxfp4:
            return _mxfp4_linear(act, [self.expert_weight("down_proj", e)], self.down_proj_bias[e], self.exact)
        return act @ self.down_proj[e] + self.down_proj_bias[e]


def _swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU: gate clamped above at `limit`, up to [-limit, limit]."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ExpertStack(nn.Module):
    """One projection of every expert as a GGUF file stacks it: `weight` `[E, R, K]` float, or MXFP4
    packed per expert into the quantized kernels' panels (`[E, panels, panel_bytes]`: the file's
    bytes reordered, no float copy), and `bias` `[E, R]`. `exact`: the quantized layers' mode (set
    with theirs at load: float32 activations, else 8-bit ones)."""

    def __init__(self, num_experts: int, rows: int, k: int, stored: str | None, dtype: torch.dtype):
        super().__init__()
        self.shape, self.mxfp4, self.exact = (num_experts, rows, k), stored == "MXFP4", True
        if self.mxfp4 and k % 32:
            raise ValueError(f"MXFP4 expert rows hold blocks of 32 values, but these rows have {k}; the GGUF "
                             f"file is inconsistent.")
        self.raw_types = (GGMLType.MXFP4,) if self.mxfp4 else ()
        self.held_qtype = GGMLType.MXFP4 if self.mxfp4 else None     # its mode set with the quantized layers'
        packed = (num_experts, quant_pack.num_panels(rows), quant_pack.panel_bytes(GGMLType.MXFP4, k))
        self.weight = nn.Parameter(torch.empty(packed, dtype=torch.uint8), False) if self.mxfp4 \
            else nn.Parameter(torch.empty(num_experts, rows, k, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, rows, dtype=dtype))

    def held_weights(self) -> dict[str, tuple[int, ...]]:
        return {"weight": self.shape} if self.mxfp4 else {}

    def load_rows(self, name: str, start: int, value) -> None:
        """The loader's MXFP4 tensor (`model.gguf.RawBlocks`), each expert packed from its bytes."""
        if getattr(value, "qtype", None) != GGMLType.MXFP4 or tuple(value.shape) != self.shape:
            raise ValueError(f"Tensor {name} must be MXFP4 of shape {self.shape} like the file's other expert "
                             f"tensors, not {getattr(value, 'qtype', 'float')} {tuple(value.shape)}.")
        e, rows, k = self.shape
        raw = value.data.reshape(e, -1)
        with torch.no_grad():
            for i in range(e):
                self.weight[i].copy_(QuantizedWeight.from_gguf(raw[i], GGMLType.MXFP4, (rows, k)).pack().data)

    def expert_weight(self, e: int) -> QuantizedWeight:
        """Expert e's packed rows (a view: nothing copied)."""
        return QuantizedWeight(GGMLType.MXFP4, self.shape[1:], self.weight[e], packed=True)

    def linear(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x `[n, K]` through expert e's rows -> `[n, R]`."""
        if not self.mxfp4:
            return torch.nn.functional.linear(x, self.weight[e], self.bias[e])
        return _mxfp4_linear(x, [self.expert_weight(e)], self.bias[e], self.exact)


def _mxfp4_linear(x: torch.Tensor, weights: list[QuantizedWeight], bias: torch.Tensor, exact: bool) -> torch.Tensor:
    """x through packed MXFP4 weights side by side: the quantized kernels on the CPU (x quantized once
    for all of them), else (another device) their values dequantized on the CPU."""
    if x.device.type != "cpu":
        w = torch.cat([quant.dequantize(QuantizedWeight(q.qtype, q.shape, q.data.cpu(), True)) for q in weights])
        return torch.nn.functional.linear(x, w.to(x.device, x.dtype), bias)
    rows = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()     # the kernels' activation types
    y = quant.linear(rows, weights[0], bias, exact) if len(weights) == 1 else \
        quant.linear_cat(rows, weights, bias, exact)
    return y.to(x.dtype)


class GgufExperts(nn.Module):
    """A layer's experts in llama.cpp's layout: gate, up and down stacked separately."""

    def __init__(self, hidden: int, inter: int, num_experts: int, alpha: float, limit: float, stored: dict,
                 dtype: torch.dtype):
        super().__init__()
        self.gate_exps = ExpertStack(num_experts, inter, hidden, stored.get("ffn_gate_exps"), dtype)
        self.up_exps = ExpertStack(num_experts, inter, hidden, stored.get("ffn_up_exps"), dtype)
        self.down_exps = ExpertStack(num_experts, hidden, inter, stored.get("ffn_down_exps"), dtype)
        self.alpha, self.limit = alpha, limit

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = self.gate_exps, self.up_exps
        if gate.mxfp4 and up.mxfp4:      # one kernel call for both: the rows quantized once
            bias = torch.cat([gate.bias[e], up.bias[e]])
            both = _mxfp4_linear(x, [gate.expert_weight(e), up.expert_weight(e)], bias, gate.exact)
            g, u = both.split(gate.shape[1], -1)
            act = _swiglu(g, u, self.alpha, self.limit)
        else:
            act = _swiglu(gate.linear(x, e), up.linear(x, e), self.alpha, self.limit)
        return self.down_exps.linear(act, e)

    def ups(self, x: torch.Tensor, experts: list[int]) -> list[torch.Tensor]:
        """One row's activations for several experts: every gate and up projection in one kernel call."""
        gate, up = self.gate_exps, self.up_exps
        if not (gate.mxfp4 and up.mxfp4):
            return [_swiglu(gate.linear(x, e), up.linear(x, e), self.alpha, self.limit) for e in experts]
        weights = [w for e in experts for w in (gate.expert_weight(e), up.expert_weight(e))]
        bias = torch.cat([b for e in experts for b in (gate.bias[e], up.bias[e])])
        both = _mxfp4_linear(x, weights, bias, gate.exact).split(gate.shape[1], -1)
        return [_swiglu(both[2 * i], both[2 * i + 1], self.alpha, self.limit) for i in range(len(experts))]


def _run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 experts: GptOssExperts | GgufExperts, num_experts: int) -> torch.Tensor:
    """Each token's chosen experts weighted and summed, one call per active expert over all its rows."""
    one_row = (experts.ups, experts.down_exps.linear) if isinstance(experts, GgufExperts) else None
    return grouped_by_expert(x, ids, weights, num_experts, experts.expert, one_row)


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
        alpha, limit = float(getattr(hf_config, "swiglu_alpha", 1.702)), float(getattr(hf_config, "swiglu_limit", 7.0))
        stored = getattr(hf_config, "gguf_expert_types", None)      # set for a GGUF file (gguf_meta)
        quant = getattr(hf_config, "quantization_config", None) or {}
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        mxfp4 = quant.get("quant_method") == "mxfp4"        # the released checkpoints' experts
        if quant and not mxfp4:
            raise ValueError(f"gpt-oss checkpoints quantized with {quant.get('quant_method')!r} are not supported; "
                             f"use the MXFP4 or a float checkpoint.")
        self.experts: GptOssExperts | GgufExperts = (
            GptOssExperts(hidden, hf_config.intermediate_size, self.num_experts, alpha, limit, dtype, mxfp4)
            if stored is None else
            GgufExperts(hidden, hf_config.intermediate_size, self.num_experts, alpha, limit, stored, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)         # [T, k] each
        weights = torch.softmax(top, dim=-1)                                # in the logits' dtype, as transformers
        return _run_experts(x, ids, weights, self.experts, self.num_experts)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: every layer routed; sinks and windows in attention. Stages run their layers as modules
    (the one-call decode op knows neither sinks nor windows). Under tensor parallelism each rank keeps
    its q heads' sinks and every expert (replicated), as for the other MoE families."""

    attention_class = GptOssAttention

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
