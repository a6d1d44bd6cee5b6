"""`inflight bench --scenario redis`: the bench's workload through Redis end to end, against
the same workload in-process, as paired runs (`bench/paired.py`).

Through Redis: an `inflight worker` process on private streams; this process queues every
job at t0 and follows all reply streams with one XREAD, stamping each token as it arrives.
In-process: the same engine settings behind the `AsyncEngine` front the worker uses (built
on its torch thread, as the worker builds it), each token stamped as its event comes out.
The TTFT overhead is Redis minus in-process. The paths are `bench/systems.py`'s.
"""

from __future__ import annotations

import argparse

from bench.paired import paired_runs, paired_workload
from bench.scenario import Scenario
from bench.systems import InProcess, ThroughRedis, private_worker
from bench.workload import prompt_vocabulary
from service.config import RedisConfig
from workers.config import ModelConfig


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
    from bench.drive import bench_engine
    from workers.model_loader import load_model

    loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))
    vocab_ids = prompt_vocabulary(loaded.tokenizer, loaded.model.config.vocab_size)
    return loaded, bench_engine(loaded, args), vocab_ids


async def _run(args: argparse.Namespace) -> dict:
    from workers.async_engine import AsyncEngine, on_torch_thread

    loaded, engine, vocab_ids = await on_torch_thread(_load, args)
    workload, prompts, short = paired_workload(args, loaded.tokenizer, vocab_ids, args.ttft_pairs)
    async with private_worker(args.redis_url, args) as (run, fleet), AsyncEngine(engine) as front:
        paths = {"inprocess": InProcess(front), "redis": ThroughRedis(run.client, fleet)}
        runs = await paired_runs(paths, prompts, short, args.redis_rounds, run.run_id)
    return runs.figures("inprocess", "redis") | {"workload": workload.describe()}


SCENARIO = Scenario("redis", run, add_arguments)
