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

// The index of the largest value in x[0, dim), the first where several are, or of the
// first NaN where there is one (as torch's `max` picks): one pass for the largest value,
// a second for its first position (which stops there).
template <typename T>
int64_t argmax_row(const T* x, int dim) {
    float largest = -INFINITY;
    bool nan = false;
    int i = 0;
#if defined(INFLIGHT_AVX2)
    __m256 lanes = _mm256_set1_ps(-INFINITY);
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = load8(x + i);
        lanes = _mm256_max_ps(v, lanes);  // where v is NaN: lanes, so NaNs never enter it
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lane[8];
    _mm256_store_ps(lane, lanes);
    for (float value : lane) largest = value > largest ? value : largest;
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < dim; ++i) {
        const float value = to_float(x[i]);
        largest = value > largest ? value : largest;
        nan = nan || value != value;
    }
    i = 0;
#if defined(INFLIGHT_AVX2)
    const __m256 target = _mm256_set1_ps(largest);
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = load8(x + i);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < dim; ++i) {
        const float value = to_float(x[i]);
        if (nan ? value != value : value == largest) return i;
    }
    return 0;  // not reached
}

template <typename T>
void argmax_rows(const T* x, int64_t row_stride, int64_t rows, int dim, int64_t* out, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * row_stride, dim);
}

}  // namespace

// out[r] = the index of the largest of x[r, 0:dim] (the first of equal ones, or the
// first NaN), rows `row_stride` elements apart.
extern "C" void argmax(const float* x, int64_t row_stride, int64_t rows, int dim, int64_t* out, int num_threads) {
    argmax_rows(x, row_stride, rows, dim, out, num_threads);
}

extern "C" void argmax_bf16(const bf16* x, int64_t row_stride, int64_t rows, int dim, int64_t* out, int num_threads) {
    argmax_rows(x, row_stride, rows, dim, out, num_threads);
}

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
