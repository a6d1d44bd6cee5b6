"""The attention backend interface, and its hook into transformers.

A step runs one forward over a ragged batch: the tokens of many requests packed into
one `[1, T]` sequence, each request's slice described by a `SequenceSlice`. Every
attention layer of the model calls `paged_attention` (registered with transformers'
`AttentionInterface`), which hands the layer's new K/V and queries to the backend:
the backend writes K/V into their cache slots and attends over each request's blocks.

A backend has two methods: `prepare` turns the step's slices into whatever index
tensors it needs (once per step, shared by every layer), and `attend` runs one layer.

Layers need not attend alike (`LayerAttention`): a sliding-window layer sees only the
last `window` positions, Gemma 2 caps its scores with a tanh, GPT-OSS adds a learned
per-head "sink" to the softmax's denominator. transformers hands each layer's settings
to the hook as keyword arguments; the lean forward reads them off the modules once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
from transformers import AttentionInterface

if TYPE_CHECKING:
    from gpu.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "inflight_paged"


class SequenceSlice(NamedTuple):
    """One request's tokens in the packed batch. (A named tuple: one is built per request
    per step, several times faster than a frozen dataclass.)"""

    query_start: int  # offset of its first new token in the batch
    query_len: int  # new tokens this step
    context_len: int  # tokens in the cache once this step's K/V are written
    block_table: Sequence[int]

    @property
    def past_len(self) -> int:
        return self.context_len - self.query_len


# A field of every slice in a list, read at C speed: `map(CONTEXT_LEN, sequences)`.
QUERY_START, QUERY_LEN, CONTEXT_LEN = itemgetter(0), itemgetter(1), itemgetter(2)


def long_tensor(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """An int64 tensor of a list of ints, built through numpy: several times faster than
    `torch.tensor` on a list, which counts at hundreds of requests a step."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


