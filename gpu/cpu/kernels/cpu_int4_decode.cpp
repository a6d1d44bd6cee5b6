// A decode step on int4 weights in one call: for every layer of a Llama-family stack,
// norm, q/k/v, rotary, KV write, attention, o, residual, norm, gate/up, SiLU, down,
// residual, then the final norm and the LM head, over the step's few tokens
// (`gpu/cpu/int4_decode.py`). At one request a layer's math takes microseconds, and the
// torch path spends more than that again calling some twenty operations a layer from
// Python.
//
// The weights are `Int4Linear.packed_in_blocks_of_64` (torch's AVX-512 int4 layout): per block of 64 output rows,
// byte [k, j] holds row j's 4-bit weight in its low nibble and row 32 + j's in its high
// one; scales and zeros are [K/32, N, 2] bfloat16, and a weight is (q - 8) × scale + zero.
// Every matmul reads the weights once for up to `ROW_TILE` tokens and sums q·x per group
// of 32 in fp32, then applies the group's scale and zero. Where the CPU has AVX-512 BF16
// it reads a repacked copy with bfloat16 dot products (`Int4Weight`); elsewhere torch's
// layout as it is.
//
// Roundings follow the torch path operation for operation: every tensor it holds in
// bfloat16 (norm outputs, projections, rotated queries and keys, attention output, the
// residual stream) is rounded to bfloat16 here at the same point; sums are fp32.
// Attention is the paged decode kernel (`cpu_paged_decode.cpp`), passed in by address:
// every token is a query row of its own, over its own context, with full attention (no
// window, softcap or sinks: the Python side takes no model whose layers have any).
//
// The LM head's int8 weights (one scale per output row, `Int8Linear`'s) are copied once
// as uint8 (w + 128). The head's input is quantized to int8 per group of 32 (llama.cpp's
// Q8_0), so that on AVX-512 VNNI a single instruction sums 64 products; logits come out
// in fp32.
//
// Threads: the matmuls split their output rows (`ITEM_ROWS` at a time; the head's, 4 at
// a time) over OpenMP (torch's runtime, as the other kernels); the element-wise work
// runs on the calling thread.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "cpu_row_ops.h"

namespace {

constexpr int BLOCK_N = 64;
constexpr int GROUP = 32;
constexpr int ROW_TILE = 4;

// On AVX-512 BF16 the weights are read from a copy made once, repacked for bfloat16 dot
// products: per 16 output rows and group of 32 columns, four 64-byte chunks of 8 columns,
// one 32-bit lane per row with its 8 nibbles (columns c..c+3 in the low 16 bits, c+4..c+7
// in the high 16), then the 16 rows' scales and their 16 zeros. Shifting each 16-bit half
// right by 4·s and looking its low bits up in a table (`vpermw`) makes the bfloat16 q - 8
// of columns c + s and c + 4 + s, a pair one `vdpbf16ps` multiplies by two inputs at once
// (exact products in fp32). Why q - 8 and not 128 + q (an `or` of 0x4300, one table
// lookup cheaper): summing (128 + q)·x carries sums some 17 times the result's size, and
// taking 136·Σx back lost about four bits of the fp32 sums, enough to flip a bfloat16
// rounding ten times as often as torch's kernel does. Elsewhere torch's layout is read as is.
#ifdef INFLIGHT_AVX512BF16
constexpr int ITEM_ROWS = 16;
#else
constexpr int ITEM_ROWS = BLOCK_N;
#endif

struct Int4Weight {
    const uint8_t* packed;     // [N/64, K, 32]
    const bf16* scales_zeros;  // [K/32, N, 2]
    int n, k;
    std::vector<uint32_t> lanes;            // the repacked copy (AVX-512 BF16 only)
    std::vector<bf16> lane_scales_zeros;

    Int4Weight(const uint8_t* packed_, const bf16* scales_zeros_, int n_, int k_)
        : packed(packed_), scales_zeros(scales_zeros_), n(n_), k(k_) {
#ifdef INFLIGHT_AVX512BF16
        repack();
#endif
    }

