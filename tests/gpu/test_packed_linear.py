"""Packed linears (oneDNN, or the AMX kernel) compute what `nn.Linear` computes, for any row count."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaMLP

from gpu.cpu.fusions import FusedGatedMLP, fused_ops
from gpu.cpu.packed_linear import (
    ONEDNN_CACHE_VARIABLES,
    PackedLinear,
    amx_kernel,
    can_pack,
    onednn_packs,
    pack_linears,
)

BF16_PACKS = pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN packs bfloat16 only with AVX-512 here")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 3e-2, marks=BF16_PACKS)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(dtype, atol, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for shape in [(0, 96), (1, 96), (1, 7, 96), (3, 64, 96), (513, 96)]:
        x = torch.randn(shape, dtype=dtype)
        with torch.inference_mode():
            got, want = packed(x), linear(x)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-2)


@pytest.mark.skipif(amx_kernel() is None, reason="this CPU has no AMX")
def test_on_amx_bfloat16_linears_run_the_tile_kernel_and_others_onednn():
    """bfloat16 with both sides multiples of 32 runs on the tile kernel, for any row count
    (rows read through their stride); a side that is not, and float32, stay on oneDNN."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).bfloat16()
    tiled = PackedLinear(linear)
    assert tiled.on_amx
    assert not PackedLinear(nn.Linear(64, 100).bfloat16()).on_amx
    assert not PackedLinear(nn.Linear(64, 96)).on_amx
    wide = torch.randn(70, 128, dtype=torch.bfloat16)
    for x in (wide[:, 32:96], wide[:1, :64], wide[:33, :64].reshape(3, 11, 64)):
        with torch.inference_mode():
            got = tiled(x)
        want = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1e-2)


@pytest.mark.skipif(amx_kernel() is None, reason="this CPU has no AMX")
def test_on_amx_a_gated_mlp_gets_silu_times_up_from_the_product_pass():
    """A gated MLP's gate and up projections, packed with their halves interleaved: the
    linear still returns [gate, up] in place, and `silu_mul` returns bit for bit what the
    separate SiLU-product pass (`silu_mul_bf16`) makes of that output."""
    torch.manual_seed(0)
    mlp = FusedGatedMLP(LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96)).bfloat16())
    plain = PackedLinear(mlp.gate_up_proj)
    gated = PackedLinear(mlp.gate_up_proj, gated=True)
    assert gated.gated and not plain.gated
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        gate_up = gated(x)
        assert torch.equal(gate_up, plain(x))
        want = torch.empty(37, 96, dtype=torch.bfloat16)
        fused_ops().silu_mul_bf16(gate_up.data_ptr(), 192, want.data_ptr(), 37, 96, 1)
        assert torch.equal(gated.silu_mul(x), want)
        mlp.gate_up_proj = gated
        torch.testing.assert_close(
            mlp(x).float(), F.linear(want.float(), mlp.down_proj.weight.float()), atol=3e-2, rtol=1e-2
        )


def test_pack_linears_replaces_every_linear_and_keeps_the_logits():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    packed = copy.deepcopy(model)
    assert can_pack(packed)
    # 7 per layer (q, k, v, o, gate, up, down) and the LM head.
    assert pack_linears(packed) == 2 * 7 + 1
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert pack_linears(packed) == 0  # packing twice changes nothing
    ids = torch.randint(0, 512, (1, 33))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def test_float16_is_left_alone():
    assert not can_pack(nn.Linear(8, 8).half())


def test_bfloat16_is_packed_only_where_onednn_can():
    """On a CPU without the instructions oneDNN's bfloat16 packing needs, the model keeps
    its plain linears (and still serves: see the engine's bfloat16 test)."""
    assert can_pack(nn.Linear(8, 8).to(torch.bfloat16)) == onednn_packs(torch.bfloat16)


# Loads a model (which bounds oneDNN's caches), then runs SmolLM2's three linear shapes at
# each of 300 row counts, as a continuous batcher's steps do; prints the growth of its
# RSS in MB.
ROW_COUNTS_PROBE = textwrap.dedent("""
    import torch
    from torch import nn
    from gpu.cpu.packed_linear import PackedLinear
    from workers.config import ModelConfig
    from workers.model_loader import load_model

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    load_model(ModelConfig(source="random:tiny-llama", dtype="float32", device="cpu", threads=1))
    shapes = [(576, 960), (576, 3072), (1536, 576)]
    linears = [PackedLinear(nn.Linear(inputs, outputs, bias=False)) for inputs, outputs in shapes]
    with torch.inference_mode():
        for linear in linears:  # the largest buffers first, so growth is what the caches keep
            linear(torch.randn(300, linear.in_features))
        start = rss_mb()
        for rows in range(1, 301):
            for linear in linears:
                linear(torch.randn(rows, linear.in_features))
    print(rss_mb() - start)
""")


def rss_growth_mb(environment: dict[str, str]) -> float:
    env = {key: value for key, value in os.environ.items() if key not in ONEDNN_CACHE_VARIABLES}
    result = subprocess.run(
        [sys.executable, "-c", ROW_COUNTS_PROBE],
        env=env | environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return float(result.stdout.split()[-1])


@pytest.mark.skipif(not onednn_packs(torch.float32), reason="oneDNN is not available")
def test_a_loaded_model_keeps_onednn_from_holding_memory_for_every_row_count():
    """oneDNN and ideep cache a primitive per row count, each with its buffers; a
    batcher's steps bring a new row count almost every time. With the caches as
    `load_model` bounds them, memory grows a fraction of what the libraries' defaults let
    it, and a capacity set in the environment is kept."""
    bounded = rss_growth_mb({})
    library_default = rss_growth_mb(dict.fromkeys(ONEDNN_CACHE_VARIABLES, "1024"))
    assert bounded < library_default / 3, (bounded, library_default)
