"""LoRA adapters (PEFT format: `adapter_config.json` + `adapter_model.safetensors`) applied per row on
the activations: `out[rows] += (x[rows] @ A^T @ B^T) * scale` after a projection, never merged into the
base weights, so requests of several adapters and of the base model share one batch. `LoraSet` holds a
stage's adapters (its own layers' weights only) and the step's row -> adapter map the worker sets.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# PEFT target name -> (the block's attribute path of our projection, the fused part it is)
TARGETS = {"q_proj": ("self_attn.qkv_proj", "q_proj"), "k_proj": ("self_attn.qkv_proj", "k_proj"),
           "v_proj": ("self_attn.qkv_proj", "v_proj"), "o_proj": ("self_attn.o_proj", None),
           "gate_proj": ("mlp.gate_up_proj", "gate_proj"), "up_proj": ("mlp.gate_up_proj", "up_proj"),
           "down_proj": ("mlp.down_proj", None)}
_REFUSED = (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
            ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("modules_to_save", "modules_to_save"),
            ("layers_to_transform", "layers_to_transform"))


def parse_lora_modules(specs) -> dict[str, str]:
    """`name=path` texts (or a {name: path} dict) -> {name: path}; one sentence on a bad one."""
    if isinstance(specs, dict):
        return {str(k): str(v) for k, v in specs.items()}
    out: dict[str, str] = {}
    for spec in specs or ():
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules entry {spec!r} must be name=path (an adapter directory).")
        out[name.strip()] = path.strip()
    return out


@dataclass
class LoraAdapter:
    """One adapter as read: its rank, scale and `{(layer_id, target): (A [r, in], B [out, r])}`."""
    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def read(cls, name: str, path: str, max_rank: int) -> "LoraAdapter":
        root = Path(path)
        cfg_file = root / "adapter_config.json"
        if not cfg_file.is_file():
            raise ValueError(f"LoRA adapter {name!r}: {path} has no adapter_config.json (a PEFT adapter directory "
                             f"is expected).")
        cfg = json.loads(cfg_file.read_text())
        for key, what in _REFUSED:
            if cfg.get(key):
                raise ValueError(f"LoRA adapter {name!r} uses {what}, which stagewise does not support.")
        if cfg.get("bias", "none") != "none":
            raise ValueError(f"LoRA adapter {name!r} trains biases (bias={cfg['bias']!r}); only bias 'none' is "
                             f"supported.")
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}; raise it.")
        targets = cfg.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else list(targets)
        bad = sorted(t for t in targets if t.split(".")[-1] not in TARGETS)
        if bad:
            raise ValueError(f"LoRA adapter {name!r} targets {', '.join(bad)}; stagewise applies LoRA to "
                             f"{', '.join(TARGETS)} only.")
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        return cls(name, rank, scale, _read_weights(name, root))


def _read_weights(name: str, root: Path) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    files = sorted(root.glob("adapter_model*.safetensors"))
    if not files:
        raise ValueError(f"LoRA adapter {name!r}: {root} has no adapter_model.safetensors.")
    from safetensors.torch import load_file  # here: a run without adapters never loads safetensors
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        parts = key.split(".")
        if "layers" not in parts or not ("lora_A" in parts or "lora_B" in parts):
            raise ValueError(f"LoRA adapter {name!r} holds {key}, which is not a decoder layer's lora_A/lora_B.")
        layer = int(parts[parts.index("layers") + 1])
        side = "A" if "lora_A" in parts else "B"
        target = parts[parts.index("lora_" + side) - 1]
        if target not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r} targets {target}; stagewise applies LoRA to "
                             f"{', '.join(TARGETS)} only.")
        pairs.setdefault((layer, target), {})[side] = t
    return {k: (v["A"], v["B"]) for k, v in pairs.items() if len(v) == 2}


class LoraSet:
    """A stage's adapters (index i+1 for the i-th name; 0 is the base model) on its layers' projections."""

    def __init__(self, names: list[str]):
        self.index = {n: i + 1 for i, n in enumerate(names)}
        # (layer_id, module path) -> per adapter index: [(out column slice, A, B, scale)]
        self.parts: dict[tuple[int, str], dict[int, list[tuple[slice, torch.Tensor, torch.Tensor, float]]]] = {}
        self.groups: list[tuple[int, torch.Tensor]] = []    # this step: (adapter index, its rows), base left out

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set_rows(self, row_adapters: list[int], device: torch.device) -> None:
        """The step's adapter index per row (0: the base model)."""
        self.groups = []
        if not any(row_adapters):
            return
        rows = torch.tensor(row_adapters, dtype=torch.long)
        for a in sorted(set(row_adapters) - {0}):
            self.groups.append((a, torch.nonzero(rows == a).flatten().to(device)))

    def hook(self, layer_id: int, path: str):
        table = self.parts[(layer_id, path)]

        def apply(module, args, out: torch.Tensor) -> torch.Tensor:
            if not self.groups:
                return out
            x = args[0]
            for a, rows in self.groups:
                xs = None
                for cols, A, B, scale in table.get(a, ()):
                    xs = x.index_select(0, rows) if xs is None else xs
                    delta = (xs @ A.t()) @ B.t() * scale
                    out[:, cols].index_add_(0, rows, delta.to(out.dtype))
            return out
        return apply


