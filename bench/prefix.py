"""`inflight bench --scenario prefix`: KV reuse across requests (the prefix cache), on seeded
random token ids, EOS ignored: `shared` (one long prefix, many suffixes, all at t0),
`multi_turn` (each turn resubmits its history, on a device pool too small for them all) and
`n` (parallel sampling against independent requests); docs/benchmarks.md, "Prefix caching".
TTFT is the engine's own (`FinalEvent.timings.first_token_s`, from each request's arrival);
throughput is output tokens over the time from t0 to the last token.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from bench.drive import Driver, kv_bytes, on_fresh_engines, random_prompts
from bench.metrics import percentile, summarize
from bench.report import system_panel
from bench.scenario import Scenario, add_flags, comma_list, with_model
from workers.api import SamplingParams
from workers.block_pool import blocks_needed
from workers.config import CacheConfig

WORKLOADS = ("shared", "multi_turn", "n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "prefix scenario", {
        "--prefix-workloads": (",".join(WORKLOADS), f"comma-separated subset of {','.join(WORKLOADS)}"),
        "--prefix-requests": (64, "shared: requests, all at t0"),
        "--prefix-shared-len": (1024, "shared: tokens of the shared prefix"),
        "--prefix-suffix-len": ([32, 128], "shared: each request's own suffix"),
        "--prefix-output-len": ([32, 64], "shared: output tokens"),
        "--prefix-hf-batch-tokens": (
            1024, "shared: max_batch_tokens of the transformers peer (the best of `inflight bench`'s sweep)"),
        "--prefix-conversations": (16, "multi_turn: conversations"),
        "--prefix-turns": (4, "multi_turn: turns per conversation"),
        "--prefix-first-len": (256, "multi_turn: tokens of each conversation's first message"),
        "--prefix-message-len": (64, "multi_turn: tokens of each later message"),
        "--prefix-turn-output-len": (64, "multi_turn: output tokens per turn"),
        "--prefix-pool-fraction": (0.25, "multi_turn: the device KV pool holds this share of all final histories"),
        "--prefix-n": (8, "n: samples per prompt"),
        "--prefix-n-prompts": (8, "n: prompts"),
        "--prefix-n-prompt-len": (512, "n: tokens per prompt"),
        "--prefix-n-output-len": (64, "n: output tokens per sample"),
    })  # fmt: skip


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    workloads = comma_list(args.prefix_workloads, "--prefix-workloads", WORKLOADS)
    runs = {"shared": run_shared, "multi_turn": run_multi_turn, "n": run_parallel_sampling}
    return {name: runs[name](loaded, args, vocab_ids) for name in WORKLOADS if name in workloads}


class CacheTally:
    """Sums the prefix cache's per-step figures (`EngineStats.cache`) over a run, and
    keeps the peak of KV blocks in use; chains to any observer already attached."""

    SUMMED = ("queried_tokens", "device_hit_tokens", "host_hit_tokens", "offloaded_blocks")

    def __init__(self, engine) -> None:
        self.totals = dict.fromkeys(self.SUMMED, 0)
        self.last = None
        self.peak_device_blocks = 0
        self.preemptions = 0
        # At the step with the most sequences running: how many, and the blocks they held.
        self.peak_running = (0, 0)
        previous = engine.observer

        def observe(stats) -> None:
            for name in self.SUMMED:
                self.totals[name] += getattr(stats.cache, name)
            self.last = stats.cache
            self.peak_device_blocks = max(self.peak_device_blocks, stats.device_blocks_used)
            self.peak_running = max(self.peak_running, (sum(stats.census.running.values()), stats.device_blocks_used))
            if stats.step is not None:
                self.preemptions += stats.step.num_preempted
            if previous is not None:
                previous(stats)

        engine.observer = observe

    def figures(self) -> dict:
        queried = self.totals["queried_tokens"]
        last = self.last
        return self.totals | {
            "device_hit_rate": self.totals["device_hit_tokens"] / queried if queried else 0.0,
            "host_hit_rate": self.totals["host_hit_tokens"] / queried if queried else 0.0,
            "device_evictions": last.device_evictions if last else 0,  # counted since the engine started
            "host_evictions": last.host_evictions if last else 0,
            "peak_device_blocks_used": self.peak_device_blocks,
            "peak_running": self.peak_running[0],
            # Shared prompts show here: n choices hold one copy of their prompt's KV.
            "device_blocks_per_running_at_peak": self.peak_running[1] / max(self.peak_running[0], 1),
            "preemptions": self.preemptions,
        }


def run_engines(loaded, args: argparse.Namespace, vocab_ids: list[int], caches: dict, work) -> dict[str, dict]:
    """For each named `CacheConfig`, a fresh engine that has run one short request (first-call
    costs are not measured; its prompt is shorter than a block, so it caches nothing), then
    `work(name, drive)` on it, run to the end: the engine's figures and any `work` returns.
    Throughput is from the driver's token times, TTFT from the engine's final events."""

    def measure(name: str, engine) -> dict:
        warmup = Driver(engine)
        warmup.add("warmup", vocab_ids[: engine.block_size - 1], 2)
        warmup.drain()
        tally = CacheTally(engine)
        drive = Driver(engine)
        extra = work(name, drive) or {}
        drive.drain()
        ttfts = [final.timings.first_token_s for final in drive.finals.values()]
        wall = max(times[-1] for times in drive.token_times.values())
        produced = sum(len(times) for times in drive.token_times.values())
        return {
            "output_tokens": produced,
            "output_tokens_per_s": produced / wall,
            "wall_s": wall,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "steps": drive.num_steps,
            "cache": tally.figures(),
            # Other processes on the host skew every figure: the 1-min load when this run ended.
            "load_average_1m": round(os.getloadavg()[0], 2),
        } | extra

    return on_fresh_engines(loaded, args, {name: {"cache": cache} for name, cache in caches.items()}, measure)


def run_shared(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    rng = random.Random(args.seed)
    prefix = random_prompts(rng, 1, (args.prefix_shared_len, args.prefix_shared_len), vocab_ids)[0]
    suffixes = random_prompts(rng, args.prefix_requests, tuple(args.prefix_suffix_len), vocab_ids)
    requests = [
        (f"req-{i}", prefix + suffix, rng.randint(*args.prefix_output_len)) for i, suffix in enumerate(suffixes)
    ]
    caches = {
        "caching_off": CacheConfig(prefix_caching=False),
        "device_only": CacheConfig(swap_memory_bytes=0),
        "host_tier": CacheConfig(),
    }

    def all_at_t0(_, drive: Driver) -> None:
        for request in requests:
            drive.add(*request)

    systems = run_engines(loaded, args, vocab_ids, caches, all_at_t0)
    systems["hf_continuous"] = run_peer(args, requests)

    on, off, peer = systems["host_tier"], systems["caching_off"], systems["hf_continuous"]
    return {
        "requests": len(requests),
        "shared_len": args.prefix_shared_len,
        "suffix_len": list(args.prefix_suffix_len),
        "output_len": list(args.prefix_output_len),
        "prompt_tokens": sum(len(prompt) for _, prompt, _ in requests),
        "systems": systems,
        # Caching on (host tier; the device-only figures are alongside) against the others.
        "tok_s_vs_caching_off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "ttft_p50_caching_off_over_on": off["ttft_p50_s"] / on["ttft_p50_s"],
        "tok_s_vs_hf_continuous": on["output_tokens_per_s"] / peer["output_tokens_per_s"],
    }


def run_peer(args: argparse.Namespace, requests: list[tuple[str, list[int], int]]) -> dict:
    """Transformers' continuous batching with block sharing, in its own process (its
    generation thread must be the process's only OpenMP team; see bench/children.py)."""
    from bench.children import Children
    from bench.workload import BenchRequest, Workload

    prompt_lens = [len(prompt) for _, prompt, _ in requests]
    workload = Workload(
        args.seed,
        (min(prompt_lens), max(prompt_lens)),
        tuple(args.prefix_output_len),
        [BenchRequest(request_id, prompt, n) for request_id, prompt, n in requests],
    )
    with tempfile.TemporaryDirectory(prefix="inflight-prefix-") as tmp:
        children = Children(Path(tmp), args.model, args.dtype)
        workload.save(children.workload_path)
        out = children.run("hf_continuous", max_batch_tokens=args.prefix_hf_batch_tokens, allow_block_sharing=True)
    figures = summarize(out["token_times"], out["peak_rss_mb"])  # TTFT from t0, when all were submitted
    keep = ("max_batch_tokens", "num_blocks", "allow_block_sharing", "prefix_hit_tokens", "load_average_1m")
    return figures | {k: out[k] for k in keep}


