// bfloat16 linears on AMX (Intel's tile unit): y = x W^T (+ bias), fp32 sums, bfloat16 out.
//
// The weight is packed once, at load, into the tiles' right-operand layout: for each block
// of 32 output columns and 32 input columns, two 16 x 16 tiles of bfloat16 pairs (1 KiB
// each, contiguous). A work item is 32 rows x 32 columns of y, four result tiles summed
// over the input in steps of 32 (two tiles of x, two of the weight, four products). Items
// go to threads in column-block order, so a thread keeps its weight blocks in cache while
// the rows stream past them. While it works on one column block, the thread asks for the
// next one's weight, into L2, a few lines after each step's products: at decode's few rows
// the weights come from memory, and tile loads left to wait on it idle the tile unit.
//
// An epilogue per item: the sums (plus bias) rounded to bfloat16 into y; or, for the gated
// MLP's gate and up projections packed with their halves interleaved (16 gate columns, then
// the 16 up columns that go with them, per block), the two halves back where they belong,
// or SiLU(gate) x up straight away (the MLP's next step, one pass over memory saved).
//
// Each item's epilogue runs during the next item's products, between its steps.
//
// Threads: OpenMP (torch's runtime), the count given. Built only where the compiler has
// AMX (-march=native on such a CPU); `amx_linear_ready` says whether it may run here.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_amx.h"
#include "cpu_vector_math.h"

