"""The command-line flags of `inflight worker`, `inflight demo` and `inflight gateway`,
read onto the frozen configs (`service/config.py`, `workers/config.py`).

One table a config (`FlagGroup`), one `Flag` a field, in the order `--help` lists them;
a flag takes its type, default and name from its field (`service/flag_groups.py`), and
a table says only what differs: the help, a name of the flag's own (`--redis-url` sets
`url`), a unit (`--kv-memory-mb` sets bytes). The fields no flag sets are named in
`unflagged`, so a new field is given a flag, or left out, on purpose
(tests/service/test_flags.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from service.config import (
    LOG_FORMATS,
    LOG_LEVELS,
    ROLES,
    DisaggConfig,
    FairQueueConfig,
    GatewayConfig,
    LoggingConfig,
    MetricsConfig,
    RedisConfig,
    WorkerConfig,
)
from service.embedded import embedded_url
from service.flag_groups import Flag, FlagGroup
from workers.config import (
    DTYPES,
    LENGTH_POLICIES,
    WEIGHTS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredConfig,
)

MIB = 1 << 20
API_KEYS_ENV = "INFLIGHT_API_KEYS"


def default_queue_url() -> str:
    """Where a client of the queue (`inflight submit`, the gateway) finds it:
    $REDIS_URL, else the embedded server a local worker starts."""
    redis = RedisConfig()
    return redis.url or embedded_url(redis.embedded_port)


# -- the worker and the demo ----------------------------------------------------------------

REDIS = FlagGroup(
    "Redis",
    RedisConfig,
    (
        Flag(
            "url",
            "the server jobs arrive on: $REDIS_URL, else an embedded Valkey server on --embedded-port",
            name="--redis-url",
            show_default=False,  # it may hold a password
        ),
        Flag("embedded_port", "port of the embedded Valkey server used when no URL is given"),
        Flag("embedded_data_dir", "the embedded server's data directory"),
        Flag("consumer", "this worker's stable name in the consumer group"),
        Flag("requests_stream", "where jobs arrive"),
        Flag("dead_letter_stream", "jobs that could not be served, with their error"),
        Flag("control_stream", "cancellations"),
        Flag("shutdown_grace_s", "on SIGINT/SIGTERM, time to finish in-flight requests before leaving them pending"),
        Flag("max_held_jobs", "most jobs held at once, running or queued here; 0 = twice the running cap"),
        Flag("claim_idle_ms", "lease: take over entries whose worker stopped renewing them this long ago"),
        Flag("reply_ttl_s", "reply streams expire this long after their last event"),
        Flag("reply_prefixes", "a key prefix reply_to may use", name="--reply-prefix"),
        Flag("cancel_ttl_s", "how long a cancel is remembered"),
        Flag("dead_letter_max_len", "approximate cap on the dead-letter stream"),
        Flag("control_max_len", "approximate cap on the control stream"),
    ),
    unflagged=("group", "block_ms", "max_deliveries"),
)

MODEL = FlagGroup(
    "model",
    ModelConfig,
    (
        Flag(
            "source",
            "HF model dir or hub id, a .gguf file, or random:NAME (random weights, e.g. random:smollm2-135m) "
            "(default: bundled SmolLM2-135M-Instruct)",
            name="--model",
            show_default=False,
        ),
        Flag("dtype", "weights and activations", choices=DTYPES),
        Flag(
            "weights",
            "linear weights: dense (in --dtype), int8 per output channel or int4 in groups of 32 (bfloat16), on a CPU",
            choices=WEIGHTS,
        ),
        Flag("cache_dir", "where converted GGUF weights are cached"),
        Flag("threads", "torch threads, 0 = one per core other processes leave free"),
        Flag("device", "auto, cpu, cuda or cuda:N"),
        Flag("cuda_graphs", "on a GPU, launch decode-only steps kernel by kernel instead of replaying CUDA graphs"),
        Flag("max_graph_batch", "largest decode batch replayed from a CUDA graph"),
        Flag("max_context", "longest request (prompt and output) in tokens, 0 = the model's max_position_embeddings"),
        Flag(
            "tensor_parallel",
            "ranks one worker runs on, each with 1/N of the heads and MLP (processes over gloo on a CPU)",
        ),
    ),
)

CACHE = FlagGroup(
    "KV cache",
    CacheConfig,
    (
        Flag("block_size", "tokens per KV block"),
        Flag("kv_memory_bytes", "KV cache size in MiB", name="--kv-memory-mb", unit=MIB),
        Flag(
            "swap_memory_bytes",
            "host KV pool for preempted requests and the prefix cache's host tier in MiB, 0 = neither: "
            "recompute instead",
            name="--swap-memory-mb",
            unit=MIB,
        ),
        Flag("prefix_caching", "compute every prompt from scratch: no reuse of cached prefix blocks"),
        Flag("trim_windows", "keep every KV block in sliding-window layers too (prefill and decode workers always do)"),
    ),
)

SCHEDULER = FlagGroup(
    "scheduler",
    SchedulerConfig,
    (
        Flag("max_batch_tokens", "tokens per step"),
        Flag("max_prefill_tokens", "prompt tokens per step"),
        Flag("max_decode_tokens", "decode tokens per step"),
        Flag("max_prefill_chunk", "prompt tokens of one request per step"),
        Flag("max_running_requests", "requests holding KV blocks at once"),
        Flag("takeover_allowance", "running slots beyond those that only taken-over requests use"),
        Flag("max_running_batch", "batch jobs running at once (0 = up to max_running_requests)"),
        Flag(
            "max_batch_prefill_tokens",
            "batch jobs' prompt tokens in a step with interactive requests (0 = up to max_prefill_tokens)",
        ),
        Flag("priority_bound_s", "no request is overtaken by one arriving this much later"),
        Flag(
            "fair_preempt_after_s",
            "a tenant 2+ running jobs below another's swaps one of the most-served tenant's out after waiting this "
            "long (0 = off)",
        ),
        Flag(
            "length_policy",
            "within a priority: first come first served, shortest predicted output first, or true lengths (bench)",
            choices=LENGTH_POLICIES,
        ),
        Flag("length_bound_s", "the largest queue head start a short predicted output buys"),
        Flag("length_oracle", "with --length-policy oracle: a JSON file of true output lengths (benchmarks)"),
        Flag("deadline_length_margin", "deadline checks take a job's output as this many times its predicted length"),
    ),
)

STRUCTURED = FlagGroup("structured outputs", StructuredConfig, (), unflagged=("grammar_cache_size",))

SPECULATIVE = FlagGroup(
    "speculative decoding",
    SpeculativeConfig,
    (
        Flag("enabled", "never draft tokens by prompt lookup (speculative decoding)", name="--no-speculative"),
        Flag("max_draft_tokens", "draft tokens one request verifies per step, at most"),
        Flag(
            "acceptance_threshold",
            "a request whose drafts are accepted less than this stops drafting for a cool-down",
            name="--spec-acceptance-threshold",
        ),
        Flag(
            "cooldown_steps",
            "steps a gated request waits before drafting again, doubled after each pause that follows another",
            name="--spec-cooldown-steps",
        ),
    ),
    unflagged=("min_ngram", "max_ngram"),
)

LORA = FlagGroup(
    "multi-LoRA",
    LoRAConfig,
    (
        Flag(
            "lora_dir",
            "a folder of PEFT LoRA adapters, one a subfolder, loaded at start and named by it; jobs name one "
            "(default: none, multi-LoRA off)",
            show_default=False,
        ),
        Flag("max_loras", "adapters resident at once: a step serves at most this many"),
        Flag("max_lora_rank", "the largest adapter rank served (a higher one is refused at load)"),
        Flag("max_host_loras", "adapters kept in host memory, 0 = all (the others are read again from their folder)"),
    ),
)

METRICS = FlagGroup(
    "metrics",
    MetricsConfig,
    (
        Flag("port", "Prometheus /metrics port, 0 = off", name="--metrics-port"),
        Flag("host", "address /metrics listens on", name="--metrics-host"),
        Flag("ingest_poll_s", "seconds between Redis ingest-lag polls"),
    ),
)

LOGGING = FlagGroup(
    "logging",
    LoggingConfig,
    (
        Flag("format", "auto = JSON unless stderr is a terminal", name="--log-format", choices=LOG_FORMATS),
        Flag("level", "the least severe events logged", name="--log-level", choices=LOG_LEVELS),
        Flag("log_prompts", "put prompts and outputs in the per-request log line"),
    ),
)

DISAGG = FlagGroup(
    "disaggregated prefill and decode",
    DisaggConfig,
    (
        Flag("role", "both = the whole job; prefill and decode split it over two pools", choices=ROLES),
        Flag("handoff_stream", "where prefill workers hand jobs to decode workers"),
        Flag("handoff_min_prompt_tokens", "shorter prompts are served whole by their prefill worker"),
        Flag(
            "handoff_memory_bytes",
            "host memory, on each side, for handed-off prompts' K/V, held until the job ends "
            "(or --handoff-hold-s); full: the prompt is computed again",
            name="--handoff-memory-mb",
            unit=MIB,
        ),
        Flag(
            "handoff_hold_s",
            "a prefill worker frees a prompt's K/V this long after its handoff unless the decode worker "
            "confirmed the job's end sooner",
        ),
    ),
)

FAIR_QUEUE = FlagGroup(
    "fair queueing, caps and quotas (docs/protocol.md)",
    FairQueueConfig,
    (
        Flag("enabled", "admit jobs into per-tenant queues and take them in fair order", name="--fair-queue"),
        Flag("max_queued_jobs", "admitted jobs not yet taken, over the stream (0 = no cap)"),
        Flag("max_queued_tokens", "their prompt tokens, over the stream (0 = no cap)"),
        Flag("max_queue_wait_s", "seconds a new interactive job would wait for a slot (0 = no cap)"),
        Flag("tenant_max_queued_jobs", "admitted jobs not yet taken, per tenant (0 = no cap)"),
        Flag("tenant_max_queued_tokens", "their prompt tokens, per tenant (0 = no cap)"),
        Flag("tenant_tokens_per_s", "tokens a tenant may be served per second (0 = no quota)"),
        Flag("charge_prompt_weight", "fair share: a tenant's charge per prompt token"),
        Flag("charge_output_weight", "fair share: a tenant's charge per output token"),
        Flag("admission_wait_ms", "before taking jobs, wait this long at most for new arrivals to be admitted"),
    ),
)

# EngineConfig's fields, each a config with its table.
ENGINE: Mapping[str, FlagGroup] = {
    "model": MODEL,
    "cache": CACHE,
    "scheduler": SCHEDULER,
    "structured": STRUCTURED,
    "speculative": SPECULATIVE,
    "lora": LORA,
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that map onto `EngineConfig` (defaults shown in --help)."""
    for group in ENGINE.values():
        if group.flags:
            group.add_to(parser)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: group.build(args) for name, group in ENGINE.items()})


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `inflight worker`: the queue's, the engine's, metrics and logging."""
    REDIS.add_to(parser)
    add_engine_arguments(parser)
    METRICS.add_to(parser)
    LOGGING.add_to(parser)
    DISAGG.add_to(parser)
    FAIR_QUEUE.add_to(parser)


def worker_config_from_args(args: argparse.Namespace, url: str) -> WorkerConfig:
    """`url` is the resolved server (the flag, or the embedded server's address)."""
    return WorkerConfig(
        engine=engine_config_from_args(args),
        redis=REDIS.build(args, url=url),
        metrics=METRICS.build(args),
        logging=LOGGING.build(args),
        disagg=DISAGG.build(args),
        fair_queue=FAIR_QUEUE.build(args),
    )


# -- the gateway ---------------------------------------------------------------------------

GATEWAY = FlagGroup(
    "gateway",
    GatewayConfig,
    (
        Flag("host", "address to listen on"),
        Flag("port", "HTTP port; /metrics is served on it too"),
        Flag(
            "redis_url",
            "the queue's server: $REDIS_URL, else the embedded server's address",
            default=default_queue_url,
        ),
        Flag("requests_stream", "where jobs go"),
        Flag("control_stream", "where cancels go"),
        Flag("model_name", "the `model` requests must name", name="--served-model-name"),
        Flag("default_max_tokens", "max_tokens of a request that gives none"),
        Flag("max_queue_depth", "answer 429 above this many undelivered jobs, 0 = no limit"),
        Flag("max_queue_age_s", "answer 429 while the oldest undelivered job waited longer, 0 = no limit"),
        Flag("queue_poll_s", "how often the queue's depth and age are looked up"),
        Flag("retry_after_s", "Retry-After of a 429"),
        Flag("reply_timeout_s", "cancel and answer 504 when a job's replies stay silent this long"),
        Flag("event_ids", "SSE event ids on every streamed answer (else where the request asks)"),
        Flag("stream_ttl_s", "a streamed answer can be resumed this long after its request"),
        Flag("resume_grace_s", "a job whose client left is cancelled after this long unless resumed, 0 = at once"),
        Flag("max_file_bytes", "largest file uploaded for the Batch API, in MiB", name="--max-file-mb", unit=MIB),
        Flag("max_file_lines", "most lines (requests) in an uploaded file"),
        Flag("file_ttl_s", "files (batch input and output) are deleted this long after they were made"),
        Flag("batch_max_outstanding", "jobs of one batch queued or running at once"),
        Flag("batch_lease_s", "a dead gateway's batches are taken over by another after this long"),
        Flag("batch_poll_s", "how often a gateway looks for batches to drive"),
    ),
    # api_keys: from --api-keys-file and $INFLIGHT_API_KEYS together; logging: GATEWAY_LOGGING;
    # batch_window_s: OpenAI's "24h", shorter only in tests.
    unflagged=("group", "api_keys", "max_body_bytes", "batch_window_s", "logging"),
)

GATEWAY_LOGGING = LOGGING.without("log_prompts")  # the gateway logs no prompts


def read_api_keys(path: Path | None, env: str | None) -> dict[str, str | None]:
    """Keys, each to the tenant it is bound to (None: unbound), from a file and from the
    environment variable's text (comma-separated keys, unbound). A line of the file is
    `KEY` or `KEY TENANT` (whitespace between); blank lines and # comments are skipped.
    A key also given unbound keeps its tenant; one bound to two tenants is an error."""
    keys: dict[str, str | None] = dict.fromkeys(key.strip() for key in (env or "").split(","))
    keys.pop("", None)
    if path is None:
        return keys
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2:
            raise ValueError(f"{path}, line {number}: expected `KEY` or `KEY TENANT`, got {len(words)} words")
        key, tenant = words[0], words[1] if len(words) == 2 else None
        if tenant is None:
            keys.setdefault(key, None)
        elif keys.get(key) not in (None, tenant):
            raise ValueError(f"{path}, line {number}: the key is bound to two tenants, {keys[key]} and {tenant}")
        else:
            keys[key] = tenant
    return keys


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `inflight gateway`, each mapping onto a `GatewayConfig` field."""
    gateway = GATEWAY.add_to(parser)
    gateway.add_argument(
        "--api-keys-file",
        type=Path,
        help=f"bearer keys, one a line, each optionally followed by the tenant it binds: `KEY [TENANT]`; "
        f"also ${API_KEYS_ENV} (comma-separated, unbound); none = no auth",
    )
    GATEWAY_LOGGING.add_to(parser)


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GATEWAY.build(
        args,
        api_keys=read_api_keys(args.api_keys_file, os.environ.get(API_KEYS_ENV)),
        logging=GATEWAY_LOGGING.build(args),
    )
