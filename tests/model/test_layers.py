"""Rope tables against HF's own functions, config styles old and new, RMSNorm, and the registry."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from stagewise.model.layers import RMSNorm, rope_inv_freq, rope_parameters
from stagewise.model.registry import get_model_class, register_model, supported_architectures

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_inv_freq_bit_identical_to_hf(scaling):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={"rope_theta": 5e5, **(scaling or
                         {"rope_type": "default"})})
    ours = rope_inv_freq(16, rope_parameters(config))
    if scaling is None:
        expected = 1.0 / (5e5 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    assert torch.equal(ours, expected)


def test_rope_parameters_reads_old_and_new_styles():
    new = SimpleNamespace(rope_parameters={"rope_theta": 5e5, **LLAMA3})
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3.items()
                                                                           if k != "rope_type"}})
    plain = SimpleNamespace(rope_theta=1e4, rope_scaling=None)
    assert rope_parameters(new) == rope_parameters(old) == {"rope_theta": 5e5, **LLAMA3}
    assert rope_parameters(plain) == {"rope_theta": 1e4, "rope_type": "default"}
    with pytest.raises(ValueError, match="'dynamic' is not supported; supported: .*yarn"):
        rope_inv_freq(16, {"rope_theta": 1e4, "rope_type": "dynamic"})


def test_rms_norm_fused_add():
    norm = RMSNorm(8, 1e-6, torch.float32)
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, r)
    assert torch.equal(new_residual, x + r) and torch.equal(out, norm(x + r))


def test_registry():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "GPT2LMHeadModel"} <= set(supported_architectures())
    with pytest.raises(ValueError, match=r"'NopeForCausalLM'.*GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class("NopeForCausalLM")

    class Custom(get_model_class("LlamaForCausalLM")):
        pass

    register_model("CustomForCausalLM", Custom)
    assert get_model_class("CustomForCausalLM") is Custom
    with pytest.raises(ValueError, match="needs a class"):
        register_model("Broken", object())
