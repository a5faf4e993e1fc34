"""Llama-family stage models: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Pre-norm blocks with a fused add+norm carry `hidden_states` + `residual` between layers, so a
non-last stage returns both (the full proxy contract). Attention itself is `batch.attention`.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from stagewise.kernels import layers as cpu_layers
from stagewise.model.attention import ForwardBatch, _DecodeGroup
from stagewise.model.cpu_gemm import Embedding, Linear, logits
from stagewise.model.layers import (
    FusedLinear,
    GatedMLP,
    RMSNorm,
    StageModel,
    apply_rotary,
    build_layers,
    rope_kv_kernel,
    rope_parameters,
    rotary_dim,
    rotary_embedding,
)
from stagewise.model.quantized import QuantLinear
from stagewise.model.sink_attention import sink_attention
from stagewise.parallel.partition import StageInfo
from stagewise.parallel.proxy import FULL_CONTRACT, ProxyTensors

log = logging.getLogger(__name__)

# eager CPU decode steps run a stage's packed Llama blocks in one C++ call where they can
# (`LlamaForCausalLM._one_call`); False: always the modules (tests compare the two)
ONE_CALL_DECODE = True


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def kv_heads_of(hf_config) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool | str, use_rope: bool = True, scale: float | None = None, window: int | None = None):
        """`qk_norm`: RMSNorm of q and k per head (True, Qwen3) or over the whole projection ("full",
        OLMoE, whose q/k/v are then clamped to `clip_qkv` where the config sets it). `use_rope`: False
        for a layer without positional rotation (SmolLM3's no-rope layers); `scale`: the softmax scale
        where it is not 1/sqrt(head_dim) (Granite's attention_multiplier); `window`: a sliding-window
        layer's window (`model.sink_attention`; Gemma 3's local layers)."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = hf_config.num_attention_heads, kv_heads_of(hf_config)
        self.head_dim = head_dim_of(hf_config)
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.use_rope, self.window = use_rope, window
        self.rotary_dim = rotary_dim(self.head_dim, rope_parameters(hf_config))    # < head_dim: partial rotary
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows))
        self.qkv_proj = FusedLinear(hf_config.hidden_size, parts, qkv_bias, dtype)
        self.o_proj = Linear(q_rows, hf_config.hidden_size, bias=o_bias, dtype=dtype)
        self.full_qk_norm = qk_norm == "full"
        q_width, k_width = (q_rows, kv_rows) if self.full_qk_norm else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, hf_config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(k_width, hf_config.rms_norm_eps, dtype) if qk_norm else None
        self.clip_qkv = getattr(hf_config, "clip_qkv", None) if self.full_qk_norm else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """cos/sin: `RotaryEmbedding.tables` `[T, 1, D]` in the activation dtype."""
        T, hq, hkv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)                                   # [T, (Hq + 2 Hkv) D]
        v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)                   # [T, Hkv, D]
        written = False
        if not self.use_rope and self.q_norm is None:   # q and k as projected; attention writes the cache
            q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
        elif self.q_norm is None:
            # eager CPU steps: one C call ropes q and k and writes k and v into the KV cache (whole heads only)
            target = batch.kv_target(self.layer_id) if self.rotary_dim == d else None
            roped = rope_kv_kernel(qkv, cos, sin, hq, hkv, target)
            written = roped is not None
            if roped is not None:
                q, k = roped                                          # [T, Hq, D], [T, Hkv, D]
            else:               # q and k are adjacent columns: rope both heads' sets in one pass
                qk = apply_rotary(qkv[:, :(hq + hkv) * d].view(T, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]                         # [T, Hq, D], [T, Hkv, D]
        else:
            assert self.k_norm is not None   # built together with q_norm
            if self.full_qk_norm:
                q = self.q_norm(qkv[:, :hq * d]).view(T, hq, d)
                k = self.k_norm(qkv[:, hq * d:(hq + hkv) * d]).view(T, hkv, d)
                if self.clip_qkv is not None:
                    clip = self.clip_qkv
                    q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
            else:
                q = self.q_norm(qkv[:, :hq * d].view(T, hq, d))
                k = self.k_norm(qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d))
            if self.use_rope:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attend(batch, q, k, v, written).reshape(T, -1))

    def attend(self, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               written: bool) -> torch.Tensor:
        """Roped q `[T, Hq, D]`, k and v `[T, Hkv, D]` -> `[T, Hq, D]`; `written`: k and v are in the
        cache already (a family with another attention overrides this)."""
        if self.window is not None:
            return sink_attention(batch, self.layer_id, q, k, v, self.scale, None, self.window, kv_written=written)
        if written:     # graph batches' attention takes no kv_written (they never get here)
            return batch.attention(self.layer_id, q, k, v, self.scale, kv_written=True)
        return batch.attention(self.layer_id, q, k, v, self.scale)


