/* The tiles of quant.c: MB rows of activations against NV panels (16 outputs each), one 32-chunk
   of K at a time. Every tile, whatever its shape and wherever its weight operands come from,
   runs `chunk_step` per chunk: each output's arithmetic is the same sequence of operations, so a
   row's result never depends on the tile, the batch or the split (batch invariance).

   Fast tiles come in two kinds: direct ones read codes from the panels as they go (decode steps:
   one or two rows against 8 or 4 panels, more streams in flight), blocked ones take a block of
   chunks whose operands and scales were extracted once per task (`chunk_ops_t`) and reused by
   every row tile of it (prefill: the nibble / high-bit unpacking is not repeated per 6 rows). */
#pragma once
#include "quant_layout.h"
#include "quant_simd.h"

#define INLINE static inline __attribute__((always_inline))
/* MB <= MBMAX rows x NV panels; panels come in pairs (quant_pack pads N to a multiple of 32).
   AVX-512 holds 6 x 2 float accumulators plus as many int32 sums in its 32 registers; AVX2
   needs two registers per panel vector. Decode tiles: 1 row x NV1 and 2 rows x NV2 panels, more
   weight streams in flight (one thread, M=1, AVX-512: 4 panels read 1.15-1.2x the GB/s of 2, 8
   panels another 1.05x; AVX2: 8 panels 1.2-1.5x the GB/s of 2, and 2 rows x 4 panels 1.2-1.35x
   2 x 2; their accumulators spill to L1 and still win). */
#if QUANT_WIDE
#define MBMAX 6
#define NV 2
#else
#define MBMAX 4
#define NV 1
#endif
#if QUANT_WIDE || QUANT_YMM
#define NV1 8
#define NV2 4
#else                     /* portable C: its speed is not the point, its build time is */
#define NV1 2
#define NV2 2
#endif
#define NVW NV1           /* bounds the accumulator arrays */
/* rows of an exact direct tile: float accumulators only (no integer sums), so AVX-512's 32
   registers hold 10 x 2 (9 rows, a verify step of 8 drafts, in one tile) */
#if QUANT_WIDE
#define XMB 10
#else
#define XMB MBMAX
#endif
#define KB 8              /* chunks per block of a blocked tile (one K-quant super-block) */
#define ROWS_PER_RUN 48   /* rows of a task (its accumulators stay in L1 between blocks) */

typedef struct { const int8_t* q; const float* d; const int32_t* s; int64_t K; } act_t;
/* one chunk's weight side for NV panels: the 8 operands (16 columns x 4 k each) and the scales */
typedef struct { pvi op[8][NV]; pvf dw[NV], mw[NV], dw2[NV]; } chunk_ops_t;
typedef struct { float* y; uint16_t* ybf; int64_t ldy, N; const float* bias; } out_t;

#ifdef QUANT_VNNI
#define Q8_OFFSET 128     /* Q8_0 codes stay unsigned (q + 128) for vpdpbusd; 128 * sum(x) comes off */
#else
#define Q8_OFFSET 0       /* maddubs would saturate on 255 * 127 * 2: signed codes, sign trick */
#endif

INLINE int offset(int qt) {
    return qt == Q4_0 ? 8 : qt == Q5_0 ? 16 : qt == Q6_K ? 32 : qt == Q8_0 ? Q8_OFFSET : qt == MXFP4 ? 12 : 0;
}

INLINE pvi dot(int qt, pvi acc, pvi w, pvi x) {
#ifndef QUANT_VNNI
    if (qt == Q8_0) return dot4s(acc, pvi_xor(w, pvi_byte(0x80)), x);
#endif
    return dot4(acc, w, x);
}

INLINE int32_t load4(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return v; }

/* acc [MB][NVT] += rows m0.. of x times chunk c of NVT panels: operands op(g, j) of group g, scales
   dw/mw/dw2 (see chunk_scales). The one place the fast arithmetic is written. */
