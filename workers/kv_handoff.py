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

import torch

from workers.kv_cache import KVCacheManager
from workers.request import Request


@torch.inference_mode()
def stage(kv_cache: KVCacheManager, device_blocks: torch.Tensor, request: Request, arena) -> int:
    """Copy `request`'s cached prompt blocks into an arena slot named by its request id;
    returns how many prompt tokens the slot holds (0: none staged)."""
    blocks, num_tokens = kv_cache.cached_prompt_blocks(request)
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
    adopted = kv_cache.adopt_blocks(request, num_tokens)
    _copy_into(device_blocks, adopted.device, prompt_kv)
    _copy_into(host_blocks, adopted.host, prompt_kv)
    kv_cache.adopted_filled(adopted)
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
