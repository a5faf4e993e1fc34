/* Quantized linear layers: y [M, N] = x [M, K] @ W^T for W in GGUF blocks, packed in panels of 16
   rows (the layout is described in quant_pack.py; quant_layout.h navigates it).

   Fast mode: each activation row is quantized once per call to int8 in chunks of 32 (one float
   scale per chunk, code sums per 16), and every chunk of a weight panel is an integer dot product
   with it (4-way u8 x s8 products summed in int32: exact), scaled into a float32 accumulator per
   output: acc += (d_w d_x) * isum, plus the type's offset or minimum term from the code sums.
   Exact mode: each panel is dequantized into float32 (bit-identical to gguf-py's values) and
   multiplied with float32 activations, one fused multiply-add per k in order.

   Work: tasks of (up to NV panels, a run of rows) split across OpenMP threads; each output's
   arithmetic is the same whatever the split or the other rows (batch invariance). */
#include <stdlib.h>

#include "quant_simd.h"
#include "quant_layout.h"

#define INLINE static inline __attribute__((always_inline))
/* Tiles: MB <= MBMAX rows x NV panels of 16 columns; panels come in pairs (quant_pack pads N to
   a multiple of 32), so a tile is never narrower than NV. AVX-512 holds 6 x 2 float accumulators
   plus as many int32 sums in its 32 registers; AVX2 needs two registers per panel vector. */
#if QUANT_WIDE
#define MBMAX 6
#define NV 2
#else
#define MBMAX 4
#define NV 1
#endif

typedef struct { const int8_t* q; const float* d; const int32_t* s; int64_t K; } act_t;

const char* quant_isa(void) { return QUANT_ISA; }

/* ---- activations ------------------------------------------------------------------------------ */
/* Row m of x (float32, or bfloat16 when is_bf16) -> q [K] int8, d [K/32] scales (amax / 127), s [K/16]
   sums of the codes; each row alone, so a row's codes never depend on the batch. */
void quant_activations(const void* x, int is_bf16, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d,
                       int32_t* s) {
    #pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        float row[CHUNK];
        for (int64_t c = 0; c < K / CHUNK; c++) {
            float amax = 0.f;
            for (int i = 0; i < CHUNK; i++) {
                int64_t at = m * ldx + c * CHUNK + i;
                if (is_bf16) {
                    uint32_t bits = (uint32_t)((const uint16_t*)x)[at] << 16;
                    memcpy(&row[i], &bits, 4);
                } else {
                    row[i] = ((const float*)x)[at];
                }
                float a = row[i] < 0 ? -row[i] : row[i];
                amax = a > amax ? a : amax;
            }
            float scale = amax / 127.f, inverse = amax > 0 ? 127.f / amax : 0.f;
            int32_t sums[2] = {0, 0};
            for (int i = 0; i < CHUNK; i++) {
                int32_t v = (int32_t)__builtin_lrintf(row[i] * inverse);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                q[m * K + c * CHUNK + i] = (int8_t)v;
                sums[i / 16] += v;
            }
            d[m * (K / CHUNK) + c] = scale;
            s[m * (K / 16) + 2 * c] = sums[0];
            s[m * (K / 16) + 2 * c + 1] = sums[1];
        }
    }
}

/* ---- fast mode -------------------------------------------------------------------------------- */
#ifdef QUANT_VNNI
#define Q8_OFFSET 128     /* Q8_0 codes stay unsigned (q + 128) for vpdpbusd; 128 * sum(x) comes off */
#else
#define Q8_OFFSET 0       /* maddubs would saturate on 255 * 127 * 2: signed codes, sign trick */
#endif

INLINE int offset(int qt) {
    return qt == Q4_0 ? 8 : qt == Q5_0 ? 16 : qt == Q6_K ? 32 : qt == Q8_0 ? Q8_OFFSET : 0;
}

INLINE pvi dot(int qt, pvi acc, pvi w, pvi x) {
#ifndef QUANT_VNNI
    if (qt == Q8_0) return dot4s(acc, pvi_xor(w, pvi_byte(0x80)), x);
#endif
    return dot4(acc, w, x);
}

