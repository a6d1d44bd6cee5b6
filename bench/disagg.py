"""`inflight bench --scenario disagg`: disaggregated prefill and decode against colocated
workers, on two cores, under a prefill storm (issue 37; the configurations and the
figures: docs/benchmarks.md, "Disaggregated prefill and decode").

Per configuration: `idle_cpu_s_per_s`, each worker's CPU use over 1 s with nothing to serve
after the warm-up (besides the model's steps, e.g. a transfer agent's progress thread);
`lone`, long prompts one at a time on idle workers: TTFT and the gap to the second token
(on P/D the handoff, the K/V read and the first decode step; `handoff_to_second_token`
from the handoff entry's arrival); `storm`, long prompts at once over running decodes: the
storm's TTFT, and the running decodes' ITL in the steady window and in the storm window
(until every storm request has its second token; a gap counts where its later token
falls). The K/V transfer: the decode worker's bytes over the summed read time, and per
1,000 prompt tokens at the handoff entries' bytes per token. Across configurations:
greedy token identity (the running decodes over the tokens both runs made before the
cancel), and P/D's lone-prompt overhead over each colocated configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from bench.fleet import BenchRun, bench_run, model_flags
from bench.follow import Follower, Job, following
from bench.metrics import inter_token_latencies, metric_total, percentile_or_none
from bench.processes import WorkerProcess, cpu_seconds
from bench.report import HostLoad, say
from bench.scenario import D, Scenario, add_flags, comma_list
from bench.servers import signals_as_exit

CONFIGURATIONS = ("disagg", "colocated_one", "colocated_two")
# A configuration's workers: (consumer name, role, index of the core in --disagg-cores, or
# None for all of them, torch threads).
LAYOUTS = {
    "disagg": [("prefill", "prefill", 0, 1), ("decode", "decode", 1, 1)],
    "colocated_one": [("both", "both", None, 2)],
    "colocated_two": [("core0", "both", 0, 1), ("core1", "both", 1, 1)],
}
# Tokens each running decode makes before the steady window opens: on P/D it has been
# handed off and resumed by then.
READY_TOKENS = 4
WARMUP_TOKENS = 4
# No event for this long fails the run instead of hanging it.
QUIET_LIMIT_S = 180.0
CLAIM_IDLE_MS = 60_000
SHUTDOWN_GRACE_S = 5
# Room left in the model's context past a running decode's prompt (its text may tokenize longer).
CONTEXT_MARGIN = 64
RUNNING_MAX_TOKENS = 4096
IDLE_SAMPLE_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "disagg scenario (also --redis-url, --workload)", {
        "--disagg-configs": (",".join(CONFIGURATIONS), "configurations to run, comma-separated" + D),
        "--disagg-running": (16, "decodes running when the storm arrives" + D),
        "--disagg-running-prompt-len": (64, "the running decodes' prompt length in tokens" + D),
        "--disagg-storm": (8, "long prompts arriving at once" + D),
        "--disagg-prompt-len": (1000, "the storm's (and lone) prompt length in tokens" + D),
        "--disagg-output-len": (128, "the storm's output length in tokens" + D),
        "--disagg-steady-tokens": (32, "tokens each running decode makes in the steady window before the storm" + D),
        "--disagg-lone": (3, "long prompts sent one at a time on idle workers, for the handoff's TTFT overhead" + D),
        "--disagg-min-prompt-tokens": (
            32, "the workers' --handoff-min-prompt-tokens (default: %(default)s, below the running prompts)"),
        "--disagg-cores": ("0,1", "the two cores to pin the workers to" + D),
    })  # fmt: skip


@dataclass(frozen=True)
class Prompts:
    running: list[str]
    storm: list[str]
    lone: list[str]
    warmup: list[str]
    running_max_tokens: int
    source: str


async def run(args: argparse.Namespace) -> dict:
    configs = comma_list(args.disagg_configs, "--disagg-configs", CONFIGURATIONS)
    cores = comma_list(args.disagg_cores, "--disagg-cores", count=2)
    if args.disagg_running_prompt_len < args.disagg_min_prompt_tokens:
        say("disagg: the running decodes' prompts are shorter than --disagg-min-prompt-tokens: on P/D they stay whole")
    prompts = _prompts(args)
    with signals_as_exit():  # SIGTERM stops the workers on the way out too
        return await _run(args, configs, cores, prompts)


def _prompts(args: argparse.Namespace) -> Prompts:
    from bench.workload import prompt_vocabulary
    from workers.config import ModelConfig
    from workers.model_loader import encode_prompt, load_model

    loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))  # for its tokenizer and context
    tokenizer, context = loaded.tokenizer, loaded.max_context
    vocab_ids = prompt_vocabulary(tokenizer, loaded.model.config.vocab_size)
    del loaded
    rng = random.Random(args.seed)

    def random_text(length: int) -> str:
        """Random token ids as text of about `length` tokens once the worker encodes it
        (decoded ids may encode to more or fewer: resized until they come close)."""
        ids = [rng.choice(vocab_ids) for _ in range(length)]
        for _ in range(8):
            text = tokenizer.decode(ids)
            encoded = len(encode_prompt(tokenizer, text))
            if abs(encoded - length) <= max(1, length // 100):
                break
            if encoded > length:
                ids = ids[: max(1, round(len(ids) * length / encoded))]
            else:
                ids += [rng.choice(vocab_ids) for _ in range(max(1, round(len(ids) * (length - encoded) / encoded)))]
        return text

    def random_texts(count: int, length: int) -> list[str]:
        return [random_text(length) for _ in range(count)]

    running = random_texts(args.disagg_running, args.disagg_running_prompt_len)
    warmup = random_texts(2, args.disagg_running_prompt_len) + random_texts(2, args.disagg_prompt_len)
    count = args.disagg_storm + args.disagg_lone
    if args.workload == "sharegpt":
        room = context - args.disagg_output_len
        long, source = _sharegpt_texts(tokenizer, count, args.disagg_prompt_len, room, args.seed)
    else:
        long = random_texts(count, args.disagg_prompt_len)
        source = "random token ids"
    longest_running = max(len(encode_prompt(tokenizer, text)) for text in running)
    running_max_tokens = min(RUNNING_MAX_TOKENS, context - longest_running - CONTEXT_MARGIN)
    if running_max_tokens < READY_TOKENS + args.disagg_steady_tokens + args.disagg_output_len:
        raise SystemExit(f"the model's context ({context}) leaves the running decodes too few tokens")
    return Prompts(running, long[: args.disagg_storm], long[args.disagg_storm :], warmup, running_max_tokens, source)


def _sharegpt_texts(tokenizer, count: int, length: int, room: int, seed: int) -> tuple[list[str], str]:
    """`count` ShareGPT first turns, chat-templated, of 0.8-1.2x `length` tokens (at most
    the workload's cap and `room`), in the seed's order, as text; and their description."""
    from bench.sharegpt import MAX_PROMPT_TOKENS, first_turns, prompt_ids

    low, high = round(0.8 * length), min(round(1.2 * length), MAX_PROMPT_TOKENS, room)
    pairs = first_turns()
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    texts = []
    for index in order:
        ids = prompt_ids(tokenizer, pairs[index][0])
        if low <= len(ids) <= high:
            texts.append(tokenizer.decode(ids))
            if len(texts) == count:
                return texts, f"sharegpt first turns of {low}-{min(round(1.2 * length), MAX_PROMPT_TOKENS)} tokens"
    raise SystemExit(f"only {len(texts)} ShareGPT first turns have {low}-{high} tokens, {count} asked")


async def _run(args: argparse.Namespace, configs: list[str], cores: list[str], prompts: Prompts) -> dict:
    results: dict[str, dict] = {}
    jobs: dict[str, dict[str, Job]] = {}
    async with bench_run(args.redis_url, "disagg") as run:
        for name in configs:
            say(f"disagg: {name}")
            results[name], jobs[name] = await _configuration(name, run, args, cores, prompts)
    return {
        "configurations": results,
        "identity": {
            f"{a}_vs_{b}": _identity(jobs[a], jobs[b]) for i, a in enumerate(configs) for b in configs[i + 1 :]
        },
        "handoff_overhead": _overhead(results),
        "workload": {
            "running": args.disagg_running,
            "running_prompt_len": args.disagg_running_prompt_len,
            "running_max_tokens": prompts.running_max_tokens,
            "storm": args.disagg_storm,
            "prompt_len": args.disagg_prompt_len,
            "output_len": args.disagg_output_len,
            "steady_tokens": args.disagg_steady_tokens,
            "lone": args.disagg_lone,
            "long_prompts": prompts.source,
            "running_prompts": "random token ids",
            "seed": args.seed,
        },
        "settings": {
            "model": args.model or "bundled SmolLM2-135M-Instruct",
            "dtype": args.dtype,
            "cores": cores,
            "handoff_min_prompt_tokens": args.disagg_min_prompt_tokens,
            "speculative": "off",
            "claim_idle_ms": CLAIM_IDLE_MS,
            "cpu_count": os.cpu_count(),
        },
    }


def _worker_flags(args) -> list[str]:
    """Every worker's, whatever its role: no speculation (tokens accepted together would
    share one arrival time), a long lease, handoffs of the running decodes too."""
    return [*model_flags(args), "--no-speculative", "--claim-idle-ms", str(CLAIM_IDLE_MS),
            "--shutdown-grace-s", str(SHUTDOWN_GRACE_S), "--handoff-min-prompt-tokens",
            str(args.disagg_min_prompt_tokens), "--log-format", "json"]  # fmt: skip


async def _configuration(name: str, run: BenchRun, args, cores: list[str], prompts: Prompts) -> tuple[dict, dict]:
    load = HostLoad()
    pinned = {consumer: ",".join(cores) if core is None else cores[core] for consumer, _, core, _ in LAYOUTS[name]}
    with run.fleet(name, _worker_flags(args)) as fleet:
        handoff_stream = f"{fleet.prefix}:handoffs"
        for consumer, role, _, threads in LAYOUTS[name]:
            flags = ["--threads", str(threads), "--role", role, "--handoff-stream", handoff_stream]
            fleet.start(consumer, *flags, cores=pinned[consumer])
        handoffs = handoff_stream if name == "disagg" else None
        async with following(run.client, fleet, handoffs, tag=f"{run.run_id}-{name}") as follower:
            figures = await _drive(follower, args, prompts)
            metrics = {worker.name: worker.metrics() for worker in fleet.workers.values()}
            figures |= {
                "handoffs": _handoff_counts(metrics.values()),
                "kv_transfer": _kv_transfer(metrics.get("decode"), follower.kv_layouts) if handoffs else None,
                "finished_by": dict(Counter(j.final.get("worker", "") for j in follower.jobs.values())),
                "finish_reasons": dict(Counter(j.final.get("finish_reason", "error") for j in follower.jobs.values())),
                "dead_letters": await run.client.xlen(fleet.dead),
            } | load.figures()  # before the workers stop
    idle = figures.pop("idle")
    figures["workers"] = [
        {"name": n, "role": role, "cores": pinned[n], "threads": t, "idle_cpu_s_per_s": idle[n]}
        for n, role, _, t in LAYOUTS[name]
    ]
    return figures, {j.label: j for j in follower.jobs.values()}


async def _drive(follower: Follower, args, prompts: Prompts) -> dict:
    """The warm-up, the lone prompts one at a time, then the storm over the running decodes."""
    job = follower.job

    def have(jobs: list[Job], count: Callable[[Job], int]) -> Callable[[], bool]:
        return lambda: all(len(j.times) >= count(j) or j.final for j in jobs)

    async def until(condition, what: str) -> None:
        await follower.until(condition, what, limit_s=QUIET_LIMIT_S, quiet=True, errors_fail=True)

    warm = [job(f"warmup-{i}", text, WARMUP_TOKENS) for i, text in enumerate(prompts.warmup)]
    await follower.send(warm)
    await until(lambda: all(j.final for j in warm), "the warm-up")

    idle = await _idle_cpu(list(follower.fleet.workers.values()))
    lone = []
    for i, text in enumerate(prompts.lone):
        lone.append(job(f"lone-{i}", text, WARMUP_TOKENS))
        await follower.send(lone[-1:])
        await until(lambda: lone[-1].final is not None, "a lone prompt")

    running = [job(f"running-{i}", text, prompts.running_max_tokens) for i, text in enumerate(prompts.running)]
    await follower.send(running)
    await until(have(running, lambda j: READY_TOKENS), "the running decodes")
    steady_start = time.perf_counter()
    marks = {j.request_id: len(j.times) for j in running}
    await until(have(running, lambda j: marks[j.request_id] + args.disagg_steady_tokens), "the steady window")
    storm = [job(f"storm-{i}", text, args.disagg_output_len) for i, text in enumerate(prompts.storm)]
    storm_start = await follower.send(storm)
    await until(have(storm, lambda j: min(2, j.max_tokens)), "the storm's second tokens")
    storm_end = time.perf_counter()
    await until(lambda: all(j.final for j in storm), "the storm to finish")
    await follower.cancel(running)
    await until(lambda: all(j.final for j in running), "the running decodes' cancels")
    return {"idle": idle, "lone": _lone(lone), "storm": _storm(running, storm, steady_start, storm_start, storm_end)}


async def _idle_cpu(workers: list[WorkerProcess]) -> dict[str, float]:
    """Each worker's CPU seconds per second while it serves nothing (after the warm-up):
    what it takes from its core besides the model's steps."""
    before = {w.name: cpu_seconds(w.pid) for w in workers}
    started = time.perf_counter()
    await asyncio.sleep(IDLE_SAMPLE_S)
    elapsed = time.perf_counter() - started
    return {w.name: round((cpu_seconds(w.pid) - before[w.name]) / elapsed, 3) for w in workers}