    void repack() {
        const int groups = k / GROUP;
        lanes.assign((size_t)n / 16 * groups * 4 * 16, 0u);
        lane_scales_zeros.resize((size_t)n / 16 * groups * 32);
        for (int row = 0; row < n; ++row) {
            const int block = row / BLOCK_N, j = row % BLOCK_N;
            for (int column = 0; column < k; ++column) {
                const uint8_t byte = packed[((size_t)block * k + column) * 32 + j % 32];
                const uint32_t q = j < 32 ? (byte & 0x0F) : (byte >> 4);
                const int g = column / GROUP, chunk = (column % GROUP) / 8, offset = column % 8;
                lanes[(((size_t)(row / 16) * groups + g) * 4 + chunk) * 16 + row % 16] |=
                    q << ((offset / 4) * 16 + (offset % 4) * 4);
            }
            for (int g = 0; g < groups; ++g) {
                bf16* scales = &lane_scales_zeros[((size_t)(row / 16) * groups + g) * 32];
                scales[row % 16] = scales_zeros[((size_t)g * n + row) * 2];
                scales[16 + row % 16] = scales_zeros[((size_t)g * n + row) * 2 + 1];
            }
        }
    }
};

using AttendFn = int (*)(bf16* out, const bf16* query, int64_t token_stride, int64_t head_stride,
                         const bf16* key_pool, const bf16* value_pool, const int32_t* query_rows,
                         const int32_t* context_lens, const int32_t* block_tables, int num_seqs, int max_blocks,
                         int block_size, int num_heads, int num_kv_heads, int head_dim, float scale, int window,
                         float softcap, const float* sinks, int threads);

struct Layer {
    const bf16* input_norm;
    const bf16* post_attention_norm;
    Int4Weight q, k, v, o, gate_up, down;
    bf16* key_pool;  // [slots, kv_heads, head_dim]
    bf16* value_pool;
};

struct Head {
    const bf16* norm;              // the final norm's weight
    std::vector<uint8_t> weights;  // [vocab, hidden], each int8 weight + 128
    const float* scales;           // [vocab]
    int vocab;
};

// One matmul's input rows: widened to fp32, or on AVX-512 BF16 as the pairs of bfloat16
// the repacked weights' lanes meet; with each group's sum.
struct Activations {
    std::vector<float> x;           // [rows, k]
    std::vector<uint32_t> pairs;    // [rows, k / 2]: per group, chunk c and shift s, columns (8c + s, 8c + 4 + s)
    std::vector<float> group_sums;  // [rows, k / GROUP]
    int rows = 0, k = 0;

    void load(const bf16* in, int num_rows, int width) {
        rows = num_rows;
        k = width;
        group_sums.resize((size_t)rows * (k / GROUP));
#ifdef INFLIGHT_AVX512BF16
        pairs.resize((size_t)rows * k / 2);
        for (int r = 0; r < rows; ++r)
            for (int column = 0; column < k; column += 8)
                for (int s = 0; s < 4; ++s)
                    pairs[((size_t)r * k + column) / 2 + s] =
                        in[(size_t)r * k + column + s].bits | (uint32_t)in[(size_t)r * k + column + 4 + s].bits << 16;
#else
        x.resize((size_t)rows * k);
#endif
        for (int r = 0; r < rows; ++r)
            for (int g = 0; g < k / GROUP; ++g) {
                float sum = 0.0f;
                for (int i = g * GROUP; i < (g + 1) * GROUP; ++i) {
                    const float v = to_float(in[(size_t)r * k + i]);
#ifndef INFLIGHT_AVX512BF16
                    x[(size_t)r * k + i] = v;
#endif
                    sum += v;
                }
                group_sums[(size_t)r * (k / GROUP) + g] = sum;
            }
    }
};

// acc[r][j] += the group's q·x for the block's 64 rows, scaled: scale_j · (Σ q·x − 8 Σ x)
// + zero_j · Σ x, with q·x summed over the group's 32 columns in fp32.
template <int R>
void add_group(const uint8_t* bytes, const bf16* scale_zero, const float* x, int64_t x_stride, const float* sums,
               float acc[ROW_TILE][BLOCK_N]) {
#ifdef INFLIGHT_AVX512
    __m512 d[R][4];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) d[r][i] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int c = 0; c < GROUP; ++c) {
        const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + c * 32));
        const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + c * 32 + 16));
        const __m512 w[4] = {
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b0, low))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b1, low))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b0, 4), low))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b1, 4), low))),
        };
        for (int r = 0; r < R; ++r) {
            const __m512 xc = _mm512_set1_ps(x[r * x_stride + c]);
            for (int i = 0; i < 4; ++i) d[r][i] = _mm512_fmadd_ps(w[i], xc, d[r][i]);
        }
    }
    // Each 32-bit lane of scale_zero holds one row's bfloat16 scale (low half) and zero (high half).
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int i = 0; i < 4; ++i) {
        const __m512i pairs = _mm512_loadu_si512(scale_zero + 32 * i);
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
        for (int r = 0; r < R; ++r) {
            const __m512 sum = _mm512_set1_ps(sums[r]);
            __m512 a = _mm512_loadu_ps(acc[r] + 16 * i);
            a = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sum, d[r][i]), a);
            _mm512_storeu_ps(acc[r] + 16 * i, _mm512_fmadd_ps(zero, sum, a));
        }
    }
