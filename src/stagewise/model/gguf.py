"""Load one pipeline stage from a GGUF file (llama.cpp's format).

Owns the tensor side of GGUF: llama.cpp tensor names -> the HF names the stage models load,
undoing the converter's layout changes (Llama/Mistral Q/K rows permuted for llama.cpp's rotary
layout, GPT-2 projections transposed, Gemma 3's norm scales stored with 1 added). Tensors of a
type with a quantized kernel stay in their own bytes (`model.quantized`; `gguf_scheme` says which);
F32/F16/BF16 and other quant types are dequantized into the engine dtype. A stage reads only its
own tensors, one at a time, with pread (no file pages mapped into the process). Metadata -> config
lives in `stagewise.checkpoint.gguf_meta`.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import torch

from stagewise.checkpoint.facts import read_facts
from stagewise.checkpoint.gguf_meta import GGMLType, gguf_facts
from stagewise.kernels.quant import SUPPORTED, QuantizedWeight, T
from stagewise.model.layers import StageModel
from stagewise.model.moe import num_experts_of
from stagewise.model.quantized import Scheme

log = logging.getLogger("stagewise.model")

# llama.cpp block tensor -> HF module path inside layer N, per family (the .weight/.bias suffix is kept).
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# OLMo 2: norms after attention and MLP, no input norm (llama.cpp keeps HF's rotate-half q/k rows)
_OLMO2_BLOCK = {**_LLAMA_BLOCK, "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Gemma 3: norms before and after attention and MLP (llama.cpp's ffn_norm is the one before the MLP)
_GEMMA3_BLOCK = {**_OLMO2_BLOCK, "ffn_norm": "pre_feedforward_layernorm"}
# Phi-3 / Phi-4: q/k/v and gate/up fused as the checkpoint holds them
_PHI3_BLOCK = {**_LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
             "output": "lm_head"}
# gpt-oss: the router and the stacked experts keep the file's layout (model/gpt_oss.py reads them so)
_GPT_OSS_BLOCK = {**_LLAMA_BLOCK, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                  "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_exps",
                  "ffn_up_exps": "mlp.experts.up_exps", "ffn_down_exps": "mlp.experts.down_exps"}
# Qwen3.5: gated full attention (q_proj holds the gate) beside linear-attention layers (llama.cpp's ssm_* names)
_QWEN35_BLOCK = {**_LLAMA_BLOCK, "post_attention_norm": "post_attention_layernorm",
                 "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                 "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                 "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias", "ssm_conv1d": "linear_attn.conv1d",
                 "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
# the (1 + w) norms llama.cpp's converter stores with the 1 added (not the gated norm of the linear layers)
_QWEN35_SHIFTED = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")
_NAMES = {"llama": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"),
          "gpt-oss": (_LLAMA_TOP, _GPT_OSS_BLOCK, "model.layers"), "qwen2": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"),
          "qwen3": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"), "gpt2": (_GPT2_TOP, _GPT2_BLOCK, "transformer.h"),
          "olmo2": (_LLAMA_TOP, _OLMO2_BLOCK, "model.layers"), "granite": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"),
          "smollm3": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"), "gemma3": (_LLAMA_TOP, _GEMMA3_BLOCK, "model.layers"),
          "phi3": (_LLAMA_TOP, _PHI3_BLOCK, "model.layers"), "qwen35": (_LLAMA_TOP, _QWEN35_BLOCK, "model.layers"),
          **{moe: (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers") for moe in ("qwen3moe", "qwen2moe", "olmoe")}}
# the archs whose converter (llama.cpp's LlamaModel and its subclasses) permutes the q/k rows
_PERMUTED_QK = ("llama", "granite", "smollm3")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")    # Qwen3.5's `ssm_a` has no suffix
# HF tensors that are parameters of the layer's module, not modules (no .weight/.bias suffix)
_PARAMETERS = (".sinks", ".A_log", ".dt_bias")
_LEGACY_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
# llama.cpp's converter stores GPT-2's Conv1D weights ([in, out]) transposed, as linear weights.
_GPT2_TRANSPOSED = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """The HF checkpoint name of a llama.cpp tensor, or None for tensors no model reads (e.g. rope_freqs)."""
    top, block, layers = _NAMES[arch]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match:
        part = block.get(match[2])
        if part is None:
            return None
        # a parameter, not a module (transformers' gpt-oss `sinks`, Qwen3.5's `A_log`): no suffix
        if part.endswith(_PARAMETERS):
            return f"{layers}.{match[1]}.{part}"
        return f"{layers}.{match[1]}.{part}.{match[3]}" if match[3] else None
    base, _, suffix = gguf_name.rpartition(".")
    return f"{top[base]}.{suffix}" if base in top else None


@functools.lru_cache(maxsize=1)
def _moe_block() -> tuple[dict[str, str], dict[str, int]]:
    """llama.cpp's MoE block tensors (names from gguf-py's constants): those that map to one HF
    tensor of the layer's MLP, and the stacked expert tensors -> their (gate, up, down) index."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES  # lazy: only MoE files need gguf-py here
    kind = lambda t: TENSOR_NAMES[t].removeprefix("blk.{bid}.")
    single = {kind(MODEL_TENSOR.FFN_GATE_INP): "gate", kind(MODEL_TENSOR.FFN_GATE_SHEXP): "shared_expert.gate_proj",
              kind(MODEL_TENSOR.FFN_UP_SHEXP): "shared_expert.up_proj",
              kind(MODEL_TENSOR.FFN_DOWN_SHEXP): "shared_expert.down_proj",
              kind(MODEL_TENSOR.FFN_GATE_INP_SHEXP): "shared_expert_gate"}
    stacked = {kind(MODEL_TENSOR.FFN_GATE_EXP): 0, kind(MODEL_TENSOR.FFN_UP_EXP): 1,
               kind(MODEL_TENSOR.FFN_DOWN_EXP): 2}
    return single, stacked


