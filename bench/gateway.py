"""`inflight bench --scenario gateway`: the throughput workload streamed through the
OpenAI-compatible gateway by concurrent HTTP clients, against the same jobs sent straight
to Redis, in one run.

One `inflight worker` process and one `inflight gateway` process on private streams.
Straight to Redis is the `redis` scenario's producer (`bench/through_redis.py`): every
job queued at t0, all reply streams followed with one XREAD. Through the gateway, every
request is its own streamed `POST /v1/completions` (aiohttp, one connection each), all
sent at t0; each token is stamped as its SSE event arrives here. Both send the same text
prompts, greedy, EOS ignored, to one worker with prefix caching off, so every round
does the same work. Rounds alternate (Redis,
gateway, gateway, Redis, ...) against the machine's drift, and the figures pool them.

Time to first token is compared on an idle system, as in the `redis` scenario: short
prompts one at a time, alternating paths, the median of the paired differences.
The gateway's CPU (user + system, from /proc) over the workload rounds, per 1,000 tokens
streamed, is what one more hop costs the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import uuid
from pathlib import Path

from bench.metrics import percentile, summarize
from bench.processes import GatewayProcess
from bench.through_redis import _brief, _redis_server, _start_worker, _ThroughRedis, paired_ttft
from bench.workload import allowed_token_ids, make_workload, special_token_ids
from service.config import DEFAULT_MODEL_NAME
from service.connect import connect
from service.protocol import reply_stream
from workers.config import ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gateway scenario (also --redis-url)")
    group.add_argument(
        "--gateway-rounds",
        type=int,
        default=2,
        help="Redis/gateway pairs of the workload, in ABBA order (default: %(default)s)",
    )
    group.add_argument(
        "--gateway-ttft-pairs",
        type=int,
        default=24,
        help="short prompts sent one at a time down each path for the TTFT overhead (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> dict:
    import uvloop

    return uvloop.run(_run(args))


async def _run(args: argparse.Namespace) -> dict:
    from workers.model_loader import load_model

    loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))  # for its tokenizer
    tokenizer = loaded.tokenizer
    vocab_ids = allowed_token_ids(min(len(tokenizer), loaded.model.config.vocab_size), special_token_ids(tokenizer))
    del loaded
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab_ids, args.seed)
    prompts = {r.request_id: (tokenizer.decode(r.prompt_ids), r.output_len) for r in workload.requests}
    rng = random.Random(args.seed + 1)
    short_prompts = [
        tokenizer.decode([rng.choice(vocab_ids) for _ in range(16)]) for _ in range(args.gateway_ttft_pairs)
    ]

    with _redis_server(args.redis_url) as url, tempfile.TemporaryDirectory(prefix="inflight-bench-gw-") as logs:
        client = connect(url, socket_timeout=30)
        run_id = uuid.uuid4().hex[:8]
        prefix = f"inflight:bench:{run_id}"
        # Both paths share this worker: with prefix caching, only the first round would
        # compute its prompts, and the path it belongs to would look slow.
        worker = _start_worker(url, prefix, args, "--no-prefix-caching")
        gateway = GatewayProcess(
            "bench",
            [
                "--redis-url",
                url,
                "--requests-stream",
                f"{prefix}:requests",
                "--control-stream",
                f"{prefix}:control",
                "--reply-timeout-s",
                "300",
                "--max-queue-depth",
                "0",
                "--max-queue-age-s",
                "0",
            ],
            Path(logs),
        )
        gateway.start()
        try:
            gateway.wait_ready()
            async with _ThroughGateway(gateway.url, client) as through_gateway:
                paths = {"redis": _ThroughRedis(client, prefix), "gateway": through_gateway}
                for path in paths.values():  # warm both (the worker loads its model meanwhile)
                    await path.generate({f"warmup-{uuid.uuid4().hex[:6]}": (short_prompts[0], 2)})
                runs: dict[str, list[dict]] = {"redis": [], "gateway": []}
                gateway_cpu_s = 0.0
                for round_ in range(args.gateway_rounds):
                    order = ("redis", "gateway") if round_ % 2 == 0 else ("gateway", "redis")
                    for name in order:
                        tagged = {f"{run_id}-{k}-{name}-{round_}": v for k, v in prompts.items()}
                        cpu_before = gateway.cpu_seconds()
                        runs[name].append(summarize(await paths[name].generate(tagged), 0.0))
                        if name == "gateway":
                            gateway_cpu_s += gateway.cpu_seconds() - cpu_before
                ttft = await paired_ttft(paths, ("redis", "gateway"), short_prompts, run_id)
        finally:
            gateway.stop()
            worker.terminate()
            worker.wait(timeout=60)
            await client.delete(*[key async for key in client.scan_iter(f"{prefix}:*")])
            await client.aclose()

    def pooled(name: str) -> float:
        return sum(r["output_tokens"] for r in runs[name]) / sum(r["wall_s"] for r in runs[name])

    streamed = sum(r["output_tokens"] for r in runs["gateway"])
    differences = [g - r for g, r in zip(ttft["gateway"], ttft["redis"])]
    return {
        "output_tokens_per_s": pooled("gateway"),
        "redis_output_tokens_per_s": pooled("redis"),
        "throughput_ratio": pooled("gateway") / pooled("redis"),
        "ttft_overhead_p50_s": percentile(differences, 50),
        "ttft_p50_s": percentile(ttft["gateway"], 50),
        "redis_ttft_p50_s": percentile(ttft["redis"], 50),
        "ttft_pairs": len(differences),
        "gateway_cpu_s": gateway_cpu_s,
        "gateway_cpu_ms_per_1000_tokens": gateway_cpu_s * 1e6 / streamed,
        "streamed_tokens": streamed,
        "rounds": {name: [_brief(r) for r in figures] for name, figures in runs.items()},
        "workload": workload.describe(),
    }


class _ThroughGateway:
    """Concurrent streaming clients: one `POST /v1/completions` per request, all at t0."""

    def __init__(self, url: str, redis) -> None:
        self.url = f"{url}/v1/completions"
        self.redis = redis

    async def __aenter__(self) -> _ThroughGateway:
        import aiohttp

        # No connection cap: every request streams on a connection of its own, as separate clients would.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_read=300)
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def generate(self, prompts: dict[str, tuple[str, int]]) -> dict[str, list[float]]:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._stream(text, n, t0) for text, n in prompts.values()))
        request_ids = [request_id for request_id, _ in results]
        await self.redis.delete(
            *[reply_stream(r) for r in request_ids], *[f"{reply_stream(r)}:owner" for r in request_ids]
        )
        return {label: times for label, (_, times) in zip(prompts, results)}

    async def _stream(self, text: str, max_tokens: int, t0: float) -> tuple[str, list[float]]:
        body = {
            "model": DEFAULT_MODEL_NAME,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        times: list[float] = []
        tokens = 0
        async with self.session.post(self.url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"through the gateway: {response.status} {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"through the gateway: {chunk['error']}")
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(now)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            request_id = response.headers["x-request-id"]
        # A token whose text was held back (a partial character) arrives with a later one.
        return request_id, times + [times[-1] if times else time.perf_counter() - t0] * (tokens - len(times))
