"""A lean forward for Llama-family decoder stacks (Llama, Qwen2, Mistral) over the paged
cache: the same modules and weights as the Hugging Face forward, called directly.

At batch 1 on a CPU a decode step's math is a few milliseconds, and the eager Hugging
Face forward adds its own host time to every layer: `nn.Module.__call__` on each
sublayer, rotary cos/sin computed again for every step, the attention function looked
up and called through keyword plumbing, causal-mask and output bookkeeping no paged
step uses (figures in docs/benchmarks.md, "Per-step overhead"). Here one step is a
loop over the layers that calls each module's `forward` (so norms, MLPs and linears
swapped in by `gpu.cpu.fusions`, `gpu.cpu.packed_linear` or any other module with the
same call run unchanged), reads cos/sin from tables built once and indexed by
position, rotates queries and keys in one pass, and hands each layer to the attention
backend with the step's metadata, prepared once.

The arithmetic is Hugging Face's, operation for operation in the model's dtype (the
residual adds, the rotary products and sums, the norms on rows that sample), so in
float32 it agrees with the Hugging Face forward to rounding and in bfloat16 it
computes the same roundings. The Hugging Face forward stays the fallback for every
other model, and the oracle in the tests (`tests/gpu/test_lean_forward.py`).

Build it after every module swap: it keeps each module's bound `forward`. With
`decode_step` (`gpu.cpu.int4_decode`), the steps that object takes run in one C++ call
from the embeddings to the logits instead of the loop here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gpu.attention import PagedBatch, layer_attention, long_tensor
from gpu.cpu.fusions import Rotary
from gpu.hf_module import HFModule

# Decoder stacks whose layer is exactly: norm, attention (q/k/v projections, rotary,
# attention, o projection), residual add, norm, MLP, residual add.
CAUSAL_LMS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
DECODER_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer"}
# Rotary kinds whose cos/sin depend on the position alone (not on the sequence length,
# as dynamic and long-rope scaling do), so a table indexed by position holds them.
STATIC_ROPE_TYPES = {"default", "linear", "llama3"}
# Positions the first cos/sin table covers; it doubles when a step goes past it.
FIRST_TABLE_POSITIONS = 2048


def lean_forward_applies(model: nn.Module) -> bool:
    """Whether `model` is a decoder stack this forward computes exactly as Hugging Face does."""
    inner = getattr(model, "model", None)
    return (
        type(model).__name__ in CAUSAL_LMS
        and inner is not None
        and getattr(getattr(inner, "rotary_emb", None), "rope_type", None) in STATIC_ROPE_TYPES
        and all(type(layer).__name__ in DECODER_LAYERS for layer in inner.layers)
    )


class _Layer:
    """One decoder layer's bound module calls and constants."""

    def __init__(self, layer: HFModule, config) -> None:
        attention = layer.self_attn
        self.index = attention.layer_idx
        self.scale = attention.scaling
        # Qwen2's layers keep their own window; Mistral's attention reads its config's.
        window = getattr(attention, "sliding_window", getattr(config, "sliding_window", None))
        self.attention = layer_attention(attention, {"sliding_window": window})
        self.input_norm = layer.input_layernorm.forward
        self.add_input_norm = _add_norm(layer.input_layernorm)
        fused = getattr(attention, "qkv_proj", None)  # gpu.cpu.fusions.fuse_qkv
        self.qkv_proj = None if fused is None else fused.forward
        self.q_proj = attention.q_proj.forward
        self.k_proj = attention.k_proj.forward
        self.v_proj = attention.v_proj.forward
        self.o_proj = attention.o_proj.forward
        self.add_post_attention_norm = _add_norm(layer.post_attention_layernorm)
        self.mlp = layer.mlp.forward


def _add_norm(norm: HFModule):
    """`hidden += delta; return norm(hidden)`: in one pass where the norm offers it
    (`gpu.cpu.fusions.FusedRMSNorm.add_forward`)."""
    fused = getattr(norm, "add_forward", None)
    if fused is not None:
        return fused
    forward = norm.forward
    return lambda hidden, delta: forward(hidden.add_(delta))


