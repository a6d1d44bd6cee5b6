"""The CUDA attention backend: the kernels of `gpu/cuda/kernels/paged_attention.cu` behind
the engine's `AttentionBackend` interface, loaded with cupy (NVRTC).

Per layer: one launch writes the new K/V into their slots; one decode launch covers
every request with a single new token (plus a reduce launch when contexts are split
into partitions); one prefill launch covers every prompt chunk. `prepare` builds the
index tensors once per step. A layer's `LayerAttention` goes to the kernels as
arguments: its window (decode reads only the partitions and keys the window covers, so
a short window needs fewer partitions and often no reduce; prefill skips key tiles
before its rows' windows and masks the rest), its softcap (each scaled score capped by a
tanh before the softmax) and its sinks (an fp32 copy per sinks tensor, kept on the
device as long as the backend, so a CUDA graph's launches can point at it; each head's
sink joins its softmax denominator once). The kernels come from `CupyKernels` on a GPU; the tests
hand in `tests.cuda_emulator.EmulatedKernels` instead, which runs the same source on the
CPU, so this class is checked without a GPU too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu.attention import (
    CONTEXT_LEN,
    FULL_ATTENTION,
    QUERY_LEN,
    QUERY_START,
    AttentionBackend,
    BlockTables,
    KernelLauncher,
    LayerAttention,
    SequenceSlice,
    checked_sinks,
    kernel_scalars,
    tensor_version,
)
from gpu.cuda import source as cuda_source
from gpu.kv_cache import PagedKVCache

# A decode launch should have a few blocks per SM; short of that, contexts are split
# into smaller partitions (down to MIN_PARTITION tokens).
BLOCKS_PER_SM = 2
MIN_PARTITION = 64


@dataclass
class DecodeBatch:
    query_rows: torch.Tensor  # [B] int32: the batch row of each decode token
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    partition_size: int
    num_partitions: int


@dataclass
class PrefillBatch:
    query_starts: torch.Tensor  # [S] int32
    query_lens: torch.Tensor  # [S] int32
    query_lens_host: list[int]
    context_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # by GQA group

    def tiles_for(self, group: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, first row) of each tile of (token, head) rows; the rows depend on
        the GQA group, known only when the first layer runs."""
        if group not in self.tiles:
            seqs, rows = [], []
            for seq, query_len in enumerate(self.query_lens_host):
                for first in range(0, query_len * group, cuda_source.prefill_rows(head_dim)):
                    seqs.append(seq)
                    rows.append(first)
            self.tiles[group] = (_int32(seqs, device), _int32(rows, device))
        return self.tiles[group]


@dataclass
class KernelMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    decode: DecodeBatch | None
    prefill: PrefillBatch | None


