/* The entry points of norm.c (C, also included by norm_ops.cpp). bf16 values are uint16_t. */
#ifndef STAGEWISE_NORM_H
#define STAGEWISE_NORM_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* RMSNorm of `rows` rows of n values, each row on its own: x [rows, n] (row stride x_row), with
   res [rows, n] (row stride res_row) added first where res is not NULL; the sum s goes to
   sum (row stride sum_row) where sum is not NULL; out [rows, n] (row stride out_row).
   float32: out = (s * rsqrt(mean(s^2) + eps)) * w.
   bfloat16: s = bf16(x + res), normed = bf16(s * rsqrt(mean(s^2) + eps)), out = bf16(w * normed)
   (HF's rounding points). Sums of squares in float32 in PyTorch's own order for its vector width
   (norm_set_lanes): PyTorch's bits, on every build (AVX-512, AVX2, portable). */
#define STAGEWISE_NORM_ARGS(T)                                                                      \
    const T* x, int64_t x_row, const T* res, int64_t res_row, const T* w, T* out, int64_t out_row,  \
    T* sum, int64_t sum_row, int64_t rows, int64_t n, float eps
/* PyTorch's vector width for float sums: 16 (its AVX-512 kernels) or 8 (the default) */
void norm_set_lanes(int lanes);
void rms_norm_f32(STAGEWISE_NORM_ARGS(float));
void rms_norm_bf16(STAGEWISE_NORM_ARGS(uint16_t));

#ifdef __cplusplus
}
#endif
#endif
