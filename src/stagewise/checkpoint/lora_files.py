"""LoRA adapter files read without their weights: a PEFT directory (`adapter_config.json` and
`adapter_model*.safetensors` headers) or a llama.cpp GGUF LoRA file (`general.type` adapter,
`adapter.type` lora, `adapter.lora.alpha`, tensors `blk.N.<kind>.weight.lora_a` / `.lora_b`).
`AdapterFacts` says its rank, scale and where each layer's A/B pair is; the driver checks a runtime
load with it, and model/lora.py reads the tensors by it. Every refusal is one sentence naming the adapter.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .gguf_meta import gguf_facts

# the PEFT target modules stagewise applies LoRA to, and the llama.cpp tensor kind of each
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GGUF_KINDS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
              "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_REFUSED = (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
            ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("modules_to_save", "modules_to_save"),
            ("layers_to_transform", "layers_to_transform"))
_GGUF_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")

Pair = tuple[int, str]      # (layer id, target module)


@dataclass
class AdapterFacts:
    name: str
    path: str
    rank: int
    scale: float
    tensors: dict[Pair, tuple[str, str]]                 # each pair's A and B tensor names in the file(s)
    shapes: dict[Pair, tuple[tuple[int, ...], tuple[int, ...]]]    # A [r, in] and B [out, r], torch order
    gguf_arch: str | None = None                         # a GGUF file's general.architecture

    @property
    def is_gguf(self) -> bool:
        return self.gguf_arch is not None


def parse_lora_modules(specs) -> dict[str, str]:
    """`name=path` texts (or a {name: path} dict) -> {name: path}; one sentence on a bad one."""
    if isinstance(specs, dict):
        return {str(k): str(v) for k, v in specs.items()}
    out: dict[str, str] = {}
    for spec in specs or ():
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules entry {spec!r} must be name=path (an adapter directory or file).")
        out[name.strip()] = path.strip()
    return out


def adapter_facts(name: str, path: str, max_rank: int) -> AdapterFacts:
    """What adapter `name` at `path` holds (a GGUF LoRA file, else a PEFT directory), checked."""
    facts = _gguf(name, path) if Path(path).is_file() else _peft(name, path)
    if facts.rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {facts.rank}, above --max-lora-rank {max_rank}; raise it.")
    return facts


def check_shapes(facts: AdapterFacts, num_layers: int, fits: dict[str, tuple[int, int]]) -> None:
    """The adapter against a model of `num_layers` layers whose targets are `fits`: target -> (in, out)."""
    for (layer, target), (a, b) in facts.shapes.items():
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {facts.name!r} has weights for layer {layer}; the model has "
                             f"{num_layers} layers (is it an adapter of another base model?).")
        fan_in, fan_out = fits[target]
        if tuple(a) != (facts.rank, fan_in) or tuple(b) != (fan_out, facts.rank):
            raise ValueError(f"LoRA adapter {facts.name!r}: layer {layer} {target} has A {tuple(a)} and B {tuple(b)}, "
                             f"which do not fit the model's {fan_in} -> {fan_out} projection (an adapter of another "
                             f"base model?).")


def _peft(name: str, path: str) -> AdapterFacts:
    root = Path(path)
    cfg_file = root / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} has no adapter_config.json (a PEFT adapter directory or a "
                         f"GGUF LoRA file is expected).")
    cfg = json.loads(cfg_file.read_text())
    for key, what in _REFUSED:
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r} uses {what}, which stagewise does not support.")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={cfg['bias']!r}); only bias 'none' is supported.")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = sorted(t for t in targets if t.split(".")[-1] not in TARGETS)
    if bad:
        raise ValueError(f"LoRA adapter {name!r} targets {', '.join(bad)}; stagewise applies LoRA to "
                         f"{', '.join(TARGETS)} only.")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    files = sorted(root.glob("adapter_model*.safetensors"))
    if not files:
        raise ValueError(f"LoRA adapter {name!r}: {root} has no adapter_model.safetensors.")
    found: dict[Pair, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for file in files:
        for key, shape in _safetensors_shapes(name, file).items():
            parts = key.split(".")
            if "layers" not in parts or not ("lora_A" in parts or "lora_B" in parts):
                raise ValueError(f"LoRA adapter {name!r} holds {key}, which is not a decoder layer's lora_A/lora_B.")
            side = "A" if "lora_A" in parts else "B"
            target = parts[parts.index("lora_" + side) - 1]
            if target not in TARGETS:
                raise ValueError(f"LoRA adapter {name!r} targets {target}; stagewise applies LoRA to "
                                 f"{', '.join(TARGETS)} only.")
            found.setdefault((int(parts[parts.index("layers") + 1]), target), {})[side] = (key, shape)
    return _facts(name, path, rank, scale, found, None)


def _safetensors_shapes(name: str, file: Path) -> dict[str, tuple[int, ...]]:
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error):
        raise ValueError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file.") from None
    return {key: tuple(meta["shape"]) for key, meta in header.items() if key != "__metadata__"}


def _gguf(name: str, path: str) -> AdapterFacts:
    try:
        facts = gguf_facts(path)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
    meta = facts.meta
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ValueError(f"LoRA adapter {name!r}: {path} is a GGUF file but not a LoRA adapter (general.type "
                         f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r}); convert the "
                         f"adapter with llama.cpp's convert_lora_to_gguf.py.")
    found: dict[Pair, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for t in facts.tensors:
        match = _GGUF_NAME.fullmatch(t.name)
        if match is None or match[2] not in GGUF_KINDS:
            raise ValueError(f"LoRA adapter {name!r} holds {t.name}, which is not a decoder layer's lora_a/lora_b of "
                             f"{', '.join(GGUF_KINDS)}; stagewise applies LoRA to those only.")
        found.setdefault((int(match[1]), GGUF_KINDS[match[2]]), {})[match[3].upper()] = (t.name, facts.shapes[t.name])
    ranks = {sides["A"][1][0] for sides in found.values() if "A" in sides}
    if len(ranks) > 1:
        raise ValueError(f"LoRA adapter {name!r} has ranks {sorted(ranks)} in one file; stagewise supports one rank "
                         f"per adapter.")
    rank = ranks.pop() if ranks else 0
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    # llama.cpp's rule: scale alpha / rank, and 1 where the file gives no alpha
    scale = alpha / rank if alpha and rank else 1.0
    return _facts(name, path, rank, scale, found, str(meta.get("general.architecture", "")))


def _facts(name: str, path: str, rank: int, scale: float, found: dict, arch: str | None) -> AdapterFacts:
    if not found:
        raise ValueError(f"LoRA adapter {name!r}: {path} holds no LoRA weights.")
    for (layer, target), sides in found.items():
        if len(sides) != 2:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} has lora_{next(iter(sides))} without its "
                             f"other half.")
    tensors = {pair: (sides["A"][0], sides["B"][0]) for pair, sides in found.items()}
    shapes = {pair: (sides["A"][1], sides["B"][1]) for pair, sides in found.items()}
    return AdapterFacts(name, path, rank, scale, tensors, shapes, arch)
