/* Quantized linear layers: y [M, N] = x [M, K] @ W^T for W in GGUF blocks, packed in panels of 16
   rows (the layout is described in quant_pack.py; quant_layout.h navigates it, quant_tiles.h
   multiplies).

   Fast mode: each activation row is quantized once per call to int8 in chunks of 32 (one float
   scale per chunk, code sums per 16), and every chunk of a weight panel is an integer dot product
   with it (4-way u8 x s8 products summed in int32: exact), scaled into a float32 accumulator per
   output: acc += (d_w d_x) * isum, plus the type's offset or minimum term from the code sums.
   MXFP4 runs as a 4-bit type whose codes go through a table (its doubled E2M1 values, as llama.cpp
   multiplies them) and whose scale is a power of two.
   Exact mode: each panel is dequantized into float32 (bit-identical to gguf-py's values) and
   multiplied with float32 activations, one fused multiply-add per k in order.

   Work: tasks of (a few panels, a run of rows) split over the stage's kernel team (team.h; OpenMP
   where there is none), as many threads as the bytes read are worth; each output's arithmetic is
   the same whatever the split or the other rows (batch invariance). */
#include <stdlib.h>

#include "quant.h"
#include "quant_tiles.h"
#include "team.h"

SW_TEAM_CLIENT(quant)

const char* quant_isa(void) { return QUANT_ISA; }

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

/* ---- the tiles of each type ------------------------------------------------------------------- */
typedef void (*direct_fn)(const act_t*, int64_t, const uint8_t*, int64_t, const out_t*, int64_t);
typedef void (*extract_fn)(const uint8_t*, int64_t, int64_t, int64_t, chunk_ops_t*);
typedef void (*block_fn)(const act_t*, int64_t, int64_t, int64_t, const chunk_ops_t*, pvf*, int);
typedef void (*exact_fn)(const float*, int64_t, int64_t, const float*, int64_t, const out_t*, int64_t);
typedef void (*exact_direct_fn)(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const out_t*,
                                int64_t);
/* direct tiles of 1 .. MBMAX rows x NV panels, of 1 row x NV1 and 2 rows x NV2 panels (decode);
   blocked tiles of 1 .. MBMAX rows x NV (none for Q8_0, whose codes need no unpacking: extracting
   them would only copy them); exact direct tiles of 1 row x NV2 panels (decode) and of 1 .. XMB
   rows x NV panels (up to EXACT_DIRECT_ROWS rows: decode and verify steps) */
typedef struct {
    direct_fn direct[MBMAX + 1], one, two;
    extract_fn extract;
    block_fn block[MBMAX + 1];
    exact_direct_fn exact_one, exact[XMB + 1];
} kernels_t;

