/* Panel vectors for the quantized kernels: 64 bytes = 16 int32/float lanes = one 16-row panel's
   columns. One implementation per instruction set, chosen when the library is compiled:
   AVX-512 (one zmm; vpdpbusd with AVX512-VNNI, maddubs + madd without), AVX2 (two ymm; maddubs +
   madd, or vpdpbusd with AVX-VNNI) and portable C (GCC vector extensions, scalar dot products).
   The kernels use only these. */
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(QUANT_PORTABLE)
#include <immintrin.h>
#define QUANT_ISA "avx512"
#define QUANT_WIDE 1
#define QUANT_YMM 0
typedef __m512i pvi;        /* 64 bytes / 32 int16 / 16 int32 */
typedef __m512 pvf;         /* 16 floats */
static inline pvi pvi_load(const void* p) { return _mm512_loadu_si512(p); }
static inline pvi pvi_and(pvi a, pvi b) { return _mm512_and_si512(a, b); }
static inline pvi pvi_or(pvi a, pvi b) { return _mm512_or_si512(a, b); }
static inline pvi pvi_xor(pvi a, pvi b) { return _mm512_xor_si512(a, b); }
static inline pvi pvi_srl16(pvi a, int n) { return _mm512_srli_epi16(a, n); }
static inline pvi pvi_sll16(pvi a, int n) { return _mm512_slli_epi16(a, n); }
static inline pvi pvi_srl32(pvi a, int n) { return _mm512_srli_epi32(a, n); }
static inline pvi pvi_byte(int c) { return _mm512_set1_epi8((char)c); }
static inline pvi pvi_set32(int32_t c) { return _mm512_set1_epi32(c); }
static inline pvi pvi_zero(void) { return _mm512_setzero_si512(); }
static inline pvi pvi_sub32(pvi a, pvi b) { return _mm512_sub_epi32(a, b); }
static inline pvf pvi_float(pvi a) { return _mm512_cvtepi32_ps(a); }
/* float(c - offset) per lane, c = the low `bits` bits of the lane (4 or 5: a permute of a table of
   the values; else the bits or'ed into 2^23's mantissa, 2^23 + offset subtracted): exact */
