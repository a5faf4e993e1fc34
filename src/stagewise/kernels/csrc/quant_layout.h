/* Navigating a packed panel (16 rows; layout described in quant_pack.py): where a chunk's scales
   and codes lie, the 64-byte code operand of one group of 4 k's, and a chunk's float values. */
#pragma once
#include "quant_simd.h"

#define INLINE_L static inline __attribute__((always_inline))
#define PANEL 16        /* rows (output columns) per panel */
#define CHUNK 32        /* k per chunk */

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };  /* ggml's ids */

INLINE_L int is_k(int qt) { return qt == Q4_K || qt == Q5_K || qt == Q6_K; }
INLINE_L int has_min(int qt) { return qt == Q4_1 || qt == Q5_1; }
INLINE_L int code_bits(int qt) {
    return qt == Q8_0 ? 8 : qt == Q6_K ? 6 : (qt == Q5_0 || qt == Q5_1 || qt == Q5_K) ? 5 : 4;
}
INLINE_L int64_t code_bytes(int qt) { return code_bits(qt) == 8 ? 512 : code_bits(qt) == 6 ? 384 : code_bits(qt) == 5 ? 320 : 256; }
/* scales before each chunk (32-block types; MXFP4: its E8M0 bytes) or each 256 (K types) */
INLINE_L int64_t head_bytes(int qt) {
    return (qt == Q4_K || qt == Q5_K) ? 320 : qt == Q6_K ? 288 : has_min(qt) ? 64 : qt == MXFP4 ? 16 : 32;
}
static inline int64_t panel_bytes(int qt, int64_t K) {
    if (is_k(qt)) return K / 256 * head_bytes(qt) + K / CHUNK * code_bytes(qt);
    return K / CHUNK * (head_bytes(qt) + code_bytes(qt));
}
int64_t quant_panel_bytes(int qt, int64_t K) { return panel_bytes(qt, K); }

INLINE_L const uint8_t* chunk_head(int qt, const uint8_t* panel, int64_t c) {
    if (is_k(qt)) return panel + (c / 8) * (head_bytes(qt) + 8 * code_bytes(qt));
    return panel + c * (head_bytes(qt) + code_bytes(qt));
}
INLINE_L const uint8_t* chunk_codes(int qt, const uint8_t* panel, int64_t c) {
    return chunk_head(qt, panel, c) + head_bytes(qt) + (is_k(qt) ? (c % 8) * code_bytes(qt) : 0);
}

/* Chunk c's per-column scales: d (and m) for the 32-block types; for Q4_K/Q5_K d * sc and
   dmin * min of the chunk's sub-block; for Q6_K d * sc of its two halves (dw, dw2); for MXFP4
   2^(e - 128), ggml's halved scale of its doubled E2M1 values (a power of two: held exactly). */
INLINE_L void chunk_scales(int qt, const uint8_t* panel, int64_t c, pvf* dw, pvf* mw, pvf* dw2) {
    const uint8_t* head = chunk_head(qt, panel, c);
    int64_t sub = c % 8;
    if (qt == Q4_K || qt == Q5_K) {
        *dw = pvf_mul(pvf_f16(head), pvf_u8(head + 64 + 16 * sub));
        *mw = pvf_mul(pvf_f16(head + 32), pvf_u8(head + 192 + 16 * sub));
    } else if (qt == Q6_K) {
        pvf d = pvf_f16(head);
        *dw = pvf_mul(d, pvf_i8(head + 32 + 32 * sub));
        *dw2 = pvf_mul(d, pvf_i8(head + 48 + 32 * sub));
    } else if (qt == MXFP4) {
        *dw = pvf_e8m0_half(head);
    } else {
        *dw = pvf_f16(head);
        if (has_min(qt)) *mw = pvf_f16(head + 32);
    }
}

/* MXFP4's E2M1 codes -> their doubled values (ggml's kvalues_mxfp4) + 12: unsigned bytes for the
   integer dot products, 12 * sum(x) taken off as a Q4_0 code's 8 is */
static const uint8_t MXFP4_BYTES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* The codes (unsigned, as stored; MXFP4: its values + 12) of group g (k = 4g .. 4g+3 of the chunk)
   for 16 columns: byte 4r + i = column r's code at k = 4g + i. */
