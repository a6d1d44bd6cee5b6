"""The metrics a worker exports: fed by a real engine's step observer and by real Redis,
named by the project's conventions, and accepted by `promtool check metrics`."""

from __future__ import annotations

import asyncio
import collections
import re
import shutil
import subprocess
import time
import uuid

import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from service.metrics import MAX_TENANT_LABELS, OTHER_TENANTS, Metrics
from service.queue_gauges import poll_fair_queue, poll_ingest
from workers.api import FinalEvent, GenerationRequest, SamplingParams

BLOCK_BYTES = 16 * 46_080  # one 16-token block of SmolLM2-135M in float32 (all layers, K and V)
UNITS = (
    "_seconds",
    "_tokens",
    "_blocks",
    "_entries",
    "_ratio",
    "_requests",
    "_preemptions",
    "_letters",
    "_bytes",
    "_adapters",
)


def value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.slow
def test_a_real_engine_feeds_step_and_request_metrics_through_its_observer(make_engine):
    # 4 device blocks for three requests that need 3 each: preemptions are certain.
    engine = make_engine(kv_memory_bytes=4 * BLOCK_BYTES, swap_memory_bytes=2 * BLOCK_BYTES)
    metrics = Metrics(engine.config.scheduler)
    seen = []

    def observe(stats):
        seen.append(stats)
        metrics.observe_step(stats)

    engine.observer = observe
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for request_id, priority in (("low", -2), ("mid", 0), ("high", 3)):
        engine.add_request(
            GenerationRequest(request_id, "List the numbers from 1 to 300, comma separated:", params, priority)
        )
    finals, steps, first_finish_step = [], 0, None
    while engine.has_unfinished():
        finals += [e for e in engine.step() if isinstance(e, FinalEvent)]
        steps += 1
        if finals and first_finish_step is None:
            first_finish_step = steps
    for event in finals:
        metrics.observe_finished(event)

    assert len(seen) == steps  # one report per step
    # Token latencies are reported as the tokens come, not when their requests finish,
    # and agree with the final events' timings.
    assert sum(len(s.first_token_s) for s in seen[: first_finish_step - 1]) == 3
    assert sorted(x for s in seen for x in s.first_token_s) == sorted(e.timings.first_token_s for e in finals)
    assert sorted(x for s in seen for x in s.queue_s) == sorted(e.timings.queue_s for e in finals)
    gaps = [b - a for e in finals for a, b in zip(e.timings.token_times, e.timings.token_times[1:])]
    assert sorted(x for s in seen for x in s.inter_token_s) == pytest.approx(sorted(gaps))
    first = seen[0].census
    assert sum(first.running.values()) + sum(first.waiting.values()) + sum(first.swapped.values()) == 3
    records = [s.step for s in seen if s.step is not None]
    assert len(records) == steps  # every step had work: the last one sampled the last token
    assert sum(r.num_sampled for r in records) == 3 * 24  # each token sampled once, recomputation or not
    assert all(s.device_blocks_used <= s.device_blocks_total == 4 and s.host_blocks_total == 2 for s in seen)
    preempted = sum(r.num_preempted for r in records)
    assert preempted > 0
    last = seen[-1]
    assert (last.census.running, last.census.waiting, last.census.swapped) == ({}, {}, {})
    assert last.device_blocks_used == last.host_blocks_used == 0 and last.oldest_waiting_s == 0

    assert (
        value(metrics, "inflight_preemptions_total", mode="swap")
        + value(metrics, "inflight_preemptions_total", mode="recompute")
        == preempted
    )
    assert value(metrics, "inflight_swapped_blocks_total", direction="out") == sum(
        r.num_blocks_swapped_out for r in records
    )
    assert value(metrics, "inflight_swapped_requests_total", direction="in") == value(
        metrics, "inflight_swapped_requests_total", direction="out"
    )  # every request swapped out came back
    assert value(metrics, "inflight_step_tokens_count", kind="decode") == len(records)
    assert value(metrics, "inflight_step_tokens_sum", kind="prefill") == sum(r.num_prefill_tokens for r in records)
    assert value(metrics, "inflight_step_duration_seconds_count") == len(records)
    # Priorities that have left a state read 0, not their last count.
    for priority in ("-2", "0", "3"):
        assert value(metrics, "inflight_scheduler_requests", state="running", priority=priority) == 0
    assert value(metrics, "inflight_kv_cache_blocks", pool="device", state="used") == 0
    assert value(metrics, "inflight_kv_cache_blocks", pool="device", state="free") == 4
    assert value(metrics, "inflight_kv_cache_usage_ratio", pool="host") == 0

    assert value(metrics, "inflight_requests_total", outcome="length") == 3
    assert value(metrics, "inflight_generation_tokens_total") == 72
    assert value(metrics, "inflight_time_to_first_token_seconds_count") == 3
    assert value(metrics, "inflight_inter_token_latency_seconds_count") == 3 * 23
    assert value(metrics, "inflight_queue_time_seconds_count") == 3


