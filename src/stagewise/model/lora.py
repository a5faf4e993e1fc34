"""LoRA adapters (PEFT format: `adapter_config.json` + `adapter_model.safetensors`; GGUF LoRA files are
read by lora_gguf.py) applied per row on the activations: `out[rows] += (x[rows] @ A^T @ B^T) * scale`
after a projection, never merged into the base weights, so requests of several adapters and of the base
model share one batch. `LoraSet` holds a stage's adapters (its own layers' weights only; loaded and
unloaded while serving too) and the step's row -> adapter map the worker sets.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoint.lora_files import adapter_facts

# PEFT target name -> (the block's attribute path of our projection, the fused part it is)
MODULES = {"q_proj": ("self_attn.qkv_proj", "q_proj"), "k_proj": ("self_attn.qkv_proj", "k_proj"),
           "v_proj": ("self_attn.qkv_proj", "v_proj"), "o_proj": ("self_attn.o_proj", None),
           "gate_proj": ("mlp.gate_up_proj", "gate_proj"), "up_proj": ("mlp.gate_up_proj", "up_proj"),
           "down_proj": ("mlp.down_proj", None)}


@dataclass
class LoraAdapter:
    """One adapter as read: its rank, scale and `{(layer_id, target): (A [r, in], B [out, r])}`."""
    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str, max_rank: int, heads: tuple[int, int]) -> LoraAdapter:
    """A PEFT directory or a llama.cpp GGUF LoRA file (`heads`: the base model's query and key-value head
    counts, which un-permute a GGUF file's q/k rows); one sentence naming the adapter if it cannot be read."""
    facts = adapter_facts(name, path, max_rank)
    if facts.is_gguf:
        from .lora_gguf import read_gguf_weights  # here: a PEFT-only run never imports the GGUF reader
        return LoraAdapter(name, facts.rank, facts.scale, read_gguf_weights(facts, heads))
    from safetensors.torch import load_file  # here: a run without adapters never loads safetensors
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("adapter_model*.safetensors")):
        tensors.update(load_file(str(f)))
    return LoraAdapter(name, facts.rank, facts.scale, {pair: (tensors[a], tensors[b])
                                                       for pair, (a, b) in facts.tensors.items()})


class LoraSet:
    """A stage's adapters on its layers' projections: each loaded adapter has an index (0 is the base
    model; indices are never reused, so a row never meets an unloaded adapter's successor)."""

    def __init__(self, model: Any, stage, max_rank: int, heads: tuple[int, int]):
        """`heads`: the model's query and key-value head counts (all ranks': a GGUF file's q/k rows)."""
        self.model, self.stage, self.max_rank, self.heads = model, stage, max_rank, heads
        self.index: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self._next = 1
        # (layer_id, module path) -> per adapter index: [(out column slice, A, B, scale)]
        self.parts: dict[tuple[int, str], dict[int, list[tuple[slice, torch.Tensor, torch.Tensor, float]]]] = {}
        self.groups: list[tuple[int, torch.Tensor]] = []    # this step: (adapter index, its rows), base left out

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def sync(self, table: dict[str, str], on_error: Callable[[str, Exception], None] | None = None) -> None:
        """Hold exactly the adapters of `table` ({name: path}): drop the others, read the new ones (a
        name whose path changed is read again). Idempotent: a rebuilt pipeline gets the whole table.
        `on_error(name, exc)`: an adapter that cannot be read is left out (None: the error is raised)."""
        for name in [n for n in self.index if table.get(n) != self.paths[n]]:
            self.unload(name)
        for name, path in table.items():
            if name in self.index:
                continue
            try:
                self.load(name, path)
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(name, exc)

    def load(self, name: str, path: str) -> None:
        """Read adapter `name` and hook its weights for this stage's layers (all checked before any is kept)."""
        adapter = read_adapter(name, path, self.max_rank, self.heads)
        p = next(self.model.parameters())
        entries = [(layer_id, mod_path, cols, A.to(p.device, p.dtype).contiguous(),
                    B.to(p.device, p.dtype).contiguous())
                   for layer_id, mod_path, cols, A, B in _fit(self.model, adapter, self.stage)]
        idx, self._next = self._next, self._next + 1
        for layer_id, mod_path, cols, A, B in entries:
            key = (layer_id, mod_path)
            if key not in self.parts:
                self.parts[key] = {}
                # first of the module's hooks: a tensor-parallel gather (parallel/tp.py) comes after the delta
                module = self.model.layers[layer_id].get_submodule(mod_path)
                module.register_forward_hook(self.hook(layer_id, mod_path), prepend=True)
            self.parts[key].setdefault(idx, []).append((cols, A, B, adapter.scale))
        self.index[name], self.paths[name] = idx, path

    def unload(self, name: str) -> None:
        idx = self.index.pop(name)
        self.paths.pop(name)
        for table in self.parts.values():
            table.pop(idx, None)

    def adapter_of(self, name: str | None) -> int:
        """A request's adapter index (0: the base model)."""
        if name is None:
            return 0
        if name not in self.index:
            raise RuntimeError(f"stage {self.stage.rank} does not hold the LoRA adapter {name!r} (it could not read "
                               f"it when it was loaded; see this stage's log).")
        return self.index[name]

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


