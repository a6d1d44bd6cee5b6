"""`gpu.prepare.prepare_model`, the one call that readies a model for its device: on a CPU
its norms and MLPs fused, its linears quantized as asked and the dense ones packed, the
lean forward for a Llama-family stack; the paged cache, its host pool and the attention
backend everywhere; decode graphs only for the CUDA kernels on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gpu.cpu.fusions import FusedGatedMLP, FusedRMSNorm
from gpu.cpu.int8_linear import Int8Linear
from gpu.cpu.packed_linear import PackedLinear, onednn_packs
from gpu.prepare import DeviceOptions, prepare_model
from gpu.torch_attention import TorchAttentionBackend
from workers.config import ModelConfig
from workers.model_loader import load_model

BLOCK_BYTES = 16 * 4096
OPTIONS = DeviceOptions(kv_memory_bytes=64 * BLOCK_BYTES, block_size=16)


def tiny_llama(dtype: str = "float32"):
    return load_model(ModelConfig(source="random:tiny-llama", dtype=dtype, device="cpu")).model


def test_a_llama_stack_on_a_cpu_is_fused_packed_and_runs_the_lean_forward():
    model = tiny_llama()
    prepared = prepare_model(model, OPTIONS)
    assert prepared.model is model and prepared.device == torch.device("cpu")
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.mlp, FusedGatedMLP)
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert prepared.lean is not None and prepared.lean.model is model and prepared.lean.decode_step is None
    assert prepared.graphs is None and prepared.host_pool is None  # no swap budget
    assert prepared.kv_cache.blocks.dtype == model.dtype and prepared.backend.kv_cache is prepared.kv_cache


@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN packs bfloat16 only with AVX-512 here")
def test_int8_weights_quantize_the_layers_and_leave_the_head_dense_and_packed():
    model = tiny_llama("bfloat16")
    prepared = prepare_model(model, DeviceOptions(kv_memory_bytes=64 * BLOCK_BYTES, block_size=16, weights="int8"))
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, Int8Linear) and isinstance(attention.o_proj, Int8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)  # `DENSE_LINEARS`
    assert isinstance(model.lm_head, PackedLinear)
    assert prepared.lean is not None and prepared.lean.decode_step is None  # one call is int4's


def test_a_swap_budget_makes_a_host_pool_and_a_backend_class_is_used_as_given():
    options = DeviceOptions(kv_memory_bytes=64 * BLOCK_BYTES, block_size=16, swap_memory_bytes=1 << 20)
    prepared = prepare_model(tiny_llama(), options, backend_class=TorchAttentionBackend)
    assert type(prepared.backend) is TorchAttentionBackend
    assert prepared.host_pool is not None and prepared.host_pool.num_blocks > 0


def test_other_architectures_keep_the_hugging_face_forward():
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).eval()
    prepared = prepare_model(model, OPTIONS)
    assert prepared.lean is None and prepared.graphs is None


def test_quantized_weights_need_a_cpu():
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    options = DeviceOptions(kv_memory_bytes=64 * BLOCK_BYTES, block_size=16, weights="int8")
    with pytest.raises(ValueError, match="runs on a CPU only"):
        prepare_model(model, options)
