"""Torch reference attention over the paged cache: the CPU path and the kernels' oracle.

Decode tokens (one query per request) are attended together: their contexts are
gathered from the pools into one padded batch with a length mask, and each KV head's
query heads are folded into the query axis so grouped-query attention reads each K/V
once. Prompt chunks are attended one request at a time (a few per step, bounded by
the token budget): a fresh prompt uses its own K/V with a causal mask, a later chunk
gathers its cached prefix and masks causally from its offset.

A sliding-window layer masks the keys before its window too; softcapped scores and
attention sinks, which SDPA does not take, run as plain matmuls and a softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gpu.attention import (
    FULL_ATTENTION,
    AttentionBackend,
    LayerAttention,
    SequenceSlice,
    padded_block_tables,
    slot_mapping,
)


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [B] rows of the batch that are decode tokens
    blocks: torch.Tensor  # [B * max_blocks] block ids to gather (padding reads block 0)
    lengths: torch.Tensor  # [B] context lengths
    width: int  # max_blocks * block_size
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by window, built on first use

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, width] True where a key is visible to the token (its last position)."""
        if window not in self.masks:
            keys = torch.arange(self.width, device=self.lengths.device)
            visible = keys < self.lengths.unsqueeze(1)
            if window is not None:
                visible &= keys >= self.lengths.unsqueeze(1) - window
            self.masks[window] = visible.view(-1, 1, 1, self.width)
        return self.masks[window]


@dataclass
class PrefillSlice:
    rows: slice  # rows of the batch
    blocks: torch.Tensor | None  # blocks holding the cached context; None for a fresh prompt
    context_len: int
    mask: torch.Tensor | None  # [query_len, context_len]; None means plain causal
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # the mask of a window, by window

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """[query_len, context_len] True where a key is visible; None means plain causal."""
        if window is None or window >= self.context_len:
            return self.mask
        if window not in self.windowed:
            query_len = self.rows.stop - self.rows.start
            device = self.blocks.device if self.blocks is not None else None
            queries = torch.arange(self.context_len - query_len, self.context_len, device=device).unsqueeze(1)
            keys = torch.arange(self.context_len, device=device).unsqueeze(0)
            self.windowed[window] = (keys <= queries) & (keys > queries - window)
        return self.windowed[window]


@dataclass
class TorchMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    # What the backend's `prepare_decodes` built: DecodeGroups here, each subclass its own.
    decodes: Any
    prefills: list[PrefillSlice]


