"""On a CUDA GPU (marker `gpu`; `ops/gpu-check.sh` runs these): the kernels match the
torch reference over the emulation's sweep, also in a cache of more than 2^31
elements, and for layers that attend otherwise (a sliding window, a softcap, sinks, all
three: `tests.attention_cases.layer_cases`), a window's decode reading no key before it;
swaps go through pinned memory and back; an engine on the kernels generates exactly the
torch backend's greedy tokens, and the same tokens with its decode steps replayed from
CUDA graphs as without, on random-weight models, a hybrid one (windowed, softcapped and
sink layers) too (no download, no bundled model: the GPU host is air-gapped). Skipped
without a GPU."""

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
    layer_cases,
    make_step,
    reference_output,
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


# Decode contexts around the layer cases' window of 37 (shorter, as long, one longer, its
# first key mid-block and mid-partition, on a boundary) and far past it.
WINDOW_CONTEXTS = [1, 20, 37, 38, 50, 100, 101, 130, 700, 2000]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(layer_cases(1)))
def test_layer_cases_sweep(kernels, name, dtype, head_dim):
    """Each layer case, every dtype and head_dim (GQA 4 and 1, blocks of 16 and 32 by
    turns): decodes in 32-token partitions, in the automatic ones and in single ones;
    prompt chunks fresh and after cached prefixes, shorter and longer than the window;
    a mixed step."""
    for block_size, group in ((16, 4), (32, 1)):
        layer = layer_cases(2 * group)[name]
        seed = group * head_dim + block_size
        for partition_size in (32, None, 512):
            step = make_step(dtype, head_dim, block_size, 2, group, decode_chunks(WINDOW_CONTEXTS), CUDA, seed)
            check_against_reference(step, backend(step.kernel_cache, kernels, partition_size), layer)
        chunks = [(0, 21), (0, 50), (35, 12), (60, 20), (0, 1), (300, 130)]
        step = make_step(dtype, head_dim, block_size, 2, group, chunks, CUDA, seed)
        check_against_reference(step, backend(step.kernel_cache, kernels), layer)
        step = make_step(dtype, head_dim, block_size, 2, group, decode_chunks([50, 3, 129]) + [(17, 40)], CUDA, seed)
        check_against_reference(step, backend(step.kernel_cache, kernels, 64), layer)


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("window", [1000, 4096])
def test_layers_at_long_contexts(kernels, batch, window):
    """Windows wider than a partition (1000) or than most contexts (4096), with a softcap
    and sinks, at contexts up to 4096, in the automatic partitions; and prompt chunks
    across the window."""
    layer = layer_cases(32)["all"]._replace(window=window)
    contexts = [4096 - 37 * i for i in range(batch)]
    step = make_step(torch.float16, 128, 16, 8, 4, decode_chunks(contexts), CUDA, batch)
    check_against_reference(step, backend(step.kernel_cache, kernels), layer)
    step = make_step(torch.bfloat16, 128, 16, 8, 4, [(3000, 300), (0, 1500)], CUDA, batch)
    check_against_reference(step, backend(step.kernel_cache, kernels), layer)


@pytest.mark.parametrize("partition_size", [32, None])
def test_a_window_reads_no_key_before_it(kernels, partition_size):
    """Every K and V row before every query's window is NaN: the outputs stay finite and
    match the reference over the real values (decodes and a chunk after a cached prefix)."""
    layer = layer_cases(8)["all"]
    step = make_step(torch.float16, 128, 16, 2, 4, decode_chunks([100, 130, 20, 2000]) + [(60, 20)], CUDA, 9)
    expected = reference_output(step, layer)
    block_size, window = step.kernel_cache.block_size, 37
    hidden = [(seq.block_table[pos // block_size], pos % block_size)
              for seq in step.sequences for pos in range(max(0, seq.past_len - window + 1))]  # fmt: skip
    blocks, rows = (torch.tensor(index, device=CUDA) for index in zip(*hidden))
    step.kernel_cache.blocks[:, :, blocks, rows] = float("nan")
    attention = backend(step.kernel_cache, kernels, partition_size)
    got = attention.attend(0, step.query, step.key, step.value, step.scale,
                           attention.prepare(step.sequences, step.query.shape[0]), layer)  # fmt: skip
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=1e-3)


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


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma3"])
def test_greedy_generation_equals_the_torch_backend(name):
    """A random-weight model (SmolLM2-135M's config: 9 heads over 3 KV heads, head_dim 64;
    the tiny ones: other GQA ratios, head_dim 128, Qwen2's biases; tiny-gemma3 a cache of six
    groups of layers, five windows of 16 giving blocks back, run eagerly) on the GPU, with chunked
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


def test_a_hybrid_model_generates_the_same_tokens_on_kernels_graphs_and_torch():
    """tiny-llama made hybrid (layer 0: a window of 24 and sinks; layer 1: a softcap of 3
    and a window of 64, short of the prompts plus 40 tokens): greedy tokens on the
    kernels with CUDA graphs, without, and on the torch backend are the same. float32."""
    from dataclasses import replace

    from gpu.cuda.attention import CupyAttentionBackend
    from workers.api import SamplingParams
    from workers.engine import Engine
    from workers.model_loader import load_model

    model_config = ModelConfig(source="random:tiny-llama", device="cuda")
    loaded = load_model(model_config)
    first, second = (layer.self_attn for layer in loaded.model.model.layers)
    first.sliding_window = 24
    first.sinks = torch.nn.Parameter(torch.linspace(-1.0, 2.0, 4, device=CUDA), requires_grad=False)
    second.sliding_window, second.attn_logit_softcapping = 64, 3.0
    c = loaded.model.config
    bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    prompts = ["The capital of France is", "Write a haiku about the sea. " * 4, "1, 2, 3, 4,", "Once upon a time"]
    results, graphs = {}, None
    for name in ("graphs", "eager", "torch"):
        config = EngineConfig(
            model=replace(model_config, cuda_graphs=name == "graphs"),
            cache=CacheConfig(kv_memory_bytes=32 * 16 * bytes_per_token, swap_memory_bytes=64 << 20),
            scheduler=SchedulerConfig(max_prefill_chunk=24),
            speculative=SpeculativeConfig(enabled=False),
        )
        engine = Engine(loaded, config)
        if name == "torch":
            engine.runner.backend = TorchAttentionBackend(engine.runner.kv_cache)
            engine.runner.host_pool.kernels = None
            engine.runner.graphs = None
        else:
            assert isinstance(engine.runner.backend, CupyAttentionBackend)
        graphs = graphs or engine.runner.graphs
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        arrivals = {0: [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]}
        results[name] = {rid: tokens for rid, (tokens, _, _) in run_to_completion(engine, arrivals).items()}
    for rid, tokens in results["torch"].items():
        for name in ("graphs", "eager"):
            got = results[name][rid]
            first_diff = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
            assert got == tokens, f"{name} {rid}: first differs at token {first_diff}: {got} != {tokens}"
    assert graphs is not None and graphs.replays > 10
