"""Our engine on the workload, and the ceiling yardstick that replays its step schedule."""

from __future__ import annotations

import random
import time

import torch

from bench.drive import Driver, StepRecorder
from bench.workload import Workload


def run_engine(loaded, workload: Workload, config) -> dict:
    """Every request is added at t0, then `step()` runs until none is left.

    A token's time is when the `step()` that produced it returns (its event comes out),
    taken with `time.perf_counter()` here, as a caller of the engine would see it.
    """
    from workers.engine import Engine  # here, so the peers run even where the engine cannot import

    engine = Engine(loaded, config)
    steps_done = StepRecorder(engine)
    warmup = workload.requests[0]
    _drain(engine, {"warmup": (warmup.prompt_ids[:8], 2)}, time.perf_counter())
    steps_done.clear()  # the schedule and overhead cover the measured run only

    t0 = time.perf_counter()
    token_times = _drain(engine, {r.request_id: (r.prompt_ids, r.output_len) for r in workload.requests}, t0)
    workload.check_lengths("engine", token_times)

    steps = [{"num_tokens": s.num_tokens, "forward_s": s.forward_s, "step_s": s.step_s} for s in steps_done]
    forward_s = sum(s["forward_s"] for s in steps)
    step_s = sum(s["step_s"] for s in steps)
    return {
        "token_times": token_times,
        "steps": steps,
        "forward_s": forward_s,
        "step_s": step_s,
        # Share of the engine's step time spent outside the model forward (scheduling, input
        # packing, sampling, detokenizing, bookkeeping).
        "overhead_fraction": 1 - forward_s / step_s,
        "scheduler": vars(config.scheduler),
        "kv_memory_bytes": config.cache.kv_memory_bytes,
    }


def _drain(engine, requests: dict[str, tuple[list[int], int]], t0: float) -> dict[str, list[float]]:
    """Add `{id: (prompt, output_len)}` and step until done: each request's token times after t0."""
    drive = Driver(engine, t0=t0)
    for request_id, (prompt_ids, output_len) in requests.items():
        drive.add(request_id, prompt_ids, output_len)
    drive.drain()
    return {request_id: drive.token_times[request_id] for request_id in requests}


@torch.inference_mode()
def run_ceiling(model, step_tokens: list[int], seed: int = 0) -> dict:
    """Bare model forwards over the engine's token schedule: the yardstick for `ceiling_fraction`.

    For every engine step that ran T tokens, time one plain transformers forward
    (eager attention, no KV cache, logits for every position) on a [1, T] input of random
    ids. `ceiling_fraction = sum(these forward times) / engine wall time` (t0 to last token).
    It is what the engine's schedule would cost if a step were nothing but a plain forward
    of that many tokens. The yardstick is not a strict bound either way: it computes logits
    for all T positions (the engine only where a token is sampled, so the engine can beat
    it, ratio > 1), but its T tokens attend only to each other, never to a cached context,
    so it undercharges decode steps whose requests carry hundreds of tokens of context.
    """
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    model(input_ids=torch.tensor([[rng.randrange(vocab) for _ in range(16)]]), use_cache=False)  # warmup
    times = []
    for num_tokens in step_tokens:
        input_ids = torch.tensor([[rng.randrange(vocab) for _ in range(num_tokens)]])
        started = time.perf_counter()
        model(input_ids=input_ids, use_cache=False)
        times.append(time.perf_counter() - started)
    return {"forward_s": sum(times), "steps": len(times), "attn_implementation": model.config._attn_implementation}
