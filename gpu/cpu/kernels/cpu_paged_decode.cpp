// Paged decode attention on the CPU: one query token per request, attending over the
// request's blocks where they lie in the pool (no gather into a padded batch).
//
// Every K and V row of a context is read once per step and layer, for all the query
// heads that share it (grouped-query attention). Queries, cache and output are float32
// or bfloat16 (one entry point each); scores and sums are fp32 either way, and a
// bfloat16 output is rounded once, at the end. Two builds of the same passes (scores,
// softmax, weighted V):
// - on AVX2 (head sizes 64 and 128), one work item per group of requests that share
//   leading blocks (often a group of one): blocks are read whole and in order, a shared
//   block once for the whole group, the next block is prefetched (blocks are scattered,
//   so the hardware cannot guess it; into L2), and the exponentials are vectorised; bfloat16
//   scores use AVX-512 BF16 dot products where the CPU has them, bfloat16 rows are
//   widened by a shift otherwise;
// - elsewhere, plain loops the compiler vectorises, one work item per (request, KV head).
//
// A layer may attend otherwise: a sliding window (the last `window` positions: the
// blocks wholly before it are not read, the one it starts in is read from there), a
// softcap (each scaled score s becomes softcap * tanh(s / softcap)), sinks (a logit per
// query head that joins the softmax's max and sum and takes no value).
//
// Cache layout, per layer: K and V pools `[slots, num_kv_heads, head_dim]`, token p of a
// request in slot `block_tables[seq][p / block_size] * block_size + p % block_size`.
// The queries' token and head strides are arguments (transformers hands over
// transposed views); the output is contiguous `[tokens, num_heads, head_dim]`.
//
// Threads: OpenMP, the runtime torch itself uses (the library is loaded into a process
// that has torch's libgomp already), with the thread count torch uses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vector_math.h"

namespace {

template <typename T>
struct Args {
    T* out;
    const T* query;
    int64_t query_token_stride;
    int64_t query_head_stride;
    const T* key_pool;
    const T* value_pool;
    const int32_t* query_rows;    // [seqs] the batch row of each decode token
    const int32_t* context_lens;  // [seqs]
    const int32_t* block_tables;  // [seqs, max_blocks]
    int num_seqs;
    int max_blocks;
    int block_size;
    int num_heads;
    int num_kv_heads;
    float scale;
    int window;           // keys a query sees, its own included (> 0), or 0: the whole context
    float softcap;        // > 0: each score s becomes softcap * tanh(s / softcap); 0: none
    const float* sinks;   // [num_heads] logits that join each softmax and take no value; or null
    float inv_softcap;

