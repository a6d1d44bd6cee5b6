"""Fewer, larger operations in the model's forward on CPU, each computing what it replaces.

On a CPU every small tensor operation pays a dispatch and a pass over memory, and a step
runs 30 layers of them. Two module swaps, for the RMSNorm and gated MLP of Llama, Qwen2
and Mistral (the classes are named, so another architecture's variant, such as Gemma's
`1 + weight` norm, is never swapped by accident):

- RMSNorm as one pass over each row instead of six operations, with HF's arithmetic: the
  norm in float32, cast back to the model's dtype, then times the weight (in bfloat16 that
  cast is a rounding the one-pass operation makes too);
- the MLP's gate and up projections as one linear of twice the width (one call, one
  pass over the activations), then SiLU of the first half times the second in one pass;
- optionally, the attention's query, key and value projections as one linear
  (`qkv_proj`): one wider product instead of three narrow ones (the narrow key and value
  products use the cores worst). The lean forward calls it once and splits the columns;
  `q_proj`, `k_proj` and `v_proj` become column slices of it, so the Hugging Face forward
  still runs (it computes the whole product for each of them: it is the fallback and the
  tests' oracle, not the serving path). With `add_forward`, a norm also does the residual
  add before it, in the same pass.

The one-pass operations are C++ (`gpu/cpu/kernels/cpu_fused_ops.cpp`, built for this CPU
like the decode kernel) for float32 and bfloat16; where it cannot be built, or for other
dtypes, they fall back to torch (the norm's own formula, `F.silu` and a multiply), which
computes the same to rounding.

Run before `pack_linears`, which then packs the fused projection like any other linear
(on AMX, with the SiLU product in the same kernel: `gpu.cpu.packed_linear`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu.native_build import CPU_CXX_FLAGS, try_load_cpu_library
from gpu.hf_module import HFModule

RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}
GATED_MLPS = {"LlamaMLP", "Qwen2MLP", "MistralMLP"}
ATTENTIONS = {"LlamaAttention", "Qwen2Attention", "MistralAttention"}


# The C++ operations' suffix for each dtype they cover.
KERNEL_DTYPES = {torch.float32: "", torch.bfloat16: "_bf16"}


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: HFModule) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon
        self.shape = tuple(norm.weight.shape)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ops = fused_ops()
        dtype = hidden_states.dtype
        rows = hidden_states.reshape(-1, self.shape[0])
        if ops is None or dtype not in KERNEL_DTYPES or self.weight.dtype != dtype or rows.stride(1) != 1:
            return self._torch(hidden_states)
        out = torch.empty(hidden_states.shape, dtype=dtype)
        getattr(ops, "rms_norm" + KERNEL_DTYPES[dtype])(
            rows.data_ptr(), rows.stride(0), self.weight.data_ptr(), out.data_ptr(), rows.shape[0], self.shape[0],
            self.eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_forward(self, hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The residual add and the norm in one pass: `hidden += delta` in place (rounded as
        torch's add rounds), then this norm of it."""
        ops = fused_ops()
        dtype = hidden.dtype
        if (
            ops is None
            or dtype not in KERNEL_DTYPES
            or self.weight.dtype != dtype
            or delta.dtype != dtype
            or not (hidden.is_contiguous() and delta.is_contiguous())
            or hidden.shape != delta.shape
        ):
            return self.forward(hidden.add_(delta))
        out = torch.empty(hidden.shape, dtype=dtype)
        getattr(ops, "add_rms_norm" + KERNEL_DTYPES[dtype])(
            hidden.data_ptr(), delta.data_ptr(), self.weight.data_ptr(), out.data_ptr(),
            hidden.numel() // self.shape[0], self.shape[0], self.eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def _torch(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(hidden_states, self.shape, self.weight, self.eps)
        # HF's own formula: the norm in float32, cast back before the weight is applied.
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(hidden_states.dtype)


class FusedGatedMLP(nn.Module):
    def __init__(self, mlp: HFModule) -> None:
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.intermediate_size = gate.out_features
        # An nn.Linear here; `pack_linears` may swap in a packed one (with `silu_mul` on AMX).
        self.gate_up_proj: HFModule = nn.Linear(gate.in_features, 2 * gate.out_features, bias=gate.bias is not None,
                                      device=gate.weight.device, dtype=gate.weight.dtype)  # fmt: skip
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias]))
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "gated", False):  # packed for AMX: SiLU x up in the product's pass
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        gate_up = self.gate_up_proj(x)
        ops = fused_ops()
        if ops is None or gate_up.dtype not in KERNEL_DTYPES or not gate_up.is_contiguous():
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        product = gate_up.new_empty((*gate_up.shape[:-1], self.intermediate_size))
        rows = product.numel() // self.intermediate_size
        getattr(ops, "silu_mul" + KERNEL_DTYPES[gate_up.dtype])(
            gate_up.data_ptr(), gate_up.shape[-1], product.data_ptr(), rows, self.intermediate_size,
            torch.get_num_threads(),
        )  # fmt: skip
        return self.down_proj(product)


