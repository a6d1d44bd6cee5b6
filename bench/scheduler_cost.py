"""`inflight bench --scenario scheduler`: what one scheduling decision costs.

The scheduler alone, no model: 256 requests decoding and 1,000 waiting (mixed
priorities), a KV pool large enough for all of them. Each decision is timed; between
decisions, an untimed simulated step samples a token for every chunk that samples and
hands it to the scheduler, as the engine does. Reported: the median and p99 decision time.
"""

from __future__ import annotations

import argparse
import time

from bench.metrics import percentile
from bench.scenario import Scenario
from workers.api import PRIORITY_MAX, PRIORITY_MIN, SamplingParams
from workers.block_pool import BlockPool
from workers.config import SchedulerConfig
from workers.plan import StepPlan
from workers.request import Request
from workers.scheduler import Scheduler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler scenario")
    group.add_argument("--scheduler-running", type=int, default=256, help="requests decoding")
    group.add_argument("--scheduler-waiting", type=int, default=1000, help="requests waiting")
    group.add_argument("--scheduler-decisions", type=int, default=200, help="decisions timed")


def run(args: argparse.Namespace) -> dict:
    block_size = 16
    running, waiting = args.scheduler_running, args.scheduler_waiting
    config = SchedulerConfig(
        max_running_requests=running, max_decode_tokens=running, max_batch_tokens=max(512, running)
    )
    prompt_len, max_tokens = 48, 10_000
    # Room for every running request to run to its end: nothing is ever preempted.
    num_blocks = running * -(-(prompt_len + max_tokens) // block_size)
    scheduler = Scheduler(config, BlockPool(num_blocks), block_size)
    span = PRIORITY_MAX - PRIORITY_MIN + 1
    for i in range(running):
        scheduler.add(Request(f"run-{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0.0))
    while scheduler.num_waiting or any(not r.is_decoding for r in scheduler.running):
        _advance(scheduler, scheduler.schedule())
    for i in range(waiting):
        priority = PRIORITY_MIN + i % span
        scheduler.add(Request(f"wait-{i}", [1] * 32, SamplingParams(max_tokens=16), 1.0 + i * 1e-3, priority))

    times = []
    for _ in range(args.scheduler_decisions):
        started = time.perf_counter()
        plan = scheduler.schedule()
        times.append(time.perf_counter() - started)
        assert plan.num_decode_tokens == running, "every running request decodes"
        _advance(scheduler, plan)
    return {
        "running": running,
        "waiting": scheduler.num_waiting,
        "decision_p50_ms": percentile(times, 50) * 1000,
        "decision_p99_ms": percentile(times, 99) * 1000,
        "decisions": len(times),
    }


def _advance(scheduler: Scheduler, plan: StepPlan) -> None:
    """What the engine does after the forward: a token for every chunk that samples."""
    scheduler.update_from_output(plan, [7 for chunk in plan.chunks if chunk.samples])


SCENARIO = Scenario("scheduler", run, add_arguments)
