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
from stagewise.model.layers import GatedMLP, RMSNorm
from stagewise.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama whose layers listed 0 in `no_rope_layers` attend without positional rotation (NoPE)."""

    one_call_decode = False

    def attention_options(self, hf_config, layer_id: int) -> dict:
        return {"use_rope": bool(hf_config.no_rope_layers[layer_id])}


class Olmo2DecoderLayer(nn.Module):
    """OLMo 2's block: no input norm; attention and MLP outputs are normed before joining the stream
    (`x + norm(attn(x))`, then `x + norm(mlp(x))`)."""

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, mlp: nn.Module | None = None, **attn_kwargs):
        super().__init__()
        self.layer_id = layer_id
        eps = hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, layer_id, dtype, **attn_kwargs)
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

    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype, mlp: nn.Module | None = None, **attn_kwargs):
        super().__init__(hf_config, layer_id, dtype, mlp, **attn_kwargs)
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
