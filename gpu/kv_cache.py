"""The paged KV cache: per-layer K and V pools cut into fixed-size blocks.

All of it is one tensor, `blocks`, shaped `[group layers, 2 (K, V), num_blocks,
block_size, kv_heads, head_dim]`, so moving a set of blocks (a swap) is one gather and
one scatter across every layer. A block (a page) holds one group's layers
(`gpu.kv_layout`: every layer, for a model whose layers attend alike); layer `l` is
row `layout.place(l)[1]` of its group's pages. Each layer's K (or V) pool is a view
with one slot per token, `[slots, kv_heads, head_dim]`: token `i` of a request lives in
slot `block_table[i // block_size] * block_size + i % block_size`, the block table
being the request's for that layer's group. The pools start zeroed so that padded
reads (masked out anyway) never meet NaNs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.kv_layout import KVLayout


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

    def bytes_per_token(self, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """K and V of one token across all layers (or `num_layers` of them)."""
        element = torch.empty((), dtype=dtype).element_size()
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * element


class PagedKVCache:
    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layout: KVLayout | None = None,
    ) -> None:
        self.shape = shape
        self.layout = layout or KVLayout.uniform(shape.num_layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        page = KVShape(self.layout.group_size, shape.num_kv_heads, shape.head_dim)
        self.blocks = torch.zeros(page.blocks_shape(num_blocks, block_size), dtype=dtype, device=device)
        pool = (num_blocks * block_size, shape.num_kv_heads, shape.head_dim)
        rows = [self.layout.place(layer)[1] for layer in range(shape.num_layers)]
        self.key_pools = [self.blocks[row, 0].view(pool) for row in rows]
        self.value_pools = [self.blocks[row, 1].view(pool) for row in rows]

    @classmethod
    def from_budget(
        cls,
        shape: KVShape,
        memory_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layout: KVLayout | None = None,
    ) -> PagedKVCache:
        """As many blocks as `memory_bytes` holds."""
        layers = shape.num_layers if layout is None else layout.group_size
        block_bytes = shape.bytes_per_token(dtype, layers) * block_size
        num_blocks = memory_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_memory_bytes={memory_bytes} is too small for one block of {block_size} tokens "
                f"({block_bytes} bytes)"
            )
        return cls(shape, num_blocks, block_size, dtype, device, layout)

    @torch.inference_mode()
    def copy_blocks(self, pairs) -> None:
        """Copy block pair[0] to block pair[1], in every layer's K and V (copy on write)."""
        ids = torch.tensor(pairs, dtype=torch.long, device=self.blocks.device)
        self.blocks.index_copy_(2, ids[:, 1], self.blocks.index_select(2, ids[:, 0]))