#else
    float dot[ROW_TILE][BLOCK_N] = {};
    for (int c = 0; c < GROUP; ++c) {
        const uint8_t* row = bytes + c * 32;
        for (int r = 0; r < R; ++r) {
            const float xc = x[r * x_stride + c];
#pragma omp simd
            for (int j = 0; j < 32; ++j) {
                dot[r][j] += (float)(row[j] & 0x0F) * xc;
                dot[r][j + 32] += (float)(row[j] >> 4) * xc;
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < BLOCK_N; ++j)
            acc[r][j] += to_float(scale_zero[2 * j]) * (dot[r][j] - 8.0f * sums[r]) + to_float(scale_zero[2 * j + 1]) * sums[r];
#endif
}

// out[r, column + j] for one block of 64 output rows and up to ROW_TILE tokens, rounded to bfloat16.
template <int R>
void matmul_block_tile(const Int4Weight& w, int block, const Activations& a, int row0, bf16* out,
                       int64_t out_stride) {
    const int groups = w.k / GROUP;
    const uint8_t* bytes = w.packed + (int64_t)block * w.k * (BLOCK_N / 2);
    float acc[ROW_TILE][BLOCK_N] = {};
    for (int g = 0; g < groups; ++g) {
        float sums[ROW_TILE];
        for (int r = 0; r < R; ++r) sums[r] = a.group_sums[(size_t)(row0 + r) * groups + g];
        add_group<R>(bytes + (int64_t)g * GROUP * 32, w.scales_zeros + ((int64_t)g * w.n + block * BLOCK_N) * 2,
                     a.x.data() + (size_t)row0 * a.k + g * GROUP, a.k, sums, acc);
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < BLOCK_N; ++j) out[(int64_t)(row0 + r) * out_stride + j] = to_bf16(acc[r][j]);
}

#ifdef INFLIGHT_AVX512BF16
// out[r, column + i] for 16 output rows (`item`) and R tokens, from the repacked copy.
template <int R>
void matmul_item_tile(const Int4Weight& w, int item, const Activations& a, int row0, bf16* out, int64_t out_stride) {
    const int groups = w.k / GROUP;
    const uint32_t* lanes = w.lanes.data() + (size_t)item * groups * 64;
    const bf16* scales_zeros = w.lane_scales_zeros.data() + (size_t)item * groups * 32;
    // Word i is the bfloat16 (i mod 16) - 8: `vpermw` reads an index's low five bits, the
    // fifth being the next nibble's.
    alignas(64) static const uint16_t centred[32] = {
        0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
        0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
    const __m512i table = _mm512_load_si512(centred);
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512 acc[4][R];
        for (int c = 0; c < 4; ++c)
            for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) {
            const __m512i chunk = _mm512_loadu_si512(lanes + ((size_t)g * 4 + c) * 16);
            for (int s = 0; s < 4; ++s) {
                const __m512i shifted = s == 0 ? chunk : _mm512_srli_epi16(chunk, 4 * s);
                const __m512bh weights = (__m512bh)_mm512_permutexvar_epi16(shifted, table);
                for (int r = 0; r < R; ++r) {
                    const uint32_t pair = a.pairs[(size_t)(row0 + r) * a.k / 2 + g * 16 + c * 4 + s];
                    acc[c][r] = _mm512_dpbf16_ps(acc[c][r], weights, (__m512bh)_mm512_set1_epi32((int)pair));
                }
            }
        }
        const bf16* group_scales = scales_zeros + (size_t)g * 32;
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_scales))), 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_scales + 16))), 16));
        for (int r = 0; r < R; ++r) {
            const __m512 dot = _mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]), _mm512_add_ps(acc[2][r], acc[3][r]));
            total[r] = _mm512_fmadd_ps(scale, dot, total[r]);
            total[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(a.group_sums[(size_t)(row0 + r) * groups + g]), total[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const __m256bh rounded = _mm512_cvtneps_pbh(total[r]);
        std::memcpy(out + (int64_t)(row0 + r) * out_stride, &rounded, 32);
    }
}
#endif