#define CHUNK_STEP(qt, MB, NVT, x, m0, c, OPERAND, dw, mw, dw2, acc)                                 \
    do {                                                                                          \
        const int64_t K_ = (x)->K, C_ = K_ / CHUNK;                                               \
        float dx[MBMAX];                                                                          \
        int32_t s0[MBMAX], s1[MBMAX];                                                             \
        for (int m = 0; m < MB; m++) {                                                            \
            dx[m] = (x)->d[((m0) + m) * C_ + (c)];                                                \
            s0[m] = (x)->s[((m0) + m) * 2 * C_ + 2 * (c)];                                        \
            s1[m] = (x)->s[((m0) + m) * 2 * C_ + 2 * (c) + 1];                                    \
        }                                                                                         \
        pvi isum[MBMAX][NVW];                                                                     \
        for (int m = 0; m < MB; m++)                                                              \
            for (int j = 0; j < NVT; j++) isum[m][j] = pvi_zero();                                \
        _Pragma("GCC unroll 8")                                                                   \
        for (int g = 0; g < 8; g++) {                                                             \
            pvi op[NVW];                                                                          \
            for (int j = 0; j < NVT; j++) op[j] = OPERAND(g, j);                                  \
            for (int m = 0; m < MB; m++) {                                                        \
                pvi xb = pvi_set32(load4((x)->q + ((m0) + m) * K_ + (c) * CHUNK + 4 * g));        \
                for (int j = 0; j < NVT; j++) isum[m][j] = dot(qt, isum[m][j], op[j], xb);        \
            }                                                                                     \
            if (qt == Q6_K && g == 3)        /* Q6_K: a scale per 16: the first half ends here */ \
                for (int m = 0; m < MB; m++)                                                      \
                    for (int j = 0; j < NVT; j++) {                                               \
                        pvf f = pvi_float(pvi_sub32(isum[m][j], pvi_set32(32 * s0[m])));          \
                        acc[m][j] = pvf_fma(f, pvf_mul((dw)[j], pvf_set(dx[m])), acc[m][j]);      \
                        isum[m][j] = pvi_zero();                                                  \
                    }                                                                             \
        }                                                                                         \
        for (int m = 0; m < MB; m++)                                                              \
            for (int j = 0; j < NVT; j++) {                                                       \
                if (qt == Q6_K) {                                                                 \
                    pvf f = pvi_float(pvi_sub32(isum[m][j], pvi_set32(32 * s1[m])));              \
                    acc[m][j] = pvf_fma(f, pvf_mul((dw2)[j], pvf_set(dx[m])), acc[m][j]);         \
                } else if (has_min(qt) || qt == Q4_K || qt == Q5_K) {                             \
                    pvf f = pvi_float(isum[m][j]);                                                \
                    acc[m][j] = pvf_fma(f, pvf_mul((dw)[j], pvf_set(dx[m])), acc[m][j]);          \
                    pvf xs = pvf_set(dx[m] * (float)(s0[m] + s1[m]));                             \
                    acc[m][j] = has_min(qt) ? pvf_fma((mw)[j], xs, acc[m][j])                     \
                                            : pvf_fnma((mw)[j], xs, acc[m][j]);                   \
                } else {                                                                          \
                    pvf f = pvi_float(pvi_sub32(isum[m][j], pvi_set32(offset(qt) * (s0[m] + s1[m])))); \
                    acc[m][j] = pvf_fma(f, pvf_mul((dw)[j], pvf_set(dx[m])), acc[m][j]);          \
                }                                                                                 \
            }                                                                                     \
    } while (0)

