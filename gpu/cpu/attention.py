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

Each layer's `LayerAttention` goes to both kernels per call: a sliding window masks the
keys before each query's window, and the blocks (decode) or key tiles (prompt) wholly
before it are not read, so a windowed layer costs its window, not its context; a softcap
turns each scaled score s into softcap * tanh(s / softcap) before the softmax; sinks (one
fp32 logit per query head, converted once per tensor) join each row's softmax max and sum
and take no value. A later prompt chunk of a windowed layer gathers only the blocks from
its first query's window on. Such layers skip the prompt kernel's AMX path (Intel's tile
unit) for its AVX-512 one.

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

from gpu.attention import (
    CONTEXT_LEN,
    FULL_ATTENTION,
    QUERY_START,
    BlockTables,
    LayerAttention,
    SequenceSlice,
    checked_sinks,
    kernel_scalars,
    tensor_version,
)
from gpu.cpu.native_build import CPU_CXX_FLAGS, load_cpu_library, try_load_cpu_library
from gpu.kv_cache import PagedKVCache
from gpu.torch_attention import PrefillSlice, TorchAttentionBackend

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# out, query, its token and head strides, K and V pools, query rows, context lengths,
# block tables, then seqs, max_blocks, block_size, heads, kv_heads, head_dim, scale, the
# layer's window (0: none), softcap (0: none) and sinks (fp32 [heads], or null), threads.
_ARGTYPES = (_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _P, _I)
_MAX_CACHED_SINKS = 1024


# The kernel's entry point for each cache dtype it covers.
ENTRY_POINTS = {torch.float32: "paged_decode_attention", torch.bfloat16: "paged_decode_attention_bf16"}

# The prompt kernel: out, query and its token and head strides, keys and their strides,
# values and theirs, then query_len, past_len, heads, kv_heads, head_dim, scale, window,
# softcap, sinks (as the decode kernel's), threads.
_PROMPT_ARGTYPES = (_P, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _I, _I, _I, _I, _I, _F, _I, _F, _P, _I)
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
        # Each layer's sinks as the kernels read them (contiguous fp32), by id() of the
        # layer's tensor: the tensor (kept alive, so the id is not reused), its version
        # when converted, the copy.
        self._sinks: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def _layer_arguments(self, layer: LayerAttention, num_heads: int) -> tuple[int, float, int]:
        """(window, softcap, sinks address) as the kernels take them: 0 for none."""
        if layer is FULL_ATTENTION or (layer.window is None and layer.softcap is None and layer.sinks is None):
            return 0, 0.0, 0
        window, softcap = kernel_scalars(layer)
        if layer.sinks is None:
            return window, softcap, 0
        return window, softcap, self._sinks_for(layer.sinks, num_heads).data_ptr()

    def _sinks_for(self, sinks: torch.Tensor, num_heads: int) -> torch.Tensor:
        """`sinks` as a contiguous fp32 host tensor, converted once (again if it changes in place)."""
        version = tensor_version(sinks)
        cached = self._sinks.get(id(sinks))
        if cached is not None and cached[0] is sinks and cached[1] == version:
            return cached[2]
        converted = checked_sinks(sinks, num_heads).detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)
        if version < 0:  # an inference tensor: not cached, read as it is now
            return converted
        if converted.data_ptr() == sinks.data_ptr():
            converted = converted.clone()  # a copy of its own: the layer's tensor may change later
        if len(self._sinks) >= _MAX_CACHED_SINKS:  # fresh tensors every call: keep no more than a model's worth
            self._sinks.clear()
        self._sinks[id(sinks)] = (sinks, version, converted)
        return converted

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
        assert query.stride(2) == 1 and out.is_contiguous() and query.dtype == key_pool.dtype == out.dtype
        window, softcap, sinks = self._layer_arguments(layer, query.shape[1])
        status = self.entry(
            out.data_ptr(), query.data_ptr(), query.stride(0), query.stride(1),
            key_pool.data_ptr(), value_pool.data_ptr(),
            decodes.query_rows.data_ptr(), decodes.context_lens.data_ptr(), decodes.block_tables.data_ptr(),
            decodes.num_seqs, decodes.block_tables.shape[1], self.kv_cache.block_size,
            query.shape[1], key_pool.shape[1], query.shape[2], scale, window, softcap, sinks, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"CPU decode kernel rejected {query.shape[1]} heads over {key_pool.shape[1]} KV heads")

    def _attend_prefills(
        self, out, query, key, value, key_pool, value_pool, scale, prefills: list[PrefillSlice], layer=FULL_ATTENTION
    ):
        rejected = [
            p
            for p in prefills
            if not self._attend_prompt(out, query, key, value, key_pool, value_pool, scale, p, layer)
        ]
        super()._attend_prefills(out, query, key, value, key_pool, value_pool, scale, rejected, layer)

    def _attend_prompt(
        self, out, query, key, value, key_pool, value_pool, scale, p: PrefillSlice, layer=FULL_ATTENTION
    ) -> bool:
        """One prompt chunk on the prompt kernel; False where it does not take it. The
        kernel masks causally (and by the layer's window) from the chunk's offset, so
        `p.mask` is not read. A later chunk of a windowed layer gathers only the blocks
        from its first query's window on."""
        if self.prompt_entry is None:
            return False
        q = query[p.rows]
        query_len = q.shape[0]
        past_len = p.context_len - query_len
        window, softcap, sinks = self._layer_arguments(layer, q.shape[1])
        if p.blocks is None:
            k, v = key[p.rows], value[p.rows]
        else:
            block_size = self.kv_cache.block_size
            skipped = 0 if window == 0 else max(0, past_len - window + 1) // block_size  # blocks before the window
            blocks = p.blocks[skipped:] if skipped else p.blocks
            past_len -= skipped * block_size
            k = self._gather(key_pool, blocks, "key")[: past_len + query_len]
            v = self._gather(value_pool, blocks, "value")[: past_len + query_len]
        dtype = self.kv_cache.blocks.dtype  # the entry point's
        if not (q.stride(2) == k.stride(2) == v.stride(2) == 1 and q.dtype == k.dtype == v.dtype == out.dtype == dtype):
            return False
        status = self.prompt_entry(
            out[p.rows].data_ptr(), q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            query_len, past_len, q.shape[1], k.shape[1], q.shape[2], scale, window, softcap, sinks,
            torch.get_num_threads(),
        )  # fmt: skip
        return status == 0
