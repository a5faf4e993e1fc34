/* Linear layers: y = x @ w^T (+ b), float32 and bfloat16.

   small_linear_*: weights in the checkpoint layout, for steps of few rows (each weight row read
   once for all the rows while it is in registers); portable (8-lane vectors), and bf16 pairs on
   AVX512-BF16 (small_linear_bf16dp).
   packed_linear_*: weights reordered once at load into panels of output columns (one stream per
   panel, no horizontal sums, any N): float32 on AVX-512 (16 lanes), AVX2 + FMA (8 lanes) or
   portable vectors (8 lanes, multiply then add), bfloat16 as pairs on AVX512-BF16, else widened
   into the float32 tiles. Every build has them, so every build gives a row the same bits in any
   batch and a weight's shards the whole weight's bits.
   Callers check shapes, dtypes and strides (kernels/gemm.py); these functions trust them. */
#include <string.h>

#include "gemm.h"
#include "vec.h"
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
#if defined(__AVX512F__)
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
#else
/* portable: 8-lane vectors of the compiler's own; a multiply and an add (two roundings) where
   the build has no FMA, in the tiles and their tails alike */
#define FLANES 8
typedef v8 fvec;
#define FLOAD ld_f32
#define FSTORE(p, v) (*(v8u*)(p) = (v))
#define FZERO() ((v8){0})
#define FSET1(s) ((v8){s, s, s, s, s, s, s, s})
#define FFMA fma8
#define FADD(a, b) ((a) + (b))
#ifdef __FMA__
#define SFMA(a, b, c) __builtin_fmaf(a, b, c)
#else
#define SFMA(a, b, c) ((a) * (b) + (c))       /* never contracted (-std=c11), as fma8 */
#endif
#endif
#ifndef SFMA
#define SFMA(a, b, c) __builtin_fmaf(a, b, c)   /* a vector lane's fused multiply-add, one output */
#endif
#ifdef FLANES
#define FPANEL (2 * FLANES)
int packed_f32_panel(void) { return FPANEL; }
/* bf16 widened exactly to float32: a vector of FLANES weights, one activation */
#if FLANES == 16
#define FLOAD_bf16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))
#elif defined(__AVX2__)
#define FLOAD_bf16(p) ((__m256)ld_bf16(p))
#else
#define FLOAD_bf16 ld_bf16
#endif
#define FLOAD_f32 FLOAD
static inline float val_f32(float v) { return v; }
static inline float val_bf16(bf16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
/* A tile of MB rows x NV vectors of FLANES columns, weights WT (float32, or bf16 widened in
   registers), activations of the same type, float32 results into y */
#define FTILE(WT, MB, NV)                                                                       \
static void ftile_##WT##_##MB##x##NV(const WT##_t* x, int64_t ldx, const WT##_t* wp, int64_t K, int64_t pw, \
                                     const float* b, float* y, int64_t ldy) {                   \
    fvec acc[MB][NV];                                                                           \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) acc[m][j] = FZERO();                                       \
    for (int64_t k = 0; k < K; k++) {                                                           \
        fvec wv[NV];                                                                            \
        for (int j = 0; j < NV; j++) wv[j] = FLOAD_##WT(wp + k * pw + FLANES * j);              \
        for (int m = 0; m < MB; m++) {                                                          \
            fvec xb = FSET1(val_##WT(x[m * ldx + k]));                                          \
            for (int j = 0; j < NV; j++) acc[m][j] = FFMA(xb, wv[j], acc[m][j]);                \
        }                                                                                       \
    }                                                                                           \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++)                                                            \
            FSTORE(y + m * ldy + FLANES * j, b ? FADD(acc[m][j], FLOAD(b + FLANES * j)) : acc[m][j]); \
}
/* Columns c0 <= c < pw of a panel (a last panel's tail of fewer than FLANES): the same chain
   per output as a vector lane (a fused multiply-add over k in order, then the bias), so a weight
   of any N gives each output the bits it has in a full panel */
