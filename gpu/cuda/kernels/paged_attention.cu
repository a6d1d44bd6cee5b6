// Paged attention over the KV cache: decode (one query token per request, split into
// partitions with a reduce step) and chunked prefill (a chunk of query tokens, causal
// over the cached prefix plus itself).
//
// Cache layout, per layer: K and V pools `[num_blocks, BLOCK_SIZE, num_kv_heads,
// HEAD_DIM]`; token p of a request lives in block `block_tables[seq][p / BLOCK_SIZE]`,
// row `p % BLOCK_SIZE`. Block offsets are 64-bit. The queries' token and head strides
// are arguments (transformers hands over transposed views); the output is contiguous
// `[tokens, num_heads, HEAD_DIM]`. Every score and sum is fp32.
//
// Each layer may attend otherwise (`gpu.attention.LayerAttention`), by three arguments of
// every kernel: `window` > 0 lets a query at position p see keys p - window + 1 .. p only
// (decode starts its partitions at the window's first and reads no key before it; prefill
// masks each row and skips key tiles before its tile's windows); `softcap` > 0 caps each
// scaled score s to softcap * tanh(s / softcap) before masking and softmax; `sinks`, when
// not null, holds one fp32 logit per query head that joins the softmax's denominator
// (exactly once: in the reduce when a decode is partitioned) and takes no value. 0 and
// null mean plain causal attention, at the cost of a uniform branch.
#include "common.cuh"

constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / 32;
// Query heads that one decode block serves from each K/V row it loads; a wider GQA
// group is split over several blocks (blockIdx.x).
constexpr int MAX_GROUP = 8;
// The longest partition a decode block handles (its scores sit in shared memory).
constexpr int MAX_PARTITION = 512;

// Where token `pos` of a request, held in cache block `block`, has its row for `kv_head`.
template <int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ i64 kv_offset(i64 block, int pos, int num_kv_heads, int kv_head) {
    const i64 row_stride = (i64)num_kv_heads * HEAD_DIM;
    return (block * BLOCK_SIZE + pos % BLOCK_SIZE) * row_stride + (i64)kv_head * HEAD_DIM;
}

