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

#include "quant.h"
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
/* Decode steps (1-2 rows) read more panels per tile: more streams in flight and fewer broadcasts
   and scalar work per weight byte (AVX-512, one thread, M=1: 4 panels 1.15-1.2x the GB/s of 2,
   8 panels another 1.05x). NVW bounds the accumulator arrays. */
#if QUANT_WIDE
#define NV1 8
#define NV2 4
#else
#define NV1 2
#define NV2 2
#endif
#define NVW NV1

typedef struct { const int8_t* q; const float* d; const int32_t* s; int64_t K; } act_t;

const char* quant_isa(void) { return QUANT_ISA; }

/* ---- activations ------------------------------------------------------------------------------ */
/* One row of x (float32, or bfloat16 when x_bf16) -> q [K] int8, d [K/32] scales (max|x| / 127),
   s [K/16] sums of the codes; a row alone, so its codes never depend on the batch. */
static void quantize_row(const void* x, int x_bf16, int64_t K, int8_t* q, float* d, int32_t* s) {
    for (int64_t c = 0; c < K / CHUNK; c++) {
        pvf a, b;
        if (x_bf16) {
            a = pvf_bf16((const uint16_t*)x + c * CHUNK);
            b = pvf_bf16((const uint16_t*)x + c * CHUNK + 16);
        } else {
            a = pvf_load((const float*)x + c * CHUNK);
            b = pvf_load((const float*)x + c * CHUNK + 16);
        }
        float amax = pvf_absmax(a), bmax = pvf_absmax(b);
        amax = bmax > amax ? bmax : amax;
        pvf inverse = pvf_set(amax > 0 ? 127.f / amax : 0.f);
        d[c] = amax / 127.f;
        s[2 * c] = pvf_round_i8(pvf_mul(a, inverse), q + c * CHUNK);
        s[2 * c + 1] = pvf_round_i8(pvf_mul(b, inverse), q + c * CHUNK + 16);
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
INLINE void fast_tile(const int qt, const int MB, const int NVT, const act_t* x, int64_t m0, const uint8_t* w,
                      int64_t pstride, pvf acc[MBMAX][NVW]) {
    const int64_t K = x->K, C = K / CHUNK;
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NVT; j++) acc[m][j] = pvf_zero();
    for (int64_t c = 0; c < C; c++) {
        pvf dw[NVW], mw[NVW], dw2[NVW];
        const uint8_t* codes[NVW];
        for (int j = 0; j < NVT; j++) {
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
        pvi isum[MBMAX][NVW];
        for (int m = 0; m < MB; m++)
            for (int j = 0; j < NVT; j++) isum[m][j] = pvi_zero();
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            pvi op[NVW];
            for (int j = 0; j < NVT; j++) op[j] = chunk_operand(qt, codes[j], g);
            for (int m = 0; m < MB; m++) {
                pvi xb = pvi_set32(load4(x->q + (m0 + m) * K + c * CHUNK + 4 * g));
                for (int j = 0; j < NVT; j++) isum[m][j] = dot(qt, isum[m][j], op[j], xb);
            }
            if (qt == Q6_K && g == 3) {       /* Q6_K: a scale per 16: the first half ends here */
                for (int m = 0; m < MB; m++)
                    for (int j = 0; j < NVT; j++) {
                        pvf f = pvi_float(pvi_sub32(isum[m][j], pvi_set32(32 * s0[m])));
                        acc[m][j] = pvf_fma(f, pvf_mul(dw[j], pvf_set(dx[m])), acc[m][j]);
                        isum[m][j] = pvi_zero();
                    }
            }
        }
        for (int m = 0; m < MB; m++)
            for (int j = 0; j < NVT; j++) {
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
                       int64_t K, pvf acc[MBMAX][NVW]) {
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

INLINE void store_tile(const int MB, const int NVT, pvf acc[MBMAX][NVW], const out_t* o, int64_t m0, int64_t n0) {
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < NVT; j++) {
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

#define FAST(QT, MB, NVT)                                                                         \
static void fast_##QT##_##MB##x##NVT(const act_t* x, int64_t m0, const uint8_t* w, int64_t pstride, \
                                     const out_t* o, int64_t n0) {                                \
    pvf acc[MBMAX][NVW];                                                                          \
    fast_tile(QT, MB, NVT, x, m0, w, pstride, acc);                                               \
    store_tile(MB, NVT, acc, o, m0, n0);                                                          \
}
#define EXACT(MB)                                                                                 \
static void exact_##MB(const float* x, int64_t ldx, int64_t m0, const float* wf, int64_t K,        \
                       const out_t* o, int64_t n0) {                                              \
    pvf acc[MBMAX][NVW];                                                                          \
    exact_tile(MB, x, ldx, m0, wf, K, acc);                                                       \
    store_tile(MB, NV, acc, o, m0, n0);                                                           \
}
/* per type: tiles of 1..MBMAX rows x NV panels, then 1 row x NV1 and 2 rows x NV2 panels */
#if QUANT_WIDE
#define TILES(T, QT) T(QT, 1, 2) T(QT, 2, 2) T(QT, 3, 2) T(QT, 4, 2) T(QT, 5, 2) T(QT, 6, 2) T(QT, 1, 8) T(QT, 2, 4)
#define TABLE(P) {0, P##1x2, P##2x2, P##3x2, P##4x2, P##5x2, P##6x2, P##1x8, P##2x4}
#define EXACT_TABLE {0, exact_1, exact_2, exact_3, exact_4, exact_5, exact_6}
EXACT(1) EXACT(2) EXACT(3) EXACT(4) EXACT(5) EXACT(6)
#else
#define TILES(T, QT) T(QT, 1, 1) T(QT, 2, 1) T(QT, 3, 1) T(QT, 4, 1) T(QT, 1, 2) T(QT, 2, 2)
#define TABLE(P) {0, P##1x1, P##2x1, P##3x1, P##4x1, P##1x2, P##2x2}
#define EXACT_TABLE {0, exact_1, exact_2, exact_3, exact_4}
EXACT(1) EXACT(2) EXACT(3) EXACT(4)
#endif
TILES(FAST, Q4_0) TILES(FAST, Q4_1) TILES(FAST, Q5_0) TILES(FAST, Q5_1)
TILES(FAST, Q8_0) TILES(FAST, Q4_K) TILES(FAST, Q5_K) TILES(FAST, Q6_K)

static const fast_fn* fast_table(int qt);
int quant_supported(int qt) { return fast_table(qt) != 0; }

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

/* A linear call multiplies x by up to MAX_SEGMENTS matrices side by side (fused projections whose
   parts are stored in different types), each writing its own columns of y. */
#define MAX_SEGMENTS QUANT_MAX_SEGMENTS
typedef struct {
    int qt;
    const fast_fn* table;
    const uint8_t* w;
    int64_t pstride, panels, first;      /* first: index of the segment's first task */
    out_t o;
} seg_t;

/* Tasks: (a group of G panels of one segment, a run of up to `rows` rows), panel-major so that a
   thread's panels stay in cache while its rows pass; a segment's last group may be narrower.
   Inside a parallel region; BODY sees sg (the segment), p0 (its first panel), r0 .. r1 (rows). */
#define FOR_TASKS(segs, S, M, G, BODY)                                                            \
    int64_t rows_ = (M) <= 96 ? (M) : 48, runs_ = ((M) + rows_ - 1) / rows_;                      \
    int64_t total_ = segs[S - 1].first + (segs[S - 1].panels + (G) - 1) / (G) * runs_;            \
    _Pragma("omp for schedule(static)")                                                          \
    for (int64_t t_ = 0; t_ < total_; t_++) {                                                     \
        int s_ = S - 1;                                                                           \
        while (segs[s_].first > t_) s_--;                                                         \
        const seg_t* sg = &segs[s_];                                                              \
        int64_t p0 = ((t_ - sg->first) / runs_) * (G), r0 = ((t_ - sg->first) % runs_) * rows_;    \
        int64_t r1 = r0 + rows_ < (M) ? r0 + rows_ : (M);                                         \
        BODY                                                                                      \
    }

/* table[mb]: mb <= MBMAX rows x NV panels; table[MBMAX + 1]: 1 row x NV1; table[MBMAX + 2]: 2 x NV2 */
static void run_fast(const seg_t* segs, int S, const void* x, int x_bf16, int64_t ldx, int64_t M, int64_t K,
                     int64_t width, char* work) {
    int8_t* xq = (int8_t*)work;
    float* xd = (float*)(work + M * K);
    int32_t* xs = (int32_t*)(xd + M * (K / CHUNK));
    act_t a = {xq, xd, xs, K};
    int64_t esize = x_bf16 ? 2 : 4;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row((const char*)x + m * ldx * esize, x_bf16, K, xq + m * K, xd + m * (K / CHUNK),
                         xs + m * (K / 16));
        FOR_TASKS(segs, S, M, width, {
            for (int64_t m0 = r0; m0 < r1; m0 += MBMAX) {
                int64_t mb = r1 - m0 < MBMAX ? r1 - m0 : MBMAX;
                int64_t end = p0 + width < sg->panels ? p0 + width : sg->panels;
                for (int64_t p = p0; p < end;) {
                    int wide = width > NV && end - p == width;      /* else NV panels at a time */
                    sg->table[wide ? MBMAX + mb : mb](&a, m0, sg->w + p * sg->pstride, sg->pstride, &sg->o,
                                                      p * PANEL);
                    p += wide ? width : NV;
                }
            }
        })
    }
}

static int run_exact(const seg_t* segs, int S, const void* x, int x_bf16, int64_t ldx, int64_t M, int64_t K,
                     char* work) {
    static const exact_fn table[] = EXACT_TABLE;
    const float* xf = x_bf16 ? (const float*)work : (const float*)x;
    int64_t ldf = x_bf16 ? K : ldx;
    int failed = 0;
    #pragma omp parallel
    {
        if (x_bf16) {
            #pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                for (int64_t k = 0; k < K; k += 16)
                    pvf_store((float*)work + m * K + k, pvf_bf16((const uint16_t*)x + m * ldx + k));
        }
        float* wf = (float*)malloc((size_t)(NV * K * PANEL) * sizeof(float));
        if (!wf) {
            #pragma omp atomic write
            failed = 1;
        }
        FOR_TASKS(segs, S, M, NV, {
            if (!wf) continue;
            for (int64_t j = 0; j < NV; j++)
                dequant_panel(sg->qt, sg->w + (p0 + j) * sg->pstride, K, wf + j * K * PANEL);
            for (int64_t m0 = r0; m0 < r1; m0 += MBMAX) {
                int64_t mb = r1 - m0 < MBMAX ? r1 - m0 : MBMAX;
                table[mb](xf, ldf, m0, wf, K, &sg->o, p0 * PANEL);
            }
        })
        free(wf);
    }
    return failed ? -2 : 0;
}

/* y [M, sum N] (float32 y or bfloat16 ybf, row stride ldy) = x [M, K] (float32, or bfloat16 when
   x_bf16; row stride ldx) @ [W_0; W_1; ...]^T (+ bias float32 [sum N]). W_s: packed panels of GGUF
   type qts[s] (ggml's ids) with ns[s] logical rows (its panels hold ceil(N/32) * 32), writing
   columns from sum of the earlier ns. Fast mode quantizes x per 32 once for all; exact mode
   multiplies float32. Returns 0, -1 for an unknown type or too many segments, -2 out of memory. */
int quant_linear(int S, const int* qts, const uint8_t* const* ws, const int64_t* ns, int exact, const void* x,
                 int x_bf16, int64_t ldx, int64_t M, int64_t K, const float* bias, float* y, uint16_t* ybf,
                 int64_t ldy) {
    if (S < 1 || S > MAX_SEGMENTS) return -1;
    seg_t segs[MAX_SEGMENTS];
    int64_t width = exact ? NV : M == 1 ? NV1 : M == 2 ? NV2 : NV, rows = M <= 96 ? M : 48;
    int64_t runs = (M + rows - 1) / rows, column = 0, first = 0;
    for (int s = 0; s < S; s++) {
        const fast_fn* table = fast_table(qts[s]);
        if (!table) return -1;
        int64_t panels = (ns[s] + 2 * PANEL - 1) / (2 * PANEL) * 2;
        out_t o = {y ? y + column : 0, ybf ? ybf + column : 0, ldy, ns[s], bias ? bias + column : 0};
        segs[s] = (seg_t){qts[s], table, ws[s], panel_bytes(qts[s], K), panels, first, o};
        first += (panels + width - 1) / width * runs;
        column += ns[s];
    }
    size_t per_row = exact ? (x_bf16 ? (size_t)K * 4 : 0) : (size_t)(K + K / CHUNK * 4 + K / 16 * 4);
    char* work = per_row ? (char*)malloc((size_t)M * per_row) : 0;
    if (per_row && !work) return -2;
    int status = 0;
    if (exact)
        status = run_exact(segs, S, x, x_bf16, ldx, M, K, work);
    else
        run_fast(segs, S, x, x_bf16, ldx, M, K, width, work);
    free(work);
    return status;
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
