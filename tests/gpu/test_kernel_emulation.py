"""The CUDA kernels, run on the CPU emulation, match the torch reference.

The emulation (`tests/cuda_emulator`) compiles the very `.cu` program text that NVRTC gets,
runs each CUDA thread as a host thread, and `CupyAttentionBackend` drives it exactly
as it drives the GPU. float32 matches to rounding; float16 to atol 1e-3 (rtol 1e-3);
bfloat16 to atol 1e-3, rtol 1.6e-2. Layers that attend otherwise (a sliding window, a
softcap, sinks, all three: `tests.attention_cases.layer_cases`) are checked for decodes
and prompt chunks around the window's edges, and a window's decode reads no key before it.
"""

from __future__ import annotations

import pytest
import torch

from gpu.attention import LayerAttention, SequenceSlice
from gpu.cuda.attention import CupyAttentionBackend
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.offload import HostKVPool
from tests.attention_cases import (
    BLOCK_SIZES,
    DTYPES,
    INSTANTIATIONS,
    check_against_reference,
    check_far_cache_against_reference,
    decode_chunks,
    far_cache,
    layer_cases,
    make_step,
    reference_output,
)
from tests.cuda_emulator import EmulatedKernels
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


@pytest.fixture(scope="module")
def kernels() -> EmulatedKernels:
    return EmulatedKernels()  # built with g++ once per source hash, then cached


# The engine tests below serve the bundled SmolLM2's shapes (9 query heads over 3 KV heads,
# head_dim 64) in its first few layers: every emulated launch costs, and what they check,
# the same greedy tokens as the torch backend's, does not depend on the depth.
EMULATED_LAYERS = 4


@pytest.fixture(scope="module")
def shallow_smollm2():
    from workers.config import ModelConfig
    from workers.model_loader import load_model

    loaded = load_model(ModelConfig())
    loaded.model.model.layers = loaded.model.model.layers[:EMULATED_LAYERS]
    loaded.model.config.num_hidden_layers = EMULATED_LAYERS
    return loaded


def backend(step, kernels, partition_size=None) -> CupyAttentionBackend:
    return CupyAttentionBackend(step.kernel_cache, kernels, partition_size=partition_size)


@pytest.mark.parametrize(("dtype", "head_dim", "group", "block_size"), INSTANTIATIONS)
def test_decode_split_into_partitions(kernels, dtype, head_dim, group, block_size):
    """Contexts that are not multiples of the block size, split into 32-token partitions
    and reduced; the shortest fits in one partition, the longest spans several."""
    step = make_step(dtype, head_dim, block_size, num_kv_heads=2, group=group,
                     chunks=decode_chunks([1, 37, 100, 75]), seed=group * head_dim + block_size)  # fmt: skip
    check_against_reference(step, backend(step, kernels, partition_size=32))


# Each batch size once, each in another dtype (the batch sets the grid, the dtype the template).
@pytest.mark.parametrize(("dtype", "batch"), list(zip(DTYPES, [1, 3, 16])), ids=str)
def test_decode_batch_sizes_in_one_partition(kernels, dtype, batch):
    """Each context in a single partition: the decode kernel writes the output itself,
    with no reduce step."""
    contexts = [(7 * i + 5) % 90 + 1 for i in range(batch)]
    step = make_step(dtype, 128, 16, num_kv_heads=2, group=4, chunks=decode_chunks(contexts), seed=batch)
    attention = backend(step, kernels, partition_size=512)
    assert attention.prepare(step.sequences, batch).decode.num_partitions == 1
    check_against_reference(step, attention)


