"""`inflight bench --scenario gateway`: the bench's workload streamed through the
OpenAI-compatible gateway by concurrent HTTP clients, against the same jobs sent straight
to Redis, as paired runs (`bench/paired.py`).

One `inflight worker` (prefix caching off, so every round does the same work) and one
`inflight gateway` on private streams. Straight to Redis is the `redis` scenario's path;
through the gateway, every request is its own streamed `POST /v1/completions`, all sent
at t0, each token stamped as its SSE event arrives. `gateway_cpu_ms_per_1000_tokens` is
the gateway's CPU (user + system, from /proc) over the workload rounds per 1,000 tokens
streamed: what one more hop costs the machine.
"""

from __future__ import annotations

import argparse

from bench.fleet import BACKPRESSURE_OFF
from bench.paired import paired_runs, paired_workload
from bench.scenario import Scenario
from bench.systems import ThroughGateway, ThroughRedis, private_worker
from bench.workload import prompt_vocabulary
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
    vocab_ids = prompt_vocabulary(loaded.tokenizer, loaded.model.config.vocab_size)
    workload, prompts, short = paired_workload(args, loaded.tokenizer, vocab_ids, args.gateway_ttft_pairs)
    del loaded

    # Both paths share the worker: with prefix caching, only the first round would compute
    # its prompts, and the path it belongs to would look slow.
    async with private_worker(args.redis_url, args, "--no-prefix-caching") as (run, fleet):
        gateway = fleet.gateway("bench", "--reply-timeout-s", "300", *BACKPRESSURE_OFF)
        gateway.wait_ready()
        async with ThroughGateway(gateway.url, run.client) as through_gateway:
            paths = {"redis": ThroughRedis(run.client, fleet), "gateway": through_gateway}
            meters = {"gateway": gateway.cpu_seconds}
            runs = await paired_runs(paths, prompts, short, args.gateway_rounds, run.run_id, meters)
    streamed = runs.output_tokens("gateway")
    gateway_cpu_s = runs.metered["gateway"]
    return runs.figures("redis", "gateway") | {
        "gateway_cpu_s": gateway_cpu_s,
        "gateway_cpu_ms_per_1000_tokens": gateway_cpu_s * 1e6 / streamed,
        "streamed_tokens": streamed,
        "workload": workload.describe(),
    }


SCENARIO = Scenario("gateway", run, add_arguments)
