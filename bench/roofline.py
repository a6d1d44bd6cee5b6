"""`python -m bench.roofline`: how close a decode step comes to the weight-streaming floor on a CPU.

A decode step reads every weight of the model once, whatever its batch, so no step can
take less than the weight bytes divided by the memory bandwidth: the floor. This
measures, in one process and with the same threads:

- the weight bytes one step reads: every tensor of the model's modules (int8 and int4
  weights with their scales, oneDNN's packed weights as packed), the LM head included,
  the embedding table not (a step reads one row of it per token);
- the read bandwidth, as the best of repeated `torch.sum`s over a buffer of exactly the
  weight bytes (what a step streams: on a CPU with a large L3 it may stay there) and over
  one of 2 GiB (DRAM);
- the engine's decode step at each batch (`ModelRunner.execute` of a decode-only plan at
  `--context` tokens a sequence, the lean forward where it applies), timed as
  `bench.step_profile` times it.

`fraction` = floor ÷ step time, against the weight-sized buffer's bandwidth: 1.0 is a
step that does nothing but stream its weights. The KV cache a step reads is reported
apart (`kv_bytes`, and `fraction_with_kv` against the floor of weights and KV together):
at batch 48 × 300 tokens it outweighs the weights.

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

from bench.step_profile import decode_plan, timed
from gpu.kv_cache import KVShape
from workers.config import WEIGHTS, CacheConfig, ModelConfig
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
    best_ms = min(timed(buffer.sum, 1)[0] for _ in range(repeats))
    return buffer.numel() * 4 / (best_ms / 1e3)


def measure(runner: ModelRunner, batch: int, context: int, steps: int, weight_bytes: int, bandwidth: float) -> dict:
    plan = decode_plan(runner, batch, context)
    with torch.inference_mode():
        for _ in range(3):
            runner.execute(plan)
        walls = [timed(lambda: runner.execute(plan), 1)[0] for _ in range(steps)]
    step_ms = statistics.median(walls)
    floor_ms = 1e3 * weight_bytes / bandwidth
    kv_bytes = batch * context * KVShape.of(runner.model.config).bytes_per_token(runner.model.dtype)
    with_kv_ms = 1e3 * (weight_bytes + kv_bytes) / bandwidth
    return {"batch": batch, "context": context, "step_ms": round(step_ms, 3), "floor_ms": round(floor_ms, 3),
            "fraction": round(floor_ms / step_ms, 3), "kv_bytes": kv_bytes,
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
    blocks = max(args.batch) * (args.context // CacheConfig.block_size + 2) + 8
    block_bytes = CacheConfig.block_size * KVShape.of(loaded.model.config).bytes_per_token(loaded.model.dtype)
    runner = ModelRunner(loaded.model, CacheConfig(kv_memory_bytes=blocks * block_bytes, swap_memory_bytes=0),
                         model_config=config)  # fmt: skip
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
