/* The entry points of gemm.c (C, also included by gemm_ops.cpp). bf16 values are uint16_t.
   small_linear_bf16dp and the packed_* functions exist only
   where the build targets their instruction sets (see gemm.c). */
#ifndef STAGEWISE_GEMM_H
#define STAGEWISE_GEMM_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* y [M, N] float32 (row stride ldy) = x [M, K] (row stride ldx) @ w [N, K]^T (+ b [N] float32); K % 8 == 0 */
void small_linear_f32(const float* x, int64_t ldx, const float* w, const float* b, float* y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K);
void small_linear_bf16(const float* x, int64_t ldx, const uint16_t* w, const float* b, float* y, int64_t ldy,
                       int64_t M, int64_t N, int64_t K);
/* bf16 activations too (AVX512-BF16); K % 32 == 0 */
void small_linear_bf16dp(const uint16_t* x, int64_t ldx, const uint16_t* w, const float* b, float* y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K);
/* packed weights (kernels/gemm.py `pack`): float32 panels of packed_f32_panel() columns */
int packed_f32_panel(void);
void packed_linear_f32(const float* x, int64_t ldx, const float* wp, const float* b, float* y, int64_t ldy,
                       int64_t M, int64_t N, int64_t K);
/* bf16 panels of packed_bf16_panel() columns, packed_bf16_pair() k per pair (64 and 2 on
   AVX512-BF16, the float32 panel and 1 elsewhere); output bf16 into y, or float32 into y32 when
   y32 is not NULL */
int packed_bf16_panel(void);
int packed_bf16_pair(void);
void packed_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, const float* b, uint16_t* y, float* y32,
                        int64_t ldy, int64_t M, int64_t N, int64_t K);

#ifdef __cplusplus
}
#endif
#endif
