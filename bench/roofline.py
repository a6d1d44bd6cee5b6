"""`python -m bench.roofline`: how close a decode step comes to the weight-streaming floor on a CPU.

A decode step reads every weight once, whatever its batch: no step takes less than the
weight bytes over the memory bandwidth, the floor. Measured in one process, same threads:
`weight_bytes`, every tensor of the model's modules as stored (int8 and int4 with their
scales, oneDNN's packed weights as packed), the LM head included, the embedding table not;
`read_gbs`, the best of repeated `torch.sum`s over a buffer of exactly the weight bytes
(a large L3 may hold it), and `dram_read_gbs` over 2 GiB; `step_ms`, the engine's decode
step at each batch at `--context` tokens (`ModelRunner.execute`, as `bench.step_profile`
times it). `fraction` = floor / step time (1.0: a step that only streams its weights);
`kv_bytes`, the KV cache a step reads, and `fraction_with_kv` against weights and KV.

    python -m bench.roofline [--dtype bfloat16] [--weights dense] [--batch 1 48] [--threads 2]

Prints one JSON line per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from torch import nn

from bench.drive import kv_bytes
from bench.metrics import timed
from bench.step_profile import decode_plan, decode_runner
from workers.config import WEIGHTS, ModelConfig
from workers.model_loader import load_model
from workers.model_runner import ModelRunner

DRAM_BUFFER_BYTES = 2 << 30


def streamed_weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor held by the model's modules but its embeddings, each storage once."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                   *(value for value in vars(module).values() if isinstance(value, torch.Tensor))]  # fmt: skip
        for tensor in tensors:
            if tensor.is_mkldnn:  # oneDNN's packed weights are opaque: no storage to share
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
            else:
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def read_bandwidth(nbytes: int, repeats: int = 20) -> float:
    """Bytes a second of the best of `repeats` sums over a float32 buffer of `nbytes`."""
    buffer = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    buffer.sum()  # pages touched, caches warm as a step's weights are
    best_ms = min(timed(buffer.sum)[0] for _ in range(repeats))
    return buffer.numel() * 4 / (best_ms / 1e3)


def measure(runner: ModelRunner, batch: int, context: int, steps: int, weight_bytes: int, bandwidth: float) -> dict:
    plan = decode_plan(runner, batch, context)
    with torch.inference_mode():
        for _ in range(3):
            runner.execute(plan)
        walls = [timed(lambda: runner.execute(plan))[0] for _ in range(steps)]
    step_ms = statistics.median(walls)
    floor_ms = 1e3 * weight_bytes / bandwidth
    kv_read = kv_bytes(runner.model, batch * context)
    with_kv_ms = 1e3 * (weight_bytes + kv_read) / bandwidth
    return {"batch": batch, "context": context, "step_ms": round(step_ms, 3), "floor_ms": round(floor_ms, 3),
            "fraction": round(floor_ms / step_ms, 3), "kv_bytes": kv_read,
            "floor_with_kv_ms": round(with_kv_ms, 3), "fraction_with_kv": round(with_kv_ms / step_ms, 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="", help="ModelConfig.source (default: the bundled SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", default="dense", choices=WEIGHTS)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 48])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig(source=args.source, dtype=args.dtype, weights=args.weights)
    loaded = load_model(config)
    runner = decode_runner(loaded.model, max(args.batch), args.context, config)
    weight_bytes = streamed_weight_bytes(runner.model)
    bandwidth = read_bandwidth(weight_bytes)
    dram = read_bandwidth(DRAM_BUFFER_BYTES, repeats=5)
    for batch in args.batch:
        load = os.getloadavg()[0]
        figures = measure(runner, batch, args.context, args.steps, weight_bytes, bandwidth)
        print(json.dumps({"dtype": args.dtype, "weights": args.weights, "threads": args.threads,
                          "weight_bytes": weight_bytes, "read_gbs": round(bandwidth / 1e9, 2),
                          "dram_read_gbs": round(dram / 1e9, 2), **figures,
                          "load": [round(load, 1), round(os.getloadavg()[0], 1)]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
