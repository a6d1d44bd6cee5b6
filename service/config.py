"""The edge's typed configuration: frozen, validated dataclasses.

The worker's own settings (Redis, metrics, logging) gathered with the engine's
(`workers.config`) into one `WorkerConfig`, and the gateway's `GatewayConfig`. The
command-line flags map onto them in `service/flags.py`. The edge reads the environment
only here ($REDIS_URL, in the defaults below) and there ($INFLIGHT_API_KEYS).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from service.protocol import TENANT_PATTERN
from workers.config import EngineConfig, default_cache_dir


@dataclass(frozen=True)
class RedisConfig:
    """The worker's queue: the server, its streams, the lease and the caps."""

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
    # An entry taken over this many times in a row with no new token on its reply stream
    # in between goes to the dead-letter stream (its workers keep dying on it).
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
    # Most jobs one worker holds, running or queued in its own scheduler; the rest wait
    # in the stream for any worker. 0: twice max_running_requests (with fair queueing,
    # max_running_requests, as Redis orders the rest). More lets a length policy order
    # more of a backlog, and keeps the jobs it holds from the fleet's idle workers.
    max_held_jobs: int = 0

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
        if self.max_held_jobs < 0:
            raise ValueError("max_held_jobs must be >= 0")
        object.__setattr__(self, "embedded_data_dir", Path(self.embedded_data_dir))

    @property
    def renew_interval_s(self) -> float:
        return self.claim_idle_ms / 4000


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class DisaggConfig:
    """Disaggregated prefill and decode (docs/features.md): which phase this worker runs,
    and how jobs and their prompts' K/V pass from prefill workers to decode workers."""

    # both: the whole job (the default). prefill: compute prompts from the request stream
    # and hand each job's decode to the decode pool. decode: continue the handed-off jobs.
    role: str = "both"
    # Where prefill workers hand jobs to decode workers: a stream read through the same
    # consumer group, with the same leases and takeovers, as the request stream.
    handoff_stream: str = "inflight:handoffs"
    # A prompt with fewer tokens than this is not handed off: its prefill worker serves
    # the whole job (the handoff would cost more than it spares the decode pool).
    handoff_min_prompt_tokens: int = 256
    # Host memory a prefill worker keeps handed-off prompts' K/V in until the job ends (the
    # decode worker confirms it) or handoff_hold_s passes; a decode worker reads into as
    # much. Full: the prompt is computed again.
    handoff_memory_bytes: int = 1 << 30
    # A prefill worker frees a prompt's K/V this long after its handoff unless the decode
    # worker confirmed the job's end sooner; a decode worker that had not read it by then
    # computes the prompt itself.
    handoff_hold_s: float = 30.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.handoff_stream:
            raise ValueError("handoff_stream must not be empty")
        if self.handoff_min_prompt_tokens < 1:
            raise ValueError("handoff_min_prompt_tokens must be >= 1")
        if self.handoff_memory_bytes < 1:
            raise ValueError("handoff_memory_bytes must be >= 1")
        if not self.handoff_hold_s > 0:
            raise ValueError("handoff_hold_s must be > 0")


@dataclass(frozen=True)
class FairQueueConfig:
    """Fair queueing across workers: admission caps, tenant quotas and fair share
    (docs/protocol.md, "Tenants, batch jobs and admission"). Every cap is off at 0."""

    # Admit jobs into per-tenant queues in Redis and take them in fair order; every
    # worker of a stream should agree on it. Any cap or quota below turns it on.
    enabled: bool = False
    # Jobs, and their prompt tokens, admitted and not yet taken by a worker: over a cap a
    # new job is refused at once as queue_full.
    max_queued_jobs: int = 0
    max_queued_tokens: int = 0
    # Seconds a new interactive job would wait to be taken: until the slot it would get
    # frees, as the workers publish them (service/slot_outlook.py; the jobs queued ahead
    # take the earlier ones). Over it, queue_full at once.
    max_queue_wait_s: float = 0.0
    # The same, per tenant.
    tenant_max_queued_jobs: int = 0
    tenant_max_queued_tokens: int = 0
    # Tokens (prompt and output) a tenant may be served per second, averaged over 10 s of
    # burst: over it, its new jobs are refused as quota_exceeded.
    tenant_tokens_per_s: float = 0.0
    # What a tenant is charged per prompt token and per output token (VTC's 1 and 2: an
    # output token costs a step, a prompt token a share of one).
    charge_prompt_weight: float = 1.0
    charge_output_weight: float = 2.0
    # A worker about to take jobs first waits, up to this long, while jobs that arrived
    # on the request stream are still being admitted: a burst is then ordered as a
    # whole, not in the order its entries happened to be admitted.
    admission_wait_ms: int = 250

    def __post_init__(self) -> None:
        for name in (
            "max_queued_jobs",
            "max_queued_tokens",
            "max_queue_wait_s",
            "tenant_max_queued_jobs",
            "tenant_max_queued_tokens",
            "tenant_tokens_per_s",
            "charge_prompt_weight",
            "charge_output_weight",
            "admission_wait_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        capped = any(
            getattr(self, name)
            for name in (
                "max_queued_jobs",
                "max_queued_tokens",
                "max_queue_wait_s",
                "tenant_max_queued_jobs",
                "tenant_max_queued_tokens",
                "tenant_tokens_per_s",
            )
        )
        if capped:  # checked at admission
            object.__setattr__(self, "enabled", True)


LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class MetricsConfig:
    """The worker's Prometheus endpoint."""

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
    """Structured logs (`service/structured_logging.py`), the worker's and the gateway's."""

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
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    fair_queue: FairQueueConfig = field(default_factory=FairQueueConfig)

    def __post_init__(self) -> None:
        if self.disagg.role != "both" and not self.engine.cache.prefix_caching:
            raise ValueError("a prefill or decode worker needs prefix caching: handed-off K/V are cached blocks")
        if self.disagg.role != "both" and self.engine.model.tensor_parallel > 1:
            raise ValueError("a prefill or decode worker runs on one rank: its handoff moves one KV cache")


# -- the gateway (`inflight gateway`, service/gateway/) -----------------------------------

# The name the gateway serves the bundled model under (`model` in OpenAI requests).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class GatewayConfig:
    """Everything one `inflight gateway` process runs with. It holds no state of its own:
    every request is a job on the request stream, and files and batches live in Redis, so
    gateways scale out freely."""

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
    # Resumable streams (docs/gateway.md, "Resuming a stream"): SSE event ids on every
    # streamed answer (else only where the request asks, by header; off by default since
    # some clients read an event as one `data:` line); how long a streamed answer can be
    # taken up again (as long as workers keep its reply stream, their reply_ttl_s); and
    # how long a job whose client left waits to be resumed before it is cancelled (0: at once).
    event_ids: bool = False
    stream_ttl_s: int = 3600
    resume_grace_s: float = 0.0
    # Bearer keys, each to the tenant it is bound to (None: the request may name its
    # own); none = no auth. A set of keys binds none. Never printed: repr=False keeps
    # them out of logs.
    api_keys: Mapping[str, str | None] = field(default_factory=dict, repr=False, hash=False)
    # Largest accepted request body, the protocol's entry limit.
    max_body_bytes: int = 1 << 20
    # The Batch API (docs/gateway.md, "Batches"). An uploaded file is held in Redis whole:
    # at most this many bytes and lines (OpenAI's line cap), kept this long (OpenAI's 30 days).
    max_file_bytes: int = 64 << 20
    max_file_lines: int = 50_000
    file_ttl_s: int = 30 * 86_400
    # Jobs of one batch queued or running at once: enough to soak idle workers, few
    # enough not to flood the queue or trip the workers' caps.
    batch_max_outstanding: int = 32
    # A gateway drives a batch while it holds the batch's lease; one that dies has its
    # batches taken over by another within about this long.
    batch_lease_s: float = 10.0
    batch_poll_s: float = 1.0
    # The completion window behind OpenAI's "24h"; shorter only in tests.
    batch_window_s: float = 86_400.0
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        for name in (
            "default_max_tokens",
            "retry_after_s",
            "max_body_bytes",
            "max_file_bytes",
            "max_file_lines",
            "file_ttl_s",
            "batch_max_outstanding",
            "stream_ttl_s",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_queue_depth", "max_queue_age_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit)")
        if self.resume_grace_s < 0:
            raise ValueError("resume_grace_s must be >= 0 (0 = cancel at once)")
        for name in ("queue_poll_s", "reply_timeout_s", "batch_lease_s", "batch_poll_s", "batch_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        keys = self.api_keys if isinstance(self.api_keys, Mapping) else dict.fromkeys(self.api_keys)
        for tenant in keys.values():
            if tenant is not None and not TENANT_PATTERN.fullmatch(tenant):
                raise ValueError(f"an API key's tenant {tenant!r} is not 1-64 letters, digits and _ . @ -")
        object.__setattr__(self, "api_keys", MappingProxyType(dict(keys)))  # read-only, as the config is frozen