// Decode. Grid: x = kv head x head group, y = sequence, z = partition of the context,
// counted from the partition that holds the window's first key (from 0 without a window;
// `num_partitions` is the grid's z, so a short window needs fewer partitions than the
// context). A block loads each K and V row of its partition, from the window's first on,
// once for all (up to MAX_GROUP) query heads that share the KV head. With one partition it
// writes the output; with more it writes each partition's normalised output, max and sum
// for `paged_decode_reduce`.
// Memory-bound: resident blocks keep loads in flight, so registers are capped for
// DECODE_BLOCKS_PER_SM of them, without spilling; within a block the next K and V rows
// are loaded while the current ones are used (docs/benchmarks.md, "The GPU path").
constexpr int DECODE_BLOCKS_PER_SM = 7;
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(NUM_THREADS, DECODE_BLOCKS_PER_SM) paged_decode_attention(
    T* __restrict__ out,                 // [tokens, num_heads, HEAD_DIM]
    float* __restrict__ partial_out,     // [seqs, num_heads, num_partitions, HEAD_DIM]
    float* __restrict__ partial_max,     // [seqs, num_heads, num_partitions]
    float* __restrict__ partial_sum,     // [seqs, num_heads, num_partitions]
    const T* __restrict__ query, i64 query_token_stride, i64 query_head_stride,
    const T* __restrict__ key_cache, const T* __restrict__ value_cache,
    const int* __restrict__ query_rows,    // [seqs] the batch row of each decode token
    const int* __restrict__ context_lens,  // [seqs]
    const int* __restrict__ block_tables,  // [seqs, max_blocks]
    int max_blocks, int num_heads, int num_kv_heads, int partition_size, int num_partitions,
    float scale,
    int window,                      // 0: the whole context
    float softcap,                   // 0: none
    const float* __restrict__ sinks  // [num_heads], or null
) {
    // Phase 1 (scores): a group of LANES lanes takes one token, each lane 16 dims.
    constexpr int DIMS_PER_LANE = 16;
    constexpr int LANES = HEAD_DIM / DIMS_PER_LANE;
    constexpr int TOKENS_PER_WARP = 32 / LANES;
    constexpr int TOKENS_PER_PASS = NUM_WARPS * TOKENS_PER_WARP;
    // Phase 3 (values): a row of V_THREADS threads takes one token, each 4 dims.
    constexpr int V_DIMS = 4;
    constexpr int V_THREADS = HEAD_DIM / V_DIMS;
    constexpr int V_ROWS = NUM_THREADS / V_THREADS;
    // Tokens whose K (V) rows a thread has in use at a time (and as many loading).
    constexpr int K_UNROLL = 1;
    constexpr int V_UNROLL = 2;
    static_assert(HEAD_DIM % DIMS_PER_LANE == 0 && LANES <= 32 && V_ROWS >= 1, "head_dim");

    // Each lane's 16 dims padded to 20 floats: the 8 lanes of a token read their slices as
    // 16-byte words from 8 distinct groups of banks (unpadded, 4 lanes share each group).
    __shared__ float q_s[MAX_GROUP][LANES][DIMS_PER_LANE + 4];
    // The scores, then phase 3's per-row sums in the same memory (written once every
    // score is read): a smaller footprint leaves room for more blocks per SM.
    constexpr int SCORES = MAX_GROUP * MAX_PARTITION, SUMS = V_ROWS * MAX_GROUP * HEAD_DIM;
    __shared__ float scratch_s[SCORES > SUMS ? SCORES : SUMS];
    float(*scores_s)[MAX_PARTITION] = reinterpret_cast<float(*)[MAX_PARTITION]>(scratch_s);
    float(*acc_s)[MAX_GROUP][HEAD_DIM] = reinterpret_cast<float(*)[MAX_GROUP][HEAD_DIM]>(scratch_s);
    __shared__ float inv_sum_s[MAX_GROUP];
    __shared__ int blocks_s[MAX_PARTITION / BLOCK_SIZE + 1];  // the partition's block ids

    const int seq = blockIdx.y;
    const int partition = blockIdx.z;
    const int group = num_heads / num_kv_heads;
    const int head_groups = (group + MAX_GROUP - 1) / MAX_GROUP;
    const int kv_head = blockIdx.x / head_groups;
    const int first_head = kv_head * group + (blockIdx.x % head_groups) * MAX_GROUP;
    const int heads = min(MAX_GROUP, kv_head * group + group - first_head);

    const int context_len = context_lens[seq];
    // The first key the query sees, and the partition (of the whole context) it lies in.
    const int window_start = window > 0 ? max(0, context_len - window) : 0;
    const int partition_start = (window_start / partition_size + partition) * partition_size;
    if (partition_start >= context_len) return;  // a shorter sequence than the batch's longest
    const int start = max(partition_start, window_start);
    const int count = min(partition_start + partition_size, context_len) - start;
    const i64 row = query_rows[seq];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    // The block ids go to shared memory first, so no K/V load waits on a table load.
    const int first_block = start / BLOCK_SIZE;
    const int num_blocks = (start + count - 1) / BLOCK_SIZE - first_block + 1;
    // Token t of the partition is row `skip + t` of its blocks (from blocks_s[0]'s first):
    // one value in the loops instead of start and first_block (registers are short).
    const int skip = start % BLOCK_SIZE;
    for (int i = tid; i < num_blocks; i += NUM_THREADS)
        blocks_s[i] = block_tables[(i64)seq * max_blocks + first_block + i];
#pragma unroll  // a constant trip count: the loads go out together, not one latency each
    for (int i = tid; i < MAX_GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int h = i / HEAD_DIM, d = i % HEAD_DIM;
        q_s[h][d / DIMS_PER_LANE][d % DIMS_PER_LANE] = h < heads
            ? to_float(query[row * query_token_stride + (i64)(first_head + h) * query_head_stride + d]) * scale
            : 0.f;
    }
    __syncthreads();

    // Phase 1: scores of every token in the partition, for every head of the group.
    // K_UNROLL tokens per lane group at a time; the next pass's K rows are loaded (as they
    // are stored) before this pass's products, so the loads overlap them (decode is bound
    // by memory bandwidth).
    const int lane_in_token = lane % LANES;
    const int token_in_pass = warp * TOKENS_PER_WARP + lane / LANES;
    constexpr int K_STEP = TOKENS_PER_PASS * K_UNROLL;
    Raw<T, DIMS_PER_LANE> k_next[K_UNROLL];
    auto load_keys = [&](int pass) {
#pragma unroll
        for (int u = 0; u < K_UNROLL; ++u) {
            const int t = pass + u * TOKENS_PER_PASS + token_in_pass;
            if (t < count) {
                const int pos = skip + t;
                const i64 at = kv_offset<HEAD_DIM, BLOCK_SIZE>(blocks_s[pos / BLOCK_SIZE], pos,
                                                               num_kv_heads, kv_head);
                k_next[u].load(key_cache + at + lane_in_token * DIMS_PER_LANE);
            } else {
                k_next[u].clear();
            }
        }
    };
    load_keys(0);
    for (int pass = 0; pass < count; pass += K_STEP) {
        float k[K_UNROLL][DIMS_PER_LANE];
#pragma unroll
        for (int u = 0; u < K_UNROLL; ++u) k_next[u].widen(k[u]);
        if (pass + K_STEP < count) load_keys(pass + K_STEP);  // uniform across the block
        // Heads outer, tokens inner: each slice of q read from shared memory serves
        // K_UNROLL tokens (shared-memory bandwidth would bound this loop otherwise).
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
            if (h >= heads) break;  // uniform across the block
            float q[DIMS_PER_LANE];
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) q[i] = q_s[h][lane_in_token][i];
#pragma unroll
            for (int u = 0; u < K_UNROLL; ++u) {
                if (pass + u * TOKENS_PER_PASS >= count) break;  // uniform: past the partition's end
                const int t = pass + u * TOKENS_PER_PASS + warp * TOKENS_PER_WARP + lane / LANES;
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < DIMS_PER_LANE; ++i) dot += q[i] * k[u][i];
                dot = warp_sum(dot, LANES);
                if (t < count && lane_in_token == 0) scores_s[h][t] = dot;
            }
        }
    }
    __syncthreads();

    // Phase 2: softmax within the partition, one warp per head. A softcap caps the scores
    // here (phase 1 has no registers to spare); a sink joins the denominator here only
    // when there is no reduce step to add it.
    const bool sink_here = sinks != nullptr && num_partitions == 1;
    for (int h = warp; h < heads; h += NUM_WARPS) {
        float m = -INF;
        if (softcap > 0.f) {  // uniform
            for (int t = lane; t < count; t += 32) {
                const float s = capped(scores_s[h][t], softcap);
                scores_s[h][t] = s;
                m = fmaxf(m, s);
            }
        } else {
            for (int t = lane; t < count; t += 32) m = fmaxf(m, scores_s[h][t]);
        }
        m = warp_max(m, 32);
        const float sink = sink_here ? sinks[first_head + h] : -INF;
        m = fmaxf(m, sink);
        float sum = 0.f;
        for (int t = lane; t < count; t += 32) {
            const float p = expf(scores_s[h][t] - m);
            scores_s[h][t] = p;
            sum += p;
        }
        sum = warp_sum(sum, 32);
        if (sink_here) sum += expf(sink - m);
        if (lane == 0) {
            inv_sum_s[h] = 1.f / sum;
            if (num_partitions > 1) {
                const i64 at = ((i64)seq * num_heads + first_head + h) * num_partitions + partition;
                partial_max[at] = m;
                partial_sum[at] = sum;
            }
        }
    }
    __syncthreads();

    // Phase 3: probabilities times V, V_ROWS tokens at a time, then summed over the rows.
    const int v_row = tid / V_THREADS;
    const int d0 = (tid % V_THREADS) * V_DIMS;
    float acc[MAX_GROUP][V_DIMS];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h)
