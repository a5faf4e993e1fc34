"""Building blocks shared by the model families: norms, rotary tables, fused projections,
stage placeholders, and `StageModel`, the base that maps Hugging Face tensor names onto this
stage's parameters so a stage loads only its own weights. Everything is token-major
(`[T, ...]`, no batch dim) and knows nothing of requests, schedulers or processes.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Any, Callable, Iterable, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.kernels import norm as cpu_norm
from stagewise.kernels import rope as cpu_rope
from stagewise.model.cpu_gemm import Linear
from stagewise.parallel.partition import StageInfo


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """HF's NewGELUActivation: one fused kernel in float32; below it, HF's formula op by op so a
    bf16 model rounds where HF's does."""
    if x.dtype == torch.float32:
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"Activation {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}.")
    return _ACTIVATIONS[name]


def eager_only(fn: Callable) -> Callable:
    """`torch.compiler.disable(fn)` for code a compiled stage body must run eagerly (data-dependent
    grouping or indexing: a graph break there), applied only once something compiles: decorating
    with `torch.compiler.disable` at import would import torch._dynamo (~115 MB resident with sympy
    and triton) into every process that merely loads the model."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)
    return call


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like HF; with `residual` it is the fused add+norm of pre-norm blocks."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one call; the weight product is the same multiply HF does last
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x32.to(x.dtype)   # HF rounds the normed value before the weight product

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: `norm(x)`. With residual: `(norm(x + residual), x + residual)`.
        Eager on the CPU, one call of the C kernel (kernels/norm.py: the same rounding points)
        instead of ~10 PyTorch ops; compiled graphs trace the PyTorch ops below."""
        if (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and self.weight.dtype == x.dtype and x.dim() >= 2 and x.stride(-1) == 1 and cpu_norm.available()
                and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
                and not (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad))):
            return self._kernel(x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None):
        shape, n = x.shape, x.shape[-1]
        rows = x if x.dim() == 2 else x.reshape(-1, n)     # q_norm / k_norm: [T, H, D] (a copy where needed)
        res = None if residual is None else (residual if residual.dim() == 2 else residual.reshape(-1, n))
        if res is not None and res.stride(-1) != 1:
            res = res.contiguous()
        out, total = cpu_norm.rms_norm(rows, res, self.weight, self.eps)
        if x.dim() != 2:
            out, total = out.view(shape), (total.view(shape) if residual is not None else total)
        return out if residual is None else (out, total)


def rope_parameters(hf_config) -> dict:
    """Rope settings from a transformers-5 `rope_parameters` dict or the older `rope_theta` + `rope_scaling`."""
    params: dict = {"rope_theta": 10000.0}
    if getattr(hf_config, "rope_theta", None) is not None:
        params["rope_theta"] = hf_config.rope_theta
    for source in (getattr(hf_config, "rope_scaling", None), getattr(hf_config, "rope_parameters", None)):
        if isinstance(source, dict):
            params.update({k: v for k, v in source.items() if v is not None})
    if getattr(hf_config, "original_max_position_embeddings", None) is not None:    # Phi-3 keeps it beside
        params.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
    legacy_type = params.pop("type", None)  # pre-4.45 configs spell rope_type as "type"
    params["rope_type"] = params.get("rope_type") or legacy_type or "default"
    if params["rope_type"] == "yarn":   # transformers' standardize_rope_params: the pretraining length
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)
                          or getattr(hf_config, "max_position_embeddings", None))
        if params.get("factor") is None:    # transformers: the ratio of the lengths (DeepSeek-V3)
            params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


