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

**Prefix caching** (on when the manager has a cache salt). A request admitted from the
waiting queue (new, or preempted to recompute) first takes its longest cached prefix
(`find_prefix`, `take_prefix`): full blocks whose content address matches its tokens',
found in the device pool (shared as they are) or else in the host pool (copied back
into a new device block: the plan's `fetch`), and starts computing after them. It always
computes at least its last token, so a prompt that is all cached blocks recomputes its
last block rather than write into a shared one. After each step every block that the
step filled is registered under its address (`register_full_blocks`). Cached device
blocks evicted to make room are copied to the host pool while it has room (the plan's
`offload`, `plan_offloads`), so a later request finds them there. The host pool holds
swapped-out requests' blocks (never evicted) and cached ones (evicted least recently
used first).

**Prompt tails.** A prompt handed from a prefill worker to a decode worker
(`workers/kv_handoff.py`) also moves its last, partial block: it is cached under an
address of its own (the chain's, then exactly its tokens), on the prefill side when the
request ends with `handoff` (`register_prompt_tail`) and on the decode side as it is
placed. `find_prefix` looks for one only after a fully cached chain, for exactly the
tokens before the request's last, so a decode worker computes just the first token
after the prompt; that write goes into a copy of the tail block (copy on write, below).

**Copies.** Swaps, offloads and fetches are listed in the plan as (from, to) block
pairs and made before the step's forward: device to host first (swap-outs, then
offloads), then host to device (swap-ins, then fetches), so a block evicted and reused
in one step is saved before it is overwritten. The host blocks that copies read or
wrote are freed, or kept registered, when the runner reports them made (`copies_done`).

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

