"""The KV-cache manager: which device and host blocks each request holds, and the copies between them.

The scheduler decides who runs; it asks this manager, in tokens and blocks, what fits and
what a request starts from, and the manager changes the pools (`workers/block_pool.py`,
one per tier) and lists the copies a step needs in its `StepPlan`. Plain Python over
block ids, like the scheduler; the tensors the ids index are `gpu/kv_cache.py`'s and
`gpu/offload.py`'s.

**Allocation.** A request's device blocks grow as its tokens are scheduled (`allocate`),
never reserved for max_tokens up front, and are freed all at once when it ends or is
preempted (`release`), last block first: cached blocks are evicted least recently freed
first, so a chain loses its tail before its head (a lookup stops at the first miss).

**Copies.** Swaps, offloads and fetches are listed in the plan as (from, to) block
pairs and made before the step's forward: device to host first (swap-outs, then
offloads), then host to device (swap-ins, then fetches), so a block evicted and reused
in one step is saved before it is overwritten. The host blocks that copies read or
wrote are freed, or kept registered, when the runner reports them made (`copies_done`).

**Groups, the prefix cache.** The block tables per group of layers and their counting are
`workers/kv_tables.py`'s; content addresses and the host tier's copies
`workers/prefix_cache.py`'s; this manager adds allocation, copy on write and swaps.

**Copy on write.** A block held by more than one request, or registered under an
address, is never written. Before a request writes into such a block (a parallel choice
recomputing the prompt's last token in the block it shares with its lead), the block is
copied into one of its own (the plan's `copies`, device to device).
"""

from __future__ import annotations

from workers.block_pool import NULL_BLOCK, blocks_needed
from workers.plan import StepPlan
from workers.prefix_cache import PrefixCache
from workers.request import Request


