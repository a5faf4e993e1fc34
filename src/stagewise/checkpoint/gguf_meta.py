"""GGUF metadata (llama.cpp's format): the model config, the tokenizer and the tensor table a GGUF
file describes, read from its header without dequantizing anything.

The facts of a file (metadata, and where each tensor's bytes are) are read from its header by a
small bounded reader (`_read_header`: every length checked against the file size) that skips the
large tokenizer arrays instead of building them (gguf's GGUFReader builds a numpy view per array
item: ~130 MB and 3 s for a 49k-token vocabulary), and are cached per process while the file is
unchanged. Tensor data is read by `model.gguf`; the tokenizer arrays by transformers, below.

Nothing here imports transformers into the process that runs the model (it costs ~190 MB resident
with the torch._dynamo, sympy and accelerate modules it pulls in, twice the default model's weights):
the config is a `GGUFConfig` record, and the tokenizer is converted from the metadata once, by
transformers in a child process (`python -m stagewise.checkpoint.gguf_meta`), cached on disk and read back
with the `tokenizers` library (`saved_tokenizer.SavedTokenizer`).
"""
from __future__ import annotations

import enum
import functools
import hashlib
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from ..config import cache_root

log = logging.getLogger("stagewise.checkpoint")

# GGUF `general.architecture` -> the stage-model architecture that runs it (Mistral GGUFs say "llama").
# A "llama" file whose blocks hold experts (`llama.expert_count`) is Mixtral.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                      "olmoe": "OlmoeForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
                      "smollm3": "SmolLM3ForCausalLM", "gpt-oss": "GptOssForCausalLM", "gpt2": "GPT2LMHeadModel",
                      "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen35": "Qwen3_5ForCausalLM"}
_LLAMA_WITH_EXPERTS = ("MixtralForCausalLM", "mixtral")
# gguf-py's Keys.LLM.EXPERT_COUNT, spelled here so a dense file's load never imports gguf-py (a test
# checks the two agree); the rest of a MoE file's keys are read from gguf-py's constants
EXPERT_COUNT_KEY = "{arch}.expert_count"
_GGUF_BIG_FIELDS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores", "tokenizer.ggml.precompiled_charsmap"}
_ERROR_PREFIX = "stagewise-error: "    # marks the tokenizer converter's one-sentence error line
# What transformers' config class of each architecture fills in for the attributes the model code
# reads and the metadata does not give (tests/model/test_gguf_tokenizer.py compares them with transformers).
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", dtype=None, pad_token_id=None),
    "qwen2": dict(model_type="qwen2", dtype=None, pad_token_id=None, sliding_window=None, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", dtype=None, pad_token_id=None, sliding_window=None, use_sliding_window=False),
    "qwen3moe": dict(model_type="qwen3_moe", dtype=None, pad_token_id=None, sliding_window=None,
                     use_sliding_window=False, decoder_sparse_step=1),
    "qwen2moe": dict(model_type="qwen2_moe", dtype=None, pad_token_id=None, sliding_window=None,
                     use_sliding_window=False, decoder_sparse_step=1),
    "olmoe": dict(model_type="olmoe", dtype=None, pad_token_id=None),
    "olmo2": dict(model_type="olmo2", dtype=None, pad_token_id=None),
    "granite": dict(model_type="granite", dtype=None, pad_token_id=None),
    "smollm3": dict(model_type="smollm3", dtype=None, pad_token_id=None, sliding_window=None,
                    use_sliding_window=False),
    # llama.cpp's Gemma 3 has no attention soft-capping and a tanh GeGLU; Phi-3 files have no working window
    "gemma3": dict(model_type="gemma3_text", dtype=None, pad_token_id=0, attn_logit_softcapping=None,
                   final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh"),
    "phi3": dict(model_type="phi3", dtype=None, pad_token_id=32000, sliding_window=None),
    # llama.cpp's converter reorders the linear layers' value heads from grouped by key head to tiled
    # (`linear_v_heads_tiled`: model/qwen3_5.py pairs them with the key heads so, no tensor is permuted back)
    "qwen35": dict(model_type="qwen3_5_text", dtype=None, pad_token_id=None, linear_v_heads_tiled=True),
    # llama.cpp's gpt-oss: the clamped SwiGLU's constants are fixed in its graph, not stored
    "gpt-oss": dict(model_type="gpt_oss", dtype=None, pad_token_id=None, swiglu_alpha=1.702, swiglu_limit=7.0),
    "gpt2": dict(model_type="gpt2", dtype=None, pad_token_id=None, activation_function="gelu_new",
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False),
}
# The GGML types stagewise's quantized CPU kernels run (kernels.quant_formats.SUPPORTED; here by name,
# for the graph policy, which imports no torch)
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
# GPT-2's own names and the common ones transformers' GPT2Config answers to as well
_GPT2_ALIASES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                 "max_position_embeddings": "n_positions"}


