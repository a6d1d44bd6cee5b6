// Cache maintenance: writing a step's new K/V into their slots, and copying whole
// blocks between the device cache and the pinned host pool (swaps).
#include "common.cuh"

// Grid: x = token. Slot -1 skips the token (nothing is written for it).
template <typename T>
__global__ void __launch_bounds__(128) write_kv_cache(
    T* __restrict__ key_cache, T* __restrict__ value_cache,  // [slots, num_kv_heads, head_dim]
    const T* __restrict__ key, i64 key_token_stride, i64 key_head_stride,
    const T* __restrict__ value, i64 value_token_stride, i64 value_head_stride,
    const i64* __restrict__ slot_mapping,  // [tokens]
    int num_kv_heads, int head_dim) {
    const i64 token = blockIdx.x;
    const i64 slot = slot_mapping[token];
    if (slot < 0) return;
    const i64 row = slot * num_kv_heads * head_dim;
    for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += blockDim.x) {
        const int head = i / head_dim, d = i % head_dim;
        key_cache[row + i] = key[token * key_token_stride + head * key_head_stride + d];
        value_cache[row + i] = value[token * value_token_stride + head * value_head_stride + d];
    }
}

// Grid: x = (source block, destination block) pair, y = plane (layer x K/V). Both pools
// are `[planes, blocks, block_bytes]`, with their own block counts; one launch moves
// every listed block of every layer. The host side is pinned memory that the device
// reads and writes directly (mapped, unified addressing).
__global__ void __launch_bounds__(128) copy_kv_blocks(
    bytes16* __restrict__ dst, const bytes16* __restrict__ src,
    const int* __restrict__ pairs,  // [num_pairs, 2]: source id, destination id
    i64 src_blocks, i64 dst_blocks, i64 words_per_block) {
    const i64 plane = blockIdx.y;
    const i64 from = (plane * src_blocks + pairs[2 * blockIdx.x]) * words_per_block;
    const i64 to = (plane * dst_blocks + pairs[2 * blockIdx.x + 1]) * words_per_block;
    for (i64 i = threadIdx.x; i < words_per_block; i += blockDim.x) dst[to + i] = src[from + i];
}
