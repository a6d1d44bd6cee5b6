"""Decode step time on a GPU with and without CUDA graphs: one runner over a random-weight
model, one decode-only step of --batch requests at --context tokens each, timed as the
engine runs it (the host's preparation, the launches or the replay, and the GPU's work,
up to a synchronize).

    python ops/decode_step_time.py [--model smollm2-135m --batch 64 --context 512 --dtype bfloat16]

Prints one JSON line. Takes a few seconds (not part of ops/gpu-check.sh).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.kv_cache import KVShape  # noqa: E402
from workers.config import CacheConfig, ModelConfig  # noqa: E402
from workers.model_loader import load_model  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.plan import ScheduledChunk, StepPlan  # noqa: E402


def seconds_per_step(runner: ModelRunner, plan: StepPlan, iterations: int) -> float:
    for _ in range(3):  # the first one captures the graph
        runner.execute(plan)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iterations):
        runner.execute(plan)
        torch.cuda.synchronize()  # as the sampler's read of the tokens does every step
    return (time.perf_counter() - started) / iterations


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m", help="a random-weight model (workers/random_models.py)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_step_time: needs a CUDA GPU", file=sys.stderr)
        return 1

    model_config = ModelConfig(source=f"random:{args.model}", dtype=args.dtype, device="cuda",
                               max_graph_batch=max(args.batch, ModelConfig.max_graph_batch))  # fmt: skip
    loaded = load_model(model_config)
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq + 1
    block_bytes = args.block_size * KVShape.of(loaded.model.config).bytes_per_token(loaded.model.dtype)
    cache = CacheConfig(block_size=args.block_size, kv_memory_bytes=num_blocks * block_bytes, swap_memory_bytes=0)
    runner = ModelRunner(loaded.model, cache, model_config=model_config)
    if runner.graphs is None:
        print("decode_step_time: no CUDA graphs (the CUDA kernels do not cover this model)", file=sys.stderr)
        return 1

    ids = list(range(1, num_blocks))
    random.Random(0).shuffle(ids)  # scattered blocks, as a long-running server has them
    plan = StepPlan([
        ScheduledChunk(
            None, args.context - 1, (100 + i,), (ids[i * blocks_per_seq:(i + 1) * blocks_per_seq],), True, True
        )
        for i in range(args.batch)
    ])  # fmt: skip
    graphs_s = seconds_per_step(runner, plan, args.iterations)
    graphs, runner.graphs = runner.graphs, None
    eager_s = seconds_per_step(runner, plan, args.iterations)
    report = {
        "device": torch.cuda.get_device_name(),
        "shape": vars(args),
        "graphs_ms": round(graphs_s * 1e3, 3),
        "eager_ms": round(eager_s * 1e3, 3),
        "speedup": round(eager_s / graphs_s, 2),
        "graphs_captured": graphs.captured,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