#pragma unroll
        for (int i = 0; i < V_DIMS; ++i) acc[h][i] = 0.f;
    // As in phase 1, the next rows' loads go out before this round's products.
    constexpr int V_STEP = V_ROWS * V_UNROLL;
    Raw<T, V_DIMS> v_next[V_UNROLL];
    auto load_values = [&](int first) {
#pragma unroll
        for (int u = 0; u < V_UNROLL; ++u) {
            const int t = first + u * V_ROWS;
            if (t < count) {
                const int pos = skip + t;
                const i64 at = kv_offset<HEAD_DIM, BLOCK_SIZE>(blocks_s[pos / BLOCK_SIZE], pos,
                                                               num_kv_heads, kv_head);
                v_next[u].load(value_cache + at + d0);
            } else {
                v_next[u].clear();
            }
        }
    };
    load_values(v_row);
    for (int first = v_row; first < count; first += V_STEP) {
        float v[V_UNROLL][V_DIMS];
#pragma unroll
        for (int u = 0; u < V_UNROLL; ++u) v_next[u].widen(v[u]);
        if (first + V_STEP < count) load_values(first + V_STEP);  // per row of threads
#pragma unroll
        for (int u = 0; u < V_UNROLL; ++u) {
            const int t = first + u * V_ROWS;
            if (t >= count) break;
#pragma unroll
            for (int h = 0; h < MAX_GROUP; ++h) {
                if (h >= heads) break;
                const float p = scores_s[h][t];
#pragma unroll
                for (int i = 0; i < V_DIMS; ++i) acc[h][i] += p * v[u][i];
            }
        }
    }
    __syncthreads();  // every score read: the sums may overwrite them
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h)
#pragma unroll
        for (int i = 0; i < V_DIMS; ++i) acc_s[v_row][h][d0 + i] = acc[h][i];
    __syncthreads();
    for (int i = tid; i < heads * HEAD_DIM; i += NUM_THREADS) {
        const int h = i / HEAD_DIM, d = i % HEAD_DIM;
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < V_ROWS; ++r) o += acc_s[r][h][d];
        o *= inv_sum_s[h];
        if (num_partitions == 1) {
            out[(row * num_heads + first_head + h) * HEAD_DIM + d] = from_float<T>(o);
        } else {
            const i64 at = ((i64)seq * num_heads + first_head + h) * num_partitions + partition;
            partial_out[at * HEAD_DIM + d] = o;
        }
    }
}

