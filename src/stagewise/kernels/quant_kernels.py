"""Bindings of the quantized kernels (csrc/quant.c) and the checks at their boundary: `run_linear`
and `run_dequant_rows` take packed weights (`quant_pack`) only.

The library is built by `build` for this CPU (AVX-512 with or without VNNI, AVX2, or portable C,
picked by `-march=native`); tests also build the narrower `VARIANTS` so that every path runs here.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import build, native, quant_pack, team
from .quant_formats import K_TYPES, SUPPORTED, T, row_bytes

# name -> (extra compiler flags, CPU flags it needs to run)
VARIANTS = {"native": ((), ()),
            "avx512": (("-mno-avx512vnni",), ("avx512bw",)),
            "avx2": (("-mno-avx512f", "-mno-avxvnni"), ("avx2", "fma", "f16c")),
            "avx2-vnni": (("-mno-avx512f", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
            "portable": (("-DQUANT_PORTABLE", "-O2"), ())}     # -O3 unrolls its scalar loops: 3x the build


def variant_runs_here(variant: str) -> bool:
    return set(VARIANTS[variant][1]) <= build.cpu_flags()


@functools.cache
def _load(variant: str) -> ctypes.CDLL | None:
    lib = build.library("quant", ["quant.c"], VARIANTS[variant][0])
    if lib is None:
        return None
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.quant_isa.restype = ctypes.c_char_p
    lib.quant_panel_bytes.argtypes, lib.quant_panel_bytes.restype = [i32, i64], i64
    lib.quant_linear.argtypes = [i32, p, p, p, i32, p, i32, i64, i64, i64, p, p, p, i64]
    lib.quant_dequant_rows.argtypes = [i32, p, i64, p, i64, p, p]
    lib.quant_linear.restype = lib.quant_dequant_rows.restype = i32
    team.hand_to(lib, "quant")         # split over the stage's kernel team once it starts
    if variant == "native":
        native.load("quant", lib)      # the ops' CPU kernels in C++, where a C++ compiler works
    return lib


def available() -> bool:
    """The kernels built and loaded here (`build`'s switch decides what happens where they did not)."""
    return _load("native") is not None


def native_ops() -> bool:
    """The ops' CPU kernels are registered from C++ (csrc/quant_ops.cpp): eager calls go through
    the dispatcher straight to them."""
    return available() and native.loaded("quant")


def library(variant: str = "native") -> ctypes.CDLL:
    lib = _load(variant)
    if lib is None:
        raise RuntimeError(f"The quantized kernels ({variant}) are not available on this machine (see the log).")
    return lib


_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _expected(qtype: int, n: int, k: int, packed: bool) -> tuple[int, int] | str:
    """The weight's `data` shape, or why a call with these sizes cannot work."""
    if qtype not in _SUPPORTED_IDS:
        return f"GGUF type {_type_name(qtype)} has no quantized kernel."
    if n < 0:
        return f"A quantized weight has N >= 0 rows; got N={n}."
    step = 256 if T(qtype) in K_TYPES else 32
    if k % step or k == 0:
        return f"Quantized linear needs K a multiple of {step}; got K={k}."
    if packed:
        return quant_pack.num_panels(n), quant_pack.panel_bytes(T(qtype), k)
    return n, row_bytes(T(qtype), k)


_SUPPORTED_IDS = frozenset(int(t) for t in SUPPORTED)


def _type_name(qtype: int) -> str:
    try:
        return T(qtype).name
    except ValueError:
        return f"type {qtype}"


def check_linear(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, qtype: int, n: int,
                 packed: bool = True) -> None:
    """One sentence for each way a call could read out of bounds or misread the weight (cheap: it
    runs on every call)."""
    if x.dtype not in _DTYPES or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"Quantized linear takes CPU float32 or bfloat16 rows [M, K], not {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}.")
    _check_weight(x, data, qtype, n, packed)
    _check_bias(bias, n)


def _check_weight(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, packed: bool) -> None:
    if x.stride(1) != 1:
        raise ValueError(f"Quantized linear needs rows with unit column stride; got strides {x.stride()}.")
    _check_data(data, qtype, n, x.shape[1], packed)


