"""`inflight bench --scenario edge`: the Redis edge alone, at GPU token rates: a stub engine
(no model math; each step every request it holds takes one token) behind the real worker
(`service.worker.Worker`) against a private redis-server. The steps keep a fixed schedule,
as an open-loop load generator does, so a sleep that wakes late does not lower the rate
offered. Each row: `streams` jobs of `--edge-tokens` tokens, all queued at once; with
`--edge-baseline` also per event (the publishing this replaced). docs/benchmarks.md, "The
edge at GPU token rates"."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import logging
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

import structlog
import uvloop

from bench.metrics import percentile
from bench.processes import RedisClusterServers, RedisServer, cpu_seconds
from bench.scenario import Scenario, add_flags, comma_list
from bench.systems import run_streams
from service.connect import connect
from service.metrics import Metrics
from service.outbox import Published, ReplyOutbox
from service.protocol import done_fields, token_data
from service.publish import Append, LeaseLost
from service.sdk import job_payload
from service.worker import Worker
from workers.api import FinalEvent, FinishReason, Timings, TokenEvent, Usage
from workers.config import EngineConfig, SchedulerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "edge scenario", {
        "--edge-streams": ("64,256,1024", "concurrent streams per row (comma-separated)"),
        "--edge-step-ms": (5.0, "stub step time; 0 = as fast as possible"),
        "--edge-tokens": (200, "tokens per job"),
        "--edge-cluster": (False, "on a private 3-master Redis Cluster"),
        "--edge-baseline": (False, "also run each row with per-event round trips (the publishing this replaced)"),
    })  # fmt: skip


@contextlib.contextmanager
def _warnings_only():
    """structlog drops lines below warning, and is as it was afterwards (tests share it)."""
    before = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(**before)


def run(args: argparse.Namespace) -> dict:
    streams = comma_list(args.edge_streams, "--edge-streams", cast=int)
    publishings = ("per_step", "per_event") if args.edge_baseline else ("per_step",)
    redis = RedisClusterServers if args.edge_cluster else functools.partial(RedisServer, appendonly=False)
    rows = []
    with (
        _warnings_only(),  # a log line per job would be part of the cost measured
        tempfile.TemporaryDirectory(prefix="inflight-edge-") as data,
        redis(Path(data)) as servers,
    ):
        for publishing, count in itertools.product(publishings, streams):
            row = uvloop.run(_row(servers, count, args.edge_tokens, args.edge_step_ms / 1000, publishing))
            print(
                f"edge {publishing:9} {count:5} streams: {row['events_per_s']:9,.0f} events/s landed "
                f"({row['sustained_events_per_s'] or 0:,.0f} sustained, "
                f"{row['offered_events_per_s']:,.0f} made), lag p50 "
                f"{row['publish_lag_p50_ms']:.2f} ms p99 {row['publish_lag_p99_ms']:.2f} ms",
                flush=True,
            )
            rows.append(row)
    return {
        "step_ms": args.edge_step_ms,
        "tokens_per_job": args.edge_tokens,
        "cluster": args.edge_cluster,
        "rows": rows,
    }


async def _row(servers, count: int, tokens: int, step_s: float, publishing: str) -> dict:
    nodes = getattr(servers, "nodes", [servers])
    run_id = uuid.uuid4().hex[:8]
    config = run_streams(servers.url, f"edge:{run_id}", consumer="edge", block_ms=100)
    client = connect(servers.url, block_ms=config.block_ms)
    await client.flushall()  # on a cluster, every master's
    memory_before = _used_memory(nodes)
    engine = StubEngine(count, step_s)
    lags: list[float] = []
    worker = Worker(engine, client, config, Metrics(engine.config.scheduler), ingest_poll_s=3600)
    if publishing == "per_event":
        worker.outbox = PerEventOutbox(worker.publisher)
        worker.front.on_events = worker.outbox.on_events
    worker.outbox.observe_lag = lags.append
    streams_written: list[int] = []  # per round trip
    landed: list[tuple[float, int]] = []  # per round trip: when, token events
    append = worker.publisher.append

    async def counted_append(appends):
        streams_written.append(len(appends))
        written = await append(appends)
        landed.append((time.perf_counter(), sum(len(one.tokens) for one in appends)))
        return written

    worker.publisher.append = counted_append

    async with client.pipeline(transaction=False) as pipe:
        for i in range(count):
            pipe.xadd(config.requests_stream, job_payload("x", None, f"{run_id}-{i}", max_tokens=tokens))
        await pipe.execute()
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.run(stop))
    redis_cpu_before, cpu_before = _redis_cpu_s(nodes), time.process_time()
    while await client.xlen(config.requests_stream):  # every job acked and deleted
        await asyncio.sleep(0.01)
    finished = time.perf_counter()
    redis_cpu, cpu = _redis_cpu_s(nodes) - redis_cpu_before, time.process_time() - cpu_before
    memory_after = _used_memory(nodes)
    stop.set()
    await serving
    await client.aclose()
    events = count * tokens
    elapsed = finished - engine.first_step_at
    return {
        "publishing": publishing,
        "streams": count,
        "events": events,
        "offered_events_per_s": engine.made / (engine.last_step_at - engine.first_step_at),  # what the stub made
        "events_per_s": events / elapsed,  # landed, first step to last ack
        "sustained_events_per_s": _middle_rate(landed),
        # From a step's end to its events landing: the outbox's own measure, per stream and round trip.
        "publish_lag_p50_ms": percentile(lags, 50) * 1000,
        "publish_lag_p99_ms": percentile(lags, 99) * 1000,
        "streams_per_round_trip": sum(streams_written) / len(streams_written),
        "steps": engine.steps,
        "worker_cpu_ms_per_1k_events": cpu / events * 1e6,  # this process: worker, stub engine, event loop
        "redis_cpu_ms_per_1k_events": redis_cpu / events * 1e6,
        "redis_bytes_per_token": (memory_after - memory_before) / (events + count),  # finished reply streams
    }


def _middle_rate(landed: list[tuple[float, int]]) -> float | None:
    """Token events landed per second without the start and the end: from the round trip just
    before 10% of them had landed to the one that brought 90%; None if one carried all that."""
    marks = list(zip([when for when, _ in landed], itertools.accumulate(count for _, count in landed)))
    total = marks[-1][1]
    start = ([mark for mark in marks if mark[1] < total * 0.1] or marks[:1])[-1]
    end = next(mark for mark in marks if mark[1] >= total * 0.9)
    return (end[1] - start[1]) / (end[0] - start[0]) if end[0] > start[0] else None


def _redis_cpu_s(nodes) -> float:
    return sum(cpu_seconds(node.process.pid) for node in nodes)


def _used_memory(nodes) -> int:
    return sum(int(re.search(rb"^used_memory:(\d+)", node.info("INFO", "memory"), re.M)[1]) for node in nodes)


class StubEngine:
    """What the worker needs of an engine, with no model: each step, every request it
    holds takes one token (the step sleeping `step_s`, as a GPU step would take)."""

    def __init__(self, max_running: int, step_s: float) -> None:
        self.config = EngineConfig(
            scheduler=SchedulerConfig(
                max_running_requests=max_running, max_decode_tokens=max_running, max_batch_tokens=max(512, max_running)
            )
        )
        self.observer = None
        self.adapters: list[str] = []  # no LoRA adapters
        self.step_s = step_s
        self.steps = 0
        self.first_step_at = 0.0
        self._step_ends = 0.0  # when this step ends, on the fixed schedule
        self.made = 0  # token events
        self.last_step_at = 0.0
        self._lock = threading.Lock()
        self._added: list[tuple[str, int]] = []
        self._cancelled: set[str] = set()
        self._running: dict[str, list[int]] = {}  # request id -> [tokens made, tokens wanted]

    def add_request(self, request) -> None:
        with self._lock:
            self._added.append((request.request_id, request.params.max_tokens - len(request.resumed_output_ids)))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._added or self._running)

    def step(self) -> list:
        with self._lock:
            self._running.update((request_id, [0, wanted]) for request_id, wanted in self._added)
            self._added.clear()
            cancelled, self._cancelled = self._cancelled, set()
        started = time.perf_counter()
        if not self.steps:
            self.first_step_at = self._step_ends = started
        self._step_ends += self.step_s
        self.steps += 1
        events = []
        for request_id, (made, wanted) in list(self._running.items()):
            if request_id not in cancelled:
                events.append(TokenEvent(request_id, (made % 1000,), "x"))
                self.made += 1
                made = self._running[request_id][0] = made + 1
            if request_id in cancelled or made == wanted:
                del self._running[request_id]
                reason = FinishReason.CANCELLED if request_id in cancelled else FinishReason.LENGTH
                events.append(FinalEvent(request_id, reason, Usage(1, made), Timings(0.0, 0.0, 0.0, (0.0,) * made)))
        if self.step_s:
            time.sleep(max(0.0, self._step_ends - time.perf_counter()))
        self.last_step_at = time.perf_counter()
        return events


class PerEventOutbox(ReplyOutbox):
    """The publishing this scenario compares with: every event its own awaited round
    trip, one task per stream, in order."""

    def __init__(self, publisher) -> None:
        super().__init__(publisher)
        self._queues: dict[str, asyncio.Queue] = {}
        self._writers: dict[str, asyncio.Task] = {}

    def open(self, request_id, reply_to, entry_id, seq, keep_text=False, choices=1):
        future = asyncio.get_running_loop().create_future()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._writers[request_id] = asyncio.create_task(
            self._write(queue, future, reply_to, entry_id, seq, choices > 1)
        )
        return future

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        writer = self._writers.pop(request_id, None)
        if writer is not None and not writer.done():
            writer.cancel()

    def on_events(self, events) -> None:
        now = time.monotonic()
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait((now, event))

    async def run(self) -> None:
        await asyncio.Event().wait()  # the writers do the work

    async def _write(self, queue, future, reply_to, entry_id, seq, indexed) -> None:
        while True:
            produced, event = await queue.get()
            final = isinstance(event, FinalEvent)
            if final:
                append = Append(reply_to, entry_id, (), (f"{seq}-1", done_fields(event, self.publisher.worker)), True)
            else:
                data = token_data(seq, event.text, event.token_ids, event.index if indexed else None)
                append = Append(reply_to, entry_id, (data,), None, True)
            (written,) = await self.publisher.append([append])
            if written is not True:
                future.set_exception(LeaseLost(reply_to) if written is False else written)
                return
            self.observe_lag(time.monotonic() - produced)
            if final:
                future.set_result(Published(event, seq, None))
                return
            seq += 1


SCENARIO = Scenario("edge", run, add_arguments)
