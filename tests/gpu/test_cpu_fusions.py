"""The fused CPU modules compute what the modules they replace compute, in float32 and
bfloat16."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config

from gpu.cpu import fusions as cpu_fusions
from gpu.cpu.fusions import FusedGatedMLP, FusedRMSNorm, ProjectionSlice, fuse_for_cpu, fused_ops
from gpu.cpu.native_build import PORTABLE_CPU_CXX_FLAGS, cpu_identity

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
CONFIGS = {
    "llama": LlamaConfig(**TINY),
    "llama-mlp-bias": LlamaConfig(**TINY, mlp_bias=True),
    "qwen2": Qwen2Config(**TINY),
    "mistral": MistralConfig(**TINY, sliding_window=None),
}


def tiny(config) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at exactly 1 (Gemma's at 0): give them weights to apply
        for name, parameter in model.named_parameters():
            if "norm" in name or "bias" in name:
                parameter.normal_(1.0, 0.1)
    return model


@pytest.fixture(params=["native", "avx2", "portable", "torch"])
def ops(request, monkeypatch):
    """The one-pass operations as built for this CPU, for AVX2 alone (bfloat16 rounded
    without AVX-512 BF16), built portable (no AVX2), and absent (no g++: the torch
    fallback)."""
    if request.param != "torch" and fused_ops() is None:
        pytest.skip("g++ cannot build the CPU fused ops here")
    if request.param == "avx2" and not {"avx2", "fma"} <= set(cpu_identity().split()):
        pytest.skip("this CPU has no AVX2")
    library = {"native": fused_ops, "portable": lambda: fused_ops(PORTABLE_CPU_CXX_FLAGS),
               "avx2": lambda: fused_ops((*PORTABLE_CPU_CXX_FLAGS, "-mavx2", "-mfma")),
               "torch": lambda: None}[request.param]()  # fmt: skip
    monkeypatch.setattr(cpu_fusions, "fused_ops", lambda: library)
    return request.param


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fused_model_gives_the_same_logits(arch, ops):
    model = tiny(CONFIGS[arch])
    fused = copy.deepcopy(model)
    # Per layer: two norms, the MLP and the attention's projections; plus the final norm.
    assert fuse_for_cpu(fused) == 2 * 4 + 1
    assert sum(isinstance(m, FusedRMSNorm) for m in fused.modules()) == 5
    assert sum(isinstance(m, FusedGatedMLP) for m in fused.modules()) == 2
    assert fuse_for_cpu(fused) == 0  # fusing twice changes nothing
    ids = torch.randint(0, 512, (1, 37))
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fused_bfloat16_model_gives_the_same_logits(arch, ops):
    """Within bfloat16's rounding: the fused operations round where HF's modules do, but
    sum the norm's squares in another order and SiLU's exponential differs in the last bit."""
    model = tiny(CONFIGS[arch]).to(torch.bfloat16)
    fused = copy.deepcopy(model)
    assert fuse_for_cpu(fused) == 2 * 4 + 1
    ids = torch.randint(0, 512, (1, 37))
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits.float(), model(ids).logits.float(), atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 3, 700])
def test_bfloat16_norm_keeps_hfs_rounding(ops, rows):
    """HF's norm casts back to bfloat16 before applying the weight (F.rms_norm would not):
    the fused norm gives HF's bits, but where the sum of squares' order moves the scale by
    an ulp, and those few elements differ by one bfloat16 step."""
    torch.manual_seed(rows)
    hf_norm = tiny(CONFIGS["llama"]).model.norm.to(torch.bfloat16)
    x = (torch.randn(1, rows, 64) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        want, got = hf_norm(x), FusedRMSNorm(hf_norm)(x)
    assert got.dtype == torch.bfloat16
    assert (got == want).float().mean() >= 0.99
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("rows", [1, 3, 700])
def test_bfloat16_gated_product_matches_torch(ops, rows):
    torch.manual_seed(rows)
    mlp = type("MLP", (), {})()
    mlp.gate_proj = nn.Linear(50, 100, bias=False).to(torch.bfloat16)
    mlp.up_proj = nn.Linear(50, 100, bias=False).to(torch.bfloat16)
    mlp.down_proj = nn.Identity()
    x = (torch.randn(1, rows, 50) * 4).to(torch.bfloat16)
    with torch.inference_mode():
        want = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        got = FusedGatedMLP(mlp)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)


def test_other_architectures_are_left_alone():
    """Gemma's norm scales by 1 + weight and its MLP uses GELU: neither is swapped."""
    model = tiny(GemmaConfig(**TINY, head_dim=8))
    assert fuse_for_cpu(model) == 0