    // The first position a query at the end of an `n`-token context sees.
    int first_seen(int n) const { return window > 0 ? std::max(0, n - window) : 0; }
    float sink(int head) const { return sinks != nullptr ? sinks[head] : -INFINITY; }
};

// HEAD_DIM > 0 is known at compile time (the loops unroll and vectorize fully);
// 0 takes it from `head_dim`.
template <typename T, int HEAD_DIM>
void attend_one(const Args<T>& a, int head_dim, int seq, int kv_head, std::vector<float>& scores,
                std::vector<float>& acc) {
    const int dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
    const int group = a.num_heads / a.num_kv_heads;
    const int n = a.context_lens[seq];
    // Keys from `first` on (a sliding window skips the blocks before it); scores by
    // position - first, `m` a head.
    const int first = a.first_seen(n), m = n - first;
    const int64_t row_stride = (int64_t)a.num_kv_heads * dim;
    const int32_t* table = a.block_tables + (int64_t)seq * a.max_blocks;
    const int64_t row = a.query_rows[seq];
    scores.resize((size_t)group * m);
    acc.assign((size_t)group * dim, 0.0f);

    // Scores: every K row once, dotted with each query head of the group.
    for (int start = first / a.block_size * a.block_size; start < n; start += a.block_size) {
        const int64_t slot0 = (int64_t)table[start / a.block_size] * a.block_size;
        const int count = std::min(a.block_size, n - start);
        for (int j = std::max(0, first - start); j < count; ++j) {
            const T* k = a.key_pool + (slot0 + j) * row_stride + (int64_t)kv_head * dim;
            for (int g = 0; g < group; ++g) {
                const T* q = a.query + row * a.query_token_stride + (int64_t)(kv_head * group + g) * a.query_head_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; ++d) s += to_float(q[d]) * to_float(k[d]);
                scores[(size_t)g * m + start + j - first] = s * a.scale;
            }
        }
    }
    // Softmax per query head (softcapped first, a sink joining the max and the sum); the
    // weights stay unnormalised until the end.
    float sums[64];
    for (int g = 0; g < group; ++g) {
        float* s = scores.data() + (size_t)g * m;
        if (a.softcap > 0.0f)
            for (int t = 0; t < m; ++t) s[t] = a.softcap * std::tanh(s[t] * a.inv_softcap);
        const float sink = a.sink(kv_head * group + g);
        float top = std::max(s[0], sink);
        for (int t = 1; t < m; ++t) top = std::max(top, s[t]);
        float sum = a.sinks != nullptr ? std::exp(sink - top) : 0.0f;
        for (int t = 0; t < m; ++t) {
            s[t] = std::exp(s[t] - top);
            sum += s[t];
        }
        sums[g] = sum;
    }
    // Weighted V: every V row once, for each query head of the group.
    for (int start = first / a.block_size * a.block_size; start < n; start += a.block_size) {
        const int64_t slot0 = (int64_t)table[start / a.block_size] * a.block_size;
        const int count = std::min(a.block_size, n - start);
        for (int j = std::max(0, first - start); j < count; ++j) {
            const T* v = a.value_pool + (slot0 + j) * row_stride + (int64_t)kv_head * dim;
            for (int g = 0; g < group; ++g) {
                const float p = scores[(size_t)g * m + start + j - first];
                float* o = acc.data() + (size_t)g * dim;
#pragma omp simd
                for (int d = 0; d < dim; ++d) o[d] += p * to_float(v[d]);
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        T* out = a.out + (row * a.num_heads + kv_head * group + g) * dim;
        const float inv = 1.0f / sums[g];
        const float* o = acc.data() + (size_t)g * dim;
        for (int d = 0; d < dim; ++d) store_float(out + d, o[d] * inv);
    }
}


#ifdef INFLIGHT_AVX2
#ifdef INFLIGHT_AVX512BF16
inline __m512bh bf16_vector32(const bf16* p) {
    __m512bh v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// The 16 lanes of `v` summed pairwise into 8.
inline __m256 fold16(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// The eight dot products of `q` with eight K rows `row_stride` apart, as one vector.
// Each row's 8-lane partial sums are folded with horizontal adds, a few instructions for
// all eight instead of a full horizontal sum per row.
template <int HEAD_DIM, typename T>
inline __m256 dot8(const T* q, const T* k, int64_t row_stride) {
    __m256 acc[8];
#ifdef INFLIGHT_AVX512BF16
    if constexpr (std::is_same_v<T, bf16>) {
        // 32 products a row per instruction (bf16 pairs, summed in fp32), folded to 8 lanes.
        __m512 wide[8];
        for (int r = 0; r < 8; ++r) wide[r] = _mm512_setzero_ps();
        for (int d = 0; d < HEAD_DIM; d += 32) {
            const __m512bh qv = bf16_vector32(q + d);
            for (int r = 0; r < 8; ++r) wide[r] = _mm512_dpbf16_ps(wide[r], qv, bf16_vector32(k + r * row_stride + d));
        }
        for (int r = 0; r < 8; ++r) acc[r] = fold16(wide[r]);
    } else
#endif
    {
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
        for (int d = 0; d < HEAD_DIM; d += 8) {
            const __m256 qv = load8(q + d);
            for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, load8(k + r * row_stride + d), acc[r]);
        }
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

template <int HEAD_DIM, typename T>
inline float dot1(const T* q, const T* k) {
    __m256 acc = _mm256_setzero_ps();
#ifdef INFLIGHT_AVX512BF16
    if constexpr (std::is_same_v<T, bf16>) {
        __m512 wide = _mm512_setzero_ps();
        for (int d = 0; d < HEAD_DIM; d += 32) wide = _mm512_dpbf16_ps(wide, bf16_vector32(q + d), bf16_vector32(k + d));
        acc = fold16(wide);
    } else
#endif
        for (int d = 0; d < HEAD_DIM; d += 8) acc = _mm256_fmadd_ps(load8(q + d), load8(k + d), acc);
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// s = softcap * tanh(s / softcap) over one head's scores, in place: tanh(x) as
// 1 - 2 / (e^2x + 1), which exp8's clamp keeps finite (about 1e-7 off, absolute).
inline void cap_scores(float* s, int n, float softcap, float inv_softcap) {
    const __m256 cap = _mm256_set1_ps(softcap), inv = _mm256_set1_ps(inv_softcap * 2.0f);
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
        _mm256_storeu_ps(s + t, _mm256_mul_ps(cap, _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)))));
    }
    for (; t < n; ++t) s[t] = softcap * std::tanh(s[t] * inv_softcap);
}

// Softmax weights of one head's scores, in place and unnormalised; returns their sum.
// `sink` (-inf for none) joins the max and the sum, as a score that takes no value.
inline float exp_scores(float* s, int n, float sink) {
    __m256 max8 = _mm256_set1_ps(std::max(s[0], sink));
    int t = 0;
    for (; t + 8 <= n; t += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(s + t));
    alignas(32) float top[8];
    _mm256_store_ps(top, max8);
    float m = top[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, top[i]);
    for (; t < n; ++t) m = std::max(m, s[t]);
    const __m256 max = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    const float from_sink = sink > -INFINITY ? std::exp(sink - m) : 0.0f;
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), max));
        _mm256_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum8);
    float sum = from_sink;
    for (int i = 0; i < 8; ++i) sum += lanes[i];
    for (; t < n; ++t) {
        s[t] = std::exp(s[t] - m);
        sum += s[t];
    }
    return sum;
}

