"""`ModelFacts`: what a checkpoint says about its model, read once (config.json or a GGUF file's
metadata) and normalised (GPT-2's `n_embd`, a missing KV head count, ...), then handed to the driver,
the planner, the supervisor and each stage. Nothing else reads config.json or GGUF metadata.

A model is a list of layers, each with a kind and its bytes as stored: a family whose layers differ
(mixture-of-experts blocks, sliding-window or recurrent layers) names their kinds here and the
planner sizes each layer by its own entry."""
from __future__ import annotations

import copy
import functools
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import eos_token_ids_of, gguf_file_of, load_hf_config
from .gguf_meta import gguf_facts, held_quantized

DEFAULT_POSITIONS = 2048       # a config that names no position limit
# A layer's tensors, by name: HF (`model.layers.3.`, GPT-2's `h.3.`) and GGUF (`blk.3.`)
_LAYER_OF = re.compile(r"(?:^|\.)(?:layers|h|blk)\.(\d+)\.")


@dataclass(frozen=True)
class LayerFacts:
    """One layer: its kind (`decoder`: attention and a dense MLP; `sliding`, `moe`, ... as families
    add them) and its tensors' bytes as stored in the file (0 where the file says nothing)."""
    kind: str
    stored_bytes: int = 0


@dataclass(frozen=True)
class ModelFacts:
    """One model's shapes and storage, read once per file (`read_facts`)."""
    path: str                      # the checkpoint directory or GGUF file
    architecture: str              # e.g. LlamaForCausalLM ("" where the config names none)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    tie_embeddings: bool
    layers: tuple[LayerFacts, ...]
    other_bytes: int               # embedding, final norm and head as stored
    stored_dtype: str | None       # config.json's dtype ("bfloat16", ...); None for a GGUF file
    gguf: str | None               # the GGUF file, if the checkpoint is one
    quantized_as: str | None       # a GGUF file's quantized type name ("Q8_0", ...), else None
    eos_token_ids: tuple[int, ...]
    config: Any = field(compare=False, repr=False)   # as read; `hf` hands out copies

    @property
    def hf(self) -> Any:
        """The config object the model classes are built from: a copy, since callers may change it
        (e.g. a test widening a model) and the facts are shared by everyone in the process."""
        return copy.deepcopy(self.config)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    def max_len(self, asked: int | None) -> int:
        """The context length: `asked` (--max-model-len), at most the model's position limit."""
        if asked is not None and asked > self.max_positions:
            raise ValueError(f"max_model_len {asked} exceeds the model's {self.max_positions} positions.")
        return asked or self.max_positions


def read_facts(model_path: str | Path) -> ModelFacts:
    """The facts of a checkpoint directory or GGUF file, read once per version of its files."""
    return _read_facts(str(model_path), _stamp(Path(model_path)))


def _stamp(path: Path) -> tuple:
    """What changes when the checkpoint does: each file's name, size and modification time (a
    directory's own time does not change when a file in it is rewritten in place)."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    stamps = []
    for file in files:
        if file.suffix in (".json", ".safetensors", ".gguf"):
            try:
                info = file.stat()
            except OSError:
                continue
            stamps.append((file.name, info.st_size, info.st_mtime_ns))
    return tuple(stamps)


@functools.lru_cache(maxsize=8)
def _read_facts(path: str, _stamp: tuple) -> ModelFacts:
    hf = load_hf_config(path)
    gguf = gguf_file_of(path)
    n = _first(hf, "num_hidden_layers", "n_layer")
    stored, other = _stored_bytes(Path(path), gguf, n) if n else ([], 0)
    return facts_of_config(hf, path, stored, other, gguf=None if gguf is None else str(gguf),
                           eos_token_ids=eos_token_ids_of(path, hf))


def facts_of_config(hf, path: str = "the checkpoint", stored: list[int] | None = None, other_bytes: int = 0, *,
                    gguf: str | None = None, eos_token_ids: tuple[int, ...] = ()) -> ModelFacts:
    """The facts of a config object (`read_facts` reads one from the file; tests build one in memory)."""
    n = _first(hf, "num_hidden_layers", "n_layer")
    if not n:
        raise ValueError(f"{path}/config.json names no layer count (num_hidden_layers or n_layer).")
    hidden = _first(hf, "hidden_size", "n_embd")
    heads = _first(hf, "num_attention_heads", "n_head")
    return ModelFacts(
        path=path, architecture=(getattr(hf, "architectures", None) or [""])[0], hidden=hidden, heads=heads,
        kv_heads=_first(hf, "num_key_value_heads") or heads,
        head_dim=_first(hf, "head_dim") or (hidden // heads if heads else 0),
        intermediate=_first(hf, "intermediate_size", "n_inner") or 4 * hidden, vocab=int(hf.vocab_size),
        max_positions=_first(hf, "max_position_embeddings", "n_positions") or DEFAULT_POSITIONS,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        layers=tuple(LayerFacts(kind, b) for kind, b in zip(_layer_kinds(hf, n), stored or [0] * n)),
        other_bytes=other_bytes, stored_dtype=None if gguf else _dtype_name(hf), gguf=gguf,
        quantized_as=None if gguf is None else held_quantized(gguf), eos_token_ids=eos_token_ids, config=hf)


def _first(hf, *names: str) -> int:
    for name in names:
        value = getattr(hf, name, None)
        if value:
            return int(value)
    return 0


def _dtype_name(hf) -> str | None:
    saved = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return None if saved is None else str(saved).removeprefix("torch.")


def _layer_kinds(hf, n: int) -> list[str]:
    """Each layer's kind: `decoder` unless the config lists kinds (`layer_types`, e.g. sliding-window
    layers) or routes to experts (`moe`)."""
    listed = getattr(hf, "layer_types", None)
    if listed and len(listed) == n:
        return [str(kind) for kind in listed]
    experts = _first(hf, "num_local_experts", "num_experts")
    return ["moe" if experts > 1 else "decoder"] * n


def _stored_bytes(path: Path, gguf: Path | None, n: int) -> tuple[list[int], int]:
    """Bytes per layer as stored, and the rest (embedding, norm, head): from the GGUF tensor table or
    the safetensors headers (no tensor is read)."""
    sizes = _gguf_sizes(gguf) if gguf is not None else _safetensors_sizes(path)
    layers, other = [0] * n, 0
    for name, nbytes in sizes:
        match = _LAYER_OF.search(name)
        if match and int(match.group(1)) < n:
            layers[int(match.group(1))] += nbytes
        else:
            other += nbytes
    return layers, other


def _gguf_sizes(path: Path) -> list[tuple[str, int]]:
    return [(t.name, t.n_bytes) for t in gguf_facts(path).tensors]


def _safetensors_sizes(path: Path) -> list[tuple[str, int]]:
    out = []
    for file in sorted(path.glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            continue            # a damaged shard is the loader's error to report, with its name
        out += [(name, end - start) for name, meta in header.items() if name != "__metadata__"
                for start, end in [meta["data_offsets"]]]
    return out
