"""Paged attention works for any model whose attention goes through transformers'
AttentionInterface: tiny random-weight Llama, Qwen2 and Mistral configs, each token-exact
against `generate` (SmolLM2 itself is covered in test_engine.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from tests.conftest import run_to_completion
from workers.api import SamplingParams
from workers.model_loader import LoadedModel

TINY = dict(
    vocab_size=49152,  # SmolLM2's tokenizer drives the engine's detokenizer
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
CONFIGS = {
    "llama": LlamaConfig(**TINY),
    "qwen2": Qwen2Config(**TINY),
    "mistral": MistralConfig(**TINY, sliding_window=None),
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_tiny_random_model_matches_generate(arch, make_engine, smollm2):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[arch])).eval()
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[arch]), attn_implementation="sdpa").eval()
    reference.load_state_dict(model.state_dict())
    loaded = LoadedModel(model, smollm2.tokenizer, f"tiny-{arch}", TINY["max_position_embeddings"])
    engine = make_engine(loaded, kv_memory_bytes=4 << 20, max_batch_tokens=32, max_prefill_chunk=11)

    generator = torch.Generator().manual_seed(1)
    prompts = {f"r{n}": torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (1, 9, 30, 75)}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    arrivals = {2 * i: [(rid, ids, params)] for i, (rid, ids) in enumerate(prompts.items())}
    results = run_to_completion(engine, arrivals)
    for rid, ids in prompts.items():
        with torch.inference_mode():
            want = reference.generate(
                torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert results[rid][0] == want, rid