// The next block's rows, asked for ahead of their use while the current block is worked
// on: a request's blocks are scattered over the pool, so the hardware prefetcher cannot
// guess the next one. Into L2, not L1: a block is about a hundred lines, more than L1 can
// have in flight. A few lines at a time, spread over the current block's work: asked for
// all at once they fill the core's line-fill buffers, and the core stalls until most
// have landed, so the work waits on the memory instead of overlapping it
// (docs/benchmarks.md, "The CPU kernels").
struct Prefetcher {
    const char* next = nullptr;
    int lines = 0;
    int issued = 0;

    // Up to `count` more lines of the next block.
    void issue(int count) {
        for (const int end = std::min(lines, issued + count); issued < end; ++issued)
            _mm_prefetch(next + 64 * (int64_t)issued, _MM_HINT_T1);
    }
    // Whatever is left of the next block, then aim at `block` (`bytes` long; none if null).
    void aim(const void* block, int64_t bytes) {
        issue(lines);
        next = static_cast<const char*>(block);
        lines = block == nullptr ? 0 : (int)((bytes + 63) / 64);
        issued = 0;
    }
    // The lines to ask for at each of `steps` points of a block's work.
    int share(int steps) const { return (lines + steps - 1) / steps; }
};

// The block holding token `start` of a context of `n` tokens; `ahead` aims at the next one.
template <typename T>
inline const T* block_at(const T* pool, const Args<T>& a, const int32_t* table, int start, int n,
                         int64_t row_stride, Prefetcher& ahead) {
    const int index = start / a.block_size;
    const int next = start + a.block_size;
    if (next < n)
        ahead.aim(pool + (int64_t)table[index + 1] * a.block_size * row_stride,
                  std::min(a.block_size, n - next) * row_stride * (int64_t)sizeof(T));
    else
        ahead.aim(nullptr, 0);
    return pool + (int64_t)table[index] * a.block_size * row_stride;
}

// Sequences attended together: `count` entries of `seqs`, whose first `shared` blocks
// are the same blocks (forks of one prompt, requests behind one cached instructions
// block). Each shared block is read from memory once and stays in L1 while every
// sequence of the group uses it; a sequence's own arithmetic, and so its output, is the
// same as when it is attended alone.
constexpr int MAX_GROUP = 8;

struct Group {
    const int* seqs;
    int count;
    int shared;
};

