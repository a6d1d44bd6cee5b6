"""`inflight bench --scenario intake`: how many jobs per second one Redis shard takes in: each
job's request-stream commands alone (the XADD; reads through the real `JobReader` and the
control stream's XRANGE; lease renewals; the ack) against a private `redis-server`. The client
is the bottleneck, so Redis's own CPU per job sizes a shard (docs/benchmarks.md, "Intake")."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
import uuid
from pathlib import Path

import msgpack

from bench.processes import RedisServer, cpu_seconds
from bench.scenario import D, Scenario, add_flags
from bench.systems import run_streams
from service.connect import connect
from service.ingest import JobReader


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "intake scenario", {
        "--intake-jobs": (20000, "jobs to take in" + D),
        "--intake-producers": (4, "producer tasks" + D),
        "--intake-workers": (4, "worker readers" + D),
        "--intake-batch": (8, "entries one worker read asks for" + D),
        "--intake-renewals": (4, "lease renewals per job: its run time / 0.5 s" + D),
    })  # fmt: skip


async def run(args: argparse.Namespace) -> dict:
    with (
        tempfile.TemporaryDirectory(prefix="inflight-intake-") as tmp,
        RedisServer(Path(tmp), appendonly=False) as server,
    ):
        return await _take_in(args, server)


async def _take_in(args: argparse.Namespace, server: RedisServer) -> dict:
    config = run_streams(server.url, f"inflight:bench:intake:{uuid.uuid4().hex[:8]}")
    producers = [connect(server.url, socket_timeout=30) for _ in range(args.intake_producers)]
    readers = [
        JobReader(connect(server.url, block_ms=config.block_ms), dataclasses.replace(config, consumer=f"w{i}"))
        for i in range(args.intake_workers)
    ]
    await readers[0].ensure_group()
    await producers[0].xadd(config.control_stream, {"type": "cancel", "id": "none"})  # a control stream to read
    job = {"payload": msgpack.packb({"id": "", "messages": [{"role": "user", "content": "x" * 160}], "max_tokens": 64})}
    left = {"produce": args.intake_jobs, "ack": args.intake_jobs}

    async def produce(client) -> None:
        while left["produce"] > 0:
            left["produce"] -= 1
            await client.xadd(config.requests_stream, {**job, "id": uuid.uuid4().hex})

    async def work(reader: JobReader) -> None:
        while left["ack"] > 0:
            entries = await reader.read(args.intake_batch, 100)
            if not entries:
                continue
            await reader.redis.xrange(config.control_stream, min="(0-1")  # the worker's catch-up on cancels
            ids = [entry.entry_id for entry in entries]
            for _ in range(args.intake_renewals):
                await reader.renew(ids)
            for entry_id in ids:
                await reader.ack(entry_id)
            left["ack"] -= len(ids)

    cpu_before = cpu_seconds(server.process.pid)
    started = time.perf_counter()
    await asyncio.gather(*(produce(client) for client in producers), *(work(reader) for reader in readers))
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds(server.process.pid) - cpu_before
    for client in [*producers, *(reader.redis for reader in readers)]:
        await client.aclose()
    cpu_per_job = cpu / args.intake_jobs
    return {
        "jobs": args.intake_jobs,
        "elapsed_s": elapsed,
        "jobs_per_s": args.intake_jobs / elapsed,
        "redis_cpu_s": cpu,
        "redis_cpu_busy": cpu / elapsed,  # of one core
        "redis_cpu_us_per_job": cpu_per_job * 1e6,
        "shard_jobs_per_s_at_one_core": 1 / cpu_per_job if cpu_per_job else float("inf"),
        "batch": args.intake_batch,
        "renewals_per_job": args.intake_renewals,
    }


SCENARIO = Scenario("intake", run, add_arguments)