def _lone(lone: list[Job]) -> dict:
    ttfts = [j.ttft_s for j in lone]
    gaps = [j.times[1] - j.times[0] for j in lone if len(j.times) > 1]
    handoffs = [j.times[1] - j.handoff_at for j in lone if len(j.times) > 1 and j.handoff_at is not None]
    return {
        "requests": len(lone),
        "prompt_tokens": [j.final.get("usage", {}).get("prompt_tokens") for j in lone],
        "staged_tokens": [j.staged_tokens for j in lone],  # prompt tokens whose K/V its handoff carried (P/D)
        "ttft_s": ttfts,
        "ttft_p50_s": percentile_or_none(ttfts, 50),
        "second_token_gap_p50_s": percentile_or_none(gaps, 50),
        "handoff_to_second_token_p50_s": percentile_or_none(handoffs, 50),
    }


def _storm(running: list[Job], storm: list[Job], steady_start: float, storm_start: float, storm_end: float) -> dict:
    steady, during = [], []
    for j in running:
        for gap, t in zip(inter_token_latencies(j.times), j.times[1:]):
            if steady_start < t <= storm_start:
                steady.append(gap)
            elif storm_start < t <= storm_end:
                during.append(gap)
    ttfts = [j.ttft_s for j in storm]
    steady_p50, during_p99 = percentile_or_none(steady, 50), percentile_or_none(during, 99)
    return {
        "ttft_p50_s": percentile_or_none(ttfts, 50),
        "ttft_p99_s": percentile_or_none(ttfts, 99),
        "prompt_tokens_p50": percentile_or_none(
            [j.final["usage"]["prompt_tokens"] for j in storm if "usage" in j.final], 50
        ),
        "window_s": storm_end - storm_start,
        "itl_p50_steady_s": steady_p50,
        "itl_p50_storm_s": percentile_or_none(during, 50),
        "itl_p99_storm_s": during_p99,
        "itl_max_storm_s": max(during) if during else None,
        "storm_p99_over_steady_p50": during_p99 / steady_p50 if during_p99 and steady_p50 else None,
        "steady_gaps": len(steady),
        "storm_gaps": len(during),
        "running_tokens": sum(len(j.times) for j in running),
    }


