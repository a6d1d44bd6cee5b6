"""int8 linears compute the float linear of their dequantized weight, on both kernels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu.cpu.int8_linear import INT8PACK_MAX_ROWS, Int8Linear, quantize_linears, quantize_per_channel

# Row counts on each side of the crossover, for each activation dtype.
ROWS = sorted({1, 3, INT8PACK_MAX_ROWS[torch.bfloat16], INT8PACK_MAX_ROWS[torch.bfloat16] + 1, 64, 300})


def test_quantization_is_symmetric_per_output_channel():
    torch.manual_seed(0)
    weight = torch.randn(64, 96)
    weight[5] *= 100  # one loud channel must not coarsen the others
    weight[7] = 0
    quantized, scales = quantize_per_channel(weight, torch.float32)
    assert quantized.dtype == torch.int8 and scales.shape == (64,)
    assert quantized.abs().amax(dim=1)[torch.arange(64) != 7].eq(127).all()
    assert quantized[7].eq(0).all()
    error = (quantized.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-6).all()  # rounding to the nearest step


def test_bfloat16_scales_are_exact_in_bfloat16():
    """Both kernels see the same weight: the int8 one takes its scales in the activations' dtype."""
    _, scales = quantize_per_channel(torch.randn(32, 64), torch.bfloat16)
    assert torch.equal(scales.to(torch.bfloat16).float(), scales)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_the_dequantized_float_linear(dtype, atol, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    int8 = Int8Linear(linear)
    dequantized = nn.Linear(96, 160, bias=bias)
    with torch.no_grad():
        dequantized.weight.copy_(int8.weight_int8.float() * int8.scales[:, None])
        if bias:
            dequantized.bias.copy_(linear.bias.float())
    for rows in ROWS:
        for shape in [(rows, 96), (1, rows, 96)]:
            x = torch.randn(shape, dtype=dtype)
            with torch.inference_mode():
                got = int8(x)
                want = dequantized(x.float())
            assert got.shape == (*shape[:-1], 160) and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, atol=atol, rtol=2e-2, msg=f"{rows} rows, {dtype}")


def test_int8_linear_stays_close_to_the_original_weights():
    torch.manual_seed(0)
    linear = nn.Linear(576, 576, bias=False)
    x = torch.randn(8, 576)
    with torch.inference_mode():
        want = linear(x)
        relative = (Int8Linear(linear)(x) - want).norm() / want.norm()
    assert relative < 0.01


def test_quantize_linears_keeps_the_lm_head_and_frees_the_dense_weights():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 8)), nn.Linear(8, 32))
    head = model[3]
    assert quantize_linears(model, skip=(head,)) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear)
    assert model[3] is head
    assert not any(p.dtype.is_floating_point and p.dim() == 2 for p in model[0].parameters())


def test_float16_is_refused():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        Int8Linear(nn.Linear(8, 8).half())
