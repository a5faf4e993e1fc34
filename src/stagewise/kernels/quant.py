"""Quantized linear weights kept in their own bytes (GGUF Q4_0 ... Q6_K and MXFP4, int8/int4 of plain
checkpoints), and the ops that read them: `linear`, `dequantize`, `dequantize_rows`, `quantize`.

A `QuantizedWeight` is one `[N, K]` matrix: the file's blocks as `[N, bytes_per_row]` uint8 rows
until `pack()` reorders them into the kernels' panels (`quant_pack`). Row selection (`take_rows`:
llama.cpp's Q/K row order, tensor-parallel shards) works on the file rows, before packing.
`linear` is the opaque op `stagewise::qlinear` (the C kernels where built; otherwise dequantize and
`F.linear`), so a compiled graph calls it as one node.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import quant_formats as formats
from . import quant_kernels, quant_pack
from .quant_formats import SUPPORTED, T
from .registry import define

# --quantization kinds -> the format each is stored in (both per-32-element blocks: Q8_0's per-block
# scale is at least as accurate as a per-channel one; Q4_1 is group-wise scale + minimum)
KINDS = {"int8": T.Q8_0, "int4": T.Q4_1}
_ROWS_AT_ONCE = 4096        # rows decoded per step when packing or dequantizing: bounds the temporaries


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized `[N, K]` matrix (`shape`) of GGUF type `qtype`. `data` is `[N, row_bytes]`
    uint8 file rows, or `[ceil(N / 16), panel_bytes]` panels once `packed`."""

    qtype: T
    shape: tuple[int, int]
    data: torch.Tensor
    packed: bool = False

    @classmethod
    def from_gguf(cls, raw: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int]) -> QuantizedWeight:
        """The tensor's bytes as read from the file (any shape, `N * row_bytes` bytes in all) and its
        logical `(N out, K in)` shape (torch order: GGUF lists dims reversed). Copies the bytes."""
        qtype = T(qtype)
        if qtype not in SUPPORTED:
            raise ValueError(f"GGUF type {qtype.name} has no quantized kernel; supported: "
                             f"{', '.join(t.name for t in SUPPORTED)}.")
        n, k = (int(s) for s in shape)
        if k % formats.block_size(qtype):
            raise ValueError(f"A {qtype.name} matrix needs K a multiple of {formats.block_size(qtype)}, not {k}.")
        data = torch.from_numpy(np.array(raw, dtype=np.uint8)) if isinstance(raw, np.ndarray) else raw.to(torch.uint8)
        if data.numel() != n * formats.row_bytes(qtype, k):
            raise ValueError(f"A {n}x{k} {qtype.name} matrix has {n * formats.row_bytes(qtype, k)} bytes, "
                             f"not {data.numel()}; the file is inconsistent.")
        return cls(qtype, (n, k), data.reshape(n, -1).contiguous())

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def take_rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The matrix of the rows `index` selects (rows are whole blocks: any selection works)."""
        if self.packed:
            raise ValueError("take_rows works on file rows: select rows before pack().")
        data = self.data[index].contiguous()
        return replace(self, shape=(data.shape[0], self.shape[1]), data=data)

    def fields(self) -> formats.Fields:
        n, k = self.shape
        if self.packed:
            return quant_pack.decode(self.data, self.qtype, n, k)
        return formats.decode(self.data, self.qtype, k)

    def pack(self) -> QuantizedWeight:
        """The same matrix in the kernels' panels (`quant_pack`); a packed weight is returned as is."""
        if self.packed:
            return self
        n, k = self.shape
        step = _ROWS_AT_ONCE // quant_pack.ROW_ALIGN * quant_pack.ROW_ALIGN
        out = torch.empty(quant_pack.num_panels(n), quant_pack.panel_bytes(self.qtype, k), dtype=torch.uint8)
        for start in range(0, n, step):
            fields = formats.decode(self.data[start:start + step], self.qtype, k)
            first = start // quant_pack.PANEL
            panels = quant_pack.encode(fields)
            out[first:first + panels.shape[0]] = panels
        return replace(self, data=out, packed=True)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """Weight-only quantization of a float `[N, K]` matrix: `kind` is "int8" (Q8_0) or "int4" (Q4_1),
    or a GGUF type name among Q8_0, Q4_0, Q4_1, Q5_0, Q5_1. K must be a multiple of 32."""
    by_name = {t.name: t for t in formats.QUANTIZABLE}
    qtype = KINDS.get(kind.lower()) or by_name.get(kind.upper())
    if qtype is None:
        raise ValueError(f"Unknown quantization {kind!r}; use int8 or int4 (or one of {', '.join(by_name)}).")
    if weight.dim() != 2 or weight.shape[1] % 32:
        raise ValueError(f"Quantizing needs a [N, K] matrix with K a multiple of 32, not {tuple(weight.shape)}.")
    n, k = weight.shape
    rows = [formats.encode(formats.quantize(weight[i:i + _ROWS_AT_ONCE], qtype)) for i in range(0, n, _ROWS_AT_ONCE)]
    return QuantizedWeight(qtype, (n, k), torch.cat(rows) if rows else torch.empty(0, formats.row_bytes(qtype, k),
                                                                                  dtype=torch.uint8))


def _fields_rows(data: torch.Tensor, qtype: T, n: int, k: int, packed: bool, start: int, stop: int) -> formats.Fields:
    """Fields of rows [start, stop) (start a multiple of 16 when packed)."""
    if not packed:
        return formats.decode(data[start:stop], qtype, k)
    first = start // quant_pack.PANEL
    return quant_pack.decode(data[first:quant_pack.num_panels(stop)], qtype, stop - start, k)