// Decode's reduce step. Grid: x = head, y = sequence. Each partition's output is weighted
// by its share of the softmax denominator, exp(max_p - max) * sum_p; the head's sink, if
// any, joins the max and the denominator. `window` says which partitions the decode
// kernel used (those from the window's first on).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(NUM_THREADS) paged_decode_reduce(
    T* __restrict__ out, const float* __restrict__ partial_out, const float* __restrict__ partial_max,
    const float* __restrict__ partial_sum, const int* __restrict__ query_rows,
    const int* __restrict__ context_lens, int num_heads, int partition_size, int num_partitions,
    int window, const float* __restrict__ sinks) {
    const int head = blockIdx.x, seq = blockIdx.y;
    const int context_len = context_lens[seq];
    const int window_start = window > 0 ? max(0, context_len - window) : 0;
    const int used = (context_len + partition_size - 1) / partition_size - window_start / partition_size;
    const i64 base = ((i64)seq * num_heads + head) * num_partitions;
    const float sink = sinks != nullptr ? sinks[head] : -INF;
    float m = sink;
    for (int p = 0; p < used; ++p) m = fmaxf(m, partial_max[base + p]);
    float total = sinks != nullptr ? expf(sink - m) : 0.f;
    for (int p = 0; p < used; ++p) total += partial_sum[base + p] * expf(partial_max[base + p] - m);
    const float inv_total = 1.f / total;
    const i64 row = query_rows[seq];
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
        float o = 0.f;
        for (int p = 0; p < used; ++p)
            o += partial_sum[base + p] * expf(partial_max[base + p] - m) * partial_out[(base + p) * HEAD_DIM + d];
        out[(row * num_heads + head) * HEAD_DIM + d] = from_float<T>(o * inv_total);
    }
}