def _check_data(data: torch.Tensor, qtype: int, n: int, k: int, packed: bool) -> None:
    """`data` holds exactly an `n x k` matrix of type `qtype`: the C reads no byte past it."""
    expected = _expected(qtype, n, k, packed)
    if isinstance(expected, str):
        raise ValueError(expected)
    if data.dtype != torch.uint8 or data.shape != expected or not data.is_contiguous() or data.device.type != "cpu":
        raise ValueError(f"A{' packed' if packed else ''} {n}x{k} {T(qtype).name} weight is contiguous uint8 "
                         f"{expected} on the CPU; got {data.dtype} {tuple(data.shape)} on {data.device} (K of the "
                         f"activations must match the weight's, and N its rows).")


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.shape != (n,) or bias.dtype not in _DTYPES or bias.device.type != "cpu"):
        raise ValueError(f"The bias must be a CPU float [{n}], not {bias.dtype} {tuple(bias.shape)} on {bias.device}.")


def run_linear(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, qtype: int, n: int, exact: bool,
               f32_out: bool, variant: str = "native") -> torch.Tensor:
    """`x [M, K] @ W^T (+ bias)` by the kernels, W packed; float32 with `f32_out`, else x's dtype."""
    return run_linear_cat(x, [data], bias, [qtype], [n], exact, f32_out, variant)


def run_linear_cat(x: torch.Tensor, data: list[torch.Tensor], bias: torch.Tensor | None, qtypes: list[int],
                   ns: list[int], exact: bool, f32_out: bool, variant: str = "native") -> torch.Tensor:
    """`x @ [W_0; W_1; ...]^T (+ bias)`: packed matrices side by side (their types may differ), the
    activations quantized once for all; `[M, sum(ns)]`."""
    if x.dtype not in _DTYPES or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"Quantized linear takes CPU float32 or bfloat16 rows [M, K], not {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}.")
    if not 1 <= len(data) <= _MAX_SEGMENTS or len(qtypes) != len(data) or len(ns) != len(data):
        raise ValueError(f"Quantized linear takes 1 to {_MAX_SEGMENTS} weights with one type and row count each.")
    for d, qtype, n in zip(data, qtypes, ns):
        _check_weight(x, d, qtype, n, True)
    total = sum(ns)
    _check_bias(bias, total)
    lib = _load(variant) or library(variant)
    m, k = x.shape
    y = torch.empty(m, total, dtype=torch.float32 if f32_out else x.dtype)
    if m:
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        count, f32 = len(data), y.dtype == torch.float32
        status = lib.quant_linear(count, (ctypes.c_int * count)(*qtypes),
                                  (ctypes.c_void_p * count)(*[d.data_ptr() for d in data]),
                                  (ctypes.c_int64 * count)(*ns), exact, x.data_ptr(), x.dtype == torch.bfloat16,
                                  x.stride(0), m, k, None if bias is None else bias.data_ptr(),
                                  y.data_ptr() if f32 else None, None if f32 else y.data_ptr(), total)
        if status:
            raise MemoryError(f"The quantized kernel ran out of memory for {m} rows of {k}.")
    return y


_MAX_SEGMENTS = 8      # csrc/quant.h's QUANT_MAX_SEGMENTS


def run_dequant_rows(data: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor, dtype: torch.dtype,
                     variant: str = "native") -> torch.Tensor:
    """Rows `ids` (int64, checked in range) of a packed matrix, `[len(ids), K]` float32 or bfloat16."""
    _check_data(data, qtype, n, k, True)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"Row ids are integers, not {ids.dtype}.")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"Row ids must lie in [0, {n}); got {int(flat.min())} .. {int(flat.max())}.")
    out = torch.empty(flat.numel(), k, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    f32 = out.dtype == torch.float32
    status = library(variant).quant_dequant_rows(qtype, data.data_ptr(), k, flat.data_ptr(), flat.numel(),
                                                 out.data_ptr() if f32 else None, None if f32 else out.data_ptr())
    if status:
        raise RuntimeError(f"The quantized row kernel refused a {T(qtype).name} matrix (status {status}).")
    return out.to(dtype)
