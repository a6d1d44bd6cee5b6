// Element-wise model operations fused into one pass each, for the CPU forward
// (`gpu/cpu/fusions.py`). Rows are split over torch's OpenMP team when there are
// enough of them to pay for waking it. Arithmetic in fp32, as HF's modules do it.
#include <cmath>
#include <cstdint>

#include "cpu_vector_math.h"

namespace {

// Rows below this run on the calling thread: a fork and join costs more than they do.
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;

inline int threads_for(int64_t elements, int num_threads) { return elements < PARALLEL_ELEMENTS ? 1 : num_threads; }

void rms_norm_row(const float* x, const float* weight, float* out, int dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < dim; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(sum / dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; ++i) out[i] = weight[i] * (x[i] * inv);
}

void silu_mul_row(const float* gate, const float* up, float* out, int dim) {
    int i = 0;
#ifdef INFLIGHT_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= dim; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < dim; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace

// out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps), rows `x_row_stride` floats apart.
extern "C" void rms_norm(const float* x, int64_t x_row_stride, const float* weight, float* out, int64_t rows,
                         int dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_row_stride, weight, out + r * dim, dim, eps);
}

// out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:], rows `row_stride` floats apart.
extern "C" void silu_mul(const float* gate_up, int64_t row_stride, float* out, int64_t rows, int dim,
                         int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = gate_up + r * row_stride;
        silu_mul_row(row, row + dim, out + r * dim, dim);
    }
}
