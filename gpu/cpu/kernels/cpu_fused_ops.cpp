// Element-wise model operations fused into one pass each, for the CPU forward
// (`gpu/cpu/fusions.py`). Rows are split over torch's OpenMP team when there are
// enough of them to pay for waking it. Arithmetic in fp32, as HF's modules do it; in
// bfloat16, results are rounded to bfloat16 where HF's modules round them.
#include <cmath>
#include <cstdint>

#include "cpu_row_ops.h"

namespace {

// Rows below this run on the calling thread: a fork and join costs more than they do.
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;

inline int threads_for(int64_t elements, int num_threads) { return elements < PARALLEL_ELEMENTS ? 1 : num_threads; }

template <typename T>
void rms_norm_rows(const T* x, int64_t x_row_stride, const T* weight, T* out, int64_t rows, int dim, float eps,
                   int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_row_stride, weight, out + r * dim, dim, eps);
}

template <typename T>
void add_rms_norm_rows(T* hidden, const T* delta, const T* weight, T* out, int64_t rows, int dim, float eps,
                       int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        add_row(hidden + r * dim, delta + r * dim, dim);
        rms_norm_row(hidden + r * dim, weight, out + r * dim, dim, eps);
    }
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

// hidden[r] += delta[r] (rounded as the activations' dtype rounds), then out[r] =
// rms_norm(hidden[r]) as above; every array contiguous [rows, dim].
extern "C" void add_rms_norm(float* hidden, const float* delta, const float* weight, float* out, int64_t rows, int dim,
                             float eps, int num_threads) {
    add_rms_norm_rows(hidden, delta, weight, out, rows, dim, eps, num_threads);
}

extern "C" void add_rms_norm_bf16(bf16* hidden, const bf16* delta, const bf16* weight, bf16* out, int64_t rows,
                                  int dim, float eps, int num_threads) {
    add_rms_norm_rows(hidden, delta, weight, out, rows, dim, eps, num_threads);
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