static inline pvf pvf_code(pvi a, int bits, int offset) {
    pvf lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(offset)));
    if (bits == 4) return _mm512_permutexvar_ps(a, lo);
    if (bits == 5) return _mm512_permutex2var_ps(lo, a, _mm512_add_ps(lo, _mm512_set1_ps(16.f)));
    pvi m = _mm512_ternarylogic_epi32(a, _mm512_set1_epi32((1 << bits) - 1), _mm512_set1_epi32(0x4B000000), 0xEA);
    return _mm512_sub_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(8388608.f + (float)offset));
}
#ifdef __AVX512VNNI__
#define QUANT_VNNI 1
/* acc + per lane the sum of 4 products of unsigned w bytes and signed x bytes */
static inline pvi dot4(pvi acc, pvi w, pvi x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
static inline pvi dot4(pvi acc, pvi w, pvi x) {       /* |products| <= 63 * 127 * 2: no saturation */
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
/* acc + sums of 4 products of signed w and x bytes (|x| <= 127): |w| times x with w's sign */
static inline pvi dot4s(pvi acc, pvi w, pvi x) {
    __mmask64 neg = _mm512_movepi8_mask(w);
    pvi sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return dot4(acc, _mm512_abs_epi8(w), sx);
}
#endif
static inline pvf pvf_zero(void) { return _mm512_setzero_ps(); }
static inline pvf pvf_set(float c) { return _mm512_set1_ps(c); }
static inline pvf pvf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void pvf_store(float* p, pvf a) { _mm512_storeu_ps(p, a); }
static inline pvf pvf_add(pvf a, pvf b) { return _mm512_add_ps(a, b); }
static inline pvf pvf_mul(pvf a, pvf b) { return _mm512_mul_ps(a, b); }
static inline pvf pvf_fma(pvf a, pvf b, pvf c) { return _mm512_fmadd_ps(a, b, c); }
static inline pvf pvf_fnma(pvf a, pvf b, pvf c) { return _mm512_fnmadd_ps(a, b, c); }     /* c - a b */
static inline pvf pvf_fms(pvf a, pvf b, pvf c) { return _mm512_fmsub_ps(a, b, c); }      /* a b - c */
static inline pvf pvf_f16(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline pvf pvf_u8(const void* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline pvf pvf_i8(const void* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline pvf pvf_bf16(const void* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
/* 16 E8M0 bytes -> 2^(e - 128) (ggml's halved MXFP4 scale: subnormal below e = 2), exactly */
static inline pvf pvf_e8m0_half(const void* p) {
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}
/* each byte (0 .. 15) -> table[byte] */
static inline pvi pvi_lut16(pvi a, const uint8_t* table) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)table)), a);
}
static inline float pvf_absmax(pvf a) { return _mm512_reduce_max_ps(_mm512_abs_ps(a)); }
/* round to nearest even, store as 16 int8 (|v| <= 127.5 by construction), return their sum */
static inline int32_t pvf_round_i8(pvf v, int8_t* out) {
    __m512i i = _mm512_cvtps_epi32(v);
    _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(i));
    return _mm512_reduce_add_epi32(i);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(QUANT_PORTABLE)
#include <immintrin.h>
#define QUANT_ISA "avx2"
#define QUANT_WIDE 0
#define QUANT_YMM 1
typedef struct { __m256i a, b; } pvi;
typedef struct { __m256 a, b; } pvf;
static inline pvi pvi_load(const void* p) { return (pvi){ _mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1) }; }
static inline pvi pvi_and(pvi x, pvi y) { return (pvi){ _mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b) }; }
static inline pvi pvi_or(pvi x, pvi y) { return (pvi){ _mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b) }; }
static inline pvi pvi_xor(pvi x, pvi y) { return (pvi){ _mm256_xor_si256(x.a, y.a), _mm256_xor_si256(x.b, y.b) }; }
static inline pvi pvi_srl16(pvi x, int n) { return (pvi){ _mm256_srli_epi16(x.a, n), _mm256_srli_epi16(x.b, n) }; }
static inline pvi pvi_sll16(pvi x, int n) { return (pvi){ _mm256_slli_epi16(x.a, n), _mm256_slli_epi16(x.b, n) }; }
static inline pvi pvi_srl32(pvi x, int n) { return (pvi){ _mm256_srli_epi32(x.a, n), _mm256_srli_epi32(x.b, n) }; }
static inline pvi pvi_byte(int c) { __m256i v = _mm256_set1_epi8((char)c); return (pvi){ v, v }; }
static inline pvi pvi_set32(int32_t c) { __m256i v = _mm256_set1_epi32(c); return (pvi){ v, v }; }
static inline pvi pvi_zero(void) { return (pvi){ _mm256_setzero_si256(), _mm256_setzero_si256() }; }
static inline pvi pvi_sub32(pvi x, pvi y) { return (pvi){ _mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b) }; }
static inline pvf pvi_float(pvi x) { return (pvf){ _mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b) }; }
/* float(c - offset) per lane, c = the low `bits` bits of the lane: exact */
static inline pvf pvf_code(pvi x, int bits, int offset) {
    x = pvi_and(x, pvi_set32((1 << bits) - 1));
    return pvi_float(offset ? pvi_sub32(x, pvi_set32(offset)) : x);
}
#ifdef __AVXVNNI__
#define QUANT_VNNI 1         /* AVX-VNNI (Alder Lake, Zen 4 without AVX-512 builds): vpdpbusd on ymm */
static inline __m256i dot4_256(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
static inline __m256i dot4_256(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#endif
static inline pvi dot4(pvi acc, pvi w, pvi x) { return (pvi){ dot4_256(acc.a, w.a, x.a), dot4_256(acc.b, w.b, x.b) }; }
static inline pvi dot4s(pvi acc, pvi w, pvi x) {      /* unused where VNNI keeps Q8_0 codes unsigned */
    return (pvi){ dot4_256(acc.a, _mm256_sign_epi8(w.a, w.a), _mm256_sign_epi8(x.a, w.a)),
                  dot4_256(acc.b, _mm256_sign_epi8(w.b, w.b), _mm256_sign_epi8(x.b, w.b)) };
}
static inline pvf pvf_zero(void) { return (pvf){ _mm256_setzero_ps(), _mm256_setzero_ps() }; }
static inline pvf pvf_set(float c) { __m256 v = _mm256_set1_ps(c); return (pvf){ v, v }; }
static inline pvf pvf_load(const float* p) { return (pvf){ _mm256_loadu_ps(p), _mm256_loadu_ps(p + 8) }; }
static inline void pvf_store(float* p, pvf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline pvf pvf_add(pvf x, pvf y) { return (pvf){ _mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b) }; }
static inline pvf pvf_mul(pvf x, pvf y) { return (pvf){ _mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b) }; }
static inline pvf pvf_fma(pvf x, pvf y, pvf z) { return (pvf){ _mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b) }; }
static inline pvf pvf_fnma(pvf x, pvf y, pvf z) { return (pvf){ _mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b) }; }
static inline pvf pvf_fms(pvf x, pvf y, pvf z) { return (pvf){ _mm256_fmsub_ps(x.a, y.a, z.a), _mm256_fmsub_ps(x.b, y.b, z.b) }; }
static inline pvf pvf_f16(const void* p) {
    const __m128i* h = (const __m128i*)p;
    return (pvf){ _mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1)) };
}
static inline pvf pvf_u8(const void* p) {
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    return (pvf){ _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))) };
}
static inline pvf pvf_i8(const void* p) {
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    return (pvf){ _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))) };
}
static inline __m256 bf16_8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline pvf pvf_bf16(const void* p) { return (pvf){ bf16_8((const uint16_t*)p), bf16_8((const uint16_t*)p + 8) }; }
static inline __m256 e8m0_half_8(__m128i b) {
    __m256i e = _mm256_cvtepu8_epi32(b);
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
/* 16 E8M0 bytes -> 2^(e - 128) (ggml's halved MXFP4 scale: subnormal below e = 2), exactly */
static inline pvf pvf_e8m0_half(const void* p) {
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    return (pvf){ e8m0_half_8(b), e8m0_half_8(_mm_srli_si128(b, 8)) };
}
/* each byte (0 .. 15) -> table[byte] */
static inline pvi pvi_lut16(pvi x, const uint8_t* table) {
    __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)table));
    return (pvi){ _mm256_shuffle_epi8(t, x.a), _mm256_shuffle_epi8(t, x.b) };
}
static inline float pvf_absmax(pvf x) {
    __m256 m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), x.a), _mm256_andnot_ps(_mm256_set1_ps(-0.f), x.b));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
