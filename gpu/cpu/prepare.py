"""A model prepared for a CPU: its modules swapped for the CPU's faster ones, then the
lean forward that runs its steps.

The swaps come first and the lean forward last: it keeps each module's bound `forward`
(`gpu.cpu.lean_forward`), so it must see the modules that will run.
"""

from __future__ import annotations

from torch import nn

from gpu.attention import AttentionBackend
from gpu.cpu import int4_linear, int8_linear
from gpu.cpu.fusions import fuse_for_cpu
from gpu.cpu.int4_decode import Int4DecodeStep
from gpu.cpu.lean_forward import LeanForward, lean_forward_applies
from gpu.cpu.packed_linear import can_pack, pack_linears


def swap_modules_for_cpu(model: nn.Module, weights: str) -> None:
    """Fuses the norms, MLPs and (but with int4 weights, whose decode stack reads the three
    projections) the attention projections (`gpu.cpu.fusions`), stores the linears'
    weights as `weights` says ("dense", "int8" or "int4"; `gpu.cpu.int8_linear`,
    `gpu.cpu.int4_linear`) and packs every linear still dense for oneDNN
    (`gpu.cpu.packed_linear`)."""
    fuse_for_cpu(model, qkv=weights != "int4")
    if weights == "int8":
        int8_linear.quantize_model(model)  # the LM head stays dense: logits keep the dense model's precision
    elif weights == "int4":
        int4_linear.quantize_model(model)
    if can_pack(model):
        pack_linears(model)


def cpu_forward(model: nn.Module, backend: AttentionBackend, weights: str) -> LeanForward | None:
    """The lean forward of a Llama-family stack (with int4 weights, its decode steps in one
    C++ call: `gpu.cpu.int4_decode`); None for any other model, which the Hugging Face
    forward serves."""
    if not lean_forward_applies(model):
        return None
    decode_step = Int4DecodeStep.build(model, backend) if weights == "int4" else None
    return LeanForward(model, decode_step)