class LeanForward:
    def __init__(self, model: HFModule, decode_step=None) -> None:
        if not lean_forward_applies(model):
            raise ValueError(f"the lean forward does not cover {type(model).__name__}")
        self.model = model
        inner = model.model
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.embed = inner.embed_tokens.forward
        self.layers = [_Layer(layer, config) for layer in inner.layers[: config.num_hidden_layers]]
        self.final_norm = inner.norm.forward
        self.lm_head = model.lm_head.forward
        self.rotary = inner.rotary_emb
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self.decode_step = decode_step

    def __call__(
        self, token_ids: Sequence[int], positions: Sequence[int], sample_rows: Sequence[int], batch: PagedBatch
    ) -> torch.Tensor:
        """Logits [len(sample_rows), vocab] of one packed step: `token_ids` at `positions`,
        attention through `batch`'s backend and metadata."""
        num_tokens = len(token_ids)
        device = self.device
        positions_t = long_tensor(positions, device)
        self._cover(max(positions) + 1)
        hidden = self.embed(long_tensor(token_ids, device))  # [T, hidden]
        if (
            self.decode_step is not None
            and batch.per_layer is None
            and self.decode_step.takes(batch.metadata, num_tokens)
        ):
            logits = self.decode_step(hidden, positions_t, self._cos, self._sin, batch.metadata)
            if len(sample_rows) != num_tokens:
                logits = logits.index_select(0, long_tensor(sample_rows, device))
            return logits
        self._layers(hidden, positions_t, batch)
        if len(sample_rows) != num_tokens:  # a decode-only step samples at every row
            hidden = hidden.index_select(0, long_tensor(sample_rows, device))
        return self.lm_head(self.final_norm(hidden))

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> None:
        """Every decoder layer over `hidden` [T, hidden], in place."""
        num_tokens = hidden.shape[0]
        rotary = Rotary(self._cos, self._sin, positions)
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        attend, for_layer = batch.backend.attend, batch.for_layer
        query_and_key = (heads + kv_heads) * head_dim
        mlp_out = None  # each layer's MLP output is added to `hidden` by the next layer's norm
        for layer in self.layers:
            x = layer.input_norm(hidden) if mlp_out is None else layer.add_input_norm(hidden, mlp_out)
            if layer.qkv_proj is not None:
                qkv = layer.qkv_proj(x)
                qk = qkv[:, :query_and_key].view(num_tokens, heads + kv_heads, head_dim)
                v = qkv[:, query_and_key:].view(num_tokens, kv_heads, head_dim)
            else:
                q = layer.q_proj(x).view(num_tokens, heads, head_dim)
                k = layer.k_proj(x).view(num_tokens, kv_heads, head_dim)
                v = layer.v_proj(x).view(num_tokens, kv_heads, head_dim)
                qk = torch.cat((q, k), dim=1)
            # Queries and keys at once (in place: `qk` is not read again).
            rotated = rotary(qk)
            out = attend(
                layer.index,
                rotated[:, :heads],
                rotated[:, heads:],
                v,
                layer.scale,
                for_layer(layer.index),
                layer.attention,
            )
            x = layer.add_post_attention_norm(hidden, layer.o_proj(out.view(num_tokens, heads * head_dim)))
            mlp_out = layer.mlp(x)
        if mlp_out is not None:
            hidden.add_(mlp_out)

    def _cover(self, needed: int) -> None:
        """cos/sin tables (`_cos`, and `_sin` with its first half negated) for `needed` positions."""
        if needed > self._cos.shape[0]:
            self._build_tables(max(needed, 2 * self._cos.shape[0], FIRST_TABLE_POSITIONS))

    def _build_tables(self, num_positions: int) -> None:
        # The model's own rotary module, so its scaling (linear, llama3) applies; cos/sin at
        # a position do not depend on the other positions computed with it.
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        all_positions = torch.arange(num_positions, device=self.device).unsqueeze(0)
        with torch.inference_mode():
            cos, sin = self.rotary(probe, position_ids=all_positions)
        half = self.head_dim // 2
        sin = sin[0].clone()
        sin[:, :half].neg_()
        self._cos, self._sin = cos[0].contiguous(), sin
