"""GGUF fixtures: tiny GGUF files written from the tiny HF checkpoints the way llama.cpp's converter
writes them: tensor names from gguf's own name map, Llama-family Q/K rows permuted for llama.cpp's
rotary layout, GPT-2 projections transposed, llama3 rope as per-frequency factors (rope_freqs),
tokenizer and chat template as metadata; weights in F32 or quantized (Q8_0).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2",
             "qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "olmo2": "olmo2",
             "granite": "granite", "smollm3": "smollm3", "gpt_oss": "gpt-oss", "gemma3_text": "gemma3", "phi3": "phi3",
             "qwen3_5_text": "qwen35"}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rotate-half rows -> interleaved pairs per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(config) -> float:
    return float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))


def _write_gemma3_hparams(writer, config) -> None:
    """What llama.cpp's Gemma3Model writes (its base class's keys and its own): the global layers'
    rope (base, linear scaling), the window layers' base, the window; no window pattern (6 is fixed)."""
    import gguf
    rope = config.rope_parameters
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if rope["full_attention"].get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)


def _write_phi3_hparams(writer, config) -> None:
    """What llama.cpp's Phi3MiniModel writes: rope dims from `partial_rotary_factor`, the original
    context length, window 0; with long-rope its attention factor (the factors: `_phi3_rope_factors`)."""
    rope = config.rope_parameters
    # the converter mirrors the config's top-level original length into its rope parameters
    heads = config.num_attention_heads
    orig = rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
    writer.add_context_length(config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(orig)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("long_factor"):
        scale = config.max_position_embeddings / orig
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)


def _phi3_rope_factors(config) -> dict[str, np.ndarray]:
    """Phi3MiniModel.generate_extra_tensors: long-rope's factors as two F32 tensors."""
    rope = config.rope_parameters
    if not rope.get("long_factor"):
        return {}
    return {f"rope_factors_{kind}.weight": np.array(rope[f"{kind}_factor"], dtype=np.float32)
            for kind in ("long", "short")}


def _write_llama_keys(writer, config, head_dim: int) -> None:
    """The hyperparameters llama.cpp's LlamaModel writes, which its subclasses keep."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _write_qwen35_hparams(writer, config) -> None:
    """What llama.cpp's Qwen3_5TextModel writes: the Llama keys, a quarter of each head rotated, the
    linear layers under `ssm.*`, which layers are recurrent (a flag per layer, and the interval)."""
    head_dim = config.head_dim
    _write_llama_keys(writer, config, head_dim)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_array("qwen35.attention.recurrent_layers", [t == "linear_attention" for t in config.layer_types])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_rope_dimension_sections([11, 11, 10, 0])


def _v_tiled(array: np.ndarray, axis: int, config, size: int) -> np.ndarray:
    """llama.cpp's _reorder_v_heads: value heads along `axis` (`size` each) from grouped by key head to tiled."""
    hk, rep = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    a = np.moveaxis(array, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(hk, rep, size, *rest).swapaxes(0, 1).reshape(hk * rep * size, *rest)
    return np.moveaxis(a, 0, axis)


def _qwen35_tensor(hf_name: str, array: np.ndarray, config) -> tuple[str, np.ndarray]:
    """One Qwen3.5 tensor as llama.cpp's converter writes it: value heads tiled, `-exp(A_log)`, `dt_bias`
    as `dt_proj.bias`, the conv weight squeezed, the `(1 + w)` norms with the 1 added."""
    dv, qk = config.linear_value_head_dim, 2 * config.linear_num_key_heads * config.linear_key_head_dim
    if "linear_attn." in hf_name:
        if ".in_proj_qkv." in hf_name or ".conv1d." in hf_name:
            array = np.concatenate([array[:qk], _v_tiled(array[qk:], 0, config, dv)])
        elif ".in_proj_z." in hf_name:
            array = _v_tiled(array, 0, config, dv)
        elif any(part in hf_name for part in (".in_proj_a.", ".in_proj_b.", ".A_log", ".dt_bias")):
            array = _v_tiled(array, 0, config, 1)
        elif ".out_proj." in hf_name:
            array = _v_tiled(array, 1, config, dv)
    if hf_name.endswith(".A_log"):
        array = -np.exp(array)
    elif hf_name.endswith(".dt_bias"):
        hf_name = hf_name.replace(".dt_bias", ".dt_proj.bias")
    elif ".conv1d." in hf_name:
        array = array.squeeze(1)
    elif hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        array = array + 1.0
    return hf_name, array


def _write_hparams(writer, config, arch: str) -> None:
    if arch == "qwen35":
        return _write_qwen35_hparams(writer, config)
    if arch == "gemma3":
        return _write_gemma3_hparams(writer, config)
    if arch == "phi3":
        return _write_phi3_hparams(writer, config)
    if arch == "gpt2":
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    _write_llama_keys(writer, config, head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch == "granite":     # what llama.cpp's GraniteModel writes
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:     # what llama.cpp's converter writes for a MoE model
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        if getattr(config, "clip_qkv", None) is not None:
            writer.add_clamp_kqv(config.clip_qkv)
    if arch == "gpt-oss":      # what llama.cpp's GptOssModel converter writes besides
        import gguf
        rope = config.rope_parameters
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _llama3_rope_freqs(config) -> np.ndarray | None:
    """llama.cpp's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_tensors(hf_dir: Path, config, arch: str) -> dict[str, np.ndarray]:
    """HF checkpoint tensors renamed and re-laid-out as llama.cpp's converter writes them."""
    import gguf
    from safetensors.numpy import load_file
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, getattr(config, "num_hidden_layers", None) or config.n_layer)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, getattr(config, "num_hidden_layers", None) or 1)
    out, experts = {}, {}
    for hf_name, array in load_file(str(hf_dir / "model.safetensors")).items():
        if (match := _EXPERT.fullmatch(hf_name)) is not None:   # stacked per layer and projection, as llama.cpp
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = array
            continue
        if arch == "qwen35":
            hf_name, array = _qwen35_tensor(hf_name, array, config)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None and ".mlp." in hf_name:     # a dense layer of a MoE model (Qwen's mlp_only_layers)
            name = dense.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch in ("llama", "granite", "smollm3") and ".q_proj." in hf_name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch in ("llama", "granite", "smollm3") and ".k_proj." in hf_name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        elif arch == "gpt2" and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            array = array.T
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + 1.0                 # Gemma3Model.norm_shift: the `1 + w` of Gemma's RMSNorm
        if arch == "gemma3" and hf_name.endswith("embed_tokens.weight"):    # its out-of-vocabulary rows cut
            tok = json.loads((hf_dir / "tokenizer.json").read_text())
            array = array[:len(tok["model"]["vocab"]) + len(tok["added_tokens"])]
        if hf_name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)             # the converter squeezes the [1, H] gate
        out[name] = np.ascontiguousarray(array, dtype=np.float32)
    for hf_name, by_expert in experts.items():
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, hf_name
        out[name] = np.ascontiguousarray(np.stack([by_expert[e] for e in sorted(by_expert)]), dtype=np.float32)
    if arch == "gpt2":
        out["output.weight"] = out["token_embd.weight"]  # the converter writes GPT-2's tied head out
    if arch == "phi3":
        out.update(_phi3_rope_factors(config))
    rope_freqs = _llama3_rope_freqs(config) if arch == "llama" else None
    if rope_freqs is not None:
        out["rope_freqs.weight"] = rope_freqs
    return out


