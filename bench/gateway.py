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

from bench.paired import paired_runs, short_prompts, text_prompts
from bench.servers import open_gateway
from bench.systems import ThroughGateway, ThroughRedis, private_worker
from bench.workload import make_workload, prompt_vocabulary
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
    vocab_ids = prompt_vocabulary(tokenizer, loaded.model.config.vocab_size)
    del loaded
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab_ids, args.seed)
    prompts = text_prompts(tokenizer, workload)
    short = short_prompts(tokenizer, vocab_ids, args.gateway_ttft_pairs, args.seed)

    # Both paths share the worker: with prefix caching, only the first round would compute
    # its prompts, and the path it belongs to would look slow.
    async with private_worker(args.redis_url, args, "--no-prefix-caching") as run:
        streams = ["--requests-stream", f"{run.prefix}:requests", "--control-stream", f"{run.prefix}:control"]
        gateway = open_gateway("bench", run.url, 300, run.log_dir, *streams)
        gateway.start()
        try:
            gateway.wait_ready()
            async with ThroughGateway(gateway.url, run.client) as through_gateway:
                paths = {"redis": ThroughRedis(run.client, run.prefix), "gateway": through_gateway}
                meters = {"gateway": gateway.cpu_seconds}
                runs = await paired_runs(paths, prompts, short, args.gateway_rounds, run.run_id, meters)
        finally:
            gateway.stop()

    streamed = runs.output_tokens("gateway")
    gateway_cpu_s = runs.metered["gateway"]
    return runs.figures("redis", "gateway") | {
        "gateway_cpu_s": gateway_cpu_s,
        "gateway_cpu_ms_per_1000_tokens": gateway_cpu_s * 1e6 / streamed,
        "streamed_tokens": streamed,
        "workload": workload.describe(),
    }
