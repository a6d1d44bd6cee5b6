"""The lean forward (`gpu/cpu/lean_forward.py`) computes what the Hugging Face forward
computes, step by step over the paged cache: on the bundled SmolLM2 and on tiny random
Llama, Qwen2 and Mistral models, in float32 and bfloat16, through a step that mixes
prompt chunks with decodes. The runner picks it by itself for those architectures."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from gpu.cpu.lean_forward import lean_forward_applies
from workers.config import CacheConfig, ModelConfig
from workers.model_loader import load_model
from workers.model_runner import ModelRunner
from workers.plan import ScheduledChunk, StepPlan

CACHE = CacheConfig(kv_memory_bytes=8 << 20, swap_memory_bytes=0)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these steps are small, and on a busy 2-core machine two threads
    wait on each other at every operation (docs/benchmarks.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lockstep(runner: ModelRunner, prompts: list[list[int]], decodes: int):
    """Run the prompts greedily, each step on the lean forward and then again on the Hugging
    Face forward with the same inputs. Yields (lean logits, HF logits) per step.

    The first prompt runs whole in step 1; the second is split into two chunks, the
    second of which runs next to the first prompt's first decode (a mixed step); then
    both decode. Each prompt's blocks are its own."""
    assert runner.lean is not None
    per_request = runner.kv_cache.num_blocks // len(prompts)
    tables = [list(range(1 + i * per_request, (i + 1) * per_request)) for i in range(len(prompts))]
    first, second = prompts
    split = len(second) // 2
    plans = [
        [ScheduledChunk(None, 0, tuple(first), (tables[0],), True, False),
         ScheduledChunk(None, 0, tuple(second[:split]), (tables[1],), False, False)],
        [None, ScheduledChunk(None, split, tuple(second[split:]), (tables[1],), True, False)],
    ]  # fmt: skip
    lengths = [len(first), len(second)]
    next_tokens: list[int] = []
    for step in range(2 + decodes):
        if step == 0:
            chunks = plans[0]
        else:
            chunks = [ScheduledChunk(None, lengths[i] + step - (2 if i else 1), (token,), (tables[i],), True, True)
                      for i, token in enumerate(next_tokens)]  # fmt: skip
            if step == 1:
                chunks = [chunks[0], plans[1][1]]
        plan = StepPlan(chunks)
        lean = runner.execute(plan).logits.float()
        runner_lean, runner.lean = runner.lean, None
        try:
            hf = runner.execute(plan).logits.float()
        finally:
            runner.lean = runner_lean
        yield lean, hf
        tokens = lean.argmax(-1).tolist()
        next_tokens = tokens if step else [tokens[0]]


def prompts(vocab: int, lengths=(23, 37)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def assert_agrees(lean: torch.Tensor, hf: torch.Tensor, dtype: str) -> None:
    assert lean.shape == hf.shape
    if dtype == "float32":
        torch.testing.assert_close(lean, hf, rtol=1e-5, atol=1e-5)
    else:  # the same roundings in the same order: close, and the same greedy tokens
        torch.testing.assert_close(lean, hf, rtol=1.6e-2, atol=1e-2)
        assert torch.equal(lean.argmax(-1), hf.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_lean_logits_equal_hugging_faces_on_random_models(name, dtype):
    loaded = load_model(ModelConfig(source=f"random:{name}", dtype=dtype, device="cpu"))
    runner = ModelRunner(loaded.model, CACHE)
    steps = 0
    for lean, hf in lockstep(runner, prompts(loaded.model.config.vocab_size), decodes=4):
        assert_agrees(lean, hf, dtype)
        steps += 1
    assert steps == 6


def test_lean_logits_equal_hugging_faces_on_smollm2_float32(smollm2):
    runner = ModelRunner(smollm2.model, CACHE)
    for lean, hf in lockstep(runner, prompts(smollm2.model.config.vocab_size, (9, 14)), decodes=3):
        assert_agrees(lean, hf, "float32")


def test_lean_greedy_tokens_equal_hugging_faces_on_smollm2_bfloat16():
    loaded = load_model(ModelConfig(dtype="bfloat16"))
    runner = ModelRunner(loaded.model, CACHE)
    text = loaded.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    for lean, hf in lockstep(runner, [text, text[:7]], decodes=6):
        assert_agrees(lean, hf, "bfloat16")


def test_the_runner_picks_the_lean_forward_which_calls_no_decoder_layer():
    loaded = load_model(ModelConfig(source="random:tiny-llama", device="cpu"))
    runner = ModelRunner(loaded.model, CACHE)
    assert runner.lean is not None
    calls = []
    loaded.model.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(module))
    plan = StepPlan([ScheduledChunk(None, 0, (5, 6, 7), ([1, 2],), True, False)])
    lean = runner.execute(plan).logits
    assert calls == []
    runner.lean = None  # the Hugging Face forward: module calls, hooks and all
    assert torch.equal(runner.execute(plan).logits, lean) and len(calls) == 1


def test_other_architectures_and_rotary_kinds_keep_the_hugging_face_forward():
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    assert lean_forward_applies(LlamaForCausalLM(LlamaConfig(**tiny)))
    # Dynamic scaling depends on the sequence length: no table indexed by position holds it.
    dynamic = LlamaConfig(**tiny, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert not lean_forward_applies(LlamaForCausalLM(dynamic))
    assert not lean_forward_applies(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)))