static inline int32_t pvf_round_i8(pvf x, int8_t* out) {
    int32_t v[16], sum = 0;
    _mm256_storeu_si256((__m256i*)v, _mm256_cvtps_epi32(x.a));
    _mm256_storeu_si256((__m256i*)(v + 8), _mm256_cvtps_epi32(x.b));
    for (int l = 0; l < 16; l++) { out[l] = (int8_t)v[l]; sum += v[l]; }
    return sum;
}

#else
#define QUANT_ISA "portable"
#pragma GCC diagnostic ignored "-Wpsabi"     /* 64-byte vectors between inlined helpers only */
#define QUANT_WIDE 0
#define QUANT_YMM 0
typedef uint8_t pvi __attribute__((vector_size(64)));
typedef float pvf __attribute__((vector_size(64)));
typedef int32_t pv32 __attribute__((vector_size(64)));
typedef uint16_t pv16 __attribute__((vector_size(64)));
static inline pvi pvi_load(const void* p) { pvi v; memcpy(&v, p, 64); return v; }
static inline pvi pvi_and(pvi a, pvi b) { return a & b; }
static inline pvi pvi_or(pvi a, pvi b) { return a | b; }
static inline pvi pvi_xor(pvi a, pvi b) { return a ^ b; }
static inline pvi pvi_srl16(pvi a, int n) { return (pvi)((pv16)a >> n); }
static inline pvi pvi_sll16(pvi a, int n) { return (pvi)((pv16)a << n); }
static inline pvi pvi_srl32(pvi a, int n) { return (pvi)((uint32_t __attribute__((vector_size(64))))a >> n); }
static inline pvi pvi_byte(int c) { return (pvi){} + (uint8_t)c; }
static inline pvi pvi_set32(int32_t c) { return (pvi)((pv32){} + c); }
static inline pvi pvi_zero(void) { return (pvi){}; }
static inline pvi pvi_sub32(pvi a, pvi b) { return (pvi)((pv32)a - (pv32)b); }
static inline pvf pvi_float(pvi a) {
    pv32 v = (pv32)a; pvf r;
    for (int l = 0; l < 16; l++) r[l] = (float)v[l];
    return r;
}
/* float(c - offset) per lane, c = the low `bits` bits of the lane: exact */
static inline pvf pvf_code(pvi a, int bits, int offset) {
    return pvi_float(pvi_sub32(pvi_and(a, pvi_set32((1 << bits) - 1)), pvi_set32(offset)));
}
#if defined(__clang__) || __GNUC__ >= 12      /* __builtin_shufflevector */
typedef int8_t pv8s __attribute__((vector_size(64)));
typedef int16_t pv16s __attribute__((vector_size(128)));
typedef int16_t pv16s16 __attribute__((vector_size(32)));
/* whole-vector operations, so the compiler uses the target's own vectors (NEON, SSE2, ...): 64
   int16 products (|w x| <= 255 * 127 fits), then each lane's 4 products summed in int32 (one
   thread, 2048x2048 here: 3.7x the speed of lane loops at one row, 8x at 32 rows) */