def attach_loras(model: torch.nn.Module, stage, adapters: dict[str, str], max_rank: int, heads: tuple[int, int],
                 runtime: bool = False) -> LoraSet | None:
    """Read `adapters` ({name: path}) and hook their weights onto this stage's layers of `model` (a
    Llama-style decoder, whole or one tensor-parallel rank's shard); None without adapters unless
    `runtime` (adapters loaded while serving). A mismatch is one sentence naming the adapter."""
    if not adapters and not runtime:
        return None
    if getattr(model, "layers", None) is None or not hasattr(model, "qk_norm"):
        what = ", ".join(adapters) or "loaded at run time"
        raise ValueError(f"LoRA adapters ({what}) need a Llama-style model; {type(model).__name__} is not one.")
    lora = LoraSet(model, stage, max_rank, heads)
    lora.sync(adapters)
    model.__dict__["lora"] = lora      # not a submodule: its tensors are not the model's weights
    return lora


def _check_pair(adapter: LoraAdapter, layer_id: int, target: str, A: torch.Tensor, B: torch.Tensor,
                fan_in: int, fan_out: int) -> None:
    if A.shape != (adapter.rank, fan_in) or B.shape != (fan_out, adapter.rank):
        raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer_id} {target} has A {tuple(A.shape)} and B "
                         f"{tuple(B.shape)}, which do not fit the model's {fan_in} -> {fan_out} projection (an "
                         f"adapter of another base model?).")


def _fit(model: Any, adapter: LoraAdapter, stage):
    """(layer_id, module path, output columns, A, B) of each weight pair of `stage`'s layers, checked
    against `model`."""
    layers = model.layers
    for (layer_id, target), (A, B) in adapter.weights.items():
        if layer_id >= len(layers):
            raise ValueError(f"LoRA adapter {adapter.name!r} has weights for layer {layer_id}; the model has "
                             f"{len(layers)} layers (is it an adapter of another base model?).")
        if not stage.start <= layer_id < stage.end:
            continue
        mod_path, part = MODULES[target]
        try:
            module = layers[layer_id].get_submodule(mod_path)
        except AttributeError:      # a mixture-of-experts block has no dense gate/up/down
            raise ValueError(f"LoRA adapter {adapter.name!r} targets {target} of layer {layer_id}, which "
                             f"{type(model).__name__} does not have as a dense projection.") from None
        cols = _columns(module, part)
        if cols is None:
            raise ValueError(f"LoRA adapter {adapter.name!r} targets {target}, which {type(model).__name__} holds "
                             f"fused with other projections in its checkpoint; LoRA on it is not supported.")
        piece = _tp_piece(model, layer_id, mod_path, target)
        _check_pair(adapter, layer_id, target, A, B, int(module.in_features),
                    cols.stop - cols.start if piece is None else piece.full)
        # tensor parallel: this rank's output rows of B (its heads, its share of gate/up, its rows of the
        # gathered o/down projections, whose input is whole here); A is whole on every rank
        yield layer_id, mod_path, cols, A, B if piece is None else piece.take(B)


def _tp_piece(model: Any, layer_id: int, mod_path: str, target: str):
    """This tensor-parallel rank's parallel.tp.Slice of the target's weight rows; None without TP."""
    slices = model.__dict__.get("tp_slices")
    if not slices:
        return None
    return slices[model.hf_name(f"layers.{layer_id}.{mod_path.rsplit('.', 1)[0]}.{target}.weight")]


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
