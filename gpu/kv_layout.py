"""Which layers share a block table: the paged KV cache's groups (after vLLM's hybrid KV
cache manager).

A full-attention layer reads a request's whole context; a sliding-window layer only its
last `window` positions, so its older blocks can go. Layers are grouped by what they
read (their window, None for full attention), and every group holds the same number of
layers: one page of the pool is one block of that many layers' K and V, whichever group
owns it, so all groups draw on one pool. A request holds one block table per group. A
model whose layers all attend alike (most: every layer full, or every layer the same
window) is one group of all its layers, which is the whole cache as it always was.

Gemma 3's 270M model, 15 sliding layers to 3 full, is six groups of three layers: five
sliding, one full. Past the window a request's tokens cost a sixth of what they cost with
every layer holding the whole context.

The windows come from the model itself: one token's forward through a probe hook
(`probe_attention`) records what transformers hands each layer's attention.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface

from gpu.attention import layer_attention

PROBE_ATTENTION = "inflight_probe"


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # the positions each of its layers reads back; None: all of them
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]

    @classmethod
    def uniform(cls, num_layers: int) -> KVLayout:
        """One group of every layer, holding the whole context."""
        return cls((KVGroup(None, tuple(range(num_layers))),))

    @classmethod
    def of_windows(cls, windows: Sequence[int | None]) -> KVLayout:
        """Groups of equal size by window: the largest size that cuts every kind of layer
        into whole groups, each group's layers in model order."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        size = math.gcd(*(len(layers) for layers in kinds.values()))
        return cls(
            tuple(
                KVGroup(window, tuple(layers[start : start + size]))
                for window, layers in kinds.items()
                for start in range(0, len(layers), size)
            )
        )

    @property
    def group_size(self) -> int:
        """Layers per group: a page of the pool holds a block of this many layers."""
        return len(self.groups[0].layers)

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window, in group order."""
        return tuple(group.window for group in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, index within the group's page) of `layer`."""
        for group_index, group in enumerate(self.groups):
            if layer in group.layers:
                return group_index, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no group")


class AttentionCall(NamedTuple):
    """What one layer's attention was handed in a probe forward."""

    layer_idx: int | None
    key: tuple[int, int]  # [kv heads, head_dim]
    value: tuple[int, int]
    window: int | None


def probe_attention(model: Any) -> list[AttentionCall]:
    """Every call a one-token forward of `model` makes to transformers' attention hook,
    in order (the model's attention implementation is restored after)."""
    calls: list[AttentionCall] = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        window = layer_attention(module, kwargs).window
        calls.append(
            AttentionCall(
                getattr(module, "layer_idx", None),
                (key.shape[1], key.shape[3]),
                (value.shape[1], value.shape[3]),
                None if window is None else int(window),
            )
        )
        # What a layer expects back, [batch, tokens, heads, value head_dim]; the values do not matter.
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    previous = model.config._attn_implementation
    AttentionInterface.register(PROBE_ATTENTION, probe)
    try:
        model.set_attn_implementation(PROBE_ATTENTION)
        with torch.inference_mode():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device), use_cache=False)
    finally:
        with contextlib.suppress(Exception):
            model.set_attn_implementation(previous)
    return calls


def may_have_windows(config: Any) -> bool:
    """A config that names a sliding window somewhere (its layers may still not use it)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "sliding_window", None)) or "sliding_attention" in (
        getattr(text, "layer_types", None) or ()
    )


def kv_layout(model: Any, windowed: bool = True) -> KVLayout:
    """`model`'s groups: by its layers' windows, probed, when `windowed` and its config names
    a window; else one group of every layer."""
    num_layers = model.config.get_text_config().num_hidden_layers
    if not windowed or not may_have_windows(model.config):
        return KVLayout.uniform(num_layers)
    windows: list[int | None] = [None] * num_layers
    for call in probe_attention(model):
        if call.layer_idx is not None:
            windows[call.layer_idx] = call.window
    return KVLayout.of_windows(windows)
