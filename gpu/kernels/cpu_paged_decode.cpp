// Paged decode attention on the CPU: one query token per request, attending over the
// request's blocks where they lie in the pool (no gather into a padded batch).
//
// Work is split over (request, KV head) pairs; each pair reads every K and V row of
// its context once for all the query heads that share the KV head (grouped-query
// attention), so the pool is read once per step and layer. Scores and sums are fp32.
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
#include <vector>

namespace {

struct Args {
    float* out;
    const float* query;
    int64_t query_token_stride;
    int64_t query_head_stride;
    const float* key_pool;
    const float* value_pool;
    const int32_t* query_rows;    // [seqs] the batch row of each decode token
    const int32_t* context_lens;  // [seqs]
    const int32_t* block_tables;  // [seqs, max_blocks]
    int num_seqs;
    int max_blocks;
    int block_size;
    int num_heads;
    int num_kv_heads;
    float scale;
};

// HEAD_DIM > 0 is known at compile time (the loops unroll and vectorize fully);
// 0 takes it from `head_dim`.
template <int HEAD_DIM>
void attend_one(const Args& a, int head_dim, int seq, int kv_head, std::vector<float>& scores,
                std::vector<float>& acc) {
    const int dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
    const int group = a.num_heads / a.num_kv_heads;
    const int n = a.context_lens[seq];
    const int64_t row_stride = (int64_t)a.num_kv_heads * dim;
    const int32_t* table = a.block_tables + (int64_t)seq * a.max_blocks;
    const int64_t row = a.query_rows[seq];
    scores.resize((size_t)group * n);
    acc.assign((size_t)group * dim, 0.0f);

    // Scores: every K row once, dotted with each query head of the group.
    for (int start = 0; start < n; start += a.block_size) {
        const int64_t slot0 = (int64_t)table[start / a.block_size] * a.block_size;
        const int count = std::min(a.block_size, n - start);
        for (int j = 0; j < count; ++j) {
            const float* k = a.key_pool + (slot0 + j) * row_stride + (int64_t)kv_head * dim;
            for (int g = 0; g < group; ++g) {
                const float* q = a.query + row * a.query_token_stride + (int64_t)(kv_head * group + g) * a.query_head_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; ++d) s += q[d] * k[d];
                scores[(size_t)g * n + start + j] = s * a.scale;
            }
        }
    }
    // Softmax per query head; the weights stay unnormalised until the end.
    float sums[64];
    for (int g = 0; g < group; ++g) {
        float* s = scores.data() + (size_t)g * n;
        float m = s[0];
        for (int t = 1; t < n; ++t) m = std::max(m, s[t]);
        float sum = 0.0f;
        for (int t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - m);
            sum += s[t];
        }
        sums[g] = sum;
    }
    // Weighted V: every V row once, for each query head of the group.
    for (int start = 0; start < n; start += a.block_size) {
        const int64_t slot0 = (int64_t)table[start / a.block_size] * a.block_size;
        const int count = std::min(a.block_size, n - start);
        for (int j = 0; j < count; ++j) {
            const float* v = a.value_pool + (slot0 + j) * row_stride + (int64_t)kv_head * dim;
            for (int g = 0; g < group; ++g) {
                const float p = scores[(size_t)g * n + start + j];
                float* o = acc.data() + (size_t)g * dim;
#pragma omp simd
                for (int d = 0; d < dim; ++d) o[d] += p * v[d];
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        float* out = a.out + (row * a.num_heads + kv_head * group + g) * dim;
        const float inv = 1.0f / sums[g];
        const float* o = acc.data() + (size_t)g * dim;
#pragma omp simd
        for (int d = 0; d < dim; ++d) out[d] = o[d] * inv;
    }
}

template <int HEAD_DIM>
void attend_all(const Args& a, int head_dim, int num_threads) {
    const int items = a.num_seqs * a.num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores, acc;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item)
            attend_one<HEAD_DIM>(a, head_dim, item / a.num_kv_heads, item % a.num_kv_heads, scores, acc);
    }
}

}  // namespace

// Returns 0, or -1 if the arguments are out of what this kernel handles.
extern "C" int paged_decode_attention(
    float* out, const float* query, int64_t query_token_stride, int64_t query_head_stride,
    const float* key_pool, const float* value_pool, const int32_t* query_rows,
    const int32_t* context_lens, const int32_t* block_tables, int num_seqs, int max_blocks,
    int block_size, int num_heads, int num_kv_heads, int head_dim, float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 64) return -1;
    const Args a{out, query, query_token_stride, query_head_stride, key_pool, value_pool, query_rows,
                 context_lens, block_tables, num_seqs, max_blocks, block_size, num_heads, num_kv_heads, scale};
    switch (head_dim) {
        case 64: attend_all<64>(a, head_dim, num_threads); break;
        case 128: attend_all<128>(a, head_dim, num_threads); break;
        default: attend_all<0>(a, head_dim, num_threads); break;
    }
    return 0;
}
