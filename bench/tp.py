"""`inflight bench --scenario tp`: one worker's engine on N tensor-parallel ranks against
one rank with all the cores, on ShareGPT first turns, every request at t0, bfloat16
(docs/benchmarks.md, "Tensor parallelism").

On a CPU the ranks are processes over gloo, each with its share of the cores: TP=2 on two
cores is two processes of one thread against one process of two. The model is a random-
weight shape whose heads the ranks can share (Qwen2.5-0.5B's by default: 14 heads over 2
KV heads); the prompts and output lengths are ShareGPT's, tokenized by the bench's
`--model` (ids folded into the model's vocabulary, for a smaller one), so the work is
real text's. Rank 0 times its all-reduces (two a layer a step),
waiting for the other ranks included: their share of the forward time is what tensor
parallelism costs here.
"""

from __future__ import annotations

import argparse
import gc
import os

from bench.scenario import Scenario, add_flags, comma_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "tp scenario", {
        "--tp-model": ("random:qwen2.5-0.5b-shape", "the model the ranks share (its heads must divide among them)"),
        "--tp-ranks": ("1,2", "the rank counts compared, comma-separated (1 is the baseline)"),
        "--tp-requests": (64, "ShareGPT first turns, all arriving at t0"),
        "--tp-max-output": (256, "cap on a request's output length (its reply's length)"),
        "--tp-kv-mb": (512, "KV pool in MiB, all ranks together"),
    })  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    from bench.sharegpt import make_sharegpt_workload
    from workers.config import ModelConfig
    from workers.model_loader import load_model

    tokenizer = load_model(ModelConfig(source=args.model)).tokenizer
    workload = make_sharegpt_workload(tokenizer, args.tp_requests, args.tp_max_output, args.seed)
    cores = len(os.sched_getaffinity(0))
    report: dict = {
        "model": args.tp_model,
        "requests": len(workload.requests),
        "prompt_tokens": sum(len(r.prompt_ids) for r in workload.requests),
        "cores": cores,
    }
    for ranks in comma_list(args.tp_ranks, "--tp-ranks", cast=int):
        report[f"tp{ranks}"] = _measure(args, workload, ranks, max(1, cores // ranks))
        gc.collect()
    base = report.get("tp1", {}).get("output_tokens_per_s")
    for key, figures in report.items():
        if key.startswith("tp") and key != "tp1" and base:
            figures["throughput_vs_tp1"] = figures["output_tokens_per_s"] / base
    return report


def _measure(args: argparse.Namespace, workload, ranks: int, threads: int) -> dict:
    from bench.drive import Driver, StepRecorder
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.engine import Engine
    from workers.model_loader import load_model

    model = ModelConfig(source=args.tp_model, dtype="bfloat16", threads=threads, tensor_parallel=ranks)
    cache = CacheConfig(kv_memory_bytes=(args.tp_kv_mb << 20) // ranks, swap_memory_bytes=0)
    loaded = load_model(model)
    vocab = loaded.model.config.vocab_size
    engine = Engine(loaded, EngineConfig(model=model, cache=cache))
    leader = engine.runner.leader
    try:
        warm_up = Driver(engine)  # the first steps pack weights and build kernels: not timed
        warm_up.add("warm-up", [t % vocab for t in workload.requests[0].prompt_ids], 4)
        warm_up.drain()
        if leader is not None:
            leader.all_reduces = leader.all_reduce_bytes = 0
            leader.all_reduce_s = 0.0
        steps = StepRecorder(engine)
        driver = Driver(engine)
        for request in workload.requests:
            driver.add(request.request_id, [t % vocab for t in request.prompt_ids], request.output_len)
        driver.drain()
        records = list(steps)
        figures = driver.throughput() | {
            "ranks": ranks,
            "threads_per_rank": threads,
            "steps": len(records),
            "tokens_run": sum(record.num_tokens for record in records),  # prompt, decode and draft tokens
        }
        forward_s = sum(record.forward_s for record in records)
        figures["forward_s"] = forward_s
        if leader is not None:
            figures |= {
                "all_reduces": leader.all_reduces,
                "all_reduce_mb": leader.all_reduce_bytes / 2**20,
                "all_reduce_s": leader.all_reduce_s,
                "all_reduce_ms_per_step": 1000 * leader.all_reduce_s / max(1, len(records)),
                "all_reduce_share_of_forward": leader.all_reduce_s / forward_s if forward_s else 0.0,
            }
        return figures
    finally:
        if leader is not None:
            leader.stop()


def chart_panels(figures: dict) -> list[tuple]:
    runs = {key: value for key, value in figures.items() if key.startswith("tp")}
    return [
        ("output tokens/s", {key: run["output_tokens_per_s"] for key, run in runs.items()}, "{:.0f}"),
        ("all-reduce share of the forward",
         {key: run.get("all_reduce_share_of_forward", 0.0) for key, run in runs.items()}, "{:.0%}"),
    ]  # fmt: skip


SCENARIO = Scenario("tp", run, add_arguments, chart_panels)
