"""The quantized kernels' C library (csrc/quant*.c): its build, its ctypes bindings and the checks
at its boundary. `run_linear` and `run_dequant_rows` take packed weights only.

The library is compiled for this CPU (`-march=native`: AVX-512 with or without VNNI, AVX2, or
portable C); tests also build the narrower variants (`VARIANTS`) to check every path here.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

from . import quant_pack
from .quant_formats import K_TYPES, SUPPORTED, T, row_bytes

log = logging.getLogger("stagewise.kernels")

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("quant.c", "quant_layout.h", "quant_simd.h")
_COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-Wall"]
# name -> (compiler flags, CPU flags it needs)
VARIANTS = {"native": (["-march=native"], ()),
            "avx512": (["-march=native", "-mno-avx512vnni"], ("avx512bw",)),
            "avx2": (["-march=native", "-mno-avx512f"], ("avx2", "fma", "f16c")),
            "portable": (["-DQUANT_PORTABLE", "-O2"], ())}     # -O3 unrolls its scalar loops: 3x the build


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def variant_runs_here(variant: str) -> bool:
    return set(VARIANTS[variant][1]) <= _cpu_flags()


def _compiler() -> tuple[str, str]:
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    return cc, version


def _build(variant: str) -> Path:
    cc, version = _compiler()
    flags = [*_COMMON, *VARIANTS[variant][0]]
    text = "\0".join([(_CSRC / s).read_text() for s in _SOURCES] + flags + [version, " ".join(sorted(_cpu_flags()))])
    root = Path(os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise") / "kernels"
    path = root / f"quant_{variant}_{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")          # same directory: the rename is atomic
        done = subprocess.run([cc, *flags, str(_CSRC / "quant.c"), "-o", str(partial), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"Building the quantized kernels ({variant}) failed:\n{done.stderr}")
        os.replace(partial, path)
    return path


@functools.cache
def library(variant: str = "native") -> ctypes.CDLL:
    """The kernel library, built on first use (raises if it cannot be built)."""
    lib = ctypes.CDLL(str(_build(variant)))
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.quant_isa.restype = ctypes.c_char_p
    lib.quant_panel_bytes.argtypes, lib.quant_panel_bytes.restype = [i32, i64], i64
    lib.quant_activations.argtypes, lib.quant_activations.restype = [p, i32, i64, i64, i64, p, p, p], None
    lib.quant_linear_fast.argtypes = [i32, p, p, p, i64, i64, p, i64, p, p, p, i64]
    lib.quant_linear_exact.argtypes = [i32, p, i64, i64, i64, p, i64, p, p, p, i64]
    lib.quant_dequant_rows.argtypes = [i32, p, i64, p, i64, p, p]
    for fn in (lib.quant_linear_fast, lib.quant_linear_exact, lib.quant_dequant_rows):
        fn.restype = i32
    return lib


@functools.cache
def available() -> bool:
    """The native library builds and loads here (one warning otherwise: the torch fallback runs)."""
    if os.environ.get("STAGEWISE_CPU_KERNELS", "1") == "0":
        return False
    try:
        library()
        return True
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        if os.environ.get("STAGEWISE_REQUIRE_KERNELS") == "1":
            raise
        log.warning("Quantized kernels unavailable; quantized layers dequantize per call (slow): %s", exc)
        return False


def check_linear(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, qtype: int, n: int,
                 packed: bool = True) -> None:
    """One sentence for each way a call could read out of bounds or misread the weight."""
    if T(qtype) not in SUPPORTED:
        raise ValueError(f"GGUF type {T(qtype).name} has no quantized kernel.")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"Quantized linear takes CPU float32 or bfloat16 rows [M, K], not {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}.")
    k = x.shape[1]
    step = 256 if T(qtype) in K_TYPES else 32
    if k % step or x.stride(1) != 1:
        raise ValueError(f"Quantized linear needs K a multiple of {step} and unit column stride; got K={k}, "
                         f"strides {x.stride()}.")
    if packed:
        expected = (quant_pack.num_panels(n), quant_pack.panel_bytes(T(qtype), k))
    else:
        expected = (n, row_bytes(T(qtype), k))
    if data.dtype != torch.uint8 or tuple(data.shape) != expected or not data.is_contiguous():
        raise ValueError(f"A{' packed' if packed else ''} {n}x{k} {T(qtype).name} weight is contiguous uint8 "
                         f"{expected}; got {data.dtype} {tuple(data.shape)} (K of the activations must match the "
                         f"weight's, and N its rows).")
    if bias is not None and (bias.shape != (n,) or bias.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"The bias must be float [{n}], not {bias.dtype} {tuple(bias.shape)}.")


def run_linear(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, qtype: int, n: int, exact: bool,
               f32_out: bool, variant: str = "native") -> torch.Tensor:
    """`x [M, K] @ W^T (+ bias)` by the kernels, W packed; float32 with `f32_out`, else x's dtype."""
    check_linear(x, data, bias, qtype, n)
    lib = library(variant)
    m, k = x.shape
    out_dtype = torch.float32 if f32_out else x.dtype
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    b = None if bias is None else bias.float().contiguous()
    ptrs = (None if b is None else b.data_ptr(), y.data_ptr() if out_dtype == torch.float32 else None,
            y.data_ptr() if out_dtype == torch.bfloat16 else None, n)
    if exact:
        xf = x.float() if x.dtype != torch.float32 else x
        status = lib.quant_linear_exact(qtype, xf.data_ptr(), xf.stride(0), m, k, data.data_ptr(), n, *ptrs)
    else:
        xq = torch.empty(m, k, dtype=torch.int8)
        xd, xs = torch.empty(m, k // 32), torch.empty(m, k // 16, dtype=torch.int32)
        lib.quant_activations(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), m, k, xq.data_ptr(),
                              xd.data_ptr(), xs.data_ptr())
        status = lib.quant_linear_fast(qtype, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), m, k, data.data_ptr(),
                                       n, *ptrs)
    assert status == 0
    return y


def run_dequant_rows(data: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor, dtype: torch.dtype,
                     variant: str = "native") -> torch.Tensor:
    """Rows `ids` (int64, checked in range) of a packed matrix, `[len(ids), K]` float32 or bfloat16."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"Row ids must lie in [0, {n}); got {int(flat.min())} .. {int(flat.max())}.")
    out = torch.empty(flat.numel(), k, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    f32 = out.dtype == torch.float32
    status = library(variant).quant_dequant_rows(qtype, data.data_ptr(), k, flat.data_ptr(), flat.numel(),
                                                 out.data_ptr() if f32 else None, None if f32 else out.data_ptr())
    assert status == 0
    return out.to(dtype)
