"""Linear layers on CPU: C kernels for packed weights and for steps of few rows.

Packed weights (`pack_linears`, called once the weights are loaded): bf16 on CPUs with native
bf16 and float32 with AVX2/AVX-512 FMA, each weight is reordered in its own storage into panels
of output columns, and one kernel serves every row count by broadcasting each activation (bf16:
each pair of activations) against a panel's contiguous weights: no horizontal sums, one stream
per panel, each output one chain over k in order, so a row's result does not depend on its batch.

Small-row kernel (weights that are not packed): a decode step of a small batch, a speculative
verify step or a prefill's LM-head row multiplies a handful of rows by every weight matrix, and
the weights do not fit the cache, so such a step is bound by reading them; MKL's sgemm costs about
one full weight read per row at 2-16 rows, where this kernel reads every weight row once and
multiplies it with all the activation rows while it is in registers. From `MAX_ROWS` rows up
MKL's blocked GEMM runs instead. bfloat16 weights are widened in registers on CPUs without native
bf16 (above `MAX_ROWS` rows they are widened per call for MKL); with AVX512-BF16 a variant
multiplies bf16 pairs natively up to `NATIVE_BF16_ROWS` rows, oneDNN above.

Kernels come from `ckernel` (cc + ctypes, cached); without a compiler, or for other dtypes and
layouts, `linear` is `F.linear` and nothing is packed. Under `torch.compile`, or under a dispatch
mode that records ops, the calls are the opaque ops `stagewise::linear` (which picks by the
step's row count at run time: the compiled row dimension is dynamic) and `stagewise::linear_packed`.
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import ckernel

MAX_ROWS = 32      # measured crossover with MKL (fp32, AVX2, one and two threads)

_SOURCE = ckernel.VEC8 + ckernel.BF16_TILE + r"""
#include <string.h>
/* y[m, j] = x[m, :] . w[j, :] (+ b[j]) for m < MB, j < NB: NB weight rows stay in registers
   while every one of the MB activation rows uses them. Activations, bias and output are float32;
   weights are WT (float32 or bfloat16). */
#define TILE(WT, MB, NB)                                                                        \
static void tile_##WT##_##MB##x##NB(const float* x, int64_t ldx, const WT##_t* w, int64_t K,     \
                                    const float* b, float* y, int64_t ldy) {                    \
    v8 acc[MB][NB] = {{{0}}};                                                                   \
    for (int64_t k = 0; k < K; k += 8) {                                                        \
        v8 wv[NB];                                                                              \
        for (int j = 0; j < NB; j++) wv[j] = ld_##WT(w + j * K + k);                            \
        for (int m = 0; m < MB; m++) {                                                          \
            v8 xv = ld_f32(x + m * ldx + k);                                                    \
            for (int j = 0; j < NB; j++) acc[m][j] = fma8(xv, wv[j], acc[m][j]);                \
        }                                                                                       \
    }                                                                                           \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NB; j++) y[m * ldy + j] = hsum(acc[m][j]) + (b ? b[j] : 0.f);       \
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w [N, K]^T (+ b [N]); K % 8 == 0.
   Up to SEQ_ROWS rows: one weight row at a time against all rows, so the weights stream in
   address order (interleaving several weight rows, for fewer horizontal sums, read them at
   0.6-0.8x the rate: SmolLM2 bf16, one thread, 10-11 vs 14-15 GB/s). More rows: blocks of 4 rows
   against tiles of 3 weight rows, which stay in L1 across the blocks (every weight is read once). */