// Scores of one sequence's query heads against `count` K rows of `block`, from token `start`.
template <int HEAD_DIM, typename T>
inline void score_block(const Args<T>& a, const T* query, const T* block, int count, float* scores, int n,
                        int64_t row_stride, Prefetcher& ahead) {
    const int group = a.num_heads / a.num_kv_heads;
    const __m256 scale = _mm256_set1_ps(a.scale);
    const int per_head = ahead.share(a.num_heads);
    for (int h = 0; h < a.num_heads; ++h) {
        ahead.issue(per_head);
        const T* q = query + (int64_t)h * a.query_head_stride;
        const T* k = block + (int64_t)(h / group) * HEAD_DIM;
        float* s = scores + (size_t)h * n;
        int j = 0;
        for (; j + 8 <= count; j += 8)
            _mm256_storeu_ps(s + j, _mm256_mul_ps(dot8<HEAD_DIM>(q, k + j * row_stride, row_stride), scale));
        for (; j < count; ++j) s[j] = dot1<HEAD_DIM>(q, k + j * row_stride) * a.scale;
    }
}

// Adds `count` V rows of `block`, weighted by the scores from token `start`, to each head's sum.
#ifdef INFLIGHT_AVX512
// Each V row is loaded and widened once for its KV head and added into up to
// `HEADS_AT_ONCE` of the query heads that share it, whose sums stay in registers: the
// loads and widening, not the multiply-adds, were most of the work. Every sum adds the
// same products in the same order as one head at a time would.
template <int HEAD_DIM, int HEADS, typename T>
inline void weigh_heads(const T* v, int count, const float* scores, int n, float* acc, int64_t row_stride,
                        Prefetcher& ahead, int per_row) {
    constexpr int CHUNKS = HEAD_DIM / 16;
    __m512 out[HEADS][CHUNKS];
    for (int g = 0; g < HEADS; ++g)
        for (int c = 0; c < CHUNKS; ++c) out[g][c] = _mm512_loadu_ps(acc + g * HEAD_DIM + 16 * c);
    for (int j = 0; j < count; ++j) {
        ahead.issue(per_row);
        __m512 row[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) row[c] = load16(v + j * row_stride + 16 * c);
        for (int g = 0; g < HEADS; ++g) {
            const __m512 weight = _mm512_set1_ps(scores[(size_t)g * n + j]);
            for (int c = 0; c < CHUNKS; ++c) out[g][c] = _mm512_fmadd_ps(weight, row[c], out[g][c]);
        }
    }
    for (int g = 0; g < HEADS; ++g)
        for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + g * HEAD_DIM + 16 * c, out[g][c]);
}

template <int HEAD_DIM, typename T>
inline void weigh_block(const Args<T>& a, const T* block, int count, const float* scores, int n, float* acc,
                        int64_t row_stride, Prefetcher& ahead) {
    // Sums held at once: HEADS_AT_ONCE × HEAD_DIM / 16 registers of the 32, with room for the row.
    constexpr int HEADS_AT_ONCE = HEAD_DIM <= 64 ? 4 : 2;
    const int group = a.num_heads / a.num_kv_heads;
    const int per_row = ahead.share(a.num_kv_heads * ((group + HEADS_AT_ONCE - 1) / HEADS_AT_ONCE) * count);
    for (int kv = 0; kv < a.num_kv_heads; ++kv) {
        const T* v = block + (int64_t)kv * HEAD_DIM;
        for (int first = kv * group; first < (kv + 1) * group; first += HEADS_AT_ONCE) {
            const float* p = scores + (size_t)first * n;
            float* o = acc + (size_t)first * HEAD_DIM;
            switch (std::min(HEADS_AT_ONCE, (kv + 1) * group - first)) {
                case 4: weigh_heads<HEAD_DIM, 4>(v, count, p, n, o, row_stride, ahead, per_row); break;
                case 3: weigh_heads<HEAD_DIM, 3>(v, count, p, n, o, row_stride, ahead, per_row); break;
                case 2: weigh_heads<HEAD_DIM, 2>(v, count, p, n, o, row_stride, ahead, per_row); break;
                default: weigh_heads<HEAD_DIM, 1>(v, count, p, n, o, row_stride, ahead, per_row); break;
            }
        }
    }
}
#else
template <int HEAD_DIM, typename T>
inline void weigh_block(const Args<T>& a, const T* block, int count, const float* scores, int n, float* acc,
                        int64_t row_stride, Prefetcher& ahead) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    const int group = a.num_heads / a.num_kv_heads;
    const int per_head = ahead.share(a.num_heads);
    for (int h = 0; h < a.num_heads; ++h) {
        ahead.issue(per_head);
        const float* p = scores + (size_t)h * n;
        const T* v = block + (int64_t)(h / group) * HEAD_DIM;
        float* o = acc + (size_t)h * HEAD_DIM;
        __m256 out[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) out[c] = _mm256_loadu_ps(o + 8 * c);
        for (int j = 0; j < count; ++j) {
            const __m256 weight = _mm256_set1_ps(p[j]);
            for (int c = 0; c < CHUNKS; ++c)
                out[c] = _mm256_fmadd_ps(weight, load8(v + j * row_stride + 8 * c), out[c]);
        }
        for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(o + 8 * c, out[c]);
    }
}
#endif

