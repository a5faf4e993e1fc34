"""Qwen3.5 (dense text): gated delta-rule linear-attention layers (three of every four by default)
beside gated full-attention layers, `(1 + w)` RMSNorms, partial rotary.

A linear layer keeps a fixed-size state per request instead of KV blocks: the window of its last
conv inputs and the delta rule's `[Hv, Dk, Dv]` matrix, in the slot `meta.state_slots` names for
each sequence (`batch.states[layer_id]`: the stage's pool, kvcache/state.py). A sequence whose step
starts at position 0 starts from a zero state. Only the full-attention layers use the paged KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.checkpoint.layer_kinds import recurrent_layers
from stagewise.model import delta_rule
from stagewise.model.attention import ForwardBatch
from stagewise.model.cpu_gemm import Linear
from stagewise.model.layers import FusedLinear, GatedMLP, apply_rotary, eager_only
from stagewise.model.llama import LlamaAttention, LlamaForCausalLM, head_dim_of
from stagewise.model.llama_dense import GemmaRMSNorm
from stagewise.model.moe import SparseMoE, num_experts_of


class Qwen35Attention(LlamaAttention):
    """Full attention whose q projection also yields a per-head output gate (`o_proj(attn * sigmoid(gate))`),
    with `(1 + w)` q/k norms per head and partial rotary."""

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, **kwargs):
        super().__init__(hf_config, layer_id, dtype, **{**kwargs, "qk_norm": True})
        hq, hkv, d, bias = self.num_heads, self.num_kv_heads, self.head_dim, kwargs.get("qkv_bias", False)
        # q_proj's rows are per head [query D, gate D]
        self.qkv_proj = FusedLinear(hf_config.hidden_size, (("q_proj", 2 * hq * d), ("k_proj", hkv * d),
                                                            ("v_proj", hkv * d)), bias, dtype)
        self.q_norm = GemmaRMSNorm(d, hf_config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, hf_config.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        T, hq, hkv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        qg = qkv[:, :2 * hq * d].view(T, hq, 2 * d)
        gate = qg[..., d:].reshape(T, hq * d)
        assert self.q_norm is not None and self.k_norm is not None
        q = apply_rotary(self.q_norm(qg[..., :d]), cos, sin)
        k = apply_rotary(self.k_norm(qkv[:, 2 * hq * d:(2 * hq + hkv) * d].view(T, hkv, d)), cos, sin)
        v = qkv[:, (2 * hq + hkv) * d:].view(T, hkv, d)
        out = self.attend(batch, q, k, v, False).reshape(T, -1)
        return self.o_proj(out * torch.sigmoid(gate))


class _Conv(nn.Module):
    """The depthwise conv's weight `[C, 1, K]` under the checkpoint's name (`conv1d.weight`)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))


@dataclass
class _StepPlan:
    """How a step's sequences meet the linear layers, worked out once per step (every layer shares it)."""

    fresh: list[int]                        # slots of sequences that start at position 0
    prompts: list[tuple[int, int, int]]     # (first row, rows, slot) of each sequence with several rows
    one_rows: torch.Tensor | None           # rows of the one-row sequences (decode rows), and their slots
    one_slots: torch.Tensor | None


