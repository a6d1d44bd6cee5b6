"""The attention backend interface, and its hook into transformers.

A step runs one forward over a ragged batch: the tokens of many requests packed into
one `[1, T]` sequence, each request's slice described by a `SequenceSlice`. Every
attention layer of the model calls `paged_attention` (registered with transformers'
`AttentionInterface`), which hands the layer's new K/V and queries to the backend:
the backend writes K/V into their cache slots and attends over each request's blocks.

A backend has two methods: `prepare` turns the step's slices into whatever index
tensors it needs (once per step, shared by every layer), and `attend` runs one layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from gpu.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "inflight_paged"


@dataclass(frozen=True)
class SequenceSlice:
    """One request's tokens in the packed batch."""

    query_start: int  # offset of its first new token in the batch
    query_len: int  # new tokens this step
    context_len: int  # tokens in the cache once this step's K/V are written
    block_table: Sequence[int]

    @property
    def past_len(self) -> int:
        return self.context_len - self.query_len


class AttentionBackend(ABC):
    # The CUDA kernels' launcher (`CupyKernels`, or the tests' emulation) when this
    # backend runs them; the host KV pool then swaps blocks with the same kernels.
    kernels = None

    def __init__(self, kv_cache: PagedKVCache) -> None:
        self.kv_cache = kv_cache

    @abstractmethod
    def prepare(self, sequences: Sequence[SequenceSlice], num_tokens: int) -> Any:
        """Index tensors for one step; built once, used by every layer."""

    @abstractmethod
    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,  # [T, kv_heads, head_dim]
        scale: float,
        metadata: Any,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        """Write this layer's new K/V into the cache, then attend over each sequence's blocks."""


@dataclass(frozen=True)
class PagedBatch:
    """What the model's forward carries to every attention layer (as a keyword argument)."""

    backend: AttentionBackend
    metadata: Any


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention hook: `query` is [1, heads, T, head_dim], K/V [1, kv_heads, T, head_dim]."""
    batch: PagedBatch = kwargs["paged_batch"]
    out = batch.backend.attend(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        batch.metadata,
    )
    return out.unsqueeze(0), None  # transformers expects [1, T, heads, head_dim]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
