"""Prometheus metrics of one worker: what feeds them (their declarations are data, in
service/metric_specs.py).

Each `Metrics` owns its registry, so several workers can live in one process (tests).
It is fed from three places, none of which imports prometheus_client:
- `observe_step`, the engine's observer (`Engine.observer`), called in the stepping
  thread after every step with an `EngineStats`: the queue, first-token and
  inter-token latencies it made, batch composition, step time, budget use,
  requests by state and priority, KV blocks, preemptions and swaps, the prefix
  cache (tokens queried, hits and cached blocks by tier, evictions, offloads), and
  speculative decoding (draft tokens verified and accepted, acceptance per verification);
- `observe_finished`, `observe_outcome`, `observe_dead_letter`, `observe_tenant_tokens`,
  `observe_refused` and `observe_adapter`, from the worker, and `observe_adapter_load`,
  from its adapter loader;
- `observe_ingest` and `observe_fair_queue`, from service/queue_gauges.py, which the worker's
  event loop runs every `ingest_poll_s`: Redis lag, pending entries and dead letters (a few
  round trips, never in the model thread); with fair queueing also jobs and prompt tokens
  queued by tenant, the batch backlog.

A tenant label takes the tenant's name for the first `MAX_TENANT_LABELS` tenants a worker
sees; any later tenant is counted under `OTHER_TENANTS`, so producers naming ever new
tenants cannot grow the series without bound.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from service.metric_specs import (
    BASE_MODEL,
    LENGTH_TAU_WINDOW,
    POOLS,
    STATES,
    UNKNOWN_ADAPTER,
    WORKER_METRICS,
    build_all,
)
from service.protocol import DEFAULT_TENANT
from workers.api import ErrorCode, FinalEvent, FinishReason
from workers.config import SchedulerConfig
from workers.length_predictor import kendall_tau

if TYPE_CHECKING:  # the step stats pull in torch; the metrics need only their dataclasses
    from workers.plan import CacheStats, Census
    from workers.step_stats import EngineStats, StepRecord

LENGTH_TAU_EVERY = 16
# Tenants (docs/protocol.md, "Tenants, batch jobs and admission").
MAX_TENANT_LABELS = 100
OTHER_TENANTS = "(other)"  # no tenant's name: tenant names have no parentheses


class Metrics:
    # One attribute per spec of WORKER_METRICS, which `build_all` sets.
    requests: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    request_duration: Histogram
    queue_time: Histogram
    publish_lag: Histogram
    scheduler_requests: Gauge
    oldest_waiting: Gauge
    kv_blocks: Gauge
    kv_usage: Gauge
    preemptions: Counter
    swapped_requests: Counter
    swapped_blocks: Counter
    prefix_queried: Counter
    prefix_hits: Counter
    prefix_blocks: Gauge
    prefix_evicted: Counter
    prefix_offloaded: Counter
    step_tokens: Histogram
    step_duration: Histogram
    step_budget: Histogram
    speculative_tokens: Counter
    speculative_acceptance: Histogram
    length_prediction_error: Histogram
    length_prediction_tau: Gauge
    ingest_lag: Gauge
    ingest_pending: Gauge
    dead_letter_entries: Gauge
    dead_letters: Counter
    tenant_tokens: Counter
    refused: Counter
    tenant_queued: Gauge
    tenant_queued_tokens: Gauge
    batch_queued: Gauge
    adapter_requests: Counter
    adapter_tokens: Counter
    adapters_loaded: Gauge
    adapter_loads: Counter
    adapter_load_time: Histogram
    handoffs: Counter
    kv_transfer_bytes: Counter
    kv_transfer_time: Histogram
    handoff_kv_held: Gauge

    def __init__(self, scheduler: SchedulerConfig | None = None) -> None:
        self.registry = CollectorRegistry()
        self.budgets = scheduler or SchedulerConfig()
        build_all(self, WORKER_METRICS, self.registry)
        self._length_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=LENGTH_TAU_WINDOW)
        self._length_outcomes_since_tau = 0
        self._tenant_labels = {DEFAULT_TENANT}  # the tenants with a label of their own
        self._queued_tenants_seen: set[str] = set()
        self._priorities_seen: set[tuple[str, int]] = set()
        # The engine reports evictions as running totals; the counters take the difference.
        self._evictions_seen = {pool: 0 for pool in POOLS}
        # Computed at scrape time, so the age keeps growing if the engine stops stepping.
        self._oldest_waiting_since: float | None = None  # wall clock
        self.oldest_waiting.set_function(self._oldest_waiting_age)

    # -- feeds ---------------------------------------------------------------------------

    def observe_step(self, stats: EngineStats) -> None:
        """The engine's observer: runs in the stepping thread after each step."""
        for seconds in stats.queue_s:
            self.queue_time.observe(seconds)
        for seconds in stats.first_token_s:
            self.time_to_first_token.observe(seconds)
        for seconds in stats.inter_token_s:
            self.inter_token_latency.observe(seconds)
        if stats.length_outcomes:
            self._observe_lengths(stats.length_outcomes)
        if stats.step is not None:
            self._observe_batch(stats.step)
        self._observe_census(stats.census, stats.oldest_waiting_s)
        for pool, used, total in (
            ("device", stats.device_blocks_used, stats.device_blocks_total),
            ("host", stats.host_blocks_used, stats.host_blocks_total),
        ):
            self.kv_blocks.labels(pool, "used").set(used)
            self.kv_blocks.labels(pool, "free").set(total - used)
            self.kv_usage.labels(pool).set(used / total if total else 0.0)
        self._observe_prefix_cache(stats.cache)

    def _observe_batch(self, step: StepRecord) -> None:
        """What one step ran: its batch, time and budget use, preemptions and swaps, drafts."""
        self.step_tokens.labels("prefill").observe(step.num_prefill_tokens)
        self.step_tokens.labels("decode").observe(step.num_decode_tokens)
        self.step_duration.observe(step.step_s)
        budgets = self.budgets
        self.step_budget.labels("batch").observe(step.num_tokens / budgets.max_batch_tokens)
        self.step_budget.labels("prefill").observe(step.num_prefill_tokens / budgets.max_prefill_tokens)
        self.step_budget.labels("decode").observe(step.num_decode_tokens / budgets.max_decode_tokens)
        if step.num_preempted:
            self.preemptions.labels("swap").inc(step.num_swapped_out)
            self.preemptions.labels("recompute").inc(step.num_preempted - step.num_swapped_out)
        self.swapped_requests.labels("out").inc(step.num_swapped_out)
        self.swapped_requests.labels("in").inc(step.num_swapped_in)
        self.swapped_blocks.labels("out").inc(step.num_blocks_swapped_out)
        self.swapped_blocks.labels("in").inc(step.num_blocks_swapped_in)
        if step.num_draft_tokens:
            self.speculative_tokens.labels("drafted").inc(step.num_draft_tokens)
            self.speculative_tokens.labels("accepted").inc(step.num_accepted_tokens)
            for ratio in step.acceptance:
                self.speculative_acceptance.observe(ratio)

    def _observe_census(self, census: Census, oldest_waiting_s: float) -> None:
        """Requests in the engine by state and priority, and since when the oldest has waited."""
        now = {
            (state, priority): count
            for state, counts in zip(STATES, (census.running, census.waiting, census.swapped))
            for priority, count in counts.items()
        }
        # A priority that has left a state reads 0 rather than its last count.
        for state, priority in self._priorities_seen | now.keys():
            self.scheduler_requests.labels(state, str(priority)).set(now.get((state, priority), 0))
        self._priorities_seen |= now.keys()
        waiting = census.oldest_queued_arrival is not None
        self._oldest_waiting_since = time.time() - oldest_waiting_s if waiting else None

    def _observe_prefix_cache(self, cache: CacheStats) -> None:
        self.prefix_queried.inc(cache.queried_tokens)
        self.prefix_offloaded.inc(cache.offloaded_blocks)
        for pool, hits, cached, evictions in (
            ("device", cache.device_hit_tokens, cache.device_cached_blocks, cache.device_evictions),
            ("host", cache.host_hit_tokens, cache.host_cached_blocks, cache.host_evictions),
        ):
            self.prefix_hits.labels(pool).inc(hits)
            self.prefix_blocks.labels(pool).set(cached)
            seen = self._evictions_seen[pool]
            # A total below the last one is a new engine's, counted from 0 (as Prometheus treats a reset).
            self.prefix_evicted.labels(pool).inc(evictions - seen if evictions >= seen else evictions)
            self._evictions_seen[pool] = evictions

    def _observe_lengths(self, outcomes: Sequence[tuple[float, int]]) -> None:
        for predicted, actual in outcomes:
            self.length_prediction_error.observe(math.log2(max(actual, 1) / max(predicted, 1.0)))
        self._length_window.extend(outcomes)
        self._length_outcomes_since_tau += len(outcomes)
        # tau is quadratic in the window: refreshed every few endings, not every step
        if self._length_outcomes_since_tau >= LENGTH_TAU_EVERY and len(self._length_window) >= 2:
            predicted_lengths, actual_lengths = zip(*self._length_window)
            self.length_prediction_tau.set(kendall_tau(predicted_lengths, actual_lengths))
            self._length_outcomes_since_tau = 0

    def observe_finished(self, event: FinalEvent) -> None:
        """A request the engine ended (any finish reason, errors included). Its queue,
        first-token and inter-token latencies were observed as they happened (`observe_step`)."""
        self.requests.labels(event.finish_reason.value).inc()
        self.prompt_tokens.inc(event.usage.prompt_tokens)
        self.generation_tokens.inc(len(event.timings.token_times))  # here: not those resumed from another worker
        if event.finish_reason is FinishReason.ERROR and not event.timings.token_times:
            return  # rejected by the engine's validation: it never queued, there is nothing to time
        self.request_duration.observe(event.timings.total_s)

    def observe_publish_lag(self, seconds: float) -> None:
        self.publish_lag.observe(seconds)

    def observe_outcome(self, outcome: str) -> None:
        """A request that ended without the engine's timings: "rejected" (it never reached
        the engine), or a taken-over request whose tokens were all published already."""
        self.requests.labels(outcome).inc()

    def observe_handoff(self, outcome: str, num_bytes: int = 0, seconds: float | None = None) -> None:
        """One job through the handoff (`metric_specs.HANDOFF_OUTCOMES`); a read's bytes and time."""
        self.handoffs.labels(outcome).inc()
        if seconds is not None:
            self.kv_transfer_bytes.inc(num_bytes)
            self.kv_transfer_time.observe(seconds)

    def observe_dead_letter(self, code: str) -> None:
        self.dead_letters.labels(code).inc()

    def observe_tenant_tokens(self, tenant: str, batch: bool, kind: str, num_tokens: int) -> None:
        """Tokens served to a tenant's job: `prompt` (as the request ends) or `output`."""
        self.tenant_tokens.labels(self._tenant_label(tenant), _job_class(batch), kind).inc(num_tokens)

    def observe_adapter(self, adapter: str | None, event: FinalEvent) -> None:
        """An ended request, by the adapter it named: a name the engine refused counts
        under UNKNOWN_ADAPTER, so unknown names cannot grow the series."""
        if adapter is None:
            label = BASE_MODEL
        elif event.error_code is ErrorCode.UNKNOWN_ADAPTER:
            label = UNKNOWN_ADAPTER
        else:
            label = adapter
        self.adapter_requests.labels(label).inc()
        self.adapter_tokens.labels(label, "prompt").inc(event.usage.prompt_tokens)
        self.adapter_tokens.labels(label, "output").inc(len(event.timings.token_times))

    def observe_adapter_load(self, loaded: bool, seconds: float, num_loaded: int) -> None:
        """An adapter the control stream asked for: loaded or not, how long it took, how many the worker serves."""
        self.adapter_loads.labels("loaded" if loaded else "failed").inc()
        if loaded:
            self.adapter_load_time.observe(seconds)
        self.adapters_loaded.set(num_loaded)

    def observe_refused(self, tenant: str, code: str) -> None:
        """A job refused at admission: `queue_full` or `quota_exceeded`."""
        self.refused.labels(self._tenant_label(tenant), code).inc()

    def observe_ingest(self, lag: int | None, pending: int, dead_letters: int) -> None:
        """The consumer group as Redis sees it (service/queue_gauges.py reads it): entries not
        yet delivered (`lag`: None when Redis cannot tell, and the gauge keeps its last value),
        delivered and not acked, and the dead-letter stream's length."""
        if lag is not None:
            self.ingest_lag.set(lag)
        self.ingest_pending.set(pending)
        self.dead_letter_entries.set(dead_letters)

    def observe_fair_queue(self, queued: dict[str, int], queued_tokens: dict[str, int], batch_queued: int) -> None:
        """The tenant queues as Redis counts them: jobs and prompt tokens by tenant, batch jobs."""
        jobs: dict[str, int] = collections.Counter()
        tokens: dict[str, int] = collections.Counter()
        for tenant, count in queued.items():
            jobs[self._tenant_label(tenant)] += count
        for tenant, count in queued_tokens.items():
            tokens[self._tenant_label(tenant)] += count
        # A tenant no longer counted reads 0 rather than its last count.
        for tenant in self._queued_tenants_seen | jobs.keys() | tokens.keys():
            self.tenant_queued.labels(tenant).set(jobs.get(tenant, 0))
            self.tenant_queued_tokens.labels(tenant).set(tokens.get(tenant, 0))
        self._queued_tenants_seen |= jobs.keys() | tokens.keys()
        self.batch_queued.set(batch_queued)

    def _tenant_label(self, tenant: str) -> str:
        if tenant in self._tenant_labels:
            return tenant
        if len(self._tenant_labels) < MAX_TENANT_LABELS:
            self._tenant_labels.add(tenant)
            return tenant
        return OTHER_TENANTS

    def _oldest_waiting_age(self) -> float:
        since = self._oldest_waiting_since
        return 0.0 if since is None else max(0.0, time.time() - since)


def _job_class(batch: bool) -> str:
    return "batch" if batch else "interactive"


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> WSGIServer:
    """Serve GET /metrics from a daemon thread (neither the event loop nor the model
    thread ever waits on a scrape). Returns the server; `.shutdown()` stops it."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
