/* The entry points of rope.c (C, also included by rope_ops.cpp). bf16 values are uint16_t. */
#ifndef STAGEWISE_ROPE_H
#define STAGEWISE_ROPE_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Rope on the q and k heads of `rows` rows of a fused qkv projection, qkv [rows, (hq + 2 hkv) d]
   (row stride qkv_row): the q heads of each row go to q_out [rows, hq, d] and its k heads to
   k_out [rows, hkv, d] (both contiguous) as `x * cos + swap(x) * sin`, swap(x) = [x2, x1] (the halves
   exchanged), with cos / sin [rows, d] (row stride cs_row) the full-width tables with the
   rotate-half sign folded into sin (model/layers.py `RotaryEmbedding.tables`).
   float32: each multiply and the add rounded once, as PyTorch's eager ops (no FMA contraction);
   bfloat16: each product and the sum rounded to bfloat16 (round to nearest even), as PyTorch's.
   Where cache is not NULL, the first nslots rows' roped k heads and v heads (qkv's last hkv d
   values) are also written into the paged cache [2, cache_slots, hkv, d] (contiguous: K then V)
   at slots[i]; nothing else of it changes. Returns -1, or, where a slot lies outside
   0 .. cache_slots - 1, the index of the first such slot: then nothing is written at all. */
#define STAGEWISE_ROPE_ARGS(T)                                                                      \
    const T* qkv, int64_t qkv_row, const T* cos, const T* sin, int64_t cs_row, T* q_out, T* k_out,  \
    int64_t rows, int64_t hq, int64_t hkv, int64_t d, T* cache, int64_t cache_slots,                 \
    const int64_t* slots, int64_t nslots
int64_t rope_kv_f32(STAGEWISE_ROPE_ARGS(float));
int64_t rope_kv_bf16(STAGEWISE_ROPE_ARGS(uint16_t));

#ifdef __cplusplus
}
#endif
#endif