def rope_inv_freq(head_dim: int, params: dict, device=None) -> torch.Tensor:
    """Inverse frequencies `[D/2]`, bit-identical to HF for rope types default, linear, llama3 and yarn.
    `head_dim`: the rotated dims (`rotary_dim`: fewer under `partial_rotary_factor`)."""
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / params["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv, params)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, base, params, device)
    raise ValueError(f"Rope type {kind!r} is not supported; supported: default, linear, llama3, yarn.")


def _yarn_inv_freq(dim: int, base: float, params: dict, device) -> torch.Tensor:
    """YaRN (transformers' `_compute_yarn_parameters`): low frequencies interpolated by `factor`,
    high ones kept, a linear ramp between the dimensions that turn `beta_slow` and `beta_fast` times
    over the pretraining length."""
    factor = float(params["factor"])
    old_len = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001       # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_scaling(params: dict) -> float:
    """The factor transformers multiplies the cos/sin tables by: 1, or YaRN's attention factor
    (`attention_factor`, else from `factor` and `mscale`/`mscale_all_dim`)."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"]))
    return mscale(factor)


def _llama3_inv_freq(inv: torch.Tensor, params: dict) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    # Medium wavelengths blend the scaled and unscaled frequencies (Llama 3.1 recipe).
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables precomputed up to max positions, indexed by `positions` (no data-dependent work).

    Kept full-width, built from HF's half-width tables with the rotate-half sign folded in, so
    applying rope is one cat and three elementwise ops per call.
    """

    cos_full: torch.Tensor      # buffers registered in __init__
    sin_signed: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        self.head_dim, self.max_positions, self.params = head_dim, max_positions, params
        # NOTE: non-persistent, so the loader must call reset_buffers() after to_empty().
        self.register_buffer("cos_full", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin_signed", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The tables, unless on the meta device (where stages are built before loading): there is
        nothing to compute there, and meta pow runs torch._refs' Python version, whose first call
        imports torch._dynamo (~115 MB resident with sympy and triton)."""
        device = self.cos_full.device
        if device.type == "meta":
            return
        inv = rope_inv_freq(self.head_dim, self.params, device)
        pos = torch.arange(self.max_positions, device=device).float()
        freqs = pos[:, None] * inv[None, :]  # [P, D/2] float32, same product as HF
        cos, sin = freqs.cos(), freqs.sin()  # HF's half-width tables (not kept: 2 MiB at 8k positions)
        scaling = rope_attention_scaling(self.params)
        if scaling != 1.0:                   # YaRN: HF scales the float32 tables before the cast
            cos, sin = cos * scaling, sin * scaling
        self.cos_full.copy_(torch.cat((cos, cos), -1))       # [P, D]
        self.sin_signed.copy_(torch.cat((-sin, sin), -1))    # [P, D]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` -> (cos, signed sin) each `[T, 1, D]` in `dtype` (HF casts them to the
        activation dtype too), for `apply_rotary_full`; built once per forward, shared by all layers."""
        cos, sin = self.cos_full[positions, None], self.sin_signed[positions, None]
        return cos.to(dtype), sin.to(dtype)


def rotary_dim(head_dim: int, params: dict) -> int:
    """The dims of a head that rope rotates (the first ones): all but under `partial_rotary_factor` (Phi)."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


class LongRopeEmbedding(RotaryEmbedding):
    """Phi-3's long-rope (`rope_type` longrope): inverse frequencies divided per frequency by
    `long_factor` when the context this model holds (its max positions) exceeds
    `original_max_position_embeddings`, else by `short_factor`; cos and sin times the attention
    factor, as transformers' `_compute_longrope_parameters`. One set for every position, chosen by the
    context length as llama.cpp does: transformers picks by each sequence's length and recomputes a
    sequence's cache when decode crosses the original length, so with a longer context a sequence
    within the original length rotates here with the long factors where transformers uses the short."""

    def reset_buffers(self) -> None:
        device = self.cos_full.device
        if device.type == "meta":
            return
        p, dim = self.params, self.head_dim
        original = int(p["original_max_position_embeddings"])
        factor = p.get("factor") or self.max_positions / original
        scale = p.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = torch.tensor(p["long_factor" if self.max_positions > original else "short_factor"],
                           dtype=torch.float32, device=device)
        inv = 1.0 / (ext * float(p["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                                      device=device).float() / dim))
        freqs = torch.arange(self.max_positions, device=device).float()[:, None] * inv[None, :]
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.cos_full.copy_(torch.cat((cos, cos), -1))
        self.sin_signed.copy_(torch.cat((-sin, sin), -1))


def rotary_embedding(head_dim: int, max_positions: int, params: dict) -> RotaryEmbedding:
    """The rotary tables of `params`' rope type over the first `rotary_dim` dims of each head."""
    dim = rotary_dim(head_dim, params)
    if params["rope_type"] == "longrope":
        return LongRopeEmbedding(dim, max_positions, params)
    return RotaryEmbedding(dim, max_positions, params)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_full` on the first `cos.shape[-1]` dims of x's heads, the rest passed through
    (partial rotary, HF's `cat([rotated, pass])`)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return apply_rotary_full(x, cos, sin_signed)
    return torch.cat((apply_rotary_full(x[..., :dim], cos, sin_signed), x[..., dim:]), dim=-1)


def apply_rotary_full(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rope on x `[T, H, D]` (any row stride) with `RotaryEmbedding.tables`: HF's
    `x * cos + rotate_half(x) * sin`, bit for bit (the sign moves from x2 onto sin, exactly)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)   # [x2, x1]
    return x * cos + swapped * sin_signed


def rope_kv_kernel(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, heads: int, kv_heads: int,
                   target: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Eager on the CPU, with `target` (`ForwardBatch.kv_target`: the KV cache and the live rows'
    slots): the q and k heads of the fused projection `qkv` `[T, (Hq + 2 Hkv) D]` roped by one
    call of the C op (kernels/rope.py: `apply_rotary_full`'s bits) -> q `[T, Hq, D]` and k
    `[T, Hkv, D]`, with the roped k and v written into the cache, instead of ~8 PyTorch ops. None
    where the op does not serve (compiled graphs trace `apply_rotary_full`; other devices or
    dtypes; autograd): the caller ropes with PyTorch's ops and attention writes the cache."""
    if target is None or torch.compiler.is_compiling() or not cpu_rope.supports(qkv, cos, heads, kv_heads):
        return None
    cache, slots = target
    if (cache.device.type != "cpu" or cache.dtype != qkv.dtype or not cache.is_contiguous()
            or cache.shape[3:] != (kv_heads, cos.shape[-1]) or slots.device.type != "cpu"
            or slots.dtype != torch.int64 or slots.numel() > qkv.shape[0]
            or (torch.is_grad_enabled() and qkv.requires_grad) or not cpu_rope.available()):
        return None
    return cpu_rope.rope_kv(qkv, cos, sin_signed, heads, kv_heads, cache, slots)


class FusedLinear(Linear):
    """A Linear whose output rows stack several HF projections (q/k/v, gate/up): one matmul instead of many.

    `hf_parts` names each checkpoint projection (a sibling module name in HF) and its row count.
    """

    def __init__(self, in_features: int, parts: tuple[tuple[str, int], ...], bias: bool, dtype: torch.dtype):
        super().__init__(in_features, sum(rows for _, rows in parts), bias=bias, dtype=dtype)
        self.hf_parts = parts


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, (("gate_proj", inter), ("up_proj", inter)), bias, dtype)
        self.down_proj = Linear(inter, hidden, bias=bias, dtype=dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class StagePlaceholder(nn.Module):
    """Holds the slot of a layer another stage owns: no parameters, never called."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"Layer {self.layer_id} belongs to another pipeline stage.")


def build_layers(stage: StageInfo, make_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
    """A list of all `num_layers` slots: real layers for this stage's global ids, placeholders elsewhere."""
    return nn.ModuleList(make_layer(i) if stage.owns(i) else StagePlaceholder(i)
                         for i in range(stage.num_layers))


class WeightSlot(NamedTuple):
    """Where one checkpoint tensor goes: a parameter, optionally a row range of it (fused projections).
    Under tensor parallelism `piece` is this rank's part of the tensor (parallel/tp.py `Slice`) and
    `shape` the whole tensor's."""

    param: str
    start: int
    rows: int | None
    shape: tuple[int, ...]
    piece: Any = None


class StageModel(nn.Module):
    """Base of every family: checkpoint-name bookkeeping and the stage-only weight loading.

    Subclasses define `hf_name(param_name)` (our parameter name -> its HF checkpoint name) and may
    override `canonical_name` to accept alternative checkpoint spellings.
    """

    proxy_keys: tuple[str, ...] = ()
    stage: StageInfo     # set by every family's __init__

    def hf_name(self, param_name: str) -> str:
        raise NotImplementedError

    def canonical_name(self, hf_name: str) -> str:
        return hf_name

    def weight_table(self) -> dict[str, WeightSlot]:
        """Every checkpoint tensor this stage needs -> its slot. Built once; shapes survive meta/to_empty."""
        table = self.__dict__.get("_weight_table")
        if table is None:
            table = {}
            for mod_name, module in self.named_modules():
                shapes = {p_name: tuple(p.shape) for p_name, p in module.named_parameters(recurse=False)}
                shapes.update(getattr(module, "held_weights", dict)())    # quantized layers: weights in buffers
                for p_name, shape in shapes.items():
                    table.update(self._slots(mod_name, module, p_name, shape))
            self.__dict__["_weight_table"] = table
        return table

    def _slots(self, mod_name: str, module: nn.Module, p_name: str, shape: tuple[int, ...]) -> dict[str, WeightSlot]:
        full = f"{mod_name}.{p_name}" if mod_name else p_name
        parts = getattr(module, "hf_parts", None)
        if parts is None:
            return dict([self._slot(full, full, 0, None, shape)])
        parent = mod_name.rsplit(".", 1)[0]
        slots: dict[str, WeightSlot] = {}
        start = 0
        for part, rows in parts:
            slots.update([self._slot(f"{parent}.{part}.{p_name}", full, start, rows, (rows, *shape[1:]))])
            start += rows
        return slots

    def _slot(self, name: str, param: str, start: int, rows: int | None,
              shape: tuple[int, ...]) -> tuple[str, WeightSlot]:
        hf = self.hf_name(name)
        piece = self.__dict__.get("tp_slices", {}).get(hf)      # set by parallel.tp.shard
        return hf, WeightSlot(param, start, rows, shape if piece is None else piece.full_shape(shape), piece)

    def held_module(self, slot: WeightSlot) -> nn.Module | None:
        """The quantized layer (`model.quantized`) that holds `slot`'s weight in buffers, if any."""
        owner, _, leaf = slot.param.rpartition(".")
        module = self.get_submodule(owner)
        return module if leaf in getattr(module, "held_weights", dict)() else None

    def is_stage_weight(self, hf_name: str) -> bool:
        return self.canonical_name(hf_name) in self.weight_table()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy this stage's tensors in (others are skipped); returns the canonical names loaded.
        A quantized layer's weight may come as float rows or as a `kernels.quant.QuantizedWeight`."""
        table, params, loaded = self.weight_table(), dict(self.named_parameters()), set()
        self.__dict__.pop("_decode_plan", None)      # a model's one-call decode is planned on its loaded weights
        for hf_name, tensor in weights:
            name = self.canonical_name(hf_name)
            slot = table.get(name)
            if slot is None:
                continue
            held = self.held_module(slot)
            if held is not None and slot.piece is not None:      # this tensor-parallel rank's part
                tensor = slot.piece.take(tensor)
            if held is not None:      # checks the shape itself: a QuantizedWeight or float rows
                cast(Any, held).load_rows(hf_name, slot.start, tensor)
                loaded.add(name)
                continue
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(f"Checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, but this model "
                                 f"expects {slot.shape}; the checkpoint does not match its config.json.")
            if slot.piece is not None:
                tensor = slot.piece.take(tensor)
            dst: torch.Tensor = params[slot.param]
            if slot.rows is not None:
                dst = dst.narrow(0, slot.start, slot.rows)
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add(name)
        return loaded

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary tables) after `to_empty`."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                cast(Any, module).reset_buffers()
