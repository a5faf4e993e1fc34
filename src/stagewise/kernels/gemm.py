"""Linear-layer kernels (csrc/gemm.c): bindings, argument checks, the packed weight layout, and the
ops `stagewise::linear` / `stagewise::linear_packed`.

Packed weights: each `[N, K]` weight reordered once at load into panels of output columns (float32
and bfloat16 with AVX2/AVX-512 FMA: bf16 as pairs on CPUs with native bf16, else widened in the
kernel); one kernel serves every row count and every N, and each output is one chain over k in
order, so a row's result depends neither on its batch nor on how the weight's rows are sharded.
Small-row kernel (weights not packed): steps of at most `MAX_ROWS` rows read each weight row once
for all the rows; MKL/oneDNN above, and for whatever the kernel does not serve (`supports`).
Under `torch.compile`, or a dispatch mode that records ops, calls are the opaque ops (`linear`
picks by the step's row count at run time: the compiled row dimension is dynamic).
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import envs
from . import build, native
from .registry import define

MAX_ROWS = 32      # measured crossover with MKL (fp32, AVX2, one and two threads)
# bf16 on a CPU with native bf16 (AVX512-BF16): the `bf16dp` kernel, bf16 activations and
# weights; it beats oneDNN's bf16 GEMM up to about 16 rows (SmolLM2 layers, one thread: 0.35-0.6x
# the time at 1-4 rows, 0.7-0.9x at 8-16, 1.2x at 32). On other CPUs bf16 weights are widened to
# float32 in the kernel (oneDNN emulates bf16 there, slowly).
NATIVE_BF16 = build.native_bf16()
NATIVE_BF16_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _load() -> ctypes.CDLL | None:
    lib = build.library("gemm", ["gemm.c"])
    if lib is None:
        return None
    i64, p = ctypes.c_int64, ctypes.c_void_p
    for name in ("small_linear_f32", "small_linear_bf16", "small_linear_bf16dp", "packed_linear_f32"):
        if hasattr(lib, name):          # bf16dp and the packed kernels exist where their ISA does
            getattr(lib, name).argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
            getattr(lib, name).restype = None
    for name in ("packed_f32_panel", "packed_bf16_panel", "packed_bf16_pair"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
    if hasattr(lib, "packed_linear_bf16"):
        lib.packed_linear_bf16.argtypes = [p, i64, p, p, p, p, i64, i64, i64, i64]
        lib.packed_linear_bf16.restype = None
    ops = native.load("gemm", lib)
    if ops is not None:
        _configure(lib, ops)
    return lib


def configure() -> None:
    """Hand `MAX_ROWS` and the CPU's bf16 support to the C++ `stagewise::linear` (done when it
    loads; call again after changing `MAX_ROWS`)."""
    lib = _load()
    ops = None if lib is None else native.load("gemm", lib)
    if lib is not None and ops is not None:
        _configure(lib, ops)


def _configure(lib: ctypes.CDLL, ops: ctypes.CDLL) -> None:
    ops.stagewise_gemm_configure(ctypes.c_int64(_rows_limit(lib, torch.float32)),
                                 ctypes.c_int64(_rows_limit(lib, torch.bfloat16)), ctypes.c_int(NATIVE_BF16))


def available() -> bool:
    return _load() is not None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What the kernel serves, from static properties only (so tracing never breaks on it): CPU
    rows `[M, K]` in `_DTYPES` with unit column stride, a contiguous `[N, K]` weight of the same
    dtype, K a multiple of 8 (of 32 for native bf16). Whether the kernel built is asked at run time."""
    step = 32 if NATIVE_BF16 and x.dtype == torch.bfloat16 else 8
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in _DTYPES
            and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and weight.shape[1] % step == 0
            and x.stride(1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError, saying what is wrong, unless `supports` holds and the bias has N entries."""
    if not supports(x, weight, bias) or (bias is not None and bias.shape != weight.shape[:1]):
        step = 32 if NATIVE_BF16 and x.dtype == torch.bfloat16 else 8
        raise ValueError(
            f"stagewise linear kernel: x {_describe(x)}, weight {_describe(weight)}, bias {_describe(bias)}; it needs "
            f"CPU float32 or bfloat16 of one dtype, x [M, K] with unit column stride, a contiguous weight [N, K] "
            f"with the same K, a multiple of {step}, and a contiguous bias [N] or none.")


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"{t.dtype} {t.device.type} {list(t.shape)} strides {list(t.stride())}"


def _kernel(lib: ctypes.CDLL, dtype: torch.dtype):
    if dtype == torch.float32:
        return lib.small_linear_f32
    if not NATIVE_BF16:
        return lib.small_linear_bf16
    return getattr(lib, "small_linear_bf16dp", None)      # absent if the compiler lacks AVX512-BF16


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for `supports` inputs by the kernel, at any row count (tests call it directly).
    bfloat16 multiplies exact products and sums them in float32 (activations widened once and bf16
    weights in registers, or both as bf16 pairs on native bf16), and rounds the output once, as
    oneDNN does."""
    _check_linear(x, weight, bias)
    lib = _load()
    fn = None if lib is None else _kernel(lib, x.dtype)
    if fn is None:
        raise RuntimeError("The small-row linear kernel is not available on this machine.")
    out_dtype = x.dtype
    if out_dtype == torch.bfloat16:
        bias = None if bias is None else bias.float()
        if not NATIVE_BF16:
            x = x.float()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n)
    if m:
        fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
           y.data_ptr(), n, m, n, k)
    return y.to(out_dtype)