def _handoff_counts(metrics) -> dict[str, int]:
    counts: Counter = Counter()
    for worker in metrics:
        for (name, labels), value in worker.items():
            if name == "inflight_handoff_requests_total":
                counts[dict(labels)["outcome"]] += int(value)
    return dict(counts)


def _kv_transfer(metrics: dict | None, layouts: list[tuple[int, int]]) -> dict | None:
    """The decode worker's reads: bytes over their summed time, and the time per 1,000
    prompt tokens at the handoffs' bytes per token."""
    if metrics is None:
        return None
    num_bytes = metric_total(metrics, "inflight_kv_transfer_bytes_total")
    seconds = metric_total(metrics, "inflight_kv_transfer_seconds_sum")
    reads = int(metric_total(metrics, "inflight_kv_transfer_seconds_count"))
    per_token = sum(b for b, _ in layouts) / sum(t for _, t in layouts) if layouts else None
    per_s = num_bytes / seconds if seconds > 0 else None
    return {
        "reads": reads,
        "bytes": int(num_bytes),
        "seconds": seconds,
        "bytes_per_s": per_s,
        "bytes_per_token": per_token,
        "ms_per_1000_prompt_tokens": 1000 * per_token / per_s * 1e3 if per_s and per_token else None,
        "mean_read_ms": seconds / reads * 1e3 if reads else None,
    }