def run_multi_turn(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    rng = random.Random(args.seed + 1)
    conversations, turns = args.prefix_conversations, args.prefix_turns
    first = random_prompts(rng, conversations, (args.prefix_first_len, args.prefix_first_len), vocab_ids)
    messages = [
        random_prompts(rng, turns - 1, (args.prefix_message_len, args.prefix_message_len), vocab_ids)
        for _ in range(conversations)
    ]
    output_len = args.prefix_turn_output_len
    final_history = args.prefix_first_len + (turns - 1) * args.prefix_message_len + turns * output_len

    # The device pool: a share of all final histories, but never less than one (a request must fit alone).
    block_size = CacheConfig().block_size
    pool_blocks = max(
        blocks_needed(round(args.prefix_pool_fraction * conversations * final_history), block_size),
        blocks_needed(final_history, block_size) + 1,
    )
    pool_bytes = kv_bytes(loaded.model, pool_blocks * block_size)
    caches = {
        "device_only": CacheConfig(kv_memory_bytes=pool_bytes, swap_memory_bytes=0),
        "host_tier": CacheConfig(kv_memory_bytes=pool_bytes),
    }
    histories = {}

    def converse(name: str, drive: Driver) -> dict:
        histories[name] = _converse(drive, first, messages, output_len)
        # Later turns are where a history can be reused.
        later = [f.timings.first_token_s for rid, f in drive.finals.items() if not rid.endswith("-t0")]
        host = drive.engine.host_allocator
        return {
            "ttft_p50_later_turns_s": percentile(later, 50),
            "kv_blocks": drive.engine.allocator.num_blocks,
            "host_blocks": host.num_blocks if host else 0,
        }

    systems = run_engines(loaded, args, vocab_ids, caches, converse)
    device, host = systems["device_only"], systems["host_tier"]
    return {
        "conversations": conversations,
        "turns": turns,
        "first_len": args.prefix_first_len,
        "message_len": args.prefix_message_len,
        "output_len": output_len,
        "final_history_tokens": final_history,
        "pool_blocks": pool_blocks,
        "pool_share_of_final_histories": pool_blocks * block_size / (conversations * final_history),
        "systems": systems,
        # Greedy outputs feed the next turn's prompt: equal histories mean both ran the same prompts.
        "same_histories": histories["device_only"] == histories["host_tier"],
        "ttft_p50_device_only_over_host_tier": device["ttft_p50_s"] / host["ttft_p50_s"],
    }


def _converse(drive: Driver, first: list[list[int]], messages: list[list[list[int]]], output_len: int) -> list:
    """Every conversation's first turn at t0; each later turn (history plus the next
    message) as soon as the previous one finishes. Returns each conversation's history."""
    prompts = {f"c{c}-t0": prompt for c, prompt in enumerate(first)}
    for request_id, prompt in prompts.items():
        drive.add(request_id, prompt, output_len)
    seen = 0
    while drive.engine.has_unfinished():
        drive.step()
        finished = list(drive.finals)[seen:]
        seen += len(finished)
        for request_id in finished:
            conversation, turn = (int(part[1:]) for part in request_id.split("-"))
            history = prompts[request_id] + drive.tokens[request_id]
            if turn + 1 <= len(messages[conversation]):
                next_id = f"c{conversation}-t{turn + 1}"
                prompts[next_id] = history + messages[conversation][turn]
                drive.add(next_id, prompts[next_id], output_len)
    last = len(messages[0])
    return [prompts[f"c{c}-t{last}"] + drive.tokens[f"c{c}-t{last}"] for c in range(len(first))]


def run_parallel_sampling(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    """n samples of each prompt in one request (`SamplingParams.n`, caching on), against
    the same samples as independent requests with caching off."""
    rng = random.Random(args.seed + 2)
    length = (args.prefix_n_prompt_len, args.prefix_n_prompt_len)
    prompts = random_prompts(rng, args.prefix_n_prompts, length, vocab_ids)
    n, output_len = args.prefix_n, args.prefix_n_output_len
    sampled = dict(max_tokens=output_len, temperature=0.8, ignore_eos=True)
    requests = {
        "parallel": [(f"p{i}", prompt, SamplingParams(n=n, **sampled)) for i, prompt in enumerate(prompts)],
        "independent_caching_off": [
            (f"p{i}-s{s}", prompt, SamplingParams(**sampled)) for i, prompt in enumerate(prompts) for s in range(n)
        ],
    }

    def all_at_t0(name: str, drive: Driver) -> None:
        for request in requests[name]:
            drive.submit(*request)

    caches = {"parallel": CacheConfig(), "independent_caching_off": CacheConfig(prefix_caching=False)}
    systems = run_engines(loaded, args, vocab_ids, caches, all_at_t0)
    expected = len(prompts) * n * output_len
    for name, figures in systems.items():
        if figures["output_tokens"] != expected:
            raise RuntimeError(f"n: {name} produced {figures['output_tokens']} tokens, expected {expected}")
    parallel, independent = systems["parallel"], systems["independent_caching_off"]
    return {
        "prompts": len(prompts),
        "prompt_len": args.prefix_n_prompt_len,
        "n": n,
        "output_len": output_len,
        "temperature": sampled["temperature"],
        "systems": systems,
        "tok_s_vs_independent": parallel["output_tokens_per_s"] / independent["output_tokens_per_s"],
        "peak_blocks_parallel": parallel["cache"]["peak_device_blocks_used"],
        "peak_blocks_independent": independent["cache"]["peak_device_blocks_used"],
        # The prompt's KV stored once per prompt: far fewer blocks per running sequence.
        "blocks_per_sequence_parallel": parallel["cache"]["device_blocks_per_running_at_peak"],
        "blocks_per_sequence_independent": independent["cache"]["device_blocks_per_running_at_peak"],
    }


def chart_panels(report: dict) -> list[tuple]:
    panels = []
    if "shared" in report:
        systems = report["shared"]["systems"]
        panels.append(system_panel("shared: output tok/s (higher is better)", systems, "output_tokens_per_s", "{:.1f}"))
        panels.append(system_panel("shared: TTFT p50 s (lower is better)", systems, "ttft_p50_s", "{:.2f}"))
    if "multi_turn" in report:
        systems = report["multi_turn"]["systems"]
        panels.append(system_panel("multi-turn: TTFT p50 s (lower is better)", systems, "ttft_p50_s", "{:.2f}"))
        hit_rates = {
            f"{name}\n{tier}": s["cache"][f"{tier}_hit_rate"]
            for name, s in systems.items()
            for tier in ("device", "host")
        }
        panels.append(("multi-turn: prompt tokens found cached", hit_rates, "{:.0%}"))
    if "n" in report and "skipped" not in report["n"]:
        systems = report["n"]["systems"]
        title = f"n={report['n']['n']}: output tok/s (higher is better)"
        panels.append(system_panel(title, systems, "output_tokens_per_s", "{:.1f}"))
    return panels


SCENARIO = Scenario("prefix", with_model(run), add_arguments, chart_panels=chart_panels)
