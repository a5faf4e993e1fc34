"""float32 linear layers for steps of few rows on CPU: a C kernel that reads each weight once.

A decode step of a small batch, a speculative verify step (k + 1 rows) or a prefill's LM-head row
multiplies a handful of activation rows by every weight matrix. The weights do not fit the cache,
so such a step is bound by reading them; MKL's sgemm costs about one full weight read per row at
2-16 rows (SmolLM2-135M, one thread: 106 ms at 1 row, 183 ms at 2, 190 ms at 8), where this
kernel reads every weight row once and multiplies it with all the activation rows while it is
in registers (73, 96, 144 ms). From `MAX_ROWS` rows up MKL's blocked GEMM wins and runs instead.
bfloat16 weights are widened in registers on CPUs without native bf16, so a decode step reads half
the bytes (above `MAX_ROWS` rows they are widened per call for MKL); with AVX512-BF16 a third
kernel multiplies bf16 pairs natively and serves up to `NATIVE_BF16_ROWS` rows, oneDNN above.

Each output is an 8-lane dot product summed in a fixed order, so a row's result does not depend
on which other rows share the step. Kernels come from `ckernel` (cc + ctypes, cached);
without a compiler, or for other dtypes and layouts, `linear` is `F.linear`. Under
`torch.compile`, or under a dispatch mode that records ops, the call is the opaque op
`stagewise::linear`, which picks the kernel by the step's row count at run time (the compiled row
dimension is dynamic).
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import ckernel

MAX_ROWS = 32      # measured crossover with MKL (fp32, AVX2, one and two threads)

_SOURCE = ckernel.VEC8 + r"""
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
                              int64_t pw, const float* b, bf16_t* y, int64_t ldy) {             \
    __m512 acc[MB][NV];                                                                         \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) acc[m][j] = _mm512_setzero_ps();                           \
    for (int64_t kp = 0; kp < K / 2; kp++) {                                                    \
        __m512bh wv[NV];                                                                        \
        for (int j = 0; j < NV; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wp + 2 * (kp * pw + 16 * j)); \
        for (int m = 0; m < MB; m++) {                                                          \
            int32_t pair;                                                                       \
            memcpy(&pair, x + m * ldx + 2 * kp, 4);                                             \
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                    \
            for (int j = 0; j < NV; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);    \
        }                                                                                       \
    }                                                                                           \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) {                                                          \
            __m512 r = b ? _mm512_add_ps(acc[m][j], _mm512_loadu_ps(b + 16 * j)) : acc[m][j];  \
            _mm256_storeu_si256((__m256i*)(y + m * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(r)); \
        }                                                                                       \
}
#define PTILES(MB) PTILE(MB, 1) PTILE(MB, 2) PTILE(MB, 3) PTILE(MB, 4)
PTILES(1) PTILES(2) PTILES(3) PTILES(4) PTILES(5) PTILES(6)
typedef void (*ptile_fn)(const bf16_t*, int64_t, const bf16_t*, int64_t, int64_t, const float*, bf16_t*, int64_t);
#define PROW(MB) {0, ptile_##MB##x1, ptile_##MB##x2, ptile_##MB##x3, ptile_##MB##x4}

/* y [M, N] bf16 (row stride ldy) = x [M, K] bf16 (row stride ldx) @ packed w (+ b [N] float32);
   N % 16 == 0, K % 2 == 0. Tasks are (panel, up to 48 rows), panel-major, so a thread's panel
   stays in L2 while its rows pass; tiles of up to 6 rows. */
void packed_linear_bf16(const bf16_t* x, int64_t ldx, const bf16_t* wp, const float* b, bf16_t* y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K) {
    static const ptile_fn tiles[7][5] = {{0}, PROW(1), PROW(2), PROW(3), PROW(4), PROW(5), PROW(6)};
    int64_t panels = (N + PANEL - 1) / PANEL, rows = M <= 96 ? M : 48, chunks = (M + rows - 1) / rows;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t t = 0; t < panels * chunks; t++) {
        int64_t n0 = (t / chunks) * PANEL, pw = N - n0 < PANEL ? N - n0 : PANEL;
        int64_t m1 = (t % chunks + 1) * rows < M ? (t % chunks + 1) * rows : M;
        for (int64_t m0 = (t % chunks) * rows; m0 < m1; m0 += 6) {
            int64_t mb = m1 - m0 < 6 ? m1 - m0 : 6;
            tiles[mb][pw / 16](x + m0 * ldx, ldx, wp + n0 * K, K, pw, b ? b + n0 : 0, y + m0 * ldy + n0, ldy);
        }
    }
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
            if hasattr(lib, "packed_linear_bf16"):
                lib.packed_linear_bf16.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
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