INLINE int32_t load4(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return v; }

/* acc [MB][NV] (+)= rows m0.. of x times panels w, w + pstride, ...: one tile, K in order */
INLINE void fast_tile(const int qt, const int MB, const act_t* x, int64_t m0, const uint8_t* w,
                      int64_t pstride, pvf acc[MBMAX][NV]) {
    const int64_t K = x->K, C = K / CHUNK;
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = pvf_zero();
    for (int64_t c = 0; c < C; c++) {
        pvf dw[NV], mw[NV], dw2[NV];
        const uint8_t* codes[NV];
        for (int j = 0; j < NV; j++) {
            chunk_scales(qt, w + j * pstride, c, &dw[j], &mw[j], &dw2[j]);
            codes[j] = chunk_codes(qt, w + j * pstride, c);
        }
        float dx[MBMAX];
        int32_t s0[MBMAX], s1[MBMAX];
        for (int m = 0; m < MB; m++) {
            dx[m] = x->d[(m0 + m) * C + c];
            s0[m] = x->s[(m0 + m) * 2 * C + 2 * c];
            s1[m] = x->s[(m0 + m) * 2 * C + 2 * c + 1];
        }
        pvi isum[MBMAX][NV];
        for (int m = 0; m < MB; m++)
            for (int j = 0; j < NV; j++) isum[m][j] = pvi_zero();
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            pvi op[NV];
            for (int j = 0; j < NV; j++) op[j] = chunk_operand(qt, codes[j], g);
            for (int m = 0; m < MB; m++) {
                pvi xb = pvi_set32(load4(x->q + (m0 + m) * K + c * CHUNK + 4 * g));
                for (int j = 0; j < NV; j++) isum[m][j] = dot(qt, isum[m][j], op[j], xb);
            }
            if (qt == Q6_K && g == 3) {       /* Q6_K: a scale per 16: the first half ends here */
                for (int m = 0; m < MB; m++)
                    for (int j = 0; j < NV; j++) {
                        pvf f = pvi_float(pvi_sub32(isum[m][j], pvi_set32(32 * s0[m])));
                        acc[m][j] = pvf_fma(f, pvf_mul(dw[j], pvf_set(dx[m])), acc[m][j]);
                        isum[m][j] = pvi_zero();
                    }
            }
        }
        for (int m = 0; m < MB; m++)
            for (int j = 0; j < NV; j++) {
                if (qt == Q6_K) {
                    pvf f = pvi_float(pvi_sub32(isum[m][j], pvi_set32(32 * s1[m])));
                    acc[m][j] = pvf_fma(f, pvf_mul(dw2[j], pvf_set(dx[m])), acc[m][j]);
                } else if (has_min(qt) || qt == Q4_K || qt == Q5_K) {
                    pvf f = pvi_float(isum[m][j]);
                    acc[m][j] = pvf_fma(f, pvf_mul(dw[j], pvf_set(dx[m])), acc[m][j]);
                    pvf xs = pvf_set(dx[m] * (float)(s0[m] + s1[m]));
                    acc[m][j] = has_min(qt) ? pvf_fma(mw[j], xs, acc[m][j]) : pvf_fnma(mw[j], xs, acc[m][j]);
                } else {
                    pvf f = pvi_float(pvi_sub32(isum[m][j], pvi_set32(offset(qt) * (s0[m] + s1[m]))));
                    acc[m][j] = pvf_fma(f, pvf_mul(dw[j], pvf_set(dx[m])), acc[m][j]);
                }
            }
    }
}

/* ---- exact mode ------------------------------------------------------------------------------- */
/* Panel -> float32 [K][16] (bit-identical to gguf-py's dequantized values) */
static void dequant_panel(int qt, const uint8_t* panel, int64_t K, float* out) {
    for (int64_t c = 0; c < K / CHUNK; c++) dequant_chunk(qt, panel, c, out + c * CHUNK * PANEL);
}