class GGUFConfig(SimpleNamespace):
    """A GGUF model's config under transformers' attribute names: what the metadata says, plus
    transformers' defaults for the rest the model code reads. A plain record, so the process that
    runs a GGUF model never imports transformers for its config."""

    @classmethod
    def build(cls, arch: str, fields: dict[str, Any]) -> GGUFConfig:
        config = cls(**{**_CONFIG_DEFAULTS[arch], **fields})
        if arch == "gpt2":
            for alias, name in _GPT2_ALIASES.items():
                setattr(config, alias, fields[name])
        return config


class GGUFTensor(NamedTuple):
    """Where one tensor's bytes are in the file, and what they hold (what `model.gguf` reads by)."""
    name: str
    tensor_type: int      # GGMLType value
    shape: tuple          # GGUF order (dims reversed from torch's)
    data_offset: int
    n_bytes: int


class GGUFFacts(NamedTuple):
    meta: dict            # metadata key -> value (the large tokenizer arrays left out)
    shapes: dict          # tensor name -> shape in torch order (GGUF stores dims reversed)
    types: dict           # tensor name -> GGML type name (F32, Q4_K, ...)
    rope_freqs: list | None  # per-frequency rope divisors (llama3-style long-context rope), if stored
    tensors: tuple = ()   # GGUFTensor per tensor, in file order
    rope_factors: dict | None = None  # Phi-3 long-rope: "long"/"short" -> per-frequency factors, if stored


def _file_key(path: str | Path) -> tuple[str, int, int]:
    stat = Path(path).stat()
    return str(path), stat.st_size, stat.st_mtime_ns


def gguf_facts(path: str | Path) -> GGUFFacts:
    return _gguf_facts(*_file_key(path))


def _gguf_facts_uncached(path: str, size: int) -> GGUFFacts:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); pass a "
                             f"llama.cpp .gguf file or a checkpoint directory.")
        try:
            return _read_header(f, size)
        except _Damaged as exc:
            raise ValueError(f"{path} is truncated or damaged ({size} bytes; {exc}); download or convert it "
                             f"again.") from None


@functools.lru_cache(maxsize=8)
def _gguf_facts(path: str, size: int, mtime_ns: int) -> GGUFFacts:
    return _gguf_facts_uncached(path, size)


class _Damaged(Exception):
    """A header that does not parse: what is wrong and where (`_gguf_facts` words the error)."""