// attend_one for head sizes that are multiples of 8, on AVX2, for all the KV heads of a
// group's sequences at once: a block's rows are read whole and in order (reading one
// head's slice of every row leaves the hardware prefetcher fetching the other heads'
// for nothing), and stay in L1 while every query head uses them.
template <int HEAD_DIM, typename T>
void attend_group_avx2(const Args<T>& a, const Group& g, std::vector<float>& scores, std::vector<float>& acc) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    const int heads = a.num_heads;
    const int64_t row_stride = (int64_t)a.num_kv_heads * HEAD_DIM;
    // Each sequence's keys from `firsts` on (0 but in a group of one, `form_groups`): its
    // scores by position - first, `lens` a head.
    int firsts[MAX_GROUP], lens[MAX_GROUP];
    size_t offsets[MAX_GROUP + 1] = {0};
    for (int i = 0; i < g.count; ++i) {
        const int n = a.context_lens[g.seqs[i]];
        firsts[i] = a.first_seen(n);
        lens[i] = n - firsts[i];
        offsets[i + 1] = offsets[i] + (size_t)heads * lens[i];
    }
    scores.resize(offsets[g.count]);
    acc.assign((size_t)g.count * heads * HEAD_DIM, 0.0f);
    const int32_t* shared_table = a.block_tables + (int64_t)g.seqs[0] * a.max_blocks;
    const int shared_tokens = g.shared * a.block_size;
    auto query_of = [&](int i) { return a.query + (int64_t)a.query_rows[g.seqs[i]] * a.query_token_stride; };
    // The first block a sequence reads past the shared ones: the one holding its first key.
    auto own_start = [&](int i) { return std::max(shared_tokens, firsts[i] / a.block_size * a.block_size); };
    Prefetcher ahead;

    for (int start = 0; start < shared_tokens; start += a.block_size) {
        const T* block = block_at(a.key_pool, a, shared_table, start, shared_tokens, row_stride, ahead);
        for (int i = 0; i < g.count; ++i)
            score_block<HEAD_DIM>(a, query_of(i), block, a.block_size, scores.data() + offsets[i] + start, lens[i],
                                  row_stride, ahead);
    }
    for (int i = 0; i < g.count; ++i) {
        const int n = a.context_lens[g.seqs[i]], first = firsts[i];
        const int32_t* table = a.block_tables + (int64_t)g.seqs[i] * a.max_blocks;
        for (int start = own_start(i); start < n; start += a.block_size) {
            const int skip = std::max(0, first - start);  // keys before the window, in its first block
            score_block<HEAD_DIM>(a, query_of(i),
                                  block_at(a.key_pool, a, table, start, n, row_stride, ahead) + skip * row_stride,
                                  std::min(a.block_size, n - start) - skip,
                                  scores.data() + offsets[i] + start + skip - first, lens[i], row_stride, ahead);
        }
    }
    // The first V block (the group's first sequence's, shared or not) arrives while the
    // exponentials are computed.
    const int first_block = firsts[0] / a.block_size;
    ahead.aim(a.value_pool + (int64_t)shared_table[first_block] * a.block_size * row_stride,
              std::min(a.block_size, a.context_lens[g.seqs[0]] - first_block * a.block_size) * row_stride *
                  (int64_t)sizeof(T));
    const int per_head = ahead.share(heads);
    float sums[MAX_GROUP][1024];
    for (int i = 0; i < g.count; ++i)
        for (int h = 0; h < heads; ++h) {
            ahead.issue(per_head);
            float* s = scores.data() + offsets[i] + (size_t)h * lens[i];
            if (a.softcap > 0.0f) cap_scores(s, lens[i], a.softcap, a.inv_softcap);
            sums[i][h] = exp_scores(s, lens[i], a.sink(h));
        }
    for (int start = 0; start < shared_tokens; start += a.block_size) {
        const T* block = block_at(a.value_pool, a, shared_table, start, shared_tokens, row_stride, ahead);
        for (int i = 0; i < g.count; ++i)
            weigh_block<HEAD_DIM>(a, block, a.block_size, scores.data() + offsets[i] + start, lens[i],
                                  acc.data() + (size_t)i * heads * HEAD_DIM, row_stride, ahead);
    }
    for (int i = 0; i < g.count; ++i) {
        const int n = a.context_lens[g.seqs[i]], first = firsts[i];
        const int32_t* table = a.block_tables + (int64_t)g.seqs[i] * a.max_blocks;
        float* seq_acc = acc.data() + (size_t)i * heads * HEAD_DIM;
        for (int start = own_start(i); start < n; start += a.block_size) {
            const int skip = std::max(0, first - start);
            weigh_block<HEAD_DIM>(a, block_at(a.value_pool, a, table, start, n, row_stride, ahead) + skip * row_stride,
                                  std::min(a.block_size, n - start) - skip,
                                  scores.data() + offsets[i] + start + skip - first, lens[i], seq_acc, row_stride,
                                  ahead);
        }
        const int64_t row = a.query_rows[g.seqs[i]];
        for (int h = 0; h < heads; ++h) {
            T* out = a.out + (row * heads + h) * HEAD_DIM;
            const __m256 inv = _mm256_set1_ps(1.0f / sums[i][h]);
            for (int c = 0; c < CHUNKS; ++c)
                store8(out + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(seq_acc + h * HEAD_DIM + 8 * c), inv));
        }
    }
}
#endif