def hf_tensor_names(gguf_name: str, arch: str, experts: int = 0) -> list[str]:
    """The HF checkpoint names a llama.cpp tensor holds: one, or one per expert for a stacked expert
    tensor (`blk.N.ffn_gate_exps` -> `...mlp.experts.{e}.gate_proj`, Mixtral's `w1`); [] for tensors no
    model reads. `experts`: the file's experts per layer (0: a dense model)."""
    name = hf_tensor_name(gguf_name, arch)
    match = _BLOCK_RE.fullmatch(gguf_name)
    if name is None and experts and arch == "llama" and (legacy := _LEGACY_EXPERT_RE.fullmatch(gguf_name)):
        # Mixtral files converted before llama.cpp stacked experts: one tensor per expert
        part = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}[legacy[2]]
        return [f"model.layers.{legacy[1]}.block_sparse_moe.experts.{legacy[3]}.{part}.weight"]
    if name is not None or match is None or not experts:
        return [] if name is None else [name]
    single, stacked = _moe_block()
    mixtral = arch == "llama"
    prefix = f"model.layers.{match[1]}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if match[2] in single:
        return [f"{prefix}.{single[match[2]]}.{match[3]}"]
    if match[2] in stacked:
        part = (("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))[stacked[match[2]]]
        return [f"{prefix}.experts.{e}.{part}.{match[3]}" for e in range(experts)]
    return []


def _unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order (pairs interleaved) back to HF's rotate-half halves:
    HF row i is file row index[i]."""
    return torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)


def _to_hf_layout(tensor, gguf_name: str, arch: str, hf_config):
    """A float tensor or a QuantizedWeight in the layout the HF checkpoint has (quantized GPT-2
    projections stay [out, in]: a quantized layer holds rows)."""
    if arch == "qwen35" and isinstance(tensor, torch.Tensor):
        return _qwen35_layout(tensor, gguf_name)
    kind = gguf_name.split(".")[-2]
    if arch in _PERMUTED_QK and kind in ("attn_q", "attn_k"):
        heads = hf_config.num_attention_heads if kind == "attn_q" else hf_config.num_key_value_heads
        index = _unpermute_index(tensor.shape[0], heads)
        return tensor.take_rows(index) if isinstance(tensor, QuantizedWeight) else tensor[index]
    if arch == "gpt2" and kind in _GPT2_TRANSPOSED and not isinstance(tensor, QuantizedWeight) and tensor.dim() == 2:
        return tensor.t()
    if arch == "gemma3" and kind.endswith("norm") and isinstance(tensor, torch.Tensor):
        # llama.cpp's converter stores Gemma's `(1 + w)` norm scales with the 1 added; taking it off again
        # is exact for weights in [-0.5, 1] (Sterbenz), so `1 + w` below gives the file's value back
        return tensor - 1.0
    if kind.endswith("_inp_shexp") and isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
        return tensor[None]        # the converter squeezes the shared expert's [1, H] gate to [H]
    return tensor


def _qwen35_layout(tensor: torch.Tensor, gguf_name: str) -> torch.Tensor:
    """Qwen3.5 as llama.cpp's converter stores it: `(1 + w)` norms with the 1 added (taken off again),
    `A_log` as `-exp(A_log)`, the conv weight `[C, K]` squeezed; the value heads' reorder is not undone
    (the model pairs them as stored: `linear_v_heads_tiled`)."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    kind = match[2] if match else gguf_name.rpartition(".")[0]
    if kind in _QWEN35_SHIFTED:
        return tensor - 1.0
    if kind == "ssm_a":
        return torch.log(-tensor)
    if kind == "ssm_conv1d":
        return tensor.unsqueeze(1)
    return tensor


def gguf_scheme(path: Path) -> Scheme:
    """Which checkpoint tensors (by HF name) a GGUF file holds in a type with a quantized kernel."""
    facts = gguf_facts(path)
    arch, experts = facts.meta["general.architecture"], num_experts_of(read_facts(path).config)
    types = {hf: T.__members__[kind] for name, kind in facts.types.items()
             for hf in hf_tensor_names(name, arch, experts)}
    return lambda hf_name, shape: types[hf_name] if types.get(hf_name) in SUPPORTED else None


def read_raw(reader_tensor, file) -> torch.Tensor:
    """A tensor's bytes, read with pread into a new uint8 tensor (the file is never mapped)."""
    out = torch.empty(int(reader_tensor.n_bytes), dtype=torch.uint8)
    view, done = out.numpy().data, 0
    while done < len(view):
        got = os.preadv(file.fileno(), [view[done:]], int(reader_tensor.data_offset) + done)
        if got <= 0:
            raise ValueError(f"{file.name} ends inside tensor {reader_tensor.name}; the GGUF file is truncated.")
        done += got
    return out


def _shape(reader_tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(reader_tensor.shape))    # torch order: GGUF lists dims reversed


# GGUF float types -> torch dtypes (read without gguf-py)
_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


def dequantize_raw(raw: torch.Tensor, reader_tensor, path: Path) -> torch.Tensor:
    """One GGUF tensor's bytes as float32, in torch dim order."""
    shape = _shape(reader_tensor)
    if reader_tensor.tensor_type in _FLOATS:        # widening is exact: gguf-py's values
        return raw.contiguous().view(_FLOATS[reader_tensor.tensor_type]).reshape(shape).float()
    from gguf import GGMLQuantizationType  # lazy: only quantized types the kernels do not hold need gguf-py
    from gguf.quants import dequantize
    qtype = GGMLQuantizationType(reader_tensor.tensor_type)
    rows = raw.numpy().reshape(-1, raw.numel() // max(1, int(np.prod(shape[:-1]))))
    try:
        array = dequantize(rows, qtype)
    except NotImplementedError:
        raise ValueError(f"Tensor {reader_tensor.name} in {path} is stored as {qtype.name}, which stagewise cannot "
                         f"dequantize; re-quantize the model to a supported type such as Q8_0, Q4_K or F16.") from None
    return torch.from_numpy(np.ascontiguousarray(array.reshape(shape), dtype=np.float32))


def load_gguf_stage(model: StageModel, path: Path, hf_config) -> None:
    """Load this stage's tensors (`model.is_stage_weight`) from `path` into `model`: into its quantized
    layers as stored, the rest dequantized into the model's dtype."""
    started, kept, converted = time.perf_counter(), Counter[str](), Counter[str]()
    facts = gguf_facts(path)
    arch = facts.meta["general.architecture"]
    table, dtype = model.weight_table(), cast(torch.dtype, model.dtype)
    named = [(t, hf_tensor_names(t.name, arch, num_experts_of(hf_config))) for t in facts.tensors]
    mine = [(t, names) for t, names in named if names and model.is_stage_weight(names[0])]
    _check_complete(model, table, [name for _, names in mine for name in names], path)

    def tensors(file):  # one tensor at a time: at most one tensor's bytes and float copy are alive
        for tensor, names in mine:
            qtype, held = T(tensor.tensor_type), model.held_module(table[model.canonical_name(names[0])])
            shape = _shape(tensor)
            if held is not None and qtype in getattr(held, "raw_types", ()):   # held in the file's own bytes
                value = RawBlocks(read_raw(tensor, file), qtype, shape)
                kept[qtype.name] += 1
            elif qtype in SUPPORTED and held is not None:
                value = QuantizedWeight.from_gguf(read_raw(tensor, file), qtype, (math.prod(shape[:-1]), shape[-1]))
                kept[qtype.name] += 1
            else:
                value = dequantize_raw(read_raw(tensor, file), tensor, path).to(dtype)
                converted[qtype.name] += 1
            # a stacked expert tensor [E, R, K] holds one checkpoint tensor per expert
            rows = shape[-2] if len(names) > 1 else None
            for e, name in enumerate(names):
                part = value if rows is None else (value.take_rows(slice(e * rows, (e + 1) * rows))
                                                   if isinstance(value, QuantizedWeight) else value[e])
                yield name, _checked(_to_hf_layout(part, tensor.name, arch, hf_config), tensor.name, path,
                                     table[model.canonical_name(name)].shape, held)
    with open(path, "rb", buffering=0) as file:
        model.load_weights(tensors(file))
    _log_load(model, kept, converted, dtype, time.perf_counter() - started)


class RawBlocks(NamedTuple):
    """A tensor's bytes as the file stores them, for a layer that holds that type itself (`raw_types`)."""
    data: torch.Tensor          # uint8, the whole tensor
    qtype: T
    shape: tuple[int, ...]      # torch order


def _checked(value, gguf_name: str, path: Path, expected: tuple[int, ...], held) -> torch.Tensor | QuantizedWeight:
    """`value` if it has the checkpoint tensor's shape (a quantized layer's rows: [out, in])."""
    if isinstance(value, QuantizedWeight) and held is not None and held.in_out_layout:
        expected = expected[::-1]
    if tuple(value.shape) != expected:
        raise ValueError(f"Tensor {gguf_name} in {path} has shape {tuple(value.shape)}, but the file's "
                         f"metadata implies {expected}; the GGUF file is inconsistent.")
    return value


def _log_load(model, kept: Counter, converted: Counter, dtype: torch.dtype, seconds: float) -> None:
    listed = lambda types: ", ".join(f"{n} {t}" for t, n in types.most_common()) or "none"
    log.info("Stage %d: GGUF tensors kept quantized: %s; converted to %s: %s (%.2f s)", model.stage.rank,
             listed(kept), dtype, listed(converted), seconds)
    # (kernel types converted too: off the CPU, or a tensor-parallel shard not on whole blocks)
    no_kernel = sorted(t for t in converted if t not in _FLOAT_TYPES and T.__members__[t] not in SUPPORTED)
    if no_kernel:
        log.warning("Stage %d: GGUF type(s) %s have no quantized kernel in stagewise; those tensors were "
                    "dequantized to %s.", model.stage.rank, ", ".join(no_kernel), dtype)


def _check_complete(model, table: dict, names: list[str], path: Path) -> None:
    missing = sorted(set(table) - {model.canonical_name(n) for n in names})
    if missing:
        raise ValueError(f"Tensor {missing[0]} (shape {table[missing[0]].shape}) has no counterpart in {path}; stage "
                         f"{model.stage.rank} needs it ({len(missing)} missing in all). The GGUF file is incomplete.")
