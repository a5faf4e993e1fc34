/* Lane vectors of KV rows stored in llama.cpp's q8_0/q4_0 blocks (a quantized KV cache): each
   block of 32 values is an fp16 scale, then 32 int8 codes (q8_0, 34 bytes) or 16 bytes whose low
   nibbles are values 0..15 and high nibbles 16..31 (q4_0, 18 bytes; value = (nibble - 8) * scale).
   kld8_q8_0(row, c) gives values 8c .. 8c + 7 of the head row at `row` as float32, code times the
   scale widened exactly: the same float32 products as dequantizing the blocks first (the *_bf16
   loaders round them to bfloat16 as well, as dequantizing for a bf16 model does). */
#ifndef STAGEWISE_KV_BLOCKS_H
#define STAGEWISE_KV_BLOCKS_H
#include <stdint.h>
#include <string.h>

#include "vec.h"

typedef int8_t c8 __attribute__((vector_size(8), aligned(1), may_alias));
typedef uint8_t u8x8 __attribute__((vector_size(8), aligned(1), may_alias));
typedef int32_t kv_v8i __attribute__((vector_size(32)));

/* fp16 bits -> float32, exactly (subnormals, infinities and NaNs included) */
static inline float kv_h2f(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {                                      /* zero or subnormal: m * 2^-24, exact */
        float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* values 8c .. 8c + 7 of a q8_0 head row: block c / 4, codes (c % 4) * 8 on */
static inline v8 kld8_q8_0(const uint8_t* row, int64_t c) {
    const uint8_t* blk = row + (c >> 2) * 34;
    v8 codes = __builtin_convertvector(__builtin_convertvector(*(const c8*)(blk + 2 + (c & 3) * 8), kv_v8i), v8);
    return codes * kv_h2f(blk);
}

/* values 8c .. 8c + 7 of a q4_0 head row: block c / 4; within it, values 0..7 and 8..15 are the
   low nibbles of bytes 0..7 and 8..15, values 16..31 the high nibbles of the same bytes */
static inline v8 kld8_q4_0(const uint8_t* row, int64_t c) {
    const uint8_t* blk = row + (c >> 2) * 18;
    u8x8 bytes = *(const u8x8*)(blk + 2 + (c & 1) * 8);
    u8x8 nib = (bytes >> (uint8_t)((c & 2) * 2)) & 15;
    v8 codes = __builtin_convertvector(__builtin_convertvector(nib, kv_v8i) - 8, v8);
    return codes * kv_h2f(blk);
}

/* the same rounded to bfloat16 (to nearest even), as a bf16 model's dense copy of the blocks holds
   them: its kernels then give what they give over that copy, bit for bit */
static inline v8 kv_bf16_round(v8 x) {
    i8 u = (i8)x;
    return (v8)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}
static inline v8 kld8_q8_0_bf16(const uint8_t* row, int64_t c) { return kv_bf16_round(kld8_q8_0(row, c)); }
static inline v8 kld8_q4_0_bf16(const uint8_t* row, int64_t c) { return kv_bf16_round(kld8_q4_0(row, c)); }

/* the cache's row elements (bytes) of one head of D values */
#define ROW_q8_0(D) ((D) / 32 * 34)
#define ROW_q4_0(D) ((D) / 32 * 18)
#endif