#ifdef INFLIGHT_AVX2
// The batch in groups of up to MAX_GROUP sequences: sequences with the same first block
// are taken in batch order, and a group ends where the next one shares fewer full blocks
// with its first sequence than the group does. With a sliding window, a sequence whose
// context outruns it goes alone (what it shares is mostly behind its window); those
// within it group as without one.
template <typename T>
std::vector<Group> form_groups(const Args<T>& a, std::vector<int>& order) {
    order.resize(a.num_seqs);
    for (int s = 0; s < a.num_seqs; ++s) order[s] = s;
    auto table_of = [&](int s) { return a.block_tables + (int64_t)s * a.max_blocks; };
    auto first_block = [&](int s) { return a.context_lens[s] > 0 ? table_of(s)[0] : -1; };
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return first_block(x) < first_block(y); });
    std::vector<Group> groups;
    auto windowed = [&](int s) { return a.first_seen(a.context_lens[s]) > 0; };
    for (int i = 0; i < a.num_seqs;) {
        const int32_t* lead = table_of(order[i]);
        int count = 1, shared = a.context_lens[order[i]] / a.block_size;
        while (!windowed(order[i]) && i + count < a.num_seqs && count < MAX_GROUP) {
            const int next = order[i + count];
            if (windowed(next)) break;
            const int32_t* table = table_of(next);
            const int limit = std::min(shared, a.context_lens[next] / a.block_size);
            int common = 0;
            while (common < limit && table[common] == lead[common]) ++common;
            if (common == 0 || (count > 1 && common < shared)) break;
            shared = common;
            ++count;
        }
        groups.push_back(Group{order.data() + i, count, count > 1 ? shared : 0});
        i += count;
    }
    return groups;
}
#endif

