"""Fewer, larger operations in the model's forward on CPU, each computing what it replaces.

On a CPU every small tensor operation pays a dispatch and a pass over memory, and a step
runs 30 layers of them. Two module swaps, for the RMSNorm and gated MLP of Llama, Qwen2
and Mistral (the classes are named, so another architecture's variant, such as Gemma's
`1 + weight` norm, is never swapped by accident):

- RMSNorm as one `F.rms_norm` call instead of six operations (float32 models only, where
  it is the same arithmetic: HF's norm computes in float32 and casts back);
- the MLP's gate and up projections as one linear of twice the width (one pass over the
  activations, one call), SiLU in place on the first half, times the second half.

Run before `pack_linears`, which then packs the fused projection like any other linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}
GATED_MLPS = {"LlamaMLP", "Qwen2MLP", "MistralMLP"}


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon
        self.shape = tuple(norm.weight.shape)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.shape, self.weight, self.eps)


class FusedGatedMLP(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.intermediate_size = gate.out_features
        self.gate_up_proj = nn.Linear(gate.in_features, 2 * gate.out_features, bias=gate.bias is not None,
                                      device=gate.weight.device, dtype=gate.weight.dtype)  # fmt: skip
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias]))
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


def fuse_for_cpu(model: nn.Module) -> int:
    """Swap the model's norms and MLPs in place; returns how many modules were swapped."""
    float32 = next(model.parameters()).dtype == torch.float32
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in RMS_NORMS and float32:
                setattr(parent, name, FusedRMSNorm(child))
            elif kind in GATED_MLPS and _is_silu(child.act_fn):
                setattr(parent, name, FusedGatedMLP(child))
            else:
                continue
            swapped += 1
    return swapped


def _is_silu(activation: nn.Module) -> bool:
    return isinstance(activation, nn.SiLU) or type(activation).__name__ == "SiLUActivation"
