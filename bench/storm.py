"""`inflight bench --scenario storm`: a backlog of long prompts lands at once on long
generations decoding at a steady pace, with the prefill sub-budget on (`budgets_on`) and off
(`budgets_off`: the whole step budget), on the same seeded requests. The burst window lasts
until every burst request has its first token; `steady` is the long generations alone through
the same output positions as `budgets_on`'s window, since a decode step costs more as contexts
grow (docs/benchmarks.md, "Scheduler scenarios")."""

from __future__ import annotations

import argparse
import gc
import random

from bench.drive import Driver, bench_engine, random_prompts
from bench.metrics import inter_token_latencies, percentile
from bench.scenario import Scenario, add_flags, with_model
from workers.config import SchedulerConfig, SpeculativeConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "storm scenario", {
        "--storm-running": (16, "long generations running before the burst"),
        "--storm-burst": (32, "requests in the burst"),
        "--storm-prompt-len": ([200, 800], "burst prompt lengths"),
        "--storm-output-len": (16, "burst output length"),
        "--storm-prefill-tokens": (
            16, "max_prefill_tokens with budgets on (default: %(default)s, a latency-first setting)"),
        "--storm-steady-steps": (40, "steps the generations decode alone before the burst (default: %(default)s)"),
    })  # fmt: skip


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    base = SchedulerConfig()
    settings = {
        "budgets_on": args.storm_prefill_tokens,
        "budgets_off": base.max_batch_tokens,  # the prefill sub-budget off: prompts may take the whole step
    }
    report = {}
    for name, max_prefill_tokens in settings.items():
        drive, steady_start = _start(loaded, args, vocab_ids, max_prefill_tokens)
        limits = {"max_prefill_tokens": max_prefill_tokens, "max_batch_tokens": base.max_batch_tokens}
        report[name] = _burst(drive, steady_start, args, vocab_ids) | limits
        del drive
        gc.collect()

    # The steady pace at the positions budgets_on's burst window covered.
    window = report["budgets_on"].pop("positions")
    report["budgets_off"].pop("positions")
    drive, _ = _start(loaded, args, vocab_ids, args.storm_prefill_tokens)
    drive.run_until(lambda: all(len(drive.token_times[r]) > last for r, (_, last) in window.items()))
    gaps = {r: inter_token_latencies(drive.token_times[r]) for r in window}
    steady = [gap for r, (first, last) in window.items() for gap in gaps[r][first - 1 : last]]
    _cancel_all(drive)
    report["steady"] = {"itl_p50_s": percentile(steady, 50), "itl_p99_s": percentile(steady, 99)}
    for name in settings:
        report[name]["itl_p50_steady_s"] = report["steady"]["itl_p50_s"]
    on, off = report["budgets_on"], report["budgets_off"]
    report["burst_p99_over_steady_p50"] = on["itl_p99_burst_s"] / on["itl_p50_steady_s"]
    report["off_p99_over_on_p99"] = off["itl_p99_burst_s"] / on["itl_p99_burst_s"]
    return report


def _start(loaded, args: argparse.Namespace, vocab_ids: list[int], max_prefill_tokens: int) -> tuple[Driver, float]:
    """An engine with the long generations decoding for `--storm-steady-steps` steps, and when those began."""
    # Without speculation: the scenario measures what prompt budgets do to the decodes'
    # pace, and tokens accepted together would share one time.
    scheduler = SchedulerConfig(max_prefill_tokens=max_prefill_tokens)
    drive = Driver(bench_engine(loaded, args, scheduler=scheduler, speculative=SpeculativeConfig(enabled=False)))
    rng = random.Random(args.seed)
    for i, prompt in enumerate(random_prompts(rng, args.storm_running, (32, 96), vocab_ids)):
        drive.add(f"long-{i}", prompt, output_len=4000)
    drive.run_until(lambda: all(drive.token_times.values()))
    steady_start = drive.now()
    for _ in range(args.storm_steady_steps):
        drive.step()
    return drive, steady_start


def _burst(drive: Driver, steady_start: float, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    long_ids = list(drive.token_times)
    rng = random.Random(args.seed + 1)
    burst_ids = [f"burst-{i}" for i in range(args.storm_burst)]
    burst_prompts = random_prompts(rng, len(burst_ids), tuple(args.storm_prompt_len), vocab_ids)
    burst_start = drive.now()
    for request_id, prompt in zip(burst_ids, burst_prompts):
        drive.add(request_id, prompt, output_len=args.storm_output_len)
    first_burst_step = drive.num_steps
    drive.run_until(lambda: all(drive.token_times[r] for r in burst_ids))
    burst_end = drive.now()
    burst_steps = drive.num_steps - first_burst_step
    _cancel_all(drive)

    # The long generations' gaps by where their later token falls: before the burst, in its window.
    before, burst, positions = [], [], {}
    for request_id in long_ids:
        times = drive.token_times[request_id]
        for index, (gap, t) in enumerate(zip(inter_token_latencies(times), times[1:]), start=1):
            if steady_start < t <= burst_start:
                before.append(gap)
            elif burst_start < t <= burst_end:
                burst.append(gap)
                first, _ = positions.get(request_id, (index, index))
                positions[request_id] = (first, index)  # token indexes whose gaps fall in the window
    ttfts = [drive.first_token_s(r) for r in burst_ids]
    return {
        "itl_p50_before_burst_s": percentile(before, 50),
        "itl_p50_burst_s": percentile(burst, 50),
        "itl_p99_burst_s": percentile(burst, 99),
        "itl_max_burst_s": max(burst),
        "burst_s": burst_end - burst_start,
        "burst_steps": burst_steps,
        "burst_prompt_tokens": sum(len(p) for p in burst_prompts),
        "burst_ttft_p50_s": percentile(ttfts, 50),
        "burst_ttft_p99_s": percentile(ttfts, 99),
        "positions": positions,
    }


def _cancel_all(drive: Driver) -> None:
    for request_id in drive.token_times:
        drive.engine.cancel(request_id)
    drive.drain()


SCENARIO = Scenario("storm", with_model(run), add_arguments)
