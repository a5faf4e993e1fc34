"""Mixture-of-experts families on the Llama-style decoder: Qwen3-MoE, Mixtral, Qwen2-MoE (with a shared
expert) and OLMoE. Attention, norms, rope and the pipeline contract are `LlamaForCausalLM`'s; each
family says which layers route their MLP through experts (`model.moe.SparseMoE`) and how its router
weighs the chosen experts.
"""
from __future__ import annotations

import torch
from torch import nn

from stagewise.model.llama import LlamaForCausalLM
from stagewise.model.moe import SparseMoE, num_experts_of


def _sparse_layer(hf_config, layer_id: int) -> bool:
    """Qwen-MoE's rule: a layer is sparse unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th."""
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    return (layer_id not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and num_experts_of(hf_config) > 0 and (layer_id + 1) % step == 0)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 attention (per-head q/k norms); softmax top-k routing, renormalised when `norm_topk_prob`."""

    qk_norm = True
    shared_expert = False

    def make_mlp(self, hf_config, layer_id: int, dtype: torch.dtype) -> nn.Module | None:
        if not _sparse_layer(hf_config, layer_id):
            return None
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if self.shared_expert else 0
        return SparseMoE(hf_config.hidden_size, hf_config.moe_intermediate_size, num_experts_of(hf_config),
                         hf_config.num_experts_per_tok, bool(getattr(hf_config, "norm_topk_prob", False)),
                         hf_config.hidden_act, dtype, shared_inter=shared)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2 attention (q/k/v biases as `qkv_bias` says, no q/k norms), a shared expert beside the routed ones."""

    qk_norm = False
    shared_expert = True

    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False


class MixtralForCausalLM(LlamaForCausalLM):
    """Mistral attention; every layer routed (top-k, renormalised), experts named w1 (gate), w3 (up), w2 (down)."""

    def make_mlp(self, hf_config, layer_id: int, dtype: torch.dtype) -> nn.Module | None:
        return SparseMoE(hf_config.hidden_size, hf_config.intermediate_size, num_experts_of(hf_config),
                         hf_config.num_experts_per_tok, True, hf_config.hidden_act, dtype, names=("w1", "w3", "w2"))

    def hf_name(self, param_name: str) -> str:
        name = super().hf_name(param_name)
        return name.replace(".mlp.", ".block_sparse_moe.", 1) if name.startswith("model.layers.") else name


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE: q/k RMSNorm over the whole projections, q/k/v clamped to `clip_qkv`, every layer routed."""

    qk_norm = "full"
    tensor_parallel = False      # the full-width q/k norms need every head's columns on one rank

    def make_mlp(self, hf_config, layer_id: int, dtype: torch.dtype) -> nn.Module | None:
        return SparseMoE(hf_config.hidden_size, hf_config.intermediate_size, num_experts_of(hf_config),
                         hf_config.num_experts_per_tok, bool(getattr(hf_config, "norm_topk_prob", False)),
                         hf_config.hidden_act, dtype)
