"""CUDA graphs for decode-only steps (`gpu/cuda/graphs.py`), checked without a GPU.

The bucket and partition choices are plain functions. The rest runs the graphs' own
forward over their static buffers with the CUDA kernels emulated on the CPU and no
capture (`DecodeGraphs(capture=False)`): a padded decode batch gives the eager step's
logits and K/V, its padded rows write nothing, and an engine generates the same
tokens with graphs as without. What only a GPU shows (the capture itself, and cupy's
launches landing in it) is in tests/gpu/test_gpu_kernels.py.
"""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from bench.drive import StepRecorder
from gpu.attention import SequenceSlice
from gpu.cuda.attention import CupyAttentionBackend
from gpu.cuda.graphs import DecodeGraphs, StaticDecodeInputs, bucket_for, decode_graphs, graph_buckets, partition_count
from gpu.kv_cache import KVShape
from gpu.torch_attention import TorchAttentionBackend
from tests.conftest import run_to_completion
from tests.cuda_emulator import EmulatedKernels
from workers.api import SamplingParams
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from workers.engine import Engine
from workers.model_loader import load_model
from workers.model_runner import ModelRunner
from workers.plan import ScheduledChunk, StepPlan

BLOCK = 16


@pytest.fixture(scope="module")
def kernels() -> EmulatedKernels:
    return EmulatedKernels()


@pytest.fixture(scope="module")
def tiny_llama():
    return load_model(ModelConfig(source="random:tiny-llama"))  # float32, CPU


def test_buckets_are_1_2_4_8_then_every_8_up_to_the_largest():
    assert graph_buckets(256)[:7] == (1, 2, 4, 8, 16, 24, 32)
    assert graph_buckets(256)[-2:] == (248, 256)
    assert len(graph_buckets(256)) == 35
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)  # the largest is a bucket even off the grid
    assert graph_buckets(4) == (1, 2, 4)
    assert graph_buckets(1) == (1,)
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it():
    buckets = graph_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 24, 64, 64]
    assert bucket_for(65, buckets) is None  # runs eagerly


def test_partitions_cover_the_longest_context_in_powers_of_two():
    """Contexts of 65 to 128 tokens in 64-token partitions share one graph (2
    partitions), 129 to 256 the next (4); never more than the buffers can need."""
    assert [partition_count(n, 64, 128) for n in (1, 64, 65, 128, 129, 256, 257)] == [1, 1, 2, 2, 4, 4, 8]
    assert partition_count(8192, 512, 16) == 16
    assert partition_count(700, 64, 8) == 8


def test_padded_rows_write_nowhere_and_read_one_token_of_block_0():
    """Three sequences in a bucket of 4: their tokens, positions, slots, contexts and block
    tables, then one padded row (slot -1, context 1 over block 0). A later, smaller batch
    pads the rows the earlier one filled."""
    inputs = StaticDecodeInputs(max_batch=8, max_blocks=4, block_size=BLOCK, device=torch.device("cpu"))
    sequences = [SequenceSlice(0, 1, 1, [7]), SequenceSlice(1, 1, 17, [3, 9, 5]), SequenceSlice(2, 1, 40, [2, 6, 4])]
    inputs.fill([11, 12, 13], [0, 16, 39], sequences, bucket=4)
    assert inputs.token_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [0, 16, 39, 0]
    assert inputs.slot_mapping[:4].tolist() == [7 * BLOCK, 9 * BLOCK, 4 * BLOCK + 7, -1]
    assert inputs.context_lens[:4].tolist() == [1, 17, 40, 1]
    assert inputs.block_tables[0, :1].tolist() == [7]
    assert inputs.block_tables[1, :2].tolist() == [3, 9]  # only the blocks the context covers
    assert inputs.block_tables[2, :3].tolist() == [2, 6, 4]
    assert inputs.block_tables[3, 0] == 0

    inputs.fill([21], [16], [sequences[1]], bucket=2)
    assert inputs.slot_mapping[:2].tolist() == [9 * BLOCK, -1]
    assert inputs.context_lens[:2].tolist() == [17, 1]
    assert inputs.block_tables[1, 0] == 0


def runner_on_emulated_kernels(loaded, kernels, num_blocks=64) -> ModelRunner:
    shape = KVShape.of(loaded.model.config)
    cache = CacheConfig(kv_memory_bytes=num_blocks * BLOCK * shape.bytes_per_token(torch.float32), swap_memory_bytes=0)
    return ModelRunner(loaded.model, cache, backend_class=lambda kv: CupyAttentionBackend(kv, kernels))


def chunk(start, token_ids, block_ids, samples=True):
    return ScheduledChunk(None, start, tuple(token_ids), (block_ids,), samples, len(token_ids) == 1)


