"""Two paths (`bench/systems.py`) on the same text prompts, compared against the machine's
drift (the `redis` and `gateway` scenarios): throughput rounds alternate A B B A ... and
pool per path; TTFT pairs short prompts one at a time, alternating, so the median paired
difference is what the second path adds."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.metrics import percentile, summarize
from bench.workload import make_workload

# A round's figures kept in the report.
BRIEF = ("output_tokens_per_s", "output_tokens", "wall_s", "ttft_p50_s", "itl_p50_s", "itl_p99_s")


def paired_workload(args, tokenizer, vocab_ids: list[int], ttft_pairs: int):
    """The bench's random workload, its prompts as text, and `ttft_pairs` short prompts (16
    random tokens each)."""
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab_ids, args.seed)
    prompts = {r.request_id: (tokenizer.decode(r.prompt_ids), r.output_len) for r in workload.requests}
    rng = random.Random(args.seed + 1)
    short = [tokenizer.decode([rng.choice(vocab_ids) for _ in range(16)]) for _ in range(ttft_pairs)]
    return workload, prompts, short


@dataclass
class PairedRuns:
    rounds: dict[str, list[dict]]  # each path's figures, a round each
    ttft: dict[str, list[float]]  # each path's TTFT of each short prompt
    metered: dict[str, float] = field(default_factory=dict)  # each meter's total over its path's rounds

    def output_tokens_per_s(self, name: str) -> float:
        rounds = self.rounds[name]
        return sum(r["output_tokens"] for r in rounds) / sum(r["wall_s"] for r in rounds)

    def output_tokens(self, name: str) -> int:
        return sum(r["output_tokens"] for r in self.rounds[name])

    def figures(self, base: str, other: str) -> dict:
        """`other` against `base` (its figures under its name), their ratio, the TTFT overhead
        (the median of the paired differences) and every round in brief."""
        throughput, base_throughput = self.output_tokens_per_s(other), self.output_tokens_per_s(base)
        return {
            "output_tokens_per_s": throughput,
            f"{base}_output_tokens_per_s": base_throughput,
            "throughput_ratio": throughput / base_throughput,
            "ttft_overhead_p50_s": percentile([o - b for o, b in zip(self.ttft[other], self.ttft[base])], 50),
            "ttft_p50_s": percentile(self.ttft[other], 50),
            f"{base}_ttft_p50_s": percentile(self.ttft[base], 50),
            "ttft_pairs": len(self.ttft[other]),
            "rounds": {name: [{k: r[k] for k in BRIEF} for r in rounds] for name, rounds in self.rounds.items()},
        }


async def paired_runs(paths: dict, prompts: dict[str, tuple[str, int]], short: list[str], rounds: int, run_id: str,
                      meters: dict[str, Callable[[], float]] | None = None) -> PairedRuns:  # fmt: skip
    """Warm both paths, run `rounds` A/B rounds of `prompts`, then the TTFT pairs of `short`;
    `meters[name]` (a process's CPU seconds) is read around each of that path's rounds."""
    names = tuple(paths)
    meters = meters or {}
    for path in paths.values():  # warm both: first-step costs are not the path's
        await path.generate({f"warmup-{uuid.uuid4().hex[:6]}": (short[0], 2)})
    figures: dict[str, list[dict]] = {name: [] for name in names}
    metered = dict.fromkeys(meters, 0.0)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            tagged = {f"{run_id}-{k}-{name}-{round_}": v for k, v in prompts.items()}
            before = meters[name]() if name in meters else 0.0
            figures[name].append(summarize(await paths[name].generate(tagged), 0.0))
            if name in meters:
                metered[name] += meters[name]() - before
    ttft: dict[str, list[float]] = {name: [] for name in names}
    for i, prompt in enumerate(short):
        for name in names if i % 2 == 0 else names[::-1]:
            times = await paths[name].generate({f"{run_id}-ttft-{i}-{name}": (prompt, 1)})
            ttft[name].append(next(iter(times.values()))[0])
    return PairedRuns(figures, ttft, metered)
