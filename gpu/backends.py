"""Which attention backend a model gets: the CUDA kernels (`CupyAttentionBackend`)
when the cache is on a GPU, cupy imports and kernels exist for the cache's dtype,
head_dim and block size; on a CPU, the C++ decode kernel (`CpuAttentionBackend`) for a
float32 or bfloat16 cache where g++ builds it; the torch reference (`TorchAttentionBackend`) otherwise."""

from __future__ import annotations

from gpu.attention import AttentionBackend
from gpu.cpu.attention import CpuAttentionBackend, kernel_applies
from gpu.cuda import source as cuda_source
from gpu.cuda.cupy_kernels import cupy_available
from gpu.kv_cache import PagedKVCache
from gpu.torch_attention import TorchAttentionBackend


def kernels_apply(kv_cache: PagedKVCache) -> bool:
    return (
        kv_cache.blocks.device.type == "cuda"
        and cuda_source.supports(kv_cache.blocks.dtype, kv_cache.shape.head_dim, kv_cache.block_size)
        and cupy_available()
    )


def select_backend(kv_cache: PagedKVCache) -> AttentionBackend:
    if kernels_apply(kv_cache):
        from gpu.cuda.attention import CupyAttentionBackend

        return CupyAttentionBackend(kv_cache)
    if kernel_applies(kv_cache):
        return CpuAttentionBackend(kv_cache)
    return TorchAttentionBackend(kv_cache)