// One item of ITEM_ROWS output rows for every token, up to ROW_TILE tokens at a time.
void matmul_item(const Int4Weight& w, int item, const Activations& a, bf16* out, int64_t out_stride) {
    bf16* column = out + item * ITEM_ROWS;
    for (int row0 = 0; row0 < a.rows; row0 += ROW_TILE) {
        switch (std::min(ROW_TILE, a.rows - row0)) {
#ifdef INFLIGHT_AVX512BF16
            case 1: matmul_item_tile<1>(w, item, a, row0, column, out_stride); break;
            case 2: matmul_item_tile<2>(w, item, a, row0, column, out_stride); break;
            case 3: matmul_item_tile<3>(w, item, a, row0, column, out_stride); break;
            default: matmul_item_tile<4>(w, item, a, row0, column, out_stride); break;
#else
            case 1: matmul_block_tile<1>(w, item, a, row0, column, out_stride); break;
            case 2: matmul_block_tile<2>(w, item, a, row0, column, out_stride); break;
            case 3: matmul_block_tile<3>(w, item, a, row0, column, out_stride); break;
            default: matmul_block_tile<4>(w, item, a, row0, column, out_stride); break;
#endif
        }
    }
}

// One or more matmuls of the same input, their outputs side by side in rows of `out_stride`
// (q, k and v into one buffer): every weight's items of ITEM_ROWS rows shared out over the team.
struct Output {
    const Int4Weight* weight;
    bf16* out;  // the first column of this weight's output
};

using Items = std::vector<std::pair<const Output*, int>>;

// `items` is scratch space, kept by the caller so that a step allocates nothing.
void matmuls(std::initializer_list<Output> outputs, const Activations& a, int64_t out_stride, int threads,
             Items& items) {
    items.clear();
    for (const Output& o : outputs)
        for (int item = 0; item < o.weight->n / ITEM_ROWS; ++item) items.emplace_back(&o, item);
    const int count = (int)items.size();
#pragma omp parallel for num_threads(std::min(threads, count)) schedule(static)
    for (int i = 0; i < count; ++i) matmul_item(*items[i].first->weight, items[i].second, a, items[i].first->out, out_stride);
}

// HF's q·cos + rotate_half(q)·sin as the torch path computes it: each product rounded, then the sum.
void rotate(bf16* x, const bf16* cos, const bf16* signed_sin, int head_dim) {
    const int half = head_dim / 2;
    float rotated[512];
    for (int i = 0; i < head_dim; ++i) {
        const float straight = rounded_as(to_float(x[i]) * to_float(cos[i]), x);
        const float swapped = rounded_as(to_float(x[(i + half) % head_dim]) * to_float(signed_sin[i]), x);
        rotated[i] = straight + swapped;
    }
    for (int i = 0; i < head_dim; ++i) x[i] = to_bf16(rotated[i]);
}

void add_rounded(bf16* hidden, const bf16* delta, int n) {
    for (int i = 0; i < n; ++i) hidden[i] = to_bf16(to_float(hidden[i]) + to_float(delta[i]));
}