class _Header:
    """Reads a GGUF header front to back through a small buffer, checking every length against the
    file size. gguf's GGUFReader would build a numpy view per array element (~150 MB and seconds for
    a 49k-token vocabulary); this keeps the values the config needs and skips the large arrays."""

    def __init__(self, file, size: int):
        self.file, self.size, self.pos, self.order = file, size, 4, "<"

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise _Damaged(f"a {n}-byte field at byte {self.pos} runs past the end of the file")
        data = self.file.read(n)
        if len(data) != n:
            raise _Damaged(f"reading {n} bytes at byte {self.pos} returned {len(data)}")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Damaged(f"a {n}-byte field at byte {self.pos} runs past the end of the file")
        self.file.seek(n, os.SEEK_CUR)
        self.pos += n

    def unpack(self, fmt: str):
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"a string before byte {self.pos} is not UTF-8") from None

    def value(self, vtype: int, keep: bool = True):
        """One metadata value of GGUF value type `vtype`; with keep=False it is skipped (None)."""
        if vtype == _STRING:
            if keep:
                return self.string()
            return self.skip(self.unpack("Q"))
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return self.unpack(fmt) if keep else self.skip(struct.calcsize(fmt))
        if vtype != _ARRAY:
            raise _Damaged(f"unknown value type {vtype} before byte {self.pos}")
        itype, count = self.unpack("I"), self.unpack("Q")
        if itype in _SCALARS and not keep:     # fixed-size items: skip the block at once
            return self.skip(count * struct.calcsize(_SCALARS[itype]))
        if count > self.size - self.pos:       # every item takes at least a byte
            raise _Damaged(f"an array of {count} items at byte {self.pos} cannot fit in the file")
        if keep:
            return [self.value(itype) for _ in range(count)]
        for _ in range(count):
            self.value(itype, keep=False)
        return None


class GGMLType(enum.IntEnum):
    """ggml's tensor types by their number in a GGUF file (gguf-py's GGMLQuantizationType; the
    package itself, its writer and its YAML reader, is ~2 MiB resident that a load does not need)."""
    F32, F16, Q4_0, Q4_1 = 0, 1, 2, 3
    Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = range(6, 16)
    IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, I8, I16, I32, I64, F64, IQ1_M, BF16 = range(16, 31)
    TQ1_0, TQ2_0 = 34, 35
    MXFP4, NVFP4, Q1_0 = 39, 40, 41


# (elements per block, bytes per block) of each type (gguf-py's GGML_QUANT_SIZES; tests/model/test_gguf_header.py
# checks the two agree)
GGML_SIZES = {GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20),
              GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 40),
              GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
              GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292),
              GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98),
              GGMLType.IQ1_S: (256, 50), GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110),
              GGMLType.IQ2_S: (256, 82), GGMLType.IQ4_XS: (256, 136), GGMLType.I8: (1, 1), GGMLType.I16: (1, 2),
              GGMLType.I32: (1, 4), GGMLType.I64: (1, 8), GGMLType.F64: (1, 8), GGMLType.IQ1_M: (256, 56),
              GGMLType.BF16: (1, 2), GGMLType.TQ1_0: (256, 54), GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17),
              GGMLType.NVFP4: (64, 36), GGMLType.Q1_0: (128, 18)}


