"""The worker's typed configuration and its command-line flags.

The edge's own settings live here (Redis, metrics, logging) as frozen, validated
dataclasses, gathered with the engine's (`workers.config`) into one `WorkerConfig`.
The CLI maps its flags onto them; no other module reads the environment.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from workers.config import (
    DTYPES,
    WEIGHTS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_cache_dir,
)


@dataclass(frozen=True)
class RedisConfig:
    # The server jobs and replies go through: $REDIS_URL, e.g. redis://127.0.0.1:6379,
    # redis://user:password@host:6379/0 (AUTH/ACL) or
    # rediss://host:6380?ssl_ca_certs=/path/ca.pem (TLS), or a Redis Cluster through one
    # of its nodes, redis+cluster://host:7000 (service/connect.py). Empty: an embedded
    # Valkey server (service/embedded.py) on 127.0.0.1:embedded_port.
    url: str = field(default_factory=lambda: os.environ.get("REDIS_URL", ""))
    embedded_port: int = 6399
    # Where the embedded server keeps its append-only file (queued jobs survive restarts).
    embedded_data_dir: Path = field(default_factory=lambda: default_cache_dir() / "valkey")
    requests_stream: str = "inflight:requests"
    control_stream: str = "inflight:control"
    group: str = "inflight"
    # Stable per worker and unique in the group, so a restarted worker finds its own
    # pending entries again (and only its own). Two workers on one host need two names.
    consumer: str = field(default_factory=socket.gethostname)
    dead_letter_stream: str = "inflight:dead"
    # How long one blocking read waits for new entries; also how often an idle worker
    # looks for entries whose lease ran out.
    block_ms: int = 500
    # The lease: a worker renews the entries it holds every claim_idle_ms / 4; an entry
    # not renewed for this long (its worker died or hangs) is taken over by another.
    claim_idle_ms: int = 2000
    # An entry delivered more times than this goes to the dead-letter stream.
    max_deliveries: int = 3
    # Reply streams (and their owner keys) expire this long after their last event.
    reply_ttl_s: int = 3600
    # reply_to must start with one of these: a job cannot make the worker write
    # anywhere else in Redis.
    reply_prefixes: tuple[str, ...] = ("inflight:out:",)
    # How long a cancel is remembered: a job submitted before it and taken up to this
    # long after it is cancelled without running. The control stream is trimmed to it.
    cancel_ttl_s: int = 3600
    # Caps (approximate, as XADD/XTRIM MAXLEN ~ trims them) on the dead-letter and
    # control streams, the two streams no consumer deletes from.
    dead_letter_max_len: int = 10_000
    control_max_len: int = 100_000
    # On SIGINT or SIGTERM: stop claiming, give in-flight requests this long to finish,
    # then leave the rest pending (unacked) for other workers to take over and continue.
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "block_ms",
            "claim_idle_ms",
            "max_deliveries",
            "reply_ttl_s",
            "cancel_ttl_s",
            "dead_letter_max_len",
            "control_max_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.reply_prefixes or not all(self.reply_prefixes):
            raise ValueError("reply_prefixes must be non-empty strings")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        object.__setattr__(self, "embedded_data_dir", Path(self.embedded_data_dir))

    @property
    def renew_interval_s(self) -> float:
        return self.claim_idle_ms / 4000


def add_redis_arguments(parser) -> None:
    """The worker's flags that map onto `RedisConfig`."""
    redis = RedisConfig()
    group = parser.add_argument_group("queue")
    group.add_argument(
        "--redis-url", default=redis.url, help="default: $REDIS_URL, else an embedded Valkey server on --embedded-port"
    )
    group.add_argument(
        "--embedded-port",
        type=int,
        default=redis.embedded_port,
        help="port of the embedded Valkey server used when no URL is given (default: %(default)s)",
    )
    group.add_argument(
        "--embedded-data-dir",
        type=Path,
        default=redis.embedded_data_dir,
        help="the embedded server's data directory (default: %(default)s)",
    )
    group.add_argument(
        "--consumer",
        default=redis.consumer,
        help="this worker's stable name in the consumer group (default: %(default)s)",
    )
    group.add_argument("--requests-stream", default=redis.requests_stream)
    group.add_argument("--dead-letter-stream", default=redis.dead_letter_stream)
    group.add_argument("--control-stream", default=redis.control_stream)
    group.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=redis.shutdown_grace_s,
        help="on SIGINT/SIGTERM, time to finish in-flight requests before leaving them pending (default: %(default)s)",
    )
    group.add_argument(
        "--claim-idle-ms",
        type=int,
        default=redis.claim_idle_ms,
        help="lease: take over entries whose worker stopped renewing them this long ago (default: %(default)s)",
    )
    group.add_argument(
        "--reply-ttl-s",
        type=int,
        default=redis.reply_ttl_s,
        help="reply streams expire this long after their last event (default: %(default)s)",
    )
    group.add_argument(
        "--reply-prefix",
        action="append",
        dest="reply_prefixes",
        help=f"a key prefix reply_to may use (repeatable; default: {' '.join(redis.reply_prefixes)})",
    )
    group.add_argument(
        "--cancel-ttl-s",
        type=int,
        default=redis.cancel_ttl_s,
        help="how long a cancel is remembered (default: %(default)s)",
    )
    group.add_argument(
        "--dead-letter-max-len",
        type=int,
        default=redis.dead_letter_max_len,
        help="approximate cap on the dead-letter stream (default: %(default)s)",
    )
    group.add_argument(
        "--control-max-len",
        type=int,
        default=redis.control_max_len,
        help="approximate cap on the control stream (default: %(default)s)",
    )