#define SEQ_ROWS 4
#define TILES(T, NAME)                                                                          \
T(NAME, 1, 3) T(NAME, 2, 3) T(NAME, 3, 3) T(NAME, 4, 3)                                         \
T(NAME, 1, 1) T(NAME, 2, 1) T(NAME, 3, 1) T(NAME, 4, 1)
#define LINEAR(NAME, XT, WT)                                                                    \
typedef void (*tile_##NAME##_fn)(const XT*, int64_t, const WT*, int64_t, const float*, float*, int64_t); \
void small_linear_##NAME(const XT* x, int64_t ldx, const WT* w, const float* b, float* y, int64_t ldy, \
                         int64_t M, int64_t N, int64_t K) {                                     \
    static const tile_##NAME##_fn narrow[5] = {0, tile_##NAME##_1x3, tile_##NAME##_2x3,         \
        tile_##NAME##_3x3, tile_##NAME##_4x3};                                                  \
    static const tile_##NAME##_fn single[5] = {0, tile_##NAME##_1x1, tile_##NAME##_2x1,         \
        tile_##NAME##_3x1, tile_##NAME##_4x1};                                                  \
    int64_t nb = M <= SEQ_ROWS ? 1 : 3;                                                         \
    const tile_##NAME##_fn* tiles = nb == 1 ? single : narrow;                                  \
    int64_t ntiles = (N + nb - 1) / nb;                                                         \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t t = 0; t < ntiles; t++) {                                                      \
        int64_t n0 = t * nb, nn = N - n0 < nb ? N - n0 : nb;                                    \
        for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                 \
            int64_t mb = M - m0 < 4 ? M - m0 : 4;                                               \
            const XT* xt = x + m0 * ldx;                                                        \
            float* yt = y + m0 * ldy + n0;                                                      \
            if (nn == nb)                                                                       \
                tiles[mb](xt, ldx, w + n0 * K, K, b ? b + n0 : 0, yt, ldy);                     \
            else                                                                                \
                for (int64_t j = 0; j < nn; j++)                                                \
                    single[mb](xt, ldx, w + (n0 + j) * K, K, b ? b + n0 + j : 0, yt + j, ldy);  \
        }                                                                                       \
    }                                                                                           \
}

TILES(TILE, f32) LINEAR(f32, float, f32_t)
TILES(TILE, bf16) LINEAR(bf16, float, bf16_t)

/* The packed kernels' task loop: tasks are (panel of up to PW columns, up to 48 rows),
   panel-major, so a thread's panel stays in L2 while its rows pass; CALL runs one tile of mb <= 6
   rows at row m0 against the panel at column n0, pw wide. */
#define FOR_PACKED_TILES(PW, M, N, CALL)                                                        \
    int64_t panels = (N + PW - 1) / PW, rows = M <= 96 ? M : 48, chunks = (M + rows - 1) / rows; \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t t = 0; t < panels * chunks; t++) {                                             \
        int64_t n0 = (t / chunks) * PW, pw = N - n0 < PW ? N - n0 : PW;                         \
        int64_t m1 = (t % chunks + 1) * rows < M ? (t % chunks + 1) * rows : M;                 \
        for (int64_t m0 = (t % chunks) * rows; m0 < m1; m0 += 6) {                              \
            int64_t mb = m1 - m0 < 6 ? m1 - m0 : 6;                                             \
            CALL;                                                                               \
        }                                                                                       \
    }

/* Packed float32 weights: panels of FPANEL output columns (the last one may be half as wide),
   each [K][width]: at every k the panel's weights lie side by side. A tile of up to 6 rows x
   FPANEL columns broadcasts x[m, k] against them (two vectors of FLANES per row, 12
   accumulators: BLIS's 6x16 shape on AVX2); every output is one chain over k in order. */