# GGUF value types (gguf.GGUFValueType) -> struct format; strings and arrays are read item by item.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read_header(file, size: int) -> GGUFFacts:
    """The facts of a GGUF file (version 2 or 3, either byte order) from its header: metadata (large
    tokenizer arrays skipped), the tensor table, and the rope divisors if `rope_freqs.weight` exists."""
    header = _Header(file, size)
    version = header.unpack("I")
    if version & 0xFFFF == 0:                  # written on a big-endian machine
        header.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise _Damaged(f"GGUF version {version} is not one stagewise reads (2 or 3)")
    n_tensors, n_kv = header.unpack("Q"), header.unpack("Q")
    if n_tensors > size or n_kv > size:
        raise _Damaged(f"it claims {n_tensors} tensors and {n_kv} metadata entries")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, vtype = header.string(), header.unpack("I")
        value = header.value(vtype, keep=key not in _GGUF_BIG_FIELDS)
        if key not in _GGUF_BIG_FIELDS:
            meta[key] = value
    infos = []
    for _ in range(n_tensors):
        name, n_dims = header.string(), header.unpack("I")
        if n_dims > 8:
            raise _Damaged(f"tensor {name} claims {n_dims} dimensions")
        dims = tuple(header.unpack("Q") for _ in range(n_dims))
        infos.append((name, dims, header.unpack("I"), header.unpack("Q")))
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Damaged(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-header.pos // alignment) * alignment
    tensors = []
    for name, dims, raw_type, offset in infos:
        try:
            qtype = GGMLType(raw_type)
            block, type_size = GGML_SIZES[qtype]
        except (ValueError, KeyError):
            raise _Damaged(f"tensor {name} has unknown type {raw_type}") from None
        n_elems = math.prod(dims)
        if n_elems % block:
            raise _Damaged(f"tensor {name} of shape {dims} is not whole {qtype.name} blocks")
        n_bytes = n_elems // block * type_size
        if data_start + offset + n_bytes > size:
            raise _Damaged(f"tensor {name} ends at byte {data_start + offset + n_bytes}, past the end of the file")
        tensors.append(GGUFTensor(name, int(qtype), dims, data_start + offset, n_bytes))
    if len({t.name for t in tensors}) != len(tensors):
        raise _Damaged("two tensors share a name")
    by_name = {t.name: t for t in tensors}
    return GGUFFacts(meta, {t.name: tuple(reversed(t.shape)) for t in tensors},
                     {t.name: GGMLType(t.tensor_type).name for t in tensors},
                     _rope_divisors(file, by_name.get("rope_freqs.weight"), header.order), tuple(tensors),
                     {kind: _rope_divisors(file, by_name[f"rope_factors_{kind}.weight"], header.order)
                      for kind in ("long", "short") if f"rope_factors_{kind}.weight" in by_name} or None)


def _rope_divisors(file, tensor: GGUFTensor | None, order: str) -> list | None:
    if tensor is None:
        return None
    import numpy as np
    dtypes = {0: "f4", 1: "f2"}               # GGML F32, F16
    if tensor.tensor_type not in dtypes:
        raise _Damaged(f"{tensor.name} is stored as type {tensor.tensor_type}, not F32 or F16")
    file.seek(tensor.data_offset)
    return np.frombuffer(file.read(tensor.n_bytes), dtype=order + dtypes[tensor.tensor_type]).astype("float64").tolist()


def held_quantized(path: str | Path) -> str | None:
    """The most common type of the file's transformer-block matrices (`blk.N.*.weight`, 2-D) when most
    of them are stored in a type the quantized kernels run (the stages' linear layers are held
    quantized, not as float tensors), else None."""
    facts = gguf_facts(path)
    kinds = [facts.types[name] for name, shape in facts.shapes.items()
             if name.startswith("blk.") and name.endswith(".weight") and len(shape) == 2]
    quantized = [kind for kind in kinds if kind in KERNEL_TYPES]
    return max(set(quantized), key=quantized.count) if 2 * len(quantized) > len(kinds) else None


def hf_config_from_gguf(path: Path) -> GGUFConfig:
    """The model config built from GGUF metadata (what llama.cpp's converter wrote from config.json)."""
    arch, fields = config_fields_from_gguf(path)
    return GGUFConfig.build(arch, fields)


def config_fields_from_gguf(path: Path) -> tuple[str, dict[str, Any]]:
    """The file's architecture and the config values its metadata gives, under transformers' names
    (transformers' config class of that architecture, given these, builds the same config)."""
    facts = gguf_facts(path)
    arch = facts.meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path} holds a {arch!r} model, which stagewise cannot run from GGUF; supported GGUF "
                         f"architectures: {', '.join(sorted(GGUF_ARCHITECTURES))}.")
    if int(facts.meta.get("split.count", 1)) > 1:
        raise ValueError(f"{path} is one part of a split GGUF model; merge the parts into one file first "
                         f"(llama-gguf-split --merge).")
    if "token_embd.weight" not in facts.shapes:
        raise ValueError(f"{path} has no token_embd.weight tensor; it is not a complete {arch} model file.")
    common = dict(vocab_size=facts.shapes["token_embd.weight"][0], architectures=[GGUF_ARCHITECTURES[arch]],
                  tie_word_embeddings="output.weight" not in facts.shapes,
                  bos_token_id=facts.meta.get("tokenizer.ggml.bos_token_id"),
                  eos_token_id=facts.meta.get("tokenizer.ggml.eos_token_id"))
    kwargs = _gpt2_kwargs(facts, path) if arch == "gpt2" else _llama_kwargs(facts, arch, path)
    if arch == "granite":
        kwargs.update(_granite_kwargs(facts, kwargs["head_dim"], path))
    if arch == "smollm3":   # every 4th layer without rope: llama.cpp's fixed rule (its files carry no key)
        kwargs["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(kwargs["num_hidden_layers"])]
    if arch == "gemma3":
        kwargs.update(_gemma3_kwargs(facts, kwargs, path))
    if arch == "phi3":
        kwargs.update(_phi3_kwargs(facts, kwargs, path))
    if arch == "qwen35":
        kwargs.update(_qwen35_kwargs(facts, kwargs, path))
    moe = _moe_kwargs(facts, arch) if arch != "gpt2" else {}
    if moe and arch == "llama":
        common.update(architectures=[_LLAMA_WITH_EXPERTS[0]], model_type=_LLAMA_WITH_EXPERTS[1])
    if arch == "gpt-oss":
        moe.update(_gpt_oss_kwargs(facts, moe, int(kwargs["num_hidden_layers"])))
    return arch, {**kwargs, **moe, **common}


def _gpt_oss_kwargs(facts: GGUFFacts, moe: dict, layers: int) -> dict:
    """gpt-oss: the experts' width as its config names it, window layers on even ids (llama.cpp's
    swa pattern 2, transformers' default `layer_types`), and the GGML type of the stacked expert
    tensors (the stage holds them in the file's layout, `model.gpt_oss`)."""
    return dict(intermediate_size=moe.get("moe_intermediate_size"),
                sliding_window=facts.meta.get("gpt-oss.attention.sliding_window"),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                gguf_expert_types={kind: facts.types.get(f"blk.0.{kind}.weight")
                                   for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")})


def _gemma3_kwargs(facts: GGUFFacts, kwargs: dict, path: Path) -> dict:
    """Gemma 3 as llama.cpp runs it: window layers by `attention.sliding_window_pattern` (a period,
    6 when absent, the last layer of each period global; or a flag per layer), their rope base
    `rope.freq_base_swa` (10000 when absent) unscaled; the softmax scale 1/sqrt(head size), or
    1/sqrt(hidden / heads) for the 62-layer (27B) model: llama.cpp's rule, as the files store no
    `query_pre_attn_scalar`."""
    get = _metadata_getter(facts, "gemma3", path)
    layers, window = int(kwargs["num_hidden_layers"]), int(get("attention.sliding_window") or 0)
    pattern = get("attention.sliding_window_pattern")
    if window <= 0:
        flags = [False] * layers
    elif isinstance(pattern, list):
        flags = [bool(flag) for flag in pattern][:layers]
    else:
        period = int(pattern or 6)
        flags = [period > 1 and i % period < period - 1 for i in range(layers)]
    scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"] if layers == 62 else kwargs["head_dim"]
    softcap = get("final_logit_softcapping")
    return dict(layer_types=["sliding_attention" if f else "full_attention" for f in flags],
                sliding_window=window if window > 0 else None, query_pre_attn_scalar=scalar,
                final_logit_softcapping=float(softcap) if softcap else None,
                rope_parameters={"full_attention": kwargs["rope_parameters"],
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": float(get("rope.freq_base_swa") or 10000.0)}})


def _phi3_kwargs(facts: GGUFFacts, kwargs: dict, path: Path) -> dict:
    """Phi-3 / Phi-4: long-rope from the factors llama.cpp stores as tensors (`rope_factors_long`,
    `rope_factors_short`) and the original context length; no window (llama.cpp disables Phi's)."""
    get = _metadata_getter(facts, "phi3", path)
    rope, factors = dict(kwargs["rope_parameters"]), facts.rope_factors or {}
    original = get("rope.scaling.original_context_length")
    if factors:
        if set(factors) != {"long", "short"} or original is None:
            raise ValueError(f"{path} stores only part of Phi-3's long-rope settings (rope_factors_long, "
                             f"rope_factors_short and rope.scaling.original_context_length are all needed); "
                             f"convert the model again.")
        rope.update(rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"])
    if original is not None:
        rope["original_max_position_embeddings"] = int(original)
    return dict(rope_parameters=rope, original_max_position_embeddings=int(original) if original else None)


def _qwen35_kwargs(facts: GGUFFacts, kwargs: dict, path: Path) -> dict:
    """Qwen3.5's linear-attention layers under llama.cpp's `ssm.*` keys (key heads: `group_count`, their
    size: `state_size`; value heads: `time_step_rank`, their total width: `inner_size`), which layers are
    recurrent (`attention.recurrent_layers`, else every layer but each `full_attention_interval`-th)."""
    get = _metadata_getter(facts, "qwen35", path)
    layers, v_heads = int(kwargs["num_hidden_layers"]), int(get("ssm.time_step_rank", required=True))
    flags = get("attention.recurrent_layers")
    if isinstance(flags, list):
        recurrent = [bool(f) for f in flags][:layers]
    else:
        interval = int(get("full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    return dict(linear_conv_kernel_dim=int(get("ssm.conv_kernel", required=True)),
                linear_key_head_dim=int(get("ssm.state_size", required=True)),
                linear_num_key_heads=int(get("ssm.group_count", required=True)),
                linear_num_value_heads=v_heads,
                linear_value_head_dim=int(get("ssm.inner_size", required=True)) // v_heads,
                layer_types=["linear_attention" if r else "full_attention" for r in recurrent])


def _moe_kwargs(facts: GGUFFacts, arch: str) -> dict:
    """The experts' config where the file's blocks hold them (metadata keys from gguf-py's constants;
    sizes the metadata leaves out read from the expert tensors' shapes); {} for a dense model."""
    experts = facts.meta.get(EXPERT_COUNT_KEY.format(arch=arch))
    if not experts:
        return {}
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys  # lazy: only MoE files need gguf-py here
    meta = lambda key: facts.meta.get(key.format(arch=arch))
    tensor = lambda kind, bid: facts.shapes.get(TENSOR_NAMES[kind].format(bid=bid) + ".weight")
    layers = int(meta(Keys.LLM.BLOCK_COUNT) or 0)
    routed = [i for i in range(layers) if tensor(MODEL_TENSOR.FFN_GATE_INP, i) is not None]
    gate = tensor(MODEL_TENSOR.FFN_GATE_EXP, routed[0]) if routed else None
    shared = tensor(MODEL_TENSOR.FFN_GATE_SHEXP, routed[0]) if routed else None
    norm = meta(Keys.LLM.EXPERT_WEIGHTS_NORM)
    return dict(num_experts=int(experts), num_local_experts=int(experts),
                num_experts_per_tok=int(meta(Keys.LLM.EXPERT_USED_COUNT) or 1),
                moe_intermediate_size=int(meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) or (gate[1] if gate else 0)),
                shared_expert_intermediate_size=int(meta(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
                                                    or (shared[0] if shared else 0)),
                # llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's or OLMoE's
                norm_topk_prob=bool(norm) if norm is not None else arch == "qwen3moe",
                mlp_only_layers=[i for i in range(layers) if i not in routed],
                clip_qkv=meta(Keys.Attention.CLAMP_KQV), qkv_bias="blk.0.attn_q.bias" in facts.shapes)


def _metadata_getter(facts: GGUFFacts, arch: str, path: Path):
    def get(key: str, default=None, required: bool = False):
        value = facts.meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"{path} has no {arch}.{key} metadata; the file is incomplete, convert it again.")
        return value
    return get


def _llama_kwargs(facts: GGUFFacts, arch: str, path: Path) -> dict:
    get = _metadata_getter(facts, arch, path)
    hidden, heads = int(get("embedding_length", required=True)), int(get("attention.head_count", required=True))
    head_dim = int(get("attention.key_length") or hidden // heads)
    rotated = int(get("rope.dimension_count") or head_dim)
    partial = arch in ("phi3", "qwen35")             # Phi-4-mini and Qwen3.5 rotate part of each head
    if rotated != head_dim and not partial:
        raise ValueError(f"{path} rotates only part of each head (rope.dimension_count "
                         f"{get('rope.dimension_count')} < head size {head_dim}), which stagewise does not support.")
    return dict(hidden_size=hidden, intermediate_size=int(get("feed_forward_length", required=True)),
                num_hidden_layers=int(get("block_count", required=True)), num_attention_heads=heads,
                num_key_value_heads=int(get("attention.head_count_kv") or heads), head_dim=head_dim,
                max_position_embeddings=int(get("context_length") or 2048),
                rms_norm_eps=float(get("attention.layer_norm_rms_epsilon") or 1e-6),
                rope_parameters={**_rope_parameters(facts, get, head_dim, path),
                                 **({"partial_rotary_factor": rotated / head_dim} if partial else {})},
                hidden_act="silu",
                attention_bias="blk.0.attn_q.bias" in facts.shapes, mlp_bias="blk.0.ffn_up.bias" in facts.shapes)


def _granite_kwargs(facts: GGUFFacts, head_dim: int, path: Path) -> dict:
    """Granite's multipliers under llama.cpp's keys; a missing attention scale is 1/sqrt(head size), as there."""
    get = _metadata_getter(facts, "granite", path)
    scale = lambda key: float(get(key) or 1.0)
    return dict(embedding_multiplier=scale("embedding_scale"), residual_multiplier=scale("residual_scale"),
                logits_scaling=scale("logit_scale"),
                attention_multiplier=float(get("attention.scale") or head_dim ** -0.5))


def _gpt2_kwargs(facts: GGUFFacts, path: Path) -> dict:
    get = _metadata_getter(facts, "gpt2", path)
    return dict(n_embd=int(get("embedding_length", required=True)), n_layer=int(get("block_count", required=True)),
                n_head=int(get("attention.head_count", required=True)), n_inner=int(get("feed_forward_length") or 0)
                or None, n_positions=int(get("context_length") or 1024),
                layer_norm_epsilon=float(get("attention.layer_norm_epsilon") or 1e-5))


def _rope_parameters(facts: GGUFFacts, get, head_dim: int, path: Path) -> dict:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base") or 10000.0)}
    kind = get("rope.scaling.type") or "none"
    if kind == "linear":
        params.update(rope_type="linear", factor=float(get("rope.scaling.factor", required=True)))
    elif kind == "yarn":
        params.update(rope_type="yarn", factor=float(get("rope.scaling.factor", required=True)),
                      original_max_position_embeddings=int(get("rope.scaling.original_context_length",
                                                               required=True)),
                      beta_fast=float(get("rope.scaling.yarn_beta_fast") or 32.0),
                      beta_slow=float(get("rope.scaling.yarn_beta_slow") or 1.0),
                      # gpt-oss's recipe (its config's `truncate: false`); transformers' default elsewhere
                      truncate=facts.meta.get("general.architecture") != "gpt-oss")
    elif kind != "none":
        raise ValueError(f"{path} uses {kind!r} rope scaling; stagewise supports none, linear, yarn and llama3.")
    if facts.rope_freqs is not None:
        params.update(_llama3_rope(facts.rope_freqs, params["rope_theta"], head_dim, path))
    return params


def _llama3_rope(divisors: list, theta: float, head_dim: int, path: Path) -> dict:
    """Recover llama3 rope settings from the per-frequency divisors llama.cpp stores (`rope_freqs.weight`).

    In the medium band smooth = (orig / wavelen - low) / (high - low), linear in 1 / wavelen; only the ratios
    of orig, low and high matter, so low = 1 and a line through the medium band give the rest exactly.
    """
    import numpy as np
    div = np.asarray(divisors, dtype=np.float64)
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(div.max())
    if factor <= 1.0:
        return {}
    mid = (div > 1 + 1e-6) & (div < factor * (1 - 1e-6))
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[mid], (1 / div[mid] - 1 / factor) / (1 - 1 / factor), 1)
        high = round(float(1 - 1 / intercept), 4)   # recipes use round numbers; the check below guards it
        orig = int(round(slope * (high - 1)))
        smooth = (orig / wavelen - 1) / (high - 1)
        rebuilt = np.where(wavelen < orig / high, 1.0,
                           np.where(wavelen > orig, factor, 1 / ((1 - smooth) / factor + smooth)))
        if np.allclose(rebuilt, div, rtol=1e-4):
            return dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=high,
                        original_max_position_embeddings=orig)
    raise ValueError(f"{path} stores rope frequency factors (rope_freqs.weight) that follow no llama3 rope recipe "
                     f"stagewise can reproduce; this model is not supported.")


def tokenizer_from_gguf(path: Path):
    """The tokenizer and chat template the GGUF metadata describes (a `SavedTokenizer`): transformers
    converts them once, in a child process, and the result is cached on disk."""
    from .saved_tokenizer import SavedTokenizer
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_root() / "gguf-tokenizers" / f"{path.stem}-{key}"
    if (cached / "tokenizer.json").exists():
        return SavedTokenizer.from_dir(cached)
    return _convert_tokenizer(path, cached)


def _convert_tokenizer(path: Path, target: Path):
    """Convert into a temp dir, read it, then rename it to `target`, so concurrent first starts never
    see half a tokenizer; a cache that cannot be written only costs the next start a conversion."""
    from .saved_tokenizer import SavedTokenizer
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    except OSError as exc:
        log.warning("Not caching the converted tokenizer (%s); the next start converts it again.", exc)
        tmp = Path(tempfile.mkdtemp(prefix="stagewise-tokenizer-"))
    try:
        _run_converter(path, tmp)
        tokenizer = SavedTokenizer.from_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            pass  # another process cached it first (rename onto a non-empty dir fails), or no cache dir
        return tokenizer
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_converter(path: Path, out: Path) -> None:
    """`python -m stagewise.checkpoint.gguf_meta PATH OUT` in a child process: transformers (and the seconds and
    ~190 MB it costs) stays out of this one. Its one-sentence error becomes this process's."""
    log.info("converting the tokenizer in %s's metadata (once; cached in %s)", path.name, out.parent)
    package_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "stagewise.checkpoint.gguf_meta", str(path), str(out)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode == 0:
        return
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    said = [line.removeprefix(_ERROR_PREFIX) for line in lines if line.startswith(_ERROR_PREFIX)]
    if said:
        raise ValueError(said[-1])
    last = lines[-1] if lines else "no output"
    raise ValueError(f"Converting the tokenizer in the metadata of {path} failed (exit status {done.returncode}: "
                     f"{last}); pass --tokenizer DIR with the model's tokenizer files.")


def _convert_main(argv: list[str]) -> int:
    """The child process of `_run_converter`: transformers' fast tokenizer from the metadata of
    `argv[0]`, saved (tokenizer.json, tokenizer_config.json, chat_template.jinja) into `argv[1]`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    path, out = Path(argv[0]), Path(argv[1])
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except TypeError:
            # transformers 5.23 fails parsing gpt-oss's `rope.scaling.*` keys while picking the tokenizer
            # class from the file's config; the generic fast tokenizer reads only `tokenizer.ggml.*`
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = " ".join(str(exc).split())
        print(f"{_ERROR_PREFIX}Could not build a tokenizer from the metadata of {path} ({why}); pass "
              f"--tokenizer DIR with the model's tokenizer files.", file=sys.stderr)
        return 2
    tokenizer.save_pretrained(str(out))
    return 0


if __name__ == "__main__":
    sys.exit(_convert_main(sys.argv[1:]))
