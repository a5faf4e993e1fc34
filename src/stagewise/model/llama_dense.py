"""Dense families on the Llama-style decoder that differ from it in a detail or two: SmolLM3
(layers without rope), OLMo 2 (norms after attention and MLP, q/k norms over the whole
projections), Granite (embedding, attention, residual and logit multipliers) and Phi-3 / Phi-4
(fused checkpoint projections; partial rotary and long-rope in the rope code). Each is
`LlamaForCausalLM` with its hooks set; of these only Phi-3's blocks run the one-call C decode.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from stagewise.model.attention import ForwardBatch
from stagewise.model.cpu_gemm import Embedding
from stagewise.model.layers import GatedMLP, RMSNorm, rotary_embedding
from stagewise.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, head_dim_of
from stagewise.parallel.proxy import ProxyTensors


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama whose layers listed 0 in `no_rope_layers` attend without positional rotation (NoPE)."""

    one_call_decode = False

    def attention_options(self, hf_config, layer_id: int) -> dict:
        return {"use_rope": bool(hf_config.no_rope_layers[layer_id])}


class Olmo2DecoderLayer(nn.Module):
    """OLMo 2's block: no input norm; attention and MLP outputs are normed before joining the stream
    (`x + norm(attn(x))`, then `x + norm(mlp(x))`)."""

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, mlp: nn.Module | None = None,
                 attention: type[LlamaAttention] = LlamaAttention, **attn_kwargs):
        super().__init__()
        self.layer_id = layer_id
        eps = hf_config.rms_norm_eps
        self.self_attn = attention(hf_config, layer_id, dtype, **attn_kwargs)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.mlp = mlp if mlp is not None else GatedMLP(hf_config.hidden_size, hf_config.intermediate_size,
                                                        hf_config.hidden_act, False, dtype)
        self.post_feedforward_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # the same carry as Llama's blocks: `hidden` (the last output, not yet added) and `residual`
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, cos, sin, batch))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: post-norm placement (`Olmo2DecoderLayer`), q/k RMSNorm over the whole projections."""

    qk_norm = "full"
    decoder_layer = Olmo2DecoderLayer
    one_call_decode = False
    tensor_parallel = False      # the full-width q/k norms need every head's columns on one rank


class GraniteDecoderLayer(LlamaDecoderLayer):
    """A Llama block whose attention and MLP outputs are scaled by `residual_multiplier` before the add."""

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, mlp: nn.Module | None = None,
                 attention: type[LlamaAttention] = LlamaAttention, **attn_kwargs):
        super().__init__(hf_config, layer_id, dtype, mlp, attention, **attn_kwargs)
        self.out_scale = float(hf_config.residual_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite: embeddings times `embedding_multiplier`, softmax scale `attention_multiplier`, attention
    and MLP outputs times `residual_multiplier` before the residual add, logits divided by `logits_scaling`."""

    decoder_layer = GraniteDecoderLayer
    one_call_decode = False

    def __init__(self, hf_config, stage, dtype: torch.dtype):
        super().__init__(hf_config, stage, dtype)
        self.multipliers = (float(hf_config.embedding_multiplier), float(hf_config.logits_scaling))

    def attention_options(self, hf_config, layer_id: int) -> dict:
        return {"scale": float(hf_config.attention_multiplier)}

    def scale_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * self.multipliers[0]

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.multipliers[1]


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4: Llama blocks whose checkpoint holds q/k/v as one `qkv_proj` and gate/up as one
    `gate_up_proj` (the fused projections here, loaded whole); partial rotary and long-rope come from
    the rope code. The one-call C decode serves it where every head is rotated whole."""

    tensor_parallel = False      # the fused checkpoint tensors are not cut by heads

    def __init__(self, hf_config, stage, dtype: torch.dtype):
        super().__init__(hf_config, stage, dtype)
        for i in range(stage.start, stage.end):
            layer = cast(LlamaDecoderLayer, self.layers[i])
            attn, mlp = layer.self_attn, cast(GatedMLP, layer.mlp)
            for proj, name in ((attn.qkv_proj, "qkv_proj"), (mlp.gate_up_proj, "gate_up_proj")):
                proj.hf_parts = ((name, proj.out_features),)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by `1 + weight` (weights stored around 0), in float32 as transformers';
    with `residual`, the add first: `(norm(x + residual), x + residual)` like `RMSNorm` (whose C
    kernel multiplies by the weight itself, so it is not used here)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ScaledEmbedding(Embedding):
    """Token embeddings times `embed_scale` (Gemma's sqrt(hidden), rounded to the weight dtype as
    transformers'); as the tied head it is the plain weight. Kept float under `--quantization`: the
    quantized embedding that would replace it does not scale."""

    embed_scale = 1.0
    keep_float = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.embed_scale).to(self.weight.dtype)


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3's block: norms before and after attention and MLP (`(1 + w)` scales), per-head q/k norms,
    GeGLU MLP; a sliding-window layer attends its last `sliding_window` keys."""

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, mlp: nn.Module | None = None,
                 attention: type[LlamaAttention] = LlamaAttention, **attn_kwargs):
        super().__init__()
        self.layer_id = layer_id
        eps, hidden, d = hf_config.rms_norm_eps, hf_config.hidden_size, head_dim_of(hf_config)
        self.self_attn = attention(hf_config, layer_id, dtype, **attn_kwargs)
        self.self_attn.q_norm, self.self_attn.k_norm = GemmaRMSNorm(d, eps, dtype), GemmaRMSNorm(d, eps, dtype)
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_activation, False, dtype)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # the same carry as Llama's blocks: `hidden` (the last output, not yet added) and `residual`
        stream = hidden if residual is None else hidden + residual
        out = self.self_attn(self.input_layernorm(stream), cos, sin, batch)
        stream = stream + self.post_attention_layernorm(out)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream))), stream


