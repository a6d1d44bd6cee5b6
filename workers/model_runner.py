"""Runs one step's plan: its KV copies (swaps and the prefix cache's host tier), then one
forward of the Hugging Face model over the paged KV cache.

The plan's chunks are packed into a single `[1, T]` sequence with their own positions
(no padding to the longest request). Logits are computed only for the last token of
each chunk that samples, not for every prompt token. On CPU the model's norms and MLPs
are fused (`gpu.cpu.fusions`) and its linears swapped for oneDNN ones with packed
weights (`gpu.cpu.packed_linear`), or, with `ModelConfig.weights` "int8" or "int4", for
quantized ones (`gpu.cpu.int8_linear`, `gpu.cpu.int4_linear`; the LM head stays packed
and dense); a Llama, Qwen2 or Mistral
stack runs the lean forward (`gpu.cpu.lean_forward`: the same modules without the eager
forward's per-layer host overhead; the Hugging Face forward for any other model), and
with int4 weights its decode steps run in one C++ call, layers and head (`gpu.cpu.int4_decode`).
Attention runs on the CUDA kernels on a GPU, on the C++ decode kernel on a CPU, and on
the torch reference otherwise (`gpu.backends`). On the CUDA kernels, a decode-only step
(one token per request) replays a CUDA graph (`gpu.cuda.graphs`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gpu.attention import ATTN_IMPLEMENTATION, AttentionBackend, PagedBatch, SequenceSlice, long_tensor
from gpu.backends import select_backend
from gpu.cpu import int4_linear, int8_linear
from gpu.cpu.fusions import fuse_for_cpu
from gpu.cpu.int4_decode import Int4DecodeStep
from gpu.cpu.lean_forward import LeanForward, lean_forward_applies
from gpu.cpu.packed_linear import can_pack, pack_linears
from gpu.cuda.graphs import decode_graphs
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.offload import HostKVPool
from workers.config import CacheConfig, ModelConfig
from workers.plan import StepPlan


@dataclass(frozen=True)
class StepOutput:
    # [chunks that sample, vocab], in the order of the plan's chunks; a chunk with drafts
    # has a row for its decode token and one for each draft.
    logits: torch.Tensor | None
    forward_s: float
    swap_s: float


class ModelRunner:
    def __init__(
        self,
        model,
        cache_config: CacheConfig,
        backend_class: type[AttentionBackend] | None = None,
        model_config: ModelConfig | None = None,
    ):
        """`backend_class` None picks one (`gpu.backends`): the CUDA kernels on a GPU, else torch.
        `model_config` says how the linears' weights are stored and whether decode-only steps
        replay CUDA graphs (default: dense, yes)."""
        settings = model_config or ModelConfig()
        self.model = model
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        on_cpu = next(model.parameters()).device.type == "cpu"
        if settings.weights != "dense" and not on_cpu:
            raise ValueError(
                f"weights={settings.weights} runs on a CPU only; this model is on "
                f"{next(model.parameters()).device} (use --device cpu, or --weights dense)"
            )
        if on_cpu:
            fuse_for_cpu(model)
        if settings.weights == "int8":
            int8_linear.quantize_model(model)  # the LM head stays dense: logits keep the dense model's precision
        elif settings.weights == "int4":
            int4_linear.quantize_model(model)
        if can_pack(model):
            pack_linears(model)
        self.device = next(model.parameters()).device
        self.kv_cache = PagedKVCache.from_budget(
            KVShape.of(model.config),
            cache_config.kv_memory_bytes,
            cache_config.block_size,
            model.dtype,
            self.device,
        )
        self.backend = backend_class(self.kv_cache) if backend_class else select_backend(self.kv_cache)
        # With the CUDA kernels, swaps are kernel launches too.
        self.host_pool = HostKVPool.from_budget(self.kv_cache, cache_config.swap_memory_bytes, self.backend.kernels)
        # With the CUDA kernels on a GPU, decode-only steps replay CUDA graphs (`gpu.cuda.graphs`).
        self.graphs = decode_graphs(model, self.backend, settings.max_graph_batch) if settings.cuda_graphs else None
        # Built last: it keeps the modules the swaps above put in place. With int4 weights,
        # decode steps run in one C++ call (`gpu.cpu.int4_decode`).
        self.lean = None
        if self.device.type == "cpu" and lean_forward_applies(model):
            decode_step = Int4DecodeStep.build(model, self.backend) if settings.weights == "int4" else None
            self.lean = LeanForward(model, decode_step)

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks if self.host_pool else 0

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        started = time.perf_counter()
        # Device to host first, so a block evicted and reused this step is saved before it
        # is overwritten; then copies on write; then host to device.
        copies_out, copies_in = plan.copies_out, plan.copies_in
        if copies_out:
            self.host_pool.swap(copies_out, ())
        if plan.copies:
            self.kv_cache.copy_blocks(plan.copies)
        if copies_in:
            self.host_pool.swap((), copies_in)
        swap_s = time.perf_counter() - started
        if not plan.chunks:
            return StepOutput(None, 0.0, swap_s)
        token_ids: list[int] = []
        positions: list[int] = []
        sequences: list[SequenceSlice] = []
        sample_rows: list[int] = []
        for chunk in plan.chunks:
            start, chunk_ids, row = chunk.start, chunk.token_ids, len(token_ids)
            if len(chunk_ids) == 1:  # a decode, most of every step: kept short
                sequences.append(SequenceSlice(row, 1, start + 1, chunk.block_ids))
                token_ids.append(chunk_ids[0])
                positions.append(start)
                if chunk.samples:
                    sample_rows.append(row)
                continue
            num_tokens = len(chunk_ids)
            if chunk.drafts:
                # A token and its drafts attend as one-token decodes, each over the context
                # up to its own position: every token's K/V is written before attention, so
                # they take the decode kernel rather than the path of prompt chunks.
                sequences.extend(SequenceSlice(row + i, 1, start + i + 1, chunk.block_ids) for i in range(num_tokens))
                # Logits at the decode token and at every draft, to verify them.
                sample_rows.extend(range(row, row + num_tokens))
            else:
                sequences.append(SequenceSlice(row, num_tokens, start + num_tokens, chunk.block_ids))
                if chunk.samples:
                    sample_rows.append(row + num_tokens - 1)
            token_ids.extend(chunk_ids)
            positions.extend(range(start, start + num_tokens))

        graphs = self.graphs
        # Steps that verify drafts run eagerly: their several logit rows per request were never checked under a graph.
        if (
            graphs is not None
            and graphs.backend is self.backend
            and not plan.num_draft_tokens
            and graphs.applies(sequences)
        ):
            started = time.perf_counter()
            logits = graphs.run(token_ids, positions, sequences, sample_rows)
            return StepOutput(logits, time.perf_counter() - started, swap_s)
        metadata = self.backend.prepare(sequences, len(token_ids))
        started = time.perf_counter()
        logits = self.forward(token_ids, positions, sample_rows, PagedBatch(self.backend, metadata))
        return StepOutput(logits, time.perf_counter() - started, swap_s)

    def forward(
        self, token_ids: list[int], positions: list[int], sample_rows: list[int], batch: PagedBatch
    ) -> torch.Tensor:
        """Logits at `sample_rows` of one packed step: the lean forward where it applies
        (and the model was not replaced since), else the Hugging Face forward."""
        if self.lean is not None and self.lean.model is self.model:
            return self.lean(token_ids, positions, sample_rows, batch)
        return self.hf_forward(token_ids, positions, sample_rows, batch)

    def hf_forward(
        self, token_ids: list[int], positions: list[int], sample_rows: list[int], batch: PagedBatch
    ) -> torch.Tensor:
        return self.model(
            input_ids=long_tensor(token_ids, self.device)[None],
            position_ids=long_tensor(positions, self.device)[None],
            logits_to_keep=long_tensor(sample_rows, self.device),
            use_cache=False,
            paged_batch=batch,
        ).logits[0]