// The head's input, one token: int8 values and a scale per group of 32 (the group's
// largest magnitude to ±127), each scale repeated over its group's 8 lanes of a VNNI sum.
struct QuantizedRow {
    std::vector<int8_t> values;       // [hidden]
    std::vector<float> lane_scales;   // [hidden / 4]: lane j covers values 4j..4j+3
    float offset = 0.0f;              // 128 · Σ_g scale_g · Σ values_g: the weights' +128, taken back
};

void quantize_row(const bf16* x, int k, QuantizedRow& q) {
    q.values.resize(k);
    q.lane_scales.resize(k / 4);
    q.offset = 0.0f;
    for (int g = 0; g < k / GROUP; ++g) {
        float largest = 0.0f;
        for (int i = g * GROUP; i < (g + 1) * GROUP; ++i) largest = std::max(largest, std::fabs(to_float(x[i])));
        const float scale = largest / 127.0f;
        const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        int sum = 0;
        for (int i = g * GROUP; i < (g + 1) * GROUP; ++i) {
            const int v = (int)std::nearbyint(to_float(x[i]) * inverse);
            q.values[i] = (int8_t)std::min(127, std::max(-127, v));
            sum += q.values[i];
        }
        for (int j = g * GROUP / 4; j < (g + 1) * GROUP / 4; ++j) q.lane_scales[j] = scale;
        q.offset += 128.0f * scale * (float)sum;
    }
}

// logits[t, n] for output rows n0..n0+COUNT-1: scale_n · (Σ_g scale_g Σ_k (w + 128) x − offset).
template <int COUNT>
void head_rows(const Head& h, int k, const QuantizedRow* rows, int tokens, int n0, float* logits) {
    for (int t = 0; t < tokens; ++t) {
        const QuantizedRow& q = rows[t];
        float sums[COUNT];
#if defined(INFLIGHT_AVX512) && defined(__AVX512VNNI__)
        if (k % 64 == 0) {
            __m512 acc[COUNT];
            for (int i = 0; i < COUNT; ++i) acc[i] = _mm512_setzero_ps();
            for (int c = 0; c < k; c += 64) {
                const __m512i x = _mm512_loadu_si512(q.values.data() + c);
                const __m512 lane_scales = _mm512_loadu_ps(q.lane_scales.data() + c / 4);
                for (int i = 0; i < COUNT; ++i) {
                    const __m512i w = _mm512_loadu_si512(h.weights.data() + (size_t)(n0 + i) * k + c);
                    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lane_scales, acc[i]);
                }
            }
            for (int i = 0; i < COUNT; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
        } else
#endif
        {
            for (int i = 0; i < COUNT; ++i) {
                const uint8_t* w = h.weights.data() + (size_t)(n0 + i) * k;
                float sum = 0.0f;
                for (int j = 0; j < k / 4; ++j) {
                    int dot = 0;
                    for (int b = 4 * j; b < 4 * j + 4; ++b) dot += (int)w[b] * (int)q.values[b];
                    sum += (float)dot * q.lane_scales[j];
                }
                sums[i] = sum;
            }
        }
        for (int i = 0; i < COUNT; ++i) logits[(size_t)t * h.vocab + n0 + i] = h.scales[n0 + i] * (sums[i] - q.offset);
    }
}

// logits [tokens, vocab] (fp32) of `normed` [tokens, hidden], the final norm's output.
// `rows` is scratch space, kept by the caller so that a step allocates nothing.
void head_logits(const Head& h, int k, const bf16* normed, int tokens, float* logits, int threads,
                 std::vector<QuantizedRow>& rows) {
    rows.resize(tokens);
    for (int t = 0; t < tokens; ++t) quantize_row(normed + (size_t)t * k, k, rows[t]);
    const int quads = h.vocab / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int i = 0; i < quads; ++i) head_rows<4>(h, k, rows.data(), tokens, 4 * i, logits);
    for (int n = 4 * quads; n < h.vocab; ++n) head_rows<1>(h, k, rows.data(), tokens, n, logits);
}

// The buffers of a step, kept across steps (one step at a time per stack: the engine
// steps on one thread); each is written whole before it is read.
struct Workspace {
    std::vector<bf16> normed, qkv, attended, projected, gate_up, product;
    Activations activations;
    std::vector<QuantizedRow> quantized;
    Items items;
};