# --- prepacked bf16 weights (CPUs with native bf16) -------------------------------------------
# Every bf16 linear layer's weight is reordered once at load into panels of 64 output columns
# (`pack`), in place of the checkpoint layout: no second copy. One kernel then serves every row
# count, from a one-row decode step to a 512-token prefill (SmolLM2-135M layers, one thread, bf16:
# 0.72x the time of the unpacked kernels at 1 row, 0.46x at 4, 0.71x at 32, 0.85x at 200 and
# 0.83x at 512, where oneDNN's own prepacked linear took 1.26x / 0.57x / 0.86x / 0.87x / 0.93x).
_PANEL = 64


def packable(weight: torch.Tensor) -> bool:
    """The packed kernel serves this bf16 `[N, K]` weight here: native bf16, N % 16 == 0, K even.
    `STAGEWISE_PACKED_WEIGHTS=0` keeps the checkpoint layout (the unpacked kernels and oneDNN)."""
    lib = _load()
    return (lib is not None and hasattr(lib, "packed_linear_bf16") and NATIVE_BF16
            and os.environ.get("STAGEWISE_PACKED_WEIGHTS", "1") != "0"
            and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> the same shape holding panels of 64 rows (the last may be narrower), each
    stored `[K/2, width, 2]`: the (k, k+1) pairs of all the panel's output columns side by side."""
    n, k = weight.shape
    full = n // _PANEL * _PANEL
    parts = [weight[:full].reshape(n // _PANEL, _PANEL, k // 2, 2).permute(0, 2, 1, 3).reshape(-1)]
    if full < n:
        parts.append(weight[full:].reshape(1, n - full, k // 2, 2).permute(0, 2, 1, 3).reshape(-1))
    return torch.cat(parts).view(n, k)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse."""
    n, k = packed.shape
    full = n // _PANEL * _PANEL
    flat = packed.reshape(-1)
    parts = [flat[:full * k].view(n // _PANEL, k // 2, _PANEL, 2).permute(0, 2, 1, 3).reshape(full, k)]
    if full < n:
        parts.append(flat[full * k:].view(k // 2, n - full, 2).permute(1, 0, 2).reshape(n - full, k))
    return torch.cat(parts)


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lib = _load()
    assert lib is not None, "weights are packed only where the kernel loaded"
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        x = x.to(torch.bfloat16).reshape(-1, x.shape[-1]).contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    b = None if bias is None else bias.float().contiguous()
    if m:
        lib.packed_linear_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), None if b is None else b.data_ptr(),
                               y.data_ptr(), n, m, n, k)
    return y


_LIB.define("linear_packed(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("linear_packed", _packed, "CPU")


@torch.library.register_fake("stagewise::linear_packed")
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)


def linear_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for a `pack`ed weight; bf16 out."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        y = torch.ops.stagewise.linear_packed(rows, weight, bias)
    else:
        y = _packed(rows, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


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

    def pack_(self) -> bool:
        if self.packed or not self.serves_head or not packable(self.weight) or self.weight.shape[0] % _PANEL:
            return False
        with torch.no_grad():
            self.weight.copy_(pack(self.weight))
        self.packed = True
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return super().forward(ids)
        n, k = self.weight.shape
        panels = self.weight.view(n // _PANEL, k // 2, _PANEL, 2)
        flat = ids.reshape(-1)
        return panels[flat // _PANEL, :, flat % _PANEL].reshape(*ids.shape, k)      # [..., K/2, 2] -> [..., K]

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of `hidden` `[R, H]` against this (tied) weight, in the weight's dtype."""
        return linear_packed(hidden, self.weight) if self.packed else linear(hidden, self.weight)


def pack_linears(model: torch.nn.Module) -> int:
    """`pack_` on every `Linear` and head-serving `Embedding` of `model`, once its weights are
    loaded: how many weights were packed."""
    return sum(m.pack_() for m in model.modules() if isinstance(m, (Linear, Embedding)))
