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
The paths are `bench/systems.py`'s, the rounds and pairs `bench/paired.py`'s.
"""

from __future__ import annotations

import argparse

from bench.paired import paired_runs, short_prompts, text_prompts
from bench.systems import InProcess, ThroughRedis, private_worker
from bench.workload import make_workload, prompt_vocabulary
from service.config import RedisConfig
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
    from workers.engine import Engine
    from workers.model_loader import load_model

    loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))
    vocab_ids = prompt_vocabulary(loaded.tokenizer, loaded.model.config.vocab_size)
    return loaded, Engine(loaded, EngineConfig(model=ModelConfig(dtype=args.dtype))), vocab_ids


async def _run(args: argparse.Namespace) -> dict:
    from workers.async_engine import AsyncEngine, on_torch_thread

    loaded, engine, vocab_ids = await on_torch_thread(_load, args)
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab_ids, args.seed)
    prompts = text_prompts(loaded.tokenizer, workload)
    short = short_prompts(loaded.tokenizer, vocab_ids, args.ttft_pairs, args.seed)

    async with private_worker(args.redis_url, args) as run, AsyncEngine(engine) as front:
        paths = {"inprocess": InProcess(front), "redis": ThroughRedis(run.client, run.prefix)}
        runs = await paired_runs(paths, prompts, short, args.redis_rounds, run.run_id)
    return runs.figures("inprocess", "redis") | {"workload": workload.describe()}
