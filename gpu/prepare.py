"""A model prepared for its device, in one call (`prepare_model`): what a step runs on.

Everywhere: the paged KV cache, its host pool and the attention backend (`gpu.backends`:
the CUDA kernels on a GPU, the C++ decode kernel on a CPU, the torch reference otherwise),
with the Hugging Face attention routed to it. On a CPU the model's modules are swapped
for faster ones (fused, quantized, packed) and a Llama-family stack gets the lean forward
(`gpu.cpu.prepare`). With the CUDA kernels on a GPU, decode-only steps replay CUDA graphs
(`gpu.cuda.graphs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gpu.attention import ATTN_IMPLEMENTATION, AttentionBackend
from gpu.backends import select_backend
from gpu.cpu.lean_forward import LeanForward
from gpu.cpu.prepare import cpu_forward, swap_modules_for_cpu
from gpu.cuda.graphs import DecodeGraphs, decode_graphs
from gpu.hf_module import HFModule
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.kv_layout import KVLayout
from gpu.offload import HostKVPool


@dataclass(frozen=True)
class DeviceOptions:
    """How a model is prepared: its cache budgets, how its linears' weights are stored
    ("dense", or "int8"/"int4" on a CPU) and whether decode-only steps replay CUDA graphs."""

    kv_memory_bytes: int
    block_size: int
    swap_memory_bytes: int = 0
    weights: str = "dense"
    cuda_graphs: bool = True
    max_graph_batch: int = 256


@dataclass
class PreparedModel:
    model: nn.Module
    device: torch.device
    kv_cache: PagedKVCache
    backend: AttentionBackend
    host_pool: HostKVPool | None  # None without a swap budget
    graphs: DecodeGraphs | None  # with the CUDA kernels on a GPU
    lean: LeanForward | None  # for a Llama-family stack on a CPU


def prepare_model(
    model: HFModule,
    options: DeviceOptions,
    backend_class: Callable[[PagedKVCache], AttentionBackend] | None = None,
    layout: KVLayout | None = None,
) -> PreparedModel:
    """Prepares `model` in place for the device its weights are on. `backend_class` None
    picks the attention backend (`gpu.backends.select_backend`); `layout` (None: one group
    of every layer) groups the cache's layers (`gpu.kv_layout`). CUDA graphs replay a
    cache of one group only: a model with several runs its decode steps eagerly."""
    device = next(model.parameters()).device
    if options.weights != "dense" and device.type != "cpu":
        raise ValueError(
            f"weights={options.weights} runs on a CPU only; this model is on {device} "
            "(use --device cpu, or --weights dense)"
        )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if device.type == "cpu":
        swap_modules_for_cpu(model, options.weights)
    # The cache after the swaps: the weights they free make room for it.
    kv_cache = PagedKVCache.from_budget(
        KVShape.of(model.config), options.kv_memory_bytes, options.block_size, model.dtype, device, layout
    )
    backend = backend_class(kv_cache) if backend_class else select_backend(kv_cache)
    # With the CUDA kernels, swaps are kernel launches too.
    host_pool = HostKVPool.from_budget(kv_cache, options.swap_memory_bytes, backend.kernels)
    one_group = len(kv_cache.layout.groups) == 1
    graphs = decode_graphs(model, backend, options.max_graph_batch) if options.cuda_graphs and one_group else None
    lean = cpu_forward(model, backend, options.weights) if device.type == "cpu" else None
    return PreparedModel(model, device, kv_cache, backend, host_pool, graphs, lean)
