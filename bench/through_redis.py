"""`inflight bench --scenario redis`: the bench's workload through an `inflight worker`
process against the same engine in-process behind the `AsyncEngine` front, as paired runs
(`bench/paired.py`, paths from `bench/systems.py`); docs/benchmarks.md, "Through Redis"."""

from __future__ import annotations

import argparse

from bench.paired import paired_runs, paired_workload
from bench.scenario import D, Scenario, add_flags
from bench.systems import InProcess, ThroughRedis, private_worker
from bench.workload import prompt_vocabulary
from service.config import RedisConfig
from workers.config import ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "redis scenario", {
        "--redis-url": (RedisConfig().url,
                        "the server to go through (default: $REDIS_URL, else an embedded Valkey on a free port)"),
        "--redis-rounds": (2, "in-process/Redis pairs of the workload, in ABBA order" + D),
        "--ttft-pairs": (24, "short prompts sent one at a time down each path for the TTFT overhead" + D),
    })  # fmt: skip


def _load(args: argparse.Namespace):
    """The model, its engine and the prompt vocabulary, built on the torch thread as in the worker."""
    from bench.drive import bench_engine
    from workers.model_loader import load_model

    loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))
    vocab_ids = prompt_vocabulary(loaded.tokenizer, loaded.model.config.vocab_size)
    return loaded, bench_engine(loaded, args), vocab_ids


async def run(args: argparse.Namespace) -> dict:
    from workers.async_engine import AsyncEngine, on_torch_thread

    loaded, engine, vocab_ids = await on_torch_thread(_load, args)
    workload, prompts, short = paired_workload(args, loaded.tokenizer, vocab_ids, args.ttft_pairs)
    async with private_worker(args.redis_url, args) as (run, fleet), AsyncEngine(engine) as front:
        paths = {"inprocess": InProcess(front), "redis": ThroughRedis(run.client, fleet)}
        runs = await paired_runs(paths, prompts, short, args.redis_rounds, run.run_id)
    return runs.figures("inprocess", "redis") | {"workload": workload.describe()}


SCENARIO = Scenario("redis", run, add_arguments)