def redis_config_from_args(args, url: str) -> RedisConfig:
    """`url` is the resolved server (the flag, or the embedded server's address)."""
    return RedisConfig(
        url=url,
        embedded_port=args.embedded_port,
        embedded_data_dir=args.embedded_data_dir,
        consumer=args.consumer,
        requests_stream=args.requests_stream,
        dead_letter_stream=args.dead_letter_stream,
        control_stream=args.control_stream,
        shutdown_grace_s=args.shutdown_grace_s,
        claim_idle_ms=args.claim_idle_ms,
        reply_ttl_s=args.reply_ttl_s,
        reply_prefixes=tuple(args.reply_prefixes or RedisConfig().reply_prefixes),
        cancel_ttl_s=args.cancel_ttl_s,
        dead_letter_max_len=args.dead_letter_max_len,
        control_max_len=args.control_max_len,
    )


LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class MetricsConfig:
    # Port of the worker's Prometheus endpoint (GET /metrics); 0 serves none.
    port: int = 9464
    # Address it listens on; 0.0.0.0 so Prometheus in another container can scrape it.
    host: str = "0.0.0.0"
    # How often the worker asks Redis for the ingest lag (XINFO GROUPS, XPENDING, XLEN);
    # from the event loop, never the model thread.
    ingest_poll_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("metrics port must be in [0, 65535]")
        if not self.ingest_poll_s > 0:
            raise ValueError("ingest_poll_s must be > 0")


@dataclass(frozen=True)
class LoggingConfig:
    # auto: JSON lines when stderr is not a terminal, human-readable console output when it is.
    format: str = "auto"
    level: str = "info"
    # Prompts and generated text go into the per-request log line only when the operator
    # opts in: they may hold personal data.
    log_prompts: bool = False

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {LOG_FORMATS}, got {self.format!r}")
        if self.level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {LOG_LEVELS}, got {self.level!r}")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one `inflight worker` process runs with."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def worker_config_from_args(args, url: str) -> WorkerConfig:
    """`url` is the resolved server (the flag, or the embedded server's address)."""
    return WorkerConfig(
        engine_config_from_args(args),
        redis_config_from_args(args, url),
        metrics_config_from_args(args),
        logging_config_from_args(args),
    )


