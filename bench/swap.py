"""`inflight bench --scenario swap`: preemption under a KV pool too small for the load.

One seeded workload, all arriving at once, three ways: a KV pool large enough that
nothing is preempted; a small pool whose victims swap to the host pool; the same
small pool with swapping off, so victims are recomputed. Reported: throughput of each,
blocks swapped per second, and the small pools' throughput against the large one.
"""

from __future__ import annotations

import argparse
import gc
import random

from bench.drive import Driver, StepRecorder, random_prompts
from gpu.kv_cache import KVShape
from workers.config import CacheConfig, EngineConfig, ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("swap scenario")
    group.add_argument("--swap-requests", type=int, default=24, help="requests, all arriving at t0")
    group.add_argument("--swap-prompt-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    group.add_argument("--swap-output-len", type=int, nargs=2, default=[64, 192], metavar=("MIN", "MAX"))
    group.add_argument(
        "--swap-pool-blocks",
        type=int,
        default=160,
        help="device KV blocks of the small pool (default: %(default)s, about a third of the load)",
    )


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    from workers.engine import Engine

    rng = random.Random(args.seed)
    prompts = random_prompts(rng, args.swap_requests, tuple(args.swap_prompt_len), vocab_ids)
    outputs = [rng.randint(*args.swap_output_len) for _ in prompts]
    block_size = CacheConfig().block_size
    block_bytes = KVShape.of(loaded.model.config).bytes_per_token(loaded.model.dtype) * block_size
    small = args.swap_pool_blocks * block_bytes
    settings = {
        "large_pool": CacheConfig(),
        "small_pool_swap": CacheConfig(kv_memory_bytes=small),
        "small_pool_recompute": CacheConfig(kv_memory_bytes=small, swap_memory_bytes=0),
    }
    report = {}
    for name, cache in settings.items():
        engine = Engine(loaded, EngineConfig(model=ModelConfig(dtype=args.dtype), cache=cache))
        steps_done = StepRecorder(engine)
        drive = Driver(engine)
        for i, (prompt, output_len) in enumerate(zip(prompts, outputs)):
            drive.add(f"req-{i}", prompt, output_len)
        drive.drain()
        records = list(steps_done)
        figures = drive.throughput()
        wall = figures["wall_s"]
        swapped = sum(r.num_blocks_swapped_out + r.num_blocks_swapped_in for r in records)
        report[name] = figures | {
            "kv_blocks": engine.allocator.num_blocks,
            "preemptions": sum(r.num_preempted for r in records),
            "blocks_swapped_out": sum(r.num_blocks_swapped_out for r in records),
            "blocks_swapped_in": sum(r.num_blocks_swapped_in for r in records),
            "swapped_blocks_per_s": swapped / wall,
            "swap_s": sum(r.swap_s for r in records),
            # Copy rate while swapping: K/V bytes moved over the time spent in swap copies.
            "swap_gb_per_s": swapped * block_bytes / max(sum(r.swap_s for r in records), 1e-9) / 1e9,
            "steps": len(records),
        }
        del engine, drive
        gc.collect()
    large = report["large_pool"]["output_tokens_per_s"]
    report["swap_vs_large_pool"] = report["small_pool_swap"]["output_tokens_per_s"] / large
    report["recompute_vs_large_pool"] = report["small_pool_recompute"]["output_tokens_per_s"] / large
    return report