#define FTAIL(WT)                                                                               \
static void ftail_##WT(const WT##_t* x, int64_t ldx, const WT##_t* wp, int64_t K, int64_t pw, int64_t c0, \
                       int64_t mb, const float* b, float* y, int64_t ldy) {                     \
    for (int64_t m = 0; m < mb; m++)                                                            \
        for (int64_t c = c0; c < pw; c++) {                                                     \
            float acc = 0.f;                                                                    \
            for (int64_t k = 0; k < K; k++)                                                     \
                acc = SFMA(val_##WT(x[m * ldx + k]), val_##WT(wp[k * pw + c]), acc);            \
            y[m * ldy + c] = b ? acc + b[c] : acc;                                              \
        }                                                                                       \
}
#define FTILES(WT, MB) FTILE(WT, MB, 1) FTILE(WT, MB, 2)
#define FROW(WT, MB) {0, ftile_##WT##_##MB##x1, ftile_##WT##_##MB##x2}
/* mb rows of one panel pw wide (pw <= FPANEL): its whole vectors by a tile, the rest by FTAIL */
#define FPANEL_RUN(WT)                                                                          \
FTILES(WT, 1) FTILES(WT, 2) FTILES(WT, 3) FTILES(WT, 4) FTILES(WT, 5) FTILES(WT, 6) FTAIL(WT)   \
typedef void (*ftile_##WT##_fn)(const WT##_t*, int64_t, const WT##_t*, int64_t, int64_t, const float*, float*, int64_t); \
static void fpanel_##WT(const WT##_t* x, int64_t ldx, const WT##_t* wp, int64_t K, int64_t pw, int64_t mb, \
                        const float* b, float* y, int64_t ldy) {                                \
    static const ftile_##WT##_fn tiles[7][3] = {{0}, FROW(WT, 1), FROW(WT, 2), FROW(WT, 3), FROW(WT, 4), \
                                                FROW(WT, 5), FROW(WT, 6)};                      \
    int64_t nv = pw / FLANES;                                                                   \
    if (nv) tiles[mb][nv](x, ldx, wp, K, pw, b, y, ldy);                                        \
    if (pw % FLANES) ftail_##WT(x, ldx, wp, K, pw, nv * FLANES, mb, b, y, ldy);                 \
}
FPANEL_RUN(f32)

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ packed w (+ b [N]); any N. Tasks as
   in FOR_PACKED_TILES. */
void packed_linear_f32(const float* x, int64_t ldx, const float* wp, const float* b, float* y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K) {
    FOR_PACKED_TILES(FPANEL, M, N, fpanel_f32(x + m0 * ldx, ldx, wp + n0 * K, K, pw, mb, b ? b + n0 : 0,
                                              y + m0 * ldy + n0, ldy))
}

#ifndef __AVX512BF16__
/* Packed bf16 weights without native bf16 (AVX2, or AVX-512 without BF16): the float32 layout
   and tiles, weights and activations widened exactly in registers, so each output is one fused
   chain over k in order whatever the row count (as the native kernel's is); bf16 output rounded
   to nearest even, or float32 into y32 */
int packed_bf16_panel(void) { return FPANEL; }
int packed_bf16_pair(void) { return 1; }
FPANEL_RUN(bf16)
static void bf16_panel_out(const bf16_t* x, int64_t ldx, const bf16_t* wp, int64_t K, int64_t pw, int64_t mb,
                           const float* b, bf16_t* y, float* y32, int64_t ldy) {
    if (y32) {
        fpanel_bf16(x, ldx, wp, K, pw, mb, b, y32, ldy);
        return;
    }
    float out[6 * FPANEL];
    fpanel_bf16(x, ldx, wp, K, pw, mb, b, out, FPANEL);
    for (int64_t m = 0; m < mb; m++)
        for (int64_t c = 0; c < pw; c++) y[m * ldy + c] = f2bf(out[m * FPANEL + c]);
}

void packed_linear_bf16(const bf16_t* x, int64_t ldx, const bf16_t* wp, const float* b, bf16_t* y,
                        float* y32, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    FOR_PACKED_TILES(FPANEL, M, N, bf16_panel_out(x + m0 * ldx, ldx, wp + n0 * K, K, pw, mb, b ? b + n0 : 0,
                                                  y + m0 * ldy + n0, y32 ? y32 + m0 * ldy + n0 : 0, ldy))
}
#endif
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
int packed_bf16_panel(void) { return PANEL; }
int packed_bf16_pair(void) { return 2; }
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
