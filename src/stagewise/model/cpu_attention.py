"""Decode attention that reads the paged KV cache in place, on CPU: a small C kernel (`ckernel`:
built once with the system C compiler, cached, called through ctypes).

Each sequence, or each (sequence, KV head) pair when there are fewer than two sequences per
thread, is one OpenMP task: it walks the sequence's block table, scores every cached key against
the query heads (8-lane dot products over the head size, a multiple of 8, one independent chain
per query head, summed in a fixed order), and accumulates the values, so no `[G, L, Hkv, D]`
copy of the keys is ever made. Both task layouts give the same results bit for bit. float32 and
bfloat16 (computed in float32, rounded once on output). `available()` is False where no
compiler works: callers keep the SDPA path.
"""
from __future__ import annotations

import ctypes

import torch

from . import ckernel

_SOURCE = ckernel.VEC8 + r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);      /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);                                                /* round to nearest even */
    return (uint16_t)(u >> 16);
}
#define IDENT(x) (x)
#define MAX_GROUP 16     /* query heads per KV head the kernel serves */

static void softmax_row(float* s, int64_t L) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < L; j++) m = s[j] > m ? s[j] : m;
    for (int64_t j = 0; j < L; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t j = 0; j < L; j++) s[j] *= inv;
}

/* One task per sequence and run of `hpt` KV heads (hpt = Hkv: a task per sequence, each key's
   row of all its KV heads, [Hkv, D] contiguous in its block, read once and in order; hpt = 1: a
   task per (sequence, KV head), for batches too small to keep every thread busy otherwise). The
   query heads sharing a KV head score every cached key (one chain per query head), a softmax per
   query head, then the values are summed with those weights. Each head's arithmetic is the
   same whatever hpt is, so results do not depend on it. */
#define DECODE_KERNEL(NAME, T, LD, STORE)                                                          \
void NAME(const T* q, int64_t q_row, const T* k, const T* v, int64_t blk_stride,                    \
          const int64_t* tables, int64_t tab_stride, const int64_t* seq_lens, int64_t G,            \
          int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t hpt, T* out) {       \
    int64_t grp = Hq / Hkv, nd = D / 8, runs = Hkv / hpt, nq = hpt * grp;                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                               \
    for (int64_t t = 0; t < G * runs; t++) {                                                        \
        int64_t b = t / runs, h0 = (t % runs) * hpt, L = seq_lens[b];                               \
        size_t scores = (size_t)((nq * (L > 0 ? L : 1) + 7) / 8 + 1);         /* in v8s */          \
        v8* qv = (v8*)aligned_alloc(32, sizeof(v8) * ((size_t)(2 * nq * nd) + scores));             \
        v8* acc = qv + nq * nd;                                                                     \
        float* s = (float*)(acc + nq * nd);                                                         \
        const T* qb = q + b * q_row + h0 * grp * D;                                                 \
        for (int64_t i = 0; i < nq; i++)                                                            \
            for (int64_t c = 0; c < nd; c++) {                                                      \
                qv[i * nd + c] = LD(qb + i * D + 8 * c) * scale;                                    \
                acc[i * nd + c] = (v8){0};                                                          \
            }                                                                                       \
        for (int64_t j = 0; j < L; j++) {                                                           \
            const T* row = k + tables[b * tab_stride + j / bs] * blk_stride + ((j % bs) * Hkv + h0) * D; \
            for (int64_t h = 0; h < hpt; h++) {                                                     \
                v8 dot[MAX_GROUP] = {{0}};                                                          \
                const v8* qh = qv + h * grp * nd;                                                   \
                for (int64_t c = 0; c < nd; c++) {                                                  \
                    v8 kc = LD(row + h * D + 8 * c);                                                \
                    for (int64_t i = 0; i < grp; i++) dot[i] = fma8(qh[i * nd + c], kc, dot[i]);    \
                }                                                                                   \
                for (int64_t i = 0; i < grp; i++) s[(h * grp + i) * L + j] = hsum(dot[i]);          \
            }                                                                                       \
        }                                                                                           \
        for (int64_t i = 0; i < nq; i++) softmax_row(s + i * L, L);                                 \
        for (int64_t j = 0; j < L; j++) {                                                           \
            const T* row = v + tables[b * tab_stride + j / bs] * blk_stride + ((j % bs) * Hkv + h0) * D; \
            for (int64_t h = 0; h < hpt; h++)                                                       \
                for (int64_t c = 0; c < nd; c++) {                                                  \
                    v8 vc = LD(row + h * D + 8 * c);                                                \
                    for (int64_t i = h * grp; i < (h + 1) * grp; i++)                               \
                        acc[i * nd + c] = fma8((v8){0} + s[i * L + j], vc, acc[i * nd + c]);        \
                }                                                                                   \
        }                                                                                           \
        T* ob = out + (b * Hq + h0 * grp) * D;                                                      \
        for (int64_t i = 0; i < nq; i++)                                                            \
            for (int64_t c = 0; c < nd; c++)                                                        \
                for (int d = 0; d < 8; d++) ob[i * D + 8 * c + d] = STORE(acc[i * nd + c][d]);      \
        free(qv);                                                                                   \
    }                                                                                               \
}

DECODE_KERNEL(decode_attention_f32, float, ld_f32, IDENT)
DECODE_KERNEL(decode_attention_bf16, uint16_t, ld_bf16, f2bf)
"""

_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    lib = ckernel.load("paged_decode", _SOURCE, "decode attention gathers KV for SDPA")
    if lib is None:
        return None
    i64, p, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for fn in (lib.decode_attention_f32, lib.decode_attention_bf16):
        fn.argtypes = [p, i64, p, p, i64, p, i64, p, i64, i64, i64, i64, i64, f32, i64, p]
        fn.restype = None
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel serves CPU float32/bfloat16 with the cache's dtype, a dense head layout, a head
    size that is a multiple of 8 and at most 16 query heads per KV head."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and kv_cache.dtype == q.dtype
            and kv_cache.is_contiguous() and q.shape[-1] % 8 == 0 and q.shape[-2] <= 16 * kv_cache.shape[-2]
            and available())


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, per_sequence: bool | None = None) -> torch.Tensor:
    """One query row per sequence: q `[G, Hq, D]`, cache `[2, nb, bs, Hkv, D]`, block_tables
    `[G, nblk]` int64, seq_lens `[G]` int64 -> `[G, Hq, D]`."""
    g, hq, d = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    lib = _load()
    if lib is None:
        raise RuntimeError("The in-place decode attention kernel is not available on this machine.")
    out = q.new_empty(g, hq, d)
    # a task per sequence reads each key row once; with fewer than two sequences per thread, a
    # task per (sequence, KV head) keeps every thread busy (the two give identical results)
    per_seq = g >= 2 * torch.get_num_threads() if per_sequence is None else per_sequence
    fn = lib.decode_attention_f32 if q.dtype == torch.float32 else lib.decode_attention_bf16
    fn(q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), bs * hkv * d,
       tables.data_ptr(), tables.stride(0), lens.data_ptr(), g, hq, hkv, d, bs, scale, hkv if per_seq else 1,
       out.data_ptr())
    return out
