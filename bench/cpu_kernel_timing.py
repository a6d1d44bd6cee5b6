"""`python -m bench.cpu_kernel_timing`: the CPU fast paths timed against what they replace,
in float32 and bfloat16, at SmolLM2-135M's shapes, in one process.

Each case is timed in turns with the others (the median of `--repeats` rounds), so a
machine shared with other work disturbs them alike and the ratios hold. Decode attention
is one layer's step over 48 (or 1) decodes with the cache write; prompt attention one
layer's step over one fresh prompt of 128, 512 or 861 tokens (also given per 30 layers,
the whole model's); the fused operations and linears run on the rows of a 48-decode (or
1-decode) step. `--only` times just the cases whose names contain it (e.g. "prompt").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch
from torch import nn

from bench.metrics import in_turns
from gpu.attention import SequenceSlice
from gpu.cpu.attention import CpuAttentionBackend, cpu_kernel, cpu_prompt_kernel
from gpu.cpu.fusions import FusedRMSNorm, fused_ops
from gpu.cpu.packed_linear import PackedLinear
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.torch_attention import TorchAttentionBackend

# SmolLM2-135M: hidden 576, MLP 1536, 9 query heads over 3 KV heads of 64, 30 layers.
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 576, 1536, 9, 3, 64, 16, 30


def attention_cases(dtype: torch.dtype, decodes: int, context: int) -> dict:
    """One layer's decode step on the C++ kernel and on the torch reference."""
    blocks_each = -(-context // BLOCK)
    ids = list(range(decodes * blocks_each + 8))
    random.Random(0).shuffle(ids)  # scattered, as a running engine's blocks are
    sequences = [SequenceSlice(i, 1, context, ids[i * blocks_each : (i + 1) * blocks_each]) for i in range(decodes)]
    query = torch.randn(decodes, HEADS, HEAD_DIM).to(dtype)
    return _backend_cases(dtype, len(ids), sequences, query)


def prompt_cases(dtype: torch.dtype, tokens: int) -> dict:
    """One layer's step over one fresh prompt: the C++ prompt kernel and torch's SDPA."""
    blocks = -(-tokens // BLOCK)
    sequences = [SequenceSlice(0, tokens, tokens, list(range(blocks)))]
    # A transposed view, as transformers hands the queries over.
    query = torch.randn(1, HEADS, tokens, HEAD_DIM).to(dtype)[0].transpose(0, 1)
    return _backend_cases(dtype, blocks, sequences, query)


def _backend_cases(dtype: torch.dtype, num_blocks: int, sequences: list[SequenceSlice], query: torch.Tensor) -> dict:
    """One layer's `attend` on each backend, over a cache of random K/V, for `query`'s rows."""
    rows = query.shape[0]
    key, value = torch.randn(2, rows, KV_HEADS, HEAD_DIM).to(dtype)
    shape = KVShape(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    cases = {}
    for name, backend_class in (("kernel", CpuAttentionBackend), ("torch", TorchAttentionBackend)):
        cache = PagedKVCache(shape, num_blocks, BLOCK, dtype)
        cache.blocks.copy_(torch.randn(cache.blocks.shape))
        backend = backend_class(cache)
        metadata = backend.prepare(sequences, rows)
        cases[name] = lambda b=backend, m=metadata: b.attend(0, query, key, value, HEAD_DIM**-0.5, m)
    return cases


def fused_cases(dtype: torch.dtype, rows: int) -> dict:
    """RMSNorm and SiLU-times-up in one C++ pass, and as torch computes them (the fallback)."""
    norm = type("Norm", (), {"weight": torch.randn(HIDDEN).to(dtype), "variance_epsilon": 1e-5})()
    fused_norm = FusedRMSNorm(norm)
    x = torch.randn(1, rows, HIDDEN).to(dtype)
    gate_up = torch.randn(1, rows, 2 * INTERMEDIATE).to(dtype)
    ops = fused_ops()

    def torch_silu_mul():
        gate, up = gate_up.split(INTERMEDIATE, dim=-1)
        return nn.functional.silu(gate) * up

    def kernel_silu_mul():
        out = gate_up.new_empty((1, rows, INTERMEDIATE))
        suffix = "_bf16" if dtype == torch.bfloat16 else ""
        getattr(ops, "silu_mul" + suffix)(gate_up.data_ptr(), 2 * INTERMEDIATE, out.data_ptr(), rows, INTERMEDIATE,
                                          torch.get_num_threads())  # fmt: skip
        return out

    return {"rms_norm kernel": lambda: fused_norm(x), "rms_norm torch": lambda: fused_norm._torch(x),
            "silu_mul kernel": kernel_silu_mul, "silu_mul torch": torch_silu_mul}  # fmt: skip


def linear_cases(dtype: torch.dtype, rows: int) -> dict:
    """The gate-and-up projection (576 -> 3072), oneDNN with the weight packed once."""
    linear = PackedLinear(nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False).to(dtype))
    x = torch.randn(rows, HIDDEN).to(dtype)
    return {"gate_up linear": lambda: linear(x)}


def time_cases(cases: dict, repeats: int, calls: int) -> dict[str, float]:
    """Median microseconds per call of each case, the cases timed in turns."""
    for fn in cases.values():
        fn()  # warm: first-call costs are not measured

    def repeated(fn):
        return lambda: [fn() for _ in range(calls)]

    samples = in_turns({name: repeated(fn) for name, fn in cases.items()}, repeats)
    return {name: statistics.median(wall for wall, _ in runs) * 1e3 / calls for name, runs in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); on a loaded machine 1 keeps OpenMP "
        "barriers from waiting on descheduled threads",
    )
    parser.add_argument("--only", default="", help="time only the cases whose names contain this")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if cpu_kernel() is None or cpu_prompt_kernel() is None or fused_ops() is None:
        raise SystemExit("the CPU kernels cannot be built here (g++)")
    cases = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            tag = str(dtype).removeprefix("torch.")
            for decodes, context in ((48, 300), (1, 356)):
                for name, fn in attention_cases(dtype, decodes, context).items():
                    cases[f"{tag} attention {decodes}x{context} {name}"] = fn
            for tokens in (128, 512, 861):
                for name, fn in prompt_cases(dtype, tokens).items():
                    cases[f"{tag} prompt attention {tokens} {name}"] = fn
            for rows in (48, 1):
                for name, fn in (fused_cases(dtype, rows) | linear_cases(dtype, rows)).items():
                    cases[f"{tag} {name} rows={rows}"] = fn
        cases = {name: fn for name, fn in cases.items() if args.only in name}
        timings = time_cases(cases, args.repeats, args.calls)
    microseconds = {name: round(us, 1) for name, us in timings.items()}
    # A prompt's attention in every layer of the model, its share of time to first token.
    per_model = {name: round(us * LAYERS / 1000, 1) for name, us in timings.items() if "prompt" in name}
    report = {"threads": torch.get_num_threads(), "microseconds_per_call": microseconds}
    if per_model:
        report[f"prompt_attention_ms_per_{LAYERS}_layers"] = per_model
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