def _identity(a: dict[str, Job], b: dict[str, Job]) -> dict:
    """Greedy tokens of the same requests in two configurations; the running decodes (cut
    short by the cancel) over the tokens both made."""
    labels = sorted(set(a) & set(b) - {label for label in a if label.startswith("warmup")})
    differ, compared = {}, 0
    for label in labels:
        n = min(len(a[label].tokens), len(b[label].tokens))
        compared += n
        x, y = a[label].tokens[:n], b[label].tokens[:n]
        if x != y:
            differ[label] = next(i for i, (u, v) in enumerate(zip(x, y)) if u != v)
        elif not label.startswith("running") and len(a[label].tokens) != len(b[label].tokens):
            differ[label] = n
    return {
        "requests": len(labels),
        "identical": len(labels) - len(differ),
        "tokens_compared": compared,
        "first_difference": differ,  # label: index of the first token that differs
    }


def _overhead(results: dict) -> dict:
    """P/D's lone-prompt TTFT and second-token gap minus each colocated configuration's."""
    if "disagg" not in results:
        return {}
    pd = results["disagg"]["lone"]
    overhead = {}
    for other in ("colocated_two", "colocated_one"):
        if other in results:
            base = results[other]["lone"]
            for key in ("ttft_p50_s", "second_token_gap_p50_s"):
                if pd[key] is not None and base[key] is not None:
                    overhead[f"{key.removesuffix('_p50_s')}_vs_{other}_s"] = pd[key] - base[key]
    return overhead


def chart_panels(report: dict) -> list[tuple]:
    """The storm's TTFT p99, the running decodes' ITL p99 during it over their steady p50,
    and a lone long prompt's TTFT, one bar per configuration."""
    configs = report["configurations"]
    panels = []
    for title, section, key, fmt in (
        ("storm TTFT p99 s (lower is better)", "storm", "ttft_p99_s", "{:.2f}"),
        ("ITL p99 in storm / steady p50 (lower is better)", "storm", "storm_p99_over_steady_p50", "{:.2f}"),
        ("lone prompt TTFT p50 s (lower is better)", "lone", "ttft_p50_s", "{:.3f}"),
    ):
        bars = {name: c[section][key] for name, c in configs.items() if c[section][key] is not None}
        panels.append((title, bars, fmt))
    return panels


SCENARIO = Scenario("disagg", run, add_arguments, chart_panels=chart_panels)
