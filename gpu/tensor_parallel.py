"""Tensor parallelism: one rank's share of a decoder stack, in the Megatron layout.

Each of N ranks keeps 1/N of every layer's attention heads and of its MLP: the q, k, v,
gate and up projections are cut by output rows (column-parallel: each rank computes its
own heads and its own slice of the hidden MLP), the o and down projections by input
columns (row-parallel: each rank's product is a partial sum), and one all-reduce after
each of those two adds the partial sums, so every rank holds the whole hidden state
again. Two all-reduces a layer; embeddings and norms are whole on every rank. The LM
head is cut by vocabulary rows (where N divides them): each rank computes its slice of
the logits, for the sampled rows only, and one gather a step puts them side by side.
KV heads are split like the query heads where N divides them, and
replicated otherwise (N a multiple of them: each rank keeps the one its query heads
read). A rank's attention then runs on its own heads over its own paged KV cache, with
no change: the attention backends read the head counts off the tensors.

The cut is made on the plain modules after loading, before the device swaps them for
faster ones (`gpu.prepare`): the all-reduce is a wrapper around the row-parallel
linear, so a packed or fused replacement of the linear inside it still all-reduces.
Collectives are torch.distributed's (gloo on a CPU, NCCL on GPUs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpu.hf_module import HFModule

# The decoder stacks cut here: their layers' attention is `self_attn.{q,k,v,o}_proj` and
# their MLP `mlp.{gate,up,down}_proj`.
SHARDABLE = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


@dataclass(frozen=True)
class Shard:
    """Which share of the model a rank holds."""

    rank: int
    world: int
    group: Any = None  # the process group of its all-reduces (None: the default group)

    def slice(self, total: int) -> slice:
        """This rank's equal part of `total` rows or columns."""
        size = total // self.world
        return slice(self.rank * size, (self.rank + 1) * size)


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the ranks by
    `all_reduce` (the caller's: the leader's exits when a rank is gone)."""

    def __init__(self, linear: nn.Module, all_reduce: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.linear = linear
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """The LM head cut by vocabulary rows: this rank's slice of every row's logits, the
    slices gathered side by side by `all_gather` (a rank's slice in, all of them out)."""

    def __init__(self, head: nn.Linear, shard: Shard, all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        rows = shard.slice(head.out_features)
        self.head = nn.Linear(head.in_features, rows.stop - rows.start, bias=head.bias is not None)
        self.head.weight = nn.Parameter(head.weight[rows].clone(), requires_grad=False)  # untied from the embeddings
        if head.bias is not None:
            self.head.bias = nn.Parameter(head.bias[rows].clone(), requires_grad=False)
        self.all_gather = all_gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_gather(self.head(x))


def gather_last_dim(tensor: torch.Tensor, world: int, group: Any = None) -> torch.Tensor:
    """Every rank's `tensor`, side by side along the last dimension, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def check_shardable(config, model_class: str, world: int) -> None:
    """Raise ValueError, in one line, where `world` ranks cannot share this model."""
    if model_class not in SHARDABLE:
        raise ValueError(f"tensor parallelism covers {', '.join(sorted(SHARDABLE))}; not {model_class}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    if heads % world:
        raise ValueError(f"--tensor-parallel {world} does not divide the model's {heads} attention heads")
    if kv_heads % world and world % kv_heads:
        raise ValueError(f"--tensor-parallel {world} neither divides nor is a multiple of its {kv_heads} KV heads")
    if config.intermediate_size % world:
        raise ValueError(f"--tensor-parallel {world} does not divide the MLP's {config.intermediate_size} columns")


@torch.no_grad()
def shard_model(
    model: HFModule,
    shard: Shard,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Cut `model` in place down to `shard`'s heads, MLP columns and vocabulary rows, and
    its config with it (head counts and MLP size become this rank's); the partial sums
    meet in `all_reduce`, the logits' slices in `all_gather` (None: torch.distributed's,
    in the shard's group)."""
    all_reduce = all_reduce or functools.partial(dist.all_reduce, group=shard.group)
    all_gather = all_gather or functools.partial(gather_last_dim, world=shard.world, group=shard.group)
    config = model.config
    check_shardable(config, type(model).__name__, shard.world)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    query_rows = _heads(shard.slice(heads), head_dim)
    if kv_heads % shard.world == 0:
        kv_rows = _heads(shard.slice(kv_heads), head_dim)
    else:  # replicated: the KV head this rank's query heads read
        kv_head = shard.rank * kv_heads // shard.world
        kv_rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
    mlp_rows = shard.slice(config.intermediate_size)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _keep_rows(attention.q_proj, query_rows)
        _keep_rows(attention.k_proj, kv_rows)
        _keep_rows(attention.v_proj, kv_rows)
        attention.o_proj = RowParallel(_keep_columns(attention.o_proj, query_rows, shard), all_reduce)
        _keep_rows(mlp.gate_proj, mlp_rows)
        _keep_rows(mlp.up_proj, mlp_rows)
        mlp.down_proj = RowParallel(_keep_columns(mlp.down_proj, mlp_rows, shard), all_reduce)
        if hasattr(attention, "num_key_value_groups"):
            attention.num_key_value_groups = (heads // shard.world) // max(1, kv_heads // shard.world)
    head = model.lm_head
    if isinstance(head, nn.Linear) and head.out_features % shard.world == 0:
        model.lm_head = VocabParallelHead(head, shard, all_gather)
    config.num_attention_heads = heads // shard.world
    config.num_key_value_heads = max(1, kv_heads // shard.world)
    config.intermediate_size //= shard.world
    config.head_dim = head_dim  # no longer hidden_size // heads


def _heads(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, columns: slice, shard: Shard) -> nn.Linear:
    linear.weight = nn.Parameter(linear.weight[:, columns].contiguous(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and shard.rank != 0:  # added once, by rank 0's partial sum
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    return linear
