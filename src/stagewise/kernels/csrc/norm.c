/* RMSNorm, with the residual add of pre-norm blocks fused in: one pass over a row for the sum
   (and its squares), one for the output; float32 and bfloat16.

   16-lane float vectors (GCC vector extensions): one zmm register on AVX-512 builds, two ymm on
   AVX2, SSE or scalar code on a portable build. The sum of squares follows PyTorch's own order
   (`sumsq`), so the results are PyTorch's bits, on every build and for every row count. Rows are
   independent (a row's result never depends on the batch); many rows split over the kernel team.
   Callers check shapes, dtypes and strides (kernels/norm.py). */
#include <math.h>
#include <string.h>

#include "norm.h"
#include "team.h"

SW_TEAM_CLIENT(norm)

/* 16-lane helpers are static inline: narrower builds pass them in pairs of registers, quietly */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t u16x __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint16_t h16 __attribute__((vector_size(32)));

static inline v16 ld_f32(const float* p) { return *(const v16u*)p; }
static inline void st_f32(float* p, v16 v) { *(v16u*)p = v; }
/* bfloat16 is the top half of a float32: widen and shift, exactly */
static inline v16 ld_bf16(const uint16_t* p) { return (v16)(__builtin_convertvector(*(const h16u*)p, u16x) << 16); }
/* float32 -> bfloat16, round to nearest even, NaN stays NaN (vec.h's f2bf, 16 lanes) */
static inline void st_bf16(uint16_t* p, v16 f) {
    u16x u = (u16x)f;
    u16x r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    u16x nan = (u >> 16) | 0x40;
    u16x is_nan = (u16x)((u & 0x7fffffff) > 0x7f800000);
    *(h16u*)p = __builtin_convertvector((nan & is_nan) | (r & ~is_nan), h16);
}
/* bits through the vector path, for a row's tail of m < 16 values (padded with zeros) */
static inline v16 ld_f32_tail(const float* p, int64_t m) { v16 v = {0}; memcpy(&v, p, m * 4); return v; }
static inline v16 ld_bf16_tail(const uint16_t* p, int64_t m) {
    uint16_t b[16] = {0}; memcpy(b, p, m * 2); return ld_bf16(b);
}
static inline void st_f32_tail(float* p, v16 v, int64_t m) { memcpy(p, &v, m * 4); }
static inline void st_bf16_tail(uint16_t* p, v16 v, int64_t m) { uint16_t b[16]; st_bf16(b, v); memcpy(p, b, m * 2); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint32_t u8x __attribute__((vector_size(32)));
typedef uint16_t h8u __attribute__((vector_size(16), aligned(2), may_alias));
static inline v8 ld8_f32(const float* p) { return *(const v8u*)p; }
static inline v8 ld8_bf16(const uint16_t* p) { return (v8)(__builtin_convertvector(*(const h8u*)p, u8x) << 16); }
static inline float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float f32(float f) { return f; }

/* PyTorch's vector width for float sums (torch.backends.cpu.get_cpu_capability(): 16 lanes on
   AVX-512, else 8), set by kernels/norm.py at load */
static int torch_lanes = 8;
void norm_set_lanes(int lanes) { torch_lanes = lanes == 16 ? 16 : 8; }

static inline int64_t ceil_log2(int64_t x) {      /* c10 utils::CeilLog2 */
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)x - 1; v; v >>= 1) b++;
    return b;
}

/* The sum of squares of a row in PyTorch's order, so that the norm has its bits: `pow(2)` then
   aten's float sum of a contiguous row (SumKernel.cpp cascade_sum: rows of at least W values by
   vectorized_inner_sum, W-lane vectors in four interleaved cascades of at most four levels, the
   rest of the vectors into the first, the four added, then the scalar tail and the W lanes in
   order; shorter rows by scalar_inner_sum, the same with scalars). Plain multiplies and adds: every build of
   this file gives the same bits. */
#define SUMSQ(NAME, T, VT, W, LOAD, WIDEN)                                                          \
static float NAME(const T* p, int64_t n) {                                                          \
    if (n < W) {                         /* scalar_inner_sum: four interleaved sums, then the rest */ \
        float a[4] = {0.f, 0.f, 0.f, 0.f};                                                         \
        int64_t q = n / 4;                                                                          \
        for (int64_t i = 0; i < q; i++)                                                             \
            for (int k = 0; k < 4; k++) { float v = WIDEN(p[i * 4 + k]); a[k] += v * v; }          \
        for (int64_t i = q * 4; i < n; i++) { float v = WIDEN(p[i]); a[0] += v * v; }              \
        return ((a[0] + a[1]) + a[2]) + a[3];                                                      \
    }                                                                                               \
    int64_t nv = n / W, nilp = nv / 4;                                                              \
    int64_t lp = ceil_log2(nilp) / 4 > 4 ? ceil_log2(nilp) / 4 : 4, step = (int64_t)1 << lp, mask = step - 1; \
    VT acc[4][4];                                                                                   \
    memset(acc, 0, sizeof acc);                                                                     \
    int64_t i = 0;                                                                                  \
    while (i + step <= nilp) {                                                                      \
        for (int64_t j = 0; j < step; j++, i++)                                                     \
            for (int k = 0; k < 4; k++) { VT v = LOAD(p + (i * 4 + k) * W); acc[0][k] += v * v; }  \
        for (int j = 1; j < 4; j++) {                                                               \
            for (int k = 0; k < 4; k++) { acc[j][k] += acc[j - 1][k]; acc[j - 1][k] = (VT){0}; }    \
            if (i & (mask << (j * lp))) break;                                                      \
        }                                                                                           \
    }                                                                                               \
    for (; i < nilp; i++)                                                                           \
        for (int k = 0; k < 4; k++) { VT v = LOAD(p + (i * 4 + k) * W); acc[0][k] += v * v; }      \
    for (int j = 1; j < 4; j++)                                                                     \
        for (int k = 0; k < 4; k++) acc[0][k] += acc[j][k];                                         \
    for (i = nilp * 4; i < nv; i++) { VT v = LOAD(p + i * W); acc[0][0] += v * v; }                  \
    for (int k = 1; k < 4; k++) acc[0][0] += acc[0][k];                                             \
    float f = 0.f;                                                                                  \
    for (int64_t k = nv * W; k < n; k++) { float v = WIDEN(p[k]); f += v * v; }                     \
    for (int l = 0; l < W; l++) f += acc[0][0][l];                                                  \
    return f;                                                                                       \
}
SUMSQ(sumsq16_f32, float, v16, 16, ld_f32, f32)
SUMSQ(sumsq8_f32, float, v8, 8, ld8_f32, f32)
SUMSQ(sumsq16_bf16, uint16_t, v16, 16, ld_bf16, bf)
SUMSQ(sumsq8_bf16, uint16_t, v8, 8, ld8_bf16, bf)

