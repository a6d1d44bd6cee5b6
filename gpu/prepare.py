"""A model prepared for its device, in one call (`prepare_model`): what a step runs on.

Everywhere: the paged KV cache, its host pool and the attention backend (`gpu.backends`:
the CUDA kernels on a GPU, the C++ decode kernel on a CPU, the torch reference otherwise),
with the Hugging Face attention routed to it. On a CPU the model's modules are swapped
for faster ones (fused, quantized, packed) and a Llama-family stack gets the lean forward
(`gpu.cpu.prepare`). With the CUDA kernels on a GPU, decode-only steps replay CUDA graphs
(`gpu.cuda.graphs`).

With multi-LoRA (`DeviceOptions.max_loras`), the linears that will run are wrapped to add
each row's adapter delta (`gpu.lora.LoRASlots`), after the CPU's swaps and before the lean
forward, which keeps the modules' bound forwards. What bypasses the modules bypasses the
deltas too, so it serves only steps without adapters: int4's one-call decode step, built
on the bare int4 linears, takes no step with an adapter row (`BaseStepsOnly`), and the
runner replays no CUDA graph for one (`workers.model_runner`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gpu.attention import ATTN_IMPLEMENTATION, AttentionBackend
from gpu.backends import select_backend
from gpu.cpu.int4_decode import Int4DecodeStep
from gpu.cpu.lean_forward import LeanForward, lean_forward_applies
from gpu.cpu.prepare import cpu_forward, swap_modules_for_cpu
from gpu.cuda.graphs import DecodeGraphs, decode_graphs
from gpu.hf_module import HFModule
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.kv_layout import KVLayout
from gpu.lora import LoRABatch, LoRASlots
from gpu.offload import HostKVPool


@dataclass(frozen=True)
class DeviceOptions:
    """How a model is prepared: its cache budgets, how its linears' weights are stored
    ("dense", or "int8"/"int4" on a CPU), whether decode-only steps replay CUDA graphs, and
    multi-LoRA's slots (`max_loras` adapters of rank up to `max_lora_rank`, at most
    `max_host_loras` held in host memory, None: all; `max_loras` 0: no LoRA)."""

    kv_memory_bytes: int
    block_size: int
    swap_memory_bytes: int = 0
    weights: str = "dense"
    cuda_graphs: bool = True
    max_graph_batch: int = 256
    max_loras: int = 0
    max_lora_rank: int = 64
    max_host_loras: int | None = None


@dataclass
class PreparedModel:
    model: nn.Module
    device: torch.device
    kv_cache: PagedKVCache
    backend: AttentionBackend
    host_pool: HostKVPool | None  # None without a swap budget
    graphs: DecodeGraphs | None  # with the CUDA kernels on a GPU
    lean: LeanForward | None  # for a Llama-family stack on a CPU
    lora: LoRASlots | None = None  # with multi-LoRA


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
    if not options.max_loras:
        lean = cpu_forward(model, backend, options.weights) if device.type == "cpu" else None
        return PreparedModel(model, device, kv_cache, backend, host_pool, graphs, lean)
    lean_applies = device.type == "cpu" and lean_forward_applies(model)
    # int4's decode step reads the bare int4 linears: it is built before they are wrapped.
    decode_step = Int4DecodeStep.build(model, backend) if lean_applies and options.weights == "int4" else None
    lora = LoRASlots(model, options.max_loras, options.max_lora_rank, options.max_host_loras)
    base_steps = BaseStepsOnly(decode_step, lora.batch) if decode_step is not None else None
    lean = LeanForward(model, base_steps) if lean_applies else None  # over the wrapped linears
    return PreparedModel(model, device, kv_cache, backend, host_pool, graphs, lean, lora)


class BaseStepsOnly:
    """A decode step that bypasses the model's modules (`gpu.cpu.int4_decode`), taking only
    the steps whose rows have no adapter: it would miss their deltas."""

    def __init__(self, step: Int4DecodeStep, batch: LoRABatch) -> None:
        self.step, self.batch = step, batch

    def takes(self, metadata, num_tokens: int) -> bool:
        return not self.batch.segments and self.step.takes(metadata, num_tokens)

    def __call__(self, *args) -> torch.Tensor:
        return self.step(*args)
