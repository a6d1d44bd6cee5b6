"""A prompt's K/V handed from a prefill worker to a decode worker (disaggregated serving).

**Staging** (prefill side). A request that finishes with `handoff` still has its
prompt's blocks in the device pool, cached under their content addresses: the step that
computed them registered the full ones, finishing registered the partial last one (its
tail, `KVCacheManager.register_prompt_tail`) and freed them all. `stage` gathers them,
in order, into one contiguous slot of the handoff arena (`gpu/kv_transfer.py`), one copy
across every layer, before the next step can reuse them. From then on the slot holds
them, not the pool, until the decode worker confirms its read or the hold times out.

**Placing** (decode side). `place` copies the K/V read from the prefill worker straight
into empty blocks of the device pool, as cached blocks under content addresses computed
from the request's own tokens with this engine's salt; what finds no empty device block
goes to the host tier. The request is then admitted like any other: the prefix cache
finds its whole prompt, tail included (on the device: no copy in the step that admits
it), and only the first token after it is computed, as a decode. Pools without room, or a
prompt already cached, simply place fewer blocks: those are computed or found instead.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from workers.block_pool import BlockPool
from workers.kv_cache import KVCacheManager
from workers.request import Request


@torch.inference_mode()
def stage(kv_cache: KVCacheManager, device_blocks: torch.Tensor, request: Request, arena) -> int:
    """Copy `request`'s cached prompt blocks into an arena slot named by its request id;
    returns how many prompt tokens the slot holds (0: none staged)."""
    blocks, num_tokens = cached_prompt_blocks(kv_cache, request)
    if not blocks:
        return 0
    shape = (*device_blocks.shape[:2], len(blocks), *device_blocks.shape[3:])
    slot = arena.reserve(request.request_id, shape, device_blocks.dtype, time.monotonic())
    if slot is None:  # the arena is full: the decode side computes the prompt again
        return 0
    ids = torch.tensor(blocks, dtype=torch.long, device=device_blocks.device)
    torch.index_select(device_blocks, 2, ids, out=slot)
    return num_tokens


@torch.inference_mode()
def place(
    kv_cache: KVCacheManager,
    device_blocks: torch.Tensor,
    host_blocks: torch.Tensor | None,
    request: Request,
    prompt_kv: torch.Tensor,
) -> int:
    """Put `prompt_kv` (the K/V of `request`'s first blocks: its prompt's, the last one
    partial when the prompt ends inside it) into the pools as cached blocks; returns how
    many blocks were written."""
    expected = (*device_blocks.shape[:2], prompt_kv.shape[2], *device_blocks.shape[3:])
    if tuple(prompt_kv.shape) != expected or prompt_kv.dtype != device_blocks.dtype:
        raise ValueError(f"prompt K/V shaped {tuple(prompt_kv.shape)} {prompt_kv.dtype}, this pool's are {expected}")
    # The blocks stop at the prompt's end; a prefill worker that staged full blocks only
    # sends fewer.
    num_tokens = min(prompt_kv.shape[2] * kv_cache.block_size, request.num_prompt_tokens, request.num_tokens - 1)
    adopted = adopt_blocks(kv_cache, request, num_tokens)
    _copy_into(device_blocks, adopted.device, prompt_kv)
    _copy_into(host_blocks, adopted.host, prompt_kv)
    adopted_filled(kv_cache, adopted)
    return len(adopted.device) + len(adopted.host)


def _copy_into(pool: torch.Tensor | None, pairs: list[tuple[int, int]], prompt_kv: torch.Tensor) -> None:
    """Block `index` of `prompt_kv` into block `block` of `pool`, for each (index, block)."""
    if not pairs:
        return
    if pool is None:
        raise ValueError("blocks to fill in a pool that does not exist")
    indices = [index for index, _ in pairs]
    if indices == list(range(indices[0], indices[0] + len(indices))):  # the usual case: no gather
        source = prompt_kv.narrow(2, indices[0], len(indices))
    else:
        source = prompt_kv.index_select(2, torch.tensor(indices, dtype=torch.long))
    ids = torch.tensor([block for _, block in pairs], dtype=torch.long, device=pool.device)
    pool.index_copy_(2, ids, source.to(pool.device))


class AdoptedBlocks(NamedTuple):
    """Blocks taken for K/V computed elsewhere (`adopt_blocks`): (index of
    the block in the request, block id) pairs, per tier."""

    device: list[tuple[int, int]]
    host: list[tuple[int, int]]


def cached_prompt_blocks(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """The device blocks holding `request`'s prompt, found by their addresses (it has
    finished: they are cached, not held) up to the first missing, and the tokens they
    hold: its full blocks, then its tail (`KVCacheManager.register_prompt_tail`)."""
    _check(kv)
    if kv.cache_salt is None:
        return [], 0
    num_prompt = request.num_prompt_tokens
    addresses = kv.addresses(request, num_prompt // kv.block_size)[: num_prompt // kv.block_size]
    if num_prompt % kv.block_size:
        addresses.append(kv.tail_address(request, num_prompt))
    blocks = []
    for address in addresses:
        block = kv.device_pool.lookup(address)
        if block is None:
            break
        blocks.append(block)
    return blocks, min(len(blocks) * kv.block_size, num_prompt)


def adopt_blocks(kv: KVCacheManager, request: Request, num_tokens: int) -> AdoptedBlocks:
    """Blocks, registered under `request`'s addresses, for the blocks of its first
    `num_tokens` tokens (full blocks, then a tail) that neither tier caches yet, for
    the caller to fill and then hand back with `adopted_filled` (they stay cached).
    Empty device blocks first, so the request finds them where it runs; never a
    cached device block, whose offload to the host tier is planned only with the next
    step (it would be overwritten before it is saved); then the host tier's. Stops
    when neither has room; nothing without prefix caching."""
    _check(kv)
    adopted = AdoptedBlocks([], [])
    if kv.cache_salt is None:
        return adopted
    device, host = kv.device_pool, kv.host_pool
    num_blocks = num_tokens // kv.block_size
    addresses = kv.addresses(request, num_blocks)[:num_blocks]
    if num_tokens % kv.block_size:
        addresses.append(kv.tail_address(request, num_tokens))
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


def adopted_filled(kv: KVCacheManager, adopted: AdoptedBlocks) -> None:
    """The blocks `adopt_blocks` gave hold their K/V: free them, cached (a chain's tail
    is evicted first)."""
    kv.device_pool.free(block for _, block in reversed(adopted.device))
    if adopted.host:
        _host(kv).free(block for _, block in reversed(adopted.host))


def _check(kv: KVCacheManager) -> None:
    if not kv.moves_handoffs:
        raise ValueError("prompt handoffs move the K/V of caches whose layers all hold the whole context")


def _host(kv: KVCacheManager) -> BlockPool:
    """The host tier, where host blocks were adopted (so there is one)."""
    if kv.host_pool is None:
        raise RuntimeError("no host tier")
    return kv.host_pool