struct Stack {
    int hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    AttendFn attend;
    std::vector<Layer> layers;
    Head head;
    Workspace workspace;
};

int decode(Stack& s, bf16* hidden, int tokens, const bf16* cos_table, const bf16* sin_table,
           const int64_t* positions, const int64_t* slots, const int32_t* query_rows, const int32_t* context_lens,
           const int32_t* block_tables, int num_seqs, int max_blocks, int block_size, float* logits,
           int threads) {
    const int d = s.head_dim, q_width = s.heads * d, kv_width = s.kv_heads * d;
    const int qkv_width = q_width + 2 * kv_width;
    Workspace& w = s.workspace;
    std::vector<bf16>&normed = w.normed, &qkv = w.qkv, &attended = w.attended, &projected = w.projected,
                     &gate_up = w.gate_up, &product = w.product;
    normed.resize((size_t)tokens * s.hidden);
    qkv.resize((size_t)tokens * qkv_width);
    attended.resize((size_t)tokens * q_width);
    projected.resize((size_t)tokens * s.hidden);
    gate_up.resize((size_t)tokens * 2 * s.intermediate);
    product.resize((size_t)tokens * s.intermediate);
    Activations& a = w.activations;
    for (const Layer& layer : s.layers) {
        for (int t = 0; t < tokens; ++t)
            rms_norm_row(hidden + (size_t)t * s.hidden, layer.input_norm, &normed[(size_t)t * s.hidden], s.hidden, s.eps);
        a.load(normed.data(), tokens, s.hidden);
        bf16* q = qkv.data();
        matmuls({{&layer.q, q}, {&layer.k, q + q_width}, {&layer.v, q + q_width + kv_width}}, a, qkv_width, threads, w.items);
        for (int t = 0; t < tokens; ++t) {
            bf16* row = &qkv[(size_t)t * qkv_width];
            const bf16* cos = cos_table + positions[t] * d;
            const bf16* sin = sin_table + positions[t] * d;
            for (int h = 0; h < s.heads + s.kv_heads; ++h) rotate(row + h * d, cos, sin, d);
            std::copy(row + q_width, row + q_width + kv_width, layer.key_pool + slots[t] * kv_width);
            std::copy(row + q_width + kv_width, row + qkv_width, layer.value_pool + slots[t] * kv_width);
        }
        const int status = s.attend(attended.data(), qkv.data(), qkv_width, d, layer.key_pool, layer.value_pool,
                                    query_rows, context_lens, block_tables, num_seqs, max_blocks, block_size, s.heads,
                                    s.kv_heads, d, s.scale, 0, 0.0f, nullptr, threads);  // full attention
        if (status != 0) return status;
        a.load(attended.data(), tokens, q_width);
        matmuls({{&layer.o, projected.data()}}, a, s.hidden, threads, w.items);
        add_rounded(hidden, projected.data(), tokens * s.hidden);
        for (int t = 0; t < tokens; ++t)
            rms_norm_row(hidden + (size_t)t * s.hidden, layer.post_attention_norm, &normed[(size_t)t * s.hidden],
                         s.hidden, s.eps);
        a.load(normed.data(), tokens, s.hidden);
        matmuls({{&layer.gate_up, gate_up.data()}}, a, 2 * s.intermediate, threads, w.items);
        for (int t = 0; t < tokens; ++t) {
            const bf16* row = &gate_up[(size_t)t * 2 * s.intermediate];
            silu_mul_row(row, row + s.intermediate, &product[(size_t)t * s.intermediate], s.intermediate);
        }
        a.load(product.data(), tokens, s.intermediate);
        matmuls({{&layer.down, projected.data()}}, a, s.hidden, threads, w.items);
        add_rounded(hidden, projected.data(), tokens * s.hidden);
    }
    for (int t = 0; t < tokens; ++t)
        rms_norm_row(hidden + (size_t)t * s.hidden, s.head.norm, &normed[(size_t)t * s.hidden], s.hidden, s.eps);
    head_logits(s.head, s.hidden, normed.data(), tokens, logits, threads, w.quantized);
    return 0;
}

