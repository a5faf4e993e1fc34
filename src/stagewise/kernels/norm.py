"""RMSNorm kernel (csrc/norm.c): bindings, argument checks and the op `stagewise::rms_norm`.

`rms_norm(x, residual, weight, eps)` -> `(out, sum)`: rows `[M, N]` of float32 or bfloat16, the
residual (same shape and dtype, or None) added first, `sum` = x + residual (an empty tensor
without a residual); the rounding points are those of model/layers.py `RMSNorm` (HF's): float32
`(s * rsqrt(mean(s^2) + eps)) * w`; bfloat16 `bf16(w * bf16(s * rsqrt(mean(s^2) + eps)))` with
`s = bf16(x + residual)`. One call instead of the ~10 PyTorch ops of the eager path. The sum of
squares is float32 in PyTorch's own order (its cascade sum at its vector width), so the results
are PyTorch's bits (each row on its own, on every build).
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import build, native, team
from .registry import define

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _load() -> ctypes.CDLL | None:
    lib = build.library("norm", ["norm.c"])
    if lib is None:
        return None
    bind(lib)
    lib.norm_set_lanes(torch_lanes(lib))
    team.hand_to(lib, "norm")      # many rows split over the stage's kernel team
    native.load("norm", lib)
    return lib


def bind(lib: ctypes.CDLL) -> None:
    """Argument types of the entry points (tests bind their narrower builds with it too)."""
    i64, p = ctypes.c_int64, ctypes.c_void_p
    for name in ("rms_norm_f32", "rms_norm_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, i64, p, p, i64, p, i64, i64, i64, ctypes.c_float]
        fn.restype = None
    lib.norm_set_lanes.argtypes, lib.norm_set_lanes.restype = [ctypes.c_int], None


def torch_lanes(lib: ctypes.CDLL) -> int:
    """The vector width of PyTorch's float sums in this process (8 lanes or 16: its AVX-512 sum
    kernels), found once by asking both of the kernel on a probe that tells them apart; the kernel
    then sums squares in PyTorch's order. 8 where neither matches (another PyTorch build)."""
    x = torch.linspace(-3.0, 5.0, 4 * 61).reshape(4, 61).pow(3).contiguous()
    w = torch.ones(61)
    ref = F.rms_norm(x, (61,), w, 1e-6)
    for lanes in (8, 16):
        lib.norm_set_lanes(lanes)
        out = torch.empty_like(x)
        lib.rms_norm_f32(x.data_ptr(), 61, None, 0, w.data_ptr(), out.data_ptr(), 61, None, 0, 4, 61, 1e-6)
        if torch.equal(out, ref):
            return lanes
    return 8


def available() -> bool:
    return _load() is not None


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """What the kernel serves, from static properties: CPU float32/bfloat16 rows `[M, N]` with unit
    column stride and a weight of N values of the same dtype."""
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.stride(1) == 1
            and weight.dtype == x.dtype and weight.shape == x.shape[1:])


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"{t.dtype} {t.device.type} {list(t.shape)} strides {list(t.stride())}"


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    ok = (supports(x, weight) and weight.device.type == "cpu" and weight.is_contiguous()
          and (residual is None or (residual.device.type == "cpu" and residual.dtype == x.dtype
                                    and residual.shape == x.shape and residual.stride(1) == 1)))
    if not ok:
        raise ValueError(f"stagewise rms_norm: x {_describe(x)}, residual {_describe(residual)}, weight "
                         f"{_describe(weight)}; it needs CPU float32 or bfloat16 of one dtype, x [M, N] and a residual "
                         f"of the same shape (or none) with unit column stride, and a contiguous weight [N].")


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, residual, weight)
    lib = _load()
    if lib is None:
        raise RuntimeError("The RMSNorm kernel is not available on this machine.")
    m, n = x.shape
    out = x.new_empty(m, n)
    total = x.new_empty(m, n) if residual is not None else x.new_empty(0)
    fn = lib.rms_norm_f32 if x.dtype == torch.float32 else lib.rms_norm_bf16
    fn(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
       0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(), n,
       None if residual is None else total.data_ptr(), n, m, n, eps)
    return out, total


def _fake(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    return x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,))


define("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)", _rms_norm, _fake)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual), x + residual)` for rows `[M, N]` (`sum` empty without a residual):
    the C++ op where it is registered (or a dispatch mode records ops), else the Python one called
    directly (no dispatcher)."""
    if native.loaded("norm") or _get_current_dispatch_mode() is not None:
        return torch.ops.stagewise.rms_norm(x, residual, weight, eps)
    return _rms_norm(x, residual, weight, eps)
