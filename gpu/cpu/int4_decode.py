"""A decode step in one C++ call, for int4 weights on a CPU: every decoder layer, the
final norm and the LM head.

With int4 weights a step at one request reads under 100 MB, and on two cores the
torch path's host work (some twenty operations a layer, called from Python) costs more
than the matmuls (figures in docs/benchmarks.md, "One request in one call"). The C++
code (`gpu/cpu/kernels/cpu_int4_decode.cpp`) runs every layer of the lean forward in one
call over the same weights: `Int4Linear`'s packed bytes, scales and zeros (on CPUs with
AVX-512 BF16, a copy repacked at start for bfloat16 dot products), the fused norms'
weights, and the KV cache's pools in place; attention is the paged decode kernel the CPU
backend calls. It rounds to bfloat16 wherever the torch path does. The LM
head (`Int8Linear`'s int8 weights, copied once) takes its input quantized to int8 per
group of 32, llama.cpp's way, so that AVX-512 VNNI sums 64 products an instruction; its
logits are fp32 and differ from the torch path's by that quantization (quality in
docs/benchmarks.md, "One request in one call").

It takes steps whose every token is a decode (speculative drafts included) and that
have at most `MAX_TOKENS` tokens; prompt chunks and larger batches run the torch path.
It is for Llama-family stacks with full attention in every layer: a model with any
sliding-window, softcapped or sink layer (`gpu.attention.LayerAttention`) is not built
here (`build` returns None) and runs the torch path, whose CPU attention backend takes
those layers.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from gpu.attention import FULL_ATTENTION, layer_attention
from gpu.cpu.attention import CpuAttentionBackend
from gpu.cpu.fusions import FusedGatedMLP, FusedRMSNorm
from gpu.cpu.int4_linear import Int4Linear
from gpu.cpu.int8_linear import Int8Linear
from gpu.cpu.native_build import CPU_CXX_FLAGS, try_load_cpu_library
from gpu.hf_module import HFModule
from gpu.torch_attention import TorchMetadata

# Tokens a step may have to run here. The C++ matmul's cost grows with every token (a dot
# product per token per weight); up to 32 tokens it still beat the torch path in a
# measurement (docs/benchmarks.md, "One request in one call"), larger batches were not
# measured and run the torch path.
MAX_TOKENS = 32
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def decode_library(flags: tuple[str, ...] = CPU_CXX_FLAGS) -> ctypes.CDLL | None:
    """The C++ layers, or None where g++ cannot build them (logged once)."""
    library = try_load_cpu_library("cpu_int4_decode", flags, instead="the torch path for int4 decodes")
    if library is None:
        return None
    library.int4_stack_create.argtypes = (_I, _P, _I, _I, _I, _I, _I, _F, _F, _P, _P, _P, _P, _I)
    library.int4_stack_create.restype = _P
    library.int4_stack_free.argtypes = (_P,)
    library.int4_stack_free.restype = None
    library.int4_decode.argtypes = (_P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _I)
    library.int4_stack_head.argtypes = (_P, _P, _I, _P, _I)
    library.int4_stack_head.restype = None
    library.int4_decode.restype = _I
    library.int4_linear.argtypes = (_P, _P, _I, _I, _P, _I, _P, _I)
    library.int4_linear.restype = None
    return library


def _layers(model: HFModule) -> list[HFModule]:
    return list(model.model.layers[: model.config.num_hidden_layers])


def _full_attention(layer: HFModule, config) -> bool:
    """Whether the layer attends plainly causally (as the lean forward reads its window)."""
    attention = layer.self_attn
    window = getattr(attention, "sliding_window", getattr(config, "sliding_window", None))
    found = layer_attention(attention, {"sliding_window": window})
    return found is FULL_ATTENTION


def _layer_pointers(layer: HFModule, key_pool: torch.Tensor, value_pool: torch.Tensor) -> list[int] | None:
    """The 16 addresses the C++ stack takes for one layer, or None if a module is not one it runs."""
    attention, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(norm) is FusedRMSNorm and norm.weight.dtype == torch.bfloat16 for norm in norms):
        return None
    if type(mlp) is not FusedGatedMLP:
        return None
    linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(type(linear) is Int4Linear and linear.bias is None for linear in linears):
        return None
    pointers = [norm.weight.data_ptr() for norm in norms]
    for linear in linears:
        pointers += [linear.packed_in_blocks_of_64.data_ptr(), linear.scales_and_zeros.data_ptr()]
    return pointers + [key_pool.data_ptr(), value_pool.data_ptr()]


class Int4DecodeStep:
    """A decode step of `model` as one call, for the steps `takes` accepts: logits from token embeddings."""

    def __init__(
        self, model: HFModule, backend: CpuAttentionBackend, library: ctypes.CDLL, pointers: list[int]
    ) -> None:
        config, layers = model.config, _layers(model)
        attention = layers[0].self_attn
        self.model = model  # the weights the stack points into stay alive with it
        self.kv_cache = backend.kv_cache
        self.library = library
        head, final_norm = model.get_output_embeddings(), model.model.norm
        self.vocab_size = head.out_features
        addresses = np.array(pointers, dtype=np.int64)  # alive through the call that copies it
        self._stack = library.int4_stack_create(
            len(layers), addresses.ctypes.data, config.hidden_size,
            config.num_attention_heads, config.num_key_value_heads, attention.head_dim,
            layers[0].mlp.intermediate_size, layers[0].input_layernorm.eps, attention.scaling,
            ctypes.cast(backend.entry, ctypes.c_void_p).value, final_norm.weight.data_ptr(),
            head.weight_int8.data_ptr(), head.scales.data_ptr(), head.out_features,
        )  # fmt: skip
        if not self._stack:
            raise ValueError("the int4 decode stack does not take this model's shapes")

    @classmethod
    def build(cls, model: HFModule, backend, library: ctypes.CDLL | None = None) -> Int4DecodeStep | None:
        """The step over `model`'s int4 layers, int8 head and `backend`'s cache, or None where
        it does not apply (a layer with a sliding window, softcap or sinks among them: the
        stack attends with full attention only); `library` None is `decode_library()`,
        built for this CPU."""
        if not isinstance(backend, CpuAttentionBackend) or backend.kv_cache.blocks.dtype != torch.bfloat16:
            return None
        library = library or decode_library()
        if library is None:
            return None
        cache = backend.kv_cache
        pointers: list[int] = []
        layers = _layers(model)
        if not all(_full_attention(layer, model.config) for layer in layers):
            return None
        for index, layer in enumerate(layers):
            found = _layer_pointers(layer, cache.key_pools[index], cache.value_pools[index])
            if found is None:
                return None
            pointers += found
        head, final_norm = model.get_output_embeddings(), model.model.norm
        if type(head) is not Int8Linear or head.bias is not None or head.dtype != torch.bfloat16:
            return None
        if type(final_norm) is not FusedRMSNorm or final_norm.weight.dtype != torch.bfloat16:
            return None
        norms = [final_norm] + [
            norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        if len({norm.eps for norm in norms}) != 1:
            return None
        try:
            return cls(model, backend, library, pointers)
        except ValueError:  # shapes the C++ code does not take: the torch path serves the model
            return None

    def takes(self, metadata, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` with this attention metadata runs here: decodes only."""
        return num_tokens <= MAX_TOKENS and isinstance(metadata, TorchMetadata) and not metadata.prefills

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        metadata: TorchMetadata,
    ) -> torch.Tensor:
        """Logits [tokens, vocab] (float32) of every token; `hidden` [tokens, hidden size]
        (the embeddings, bfloat16, contiguous) is overwritten."""
        decodes = metadata.decodes
        logits = torch.empty(hidden.shape[0], self.vocab_size)
        status = self.library.int4_decode(
            self._stack, hidden.data_ptr(), hidden.shape[0], cos_table.data_ptr(), sin_table.data_ptr(),
            positions.data_ptr(), metadata.slot_mapping.data_ptr(), decodes.query_rows.data_ptr(),
            decodes.context_lens.data_ptr(), decodes.block_tables.data_ptr(), decodes.num_seqs,
            decodes.block_tables.shape[1], self.kv_cache.block_size, logits.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError("the CPU decode kernel rejected this model's heads")
        return logits

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head alone: logits [rows, vocab] (float32) of the final norm's output [rows, hidden]."""
        normed = normed.contiguous()
        logits = torch.empty(normed.shape[0], self.vocab_size)
        self.library.int4_stack_head(self._stack, normed.data_ptr(), normed.shape[0], logits.data_ptr(),
                                     torch.get_num_threads())  # fmt: skip
        return logits

    def __del__(self) -> None:
        if getattr(self, "_stack", None):
            self.library.int4_stack_free(self._stack)
