// Vector math shared by the CPU kernels: AVX2 where the build has it (-march=native on
// a CPU with AVX2 and FMA defines INFLIGHT_AVX2), 16-lane loads where it has AVX-512
// (INFLIGHT_AVX512), AVX-512 BF16 dot products where it has those too
// (INFLIGHT_AVX512BF16), plain loops otherwise.
//
// Element types: float, and bfloat16 (`bf16`, the top 16 bits of a float). bfloat16 is
// only a storage type here: it is widened to fp32 on load (a 16-bit shift), all
// arithmetic is fp32, and results are rounded to nearest-even on store.
#pragma once

#include <cstdint>
#include <cstring>

struct bf16 {
    uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
    const uint32_t u = (uint32_t)x.bits << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Round to nearest even; a NaN stays a (quiet) NaN.
inline bf16 to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16{(uint16_t)(u >> 16)};
}

inline void store_float(float* p, float x) { *p = x; }
inline void store_float(bf16* p, float x) { *p = to_bf16(x); }

// x as the element type T would hold it, back in fp32 (identity for float).
inline float rounded_as(float x, const float*) { return x; }
inline float rounded_as(float x, const bf16*) { return to_float(to_bf16(x)); }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INFLIGHT_AVX2 1
#if defined(__AVX512F__)
#define INFLIGHT_AVX512 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512F__)
#define INFLIGHT_AVX512BF16 1
#endif

// e^x, 8 at a time, for x in [-87, 88] (clamped there): x = n ln2 + r with |r| <= ln2/2,
// e^r by the Cephes polynomial, 2^n by building the exponent bits. Relative error about
// 2e-7 (below 2 ulp); inputs under -87 give about 1.6e-38 where std::exp gives less.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// Eight elements widened to fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#ifdef INFLIGHT_AVX512
// Sixteen elements widened to fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// exp8's operations on sixteen lanes: lane for lane the same results.
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

// bf16_bits8 on sixteen lanes.
inline __m512i bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet_nan);
}

// store8 and rounded_as8 on sixteen lanes (the same roundings).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
#ifdef INFLIGHT_AVX512BF16
    const __m256bh packed = _mm512_cvtneps_pbh(v);
    std::memcpy(p, &packed, 32);
#else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
#endif
}
inline __m512 rounded_as16(__m512 v, const float*) { return v; }
inline __m512 rounded_as16(__m512 v, const bf16*) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
#endif

// Eight fp32 values rounded to nearest even as bfloat16 bits, in the low 16 bits of each lane.
inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
#ifdef INFLIGHT_AVX512BF16
    const __m128bh packed = _mm256_cvtneps_pbh(v);
    std::memcpy(p, &packed, 16);
#else
    const __m256i bits = bf16_bits8(v);
    // Pack the eight 32-bit lanes' low halves in order (packus works within 128-bit lanes).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
#endif
}

// v as the element type T would hold it, back in fp32 (identity for float).
inline __m256 rounded_as8(__m256 v, const float*) { return v; }
inline __m256 rounded_as8(__m256 v, const bf16*) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

#endif