class KVCacheManager(PrefixCache):
    """Which blocks each request holds, on the device and in the host tier (see the module)."""

    # -- a request's blocks ----------------------------------------------------------

    def room(self, request: Request, keep_free: int = 0) -> int:
        """Tokens `request` can write from `num_computed` on: the rest of its own blocks and
        the free blocks beyond `keep_free` (less one for each copy on write its next block
        needs)."""
        free = self.device_pool.num_free - self._shared_next(request)
        if free < 0:
            return 0  # its next block must be copied, and no block is free to copy it into
        return self._room(request.num_computed, self._held(request), max(0, free - keep_free))

    def allocate(self, request: Request, num_tokens: int, plan: StepPlan) -> bool:
        """Give `request` the blocks for its first `num_tokens` tokens, copying its next
        block first where it may not write it, after the blocks its windows left go back.
        False, allocating nothing, when too few are free."""
        self._leave_windows(request)
        blocks = blocks_needed(num_tokens, self.block_size)
        shared = self._shared_next(request)
        need = sum(blocks - len(table) for table in request.block_tables) + shared
        if need > self.device_pool.num_free:
            return False
        if shared:
            self._copy_on_write(request, plan)
        for table in request.block_tables:
            for _ in range(blocks - len(table)):
                table.append(self.device_pool.allocate())
        return True

    def _leave_windows(self, request: Request) -> None:
        """Sliding groups give back the blocks before their windows (oldest first: the
        least recent to be evicted, when cached), naming the null block there."""
        tables = request.block_tables
        for group, first in enumerate(self._kept_from(request.num_computed)):
            table = tables[group]
            start = first
            while start > 0 and table[start - 1] != NULL_BLOCK:
                start -= 1
            if start < first:
                self.device_pool.free(table[start:first])
                # A new list, not a write into the old one (see `_copy_on_write`).
                tables = self._with_table(
                    request, group, [*table[:start], *[NULL_BLOCK] * (first - start), *table[first:]]
                )

    @staticmethod
    def _with_table(request: Request, group: int, table: list[int]) -> tuple[list[int], ...]:
        tables = request.block_tables
        request.block_tables = (*tables[:group], table, *tables[group + 1 :])
        return request.block_tables

    def writes_in_place(self, request: Request) -> bool:
        """The next token goes into a block `request` already holds and may write: nothing
        to allocate or copy (most decode steps; kept cheap, it runs for each of them). The
        first group answers for all: they share or copy that block together."""
        num_computed = request.num_computed
        if not num_computed % self.block_size:
            return False
        block = request.block_tables[0][num_computed // self.block_size]
        return self.device_pool.holders(block) == 1 and self.device_pool.address(block) is None

    def shares_next_block(self, request: Request) -> bool:
        """The block `request` writes next is one it may not write: held by another request,
        or registered (a choice recomputing the prompt's last token, when it ends a block)."""
        return self._shared_next(request) > 0

    def _shared_next(self, request: Request) -> int:
        """The groups whose next block `request` may not write."""
        index = request.num_computed // self.block_size
        pool = self.device_pool
        return sum(
            1
            for table in request.block_tables
            if index < len(table) and (pool.holders(table[index]) > 1 or pool.address(table[index]) is not None)
        )

    def _copy_on_write(self, request: Request, plan: StepPlan) -> None:
        index = request.num_computed // self.block_size
        pool = self.device_pool
        for group, table in enumerate(request.block_tables):
            shared = table[index]
            if pool.holders(shared) == 1 and pool.address(shared) is None:
                continue
            own = pool.allocate()
            plan.copies.append((shared, own))
            pool.free([shared])
            # A new list, not a write into the old one: block lists are only ever appended to,
            # which lets the runner keep their block tables across steps.
            self._with_table(request, group, [*table[:index], own, *table[index + 1 :]])

    def share_prompt(self, lead: Request, fork: Request) -> None:
        """`fork` holds the blocks of `lead`'s prompt before its last token, with it."""
        shared_blocks = blocks_needed(lead.num_prompt_tokens - 1, self.block_size)
        tables = []
        for table in lead.block_tables:
            shared = table[:shared_blocks]
            for block in self._real(shared):
                self.device_pool.fork(block)
            tables.append(list(shared))
        fork.block_tables = tuple(tables)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the blocks of `request` past its first `num_tokens` tokens (rejected drafts')."""
        keep = blocks_needed(num_tokens, self.block_size)
        for group, table in enumerate(request.block_tables):
            if len(table) > keep:
                self.device_pool.free(reversed(table[keep:]))
                self._with_table(request, group, table[:keep])  # a new list: block lists only grow

    def release(self, request: Request, plan: StepPlan | None = None) -> None:
        """Free `request`'s device blocks, and drop the plan's copies on write into them."""
        tables = request.block_tables
        if plan is not None and plan.copies:
            plan.copies = [(shared, own) for shared, own in plan.copies if not any(own in t for t in tables)]
        for table in tables:
            # Last block first (see the module doc).
            self.device_pool.free(reversed(self._real(table)))
        request.block_tables = tuple([] for _ in self.windows)

    def free(self, request: Request) -> None:
        """Free every block `request` holds, on the device and in the host tier."""
        self.release(request)
        if any(request.host_block_tables):
            for table in request.host_block_tables:
                self._host.free(table)
        request.host_block_tables = ()

    # -- swaps -----------------------------------------------------------------------

    def swap_out(self, request: Request, plan: StepPlan) -> bool:
        """Plan copying `request`'s computed blocks to the host tier (its device blocks are
        still to be released). False when the host tier has no room, or one of its blocks
        is a copy on write of this step, which holds nothing yet."""
        self._leave_windows(request)
        computed_blocks = blocks_needed(request.num_computed, self.block_size)
        computed = [self._real(table[:computed_blocks]) for table in request.block_tables]
        host = self.host_pool
        if (
            not any(computed)
            or host is None
            or host.num_free < sum(map(len, computed))
            or any(own in table for _, own in plan.copies for table in request.block_tables)
        ):
            return False
        request.host_block_tables = tuple([host.allocate() for _ in table] for table in computed)
        for table, host_table in zip(computed, request.host_block_tables):
            plan.swap_out.extend(zip(table, host_table))
        return True

    def swap_in(self, request: Request, plan: StepPlan) -> None:
        """Plan copying a swapped-out request's blocks back into new device blocks (after a
        window's null blocks, where it had left them)."""
        computed_blocks = blocks_needed(request.num_computed, self.block_size)
        tables = []
        for host_table in request.host_block_tables:
            device_table = [self.device_pool.allocate() for _ in host_table]
            plan.swap_in.extend(zip(host_table, device_table))
            tables.append([NULL_BLOCK] * (computed_blocks - len(host_table)) + device_table)
        request.block_tables = tuple(tables)
        request.host_block_tables = ()  # freed by `copies_done`, once they have been read

    def copies_done(self, plan: StepPlan, copied: bool = True) -> None:
        """The runner has made the plan's copies (or failed to: `copied` False): the host
        blocks they read or wrote are free again. Blocks whose copy may have failed lose
        their content address."""
        if not copied:
            for _, device_block in plan.fetch:
                self.device_pool.unregister(device_block)
            for _, host_block in plan.offload:
                self._host.unregister(host_block)
        # A fetch lists a chain head first: free it last block first (as `release` does), so
        # the host tier evicts its tail first. Offloads are already in eviction order.
        for pairs, host_side in ((plan.swap_in, 0), (plan.fetch[::-1], 0), (plan.offload, 1)):
            if pairs:
                self._host.free([pair[host_side] for pair in pairs])

    # -- handoffs (disaggregated serving, `workers/kv_handoff.py`) ---------------------

    def register_prompt_tail(self, request: Request) -> None:
        """Cache the partial last block of `request`'s prompt under its tail address, as
        it ends with `handoff` (its full blocks are cached already), so it is staged too."""
        tail = request.num_prompt_tokens % self.block_size
        index = request.num_prompt_tokens // self.block_size
        if self.cache_salt is None or not tail or request.num_computed < request.num_prompt_tokens:
            return
        if not self.moves_handoffs:
            raise ValueError("prompt handoffs move the K/V of caches whose layers all hold the whole context")
        table = request.block_tables[0]
        if index < len(table):
            self.device_pool.register(table[index], self.tail_address(request, request.num_prompt_tokens))

    @property
    def moves_handoffs(self) -> bool:
        """Handoffs move one block table's K/V (`workers/kv_handoff.py`): a cache of one
        group, with no window."""
        return self.num_groups == 1 and not self._windowed
