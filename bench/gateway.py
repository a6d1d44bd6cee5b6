"""`inflight bench --scenario gateway`: the bench's workload streamed through `inflight
gateway` by concurrent HTTP clients against the same jobs straight to Redis, as paired runs
(`bench/paired.py`); docs/benchmarks.md, "Through the gateway"."""

from __future__ import annotations

import argparse

from bench.fleet import BACKPRESSURE_OFF
from bench.paired import paired_runs, paired_workload
from bench.scenario import D, Scenario, add_flags
from bench.systems import ThroughGateway, ThroughRedis, private_worker
from bench.workload import prompt_vocabulary
from workers.config import ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "gateway scenario (also --redis-url)", {
        "--gateway-rounds": (2, "Redis/gateway pairs of the workload, in ABBA order" + D),
        "--gateway-ttft-pairs": (24, "short prompts sent one at a time down each path for the TTFT overhead" + D),
    })  # fmt: skip


async def run(args: argparse.Namespace) -> dict:
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
            meters = {"gateway": gateway.cpu_seconds}  # user + system, from /proc
            runs = await paired_runs(paths, prompts, short, args.gateway_rounds, run.run_id, meters)
    streamed = runs.output_tokens("gateway")
    gateway_cpu_s = runs.metered["gateway"]
    return runs.figures("redis", "gateway") | {
        "gateway_cpu_s": gateway_cpu_s,
        # What one more hop costs the machine.
        "gateway_cpu_ms_per_1000_tokens": gateway_cpu_s * 1e6 / streamed,
        "streamed_tokens": streamed,
        "workload": workload.describe(),
    }


SCENARIO = Scenario("gateway", run, add_arguments)
