"""The paged KV cache: per-layer K and V pools cut into fixed-size blocks.

All of it is one tensor, `blocks`, shaped `[layers, 2 (K, V), num_blocks, block_size,
kv_heads, head_dim]`, so moving a set of blocks (a swap) is one gather and one scatter
across every layer. Each layer's K (or V) pool is a view of it with one slot per
token, `[slots, kv_heads, head_dim]`: token `i` of a request lives in slot
`block_table[i // block_size] * block_size + i % block_size`. The pools start zeroed
so that padded reads (masked out anyway) never meet NaNs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, hf_config) -> KVShape:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return cls(hf_config.num_hidden_layers, kv_heads, head_dim)

    def blocks_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


class PagedKVCache:
    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = torch.zeros(shape.blocks_shape(num_blocks, block_size), dtype=dtype, device=device)
        pool = (num_blocks * block_size, shape.num_kv_heads, shape.head_dim)
        self.key_pools = [self.blocks[layer, 0].view(pool) for layer in range(shape.num_layers)]
        self.value_pools = [self.blocks[layer, 1].view(pool) for layer in range(shape.num_layers)]

    @classmethod
    def from_budget(
        cls,
        shape: KVShape,
        memory_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """As many blocks as `memory_bytes` holds."""
        num_blocks = memory_bytes // (shape.bytes_per_token(dtype) * block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_memory_bytes={memory_bytes} is too small for one block of {block_size} tokens "
                f"({shape.bytes_per_token(dtype) * block_size} bytes)"
            )
        return cls(shape, num_blocks, block_size, dtype, device)

    @torch.inference_mode()
    def copy_blocks(self, pairs) -> None:
        """Copy block pair[0] to block pair[1], in every layer's K and V (copy on write)."""
        ids = torch.tensor(pairs, dtype=torch.long, device=self.blocks.device)
        self.blocks.index_copy_(2, ids[:, 1], self.blocks.index_select(2, ids[:, 0]))