def _dequantize(data: torch.Tensor, qtype: T, n: int, k: int, packed: bool, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(n, k, dtype=dtype)
    for start in range(0, n, _ROWS_AT_ONCE):
        stop = min(n, start + _ROWS_AT_ONCE)
        out[start:stop] = formats.values(_fields_rows(data, qtype, n, k, packed, start, stop))
    return out


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix's values `[N, K]` in `dtype` (float32 values are exactly gguf-py's)."""
    return _dequantize(w.data, w.qtype, *w.shape, w.packed, dtype)


def dequantize_rows(w: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (any shape of int64 row numbers) of the matrix: `[*ids.shape, K]` (an embedding lookup)."""
    n, k = w.shape
    flat = ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"Row ids must lie in [0, {n}); got {int(flat.min())} .. {int(flat.max())}.")
    if w.packed and quant_kernels.available():
        return quant_kernels.run_dequant_rows(w.data, int(w.qtype), n, k, flat, dtype).reshape(*ids.shape, k)
    if not w.packed:
        rows = formats.values(formats.decode(w.data[flat], w.qtype, k))
    else:
        panels, inner = flat // quant_pack.PANEL, flat % quant_pack.PANEL
        unique, where = torch.unique(panels, return_inverse=True)
        decoded = quant_pack.decode(w.data[unique], w.qtype, unique.numel() * quant_pack.PANEL, k)
        rows = formats.values(decoded.take(where * quant_pack.PANEL + inner))
    return rows.to(dtype).reshape(*ids.shape, k)


def _reference(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, qtype: int, n: int, packed: bool,
               exact: bool, f32_out: bool) -> torch.Tensor:
    """Dequantize and `F.linear` in float32 (exact mode's definition; the fallback without kernels)."""
    weight = _dequantize(data, T(qtype), n, x.shape[1], packed, torch.float32)
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y if f32_out else y.to(x.dtype)


def _qlinear(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, qtype: int, n: int, packed: bool,
             exact: bool, f32_out: bool) -> torch.Tensor:
    if packed and quant_kernels.available():
        return quant_kernels.run_linear(x, data, bias, qtype, n, exact, f32_out)
    quant_kernels.check_linear(x, data, bias, qtype, n, packed)
    return _reference(x, data, bias, qtype, n, packed, exact, f32_out)


def _qlinear_fake(x, data, bias, qtype, n, packed, exact, f32_out):
    return x.new_empty(x.shape[0], n, dtype=torch.float32 if f32_out else x.dtype)


define("qlinear(Tensor x, Tensor data, Tensor? bias, int qtype, int n, bool packed, bool exact, bool f32_out) "
       "-> Tensor", _qlinear, _qlinear_fake)


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None, exact: bool = False,
           f32_out: bool = False) -> torch.Tensor:
    """`x [..., K] @ w.T (+ bias)` in x's dtype (float32 with `f32_out`: an LM head's logits).
    `exact` keeps activations in float32 (equal to `F.linear(x.float(), dequantize(w))` up to the
    order of the sums); the default quantizes each row's activations to 8 bits per 32 once per call
    and multiplies integers (see the docs' "Quantized kernels")."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"Activations have {x.shape[-1]} features but the {n}x{k} {w.qtype.name} weight takes {k}.")
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, k)
    if w.packed and (torch.compiler.is_compiling() or quant_kernels.native_ops()
                     or _get_current_dispatch_mode() is not None):
        y = torch.ops.stagewise.qlinear(rows, w.data, bias, w.qtype, n, True, exact, f32_out)
    else:               # file rows run the reference here (the C++ op takes packed weights only)
        y = _qlinear(rows, w.data, bias, w.qtype, n, w.packed, exact, f32_out)
    return y if flat else y.view(*x.shape[:-1], n)


def _qlinear_cat(x: torch.Tensor, data: list[torch.Tensor], bias: torch.Tensor | None, qtypes: list[int],
                 ns: list[int], exact: bool, f32_out: bool) -> torch.Tensor:
    if quant_kernels.available():
        return quant_kernels.run_linear_cat(x, data, bias, qtypes, ns, exact, f32_out)
    parts = [_qlinear(x, d, None, q, n, True, exact, True) for d, q, n in zip(data, qtypes, ns)]
    y = torch.cat(parts, -1) + (0 if bias is None else bias.float())
    return y if f32_out else y.to(x.dtype)


def _qlinear_cat_fake(x, data, bias, qtypes, ns, exact, f32_out):
    return x.new_empty(x.shape[0], sum(ns), dtype=torch.float32 if f32_out else x.dtype)


define("qlinear_cat(Tensor x, Tensor[] data, Tensor? bias, int[] qtypes, int[] ns, bool exact, bool f32_out) "
       "-> Tensor", _qlinear_cat, _qlinear_cat_fake)


def linear_cat(x: torch.Tensor, weights: list[QuantizedWeight], bias: torch.Tensor | None = None,
               exact: bool = False, f32_out: bool = False) -> torch.Tensor:
    """`linear` of several packed weights side by side (a fused projection whose parts are stored
    in different types, e.g. Q4_K q/k and Q6_K v): `[..., sum N]`, x quantized once for all."""
    k = x.shape[-1]
    if any(w.shape[1] != k or not w.packed for w in weights):
        raise ValueError(f"linear_cat takes packed weights of K={k} (the activations' features).")
    rows = x.reshape(-1, k)
    args = (rows, [w.data for w in weights], bias, [int(w.qtype) for w in weights], [w.shape[0] for w in weights],
            exact, f32_out)
    if torch.compiler.is_compiling() or quant_kernels.native_ops() or _get_current_dispatch_mode() is not None:
        y = torch.ops.stagewise.qlinear_cat(*args)
    else:
        y = _qlinear_cat(*args)
    return y.view(*x.shape[:-1], y.shape[-1])
