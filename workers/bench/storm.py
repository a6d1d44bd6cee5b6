"""`inflight bench --scenario storm`: a prefill storm against running generations.

Long generations run at a steady pace; then a backlog of long prompts lands at once
(what a restart leaves behind). The figure that matters is the running generations'
inter-token latency while the backlog is being prefilled, against their steady pace,
with the prefill sub-budget on and with it off (set to the whole step budget).

Phases, for each setting:
1. the long generations are admitted; once all of them decode, `steady_steps` steps
   give the steady inter-token latencies;
2. the burst arrives; the burst window lasts until every burst request has its first
   token (its prompt is fully prefilled); the long generations' gaps whose later token
   falls in the window are the burst latencies;
3. everything left is cancelled.
"""

from __future__ import annotations

import argparse
import gc
import random

from service.config import EngineConfig, ModelConfig, SchedulerConfig
from workers.bench.drive import Driver, random_prompts
from workers.bench.metrics import inter_token_latencies, percentile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("storm scenario")
    group.add_argument("--storm-running", type=int, default=16, help="long generations running before the burst")
    group.add_argument("--storm-burst", type=int, default=64, help="requests in the burst")
    group.add_argument("--storm-prompt-len", type=int, nargs=2, default=[200, 800], metavar=("MIN", "MAX"),
                       help="burst prompt lengths")
    group.add_argument("--storm-output-len", type=int, default=16, help="burst output length")
    group.add_argument("--storm-prefill-tokens", type=int, default=SchedulerConfig().max_prefill_tokens,
                       help="max_prefill_tokens with budgets on (default: the engine's default, %(default)s)")


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    from workers.engine import Engine

    base = SchedulerConfig()
    settings = {
        "budgets_on": args.storm_prefill_tokens,
        "budgets_off": base.max_batch_tokens,  # the prefill sub-budget off: prompts may take the whole step
    }
    report = {}
    for name, max_prefill_tokens in settings.items():
        scheduler = SchedulerConfig(max_prefill_tokens=max_prefill_tokens)
        engine = Engine(loaded, EngineConfig(model=ModelConfig(dtype=args.dtype), scheduler=scheduler))
        report[name] = _run_once(engine, args, vocab_ids) | {"max_prefill_tokens": max_prefill_tokens,
                                                            "max_batch_tokens": scheduler.max_batch_tokens}
        del engine
        gc.collect()
    on, off = report["budgets_on"], report["budgets_off"]
    report["burst_p99_over_steady_p50"] = on["itl_p99_burst_s"] / on["itl_p50_steady_s"]
    report["off_p99_over_on_p99"] = off["itl_p99_burst_s"] / on["itl_p99_burst_s"]
    return report


def _run_once(engine, args: argparse.Namespace, vocab_ids: list[int], steady_steps: int = 40) -> dict:
    rng = random.Random(args.seed)
    drive = Driver(engine)
    long_ids = [f"long-{i}" for i in range(args.storm_running)]
    for request_id, prompt in zip(long_ids, random_prompts(rng, len(long_ids), (32, 96), vocab_ids)):
        drive.add(request_id, prompt, output_len=4000)
    drive.run_until(lambda: all(drive.token_times[r] for r in long_ids))
    steady_start = drive.now()
    for _ in range(steady_steps):
        drive.step()

    burst_ids = [f"burst-{i}" for i in range(args.storm_burst)]
    burst_prompts = random_prompts(rng, len(burst_ids), tuple(args.storm_prompt_len), vocab_ids)
    burst_start = drive.now()
    for request_id, prompt in zip(burst_ids, burst_prompts):
        drive.add(request_id, prompt, output_len=args.storm_output_len)
    first_burst_step = drive.num_steps
    drive.run_until(lambda: all(drive.token_times[r] for r in burst_ids))
    burst_end = drive.now()
    burst_steps = drive.num_steps - first_burst_step
    for request_id in long_ids + burst_ids:
        engine.cancel(request_id)
    drive.drain()

    def gaps(start: float, end: float) -> list[float]:
        out = []
        for request_id in long_ids:
            times = drive.token_times[request_id]
            out += [gap for gap, t in zip(inter_token_latencies(times), times[1:]) if start < t <= end]
        return out

    steady, burst = gaps(steady_start, burst_start), gaps(burst_start, burst_end)
    ttfts = [drive.first_token_s(r) for r in burst_ids]
    return {
        "itl_p50_steady_s": percentile(steady, 50),
        "itl_p99_steady_s": percentile(steady, 99),
        "itl_p50_burst_s": percentile(burst, 50),
        "itl_p99_burst_s": percentile(burst, 99),
        "itl_max_burst_s": max(burst),
        "burst_s": burst_end - burst_start,
        "burst_steps": burst_steps,
        "burst_prompt_tokens": sum(len(p) for p in burst_prompts),
        "burst_ttft_p50_s": percentile(ttfts, 50),
        "burst_ttft_p99_s": percentile(ttfts, 99),
    }