def slot_mapping(sequences: Sequence[SequenceSlice], block_size: int) -> list[int]:
    """The cache slot of every new token, in batch order."""
    slots: list[int] = []
    for seq in sequences:
        table = seq.block_table
        if seq.query_len == 1:  # a decode: one slot, no range to walk
            position = seq.context_len - 1
            slots.append(table[position // block_size] * block_size + position % block_size)
        else:
            slots.extend(table[position // block_size] * block_size + position % block_size
                         for position in range(seq.past_len, seq.context_len))  # fmt: skip
    return slots


def padded_block_tables(sequences: Sequence[SequenceSlice], block_size: int, dtype=np.int32) -> np.ndarray:
    """[len(sequences), most blocks] the block ids of each sequence's context, padded
    with block 0 (never read). Built in one pass over the ids, not a row at a time: at
    hundreds of decodes a step this is host time the device waits for."""
    used = np.fromiter(((seq.context_len + block_size - 1) // block_size for seq in sequences), np.int64,
                       len(sequences))  # fmt: skip
    tables = np.zeros((len(sequences), int(used.max(initial=0))), dtype)
    ids = chain.from_iterable(seq.block_table[:n] for seq, n in zip(sequences, used.tolist()))
    tables[np.arange(tables.shape[1]) < used[:, None]] = np.fromiter(ids, dtype, int(used.sum()))
    return tables


class BlockTables:
    """Padded block tables kept across steps, for one kind of sequence (decodes, say).

    The scheduler only ever appends to a request's block list (any other change makes a
    new list), so a list's ids are copied into its row once, and after that only the
    ids appended since; a step's table is then one gather of rows. A step may gather
    once per group of layers (`gpu.kv_layout`), each over other lists, so a row goes
    only once its list has been absent from `RETAIN_GATHERS` gathers. Entries past a
    sequence's context are never read.
    """

    RETAIN_GATHERS = 64

    def __init__(self, dtype=np.int32) -> None:
        self._table = np.zeros((8, 8), dtype)
        self._rows: dict[int, _Row] = {}  # by id() of the block list (the row keeps it alive)
        self._free: list[int] = []
        self._gathers = 0

    def gather(self, sequences: Sequence[SequenceSlice], block_size: int) -> np.ndarray:
        """[len(sequences), most blocks of a context] as `padded_block_tables` builds it
        (past each context: later ids or 0, never read)."""
        self._gathers += 1
        gathers, rows = self._gathers, []
        known = self._rows
        for seq in sequences:
            ids = seq.block_table
            row = known.get(id(ids))
            if row is None or row.ids is not ids:
                row = self._add(ids)
            if len(ids) != row.copied:
                self._copy(row)
            row.last_gather = gathers
            rows.append(row.index)
        if gathers % 16 == 0:  # now and then: the rows of lists long absent go
            stale = [key for key, row in known.items() if gathers - row.last_gather >= self.RETAIN_GATHERS]
            for key in stale:
                self._free.append(known.pop(key).index)
        width = -(-max(map(CONTEXT_LEN, sequences), default=0) // block_size)
        return self._table[rows, :width]

    def _add(self, ids: Sequence[int]) -> _Row:
        if not self._free:
            old = self._table
            self._table = np.zeros((2 * old.shape[0], old.shape[1]), old.dtype)
            self._table[: old.shape[0]] = old
            self._free.extend(range(2 * old.shape[0] - 1, old.shape[0] - 1, -1))
        previous = self._rows.get(id(ids))
        if previous is not None:  # another list had this id: its row goes
            self._free.append(previous.index)
        row = _Row(ids, self._free.pop(), 0, self._gathers)
        self._table[row.index] = 0
        self._rows[id(ids)] = row
        return row

    def _copy(self, row: _Row) -> None:
        n = len(row.ids)
        if n > self._table.shape[1]:
            old = self._table
            self._table = np.zeros((old.shape[0], max(n, 2 * old.shape[1])), old.dtype)
            self._table[:, : old.shape[1]] = old
        start = row.copied if n > row.copied else 0  # a shorter list than copied: copy it anew
        self._table[row.index, start:n] = row.ids[start:]
        row.copied = n


@dataclass
class _Row:
    ids: Sequence[int]
    index: int
    copied: int
    last_gather: int


class LayerAttention(NamedTuple):
    """How one layer attends, beyond plain causal attention."""

    # A query at position p sees keys at positions p - window + 1 .. p (transformers'
    # `sliding_window`, the query's own key included); None sees the whole context.
    window: int | None = None
    # Gemma 2: each score s becomes softcap * tanh(s / softcap) before the softmax.
    softcap: float | None = None
    # GPT-OSS: [heads] logits that join each row's softmax and take no value.
    sinks: torch.Tensor | None = None

    def window_start(self, position: int) -> int:
        """The first position a query at `position` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)


FULL_ATTENTION = LayerAttention()
INT32_MAX = 2**31 - 1


def kernel_scalars(layer: LayerAttention) -> tuple[int, float]:
    """`layer`'s window and softcap as the C++ and CUDA kernels take them (0 for none),
    checked: a window holds at least one key (a longer one than int32 reads as all), a
    softcap is positive."""
    window = 0 if layer.window is None else min(int(layer.window), INT32_MAX)
    if layer.window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least one key, not {layer.window}")
    softcap = 0.0 if layer.softcap is None else float(layer.softcap)
    if layer.softcap is not None and not softcap > 0:
        raise ValueError(f"a softcap must be positive, not {layer.softcap}")
    return window, softcap


def checked_sinks(sinks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`sinks`, which must hold one logit per query head."""
    if sinks.numel() != num_heads:
        raise ValueError(f"{sinks.numel()} sinks for {num_heads} query heads")
    return sinks


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter, or -1 for an inference tensor (which keeps none)."""
    return -1 if tensor.is_inference() else tensor._version


def layer_attention(module: Any, kwargs: dict[str, Any]) -> LayerAttention:
    """A layer's `LayerAttention` from what transformers hands its attention function
    (`sliding_window`, `softcap`, `s_aux`), else from the module's own attributes."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    softcap = kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None))
    sinks = kwargs.get("s_aux", getattr(module, "sinks", None))
    if window is None and softcap is None and sinks is None:
        return FULL_ATTENTION
    return LayerAttention(window, softcap, sinks)


class KernelLauncher(Protocol):
    """What launches the CUDA kernels: `CupyKernels` on a GPU, or the tests' emulation."""

    def launch(self, instance: Any, grid: tuple[int, ...], block: int, args: list) -> None: ...


class AttentionBackend(ABC):
    # The CUDA kernels' launcher (`CupyKernels`, or the tests' emulation) when this
    # backend runs them; the host KV pool then swaps blocks with the same kernels.
    kernels: KernelLauncher | None = None

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
        layer: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        """Write this layer's new K/V into the cache, then attend over each sequence's
        blocks as `layer` says."""


@dataclass(frozen=True)
class PagedBatch:
    """What the model's forward carries to every attention layer (as a keyword argument):
    the step's metadata, or with several groups of layers (`gpu.kv_layout`) each layer's,
    prepared over its group's block tables."""

    backend: AttentionBackend
    metadata: Any  # the first group's
    per_layer: Sequence[Any] | None = None  # None: every layer's is `metadata`

    def for_layer(self, layer_idx: int) -> Any:
        return self.metadata if self.per_layer is None else self.per_layer[layer_idx]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention hook: `query` is [1, heads, T, head_dim], K/V [1, kv_heads, T, head_dim]."""
    batch: PagedBatch = kwargs["paged_batch"]
    out = batch.backend.attend(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        batch.for_layer(module.layer_idx),
        layer_attention(module, kwargs),
    )
    return out.unsqueeze(0), None  # transformers expects [1, T, heads, head_dim]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
