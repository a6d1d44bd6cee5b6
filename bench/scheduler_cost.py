"""`inflight bench --scenario scheduler`: what one scheduling decision costs, the scheduler
alone (no model), each decision timed between untimed simulated steps (docs/benchmarks.md,
"Scheduler scenarios")."""

from __future__ import annotations

import argparse
import time

from bench.metrics import percentile
from bench.scenario import Scenario, add_flags
from workers.api import PRIORITY_MAX, PRIORITY_MIN, SamplingParams
from workers.block_pool import BlockPool
from workers.config import SchedulerConfig
from workers.plan import StepPlan
from workers.request import Request
from workers.scheduler import Scheduler

BLOCK_SIZE, PROMPT_LEN, MAX_TOKENS = 16, 48, 10_000  # of the running requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "scheduler scenario", {
        "--scheduler-running": (256, "requests decoding"),
        "--scheduler-waiting": (1000, "requests waiting"),
        "--scheduler-decisions": (200, "decisions timed"),
    })  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    running = args.scheduler_running
    config = SchedulerConfig(
        max_running_requests=running, max_decode_tokens=running, max_batch_tokens=max(512, running)
    )
    # Room for every running request to run to its end: nothing is ever preempted.
    scheduler = Scheduler(config, BlockPool(running * -(-(PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE)), BLOCK_SIZE)
    for i in range(running):
        scheduler.add(Request(f"run-{i}", [1] * PROMPT_LEN, SamplingParams(max_tokens=MAX_TOKENS), 0.0))
    while scheduler.num_waiting or any(not r.is_decoding for r in scheduler.running):
        _advance(scheduler, scheduler.schedule())
    for i in range(args.scheduler_waiting):  # mixed priorities
        priority = PRIORITY_MIN + i % (PRIORITY_MAX - PRIORITY_MIN + 1)
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
