"""KV block bookkeeping: which block ids are free, shared or cached. Pure Python, no tensors.

The tensors live in `gpu.kv_cache` (device) and `gpu.offload` (host); a `BlockPool`
only hands out and takes back ids, one pool per tier. The KV-cache manager
(`workers/kv_cache.py`) decides which request holds which of them.

**Refcounts.** A block is held by every request whose block table lists it; `free`
drops one holder. A block with no holder is free.

**Content addresses.** A full block can be registered under its hash (`block_hash`:
the parent block's hash, this block's token ids and the cache's salt, which names
what else changes K/V: the model and its dtype). A free block that is registered keeps
its contents and its address: it is *cached*, and a request whose prompt starts with
the same tokens takes it again (`lookup`, `share`) instead of computing it. Cached
blocks are evicted lazily, least recently freed first, only when `allocate` finds no
free block without contents; the evicted addresses are collected in `evicted` for a
lower tier to keep. A registered block is never written again: a request only
writes past the tokens its blocks already hold, and only full blocks are registered.

**The null block.** A pool for a cache with sliding-window layers keeps block 0 back
(`NULL_BLOCK`): a window's block table names it where blocks left the window, so a
table keeps one entry per block of context (the kernels never read before the window).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

NULL_BLOCK = 0  # where a sliding window's table has no block (a pool with `keep_null`)


class OutOfBlocks(RuntimeError):
    pass


def block_hash(parent: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    """The content address of a full block: a chain, so equal hashes mean equal prefixes."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16, key=salt[:64]).digest()


class BlockPool:
    def __init__(self, num_blocks: int, keep_null: bool = False) -> None:
        """`num_blocks` blocks, less `NULL_BLOCK` with `keep_null`."""
        first = 1 if keep_null else 0
        self.keeps_null = keep_null
        if num_blocks < first + 1:
            raise ValueError(f"num_blocks must be >= {first + 1}")
        self.num_blocks = num_blocks - first  # the blocks it hands out
        self._holders = [0] * num_blocks
        self._address: list[bytes | None] = [None] * num_blocks
        self._by_address: dict[bytes, int] = {}
        self._empty: deque[int] = deque(range(first, num_blocks))  # free, nothing worth keeping
        # Free, registered blocks and their addresses; least recent first.
        self._cached: OrderedDict[int, bytes] = OrderedDict()
        self.evicted: list[tuple[bytes, int]] = []  # (address, block) evicted, for the caller to take
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: empty ones, then cached ones (evicting them)."""
        return len(self._empty) + len(self._cached)

    @property
    def num_empty(self) -> int:
        """Free blocks holding nothing worth keeping: `allocate` takes these before it evicts."""
        return len(self._empty)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under an address, held or not."""
        return len(self._by_address)

    def holders(self, block_id: int) -> int:
        return self._holders[block_id]

    def address(self, block_id: int) -> bytes | None:
        return self._address[block_id]

    def allocate(self) -> int:
        """A block with one holder; an empty one if there is any, else the least recently
        freed cached block, whose address is dropped (and recorded in `evicted`)."""
        if self._empty:
            block_id = self._empty.popleft()
        elif self._cached:
            block_id, address = self._cached.popitem(last=False)
            del self._by_address[address]
            self._address[block_id] = None
            self.evicted.append((address, block_id))
            self.num_evictions += 1
        else:
            raise OutOfBlocks("no free KV blocks")
        self._holders[block_id] = 1
        return block_id

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block; a block left with none is free (cached if registered)."""
        for block_id in block_ids:
            if not (0 <= block_id < len(self._holders)) or self._holders[block_id] <= 0:
                raise ValueError(f"block {block_id} freed twice or never allocated")
            self._holders[block_id] -= 1
            if self._holders[block_id] == 0:
                address = self._address[block_id]
                if address is None:
                    self._empty.append(block_id)
                else:
                    self._cached[block_id] = address  # most recently freed last

    def lookup(self, address: bytes) -> int | None:
        return self._by_address.get(address)

    def share(self, block_id: int) -> None:
        """One more holder of a registered block (found by `lookup`)."""
        if self._address[block_id] is None:
            raise ValueError(f"block {block_id} is not cached: only registered blocks are shared")
        if self._holders[block_id] == 0:
            del self._cached[block_id]
        self._holders[block_id] += 1

    def fork(self, block_id: int) -> None:
        """One more holder of a held block (parallel choices sharing their prompt)."""
        if self._holders[block_id] <= 0:
            raise ValueError(f"block {block_id} is not held: only held blocks are forked")
        self._holders[block_id] += 1

    def register(self, block_id: int, address: bytes) -> bool:
        """Give a held, full block its content address. False (and nothing changes) when
        another block already has that address, or this one has an address already."""
        if self._holders[block_id] <= 0:
            raise ValueError(f"block {block_id} is not held: only held blocks are registered")
        if address in self._by_address or self._address[block_id] is not None:
            return False
        self._by_address[address] = block_id
        self._address[block_id] = address
        return True

    def unregister(self, block_id: int) -> None:
        """Forget a block's address (its contents cannot be trusted, e.g. a copy failed)."""
        address = self._address[block_id]
        if address is None:
            return
        del self._by_address[address]
        self._address[block_id] = None
        if self._holders[block_id] == 0:
            del self._cached[block_id]
            self._empty.append(block_id)

    def take_evicted(self) -> list[tuple[bytes, int]]:
        evicted, self.evicted = self.evicted, []
        return evicted


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