#ifdef INFLIGHT_AMX
namespace {

using amx::granted;
constexpr int TILE = amx::ROWS;
constexpr int BLOCK = 2 * TILE;  // rows, columns and input columns of a work item's step
constexpr int64_t TILE_ELEMENTS = TILE * BLOCK;  // bfloat16 in one packed tile

// Tiles 0-3: results; 4-5: rows of x; 6-7: the weight (`cpu_amx.h`).

// The sums of y rows [row, row + 32) x columns [col, col + 32) into `sums` (32 x 32): x's
// rows `x_stride` apart, the packed weight's column block `weight`. `ahead_lines` lines from
// `ahead` are prefetched, spread over the steps. `between(step)` runs after each step's
// products: vector work (the last item's epilogue) that the core does while the tile unit
// multiplies.
template <typename Between>
void item(const bf16* x, int64_t x_stride, const bf16* weight, int64_t k_steps, float* sums, const char* ahead,
          int64_t ahead_lines, Between between) {
    const int64_t per_step = (ahead_lines + k_steps - 1) / k_steps;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < k_steps; ++k) {
        _tile_loadd(4, x + k * BLOCK, x_stride * 2);
        _tile_loadd(5, x + TILE * x_stride + k * BLOCK, x_stride * 2);
        _tile_loadd(6, weight + 2 * k * TILE_ELEMENTS, 64);
        _tile_loadd(7, weight + (2 * k + 1) * TILE_ELEMENTS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        for (int64_t line = k * per_step; line < std::min(ahead_lines, (k + 1) * per_step); ++line)
            _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
        between(k);
    }
    _tile_stored(0, sums, BLOCK * 4);
    _tile_stored(1, sums + TILE, BLOCK * 4);
    _tile_stored(2, sums + TILE * BLOCK, BLOCK * 4);
    _tile_stored(3, sums + TILE * BLOCK + TILE, BLOCK * 4);
}

enum Epilogue { PLAIN = 0, HALVES = 1, SILU_MUL = 2 };

// As bfloat16 would hold it, back in fp32 (the AVX-512 BF16 rounding `store16` makes).
inline __m512 rounded(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

// Row r of an item at columns [col, col + 32) of the packed order: `low` its first 16 sums
// plus bias, `high` the next 16. y has n columns (PLAIN, HALVES) or n / 2 (SILU_MUL).
inline void finish_row(Epilogue epilogue, __m512 low, __m512 high, bf16* y_row, int64_t col, int64_t n) {
    switch (epilogue) {
        case PLAIN:
            store16(y_row + col, low);
            store16(y_row + col + TILE, high);
            break;
        case HALVES:
            store16(y_row + col / 2, low);
            store16(y_row + n / 2 + col / 2, high);
            break;
        case SILU_MUL: {
            // As `silu_mul_bf16` over the rounded projections: SiLU rounded, times up, rounded.
            const __m512 gate = rounded(low), up = rounded(high);
            const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
            store16(y_row + col / 2, _mm512_mul_ps(rounded(silu), up));
            break;
        }
    }
}

}  // namespace

extern "C" int amx_linear_ready() { return granted() ? 1 : 0; }

// `weight` [n, k] row-major (a linear's) into `packed` (n * k bfloat16): per column block
// of 32 and input step of 32, two tiles (columns 0-15, then 16-31) of 16 rows of pairs:
// row p, column c holds input columns 2p and 2p + 1 of output column c. n and k must be
// multiples of 32.
extern "C" void amx_pack_weight(const bf16* weight, int64_t n, int64_t k, bf16* packed) {
    const int64_t k_steps = k / BLOCK;
    for (int64_t col = 0; col < n; ++col)
        for (int64_t i = 0; i < k; ++i) {
            const int64_t block = col / BLOCK, half = col % BLOCK / TILE, c = col % TILE;
            const int64_t step = i / BLOCK, p = i % BLOCK / 2, e = i % 2;
            const int64_t tile = (block * k_steps + step) * 2 + half;
            packed[tile * TILE_ELEMENTS + p * BLOCK + c * 2 + e] = weight[col * k + i];
        }
}

// y (rows `y_stride` apart) from x [m, k] (rows `x_stride` apart) times the packed weight
// [n, k], plus `bias` [n] (in the packed column order) unless null, through `epilogue`
// (see above: 0 plain, 1 halves, 2 SiLU x up). Returns 0, or -1 where it cannot run (no
// tile permission, n or k not multiples of 32, an unknown epilogue).
extern "C" int amx_linear(const bf16* x, int64_t m, int64_t k, int64_t x_stride, const bf16* packed, int64_t n,
                          const bf16* bias, bf16* y, int64_t y_stride, int epilogue, int num_threads) {
    if (!granted() || n % BLOCK != 0 || k % BLOCK != 0 || m < 0 || epilogue < PLAIN || epilogue > SILU_MUL) return -1;
    if (m == 0) return 0;
    const int64_t row_blocks = (m + BLOCK - 1) / BLOCK, col_blocks = n / BLOCK, k_steps = k / BLOCK;
    const int64_t items = row_blocks * col_blocks;
    const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(items, num_threads));
#pragma omp parallel num_threads(threads)
    {
        amx::configure();
        alignas(64) float sums[2][BLOCK * BLOCK];  // this item's, and the last one's
        std::vector<bf16> pad;                     // a last, partial row block, zero-padded to 32 rows
        struct Finished {
            const float* sums = nullptr;
            int64_t row = 0, rows = 0, col = 0;
            __m512 bias_low, bias_high;
        } last;
        auto finish = [&](int64_t from, int64_t to) {  // rows [from, to) of the last item
            if (last.sums == nullptr) return;
            for (int64_t r = from; r < std::min(to, last.rows); ++r)
                finish_row((Epilogue)epilogue, _mm512_add_ps(_mm512_loadu_ps(last.sums + r * BLOCK), last.bias_low),
                           _mm512_add_ps(_mm512_loadu_ps(last.sums + r * BLOCK + TILE), last.bias_high),
                           y + (last.row + r) * y_stride, last.col, n);
        };
        // A contiguous share of the items, in column-block order (static, as `omp for` would).
        const int64_t team = omp_get_num_threads(), self = omp_get_thread_num();
        for (int64_t i = items * self / team; i < items * (self + 1) / team; ++i) {
            const int64_t col_block = i / row_blocks, row_block = i % row_blocks;
            const int64_t row = row_block * BLOCK, rows = std::min<int64_t>(BLOCK, m - row);
            const bf16* rows_of_x = x + row * x_stride;
            int64_t stride = x_stride;
            if (rows < BLOCK) {
                if (pad.empty()) {
                    pad.assign((size_t)BLOCK * k, bf16{});
                    for (int64_t r = 0; r < rows; ++r) std::memcpy(&pad[r * k], rows_of_x + r * x_stride, k * 2);
                }
                rows_of_x = pad.data();
                stride = k;
            }
            float* into = sums[i & 1];
            const int64_t rows_a_step = (last.rows + k_steps - 1) / k_steps;
            // The next column block's weight, a share of it during each row block's item.
            const int64_t block_lines = k_steps * 2 * TILE_ELEMENTS * 2 / 64;
            const int64_t share = (block_lines + row_blocks - 1) / row_blocks;
            const char* next_block = (const char*)(packed + (col_block + 1) * k_steps * 2 * TILE_ELEMENTS);
            const int64_t ahead_lines = col_block + 1 < col_blocks ? std::min(share, block_lines - row_block * share) : 0;
            item(rows_of_x, stride, packed + col_block * k_steps * 2 * TILE_ELEMENTS, k_steps, into,
                 next_block + 64 * row_block * share, std::max<int64_t>(0, ahead_lines),
                 [&](int64_t step) { finish(step * rows_a_step, (step + 1) * rows_a_step); });
            const int64_t col = col_block * BLOCK;
            last.sums = into;
            last.row = row;
            last.rows = rows;
            last.col = col;
            last.bias_low = bias ? _mm512_cvtpbh_ps(*(const __m256bh*)(bias + col)) : _mm512_setzero_ps();
            last.bias_high = bias ? _mm512_cvtpbh_ps(*(const __m256bh*)(bias + col + TILE)) : _mm512_setzero_ps();
        }
        finish(0, BLOCK);
        _tile_release();
    }
    return 0;
}

#else
extern "C" int amx_linear_ready() { return 0; }
extern "C" void amx_pack_weight(const bf16*, int64_t, int64_t, bf16*) {}
extern "C" int amx_linear(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, const bf16*, bf16*, int64_t,
                          int, int) {
    return -1;
}
#endif