def _step_plan(meta, device) -> _StepPlan:
    plan = meta.__dict__.get("_linear_plan")
    if plan is None:
        fresh, prompts, rows, slots, row = [], [], [], [], 0
        for n, total, slot in zip(meta.query_lens, meta.seq_lens, meta.state_slots):
            if total == n:
                fresh.append(slot)
            if n == 1:
                rows.append(row)
                slots.append(slot)
            elif n > 1:
                prompts.append((row, n, slot))
            row += n
        tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device) if xs else None
        plan = meta.__dict__["_linear_plan"] = _StepPlan(fresh, prompts, tensor(rows), tensor(slots))
    return plan


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention: q/k/v through a short causal conv, the gated delta rule over them
    (decay `exp(g)`, `g = -exp(A_log) * softplus(a + dt_bias)`, write strength `sigmoid(b)`), then a
    per-head RMSNorm gated by `silu(z)` and the output projection."""

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.hk, self.hv = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
        self.dk, self.dv = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
        if self.hv % self.hk:
            raise ValueError(f"linear_num_value_heads ({self.hv}) must be a multiple of linear_num_key_heads "
                             f"({self.hk}); the config is inconsistent.")
        self.kernel = hf_config.linear_conv_kernel_dim
        # value heads ordered tiled over the key heads (llama.cpp's files), not grouped by them (HF's)
        self.tiled = bool(getattr(hf_config, "linear_v_heads_tiled", False))
        key, value, hidden = self.hk * self.dk, self.hv * self.dv, hf_config.hidden_size
        self.conv_dim = 2 * key + value
        self.in_proj = FusedLinear(hidden, self.input_parts(), False, dtype)
        self.conv1d = _Conv(self.conv_dim, self.kernel, dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=dtype))
        self.norm_weight = nn.Parameter(torch.empty(self.dv, dtype=dtype))    # checkpoint: norm.weight
        self.eps = hf_config.rms_norm_eps
        self.out_proj = Linear(value, hidden, bias=False, dtype=dtype)

    def input_parts(self) -> tuple[tuple[str, int], ...]:
        """The checkpoint's input projections, fused into one (Qwen3.5: q/k/v, z, b and a apart)."""
        return (("in_proj_qkv", self.conv_dim), ("in_proj_z", self.hv * self.dv), ("in_proj_b", self.hv),
                ("in_proj_a", self.hv))

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden `[T, H]` -> (the conv's input q|k|v `[T, C]`, z `[T, Hv * Dv]`, b and a `[T, Hv]`)."""
        return self.in_proj(hidden).split([self.conv_dim, self.hv * self.dv, self.hv, self.hv], -1)

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's state: the conv window `[C, K-1]` (model dtype), the delta rule's `[Hv, Dk, Dv]` (float32)."""
        return [((self.conv_dim, self.kernel - 1), dtype), ((self.hv, self.dk, self.dv), torch.float32)]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        T = hidden.shape[0]
        mixed, z, b, a = self.project(hidden)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)      # [T, Hv] log decay
        core = self._recur(mixed, g, b.sigmoid(), batch)                           # [T, Hv, Dv]
        return self.out_proj(self._gated_norm(core, z.reshape(T, self.hv, self.dv)).reshape(T, -1))

    @eager_only     # per-sequence loops over the live metadata
    def _recur(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        meta, states = batch.meta, getattr(batch, "states", None)
        if meta is None or states is None or states[self.layer_id] is None or meta.state_slots is None:
            raise RuntimeError(f"Linear-attention layer {self.layer_id} has no recurrent state slots this step "
                               f"(the stage was built without a state pool, or graphs froze the batch).")
        conv_states, rec_states = states[self.layer_id]
        plan = _step_plan(meta, mixed.device)
        out = mixed.new_zeros(mixed.shape[0], self.hv, self.dv)     # rows past the live ones stay zero
        w = self.conv1d.weight
        for slot in plan.fresh:             # sequences that start this step: from a zero state
            conv_states[slot].zero_()
            rec_states[slot].zero_()
        for row, n, slot in plan.prompts:   # rows of one sequence: the conv over them, the chunked rule
            x = delta_rule.conv_rows(mixed[row:row + n], conv_states[slot], w)
            q, k, v = self._split(x)
            out[row:row + n] = delta_rule.chunked(q, k, v, g[row:row + n], beta[row:row + n], rec_states[slot],
                                                 self.tiled)
        if plan.one_rows is not None and plan.one_slots is not None:   # one row each: one batched step
            rows, slots = plan.one_rows, plan.one_slots
            x, window = delta_rule.conv_step(mixed.index_select(0, rows), conv_states.index_select(0, slots), w)
            conv_states.index_copy_(0, slots, window.to(conv_states.dtype))
            q, k, v = self._split(x)
            o, s = delta_rule.step(q, k, v, g.index_select(0, rows), beta.index_select(0, rows),
                                   rec_states.index_select(0, slots), self.tiled)
            rec_states.index_copy_(0, slots, s)
            out.index_copy_(0, rows, o)
        return out

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, key = x.shape[0], self.hk * self.dk
        return (x[:, :key].reshape(n, self.hk, self.dk), x[:, key:2 * key].reshape(n, self.hk, self.dk),
                x[:, 2 * key:].reshape(n, self.hv, self.dv))

    def _gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm per head (plain weight), in float32, then times silu(z) (transformers' RMSNormGated)."""
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.norm_weight * normed * F.silu(z.float())).to(x.dtype)


class NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's linear attention: Qwen3.5's, its inputs projected by two matrices whose rows run per key
    head: `in_proj_qkvz` [q Dk, k Dk, v and z (Hv/Hk) Dv each] and `in_proj_ba` [b, a (Hv/Hk) each]."""

    def input_parts(self) -> tuple[tuple[str, int], ...]:
        rep = self.hv // self.hk
        return (("in_proj_qkvz", self.hk * (2 * self.dk + 2 * rep * self.dv)), ("in_proj_ba", 2 * self.hv))

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T, hk, rep, dk, dv = hidden.shape[0], self.hk, self.hv // self.hk, self.dk, self.dv
        qkvz, ba = self.in_proj(hidden).split([hk * (2 * dk + 2 * rep * dv), 2 * self.hv], -1)
        q, k, v, z = qkvz.view(T, hk, -1).split([dk, dk, rep * dv, rep * dv], -1)
        b, a = ba.view(T, hk, 2 * rep).split([rep, rep], -1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
        return mixed, z.reshape(T, -1), b.reshape(T, -1), a.reshape(T, -1)


class Qwen35DecoderLayer(nn.Module):
    """Pre-norm block (`(1 + w)` norms) whose token mixer is gated delta-rule linear attention or gated
    full attention, by `layer_types`; the Llama blocks' carry of `hidden` + `residual`. `mlp`: a MoE block
    (Qwen3-Next's routed layers), else the config's dense gated MLP."""

    linear_class: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, mlp: nn.Module | None = None,
                 attention: type[LlamaAttention] = LlamaAttention, **attn_kwargs):
        super().__init__()
        self.layer_id, eps, hidden = layer_id, hf_config.rms_norm_eps, hf_config.hidden_size
        self.linear = layer_id in recurrent_layers(hf_config)
        if self.linear:
            self.linear_attn = self.linear_class(hf_config, layer_id, dtype)
        else:
            self.self_attn = Qwen35Attention(hf_config, layer_id, dtype, **attn_kwargs)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = mlp if mlp is not None else GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act,
                                                        False, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.linear_attn if self.linear else self.self_attn
        hidden, residual = self.post_attention_layernorm(mixer(hidden, cos, sin, batch), residual)
        return self.mlp(hidden), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Qwen3.5 dense text model. Stages run eager modules (no one-call decode, no captured graphs: the
    linear layers loop over the step's sequences) and tensor parallelism is not offered."""

    decoder_layer = Qwen35DecoderLayer
    one_call_decode = False
    tensor_parallel = False

    def __init__(self, hf_config, stage, dtype: torch.dtype):
        if head_dim_of(hf_config) % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim_of(hf_config)}.")
        super().__init__(hf_config, stage, dtype)
        if self.norm is not None:
            self.norm = GemmaRMSNorm(self.hidden_size, hf_config.rms_norm_eps, dtype)
        self.linear_ids = [i for i in recurrent_layers(hf_config) if stage.owns(i)]

    def hf_name(self, param_name: str) -> str:
        return super().hf_name(param_name.replace("linear_attn.norm_weight", "linear_attn.norm.weight"))

    def state_spec(self) -> dict[int, list[tuple[tuple[int, ...], torch.dtype]]]:
        """Per own linear layer, the shapes and dtypes of one request's state slot (empty: no recurrent layer)."""
        return {i: cast(Qwen35DecoderLayer, self.layers[i]).linear_attn.state_shapes(self.dtype)
                for i in self.linear_ids}

    def kv_layer_ids(self) -> list[int]:
        """The own layers that hold KV blocks (the full-attention ones)."""
        return [i for i in range(self.stage.start, self.stage.end) if i not in self.linear_ids]

    def _warn_sliding_window(self, hf_config) -> None:
        pass

    def _plan_decode_layers(self) -> dict | None:
        return None


class NextDecoderLayer(Qwen35DecoderLayer):
    linear_class = NextGatedDeltaNet


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5's layer kinds with its own linear-layer projections (`NextGatedDeltaNet`) and
    Qwen-MoE MLPs (softmax top-k, renormalised when `norm_topk_prob`, a shared expert behind a sigmoid
    gate) on the layers `decoder_sparse_step` / `mlp_only_layers` route."""

    decoder_layer = NextDecoderLayer

    def make_mlp(self, hf_config, layer_id: int, dtype: torch.dtype) -> nn.Module | None:
        step = getattr(hf_config, "decoder_sparse_step", None) or 1
        if (layer_id in (getattr(hf_config, "mlp_only_layers", None) or []) or num_experts_of(hf_config) == 0
                or (layer_id + 1) % step):
            return None
        return SparseMoE(hf_config.hidden_size, hf_config.moe_intermediate_size, num_experts_of(hf_config),
                         hf_config.num_experts_per_tok, bool(getattr(hf_config, "norm_topk_prob", False)),
                         hf_config.hidden_act, dtype,
                         shared_inter=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0))