INLINE void exact_tile(const int MB, const float* x, int64_t ldx, int64_t m0, const float* wf,
                       int64_t K, pvf acc[MBMAX][NV]) {
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

/* ---- drivers ---------------------------------------------------------------------------------- */
typedef struct {
    float* y; uint16_t* ybf; int64_t ldy, N; const float* bias;
} out_t;

INLINE void store_tile(const int MB, pvf acc[MBMAX][NV], const out_t* o, int64_t m0, int64_t n0) {
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NV; j++) {
            int64_t n = n0 + j * PANEL, count = o->N - n < PANEL ? o->N - n : PANEL;
            if (count <= 0) continue;                    /* a padding panel */
            pvf v = acc[m][j];
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

typedef void (*fast_fn)(const act_t*, int64_t, const uint8_t*, int64_t, const out_t*, int64_t);
typedef void (*exact_fn)(const float*, int64_t, int64_t, const float*, int64_t, const out_t*, int64_t);

#define FAST(QT, MB)                                                                              \
static void fast_##QT##_##MB(const act_t* x, int64_t m0, const uint8_t* w, int64_t pstride,         \
                             const out_t* o, int64_t n0) {                                        \
    pvf acc[MBMAX][NV];                                                                           \
    fast_tile(QT, MB, x, m0, w, pstride, acc);                                                    \
    store_tile(MB, acc, o, m0, n0);                                                               \
}
#define EXACT(MB)                                                                                 \
static void exact_##MB(const float* x, int64_t ldx, int64_t m0, const float* wf, int64_t K,        \
                       const out_t* o, int64_t n0) {                                              \
    pvf acc[MBMAX][NV];                                                                           \
    exact_tile(MB, x, ldx, m0, wf, K, acc);                                                       \
    store_tile(MB, acc, o, m0, n0);                                                               \
}
#if QUANT_WIDE
#define TILES(T, ...) T(__VA_ARGS__, 1) T(__VA_ARGS__, 2) T(__VA_ARGS__, 3) T(__VA_ARGS__, 4) \
                      T(__VA_ARGS__, 5) T(__VA_ARGS__, 6)
#define TABLE(P) {0, P##1, P##2, P##3, P##4, P##5, P##6}
#else
#define TILES(T, ...) T(__VA_ARGS__, 1) T(__VA_ARGS__, 2) T(__VA_ARGS__, 3) T(__VA_ARGS__, 4)
#define TABLE(P) {0, P##1, P##2, P##3, P##4}
#endif
#define EXACT1(_, MB) EXACT(MB)
TILES(FAST, Q4_0) TILES(FAST, Q4_1) TILES(FAST, Q5_0) TILES(FAST, Q5_1)
TILES(FAST, Q8_0) TILES(FAST, Q4_K) TILES(FAST, Q5_K) TILES(FAST, Q6_K)
TILES(EXACT1, 0)

static const fast_fn* fast_table(int qt) {
    static const fast_fn q4_0[] = TABLE(fast_Q4_0_), q4_1[] = TABLE(fast_Q4_1_), q5_0[] = TABLE(fast_Q5_0_),
        q5_1[] = TABLE(fast_Q5_1_), q8_0[] = TABLE(fast_Q8_0_), q4_k[] = TABLE(fast_Q4_K_),
        q5_k[] = TABLE(fast_Q5_K_), q6_k[] = TABLE(fast_Q6_K_);
    switch (qt) {
        case Q4_0: return q4_0;
        case Q4_1: return q4_1;
        case Q5_0: return q5_0;
        case Q5_1: return q5_1;
        case Q8_0: return q8_0;
        case Q4_K: return q4_k;
        case Q5_K: return q5_k;
        case Q6_K: return q6_k;
        default: return 0;
    }
}

/* Tasks: (NV panels, a run of up to `rows` rows), panel-major so that a thread's panels stay in
   cache while its rows pass. */
