"""Small C kernels for the CPU, built once with the system C compiler and loaded through ctypes.

No torch headers are involved, so a kernel builds in about a second. The shared library is
cached under the stagewise cache directory, keyed by its source, flags and CPU, and it is built
into a temporary file and renamed, so concurrent builders never load a half-written one.
OpenMP comes from the libgomp torch already loaded (same soname), so kernels share torch's
thread pool and its OMP_* settings. `STAGEWISE_CPU_KERNELS=0` turns every kernel off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile

log = logging.getLogger("stagewise.kernels")

# C helpers the kernels share: 8-lane float vectors (GCC vector extensions; AVX2 under
# -march=native), exact bf16 widening, a fused multiply-add where the CPU has FMA and a
# horizontal sum in a fixed order (a kernel's results never depend on how work was split).
VEC8 = r"""
#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t h8u __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t i8 __attribute__((vector_size(32)));
typedef float f32_t;
typedef uint16_t bf16_t;

static inline v8 ld_f32(const float* p) { return *(const v8u*)p; }
/* bfloat16 is the top half of a float32: widen and shift, exactly */
#ifdef __AVX2__
#include <immintrin.h>
static inline v8 ld_bf16(const uint16_t* p) {      /* one zero-extending load and a shift */
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
#else
static inline v8 ld_bf16(const uint16_t* p) { return (v8)(__builtin_convertvector(*(const h8u*)p, i8) << 16); }
#endif
#ifdef __FMA__
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }     /* never contracted (-std=c11) */
#endif
static inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
"""
# The AVX512-BF16 tile of the packed linear layers and the prefill attention: MB rows of bf16 x
# (row stride ldx) against NV vectors of 16 columns whose (k, k+1) weight pairs lie at
# w + kp * kstride + j * jstride, into float32 acc[MB][NV]: each row's pair broadcast, exact
# products (vdpbf16ps), float32 sums over k in order. Kernels include it after immintrin.h.
BF16_TILE = r"""
#define BF16_TILE_ACC(MB, NV, x, ldx, w, kstride, jstride, npairs, acc)                          \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) acc[m][j] = _mm512_setzero_ps();                           \
    for (int64_t kp = 0; kp < (npairs); kp++) {                                                 \
        __m512bh wv_[NV];                                                                       \
        for (int j = 0; j < NV; j++) wv_[j] = (__m512bh)_mm512_loadu_si512((w) + kp * (kstride) + j * (jstride)); \
        for (int m = 0; m < MB; m++) {                                                          \
            int32_t pair_;                                                                      \
            memcpy(&pair_, (x) + m * (ldx) + 2 * kp, 4);                                        \
            __m512bh xb_ = (__m512bh)_mm512_set1_epi32(pair_);                                  \
            for (int j = 0; j < NV; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb_, wv_[j]);  \
        }                                                                                       \
    }
"""
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def native_bf16() -> bool:
    """The CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    flags = _cpu_flags().split()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _cache_path(name: str, source: str) -> str:
    root = os.environ.get("STAGEWISE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stagewise")
    digest = hashlib.sha256("\0".join([source, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    return os.path.join(root, "kernels", f"{name}_{digest}.so")


def _build(name: str, source: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so")
        with open(src, "w") as f:
            f.write(source)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, *FLAGS, src, "-o", lib, "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(lib, path)


def load(name: str, source: str, what: str) -> ctypes.CDLL | None:
    """The kernel library for `source`, built on first use; None (after one warning naming `what`
    falls back) where kernels are off or no compiler works."""
    if os.environ.get("STAGEWISE_CPU_KERNELS", "1") == "0":
        return None
    path = _cache_path(name, source)
    try:
        if not os.path.exists(path):
            _build(name, source, path)
        return ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernel %s unavailable (%s); %s", name,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__, what)
        return None