@pytest.mark.slow
def test_prefix_cache_hits_evictions_and_offloads_by_tier(make_engine):
    # 6 device blocks, 6 host blocks; prompts are token ids, so block counts are exact.
    engine = make_engine(kv_memory_bytes=6 * BLOCK_BYTES, swap_memory_bytes=6 * BLOCK_BYTES)
    metrics = Metrics(engine.config.scheduler)
    seen = []

    def observe(stats):
        seen.append(stats.cache)
        metrics.observe_step(stats)

    engine.observer = observe
    shared = list(range(1000, 1040))  # 40 tokens: 2 full blocks cacheable (the last token is always computed)
    other = list(range(2000, 2080))  # 80 tokens + 8 generated: all 6 device blocks, evicting the shared prefix
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(request_id, prompt):
        engine.add_request(GenerationRequest(request_id, prompt, params))
        while engine.has_unfinished():
            engine.step()

    run("first", shared)  # a miss: computes and caches the prefix
    assert value(metrics, "inflight_prefix_cache_hit_tokens_total", tier="device") == 0
    assert value(metrics, "inflight_prefix_cache_blocks", tier="device") >= 2
    run("again", shared)  # the same prompt: both full blocks come from the device pool
    assert value(metrics, "inflight_prefix_cache_hit_tokens_total", tier="device") == 32
    run("other", other)  # needs every device block: the cached ones are evicted, and offloaded
    device_evicted = value(metrics, "inflight_prefix_cache_evicted_blocks_total", tier="device")
    assert device_evicted >= 2
    assert value(metrics, "inflight_prefix_cache_offloaded_blocks_total") >= 2
    assert value(metrics, "inflight_prefix_cache_blocks", tier="host") >= 2
    run("back", shared)  # the prefix is now only in the host tier: copied back, not recomputed
    assert value(metrics, "inflight_prefix_cache_hit_tokens_total", tier="host") == 32

    # The counters add up the steps; evictions are running totals, counted once.
    queried = sum(c.queried_tokens for c in seen)
    assert value(metrics, "inflight_prefix_cache_queried_tokens_total") == queried == 3 * 40 + 80
    assert value(metrics, "inflight_prefix_cache_hit_tokens_total", tier="device") == sum(
        c.device_hit_tokens for c in seen
    )
    assert value(metrics, "inflight_prefix_cache_offloaded_blocks_total") == sum(c.offloaded_blocks for c in seen)
    assert value(metrics, "inflight_prefix_cache_evicted_blocks_total", tier="device") == seen[-1].device_evictions
    assert value(metrics, "inflight_prefix_cache_evicted_blocks_total", tier="host") == seen[-1].host_evictions
    assert value(metrics, "inflight_prefix_cache_blocks", tier="device") == seen[-1].device_cached_blocks


def test_eviction_totals_become_counter_increments():
    """CacheStats carries evictions as running totals; a total that drops is a new engine's."""
    from workers.engine import EngineStats
    from workers.plan import CacheStats, Census

    metrics = Metrics()
    idle = Census({}, {}, {}, None)
    for device, host in ((3, 0), (3, 1), (5, 1), (2, 0)):
        cache = CacheStats(device_evictions=device, host_evictions=host)
        metrics.observe_step(EngineStats(None, idle, 0.0, 0, 10, 0, 4, cache))
    assert value(metrics, "inflight_prefix_cache_evicted_blocks_total", tier="device") == 5 + 2
    assert value(metrics, "inflight_prefix_cache_evicted_blocks_total", tier="host") == 1


