// bfloat16 linears on AMX (Intel's tile unit): y = x W^T (+ bias), fp32 sums, bfloat16 out.
//
// The weight is packed once, at load, into the tiles' right-operand layout: for each block
// of 32 output columns and 32 input columns, two 16 x 16 tiles of bfloat16 pairs (1 KiB
// each, contiguous). A work item is 32 rows x 32 columns of y, four result tiles summed
// over the input in steps of 32 (two tiles of x, two of the weight, four products). Items
// go to threads in column-block order, so a thread keeps its weight blocks in cache while
// the rows stream past them.
//
// Threads: OpenMP (torch's runtime), the count given. Built only where the compiler has
// AMX (-march=native on such a CPU); `amx_linear_ready` says whether it may run here.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vector_math.h"

#if defined(INFLIGHT_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int TILE = 16;         // rows of a tile; its 64 bytes hold 16 fp32 or 16 bfloat16 pairs
constexpr int BLOCK = 2 * TILE;  // rows, columns and input columns of a work item's step
constexpr int64_t TILE_ELEMENTS = TILE * BLOCK;  // bfloat16 in one packed tile

struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Linux gives the tile state only to a process that asks for it (once; oneDNN asks too).
bool granted() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ok;
}

// Tiles 0-3: results; 4-5: rows of x; 6-7: the weight. Per thread, before its first tile
// instruction (oneDNN, in the same threads, loads its own).
void configure() {
    Config config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = TILE;
    }
    _tile_loadconfig(&config);
}

// y rows [row, row + 32) x columns [col, col + 32): x's rows `x_stride` apart (a partial
// block comes zero-padded in `pad`), the packed weight's column block `weight`.
void item(const bf16* x, int64_t x_stride, const bf16* weight, int64_t k_steps, float* sums) {
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
    }
    _tile_stored(0, sums, BLOCK * 4);
    _tile_stored(1, sums + TILE, BLOCK * 4);
    _tile_stored(2, sums + TILE * BLOCK, BLOCK * 4);
    _tile_stored(3, sums + TILE * BLOCK + TILE, BLOCK * 4);
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

// y [m, n] (rows `y_stride` apart) = x [m, k] (rows `x_stride` apart) times the packed
// weight, plus `bias` [n] unless null. Returns 0, or -1 where it cannot run (no tile
// permission, or n, k not multiples of 32).
extern "C" int amx_linear(const bf16* x, int64_t m, int64_t k, int64_t x_stride, const bf16* packed, int64_t n,
                          const bf16* bias, bf16* y, int64_t y_stride, int num_threads) {
    if (!granted() || n % BLOCK != 0 || k % BLOCK != 0 || m < 0) return -1;
    if (m == 0) return 0;
    const int64_t row_blocks = (m + BLOCK - 1) / BLOCK, col_blocks = n / BLOCK, k_steps = k / BLOCK;
    const int64_t items = row_blocks * col_blocks;
    const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(items, num_threads));
#pragma omp parallel num_threads(threads)
    {
        configure();
        alignas(64) float sums[BLOCK * BLOCK];
        std::vector<bf16> pad;  // a last, partial row block, zero-padded to 32 rows
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; ++i) {
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
            item(rows_of_x, stride, packed + col_block * k_steps * 2 * TILE_ELEMENTS, k_steps, sums);
            const int64_t col = col_block * BLOCK;
            const __m512 bias_low = bias ? _mm512_cvtpbh_ps(*(const __m256bh*)(bias + col)) : _mm512_setzero_ps();
            const __m512 bias_high =
                bias ? _mm512_cvtpbh_ps(*(const __m256bh*)(bias + col + TILE)) : _mm512_setzero_ps();
            for (int64_t r = 0; r < rows; ++r) {
                const __m256bh low = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + r * BLOCK), bias_low));
                const __m256bh high =
                    _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + r * BLOCK + TILE), bias_high));
                std::memcpy(y + (row + r) * y_stride + col, &low, sizeof low);
                std::memcpy(y + (row + r) * y_stride + col + TILE, &high, sizeof high);
            }
        }
        _tile_release();
    }
    return 0;
}

#else
extern "C" int amx_linear_ready() { return 0; }
extern "C" void amx_pack_weight(const bf16*, int64_t, int64_t, bf16*) {}
extern "C" int amx_linear(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, const bf16*, bf16*, int64_t,
                          int) {
    return -1;
}
#endif