#define FOR_TASKS(M, P, BODY)                                                                     \
    int64_t groups_ = (P) / NV, rows_ = (M) <= 96 ? (M) : 48, runs_ = ((M) + rows_ - 1) / rows_;   \
    _Pragma("omp parallel for schedule(static)")                                                 \
    for (int64_t t_ = 0; t_ < groups_ * runs_; t_++) {                                            \
        int64_t p0 = (t_ / runs_) * NV;                                                           \
        int64_t r0 = (t_ % runs_) * rows_, r1 = r0 + rows_ < (M) ? r0 + rows_ : (M);              \
        BODY                                                                                      \
    }

/* y [M, N] (float32 y or bfloat16 ybf, row stride ldy) = activations quantized by
   quant_activations @ W^T (+ bias float32 [N]); w: ceil(N/16) panels. Returns 0, or -1 for an
   unknown type. N is the logical row count; the panels hold ceil(N/32) * 32 rows. */
int quant_linear_fast(int qt, const int8_t* xq, const float* xd, const int32_t* xs, int64_t M, int64_t K,
                      const uint8_t* w, int64_t N, const float* bias, float* y, uint16_t* ybf, int64_t ldy) {
    const fast_fn* table = fast_table(qt);
    if (!table) return -1;
    act_t x = {xq, xd, xs, K};
    out_t o = {y, ybf, ldy, N, bias};
    int64_t pstride = panel_bytes(qt, K), P = (N + 2 * PANEL - 1) / (2 * PANEL) * 2;
    FOR_TASKS(M, P, {
        for (int64_t m0 = r0; m0 < r1; m0 += MBMAX) {
            int64_t mb = r1 - m0 < MBMAX ? r1 - m0 : MBMAX;
            table[mb](&x, m0, w + p0 * pstride, pstride, &o, p0 * PANEL);
        }
    })
    return 0;
}

/* Exact mode: as quant_linear_fast with float32 activations x (row stride ldx). */
int quant_linear_exact(int qt, const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                       const float* bias, float* y, uint16_t* ybf, int64_t ldy) {
    static const exact_fn table[] = TABLE(exact_);
    if (!fast_table(qt)) return -1;
    out_t o = {y, ybf, ldy, N, bias};
    int64_t pstride = panel_bytes(qt, K), P = (N + 2 * PANEL - 1) / (2 * PANEL) * 2;
    FOR_TASKS(M, P, {
        float* wf = (float*)aligned_alloc(64, (size_t)(NV * K * PANEL) * sizeof(float));
        for (int64_t j = 0; j < NV; j++) dequant_panel(qt, w + (p0 + j) * pstride, K, wf + j * K * PANEL);
        for (int64_t m0 = r0; m0 < r1; m0 += MBMAX) {
            int64_t mb = r1 - m0 < MBMAX ? r1 - m0 : MBMAX;
            table[mb](x, ldx, m0, wf, K, &o, p0 * PANEL);
        }
        free(wf);
    })
    return 0;
}

/* Rows ids [R] of the matrix -> out [R, K] float32 (or bfloat16 into outbf): embedding lookups.
   Ids are checked by the caller. */
int quant_dequant_rows(int qt, const uint8_t* w, int64_t K, const int64_t* ids, int64_t R, float* out,
                       uint16_t* outbf) {
    if (!fast_table(qt)) return -1;
    int64_t pstride = panel_bytes(qt, K);
    #pragma omp parallel for schedule(static) if (R > 8)
    for (int64_t r = 0; r < R; r++) {
        float chunk[CHUNK * PANEL];
        const uint8_t* panel = w + (ids[r] / PANEL) * pstride;
        int64_t col = ids[r] % PANEL;
        for (int64_t c = 0; c < K / CHUNK; c++) {
            dequant_chunk(qt, panel, c, chunk);
            for (int i = 0; i < CHUNK; i++) {
                float v = chunk[i * PANEL + col];
                if (outbf) outbf[r * K + c * CHUNK + i] = bf16_round(v);
                else out[r * K + c * CHUNK + i] = v;
            }
        }
    }
    return 0;
}
