"""A request's KV block tables, one per group of layers, counted in blocks.

The base of the KV-cache manager (`workers/kv_cache.py`, over `workers/prefix_cache.py`):
the pools, the groups' windows and how many blocks a request holds or needs.

**Groups** (`gpu/kv_layout.py`). A model whose layers attend alike has one block
table per request; one with sliding-window layers has one per group of layers, all
drawing on the same pool (a block of any group is one page). A sliding group keeps only
the blocks its window can still read: as a request moves on, blocks wholly before
`num_computed - window + 1` go back to the pool (cached, when prefix caching is on) and
the table names the null block there (`NULL_BLOCK`), so every table keeps one entry per
block of context. Counting blocks (room, admission, what a request needs to run at all,
swaps) counts each group's own: past the window a sliding group holds a window's worth.
A prefix hit needs every full group's blocks from the start and a sliding group's only
from its window's first block; swapping out copies the blocks a group holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.block_pool import NULL_BLOCK, BlockPool, blocks_needed
from workers.request import Request


class KVTables:
    def __init__(
        self,
        device_pool: BlockPool,
        block_size: int,
        host_pool: BlockPool | None = None,
        cache_salt: bytes | None = None,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        """`windows`: each group's (`gpu.kv_layout`), None for full attention; a pool whose
        groups have windows keeps the null block back."""
        if any(window is not None for window in windows) and not device_pool.keeps_null:
            raise ValueError("a cache with sliding-window groups needs a pool that keeps the null block")
        self.device_pool = device_pool
        self.host_pool = host_pool  # None: no host tier, preempted requests recompute
        self.block_size = block_size
        self.cache_salt = cache_salt  # None: no prefix caching
        self.windows = tuple(windows)
        self._windowed = any(window is not None for window in windows)  # tables may name the null block
        self._queried = self._device_hits = self._host_hits = self._offloaded = 0  # this step's

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    # -- counting --------------------------------------------------------------------

    def _first_kept(self, window: int | None, num_computed: int) -> int:
        """The first block a group reads once `num_computed` tokens are computed: every
        query from then on is at `num_computed` or later."""
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def _kept_from(self, num_computed: int) -> list[int]:
        return [self._first_kept(window, num_computed) for window in self.windows]

    def _blocks_for(self, num_computed: int, num_tokens: int) -> int:
        """Blocks a request holds, over every group, with `num_tokens` tokens' blocks
        allocated and `num_computed` computed."""
        blocks = blocks_needed(num_tokens, self.block_size)
        return sum(max(0, blocks - first) for first in self._kept_from(num_computed))

    def _held(self, request: Request) -> int:
        """Blocks `request` holds, over every group."""
        held = sum(map(len, request.block_tables))
        return held - sum(table.count(NULL_BLOCK) for table in request.block_tables) if self._windowed else held

    def _real(self, blocks: list[int]) -> list[int]:
        """`blocks` without the null block."""
        return [block for block in blocks if block != NULL_BLOCK] if self._windowed else blocks

    def _room(self, num_computed: int, held: int, free: int) -> int:
        """Tokens a request holding `held` blocks can write from `num_computed` on, with
        `free` more blocks: each new block of tokens takes one per group, while a sliding
        group gives back what falls out of its window."""
        kept_before = sum(self._kept_from(num_computed))
        tokens = (free + held + kept_before) // self.num_groups * self.block_size
        return max(0, tokens - num_computed)

    def fits(self, num_tokens: int) -> bool:
        """A request of `num_tokens` tokens can run alone: the pool holds its blocks for its
        last token (more than that, and preempting others would not help)."""
        return self._blocks_for(num_tokens - 1, num_tokens) <= self.device_pool.num_blocks

    def most_tokens(self, limit: int = 2**31 - 1) -> int:
        """The longest request that `fits`, up to `limit` (with no full-attention group,
        the window bounds what a request holds, and only `limit` its length)."""
        low, high = 0, limit  # fits(low); the answer is at most high
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.fits(middle) else (low, middle - 1)
        return low

    def can_resume(self, request: Request) -> bool:
        """A swapped-out `request` fits back with room for its next token."""
        num_computed = request.num_computed
        return self._blocks_for(num_computed, num_computed + 1) <= self.device_pool.num_free

    @property
    def _host(self) -> BlockPool:
        """The host tier, on the paths that run only with one (host blocks are held)."""
        if self.host_pool is None:
            raise RuntimeError("no host tier")
        return self.host_pool