INLINE_L pvi chunk_operand(int qt, const uint8_t* codes, int g) {
    if (code_bits(qt) == 8) return pvi_load(codes + 64 * g);
    pvi v = pvi_load(codes + 64 * (g & 3)), low = pvi_byte(15);
    pvi q = g < 4 ? pvi_and(v, low) : pvi_and(pvi_srl16(v, 4), low);
    if (code_bits(qt) == 5) {              /* bit g of each byte -> bit 4 */
        pvi h = pvi_load(codes + 256);
        h = g <= 4 ? pvi_sll16(h, 4 - g) : pvi_srl16(h, g - 4);
        q = pvi_or(q, pvi_and(h, pvi_byte(0x10)));
    } else if (code_bits(qt) == 6) {       /* bits 2t, 2t+1 of vector g / 4 -> bits 4, 5 */
        int t = g & 3;
        pvi h = pvi_load(codes + 256 + 64 * (g >> 2));
        h = t <= 2 ? pvi_sll16(h, 4 - 2 * t) : pvi_srl16(h, 2);
        q = pvi_or(q, pvi_and(h, pvi_byte(0x30)));
    } else if (qt == MXFP4) {
        q = pvi_lut16(q, MXFP4_BYTES);
    }
    return q;
}

/* What a type's codes are offset by: value = d (code - offset) */
INLINE_L int code_offset(int qt) {
    return qt == Q4_0 ? 8 : qt == Q5_0 ? 16 : qt == Q8_0 ? 128 : qt == Q6_K ? 32 : qt == MXFP4 ? 12 : 0;
}
/* Bits of an operand byte that hold its code (MXFP4's looked-up values reach 24: 5 bits) */
INLINE_L int operand_bits(int qt) { return qt == MXFP4 ? 5 : code_bits(qt); }

/* The values of 16 columns at k = 4g + i of a chunk from f = float(code - offset) and the chunk's
   scales, each computed as gguf-py computes it (the products are exact in float32, so one fused
   rounding equals its separate ones): the one place a weight's float value is written. */
INLINE_L pvf scaled_value(int qt, pvf f, int g, pvf dw, pvf mw, pvf dw2) {
    if (has_min(qt)) return pvf_fma(f, dw, mw);                      /* d q + m */
    if (qt == Q4_K || qt == Q5_K) return pvf_fms(f, dw, mw);         /* (d sc) q - dmin m */
    return pvf_mul(f, qt == Q6_K && g >= 4 ? dw2 : dw);
}

/* ... from the operand `op` of group g */
INLINE_L pvf code_value(int qt, pvi op, int g, int i, pvf dw, pvf mw, pvf dw2) {
    return scaled_value(qt, pvf_code(pvi_srl32(op, 8 * i), operand_bits(qt), code_offset(qt)), g, dw, mw, dw2);
}

/* Types whose codes can be read in place (code_lanes): 4 and 8 bits, no high bits elsewhere */
INLINE_L int codes_in_place(int qt) { return qt == Q4_0 || qt == Q4_1 || qt == Q4_K || qt == Q8_0; }
/* For those: 16 lanes whose low code_bits(qt) bits are the codes at k = 4g + i (the bits above are
   left as they come: `pvf_code` ignores them). A low nibble or a byte is read i bytes further on,
   so that lane r starts at byte 4r + i and needs no shift (the load may cross a cache line, which
   costs less than the shift); a high nibble shifts by 8i + 4 anyway, so it is read where its
   vector starts. `tail`: the chunk may end the buffer, so nothing is read past its last vector. */
INLINE_L pvi code_lanes(int qt, const uint8_t* codes, int g, int i, int tail) {
    int64_t at = code_bits(qt) == 8 ? 64 * g : 64 * (g & 3);
    int high = code_bits(qt) == 4 && g >= 4;
    if (tail || high) return pvi_srl32(pvi_load(codes + at), 8 * i + 4 * high);
    return pvi_load(codes + at + i);
}

/* Chunk c of a panel -> out [32][16] float32 */
INLINE_L void dequant_chunk(int qt, const uint8_t* panel, int64_t c, float* out) {
    pvf dw, mw = pvf_zero(), dw2 = pvf_zero();
    chunk_scales(qt, panel, c, &dw, &mw, &dw2);
    const uint8_t* codes = chunk_codes(qt, panel, c);
    for (int g = 0; g < 8; g++) {
        pvi op = chunk_operand(qt, codes, g);
        for (int i = 0; i < 4; i++) pvf_store(out + (4 * g + i) * PANEL, code_value(qt, op, g, i, dw, mw, dw2));
    }
}
