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

import torch
from torch import nn

from gpu.cpu.native_build import CPU_CXX_FLAGS, try_load_cpu_library

# oneDNN packs float32 everywhere, bfloat16 on most x86 CPUs; float16 needs features most lack.
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN tunes the packed layout for; any row count works with it.
_ROWS_HINT = 64


# The tile kernel's blocks: 32 output and 32 input columns.
_AMX_BLOCK = 32


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives in a packed layout (inference only): the AMX
    kernel's where it applies (`amx_applies`), oneDNN's otherwise."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.on_amx = amx_applies(weight)
        if self.on_amx:
            self.packed_weight = torch.empty_like(weight)
            amx_kernel().amx_pack_weight(weight.contiguous().data_ptr(), *weight.shape, self.packed_weight.data_ptr())
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_amx:
            return self._amx_forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _amx_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.data_ptr()
        status = amx_kernel().amx_linear(
            rows.data_ptr(), rows.shape[0], self.in_features, rows.stride(0),
            self.packed_weight.data_ptr(), self.out_features, bias, out.data_ptr(), self.out_features,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the AMX linear refused {tuple(x.shape)} x {self.in_features}->{self.out_features}")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
    library.amx_linear.argtypes = (p, i64, i64, i64, p, i64, p, p, i64, ctypes.c_int)
    library.amx_linear.restype = ctypes.c_int
    return library if library.amx_linear_ready() else None


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
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