def _write_tokenizer(writer, hf_dir: Path, add_bos: bool = False) -> None:
    import gguf
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(config["chat_template"])


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32", *, tokenizer: bool = True, add_bos: bool = False,
               tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write `hf_dir` as a GGUF file; `qtype` other than F32 stores every 2-D tensor in that type (norms stay F32).
    `tensors` replaces the checkpoint's; a `(raw bytes, GGMLQuantizationType)` value is written as is;
    `add_bos`: the tokenizer metadata says to add the BOS token."""
    import gguf
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(hf_dir)
    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny {config.model_type}")
    _write_hparams(writer, config, arch)
    if tokenizer:
        _write_tokenizer(writer, hf_dir, add_bos)
    quant = gguf.GGMLQuantizationType[qtype]
    for name, array in (tensors or gguf_tensors(hf_dir, config, arch)).items():
        if isinstance(array, tuple):
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        elif quant == gguf.GGMLQuantizationType.F32 or array.ndim < 2 or array.shape[-1] % 32:   # not whole blocks
            writer.add_tensor(name, array)
        elif quant == gguf.GGMLQuantizationType.F16:   # a plain float16 array: the writer infers F16
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="session")
def tiny_gguf(request, tmp_path_factory):
    """Factory: `tiny_gguf(family, qtype="F32")` -> a GGUF file of that tiny checkpoint (written once)."""
    made: dict[tuple[str, str], Path] = {}

    def make(family: str, qtype: str = "F32") -> Path:
        if (family, qtype) not in made:
            hf_dir = request.getfixturevalue(f"{family}_dir")
            out = tmp_path_factory.mktemp(f"gguf-{family}-{qtype}") / f"tiny-{family}.{qtype}.gguf"
            made[family, qtype] = write_gguf(hf_dir, out, qtype)
        return made[family, qtype]
    return make


def dequantized_hf_dir(hf_dir: Path, out: Path, qtype: str) -> Path:
    """A copy of the HF checkpoint whose 2-D weights went through `qtype` and back (the quantized file's values)."""
    import gguf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    quant = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                roundtrip = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), quant), quant)
                param.copy_(torch.from_numpy(roundtrip))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gguf_tools():
    """The writer helpers, for tests that build their own GGUF files."""
    from types import SimpleNamespace
    return SimpleNamespace(write_gguf=write_gguf, gguf_tensors=gguf_tensors, write_hparams=_write_hparams,
                           dequantized_hf_dir=dequantized_hf_dir)