#define DIRECT(QT, MB, NVT)                                                                       \
static void direct_##QT##_##MB##x##NVT(const act_t* x, int64_t m0, const uint8_t* w, int64_t pstride,      \
                               const out_t* o, int64_t n0) {                                      \
    pvf acc[MBMAX][NVW];                                                                          \
    fast_tile(QT, MB, NVT, x, m0, w, pstride, acc);                                               \
    store_tile(MB, NVT, &acc[0][0], NVW, o, m0, n0);                                              \
}
#define BLOCK(QT, MB)                                                                             \
static void block_##QT##_##MB(const act_t* x, int64_t m0, int64_t c0, int64_t count, const chunk_ops_t* ops, \
                              pvf* rows, int first) {                                             \
    block_tile(QT, MB, x, m0, c0, count, ops, rows, first);                                       \
}
#if QUANT_WIDE
#define EACH_MB(T, QT, ...) T(QT, 1, ##__VA_ARGS__) T(QT, 2, ##__VA_ARGS__) T(QT, 3, ##__VA_ARGS__) \
                            T(QT, 4, ##__VA_ARGS__) T(QT, 5, ##__VA_ARGS__) T(QT, 6, ##__VA_ARGS__)
#define MB_TABLE(P, S) {0, P##1##S, P##2##S, P##3##S, P##4##S, P##5##S, P##6##S}
#define EACH_XMB(T, QT) EACH_MB(T, QT) T(QT, 7) T(QT, 8) T(QT, 9) T(QT, 10)
#define XMB_TABLE(P) {0, P##1, P##2, P##3, P##4, P##5, P##6, P##7, P##8, P##9, P##10}
#else
#define EACH_MB(T, QT, ...) T(QT, 1, ##__VA_ARGS__) T(QT, 2, ##__VA_ARGS__) T(QT, 3, ##__VA_ARGS__) \
                            T(QT, 4, ##__VA_ARGS__)
#define MB_TABLE(P, S) {0, P##1##S, P##2##S, P##3##S, P##4##S}
#define EACH_XMB(T, QT) EACH_MB(T, QT)
#define XMB_TABLE(P) MB_TABLE(P, )
#endif
/* the decode tiles (their names spell NV1 and NV2 as such: ## does not expand them) */
#define WIDE(QT) DIRECT(QT, 1, NV1) DIRECT(QT, 2, NV2)
#define WIDE_TABLE(QT) direct_##QT##_1xNV1, direct_##QT##_2xNV2
#if NV == 2
#define DIRECT_NV(QT, MB) DIRECT(QT, MB, 2)
#define NV_SUFFIX x2
#else
#define DIRECT_NV(QT, MB) DIRECT(QT, MB, 1)
#define NV_SUFFIX x1
#endif
#define DIRECT_TABLE(QT, S) MB_TABLE(direct_##QT##_, S)
#define EXACT_DIRECT(QT, MB, NVT, NAME)                                                           \
static void NAME(const float* x, int64_t ldx, int64_t m0, const uint8_t* w, int64_t pstride, int64_t K, \
                 const out_t* o, int64_t n0) {                                                    \
    pvf acc[XMB][NVW];                                                                            \
    exact_direct_tile(QT, MB, NVT, x, ldx, m0, w, pstride, K, acc);                               \
    store_tile(MB, NVT, &acc[0][0], NVW, o, m0, n0);                                              \
}
#define EXACT_NV(QT, MB) EXACT_DIRECT(QT, MB, NV, exact_##QT##_##MB)
#define EXACTS(QT) EXACT_DIRECT(QT, 1, NV2, exact_one_##QT) EACH_XMB(EXACT_NV, QT)
#define KERNELS(QT)                                                                               \
EACH_MB(DIRECT_NV, QT) WIDE(QT) EACH_MB(BLOCK, QT) EXACTS(QT)                                     \
static void extract_##QT(const uint8_t* w, int64_t pstride, int64_t c0, int64_t count, chunk_ops_t* ops) { \
    extract_chunks(QT, w, pstride, c0, count, ops);                                               \
}                                                                                                 \
static const kernels_t kernels_##QT = {DIRECT_TABLE(QT, NV_SUFFIX), WIDE_TABLE(QT), extract_##QT,   \
                                       MB_TABLE(block_##QT##_, ), exact_one_##QT, XMB_TABLE(exact_##QT##_)};
#define KERNELS_Q8(QT)                                                                            \
EACH_MB(DIRECT_NV, QT) WIDE(QT) EXACTS(QT)                                                        \
static const kernels_t kernels_##QT = {DIRECT_TABLE(QT, NV_SUFFIX), WIDE_TABLE(QT), 0, {0}, exact_one_##QT, \
                                       XMB_TABLE(exact_##QT##_)};
KERNELS(Q4_0) KERNELS(Q4_1) KERNELS(Q5_0) KERNELS(Q5_1) KERNELS_Q8(Q8_0) KERNELS(Q4_K) KERNELS(Q5_K) KERNELS(Q6_K)
KERNELS(MXFP4)

static const kernels_t* kernels_of(int qt) {
    switch (qt) {
        case Q4_0: return &kernels_Q4_0;
        case Q4_1: return &kernels_Q4_1;
        case Q5_0: return &kernels_Q5_0;
        case Q5_1: return &kernels_Q5_1;
        case Q8_0: return &kernels_Q8_0;
        case Q4_K: return &kernels_Q4_K;
        case Q5_K: return &kernels_Q5_K;
        case Q6_K: return &kernels_Q6_K;
        case MXFP4: return &kernels_MXFP4;
        default: return 0;
    }
}

int quant_supported(int qt) { return kernels_of(qt) != 0; }

#define EXACT(MB)                                                                                 \
static void exact_##MB(const float* x, int64_t ldx, int64_t m0, const float* wf, int64_t K,        \
                       const out_t* o, int64_t n0) {                                              \
    pvf acc[MBMAX][NVW];                                                                          \
    exact_tile(MB, x, ldx, m0, wf, K, acc);                                                       \
    store_tile(MB, NV, &acc[0][0], NVW, o, m0, n0);                                               \
}
#if QUANT_WIDE
EXACT(1) EXACT(2) EXACT(3) EXACT(4) EXACT(5) EXACT(6)
static const exact_fn exact_tiles[] = {0, exact_1, exact_2, exact_3, exact_4, exact_5, exact_6};
#else
EXACT(1) EXACT(2) EXACT(3) EXACT(4)
static const exact_fn exact_tiles[] = {0, exact_1, exact_2, exact_3, exact_4};
#endif

/* ---- tasks ------------------------------------------------------------------------------------ */
/* A linear call multiplies x by up to QUANT_MAX_SEGMENTS matrices side by side (fused projections
   whose parts are stored in different types), each writing its own columns of y. */
typedef struct {
    int qt;
    const kernels_t* k;
    const uint8_t* w;
    int64_t pstride, panels, first;      /* first: index of the segment's first task */
    out_t o;
} seg_t;

/* Tasks: (a group of `width` panels of one segment, a run of up to ROWS_PER_RUN rows), panel-major
   so that consecutive tasks share their panels; a segment's last group may be narrower. */
#define RUN_ROWS(M) ((M) <= 2 * ROWS_PER_RUN ? (M) : ROWS_PER_RUN)

/* Rows r0 .. r1 against NV panels from p, by blocked tiles: each block of KB chunks is extracted
   once for all the rows, whose accumulators wait in `rows` between blocks. */
static void blocked(const seg_t* sg, const act_t* x, int64_t p, int64_t r0, int64_t r1, chunk_ops_t* ops,
                    pvf* rows) {
    const uint8_t* w = sg->w + p * sg->pstride;
    int64_t C = x->K / CHUNK;
    for (int64_t c0 = 0; c0 < C; c0 += KB) {
        int64_t count = C - c0 < KB ? C - c0 : KB;
        sg->k->extract(w, sg->pstride, c0, count, ops);
        for (int64_t m0 = r0; m0 < r1; m0 += MBMAX) {
            int64_t mb = r1 - m0 < MBMAX ? r1 - m0 : MBMAX;
            sg->k->block[mb](x, m0, c0, count, ops, rows + (m0 - r0) * NV, c0 == 0);
        }
    }
    store_tile((int)(r1 - r0), NV, rows, NV, &sg->o, r0, p * PANEL);
}

/* One task of a fast call: task t -> its segment, panels and rows. */
typedef struct {
    const seg_t* segs;
    int S;
    int64_t M, width;
    act_t a;
    const void* x;
    int x_bf16;
    int64_t ldx, esize;
} fast_job_t;

static void fast_task(const fast_job_t* j, int64_t t) {
    const seg_t* segs = j->segs;
    int64_t M = j->M, width = j->width, rows = RUN_ROWS(M), runs = (M + rows - 1) / rows;
    int s = j->S - 1;
    while (segs[s].first > t) s--;
    const seg_t* sg = &segs[s];
    int64_t p0 = ((t - sg->first) / runs) * width, r0 = ((t - sg->first) % runs) * rows;
    int64_t p1 = p0 + width < sg->panels ? p0 + width : sg->panels, r1 = r0 + rows < M ? r0 + rows : M;
    const act_t* a = &j->a;
    if (width > NV && p1 - p0 == width) {           /* a decode step's wide group */
        (M == 1 ? sg->k->one : sg->k->two)(a, 0, sg->w + p0 * sg->pstride, sg->pstride, &sg->o, p0 * PANEL);
    } else if (M > MBMAX && sg->k->extract) {       /* several row tiles share each block */
        chunk_ops_t ops[KB];
        pvf acc[2 * ROWS_PER_RUN * NV];             /* RUN_ROWS(M) <= 2 * ROWS_PER_RUN */
        for (int64_t p = p0; p < p1; p += NV) blocked(sg, a, p, r0, r1, ops, acc);
    } else {
        for (int64_t p = p0; p < p1; p += NV)
            for (int64_t m0 = r0; m0 < r1; m0 += MBMAX) {
                int64_t mb = r1 - m0 < MBMAX ? r1 - m0 : MBMAX;
                sg->k->direct[mb](a, m0, sg->w + p * sg->pstride, sg->pstride, &sg->o, p * PANEL);
            }
    }
}

static void fast_tasks(void* ctx, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) fast_task((const fast_job_t*)ctx, t);
}

static void quantize_rows(void* ctx, int64_t m0, int64_t m1) {
    const fast_job_t* j = (const fast_job_t*)ctx;
    int64_t K = j->a.K;
    for (int64_t m = m0; m < m1; m++)
        quantize_row((const char*)j->x + m * j->ldx * j->esize, j->x_bf16, K, (int8_t*)j->a.q + m * K,
                     (float*)j->a.d + m * (K / CHUNK), (int32_t*)j->a.s + m * (K / 16));
}

/* Threads a call is worth: one per TEAM_BYTES of weight-reads (rows count up to 64: past that a
   call is compute-bound and every thread pays); the team caps it at its size. */
#define TEAM_BYTES (48 << 10)
static int threads_for(const seg_t* segs, int S, int64_t M) {
    int64_t bytes = 0;
    for (int s = 0; s < S; s++) bytes += segs[s].panels * segs[s].pstride;
    int64_t want = 1 + bytes * (M < 64 ? M : 64) / TEAM_BYTES;
    return want > 1024 ? 1024 : (int)want;
}

static void run_fast(const seg_t* segs, int S, const void* x, int x_bf16, int64_t ldx, int64_t M, int64_t K,
                     int64_t width, char* work) {
    int8_t* xq = (int8_t*)work;
    float* xd = (float*)(work + M * K);
    int32_t* xs = (int32_t*)(xd + M * (K / CHUNK));
    fast_job_t j = {segs, S, M, width, {xq, xd, xs, K}, x, x_bf16, ldx, x_bf16 ? 2 : 4};
    int want = threads_for(segs, S, M);
    parallel_for(quantize_rows, &j, M, M >= 16 ? want : 1);
    int64_t rows = RUN_ROWS(M), runs = (M + rows - 1) / rows;
    int64_t total = segs[S - 1].first + (segs[S - 1].panels + width - 1) / width * runs;
    parallel_for(fast_tasks, &j, total, want);
}

/* Panel -> float32 [K][16] (bit-identical to gguf-py's dequantized values) */
static void dequant_panel(int qt, const uint8_t* panel, int64_t K, float* out) {
    for (int64_t c = 0; c < K / CHUNK; c++) dequant_chunk(qt, panel, c, out + c * CHUNK * PANEL);
}

/* One task of an exact call: in registers for a decode step's whole group, else its panels
   dequantized into the thread's scratch (grown as needed, kept for the thread's life). */
typedef struct {
    const seg_t* segs;
    int S;
    int64_t M, K, width, ldf;
    const float* xf;
    int failed;
} exact_job_t;

/* Rows up to which exact tiles dequantize in registers (again for each tile of up to XMB rows);
   past them, panels are dequantized once into memory for all the rows. Measured on 576 x 3072
   (Q4_1, Q4_K, Q8_0): AVX-512 in registers is 1.5-2x faster at 2-9 rows and still ahead at 32;
   AVX2 (4-row tiles) 1.3-1.9x at 2-9 rows, behind from 16. */
#if QUANT_WIDE
#define EXACT_DIRECT_ROWS 32
#else
#define EXACT_DIRECT_ROWS 12
#endif

static __thread float* scratch;
static __thread int64_t scratch_floats;

static void exact_task(exact_job_t* j, int64_t t) {
    const seg_t* segs = j->segs;
    int64_t M = j->M, K = j->K, width = j->width, rows = RUN_ROWS(M), runs = (M + rows - 1) / rows;
    int s = j->S - 1;
    while (segs[s].first > t) s--;
    const seg_t* sg = &segs[s];
    int64_t p0 = ((t - sg->first) / runs) * width, r0 = ((t - sg->first) % runs) * rows;
    int64_t p1 = p0 + width < sg->panels ? p0 + width : sg->panels, r1 = r0 + rows < M ? r0 + rows : M;
    if (M == 1 && p1 - p0 == width) {                /* a decode step's wide group: in registers */
        sg->k->exact_one(j->xf, j->ldf, 0, sg->w + p0 * sg->pstride, sg->pstride, K, &sg->o, p0 * PANEL);
        return;
    }
    if (M <= EXACT_DIRECT_ROWS) {     /* a few rows: in registers, in as few tiles of rows as fit, even */
        int64_t tiles = (r1 - r0 + XMB - 1) / XMB;
        for (int64_t p = p0; p < p1; p += NV)
            for (int64_t m0 = r0, left = tiles; m0 < r1; left--) {
                int64_t mb = (r1 - m0 + left - 1) / left;
                sg->k->exact[mb](j->xf, j->ldf, m0, sg->w + p * sg->pstride, sg->pstride, K, &sg->o, p * PANEL);
                m0 += mb;
            }
        return;
    }
    int64_t need = NV * K * PANEL;
    if (scratch_floats < need) {
        free(scratch);
        scratch = (float*)malloc((size_t)need * sizeof(float));
        scratch_floats = scratch ? need : 0;
        if (!scratch) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    float* wf = scratch;
    for (int64_t p = p0; p < p1; p += NV) {
        for (int64_t q = 0; q < NV; q++)
            dequant_panel(sg->qt, sg->w + (p + q) * sg->pstride, K, wf + q * K * PANEL);
        for (int64_t m0 = r0; m0 < r1; m0 += MBMAX) {
            int64_t mb = r1 - m0 < MBMAX ? r1 - m0 : MBMAX;
            exact_tiles[mb](j->xf, j->ldf, m0, wf, K, &sg->o, p * PANEL);
        }
    }
}

static void exact_tasks(void* ctx, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) exact_task((exact_job_t*)ctx, t);
}

typedef struct { const uint16_t* x; int64_t ldx, K; float* out; } widen_job_t;

static void widen_rows(void* ctx, int64_t m0, int64_t m1) {
    const widen_job_t* j = (const widen_job_t*)ctx;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t k = 0; k < j->K; k += 16)
            pvf_store(j->out + m * j->K + k, pvf_bf16(j->x + m * j->ldx + k));
}

