"""KV block bookkeeping: which block ids are free. Pure Python, no tensors.

The tensors live in `gpu.kv_cache`; this class only hands out and takes back ids.
A deque gives O(1) allocate and free; a set guards against double frees, which
would otherwise hand one block to two requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set: set[int] = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free KV blocks")
        block_id = self._free.popleft()
        self._free_set.discard(block_id)
        return block_id

    def free(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if block_id in self._free_set or not (0 <= block_id < self.num_blocks):
                raise ValueError(f"block {block_id} freed twice or never allocated")
            self._free_set.add(block_id)
            self._free.append(block_id)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