// Chunked prefill. Grid: x = tile, y = kv head. A tile is 16 consecutive (query token,
// head of the group) rows of one sequence's chunk, each warp owning 4 of them; the block
// walks the keys up to its last row's position in tiles of 16, each K/V tile loaded once
// into shared memory for all the tile's rows, with an online softmax (running max and sum).
// With a window the walk starts at its first row's first visible key, and each row masks
// the keys before its own window.
// A warp scores two rows at a time: lanes 0-15 take one row, 16-31 the other, one key each.
// At head_dim 256 a tile has 8 rows, so that its shared memory stays under 48 KB.
template <int HEAD_DIM>
__device__ constexpr int prefill_rows() { return HEAD_DIM <= 128 ? 16 : 8; }
constexpr int KEY_TILE = 16;

template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_prefill_attention(
    T* __restrict__ out,  // [tokens, num_heads, HEAD_DIM]
    const T* __restrict__ query, i64 query_token_stride, i64 query_head_stride,
    const T* __restrict__ key_cache, const T* __restrict__ value_cache,
    const int* __restrict__ tile_seqs,      // [tiles] which sequence
    const int* __restrict__ tile_rows,      // [tiles] its first row (token * group + head)
    const int* __restrict__ query_starts,   // [seqs] batch row of the chunk's first token
    const int* __restrict__ query_lens,     // [seqs]
    const int* __restrict__ context_lens,   // [seqs] including the chunk
    const int* __restrict__ block_tables,   // [seqs, max_blocks]
    int max_blocks, int num_heads, int num_kv_heads, float scale,
    int window,                      // 0: the whole context
    float softcap,                   // 0: none
    const float* __restrict__ sinks  // [num_heads], or null
) {
    constexpr int PREFILL_ROWS = prefill_rows<HEAD_DIM>();
    constexpr int ROWS_PER_WARP = PREFILL_ROWS / NUM_WARPS;
    constexpr int PAIRS = ROWS_PER_WARP / 2;
    constexpr int DIMS_PER_LANE = HEAD_DIM / 32;
    static_assert(KEY_TILE * 2 == 32 && ROWS_PER_WARP % 2 == 0, "a warp scores two rows of 16 keys at a time");

    __shared__ float q_s[PREFILL_ROWS][HEAD_DIM + 1];  // padded: a warp reads two rows at once
    __shared__ float k_s[KEY_TILE][HEAD_DIM + 1];  // padded: the 16 lanes of a row read 16 keys' rows
    __shared__ float v_s[KEY_TILE][HEAD_DIM];
    __shared__ float p_s[NUM_WARPS][ROWS_PER_WARP][KEY_TILE];  // one tile's probabilities per row
    __shared__ float alpha_s[NUM_WARPS][ROWS_PER_WARP];        // and its rescaling of the row's sum
    __shared__ float inv_s[NUM_WARPS][ROWS_PER_WARP];  // 1 / each row's denominator

    const int seq = tile_seqs[blockIdx.x];
    const int first_row = tile_rows[blockIdx.x];
    const int kv_head = blockIdx.y;
    const int group = num_heads / num_kv_heads;
    const int query_len = query_lens[seq];
    const int context_len = context_lens[seq];
    const int past = context_len - query_len;
    const int rows = min(PREFILL_ROWS, query_len * group - first_row);
    const int* table = block_tables + (i64)seq * max_blocks;
    const i64 query_start = query_starts[seq];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    for (int i = tid; i < PREFILL_ROWS * HEAD_DIM; i += NUM_THREADS) {
        const int r = i / HEAD_DIM, d = i % HEAD_DIM;
        float q = 0.f;
        if (r < rows) {
            const int token = (first_row + r) / group, head = kv_head * group + (first_row + r) % group;
            q = to_float(query[(query_start + token) * query_token_stride + (i64)head * query_head_stride + d]) * scale;
        }
        q_s[r][d] = q;
    }

    // Each lane keeps the running max and sum of its half's row in each pair, and the
    // output of dims lane, lane + 32, ... of all the warp's rows.
    const int half = lane / KEY_TILE, key = lane % KEY_TILE;
    float m[PAIRS], l[PAIRS], acc[ROWS_PER_WARP][DIMS_PER_LANE];
#pragma unroll
    for (int pair = 0; pair < PAIRS; ++pair) {
        m[pair] = -INF;
        l[pair] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[r][i] = 0.f;

    const int key_end = past + (first_row + rows - 1) / group + 1;  // the last row's causal bound
    // The first row's first visible key: no row of the tile sees one before it.
    const int key_begin = window > 0 ? max(0, past + first_row / group - window + 1) : 0;
    const unsigned span = window > 0 ? (unsigned)window : 0x80000000u;  // how far back a row sees
    for (int tile = key_begin; tile < key_end; tile += KEY_TILE) {
        __syncthreads();  // the previous tile is consumed (and q_s written, the first time)
        for (int i = tid; i < KEY_TILE * HEAD_DIM; i += NUM_THREADS) {
            const int j = i / HEAD_DIM, d = i % HEAD_DIM;
            float k = 0.f, v = 0.f;
            if (tile + j < key_end) {
                const int pos = tile + j;
                const i64 at = kv_offset<HEAD_DIM, BLOCK_SIZE>(table[pos / BLOCK_SIZE], pos, num_kv_heads, kv_head) + d;
                k = to_float(key_cache[at]);
                v = to_float(value_cache[at]);
            }
            k_s[j][d] = k;
            v_s[j][d] = v;
        }
        __syncthreads();

        // Both pairs' scores first, then (a uniform branch outside the products, which
        // keeps the register count of the plain path) their softcap.
        float scores[PAIRS];
#pragma unroll
        for (int pair = 0; pair < PAIRS; ++pair) {
            const int row = warp * ROWS_PER_WARP + 2 * pair + half;
            float s = 0.f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; ++d) s += q_s[row][d] * k_s[key][d];
            scores[pair] = s;
        }
        if (softcap > 0.f) {
#pragma unroll
            for (int pair = 0; pair < PAIRS; ++pair) scores[pair] = capped(scores[pair], softcap);
        }
#pragma unroll
        for (int pair = 0; pair < PAIRS; ++pair) {
            const int local = 2 * pair + half;  // this half's row among the warp's
            const int row = warp * ROWS_PER_WARP + local;
            const int position = past + (first_row + row) / group;
            float s = scores[pair];
            // Causal and within the window at the one compare causal takes alone: the key
            // is 0 .. span - 1 positions back (a key after the row wraps to a huge value).
            const bool visible = row < rows && (unsigned)(position - tile - key) < span;
            s = visible ? s : -INF;
            const float m_new = fmaxf(m[pair], warp_max(s, KEY_TILE));
            const float p = visible ? expf(s - m_new) : 0.f;
            const float alpha = m[pair] == -INF ? 0.f : expf(m[pair] - m_new);
            l[pair] = l[pair] * alpha + warp_sum(p, KEY_TILE);
            m[pair] = m_new;
            p_s[warp][local][key] = p;
            if (key == 0) alpha_s[warp][local] = alpha;
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const float alpha = alpha_s[warp][r];
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                float o = acc[r][i] * alpha;
#pragma unroll
                for (int j = 0; j < KEY_TILE; ++j) o += p_s[warp][r][j] * v_s[j][d];
                acc[r][i] = o;
            }
        }
    }

    // Each row's denominator, its head's sink (if any) joining the sum and the max.
#pragma unroll
    for (int pair = 0; pair < PAIRS; ++pair) {
        const int local = 2 * pair + half;
        const int row = warp * ROWS_PER_WARP + local;
        float inv = 1.f / l[pair];
        if (sinks != nullptr && row < rows) {
            const float sink = sinks[kv_head * group + (first_row + row) % group];
            const float m_all = fmaxf(m[pair], sink);
            const float kept = expf(m[pair] - m_all);  // the scores' share, rescaled to m_all
            inv = kept / (l[pair] * kept + expf(sink - m_all));
        }
        if (key == 0) inv_s[warp][local] = inv;
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int row = warp * ROWS_PER_WARP + r;
        if (row >= rows) continue;
        const int token = (first_row + row) / group, head = kv_head * group + (first_row + row) % group;
        const float inv = inv_s[warp][r];
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i)
            out[((query_start + token) * num_heads + head) * HEAD_DIM + lane + 32 * i] = from_float<T>(acc[r][i] * inv);
    }
}
