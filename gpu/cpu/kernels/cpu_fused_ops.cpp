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

// HF's x * cos + rotate_half(x) * sin over each of `heads` heads of one token, in place;
// `sin` has its first half negated, so rotate_half is a swap of the halves. Each product
// is rounded to the activations' dtype before the sum, as torch's separate operations
// round them: no multiply and add fused into one rounding, which -O3 would make of them.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotary_row(T* x, const T* cos, const T* sin, int heads, int head_dim) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; ++h) {
        T* first = x + h * head_dim;
        T* second = first + half;
        int i = 0;
#if defined(INFLIGHT_AVX2)
        for (; i + 8 <= half; i += 8) {
            const __m256 a = load8(first + i), b = load8(second + i);
            const __m256 low = _mm256_add_ps(rounded_as8(_mm256_mul_ps(a, load8(cos + i)), first),
                                             rounded_as8(_mm256_mul_ps(b, load8(sin + i)), first));
            const __m256 high = _mm256_add_ps(rounded_as8(_mm256_mul_ps(b, load8(cos + half + i)), first),
                                              rounded_as8(_mm256_mul_ps(a, load8(sin + half + i)), first));
            store8(first + i, low);
            store8(second + i, high);
        }
#endif
        for (; i < half; ++i) {
            const float a = to_float(first[i]), b = to_float(second[i]);
            const float low = rounded_as(a * to_float(cos[i]), first) + rounded_as(b * to_float(sin[i]), first);
            const float high =
                rounded_as(b * to_float(cos[half + i]), first) + rounded_as(a * to_float(sin[half + i]), first);
            store_float(first + i, low);
            store_float(second + i, high);
        }
    }
}
#pragma GCC pop_options

template <typename T>
void rotary_rows(T* x, int64_t row_stride, int64_t rows, int heads, int head_dim, const T* cos_table,
                 const T* sin_table, const int64_t* positions, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * heads * head_dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = positions[r] * head_dim;
        rotary_row(x + r * row_stride, cos_table + at, sin_table + at, heads, head_dim);
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

// The rotary embedding of x[r] (`heads` heads of `head_dim`, rows `row_stride` elements
// apart), in place, at position positions[r] of the [position, head_dim] tables (`sin`'s
// first half negated).
extern "C" void rotary(float* x, int64_t row_stride, int64_t rows, int heads, int head_dim, const float* cos_table,
                       const float* sin_table, const int64_t* positions, int num_threads) {
    rotary_rows(x, row_stride, rows, heads, head_dim, cos_table, sin_table, positions, num_threads);
}

extern "C" void rotary_bf16(bf16* x, int64_t row_stride, int64_t rows, int heads, int head_dim, const bf16* cos_table,
                            const bf16* sin_table, const int64_t* positions, int num_threads) {
    rotary_rows(x, row_stride, rows, heads, head_dim, cos_table, sin_table, positions, num_threads);
}

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