def test_partitions_shrink_until_the_batch_fills_the_device(kernels):
    """Partitions are 512 tokens unless the launch would have fewer blocks than the device
    wants (on the emulation, 256), down to 64 tokens."""
    step = make_step(torch.float16, 64, 16, num_kv_heads=8, group=1, chunks=decode_chunks([5]))
    attention = backend(step, kernels)

    def partition_size(batch, context):
        sequences = [SequenceSlice(i, 1, context, [0] * -(-context // 16)) for i in range(batch)]
        return attention.prepare(sequences, batch).decode.partition_size

    assert partition_size(64, 4096) == 512  # 4096 blocks
    assert partition_size(1, 4096) == 128  # 8 KV heads x 32 partitions = 256 blocks
    assert partition_size(2, 100) == 64  # as small as it goes


def test_decode_long_context_uses_the_largest_partition(kernels):
    """One sequence of 1100 tokens: 512-token partitions (the most a block holds) and a reduce."""
    step = make_step(torch.float16, 64, 32, num_kv_heads=1, group=4, chunks=decode_chunks([1100]), seed=3)
    attention = backend(step, kernels, partition_size=512)
    check_against_reference(step, attention)
    assert attention.prepare(step.sequences, 1).decode.num_partitions == 3


def test_wide_gqa_groups_span_several_blocks(kernels):
    """A group wider than one decode block serves (12 query heads per KV head), and an
    odd one (3, as in SmolLM2)."""
    for group in (12, 3):
        step = make_step(torch.float32, 64, 16, num_kv_heads=2, group=group,
                         chunks=decode_chunks([20, 41]) + [(0, 9), (13, 6)], seed=group)  # fmt: skip
        check_against_reference(step, backend(step, kernels, partition_size=32))


def test_cache_of_more_than_2_31_elements(kernels):
    """Blocks whose offsets pass 2^31 elements (in both the K and the V pool) are read
    and written where they are: offsets are 64-bit."""
    step = make_step(torch.float16, 128, 16, num_kv_heads=8, group=4,
                     chunks=decode_chunks([70, 45]) + [(20, 17)], seed=5)  # fmt: skip
    base = 2**31 // (16 * 8 * 128) + 3
    cache, sequences = far_cache(step, base)
    assert cache.key_pools[0].numel() > 2**31
    attention = CupyAttentionBackend(cache, kernels, partition_size=32)
    check_far_cache_against_reference(step, cache, sequences, attention, base)


@pytest.mark.parametrize(("dtype", "head_dim", "group", "block_size"), INSTANTIATIONS)
def test_chunked_prefill(kernels, dtype, head_dim, group, block_size):
    """A fresh prompt, a later chunk of a prompt whose prefix is cached (both not
    block-aligned), and a one-token prompt, in one step."""
    step = make_step(dtype, head_dim, block_size, num_kv_heads=2, group=group,
                     chunks=[(0, 21), (35, 12), (0, 1)], seed=group * head_dim + block_size)  # fmt: skip
    check_against_reference(step, backend(step, kernels))


# Each dtype once and each block size (the geometry) at least once: every (dtype, block
# size) instantiation is in test_chunked_prefill's sweep already.
@pytest.mark.parametrize(
    ("dtype", "block_size"), [(dtype, BLOCK_SIZES[i % 2]) for i, dtype in enumerate(DTYPES)], ids=str
)
def test_prefill_after_a_shared_cached_prefix_that_is_not_a_multiple_of_the_chunk_size(kernels, dtype, block_size):
    """Prefix caching: three requests whose first three blocks are the same cached blocks
    (one block table entry, read by all) go on in one step. The first prefills a chunk of
    12 right after the prefix, so its chunks start at 3 * block_size, not at a multiple of
    12; the second is one chunk further on (past 3 * block_size + 12, mid-block); the third
    decodes over two of the shared blocks. Each writes only its own blocks."""
    prefix = 3 * block_size
    step = make_step(dtype, 64, block_size, num_kv_heads=3, group=3,
                     chunks=[(prefix, 12), (prefix + 12, 12), (2 * block_size, 1)], seed=block_size)  # fmt: skip
    shared = step.sequences[0].block_table[:3]
    step.sequences = [seq._replace(block_table=shared[:keep] + seq.block_table[keep:])
                      for seq, keep in zip(step.sequences, (3, 3, 2))]  # fmt: skip
    before = step.kernel_cache.blocks[:, :, shared].clone()
    check_against_reference(step, backend(step, kernels))
    assert torch.equal(step.kernel_cache.blocks[:, :, shared], before), "a shared block was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_step_of_decodes_and_prefill_chunks(kernels, dtype):
    """What the scheduler sends: decodes first, then prompt chunks, in one batch."""
    chunks = decode_chunks([50, 3, 129, 64]) + [(17, 40), (0, 33)]
    step = make_step(dtype, 128, 16, num_kv_heads=4, group=4, chunks=chunks, seed=11)
    check_against_reference(step, backend(step, kernels, partition_size=64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swap_round_trip(kernels, dtype):
    """Blocks swapped out to the host pool and back in (to other ids) by the copy kernel
    come back bit for bit, in every layer's K and V; the other blocks are untouched."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=64)
    cache = PagedKVCache(shape, num_blocks=12, block_size=16, dtype=dtype)
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    original = cache.blocks.clone()
    pool = HostKVPool(cache, num_blocks=6, kernels=kernels)

    pool.swap(swap_out=[(3, 5), (7, 0), (10, 2)], swap_in=[])
    for device_id, host_id in [(3, 5), (7, 0), (10, 2)]:
        assert torch.equal(pool.blocks[:, :, host_id], original[:, :, device_id])
    pool.swap(swap_out=[], swap_in=[(5, 1), (0, 4), (2, 11)])
    expected = original.clone()
    expected[:, :, [1, 4, 11]] = original[:, :, [3, 7, 10]]
    assert torch.equal(cache.blocks, expected)


def test_swap_out_and_in_in_one_step(kernels):
    """The step's swap-out runs before its swap-in, so a block freed by a swap-out can be
    the destination of a swap-in."""
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=64)
    cache = PagedKVCache(shape, num_blocks=4, block_size=16, dtype=torch.float16)
    cache.blocks.copy_(torch.randn(cache.blocks.shape).half())
    pool = HostKVPool(cache, num_blocks=2, kernels=kernels)
    pool.swap(swap_out=[(1, 0)], swap_in=[])
    parked = pool.blocks[:, :, 0].clone()
    block_2 = cache.blocks[:, :, 2].clone()
    pool.swap(swap_out=[(2, 1)], swap_in=[(0, 2)])
    assert torch.equal(cache.blocks[:, :, 2], parked)
    assert torch.equal(pool.blocks[:, :, 1], block_2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_conversions_are_the_hardwares(kernels, dtype):
    """The emulation rounds float32 to 16 bits to nearest even, subnormals, overflow and
    ties included, as torch (and the GPU's cvt.rn) do; and widens every 16-bit value exactly."""
    every_16_bit = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    widened = kernels.convert(every_16_bit, torch.float32)
    expected = every_16_bit.float()
    assert torch.equal(widened.isnan(), expected.isnan())
    assert torch.equal(widened[~expected.isnan()], expected[~expected.isnan()])

    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=torch.Generator().manual_seed(0))
    # Every 16-bit value, the midpoints between neighbours (the ties) and a hair either side.
    ties = (expected[:-1].double() + expected[1:].double()) / 2
    floats = torch.cat([random_bits.to(torch.int32).view(torch.float32), expected, ties.float(),
                        ties.float().nextafter(torch.tensor(float("inf"))),
                        ties.float().nextafter(torch.tensor(float("-inf")))])  # fmt: skip
    rounded = kernels.convert(floats, dtype)
    expected = floats.to(dtype)
    nan = floats.isnan()
    assert torch.equal(rounded[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert rounded[nan].isnan().all()


def test_engine_on_the_emulated_kernels_generates_the_torch_backends_tokens(kernels, make_engine, shallow_smollm2):
    """End to end through transformers' attention hook: SmolLM2's shapes with prompts in
    chunks of 8 and a cache of 3 blocks, so a request is swapped out and back in by the
    copy kernel. Greedy tokens are the same as on the torch backend."""
    from bench.drive import StepRecorder
    from gpu.torch_attention import TorchAttentionBackend
    from tests.conftest import run_to_completion
    from workers.api import SamplingParams
    from workers.config import SpeculativeConfig

    block_bytes = 16 * 2 * EMULATED_LAYERS * 3 * 64 * 4  # 16 tokens of K and V, every layer, float32
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is the city of light, and its river", "def fibonacci(n):\n    if n < 2: return n"]
    results, swapped = {}, {}
    for name in ("emulated", "torch"):
        # No speculation: accepted drafts would make the steps, and so the swaps, the model's doing.
        engine = make_engine(
            shallow_smollm2,
            kv_memory_bytes=3 * block_bytes,
            max_prefill_chunk=8,
            speculative=SpeculativeConfig(enabled=False),
        )
        steps = StepRecorder(engine)
        if name == "emulated":
            engine.runner.backend = CupyAttentionBackend(engine.runner.kv_cache, kernels)
            engine.runner.host_pool.kernels = kernels
        assert isinstance(engine.runner.backend, CupyAttentionBackend if name == "emulated" else TorchAttentionBackend)
        arrivals = {0: [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]}
        results[name] = {rid: tokens for rid, (tokens, _, _) in run_to_completion(engine, arrivals).items()}
        swapped[name] = any(record.num_blocks_swapped_in for record in steps)
    assert results["emulated"] == results["torch"]
    assert swapped == {"emulated": True, "torch": True}


def test_engine_on_the_emulated_kernels_continues_after_a_cached_prefix(kernels, make_engine, shallow_smollm2):
    """End to end with prefix caching: a second prompt shares the first one's two full
    blocks (32 tokens), so it starts at position 32, and goes on in chunks of 12 (32 is not
    a multiple of 12: its chunks start where a cold prompt's never do). Its greedy tokens
    are those of the torch backend with caching off."""
    from gpu.torch_attention import TorchAttentionBackend
    from tests.conftest import run_to_completion
    from workers.api import SamplingParams

    first = list(range(1000, 1040))  # 40 tokens: two full blocks and a partial one
    second = first[:32] + list(range(3000, 3011))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    results, hits = {}, {}
    for name in ("emulated", "torch"):
        engine = make_engine(shallow_smollm2, max_prefill_chunk=12, prefix_caching=name == "emulated")
        if name == "emulated":
            engine.runner.backend = CupyAttentionBackend(engine.runner.kv_cache, kernels)
            engine.runner.host_pool.kernels = kernels
        assert isinstance(engine.runner.backend, CupyAttentionBackend if name == "emulated" else TorchAttentionBackend)
        hit_tokens = []
        engine.observer = lambda stats: hit_tokens.append(stats.cache.device_hit_tokens)
        run_to_completion(engine, {0: [("first", first, SamplingParams(max_tokens=1))]})
        hit_tokens.clear()
        results[name] = run_to_completion(engine, {0: [("second", second, params)]})["second"][0]
        hits[name] = sum(hit_tokens)
    assert results["emulated"] == results["torch"]
    assert hits == {"emulated": 32, "torch": 0}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_random_models_on_the_emulated_kernels_generate_the_torch_backends_tokens(kernels, name):
    """The GPU's end-to-end check (tests/gpu/test_gpu_kernels.py), emulated: a random-weight
    model (what the air-gapped GPU host serves; head_dim 64 and 128, GQA 2 and 4, Qwen2's
    biases) with prompts of 21 and 11 tokens in chunks of 8 and a cache of 3 blocks, too
    few for both (29 and 19 tokens: 4 blocks), so a request is swapped out and back in by
    the copy kernel.
    Greedy tokens are the same as on the torch backend."""
    from bench.drive import StepRecorder
    from gpu.torch_attention import TorchAttentionBackend
    from tests.conftest import run_to_completion
    from workers.api import SamplingParams
    from workers.engine import Engine
    from workers.model_loader import load_model

    model_config = ModelConfig(source=f"random:{name}", device="cpu")
    loaded = load_model(model_config)
    c = loaded.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    block_bytes = 16 * 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4  # float32
    config = EngineConfig(
        model=model_config,
        cache=CacheConfig(kv_memory_bytes=3 * block_bytes, swap_memory_bytes=8 * block_bytes),
        scheduler=SchedulerConfig(max_prefill_chunk=8),
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France", "def fib(n):"]  # a token a character
    results, swapped = {}, {}
    for backend_name in ("emulated", "torch"):
        engine = Engine(loaded, config)
        steps = StepRecorder(engine)
        if backend_name == "emulated":
            engine.runner.backend = CupyAttentionBackend(engine.runner.kv_cache, kernels)
            engine.runner.host_pool.kernels = kernels
        else:
            engine.runner.backend = TorchAttentionBackend(engine.runner.kv_cache)
            engine.runner.host_pool.kernels = None
        arrivals = {0: [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]}
        results[backend_name] = {rid: tokens for rid, (tokens, _, _) in run_to_completion(engine, arrivals).items()}
        swapped[backend_name] = any(record.num_blocks_swapped_in for record in steps)
    assert results["emulated"] == results["torch"]
    assert all(len(tokens) == 8 for tokens in results["emulated"].values())
    assert swapped == {"emulated": True, "torch": True}


# Layers that attend otherwise (window 37, softcap 5, sinks, all three), in fp32 and a
# 16-bit dtype, GQA 4 over 2 KV heads. Decode contexts shorter than the window (20), as
# long (37), one longer (38), and longer, the window's first key mid-block and
# mid-partition (50: key 13; 100: key 63; 130: key 93, in blocks of 16 and partitions of
# 32) or on a block and partition boundary (101: key 64).
LAYER_NAMES = list(layer_cases(1))
LAYER_DTYPES = [torch.float32, torch.bfloat16]
WINDOW_CONTEXTS = [20, 37, 38, 50, 100, 101, 130]
# How a layer attends is a runtime argument, the dtype a template's: each emulated launch
# costs, so the decodes take the layer cases in alternating dtypes and the prompt chunks in
# the other, and between them every case meets every dtype.
DECODE_LAYERS = [
    pytest.param(name, LAYER_DTYPES[i % 2], id=f"{name}-{LAYER_DTYPES[i % 2]}") for i, name in enumerate(LAYER_NAMES)
]
PROMPT_LAYERS = [
    pytest.param(name, LAYER_DTYPES[1 - i % 2], id=f"{name}-{LAYER_DTYPES[1 - i % 2]}")
    for i, name in enumerate(LAYER_NAMES)
]


class RecordingKernels:
    """Launches through the emulation and records each launch's kernel and grid."""

    def __init__(self, kernels: EmulatedKernels) -> None:
        self.kernels = kernels
        self.grids: list[tuple[str, tuple[int, ...]]] = []

    def launch(self, instance, grid, block, args) -> None:
        self.grids.append((instance.kernel.name, tuple(grid)))
        self.kernels.launch(instance, grid, block, args)


@pytest.mark.parametrize(("name", "dtype"), DECODE_LAYERS)
def test_layer_decodes_around_the_window(kernels, name, dtype):
    """Each layer case's decodes in 32-token partitions (the reduce adds the sinks; a
    window's launch has only the 3 partitions 37 keys can span, not the longest context's
    5) and in one partition (the decode kernel adds them, no reduce)."""
    layer = layer_cases(8)[name]
    for partition_size, partitions in ((32, 3 if layer.window else 5), (512, 1)):
        step = make_step(dtype, 64, 16, num_kv_heads=2, group=4, chunks=decode_chunks(WINDOW_CONTEXTS),
                         seed=partition_size)  # fmt: skip
        recording = RecordingKernels(kernels)
        check_against_reference(step, backend(step, recording, partition_size), layer)
        launched = dict(recording.grids)
        assert launched["paged_decode_attention"] == (2, len(WINDOW_CONTEXTS), partitions)
        assert ("paged_decode_reduce" in launched) == (partitions > 1)


@pytest.mark.parametrize(("name", "dtype"), PROMPT_LAYERS)
def test_layer_prompt_chunks_around_the_window(kernels, name, dtype):
    """Each layer case's prompt chunks: fresh prompts shorter (21) and longer (50) than the
    window, chunks after a cached prefix whose first rows' windows start before the chunk
    (35 + 12) and mid-block (60 + 20: the first row sees keys 24 on), with a decode."""
    layer = layer_cases(8)[name]
    chunks = [(0, 50), (0, 21), (35, 12), (60, 20)] + decode_chunks([90])
    step = make_step(dtype, 64, 16, num_kv_heads=2, group=4, chunks=chunks, seed=len(name))
    check_against_reference(step, backend(step, kernels, partition_size=32), layer)


def test_all_three_at_head_dim_256_with_16_bit_sinks(kernels):
    """head_dim 256 (prefill tiles of 8 rows), blocks of 32, GQA 2, float16, sinks held in
    bfloat16 (the backend keeps an fp32 copy): window, softcap and sinks at once."""
    layer = layer_cases(4)["all"]
    layer = layer._replace(sinks=torch.linspace(-1.0, 2.0, 4).to(torch.bfloat16))
    chunks = decode_chunks([30, 80]) + [(0, 40), (45, 9)]
    step = make_step(torch.float16, 256, 32, num_kv_heads=2, group=2, chunks=chunks, seed=256)
    check_against_reference(step, backend(step, kernels, partition_size=32), layer)


@pytest.mark.parametrize("partition_size", [32, 512])
def test_a_window_reads_no_key_before_it(kernels, partition_size):
    """Every K and V row before every query's window (whole blocks and the rows of the
    block the window starts in) is NaN in the kernels' cache: the outputs stay finite and
    match the reference over the real values, for decodes partitioned or not and for a
    prompt chunk after a cached prefix."""
    layer = layer_cases(8)["all"]
    chunks = decode_chunks([100, 130, 20]) + [(60, 20)]
    step = make_step(torch.float16, 64, 16, num_kv_heads=2, group=4, chunks=chunks, seed=9)
    expected = reference_output(step, layer)
    block_size, window = step.kernel_cache.block_size, 37
    assert layer.window == window
    hidden = [(seq.block_table[pos // block_size], pos % block_size)
              for seq in step.sequences for pos in range(max(0, seq.past_len - window + 1))]  # fmt: skip
    assert len(hidden) == 63 + 93 + 0 + 24
    blocks, rows = (torch.tensor(index) for index in zip(*hidden))
    step.kernel_cache.blocks[:, :, blocks, rows] = float("nan")
    attention = backend(step, kernels, partition_size)
    got = attention.attend(0, step.query, step.key, step.value, step.scale,
                           attention.prepare(step.sequences, step.query.shape[0]), layer)  # fmt: skip
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=1e-3)


def test_layer_arguments_are_checked_and_sinks_copied_once(kernels):
    """A window under one key, a softcap not above 0, or a sink count other than the
    query heads' are refused; a sinks tensor is copied to fp32 once, and again only
    once it changes (the copy's address is what a CUDA graph's launches keep)."""
    step = make_step(torch.float32, 64, 16, num_kv_heads=2, group=4, chunks=decode_chunks([40]))
    attention = backend(step, kernels)
    metadata = attention.prepare(step.sequences, 1)
    for layer in (LayerAttention(window=0), LayerAttention(softcap=0.0), LayerAttention(sinks=torch.zeros(4))):
        with pytest.raises(ValueError):
            attention.attend(0, step.query, step.key, step.value, step.scale, metadata, layer)
    sinks = torch.ones(8, dtype=torch.bfloat16)
    layer = LayerAttention(sinks=sinks)
    first = attention.attend(0, step.query, step.key, step.value, step.scale, metadata, layer)
    copies = {id(c) for _, _, c in attention._sinks.values()}
    attention.attend(0, step.query, step.key, step.value, step.scale, metadata, layer)
    assert {id(c) for _, _, c in attention._sinks.values()} == copies
    sinks.fill_(30.0)  # a sink that outweighs every score: the output shrinks towards 0
    second = attention.attend(0, step.query, step.key, step.value, step.scale, metadata, layer)
    assert second.abs().max() < first.abs().max() / 100
    with torch.inference_mode():  # an inference tensor keeps no version: copied once all the same
        inference_layer = LayerAttention(sinks=torch.ones(8))
        third = attention.attend(0, step.query, step.key, step.value, step.scale, metadata, inference_layer)
    assert torch.equal(third, first)