@pytest.mark.parametrize("rows", [1, 3, 700])  # 700 rows of 100 split over the threads
def test_norm_and_gated_product_match_torch_for_any_shape(ops, rows):
    """Widths that are not a multiple of the vector width, one row and many."""
    torch.manual_seed(rows)
    norm = FusedRMSNorm(type("Norm", (), {"weight": torch.randn(100), "variance_epsilon": 1e-5})())
    x = torch.randn(1, rows, 100) * 3
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(norm(x), want, atol=1e-5, rtol=1e-5)

    mlp = type("MLP", (), {})()
    mlp.gate_proj, mlp.up_proj = nn.Linear(50, 100, bias=False), nn.Linear(50, 100, bias=False)
    mlp.down_proj = nn.Identity()
    fused = FusedGatedMLP(mlp)
    x = torch.randn(1, rows, 50) * 4  # gate values well into both tails of SiLU
    with torch.inference_mode():
        want = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        torch.testing.assert_close(fused(x), want, atol=1e-5, rtol=1e-5)


def test_fused_projections_are_the_three_stacked():
    """qkv_proj's rows are q's, k's and v's weights (and biases) in that order, and the
    three projections still answer, as slices of its output."""
    model = tiny(CONFIGS["qwen2"])  # Qwen2: projections with biases
    attention = model.model.layers[0].self_attn
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = [q(x), k(x), v(x)]
    fused = copy.deepcopy(model)
    assert fuse_for_cpu(fused, qkv=True) == 2 * 4 + 1
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.q_proj, ProjectionSlice)
    assert torch.equal(attention.qkv_proj.weight, torch.cat([q.weight, k.weight, v.weight]))
    assert torch.equal(attention.qkv_proj.bias, torch.cat([q.bias, k.bias, v.bias]))
    with torch.no_grad():
        got = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    plain = copy.deepcopy(model)
    assert fuse_for_cpu(plain, qkv=False) == 2 * 3 + 1
    assert type(plain.model.layers[0].self_attn.q_proj) is nn.Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 700])
def test_the_residual_add_before_a_norm_is_torchs_add_then_the_norm(ops, dtype, rows):
    """add_forward leaves `hidden + delta` in `hidden`, rounded as torch's add rounds it, and
    returns exactly what the norm gives for that sum."""
    torch.manual_seed(rows)
    norm = FusedRMSNorm(type("Norm", (), {"weight": torch.randn(100).to(dtype), "variance_epsilon": 1e-5})())
    hidden, delta = (torch.randn(rows, 100) * 3).to(dtype), torch.randn(rows, 100).to(dtype)
    want_sum = hidden + delta
    want = norm(want_sum)
    got = norm.add_forward(hidden, delta)
    assert torch.equal(hidden, want_sum)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, width", [(1, 7), (3, 49152), (40, 1003)])  # 40 x 1003 splits over the threads
def test_row_argmax_picks_what_torchs_max_picks(ops, dtype, rows, width):
    """The greedy token of each row: the first of equal maxima (bfloat16 logits tie
    often), wherever the largest value sits, for rows read through a stride; a row
    masked to -inf but for one token picks it, a row all -inf its first."""
    torch.manual_seed(0)
    logits = torch.randn(rows, width + 5).to(dtype)[:, 2 : 2 + width]  # rows `width + 5` apart
    logits[0, -1] = 50.0  # the largest in the tail past the last full vector
    logits[-1, :] = logits[-1, 0]  # every value tied: the first
    assert cpu_fusions.row_argmax(logits) == logits.max(dim=-1).indices.tolist()
    masked = torch.full((2, width), -torch.inf, dtype=dtype)
    masked[1, width // 2] = -3.0
    assert cpu_fusions.row_argmax(masked) == [0, width // 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_argmax_picks_the_first_nan_as_torch_does(ops, dtype):
    rows = torch.tensor([[1.0, 3.0, 2.0] * 9 + [float("nan"), 1.0, float("nan")], [1.0, float("nan")] + [0.0] * 28])
    assert cpu_fusions.row_argmax(rows.to(dtype)) == rows.max(dim=-1).indices.tolist() == [27, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens, head_dim", [(1, 64), (5, 20), (300, 64)])  # 20: a half shorter than a vector
def test_rotary_is_hugging_faces_rounding_for_rounding(ops, dtype, tokens, head_dim):
    """Queries and keys rotated at their positions, read where they sit in the step's
    fused q/k/v rows: bit for bit torch's `q * cos + rotate_half(q) * sin` in the
    activations' dtype (each product rounded, then the sum)."""
    torch.manual_seed(0)
    heads, kv_heads, positions = 9, 3, torch.randint(0, 500, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    angles = torch.arange(500.0).unsqueeze(1) * torch.rand(head_dim // 2).repeat(2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cos_at, sin_at = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = head_dim // 2
    rotate_half = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    want = qk * cos_at + rotate_half * sin_at
    negated_sin = sin.clone()
    negated_sin[:, :half].neg_()
    values = qkv[:, (heads + kv_heads) * head_dim :].clone()
    got = cpu_fusions.Rotary(cos, negated_sin, positions)(qk)
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], values)  # the values left alone
