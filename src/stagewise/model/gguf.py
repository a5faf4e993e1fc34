"""Load one pipeline stage from a GGUF file (llama.cpp's format).

Owns the tensor side of GGUF: llama.cpp tensor names -> the HF names the stage models load,
undoing the converter's layout changes (Llama/Mistral Q/K rows permuted for llama.cpp's rotary
layout, GPT-2 projections transposed), and dequantizing every quant type `gguf.quants` reads
into the engine dtype. A stage dequantizes only the tensors it owns. Metadata -> config lives
in `stagewise.checkpoint`.
"""
from __future__ import annotations

import logging
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from stagewise.gguf_meta import gguf_facts, gguf_reader
from stagewise.model.layers import StageModel

log = logging.getLogger("stagewise.model")

# llama.cpp block tensor -> HF module path inside layer N, per family (the .weight/.bias suffix is kept).
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
             "output": "lm_head"}
_NAMES = {"llama": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"), "qwen2": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"),
          "qwen3": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"), "gpt2": (_GPT2_TOP, _GPT2_BLOCK, "transformer.h")}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's converter stores GPT-2's Conv1D weights ([in, out]) transposed, as linear weights.
_GPT2_TRANSPOSED = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """The HF checkpoint name of a llama.cpp tensor, or None for tensors no model reads (e.g. rope_freqs)."""
    top, block, layers = _NAMES[arch]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match:
        part = block.get(match[2])
        return None if part is None else f"{layers}.{match[1]}.{part}.{match[3]}"
    base, _, suffix = gguf_name.rpartition(".")
    return f"{top[base]}.{suffix}" if base in top else None


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order (pairs interleaved) back to HF's rotate-half halves."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _to_hf_layout(tensor: torch.Tensor, gguf_name: str, arch: str, hf_config) -> torch.Tensor:
    kind = gguf_name.split(".")[-2]
    if arch == "llama" and kind in ("attn_q", "attn_k"):
        heads = hf_config.num_attention_heads if kind == "attn_q" else hf_config.num_key_value_heads
        return _unpermute_rows(tensor, heads)
    if arch == "gpt2" and kind in _GPT2_TRANSPOSED and tensor.dim() == 2:
        return tensor.t()
    return tensor


def read_tensor(reader_tensor, path: Path) -> torch.Tensor:
    """One GGUF tensor as float32, in torch dim order (GGUF lists dims reversed)."""
    qtype = GGMLQuantizationType(reader_tensor.tensor_type)
    try:
        # A plain ndarray view of the memmap: numpy's memmap subclass hooks cost more than the dequantization.
        array = dequantize(np.asarray(reader_tensor.data), qtype)
    except NotImplementedError:
        raise ValueError(f"Tensor {reader_tensor.name} in {path} is stored as {qtype.name}, which stagewise cannot "
                         f"dequantize; re-quantize the model to a supported type such as Q8_0, Q4_K or F16.") from None
    shape = tuple(int(d) for d in reversed(reader_tensor.shape))
    array = array.reshape(shape).astype(np.float32, copy=False)
    return torch.from_numpy(array if array.flags.writeable else array.copy())  # F32 is a read-only memmap view


def load_gguf_stage(model: StageModel, path: Path, hf_config) -> None:
    """Dequantize this stage's tensors (`model.is_stage_weight`) from `path` into `model`, in the model's dtype."""
    started, types = time.perf_counter(), Counter[str]()
    arch = gguf_facts(path).meta["general.architecture"]
    table, dtype = model.weight_table(), next(model.parameters()).dtype
    named = [(t, hf_tensor_name(t.name, arch)) for t in gguf_reader(path).tensors]
    mine = [(t, name) for t, name in named if name is not None and model.is_stage_weight(name)]
    _check_complete(model, table, [name for _, name in mine], path)

    def dequantized():  # one tensor at a time, so at most one float32 copy is alive
        for tensor, name in mine:
            value = _to_hf_layout(read_tensor(tensor, path), tensor.name, arch, hf_config)
            expected = table[model.canonical_name(name)].shape
            if tuple(value.shape) != expected:
                raise ValueError(f"Tensor {tensor.name} in {path} has shape {tuple(value.shape)}, but the file's "
                                 f"metadata implies {expected}; the GGUF file is inconsistent.")
            types[tensor.tensor_type.name] += 1
            yield name, value.to(dtype)
    model.load_weights(dequantized())
    log.info("Stage %d: dequantized %d GGUF tensors (%s) to %s in %.2f s", model.stage.rank, len(mine),
             ", ".join(f"{n} {t}" for t, n in types.most_common()), dtype, time.perf_counter() - started)


def _check_complete(model, table: dict, names: list[str], path: Path) -> None:
    missing = sorted(set(table) - {model.canonical_name(n) for n in names})
    if missing:
        raise ValueError(f"Tensor {missing[0]} (shape {table[missing[0]].shape}) has no counterpart in {path}; stage "
                         f"{model.stage.rank} needs it ({len(missing)} missing in all). The GGUF file is incomplete.")