def add_engine_arguments(parser) -> None:
    """The command-line flags that map onto `EngineConfig` (defaults shown in --help)."""
    model, cache, sched, spec = ModelConfig(), CacheConfig(), SchedulerConfig(), SpeculativeConfig()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=model.source,
        help=(
            "HF model dir or hub id, a .gguf file, or random:NAME (random weights, e.g. "
            "random:smollm2-135m) (default: bundled SmolLM2-135M-Instruct)"
        ),
    )
    group.add_argument("--dtype", default=model.dtype, choices=DTYPES)
    group.add_argument(
        "--weights",
        default=model.weights,
        choices=WEIGHTS,
        help=(
            "linear weights: dense (in --dtype), int8 per output channel or int4 in groups of 32 "
            "(bfloat16), on a CPU (default: %(default)s)"
        ),
    )
    group.add_argument(
        "--cache-dir",
        type=Path,
        default=model.cache_dir,
        help="where converted GGUF weights are cached (default: %(default)s)",
    )
    group.add_argument("--threads", type=int, default=model.threads, help="torch threads, 0 = one per core")
    group.add_argument("--device", default=model.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    group.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on a GPU, launch decode-only steps kernel by kernel instead of replaying CUDA graphs",
    )
    group.add_argument(
        "--max-graph-batch",
        type=int,
        default=model.max_graph_batch,
        help="largest decode batch replayed from a CUDA graph (default: %(default)s)",
    )
    group.add_argument(
        "--block-size", type=int, default=cache.block_size, help="tokens per KV block (default: %(default)s)"
    )
    group.add_argument(
        "--kv-memory-mb",
        type=int,
        default=cache.kv_memory_bytes >> 20,
        help="KV cache size in MiB (default: %(default)s)",
    )
    group.add_argument(
        "--swap-memory-mb",
        type=int,
        default=cache.swap_memory_bytes >> 20,
        help=(
            "host KV pool for preempted requests and the prefix cache's host tier in MiB, 0 = "
            "neither: recompute instead (default: %(default)s)"
        ),
    )
    group.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt from scratch: no reuse of cached prefix blocks",
    )
    group.add_argument(
        "--max-batch-tokens", type=int, default=sched.max_batch_tokens, help="tokens per step (default: %(default)s)"
    )
    group.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=sched.max_prefill_tokens,
        help="prompt tokens per step (default: %(default)s)",
    )
    group.add_argument(
        "--max-decode-tokens",
        type=int,
        default=sched.max_decode_tokens,
        help="decode tokens per step (default: %(default)s)",
    )
    group.add_argument(
        "--max-prefill-chunk",
        type=int,
        default=sched.max_prefill_chunk,
        help="prompt tokens of one request per step (default: %(default)s)",
    )
    group.add_argument(
        "--max-running-requests",
        type=int,
        default=sched.max_running_requests,
        help="requests holding KV blocks at once (default: %(default)s)",
    )
    group.add_argument(
        "--priority-bound-s",
        type=float,
        default=sched.priority_bound_s,
        help="no request is overtaken by one arriving this much later (default: %(default)s)",
    )
    group.add_argument(
        "--no-speculative",
        dest="speculative",
        action="store_false",
        help="never draft tokens by prompt lookup (speculative decoding)",
    )
    group.add_argument(
        "--max-draft-tokens",
        type=int,
        default=spec.max_draft_tokens,
        help="draft tokens one request verifies per step, at most (default: %(default)s)",
    )
    group.add_argument(
        "--spec-acceptance-threshold",
        type=float,
        default=spec.acceptance_threshold,
        help="a request whose drafts are accepted less than this stops drafting for a cool-down (default: %(default)s)",
    )
    group.add_argument(
        "--spec-cooldown-steps",
        type=int,
        default=spec.cooldown_steps,
        help=(
            "steps a gated request waits before drafting again, doubled after each pause that "
            "follows another (default: %(default)s)"
        ),
    )


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            source=args.model,
            dtype=args.dtype,
            cache_dir=args.cache_dir,
            threads=args.threads,
            weights=args.weights,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
            max_graph_batch=args.max_graph_batch,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_memory_bytes=args.kv_memory_mb << 20,
            swap_memory_bytes=args.swap_memory_mb << 20,
            prefix_caching=args.prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_batch_tokens=args.max_batch_tokens,
            max_prefill_tokens=args.max_prefill_tokens,
            max_decode_tokens=args.max_decode_tokens,
            max_prefill_chunk=args.max_prefill_chunk,
            max_running_requests=args.max_running_requests,
            priority_bound_s=args.priority_bound_s,
        ),
        speculative=SpeculativeConfig(
            enabled=args.speculative,
            max_draft_tokens=args.max_draft_tokens,
            acceptance_threshold=args.spec_acceptance_threshold,
            cooldown_steps=args.spec_cooldown_steps,
        ),
    )


