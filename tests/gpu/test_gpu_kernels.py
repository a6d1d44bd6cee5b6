"""On a CUDA GPU (marker `gpu`; `ops/gpu-check.sh` runs these): the kernels match the
torch reference over the emulation's sweep, also in a cache of more than 2^31
elements; swaps go through pinned memory and back; an engine on the kernels
generates exactly the torch backend's greedy tokens, and the same tokens with its
decode steps replayed from CUDA graphs as without, on random-weight models (no
download, no bundled model: the GPU host is air-gapped). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from gpu.kv_cache import KVShape, PagedKVCache
from gpu.offload import HostKVPool
from gpu.torch_attention import TorchAttentionBackend
from tests.attention_cases import (
    BLOCK_SIZES,
    DTYPES,
    GQA_GROUPS,
    HEAD_DIMS,
    check_against_reference,
    check_far_cache_against_reference,
    decode_chunks,
    far_cache,
    make_step,
)
from tests.conftest import run_to_completion
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def kernels():
    from gpu.cuda.cupy_kernels import CupyKernels

    return CupyKernels(CUDA)


def backend(cache, kernels, partition_size=None):
    from gpu.cuda.attention import CupyAttentionBackend

    return CupyAttentionBackend(cache, kernels, partition_size=partition_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_and_prefill_sweep(kernels, dtype, head_dim, group, block_size):
    seed = group * head_dim + block_size
    for partition_size in (32, None):
        step = make_step(dtype, head_dim, block_size, 2, group, decode_chunks([1, 37, 100, 75, 700]), CUDA, seed)
        check_against_reference(step, backend(step.kernel_cache, kernels, partition_size))
    step = make_step(dtype, head_dim, block_size, 2, group, [(0, 21), (35, 12), (0, 1), (300, 130)], CUDA, seed)
    check_against_reference(step, backend(step.kernel_cache, kernels))
    step = make_step(dtype, head_dim, block_size, 2, group, decode_chunks([50, 3, 129]) + [(17, 40)], CUDA, seed)
    check_against_reference(step, backend(step.kernel_cache, kernels, 64))


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_long_contexts(kernels, batch):
    contexts = [4096 - 37 * i for i in range(batch)]
    step = make_step(torch.float16, 128, 16, 8, 4, decode_chunks(contexts), CUDA, batch)
    check_against_reference(step, backend(step.kernel_cache, kernels))


def test_cache_of_more_than_2_31_elements(kernels):
    """Blocks whose offsets pass 2^31 elements are read and written where they are."""
    step = make_step(torch.float16, 128, 16, 8, 4, decode_chunks([300, 45]) + [(20, 17)], CUDA, 5)
    base = 2**31 // (16 * 8 * 128) + 3
    cache, sequences = far_cache(step, base)
    check_far_cache_against_reference(step, cache, sequences, backend(cache, kernels, 128), base)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swap_round_trip_through_pinned_memory(kernels, dtype):
    cache = PagedKVCache(KVShape(4, 2, 128), 64, 16, dtype, CUDA)
    cache.blocks.copy_(torch.randn(cache.blocks.shape, device=CUDA).to(dtype))
    original = cache.blocks.clone()
    pool = HostKVPool(cache, 16, kernels)
    assert pool.blocks.is_pinned()
    pool.swap(swap_out=[(3, 5), (40, 0), (63, 15)], swap_in=[])
    pool.swap(swap_out=[], swap_in=[(5, 1), (0, 2), (15, 60)])
    torch.cuda.synchronize()
    expected = original.clone()
    expected[:, :, [1, 2, 60]] = original[:, :, [3, 40, 63]]
    assert torch.equal(cache.blocks, expected)


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_greedy_generation_equals_the_torch_backend(name):
    """A random-weight model (SmolLM2-135M's config: 9 heads over 3 KV heads, head_dim 64;
    the tiny ones: other GQA ratios, head_dim 128, Qwen2's biases) on the GPU, with chunked
    prompts and a cache small enough to force swaps: the same tokens on both backends.
    float32, so that the backends' rounding differences cannot flip a greedy choice."""
    from gpu.cuda.attention import CupyAttentionBackend
    from workers.api import SamplingParams
    from workers.engine import Engine
    from workers.model_loader import load_model

    model_config = ModelConfig(source=f"random:{name}", device="cuda")
    loaded = load_model(model_config)
    c = loaded.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    config = EngineConfig(
        model=model_config,
        cache=CacheConfig(kv_memory_bytes=16 * 16 * bytes_per_token, swap_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_prefill_chunk=24),
    )
    prompts = [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Write a haiku about the sea. " * 4,
        "1, 2, 3, 4,",
        "Once upon a time",
        "Name three rivers in Africa and say where each one flows.",
    ]
    results = {}
    for backend_name in ("kernels", "torch"):
        engine = Engine(loaded, config)
        if backend_name == "torch":
            engine.runner.backend = TorchAttentionBackend(engine.runner.kv_cache)
            engine.runner.host_pool.kernels = None
        else:
            assert isinstance(engine.runner.backend, CupyAttentionBackend)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        arrivals = {0: [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]}
        results[backend_name] = {rid: tokens for rid, (tokens, _, _) in run_to_completion(engine, arrivals).items()}
    for rid, tokens in results["torch"].items():
        kernels = results["kernels"][rid]
        # Random weights give flat logits: a near-tie flipped by rounding shows up here as
        # the first differing position, to tell from a kernel bug (which differs early, widely).
        first = next((i for i, (a, b) in enumerate(zip(kernels, tokens)) if a != b), None)
        assert kernels == tokens, f"{rid}: first differs at token {first}: {kernels} != {tokens}"
    assert all(len(tokens) == 40 for tokens in results["kernels"].values())


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-qwen2"])
def test_decode_steps_replayed_from_cuda_graphs_generate_the_eager_tokens(name):
    """CUDA graphs on (the default) and off, on the kernels: the same greedy tokens.
    Requests of different lengths on a cache that forces swaps, so the decode batch
    shrinks through buckets 8, 4, 2 and 1 and graph replays follow swaps; the graphs
    were captured with cupy's launches in them and replayed. Speculation off: a step that
    verifies drafts runs eagerly, and random weights loop, so drafts would fill most steps."""
    from dataclasses import replace

    from workers.api import SamplingParams
    from workers.engine import Engine
    from workers.model_loader import load_model

    model_config = ModelConfig(source=f"random:{name}", device="cuda")
    loaded = load_model(model_config)
    c = loaded.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    prompts = [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Write a haiku about the sea. " * 3,
        "1, 2, 3, 4,",
        "Once upon a time",
        "Name three rivers in Africa.",
    ]
    results, graphs = {}, None
    for cuda_graphs in (True, False):
        config = EngineConfig(
            model=replace(model_config, cuda_graphs=cuda_graphs),
            cache=CacheConfig(kv_memory_bytes=16 * 16 * bytes_per_token, swap_memory_bytes=64 << 20),
            scheduler=SchedulerConfig(max_prefill_chunk=24),
            speculative=SpeculativeConfig(enabled=False),
        )
        engine = Engine(loaded, config)
        assert (engine.runner.graphs is not None) == cuda_graphs
        graphs = graphs or engine.runner.graphs
        arrivals = {
            0: [
                (f"r{i}", prompt, SamplingParams(max_tokens=8 + 6 * i, ignore_eos=True))
                for i, prompt in enumerate(prompts)
            ]
        }
        results[cuda_graphs] = {rid: tokens for rid, (tokens, _, _) in run_to_completion(engine, arrivals).items()}
    for rid, tokens in results[False].items():
        graphed = results[True][rid]
        first = next((i for i, (a, b) in enumerate(zip(graphed, tokens)) if a != b), None)
        assert graphed == tokens, f"{rid}: first differs at token {first}: {graphed} != {tokens}"
    assert {bucket for bucket, _, _ in graphs.captured} >= {8, 4, 2, 1}
    assert graphs.replays > 20
