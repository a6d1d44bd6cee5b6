"""The CPU attention backend: C++ kernels for decode tokens (`gpu/cpu/kernels/cpu_paged_decode.cpp`,
reading the paged cache in place) and for prompt chunks (`cpu_prompt_attention.cpp`).

The torch reference gathers each decode's blocks into a padded batch and reads them
again: decode attention is bound by memory, and the gather moves the context three times
instead of once. The decode kernel reads every K and V row of a context once, for all the
query heads that share it (figures in docs/benchmarks.md, "The CPU kernels").

Prompt attention is bound by arithmetic, and torch's SDPA runs it far below this CPU's
peak: it is most of a long prompt's time to first token. The prompt kernel runs it
flash-style on the AVX-512 (BF16) multiply-adds, each K/V block for all the query heads
that share it. A prompt chunk it cannot take (a head size it has no path for) falls back
to SDPA, as does every chunk where the prompt kernel cannot be built; decodes do not
depend on it.

The libraries are built with g++ for this CPU on first use and cached
(`gpu.cpu.native_build`); where the decode kernel cannot be built `cpu_kernel()` is None,
and there, or for a cache in float16, the engine stays on the torch reference. Each has
an entry point for float32 and one for bfloat16 (scores and sums in fp32 either way).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention import CONTEXT_LEN, FULL_ATTENTION, QUERY_START, BlockTables, LayerAttention, SequenceSlice
from gpu.cpu.native_build import CPU_CXX_FLAGS, load_cpu_library, try_load_cpu_library
from gpu.kv_cache import PagedKVCache
from gpu.torch_attention import PrefillSlice, TorchAttentionBackend

_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# out, query, its token and head strides, K and V pools, query rows, context lengths,
# block tables, then seqs, max_blocks, block_size, heads, kv_heads, head_dim, scale, threads.
_ARGTYPES = (_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I)


# The kernel's entry point for each cache dtype it covers.
ENTRY_POINTS = {torch.float32: "paged_decode_attention", torch.bfloat16: "paged_decode_attention_bf16"}

# The prompt kernel: out, query and its token and head strides, keys and their strides,
# values and theirs, then query_len, past_len, heads, kv_heads, head_dim, scale, threads.
_PROMPT_ARGTYPES = (_P, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _I, _I, _I, _I, _I, ctypes.c_float, _I)
PROMPT_ENTRY_POINTS = {torch.float32: "prompt_attention", torch.bfloat16: "prompt_attention_bf16"}


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

    def __init__(self, library: ctypes.CDLL, names=ENTRY_POINTS, argtypes=_ARGTYPES) -> None:
        self.entries = {}
        for dtype, name in names.items():
            entry = getattr(library, name)
            entry.argtypes = argtypes
            entry.restype = ctypes.c_int
            self.entries[dtype] = entry


@functools.cache
def cpu_prompt_kernel():
    """The prompt kernel, or None where g++ cannot build it (logged once)."""
    library = try_load_cpu_library("cpu_prompt_attention", CPU_CXX_FLAGS, instead="torch prompt attention")
    return None if library is None else Kernel(library, PROMPT_ENTRY_POINTS, _PROMPT_ARGTYPES)


def load_prompt_kernel(flags: tuple[str, ...]):
    """The prompt kernel built with `flags` (raises if it cannot be built)."""
    return Kernel(load_cpu_library("cpu_prompt_attention", flags), PROMPT_ENTRY_POINTS, _PROMPT_ARGTYPES)


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
    def __init__(self, kv_cache: PagedKVCache, kernel=None, prompt_kernel=None) -> None:
        """`kernel` None is `cpu_kernel()`, `prompt_kernel` None is `cpu_prompt_kernel()`
        (prompt chunks on torch where that is None too), both built for this CPU."""
        super().__init__(kv_cache)
        if kernel is None and not kernel_applies(kv_cache):
            raise ValueError("the CPU decode kernel needs a float32 or bfloat16 cache in host memory and g++")
        self.entry = (kernel or cpu_kernel()).entries[kv_cache.blocks.dtype]
        prompt_kernel = prompt_kernel or cpu_prompt_kernel()
        self.prompt_entry = None if prompt_kernel is None else prompt_kernel.entries[kv_cache.blocks.dtype]
        self._tables = BlockTables()

    def prepare_decodes(self, decodes: list[SequenceSlice]) -> CpuDecodes:
        return CpuDecodes(
            torch.from_numpy(np.fromiter(map(QUERY_START, decodes), np.int32, len(decodes))),
            torch.from_numpy(np.fromiter(map(CONTEXT_LEN, decodes), np.int32, len(decodes))),
            torch.from_numpy(self._tables.gather(decodes, self.kv_cache.block_size)),
        )

    def attend_decodes(
        self, out, query, key_pool, value_pool, scale, decodes: CpuDecodes, layer: LayerAttention = FULL_ATTENTION
    ) -> None:
        if decodes.num_seqs == 0:
            return
        if layer != FULL_ATTENTION:
            raise NotImplementedError("the CPU decode kernel has no sliding window, softcap or sinks yet")
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

    def _attend_prefills(
        self, out, query, key, value, key_pool, value_pool, scale, prefills: list[PrefillSlice], layer=FULL_ATTENTION
    ):
        rejected = [
            p
            for p in prefills
            if layer != FULL_ATTENTION
            or not self._attend_prompt(out, query, key, value, key_pool, value_pool, scale, p)
        ]
        super()._attend_prefills(out, query, key, value, key_pool, value_pool, scale, rejected, layer)

    def _attend_prompt(self, out, query, key, value, key_pool, value_pool, scale, p: PrefillSlice) -> bool:
        """One prompt chunk on the prompt kernel; False where it does not take it. The
        kernel masks causally from the chunk's offset, so `p.mask` is not read."""
        if self.prompt_entry is None:
            return False
        q = query[p.rows]
        if p.blocks is None:
            k, v = key[p.rows], value[p.rows]
        else:
            k = self._gather(key_pool, p.blocks, "key")[: p.context_len]
            v = self._gather(value_pool, p.blocks, "value")[: p.context_len]
        dtype = self.kv_cache.blocks.dtype  # the entry point's
        if not (q.stride(2) == k.stride(2) == v.stride(2) == 1 and q.dtype == k.dtype == v.dtype == out.dtype == dtype):
            return False
        query_len = q.shape[0]
        status = self.prompt_entry(
            out[p.rows].data_ptr(), q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            query_len, p.context_len - query_len, q.shape[1], k.shape[1], q.shape[2], scale, torch.get_num_threads(),
        )  # fmt: skip
        return status == 0