/* Direct tile: acc [MB][NVT] = rows m0.. of x times panels w, w + pstride, ..., all of K */
INLINE void fast_tile(const int qt, const int MB, const int NVT, const act_t* x, int64_t m0, const uint8_t* w,
                      int64_t pstride, pvf acc[MBMAX][NVW]) {
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NVT; j++) acc[m][j] = pvf_zero();
    for (int64_t c = 0; c < x->K / CHUNK; c++) {
        pvf dw[NVW], mw[NVW], dw2[NVW];
        const uint8_t* codes[NVW];
        for (int j = 0; j < NVT; j++) {
            chunk_scales(qt, w + j * pstride, c, &dw[j], &mw[j], &dw2[j]);
            codes[j] = chunk_codes(qt, w + j * pstride, c);
        }
#define DIRECT_OPERAND(g, j) chunk_operand(qt, codes[j], g)
        CHUNK_STEP(qt, MB, NVT, x, m0, c, DIRECT_OPERAND, dw, mw, dw2, acc);
#undef DIRECT_OPERAND
    }
}

/* The weight side of chunks c0 .. c0 + count of NV panels, for blocked tiles */
INLINE void extract_chunks(const int qt, const uint8_t* w, int64_t pstride, int64_t c0, int64_t count,
                           chunk_ops_t* ops) {
    for (int64_t c = c0; c < c0 + count; c++) {
        chunk_ops_t* o = &ops[c - c0];
        for (int j = 0; j < NV; j++) {
            o->mw[j] = o->dw2[j] = pvf_zero();
            chunk_scales(qt, w + j * pstride, c, &o->dw[j], &o->mw[j], &o->dw2[j]);
            const uint8_t* codes = chunk_codes(qt, w + j * pstride, c);
            for (int g = 0; g < 8; g++) o->op[g][j] = chunk_operand(qt, codes, g);
        }
    }
}

/* Blocked tile: acc rows (accumulators in memory, `first`: start from zero) += rows m0.. of x
   times the extracted chunks c0 .. c0 + count */
INLINE void block_tile(const int qt, const int MB, const act_t* x, int64_t m0, int64_t c0, int64_t count,
                       const chunk_ops_t* ops, pvf* rows, int first) {
    pvf acc[MBMAX][NVW];
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = first ? pvf_zero() : rows[m * NV + j];
    for (int64_t c = c0; c < c0 + count; c++) {
        const chunk_ops_t* o = &ops[c - c0];
#define BLOCK_OPERAND(g, j) o->op[g][j]
        CHUNK_STEP(qt, MB, NV, x, m0, c, BLOCK_OPERAND, o->dw, o->mw, o->dw2, acc);
#undef BLOCK_OPERAND
    }
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NV; j++) rows[m * NV + j] = acc[m][j];
}

/* Exact tile: acc [MB][NV] = rows m0.. of float32 x times dequantized panels wf ([NV][K][16]) */
INLINE void exact_tile(const int MB, const float* x, int64_t ldx, int64_t m0, const float* wf, int64_t K,
                       pvf acc[MBMAX][NVW]) {
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = pvf_zero();
    for (int64_t k = 0; k < K; k++) {
        pvf wv[NV];
        for (int j = 0; j < NV; j++) wv[j] = pvf_load(wf + (j * K + k) * PANEL);
        for (int m = 0; m < MB; m++) {
            pvf xb = pvf_set(x[(m0 + m) * ldx + k]);
            for (int j = 0; j < NV; j++) acc[m][j] = pvf_fma(xb, wv[j], acc[m][j]);
        }
    }
}

/* Group g (4 k) of chunk c of an exact direct tile (`tail`: see code_lanes) */
INLINE void exact_direct_group(const int qt, const int MB, const int NVT, const float* x, int64_t ldx, int64_t m0,
                               const uint8_t* const* codes, const pvf* dw, const pvf* mw, const pvf* dw2, int64_t c,
                               int g, pvf acc[XMB][NVW], const int tail) {
    pvi op[NVW];
    if (!codes_in_place(qt))
        for (int j = 0; j < NVT; j++) op[j] = chunk_operand(qt, codes[j], g);
    for (int i = 0; i < 4; i++) {
        pvf wv[NVW];
        for (int j = 0; j < NVT; j++) {      /* code_value, the codes read in place where they can be */
            pvi lanes = codes_in_place(qt) ? code_lanes(qt, codes[j], g, i, tail) : pvi_srl32(op[j], 8 * i);
            int bits = codes_in_place(qt) ? code_bits(qt) : operand_bits(qt);
            wv[j] = scaled_value(qt, pvf_code(lanes, bits, code_offset(qt)), g, dw[j], mw[j], dw2[j]);
        }
        for (int m = 0; m < MB; m++) {
            pvf xb = pvf_set(x[(m0 + m) * ldx + c * CHUNK + 4 * g + i]);
            for (int j = 0; j < NVT; j++) acc[m][j] = pvf_fma(xb, wv[j], acc[m][j]);
        }
    }
}

