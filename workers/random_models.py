"""Random-weight models from configs written here: `ModelConfig.source = "random:<name>"`.

Nothing is downloaded and no weights file is read, so they run on an air-gapped host
(ops/gpu-check.sh). With EOS ignored, a step's cost does not depend on the weight values,
so they serve for benchmarks at a real model's shape, and two attention backends on the
same loaded model must still produce the same greedy tokens.

The weights are drawn from a fixed seed on the target device: the same name, dtype and
device kind give the same weights. The tokenizer is built in code too: one token per
character of printable ASCII (so any text encodes to varied ids), special tokens, and
filler tokens `<tN>` for the rest of the vocabulary, so every id decodes.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

PREFIX = "random:"
SEED = 0
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL = (UNK, BOS, EOS)  # ids 0, 1, 2
CHARACTERS = string.printable  # letters, digits, punctuation and whitespace
# Renders chat messages, so chat prompts work too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Small enough to run on a CPU in tests, with head_dims the CUDA kernels cover.
_TINY: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    max_position_embeddings=1024,
)
_IDS: dict[str, Any] = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": lambda: LlamaConfig(**_TINY, **_IDS, num_attention_heads=4, num_key_value_heads=2),
    # head_dim 128, and Qwen2's biased q/k/v projections.
    "tiny-qwen2": lambda: Qwen2Config(**_TINY, **_IDS, num_attention_heads=2, num_key_value_heads=1),
    # Full attention, like the two above (tiny-gemma3 has windows).
    "tiny-mistral": lambda: MistralConfig(
        **_TINY, **_IDS, num_attention_heads=4, num_key_value_heads=1, sliding_window=None
    ),
    # Gemma 3's hybrid stack: five layers with a window of 16 tokens (shorter than most
    # prompts) to one global layer.
    "tiny-gemma3": lambda: Gemma3TextConfig(
        **{**_TINY, "num_hidden_layers": 6},
        **_IDS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=16,
    ),
    # SmolLM2-135M's config (the bundled model's architecture).
    "smollm2-135m": lambda: LlamaConfig(
        **_IDS,
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # Qwen2.5-0.5B's shape (14 heads over 2 KV heads: two ranks share it), for
    # `inflight bench --scenario tp` on a CPU.
    "qwen2.5-0.5b-shape": lambda: Qwen2Config(
        **_IDS,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    # Llama-3-8B's shape, for GPU benchmarks (8B parameters: not for a CPU).
    "llama3-8b-shape": lambda: _llama3_8b_shape(32),
    # Its first two layers: a CPU holds it (3 GB in bfloat16), e.g. to run its shapes at --tensor-parallel 2.
    "llama3-8b-shape-2-layers": lambda: _llama3_8b_shape(2),
}


def _llama3_8b_shape(layers: int) -> LlamaConfig:
    return LlamaConfig(
        **_IDS,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
    )


def random_name(source: str) -> str | None:
    """The model name in a `random:<name>` source, or None for any other source."""
    if not source.startswith(PREFIX):
        return None
    name = source[len(PREFIX) :]
    if name not in CONFIGS:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(sorted(CONFIGS))}")
    return name


def model_config(name: str) -> PretrainedConfig:
    """The transformers config of a random model."""
    return CONFIGS[name]()


def build_model(name: str, dtype: torch.dtype, device: torch.device, attn_implementation: str = "sdpa"):
    """The model with seeded random weights, created directly on `device` in `dtype`."""
    # fork_rng: seeding must not disturb the caller's random streams.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), device:
        torch.manual_seed(SEED)
        config = model_config(name)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with an entry for each of `vocab_size` ids."""
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for char in CHARACTERS:
        vocab.setdefault(char, len(vocab))
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tokenizer.decoder = decoders.Fuse()  # join the pieces with nothing between them
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=UNK,
        chat_template=CHAT_TEMPLATE,
    )
