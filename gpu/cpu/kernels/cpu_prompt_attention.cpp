// Prompt (prefill) attention on the CPU: a chunk of query tokens, causal, against
// contiguous keys and values (a fresh prompt's own, or a later chunk's gathered context).
//
// Query token i sits at position `past_len + i` and sees keys 0..past_len+i, or with a
// sliding window only the last `window` of them: key blocks wholly before every row's
// window are neither prepared nor read, and the rest are masked per row. A softcap
// (each scaled score s becomes softcap * tanh(s / softcap)) and sinks (a logit per query
// head that joins the softmax and takes no value) are per call too; such layers do not
// run on the tile unit (AMX), but on the AVX-512 path. Queries,
// keys, values and output are float32 or bfloat16 (one entry point each); scores, softmax
// and sums are fp32 either way, and a bfloat16 output is rounded once, at the end.
//
// Work items are (KV head, tile of query tokens); the query heads that share the KV head
// (grouped-query attention) are all rows of the tile, so each K and V block is read once
// for all of them while it is in L1. On AVX2 / AVX-512, flash-style:
// - a first pass lays K out transposed in blocks of SUB keys, so one vector of
//   multiply-adds yields a score for each of its keys without horizontal sums (bfloat16
//   keys in pairs for the AVX-512 BF16 dot products), and widens bfloat16 V to fp32;
// - then, per tile and key block: scores for several rows at once (independent chains
//   that hide the multiply-add latency), online softmax (running max and sum per row),
//   and the weighted V added into each row's fp32 output, several rows per V load.
// On a CPU with AMX (Intel's tile unit), bfloat16 runs both products on tiles: the scores
// against the same transposed keys, and the weighted V with V laid out in pairs of keys
// and each weight split into two bfloat16 (its rounding and the rest), which keeps the
// weights to about 16 bits instead of bfloat16's 8; softmax stays on AVX-512.
// Elsewhere, plain loops the compiler vectorises, one row at a time.
//
// Threads: OpenMP, the runtime torch itself uses, with the thread count torch uses. Tiles
// are handed out dynamically, those that see the most keys first, so causal cost balances.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_vector_math.h"

namespace {

template <typename T>
struct Args {
    T* out;  // [q_len, num_heads, head_dim], contiguous
    const T* query;
    int64_t q_token_stride;
    int64_t q_head_stride;
    const T* key;
    int64_t k_token_stride;
    int64_t k_head_stride;
    const T* value;
    int64_t v_token_stride;
    int64_t v_head_stride;
    int q_len;
    int past_len;
    int num_heads;
    int num_kv_heads;
    int head_dim;
    float scale;
    int window;          // keys a query sees, its own included (> 0), or 0: every earlier key
    float softcap;       // > 0: each score s becomes softcap * tanh(s / softcap); 0: none
    const float* sinks;  // [num_heads] logits that join each softmax and take no value; or null

    int group() const { return num_heads / num_kv_heads; }
    // The first key a query at `position` sees.
    int window_start(int position) const { return window > 0 ? std::max(0, position - window + 1) : 0; }
    bool full_attention() const { return window <= 0 && softcap == 0.0f && sinks == nullptr; }
    int num_keys() const { return past_len + q_len; }
    const T* q_row(int token, int head) const { return query + token * q_token_stride + head * q_head_stride; }
    const T* k_row(int token, int kv) const { return key + token * k_token_stride + kv * k_head_stride; }
    const T* v_row(int token, int kv) const { return value + token * v_token_stride + kv * v_head_stride; }
};

constexpr int TILE = 16;  // query tokens per work item

inline int num_tiles(int q_len) { return (q_len + TILE - 1) / TILE; }

// No more threads than work items: a short prompt runs on few threads instead of waking
// a team that would wait at the barrier.
inline int team_size(int items, int num_threads) { return std::max(1, std::min(items, num_threads)); }

// Work item i: the tiles that see the most keys come first, each for every KV head.
inline void item_of(int i, int tiles, int kv_heads, int& kv, int& tile) {
    kv = i % kv_heads;
    tile = tiles - 1 - i / kv_heads;
}

// One row of query (token, head) at a time: scores, softmax and weighted V in plain loops.
template <typename T>
void attend_tile_portable(const Args<T>& a, int kv, int tile, std::vector<float>& scores, std::vector<float>& acc) {
    const int dim = a.head_dim, group = a.group();
    const int first = tile * TILE, last = std::min(a.q_len, first + TILE);
    scores.resize((size_t)a.past_len + last);
    acc.resize(dim);
    for (int t = first; t < last; ++t) {
        const int n = a.past_len + t + 1, lo = a.window_start(n - 1);
        for (int h = kv * group; h < (kv + 1) * group; ++h) {
            const T* q = a.q_row(t, h);
            float m = a.sinks != nullptr ? a.sinks[h] : -std::numeric_limits<float>::infinity();
            for (int j = lo; j < n; ++j) {
                const T* k = a.k_row(j, kv);
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; ++d) s += to_float(q[d]) * to_float(k[d]);
                s *= a.scale;
                scores[j] = a.softcap > 0.0f ? a.softcap * std::tanh(s / a.softcap) : s;
                m = std::max(m, scores[j]);
            }
            float sum = a.sinks != nullptr ? std::exp(a.sinks[h] - m) : 0.0f;
            for (int j = lo; j < n; ++j) {
                scores[j] = std::exp(scores[j] - m);
                sum += scores[j];
            }
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int j = lo; j < n; ++j) {
                const T* v = a.v_row(j, kv);
                const float p = scores[j];
                float* o = acc.data();
#pragma omp simd
                for (int d = 0; d < dim; ++d) o[d] += p * to_float(v[d]);
            }
            T* out = a.out + ((int64_t)t * a.num_heads + h) * dim;
            const float inv = 1.0f / sum;
            for (int d = 0; d < dim; ++d) store_float(out + d, acc[d] * inv);
        }
    }
}