def test_the_oldest_waiting_age_grows_between_steps():
    """Read at scrape time: if the engine hangs, a starving request still shows its age."""
    from workers.engine import EngineStats
    from workers.plan import Census

    metrics = Metrics()
    metrics.observe_step(EngineStats(None, Census({}, {0: 1}, {}, 1.0), 5.0, 1, 10, 0, 0))
    first = value(metrics, "inflight_oldest_waiting_age_seconds")
    time.sleep(0.05)
    assert 5.0 <= first < value(metrics, "inflight_oldest_waiting_age_seconds")
    metrics.observe_step(EngineStats(None, Census({0: 1}, {}, {}, None), 0.0, 1, 10, 0, 0))
    assert value(metrics, "inflight_oldest_waiting_age_seconds") == 0


def test_an_error_before_the_engine_queued_the_request_is_counted_but_not_timed():
    from workers.api import FinishReason, Timings, Usage

    metrics = Metrics()
    metrics.observe_finished(
        FinalEvent("bad", FinishReason.ERROR, Usage(0, 0), Timings(0.0, None, 0.0, ()), error="no")
    )
    metrics.observe_outcome("rejected")
    assert value(metrics, "inflight_requests_total", outcome="error") == 1
    assert value(metrics, "inflight_requests_total", outcome="rejected") == 1
    assert value(metrics, "inflight_request_duration_seconds_count") == 0


def test_ingest_lag_pending_entries_and_dead_letters_come_from_redis():
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    stream, dead, group = f"{prefix}:requests", f"{prefix}:dead", "workers"
    metrics = Metrics()

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379)
        try:
            await client.xgroup_create(stream, group, id="0", mkstream=True)
            for i in range(5):
                await client.xadd(stream, {"id": str(i)})
            delivered = await client.xreadgroup(group, "c1", {stream: ">"}, count=2)
            await client.xadd(dead, {"code": "invalid_type"})
            await poll_ingest(client, metrics, stream, group, dead)
            first = (
                value(metrics, "inflight_ingest_lag_entries"),
                value(metrics, "inflight_ingest_pending_entries"),
                value(metrics, "inflight_dead_letter_stream_entries"),
            )
            await client.xack(stream, group, delivered[0][1][0][0])
            await poll_ingest(client, metrics, stream, group, dead)
            second = (value(metrics, "inflight_ingest_lag_entries"), value(metrics, "inflight_ingest_pending_entries"))
            return first, second
        finally:
            await client.delete(stream, dead)
            await client.aclose()

    first, second = asyncio.run(main())
    assert first == (3, 2, 1)  # 3 never delivered, 2 delivered and not acked, 1 dead letter
    assert second == (3, 1)


def test_a_tenant_label_for_the_first_tenants_seen_and_the_rest_together():
    metrics = Metrics()
    for i in range(MAX_TENANT_LABELS + 5):  # `default` holds one label from the start
        metrics.observe_tenant_tokens(f"t{i}", False, "output", 1)
    metrics.observe_refused(f"t{MAX_TENANT_LABELS + 4}", "quota_exceeded")

    def tokens(tenant: str, job_class: str = "interactive") -> float | None:
        return metrics.registry.get_sample_value(
            "inflight_tenant_tokens_total", {"tenant": tenant, "class": job_class, "kind": "output"}
        )

    assert tokens("t0") == tokens(f"t{MAX_TENANT_LABELS - 2}") == 1
    assert tokens(f"t{MAX_TENANT_LABELS - 1}") is None
    assert tokens(OTHER_TENANTS) == 6
    assert value(metrics, "inflight_refused_requests_total", tenant=OTHER_TENANTS, code="quota_exceeded") == 1
    # The default tenant's series exist from the start, so a batch share reads 0, not nothing.
    assert tokens("default", "batch") == 0
    assert value(metrics, "inflight_refused_requests_total", tenant="default", code="queue_full") == 0


def test_fair_queue_counts_come_from_redis_and_a_tenant_no_longer_queued_reads_zero():
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    tag = "{" + stream + "}"
    metrics = Metrics()

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379)
        keys = [f"{tag}:queued", f"{tag}:queued_tokens", f"{tag}:backlog"]
        try:
            # As service/fair_queue.py keeps them: by tenant with the total under '*'; by queue.
            await client.hset(keys[0], mapping={"*": 3, "a": 2, "b": 1})
            await client.hset(keys[1], mapping={"*": 40, "a": 30, "b": 10})
            await client.hset(
                keys[2], mapping={f"{tag}:q:0:a": 1, f"{tag}:q:batch:a": 1, f"{tag}:q:batch:b": 1, f"{tag}:q:3:b": 0}
            )
            await poll_fair_queue(client, metrics, stream)
            first = [
                value(metrics, "inflight_tenant_queued_requests", tenant="a"),
                value(metrics, "inflight_tenant_queued_tokens", tenant="b"),
                value(metrics, "inflight_batch_queued_requests"),
            ]
            await client.delete(*keys)
            await client.hset(keys[0], mapping={"*": 1, "a": 1})
            await poll_fair_queue(client, metrics, stream)
            return first
        finally:
            await client.delete(*keys)
            await client.aclose()

    assert asyncio.run(main()) == [2, 10, 2]
    assert value(metrics, "inflight_tenant_queued_requests", tenant="a") == 1
    assert value(metrics, "inflight_tenant_queued_requests", tenant="b") == 0
    assert value(metrics, "inflight_tenant_queued_tokens", tenant="a") == 0
    assert value(metrics, "inflight_tenant_queued_requests", tenant="*") is None
    assert value(metrics, "inflight_batch_queued_requests") == 0


@pytest.mark.slow
def test_a_fair_queueing_worker_reports_tenants_queues_refusals_and_tokens(make_engine):
    """A real worker with fair queueing on a real Redis: it holds two long jobs of tenant
    a, so two short ones of a and a batch job of b wait in the tenant queues, and a job of
    c with too long a prompt is refused; the tokens counted are the replies' usage."""
    from service.config import FairQueueConfig
    from service.worker import Worker
    from tests.service.test_worker import read_replies, stream_config
    from tests.waiting import eventually

    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    engine = make_engine(max_running_requests=1)  # the worker holds two jobs at most
    metrics = Metrics(engine.config.scheduler)
    long = {"prompt": "Hello", "max_tokens": "512", "ignore_eos": "1"}
    short = {"prompt": "Count to ten:", "max_tokens": "6"}
    jobs = {  # request id -> tenant, class, fields
        f"{run}-long-0": ("a", "interactive", {**long, "tenant": "a"}),
        f"{run}-long-1": ("a", "interactive", {**long, "tenant": "a"}),
        f"{run}-short-0": ("a", "interactive", {**short, "tenant": "a"}),
        f"{run}-short-1": ("a", "interactive", {**short, "tenant": "a"}),
        f"{run}-batch": ("b", "batch", {**short, "tenant": "b", "batch": "true"}),
    }
    huge = {"prompt": "word " * 200, "max_tokens": "6", "tenant": "c"}  # over --max-queued-tokens alone

    def queued(tenant: str) -> float | None:
        return value(metrics, "inflight_tenant_queued_requests", tenant=tenant)

    def tokens(tenant: str, job_class: str, kind: str) -> float | None:
        labels = {"tenant": tenant, "class": job_class, "kind": kind}
        return metrics.registry.get_sample_value("inflight_tenant_tokens_total", labels)

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        worker = Worker(
            engine, client, config, metrics, ingest_poll_s=0.05, fair_queue=FairQueueConfig(max_queued_tokens=100)
        )
        task = asyncio.create_task(worker.run(stop))
        try:
            for request_id, (_, _, fields) in jobs.items():
                await client.xadd(config.requests_stream, {"id": request_id, **fields})
            await client.xadd(config.requests_stream, {"id": f"{run}-huge", **huge})
            await eventually(
                lambda: (queued("a"), queued("b"), value(metrics, "inflight_batch_queued_requests")) == (2, 1, 1),
                60,
                "the short jobs and the batch job queued",
            )
            assert value(metrics, "inflight_tenant_queued_tokens", tenant="a") > 0
            refused = (await read_replies(client, f"inflight:out:{{{run}-huge}}"))[-1]
            assert refused["code"] == b"queue_full"
            assert value(metrics, "inflight_refused_requests_total", tenant="c", code="queue_full") == 1

            for name in ("long-0", "long-1"):  # the queued jobs' turn
                await client.xadd(config.control_stream, {"type": "cancel", "id": f"{run}-{name}"})
            expected = collections.Counter()
            for request_id, (tenant, job_class, _) in jobs.items():
                final = (await read_replies(client, f"inflight:out:{{{request_id}}}"))[-1]
                assert final["type"] == b"done"
                expected[tenant, job_class, "prompt"] += int(final["prompt_tokens"])
                expected[tenant, job_class, "output"] += int(final["completion_tokens"])
            assert all(expected.values())
            await eventually(
                lambda: all(tokens(*labels) == count for labels, count in expected.items()),
                10,
                "the served tokens counted",
            )
            await eventually(
                lambda: (queued("a"), queued("b"), value(metrics, "inflight_batch_queued_requests")) == (0, 0, 0),
                10,
                "the tenant queues emptied",
            )
            assert queued("c") is None  # refused: never queued
            assert value(metrics, "inflight_refused_requests_total", tenant="a", code="queue_full") is None
        finally:
            stop.set()
            await task
            await client.delete(*await client.keys(f"*inflight:test:{run}*"), *await client.keys(f"*{{{run}-*"))
            await client.aclose()

    asyncio.run(main())


