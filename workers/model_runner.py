"""Runs one step's plan: its KV copies (swaps and the prefix cache's host tier), then one
forward of the model over the paged KV cache.

The plan's chunks are packed into a single `[1, T]` sequence with their own positions
(no padding to the longest request). Logits are computed only for the last token of
each chunk that samples, not for every prompt token. The model is prepared for its
device once, at construction (`gpu.prepare`): on a CPU a Llama-family stack runs the
lean forward (the Hugging Face forward runs any other model), and with the CUDA kernels
on a GPU a decode-only step (one token per request) replays a CUDA graph.

With multi-LoRA each chunk names its adapter (`ScheduledChunk.adapter`): the runner
tells the model's slots each sequence's adapter and rows before the forward (`gpu.lora`),
and a step with any adapter row never replays a CUDA graph (a graph holds the base
model's kernels only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from gpu.attention import AttentionBackend, PagedBatch, SequenceSlice, long_tensor
from gpu.kv_layout import kv_layout
from gpu.offload import HostKVPool
from gpu.prepare import DeviceOptions, prepare_model
from gpu.tensor_parallel import Shard, check_shardable, shard_model
from workers.config import CacheConfig, LoRAConfig, ModelConfig
from workers.plan import StepPlan
from workers.tensor_parallel import Leader, StepInputs, threads_per_rank


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
        shard: Shard | None = None,
        lora: LoRAConfig | None = None,
    ):
        """Prepares `model` for its device (`gpu.prepare`). `backend_class` None picks the
        attention backend (`gpu.backends`); `model_config` says how the linears' weights are
        stored and whether decode-only steps replay CUDA graphs (default: dense, yes).
        With `model_config.tensor_parallel` > 1 this runner leads the group (it starts the
        followers, `workers.tensor_parallel`); a follower's runner is given its `shard`.
        `lora` (enabled) wraps the model's linears for multi-LoRA (`gpu.lora`), on one rank only."""
        settings = model_config or ModelConfig()
        lora = lora if lora is not None and lora.enabled else None
        if lora is not None and (shard is not None or settings.tensor_parallel > 1):
            raise ValueError("--lora-dir does not run with --tensor-parallel yet; use one rank")
        layout = kv_layout(model, cache_config.trim_windows)  # probed before any rank is cut
        self.leader: Leader | None = None
        if shard is None and settings.tensor_parallel > 1:
            if next(model.parameters()).device.type != "cpu":
                raise ValueError("--tensor-parallel runs on CPUs (gloo) so far; use --device cpu")
            check_shardable(model.config, type(model).__name__, settings.tensor_parallel)  # before any rank starts
            torch.set_num_threads(threads_per_rank(settings))
            self.leader = Leader.start(settings, cache_config)
            # The leader's all-reduces exit the worker where a rank is gone.
            shard_model(
                model,
                Shard(0, settings.tensor_parallel, self.leader.steps),
                self.leader.all_reduce,
                self.leader.all_gather,
            )
        elif shard is not None:
            shard_model(model, shard)
        options = DeviceOptions(
            kv_memory_bytes=cache_config.kv_memory_bytes,
            block_size=cache_config.block_size,
            swap_memory_bytes=cache_config.swap_memory_bytes,
            weights=settings.weights,
            cuda_graphs=settings.cuda_graphs,
            max_graph_batch=settings.max_graph_batch,
        )
        if lora is not None:
            options = replace(
                options,
                max_loras=lora.max_loras,
                max_lora_rank=lora.max_lora_rank,
                max_host_loras=lora.max_host_loras or None,  # 0: all of them
            )
        prepared = prepare_model(model, options, backend_class, layout)
        self.model, self.device = prepared.model, prepared.device
        self.kv_cache, self.backend, self.host_pool = prepared.kv_cache, prepared.backend, prepared.host_pool
        self.graphs, self.lean = prepared.graphs, prepared.lean
        self.lora = prepared.lora  # None without multi-LoRA
        self._group_of_layer = [layout.place(layer)[0] for layer in range(layout.num_layers)]
        if self.leader is not None:
            self.leader.wait_ready()  # every follower's model loaded and cut

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks if self.host_pool else 0

    def _host_pool(self) -> HostKVPool:
        """The host pool, for the copies the scheduler plans only with one."""
        if self.host_pool is None:
            raise RuntimeError("copies to or from the host planned without a host pool")
        return self.host_pool

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run the step (on every rank of a tensor-parallel group: the followers first hear of it)."""
        return self.run(plan if self.leader is None else self.leader.send(plan))

    @torch.inference_mode()
    def run(self, plan: StepPlan | StepInputs) -> StepOutput:
        started = time.perf_counter()
        # Device to host first, so a block evicted and reused this step is saved before it
        # is overwritten; then copies on write; then host to device.
        copies_out, copies_in = plan.copies_out, plan.copies_in
        if copies_out:
            self._host_pool().swap(copies_out, ())
        if plan.copies:
            self.kv_cache.copy_blocks(plan.copies)
        if copies_in:
            self._host_pool().swap((), copies_in)
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
                sequences.append(SequenceSlice(row, 1, start + 1, chunk.block_tables[0]))
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
                sequences.extend(
                    SequenceSlice(row + i, 1, start + i + 1, chunk.block_tables[0]) for i in range(num_tokens)
                )
                # Logits at the decode token and at every draft, to verify them.
                sample_rows.extend(range(row, row + num_tokens))
            else:
                sequences.append(SequenceSlice(row, num_tokens, start + num_tokens, chunk.block_tables[0]))
                if chunk.samples:
                    sample_rows.append(row + num_tokens - 1)
            token_ids.extend(chunk_ids)
            positions.extend(range(start, start + num_tokens))

        graphs = self.graphs
        # The slots, for a step with any adapter row (None: the base model's step).
        lora = self.lora if self.lora is not None and any(c.adapter is not None for c in plan.chunks) else None
        # Steps that verify drafts run eagerly: their several logit rows per request were never checked under a graph.
        if (
            graphs is not None
            and graphs.backend is self.backend
            and not plan.num_draft_tokens
            and lora is None
            and graphs.applies(sequences)
        ):
            started = time.perf_counter()
            logits = graphs.run(token_ids, positions, sequences, sample_rows)
            return StepOutput(logits, time.perf_counter() - started, swap_s)
        batch = self._paged_batch(plan, sequences, len(token_ids))
        started = time.perf_counter()
        if lora is None:
            logits = self.forward(token_ids, positions, sample_rows, batch)
            return StepOutput(logits, time.perf_counter() - started, swap_s)
        lora.begin_step([(chunk.adapter, len(chunk.token_ids)) for chunk in plan.chunks])  # rows in packed order
        try:
            logits = self.forward(token_ids, positions, sample_rows, batch)
        finally:
            lora.end_step()  # every later forward is the base model's until a step sets adapters again
        return StepOutput(logits, time.perf_counter() - started, swap_s)

    def _paged_batch(self, plan: StepPlan | StepInputs, sequences: list[SequenceSlice], num_tokens: int) -> PagedBatch:
        """The step's attention metadata: one over the first group's block tables, and with
        several groups of layers, one more per group over its tables, for its layers."""
        backend, layout = self.backend, self.kv_cache.layout
        metadata = backend.prepare(sequences, num_tokens)
        if len(layout.groups) == 1:
            return PagedBatch(backend, metadata)
        # A chunk with drafts is a slice per token (see `run`), any other one slice.
        tables = [c.block_tables for c in plan.chunks for _ in range(len(c.token_ids) if c.drafts else 1)]
        per_group = [metadata]
        for group in range(1, len(layout.groups)):
            group_sequences = [seq._replace(block_table=t[group]) for seq, t in zip(sequences, tables)]
            per_group.append(backend.prepare(group_sequences, num_tokens))
        return PagedBatch(backend, metadata, [per_group[group] for group in self._group_of_layer])

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
