"""Attention steps for checking the CUDA kernels against the torch reference, on the
CPU emulation (`test_kernel_emulation.py`) and on a GPU (`test_gpu_kernels.py`).

A step is a batch of sequences over one paged cache, each with random K/V already in
its (randomly placed, non-contiguous) blocks; the new tokens' queries come as the
transposed view transformers hands over. The reference and the kernels each get their
own copy of the cache, so the cache writes are compared as well.

The oracle is the torch reference in float32 over the same values: in 16-bit dtypes the
reference rounds its softmax probabilities to 16 bits (torch's SDPA does), while the
kernels keep every score and sum in fp32 and round only the output.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from gpu.attention import FULL_ATTENTION, AttentionBackend, LayerAttention, SequenceSlice
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.torch_attention import TorchAttentionBackend

# The sweep: every instantiated dtype, head_dim and block size, and GQA ratios 1, 4, 8.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
BLOCK_SIZES = [16, 32]
GQA_GROUPS = [1, 4, 8]
# The emulation's sweep, where every launch costs (each CUDA thread a host thread): every
# instantiation (dtype, head_dim, block size) once, the GQA ratio (a runtime argument)
# taking each of its values in turn, so every ratio meets every dtype and head_dim.
INSTANTIATIONS = [
    pytest.param(dtype, head_dim, GQA_GROUPS[i % len(GQA_GROUPS)], block_size, id=f"{dtype}-{head_dim}-{block_size}")
    for i, (dtype, head_dim, block_size) in enumerate(itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES))
]

# Tolerances against the reference, by dtype (the kernels accumulate in fp32).
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1.3e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-3, rtol=1.6e-2),
}


@dataclass
class Step:
    sequences: list[SequenceSlice]
    query: torch.Tensor  # [T, heads, head_dim], a transposed view
    key: torch.Tensor  # [T, kv_heads, head_dim]
    value: torch.Tensor
    scale: float
    reference_cache: PagedKVCache
    kernel_cache: PagedKVCache


def make_step(
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    chunks: list[tuple[int, int]],  # (past_len, query_len) per sequence
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 7,
) -> Step:
    generator = torch.Generator().manual_seed(seed)
    shuffle = random.Random(seed)
    needed = [-(-(past + new) // block_size) for past, new in chunks]
    num_blocks = sum(needed) + spare_blocks
    shape = KVShape(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
    reference_cache = PagedKVCache(shape, num_blocks, block_size, torch.float32, device)
    kernel_cache = PagedKVCache(shape, num_blocks, block_size, dtype, device)
    contents = torch.randn(reference_cache.blocks.shape, generator=generator).to(dtype)
    reference_cache.blocks.copy_(contents)
    kernel_cache.blocks.copy_(contents)

    ids = list(range(num_blocks))
    shuffle.shuffle(ids)  # a request's blocks are scattered over the pool
    sequences, start = [], 0
    for (past, new), n in zip(chunks, needed):
        sequences.append(SequenceSlice(start, new, past + new, ids[:n]))
        ids, start = ids[n:], start + new
    heads = num_kv_heads * group
    query = torch.randn(1, heads, start, head_dim, generator=generator).to(dtype).to(device)[0].transpose(0, 1)
    key = torch.randn(start, num_kv_heads, head_dim, generator=generator).to(dtype).to(device)
    value = torch.randn(start, num_kv_heads, head_dim, generator=generator).to(dtype).to(device)
    return Step(sequences, query, key, value, head_dim**-0.5, reference_cache, kernel_cache)


# Layers that attend otherwise than plainly causal (`LayerAttention`): a window shorter
# than most contexts, Gemma 2's softcap, GPT-OSS's sinks, and all three at once.
def layer_cases(num_heads: int) -> dict[str, LayerAttention]:
    sinks = torch.linspace(-1.0, 2.0, num_heads)
    return {
        "window": LayerAttention(window=37),
        "softcap": LayerAttention(softcap=5.0),
        "sinks": LayerAttention(sinks=sinks),
        "all": LayerAttention(window=37, softcap=5.0, sinks=sinks),
    }


def reference_output(step: Step, layer: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
    """The torch reference's attention output for `step`, computed in float32 (it also
    writes the step's K/V into `step.reference_cache`)."""
    reference = TorchAttentionBackend(step.reference_cache)
    sinks = None if layer.sinks is None else layer.sinks.float().to(step.query.device)
    return reference.attend(
        0, step.query.float(), step.key.float(), step.value.float(), step.scale,
        reference.prepare(step.sequences, step.query.shape[0]), layer._replace(sinks=sinks),
    )  # fmt: skip


def check_against_reference(step: Step, backend: AttentionBackend, layer: LayerAttention = FULL_ATTENTION) -> None:
    """`backend` (over `step.kernel_cache`) matches the torch reference: the output and
    the cache after the write."""
    expected, num_tokens = reference_output(step, layer), step.query.shape[0]
    metadata = backend.prepare(step.sequences, num_tokens)
    got = backend.attend(0, step.query, step.key, step.value, step.scale, metadata, layer)
    assert torch.equal(step.kernel_cache.blocks.float(), step.reference_cache.blocks), "the cache writes differ"
    assert got.dtype == step.query.dtype
    torch.testing.assert_close(got.float(), expected, **TOLERANCES[step.query.dtype])


def decode_chunks(context_lens: list[int]) -> list[tuple[int, int]]:
    return [(context - 1, 1) for context in context_lens]


def far_cache(step: Step, base: int) -> tuple[PagedKVCache, list[SequenceSlice]]:
    """The kernels' cache of `step` moved to block ids `base` and up, in a pool of
    `base + num_blocks` blocks (allocated, not zeroed: untouched host pages cost no
    memory), and the sequences with their block tables moved along."""
    small = step.kernel_cache
    cache = PagedKVCache(small.shape, 1, small.block_size, small.blocks.dtype, small.blocks.device)
    cache.num_blocks = base + small.num_blocks
    cache.blocks = torch.empty(small.shape.blocks_shape(cache.num_blocks, small.block_size),
                               dtype=small.blocks.dtype, device=small.blocks.device)  # fmt: skip
    cache.blocks[:, :, base:] = small.blocks
    pool = (cache.num_blocks * small.block_size, small.shape.num_kv_heads, small.shape.head_dim)
    cache.key_pools = [cache.blocks[layer, 0].view(pool) for layer in range(small.shape.num_layers)]
    cache.value_pools = [cache.blocks[layer, 1].view(pool) for layer in range(small.shape.num_layers)]
    sequences = [s._replace(block_table=[b + base for b in s.block_table]) for s in step.sequences]
    return cache, sequences


def check_far_cache_against_reference(step: Step, cache: PagedKVCache, sequences: list[SequenceSlice],
                                      backend: AttentionBackend, base: int) -> None:  # fmt: skip
    """Like `check_against_reference`, with the kernels over `far_cache`'s blocks."""
    expected, num_tokens = reference_output(step), step.query.shape[0]
    got = backend.attend(0, step.query, step.key, step.value, step.scale, backend.prepare(sequences, num_tokens))
    assert torch.equal(cache.blocks[:, :, base:].float(), step.reference_cache.blocks), "the cache writes differ"
    torch.testing.assert_close(got.float(), expected, **TOLERANCES[step.query.dtype])
