"""CPU linears with 4-bit weights in groups, for one request's decode speed in bfloat16.

At one decode a step streams every weight once, so its time is the weight bytes over the
memory bandwidth. Four bits a weight plus a bfloat16 scale and offset per group of 32
(what llama.cpp's Q4_1 holds) is 0.25× bfloat16's bytes (0.3× with the scales).

Each group of `GROUP_SIZE` weights along a row is quantized asymmetrically: 16 levels
spanning the group's minimum to maximum, `weight ≈ (q - 8) × scale + zero` with q in
0..15, the form torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) takes; scale and
zero are rounded to bfloat16 first, and q is chosen against the rounded values.

Two paths, picked by the number of rows in the call:
- up to `INT4PACK_MAX_ROWS` (decode steps, with their speculative drafts): torch's int4
  kernel, which unpacks the weights on the fly and runs at about the memory's speed at
  one row, but whose cost grows with every row;
- more rows (prompt chunks, batches): the weight is unpacked into a bfloat16 scratch
  buffer shared by every linear of that shape, then one dense matmul.

Where it applies: a CPU, bfloat16 activations, and linears whose output size is a
multiple of 64 and input size a multiple of 32 (the kernel's blocking); others stay dense.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu.int8_linear import Int8Linear, quantize_linears, scratch_buffer
from gpu.hf_module import HFModule

GROUP_SIZE = 32
# Rows the int4 kernel takes; more unpack and run dense. The kernel's cost grows with every
# row and the unpacking is a fixed cost per call; they cross near 64 rows on the Xeon
# (docs/benchmarks.md, "int4 weights"), so decodes, speculative drafts and decode
# batches run on the kernel and prompt chunks unpack.
INT4PACK_MAX_ROWS = 64
# Linears whose outputs are a multiple of this fit every layout below.
_BLOCK_N = 64
_INNER_K_TILES = 2

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu


def applies(linear: nn.Linear) -> bool:
    return linear.out_features % _BLOCK_N == 0 and linear.in_features % GROUP_SIZE == 0


def quantize_groupwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in 0..15, scales [N, K/G], zeros [N, K/G]) with `weight ≈ (q - 8) ×
    scale + zero` per group of `GROUP_SIZE` along a row; scales and zeros exact in bfloat16."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = ((high - low) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
    zeros = (low + 8 * scales).to(torch.bfloat16).float()
    q = torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp_(0, 15)
    return q.reshape(n, k).to(torch.int32), scales, zeros


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that `quantize_groupwise`'s output stands for."""
    n, k = q.shape
    groups = (q.float() - 8).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    return (groups * scales[..., None] + zeros[..., None]).reshape(n, k)


def pack(q: torch.Tensor, block_n: int) -> torch.Tensor:
    """q [N, K] in 0..15 packed `block_n` output rows at a time: byte [block, k, j] holds
    row block_n·block + j in its low nibble and row block_n·block + block_n/2 + j in its
    high one ([N/block_n, K, block_n/2] uint8, flat as [N, K/2])."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n // block_n, block_n, k).permute(0, 2, 1)
    half = block_n // 2
    return (blocks[..., :half] | blocks[..., half:] << 4).contiguous().reshape(n, k // 2)


def unpack(packed: torch.Tensor, out_features: int, in_features: int, block_n: int | None = None) -> torch.Tensor:
    """The q [N, K] (uint8) held in `pack`'s layout (torch's kernel's, by default)."""
    block_n = block_n or torch_block_n()
    blocks = packed.reshape(out_features // block_n, in_features, block_n // 2)
    both = torch.cat([blocks & 0xF, blocks >> 4], dim=2)  # [N/block_n, K, block_n]
    return both.permute(0, 2, 1).reshape(out_features, in_features)


@functools.cache
def torch_block_n() -> int:
    """The output rows torch's CPU int4 kernel packs at a time: its private layout depends
    on the CPU it was dispatched for (64 with AVX-512, 32 with AVX2), so ask it."""
    q = torch.randint(0, 16, (_BLOCK_N, GROUP_SIZE * 2), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
    for block_n in (64, 32):
        if torch.equal(packed.reshape(-1), pack(q, block_n).reshape(-1)):
            return block_n
    raise RuntimeError("torch's CPU int4 kernel packs in a layout inflight does not know")


class Int4Linear(nn.Module):
    """An `nn.Linear` with 4-bit weights in groups of 32 (CPU, bfloat16, inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16:
            raise ValueError(f"int4 weights need bfloat16 activations, got {linear.weight.dtype}")
        if not applies(linear):
            raise ValueError(
                f"int4 needs outputs a multiple of {_BLOCK_N} and inputs of {GROUP_SIZE}, "
                f"got {linear.out_features}x{linear.in_features}"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scales, zeros = quantize_groupwise(linear.weight)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        # The kernel's [K/G, N, 2]; the dense path reads it as [N, K/G, 1] views.
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.scales, self.zeros = self.scales_and_zeros.permute(1, 0, 2).split(1, dim=2)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= INT4PACK_MAX_ROWS and self.bias is None and x.is_contiguous():
            return _int4_mm(
                x, self.packed, GROUP_SIZE, self.scales_and_zeros
            )  # a decode step, as the lean forward calls
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= INT4PACK_MAX_ROWS:
            out = _int4_mm(rows.contiguous(), self.packed, GROUP_SIZE, self.scales_and_zeros)
            if self.bias is not None:
                out += self.bias
        else:
            out = F.linear(rows, self.dequantized(), self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    @functools.cached_property
    def packed_in_blocks_of_64(self) -> torch.Tensor:
        """The packed weight in the layout inflight's C++ decode kernel reads (torch's on
        AVX-512; repacked once, on first use, where torch packs 32 rows at a time)."""
        if torch_block_n() == 64:
            return self.packed
        return pack(unpack(self.packed, self.out_features, self.in_features), 64)

    def dequantized(self) -> torch.Tensor:
        """The weight in bfloat16 (a shared buffer: valid until the next call)."""
        scratch = scratch_buffer((self.out_features, self.in_features), torch.bfloat16)
        groups = scratch.view(self.out_features, -1, GROUP_SIZE)
        groups.copy_(unpack(self.packed, self.out_features, self.in_features).view_as(groups)).sub_(8).mul_(
            self.scales
        ).add_(self.zeros)
        return scratch

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_model(model: HFModule) -> int:
    """int4 weights for every linear of a causal LM's layers that the kernel's blocking
    fits, and int8 per output channel for the LM head, as llama.cpp's Q4_1 files hold
    Q8_0 for it (a tied embedding table stays dense for the lookups). Returns how many
    linears were replaced."""
    head = model.get_output_embeddings()
    replaced = 0
    if type(head) is nn.Linear:
        model.set_output_embeddings(Int8Linear(head))
        replaced = 1
    return replaced + quantize_linears(model, skip=(head,), make=Int4Linear, fits=applies)