def test_every_metric_has_the_prefix_a_unit_and_no_colon():
    metrics = Metrics()
    names = [family.name for family in metrics.registry.collect()]
    assert len(names) >= 20
    for name in names:
        assert re.fullmatch(r"inflight_[a-z0-9_]+", name), name
        assert name.endswith(UNITS), f"{name} does not end in a unit"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_exposition_passes_promtool_check_metrics():
    metrics = Metrics()
    metrics.observe_dead_letter("invalid_type")
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=generate_latest(metrics.registry), capture_output=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout and not result.stderr, result.stdout + result.stderr


def private_streams(prefix: str) -> list[str]:
    return [
        "--requests-stream",
        f"{prefix}:requests",
        "--dead-letter-stream",
        f"{prefix}:dead",
        "--control-stream",
        f"{prefix}:control",
    ]


def test_a_worker_whose_metrics_port_is_taken_says_so_and_exits():
    import json
    import socket
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "service.cli",
                "worker",
                "--redis-url",
                "redis://127.0.0.1:6379",
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(port),
                *private_streams(f"inflight:test:{uuid.uuid4().hex[:8]}"),
                "--log-format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    [line] = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert (line["event"], line["level"], line["port"]) == ("metrics_port_unavailable", "error", port)


@pytest.mark.slow
def test_speculative_decoding_counts_drafted_and_accepted_tokens_and_each_verification(make_engine):
    from tests.workers.test_speculative_engine import COPYING

    engine = make_engine()
    metrics = Metrics(engine.config.scheduler)
    verifications = []

    def observe(stats):
        verifications.extend(stats.step.acceptance if stats.step else ())
        metrics.observe_step(stats)

    engine.observer = observe
    engine.add_request(GenerationRequest("copies", COPYING[1], SamplingParams(max_tokens=24)))
    while engine.has_unfinished():
        engine.step()
    drafted = value(metrics, "inflight_speculative_tokens_total", kind="drafted")
    accepted = value(metrics, "inflight_speculative_tokens_total", kind="accepted")
    assert 0 < accepted <= drafted
    assert value(metrics, "inflight_speculative_acceptance_ratio_count") == len(verifications) > 0
    assert value(metrics, "inflight_speculative_acceptance_ratio_sum") == pytest.approx(sum(verifications))
