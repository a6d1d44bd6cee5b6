"""`inflight bench --scenario swap`: preemption under a KV pool too small for the load, one
seeded workload at t0 on a large pool, a small one that swaps its victims to the host pool
and the same small one that recomputes them (docs/benchmarks.md, "Scheduler scenarios")."""

from __future__ import annotations

import argparse
import random

from bench.drive import Driver, StepRecorder, kv_bytes, on_fresh_engines, random_prompts
from bench.scenario import Scenario, add_flags, with_model
from workers.config import CacheConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "swap scenario", {
        "--swap-requests": (24, "requests, all arriving at t0"),
        "--swap-prompt-len": ([64, 256], None),
        "--swap-output-len": ([64, 192], None),
        "--swap-pool-blocks": (
            160, "device KV blocks of the small pool (default: %(default)s, about a third of the load)"),
    })  # fmt: skip


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, args.swap_requests, tuple(args.swap_prompt_len), vocab_ids)
    outputs = [rng.randint(*args.swap_output_len) for _ in prompts]
    block_bytes = kv_bytes(loaded.model, CacheConfig().block_size)
    small = args.swap_pool_blocks * block_bytes
    configs = {
        "large_pool": {"cache": CacheConfig()},
        "small_pool_swap": {"cache": CacheConfig(kv_memory_bytes=small)},
        "small_pool_recompute": {"cache": CacheConfig(kv_memory_bytes=small, swap_memory_bytes=0)},
    }

    def measure(_, engine) -> dict:
        records = StepRecorder(engine)
        drive = Driver(engine)
        for i, (prompt, output_len) in enumerate(zip(prompts, outputs)):
            drive.add(f"req-{i}", prompt, output_len)
        drive.drain()
        figures = drive.throughput()
        swapped_out = sum(r.num_blocks_swapped_out for r in records)
        swapped_in = sum(r.num_blocks_swapped_in for r in records)
        moved, swap_s = swapped_out + swapped_in, sum(r.swap_s for r in records)
        return figures | {
            "kv_blocks": engine.allocator.num_blocks,
            "preemptions": sum(r.num_preempted for r in records),
            "blocks_swapped_out": swapped_out,
            "blocks_swapped_in": swapped_in,
            "swapped_blocks_per_s": moved / figures["wall_s"],
            "swap_s": swap_s,
            # Copy rate while swapping: K/V bytes moved over the time spent in swap copies.
            "swap_gb_per_s": moved * block_bytes / max(swap_s, 1e-9) / 1e9,
            "steps": len(records),
        }

    report = on_fresh_engines(loaded, args, configs, measure)
    large = report["large_pool"]["output_tokens_per_s"]
    report["swap_vs_large_pool"] = report["small_pool_swap"]["output_tokens_per_s"] / large
    report["recompute_vs_large_pool"] = report["small_pool_recompute"]["output_tokens_per_s"] / large
    return report


SCENARIO = Scenario("swap", with_model(run), add_arguments)