template <typename T>
void attend_portable(const Args<T>& a, int num_threads) {
    const int tiles = num_tiles(a.q_len), items = tiles * a.num_kv_heads;
#pragma omp parallel num_threads(team_size(items, num_threads))
    {
        std::vector<float> scores, acc;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < items; ++i) {
            int kv, tile;
            item_of(i, tiles, a.num_kv_heads, kv, tile);
            attend_tile_portable(a, kv, tile, scores, acc);
        }
    }
}

#ifdef INFLIGHT_AVX2
// The vector width the blocked path is written for: 16 lanes on AVX-512, 8 on AVX2.
#ifdef INFLIGHT_AVX512
using vec = __m512;
constexpr int W = 16;
// Rows at once: scores keep ROWS x 2 accumulators, the weighted V ROWS x 4, of 32 registers.
constexpr int SCORE_ROWS = 8;
constexpr int WEIGH_ROWS = 6;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vadd(vec x, vec y) { return _mm512_add_ps(x, y); }
inline vec vsub(vec x, vec y) { return _mm512_sub_ps(x, y); }
inline vec vmul(vec x, vec y) { return _mm512_mul_ps(x, y); }
inline vec vdiv(vec x, vec y) { return _mm512_div_ps(x, y); }
inline vec vmax(vec x, vec y) { return _mm512_max_ps(x, y); }
inline vec vfmadd(vec x, vec y, vec z) { return _mm512_fmadd_ps(x, y, z); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline float vtop(vec v) { return _mm512_reduce_max_ps(v); }

// exp16, and 0 below -87 (where masked scores, -inf, land).
inline vec vexp(vec x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), exp16(x));
}