// No more threads than work items: a single decode (one user's chat) runs on the calling
// thread instead of waking a team that would wait at the barrier.
inline int team_size(int items, int num_threads) { return std::max(1, std::min(items, num_threads)); }

template <typename T, int HEAD_DIM>
void attend_all(const Args<T>& a, int head_dim, int num_threads) {
#ifdef INFLIGHT_AVX2
    if constexpr (HEAD_DIM > 0) {
        std::vector<int> order;
        const std::vector<Group> groups = form_groups(a, order);
        const int num_groups = (int)groups.size();
#pragma omp parallel num_threads(team_size(num_groups, num_threads))
        {
            std::vector<float> scores, acc;  // per thread, reused across its groups
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < num_groups; ++i) attend_group_avx2<HEAD_DIM, T>(a, groups[i], scores, acc);
        }
        return;
    }
#endif
    const int items = a.num_seqs * a.num_kv_heads;
#pragma omp parallel num_threads(team_size(items, num_threads))
    {
        std::vector<float> scores, acc;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item)
            attend_one<T, HEAD_DIM>(a, head_dim, item / a.num_kv_heads, item % a.num_kv_heads, scores, acc);
    }
}

template <typename T>
int attend(T* out, const T* query, int64_t query_token_stride, int64_t query_head_stride, const T* key_pool,
           const T* value_pool, const int32_t* query_rows, const int32_t* context_lens, const int32_t* block_tables,
           int num_seqs, int max_blocks, int block_size, int num_heads, int num_kv_heads, int head_dim, float scale,
           int window, float softcap, const float* sinks, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 64 || num_heads > 1024)
        return -1;
    if (!(softcap >= 0.0f)) return -1;
    window = std::max(window, 0);
    const Args<T> a{out, query, query_token_stride, query_head_stride, key_pool, value_pool, query_rows,
                    context_lens, block_tables, num_seqs, max_blocks, block_size, num_heads, num_kv_heads, scale,
                    window, softcap, sinks, softcap > 0.0f ? 1.0f / softcap : 0.0f};
    switch (head_dim) {
        case 64: attend_all<T, 64>(a, head_dim, num_threads); break;
        case 128: attend_all<T, 128>(a, head_dim, num_threads); break;
        default: attend_all<T, 0>(a, head_dim, num_threads); break;
    }
    return 0;
}

}  // namespace

// A layer's attention: `window` > 0 keys before each query's own (inclusive) or 0 (or
// less) for the whole context, `softcap` > 0 or 0 for none, `sinks` [num_heads] fp32
// logits or null. Returns 0, or -1 if the arguments are out of what this kernel handles.
extern "C" int paged_decode_attention(
    float* out, const float* query, int64_t query_token_stride, int64_t query_head_stride,
    const float* key_pool, const float* value_pool, const int32_t* query_rows,
    const int32_t* context_lens, const int32_t* block_tables, int num_seqs, int max_blocks,
    int block_size, int num_heads, int num_kv_heads, int head_dim, float scale, int window, float softcap,
    const float* sinks, int num_threads) {
    return attend(out, query, query_token_stride, query_head_stride, key_pool, value_pool, query_rows, context_lens,
                  block_tables, num_seqs, max_blocks, block_size, num_heads, num_kv_heads, head_dim, scale, window,
                  softcap, sinks, num_threads);
}

// The same over bfloat16 queries, cache and output (`bf16` is layout-compatible with uint16).
extern "C" int paged_decode_attention_bf16(
    bf16* out, const bf16* query, int64_t query_token_stride, int64_t query_head_stride,
    const bf16* key_pool, const bf16* value_pool, const int32_t* query_rows,
    const int32_t* context_lens, const int32_t* block_tables, int num_seqs, int max_blocks,
    int block_size, int num_heads, int num_kv_heads, int head_dim, float scale, int window, float softcap,
    const float* sinks, int num_threads) {
    return attend(out, query, query_token_stride, query_head_stride, key_pool, value_pool, query_rows, context_lens,
                  block_tables, num_seqs, max_blocks, block_size, num_heads, num_kv_heads, head_dim, scale, window,
                  softcap, sinks, num_threads);
}