class CupyAttentionBackend(AttentionBackend):
    kernels: KernelLauncher

    def __init__(
        self, kv_cache: PagedKVCache, kernels: KernelLauncher | None = None, partition_size: int | None = None
    ) -> None:
        """`kernels` defaults to the GPU's (`CupyKernels`); `partition_size` (tokens per
        decode partition) defaults to a size that gives every SM a few blocks."""
        super().__init__(kv_cache)
        dtype, head_dim = kv_cache.blocks.dtype, kv_cache.shape.head_dim
        if not cuda_source.supports(dtype, head_dim, kv_cache.block_size):
            raise ValueError(f"no kernels for {dtype}, head_dim {head_dim}, block size {kv_cache.block_size}")
        if partition_size is not None and not 0 < partition_size <= cuda_source.MAX_PARTITION:
            raise ValueError(f"partition_size must be in 1..{cuda_source.MAX_PARTITION}")
        self.device = kv_cache.blocks.device
        if kernels is None:
            from gpu.cuda.cupy_kernels import CupyKernels

            kernels = CupyKernels(self.device)
        self.kernels = kernels
        self.partition_size = partition_size
        self._decode_tables, self._prefill_tables = BlockTables(), BlockTables()
        if self.device.type == "cuda":
            self.target_blocks = BLOCKS_PER_SM * torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.target_blocks = 256
        block_size = kv_cache.block_size
        self._write = cuda_source.write_kv(dtype)
        self._decode = cuda_source.decode(dtype, head_dim, block_size)
        self._reduce = cuda_source.decode_reduce(dtype, head_dim)
        self._prefill = cuda_source.prefill(dtype, head_dim, block_size)
        # fp32 device copies of the layers' sinks, by id() of the tensor (kept alive here,
        # so the id stays its own), with the tensor's version when copied: the kernels'
        # pointer to them must outlive a graph.
        self._sinks: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def prepare(self, sequences: Sequence[SequenceSlice], num_tokens: int) -> KernelMetadata:
        # Built with numpy from columns of the slices: at hundreds of decodes a step, this
        # is host time the device waits for.
        decodes = [seq for seq in sequences if seq.query_len == 1]
        prefills = [seq for seq in sequences if seq.query_len != 1] if len(decodes) < len(sequences) else []
        assert len(decodes) + sum(map(QUERY_LEN, prefills)) == num_tokens
        slots = np.empty(num_tokens, np.int64)
        decode = self._decode_batch(decodes, slots)
        prefill = self._prefill_batch(prefills, slots)
        return KernelMetadata(torch.from_numpy(slots).to(self.device), decode, prefill)

    def _decode_batch(self, decodes: list[SequenceSlice], slots: np.ndarray) -> DecodeBatch | None:
        """The decodes' batch; writes their tokens' cache slots into `slots`."""
        if not decodes:
            return None
        block_size = self.kv_cache.block_size
        rows = np.fromiter(map(QUERY_START, decodes), np.int32, len(decodes))
        context_lens = np.fromiter(map(CONTEXT_LEN, decodes), np.int32, len(decodes))
        tables = self._decode_tables.gather(decodes, block_size)
        positions = context_lens - 1  # of each decode's one new token
        slots[rows] = tables[np.arange(len(decodes)), positions // block_size] * block_size + positions % block_size
        longest = int(context_lens.max())
        size = self.partition_size or self._auto_partition_size(len(decodes), longest)
        return DecodeBatch(
            _on(rows, self.device), _on(context_lens, self.device), _on(tables, self.device), size, -(-longest // size)
        )

    def decode_partition_size(self, num_seqs: int, longest: int) -> int:
        """Tokens per decode partition for `num_seqs` contexts of up to `longest` tokens
        (what a CUDA graph of that many rows is captured with, `gpu.cuda.graphs`)."""
        return self.partition_size or self._auto_partition_size(num_seqs, longest)

    def _auto_partition_size(self, num_seqs: int, longest: int) -> int:
        size = cuda_source.MAX_PARTITION
        kv_heads = self.kv_cache.shape.num_kv_heads
        while size > MIN_PARTITION and num_seqs * kv_heads * -(-longest // size) < self.target_blocks:
            size //= 2
        return size

    def _prefill_batch(self, prefills: list[SequenceSlice], slots: np.ndarray) -> PrefillBatch | None:
        """The prompt chunks' batch; writes their tokens' cache slots into `slots`."""
        if not prefills:
            return None
        block_size = self.kv_cache.block_size
        tables = self._prefill_tables.gather(prefills, block_size)
        for table, seq in zip(tables, prefills):
            positions = np.arange(seq.past_len, seq.context_len)
            slots[seq.query_start : seq.query_start + seq.query_len] = (
                table[positions // block_size] * block_size + positions % block_size
            )
        return PrefillBatch(
            _int32([seq.query_start for seq in prefills], self.device),
            _int32([seq.query_len for seq in prefills], self.device),
            [seq.query_len for seq in prefills],
            _int32([seq.context_len for seq in prefills], self.device),
            _on(tables, self.device),
        )

    def attend(
        self, layer_idx, query, key, value, scale, metadata: KernelMetadata, layer: LayerAttention = FULL_ATTENTION
    ) -> torch.Tensor:
        window, softcap, sinks = self._layer_arguments(layer, query.shape[1])
        key_pool = self.kv_cache.key_pools[layer_idx]
        value_pool = self.kv_cache.value_pools[layer_idx]
        query, key, value = (_unit_stride(t) for t in (query, key, value))
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        threads = cuda_source.THREADS
        self.kernels.launch(self._write, (num_tokens,), threads, [
            key_pool, value_pool, key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
            metadata.slot_mapping, num_kv_heads, head_dim,
        ])  # fmt: skip

        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
        group = num_heads // num_kv_heads
        decode = metadata.decode
        if decode is not None:
            num_seqs = decode.query_rows.numel()
            # A window covers fewer partitions than a long context: the grid launches those.
            parts = cuda_source.decode_slots(decode.num_partitions, decode.partition_size, window)
            # Unused with a single partition: the kernel takes 0 for each.
            partial_out: torch.Tensor | int = 0
            partial_max: torch.Tensor | int = 0
            partial_sum: torch.Tensor | int = 0
            if parts > 1:
                partial_out = torch.empty(
                    (num_seqs, num_heads, parts, head_dim), dtype=torch.float32, device=out.device
                )
                partial_max = torch.empty((num_seqs, num_heads, parts), dtype=torch.float32, device=out.device)
                partial_sum = torch.empty_like(partial_max)
            head_groups = -(-group // cuda_source.MAX_GROUP)
            self.kernels.launch(self._decode, (num_kv_heads * head_groups, num_seqs, parts), threads, [
                out, partial_out, partial_max, partial_sum, query, query.stride(0), query.stride(1),
                key_pool, value_pool, decode.query_rows, decode.context_lens, decode.block_tables,
                decode.block_tables.shape[1], num_heads, num_kv_heads, decode.partition_size, parts, scale,
                window, softcap, sinks,
            ])  # fmt: skip
            if parts > 1:
                self.kernels.launch(self._reduce, (num_heads, num_seqs), threads, [
                    out, partial_out, partial_max, partial_sum, decode.query_rows, decode.context_lens,
                    num_heads, decode.partition_size, parts, window, sinks,
                ])  # fmt: skip
        prefill = metadata.prefill
        if prefill is not None:
            tile_seqs, tile_rows = prefill.tiles_for(group, head_dim, out.device)
            self.kernels.launch(self._prefill, (tile_seqs.numel(), num_kv_heads), threads, [
                out, query, query.stride(0), query.stride(1), key_pool, value_pool, tile_seqs, tile_rows,
                prefill.query_starts, prefill.query_lens, prefill.context_lens,
                prefill.block_tables, prefill.block_tables.shape[1], num_heads, num_kv_heads, scale,
                window, softcap, sinks,
            ])  # fmt: skip
        return out

    def _layer_arguments(self, layer: LayerAttention, num_heads: int) -> tuple[int, float, torch.Tensor | int]:
        """(window, softcap, sinks) as the kernels take them: 0 for none, sinks an fp32
        device tensor of one logit per query head (or 0)."""
        if layer.window is None and layer.softcap is None and layer.sinks is None:
            return 0, 0.0, 0
        window, softcap = kernel_scalars(layer)
        if layer.sinks is None:
            return window, softcap, 0
        sinks = layer.sinks
        version = tensor_version(sinks)
        cached = self._sinks.get(id(sinks))
        if cached is None or cached[0] is not sinks or cached[1] != version:
            copy = (
                checked_sinks(sinks, num_heads).detach().to(self.device, torch.float32, copy=True).contiguous().view(-1)
            )
            cached = self._sinks[id(sinks)] = (sinks, version, copy)
        return window, softcap, cached[2]


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return _on(np.array(values, dtype=np.int32), device)


def _on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take token and head strides but read head_dim contiguously."""
    return t if t.stride(-1) == 1 else t.contiguous()
