/* The entry points of quant.c (C, also included by quant_ops.cpp). Weights are packed panels
   (kernels/quant_pack.py); bf16 values are uint16_t; qt is ggml's type id. */
#ifndef STAGEWISE_QUANT_H
#define STAGEWISE_QUANT_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define QUANT_MAX_SEGMENTS 8

/* split calls over the kernel team (team.h's sw_team_for_fn); NULL: over OpenMP */
void quant_set_team(void* team_for);

/* 1 for the types with kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) */
int quant_supported(int qt);
/* bytes of one 16-row panel of K columns */
int64_t quant_panel_bytes(int qt, int64_t K);
/* y [M, sum ns] (float32 y or bfloat16 ybf, row stride ldy) = x [M, K] (float32 or bfloat16, row
   stride ldx) @ [W_0; ...; W_{S-1}]^T (+ bias float32 [sum ns]); 0, -1 bad type or S, -2 no memory */
int quant_linear(int S, const int* qts, const uint8_t* const* ws, const int64_t* ns, int exact, const void* x,
                 int x_bf16, int64_t ldx, int64_t M, int64_t K, const float* bias, float* y, uint16_t* ybf,
                 int64_t ldy);
/* rows ids [R] (checked by the caller) -> out [R, K] float32, or bfloat16 into outbf */
int quant_dequant_rows(int qt, const uint8_t* w, int64_t K, const int64_t* ids, int64_t R, float* out,
                       uint16_t* outbf);

#ifdef __cplusplus
}
#endif
#endif