def test_a_padded_decode_step_on_the_static_buffers_gives_the_eager_logits_and_kv(kernels, tiny_llama):
    """Five requests decode (contexts 4 to 71, several blocks, two partitions), and a sixth
    runs a one-token piece of its prompt that samples nothing: six rows in a bucket of 8.
    The real rows' logits and K/V equal the eager step's, and nothing outside the six new
    tokens' slots is written, not even block 0, which the padded rows read and a real
    request holds."""
    runner = runner_on_emulated_kernels(tiny_llama, kernels)
    rng = random.Random(0)
    free = list(range(1, runner.kv_cache.num_blocks))
    rng.shuffle(free)
    prompt_lens = [3, 17, 40, 70, 33, 5]
    tables = [[free.pop() for _ in range(-(-(n + 1) // BLOCK))] for n in prompt_lens]
    tables[2][0] = 0
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in prompt_lens]
    runner.execute(StepPlan([chunk(0, p, t) for p, t in zip(prompts, tables)]))

    decode = StepPlan([chunk(n, [rng.randrange(3, 1000)], t) for n, t in zip(prompt_lens[:5], tables)])
    decode.chunks.append(chunk(prompt_lens[5], [rng.randrange(3, 1000)], tables[5], samples=False))
    before = runner.kv_cache.blocks.clone()
    eager = runner.execute(decode)
    eager_kv = runner.kv_cache.blocks.clone()

    runner.kv_cache.blocks.copy_(before)
    runner.graphs = DecodeGraphs(runner.model, runner.backend, max_batch=16, capture=False)
    graphed = runner.execute(decode)
    assert runner.graphs.replays == 1
    bucket, _, partitions = runner.graphs.captured[0]
    assert (bucket, partitions) == (8, 2)

    assert graphed.logits.shape == eager.logits.shape == (5, tiny_llama.model.config.vocab_size)
    torch.testing.assert_close(graphed.logits, eager.logits)
    torch.testing.assert_close(runner.kv_cache.blocks, eager_kv)
    new_slots = {t[n // BLOCK] * BLOCK + n % BLOCK for n, t in zip(prompt_lens, tables)}
    changed = (runner.kv_cache.blocks != before).flatten(4).any(-1).any(1).any(0).flatten()  # by slot
    assert set(changed.nonzero().flatten().tolist()) == new_slots


def test_a_hybrid_models_graphed_decode_step_gives_the_eager_and_the_torch_logits(kernels):
    """Layers that attend otherwise, through the graphs' forward: tiny-llama with layer 0
    on a window of 6 keys with sinks and layer 1 on a softcap of 3 and a window of 20 (the
    module attributes the attention hook reads). Contexts of 4 to 71 tokens decode in a
    bucket of 8: the graphed step's logits equal the eager step's, both the torch
    backend's (and not the plain model's), and the sinks' fp32 copy on the device is the
    same for every step (the address a captured graph's launches keep)."""
    loaded = load_model(ModelConfig(source="random:tiny-llama"))
    first, second = (layer.self_attn for layer in loaded.model.model.layers)
    first.sliding_window, first.sinks = 6, torch.nn.Parameter(torch.linspace(-1.0, 2.0, 4), requires_grad=False)
    second.sliding_window, second.attn_logit_softcapping = 20, 3.0
    runner = runner_on_emulated_kernels(loaded, kernels)
    shape = KVShape.of(loaded.model.config)
    cache = CacheConfig(kv_memory_bytes=64 * BLOCK * shape.bytes_per_token(torch.float32), swap_memory_bytes=0)
    reference = ModelRunner(loaded.model, cache, backend_class=TorchAttentionBackend)
    rng = random.Random(1)
    free = list(range(1, runner.kv_cache.num_blocks))
    rng.shuffle(free)
    prompt_lens = [3, 17, 40, 70, 33]
    tables = [[free.pop() for _ in range(-(-(n + 1) // BLOCK))] for n in prompt_lens]
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in prompt_lens]
    prefill = StepPlan([chunk(0, p, t) for p, t in zip(prompts, tables)])
    decode = StepPlan([chunk(n, [rng.randrange(3, 1000)], t) for n, t in zip(prompt_lens, tables)])
    runner.execute(prefill)
    reference.execute(prefill)
    before = runner.kv_cache.blocks.clone()
    eager = runner.execute(decode).logits
    sinks_copies = [copy for _, _, copy in runner.backend._sinks.values()]
    runner.kv_cache.blocks.copy_(before)
    runner.graphs = DecodeGraphs(runner.model, runner.backend, max_batch=8, capture=False)
    graphed = runner.execute(decode).logits
    assert runner.graphs.replays == 1
    assert [copy for _, _, copy in runner.backend._sinks.values()] == sinks_copies and len(sinks_copies) == 1
    expected = reference.execute(decode).logits
    assert eager is not None and graphed is not None and expected is not None
    torch.testing.assert_close(graphed, eager)
    torch.testing.assert_close(eager, expected, atol=1e-4, rtol=1e-4)
    plain = ModelRunner(load_model(ModelConfig(source="random:tiny-llama")).model, cache,
                        backend_class=TorchAttentionBackend)  # fmt: skip
    plain.execute(prefill)
    assert not torch.allclose(plain.execute(decode).logits, expected, atol=1e-2)


def test_steps_with_prompt_tokens_too_many_rows_or_another_backend_run_eagerly(kernels, tiny_llama):
    runner = runner_on_emulated_kernels(tiny_llama, kernels)
    runner.graphs = graphs = DecodeGraphs(runner.model, runner.backend, max_batch=2, capture=False)
    runner.execute(StepPlan([chunk(0, [5, 6, 7], [1]), chunk(0, [8, 9], [2]), chunk(0, [10], [3])]))
    assert graphs.replays == 0  # a prefill step
    runner.execute(StepPlan([chunk(3, [11], [1]), chunk(2, [12], [2]), chunk(1, [13], [3])]))
    assert graphs.replays == 0  # three rows, more than the largest bucket
    runner.execute(StepPlan([chunk(4, [14], [1]), chunk(3, [15], [2])]))
    assert graphs.replays == 1
    runner.backend = TorchAttentionBackend(runner.kv_cache)
    runner.execute(StepPlan([chunk(5, [16], [1]), chunk(4, [17], [2])]))
    assert graphs.replays == 1  # graphs hold the backend they were built over


def test_graphs_are_made_only_for_the_cuda_kernels_on_a_gpu(kernels, tiny_llama):
    runner = runner_on_emulated_kernels(tiny_llama, kernels)
    assert runner.graphs is None  # the CUDA kernels, but on the CPU
    assert decode_graphs(runner.model, TorchAttentionBackend(runner.kv_cache), 8) is None


def test_engine_generates_the_same_tokens_with_graphs_as_without(kernels, tiny_llama):
    """Requests of different lengths on a cache small enough to preempt and swap, so the
    decode batch shrinks through buckets 8, 4, 2 and 1 and decode-only steps follow swaps.
    Greedy tokens are those of the eager steps."""
    shape = KVShape.of(tiny_llama.model.config)
    block_bytes = BLOCK * shape.bytes_per_token(torch.float32)
    config = EngineConfig(
        model=ModelConfig(source="random:tiny-llama"),
        cache=CacheConfig(kv_memory_bytes=10 * block_bytes, swap_memory_bytes=32 * block_bytes),
        scheduler=SchedulerConfig(max_prefill_chunk=16),
        # Drafts go by measured step times: with them the batch sizes would depend on the
        # machine's load (a CI run once never reached bucket 1).
        speculative=SpeculativeConfig(enabled=False),
    )
    prompts = [
        "The capital of France is",
        "def f(n):",
        "1, 2, 3, 4, 5, 6,",
        "Once upon a time, far away",
        "Name three rivers.",
        "a b c",
    ]
    results, swapped, graphs = {}, {}, None
    for name in ("graphs", "eager"):
        engine = Engine(tiny_llama, config)
        steps = StepRecorder(engine)
        engine.runner.backend = CupyAttentionBackend(engine.runner.kv_cache, kernels)
        engine.runner.host_pool.kernels = kernels
        if name == "graphs":
            engine.runner.graphs = graphs = DecodeGraphs(engine.runner.model, engine.runner.backend, 8, capture=False)
        arrivals = {
            0: [
                (f"r{i}", prompt, SamplingParams(max_tokens=10 + 6 * i, ignore_eos=True))
                for i, prompt in enumerate(prompts)
            ]
        }
        results[name] = {rid: tokens for rid, (tokens, _, _) in run_to_completion(engine, arrivals).items()}
        swapped[name] = any(record.num_blocks_swapped_in for record in steps)
        assert engine.allocator.num_free == engine.allocator.num_blocks
    assert results["graphs"] == results["eager"]
    assert swapped == {"graphs": True, "eager": True}
    assert {bucket for bucket, _, _ in graphs.captured} >= {8, 4, 2, 1}
    assert graphs.replays > 10


def test_the_switch_and_its_flags():
    from service.flags import add_engine_arguments, engine_config_from_args

    assert ModelConfig().cuda_graphs and ModelConfig().max_graph_batch == 256
    with pytest.raises(ValueError):
        ModelConfig(max_graph_batch=0)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    model = engine_config_from_args(parser.parse_args(["--no-cuda-graphs", "--max-graph-batch", "64"])).model
    assert (model.cuda_graphs, model.max_graph_batch) == (False, 64)
    assert engine_config_from_args(parser.parse_args([])).model.cuda_graphs
