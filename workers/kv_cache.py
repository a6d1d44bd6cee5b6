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

**Copy on write.** A block held by more than one request, or registered under an
address, is never written. Before a request writes into such a block (a parallel choice
recomputing the prompt's last token in the block it shares with its lead), the block is
copied into one of its own (the plan's `copies`, device to device).
"""

from __future__ import annotations

from typing import NamedTuple

from workers.block_pool import BlockPool, block_hash, blocks_needed
from workers.plan import CacheStats, StepPlan
from workers.request import Request


class CachedPrefix(NamedTuple):
    """What a waiting request would start from (`KVCacheManager.find_prefix`)."""

    # Block by block: a device block, or an (address, host block) pair to copy back.
    blocks: list[int | tuple[bytes, int]]
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
    ) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool  # None: no host tier, preempted requests recompute
        self.block_size = block_size
        self.cache_salt = cache_salt  # None: no prefix caching
        self._queried = self._device_hits = self._host_hits = self._offloaded = 0  # this step's

    @property
    def capacity(self) -> int:
        """Tokens the device pool holds: more than that, a request could never run."""
        return self.device_pool.num_blocks * self.block_size

    # -- a request's blocks ----------------------------------------------------------

    def room(self, request: Request, keep_free: int = 0) -> int:
        """Tokens `request` can write from `num_computed` on: the rest of its own blocks and
        the free blocks beyond `keep_free` (less one for a copy on write, when its next
        block is shared)."""
        free = self.device_pool.num_free - self.shares_next_block(request)
        if free < 0:
            return 0  # its next block must be copied, and no block is free to copy it into
        own = len(request.block_ids) * self.block_size - request.num_computed
        return own + max(0, free - keep_free) * self.block_size

    def can_hold(self, num_tokens: int) -> bool:
        """The free device blocks hold `num_tokens` tokens (of a request holding none)."""
        return blocks_needed(num_tokens, self.block_size) <= self.device_pool.num_free

    def allocate(self, request: Request, num_tokens: int, plan: StepPlan) -> bool:
        """Give `request` the blocks for its first `num_tokens` tokens, copying its next
        block first if it may not write it. False, changing nothing, when too few are free."""
        copy = self.shares_next_block(request)
        need = blocks_needed(num_tokens, self.block_size) - len(request.block_ids) + copy
        if need > self.device_pool.num_free:
            return False
        if copy:
            self._copy_on_write(request, plan)
        for _ in range(blocks_needed(num_tokens, self.block_size) - len(request.block_ids)):
            request.block_ids.append(self.device_pool.allocate())
        return True

    def writes_in_place(self, request: Request) -> bool:
        """The next token goes into a block `request` already holds and may write: nothing
        to allocate or copy (most decode steps; kept cheap, it runs for each of them)."""
        num_computed = request.num_computed
        if not num_computed % self.block_size:
            return False
        block = request.block_ids[num_computed // self.block_size]
        return self.device_pool.holders(block) == 1 and self.device_pool.address(block) is None

    def shares_next_block(self, request: Request) -> bool:
        """The block `request` writes next is one it may not write: held by another request,
        or registered (a choice recomputing the prompt's last token, when it ends a block)."""
        index = request.num_computed // self.block_size
        if index >= len(request.block_ids):
            return False
        block = request.block_ids[index]
        return self.device_pool.holders(block) > 1 or self.device_pool.address(block) is not None

    def _copy_on_write(self, request: Request, plan: StepPlan) -> None:
        index = request.num_computed // self.block_size
        shared = request.block_ids[index]
        own = self.device_pool.allocate()
        plan.copies.append((shared, own))
        self.device_pool.free([shared])
        # A new list, not a write into the old one: block lists are only ever appended to,
        # which lets the runner keep their block tables across steps.
        request.block_ids = [*request.block_ids[:index], own, *request.block_ids[index + 1 :]]

    def share_prompt(self, lead: Request, fork: Request) -> None:
        """`fork` holds the blocks of `lead`'s prompt before its last token, with it."""
        shared = lead.block_ids[: blocks_needed(lead.num_prompt_tokens - 1, self.block_size)]
        for block in shared:
            self.device_pool.fork(block)
        fork.block_ids = list(shared)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the blocks of `request` past its first `num_tokens` tokens (rejected drafts')."""
        keep = blocks_needed(num_tokens, self.block_size)
        if len(request.block_ids) > keep:
            self.device_pool.free(reversed(request.block_ids[keep:]))
            request.block_ids = request.block_ids[:keep]  # a new list: block lists only grow

    def release(self, request: Request, plan: StepPlan | None = None) -> None:
        """Free `request`'s device blocks, and drop the plan's copies on write into them."""
        if plan is not None and plan.copies:
            plan.copies = [(shared, own) for shared, own in plan.copies if own not in request.block_ids]
        if request.block_ids:
            self.device_pool.free(reversed(request.block_ids))  # last block first (see the module doc)
            request.block_ids = []

    def free(self, request: Request) -> None:
        """Free every block `request` holds, on the device and in the host tier."""
        self.release(request)
        if request.host_block_ids:
            self._host.free(request.host_block_ids)
            request.host_block_ids = []

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
        computed = request.block_ids[: blocks_needed(request.num_computed, self.block_size)]
        host = self.host_pool
        if (
            not computed
            or host is None
            or host.num_free < len(computed)
            or any(own in request.block_ids for _, own in plan.copies)
        ):
            return False
        request.host_block_ids = [host.allocate() for _ in computed]
        plan.swap_out.extend(zip(computed, request.host_block_ids))
        return True

    def swap_in(self, request: Request, plan: StepPlan) -> None:
        """Plan copying a swapped-out request's blocks back into new device blocks."""
        request.block_ids = [self.device_pool.allocate() for _ in request.host_block_ids]
        plan.swap_in.extend(zip(request.host_block_ids, request.block_ids))
        request.host_block_ids = []  # freed by `copies_done`, once they have been read

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
        (that one is always computed, for its logits), and the room it would leave."""
        blocks: list[int | tuple[bytes, int]] = []
        device = self.device_pool
        num_tokens = 0
        if self.cache_salt is not None:
            num_blocks = (request.num_tokens - 1) // self.block_size
            for address in self._addresses(request, num_blocks)[:num_blocks]:
                block = self._lookup(address)
                if block is None:
                    break
                blocks.append(block)
            if len(blocks) == num_blocks and (request.num_tokens - 1) % self.block_size:  # a whole chain: its tail?
                tail = self._lookup(self._tail_address(request, request.num_tokens - 1))
                if tail is not None:
                    blocks.append(tail)
            num_tokens = min(len(blocks) * self.block_size, request.num_tokens - 1)
        # Once taken, shared cached blocks stop being free, and each host hit takes a new
        # device block to be copied into.
        taken = sum(1 for block in blocks if not isinstance(block, int) or device.holders(block) == 0)
        return CachedPrefix(blocks, num_tokens, max(device.num_free - taken, 0) * self.block_size)

    def _lookup(self, address: bytes) -> int | tuple[bytes, int] | None:
        """The device block cached under `address`, else (address, host block), else None."""
        block = self.device_pool.lookup(address)
        if block is not None:
            return block
        host_block = self.host_pool.lookup(address) if self.host_pool is not None else None
        return None if host_block is None else (address, host_block)

    def take_prefix(self, request: Request, prefix: CachedPrefix, plan: StepPlan) -> None:
        """`request` (holding nothing) holds `prefix`'s blocks, host hits copied back (the
        plan's `fetch`); counted in this step's `stats`."""
        on_device = [block for block in prefix.blocks if isinstance(block, int)]
        if self.cache_salt is not None:
            self._queried += request.num_tokens
            host_hits = (len(prefix.blocks) - len(on_device)) * self.block_size
            if prefix.blocks and not isinstance(prefix.blocks[-1], int):  # its tail may be partial
                host_hits -= len(prefix.blocks) * self.block_size - prefix.num_tokens
            self._host_hits += host_hits
            self._device_hits += prefix.num_tokens - host_hits
        for block in on_device:  # first, so that no allocation below evicts them
            self.device_pool.share(block)
        request.block_ids = []
        for entry in prefix.blocks:
            if isinstance(entry, int):
                request.block_ids.append(entry)
                continue
            address, host_block = entry
            device_block = self.device_pool.allocate()
            self._host.share(host_block)  # held until the copy is made
            self.device_pool.register(device_block, address)
            plan.fetch.append((host_block, device_block))
            request.block_ids.append(device_block)

    def register_full_blocks(self, request: Request, start: int, end: int) -> None:
        """Give the blocks that tokens [start, end) filled their content addresses (when
        caching)."""
        first, last = start // self.block_size, end // self.block_size
        if last > first and self.cache_salt is not None:
            addresses = self._addresses(request, last)
            for index in range(first, last):
                self.device_pool.register(request.block_ids[index], addresses[index])

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
            parent = addresses[-1] if addresses else b""
            addresses.append(block_hash(parent, request.token_slice(start, start + size), self._salt))
        return addresses

    def _tail_address(self, request: Request, num_tokens: int) -> bytes:
        """The address of the partial block holding `request`'s tokens up to `num_tokens`
        (not a multiple of the block size) after its full blocks."""
        full = num_tokens // self.block_size
        parent = self._addresses(request, full)[full - 1] if full else b""
        return block_hash(parent, request.token_slice(full * self.block_size, num_tokens), self._salt)

    # -- handoffs (disaggregated serving, `workers/kv_handoff.py`) ---------------------

    def register_prompt_tail(self, request: Request) -> None:
        """Cache the partial last block of `request`'s prompt under its tail address, as
        it ends with `handoff` (its full blocks are cached already), so it is staged too."""
        tail = request.num_prompt_tokens % self.block_size
        index = request.num_prompt_tokens // self.block_size
        if self.cache_salt is None or not tail or request.num_computed < request.num_prompt_tokens:
            return
        if index < len(request.block_ids):
            self.device_pool.register(request.block_ids[index], self._tail_address(request, request.num_prompt_tokens))

    def cached_prompt_blocks(self, request: Request) -> tuple[list[int], int]:
        """The device blocks holding `request`'s prompt, found by their addresses (it has
        finished: they are cached, not held) up to the first missing, and the tokens they
        hold: its full blocks, then its tail (`register_prompt_tail`)."""
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