#if defined(__AVX512F__) && !defined(STAGEWISE_NO_AVX512)
#include <immintrin.h>
#define FLANES 16
typedef __m512 fvec;
#define FLOAD _mm512_loadu_ps
#define FSTORE _mm512_storeu_ps
#define FZERO _mm512_setzero_ps
#define FSET1 _mm512_set1_ps
#define FFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FADD _mm512_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define FLANES 8
typedef __m256 fvec;
#define FLOAD _mm256_loadu_ps
#define FSTORE _mm256_storeu_ps
#define FZERO _mm256_setzero_ps
#define FSET1 _mm256_set1_ps
#define FFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FADD _mm256_add_ps
#endif
#ifdef FLANES
#define FPANEL (2 * FLANES)
int packed_f32_panel(void) { return FPANEL; }
#define FTILE(MB, NV)                                                                           \
static void ftile_##MB##x##NV(const float* x, int64_t ldx, const float* wp, int64_t K, int64_t pw, \
                              const float* b, float* y, int64_t ldy) {                          \
    fvec acc[MB][NV];                                                                           \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) acc[m][j] = FZERO();                                       \
    for (int64_t k = 0; k < K; k++) {                                                           \
        fvec wv[NV];                                                                            \
        for (int j = 0; j < NV; j++) wv[j] = FLOAD(wp + k * pw + FLANES * j);                   \
        for (int m = 0; m < MB; m++) {                                                          \
            fvec xb = FSET1(x[m * ldx + k]);                                                    \
            for (int j = 0; j < NV; j++) acc[m][j] = FFMA(xb, wv[j], acc[m][j]);                \
        }                                                                                       \
    }                                                                                           \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++)                                                            \
            FSTORE(y + m * ldy + FLANES * j, b ? FADD(acc[m][j], FLOAD(b + FLANES * j)) : acc[m][j]); \
}
#define FTILES(MB) FTILE(MB, 1) FTILE(MB, 2)
FTILES(1) FTILES(2) FTILES(3) FTILES(4) FTILES(5) FTILES(6)
typedef void (*ftile_fn)(const float*, int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t);
#define FROW(MB) {0, ftile_##MB##x1, ftile_##MB##x2}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ packed w (+ b [N]); N % FLANES == 0.
   Tasks as in FOR_PACKED_TILES. */
void packed_linear_f32(const float* x, int64_t ldx, const float* wp, const float* b, float* y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K) {
    static const ftile_fn tiles[7][3] = {{0}, FROW(1), FROW(2), FROW(3), FROW(4), FROW(5), FROW(6)};
    FOR_PACKED_TILES(FPANEL, M, N, tiles[mb][pw / FLANES](x + m0 * ldx, ldx, wp + n0 * K, K, pw, b ? b + n0 : 0,
                                                          y + m0 * ldy + n0, ldy))
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* Native bf16 (AVX512-BF16): bf16 activations and weights, 32 per instruction, each pair's
   products exact and summed in float32 (vdpbf16ps); K % 32 == 0. Same tiles as above; a 3-row
   tile prefetches the next one (0.7-0.9x the time at 5-8 rows; one-row tiles stream without). */
#define DPTILE(NAME, MB, NB)                                                                    \
static void tile_##NAME##_##MB##x##NB(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t K,  \
                                      const float* b, float* y, int64_t ldy) {                  \
    __m512 acc[MB][NB];                                                                         \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NB; j++) acc[m][j] = _mm512_setzero_ps();                           \
    for (int64_t k = 0; k < K; k += 32) {                                                       \
        __m512bh wv[NB];                                                                        \
        for (int j = 0; j < NB; j++) {                                                          \
            wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);                                \
            if (NB > 1) __builtin_prefetch(w + (j + NB) * K + k, 0, 0);                         \
        }                                                                                       \
        for (int m = 0; m < MB; m++) {                                                          \
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);                        \
            for (int j = 0; j < NB; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);    \
        }                                                                                       \
    }                                                                                           \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NB; j++) y[m * ldy + j] = _mm512_reduce_add_ps(acc[m][j]) + (b ? b[j] : 0.f); \
}
TILES(DPTILE, bf16dp) LINEAR(bf16dp, bf16_t, bf16_t)

/* Packed bf16 weights (prepacked once at load): [N, K] becomes panels of PANEL = 64 output
   columns (the last one may be narrower, a multiple of 16), each [K/2][width][2], so that at pair
   kp the (k, k+1) weights of all the panel's columns lie together. A tile of MB rows x NV vectors
   of 16 columns broadcasts each row's (x[k], x[k+1]) pair against them: no horizontal sums, the
   panel is read as one stream, and every output is one chain over k in order, whatever M is. */