static int run_exact(const seg_t* segs, int S, const void* x, int x_bf16, int64_t ldx, int64_t M, int64_t K,
                     int64_t width, char* work) {
    int want = threads_for(segs, S, M);
    if (x_bf16) {
        widen_job_t w = {(const uint16_t*)x, ldx, K, (float*)work};
        parallel_for(widen_rows, &w, M, M >= 16 ? want : 1);
    }
    exact_job_t j = {segs, S, M, K, width, x_bf16 ? K : ldx, x_bf16 ? (const float*)work : (const float*)x, 0};
    int64_t rows = RUN_ROWS(M), runs = (M + rows - 1) / rows;
    parallel_for(exact_tasks, &j, segs[S - 1].first + (segs[S - 1].panels + width - 1) / width * runs, want);
    return j.failed ? -2 : 0;
}

/* ---- entry points (quant.h) ------------------------------------------------------------------- */
int quant_linear(int S, const int* qts, const uint8_t* const* ws, const int64_t* ns, int exact, const void* x,
                 int x_bf16, int64_t ldx, int64_t M, int64_t K, const float* bias, float* y, uint16_t* ybf,
                 int64_t ldy) {
    if (S < 1 || S > QUANT_MAX_SEGMENTS) return -1;
    seg_t segs[QUANT_MAX_SEGMENTS];
    int64_t width = exact ? (M == 1 ? NV2 : NV) : M == 1 ? NV1 : M == 2 ? NV2 : NV;
    int64_t runs = (M + RUN_ROWS(M) - 1) / RUN_ROWS(M), column = 0, first = 0;
    for (int s = 0; s < S; s++) {
        const kernels_t* k = kernels_of(qts[s]);
        if (!k) return -1;
        int64_t panels = (ns[s] + 2 * PANEL - 1) / (2 * PANEL) * 2;
        out_t o = {y ? y + column : 0, ybf ? ybf + column : 0, ldy, ns[s], bias ? bias + column : 0};
        segs[s] = (seg_t){qts[s], k, ws[s], panel_bytes(qts[s], K), panels, first, o};
        first += (panels + width - 1) / width * runs;
        column += ns[s];
    }
    size_t per_row = exact ? (x_bf16 ? (size_t)K * 4 : 0) : (size_t)(K + K / CHUNK * 4 + K / 16 * 4);
    char* work = per_row ? (char*)malloc((size_t)M * per_row) : 0;
    if (per_row && !work) return -2;
    int status = 0;
    if (exact)
        status = run_exact(segs, S, x, x_bf16, ldx, M, K, width, work);
    else
        run_fast(segs, S, x, x_bf16, ldx, M, K, width, work);
    free(work);
    return status;
}

int quant_dequant_rows(int qt, const uint8_t* w, int64_t K, const int64_t* ids, int64_t R, float* out,
                       uint16_t* outbf) {
    if (!kernels_of(qt)) return -1;
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