static inline pvi sum4(pvi acc, pv16s p) {
#define LANES(i) __builtin_shufflevector(p, p, i, 4 + i, 8 + i, 12 + i, 16 + i, 20 + i, 24 + i, 28 + i, 32 + i, \
                                         36 + i, 40 + i, 44 + i, 48 + i, 52 + i, 56 + i, 60 + i)
    pv16s16 p0 = LANES(0), p1 = LANES(1), p2 = LANES(2), p3 = LANES(3);
#undef LANES
    return (pvi)((pv32)acc + __builtin_convertvector(p0, pv32) + __builtin_convertvector(p1, pv32)
                 + __builtin_convertvector(p2, pv32) + __builtin_convertvector(p3, pv32));
}
static inline pvi dot4(pvi acc, pvi w, pvi x) {
    return sum4(acc, __builtin_convertvector(w, pv16s) * __builtin_convertvector((pv8s)x, pv16s));
}
static inline pvi dot4s(pvi acc, pvi w, pvi x) {
    return sum4(acc, __builtin_convertvector((pv8s)w, pv16s) * __builtin_convertvector((pv8s)x, pv16s));
}
#else
static inline pvi dot4(pvi acc, pvi w, pvi x) {
    pv32 r = (pv32)acc;
    for (int l = 0; l < 16; l++)
        for (int i = 0; i < 4; i++) r[l] += (int32_t)w[4 * l + i] * (int8_t)x[4 * l + i];
    return (pvi)r;
}
static inline pvi dot4s(pvi acc, pvi w, pvi x) {
    pv32 r = (pv32)acc;
    for (int l = 0; l < 16; l++)
        for (int i = 0; i < 4; i++) r[l] += (int8_t)w[4 * l + i] * (int8_t)x[4 * l + i];
    return (pvi)r;
}
#endif
static inline pvf pvf_zero(void) { return (pvf){}; }
static inline pvf pvf_set(float c) { return (pvf){} + c; }
static inline pvf pvf_load(const float* p) { pvf v; memcpy(&v, p, 64); return v; }
static inline void pvf_store(float* p, pvf a) { memcpy(p, &a, 64); }
static inline pvf pvf_add(pvf a, pvf b) { return a + b; }
static inline pvf pvf_mul(pvf a, pvf b) { return a * b; }
static inline pvf pvf_fma(pvf a, pvf b, pvf c) {     /* fused, as the vector builds: exact products */
    pvf r;
    for (int l = 0; l < 16; l++) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
}
static inline pvf pvf_fnma(pvf a, pvf b, pvf c) {
    pvf r;
    for (int l = 0; l < 16; l++) r[l] = __builtin_fmaf(-a[l], b[l], c[l]);
    return r;
}
static inline pvf pvf_fms(pvf a, pvf b, pvf c) {
    pvf r;
    for (int l = 0; l < 16; l++) r[l] = __builtin_fmaf(a[l], b[l], -c[l]);
    return r;
}
static inline float half_float(uint16_t h) {         /* IEEE binary16 -> binary32, exactly */
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31)
        bits = sign | 0x7F800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else {
        float f = (float)man * (1.0f / 16777216.0f);    /* subnormal: man * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float r;
    memcpy(&r, &bits, 4);
    return r;
}
static inline pvf pvf_f16(const void* p) {
    uint16_t h[16]; pvf r;
    memcpy(h, p, 32);
    for (int l = 0; l < 16; l++) r[l] = half_float(h[l]);
    return r;
}
static inline pvf pvf_u8(const void* p) { pvf r; for (int l = 0; l < 16; l++) r[l] = ((const uint8_t*)p)[l]; return r; }
static inline pvf pvf_i8(const void* p) { pvf r; for (int l = 0; l < 16; l++) r[l] = ((const int8_t*)p)[l]; return r; }
static inline pvf pvf_bf16(const void* p) {
    uint16_t h[16]; pvf r;
    memcpy(h, p, 32);
    for (int l = 0; l < 16; l++) { uint32_t b = (uint32_t)h[l] << 16; memcpy(&r[l], &b, 4); }
    return r;
}
/* 16 E8M0 bytes -> 2^(e - 128) (ggml's halved MXFP4 scale: subnormal below e = 2), exactly */
static inline pvf pvf_e8m0_half(const void* p) {
    pvf r;
    for (int l = 0; l < 16; l++) {
        uint32_t e = ((const uint8_t*)p)[l], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
        memcpy(&r[l], &bits, 4);
    }
    return r;
}
/* each byte (0 .. 15) -> table[byte] */
static inline pvi pvi_lut16(pvi a, const uint8_t* table) {
    pvi r;
    for (int i = 0; i < 64; i++) r[i] = table[a[i] & 15];
    return r;
}
static inline float pvf_absmax(pvf a) {
    float m = 0.f;
    for (int l = 0; l < 16; l++) { float v = a[l] < 0 ? -a[l] : a[l]; m = v > m ? v : m; }
    return m;
}
static inline int32_t pvf_round_i8(pvf a, int8_t* out) {
    int32_t sum = 0;
    for (int l = 0; l < 16; l++) { int32_t v = (int32_t)__builtin_lrintf(a[l]); out[l] = (int8_t)v; sum += v; }
    return sum;
}
#endif

/* float32 -> bfloat16, rounding to nearest even as torch does (NaN stays NaN) */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}
static inline void pvf_store_bf16(uint16_t* p, pvf a, int count) {
    float f[16];
    pvf_store(f, a);
    for (int l = 0; l < count; l++) p[l] = bf16_round(f[l]);
}