#define PANEL 64
#define PTILE(MB, NV)                                                                           \
static void ptile_##MB##x##NV(const bf16_t* x, int64_t ldx, const bf16_t* wp, int64_t K,        \
                              int64_t pw, const float* b, bf16_t* y, float* y32, int64_t ldy) { \
    __m512 acc[MB][NV];                                                                         \
    BF16_TILE_ACC(MB, NV, x, ldx, wp, 2 * pw, 32, K / 2, acc)                                   \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) {                                                          \
            __m512 r = b ? _mm512_add_ps(acc[m][j], _mm512_loadu_ps(b + 16 * j)) : acc[m][j];  \
            if (y32)                                                                            \
                _mm512_storeu_ps(y32 + m * ldy + 16 * j, r);                                    \
            else                                                                                \
                _mm256_storeu_si256((__m256i*)(y + m * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(r)); \
        }                                                                                       \
}
#define PTILES(MB) PTILE(MB, 1) PTILE(MB, 2) PTILE(MB, 3) PTILE(MB, 4)
PTILES(1) PTILES(2) PTILES(3) PTILES(4) PTILES(5) PTILES(6)
typedef void (*ptile_fn)(const bf16_t*, int64_t, const bf16_t*, int64_t, int64_t, const float*, bf16_t*, float*,
                         int64_t);
#define PROW(MB) {0, ptile_##MB##x1, ptile_##MB##x2, ptile_##MB##x3, ptile_##MB##x4}

/* y [M, N] bf16 (row stride ldy) = x [M, K] bf16 (row stride ldx) @ packed w (+ b [N] float32);
   N % 16 == 0, K % 2 == 0; with y32, float32 into it instead (logits: no bf16 rounding). Tasks
   are as in FOR_PACKED_TILES. */
