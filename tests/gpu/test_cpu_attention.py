"""The CPU decode kernel (`gpu/cpu/kernels/cpu_paged_decode.cpp`) matches the torch reference
in float32 and bfloat16, for full attention and for layers with a sliding window, a
softcap or sinks (reading only the blocks a window holds), is what a float32 or bfloat16
CPU engine runs on, and is never required: without g++ the engine stays on the torch
reference."""

from __future__ import annotations

import logging

import pytest
import torch

from gpu.attention import LayerAttention
from gpu.backends import select_backend
from gpu.cpu import native_build
from gpu.cpu.attention import CpuAttentionBackend, cpu_kernel, load_kernel
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.torch_attention import TorchAttentionBackend
from tests.attention_cases import (
    BLOCK_SIZES,
    TOLERANCES,
    check_against_reference,
    check_far_cache_against_reference,
    decode_chunks,
    far_cache,
    layer_cases,
    make_step,
    reference_output,
)

pytestmark = pytest.mark.skipif(cpu_kernel() is None, reason="g++ cannot build the CPU kernel here")


def has_cpu_flags(*flags: str) -> bool:
    return set(flags) <= set(native_build.cpu_identity().split())


# AVX2 without AVX-512: bfloat16 widened by a shift where the native build (on a CPU with
# AVX-512 BF16) uses the bfloat16 dot-product instructions.
AVX2_CPU_CXX_FLAGS = (*native_build.PORTABLE_CPU_CXX_FLAGS, "-mavx2", "-mfma")


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def kernel(request):
    """The kernel as built for this CPU (AVX2 loops where it has AVX2, AVX-512 BF16 dot
    products where it has those), for AVX2 alone, and without -march=native (the portable
    loops every CPU runs)."""
    if request.param == "avx2" and not has_cpu_flags("avx2", "fma"):
        pytest.skip("this CPU has no AVX2")
    flags = {"avx2": AVX2_CPU_CXX_FLAGS, "portable": native_build.PORTABLE_CPU_CXX_FLAGS}.get(request.param)
    return cpu_kernel() if flags is None else load_kernel(flags)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 64 and 128 are specialised, 80 is the generic path
def test_decodes_match_the_reference(kernel, dtype, head_dim, group, block_size):
    """Contexts of every length class: shorter than a block, ending on a block boundary,
    and spanning many blocks, scattered over the pool. bfloat16 against the float32
    reference over the same values, within bfloat16's rounding of the output."""
    step = make_step(dtype, head_dim, block_size, num_kv_heads=3, group=group,
                     chunks=decode_chunks([2, block_size, 3 * block_size + 1, 300, 37]),
                     seed=group * head_dim + block_size)  # fmt: skip
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache, kernel))


