"""The systems a scenario sends its workload through, each a path with one call:
`await path.generate({request_id: (text, max_tokens)})` returns each request's token
arrival times in seconds after t0, every request sent at t0, greedy with EOS ignored.

- `InProcess`: the engine in this process behind the `AsyncEngine` front a worker uses;
- `ThroughRedis`: jobs queued on a worker's request stream in one pipelined round trip,
  all reply streams followed with one blocking XREAD;
- `ThroughGateway`: one streamed `POST /v1/completions` per request (`bench/http_client.py`).

`private_worker` brings up what the Redis and gateway paths go through: a Redis server and
a worker on streams of the run's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgpack

from bench.arrivals import at_t0
from bench.http_client import CompletionsClient, Prompt, token_times
from bench.processes import WorkerProcess
from service.config import RedisConfig
from service.connect import connect
from service.protocol import reply_stream
from service.sdk import job_payload
from workers.api import FinalEvent, GenerationRequest, SamplingParams, TokenEvent

# A worker that stopped answering (or a job dead-lettered) fails the run instead of hanging it.
QUIET_LIMIT_S = 120.0


class InProcess:
    """The engine in this process, behind the `AsyncEngine` front a worker uses."""

    def __init__(self, front) -> None:
        self.front = front

    async def generate(self, prompts: dict[str, tuple[str, int]]) -> dict[str, list[float]]:
        """Submit every prompt at t0; each request's token arrival times after t0."""
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
    def __init__(self, client, prefix: str) -> None:
        self.client = client
        self.requests_stream = f"{prefix}:requests"

    async def generate(self, prompts: dict[str, tuple[str, int]]) -> dict[str, list[float]]:
        """Queue every job in one round trip at t0; follow all reply streams with one XREAD."""
        pipe = self.client.pipeline(transaction=False)
        for rid, (text, n) in prompts.items():
            pipe.xadd(self.requests_stream, job_payload(text, None, rid, max_tokens=n, ignore_eos=True))
        t0 = time.perf_counter()
        await pipe.execute()
        times: dict[str, list[float]] = {rid: [] for rid in prompts}
        last = {reply_stream(rid): "0" for rid in prompts}
        owner = {reply_stream(rid): rid for rid in prompts}
        quiet_since = time.perf_counter()
        while last:
            reply = await self.client.xread(last, block=5000)
            if not reply and time.perf_counter() - quiet_since > QUIET_LIMIT_S:
                raise RuntimeError(
                    f"through Redis, no reply for {QUIET_LIMIT_S:.0f} s (see {self.requests_stream}'s dead letters)"
                )
            quiet_since = time.perf_counter()
            now = time.perf_counter() - t0
            for key, entries in reply or []:
                key = key.decode()
                for entry_id, fields in entries:
                    last[key] = entry_id
                    event = msgpack.unpackb(fields[b"data"])
                    if event["type"] == "token":
                        times[owner[key]].extend([now] * len(event["token_ids"]))
                    elif event["type"] == "error":
                        raise RuntimeError(f"through Redis, {owner[key]} failed: {event['message']}")
                    else:
                        del last[key]
        await delete_replies(self.client, list(prompts))
        return times


class ThroughGateway:
    """Concurrent streaming clients on pooled connections, all sent at t0; `redis` is the
    gateway's server, whose reply streams are deleted after each call."""

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


@dataclass(frozen=True)
class PrivateWorker:
    url: str  # the Redis server's
    client: object  # a redis.asyncio client of it
    run_id: str  # request ids are unique while their reply streams live
    prefix: str  # of the run's streams and keys
    log_dir: Path


@contextlib.asynccontextmanager
async def private_worker(redis_url: str, args: argparse.Namespace, *worker_flags: str):
    """A worker on streams of this run's own (on `redis_url`, else an embedded Valkey);
    on the way out the worker stops and the run's keys are deleted."""
    with redis_server(redis_url) as url, tempfile.TemporaryDirectory(prefix="inflight-bench-") as logs:
        client = connect(url, socket_timeout=30)
        run_id = uuid.uuid4().hex[:8]
        run = PrivateWorker(url, client, run_id, f"inflight:bench:{run_id}", Path(logs))
        worker = bench_worker(url, run.prefix, args, run.log_dir, *worker_flags)
        worker.start()
        try:
            yield run
        finally:
            worker.stop()
            await client.delete(*[key async for key in client.scan_iter(f"{run.prefix}:*")])
            await client.aclose()


def bench_worker(url: str, prefix: str, args: argparse.Namespace, log_dir: Path, *extra: str) -> WorkerProcess:
    """An `inflight worker` process on `prefix`'s private streams, with the bench's model and dtype."""
    streams = run_streams(url, prefix)
    argv = ["--redis-url", url, "--dtype", args.dtype, *(["--model", args.model] if args.model else [])]
    argv += ["--requests-stream", streams.requests_stream, "--dead-letter-stream", streams.dead_letter_stream]
    argv += ["--control-stream", streams.control_stream]
    return WorkerProcess("bench", [*argv, *extra], log_dir)


@contextlib.contextmanager
def redis_server(url: str):
    """The given server, or an embedded Valkey on a free port for the run."""
    if url:
        yield url
        return
    from service.embedded import embedded_valkey

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="inflight-bench-valkey-") as data_dir:
        with embedded_valkey(port, Path(data_dir)) as embedded:
            yield embedded


def run_streams(url: str, prefix: str, **settings) -> RedisConfig:
    """A RedisConfig on `prefix`'s own request, control and dead-letter streams (the ones
    `bench_worker`'s worker serves)."""
    return RedisConfig(
        url=url,
        requests_stream=f"{prefix}:requests",
        control_stream=f"{prefix}:control",
        dead_letter_stream=f"{prefix}:dead",
        **settings,
    )
