"""The host KV pool: where preempted requests' blocks wait in CPU memory.

It mirrors the device cache's layout, `[layers, 2, num_blocks, block_size, kv_heads,
head_dim]`, so a swap is one batched copy per direction per step: gather the listed
blocks of every layer at once, copy, scatter into their new ids. On CUDA the host pool
is pinned and the copies run on their own stream; the step's forward waits for them
on the compute stream before it reads the swapped-in blocks. Given the CUDA kernels
(`kernels`), each direction is one launch of `copy_kv_blocks`, which reads and writes
the pinned pool directly; without them, torch gathers, copies and scatters. On a
CPU-only machine both pools are host memory and the same code runs (the tests run
the kernel path there through the CPU emulation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu.cuda import source as cuda_source
from gpu.kv_cache import PagedKVCache


class HostKVPool:
    def __init__(self, device_cache: PagedKVCache, num_blocks: int, kernels=None) -> None:
        if num_blocks < 1:
            raise ValueError("the host pool needs at least one block")
        self.device_cache = device_cache
        self.num_blocks = num_blocks
        device = device_cache.blocks.device
        self.on_cuda = device.type == "cuda"
        shape = (*device_cache.blocks.shape[:2], num_blocks, *device_cache.blocks.shape[3:])
        # Never read before a swap-out writes it, so it need not be zeroed (or touched).
        self.blocks = torch.empty(shape, dtype=device_cache.blocks.dtype, pin_memory=self.on_cuda)
        self.stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.kernels = kernels

    @classmethod
    def from_budget(cls, device_cache: PagedKVCache, memory_bytes: int, kernels=None) -> HostKVPool | None:
        """As many blocks as `memory_bytes` holds; None if not even one."""
        block_bytes = device_cache.blocks[:, :, 0].numel() * device_cache.blocks.element_size()
        num_blocks = memory_bytes // block_bytes
        return cls(device_cache, num_blocks, kernels) if num_blocks else None

    @torch.inference_mode()
    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Copy (device, host) block pairs out, then (host, device) pairs in."""
        if not swap_out and not swap_in:
            return
        device_blocks = self.device_cache.blocks
        if self.kernels is not None:
            self._swap_with_kernel(swap_out, swap_in)
            return
        stream = self.stream  # None off CUDA
        if stream is None:
            if swap_out:
                device_ids, host_ids = _ids(swap_out, device_blocks.device)
                self.blocks.index_copy_(2, host_ids, device_blocks.index_select(2, device_ids))
            if swap_in:
                host_ids, device_ids = _ids(swap_in, device_blocks.device)
                device_blocks.index_copy_(2, device_ids, self.blocks.index_select(2, host_ids))
            return

        compute = torch.cuda.current_stream(device_blocks.device)
        stream.wait_stream(compute)  # the blocks going out were written by earlier steps
        with torch.cuda.stream(stream):
            if swap_out:
                device_ids, host_ids = _ids(swap_out, device_blocks.device)
                staged = device_blocks.index_select(2, device_ids).to("cpu", non_blocking=True)
                stream.synchronize()  # the host scatter below reads what just arrived
                self.blocks.index_copy_(2, host_ids.cpu(), staged)
            if swap_in:
                host_ids, device_ids = _ids(swap_in, device_blocks.device)
                staged = self.blocks.index_select(2, host_ids.cpu()).pin_memory()
                device_blocks.index_copy_(2, device_ids, staged.to(device_blocks.device, non_blocking=True))
        compute.wait_stream(stream)  # the forward reads the swapped-in blocks

    def _swap_with_kernel(self, swap_out, swap_in) -> None:
        device_blocks = self.device_cache.blocks
        stream = self.stream  # None off CUDA
        if stream is None:
            self._copy_blocks(self.blocks, device_blocks, swap_out)
            self._copy_blocks(device_blocks, self.blocks, swap_in)
            return
        compute = torch.cuda.current_stream(device_blocks.device)
        stream.wait_stream(compute)  # the blocks going out were written by earlier steps
        with torch.cuda.stream(stream):
            self._copy_blocks(self.blocks, device_blocks, swap_out)
            self._copy_blocks(device_blocks, self.blocks, swap_in)
        compute.wait_stream(stream)  # the forward reads the swapped-in blocks

    def _copy_blocks(self, dst: torch.Tensor, src: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
        """One launch: block pair[0] of `src` to block pair[1] of `dst`, in every layer's K and V."""
        if not pairs:
            return
        block_bytes = src[0, 0, 0].numel() * src.element_size()
        assert block_bytes % 16 == 0, "the copy kernel moves 16-byte words"
        planes = src.shape[0] * src.shape[1]
        ids = torch.tensor(pairs, dtype=torch.int32).to(self.device_cache.blocks.device)
        self.kernels.launch(cuda_source.copy_blocks(), (len(pairs), planes), cuda_source.THREADS, [
            dst, src, ids, src.shape[2], dst.shape[2], block_bytes // 16,
        ])  # fmt: skip


def _ids(pairs: Sequence[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(pairs, dtype=torch.long, device=device)
    return ids[:, 0], ids[:, 1]