def _max_rows(dtype: torch.dtype) -> int:
    lib = _load()
    return 0 if lib is None else _rows_limit(lib, dtype)


def _rows_limit(lib: ctypes.CDLL, dtype: torch.dtype) -> int:
    """Rows up to which `linear` runs the small-row kernel (0: its kernel for `dtype` is missing)."""
    if _kernel(lib, dtype) is None:
        return 0
    return min(MAX_ROWS, NATIVE_BF16_ROWS) if NATIVE_BF16 and dtype == torch.bfloat16 else MAX_ROWS


def _by_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] <= _max_rows(x.dtype):
        return small_linear(x, weight, bias)
    if x.dtype == torch.bfloat16 and not NATIVE_BF16:
        # no native bf16 here: oneDNN's emulated bf16 GEMM is 5-7x slower than widening the
        # weight to float32 for this call and using MKL (SmolLM2 layers, one thread, 64-512 rows)
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _by_rows,
       lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the kernel for steps of at most `MAX_ROWS` rows where it applies."""
    if not supports(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return torch.ops.stagewise.linear(x, weight, bias)     # traced or recorded as one op
    return _by_rows(x, weight, bias)


# --- prepacked weights ------------------------------------------------------------------------
# bf16 (native bf16 CPUs), SmolLM2-135M layers, one thread: 0.72x the time of the unpacked
# kernels at 1 row, 0.46x at 4, 0.71x at 32, 0.85x at 200 and 0.83x at 512, where oneDNN's own
# prepacked linear took 1.26x / 0.57x / 0.86x / 0.87x / 0.93x. float32: see benchmarks/RESULTS.md.

def layout(dtype: torch.dtype) -> tuple[int, int] | None:
    """(panel width, k per pair) of the packed kernel for `dtype` on this CPU; None if it has none.
    `STAGEWISE_PACKED_WEIGHTS=0` keeps the checkpoint layout (the unpacked kernels, MKL, oneDNN)."""
    if not envs.STAGEWISE_PACKED_WEIGHTS:
        return None
    return _kernel_layout(dtype)


def _kernel_layout(dtype: torch.dtype) -> tuple[int, int] | None:
    lib = _load()
    if lib is None:
        return None
    if dtype == torch.bfloat16 and hasattr(lib, "packed_linear_bf16"):
        return lib.packed_bf16_panel(), lib.packed_bf16_pair()
    if dtype == torch.float32 and hasattr(lib, "packed_f32_panel"):
        return lib.packed_f32_panel(), 1
    return None


def packable(weight: torch.Tensor) -> bool:
    """The packed kernel serves this `[N, K]` weight here: float32 or bfloat16 with AVX2/AVX-512
    FMA, any N (bf16 as pairs on a native-bf16 CPU: N % 16 == 0, K even)."""
    found = None if weight.device.type != "cpu" or weight.dim() != 2 else layout(weight.dtype)
    if found is None:
        return False
    panel, pair = found
    return weight.shape[0] % _vector(panel, pair) == 0 and weight.shape[1] % pair == 0


def _vector(panel: int, pair: int) -> int:
    """The granularity of N: the bf16 pair tiles have no tail; the float32 ones finish a panel's
    last columns one by one with the same chain per output."""
    return 16 if pair == 2 else 1


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> the same shape holding panels of P rows (the last may be narrower), each stored
    `[K/pair, width, pair]`: at every k (bf16: every pair k, k+1) all the panel's output columns
    side by side."""
    panel, pair = _kernel_layout(weight.dtype) or (64, 2)
    n, k = weight.shape
    full = n // panel * panel
    parts = [weight[:full].reshape(n // panel, panel, k // pair, pair).permute(0, 2, 1, 3).reshape(-1)]
    if full < n:
        parts.append(weight[full:].reshape(1, n - full, k // pair, pair).permute(0, 2, 1, 3).reshape(-1))
    return torch.cat(parts).view(n, k)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse."""
    panel, pair = _kernel_layout(packed.dtype) or (64, 2)
    n, k = packed.shape
    full = n // panel * panel
    flat = packed.reshape(-1)
    parts = [flat[:full * k].view(n // panel, k // pair, panel, pair).permute(0, 2, 1, 3).reshape(full, k)]
    if full < n:
        parts.append(flat[full * k:].view(k // pair, n - full, pair).permute(1, 0, 2).reshape(n - full, k))
    return torch.cat(parts)


def _check_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError unless the packed kernel can run: a weight of a packed dtype here, N and K
    in its granularity, x `[M, K]` on the CPU, bias `[N]` or none."""
    found = _kernel_layout(weight.dtype) if weight.device.type == "cpu" and weight.dim() == 2 else None
    ok = (found is not None and weight.is_contiguous() and weight.shape[0] % _vector(*found) == 0
          and weight.shape[1] % found[1] == 0 and x.device.type == "cpu" and x.dim() == 2
          and x.shape[1] == weight.shape[1] and (bias is None or bias.shape == weight.shape[:1]))
    if not ok:
        raise ValueError(
            f"stagewise packed linear kernel: x {_describe(x)}, weight {_describe(weight)}, bias {_describe(bias)}; "
            f"it needs a contiguous packed CPU weight [N, K] (float32 or bfloat16, with AVX2 FMA; "
            f"packed layout here: {found}), x [M, K] with the same K and a bias [N] or none.")


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, f32_out: bool = False) -> torch.Tensor:
    dtype = weight.dtype
    if x.dtype != dtype or x.dim() != 2 or x.stride(1) != 1:
        x = x.to(dtype).reshape(-1, x.shape[-1]).contiguous()
    _check_packed(x, weight, bias)
    lib = _load()
    assert lib is not None, "a weight has a packed layout only where the kernel loaded"
    m, k = x.shape
    n = weight.shape[0]
    b = None if bias is None else bias.float().contiguous()
    b_ptr = None if b is None else b.data_ptr()
    if dtype == torch.bfloat16:
        y = torch.empty(m, n, dtype=torch.float32 if f32_out else dtype)
        if m:
            y_ptr = y.data_ptr()
            lib.packed_linear_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), b_ptr, None if f32_out else y_ptr,
                                   y_ptr if f32_out else None, n, m, n, k)
        return y
    y = torch.empty(m, n, dtype=dtype)
    if m:
        lib.packed_linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), b_ptr, y.data_ptr(), n, m, n, k)
    return y


define("linear_packed(Tensor x, Tensor weight, Tensor? bias, bool f32_out=False) -> Tensor", _packed,
       lambda x, weight, bias, f32_out=False: x.new_empty(x.shape[0], weight.shape[0],
                                                          dtype=torch.float32 if f32_out else weight.dtype))


def linear_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  f32_out: bool = False) -> torch.Tensor:
    """`F.linear` for a `pack`ed weight, in the weight's dtype (`f32_out`: float32, unrounded)."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or native.loaded("gemm"):
        y = torch.ops.stagewise.linear_packed(rows, weight, bias, f32_out)
    else:
        y = _packed(rows, weight, bias, f32_out)
    return y.view(*x.shape[:-1], weight.shape[0])
