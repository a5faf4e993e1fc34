/* Attention: decode rows against the paged KV cache in place, and the causal prefill of fresh prompts.

   decode_attention_*: one query row per sequence, keys and values read through its block table
   (8-lane vectors; 16 lanes on AVX-512 where the head size allows). It checks the block tables
   against the pool and the lengths against the tables before reading anything. The *_q8_0 and
   *_q4_0 variants read a cache of llama.cpp's blocks, dequantizing each tile as it is widened.
   prefill_attention_bf16: bf16 on AVX512-BF16 only (absent elsewhere).
   Callers check shapes, dtypes and strides (kernels/attention.py). Tasks split over the stage's
   kernel team (team.h; OpenMP where there is none). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "kv_blocks.h"
#include "team.h"
#include "vec.h"

SW_TEAM_CLIENT(attention)

/* threads a call reading `bytes` of keys and values is worth (the team caps it at its size) */
static int threads_for(int64_t bytes) {
    int64_t want = 1 + bytes / (32 << 10);
    return want > 1024 ? 1024 : (int)want;
}

#define IDENT(x) (x)
typedef int32_t v8i __attribute__((vector_size(32)));
#define CHUNK 8          /* keys scored, and values summed, per pass over a [CHUNK, D] tile */
#define MAX_SPAN 64      /* query rows sharing one task's key tiles, at most */

/* e^x for x <= 0 (scores minus their maximum): x = n ln2 + r, 2^n from the exponent bits and a
   degree-6 polynomial for e^r (Cephes' expf, ~1 ulp); 0 below -87 (under float32's normals).
   VT is a float vector type, VTI the int32 vector of the same width. */
