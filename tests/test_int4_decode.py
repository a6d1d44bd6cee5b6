"""With int4 weights, a decode step's layers run in one C++ call (`gpu/cpu/int4_decode.py`):
it computes what the lean forward's torch path computes over the same weights and cache,
for one decode, several requests, and a token with speculative drafts; every other step
stays on the torch path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu.attention import SequenceSlice
from gpu.cpu.int4_decode import MAX_TOKENS, Int4DecodeLayers, decode_library
from gpu.cpu.int4_linear import Int4Linear
from gpu.cpu.native_build import CPU_CXX_FLAGS, PORTABLE_CPU_CXX_FLAGS
from workers.config import CacheConfig, ModelConfig
from workers.model_loader import load_model
from workers.model_runner import ModelRunner
from workers.scheduler import ScheduledChunk, StepPlan

CACHE = CacheConfig(kv_memory_bytes=16 << 20, swap_memory_bytes=0)
BLOCKS_PER_REQUEST = 20


@pytest.mark.parametrize("flags", [CPU_CXX_FLAGS, PORTABLE_CPU_CXX_FLAGS], ids=["native", "portable"])
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_the_matmul_computes_torchs_int4_linear(flags, rows):
    """Both builds (AVX-512 where the CPU has it, plain loops otherwise), over tiles of
    up to four tokens."""
    torch.manual_seed(rows)
    linear = Int4Linear(nn.Linear(1536, 192, bias=False).to(torch.bfloat16))
    x = torch.randn(rows, 1536).to(torch.bfloat16)
    got = torch.empty(rows, 192, dtype=torch.bfloat16)
    decode_library(flags).int4_linear(linear.packed.data_ptr(), linear.scales_and_zeros.data_ptr(), 192, 1536,
                                      x.data_ptr(), rows, got.data_ptr(), 2)  # fmt: skip
    with torch.inference_mode():
        want = linear(x)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    assert (got != want).float().mean() < 0.01  # the same sums, in another order


def int4_runner(num_layers: int | None = None) -> tuple[ModelRunner, object]:
    """SmolLM2 with int4 weights, its first `num_layers` layers (all by default)."""
    settings = ModelConfig(dtype="bfloat16", weights="int4")
    loaded = load_model(settings)
    if num_layers is not None:
        loaded.model.config.num_hidden_layers = num_layers
    return ModelRunner(loaded.model, CACHE, model_config=settings), loaded.tokenizer


@pytest.fixture(scope="module")
def full_runner() -> tuple[ModelRunner, object]:
    return int4_runner()


def both_paths(runner: ModelRunner, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits in one call, then the same step again on the torch path (which
    writes the same cache slots)."""
    layers = runner.lean.decode_layers
    one_call = runner.execute(plan).logits.float()
    runner.lean.decode_layers = None
    try:
        torch_path = runner.execute(plan).logits.float()
    finally:
        runner.lean.decode_layers = layers
    return one_call, torch_path


def decode_steps(runner: ModelRunner, tokenizer):
    """(one call, torch path) logits of each decode step: two prompts run on the torch
    path, then the first request decodes alone, then both (contexts of different
    lengths), then a token with four drafts: five rows, each a decode over its own
    context, as the runner verifies drafts (more rows than the matmul takes at a time)."""
    assert isinstance(runner.lean.decode_layers, Int4DecodeLayers)
    texts = ["The capital of France is Paris. The capital of Italy is", "Water boils at"]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    tables = [list(range(1 + i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(len(prompts))]
    tokens = []
    for prompt, table in zip(prompts, tables):
        logits = runner.execute(StepPlan([ScheduledChunk(None, 0, tuple(prompt), table, True, False)])).logits
        tokens.append(int(logits.argmax(-1)))
    lengths = [len(prompt) for prompt in prompts]
    for step in range(6):
        running = range(1 if step < 2 else 2)
        plan = StepPlan([ScheduledChunk(None, lengths[i], (tokens[i],), tables[i], True, True) for i in running])
        one_call, torch_path = both_paths(runner, plan)
        yield one_call, torch_path
        for i in running:
            tokens[i] = int(torch_path[i].argmax())
            lengths[i] += 1
    drafts = tuple(tokenizer(" and the capital of")["input_ids"][:4])
    plan = StepPlan([ScheduledChunk(None, lengths[0], (tokens[0], *drafts), tables[0], True, True, drafts)])
    one_call, torch_path = both_paths(runner, plan)
    assert one_call.shape[0] == 5
    yield one_call, torch_path


def test_one_layer_computes_what_the_torch_path_computes():
    """The same roundings at the same points: only the order of the fp32 sums in the
    matmuls may differ, which flips a rare bfloat16 rounding by one unit (0.0625 for
    logits from 8 to 16), and a flip in the hidden state moves many logits a little."""
    runner, tokenizer = int4_runner(num_layers=1)
    for one_call, torch_path in decode_steps(runner, tokenizer):
        torch.testing.assert_close(one_call, torch_path, rtol=1.6e-2, atol=0.0625)


def test_the_whole_stack_stays_with_the_torch_path(full_runner):
    """Over 30 layers those rare flips grow (about 2% of the logits' norm here), so the
    test is the step's tokens: the same greedy token at nearly every row."""
    rows = agreeing = 0
    for one_call, torch_path in decode_steps(*full_runner):
        assert one_call.shape == torch_path.shape
        relative = (one_call - torch_path).norm() / torch_path.norm()
        assert relative < 0.05, f"relative difference {relative:.4f}"
        rows += one_call.shape[0]
        agreeing += int((one_call.argmax(-1) == torch_path.argmax(-1)).sum())
    assert rows == 15 and agreeing >= 14


def test_only_decode_steps_of_few_tokens_take_the_one_call(full_runner):
    runner, _ = full_runner
    layers = runner.lean.decode_layers
    backend = runner.backend
    decode = backend.prepare([SequenceSlice(0, 1, 10, [1])], 1)
    assert layers.takes(decode, 1)
    many = backend.prepare([SequenceSlice(i, 1, 10, [1 + i]) for i in range(MAX_TOKENS + 1)], MAX_TOKENS + 1)
    assert not layers.takes(many, MAX_TOKENS + 1)
    prompt = backend.prepare([SequenceSlice(0, 5, 5, [1])], 5)
    assert not layers.takes(prompt, 5)


@pytest.mark.parametrize("weights", ["dense", "int8"])
def test_other_weights_keep_the_torch_path(weights):
    settings = ModelConfig(dtype="bfloat16", weights=weights)
    loaded = load_model(settings)
    runner = ModelRunner(loaded.model, CACHE, model_config=settings)
    assert runner.lean is not None and runner.lean.decode_layers is None