def add_observability_arguments(parser) -> None:
    """The flags that map onto `MetricsConfig` and `LoggingConfig`."""
    metrics, logs = MetricsConfig(), LoggingConfig()
    group = parser.add_argument_group("observability")
    group.add_argument(
        "--metrics-port",
        type=int,
        default=metrics.port,
        help="Prometheus /metrics port, 0 = off (default: %(default)s)",
    )
    group.add_argument(
        "--metrics-host", default=metrics.host, help="address /metrics listens on (default: %(default)s)"
    )
    group.add_argument(
        "--ingest-poll-s",
        type=float,
        default=metrics.ingest_poll_s,
        help="seconds between Redis ingest-lag polls (default: %(default)s)",
    )
    group.add_argument(
        "--log-format",
        default=logs.format,
        choices=LOG_FORMATS,
        help="auto = JSON unless stderr is a terminal (default: %(default)s)",
    )
    group.add_argument("--log-level", default=logs.level, choices=LOG_LEVELS)
    group.add_argument(
        "--log-prompts",
        action="store_true",
        help="put prompts and outputs in the per-request log line (off by default)",
    )


def metrics_config_from_args(args) -> MetricsConfig:
    return MetricsConfig(port=args.metrics_port, host=args.metrics_host, ingest_poll_s=args.ingest_poll_s)


def logging_config_from_args(args) -> LoggingConfig:
    return LoggingConfig(format=args.log_format, level=args.log_level, log_prompts=args.log_prompts)


# -- the gateway (`inflight gateway`, service/gateway/) -----------------------------------

# The name the gateway serves the bundled model under (`model` in OpenAI requests).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
API_KEYS_ENV = "INFLIGHT_API_KEYS"


