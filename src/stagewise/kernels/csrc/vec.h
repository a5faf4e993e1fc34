/* Vector helpers every kernel shares (C11 + GCC vector extensions, built with -march=native).

   ISA is picked at build time: code under `#ifdef __AVX512F__` / `__AVX512BF16__` / `__AVX2__` is
   the fast path where the compiler targets those instructions, and every kernel also has a
   portable path (or is absent where its ISA is, which `isa.c` reports to the loader).
   8-lane float vectors, exact bf16 widening, a fused multiply-add where the CPU has FMA and a
   horizontal sum in a fixed order (a kernel's results never depend on how work was split). */
#ifndef STAGEWISE_VEC_H
#define STAGEWISE_VEC_H
#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t h8u __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t i8 __attribute__((vector_size(32)));
typedef float f32_t;
typedef uint16_t bf16_t;

static inline v8 ld_f32(const float* p) { return *(const v8u*)p; }
/* bfloat16 is the top half of a float32: widen and shift, exactly */
#ifdef __AVX2__
#include <immintrin.h>
static inline v8 ld_bf16(const uint16_t* p) {      /* one zero-extending load and a shift */
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
#else
static inline v8 ld_bf16(const uint16_t* p) { return (v8)(__builtin_convertvector(*(const h8u*)p, i8) << 16); }
#endif
#ifdef __FMA__
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }     /* never contracted (-std=c11) */
#endif
static inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

#include <string.h>
/* float32 -> bfloat16, round to nearest even (NaN stays NaN) */
static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);      /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);                                                /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* The AVX512-BF16 tile of the packed linear layers and the prefill attention: MB rows of bf16 x
   (row stride ldx) against NV vectors of 16 columns whose (k, k+1) weight pairs lie at
   w + kp * kstride + j * jstride, into float32 acc[MB][NV]: each row's pair broadcast, exact
   products (vdpbf16ps), float32 sums over k in order. Kernels include immintrin.h and string.h. */
#define BF16_TILE_ACC(MB, NV, x, ldx, w, kstride, jstride, npairs, acc)                          \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < NV; j++) acc[m][j] = _mm512_setzero_ps();                           \
    for (int64_t kp = 0; kp < (npairs); kp++) {                                                 \
        __m512bh wv_[NV];                                                                       \
        for (int j = 0; j < NV; j++) wv_[j] = (__m512bh)_mm512_loadu_si512((w) + kp * (kstride) + j * (jstride)); \
        for (int m = 0; m < MB; m++) {                                                          \
            int32_t pair_;                                                                      \
            memcpy(&pair_, (x) + m * (ldx) + 2 * kp, 4);                                        \
            __m512bh xb_ = (__m512bh)_mm512_set1_epi32(pair_);                                  \
            for (int j = 0; j < NV; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb_, wv_[j]);  \
        }                                                                                       \
    }

#endif