def _kind_rope(hf_config, kind: str) -> dict:
    """Gemma 3's rope settings of one layer kind (transformers 5 keeps a dict per kind)."""
    nested = getattr(hf_config, "rope_parameters", None) or {}
    params = dict(nested.get(kind) or {})
    if kind == "sliding_attention" and getattr(hf_config, "rope_local_base_freq", None):
        params.setdefault("rope_theta", hf_config.rope_local_base_freq)
    params.setdefault("rope_theta", 10000.0 if kind == "sliding_attention" else 1_000_000.0)
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    return params


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 (text): embeddings times sqrt(hidden), `(1 + w)` RMSNorms around attention and MLP,
    per-head q/k norms, GeGLU, softmax scale `query_pre_attn_scalar ** -0.5`, sliding-window layers
    (`layer_types`) with their own rope base, final logits soft-capped where configured. The KV cache
    holds every position for the window layers too, masked to the window (`model.sink_attention`)."""

    decoder_layer = Gemma3DecoderLayer
    qk_norm = True

    def __init__(self, hf_config, stage, dtype: torch.dtype):
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Attention logit soft-capping (attn_logit_softcapping) is not supported; "
                             "set it to null in config.json only if the model was trained without it.")
        super().__init__(hf_config, stage, dtype)
        self.layer_types = list(hf_config.layer_types)
        head, positions = self.head_dim, hf_config.max_position_embeddings
        self.rotary = rotary_embedding(head, positions, _kind_rope(hf_config, "full_attention"))
        self.local_rotary = rotary_embedding(head, positions, _kind_rope(hf_config, "sliding_attention"))
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)
        if self.embed_tokens is not None:
            embed = ScaledEmbedding(hf_config.vocab_size, self.hidden_size, dtype=dtype)
            embed.embed_scale, embed.serves_head = self.hidden_size ** 0.5, self.embed_tokens.serves_head
            self.embed_tokens = embed
        if self.norm is not None:
            self.norm = GemmaRMSNorm(self.hidden_size, hf_config.rms_norm_eps, dtype)
        self._local: tuple[torch.Tensor, torch.Tensor] | None = None

    def _warn_sliding_window(self, hf_config) -> None:
        """Gemma 3's windows are honoured (`model.sink_attention`)."""

    def attention_options(self, hf_config, layer_id: int) -> dict:
        window = hf_config.sliding_window if hf_config.layer_types[layer_id] == "sliding_attention" else None
        return {"scale": float(hf_config.query_pre_attn_scalar) ** -0.5, "window": window}

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, batch: ForwardBatch, *,
                input_embeds: torch.Tensor | None = None, pp_proxy_tensors: ProxyTensors | None = None):
        # the window layers' tables, once per forward for every layer that needs them
        self._local = self.local_rotary.tables(positions, self.dtype) if self.stage.start < self.stage.end else None
        try:
            return super().forward(input_ids, positions, batch, input_embeds=input_embeds,
                                   pp_proxy_tensors=pp_proxy_tensors)
        finally:
            self._local = None

    def layer_rope(self, layer_id: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_types[layer_id] == "sliding_attention" and self._local is not None:
            return self._local
        return cos, sin

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap
