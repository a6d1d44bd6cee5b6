// Element-wise model operations fused into one pass each, for the CPU forward
// (`gpu/cpu/fusions.py`). Rows are split over torch's OpenMP team when there are
// enough of them to pay for waking it. Arithmetic in fp32, as HF's modules do it; in
// bfloat16, results are rounded to bfloat16 where HF's modules round them.
#include <cmath>
#include <cstdint>

#include "cpu_vector_math.h"

namespace {

// Rows below this run on the calling thread: a fork and join costs more than they do.
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;

inline int threads_for(int64_t elements, int num_threads) { return elements < PARALLEL_ELEMENTS ? 1 : num_threads; }

// HF: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the product in the weight's dtype;
// in float32 both roundings are no-ops.
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int dim, float eps) {
    int i = 0;
    float sum = 0.0f;
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
#ifdef INFLIGHT_AVX2
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (; i + 8 <= dim; i += 8)
        store8(out + i, _mm256_mul_ps(load8(weight + i), rounded_as8(_mm256_mul_ps(load8(x + i), inv8), out)));
#endif
    for (; i < dim; ++i) store_float(out + i, to_float(weight[i]) * rounded_as(to_float(x[i]) * inv, out));
}

// HF: act_fn(gate) * up, SiLU's result in the activations' dtype.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int dim) {
    int i = 0;
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

template <typename T>
void rms_norm_rows(const T* x, int64_t x_row_stride, const T* weight, T* out, int64_t rows, int dim, float eps,
                   int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_row_stride, weight, out + r * dim, dim, eps);
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t row_stride, T* out, int64_t rows, int dim, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* row = gate_up + r * row_stride;
        silu_mul_row(row, row + dim, out + r * dim, dim);
    }
}

}  // namespace

// out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps), rows `x_row_stride` elements apart.
extern "C" void rms_norm(const float* x, int64_t x_row_stride, const float* weight, float* out, int64_t rows,
                         int dim, float eps, int num_threads) {
    rms_norm_rows(x, x_row_stride, weight, out, rows, dim, eps, num_threads);
}

extern "C" void rms_norm_bf16(const bf16* x, int64_t x_row_stride, const bf16* weight, bf16* out, int64_t rows,
                              int dim, float eps, int num_threads) {
    rms_norm_rows(x, x_row_stride, weight, out, rows, dim, eps, num_threads);
}

// out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:], rows `row_stride` elements apart.
extern "C" void silu_mul(const float* gate_up, int64_t row_stride, float* out, int64_t rows, int dim,
                         int num_threads) {
    silu_mul_rows(gate_up, row_stride, out, rows, dim, num_threads);
}

extern "C" void silu_mul_bf16(const bf16* gate_up, int64_t row_stride, bf16* out, int64_t rows, int dim,
                              int num_threads) {
    silu_mul_rows(gate_up, row_stride, out, rows, dim, num_threads);
}
