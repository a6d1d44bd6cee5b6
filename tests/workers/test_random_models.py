"""`random:<name>` models: built from configs in code with seeded weights and a tokenizer
made in code, nothing read or downloaded; the engine serves them like any model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_to_completion
from workers import random_models
from workers.api import SamplingParams
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.model_loader import encode_prompt, load_model

TINY = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma3"]


def config(name: str, dtype: str = "float32") -> ModelConfig:
    return ModelConfig(source=f"random:{name}", dtype=dtype, device="cpu")


def engine_for(loaded, name: str) -> Engine:
    return Engine(loaded, EngineConfig(
        model=config(name),
        cache=CacheConfig(kv_memory_bytes=8 << 20, swap_memory_bytes=0),
        scheduler=SchedulerConfig(max_prefill_chunk=7),  # chunked prompts too
    ))  # fmt: skip


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_is_served_greedily_as_generate_would(name):
    served = load_model(config(name))
    reference = load_model(config(name))  # the same seed: the same weights
    assert served.name == f"{name} (random weights, float32)"
    assert not served.model.training and served.model.dtype == torch.float32
    assert served.max_context == served.model.config.max_position_embeddings

    prompts = {"text": "The capital of France is", "chat": [{"role": "user", "content": "Hi!"}]}
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    results = run_to_completion(engine_for(served, name), {0: [(rid, p, params) for rid, p in prompts.items()]})
    for rid, prompt in prompts.items():
        ids = encode_prompt(reference.tokenizer, prompt)
        with torch.inference_mode():
            want = reference.model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10,
                                            do_sample=False, pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
        tokens, final, text = results[rid]
        assert tokens == want, rid
        assert final.finish_reason == "length"
        assert text == reference.tokenizer.decode(tokens)


def test_smollm2_shape_loads_at_the_real_config():
    loaded = load_model(config("smollm2-135m"))
    c = loaded.model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (576, 30, 9, 3)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1536, 49152, 8192)
    assert c.tie_word_embeddings and loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert sum(p.numel() for p in loaded.model.parameters()) == 134_515_008
    results = run_to_completion(
        engine_for(loaded, "smollm2-135m"),
        {0: [("a", "Once upon a time", SamplingParams(max_tokens=3, ignore_eos=True))]},
    )
    assert len(results["a"][0]) == 3


def test_llama3_8b_shape_is_llama_3_8b():
    """Only its config: eight billion parameters are for a GPU."""
    c = random_models.model_config("llama3-8b-shape")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (4096, 32, 32, 8)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (14336, 128256, 8192)
    assert not c.tie_word_embeddings


def test_tokenizer_decodes_every_id_and_knows_eos():
    tokenizer = random_models.build_tokenizer(1024)
    assert len(tokenizer) == 1024
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    assert all(tokenizer.convert_ids_to_tokens(i) for i in range(1024))
    text = "def f(x):\n\treturn x + 1  # ok"
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_eos_ends_a_request():
    params = SamplingParams(max_tokens=10)
    first = run_to_completion(engine_for(load_model(config("tiny-llama")), "tiny-llama"),
                              {0: [("a", "Hello", params)]})["a"][0][0]  # fmt: skip
    loaded = load_model(config("tiny-llama"))
    with torch.no_grad():  # swap the output rows of that first token and EOS: EOS comes first now
        rows = loaded.model.lm_head.weight
        rows[[first, 2]] = rows[[2, first]]
    engine = engine_for(loaded, "tiny-llama")
    assert 2 in engine.eos_token_ids
    tokens, final, text = run_to_completion(engine, {0: [("a", "Hello", params)]})["a"]
    assert final.finish_reason == "stop" and tokens == [2] and text == ""  # EOS, not shown as text


def test_weights_are_seeded_and_leave_the_callers_random_state_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = load_model(config("tiny-qwen2", "bfloat16")).model
    assert torch.equal(torch.random.get_rng_state(), before)
    second = load_model(config("tiny-qwen2", "bfloat16")).model
    assert first.dtype == torch.bfloat16
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown random model 'tiny-gpt'; known: .*smollm2-135m.*tiny-llama"):
        load_model(config("tiny-gpt"))
