"""`python -m bench.step_profile`: where one decode step's time goes on a CPU, on the
Hugging Face forward and on the lean forward (`gpu/cpu/lean_forward.py`).

Per (dtype, batch), one JSON line: one decode-only step of `--batch` requests at `--context`
tokens (`ModelRunner.execute`), timed in turns with the step's math alone: every linear on
the step's rows (`linears`) and the backend's `attend` for every layer (`attention`); median
of `--steps`, wall and CPU ms. `beyond_math_cpu_ms`: a forward's CPU time less that math (the
host's Python, module calls, dispatch, small element-wise ops). `stubbed_cpu_ms`: both
forwards with every linear and MLP returning a fixed tensor. `operators_per_step`:
`torch.profiler`'s count for one step. Takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics

import torch
from torch import nn

from bench.drive import kv_bytes
from bench.metrics import in_turns
from gpu.attention import SequenceSlice
from gpu.cpu.lean_forward import LeanForward
from workers.config import CacheConfig, ModelConfig
from workers.model_loader import load_model
from workers.model_runner import ModelRunner
from workers.plan import ScheduledChunk, StepPlan


def decode_runner(model, max_batch: int, context: int, config: ModelConfig | None = None) -> ModelRunner:
    """A runner over `model` whose KV pool holds `max_batch` sequences of `context` tokens."""
    blocks = max_batch * (context // CacheConfig.block_size + 2) + 8
    cache = CacheConfig(kv_memory_bytes=kv_bytes(model, blocks * CacheConfig.block_size), swap_memory_bytes=0)
    return ModelRunner(model, cache, model_config=config)


def decode_plan(runner: ModelRunner, batch: int, context: int) -> StepPlan:
    blocks_each = -(-context // runner.kv_cache.block_size)
    ids = list(range(1, runner.kv_cache.num_blocks))
    random.Random(0).shuffle(ids)  # scattered, as a running engine's blocks are
    return StepPlan([
        ScheduledChunk(None, context - 1, (100 + i,), (ids[i * blocks_each:(i + 1) * blocks_each],), True, True)
        for i in range(batch)
    ])  # fmt: skip


def attention_linears(attention: nn.Module) -> list[str]:
    """The names of an attention's linears: q, k and v (fused by gpu.cpu.fusions, or not), o."""
    projections = ["qkv_proj"] if hasattr(attention, "qkv_proj") else ["q_proj", "k_proj", "v_proj"]
    return [*projections, "o_proj"]


def linears_call(model: nn.Module, rows: int, dtype: torch.dtype):
    """Every linear of the step (the LM head on `rows` too), each on inputs of `rows` rows."""
    calls = []
    for layer in model.model.layers:
        attention = layer.self_attn
        modules = [getattr(attention, name) for name in attention_linears(attention)]
        modules += [m for m in layer.mlp.children() if hasattr(m, "in_features")]
        calls.extend((m.forward, torch.randn(rows, m.in_features).to(dtype)) for m in modules)
    calls.append((model.lm_head.forward, torch.randn(rows, model.lm_head.in_features).to(dtype)))

    def run():
        for forward, x in calls:
            forward(x)

    return run


def attention_call(runner: ModelRunner, plan: StepPlan, dtype: torch.dtype):
    """The backend's `attend` for every layer, with one step's metadata."""
    shape = runner.kv_cache.shape
    rows = len(plan.chunks)
    sequences = [SequenceSlice(i, 1, c.start + 1, c.block_tables[0]) for i, c in enumerate(plan.chunks)]
    metadata = runner.backend.prepare(sequences, rows)
    query = torch.randn(rows, runner.model.config.num_attention_heads, shape.head_dim).to(dtype)
    key, value = torch.randn(2, rows, shape.num_kv_heads, shape.head_dim).to(dtype)
    scale = shape.head_dim**-0.5

    def run():
        for layer in range(shape.num_layers):
            runner.backend.attend(layer, query, key, value, scale, metadata)

    return run


class _Fixed(nn.Module):
    """Stands in for a linear or an MLP: the same output shape, no math."""

    def __init__(self, rows: int, features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.out = torch.zeros(rows, features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out.view(*x.shape[:-1], -1)


def stubbed(runner: ModelRunner, rows: int, dtype: torch.dtype, calls: dict) -> dict:
    """Median CPU ms of each of `calls` with the model's linears and MLPs stubbed out."""
    model = runner.model
    saved = []
    for layer in model.model.layers:
        attention = layer.self_attn
        for owner, name in [*((attention, p) for p in attention_linears(attention)), (layer, "mlp")]:
            module = getattr(owner, name)
            features = module.out_features if name != "mlp" else model.config.hidden_size
            saved.append((owner, name, module))
            setattr(owner, name, _Fixed(rows, features, dtype))
    saved.append((model, "lm_head", model.lm_head))
    model.lm_head = _Fixed(rows, model.config.vocab_size, dtype)
    lean = runner.lean
    runner.lean = LeanForward(model)
    try:
        for call in calls.values():
            call()
        samples = in_turns(calls, 10)
        return {name: round(statistics.median(cpu for _, cpu in runs), 3) for name, runs in samples.items()}
    finally:
        runner.lean = lean
        for owner, name, module in saved:
            setattr(owner, name, module)


def operator_count(call) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(event.count for event in prof.key_averages() if event.key.startswith(("aten::", "mkldnn::")))


def profile_step(runner: ModelRunner, batch: int, context: int, steps: int, dtype: torch.dtype) -> dict:
    plan = decode_plan(runner, batch, context)

    def hf_step():
        lean, runner.lean = runner.lean, None
        try:
            runner.execute(plan)
        finally:
            runner.lean = lean

    forwards = {"hf": hf_step, "lean": lambda: runner.execute(plan)}
    math = {"linears": linears_call(runner.model, batch, dtype), "attention": attention_call(runner, plan, dtype)}
    cases = {**forwards, **math}
    with torch.inference_mode():
        for call in cases.values():  # warm-up
            call()
            call()
        samples = in_turns(cases, steps)
        operators = {name: operator_count(forwards[name]) for name in forwards}
        without_math = stubbed(runner, batch, dtype, forwards)
    median = {name: [round(statistics.median(s[i] for s in runs), 3) for i in (0, 1)] for name, runs in samples.items()}
    math_cpu_ms = median["linears"][1] + median["attention"][1]
    return {
        "batch": batch,
        "context": context,
        "ms_wall_cpu": median,
        "math_cpu_ms": round(math_cpu_ms, 3),
        # CPU time beyond the math: a step's CPU time less the linears' and attention's
        "beyond_math_cpu_ms": {name: round(median[name][1] - math_cpu_ms, 3) for name in forwards},
        # CPU time of a step whose linears and MLPs return fixed tensors
        "stubbed_cpu_ms": without_math,
        "operators_per_step": operators,
        "layers": runner.model.config.num_hidden_layers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="", help="ModelConfig.source (default: the bundled SmolLM2-135M)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 48])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype_name in args.dtype:
        loaded = load_model(ModelConfig(source=args.source, dtype=dtype_name))
        runner = decode_runner(loaded.model, max(args.batch), args.context)
        for batch in args.batch:
            load = os.getloadavg()[0]
            figures = profile_step(runner, batch, args.context, args.steps, loaded.model.dtype)
            print(json.dumps({"dtype": dtype_name, "threads": args.threads, "backend": type(runner.backend).__name__,
                              "lean": runner.lean is not None, "load": [round(load, 1), round(os.getloadavg()[0], 1)],
                              **figures}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
