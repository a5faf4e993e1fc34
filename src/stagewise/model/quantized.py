"""Quantized layers: `QuantLinear` and `QuantEmbedding` keep their weights in their own bytes, in the
kernels' packed layout (`kernels.quant`), as registered uint8 buffers (so torch.compile, graph capture
and the memory plan see plain tensors), and compute through opaque ops (`stagewise::qlinear`,
`stagewise::qembedding`). `quantize_modules` swaps them in for a model still on the meta device, as a
`Scheme` says (the GGUF type each checkpoint tensor is stored in, or `--quantization int8|int4`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from stagewise.kernels import quant, quant_pack
from stagewise.kernels.quant import QuantizedWeight, T
from stagewise.kernels.registry import define
from stagewise.model.cpu_gemm import linear as float_linear

# A checkpoint tensor's HF name and its [N, K] shape -> the quantized type it is held in, or None (float).
Scheme = Callable[[str, tuple[int, int]], "T | None"]
QUANTIZATION_KINDS = ("int8", "int4")
_LINEAR_TYPE = {"int8": T.Q8_0, "int4": T.Q4_1}     # weight-only: per-32 scale (and minimum for int4)
_PACK_ELEMENTS = 1 << 21       # weights packed per step: bounds the load's temporaries to a few MiB
_EMBEDDING_TYPE = T.Q8_0     # embeddings and LM heads keep 8 bits under int4 too (llama.cpp's mixes keep them high)


@dataclass(frozen=True)
class Segment:
    """Output rows [start, start + rows) of a QuantLinear, held alike: `qtype` None is float rows."""
    start: int
    rows: int
    qtype: T | None


def _packed_shape(qtype: T, rows: int, k: int) -> tuple[int, int]:
    return quant_pack.num_panels(rows), quant_pack.panel_bytes(qtype, k)


def _pack_into(out: torch.Tensor, weight: QuantizedWeight) -> None:
    """Pack `weight` into `out` (its packed shape) a few rows at a time: panel p holds rows 16p..16p+15,
    so packed row slices are slices of the panels, and the unpacking temporaries stay small."""
    n, k = weight.shape
    step = max(quant_pack.ROW_ALIGN, _PACK_ELEMENTS // k // quant_pack.ROW_ALIGN * quant_pack.ROW_ALIGN)
    for start in range(0, n, step):
        panels = weight.take_rows(slice(start, start + step)).pack().data
        first = start // quant_pack.PANEL
        if first + panels.shape[0] > out.shape[0] or panels.shape[1] != out.shape[1]:
            raise ValueError(f"Packed {weight.qtype.name} rows do not fit the planned {tuple(out.shape)} panels; "
                             f"the kernels' layout and this layer disagree.")
        with torch.no_grad():
            out[first:first + panels.shape[0]].copy_(panels)


class _Held(nn.Module):
    """Shared loading: whole quantized segments are packed as soon as all their rows have arrived."""

    in_features: int
    in_out_layout = False          # the checkpoint stores the weight [K, N] (GPT-2's Conv1D)

    def _init_pending(self) -> None:
        self._pending: dict[int, dict[int, QuantizedWeight]] = {}

    def _as_quantized(self, tensor: torch.Tensor | QuantizedWeight, qtype: T) -> QuantizedWeight:
        if isinstance(tensor, QuantizedWeight):
            if tensor.qtype != qtype:
                raise ValueError(f"A {tensor.qtype.name} tensor cannot load into rows held as {qtype.name}.")
            return tensor
        return quant.quantize(self._rows_of(tensor), qtype.name)

    def _rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if self.in_out_layout else tensor

    def _check(self, name: str, tensor: torch.Tensor | QuantizedWeight, rows: int) -> None:
        shape = tuple(tensor.shape) if isinstance(tensor, QuantizedWeight) else tuple(self._rows_of(tensor).shape)
        if shape != (rows, self.in_features):
            raise ValueError(f"Checkpoint tensor {name} holds {shape[0]}x{shape[1]} rows, but this model's layer "
                             f"expects {rows}x{self.in_features}; the checkpoint does not match its config.")

    def _store(self, index: int, seg: Segment, start: int, weight: QuantizedWeight) -> None:
        """Keep file rows until the segment is whole, then pack them into its buffer; where every part
        of the segment starts on a panel pair (`_direct`), pack each part into its panels as it arrives
        (a MoE layer's experts: one expert's bytes alive at a time, not the layer's)."""
        assert seg.qtype is not None, "float segments are copied, not packed"
        if index in self.__dict__.get("_direct", ()):
            _pack_into(getattr(self, f"segment{index}")[(start - seg.start) // quant_pack.PANEL:], weight)
            return
        pending = self._pending.setdefault(index, {})
        pending[start] = weight
        if sum(w.shape[0] for w in pending.values()) < seg.rows:
            return
        parts = [pending[s] for s in sorted(pending)]
        del self._pending[index], pending
        data = parts[0].data if len(parts) == 1 else torch.cat([p.data for p in parts])
        del parts
        _pack_into(getattr(self, f"segment{index}"), QuantizedWeight(seg.qtype, (seg.rows, self.in_features), data))

    def stored_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))


class QuantLinear(_Held):
    """`y = x @ W.T + b` with W's rows in segments (fused q/k/v may mix types: Q4_K_M keeps v in
    Q6_K). `exact`: float32 activations throughout (the dequantized model's numbers); otherwise
    the kernels' fast mode (activations quantized to 8 bits per block)."""

    def __init__(self, in_features: int, segments: list[Segment], bias: bool, dtype: torch.dtype, exact: bool,
                 hf_parts: tuple[tuple[str, int], ...] | None = None, in_out_layout: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, sum(s.rows for s in segments)
        self.segments, self.exact, self.in_out_layout = tuple(segments), exact, in_out_layout
        if hf_parts is not None:
            self.hf_parts = hf_parts
        for i, seg in enumerate(segments):
            shape = (seg.rows, in_features) if seg.qtype is None else _packed_shape(seg.qtype, seg.rows, in_features)
            self.register_buffer(f"segment{i}", torch.zeros(shape, dtype=dtype if seg.qtype is None else torch.uint8))
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype)) if bias else None
        self._init_pending()
        self.__dict__["_direct"] = _direct_segments(self.segments, hf_parts)

    def held_weights(self) -> dict[str, tuple[int, int]]:
        """The checkpoint weight this module holds in buffers, with its checkpoint shape."""
        n, k = self.out_features, self.in_features
        return {"weight": (k, n) if self.in_out_layout else (n, k)}

    def load_rows(self, name: str, start: int, tensor: torch.Tensor | QuantizedWeight) -> None:
        """Rows [start, ...) of the weight: file blocks (`QuantizedWeight`) or float rows (quantized
        here when their segment is quantized)."""
        index = next((i for i, s in enumerate(self.segments) if s.start <= start < s.start + s.rows), None)
        rows = tensor.shape[0] if isinstance(tensor, QuantizedWeight) else self._rows_of(tensor).shape[0]
        if index is None or start + rows > self.segments[index].start + self.segments[index].rows:
            raise ValueError(f"Checkpoint tensor {name} does not fit rows {start}..{start + rows} of its layer.")
        seg = self.segments[index]
        self._check(name, tensor, rows)
        if seg.qtype is None:
            if isinstance(tensor, QuantizedWeight):
                tensor = quant.dequantize(tensor)
            else:
                tensor = self._rows_of(tensor)
            with torch.no_grad():
                getattr(self, f"segment{index}")[start - seg.start:start - seg.start + rows].copy_(tensor)
            return
        self._store(index, seg, start, self._as_quantized(tensor, seg.qtype))

    def _segment_out(self, x: torch.Tensor, i: int, seg: Segment, f32_out: bool) -> torch.Tensor:
        bias: torch.Tensor | None = self.bias
        if bias is not None and len(self.segments) > 1:
            bias = bias[seg.start:seg.start + seg.rows]
        data = getattr(self, f"segment{i}")
        if seg.qtype is None:
            y = float_linear(x, data, bias)
            return y.float() if f32_out else y
        weight = QuantizedWeight(seg.qtype, (seg.rows, self.in_features), data, packed=True)
        return quant.linear(x, weight, bias, exact=self.exact, f32_out=f32_out)

    def forward(self, x: torch.Tensor, f32_out: bool = False) -> torch.Tensor:
        if len(self.segments) > 1 and all(seg.qtype is not None for seg in self.segments):
            # NOTE: one call for every part (e.g. Q4_K q/k with Q6_K v): activations quantized once
            weights = [QuantizedWeight(cast(T, seg.qtype), (seg.rows, self.in_features), getattr(self, f"segment{i}"),
                                       packed=True) for i, seg in enumerate(self.segments)]
            return quant.linear_cat(x, weights, self.bias, exact=self.exact, f32_out=f32_out)
        outs = [self._segment_out(x, i, seg, f32_out) for i, seg in enumerate(self.segments)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits `[R, V]` (an LM head)."""
        return self(hidden, f32_out=True)

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{s.rows} {s.qtype.name if s.qtype is not None else 'float'}" for s in self.segments)
        return f"in_features={self.in_features}, rows=[{kinds}], exact={self.exact}"


def _embedding_rows(data: torch.Tensor, ids: torch.Tensor, qtype: int, n: int, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    weight = QuantizedWeight(T(qtype), (n, k), data, packed=True)
    return quant.dequantize_rows(weight, ids, dtype)


define("qembedding(Tensor data, Tensor ids, int qtype, int n, int k, ScalarType dtype) -> Tensor",
       _embedding_rows, lambda data, ids, qtype, n, k, dtype: data.new_empty(*ids.shape, k, dtype=dtype))


class QuantEmbedding(_Held):
    """An embedding table held quantized: a lookup dequantizes only the rows it gathers; where it is
    also the (tied) LM head, `as_head` multiplies the quantized matrix."""

    serves_head = False
    segment0: torch.Tensor       # registered in __init__

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: T, dtype: torch.dtype, exact: bool):
        super().__init__()
        self.num_embeddings, self.in_features, self.qtype = num_embeddings, embedding_dim, qtype
        self.dtype, self.exact = dtype, exact
        self.register_buffer("segment0", torch.zeros(_packed_shape(qtype, num_embeddings, embedding_dim),
                                                     dtype=torch.uint8))
        self._init_pending()

    def held_weights(self) -> dict[str, tuple[int, int]]:
        return {"weight": (self.num_embeddings, self.in_features)}

    def load_rows(self, name: str, start: int, tensor: torch.Tensor | QuantizedWeight) -> None:
        self._check(name, tensor, self.num_embeddings)
        self._store(0, Segment(0, self.num_embeddings, self.qtype), start, self._as_quantized(tensor, self.qtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        args = (self.segment0, ids, int(self.qtype), self.num_embeddings, self.in_features, self.dtype)
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return torch.ops.stagewise.qembedding(*args)
        return _embedding_rows(*args)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = QuantizedWeight(self.qtype, (self.num_embeddings, self.in_features), self.segment0, packed=True)
        return quant.linear(hidden, weight, None, exact=self.exact, f32_out=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.in_features}, {self.qtype.name}, exact={self.exact}"


def kind_scheme(kind: str) -> Scheme:
    """`--quantization int8|int4` of a float checkpoint: every matrix whose K is a multiple of 32."""
    if kind not in QUANTIZATION_KINDS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_KINDS)}, got {kind!r}.")

    def scheme(hf_name: str, shape: tuple[int, int]) -> T | None:
        if shape[1] % 32 or "wpe." in hf_name:      # GPT-2's small position table stays float
            return None
        return _EMBEDDING_TYPE if any(key in hf_name for key in ("embed_tokens.", "lm_head.", "wte.")) \
            else _LINEAR_TYPE[kind]
    return scheme


def quantize_modules(model: nn.Module, scheme: Scheme | None, exact: bool) -> int:
    """Replace the linear layers and token embeddings of `model` (a StageModel, on the meta device)
    whose checkpoint tensors `scheme` holds quantized (None: none); returns how many were replaced.
    Layers that hold quantized blocks themselves (`held_qtype`: gpt-oss's MXFP4 experts) get the
    same mode (`exact`)."""
    for module in model.modules():
        if getattr(module, "held_qtype", None) is not None:
            cast(Any, module).exact = exact
    if scheme is None:
        return 0
    replaced = 0
    for name, module in list(model.named_modules()):
        new = _replacement(model, name, module, scheme, exact)
        if new is not None:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
            replaced += 1
    model.__dict__.pop("_weight_table", None)     # the slots changed
    return replaced


def _replacement(model, name: str, module: nn.Module, scheme: Scheme, exact: bool) -> nn.Module | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, _Held):
        return None
    if getattr(module, "keep_float", False):    # e.g. a MoE router, or experts whose rows the kernels cannot slice
        return None
    in_out = bool(getattr(module, "in_out_layout", False))
    dtype = weight.dtype
    if isinstance(module, nn.Embedding):
        qtype = scheme(model.hf_name(f"{name}.weight"), (int(weight.shape[0]), int(weight.shape[1])))
        if qtype is None:
            return None
        with torch.device(weight.device):
            new = QuantEmbedding(weight.shape[0], weight.shape[1], qtype, dtype, exact)
        new.serves_head = bool(getattr(module, "serves_head", False))
        return new
    if not (isinstance(module, nn.Linear) or in_out):
        return None
    n, k = (weight.shape[1], weight.shape[0]) if in_out else tuple(weight.shape)
    parent = name.rpartition(".")[0]
    parts = getattr(module, "hf_parts", None)
    named = ([(model.hf_name(f"{parent}.{p}.weight" if parent else f"{p}.weight"), rows) for p, rows in parts]
             if parts is not None else [(model.hf_name(f"{name}.weight"), n)])
    types = [scheme(hf, (rows, k)) for hf, rows in named]
    if all(t is None for t in types):
        return None
    bias = getattr(module, "bias", None)
    with torch.device(weight.device):
        return QuantLinear(k, _segments([rows for _, rows in named], types), bias is not None, dtype, exact,
                           hf_parts=parts, in_out_layout=in_out)


def _direct_segments(segments: tuple[Segment, ...], parts: tuple[tuple[str, int], ...] | None) -> frozenset[int]:
    """The quantized segments of several parts whose parts all start on a panel pair and end on one or
    at the segment's end: each part can be packed alone into its own panels."""
    starts, at = [], 0
    for _, rows in parts or ():
        starts.append((at, rows))
        at += rows
    direct = set()
    for i, seg in enumerate(segments):
        inside = [(a - seg.start, r) for a, r in starts if seg.start <= a < seg.start + seg.rows]
        if seg.qtype is not None and len(inside) > 1 and all(
                a % quant_pack.ROW_ALIGN == 0 and ((a + r) % quant_pack.ROW_ALIGN == 0 or a + r == seg.rows)
                for a, r in inside):
            direct.add(i)
    return frozenset(direct)


def _segments(rows: list[int], types: list[T | None]) -> list[Segment]:
    """Consecutive parts held alike form one segment (one kernel call)."""
    out: list[Segment] = []
    start = 0
    for count, qtype in zip(rows, types):
        if out and out[-1].qtype == qtype:
            last = out[-1]
            out[-1] = Segment(last.start, last.rows + count, qtype)
        else:
            out.append(Segment(start, count, qtype))
        start += count
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: parameters plus quantized layers' buffers."""
    held = sum(m.stored_bytes() for m in model.modules() if isinstance(m, _Held))
    return held + sum(p.numel() * p.element_size() for p in model.parameters())