# The cases' window is 37 keys: contexts shorter than it, of exactly it and one more,
# ending with the window's first key mid-block (at both block sizes), and far past it.
WINDOW_CONTEXTS = [2, 20, 36, 37, 38, 50, 71, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("head_dim", "group"), [(64, 4), (128, 1), (80, 3)])  # 80: the generic path
@pytest.mark.parametrize("case", list(layer_cases(1)))
def test_layers_that_attend_otherwise_match_the_reference(kernel, dtype, head_dim, group, block_size, case):
    """A sliding window, a softcap, sinks and all three, over contexts either side of the
    window, GQA included: bfloat16 against the float32 reference over the same values."""
    num_kv_heads = 2
    layer = layer_cases(num_kv_heads * group)[case]
    step = make_step(dtype, head_dim, block_size, num_kv_heads=num_kv_heads, group=group,
                     chunks=decode_chunks(WINDOW_CONTEXTS), seed=group * head_dim + block_size)  # fmt: skip
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache, kernel), layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_a_window_reads_only_its_blocks(kernel, dtype, head_dim):
    """Every block of the pool but those holding a decode's window is NaN: the output is
    finite and matches the reference over the clean cache, so the blocks wholly before
    a window (and the keys before it in its first block, weighted 0 or not) are not read."""
    window, block_size = 37, 16
    layer = layer_cases(6)["all"]
    step = make_step(dtype, head_dim, block_size, num_kv_heads=2, group=3,
                     chunks=decode_chunks([300, 50, 38, 517, 37, 5]), seed=head_dim)  # fmt: skip
    expected = reference_output(step, layer)
    cache = step.kernel_cache
    backend = CpuAttentionBackend(cache, kernel)
    metadata = backend.prepare(step.sequences, step.query.shape[0])
    kept: set[int] = set()
    for seq in step.sequences:  # the blocks from the one holding the window's first key on
        first = max(0, seq.context_len - window) // block_size
        kept.update(seq.block_table[first : -(-seq.context_len // block_size)])
    poisoned = [b for b in range(cache.num_blocks) if b not in kept]
    assert len(poisoned) > 30
    cache.blocks[:, :, poisoned] = float("nan")
    got = backend.attend(0, step.query, step.key, step.value, step.scale, metadata, layer)
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_are_read_as_float32_once(dtype):
    """A layer's sinks, in its model's dtype, become a float32 copy for the kernel once,
    not every layer call, and again only if they change in place (an inference tensor,
    which keeps no version count, every call)."""
    step = make_step(dtype, 64, 16, num_kv_heads=2, group=2, chunks=decode_chunks([40, 7]), seed=9)
    backend = CpuAttentionBackend(step.kernel_cache)
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=dtype)
    first = backend._sinks_for(sinks, 4)
    assert first.dtype == torch.float32 and first.is_contiguous() and backend._sinks_for(sinks, 4) is first
    with torch.no_grad():
        sinks.add_(1)
    again = backend._sinks_for(sinks, 4)
    assert again is not first and torch.equal(again, sinks.float())
    with torch.inference_mode():
        made_in_inference = torch.ones(4, dtype=dtype)
    assert torch.equal(backend._sinks_for(made_in_inference, 4), torch.ones(4))
    with pytest.raises(ValueError, match="3 sinks for 4 query heads"):
        backend._sinks_for(sinks[:3], 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", [None, 100])
def test_sequences_sharing_leading_blocks(kernel, dtype, block_size, window):
    """Forks of one prompt and requests behind one cached prefix read the same blocks:
    attended together (more than a group's worth, a prefix ending inside a block, a
    request sharing less than the rest, one sharing nothing), each output matches the
    reference and equals, bit for bit, that sequence attended alone. With a window of
    100, the contexts within it (all at blocks of 16) group as without one, and those
    past it (most at 32) go alone."""
    layer = LayerAttention(window=window)
    contexts = [5 * block_size + 3] * 10 + [3 * block_size, 4 * block_size + 1, 2 * block_size + 7, 40]
    step = make_step(dtype, 64, block_size, num_kv_heads=3, group=3,
                     chunks=decode_chunks(contexts), seed=block_size)  # fmt: skip
    lead = step.sequences[0].block_table
    shares = [5] * 10 + [3, 4, 1, 0]  # leading blocks shared with the first sequence
    for seq, shared in zip(step.sequences, shares):
        seq.block_table[:shared] = lead[:shared]
    backend = CpuAttentionBackend(step.kernel_cache, kernel)
    check_against_reference(step, backend, layer)

    num_tokens = step.query.shape[0]
    together = backend.attend(0, step.query, step.key, step.value, step.scale,
                              backend.prepare(step.sequences, num_tokens), layer)  # fmt: skip
    cache = step.kernel_cache
    for seq in step.sequences:
        alone = torch.zeros_like(together)
        backend.attend_decodes(alone, step.query, cache.key_pools[0], cache.value_pools[0], step.scale,
                               backend.prepare_decodes([seq]), layer)  # fmt: skip
        assert torch.equal(together[seq.query_start], alone[seq.query_start])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_runs_decodes_and_prompt_chunks_on_the_kernels(kernel, dtype):
    """Decodes on this kernel, a fresh prompt and a later chunk on the prompt kernel
    (`test_cpu_prompt_attention.py`), in one batch: all within the reference's tolerance,
    bfloat16 against the float32 reference over the same values."""
    chunks = [(40, 1), (0, 9), (5, 1), (33, 12), (200, 1)]
    step = make_step(dtype, 64, 16, num_kv_heads=3, group=3, chunks=chunks, seed=11)
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache, kernel))


def test_a_step_without_decodes():
    step = make_step(torch.float32, 64, 16, num_kv_heads=3, group=3, chunks=[(0, 5), (16, 3)], seed=2)
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_past_2_31_elements(kernel, dtype):
    """Slot offsets are 64-bit: blocks past 2^31 elements of the pool are read where they are."""
    step = make_step(dtype, 128, 16, num_kv_heads=8, group=4, chunks=decode_chunks([70, 45]), seed=5)
    base = 2**31 // (16 * 8 * 128) + 3
    cache, sequences = far_cache(step, base)
    assert cache.key_pools[0].numel() > 2**31
    check_far_cache_against_reference(step, cache, sequences, CpuAttentionBackend(cache, kernel), base)


def test_float32_and_bfloat16_cpu_caches_get_the_kernel_others_the_reference():
    shape = KVShape(num_layers=1, num_kv_heads=3, head_dim=64)
    assert type(select_backend(PagedKVCache(shape, 4, 16, torch.float32))) is CpuAttentionBackend
    assert type(select_backend(PagedKVCache(shape, 4, 16, torch.bfloat16))) is CpuAttentionBackend
    assert type(select_backend(PagedKVCache(shape, 4, 16, torch.float16))) is TorchAttentionBackend


def test_bfloat16_special_values_round_like_torch(kernel):
    """The output's rounding to bfloat16: nearest-even as torch rounds, a NaN stays NaN."""
    step = make_step(torch.bfloat16, 64, 16, num_kv_heads=1, group=1, chunks=decode_chunks([1, 1, 20]), seed=3)
    cache = step.kernel_cache
    backend = CpuAttentionBackend(cache, kernel)
    # One-token contexts: the output is the value row itself, whatever its bits.
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8], dtype=torch.float32)  # ties in bfloat16
    value = torch.randn(3, 1, 64).to(torch.bfloat16)
    value[0, 0, :2] = halfway.to(torch.bfloat16)
    value[1, 0, 0] = float("nan")
    out = backend.attend(0, step.query, step.key, value, step.scale, backend.prepare(step.sequences, 3))
    assert torch.equal(out[0, 0], value[0, 0])
    assert out[1, 0, 0].isnan() and torch.equal(out[1, 0, 1:], value[1, 0, 1:])