/* rsqrt(mean + eps) as PyTorch spells it: sum / n, + eps, 1 / sqrt */
static inline float inv_rms(float sumsq, int64_t n, float eps) { return 1.f / sqrtf(sumsq / (float)n + eps); }

/* one row, float32 */
static void row_f32(const float* x, const float* res, const float* w, float* out, float* sum, int64_t n, float eps) {
    int64_t n16 = n & ~(int64_t)15, m = n - n16;
    const float* s = x;
    if (res) {              /* the sum first, into `sum` (or `out`, when the caller keeps no sum) */
        float* dst = sum ? sum : out;
        for (int64_t j = 0; j < n16; j += 16) st_f32(dst + j, ld_f32(x + j) + ld_f32(res + j));
        if (m) st_f32_tail(dst + n16, ld_f32_tail(x + n16, m) + ld_f32_tail(res + n16, m), m);
        s = dst;
    }
    float r = inv_rms(torch_lanes == 16 ? sumsq16_f32(s, n) : sumsq8_f32(s, n), n, eps);
    for (int64_t j = 0; j < n16; j += 16) st_f32(out + j, (ld_f32(s + j) * r) * ld_f32(w + j));
    if (m) st_f32_tail(out + n16, (ld_f32_tail(s + n16, m) * r) * ld_f32_tail(w + n16, m), m);
}

/* one row, bfloat16 (float32 inside, rounded where HF rounds) */
static void row_bf16(const uint16_t* x, const uint16_t* res, const uint16_t* w, uint16_t* out, uint16_t* sum,
                     int64_t n, float eps) {
    int64_t n16 = n & ~(int64_t)15, m = n - n16;
    const uint16_t* s = x;
    if (res) {
        uint16_t* dst = sum ? sum : out;
        for (int64_t j = 0; j < n16; j += 16) st_bf16(dst + j, ld_bf16(x + j) + ld_bf16(res + j));
        if (m) st_bf16_tail(dst + n16, ld_bf16_tail(x + n16, m) + ld_bf16_tail(res + n16, m), m);
        s = dst;
    }
    float r = inv_rms(torch_lanes == 16 ? sumsq16_bf16(s, n) : sumsq8_bf16(s, n), n, eps);
    uint16_t b[16];
    for (int64_t j = 0; j < n16; j += 16) {
        st_bf16(b, ld_bf16(s + j) * r);
        st_bf16(out + j, ld_bf16(w + j) * ld_bf16(b));
    }
    if (m) {
        st_bf16(b, ld_bf16_tail(s + n16, m) * r);
        st_bf16_tail(out + n16, ld_bf16_tail(w + n16, m) * ld_bf16(b), m);
    }
}

#define ROWS_PER_TASK 8

typedef struct {
    const void *x, *res, *w;
    void *out, *sum;
    int64_t x_row, res_row, out_row, sum_row, rows, n;
    float eps;
} job_t;

#define TASK(NAME, T, ROW)                                                                          \
static void NAME(void* ctx, int64_t t0, int64_t t1) {                                              \
    const job_t* j = ctx;                                                                           \
    int64_t r1 = t1 * ROWS_PER_TASK < j->rows ? t1 * ROWS_PER_TASK : j->rows;                       \
    for (int64_t i = t0 * ROWS_PER_TASK; i < r1; i++)                                               \
        ROW((const T*)j->x + i * j->x_row, j->res ? (const T*)j->res + i * j->res_row : NULL,       \
            (const T*)j->w, (T*)j->out + i * j->out_row, j->sum ? (T*)j->sum + i * j->sum_row : NULL, \
            j->n, j->eps);                                                                          \
}
TASK(task_f32, float, row_f32)
TASK(task_bf16, uint16_t, row_bf16)

/* threads a call over rows x n values is worth: one per 64 KiB of rows (the team caps it) */
static int threads_for(int64_t rows, int64_t n) {
    int64_t want = 1 + rows * n / (16 << 10);
    return want > 1024 ? 1024 : (int)want;
}

#define ENTRY(NAME, T, TASKFN)                                                                      \
void NAME(STAGEWISE_NORM_ARGS(T)) {                                                                 \
    job_t j = {x, res, w, out, sum, x_row, res_row, out_row, sum_row, rows, n, eps};                \
    if (rows <= 0 || n <= 0) return;                                                                \
    parallel_for(TASKFN, &j, (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, threads_for(rows, n));      \
}
ENTRY(rms_norm_f32, float, task_f32)
ENTRY(rms_norm_bf16, uint16_t, task_bf16)