class LlamaDecoderLayer(nn.Module):
    # what the attention and MLP outputs are multiplied by before joining the residual stream (Granite's
    # residual_multiplier); None: added as they are
    out_scale: float | None = None

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, mlp: nn.Module | None = None,
                 attention: type[LlamaAttention] = LlamaAttention, **attn_kwargs):
        """`mlp`: the block's MLP where it is not the config's dense gated one (a MoE block);
        `attention`: the attention class (a family's subclass)."""
        super().__init__()
        self.layer_id = layer_id
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.self_attn = attention(hf_config, layer_id, dtype, **attn_kwargs)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.mlp = mlp if mlp is not None else GatedMLP(hf_config.hidden_size, hf_config.intermediate_size,
                                                        hf_config.hidden_act, getattr(hf_config, "mlp_bias", False),
                                                        dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # `hidden` is the previous block's MLP output, not yet added to the residual stream.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, batch)
        if self.out_scale is not None:
            hidden = hidden * self.out_scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return (hidden if self.out_scale is None else hidden * self.out_scale), residual


class LlamaForCausalLM(StageModel):
    """One pipeline stage of a Llama-style decoder; see `StageModel` for weight loading."""

    proxy_keys = FULL_CONTRACT
    qk_norm: bool | str = False
    decoder_layer: type[nn.Module] = LlamaDecoderLayer    # a family's block (same constructor and call)
    attention_class: type[LlamaAttention] = LlamaAttention
    # False: a family whose blocks `stagewise::decode_layers` cannot express (no-rope layers, multipliers,
    # other norm placements) always runs its modules
    one_call_decode = True

    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias) as the HF class builds them."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def __init__(self, hf_config, stage: StageInfo, dtype: torch.dtype):
        super().__init__()
        self.stage, self.dtype = stage, dtype
        self.hidden_size, self.vocab_size = hf_config.hidden_size, hf_config.vocab_size
        self.num_kv_heads, self.head_dim = kv_heads_of(hf_config), head_dim_of(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._warn_sliding_window(hf_config)
        vocab = hf_config.vocab_size
        # `model.embed_tokens(ids [T]) -> [T, H]` is the engine's embedding entry point (first stage).
        self.embed_tokens = Embedding(vocab, self.hidden_size, dtype=dtype) if stage.is_first else None
        qkv_bias, o_bias = self.attention_biases(hf_config)
        self.layers = build_layers(stage, lambda i: self.decoder_layer(
            hf_config, i, dtype, self.make_mlp(hf_config, i, dtype), self.attention_class, qkv_bias=qkv_bias,
            o_bias=o_bias, qk_norm=self.qk_norm, **self.attention_options(hf_config, i)))
        self.rotary = rotary_embedding(self.head_dim, hf_config.max_position_embeddings, rope_parameters(hf_config))
        self.norm = RMSNorm(self.hidden_size, hf_config.rms_norm_eps, dtype) if stage.is_last else None
        # Tied and first+last: the head reuses embed_tokens. Tied on a later stage: a separate copy
        # loaded from the embedding tensor (hf_name maps it), so no parameter is shared across modules.
        needs_head = stage.is_last and not (self.tie_word_embeddings and stage.is_first)
        self.lm_head = Linear(self.hidden_size, vocab, bias=False, dtype=dtype) if needs_head else None
        if self.embed_tokens is not None:
            self.embed_tokens.serves_head = stage.is_last and not needs_head

    def make_mlp(self, hf_config, layer_id: int, dtype: torch.dtype) -> nn.Module | None:
        """Layer `layer_id`'s MLP; None: the dense gated MLP of the config (MoE families override)."""
        return None

    def attention_options(self, hf_config, layer_id: int) -> dict:
        """Layer `layer_id`'s extra `LlamaAttention` arguments (`use_rope`, `scale`); families override."""
        return {}

    def layer_rope(self, layer_id: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_id`'s rope tables: the model's (`cos`, `sin`) unless its kind has its own (Gemma 3)."""
        return cos, sin

    def scale_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first stage's input rows (token embeddings or given `input_embeds`) as layer 0 takes them."""
        return hidden

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's float32 logits as the family returns them (Granite divides, Gemma soft-caps)."""
        return logits

    def _warn_sliding_window(self, hf_config) -> None:
        window = getattr(hf_config, "sliding_window", None)
        uses = getattr(hf_config, "use_sliding_window", True)
        if window and uses and window < hf_config.max_position_embeddings:
            log.warning("Sliding-window attention (window %d) is not implemented; sequences longer than the "
                        "window will differ from the reference model.", window)

    def hf_name(self, param_name: str) -> str:
        if param_name.startswith("lm_head."):
            return "model.embed_tokens.weight" if self.tie_word_embeddings else param_name
        return "model." + param_name

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, batch: ForwardBatch, *,
                input_embeds: torch.Tensor | None = None, pp_proxy_tensors: ProxyTensors | None = None):
        """Non-last stage -> ProxyTensors(hidden_states, residual) of T rows; last -> normed hidden `[T, H]`.

        `hidden_states` is the last block's MLP output not yet added to `residual`; the next
        block's fused add+norm adds them, so crossing a stage boundary costs no extra add.
        """
        residual: torch.Tensor | None
        if self.stage.is_first:
            assert self.embed_tokens is not None   # built on the first stage
            hidden = input_embeds if input_embeds is not None else self.embed_tokens(input_ids)  # [T, H]
            hidden = self.scale_embeddings(hidden)
            residual = None  # layer 0 starts the residual stream from the embeddings
        else:
            assert pp_proxy_tensors is not None, "a non-first stage runs on the previous stage's tensors"
            hidden, residual = pp_proxy_tensors["hidden_states"], pp_proxy_tensors["residual"]
        cos, sin = self.rotary.tables(positions, hidden.dtype)  # [T, 1, D] each, once for all layers
        one_call = self._one_call(hidden, cos, batch)
        if one_call is not None:
            hidden, residual = one_call(hidden, residual, cos, sin)
        else:
            for layer_id in range(self.stage.start, self.stage.end):
                hidden, residual = self.layers[layer_id](hidden, residual, *self.layer_rope(layer_id, cos, sin), batch)
        if not self.stage.is_last:
            if residual is None:  # first stage that ran no layer: the stream so far is all in `hidden`
                residual = torch.zeros_like(hidden)
            return ProxyTensors({"hidden_states": hidden, "residual": residual})
        assert self.norm is not None   # built on the last stage
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def _one_call(self, hidden: torch.Tensor, cos: torch.Tensor, batch: ForwardBatch):
        """An eager CPU decode step of a stage whose layers are all plain packed Llama blocks runs
        them in one call of `stagewise::decode_layers` (the same ops, without Python between them):
        that call as `fn(hidden, residual, cos, sin) -> (hidden, residual)`, else None (the modules).
        So does a step of a few rows per sequence over its cache (`meta.short_rows`: verify steps and
        decode rows beside them), its rows attended one by one as decode rows (`rows_attention`): each
        row gets the bits a decode step gives it, where the modules' cached-prefill attention sums in
        another order."""
        if not ONE_CALL_DECODE or torch.compiler.is_compiling():    # first: a trace reads nothing below
            return None
        lora = self.__dict__.get("lora")
        if lora is not None and lora.active:     # adapter rows need the modules' projections (their hooks)
            return None
        # graph batches (whose attention must see every call) give no kv_target
        if batch is None or self.stage.start == self.stage.end or batch.kv_target(self.stage.start) is None:
            return None
        meta = batch.meta
        if (hidden.device.type != "cpu" or meta is None or not (meta.is_plain_decode or meta.short_rows)
                or hidden.shape[0] != meta.num_tokens or _get_current_dispatch_mode() is not None
                or torch.is_grad_enabled() or cos.dtype != hidden.dtype):
            return None
        plan = self.__dict__.get("_decode_plan", False)
        if plan is False:
            plan = self.__dict__["_decode_plan"] = self._plan_decode_layers()
        if plan is None or hidden.dtype != plan["dtype"]:
            return None
        caches = batch.kv_caches[self.stage.start:self.stage.end]
        if any(c is None or c.dtype != hidden.dtype or not c.is_contiguous() for c in caches):
            return None
        spans = None
        if meta.is_plain_decode:
            grp = meta.groups[0]
            assert isinstance(grp, _DecodeGroup)    # a plain decode step's one group
            tables, lens = grp.block_ids, grp.seq_lens
        else:           # a few rows per sequence (verify steps): each row attended as a decode row
            assert meta.span_block_ids is not None and meta.row_lens is not None    # built with short_rows
            tables, spans, lens = meta.span_block_ids, meta.span_rows, meta.row_lens
        return lambda hidden, residual, cos, sin: torch.ops.stagewise.decode_layers(
            hidden, residual, cos, sin, meta.slot_mapping, tables, lens, plan["norms"], plan["data"],
            plan["qtypes"], plan["ns"], plan["parts"], plan["biases"], plan["bias_of"], caches, plan["heads"],
            plan["kv_heads"], plan["eps"], plan["scale"], plan["exact"], spans)

    def _plan_decode_layers(self) -> dict | None:
        """The flattened weights `stagewise::decode_layers` takes, where every layer of the stage is
        one it runs: a Llama block (no q/k norm) whose projections are held quantized or packed for
        the float kernels (biases or not), silu, one eps, no hooks (tensor parallelism's gathers),
        and the C++ op and the kernels it calls built."""
        layers: list[Any] = [self.layers[i] for i in range(self.stage.start, self.stage.end)]
        if (not layers or self.qk_norm or not self.one_call_decode or self.__dict__.get("tp_size", 1) != 1
                or not cpu_layers.available()
                or not all(type(layer) is LlamaDecoderLayer for layer in layers)):
            return None
        plan: dict = {"norms": [], "data": [], "qtypes": [], "ns": [], "parts": [], "biases": [], "bias_of": [],
                      "exact": set(), "eps": set()}
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (type(mlp) is not GatedMLP or mlp.act is not F.silu or not attn.use_rope or layer.out_scale is not None
                    or attn.rotary_dim != attn.head_dim or attn.window is not None
                    or any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())):
                return None
            for ln in (layer.input_layernorm, layer.post_attention_layernorm):
                plan["norms"].append(ln.weight.detach())
                plan["eps"].add(ln.eps)
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if isinstance(proj, QuantLinear) and all(seg.qtype is not None for seg in proj.segments):
                    plan["exact"].add(proj.exact)
                    segments = [(getattr(proj, f"segment{i}"), int(qtype), seg.rows)
                                for i, seg in enumerate(proj.segments) if (qtype := seg.qtype) is not None]
                elif type(proj) in (Linear, FusedLinear) and proj.packed and cpu_layers.floats_available():
                    segments = [(proj.weight.detach(), -1, proj.out_features)]     # the packed float kernels
                else:
                    return None
                plan["parts"].append(len(segments))
                plan["bias_of"].append(-1 if proj.bias is None else len(plan["biases"]))
                if proj.bias is not None:
                    plan["biases"].append(proj.bias.detach())
                for data, kind, rows in segments:
                    plan["data"].append(data)
                    plan["qtypes"].append(kind)
                    plan["ns"].append(rows)
        shapes = {(a.num_heads, a.num_kv_heads, a.head_dim, a.scale) for a in (layer.self_attn for layer in layers)}
        dtypes = {w.dtype for w in plan["norms"]}
        if len(plan["exact"]) > 1 or len(plan["eps"]) != 1 or len(dtypes) != 1 or len(shapes) != 1:
            return None
        heads, kv_heads, head_dim, scale = shapes.pop()
        # what the norm, rope and decode attention kernels serve (the modules take PyTorch's ops elsewhere)
        if head_dim % 8 or not dtypes <= {torch.float32, torch.bfloat16}:
            return None
        plan.update(exact=bool(plan["exact"] and plan["exact"].pop()), eps=plan["eps"].pop(), dtype=dtypes.pop(),
                    heads=heads, kv_heads=kv_heads, scale=scale)
        return plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[R, H]` -> float32 logits `[R, V]` (last stage only)."""
        return self.finish_logits(self._head_logits(hidden))

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if head is not None:
            if isinstance(head, QuantLinear):
                return head.as_head(hidden)
            return logits(hidden, head.weight, head.packed)
        assert self.embed_tokens is not None   # the last stage has a head or (tied, also first) the embedding
        return self.embed_tokens.as_head(hidden)

    def kv_cache_spec(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_dim


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
