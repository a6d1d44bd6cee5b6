"""`inflight bench --scenario redis`: the engine benchmark's workload through Redis end to
end, against the same workload in-process, in one run.

Through Redis: an `inflight worker` process (the consumer) on private streams; this
process is the producer. It queues every job at t0 (one pipelined round trip) and follows
all reply streams with one blocking XREAD, stamping each token when it arrives here.
In-process: this process runs the same engine settings behind the same `AsyncEngine`
front the worker uses (built on its torch thread, as the worker builds it), submits the
same prompts at t0 and stamps each token event as it
comes out. The prompts are the workload's token ids decoded to text (both paths encode
that text the same way), with `ignore_eos`, so both do exactly the same work.

The machine's speed drifts between runs, so the rounds alternate, in-process, Redis,
Redis, in-process, ..., and the figures pool them.

Time to first token is compared separately, on an idle system: short prompts, one at a
time, alternating between the paths; the overhead is the median of the paired
differences (Redis minus in-process), which the drift between pairs does not reach.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgpack

from bench.metrics import percentile, summarize
from bench.workload import make_workload
from service.config import RedisConfig
from service.connect import connect
from service.protocol import reply_stream
from service.sdk import job_payload
from workers.api import FinalEvent, GenerationRequest, SamplingParams, TokenEvent
from workers.config import EngineConfig, ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("redis scenario")
    group.add_argument(
        "--redis-url",
        default=RedisConfig().url,
        help="the server to go through (default: $REDIS_URL, else an embedded Valkey on a free port)",
    )
    group.add_argument(
        "--redis-rounds",
        type=int,
        default=2,
        help="in-process/Redis pairs of the workload, in ABBA order (default: %(default)s)",
    )
    group.add_argument(
        "--ttft-pairs",
        type=int,
        default=24,
        help="short prompts sent one at a time down each path for the TTFT overhead (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> dict:
    import uvloop

    return uvloop.run(_run(args))  # the loop the worker runs on


def _load(args: argparse.Namespace):
    """The model, the engine and the prompt vocabulary, built on the torch thread as in the worker."""
    from bench.workload import allowed_token_ids, special_token_ids
    from workers.engine import Engine
    from workers.model_loader import load_model

    loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))
    vocab_ids = allowed_token_ids(
        min(len(loaded.tokenizer), loaded.model.config.vocab_size), special_token_ids(loaded.tokenizer)
    )
    return loaded, Engine(loaded, EngineConfig(model=ModelConfig(dtype=args.dtype))), vocab_ids


async def _run(args: argparse.Namespace) -> dict:
    from workers.async_engine import AsyncEngine, on_torch_thread

    loaded, engine, vocab_ids = await on_torch_thread(_load, args)
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab_ids, args.seed)
    prompts = {r.request_id: (loaded.tokenizer.decode(r.prompt_ids), r.output_len) for r in workload.requests}
    rng = random.Random(args.seed + 1)
    short_prompts = [
        loaded.tokenizer.decode([rng.choice(vocab_ids) for _ in range(16)]) for _ in range(args.ttft_pairs)
    ]

    with _redis_server(args.redis_url) as url:
        client = connect(url, socket_timeout=30)
        run_id = uuid.uuid4().hex[:8]  # request ids are unique while their reply streams live
        prefix = f"inflight:bench:{run_id}"
        worker = _start_worker(url, prefix, args)
        try:
            async with AsyncEngine(engine) as front:
                paths = {"inprocess": _InProcess(front), "redis": _ThroughRedis(client, prefix)}
                for path in paths.values():  # warm both: first-step costs are not the edge's
                    await path.generate({f"warmup-{uuid.uuid4().hex[:6]}": (short_prompts[0], 2)})
                runs: dict[str, list[dict]] = {"inprocess": [], "redis": []}
                for round_ in range(args.redis_rounds):
                    order = ("inprocess", "redis") if round_ % 2 == 0 else ("redis", "inprocess")
                    for name in order:
                        tagged = {f"{run_id}-{k}-{name}-{round_}": v for k, v in prompts.items()}
                        runs[name].append(summarize(await paths[name].generate(tagged), 0.0))
                ttft = await paired_ttft(paths, ("inprocess", "redis"), short_prompts, run_id)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
            await client.delete(*[key async for key in client.scan_iter(f"{prefix}:*")])
            await client.aclose()

    def pooled(name: str) -> float:
        return sum(r["output_tokens"] for r in runs[name]) / sum(r["wall_s"] for r in runs[name])

    differences = [r - i for r, i in zip(ttft["redis"], ttft["inprocess"])]
    return {
        "output_tokens_per_s": pooled("redis"),
        "inprocess_output_tokens_per_s": pooled("inprocess"),
        "throughput_ratio": pooled("redis") / pooled("inprocess"),
        "ttft_overhead_p50_s": percentile(differences, 50),
        "ttft_p50_s": percentile(ttft["redis"], 50),
        "inprocess_ttft_p50_s": percentile(ttft["inprocess"], 50),
        "ttft_pairs": len(differences),
        "rounds": {name: [_brief(r) for r in figures] for name, figures in runs.items()},
        "workload": workload.describe(),
    }


def _brief(figures: dict) -> dict:
    keep = ("output_tokens_per_s", "output_tokens", "wall_s", "ttft_p50_s", "itl_p50_s", "itl_p99_s")
    return {k: figures[k] for k in keep}


class _InProcess:
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


# A worker that stopped answering (or a job dead-lettered) fails the run instead of hanging it.
QUIET_LIMIT_S = 120.0


class _ThroughRedis:
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
        await self.client.delete(
            *[reply_stream(rid) for rid in prompts], *[f"{reply_stream(rid)}:owner" for rid in prompts]
        )
        return times


def _start_worker(url: str, prefix: str, args: argparse.Namespace, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "worker",
            "--redis-url",
            url,
            "--requests-stream",
            f"{prefix}:requests",
            "--dead-letter-stream",
            f"{prefix}:dead",
            "--control-stream",
            f"{prefix}:control",
            "--consumer",
            "bench",
            "--metrics-port",
            "0",
            "--dtype",
            args.dtype,
            *(["--model", args.model] if args.model else []),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextlib.contextmanager
def _redis_server(url: str):
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


async def paired_ttft(paths: dict, names: tuple[str, str], prompts: list, run_id: str) -> dict[str, list[float]]:
    """Time to first token of each short prompt on both paths, one at a time, the order
    alternating so neither path always goes first."""
    ttft: dict[str, list[float]] = {name: [] for name in names}
    for i, prompt in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            times = await paths[name].generate({f"{run_id}-ttft-{i}-{name}": (prompt, 1)})
            ttft[name].append(next(iter(times.values()))[0])
    return ttft
