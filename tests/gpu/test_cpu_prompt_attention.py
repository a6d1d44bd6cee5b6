"""The CPU prompt kernel (`gpu/cpu/kernels/cpu_prompt_attention.cpp`) matches the torch
reference for fresh prompts and later chunks, in float32 and bfloat16, in every build, for
full attention and for layers with a sliding window, a softcap or sinks; the
CPU backend runs prompt chunks on it, and falls back to torch's SDPA for a chunk it
declines or where it cannot be built, without touching the decode kernel."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from gpu.cpu import native_build
from gpu.cpu.attention import CpuAttentionBackend, cpu_kernel, cpu_prompt_kernel, load_prompt_kernel
from gpu.torch_attention import TorchAttentionBackend, explicit_attention
from tests.attention_cases import TOLERANCES, check_against_reference, layer_cases, make_step, reference_output
from tests.gpu.test_cpu_attention import AVX2_CPU_CXX_FLAGS, has_cpu_flags

pytestmark = pytest.mark.skipif(
    cpu_kernel() is None or cpu_prompt_kernel() is None, reason="g++ cannot build the CPU kernels here"
)

# AVX-512 without the BF16 dot products: bfloat16 keys widened to fp32 for the scores.
AVX512_CPU_CXX_FLAGS = (*AVX2_CPU_CXX_FLAGS, "-mavx512f", "-mavx512vl")


# This CPU's build without the tile unit: the AVX-512 BF16 dot products where AMX would run.
NO_AMX_CPU_CXX_FLAGS = (*native_build.CPU_CXX_FLAGS, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


@pytest.fixture(scope="module", params=["native", "no-amx", "avx512", "avx2", "portable"])
def prompt_kernel(request):
    """The prompt kernel as built for this CPU (on AMX, bfloat16 on tiles), for it without
    AMX, for AVX-512 without BF16, for AVX2 alone, and without -march=native (the portable
    loops every CPU runs)."""
    needs = {
        "no-amx": ("amx_bf16", "avx512_bf16"),
        "avx512": ("avx512f", "avx512vl"),
        "avx2": ("avx2", "fma"),
    }.get(request.param, ())
    if not has_cpu_flags(*needs):
        pytest.skip(f"this CPU has no {needs}")
    flags = {
        "no-amx": NO_AMX_CPU_CXX_FLAGS,
        "avx512": AVX512_CPU_CXX_FLAGS,
        "avx2": AVX2_CPU_CXX_FLAGS,
        "portable": native_build.PORTABLE_CPU_CXX_FLAGS,
    }.get(request.param)
    return cpu_prompt_kernel() if flags is None else load_prompt_kernel(flags)


def call_kernel(kernel, out, q, k, v, past_len, scale, window=0, softcap=0.0, sinks=None):
    sinks = None if sinks is None else sinks.data_ptr()  # fp32, contiguous
    return kernel.entries[q.dtype](
        out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        q.shape[0], past_len, q.shape[1], k.shape[1], q.shape[2], scale, window, softcap, sinks,
        torch.get_num_threads(),
    )  # fmt: skip


def prompt_rows(step) -> list[int]:
    return [seq.query_start + i for seq in step.sequences if seq.query_len > 1 or seq.past_len == 0
            for i in range(seq.query_len)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (64, 3), (128, 4)])
def test_prompt_chunks_match_the_reference(prompt_kernel, dtype, head_dim, group):
    """Fresh prompts of one token, either side of a tile of 16 and a few tiles long, and
    later chunks whose offsets fall inside blocks, in one step. bfloat16 against the
    float32 reference over the same values, within bfloat16's rounding of the output."""
    chunks = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 100), (20, 15), (16, 16), (33, 17), (7, 100), (5, 2)]
    step = make_step(dtype, head_dim, 16, num_kv_heads=2, group=group, chunks=chunks, seed=group * head_dim)
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache, prompt_kernel=prompt_kernel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (64, 3), (128, 4)])
@pytest.mark.parametrize("case", list(layer_cases(1)))
def test_layers_that_attend_otherwise_match_the_reference(prompt_kernel, dtype, head_dim, group, case):
    """A sliding window (37 keys), a softcap, sinks and all three: fresh prompts shorter
    and longer than the window (up to several key blocks of 64 past it, which the kernel
    skips), later chunks after cached prefixes shorter and longer than it (the blocks
    before the window not gathered), GQA included, with decodes in the same step."""
    chunks = [(0, 1), (0, 17), (0, 40), (0, 200), (20, 15), (33, 17), (7, 100), (90, 40), (300, 3), (40, 1)]
    layer = layer_cases(2 * group)[case]
    step = make_step(dtype, head_dim, 16, num_kv_heads=2, group=group, chunks=chunks, seed=group * head_dim + 1)
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache, prompt_kernel=prompt_kernel), layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(layer_cases(1)))
def test_the_kernel_windows_strided_inputs_from_the_offset(prompt_kernel, dtype, case):
    """The kernel alone, over keys it is handed whole: query token i at past_len + i sees
    the last 37 keys up to its own. The keys before the first query's window, whole
    blocks of 64, are NaN and not read (a softcap or sinks alone read them all)."""
    past, length, heads, kv_heads, head_dim = 150, 40, 6, 2, 64
    layer = layer_cases(heads)[case]
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(length, heads, 2 * head_dim, generator=generator).to(dtype)[:, :, :head_dim]
    kv = torch.randn(past + length, 2, kv_heads, head_dim + 16, generator=generator).to(dtype)[..., :head_dim]
    k, v = kv[:, 0], kv[:, 1]
    positions = past + torch.arange(length).unsqueeze(1)
    visible = torch.arange(past + length) <= positions
    if layer.window is not None:
        visible &= torch.arange(past + length) > positions - layer.window
    group = heads // kv_heads
    expected = explicit_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(group, 1).transpose(0, 1),
        v.float().repeat_interleave(group, 1).transpose(0, 1), visible, 0.125, layer.softcap,
        None if layer.sinks is None else layer.sinks.view(-1, 1, 1),
    ).transpose(0, 1)  # fmt: skip
    if layer.window is not None:
        kv[:64] = float("nan")  # wholly before the first query's window (from key 114)
    out = torch.full((length, heads, head_dim), float("nan"), dtype=dtype)
    window, softcap = layer.window or 0, layer.softcap or 0.0
    assert call_kernel(prompt_kernel, out, q, k, v, past, 0.125, window, softcap, layer.sinks) == 0
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


