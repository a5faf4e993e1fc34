/* Rope on the q and k heads of a fused qkv projection, with the step's roped k and v rows
   written into the paged KV cache in the same pass: one call per layer instead of PyTorch's cat,
   three elementwise ops and two index_copy_ (eager steps; compiled graphs trace those ops).

   The arithmetic is PyTorch's op for op, `x * cos + swap(x) * sin`: float32 with every multiply
   and the add rounded on its own (the build's -std=c11 contracts nothing into an FMA), bfloat16
   computed in float32 and rounded to bfloat16 after each op. Plain loops over a head's halves,
   vectorized by the compiler (elementwise: the bits do not depend on the vector width), so every
   build gives PyTorch's bits. Rows are independent; many rows split over the kernel team.
   Callers check shapes, dtypes and strides (kernels/rope.py); the slots are checked here. */
#include <string.h>

#include "rope.h"
#include "team.h"

SW_TEAM_CLIENT(rope)

static inline float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
/* float32 -> bfloat16, round to nearest even, NaN stays NaN (vec.h's f2bf, without a branch) */
static inline uint16_t to_bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    return (uint16_t)((u & 0x7fffffff) > 0x7f800000 ? (u >> 16) | 0x40 : r);
}
static inline float round_bf(float f) { return bf(to_bf(f)); }

/* one head of d = 2 half values: out = x * c + [x2, x1] * s */
static void head_f32(const float* restrict x, const float* restrict c, const float* restrict s,
                     float* restrict out, int64_t half) {
    for (int64_t j = 0; j < half; j++) out[j] = x[j] * c[j] + x[half + j] * s[j];
    for (int64_t j = 0; j < half; j++) out[half + j] = x[half + j] * c[half + j] + x[j] * s[half + j];
}

static void head_bf16(const uint16_t* restrict x, const uint16_t* restrict c, const uint16_t* restrict s,
                      uint16_t* restrict out, int64_t half) {
    for (int64_t j = 0; j < half; j++)
        out[j] = to_bf(round_bf(bf(x[j]) * bf(c[j])) + round_bf(bf(x[half + j]) * bf(s[j])));
    for (int64_t j = 0; j < half; j++)
        out[half + j] = to_bf(round_bf(bf(x[half + j]) * bf(c[half + j])) + round_bf(bf(x[j]) * bf(s[half + j])));
}

#define ROWS_PER_TASK 4

typedef struct {
    const void *qkv, *cos, *sin;
    void *q_out, *k_out, *cache;
    const int64_t* slots;
    int64_t qkv_row, cs_row, rows, hq, hkv, d, cache_slots, nslots;
} job_t;

/* rows t0 * ROWS_PER_TASK ..: the q and k heads into q_out and k_out, k and v into the cache */
#define TASK(NAME, T, HEAD)                                                                         \
static void NAME(void* ctx, int64_t t0, int64_t t1) {                                              \
    const job_t* j = ctx;                                                                           \
    int64_t hq = j->hq, d = j->d, kv = j->hkv * d;                                                  \
    int64_t r1 = t1 * ROWS_PER_TASK < j->rows ? t1 * ROWS_PER_TASK : j->rows;                       \
    for (int64_t i = t0 * ROWS_PER_TASK; i < r1; i++) {                                             \
        const T* x = (const T*)j->qkv + i * j->qkv_row;                                             \
        const T *c = (const T*)j->cos + i * j->cs_row, *s = (const T*)j->sin + i * j->cs_row;       \
        T *q = (T*)j->q_out + i * hq * d, *k = (T*)j->k_out + i * kv;                              \
        for (int64_t h = 0; h < hq; h++) HEAD(x + h * d, c, s, q + h * d, d / 2);                  \
        for (int64_t h = 0; h < j->hkv; h++) HEAD(x + (hq + h) * d, c, s, k + h * d, d / 2);        \
        if (i < j->nslots) {                                                                        \
            T* k_at = (T*)j->cache + j->slots[i] * kv;                                              \
            memcpy(k_at, k, kv * sizeof(T));                                                        \
            memcpy(k_at + j->cache_slots * kv, x + hq * d + kv, kv * sizeof(T));                    \
        }                                                                                           \
    }                                                                                               \
}
TASK(task_f32, float, head_f32)
TASK(task_bf16, uint16_t, head_bf16)

/* threads a call over rows x heads x d values is worth: one per 64 Ki values (the team caps it) */
static int threads_for(int64_t rows, int64_t width) {
    int64_t want = 1 + rows * width / (64 << 10);
    return want > 1024 ? 1024 : (int)want;
}

#define ENTRY(NAME, T, TASKFN)                                                                      \
int64_t NAME(STAGEWISE_ROPE_ARGS(T)) {                                                              \
    if (!cache) nslots = 0;                                                                         \
    for (int64_t i = 0; i < nslots; i++)                                                            \
        if (slots[i] < 0 || slots[i] >= cache_slots) return i;                                      \
    job_t j = {qkv, cos, sin, q_out, k_out, cache, slots, qkv_row, cs_row, rows, hq, hkv, d, cache_slots, \
               nslots};                                                                             \
    if (rows <= 0 || d <= 0) return -1;                                                             \
    parallel_for(TASKFN, &j, (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, threads_for(rows, (hq + 2 * hkv) * d)); \
    return -1;                                                                                      \
}
ENTRY(rope_kv_f32, float, task_f32)
ENTRY(rope_kv_bf16, uint16_t, task_bf16)