/* Chunk c of an exact direct tile (`tail`: see code_lanes) */
INLINE void exact_direct_chunk(const int qt, const int MB, const int NVT, const float* x, int64_t ldx, int64_t m0,
                               const uint8_t* w, int64_t pstride, int64_t c, pvf acc[XMB][NVW], const int tail) {
    pvf dw[NVW], mw[NVW], dw2[NVW];
    const uint8_t* codes[NVW];
    for (int j = 0; j < NVT; j++) {
        mw[j] = dw2[j] = pvf_zero();
        chunk_scales(qt, w + j * pstride, c, &dw[j], &mw[j], &dw2[j]);
        codes[j] = chunk_codes(qt, w + j * pstride, c);
    }
    if (MB > 2) {     /* many rows: unrolled, 3-13% faster here but two minutes more to build */
        _Pragma("GCC unroll 1")
        for (int g = 0; g < 8; g++) exact_direct_group(qt, MB, NVT, x, ldx, m0, codes, dw, mw, dw2, c, g, acc, tail);
        return;
    }
#if QUANT_WIDE                          /* AVX2's 16 registers do better with the loop */
    _Pragma("GCC unroll 8")
#endif
    for (int g = 0; g < 8; g++) exact_direct_group(qt, MB, NVT, x, ldx, m0, codes, dw, mw, dw2, c, g, acc, tail);
}

/* Exact direct tile (decode): acc [MB][NVT] = rows m0.. of float32 x times panels w, w + pstride,
   ..., dequantized in registers: the same values and the same fused multiply-adds in k order as
   `exact_tile` over `dequant_chunk`'s output, so either path gives the same bits. A panel's last
   chunk reads nothing past its codes (code_lanes' `tail`). */
INLINE void exact_direct_tile(const int qt, const int MB, const int NVT, const float* x, int64_t ldx, int64_t m0,
                              const uint8_t* w, int64_t pstride, int64_t K, pvf acc[XMB][NVW]) {
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NVT; j++) acc[m][j] = pvf_zero();
    int64_t C = K / CHUNK;
    for (int64_t c = 0; c < C - 1; c++) exact_direct_chunk(qt, MB, NVT, x, ldx, m0, w, pstride, c, acc, 0);
    exact_direct_chunk(qt, MB, NVT, x, ldx, m0, w, pstride, C - 1, acc, 1);
}

/* Outputs of a tile (+ bias) into y: float32, or bfloat16 rounded once; padding panels skipped */
INLINE void store_tile(const int MB, const int NVT, const pvf* acc, int64_t stride, const out_t* o, int64_t m0,
                       int64_t n0) {
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NVT; j++) {
            int64_t n = n0 + j * PANEL, count = o->N - n < PANEL ? o->N - n : PANEL;
            if (count <= 0) continue;
            pvf v = acc[m * stride + j];
            if (o->bias) {
                float b[PANEL] = {0};
                memcpy(b, o->bias + n, count * sizeof(float));
                v = pvf_add(v, pvf_load(b));
            }
            if (o->ybf) {
                pvf_store_bf16(o->ybf + (m0 + m) * o->ldy + n, v, (int)count);
            } else if (count == PANEL) {
                pvf_store(o->y + (m0 + m) * o->ldy + n, v);
            } else {
                float t[PANEL];
                pvf_store(t, v);
                memcpy(o->y + (m0 + m) * o->ldy + n, t, count * sizeof(float));
            }
        }
}
