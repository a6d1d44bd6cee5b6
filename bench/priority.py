"""`inflight bench --scenario priority`: urgent requests against a low-priority backlog
queued at t0: each class's TTFT, the worst low-priority wait, and the aging bound at work
(docs/benchmarks.md, "Scheduler scenarios")."""

from __future__ import annotations

import argparse
import random

from bench.arrivals import ArrivalQueue, bursts
from bench.drive import Driver, bench_engine, random_prompts
from bench.metrics import percentile
from bench.scenario import D, Scenario, add_flags, with_model
from workers.api import PRIORITY_MAX, PRIORITY_MIN
from workers.config import SchedulerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "priority scenario", {
        "--priority-low": (1000, "low-priority requests queued at t0"),
        "--priority-high": (40, "high-priority requests arriving afterwards"),
        "--priority-high-every": (1.0, "seconds between high-priority arrivals (the first at that offset)"),
        "--priority-bound": (SchedulerConfig().priority_bound_s, "the scheduler's priority_bound_s" + D),
    })  # fmt: skip


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    drive = Driver(bench_engine(loaded, args, scheduler=SchedulerConfig(priority_bound_s=args.priority_bound)))
    rng = random.Random(args.seed)
    low_ids = [f"low-{i}" for i in range(args.priority_low)]
    for request_id, prompt in zip(low_ids, random_prompts(rng, len(low_ids), (8, 32), vocab_ids)):
        drive.add(request_id, prompt, output_len=rng.randint(2, 8), priority=PRIORITY_MIN)
    high_ids = [f"high-{i}" for i in range(args.priority_high)]
    high = [
        {"request_id": r, "prompt_ids": prompt, "output_len": rng.randint(2, 8), "priority": PRIORITY_MAX}
        for r, prompt in zip(high_ids, random_prompts(rng, len(high_ids), (8, 32), vocab_ids))
    ]
    every = args.priority_high_every
    drive.run_arrivals(ArrivalQueue(high, times=bursts(len(high), 1, every_s=every, first_s=every)))

    first_token = {r: drive.token_times[r][0] for r in low_ids + high_ids}
    low_ttft = [drive.first_token_s(r) for r in low_ids]
    high_ttft = [drive.first_token_s(r) for r in high_ids]
    # Aging at work: for each low request, how much later than it the latest-arriving
    # request whose first token came before its own arrived.
    overtaken_by = [
        max(
            (drive.arrivals[h] - drive.arrivals[low] for h in high_ids if first_token[h] < first_token[low]),
            default=0.0,
        )
        for low in low_ids
    ]
    return {
        "low_requests": len(low_ids),
        "high_requests": len(high_ids),
        "high_ttft_p50_s": percentile(high_ttft, 50),
        "high_ttft_p99_s": percentile(high_ttft, 99),
        "low_ttft_p50_s": percentile(low_ttft, 50),
        "low_ttft_p99_s": percentile(low_ttft, 99),
        "low_wait_max_s": max(low_ttft),
        "low_overtaken_by_max_s": max(overtaken_by),
        "priority_bound_s": args.priority_bound,
        "wall_s": drive.now(),
        "steps": drive.num_steps,
    }


SCENARIO = Scenario("priority", with_model(run), add_arguments)