**Copy on write.** A block held by more than one request, or registered under an
address, is never written. Before a request writes into such a block (a parallel choice
recomputing the prompt's last token in the block it shares with its lead), the block is
copied into one of its own (the plan's `copies`, device to device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from workers.block_pool import NULL_BLOCK, BlockPool, block_hash, blocks_needed
from workers.plan import CacheStats, StepPlan
from workers.request import Request

# A cached block: on the device, or (address, host block) to copy back.
CachedBlock = int | tuple[bytes, int]


class CachedPrefix(NamedTuple):
    """What a waiting request would start from (`KVCacheManager.find_prefix`)."""

    # Per group, block by block: a cached block, or `NULL_BLOCK` before a window's first.
    blocks: tuple[list[CachedBlock], ...]
    num_tokens: int  # the tokens those blocks hold (the last block may be a prompt tail)
    free_tokens: int  # room left in the free device blocks once the prefix is taken


class AdoptedBlocks(NamedTuple):
    """Blocks taken for K/V computed elsewhere (`KVCacheManager.adopt_blocks`): (index of
    the block in the request, block id) pairs, per tier."""

    device: list[tuple[int, int]]
    host: list[tuple[int, int]]


class KVCacheManager:
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

    @property
    def _host(self) -> BlockPool:
        """The host tier, on the paths that run only with one (host blocks are held)."""
        if self.host_pool is None:
            raise RuntimeError("no host tier")
        return self.host_pool

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

    # -- the prefix cache ------------------------------------------------------------

    def find_prefix(self, request: Request) -> CachedPrefix:
        """`request`'s longest cached prefix, at most the full blocks before its last token
        (that one is always computed, for its logits), and the room it would leave: every
        full group's blocks from the start, and each sliding group's from its window's
        first block on."""
        blocks: tuple[list[CachedBlock], ...] = tuple([] for _ in self.windows)
        num_tokens = 0
        if self.cache_salt is not None:
            num_blocks = (request.num_tokens - 1) // self.block_size
            blocks = tuple(self._find_blocks(self._addresses(request, num_blocks)[:num_blocks]))
            if (
                self.num_groups == 1
                and not self._windowed
                and len(blocks[0]) == num_blocks
                and (request.num_tokens - 1) % self.block_size
            ):  # a whole chain: its tail?
                tail = self._lookup(self._tail_address(request, request.num_tokens - 1), 0)
                if tail is not None:
                    blocks[0].append(tail)
            num_tokens = min(len(blocks[0]) * self.block_size, request.num_tokens - 1)
        # Once taken, shared cached blocks stop being free, and each host hit takes a new
        # device block to be copied into.
        device = self.device_pool
        entries = [entry for group in blocks for entry in group if entry != NULL_BLOCK or not self._windowed]
        taken = sum(1 for entry in entries if not isinstance(entry, int) or device.holders(entry) == 0)
        return CachedPrefix(blocks, num_tokens, self._room(num_tokens, len(entries), max(device.num_free - taken, 0)))

    def _find_blocks(self, addresses: list[bytes]) -> list[list[CachedBlock]]:
        """Per group, the cached blocks of the longest run of `addresses` that every group
        can start after (`NULL_BLOCK` where a window does not reach back); all as long."""
        full = [group for group, window in enumerate(self.windows) if window is None]
        length = len(addresses)
        found: list[list[CachedBlock]] = [[] for _ in self.windows]
        for index, address in enumerate(addresses):  # the full groups' common run from the start
            hits = [self._lookup(address, group) for group in full]
            if any(hit is None for hit in hits):
                length = index
                break
            for group, hit in zip(full, hits):
                found[group].append(hit)  # type: ignore[arg-type]  # None was ruled out above
        sliding = [group for group, window in enumerate(self.windows) if window is not None]
        if sliding:
            # The longest run a window reaches back over: at most `length` blocks, its window's
            # blocks all cached in every sliding group.
            cached = {group: [self._lookup(address, group) for address in addresses[:length]] for group in sliding}
            while length and any(
                None in cached[group][self._first_kept(self.windows[group], length * self.block_size) : length]
                for group in sliding
            ):
                length -= 1
            for group in sliding:
                first = self._first_kept(self.windows[group], length * self.block_size)
                window = [entry for entry in cached[group][first:length] if entry is not None]
                found[group] = [*[NULL_BLOCK] * first, *window]
        return [group[:length] for group in found]

    def _address(self, address: bytes, group: int) -> bytes:
        """The address of a chain's block in `group`'s layers (the first group's is the chain's)."""
        return address if group == 0 else address + group.to_bytes(2, "little")

    def _lookup(self, address: bytes, group: int) -> CachedBlock | None:
        """The device block cached under `address` in `group`, else (address, host block), else None."""
        address = self._address(address, group)
        block = self.device_pool.lookup(address)
        if block is not None:
            return block
        host_block = self.host_pool.lookup(address) if self.host_pool is not None else None
        return None if host_block is None else (address, host_block)

    def take_prefix(self, request: Request, prefix: CachedPrefix, plan: StepPlan) -> None:
        """`request` (holding nothing) holds `prefix`'s blocks, host hits copied back (the
        plan's `fetch`); counted in this step's `stats` by its first full group (else its
        first)."""
        if self.cache_salt is not None:
            counted = prefix.blocks[self.windows.index(None) if None in self.windows else 0]
            self._queried += request.num_tokens
            host_hits = sum(not isinstance(entry, int) for entry in counted) * self.block_size
            if counted and not isinstance(counted[-1], int):  # its tail may be partial
                host_hits -= len(counted) * self.block_size - prefix.num_tokens
            self._host_hits += host_hits
            self._device_hits += prefix.num_tokens - host_hits
        for group in prefix.blocks:  # first, so that no allocation below evicts them
            for entry in group:
                if isinstance(entry, int) and (entry != NULL_BLOCK or not self._windowed):
                    self.device_pool.share(entry)
        tables = []
        for group in prefix.blocks:
            table = []
            for entry in group:
                if isinstance(entry, int):
                    table.append(entry)
                    continue
                address, host_block = entry
                device_block = self.device_pool.allocate()
                self._host.share(host_block)  # held until the copy is made
                self.device_pool.register(device_block, address)
                plan.fetch.append((host_block, device_block))
                table.append(device_block)
            tables.append(table)
        request.block_tables = tuple(tables)

    def register_full_blocks(self, request: Request, start: int, end: int) -> None:
        """Give the blocks that tokens [start, end) filled their content addresses (when
        caching)."""
        first, last = start // self.block_size, end // self.block_size
        if last > first and self.cache_salt is not None:
            addresses = self._addresses(request, last)
            for group, table in enumerate(request.block_tables):
                for index in range(first, last):
                    if table[index] != NULL_BLOCK or not self._windowed:
                        self.device_pool.register(table[index], self._address(addresses[index], group))

    @property
    def _salt(self) -> bytes:
        """The cache salt, on the paths that run only with prefix caching on."""
        if self.cache_salt is None:
            raise RuntimeError("prefix caching is off")
        return self.cache_salt

    def _addresses(self, request: Request, num_blocks: int) -> list[bytes]:
        """`request`'s content addresses, computed up to its first `num_blocks` blocks (all
        full); the list may hold more."""
        addresses = request.block_addresses
        size = self.block_size
        while len(addresses) < num_blocks:
            start = len(addresses) * size
            parent = addresses[-1] if addresses else request.cache_root  # the chain starts at its adapter
            addresses.append(block_hash(parent, request.token_slice(start, start + size), self._salt))
        return addresses

    def _tail_address(self, request: Request, num_tokens: int) -> bytes:
        """The address of the partial block holding `request`'s tokens up to `num_tokens`
        (not a multiple of the block size) after its full blocks."""
        full = num_tokens // self.block_size
        parent = self._addresses(request, full)[full - 1] if full else request.cache_root
        return block_hash(parent, request.token_slice(full * self.block_size, num_tokens), self._salt)

    # -- handoffs (disaggregated serving, `workers/kv_handoff.py`) ---------------------

    def register_prompt_tail(self, request: Request) -> None:
        """Cache the partial last block of `request`'s prompt under its tail address, as
        it ends with `handoff` (its full blocks are cached already), so it is staged too."""
        tail = request.num_prompt_tokens % self.block_size
        index = request.num_prompt_tokens // self.block_size
        if self.cache_salt is None or not tail or request.num_computed < request.num_prompt_tokens:
            return
        self._check_handoffs()
        table = request.block_tables[0]
        if index < len(table):
            self.device_pool.register(table[index], self._tail_address(request, request.num_prompt_tokens))

    def _check_handoffs(self) -> None:
        """Handoffs move one block table's K/V: a cache of one group, with no window."""
        if self.num_groups != 1 or self._windowed:
            raise ValueError("prompt handoffs move the K/V of caches whose layers all hold the whole context")

    def cached_prompt_blocks(self, request: Request) -> tuple[list[int], int]:
        """The device blocks holding `request`'s prompt, found by their addresses (it has
        finished: they are cached, not held) up to the first missing, and the tokens they
        hold: its full blocks, then its tail (`register_prompt_tail`)."""
        self._check_handoffs()
        if self.cache_salt is None:
            return [], 0
        num_prompt = request.num_prompt_tokens
        addresses = self._addresses(request, num_prompt // self.block_size)[: num_prompt // self.block_size]
        if num_prompt % self.block_size:
            addresses.append(self._tail_address(request, num_prompt))
        blocks = []
        for address in addresses:
            block = self.device_pool.lookup(address)
            if block is None:
                break
            blocks.append(block)
        return blocks, min(len(blocks) * self.block_size, num_prompt)

    def adopt_blocks(self, request: Request, num_tokens: int) -> AdoptedBlocks:
        """Blocks, registered under `request`'s addresses, for the blocks of its first
        `num_tokens` tokens (full blocks, then a tail) that neither tier caches yet, for
        the caller to fill and then hand back with `adopted_filled` (they stay cached).
        Empty device blocks first, so the request finds them where it runs; never a
        cached device block, whose offload to the host tier is planned only with the next
        step (it would be overwritten before it is saved); then the host tier's. Stops
        when neither has room; nothing without prefix caching."""
        self._check_handoffs()
        adopted = AdoptedBlocks([], [])
        if self.cache_salt is None:
            return adopted
        device, host = self.device_pool, self.host_pool
        num_blocks = num_tokens // self.block_size
        addresses = self._addresses(request, num_blocks)[:num_blocks]
        if num_tokens % self.block_size:
            addresses.append(self._tail_address(request, num_tokens))
        for index, address in enumerate(addresses):
            if device.lookup(address) is not None or (host is not None and host.lookup(address) is not None):
                continue
            if device.num_empty:
                pool, pairs = device, adopted.device
            elif host is not None and host.num_free:
                pool, pairs = host, adopted.host
            else:
                break
            block = pool.allocate()
            pool.register(block, address)
            pairs.append((index, block))
        if host is not None:
            host.take_evicted()  # the host tier is the last: what it evicts is gone
        return adopted

    def adopted_filled(self, adopted: AdoptedBlocks) -> None:
        """The blocks `adopt_blocks` gave hold their K/V: free them, cached (a chain's tail
        is evicted first)."""
        self.device_pool.free(block for _, block in reversed(adopted.device))
        if adopted.host:
            self._host.free(block for _, block in reversed(adopted.host))

    def plan_offloads(self, plan: StepPlan) -> None:
        """Copy the cached device blocks this plan evicted to the host tier, while it has
        blocks that are free or only cached (never a swapped-out request's)."""
        evicted = self.device_pool.take_evicted()
        host = self.host_pool
        if host is None:
            return
        host.take_evicted()  # the host tier is the last: what it evicts is gone
        for address, device_block in evicted:
            if host.lookup(address) is not None or not host.num_free:
                continue
            host_block = host.allocate()  # held until the copy is made
            host.register(host_block, address)
            plan.offload.append((device_block, host_block))
        self._offloaded += len(plan.offload)

    # -- statistics ------------------------------------------------------------------

    def start_step(self) -> None:
        """A new step is planned: `stats` counts its admissions and offloads."""
        self._queried = self._device_hits = self._host_hits = self._offloaded = 0

    def stats(self) -> CacheStats:
        """The prefix cache's figures for the last step planned."""
        host = self.host_pool
        return CacheStats(
            self._queried,
            self._device_hits,
            self._host_hits,
            self._offloaded,
            self.device_pool.num_evictions,
            host.num_evictions if host else 0,
            self.device_pool.num_cached,
            host.num_cached if host else 0,
        )
