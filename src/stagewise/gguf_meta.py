"""GGUF metadata (llama.cpp's format): the transformers config, the tokenizer and the tensor
table a GGUF file describes, read from its header without dequantizing anything.

The facts of a file (metadata, and where each tensor's bytes are) are cached per process while
the file is unchanged; the reader that parsed them is not: its parsed fields (a Python object per
tokenizer entry) take ~150 MB and 3 s for a 49k-token vocabulary, so a process parses a file once
(a spare does it before it is needed) and keeps only the facts. The converted tokenizer is cached on
disk. Tensor data is read by `model.gguf`.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from .config import cache_root

log = logging.getLogger("stagewise.checkpoint")

# GGUF `general.architecture` -> the stage-model architecture that runs it (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gpt2": "GPT2LMHeadModel"}
_GGUF_BIG_FIELDS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores", "tokenizer.ggml.precompiled_charsmap"}


class GGUFTensor(NamedTuple):
    """Where one tensor's bytes are in the file, and what they hold (what `model.gguf` reads by)."""
    name: str
    tensor_type: int      # GGMLQuantizationType value
    shape: tuple          # GGUF order (dims reversed from torch's)
    data_offset: int
    n_bytes: int


class GGUFFacts(NamedTuple):
    meta: dict            # metadata key -> value (the large tokenizer arrays left out)
    shapes: dict          # tensor name -> shape in torch order (GGUF stores dims reversed)
    types: dict           # tensor name -> GGML type name (F32, Q4_K, ...)
    rope_freqs: list | None  # per-frequency rope divisors (llama3-style long-context rope), if stored
    tensors: tuple = ()   # GGUFTensor per tensor, in file order


def _file_key(path: str | Path) -> tuple[str, int, int]:
    stat = Path(path).stat()
    return str(path), stat.st_size, stat.st_mtime_ns


def gguf_facts(path: str | Path) -> GGUFFacts:
    return _gguf_facts(*_file_key(path))


def _open_gguf(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); pass a "
                             f"llama.cpp .gguf file or a checkpoint directory.")
    try:
        return GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 -- a cut-off file fails in numpy, struct or the reader itself
        raise ValueError(f"{path} is truncated or damaged ({size} bytes; reading it failed with {type(exc).__name__}: "
                         f"{exc}); download or convert it again.") from None


@functools.lru_cache(maxsize=8)
def _gguf_facts(path: str, size: int, mtime_ns: int) -> GGUFFacts:
    reader = _open_gguf(path, size, mtime_ns)
    meta = {key: field.contents() for key, field in reader.fields.items() if key not in _GGUF_BIG_FIELDS}
    tensors = {t.name: t for t in reader.tensors}
    rope = tensors.get("rope_freqs.weight")
    return GGUFFacts(meta, {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()},
                     {name: t.tensor_type.name for name, t in tensors.items()},
                     None if rope is None else rope.data.astype("float64").tolist(),
                     tuple(GGUFTensor(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset),
                                      int(t.n_bytes)) for t in reader.tensors))


def hf_config_from_gguf(path: Path):
    """A transformers config built from GGUF metadata (what llama.cpp's converter wrote from config.json)."""
    import transformers
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
    config_class = GGUF_ARCHITECTURES[arch].replace("LMHeadModel", "Config").replace("ForCausalLM", "Config")
    return getattr(transformers, config_class)(**kwargs, **common)


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
    if int(get("rope.dimension_count") or head_dim) != head_dim:
        raise ValueError(f"{path} rotates only part of each head (rope.dimension_count "
                         f"{get('rope.dimension_count')} < head size {head_dim}), which stagewise does not support.")
    return dict(hidden_size=hidden, intermediate_size=int(get("feed_forward_length", required=True)),
                num_hidden_layers=int(get("block_count", required=True)), num_attention_heads=heads,
                num_key_value_heads=int(get("attention.head_count_kv") or heads), head_dim=head_dim,
                max_position_embeddings=int(get("context_length") or 2048),
                rms_norm_eps=float(get("attention.layer_norm_rms_epsilon") or 1e-6),
                rope_parameters=_rope_parameters(facts, get, head_dim, path), hidden_act="silu",
                attention_bias="blk.0.attn_q.bias" in facts.shapes, mlp_bias="blk.0.ffn_up.bias" in facts.shapes)


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
    elif kind != "none":
        raise ValueError(f"{path} uses {kind!r} rope scaling; stagewise supports none, linear and llama3.")
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
    """transformers' fast tokenizer built from the GGUF metadata, converted once and cached on disk."""
    from transformers import AutoTokenizer
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_root() / "gguf-tokenizers" / f"{path.stem}-{key}"
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"Could not build a tokenizer from the metadata of {path} ({exc}); pass --tokenizer DIR "
                         f"with the model's tokenizer files.") from None
    _save_tokenizer(tokenizer, cached)
    return tokenizer


def _save_tokenizer(tokenizer, target: Path) -> None:
    """Write into a temp dir, then rename, so concurrent first starts never see half a tokenizer."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    except OSError as exc:
        log.warning("Not caching the converted tokenizer (%s); the next start converts it again.", exc)
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, target)
    except OSError:
        pass  # another process cached it first (rename onto a non-empty dir fails), or the disk is read-only
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
