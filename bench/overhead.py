"""`inflight bench --scenario overhead`: the host's time per step, with no model math
(docs/benchmarks.md, "Host overhead per step"): the real engine behind a stub forward over a
one-layer copy of the bundled model, whose 256 logit columns stand for the most frequent tokens
of a fixed text (`bench/overhead_text.py`), so the detokenizers see text as a model writes it.

Per step, after a warm-up that fills the batch: `total` (wall) and `total_cpu` (the stepping
thread's CPU time, which other processes do not stretch) from steps run as they are; then,
from as many steps with each phase timed by a wrapper (its cost lands in the phases, not the
totals), `timed_total` and
- scheduling: `Scheduler.schedule`, `update_from_output` and the deadline sweep;
- metadata: the runner's batch (token ids, positions, slices) and the backend's `prepare`;
- sampling: `Sampler.sample`;
- detokenization: the detokenizers' `push`;
- events: the token and final events, and the per-token latency bookkeeping;
- other: the rest of `Engine.step` (the inbox, the step record, the stats for metrics).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import time
from collections import Counter, defaultdict
from types import SimpleNamespace

import torch

from bench.drive import bench_engine, kv_bytes
from bench.metrics import percentile
from bench.overhead_text import TEXT
from bench.scenario import Scenario, add_flags, comma_list, with_model
from workers.api import FinalEvent, GenerationRequest, SamplingParams, TokenEvent
from workers.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from workers.detokenizer import IncrementalDetokenizer

STUB_VOCAB = 256
PHASES = ("scheduling", "metadata", "sampling", "detokenization", "events", "other")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "overhead scenario", {
        "--overhead-sizes": ("64,256,1024", "decoding requests, comma-separated"),
        "--overhead-steps": (200, "steps measured at each size"),
        "--overhead-prompt-len": ([256, 768], None),
        "--overhead-output-len": ([128, 512], None),
    })  # fmt: skip


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    sizes = comma_list(args.overhead_sizes, "--overhead-sizes", cast=int)
    one_layer = dataclasses.replace(loaded, model=_one_layer_copy(loaded.model))
    results = {str(size): measure(one_layer, args, vocab_ids, size) for size in sizes}
    for size, figures in results.items():
        per_step = figures["per_step_ms"]
        print(
            f"overhead: {size:>5} decoding, {per_step['total']['p50']:.2f} ms a step (p50; CPU "
            f"{per_step['total_cpu']['p50']:.2f}), "
            + ", ".join(f"{phase} {per_step[phase]['mean']:.2f}" for phase in PHASES)
        )
    return {"sizes": results}


def measure(loaded, args: argparse.Namespace, vocab_ids: list[int], size: int) -> dict:
    from gpu.cuda.attention import CupyAttentionBackend

    prompt_range, output_range = args.overhead_prompt_len, args.overhead_output_len
    longest = prompt_range[1] + output_range[1]
    scheduler = SchedulerConfig(
        max_running_requests=size, max_decode_tokens=size, max_batch_tokens=size + 128, max_prefill_tokens=128
    )
    engine = bench_engine(
        loaded,
        args,
        cache=CacheConfig(kv_memory_bytes=kv_bytes(loaded.model, (size + 8) * longest), swap_memory_bytes=0),
        scheduler=scheduler,
        speculative=SpeculativeConfig(enabled=False),  # the stub forward gives one row of logits per request
    )
    runner = engine.runner
    runner.backend = CupyAttentionBackend(runner.kv_cache, kernels=NoLaunches())  # for its `prepare` alone
    stub = StubForward(size + 8, args.seed)
    runner.model = stub
    # Every request is greedy: the sampler's argmax picks each column, read as the text token it stands for.
    argmax, text_tokens = engine.sampler.argmax, common_token_ids(loaded.tokenizer)
    engine.sampler.argmax = lambda logits: [text_tokens[column] for column in argmax(logits)]

    rng = random.Random(args.seed)
    made = 0

    def submit() -> None:
        nonlocal made
        prompt = [rng.choice(vocab_ids) for _ in range(rng.randint(*prompt_range))]
        params = SamplingParams(max_tokens=rng.randint(*output_range), temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{made}", prompt, params))
        made += 1

    for _ in range(size + 4):  # a few waiting beyond the batch: arrivals keep prefills coming
        submit()
    # Warm-up: fill the batch, with a prefill budget that does it in a few steps.
    engine.scheduler.config = dataclasses.replace(
        scheduler, max_prefill_tokens=64 * 1024, max_batch_tokens=64 * 1024, max_prefill_chunk=1024
    )
    while len(engine.scheduler.running) < size:
        for _ in _finals(engine.step()):
            submit()
    engine.scheduler.config = scheduler

    # One torch thread: the stub leaves no math to spread, and a second thread only adds
    # its wake-ups to every small tensor op.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as the worker does once it serves
    clock = PhaseClock()
    try:
        # First the steps as they run, then the same number again with each phase timed:
        # the timing wrappers cost a little per call, which the totals should not carry.
        totals, tokens = _run_steps(engine, stub, args.overhead_steps, submit)
        clock.wrap(engine.scheduler, "schedule", "scheduling")
        clock.wrap(engine.scheduler, "update_from_output", "scheduling")
        clock.wrap(engine.scheduler, "expired", "scheduling")
        clock.wrap(runner, "execute", "execute")
        clock.wrap(engine.sampler, "sample", "sampling")
        clock.wrap(engine.sampler, "argmax", "sampling")
        clock.wrap(engine.outputs, "token_events", "token_events")
        clock.wrap(IncrementalDetokenizer, "push", "detokenization")
        steps, _ = _run_steps(engine, stub, args.overhead_steps, submit, clock)
    finally:
        gc.unfreeze()
        clock.restore()
        torch.set_num_threads(threads)
    for phases in steps:
        phases["metadata"] = phases.pop("execute", 0.0) - phases["forward"]
        phases["events"] = phases.pop("token_events", 0.0) - phases.get("detokenization", 0.0)
        phases["other"] = phases["timed_total"] - sum(phases.get(p, 0.0) for p in PHASES if p != "other")
    per_step = {phase: _ms([s.get(phase, 0.0) for s in steps]) for phase in (*PHASES, "timed_total")}
    per_step |= {phase: _ms([s[phase] for s in totals]) for phase in ("total", "total_cpu")}
    # Tokens each step made: the decodes, and the prompts that finished their prefill.
    return {
        "decoding_requests": size,
        "steps": len(totals),
        "tokens_per_step": sum(tokens) / len(tokens),
        "per_step_ms": per_step,
    }


def _run_steps(engine, stub, count: int, submit, clock: PhaseClock | None = None) -> tuple[list[dict], list[int]]:
    """`count` steps, a new request submitted for each one that ends; each step's host
    time (wall and the stepping thread's CPU, the stub's forward left out), its phases
    when `clock` times them, and the token events it made."""
    steps, tokens = [], []
    for _ in range(count):
        if clock is not None:
            clock.begin_step()
        stub.forward_s = 0.0
        started, started_cpu = time.perf_counter(), time.thread_time()
        events = engine.step()
        total = time.perf_counter() - started
        # CPU time too: other processes on the host stretch wall time, not this.
        phases = {"total_cpu": time.thread_time() - started_cpu}
        if clock is not None:
            phases |= clock.end_step() | {"timed_total": total - stub.forward_s}
        phases |= {"total": total - stub.forward_s, "forward": stub.forward_s}
        steps.append(phases)
        tokens.append(sum(1 for event in events if isinstance(event, TokenEvent)))
        for _ in _finals(events):
            submit()
    return steps, tokens


def _ms(seconds: list[float]) -> dict[str, float]:
    """Mean, p50 and p99 of per-step seconds, in milliseconds."""
    mean = sum(seconds) / len(seconds)
    return {"mean": 1e3 * mean, "p50": 1e3 * percentile(seconds, 50), "p99": 1e3 * percentile(seconds, 99)}


def _finals(events: list) -> list[FinalEvent]:
    return [event for event in events if isinstance(event, FinalEvent)]


class PhaseClock:
    """Seconds spent in wrapped methods, by phase: since `begin_step` (or since it was made)
    until `end_step`."""

    def __init__(self) -> None:
        self._originals: list[tuple[object, str, object]] = []
        self._step: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, phase: str) -> None:
        if owner is None:
            return
        original = getattr(owner, name)
        self._originals.append((owner, name, owner.__dict__.get(name)))
        totals = self

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals._step[phase] += time.perf_counter() - started

        setattr(owner, name, timed)

    def begin_step(self) -> None:
        self._step = defaultdict(float)

    def end_step(self) -> dict[str, float]:
        return dict(self._step)

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


class StubForward:
    """Stands in for the model: no math, logits over `STUB_VOCAB` columns (each standing
    for a token of text, `_as_text_tokens`), from a few prepared tensors in turn."""

    def __init__(self, max_rows: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self._logits = [torch.randn(max_rows, STUB_VOCAB, generator=generator) for _ in range(8)]
        self._turn = 0
        self.forward_s = 0.0

    def __call__(self, logits_to_keep: torch.Tensor, **_) -> SimpleNamespace:
        started = time.perf_counter()
        self._turn = (self._turn + 1) % len(self._logits)
        logits = self._logits[self._turn][: logits_to_keep.numel()]
        self.forward_s += time.perf_counter() - started
        return SimpleNamespace(logits=logits[None])


def common_token_ids(tokenizer) -> list[int]:
    """The `STUB_VOCAB` most frequent tokens of `bench/overhead_text.py`'s fixed text: what the
    stub's columns stand for, so that the detokenizers see text as a model writes it (the first
    ids of a byte-level vocabulary are single bytes, half of them pieces of a character)."""
    counts = Counter(tokenizer.encode(TEXT, add_special_tokens=False))
    special = set(tokenizer.all_special_ids)
    common = [token_id for token_id, _ in counts.most_common() if token_id not in special][:STUB_VOCAB]
    if len(common) < STUB_VOCAB:
        raise ValueError(f"the stub's text has {len(common)} distinct tokens, fewer than {STUB_VOCAB}")
    return common


def _one_layer_copy(model):
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = 1
    with torch.device("meta"):
        small = AutoModelForCausalLM.from_config(config)
    return small.to_empty(device="cpu").to(model.dtype).eval()


class NoLaunches:
    """The CUDA backend's kernels: the stub forward never attends."""

    def launch(self, *_):
        raise RuntimeError("the overhead scenario's stub forward launches no kernels")


SCENARIO = Scenario("overhead", with_model(run), add_arguments)
