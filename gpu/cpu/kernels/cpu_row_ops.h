// One row of the element-wise model operations, shared by the fused operations
// (`cpu_fused_ops.cpp`) and the int4 decode stack (`cpu_int4_decode.cpp`). Arithmetic in
// fp32, as HF's modules do it; in bfloat16, results are rounded to bfloat16 where HF's
// modules round them. Sixteen lanes at a time with AVX-512, then eight with AVX2, then
// one: each lane computes what the scalar loop computes.
#pragma once

#include <cmath>

#include "cpu_vector_math.h"

// HF: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the product in the weight's dtype;
// in float32 both roundings are no-ops.
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int dim, float eps) {
    int i = 0;
    float sum = 0.0f;
#ifdef INFLIGHT_AVX512
    __m512 sum16 = _mm512_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
        const __m512 v = load16(x + i);
        sum16 = _mm512_fmadd_ps(v, v, sum16);
    }
    sum = _mm512_reduce_add_ps(sum16);
#endif
#ifdef INFLIGHT_AVX2
    __m256 sum8 = _mm256_setzero_ps();
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = load8(x + i);
        sum8 = _mm256_fmadd_ps(v, v, sum8);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum8);
    for (float lane : lanes) sum += lane;
#endif
    for (; i < dim; ++i) sum += to_float(x[i]) * to_float(x[i]);
    const float inv = 1.0f / std::sqrt(sum / dim + eps);
    i = 0;
#ifdef INFLIGHT_AVX512
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (; i + 16 <= dim; i += 16)
        store16(out + i, _mm512_mul_ps(load16(weight + i), rounded_as16(_mm512_mul_ps(load16(x + i), inv16), out)));
#endif
#ifdef INFLIGHT_AVX2
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (; i + 8 <= dim; i += 8)
        store8(out + i, _mm256_mul_ps(load8(weight + i), rounded_as8(_mm256_mul_ps(load8(x + i), inv8), out)));
#endif
    for (; i < dim; ++i) store_float(out + i, to_float(weight[i]) * rounded_as(to_float(x[i]) * inv, out));
}

// HF's residual add, in place: hidden = (hidden + delta) in the activations' dtype.
template <typename T>
void add_row(T* hidden, const T* delta, int dim) {
    int i = 0;
#ifdef INFLIGHT_AVX512
    for (; i + 16 <= dim; i += 16) store16(hidden + i, _mm512_add_ps(load16(hidden + i), load16(delta + i)));
#endif
#ifdef INFLIGHT_AVX2
    for (; i + 8 <= dim; i += 8) store8(hidden + i, _mm256_add_ps(load8(hidden + i), load8(delta + i)));
#endif
    for (; i < dim; ++i) store_float(hidden + i, to_float(hidden[i]) + to_float(delta[i]));
}

// HF: act_fn(gate) * up, SiLU's result in the activations' dtype.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int dim) {
    int i = 0;
#ifdef INFLIGHT_AVX512
    const __m512 one16 = _mm512_set1_ps(1.0f);
    for (; i + 16 <= dim; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one16, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(out + i, _mm512_mul_ps(rounded_as16(silu, out), load16(up + i)));
    }
#endif
#ifdef INFLIGHT_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= dim; i += 8) {
        const __m256 g = load8(gate + i);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        store8(out + i, _mm256_mul_ps(rounded_as8(silu, out), load8(up + i)));
    }
#endif
    for (; i < dim; ++i) {
        const float g = to_float(gate[i]);
        store_float(out + i, rounded_as(g / (1.0f + std::exp(-g)), out) * to_float(up[i]));
    }
}
