"""`inflight bench --scenario structured`: what structured outputs cost, and (with
`--structured-validity`) the proof that they hold (docs/benchmarks.md, "Structured outputs").

- `throughput`: the default workload unconstrained and under `BENCH_SCHEMA`, alternately,
  best against best; `mask_s`, `advance_s`: time spent masking logits and advancing grammars.
- `compile`: each generated schema (`bench/schemas.py`) on an empty cache, first mask included.
- `validity`: every schema greedy and at temperature 1.0 (seeded), plus regexes and choices;
  every output that ends with `stop` must validate (`jsonschema`) or match in full.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import time
from collections import Counter

from bench.drive import Driver, StepRecorder, bench_engine, on_fresh_engines, random_prompts
from bench.metrics import percentile
from bench.overhead import PhaseClock
from bench.scenario import D, Scenario, add_flags, with_model
from bench.schemas import generate_schemas
from workers.api import FinishReason, SamplingParams
from workers.config import CacheConfig

# A list of records the output never finishes within the workload's lengths.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 16},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                },
                "required": ["id", "name"],
            },
        }
    },
    "required": ["records"],
}
REGEXES = (
    r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]",
    r"[A-Z][a-z]+( [A-Z][a-z]+)?",
    r"(yes|no), because [a-z ]{5,40}\.",
    r"\+?[0-9]{6,10}",
    r"#[0-9a-f]{6}",
)
CHOICES = (
    ("yes", "no"),
    ("red", "green", "blue"),
    ("Paris", "London", "Berlin", "Madrid"),
    ("positive", "negative", "neutral"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "structured scenario", {
        "--structured-rounds": (2, "runs of each of unconstrained and constrained, alternating" + D),
        "--structured-schemas": (300, "generated schemas (compile, validity)"),
        "--structured-validity": (False, "also decode every schema greedy and at temperature 1.0, and validate (slow)"),
        "--structured-max-tokens": (192, "validity: max_tokens per output"),
    })  # fmt: skip


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    report = {"throughput": run_throughput(loaded, args, vocab_ids), "compile": run_compile(loaded, args)}
    if args.structured_validity:
        report["validity"] = run_validity(loaded, args)
    return report


def run_throughput(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, args.requests, tuple(args.prompt_len), vocab_ids)
    outputs = [rng.randint(*args.output_len) for _ in prompts]
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}

    def measure(name: str, engine) -> dict:
        grammar_time = PhaseClock()
        grammar_time.wrap(engine.grammars, "apply", "mask_s")
        grammar_time.wrap(engine.grammars, "advance", "advance_s")
        steps = StepRecorder(engine)
        drive = Driver(engine)
        for i, (prompt, output_len) in enumerate(zip(prompts, outputs)):
            shape = {"json_schema": BENCH_SCHEMA} if name == "json_schema" else {}
            drive.submit(f"req-{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, **shape))
        drive.drain()
        spent = {"mask_s": 0.0, "advance_s": 0.0} | grammar_time.end_step()
        reasons = sorted({f.finish_reason.value for f in drive.finals.values()})
        return drive.throughput() | {"steps": len(steps), **spent, "finish_reasons": reasons}

    for _ in range(args.structured_rounds):
        for name, figures in on_fresh_engines(loaded, args, dict.fromkeys(runs, {}), measure).items():
            runs[name].append(figures)
    best = {name: max(r["output_tokens_per_s"] for r in results) for name, results in runs.items()}
    return {
        "requests": args.requests,
        "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len),
        "schema": BENCH_SCHEMA,
        "runs": runs,
        "best_output_tokens_per_s": best,
        "constrained_vs_unconstrained": best["json_schema"] / best["unconstrained"],
    }


def run_compile(loaded, args: argparse.Namespace) -> dict:
    """Each schema on an empty cache: compile plus the first mask (`Grammars.start`)."""
    from workers.structured import Grammars

    engine = bench_engine(loaded, args, cache=CacheConfig(kv_memory_bytes=16 << 20, swap_memory_bytes=0))
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, cache_size=1024)
    grammars.start(SamplingParams(json_object=True))  # the vocabulary's one-off set-up, not a compile
    times = []
    for schema in generate_schemas(args.structured_schemas, args.seed):
        started = time.perf_counter()
        grammars.start(SamplingParams(json_schema=schema))
        times.append(time.perf_counter() - started)
    del engine
    gc.collect()
    return {
        "schemas": len(times),
        "p50_ms": percentile(times, 50) * 1e3,
        "p99_ms": percentile(times, 99) * 1e3,
        "max_ms": max(times) * 1e3,
        "total_s": sum(times),
    }


def run_validity(loaded, args: argparse.Namespace) -> dict:
    import jsonschema

    schemas = generate_schemas(args.structured_schemas, args.seed)
    report = {}
    for mode, sampling in (("greedy", {}), ("temperature_1", {"temperature": 1.0})):
        drive = Driver(bench_engine(loaded, args), raise_errors=False)
        jobs = [(f"s{i}", {"json_schema": schema}, "Reply with a JSON object.") for i, schema in enumerate(schemas)]
        jobs += [(f"r{i}", {"regex": regex}, "Answer in a few words.") for i, regex in enumerate(REGEXES)]
        jobs += [(f"c{i}", {"choice": c}, f"Pick one of: {', '.join(c)}.") for i, c in enumerate(CHOICES)]
        for n, (request_id, shape, text) in enumerate(jobs):
            seed = {"seed": n} if sampling else {}
            drive.submit(
                request_id,
                [{"role": "user", "content": text}],
                SamplingParams(max_tokens=args.structured_max_tokens, **sampling, **seed, **shape),
            )
        drive.drain()
        reasons = Counter(drive.finals[request_id].finish_reason.value for request_id, _, _ in jobs)
        ended = [job for job in jobs if drive.finals[job[0]].finish_reason is FinishReason.STOP]
        failures = [
            {"id": request_id, "text": drive.texts.get(request_id, "")}
            for request_id, shape, _ in ended
            if not _satisfies(shape, drive.texts.get(request_id, ""), jsonschema)
        ]
        stopped, valid = len(ended), len(ended) - len(failures)
        report[mode] = {
            "requests": len(jobs),
            "finish_reasons": dict(reasons),
            "stopped": stopped,
            "valid": valid,
            "valid_share_of_stopped": valid / max(stopped, 1),
            "failures": failures[:10],
        }
        del drive
        gc.collect()
    return report


def _satisfies(shape: dict, text: str, jsonschema) -> bool:
    try:
        if "json_schema" in shape:
            validator = jsonschema.Draft202012Validator(
                shape["json_schema"], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
            )
            validator.validate(json.loads(text))
            return True
        if "regex" in shape:
            return re.fullmatch(shape["regex"], text) is not None
        return text in shape["choice"]
    except (ValueError, jsonschema.ValidationError):
        return False


SCENARIO = Scenario("structured", with_model(run), add_arguments)