def test_without_a_compiler_the_engine_uses_the_reference(monkeypatch, tmp_path, caplog):
    """No g++ on PATH and nothing cached: a warning, and the torch reference."""
    monkeypatch.setenv("INFLIGHT_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    cpu_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="inflight.native"):
            assert cpu_kernel() is None
        assert "cpu_paged_decode unavailable" in caplog.text and "using torch attention" in caplog.text
        cache = PagedKVCache(KVShape(num_layers=1, num_kv_heads=3, head_dim=64), 4, 16, torch.float32)
        assert type(select_backend(cache)) is TorchAttentionBackend
        assert list(tmp_path.iterdir()) == []  # no half-built library left behind
    finally:
        cpu_kernel.cache_clear()


def test_the_build_is_keyed_to_this_cpu(monkeypatch):
    """A cache directory shared between machines never hands one machine a library built
    with another CPU's instructions (the kernel is built with -march=native)."""
    source = (native_build.KERNELS / "cpu_paged_decode.cpp").read_text()
    key = ("cpu_paged_decode", source, native_build.CPU_CXX_FLAGS, native_build.CPU_HEADERS)
    here = native_build.library_path(*key)
    monkeypatch.setattr(native_build, "cpu_identity", lambda: "model name: another CPU")
    elsewhere = native_build.library_path(*key)
    assert elsewhere != here
