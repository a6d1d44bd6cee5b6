"""How long a request may be: the model's own context (`max_position_embeddings`), a
sliding-window model's included, or less where `--max-context` lowers it."""

from __future__ import annotations

import pytest

from tests.conftest import run_to_completion
from workers.api import SamplingParams
from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.engine import Engine


def engine(source: str, max_context: int = 0) -> Engine:
    return Engine.from_config(
        EngineConfig(
            model=ModelConfig(source=source, threads=1, max_context=max_context),
            cache=CacheConfig(kv_memory_bytes=8 << 20),
        )
    )


def test_a_sliding_window_model_serves_its_whole_context_not_its_window():
    gemma3 = engine("random:tiny-gemma3")  # a window of 16 on five layers in six
    assert gemma3.max_context == 1024
    prompt = list(range(3, 3 + 300))
    tokens, final, _ = run_to_completion(
        gemma3, {0: [("long", prompt, SamplingParams(max_tokens=4, ignore_eos=True))]}
    )["long"]
    assert final.finish_reason == "length" and len(tokens) == 4


def test_max_context_lowers_the_context_and_a_request_past_it_is_refused_alone():
    llama = engine("random:tiny-llama", max_context=64)
    assert llama.max_context == 64
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results = run_to_completion(llama, {0: [("long", list(range(3, 63)), params), ("short", [5, 6, 7], params)]})
    assert "context of 64 tokens" in (results["long"][1].error or "")
    assert results["short"][1].finish_reason == "length"


def test_a_max_context_beyond_the_models_is_refused_at_start():
    with pytest.raises(ValueError, match="exceeds the model's context of 1024 tokens"):
        engine("random:tiny-llama", max_context=4096)
