"""The prefix cache over the KV block tables: content addresses, lookups in both tiers,
and the host tier's copies.

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
"""

from __future__ import annotations

from typing import NamedTuple

from workers.block_pool import NULL_BLOCK, block_hash
from workers.kv_tables import KVTables
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


class PrefixCache(KVTables):
    def find_prefix(self, request: Request) -> CachedPrefix:
        """`request`'s longest cached prefix, at most the full blocks before its last token
        (that one is always computed, for its logits), and the room it would leave: every
        full group's blocks from the start, and each sliding group's from its window's
        first block on."""
        blocks: tuple[list[CachedBlock], ...] = tuple([] for _ in self.windows)
        num_tokens = 0
        if self.cache_salt is not None:
            num_blocks = (request.num_tokens - 1) // self.block_size
            blocks = tuple(self._find_blocks(self.addresses(request, num_blocks)[:num_blocks]))
            if (
                self.num_groups == 1
                and not self._windowed
                and len(blocks[0]) == num_blocks
                and (request.num_tokens - 1) % self.block_size
            ):  # a whole chain: its tail?
                tail = self._lookup(self.tail_address(request, request.num_tokens - 1), 0)
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
            addresses = self.addresses(request, last)
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

    def addresses(self, request: Request, num_blocks: int) -> list[bytes]:
        """`request`'s content addresses, computed up to its first `num_blocks` blocks (all
        full); the list may hold more."""
        addresses = request.block_addresses
        size = self.block_size
        while len(addresses) < num_blocks:
            start = len(addresses) * size
            parent = addresses[-1] if addresses else request.cache_root  # the chain starts at its adapter
            addresses.append(block_hash(parent, request.token_slice(start, start + size), self._salt))
        return addresses

    def tail_address(self, request: Request, num_tokens: int) -> bytes:
        """The address of the partial block holding `request`'s tokens up to `num_tokens`
        (not a multiple of the block size) after its full blocks."""
        full = num_tokens // self.block_size
        parent = self.addresses(request, full)[full - 1] if full else request.cache_root
        return block_hash(parent, request.token_slice(full * self.block_size, num_tokens), self._salt)

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
