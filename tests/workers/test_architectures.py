"""The supported architectures (docs/features.md, "Supported architectures"), a row each.

Every row is a tiny random-weight model of its architecture, saved to a folder and loaded
through `load_model` as a user's checkpoint would be. The engine serves four prompts of
different lengths, batched, in prefill chunks of 11 tokens (and longer than the window of
8 where the model has one), greedy in float32; every token must equal transformers' own
`generate` on the same folder. Each row also states which forward runs it on a CPU (the
lean forward, or transformers' own); every row runs on the default attention backend,
windows, softcap and sinks included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
)

from gpu.cpu.attention import CpuAttentionBackend, cpu_kernel
from tests.conftest import run_to_completion
from workers.api import SamplingParams
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.model_loader import load_model
from workers.random_models import build_tokenizer

VOCAB = 512
WINDOW = 8  # shorter than three of the four prompts
PROMPT_LENGTHS = (1, 9, 30, 75)
NEW_TOKENS = 12
IDS: dict[str, Any] = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # build_tokenizer's
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    **IDS,
)
MOE: dict[str, Any] = dict(num_experts_per_tok=2)


@dataclass(frozen=True)
class Architecture:
    config: Callable[[], PretrainedConfig]
    attention: str  # as the table in docs/features.md says it
    lean: bool  # the lean forward runs it on a CPU; else transformers' own forward


ARCHITECTURES = {
    "llama": Architecture(lambda: LlamaConfig(**TINY), "full", lean=True),
    "qwen2": Architecture(lambda: Qwen2Config(**TINY), "full", lean=True),
    "qwen3": Architecture(lambda: Qwen3Config(**TINY), "full", lean=False),
    "mistral": Architecture(lambda: MistralConfig(**TINY, sliding_window=None), "full", lean=True),
    "mistral-window": Architecture(lambda: MistralConfig(**TINY, sliding_window=WINDOW), "sliding window", lean=True),
    "gemma2": Architecture(
        lambda: Gemma2Config(**TINY, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
        "softcap, sliding window every other layer",
        lean=False,
    ),
    "gemma3": Architecture(
        lambda: Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6}, sliding_window=WINDOW),
        "hybrid: 5 sliding-window layers to 1 full",
        lean=False,
    ),
    "phi3": Architecture(lambda: Phi3Config(**TINY), "full", lean=False),
    "gpt2": Architecture(
        lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, **IDS),
        "full",
        lean=False,
    ),
    "opt": Architecture(
        lambda: OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=96,
            word_embed_proj_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            **IDS,
        ),
        "full",
        lean=False,
    ),
    "gpt-neox": Architecture(
        lambda: GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            **IDS,
        ),
        "full",
        lean=False,
    ),
    "qwen2-moe": Architecture(
        lambda: Qwen2MoeConfig(
            **TINY, **MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48
        ),
        "full, MoE",
        lean=False,
    ),
    "mixtral": Architecture(lambda: MixtralConfig(**TINY, **MOE, num_local_experts=4), "full, MoE", lean=False),
    "gpt-oss": Architecture(
        lambda: GptOssConfig(
            **TINY,
            **MOE,
            num_local_experts=4,
            sliding_window=WINDOW,
            # YaRN, as GPT-OSS ships, stretched from 64 positions so the prompts go past it.
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
        "sinks, sliding window every other layer, MoE",
        lean=False,
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """At these shapes a second thread costs more in handing work over than it saves (ten
    times the wall time on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB)


def save_tiny_model(arch: str, folder: Path, tokenizer) -> Path:
    """A checkpoint folder as a user brings one: seeded random weights and a tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ARCHITECTURES[arch].config(), dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_tokens(folder: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """What transformers' `generate` gives, greedy, one prompt at a time on its eager attention."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    want = {}
    with torch.inference_mode():
        for rid, ids in prompts.items():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            want[rid] = out[0, len(ids) :].tolist()
    return want


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_serves_what_transformers_generates(arch, tokenizer, tmp_path):
    row = ARCHITECTURES[arch]
    folder = save_tiny_model(arch, tmp_path / arch, tokenizer)
    loaded = load_model(ModelConfig(source=str(folder), device="cpu"))
    engine = Engine(
        loaded,
        EngineConfig(
            cache=CacheConfig(kv_memory_bytes=4 << 20, swap_memory_bytes=0),
            scheduler=SchedulerConfig(max_batch_tokens=32, max_prefill_chunk=11),
        ),
    )
    assert (engine.runner.lean is not None) == row.lean
    # Windowed layers keep only their window's blocks (tests/workers/test_window_blocks.py).
    assert (WINDOW in engine.runner.kv_cache.layout.windows) == ("sliding" in row.attention)
    # The default backend: the CPU kernels, wherever g++ builds them.
    assert isinstance(engine.runner.backend, CpuAttentionBackend) == (cpu_kernel() is not None)

    generator = torch.Generator().manual_seed(1)
    prompts = {f"r{n}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS}
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    # Two steps apart: later prompts join while earlier ones are still prefilling or decoding.
    results = run_to_completion(engine, {2 * i: [(rid, ids, params)] for i, (rid, ids) in enumerate(prompts.items())})

    assert {rid: results[rid][0] for rid in prompts} == reference_tokens(folder, prompts)
    assert engine.allocator.num_free == engine.allocator.num_blocks