@dataclass(frozen=True)
class GatewayConfig:
    """Everything one `inflight gateway` process runs with. It holds no state of its own:
    every request is a job on the request stream, so gateways scale out freely."""

    host: str = "127.0.0.1"
    port: int = 8000
    # The server and streams the workers serve; the gateway starts no server of its own.
    redis_url: str = field(default_factory=lambda: os.environ.get("REDIS_URL", ""))
    requests_stream: str = "inflight:requests"
    control_stream: str = "inflight:control"
    group: str = "inflight"
    # What `model` must name; anything else is a 404, as with OpenAI.
    model_name: str = DEFAULT_MODEL_NAME
    # max_tokens when a request gives none (OpenAI's "up to the context" has no bound a
    # job can carry).
    default_max_tokens: int = 256
    # Backpressure: answer 429 while more entries than this wait undelivered in the request
    # stream, or while the oldest of them has waited longer than max_queue_age_s (0 = no
    # limit). Looked up every queue_poll_s, never on a request's path.
    max_queue_depth: int = 1024
    max_queue_age_s: float = 30.0
    queue_poll_s: float = 0.25
    retry_after_s: int = 1
    # A request whose reply stream stays silent this long is cancelled and answered 504:
    # no worker serves the stream (a failover's pause is about claim_idle_ms, 2 s).
    reply_timeout_s: float = 60.0
    # Bearer keys; none = no auth. Never printed: repr=False keeps them out of logs.
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    # Largest accepted request body, the protocol's entry limit.
    max_body_bytes: int = 1 << 20
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        for name in ("default_max_tokens", "retry_after_s", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_queue_depth", "max_queue_age_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit)")
        for name in ("queue_poll_s", "reply_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        object.__setattr__(self, "api_keys", frozenset(self.api_keys))


def read_api_keys(path: Path | None, env: str | None) -> frozenset[str]:
    """Keys from a file (one a line; blank lines and # comments skipped) and from the
    environment variable's text (comma-separated)."""
    keys = [key.strip() for key in (env or "").split(",")]
    if path is not None:
        keys += [line.strip() for line in Path(path).read_text().splitlines() if not line.strip().startswith("#")]
    return frozenset(key for key in keys if key)


def add_gateway_arguments(parser) -> None:
    """The flags of `inflight gateway`, each mapping onto a `GatewayConfig` field."""
    from service.embedded import embedded_url

    gateway, redis = GatewayConfig(), RedisConfig()
    group = parser.add_argument_group("gateway")
    group.add_argument("--host", default=gateway.host, help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=gateway.port, help="(default: %(default)s)")
    group.add_argument(
        "--redis-url",
        default=gateway.redis_url or embedded_url(redis.embedded_port),
        help="default: $REDIS_URL, else the embedded server's address (%(default)s)",
    )
    group.add_argument("--requests-stream", default=gateway.requests_stream)
    group.add_argument("--control-stream", default=gateway.control_stream)
    group.add_argument(
        "--served-model-name", default=gateway.model_name, help="the `model` requests must name (default: %(default)s)"
    )
    group.add_argument(
        "--default-max-tokens",
        type=int,
        default=gateway.default_max_tokens,
        help="max_tokens of a request that gives none (default: %(default)s)",
    )
    group.add_argument(
        "--max-queue-depth",
        type=int,
        default=gateway.max_queue_depth,
        help="answer 429 above this many undelivered jobs, 0 = no limit (default: %(default)s)",
    )
    group.add_argument(
        "--max-queue-age-s",
        type=float,
        default=gateway.max_queue_age_s,
        help="answer 429 while the oldest undelivered job waited longer, 0 = no limit (default: %(default)s)",
    )
    group.add_argument(
        "--queue-poll-s",
        type=float,
        default=gateway.queue_poll_s,
        help="how often the queue's depth and age are looked up (default: %(default)s)",
    )
    group.add_argument(
        "--retry-after-s", type=int, default=gateway.retry_after_s, help="Retry-After of a 429 (default: %(default)s)"
    )
    group.add_argument(
        "--reply-timeout-s",
        type=float,
        default=gateway.reply_timeout_s,
        help="cancel and answer 504 when a job's replies stay silent this long (default: %(default)s)",
    )
    group.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help=f"bearer keys, one a line; also ${API_KEYS_ENV} (comma-separated); none = no auth",
    )
    logs = LoggingConfig()
    group.add_argument(
        "--log-format",
        default=logs.format,
        choices=LOG_FORMATS,
        help="auto = JSON unless stderr is a terminal (default: %(default)s)",
    )
    group.add_argument("--log-level", default=logs.level, choices=LOG_LEVELS)


def gateway_config_from_args(args) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        requests_stream=args.requests_stream,
        control_stream=args.control_stream,
        model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens,
        max_queue_depth=args.max_queue_depth,
        max_queue_age_s=args.max_queue_age_s,
        queue_poll_s=args.queue_poll_s,
        retry_after_s=args.retry_after_s,
        reply_timeout_s=args.reply_timeout_s,
        api_keys=read_api_keys(args.api_keys_file, os.environ.get(API_KEYS_ENV)),
        logging=LoggingConfig(format=args.log_format, level=args.log_level),
    )
