"""CPU linears with weights packed once, at load.

`torch.nn.functional.linear` on CPU goes to a BLAS sgemm that re-reads the weight in
its plain layout at every call. oneDNN with the weight reordered once into its blocked
layout runs the same products faster, most of all at the small row counts of decode
steps, where re-reading the plain weight dominates (figures in docs/benchmarks.md, "The
CPU kernels"). On a CPU with AMX, bfloat16 linears run on our own tile kernel instead
(`kernels/cpu_amx_linear.cpp`, its weight in the tiles' layout): oneDNN's AMX products run
some shapes on one of two threads, the kernel runs every shape on all of them. The results
agree with `F.linear` to float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import nn

from gpu.cpu.fusions import FusedGatedMLP
from gpu.cpu.native_build import CPU_CXX_FLAGS, try_load_cpu_library

# oneDNN keeps every primitive it creates, and ideep (PyTorch's wrapper of it) its own
# cache beside: 1,024 of each by default, each holding buffers sized by its row count. A
# continuous batcher's steps change their row count almost every step, so both caches
# fill with buffers seldom used again. This many keeps the row counts of the moment
# (figures in docs/benchmarks.md, "Soak").
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

# oneDNN packs float32 everywhere, bfloat16 on most x86 CPUs; float16 needs features most lack.
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN tunes the packed layout for; any row count works with it.
_ROWS_HINT = 64
# The tile kernel's blocks: 32 output and 32 input columns.
_AMX_BLOCK = 32
# Its epilogues (`kernels/cpu_amx_linear.cpp`): plain; a gated MLP's interleaved halves put
# back in place; SiLU(gate) x up.
_PLAIN, _HALVES, _SILU_MUL = 0, 1, 2


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive cache and ideep's at `capacity` entries each. They read
    their capacity once, at their first use, so this must come before any oneDNN call in
    the process; a capacity already set in the environment is kept."""
    for variable in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(variable, str(capacity))


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives in a packed layout (inference only): the AMX
    kernel's where it applies (`amx_applies`), oneDNN's otherwise.

    `gated`: the linear is a gated MLP's gate and up projections side by side
    (`gpu.cpu.fusions.FusedGatedMLP`). On AMX its halves are packed interleaved, and
    `silu_mul(x)` computes SiLU(gate) x up in the product's own pass (`self.gated`).
    """

    def __init__(self, linear: nn.Linear, gated: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.on_amx = amx_applies(weight)
        self.gated = gated and self.on_amx
        if self.on_amx:
            if self.gated:
                weight = interleave_halves(weight)
                self.bias = None if self.bias is None else interleave_halves(self.bias)
            self.packed_weight = torch.empty_like(weight)
            _loaded_amx_kernel().amx_pack_weight(
                weight.contiguous().data_ptr(), *weight.shape, self.packed_weight.data_ptr()
            )
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_amx:
            return self._amx_forward(x, _HALVES if self.gated else _PLAIN, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) x up of the two halves of this linear's output (only where `gated`)."""
        if not self.gated:
            raise ValueError("silu_mul needs a gated linear on AMX")
        return self._amx_forward(x, _SILU_MUL, self.out_features // 2)

    def _amx_forward(self, x: torch.Tensor, epilogue: int, width: int) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], width, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.data_ptr()
        status = _loaded_amx_kernel().amx_linear(
            rows.data_ptr(), rows.shape[0], self.in_features, rows.stride(0),
            self.packed_weight.data_ptr(), self.out_features, bias, out.data_ptr(), width, epilogue,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the AMX linear refused {tuple(x.shape)} x {self.in_features}->{self.out_features}")
        return out.view(*x.shape[:-1], width)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def interleave_halves(rows: torch.Tensor) -> torch.Tensor:
    """A gated MLP's [gate; up] rows reordered as the tile kernel's blocks of 32 want them:
    16 rows of gate, then the 16 of up that go with them, and so on."""
    half = rows.shape[0] // 2
    blocks = rows.reshape(2, half // 16, 16, *rows.shape[1:]).transpose(0, 1)
    return blocks.reshape(rows.shape).contiguous()


@functools.cache
def amx_kernel() -> ctypes.CDLL | None:
    """The AMX linear kernel where this CPU and its kernel let it run, else None."""
    library = try_load_cpu_library("cpu_amx_linear", CPU_CXX_FLAGS, instead="oneDNN linears")
    if library is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.amx_linear_ready.restype = ctypes.c_int
    library.amx_pack_weight.argtypes = (p, i64, i64, p)
    library.amx_pack_weight.restype = None
    library.amx_linear.argtypes = (p, i64, i64, i64, p, i64, p, p, i64, ctypes.c_int, ctypes.c_int)
    library.amx_linear.restype = ctypes.c_int
    return library if library.amx_linear_ready() else None


def _loaded_amx_kernel() -> ctypes.CDLL:
    """The AMX kernel, which `amx_applies` found before any weight was packed for it."""
    kernel = amx_kernel()
    if kernel is None:
        raise RuntimeError("the AMX kernel is not loaded")
    return kernel


def amx_applies(weight: torch.Tensor) -> bool:
    """A bfloat16 CPU weight whose both sides are multiples of 32, on a CPU with AMX."""
    out_features, in_features = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and out_features % _AMX_BLOCK == 0
        and in_features % _AMX_BLOCK == 0
        and amx_kernel() is not None
    )


def can_pack(model: nn.Module) -> bool:
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and onednn_packs(parameter.dtype)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), _ROWS_HINT)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` in place; returns how many were replaced.

    A weight tied to another module (the LM head to the embeddings) stays where it is
    for that module; the packed copy is the linear's own.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                gated = isinstance(parent, FusedGatedMLP) and name == "gate_up_proj"
                setattr(parent, name, PackedLinear(child, gated=gated))
                replaced += 1
    return replaced