void packed_linear_bf16(const bf16_t* x, int64_t ldx, const bf16_t* wp, const float* b, bf16_t* y,
                        float* y32, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    static const ptile_fn tiles[7][5] = {{0}, PROW(1), PROW(2), PROW(3), PROW(4), PROW(5), PROW(6)};
    FOR_PACKED_TILES(PANEL, M, N, tiles[mb][pw / 16](x + m0 * ldx, ldx, wp + n0 * K, K, pw, b ? b + n0 : 0,
                                                     y + m0 * ldy + n0, y32 ? y32 + m0 * ldy + n0 : 0, ldy))
}
#endif
"""

_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        lib = ckernel.load("small_linear", _SOURCE, "linear layers use MKL at every row count")
        if lib is not None:
            i64, p = ctypes.c_int64, ctypes.c_void_p
            for fn in (lib.small_linear_f32, lib.small_linear_bf16, getattr(lib, "small_linear_bf16dp", None)):
                if fn is None:
                    continue
                fn.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
                fn.restype = None
            if hasattr(lib, "packed_linear_f32"):
                lib.packed_f32_panel.restype = ctypes.c_int
                lib.packed_linear_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
                lib.packed_linear_f32.restype = None
            if hasattr(lib, "packed_linear_bf16"):
                lib.packed_linear_bf16.argtypes = [p, i64, p, p, p, p, i64, i64, i64, i64]
                lib.packed_linear_bf16.restype = None
        _lib = lib
    return _lib


def available() -> bool:
    return _load() is not None


# bf16 on a CPU with native bf16 (AVX512-BF16): the `bf16dp` kernel, bf16 activations and
# weights; it beats oneDNN's bf16 GEMM up to about 16 rows (SmolLM2 layers, one thread: 0.35-0.6x
# the time at 1-4 rows, 0.7-0.9x at 8-16, 1.2x at 32). On other CPUs bf16 weights are widened to
# float32 in the kernel (oneDNN emulates bf16 there, slowly).
NATIVE_BF16 = ckernel.native_bf16()
NATIVE_BF16_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What the kernel serves, from static properties only (so tracing never breaks on it): CPU
    rows `[M, K]` in `_DTYPES` with unit column stride, a contiguous `[N, K]` weight of the same
    dtype, K a multiple of 8 (of 32 for native bf16). Whether the kernel built is asked at run time."""
    step = 32 if NATIVE_BF16 and x.dtype == torch.bfloat16 else 8
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in _DTYPES
            and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and weight.shape[1] % step == 0
            and x.stride(1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


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
    if lib is None or _kernel(lib, dtype) is None:
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


# NOTE: defined through torch.library.Library, not `custom_op`: the dispatcher then calls
# `_by_rows` directly, ~14 us a call instead of ~24 us of custom_op's checks (121 calls a step).
_LIB = torch.library.Library("stagewise", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("linear", _by_rows, "CPU")


@torch.library.register_fake("stagewise::linear")
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the kernel for steps of at most `MAX_ROWS` rows where it applies."""
    if not supports(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return torch.ops.stagewise.linear(x, weight, bias)     # traced or recorded as one op
    return _by_rows(x, weight, bias)


# --- prepacked weights ------------------------------------------------------------------------
# Every linear layer's weight is reordered once at load into panels of output columns (`pack`),
# in place of the checkpoint layout: no second copy. One kernel then serves every row count,
# from a one-row decode step to a 512-token prefill. bf16 (native bf16 CPUs), SmolLM2-135M layers,
# one thread: 0.72x the time of the unpacked kernels at 1 row, 0.46x at 4, 0.71x at 32, 0.85x at
# 200 and 0.83x at 512, where oneDNN's own prepacked linear took 1.26x / 0.57x / 0.86x / 0.87x /
# 0.93x. float32 (AVX2 or AVX-512 with FMA): see `benchmarks/RESULTS.md`.

def _layout(dtype: torch.dtype) -> tuple[int, int] | None:
    """(panel width, k per pair) of the packed kernel for `dtype` on this CPU; None if it has none."""
    lib = _load()
    if lib is None or os.environ.get("STAGEWISE_PACKED_WEIGHTS", "1") == "0":
        return None
    if dtype == torch.bfloat16 and NATIVE_BF16 and hasattr(lib, "packed_linear_bf16"):
        return 64, 2
    if dtype == torch.float32 and hasattr(lib, "packed_f32_panel"):
        return lib.packed_f32_panel(), 1
    return None


def packable(weight: torch.Tensor) -> bool:
    """The packed kernel serves this `[N, K]` weight here: bf16 on a native-bf16 CPU (N % 16 == 0,
    K even) or float32 with AVX2/AVX-512 FMA (N a multiple of half a panel).
    `STAGEWISE_PACKED_WEIGHTS=0` keeps the checkpoint layout (the unpacked kernels, MKL, oneDNN)."""
    layout = None if weight.device.type != "cpu" or weight.dim() != 2 else _layout(weight.dtype)
    if layout is None:
        return False
    panel, pair = layout
    vector = 16 if pair == 2 else panel // 2           # output columns per vector of a tile
    return weight.shape[0] % vector == 0 and weight.shape[1] % pair == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> the same shape holding panels of P rows (the last may be narrower), each stored
    `[K/pair, width, pair]`: at every k (bf16: every pair k, k+1) all the panel's output columns
    side by side."""
    panel, pair = _layout(weight.dtype) or (64, 2)
    n, k = weight.shape
    full = n // panel * panel
    parts = [weight[:full].reshape(n // panel, panel, k // pair, pair).permute(0, 2, 1, 3).reshape(-1)]
    if full < n:
        parts.append(weight[full:].reshape(1, n - full, k // pair, pair).permute(0, 2, 1, 3).reshape(-1))
    return torch.cat(parts).view(n, k)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse."""
    panel, pair = _layout(packed.dtype) or (64, 2)
    n, k = packed.shape
    full = n // panel * panel
    flat = packed.reshape(-1)
    parts = [flat[:full * k].view(n // panel, k // pair, panel, pair).permute(0, 2, 1, 3).reshape(full, k)]
    if full < n:
        parts.append(flat[full * k:].view(k // pair, n - full, pair).permute(1, 0, 2).reshape(n - full, k))
    return torch.cat(parts)


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, f32_out: bool = False) -> torch.Tensor:
    lib = _load()
    assert lib is not None, "weights are packed only where the kernel loaded"
    dtype = weight.dtype
    if x.dtype != dtype or x.dim() != 2 or x.stride(1) != 1:
        x = x.to(dtype).reshape(-1, x.shape[-1]).contiguous()
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


_LIB.define("linear_packed(Tensor x, Tensor weight, Tensor? bias, bool f32_out=False) -> Tensor")
_LIB.impl("linear_packed", _packed, "CPU")


@torch.library.register_fake("stagewise::linear_packed")
def _(x, weight, bias, f32_out=False):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if f32_out else weight.dtype)


def linear_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  f32_out: bool = False) -> torch.Tensor:
    """`F.linear` for a `pack`ed weight, in the weight's dtype (`f32_out`: float32, unrounded)."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        y = torch.ops.stagewise.linear_packed(rows, weight, bias, f32_out)
    else:
        y = _packed(rows, weight, bias, f32_out)
    return y.view(*x.shape[:-1], weight.shape[0])


def logits(hidden: torch.Tensor, weight: torch.Tensor, packed: bool) -> torch.Tensor:
    """float32 logits `[R, V]` of an LM head: a packed bf16 head writes them unrounded (bf16 logits
    of a ~25 magnitude are 0.125 apart, enough to tie or flip a near-tie greedy pick)."""
    if packed:
        return linear_packed(hidden, weight, None, f32_out=weight.dtype == torch.bfloat16).float()
    return linear(hidden, weight).float()


class Linear(torch.nn.Linear):
    """`nn.Linear` whose forward is `linear` (same parameters, same checkpoints). After `pack_`
    the weight holds the packed layout and every call goes to the packed kernel."""

    packed = False

    def pack_(self) -> bool:
        """Reorder the weight in place of the checkpoint layout where `packable`; True if it was."""
        if self.packed or not packable(self.weight):
            return False
        with torch.no_grad():
            self.weight.copy_(pack(self.weight))      # in the same storage: no second copy stays
        self.packed = True
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return linear_packed(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


class Embedding(torch.nn.Embedding):
    """`nn.Embedding`. Where it is also the LM head (tied weights on a stage that is first and
    last; the model sets `serves_head`), `pack_` packs its weight for the head's GEMMs and a
    lookup gathers each token's row out of the packed layout."""

    packed = False
    serves_head = False
    layout = (1, 1)       # (panel width, k per pair) once packed

    def pack_(self) -> bool:
        layout = _layout(self.weight.dtype)
        if (self.packed or not self.serves_head or layout is None or not packable(self.weight)
                or self.weight.shape[0] % layout[0]):
            return False
        with torch.no_grad():
            self.weight.copy_(pack(self.weight))
        self.packed, self.layout = True, layout
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return super().forward(ids)
        panel, pair = self.layout
        n, k = self.weight.shape
        panels = self.weight.view(n // panel, k // pair, panel, pair)
        flat = ids.reshape(-1)
        return panels[flat // panel, :, flat % panel].reshape(*ids.shape, k)      # [..., K/pair, pair] -> [..., K]

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of `hidden` `[R, H]` against this (tied) weight."""
        return logits(hidden, self.weight, self.packed)


def pack_linears(model: torch.nn.Module) -> int:
    """`pack_` on every `Linear` and head-serving `Embedding` of `model`, once its weights are
    loaded: how many weights were packed."""
    return sum(m.pack_() for m in model.modules() if isinstance(m, (Linear, Embedding)))
