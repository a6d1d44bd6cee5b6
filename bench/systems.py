"""The paths a scenario sends its workload through: `await path.generate({request_id: (text,
max_tokens)})` returns each request's token times after t0, all sent at t0, greedy, EOS
ignored. In process, through Redis (one pipelined round trip, one XREAD) or a gateway."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from bench.arrivals import at_t0
from bench.fleet import Fleet, bench_run, model_flags
from bench.follow import Follower, Job
from bench.http_client import CompletionsClient, Prompt, token_times
from service.config import RedisConfig
from service.protocol import reply_stream
from workers.api import FinalEvent, GenerationRequest, SamplingParams, TokenEvent

# A worker that stopped answering (or a job dead-lettered) fails the run instead of hanging it.
QUIET_LIMIT_S = 120.0


class InProcess:
    """The engine in this process, behind the `AsyncEngine` front a worker uses."""

    def __init__(self, front) -> None:
        self.front = front

    async def generate(self, prompts: dict[str, tuple[str, int]]) -> dict[str, list[float]]:
        t0 = time.perf_counter()
        streams = {
            rid: self.front.submit_streamed(GenerationRequest(rid, text, SamplingParams(max_tokens=n, ignore_eos=True)))
            for rid, (text, n) in prompts.items()
        }

        async def follow(stream) -> list[float]:
            times = []
            async for event in stream:
                if isinstance(event, TokenEvent):
                    times.extend([time.perf_counter() - t0] * len(event.token_ids))
                elif isinstance(event, FinalEvent) and event.error:
                    raise RuntimeError(f"in-process request {event.request_id} failed: {event.error}")
            return times

        results = await asyncio.gather(*(follow(s) for s in streams.values()))
        return dict(zip(streams, results))


class ThroughRedis:
    """Jobs queued on a worker's request stream, all reply streams followed with one XREAD."""

    def __init__(self, client, fleet: Fleet) -> None:
        self.client, self.fleet = client, fleet

    async def generate(self, prompts: dict[str, tuple[str, int]]) -> dict[str, list[float]]:
        jobs = [Job(rid, rid, text, n) for rid, (text, n) in prompts.items()]
        async with Follower(self.client, self.fleet).reading() as follower:
            t0 = await follower.send(jobs)
            await follower.all_final(jobs, "through Redis", limit_s=QUIET_LIMIT_S, quiet=True, errors_fail=True)
        await delete_replies(self.client, list(prompts))
        return {job.label: [t - t0 for t in job.times] for job in jobs}


class ThroughGateway:
    """Streamed completions on pooled connections; `redis` is the gateway's server, whose reply
    streams are deleted after each call."""

    def __init__(self, url: str, redis) -> None:
        self.client = CompletionsClient(url, timeout_s=300, fresh_connections=False)
        self.redis = redis

    async def __aenter__(self) -> ThroughGateway:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.__aexit__(*exc)

    async def generate(self, prompts: dict[str, tuple[str, int]]) -> dict[str, list[float]]:
        records, _ = await self.client.send([Prompt(text, 0, n) for text, n in prompts.values()], at_t0(len(prompts)))
        failed = [r.error for r in records if r.error is not None]
        if failed:
            raise RuntimeError(f"through the gateway: {failed[0]}")
        await delete_replies(self.redis, [r.request_id for r in records])
        return {label: token_times(record) for label, record in zip(prompts, records)}


async def delete_replies(client, request_ids: list[str]) -> None:
    """The requests' reply streams and their owner keys, read and done with."""
    streams = [reply_stream(r) for r in request_ids]
    await client.delete(*streams, *[f"{stream}:owner" for stream in streams])


@contextlib.asynccontextmanager
async def private_worker(redis_url: str, args: argparse.Namespace, *worker_flags: str):
    """A worker, `bench`, on streams of this run's own (on `redis_url`, else an embedded
    Valkey): yields the run and its fleet, both closed on the way out."""
    async with bench_run(redis_url, "worker", socket_timeout=30) as run:
        with run.fleet("worker", [*model_flags(args), *worker_flags], reap=False) as fleet:
            fleet.start("bench")
            yield run, fleet


def run_streams(url: str, prefix: str, **settings) -> RedisConfig:
    """A RedisConfig on the streams a fleet on `prefix` serves."""
    streams = {"requests_stream": f"{prefix}:requests", "control_stream": f"{prefix}:control"}
    return RedisConfig(url=url, dead_letter_stream=f"{prefix}:dead", **streams, **settings)