template <typename T>
inline void vstore_as(T* p, vec v) {
    store8(p, _mm512_castps512_ps256(v));
    store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
using vec = __m256;
constexpr int W = 8;
constexpr int SCORE_ROWS = 4;  // of 16 registers
constexpr int WEIGH_ROWS = 2;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vadd(vec x, vec y) { return _mm256_add_ps(x, y); }
inline vec vsub(vec x, vec y) { return _mm256_sub_ps(x, y); }
inline vec vmul(vec x, vec y) { return _mm256_mul_ps(x, y); }
inline vec vdiv(vec x, vec y) { return _mm256_div_ps(x, y); }
inline vec vmax(vec x, vec y) { return _mm256_max_ps(x, y); }
inline vec vfmadd(vec x, vec y, vec z) { return _mm256_fmadd_ps(x, y, z); }
inline float vsum(vec v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
inline float vtop(vec v) {
    const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}
// exp8, and 0 below -87 (where masked scores, -inf, land).
inline vec vexp(vec x) { return _mm256_and_ps(exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ)); }

template <typename T>
inline void vstore_as(T* p, vec v) {
    store8(p, v);
}
#endif

// tanh(x) as 1 - 2 / (e^2x + 1): vexp's clamp and its 0 below -87 keep it finite, -1
// and 1 at the ends (about 1e-7 off, absolute). -inf gives -1.
inline vec vtanh(vec x) {
    const vec one = vset1(1.0f);
    return vsub(one, vdiv(vset1(2.0f), vadd(vexp(vadd(x, x)), one)));
}

// Keys are scored SUB at a time (two vectors per row), and softmax and weighted V go
// BLOCK at a time, which halves the per-block row reductions and output reloads.
constexpr int SUB = 2 * W;
constexpr int BLOCK = 2 * SUB;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// What the scores read keys (and queries) as: bfloat16 pairs where the CPU has the
// AVX-512 BF16 dot products, fp32 otherwise.
#ifdef INFLIGHT_AVX512BF16
template <typename T>
using KeyT = T;
#else
template <typename T>
using KeyT = float;
#endif

// Scores of ROWS query rows (`dim` apart in `q`) against one SUB-key block of transposed
// keys, into rows BLOCK apart in `s`. The block's layout: fp32 as [head_dim][SUB];
// bfloat16 as [head_dim / 2][SUB] pairs (the dot products' operand).
template <int ROWS, typename K>
inline void score_rows(const K* q, int dim, const K* kt, float* s, vec scale) {
    vec acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = vzero();
#ifdef INFLIGHT_AVX512BF16
    if constexpr (std::is_same_v<K, bf16>) {
        for (int d = 0; d < dim; d += 2) {
            __m512bh k0, k1;
            std::memcpy(&k0, kt + (int64_t)d * SUB, sizeof k0);
            std::memcpy(&k1, kt + (int64_t)d * SUB + 2 * W, sizeof k1);
            for (int r = 0; r < ROWS; ++r) {
                int32_t pair;
                std::memcpy(&pair, q + r * dim + d, sizeof pair);
                const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
            }
        }
    } else
#endif
    {
        for (int d = 0; d < dim; ++d) {
            const vec k0 = vload(kt + (int64_t)d * SUB), k1 = vload(kt + (int64_t)d * SUB + W);
            for (int r = 0; r < ROWS; ++r) {
                const vec qv = vset1(q[r * dim + d]);
                acc[r][0] = vfmadd(qv, k0, acc[r][0]);
                acc[r][1] = vfmadd(qv, k1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        vstore(s + r * BLOCK, vmul(acc[r][0], scale));
        vstore(s + r * BLOCK + W, vmul(acc[r][1], scale));
    }
}

template <typename K>
inline void score_some(int rows, const K* q, int dim, const K* kt, float* s, vec scale) {
    switch (rows) {
        case 8: score_rows<8>(q, dim, kt, s, scale); break;
        case 7: score_rows<7>(q, dim, kt, s, scale); break;
        case 6: score_rows<6>(q, dim, kt, s, scale); break;
        case 5: score_rows<5>(q, dim, kt, s, scale); break;
        case 4: score_rows<4>(q, dim, kt, s, scale); break;
        case 3: score_rows<3>(q, dim, kt, s, scale); break;
        case 2: score_rows<2>(q, dim, kt, s, scale); break;
        default: score_rows<1>(q, dim, kt, s, scale); break;
    }
}

// Each row's output columns [0, COLS vectors) scaled by its `alpha`, plus its weights
// times `count` V rows: each V vector is loaded once for all ROWS rows.
template <int ROWS, int COLS>
inline void weigh_rows(const float* p, const float* alpha, const float* v, int64_t v_stride, int count, float* o,
                       int dim) {
    vec acc[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r) {
        const vec scale = vset1(alpha[r]);
        for (int c = 0; c < COLS; ++c) acc[r][c] = vmul(vload(o + r * dim + c * W), scale);
    }
    for (int j = 0; j < count; ++j) {
        vec row[COLS];
        for (int c = 0; c < COLS; ++c) row[c] = vload(v + j * v_stride + c * W);
        for (int r = 0; r < ROWS; ++r) {
            const vec weight = vset1(p[r * BLOCK + j]);
            for (int c = 0; c < COLS; ++c) acc[r][c] = vfmadd(weight, row[c], acc[r][c]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < COLS; ++c) vstore(o + r * dim + c * W, acc[r][c]);
}

template <int ROWS>
inline void weigh_cols(int cols, const float* p, const float* alpha, const float* v, int64_t v_stride, int count,
                       float* o, int dim) {
    switch (cols) {
        case 4: weigh_rows<ROWS, 4>(p, alpha, v, v_stride, count, o, dim); break;
        case 3: weigh_rows<ROWS, 3>(p, alpha, v, v_stride, count, o, dim); break;
        case 2: weigh_rows<ROWS, 2>(p, alpha, v, v_stride, count, o, dim); break;
        default: weigh_rows<ROWS, 1>(p, alpha, v, v_stride, count, o, dim); break;
    }
}

// Keys transposed block by block (and bfloat16 V widened), per KV head: built once per
// call, read by every tile; the buffers live in the calling thread, kept across calls.
// Keys from `base` on (a multiple of BLOCK): a sliding window's chunk skips those before
// its first query's window; 0 otherwise. Blocks are counted from there.
template <typename T>
struct Prepared {
    const KeyT<T>* keys;      // [kv_heads][blocks][head_dim * SUB]
    const float* values;      // [kv_heads][keys - base][head_dim] for bfloat16; float32 V is read in place
    const T* value_pairs;     // on AMX instead: [kv_heads][blocks * SUB / 2][head_dim] pairs of keys
    int blocks;
    int base;

    const KeyT<T>* key_block(int kv, int key, int dim) const {
        return keys + ((int64_t)kv * blocks + (key - base) / SUB) * dim * SUB;
    }
};

template <typename T>
void prepare_block(const Args<T>& a, KeyT<T>* keys, float* values, T* value_pairs, int blocks, int base, int kv,
                   int b) {
    using K = KeyT<T>;
    const int dim = a.head_dim, start = base + b * SUB, count = std::min(SUB, a.num_keys() - start);
    K* kt = keys + ((int64_t)kv * blocks + b) * dim * SUB;
    std::fill(kt, kt + (int64_t)dim * SUB, K{});  // zero past the last key: scored, masked, never NaN
    for (int j = 0; j < count; ++j) {
        const T* k = a.k_row(start + j, kv);
        if constexpr (std::is_same_v<K, bf16>) {
            // A pair of bfloat16 at a time, as one 32-bit element.
            uint32_t* pairs = reinterpret_cast<uint32_t*>(kt);
            for (int d = 0; d < dim; d += 2) std::memcpy(pairs + (int64_t)(d / 2) * SUB + j, k + d, 4);
        } else {
            for (int d = 0; d < dim; ++d) kt[(int64_t)d * SUB + j] = to_float(k[d]);
        }
    }
    if (value_pairs != nullptr) {
        // Key 2i and 2i + 1 side by side for each column (the tile unit's right operand);
        // zero past the last key, where the weights are 0 (and 0 x garbage could be NaN).
        T* pairs = value_pairs + ((int64_t)kv * blocks + b) * SUB * dim;
        for (int j = 0; j < SUB; ++j) {
            T* column = pairs + (int64_t)(j / 2) * 2 * dim + j % 2;
            if (j < count) {
                const T* v = a.v_row(start + j, kv);
                for (int d = 0; d < dim; ++d) column[2 * d] = v[d];
            } else {
                for (int d = 0; d < dim; ++d) column[2 * d] = T{};
            }
        }
    }
    if (values != nullptr)
        for (int j = 0; j < count; ++j) {
            const T* v = a.v_row(start + j, kv);
            float* wide = values + ((int64_t)kv * (a.num_keys() - base) + start - base + j) * dim;
            for (int d = 0; d < dim; ++d) wide[d] = to_float(v[d]);
        }
}

// Per-thread buffers for one tile.
struct Scratch {
    std::vector<float> q32, scores, out, top, fresh, sums, shift, alpha, part;
    std::vector<bf16> q16, weights;
};

template <typename T>
void attend_tile(const Args<T>& a, const Prepared<T>& prep, int kv, int tile, Scratch& w) {
    using K = KeyT<T>;
    const int dim = a.head_dim, group = a.group();
    const int first = tile * TILE, tokens = std::min(TILE, a.q_len - first), rows = tokens * group;
    const int padded = (rows + W - 1) / W * W;
    // Rows in token order, the group's heads within a token: row r is token first + r / group.
    K* q;
    if constexpr (std::is_same_v<K, bf16>) {
        w.q16.resize((size_t)rows * dim);
        q = w.q16.data();
    } else {
        w.q32.resize((size_t)rows * dim);
        q = w.q32.data();
    }
    for (int r = 0; r < rows; ++r) {
        const T* src = a.q_row(first + r / group, kv * group + r % group);
        if constexpr (std::is_same_v<K, T>) std::memcpy(q + r * dim, src, dim * sizeof(T));
        else
            for (int d = 0; d < dim; ++d) q[r * dim + d] = to_float(src[d]);
    }
    w.scores.resize((size_t)rows * BLOCK);
    w.out.assign((size_t)rows * dim, 0.0f);
    w.top.assign(rows, NEG_INF);            // running max of each row's scores
    w.sums.assign((size_t)rows * W, 0.0f);  // running sum of its weights, per lane
    if (a.sinks != nullptr)                 // a sink: a score of its own, weight e^0, no value
        for (int r = 0; r < rows; ++r) {
            w.top[r] = a.sinks[kv * group + r % group];
            w.sums[(size_t)r * W] = 1.0f;
        }
    w.shift.assign(padded, 0.0f);
    w.alpha.resize(padded);
    float* s = w.scores.data();
    const vec scale = vset1(a.scale);
    const int first_pos = a.past_len + first;  // position of the tile's first token
    const int keys = first_pos + tokens;       // keys its last token sees
    constexpr int VECTORS = BLOCK / W;
    // A sliding window: blocks wholly before the first row's window are skipped, and rows
    // whose window starts past a block see none of it.
    const int window = a.window, window_begin = a.window_start(first_pos);
    const bool capped = a.softcap > 0.0f;
    const vec cap = vset1(a.softcap), inv_cap = vset1(capped ? 1.0f / a.softcap : 0.0f);

    for (int start = window_begin / BLOCK * BLOCK; start < keys; start += BLOCK) {
        const int count = std::min(BLOCK, keys - start);
        // Rows that see none of this block are left as they are: in token order, a prefix
        // (before it) and, with a window, a suffix (past it).
        const int begin = std::max(0, start - first_pos) * group;
        const int end = window > 0 ? std::min(rows, std::max(0, start + count + window - 1 - first_pos) * group) : rows;
        if (begin >= end) continue;
        for (int sub = start; sub < start + count; sub += SUB) {
            const K* kt = prep.key_block(kv, sub, dim);
            for (int r = std::max(0, sub - first_pos) * group; r < end; r += SCORE_ROWS)
                score_some(std::min(SCORE_ROWS, end - r), q + r * dim, dim, kt, s + r * BLOCK + sub - start, scale);
        }
        if (capped)
            for (int r = begin; r < end; ++r)
                for (int i = 0; i < VECTORS; ++i) {
                    float* x = s + r * BLOCK + i * W;
                    vstore(x, vmul(cap, vtanh(vmul(vload(x), inv_cap))));
                }
        // Causal mask: keys past a row's own position (and past the last key: scores
        // skipped above) do not count.
        if (start + BLOCK > first_pos + 1)
            for (int r = begin; r < end; ++r)
                for (int j = std::max(0, first_pos + r / group + 1 - start); j < BLOCK; ++j)
                    s[r * BLOCK + j] = NEG_INF;
        // Window mask: keys before a row's window do not count either.
        if (window > 0 && start < a.window_start(keys - 1))
            for (int r = begin; r < end; ++r)
                for (int j = 0, stop = std::min(BLOCK, a.window_start(first_pos + r / group) - start); j < stop; ++j)
                    s[r * BLOCK + j] = NEG_INF;
        // Online softmax: each row's new max, the factor its earlier sums shrink by
        // (0 on its first block, where the old max is -inf), and the block's weights.
        // Every row from `begin` to `end` sees a key of the block, so its max is finite.
        for (int r = begin; r < end; ++r) {
            vec top = vload(s + r * BLOCK);
            for (int i = 1; i < VECTORS; ++i) top = vmax(top, vload(s + r * BLOCK + i * W));
            const float row_top = std::max(w.top[r], vtop(top));
            w.shift[r] = w.top[r] - row_top;
            w.top[r] = row_top;
        }
        for (int r = begin / W * W; r < end; r += W) vstore(w.alpha.data() + r, vexp(vload(w.shift.data() + r)));
        for (int r = begin; r < end; ++r) {
            const vec top = vset1(w.top[r]);
            vec total = vzero();
            for (int i = 0; i < VECTORS; ++i) {
                const vec p = vexp(vsub(vload(s + r * BLOCK + i * W), top));
                vstore(s + r * BLOCK + i * W, p);
                total = vadd(total, p);
            }
            float* sum = w.sums.data() + (size_t)r * W;
            vstore(sum, vfmadd(vload(sum), vset1(w.alpha[r]), total));
        }
        // Weighted V, in column slices of up to four vectors.
        const float* v;
        int64_t v_stride;
        if constexpr (std::is_same_v<T, float>) {
            v = a.v_row(start, kv);
            v_stride = a.v_token_stride;
        } else {
            v = prep.values + ((int64_t)kv * (a.num_keys() - prep.base) + start - prep.base) * dim;
            v_stride = dim;
        }
        for (int col = 0; col < dim; col += 4 * W) {
            const int cols = std::min(4, (dim - col) / W);
            for (int r = begin; r < end; r += WEIGH_ROWS) {
                const float* p = s + r * BLOCK;
                const float* alpha = w.alpha.data() + r;
                float* o = w.out.data() + (size_t)r * dim + col;
                switch (std::min(WEIGH_ROWS, end - r)) {
                    case 6: weigh_cols<6>(cols, p, alpha, v + col, v_stride, count, o, dim); break;
                    case 5: weigh_cols<5>(cols, p, alpha, v + col, v_stride, count, o, dim); break;
                    case 4: weigh_cols<4>(cols, p, alpha, v + col, v_stride, count, o, dim); break;
                    case 3: weigh_cols<3>(cols, p, alpha, v + col, v_stride, count, o, dim); break;
                    case 2: weigh_cols<2>(cols, p, alpha, v + col, v_stride, count, o, dim); break;
                    default: weigh_cols<1>(cols, p, alpha, v + col, v_stride, count, o, dim); break;
                }
            }
        }
    }
    for (int r = 0; r < rows; ++r) {
        T* out = a.out + ((int64_t)(first + r / group) * a.num_heads + kv * group + r % group) * dim;
        const vec inv = vset1(1.0f / vsum(vload(w.sums.data() + (size_t)r * W)));
        for (int d = 0; d < dim; d += W) vstore_as(out + d, vmul(vload(w.out.data() + (size_t)r * dim + d), inv));
    }
}

#ifdef INFLIGHT_AMX
// Tiles 0-3 hold results, 4 and 6 left operands, 5 the right (`cpu_amx.h`).
namespace tiles {

static_assert(SUB == 32 && BLOCK == 64, "a key block is four result tiles of 16 keys");

// The first n lanes of 16 (none for n <= 0, all for n >= 16).
inline __mmask16 lanes(int n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

// Scores of 16 query rows (`dim` apart) against `subs` SUB-key blocks of transposed keys
// (their [dim / 2][SUB] pairs are the right operand as laid out), into rows BLOCK apart.
inline void score_group(const bf16* q, int dim, const bf16* kt, int subs, float* s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const bf16* next = kt + (int64_t)dim * SUB;  // the second SUB block
    for (int d = 0; d < dim; d += 32) {
        _tile_loadd(4, q + d, dim * 2);
        _tile_loadd(5, kt + (int64_t)d * SUB, SUB * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, kt + (int64_t)d * SUB + 32, SUB * 4);
        _tile_dpbf16ps(1, 4, 5);
        if (subs == 2) {
            _tile_loadd(5, next + (int64_t)d * SUB, SUB * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, next + (int64_t)d * SUB + 32, SUB * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, s, BLOCK * 4);
    _tile_stored(1, s + 16, BLOCK * 4);
    if (subs == 2) {
        _tile_stored(2, s + 32, BLOCK * 4);
        _tile_stored(3, s + 48, BLOCK * 4);
    }
}

// 16 rows' weights for one block, each the sum of a high and a low bfloat16 (`high` and
// `low`, rows BLOCK apart), times its V (pairs of keys, [keys / 2][dim]), 64 columns at
// a time, into `part` (16 x dim fp32).
inline void weigh_group(const bf16* high, const bf16* low, const bf16* pairs, int subs, int dim, float* part) {
    for (int col = 0; col < dim; col += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < subs; ++k) {
            const bf16* v = pairs + (int64_t)k * (SUB / 2) * 2 * dim + 2 * col;
            _tile_loadd(4, high + k * SUB, BLOCK * 2);
            _tile_loadd(6, low + k * SUB, BLOCK * 2);
            _tile_loadd(5, v, dim * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(0, 6, 5);
            _tile_loadd(5, v + 32, dim * 4);
            _tile_dpbf16ps(1, 4, 5);
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(5, v + 64, dim * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(2, 6, 5);
            _tile_loadd(5, v + 96, dim * 4);
            _tile_dpbf16ps(3, 4, 5);
            _tile_dpbf16ps(3, 6, 5);
        }
        _tile_stored(0, part + col, dim * 4);
        _tile_stored(1, part + col + 16, dim * 4);
        _tile_stored(2, part + col + 32, dim * 4);
        _tile_stored(3, part + col + 48, dim * 4);
    }
}

}  // namespace tiles

// A row's BLOCK scores, those of keys at or past `seen` as -inf.
inline void masked_scores(const float* row, int seen, vec* x) {
    for (int i = 0; i < BLOCK / W; ++i) x[i] = _mm512_mask_loadu_ps(vset1(NEG_INF), tiles::lanes(seen - i * W), row + i * W);
}

// attend_tile on the tile unit (bfloat16, head_dim a multiple of 64, scale > 0). The
// running max is kept in unscaled scores (the same order for a positive scale), so the
// scale rides in the exponent's multiply-add.
void attend_tile_amx(const Args<bf16>& a, const Prepared<bf16>& prep, int kv, int tile, Scratch& w) {
    const int dim = a.head_dim, group = a.group();
    const int first = tile * TILE, tokens = std::min(TILE, a.q_len - first), rows = tokens * group;
    const int groups = (rows + amx::ROWS - 1) / amx::ROWS, padded = groups * amx::ROWS;
    // Rows in token order as in attend_tile; rows past the last are zero: scored, not used.
    w.q16.resize((size_t)padded * dim);
    bf16* q = w.q16.data();
    for (int r = 0; r < rows; ++r)
        std::memcpy(q + r * dim, a.q_row(first + r / group, kv * group + r % group), dim * sizeof(bf16));
    std::memset(q + rows * dim, 0, (size_t)(padded - rows) * dim * sizeof(bf16));
    w.scores.resize((size_t)padded * BLOCK);
    // The high parts, then the low. A row not (or no longer) written keeps finite leftovers:
    // a result row depends on its own weights row only, and such rows' results are unused.
    w.weights.resize((size_t)2 * padded * BLOCK);
    w.part.resize((size_t)amx::ROWS * dim);
    w.out.assign((size_t)rows * dim, 0.0f);
    w.top.assign(padded, NEG_INF);
    w.fresh.assign(padded, NEG_INF);
    w.sums.assign((size_t)rows * W, 0.0f);
    w.alpha.resize(padded);
    float* s = w.scores.data();
    const float scale = a.scale;
    const int first_pos = a.past_len + first, keys = first_pos + tokens;

    for (int start = 0; start < keys; start += BLOCK) {
        const int begin = std::max(0, start - first_pos) * group;
        const int subs = std::min(2, (keys - start + SUB - 1) / SUB);
        const bf16* kt = prep.keys + ((int64_t)kv * prep.blocks + start / SUB) * dim * SUB;
        for (int g = begin / amx::ROWS; g < groups; ++g)
            tiles::score_group(q + (int64_t)g * amx::ROWS * dim, dim, kt, subs, s + (size_t)g * amx::ROWS * BLOCK);
        // Softmax in three passes over the rows, each row independent of the others within
        // a pass (so the core overlaps them): each row's new max, of its scores with the
        // causal mask (and past the block's last key) as -inf; then 16 rows at a time, the
        // factor their earlier sums shrink by; then each row's weights, split in two
        // bfloat16, and its sum, kept per lane.
        const int first_row = begin / W * W;
        std::copy(w.top.begin() + first_row, w.top.end(), w.fresh.begin() + first_row);
        for (int r = begin; r < rows; ++r) {
            vec x[BLOCK / W];
            masked_scores(s + (size_t)r * BLOCK, first_pos + r / group + 1 - start, x);
            w.fresh[r] = std::max(w.top[r], vtop(vmax(vmax(x[0], x[1]), vmax(x[2], x[3]))));
        }
        for (int r = first_row; r < rows; r += W) {
            const vec top = vload(w.top.data() + r), fresh = vload(w.fresh.data() + r);
            vstore(w.alpha.data() + r, vexp(vmul(vsub(top, fresh), vset1(scale))));  // 0 where top is -inf
            vstore(w.top.data() + r, fresh);
        }
        for (int r = begin; r < rows; ++r) {
            vec x[BLOCK / W];
            masked_scores(s + (size_t)r * BLOCK, first_pos + r / group + 1 - start, x);
            const vec shift = vset1(-w.top[r] * scale), times = vset1(scale);
            vec total = vzero();
            bf16* high = w.weights.data() + (size_t)r * BLOCK;
            bf16* low = high + (size_t)padded * BLOCK;
            for (int i = 0; i < BLOCK / W; ++i) {
                const vec weight = vexp(vfmadd(x[i], times, shift));
                const __m256bh rounded = _mm512_cvtneps_pbh(weight);
                const __m256bh rest = _mm512_cvtneps_pbh(vsub(weight, _mm512_cvtpbh_ps(rounded)));
                std::memcpy(high + i * W, &rounded, sizeof rounded);
                std::memcpy(low + i * W, &rest, sizeof rest);
                total = vadd(total, weight);
            }
            float* sum = w.sums.data() + (size_t)r * W;
            vstore(sum, vfmadd(vload(sum), vset1(w.alpha[r]), total));
        }
        const bf16* pairs = prep.value_pairs + ((int64_t)kv * prep.blocks * SUB + start) * dim;
        for (int g = begin / amx::ROWS; g < groups; ++g) {
            const bf16* high = w.weights.data() + (size_t)g * amx::ROWS * BLOCK;
            tiles::weigh_group(high, high + (size_t)padded * BLOCK, pairs, subs, dim, w.part.data());
            for (int r = std::max(begin, g * amx::ROWS); r < std::min(rows, (g + 1) * amx::ROWS); ++r) {
                float* o = w.out.data() + (size_t)r * dim;
                const float* part = w.part.data() + (size_t)(r - g * amx::ROWS) * dim;
                const vec alpha = vset1(w.alpha[r]);
                for (int d = 0; d < dim; d += W) vstore(o + d, vfmadd(vload(o + d), alpha, vload(part + d)));
            }
        }
    }
    for (int r = 0; r < rows; ++r) {
        bf16* out = a.out + ((int64_t)(first + r / group) * a.num_heads + kv * group + r % group) * dim;
        const vec inv = vset1(1.0f / vsum(vload(w.sums.data() + (size_t)r * W)));
        for (int d = 0; d < dim; d += W) vstore_as(out + d, vmul(vload(w.out.data() + (size_t)r * dim + d), inv));
    }
}
#endif

template <typename T>
bool use_amx(const Args<T>& a) {
#ifdef INFLIGHT_AMX
    if constexpr (std::is_same_v<T, bf16>)
        return a.full_attention() && a.head_dim % 64 == 0 && a.scale > 0.0f && amx::granted();
#endif
    (void)a;
    return false;
}

constexpr size_t MAX_KEPT_BYTES = size_t(64) << 20;

template <typename T>
void attend_blocked(const Args<T>& a, int num_threads) {
    using K = KeyT<T>;
    // Keys before the first query's window are never read (none without a window).
    const int base = a.window_start(a.past_len) / BLOCK * BLOCK;
    const int blocks = (a.num_keys() - base + SUB - 1) / SUB;
    const int tiles = num_tiles(a.q_len), items = tiles * a.num_kv_heads;
    const bool tiled = use_amx(a);
    thread_local std::vector<K> key_store;
    thread_local std::vector<float> value_store;
    thread_local std::vector<T> pair_store;
    const size_t key_size = (size_t)a.num_kv_heads * blocks * a.head_dim * SUB;
    if (key_store.size() < key_size) key_store.resize(key_size);
    float* values = nullptr;
    T* pairs = nullptr;
    if (tiled) {
        if (pair_store.size() < key_size) pair_store.resize(key_size);
        pairs = pair_store.data();
    } else if constexpr (!std::is_same_v<T, float>) {
        const size_t value_size = (size_t)a.num_kv_heads * (a.num_keys() - base) * a.head_dim;
        if (value_store.size() < value_size) value_store.resize(value_size);
        values = value_store.data();
    }
    const Prepared<T> prep{key_store.data(), values, pairs, blocks, base};
    K* keys = key_store.data();
#pragma omp parallel num_threads(team_size(items, num_threads))
    {
#pragma omp for schedule(static)
        for (int i = 0; i < a.num_kv_heads * blocks; ++i)
            prepare_block(a, keys, values, pairs, blocks, base, i / blocks, i % blocks);
        Scratch scratch;  // per thread, reused across its items
#ifdef INFLIGHT_AMX
        if constexpr (std::is_same_v<T, bf16>)
            if (tiled) amx::configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < items; ++i) {
            int kv, tile;
            item_of(i, tiles, a.num_kv_heads, kv, tile);
#ifdef INFLIGHT_AMX
            if constexpr (std::is_same_v<T, bf16>)
                if (tiled) {
                    attend_tile_amx(a, prep, kv, tile, scratch);
                    continue;
                }
#endif
            attend_tile(a, prep, kv, tile, scratch);
        }
#ifdef INFLIGHT_AMX
        if (tiled) _tile_release();
#endif
    }
    // Kept for the next call (fresh pages cost more than filling them), unless a very long
    // context made them large.
    const size_t kept = key_store.capacity() * sizeof(K) + value_store.capacity() * sizeof(float) +
                        pair_store.capacity() * sizeof(T);
    if (kept > MAX_KEPT_BYTES) {
        std::vector<K>().swap(key_store);
        std::vector<float>().swap(value_store);
        std::vector<T>().swap(pair_store);
    }
}
#endif

template <typename T>
int attend(const Args<T>& a, int num_threads) {
    if (a.num_kv_heads <= 0 || a.num_heads <= 0 || a.num_heads % a.num_kv_heads != 0) return -1;
    if (!(a.softcap >= 0.0f)) return -1;
    if (a.head_dim <= 0 || a.head_dim % 16 != 0 || a.head_dim > 512 || a.q_len < 0 || a.past_len < 0) return -1;
    if (a.q_len == 0) return 0;
#ifdef INFLIGHT_AVX2
    attend_blocked(a, num_threads);
#else
    attend_portable(a, num_threads);
#endif
    return 0;
}

// A window that covers every key is no window (and the sums above stay in int range).
inline int window_of(int window, int q_len, int past_len) {
    return window <= 0 || (int64_t)window >= (int64_t)q_len + past_len ? 0 : window;
}

}  // namespace

// A layer's attention: `window` > 0 keys up to each query's own (inclusive) or 0 (or
// less) for all earlier keys, `softcap` > 0 or 0 for none, `sinks` [num_heads] fp32
// logits or null. Returns 0, or -1 if the arguments are out of what this kernel handles
// (head_dim must be a multiple of 16, at most 512; num_heads a multiple of num_kv_heads).
extern "C" int prompt_attention(float* out, const float* query, int64_t q_token_stride, int64_t q_head_stride,
                                const float* key, int64_t k_token_stride, int64_t k_head_stride, const float* value,
                                int64_t v_token_stride, int64_t v_head_stride, int q_len, int past_len, int num_heads,
                                int num_kv_heads, int head_dim, float scale, int window, float softcap,
                                const float* sinks, int num_threads) {
    const Args<float> a{out, query, q_token_stride, q_head_stride, key, k_token_stride, k_head_stride, value,
                        v_token_stride, v_head_stride, q_len, past_len, num_heads, num_kv_heads, head_dim, scale,
                        window_of(window, q_len, past_len), softcap, sinks};
    return attend(a, num_threads);
}

// The same over bfloat16 queries, keys, values and output (`bf16` is layout-compatible with uint16).
extern "C" int prompt_attention_bf16(bf16* out, const bf16* query, int64_t q_token_stride, int64_t q_head_stride,
                                     const bf16* key, int64_t k_token_stride, int64_t k_head_stride, const bf16* value,
                                     int64_t v_token_stride, int64_t v_head_stride, int q_len, int past_len,
                                     int num_heads, int num_kv_heads, int head_dim, float scale, int window,
                                     float softcap, const float* sinks, int num_threads) {
    const Args<bf16> a{out, query, q_token_stride, q_head_stride, key, k_token_stride, k_head_stride, value,
                       v_token_stride, v_head_stride, q_len, past_len, num_heads, num_kv_heads, head_dim, scale,
                       window_of(window, q_len, past_len), softcap, sinks};
    return attend(a, num_threads);
}