class ProjectionSlice(nn.Module):
    """Columns [start, stop) of the attention's fused `qkv_proj`: what `q_proj`, `k_proj` or
    `v_proj` computed. The attention is held without registering it (it is the parent)."""

    _attention: HFModule

    def __init__(self, attention: HFModule, start: int, stop: int) -> None:
        super().__init__()
        object.__setattr__(self, "_attention", attention)
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._attention.qkv_proj(x)[..., self.start : self.stop]


class Rotary:
    """Hugging Face's `q * cos + rotate_half(q) * sin` for one step's queries and keys at
    their positions, over tables of cos and sin (`sin`'s first half negated, so that
    rotate_half is a swap of halves times it). On a CPU one pass in place over each
    layer's heads; elsewhere torch's operations, rounded as Hugging Face's."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> None:
        on_cpu = cos_table.device.type == "cpu" and cos_table.dtype in KERNEL_DTYPES
        self.ops = fused_ops() if on_cpu else None
        if self.ops is not None:
            self.cos_table, self.sin_table, self.positions = cos_table, sin_table, positions.contiguous()
        else:  # gathered once for every layer
            self.cos = cos_table.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim]
            self.sin = sin_table.index_select(0, positions).unsqueeze(1)

    def __call__(self, heads: torch.Tensor) -> torch.Tensor:
        """`heads` [T, heads, head_dim] rotated (in place, where the kernel runs)."""
        tokens, count, head_dim = heads.shape
        if self.ops is None:
            rotated = heads * self.cos
            return rotated.add_(heads.roll(head_dim // 2, dims=-1).mul_(self.sin))
        if heads.stride(2) != 1 or heads.stride(1) != head_dim:
            heads = heads.contiguous()
        getattr(self.ops, "rotary" + KERNEL_DTYPES[heads.dtype])(
            heads.data_ptr(), heads.stride(0), tokens, count, head_dim, self.cos_table.data_ptr(),
            self.sin_table.data_ptr(), self.positions.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return heads


def row_argmax(rows: torch.Tensor) -> list[int]:
    """The index of each row's largest value (the first of equal ones, or the first NaN),
    as torch's `max` picks it: on a CPU in one vectorized pass a row (docs/benchmarks.md,
    "The CPU kernels")."""
    ops = fused_ops()
    if ops is None or rows.dtype not in KERNEL_DTYPES or rows.device.type != "cpu" or rows.dim() != 2:
        return rows.max(dim=-1).indices.tolist()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    getattr(ops, "argmax" + KERNEL_DTYPES[rows.dtype])(
        rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out.tolist()


def fuse_qkv(attention: HFModule) -> bool:
    """`attention.qkv_proj` from its three projections, which become slices of it; False
    where they are not three plain linears over the same input."""
    found = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    projections = [p for p in found if type(p) is nn.Linear]
    if len(projections) != len(found):
        return False
    if len({p.in_features for p in projections}) != 1 or len({p.bias is None for p in projections}) != 1:
        return False
    q, k, v = projections
    fused = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features, bias=q.bias is not None,
                      device=q.weight.device, dtype=q.weight.dtype)  # fmt: skip
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in projections]))
        if q.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in projections]))
    attention.qkv_proj = fused
    start = 0
    for name, projection in zip(("q_proj", "k_proj", "v_proj"), projections):
        setattr(attention, name, ProjectionSlice(attention, start, start + projection.out_features))
        start += projection.out_features
    return True


def fuse_for_cpu(model: nn.Module, qkv: bool = True) -> int:
    """Swap the model's norms and MLPs in place, and with `qkv` fuse each attention's
    projections; returns how many modules were swapped or fused."""
    swapped = 0
    for parent in list(model.modules()):
        if qkv and type(parent).__name__ in ATTENTIONS and fuse_qkv(parent):
            swapped += 1
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in RMS_NORMS:
                setattr(parent, name, FusedRMSNorm(child))
            elif kind in GATED_MLPS and _is_silu(child.act_fn):
                setattr(parent, name, FusedGatedMLP(child))
            else:
                continue
            swapped += 1
    return swapped


@functools.cache
def fused_ops(flags: tuple[str, ...] = CPU_CXX_FLAGS) -> ctypes.CDLL | None:
    """The one-pass operations, or None where g++ cannot build them (logged once)."""
    library = try_load_cpu_library("cpu_fused_ops", flags, instead="torch operations")
    if library is None:
        return None
    P, I, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for suffix in KERNEL_DTYPES.values():
        getattr(library, "rms_norm" + suffix).argtypes = (P, I64, P, P, I64, I, ctypes.c_float, I)
        getattr(library, "rms_norm" + suffix).restype = None
        getattr(library, "add_rms_norm" + suffix).argtypes = (P, P, P, P, I64, I, ctypes.c_float, I)
        getattr(library, "add_rms_norm" + suffix).restype = None
        getattr(library, "silu_mul" + suffix).argtypes = (P, I64, P, I64, I, I)
        getattr(library, "silu_mul" + suffix).restype = None
        getattr(library, "rotary" + suffix).argtypes = (P, I64, I64, I, I, P, P, P, I)
        getattr(library, "rotary" + suffix).restype = None
        getattr(library, "argmax" + suffix).argtypes = (P, I64, I64, I, P, I)
        getattr(library, "argmax" + suffix).restype = None
    return library


def _is_silu(activation: object) -> bool:
    return isinstance(activation, nn.SiLU) or type(activation).__name__ == "SiLUActivation"