def test_a_window_gathers_only_its_blocks():
    """A later chunk of a windowed layer: every cache block before the one holding its
    first query's window is NaN, and its output is finite and matches the reference."""
    window, block_size = 37, 16
    layer = layer_cases(6)["all"]
    step = make_step(torch.float32, 64, block_size, num_kv_heads=2, group=3, chunks=[(250, 20)], seed=8)
    expected = reference_output(step, layer)
    seq = step.sequences[0]
    backend = CpuAttentionBackend(step.kernel_cache)
    metadata = backend.prepare(step.sequences, step.query.shape[0])
    before = seq.block_table[: (seq.past_len - window + 1) // block_size]
    step.kernel_cache.blocks[:, :, before] = float("nan")
    got = backend.attend(0, step.query, step.key, step.value, step.scale, metadata, layer)
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prompt(prompt_kernel, dtype):
    """SmolLM2's heads (9 over 3 KV heads of 64) over a 300-token prompt: many tiles and
    key blocks, the work shared among threads."""
    step = make_step(dtype, 64, 16, num_kv_heads=3, group=3, chunks=[(0, 300)], seed=300)
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache, prompt_kernel=prompt_kernel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_strided_inputs_causally_from_the_offset(prompt_kernel, dtype):
    """Query token i sits at position past_len + i and sees keys 0..past_len + i; queries,
    keys and values are read through their token and head strides (here views into wider
    tensors), the output written contiguous."""
    past, length, heads, kv_heads, head_dim = 21, 19, 8, 2, 64
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(length, heads, 2 * head_dim, generator=generator).to(dtype)[:, :, :head_dim]
    kv = torch.randn(past + length, 2, kv_heads, head_dim + 16, generator=generator).to(dtype)[..., :head_dim]
    k, v = kv[:, 0], kv[:, 1]
    out = torch.full((length, heads, head_dim), float("nan"), dtype=dtype)
    assert call_kernel(prompt_kernel, out, q, k, v, past, 0.125) == 0

    visible = torch.arange(past + length) <= past + torch.arange(length).unsqueeze(1)
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=visible, scale=0.125, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_matches_the_torch_backend(dtype):
    """Decodes on the decode kernel and prompt chunks (fresh and later) on the prompt
    kernel, in one batch, against `TorchAttentionBackend.attend` in float32."""
    chunks = [(40, 1), (0, 9), (5, 1), (33, 12), (200, 1), (0, 40), (64, 20)]
    step = make_step(dtype, 64, 16, num_kv_heads=3, group=3, chunks=chunks, seed=11)
    check_against_reference(step, CpuAttentionBackend(step.kernel_cache))


def torch_and_cpu_outputs(step, backend):
    torch_cache = copy.deepcopy(step.kernel_cache)
    num_tokens = step.query.shape[0]
    return (
        b.attend(0, step.query, step.key, step.value, step.scale, b.prepare(step.sequences, num_tokens))
        for b in (backend, TorchAttentionBackend(torch_cache))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_size_the_kernel_declines_falls_back_to_sdpa(dtype):
    """Head sizes that are not a multiple of 16: the kernel says no (nonzero status, the
    output untouched), and those prompt chunks are torch's own attention, bit for bit;
    the decodes stay on the decode kernel."""
    kernel = cpu_prompt_kernel()
    q, kv = torch.randn(3, 2, 72).to(dtype), torch.randn(3, 1, 72).to(dtype)
    out = torch.zeros_like(q)
    assert call_kernel(kernel, out, q, kv, kv, 0, 0.1) != 0
    assert not out.any()

    step = make_step(dtype, 72, 16, num_kv_heads=2, group=2, chunks=[(0, 20), (30, 1), (17, 5)], seed=72)
    got, on_torch = torch_and_cpu_outputs(step, CpuAttentionBackend(step.kernel_cache))
    rows = prompt_rows(step)
    assert torch.equal(got[rows], on_torch[rows])
    torch.testing.assert_close(got.float(), on_torch.float(), **TOLERANCES[dtype])


def test_the_kernel_rejects_heads_that_do_not_share_kv_heads_evenly():
    q, kv = torch.randn(3, 5, 64), torch.randn(3, 2, 64)
    assert call_kernel(cpu_prompt_kernel(), torch.empty_like(q), q, kv, kv, 0, 0.1) != 0


def test_a_declined_chunk_alone_falls_back():
    """A kernel that declines (nonzero status) sends its chunks to SDPA, chunk by chunk."""
    declining = type("Declining", (), {"entries": {torch.float32: lambda *args: 1}})()
    step = make_step(torch.float32, 64, 16, num_kv_heads=2, group=2, chunks=[(0, 20), (30, 1), (17, 5)], seed=1)
    got, on_torch = torch_and_cpu_outputs(step, CpuAttentionBackend(step.kernel_cache, prompt_kernel=declining))
    rows = prompt_rows(step)
    assert torch.equal(got[rows], on_torch[rows])


def test_without_the_prompt_kernel_decodes_keep_their_kernel(monkeypatch, tmp_path, caplog):
    """The prompt kernel cannot be built (no g++, nothing cached): a warning, prompt chunks
    on torch's SDPA, and the decode kernel (already built) still in use."""
    decode_kernel = cpu_kernel()
    monkeypatch.setenv("INFLIGHT_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    cpu_prompt_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="inflight.native"):
            assert cpu_prompt_kernel() is None
        assert "cpu_prompt_attention unavailable" in caplog.text and "using torch prompt attention" in caplog.text
        step = make_step(torch.float32, 64, 16, num_kv_heads=3, group=3, chunks=[(0, 9), (40, 1)], seed=6)
        backend = CpuAttentionBackend(step.kernel_cache)
        assert backend.prompt_entry is None and backend.entry is decode_kernel.entries[torch.float32]
        check_against_reference(step, backend)
    finally:
        cpu_prompt_kernel.cache_clear()


def test_bfloat16_output_rounds_like_torch(prompt_kernel):
    """The output's rounding to bfloat16: nearest-even as torch rounds, a NaN stays NaN.
    With zero queries every visible key weighs the same, so the second token's output is
    the mean of two value rows, exact in fp32: chosen to be halfway between bfloat16s."""
    dtype = torch.bfloat16
    step = make_step(dtype, 64, 16, num_kv_heads=1, group=1, chunks=[(0, 2), (0, 1)], seed=3)
    query = torch.zeros_like(step.query)
    value = torch.randn(3, 1, 64).to(dtype)
    value[0, 0, :2] = torch.tensor([1.0, 1 + 2**-7])
    value[1, 0, :2] = torch.tensor([1 + 2**-7, 1 + 2**-6])  # means: 1 + 2^-8 and 1 + 3 * 2^-8, ties
    value[2, 0, 0] = float("nan")
    backend = CpuAttentionBackend(step.kernel_cache, prompt_kernel=prompt_kernel)
    out = backend.attend(0, query, step.key, value, step.scale, backend.prepare(step.sequences, 3))
    assert torch.equal(out[0, 0], value[0, 0])
    assert torch.equal(out[1, 0], ((value[0, 0].float() + value[1, 0].float()) / 2).to(dtype))
    assert out[1, 0, :2].tolist() == [1.0, 1 + 2**-6]
    assert out[2, 0, 0].isnan() and torch.equal(out[2, 0, 1:], value[2, 0, 1:])