Int4Weight weight_at(const int64_t* p, int n, int k) {
    return Int4Weight(reinterpret_cast<const uint8_t*>(p[0]), reinterpret_cast<const bf16*>(p[1]), n, k);
}

}  // namespace

// Per layer, `pointers` holds 16 addresses: input norm, post-attention norm, then the
// packed weight and scales/zeros of q, k, v, o, gate_up and down, then the K and V pools.
// The head: the final norm's weight, int8 weights [vocab, hidden] (copied here) and
// their fp32 scales [vocab]. Returns a stack for `int4_decode`, or null if a shape is one
// this code does not take.
extern "C" void* int4_stack_create(int num_layers, const int64_t* pointers, int hidden, int heads, int kv_heads,
                                   int head_dim, int intermediate, float eps, float scale, void* attend,
                                   const bf16* final_norm, const int8_t* head_weights, const float* head_scales,
                                   int vocab) {
    if (head_dim > 512 || head_dim % 2 || hidden % BLOCK_N || hidden % GROUP || intermediate % BLOCK_N ||
        (heads * head_dim) % BLOCK_N || (kv_heads * head_dim) % BLOCK_N)
        return nullptr;
    std::vector<uint8_t> shifted((size_t)vocab * hidden);
    for (size_t i = 0; i < shifted.size(); ++i) shifted[i] = (uint8_t)(head_weights[i] + 128);
    auto* stack = new Stack{hidden, heads, kv_heads, head_dim, intermediate, eps, scale,
                            reinterpret_cast<AttendFn>(attend), {},
                            Head{final_norm, std::move(shifted), head_scales, vocab}};
    const int q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    for (int i = 0; i < num_layers; ++i) {
        const int64_t* p = pointers + 16 * i;
        stack->layers.push_back(Layer{
            reinterpret_cast<const bf16*>(p[0]), reinterpret_cast<const bf16*>(p[1]),
            weight_at(p + 2, q_width, hidden), weight_at(p + 4, kv_width, hidden), weight_at(p + 6, kv_width, hidden),
            weight_at(p + 8, hidden, q_width), weight_at(p + 10, 2 * intermediate, hidden),
            weight_at(p + 12, hidden, intermediate),
            reinterpret_cast<bf16*>(p[14]), reinterpret_cast<bf16*>(p[15]),
        });
    }
    return stack;
}

extern "C" void int4_stack_free(void* stack) { delete static_cast<Stack*>(stack); }

// out [rows, n] = x [rows, k] · weight, one linear as the stack computes it (bfloat16 in and out).
extern "C" void int4_linear(const uint8_t* packed, const bf16* scales_zeros, int n, int k, const bf16* x, int rows,
                            bf16* out, int threads) {
    const Int4Weight weight{packed, scales_zeros, n, k};
    Activations a;
    a.load(x, rows, k);
    Items items;
    matmuls({{&weight, out}}, a, n, threads, items);
}

// Runs every layer over `hidden` [tokens, hidden] in place: token t at positions[t],
// its K/V written to slots[t]; `num_seqs` decodes attend as the attention kernel's
// metadata says (every token a decode of one query row); then the final norm and the head
// into `logits` [tokens, vocab] (fp32). cos/sin tables are [positions, head_dim], sin with
// its first half negated. Returns 0, or the attention kernel's error.
extern "C" int int4_decode(void* stack, bf16* hidden, int tokens, const bf16* cos_table, const bf16* sin_table,
                           const int64_t* positions, const int64_t* slots, const int32_t* query_rows,
                           const int32_t* context_lens, const int32_t* block_tables, int num_seqs, int max_blocks,
                           int block_size, float* logits, int threads) {
    return decode(*static_cast<Stack*>(stack), hidden, tokens, cos_table, sin_table, positions, slots, query_rows,
                  context_lens, block_tables, num_seqs, max_blocks, block_size, logits, threads);
}

// logits [tokens, vocab] (fp32) of `normed` [tokens, hidden], the final norm's output: the
// stack's LM head alone.
extern "C" void int4_stack_head(void* stack, const bf16* normed, int tokens, float* logits, int threads) {
    Stack& s = *static_cast<Stack*>(stack);
    head_logits(s.head, s.hidden, normed, tokens, logits, threads, s.workspace.quantized);
}
