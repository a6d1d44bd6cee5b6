"""The CPU attention backend: decode tokens on a C++ kernel that reads the paged cache in
place (`gpu/cpu/kernels/cpu_paged_decode.cpp`), prompt chunks on the torch reference.

The torch reference gathers each decode's blocks into a padded batch and reads them
again: decode attention is bound by memory, and the gather moves the context three times
instead of once. The kernel reads every K and V row of a context once, for all the
query heads that share it (figures in docs/benchmarks.md, "The CPU kernels").

The library is built with g++ for this CPU on first use and cached
(`gpu.cpu.native_build`); where it cannot be built `cpu_kernel()` is None, and there,
or for a cache in float16, the engine stays on the torch reference. It has an entry
point for float32 and one for bfloat16 (scores and sums in fp32 either way).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention import CONTEXT_LEN, QUERY_START, BlockTables, SequenceSlice
from gpu.cpu.native_build import CPU_CXX_FLAGS, load_cpu_library, try_load_cpu_library
from gpu.kv_cache import PagedKVCache
from gpu.torch_attention import TorchAttentionBackend

_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# out, query, its token and head strides, K and V pools, query rows, context lengths,
# block tables, then seqs, max_blocks, block_size, heads, kv_heads, head_dim, scale, threads.
_ARGTYPES = (_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I)


# The kernel's entry point for each cache dtype it covers.
ENTRY_POINTS = {torch.float32: "paged_decode_attention", torch.bfloat16: "paged_decode_attention_bf16"}


@functools.cache
def cpu_kernel():
    """The kernel, or None where g++ cannot build it (logged once)."""
    library = try_load_cpu_library("cpu_paged_decode", CPU_CXX_FLAGS, instead="torch attention")
    return None if library is None else Kernel(library)


def load_kernel(flags: tuple[str, ...]):
    """The kernel built with `flags` (raises if it cannot be built)."""
    return Kernel(load_cpu_library("cpu_paged_decode", flags))


class Kernel:
    """The library's entry points, by the dtype of the cache they read."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.entries = {}
        for dtype, name in ENTRY_POINTS.items():
            entry = getattr(library, name)
            entry.argtypes = _ARGTYPES
            entry.restype = ctypes.c_int
            self.entries[dtype] = entry


def kernel_applies(kv_cache: PagedKVCache) -> bool:
    return kv_cache.blocks.device.type == "cpu" and kv_cache.blocks.dtype in ENTRY_POINTS and cpu_kernel() is not None


@dataclass
class CpuDecodes:
    query_rows: torch.Tensor  # [B] int32, the batch row of each decode token
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0

    @property
    def num_seqs(self) -> int:
        return self.query_rows.numel()


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, kv_cache: PagedKVCache, kernel=None) -> None:
        """`kernel` None is `cpu_kernel()`, built for this CPU."""
        super().__init__(kv_cache)
        if kernel is None and not kernel_applies(kv_cache):
            raise ValueError("the CPU decode kernel needs a float32 or bfloat16 cache in host memory and g++")
        self.entry = (kernel or cpu_kernel()).entries[kv_cache.blocks.dtype]
        self._tables = BlockTables()

    def prepare_decodes(self, decodes: list[SequenceSlice]) -> CpuDecodes:
        return CpuDecodes(
            torch.from_numpy(np.fromiter(map(QUERY_START, decodes), np.int32, len(decodes))),
            torch.from_numpy(np.fromiter(map(CONTEXT_LEN, decodes), np.int32, len(decodes))),
            torch.from_numpy(self._tables.gather(decodes, self.kv_cache.block_size)),
        )

    def attend_decodes(self, out, query, key_pool, value_pool, scale, decodes: CpuDecodes) -> None:
        if decodes.num_seqs == 0:
            return
        assert query.stride(2) == 1 and out.is_contiguous() and query.dtype == key_pool.dtype == out.dtype
        status = self.entry(
            out.data_ptr(), query.data_ptr(), query.stride(0), query.stride(1),
            key_pool.data_ptr(), value_pool.data_ptr(),
            decodes.query_rows.data_ptr(), decodes.context_lens.data_ptr(), decodes.block_tables.data_ptr(),
            decodes.num_seqs, decodes.block_tables.shape[1], self.kv_cache.block_size,
            query.shape[1], key_pool.shape[1], query.shape[2], scale, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"CPU decode kernel rejected {query.shape[1]} heads over {key_pool.shape[1]} KV heads")