# Decode contexts are padded to the longest in their group; grouping by length keeps
# the padding (copied and read for nothing) small, at the price of a few more calls.
MAX_DECODE_GROUPS = 4
DECODE_GROUP_SPREAD = 1.5


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, kv_cache) -> None:
        super().__init__(kv_cache)
        self.device = kv_cache.blocks.device  # the index tensors are built on the host, then moved
        # Gathers land in buffers kept across calls: a fresh multi-MB tensor per gather
        # pays page faults on every call, which slowed the copy many times over (see
        # docs/benchmarks.md, "The CPU kernels").
        self._workspaces: dict[str, torch.Tensor] = {}

    def prepare(self, sequences: Sequence[SequenceSlice], num_tokens: int) -> TorchMetadata:
        block_size = self.kv_cache.block_size
        slots = slot_mapping(sequences, block_size)
        decodes: list[SequenceSlice] = []
        prefills: list[PrefillSlice] = []
        for seq in sequences:
            if seq.query_len == 1 and seq.past_len > 0:
                decodes.append(seq)
                continue
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            if seq.past_len == 0:
                prefills.append(PrefillSlice(rows, None, seq.context_len, None))
            else:
                blocks = _block_tables([seq], block_size).view(-1)
                query_pos = torch.arange(seq.past_len, seq.context_len).unsqueeze(1)
                mask = torch.arange(seq.context_len).unsqueeze(0) <= query_pos
                prefills.append(PrefillSlice(rows, blocks.to(self.device), seq.context_len, mask.to(self.device)))
        assert len(slots) == num_tokens
        slot_tensor = torch.from_numpy(np.array(slots, dtype=np.int64)).to(self.device)
        return TorchMetadata(slot_tensor, self.prepare_decodes(decodes), prefills)

    def prepare_decodes(self, decodes: list[SequenceSlice]):
        """The decode tokens' index tensors (what `attend_decodes` takes)."""
        return [_decode_group(group, self.kv_cache.block_size, self.device) for group in _by_length(decodes)]

    def attend(
        self, layer_idx, query, key, value, scale, metadata: TorchMetadata, layer: LayerAttention = FULL_ATTENTION
    ) -> torch.Tensor:
        key_pool = self.kv_cache.key_pools[layer_idx]
        value_pool = self.kv_cache.value_pools[layer_idx]
        key_pool.index_copy_(0, metadata.slot_mapping, key)
        value_pool.index_copy_(0, metadata.slot_mapping, value)
        out = query.new_empty(query.shape)
        self.attend_decodes(out, query, key_pool, value_pool, scale, metadata.decodes, layer)
        self._attend_prefills(out, query, key, value, key_pool, value_pool, scale, metadata.prefills, layer)
        return out

    def attend_decodes(
        self, out, query, key_pool, value_pool, scale, groups: Any, layer: LayerAttention = FULL_ATTENTION
    ) -> None:
        """Fill the decode tokens' rows of `out`; `groups` is what `prepare_decodes` built
        (a list of DecodeGroups here; a subclass takes its own)."""
        num_heads, num_kv_heads, head_dim = query.shape[1], key_pool.shape[1], query.shape[2]
        for group in groups:
            batch = group.token_index.numel()
            # [B, kv_heads, group, D]: the query heads sharing a KV head become query rows.
            q = query.index_select(0, group.token_index).view(batch, num_kv_heads, -1, head_dim)
            k = self._gather(key_pool, group.blocks, "key").view(batch, -1, num_kv_heads, head_dim)
            v = self._gather(value_pool, group.blocks, "value").view(batch, -1, num_kv_heads, head_dim)
            mask = group.mask(layer.window)
            if layer.softcap is None and layer.sinks is None:
                o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
            else:
                sinks = None if layer.sinks is None else layer.sinks.view(1, num_kv_heads, -1, 1)
                o = explicit_attention(q, k.transpose(1, 2), v.transpose(1, 2), mask, scale, layer.softcap, sinks)
            out.index_copy_(0, group.token_index, o.reshape(batch, num_heads, head_dim))

    def _attend_prefills(
        self, out, query, key, value, key_pool, value_pool, scale, prefills: list[PrefillSlice], layer=FULL_ATTENTION
    ):
        for p in prefills:
            q = query[p.rows].transpose(0, 1).unsqueeze(0)  # 4-D so SDPA takes its fused path
            if p.blocks is None:
                k, v = key[p.rows], value[p.rows]
            else:
                k = self._gather(key_pool, p.blocks, "key")[: p.context_len]
                v = self._gather(value_pool, p.blocks, "value")[: p.context_len]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            mask = p.mask_for(layer.window)
            if layer.softcap is None and layer.sinks is None:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
                )
            else:
                if mask is None:
                    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                sinks = None if layer.sinks is None else layer.sinks.view(1, -1, 1, 1)
                o = explicit_attention(q, k, v, mask, scale, layer.softcap, sinks)
            out[p.rows] = o[0].transpose(0, 1)

    def _gather(self, pool: torch.Tensor, blocks: torch.Tensor, workspace: str) -> torch.Tensor:
        """Whole blocks, copied in one index_select into the named workspace (valid until
        its next gather): [len(blocks) * block_size, kv_heads, head_dim]."""
        block_size = self.kv_cache.block_size
        by_block = pool.view(-1, block_size * pool.shape[1] * pool.shape[2])
        buffer = self._workspaces.get(workspace)
        if buffer is None or buffer.shape[0] < blocks.numel():
            buffer = by_block.new_empty(
                (max(blocks.numel(), 2 * (0 if buffer is None else buffer.shape[0])), by_block.shape[1])
            )
            self._workspaces[workspace] = buffer
        out = buffer[: blocks.numel()]
        torch.index_select(by_block, 0, blocks, out=out)
        return out.view(-1, pool.shape[1], pool.shape[2])


def explicit_attention(q, k, v, mask, scale, softcap=None, sinks=None) -> torch.Tensor:
    """softmax(scores) @ v as the models' eager attention computes it, for what SDPA does
    not take: `softcap` (scores s become softcap * tanh(s / softcap)) and `sinks` (one
    more logit per row, broadcast over [.., heads, rows, 1], that takes no value).
    q [.., rows, D], k and v [.., keys, D], mask [.., rows, keys] True where visible."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v)


def _block_tables(sequences: Sequence[SequenceSlice], block_size: int) -> torch.Tensor:
    """[len(sequences), max_blocks] block ids of each sequence's context, padded with block 0."""
    return torch.from_numpy(padded_block_tables(sequences, block_size, np.int64))


def _by_length(decodes: list[SequenceSlice]) -> list[list[SequenceSlice]]:
    """Group decodes by context length, longest first: a group takes sequences down to
    1/DECODE_GROUP_SPREAD of its longest. Past MAX_DECODE_GROUPS the shortest share the
    last group, where padding them costs least."""
    groups: list[list[SequenceSlice]] = []
    for seq in sorted(decodes, key=lambda s: s.context_len, reverse=True):
        if not groups or (
            seq.context_len * DECODE_GROUP_SPREAD < groups[-1][0].context_len and len(groups) < MAX_DECODE_GROUPS
        ):
            groups.append([])
        groups[-1].append(seq)
    return groups


def _decode_group(decodes: list[SequenceSlice], block_size: int, device: torch.device) -> DecodeGroup:
    tables = _block_tables(decodes, block_size)
    lengths = torch.tensor([seq.context_len for seq in decodes])
    token_index = torch.tensor([seq.query_start for seq in decodes])
    return DecodeGroup(
        token_index.to(device), tables.view(-1).to(device), lengths.to(device), tables.shape[1] * block_size
    )