def attach_loras(model: torch.nn.Module, stage, adapters: dict[str, str], max_rank: int) -> LoraSet | None:
    """Read `adapters` ({name: directory}) and hook their weights onto this stage's layers of `model`
    (a Llama-style decoder); None without adapters. A mismatch is one sentence naming the adapter."""
    if not adapters:
        return None
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "qk_norm") or getattr(model, "tp_size", 1) != 1:
        raise ValueError(f"LoRA adapters ({', '.join(adapters)}) need a Llama-style model without tensor "
                         f"parallelism; {type(model).__name__} is not one (or tp_size > 1).")
    lora = LoraSet(list(adapters))
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    for name, path in adapters.items():
        adapter = LoraAdapter.read(name, path, max_rank)
        for (layer_id, target), (A, B) in adapter.weights.items():
            if layer_id >= len(layers):
                raise ValueError(f"LoRA adapter {name!r} has weights for layer {layer_id}; the model has "
                                 f"{len(layers)} layers (is it an adapter of another base model?).")
            if not stage.start <= layer_id < stage.end:
                continue
            mod_path, part = TARGETS[target]
            try:
                module = layers[layer_id].get_submodule(mod_path)
            except AttributeError:      # a mixture-of-experts block has no dense gate/up/down
                raise ValueError(f"LoRA adapter {name!r} targets {target} of layer {layer_id}, which "
                                 f"{type(model).__name__} does not have as a dense projection.") from None
            cols = _columns(module, part)
            if cols is None:
                raise ValueError(f"LoRA adapter {name!r} targets {target}, which {type(model).__name__} holds fused "
                                 f"with other projections in its checkpoint; LoRA on it is not supported.")
            if A.shape != (adapter.rank, module.in_features) or B.shape != (cols.stop - cols.start, adapter.rank):
                raise ValueError(f"LoRA adapter {name!r}: layer {layer_id} {target} has A {tuple(A.shape)} and B "
                                 f"{tuple(B.shape)}, which do not fit the model's {module.in_features} -> "
                                 f"{cols.stop - cols.start} projection (an adapter of another base model?).")
            table = lora.parts.setdefault((layer_id, mod_path), {})
            table.setdefault(lora.index[name], []).append(
                (cols, A.to(device, dtype).contiguous(), B.to(device, dtype).contiguous(), adapter.scale))
    for (layer_id, mod_path) in lora.parts:
        layers[layer_id].get_submodule(mod_path).register_forward_hook(lora.hook(layer_id, mod_path))
    model.__dict__["lora"] = lora      # not a submodule: its tensors are not the model's weights
    return lora


def _columns(module: Any, part: str | None) -> slice | None:
    """The output columns of `part` in a fused projection (all of them for a plain one)."""
    if part is None:
        return slice(0, int(module.out_features))
    start = 0
    for name, rows in module.hf_parts:
        if name == part:
            return slice(start, start + rows)
        start += rows
    return None