#define EXP_KERNEL(NAME, VT, VTI)                                                                   \
static inline VT NAME(VT x) {                                                                       \
    VT n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;   /* round(x / ln2) */              \
    VT r = (x - n * 0.693359375f) + n * 2.12194440e-4f;                                             \
    VT p = (((((r * 1.9875691500e-4f + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r                \
              + 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * (r * r) + r + 1.f; \
    VTI two_n = (__builtin_convertvector(n, VTI) + 127) << 23;                                      \
    return (VT)((VTI)(p * (VT)two_n) & (x >= -87.f));                                               \
}
EXP_KERNEL(exp8, v8, v8i)

/* [sum(a[0]), ..., sum(a[7])]: a transposing tree of shuffles and adds, in a fixed order */
static inline v8 hsum8x8(const v8* a) {
    v8 s[4], u[2];
    for (int i = 0; i < 4; i++)
        s[i] = __builtin_shufflevector(a[i], a[i + 4], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(a[i], a[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(s[2 * i], s[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 8, 10, 4, 6, 12, 14)
         + __builtin_shufflevector(u[0], u[1], 1, 3, 9, 11, 5, 7, 13, 15);
}

/* softmax of s[0, L) in place, 8 lanes at a time in a fixed order; s[L, Lp) (the last chunk's
   padding) becomes 0 */
static void softmax_row(float* s, int64_t L, int64_t Lp) {
    for (int64_t j = L; j < Lp; j++) s[j] = -INFINITY;
    v8 mv = *(v8*)s, sv = {0};
    for (int64_t j = CHUNK; j < Lp; j += CHUNK) {
        v8 x = *(v8*)(s + j);
        mv = (v8)(((v8i)x & (x > mv)) | ((v8i)mv & ~(x > mv)));
    }
    float m = mv[0];
    for (int t = 1; t < 8; t++) m = mv[t] > m ? mv[t] : m;
    for (int64_t j = 0; j < Lp; j += CHUNK) {
        v8 e = exp8(*(v8*)(s + j) - m);
        *(v8*)(s + j) = e;
        sv += e;
    }
    float sum = hsum(sv), inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t j = 0; j < Lp; j += CHUNK) *(v8*)(s + j) *= inv;
}

/* rp[r]: row j0 + r of the sequence's keys or values ([Hkv, D], all KV heads), for the rows
   below L; the rows AHEAD keys further on are prefetched (a sequence's blocks lie anywhere in the
   cache, and the hardware prefetcher only follows a block once it is being read) */
#define AHEAD 16
#define CHUNK_ROWS(T, base, rp, j0)                                                                 \
    for (int64_t r = 0; r < CHUNK && (j0) + r < L; r++) {                                           \
        int64_t j = (j0) + r, ja = j + AHEAD;                                                       \
        rp[r] = base + tables[b * tab_stride + j / bs] * blk_stride + (j % bs) * Hkv * rl;          \
        if (ja < L) {                                                                               \
            const char* ra = (const char*)(base + tables[b * tab_stride + ja / bs] * blk_stride     \
                                           + ((ja % bs) * Hkv + h0) * rl);                          \
            for (int64_t o = 0; o < (int64_t)(hpt * rl * sizeof(T)); o += 64) __builtin_prefetch(ra + o, 0, 1); \
        }                                                                                           \
    }

/* rows j0 .. j0 + CHUNK of KV head h, widened (or dequantized) to float32 into tile [CHUNK, D];
   rows past L are 0. KLD(row, c): lane vector c of the head row at `row` (rl elements a head). */
#define WIDEN_TILE(VT, KLD, rp, tile, j0)                                                           \
    for (int64_t r = 0; r < CHUNK; r++)                                                             \
        for (int64_t c = 0; c < nd; c++)                                                            \
            tile[r * nd + c] = (j0) + r < L ? KLD(rp[r] + h * rl, c) : (VT){0};

/* 0 if every sequence b < G has 1 <= seq_lens[b] <= nblk * bs keys and the blocks it reads
   (its first ceil(L / bs) table entries) lie in [0, num_blocks); else 1 + the first b that does not.
   Run before any cache read, so a bad table is an error instead of an out-of-bounds read. */
static int64_t check_tables(const int64_t* tables, int64_t tab_stride, const int64_t* seq_lens, int64_t G,
                            int64_t nblk, int64_t num_blocks, int64_t bs) {
    for (int64_t b = 0; b < G; b++) {
        int64_t L = seq_lens[b];
        if (L < 1 || L > nblk * bs) return b + 1;
        for (int64_t i = 0; i < (L + bs - 1) / bs; i++) {
            int64_t id = tables[b * tab_stride + i];
            if (id < 0 || id >= num_blocks) return b + 1;
        }
    }
    return 0;
}

/* 0 if every span sp < S (rows spans[sp] .. spans[sp + 1], increasing, spans[0] = 0, spans[S] =
   G) has rows of 1 <= seq_lens[m] <= nblk * bs keys and the blocks its longest row reads (the first
   ceil(L / bs) entries of table row sp) lie in [0, num_blocks); else 1 + the first span that does not. */
static int64_t check_spans(const int64_t* tables, int64_t tab_stride, const int64_t* seq_lens, int64_t G,
                           const int64_t* spans, int64_t S, int64_t nblk, int64_t num_blocks, int64_t bs) {
    if (S < 1 || spans[0] != 0 || spans[S] != G) return 1;
    for (int64_t sp = 0; sp < S; sp++) {
        int64_t L = 0;
        if (spans[sp + 1] <= spans[sp] || spans[sp + 1] - spans[sp] > MAX_SPAN) return sp + 1;
        for (int64_t m = spans[sp]; m < spans[sp + 1]; m++) {
            if (seq_lens[m] < 1 || seq_lens[m] > nblk * bs) return sp + 1;
            L = seq_lens[m] > L ? seq_lens[m] : L;
        }
        for (int64_t i = 0; i < (L + bs - 1) / bs; i++) {
            int64_t id = tables[sp * tab_stride + i];
            if (id < 0 || id >= num_blocks) return sp + 1;
        }
    }
    return 0;
}

/* One task per span of query rows and run of `hpt` KV heads. A span is up to MAX_SPAN rows that
   read one block table (a decode call: every row its own span; the rows of one prompt chunk
   share their sequence's table); each row has its own length. hpt = Hkv: each key's row of all
   its KV heads, [Hkv, D] contiguous in its block, read once and in order; hpt = 1: a task per
   (span, KV head), for calls too small to keep every thread busy otherwise.
   Keys come in chunks of CHUNK rows aligned to position 0, widened to float32 once per KV head
   and shared by the span's rows; every query head of every row scores the chunk (CHUNK
   independent chains, reduced by one transposing tree), a vectorised softmax per row and query
   head, then the values are summed chunk by chunk with those weights, a row's keys past its own
   length taken as zeros. A row's arithmetic is the same whatever the span, hpt or thread split:
   it depends only on its query, its length and its keys. */
#define DECODE_KERNEL(NAME, T, KT, ROWLEN, KLD, VT, LANES, LD, FMA, FOLD, STORE)                     \
typedef struct {                                                                                    \
    const T* q;                                                                                     \
    const KT *k, *v;                                                                                \
    int64_t q_row, blk_stride, tab_stride;                                                          \
    const int64_t *tables, *seq_lens, *spans;                                                       \
    int64_t Hq, Hkv, D, bs, hpt, grp, nd, runs, nq;                                                 \
    float scale;                                                                                    \
    T* out;                                                                                         \
} NAME##_job;                                                                                       \
static void NAME##_tasks(void* ctx, int64_t t0, int64_t t1) {                                       \
    const NAME##_job* j_ = (const NAME##_job*)ctx;                                                  \
    const T* q = j_->q;                                                                             \
    const KT *k = j_->k, *v = j_->v;                                                                \
    int64_t q_row = j_->q_row, blk_stride = j_->blk_stride, tab_stride = j_->tab_stride;            \
    const int64_t *tables = j_->tables, *seq_lens = j_->seq_lens, *spans = j_->spans;               \
    int64_t Hq = j_->Hq, Hkv = j_->Hkv, D = j_->D, bs = j_->bs, hpt = j_->hpt, grp = j_->grp;      \
    int64_t nd = j_->nd, rl = ROWLEN(D);                                                            \
    int64_t runs = j_->runs, nq = j_->nq;                                                           \
    float scale = j_->scale;                                                                        \
    T* out = j_->out;                                                                               \
    for (int64_t t = t0; t < t1; t++) {                                                             \
        int64_t b = t / runs, h0 = (t % runs) * hpt;          /* b: the span, its table row */      \
        int64_t m0 = spans ? spans[b] : b, nr = spans ? spans[b + 1] - m0 : 1, L = 0;               \
        for (int64_t m = 0; m < nr; m++) L = seq_lens[m0 + m] > L ? seq_lens[m0 + m] : L;           \
        int64_t Lp = (L + CHUNK - 1) / CHUNK * CHUNK;     /* the tiles hold keys [0, L): the longest row */ \
        VT* qv = (VT*)aligned_alloc(64, sizeof(VT) * (size_t)(2 * nr * nq * nd + (CHUNK + 1) * nd       \
                                                              + nr * nq * Lp / 8 + 1));             \
        VT* acc = qv + nr * nq * nd;                                                                \
        VT* tile = acc + nr * nq * nd;                                                              \
        VT* zero = tile + CHUNK * nd;                                                               \
        float* s = (float*)(zero + nd);                   /* [nr, nq, Lp] */                        \
        for (int64_t c = 0; c < nd; c++) zero[c] = (VT){0};                                         \
        for (int64_t m = 0; m < nr; m++) {                                                          \
            const T* qb = q + (m0 + m) * q_row + h0 * grp * D;                                      \
            for (int64_t i = 0; i < nq; i++)                                                        \
                for (int64_t c = 0; c < nd; c++) {                                                  \
                    qv[(m * nq + i) * nd + c] = LD(qb + i * D + LANES * c) * scale;                 \
                    acc[(m * nq + i) * nd + c] = (VT){0};                                           \
                }                                                                                   \
        }                                                                                           \
        for (int64_t j0 = 0; j0 < Lp; j0 += CHUNK) {                                                \
            const KT* rp[CHUNK];                                                                    \
            CHUNK_ROWS(KT, k, rp, j0)                                                                \
            for (int64_t h = h0; h < h0 + hpt; h++) {                                               \
                WIDEN_TILE(VT, KLD, rp, tile, j0)                                                   \
                for (int64_t m = 0; m < nr; m++) {                                                  \
                    if (j0 >= seq_lens[m0 + m]) continue;     /* past this row's keys */            \
                    for (int64_t i = (h - h0) * grp; i < (h - h0 + 1) * grp; i++) {                 \
                        const VT* qi = qv + (m * nq + i) * nd;                                      \
                        VT dot[CHUNK] = {{0}};                                                      \
                        v8 part[CHUNK];                                                             \
                        for (int64_t c = 0; c < nd; c++) {                                          \
                            VT qc = qi[c];                                                          \
                            for (int r = 0; r < CHUNK; r++) dot[r] = FMA(qc, tile[r * nd + c], dot[r]); \
                        }                                                                           \
                        for (int r = 0; r < CHUNK; r++) part[r] = FOLD(dot[r]);                     \
                        *(v8*)(s + (m * nq + i) * Lp + j0) = hsum8x8(part);                         \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t m = 0; m < nr; m++) {                                                          \
            int64_t Lm = seq_lens[m0 + m];                                                          \
            for (int64_t i = 0; i < nq; i++)                                                        \
                softmax_row(s + (m * nq + i) * Lp, Lm, (Lm + CHUNK - 1) / CHUNK * CHUNK);           \
        }                                                                                           \
        for (int64_t j0 = 0; j0 < Lp; j0 += CHUNK) {                                                \
            const KT* rp[CHUNK];                                                                    \
            CHUNK_ROWS(KT, v, rp, j0)                                                                \
            for (int64_t h = h0; h < h0 + hpt; h++) {                                               \
                WIDEN_TILE(VT, KLD, rp, tile, j0)                                                   \
                for (int64_t m = 0; m < nr; m++) {                                                  \
                    int64_t left = seq_lens[m0 + m] - j0;                                           \
                    if (left <= 0) continue;                                                        \
                    const VT* tr[CHUNK];                  /* keys past the row's length: zeros */   \
                    for (int r = 0; r < CHUNK; r++) tr[r] = r < left ? tile + r * nd : zero;        \
                    for (int64_t i = (h - h0) * grp; i < (h - h0 + 1) * grp; i++) {                 \
                        VT w[CHUNK];                                                                \
                        VT* ai = acc + (m * nq + i) * nd;                                           \
                        for (int r = 0; r < CHUNK; r++) w[r] = (VT){0} + s[(m * nq + i) * Lp + j0 + r]; \
                        for (int64_t c = 0; c < nd; c++) {                                          \
                            VT a = ai[c];                                                           \
                            for (int r = 0; r < CHUNK; r++) a = FMA(w[r], tr[r][c], a);             \
                            ai[c] = a;                                                              \
                        }                                                                           \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t m = 0; m < nr; m++) {                                                          \
            T* ob = out + ((m0 + m) * Hq + h0 * grp) * D;                                           \
            for (int64_t i = 0; i < nq; i++)                                                        \
                for (int64_t c = 0; c < nd; c++)                                                    \
                    for (int d = 0; d < LANES; d++)                                                 \
                        ob[i * D + LANES * c + d] = STORE(acc[(m * nq + i) * nd + c][d]);           \
        }                                                                                           \
        free(qv);                                                                                   \
    }                                                                                               \
}                                                                                                   \
static void NAME##_run(const T* q, int64_t q_row, const KT* k, const KT* v, int64_t blk_stride,     \
                       const int64_t* tables, int64_t tab_stride, const int64_t* seq_lens, int64_t G, \
                       const int64_t* spans, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, \
                       float scale, int64_t hpt, T* out) {                                          \
    int64_t grp = Hq / Hkv, keys = 0;                                                               \
    NAME##_job job = {q, k, v, q_row, blk_stride, tab_stride, tables, seq_lens, spans, Hq, Hkv, D, bs, \
                      hpt, grp, D / LANES, Hkv / hpt, hpt * grp, scale, out};                       \
    for (int64_t b = 0; b < G; b++) keys += seq_lens[b];                                            \
    parallel_for(NAME##_tasks, &job, S * job.runs,                                                  \
                 threads_for(keys * Hkv * ROWLEN(D) * 2 * (int64_t)sizeof(KT)));                    \
}                                                                                                   \
int64_t NAME(const T* q, int64_t q_row, const KT* k, const KT* v, int64_t blk_stride, int64_t num_blocks, \
             const int64_t* tables, int64_t tab_stride, int64_t nblk, const int64_t* seq_lens, int64_t G,  \
             int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t hpt, T* out) {       \
    int64_t bad = check_tables(tables, tab_stride, seq_lens, G, nblk, num_blocks, bs);              \
    if (bad) return bad;                                                                            \
    NAME##_run(q, q_row, k, v, blk_stride, tables, tab_stride, seq_lens, G, NULL, G, Hq, Hkv, D, bs, scale, \
               hpt, out);                                                                           \
    return 0;                                                                                       \
}                                                                                                   \
int64_t NAME##_rows(const T* q, int64_t q_row, const KT* k, const KT* v, int64_t blk_stride,         \
                    int64_t num_blocks, const int64_t* tables, int64_t tab_stride, int64_t nblk,    \
                    const int64_t* seq_lens, int64_t G, const int64_t* spans, int64_t S, int64_t Hq, \
                    int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t hpt, T* out) {        \
    int64_t bad = check_spans(tables, tab_stride, seq_lens, G, spans, S, nblk, num_blocks, bs);     \
    if (bad) return bad;                                                                            \
    NAME##_run(q, q_row, k, v, blk_stride, tables, tab_stride, seq_lens, G, spans, S, Hq, Hkv, D, bs, scale, \
               hpt, out);                                                                           \
    return 0;                                                                                       \
}

#define FOLD8(x) (x)
#define ROW_DENSE(D) (D)
static inline v8 kld8_f32(const float* p, int64_t c) { return ld_f32(p + 8 * c); }
static inline v8 kld8_bf16(const uint16_t* p, int64_t c) { return ld_bf16(p + 8 * c); }
DECODE_KERNEL(decode_attention_f32, float, float, ROW_DENSE, kld8_f32, v8, 8, ld_f32, fma8, FOLD8, IDENT)
DECODE_KERNEL(decode_attention_bf16, uint16_t, uint16_t, ROW_DENSE, kld8_bf16, v8, 8, ld_bf16, fma8, FOLD8, f2bf)
/* over a cache of q8_0/q4_0 blocks (kv_blocks.h): tiles dequantized as they are widened */
#define QDECODE8(FMT)                                                                               \
DECODE_KERNEL(decode_attention_f32_##FMT, float, uint8_t, ROW_##FMT, kld8_##FMT, v8, 8, ld_f32, fma8, FOLD8, IDENT) \
DECODE_KERNEL(decode_attention_bf16_##FMT, uint16_t, uint8_t, ROW_##FMT, kld8_##FMT##_bf16, v8, 8, ld_bf16, fma8, FOLD8, f2bf)
QDECODE8(q8_0)
QDECODE8(q4_0)

#ifdef __AVX512F__
/* 16 lanes where the CPU has AVX-512 (head sizes that are a multiple of 16): half the instructions */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(64)));
EXP_KERNEL(exp16, v16, v16i)
static inline v16 ld16_f32(const float* p) { return *(const v16u*)p; }
static inline v16 ld16_bf16(const uint16_t* p) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
static inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline v8 fold16(v16 a) {
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline v16 kld16_f32(const float* p, int64_t c) { return ld16_f32(p + 16 * c); }
static inline v16 kld16_bf16(const uint16_t* p, int64_t c) { return ld16_bf16(p + 16 * c); }
DECODE_KERNEL(decode_attention16_f32, float, float, ROW_DENSE, kld16_f32, v16, 16, ld16_f32, fma16, fold16, IDENT)
DECODE_KERNEL(decode_attention16_bf16, uint16_t, uint16_t, ROW_DENSE, kld16_bf16, v16, 16, ld16_bf16, fma16, fold16,
              f2bf)
/* values 16c .. 16c + 15 of a quantized head row: two 8-lane halves */
#define KLD16(FMT)                                                                                  \
static inline v16 kld16_##FMT(const uint8_t* row, int64_t c) {                                      \
    v8 lo = kld8_##FMT(row, 2 * c), hi = kld8_##FMT(row, 2 * c + 1);                                \
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);   \
}
#define KLD16_Q(FMT)                                                                                \
KLD16(FMT)                                                                                          \
KLD16(FMT##_bf16)                                                                                   \
DECODE_KERNEL(decode_attention16_f32_##FMT, float, uint8_t, ROW_##FMT, kld16_##FMT, v16, 16, ld16_f32, fma16, fold16, \
              IDENT)                                                                                \
DECODE_KERNEL(decode_attention16_bf16_##FMT, uint16_t, uint8_t, ROW_##FMT, kld16_##FMT##_bf16, v16, 16, ld16_bf16, fma16,  \
              fold16, f2bf)
KLD16_Q(q8_0)
KLD16_Q(q4_0)
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* Causal attention of fresh prompts (no cached prefix) in bf16, on CPUs with AVX512-BF16.
   Per KV head, the keys are packed into panels of 16 keys, each [D/2][16][2] (at every pair of
   head dims, the 16 keys' pairs side by side), and the values transposed into panels of 16 head
   dims, each [keys][16][2] holding every value twice. Scores and outputs are then tiles of up to
   6 query rows x 64 columns, the way the packed linear layers run: each row's (x[2p], x[2p+1])
   pair broadcast against a panel's pairs (vdpbf16ps: exact products, float32 sums). Scores, the
   causal mask and the softmax are float32; each probability p becomes the bf16 pair (hi, lo),
   hi + lo = p to 16 bits, against the value's (v, v), so the sum over values loses no more than
   float32 math would (one bf16 p instead measured 1.4x SDPA's error, outside bf16's noise). */
/* o[m, 16 j + c] = sum over pairs kp < npairs of x[m, 2kp .. 2kp+1] . panel_j[kp, c, 0 .. 1] */
#define ATILE(MB, NV)                                                                           \
static void atile_##MB##x##NV(const uint16_t* x, int64_t ldx, const uint16_t* pan, int64_t pstride, \
                              int64_t npairs, float* o, int64_t ldo) {                          \
    __m512 acc[MB][NV];                                                                         \
    BF16_TILE_ACC(MB, NV, x, ldx, pan, 32, pstride, npairs, acc)                                \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(o + m * ldo + 16 * j, acc[m][j]);         \
}
#define ATILES(MB) ATILE(MB, 1) ATILE(MB, 2) ATILE(MB, 3) ATILE(MB, 4)
ATILES(1) ATILES(2) ATILES(3) ATILES(4) ATILES(5) ATILES(6)
typedef void (*atile_fn)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);
#define AROW(MB) {0, atile_##MB##x1, atile_##MB##x2, atile_##MB##x3, atile_##MB##x4}
static const atile_fn atiles[7][5] = {{0}, AROW(1), AROW(2), AROW(3), AROW(4), AROW(5), AROW(6)};

/* out[mb rows, 16 * ncols] = x[mb rows] against ncols panels (of pstride elements each) */
static void apanels(const uint16_t* x, int64_t ldx, int64_t mb, const uint16_t* pan, int64_t pstride,
                    int64_t npanels, int64_t npairs, float* o, int64_t ldo) {
    for (int64_t p0 = 0; p0 < npanels; p0 += 4) {
        int64_t nv = npanels - p0 < 4 ? npanels - p0 : 4;
        atiles[mb][nv](x, ldx, pan + p0 * pstride, pstride, npairs, o + 16 * p0, ldo);
    }
}

#define ROWS 6           /* query rows per tile */
#define BLOCK 48         /* query rows per task */
typedef struct {
    const uint16_t *q, *k, *v;
    int64_t q_row, kv_row, n, np, Hq, grp, D, blocks, o_row;
    float scale;
    uint16_t *kp, *vp, *out;
} prefill_job;

/* pack the keys and values of KV heads h0 .. h1 (padding keys are zeros) */
static void prefill_pack(void* ctx, int64_t h0, int64_t h1) {
    const prefill_job* j = (const prefill_job*)ctx;
    int64_t n = j->n, np = j->np, D = j->D;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t r = 0; r < np; r++)
            for (int64_t d = 0; d < D; d++) {
                uint16_t kx = r < n ? j->k[r * j->kv_row + h * D + d] : 0, vx = r < n ? j->v[r * j->kv_row + h * D + d] : 0;
                j->kp[h * np * D + (r / 16) * 16 * D + (d / 2) * 32 + (r % 16) * 2 + d % 2] = kx;
                j->vp[h * 2 * np * D + (d / 16) * 32 * np + r * 32 + (d % 16) * 2] = vx;
                j->vp[h * 2 * np * D + (d / 16) * 32 * np + r * 32 + (d % 16) * 2 + 1] = vx;
            }
}

/* task t: query head t % Hq, one block of BLOCK query rows (the longest blocks first) */
static void prefill_tasks(void* ctx, int64_t t0, int64_t t1) {
    const prefill_job* j = (const prefill_job*)ctx;
    int64_t n = j->n, np = j->np, D = j->D, Hq = j->Hq, q_row = j->q_row;
    for (int64_t t = t0; t < t1; t++) {
        int64_t qh = t % Hq, b0 = (j->blocks - 1 - t / Hq) * BLOCK;
        int64_t b1 = b0 + BLOCK < n ? b0 + BLOCK : n, h = qh / j->grp;
        float* s = (float*)aligned_alloc(64, sizeof(float) * (size_t)(ROWS * (np + D)));
        uint16_t* pb = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * (size_t)(2 * ROWS * np));
        float* o = s + ROWS * np;
        for (int64_t r0 = b0; r0 < b1; r0 += ROWS) {
            int64_t mb = b1 - r0 < ROWS ? b1 - r0 : ROWS, L = r0 + mb, Lp = (L + 15) / 16 * 16;
            apanels(j->q + r0 * q_row + qh * D, q_row, mb, j->kp + h * np * D, 16 * D, Lp / 16, D / 2, s, np);
            for (int64_t m = 0; m < mb; m++) {
                float* sr = s + m * np;
                int64_t valid = r0 + m + 1;
                float mx = -INFINITY, sum = 0.f;
                for (int64_t c = 0; c < valid; c++) { sr[c] *= j->scale; mx = sr[c] > mx ? sr[c] : mx; }
                for (int64_t c = valid; c < Lp; c++) sr[c] = -INFINITY;
                v16 sv = {0};
                for (int64_t c = 0; c < Lp; c += 16) {
                    v16 e = exp16(*(v16*)(sr + c) - mx);
                    *(v16*)(sr + c) = e;
                    sv += e;
                }
                for (int i = 0; i < 16; i++) sum += sv[i];
                __m512 inv = _mm512_set1_ps(1.f / sum);
                for (int64_t c = 0; c < Lp; c += 16) {          /* (hi, lo) bf16 pairs of p */
                    __m512 pr = _mm512_mul_ps(*(__m512*)(sr + c), inv);
                    __m256i hi = (__m256i)_mm512_cvtneps_pbh(pr);
                    __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
                    __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(pr, hi_f));
                    _mm512_storeu_si512(pb + m * 2 * np + 2 * c, _mm512_or_si512(
                        _mm512_cvtepu16_epi32(hi), _mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 16)));
                }
            }
            apanels(pb, 2 * np, mb, j->vp + h * 2 * np * D, 32 * np, D / 16, Lp, o, D);
            for (int64_t m = 0; m < mb; m++)
                for (int64_t d = 0; d < D; d += 16)
                    _mm256_storeu_si256((__m256i*)(j->out + (r0 + m) * j->o_row + qh * D + d),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(o + m * D + d)));
        }
        free(s);
        free(pb);
    }
}

/* q [n, Hq, D] (row stride q_row), k, v [n, Hkv, D] (row stride kv_row) -> out [n, Hq, D] (row
   stride o_row); D % 16 == 0. */
void prefill_attention_bf16(const uint16_t* q, int64_t q_row, const uint16_t* k, const uint16_t* v,
                            int64_t kv_row, int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                            uint16_t* out, int64_t o_row) {
    int64_t np = (n + 15) / 16 * 16, blocks = (n + BLOCK - 1) / BLOCK;
    uint16_t* kp = (uint16_t*)aligned_alloc(64, (size_t)(3 * Hkv * np * D) * sizeof(uint16_t));
    prefill_job job = {q, k, v, q_row, kv_row, n, np, Hq, Hq / Hkv, D, blocks, o_row, scale, kp, kp + Hkv * np * D, out};
    int want = threads_for(n * n * Hq * D);           /* the work grows with the square of n */
    parallel_for(prefill_pack, &job, Hkv, want);
    parallel_for(prefill_tasks, &job, Hq * blocks, want);
    free(kp);
}
#endif
