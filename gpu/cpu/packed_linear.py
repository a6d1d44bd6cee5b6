"""CPU linears through oneDNN with weights packed once, at load.

`torch.nn.functional.linear` on CPU goes to a BLAS sgemm that re-reads the weight in
its plain layout at every call. oneDNN with the weight reordered once into its blocked
layout runs the same products faster, most of all at the small row counts of decode
steps, where re-reading the plain weight dominates (figures in docs/benchmarks.md, "The
CPU kernels"). The results agree with `F.linear` to float rounding.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# oneDNN packs float32 everywhere, bfloat16 on most x86 CPUs; float16 needs features most lack.
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN tunes the packed layout for; any row count works with it.
_ROWS_HINT = 64


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
