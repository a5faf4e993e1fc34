/* The entry points of attention.c (C, also included by attention_ops.cpp). bf16 values are
   uint16_t. The 16-lane decode kernels exist on AVX-512 builds, prefill_attention_bf16 on
   AVX512-BF16 builds only. */
#ifndef STAGEWISE_ATTENTION_H
#define STAGEWISE_ATTENTION_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* q [G, Hq, D] (row stride q_row), keys and values [num_blocks, bs, Hkv, D] (blk_stride apart),
   block tables [G, nblk] (row stride tab_stride), seq_lens [G] -> out [G, Hq, D]; hpt KV heads
   per task (Hkv or 1). Returns 0, or 1 + the first sequence whose length or blocks are out of
   range (nothing is read then). */
#define STAGEWISE_DECODE_ARGS(T)                                                                    \
    const T* q, int64_t q_row, const T* k, const T* v, int64_t blk_stride, int64_t num_blocks,      \
    const int64_t* tables, int64_t tab_stride, int64_t nblk, const int64_t* seq_lens, int64_t G,    \
    int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t hpt, T* out
int64_t decode_attention_f32(STAGEWISE_DECODE_ARGS(float));
int64_t decode_attention_bf16(STAGEWISE_DECODE_ARGS(uint16_t));
int64_t decode_attention16_f32(STAGEWISE_DECODE_ARGS(float));
int64_t decode_attention16_bf16(STAGEWISE_DECODE_ARGS(uint16_t));
/* The same over a cache of llama.cpp's q8_0/q4_0 blocks (kv_blocks.h): keys and values uint8 [num_blocks,
   bs, Hkv, D / 32 * 34 or 18] (blk_stride bytes apart), dequantized a tile at a time. */
#define STAGEWISE_QDECODE_ARGS(T)                                                                   \
    const T* q, int64_t q_row, const uint8_t* k, const uint8_t* v, int64_t blk_stride, int64_t num_blocks, \
    const int64_t* tables, int64_t tab_stride, int64_t nblk, const int64_t* seq_lens, int64_t G,    \
    int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t hpt, T* out
int64_t decode_attention_f32_q8_0(STAGEWISE_QDECODE_ARGS(float));
int64_t decode_attention_bf16_q8_0(STAGEWISE_QDECODE_ARGS(uint16_t));
int64_t decode_attention16_f32_q8_0(STAGEWISE_QDECODE_ARGS(float));
int64_t decode_attention16_bf16_q8_0(STAGEWISE_QDECODE_ARGS(uint16_t));
int64_t decode_attention_f32_q4_0(STAGEWISE_QDECODE_ARGS(float));
int64_t decode_attention_bf16_q4_0(STAGEWISE_QDECODE_ARGS(uint16_t));
int64_t decode_attention16_f32_q4_0(STAGEWISE_QDECODE_ARGS(float));
int64_t decode_attention16_bf16_q4_0(STAGEWISE_QDECODE_ARGS(uint16_t));
/* The same per row, for rows in spans that share a block table: rows spans[s] .. spans[s + 1]
   (at most 64) read table row s; seq_lens [G] is per row. A row's result is the bits the decode
   entry gives it alone. Returns 0, or 1 + the first span whose rows, lengths or blocks are out of
   range (nothing is read then). */
#define STAGEWISE_ROWS_ARGS(T)                                                                      \
    const T* q, int64_t q_row, const T* k, const T* v, int64_t blk_stride, int64_t num_blocks,      \
    const int64_t* tables, int64_t tab_stride, int64_t nblk, const int64_t* seq_lens, int64_t G,    \
    const int64_t* spans, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,   \
    int64_t hpt, T* out
int64_t decode_attention_f32_rows(STAGEWISE_ROWS_ARGS(float));
int64_t decode_attention_bf16_rows(STAGEWISE_ROWS_ARGS(uint16_t));
int64_t decode_attention16_f32_rows(STAGEWISE_ROWS_ARGS(float));
int64_t decode_attention16_bf16_rows(STAGEWISE_ROWS_ARGS(uint16_t));
/* causal attention of one fresh prompt: q [n, Hq, D] (row stride q_row), k, v [n, Hkv, D] (row
   stride kv_row) -> out [n, Hq, D] (row stride o_row); D % 16 == 0 */
void prefill_attention_bf16(const uint16_t* q, int64_t q_row, const uint16_t* k, const uint16_t* v, int64_t kv_row,
                            int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale, uint16_t* out, int64_t o_row);

#ifdef __cplusplus
}
#endif
#endif
