"""CPU linears with int8 weights: a quarter of float32's weight bytes, half of bfloat16's.

Each output channel (row of the weight) is quantized symmetrically: one float scale per
row, `weight ≈ int8 × scale`, the scale rounded to the activations' dtype first so that
both kernels below compute with exactly the same dequantized weight. Activations stay
float (float32 or bfloat16); only the weights are int8.

Two kernels, picked by the number of rows (tokens) in the call:

- few rows (decode steps) in bfloat16: torch's `_weight_int8pack_mm`, which reads the
  int8 weight and converts it on the fly, so a step streams half the bytes of bfloat16;
- more rows (prompt chunks, large decode batches), and float32 at any row count:
  dequantize the weight into a scratch buffer shared by every linear of that shape, then
  one dense matmul. The dequantization is a fixed cost per call, small against a matmul
  of many rows, and the matmul runs on the CPU's fastest dense kernel: in the
  activations' dtype where oneDNN has native kernels for it, else in float32 (on a CPU
  without AVX-512 a bfloat16 matmul is much slower than float32's).

Where the kernels cross over is in `INT8PACK_MAX_ROWS` (figures in docs/benchmarks.md,
"int8 weights").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu.packed_linear import onednn_packs
from gpu.hf_module import HFModule

# The most rows a call runs on `_weight_int8pack_mm`; more rows dequantize and run dense.
# The int8 kernel's cost grows with every row while the dequantized matmul's is mostly a
# fixed cost, so they cross; on the AVX2 EPYC they cross at about 16 rows in bfloat16.
# In float32 torch's int8 kernel loses to the dense linear there even at one row (the
# AVX-512 EPYC was not measured in float32), so float32 always dequantizes (figures in
# docs/benchmarks.md, "int8 weights").
INT8PACK_MAX_ROWS = {torch.bfloat16: 16, torch.float32: 0}
QUANTIZABLE_DTYPES = tuple(INT8PACK_MAX_ROWS)
# Linears `quantize_model` leaves dense, by attribute name. Quantizing SmolLM2's MLP down
# projections too takes its top-1 agreement with float32 under the quality gate's 97%
# (tests/gpu/test_int8_weights.py; figures in docs/benchmarks.md).
DENSE_LINEARS = frozenset({"down_proj"})

# Dequantized weights, one buffer per (shape, dtype), reused by every call of every linear:
# one forward at a time per process (the engine steps on one thread).
_scratch: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def quantize_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 weight [N, K], float32 scales [N]) with
    every scale exactly representable in `scale_dtype`."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    # An all-zero row keeps a tiny scale (its int8 values are zeros anyway).
    scales = (amax / 127).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype).float()
    quantized = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized.contiguous(), scales


class Int8Linear(nn.Module):
    """An `nn.Linear` with per-output-channel int8 weights (CPU, inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        dtype = linear.weight.dtype
        if dtype not in QUANTIZABLE_DTYPES:
            raise ValueError(f"int8 weights need float32 or bfloat16 activations, got {dtype}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = dtype
        self.weight_int8, self.scales = quantize_per_channel(linear.weight, dtype)
        self.scales_in_dtype = self.scales.to(dtype)  # what `_weight_int8pack_mm` takes
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.max_int8pack_rows = INT8PACK_MAX_ROWS[dtype]
        # The dense path's dtype: the activations' where oneDNN runs it natively, else float32.
        self.dense_dtype = dtype if onednn_packs(dtype) else torch.float32
        self.dense_scales = self.scales.to(self.dense_dtype)[:, None]
        self.dense_bias = None if self.bias is None else self.bias.to(self.dense_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.max_int8pack_rows and x.dtype == self.dtype:
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight_int8, self.scales_in_dtype)
            if self.bias is not None:
                out += self.bias
        else:
            out = F.linear(rows.to(self.dense_dtype), self.dequantized(), self.dense_bias).to(x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight as floats in the dense path's dtype (a shared buffer: valid until the next call)."""
        scratch = scratch_buffer((self.out_features, self.in_features), self.dense_dtype)
        return scratch.copy_(self.weight_int8).mul_(self.dense_scales)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}"
        )


def scratch_buffer(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The process's one buffer of `shape` and `dtype` for dequantized weights."""
    key = (*shape, dtype)
    scratch = _scratch.get(key)
    if scratch is None:
        # A normal tensor even when created under inference mode, so it can be written outside it too.
        with torch.inference_mode(False):
            scratch = _scratch[key] = torch.empty(shape, dtype=dtype)
    return scratch


def quantize_linears(
    model: nn.Module,
    skip: tuple[nn.Module, ...] = (),
    skip_names: frozenset[str] = frozenset(),
    make=None,
    fits=lambda linear: True,
) -> int:
    """Replace every `nn.Linear` of `model` in place by `make(linear)` (default `Int8Linear`),
    except the modules in `skip`, those whose attribute name is in `skip_names` and those
    `fits` refuses; returns how many were replaced."""
    make = make or Int8Linear
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and name not in skip_names and fits(child)
                    and not any(child is kept for kept in skip)):  # fmt: skip
                setattr(parent, name, make(child))
                replaced += 1
    return replaced


def quantize_model(model: HFModule) -> int:
    """int8 weights for a Hugging Face causal LM's layers: every linear except the LM head
    (logits keep the dense model's precision) and those named in `DENSE_LINEARS`."""
    return quantize_linears(model, skip=(model.get_output_embeddings(),), skip_names=DENSE_LINEARS)
