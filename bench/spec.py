"""`inflight bench --scenario spec`: speculative decoding by prompt lookup, on against off
(docs/benchmarks.md, "Speculative decoding"): `copy` (chat requests whose answers quote their
prompts, at each `--spec-concurrency`), `default` (the bench's random-token workload) and
`sharegpt` (real text, at each `--spec-sharegpt-concurrency`).

Each workload runs on two engines over one loaded model, speculation off and on, stepped in
turns (the one behind steps next); each engine's time is the sum of its own steps. Greedy, so
both make the same tokens (`identical`). Per engine: acceptance (accepted / drafted), steps,
tokens verified per speculating request-step (1 + its drafts) and how often each length
occurred; `copied_fraction`: the share of output tokens that end a 4-gram of the prompt.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import Counter

from bench.arrivals import ArrivalQueue
from bench.drive import Driver, StepRecorder, bench_engine, random_prompts
from bench.report import HostLoad
from bench.scenario import D, Scenario, add_flags, comma_list, with_model
from workers.config import SpeculativeConfig
from workers.model_loader import encode_prompt

WORKLOADS = ("copy", "default", "sharegpt")

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog near the river bank. Every morning the farmer walks to the "
    "market with a basket of apples, pears and plums, and sells them to the villagers who gather by the old "
    "stone well.",
    "Our office will be closed on Monday for the public holiday. All support requests received over the weekend "
    "will be answered on Tuesday morning, in the order they arrived. For urgent problems with billing, please "
    "call the emergency line listed on your invoice.",
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up to five "
    "books at a time for three weeks. Late returns cost ten cents a day, and lost books must be replaced or paid "
    "for at the front desk.",
    "To reset your password, open the settings page and choose Security. Click the button labelled Reset "
    "Password, enter the code we send to your email address, and then type your new password twice. The new "
    "password must have at least twelve characters.",
]
# Chat requests whose answers quote their prompts (SmolLM2-135M-Instruct copies these).
COPY_PROMPTS = [
    "Copy this text exactly, word for word:\n\n" + PARAGRAPHS[1],
    "Quote this text:\n\n" + PARAGRAPHS[0],
    "Quote the first two sentences of this text:\n\n" + PARAGRAPHS[1],
    "Copy this text exactly, word for word:\n\n" + PARAGRAPHS[2],
    "Copy this text exactly, word for word:\n\n" + PARAGRAPHS[3],
    "Quote this text:\n\n" + PARAGRAPHS[2],
    "Quote the first two sentences of this text:\n\n" + PARAGRAPHS[3],
    "Extract the fields as JSON with keys name, city, email and phone:\n\nName: Maria Gonzalez\nCity: Barcelona\n"
    "Email: maria.gonzalez@example.com\nPhone: +34 612 345 678",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    count = len(COPY_PROMPTS)
    add_flags(parser, "spec scenario", {
        "--spec-workloads": ("copy,default", f"comma-separated subset of {','.join(WORKLOADS)}" + D),
        "--spec-copy-requests": (count, f"copy: requests (at most {count})"),
        "--spec-concurrency": ("1,8", "copy: comma-separated concurrencies (1: one request at a time; n: n at t0)"),
        "--spec-max-tokens": (160, "copy: max_tokens of each request"),
        "--spec-sharegpt-concurrency": ("1,8,64", "sharegpt: comma-separated concurrencies (n requests at a time)"),
        "--spec-max-draft-tokens": (
            SpeculativeConfig.max_draft_tokens, "drafts a request verifies per step, at most (K)"),
    })  # fmt: skip


def run(loaded, args: argparse.Namespace, vocab_ids: list[int]) -> dict:
    workloads = comma_list(args.spec_workloads, "--spec-workloads", WORKLOADS)
    if not 1 <= args.spec_copy_requests <= len(COPY_PROMPTS):
        raise SystemExit(f"--spec-copy-requests must be in [1, {len(COPY_PROMPTS)}]")
    on = SpeculativeConfig(max_draft_tokens=args.spec_max_draft_tokens)
    report = {"max_draft_tokens": on.max_draft_tokens}
    if "copy" in workloads:
        prompts = [
            encode_prompt(loaded.tokenizer, [{"role": "user", "content": text}])
            for text in COPY_PROMPTS[: args.spec_copy_requests]
        ]
        for concurrency in comma_list(args.spec_concurrency, "--spec-concurrency", cast=int):
            requests = [
                request(f"copy{i}", ids, args.spec_max_tokens, ignore_eos=False) for i, ids in enumerate(prompts)
            ]
            report[f"copy_c{concurrency}"] = compare(loaded, args, on, requests, concurrency)
    if "default" in workloads:
        rng = random.Random(args.seed)
        prompts = random_prompts(rng, args.requests, tuple(args.prompt_len), vocab_ids)
        requests = [request(f"r{i}", ids, rng.randint(*args.output_len)) for i, ids in enumerate(prompts)]
        report["default"] = compare(loaded, args, on, requests, len(requests))
    if "sharegpt" in workloads:
        from bench.sharegpt import make_sharegpt_workload

        workload = make_sharegpt_workload(loaded.tokenizer, args.requests, args.sharegpt_max_output, args.seed)
        requests = [request(r.request_id, r.prompt_ids, r.output_len) for r in workload.requests]
        for concurrency in comma_list(args.spec_sharegpt_concurrency, "--spec-sharegpt-concurrency", cast=int):
            report[f"sharegpt_c{concurrency}"] = compare(loaded, args, on, requests, min(concurrency, len(requests)))
    return report


def request(request_id: str, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> dict:
    """A greedy request, as `Driver.add` takes it."""
    return {"request_id": request_id, "prompt_ids": prompt_ids, "output_len": max_tokens, "ignore_eos": ignore_eos}


def compare(loaded, args, on: SpeculativeConfig, requests: list[dict], concurrency: int) -> dict:
    """Run `requests` on two engines, speculation off and on, stepped alternately (see the
    module doc); their figures and the ratio of their output tok/s."""
    runs = {
        name: Run(loaded, args, speculative, requests, concurrency)
        for name, speculative in (("off", SpeculativeConfig(enabled=False)), ("on", on))
    }
    load = HostLoad()
    while any(run.going for run in runs.values()):
        # The one behind steps next, so both cross the workload over the same stretch of time.
        min((run for run in runs.values() if run.going), key=lambda run: run.num_output_tokens).step()
    off, spec = runs["off"], runs["on"]
    result = {name: run.figures() for name, run in runs.items()}
    del runs
    gc.collect()
    return (
        result
        | {
            "requests": len(requests),
            "concurrency": concurrency,
            "identical": off.driver.tokens == spec.driver.tokens,
            "speedup": result["on"]["output_tok_s"] / result["off"]["output_tok_s"],
            "copied_fraction": copied_fraction(
                [r["prompt_ids"] for r in requests], [off.driver.tokens[r["request_id"]] for r in requests]
            ),
        }
        | load.figures()
    )


class Run:
    """One engine working through the requests, `concurrency` at a time, one step per call;
    its time is the sum of its own steps."""

    def __init__(self, loaded, args, speculative: SpeculativeConfig, requests: list[dict], concurrency: int):
        self.engine = bench_engine(loaded, args, speculative=speculative)
        self.steps = StepRecorder(self.engine)
        self.driver = Driver(self.engine)
        self.arrivals = ArrivalQueue(requests, concurrency=concurrency)  # closed loop
        self.busy_s = 0.0

    @property
    def num_output_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.driver.tokens.values())

    @property
    def going(self) -> bool:
        return bool(self.arrivals) or self.engine.has_unfinished()

    def step(self) -> None:
        self.driver.admit(self.arrivals)
        started = time.perf_counter()
        self.driver.step()
        self.busy_s += time.perf_counter() - started

    def figures(self) -> dict:
        steps = list(self.steps)
        drafted = sum(s.num_draft_tokens for s in steps)
        accepted = sum(s.num_accepted_tokens for s in steps)
        # Each speculating request's tokens verified in a step: 1 + its drafts.
        verified = Counter(1 + drafts for s in steps for drafts, _ in s.verified)
        output = self.num_output_tokens
        return {
            "output_tokens": output,
            "busy_s": self.busy_s,
            "output_tok_s": output / self.busy_s,
            "steps": len(steps),
            "mean_step_s": self.busy_s / max(1, len(steps)),
            "tokens_per_step": sum(s.num_tokens for s in steps) / max(1, len(steps)),
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "verified_tokens_per_request_step": {str(n): c for n, c in sorted(verified.items())},
            "mean_verified_tokens": sum(n * c for n, c in verified.items()) / max(1, sum(verified.values())),
        }


def copied_fraction(prompts: list[list[int]], outputs: list[list[int]], n: int = 4) -> float:
    """Share of output tokens that end an n-gram (of the output) found in its prompt."""
    copied = total = 0
    for prompt, output in zip(prompts, outputs):
        grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
        tokens = prompt[-(n - 1) :] + output
        for i in range(len(output)):
            copied += tuple(tokens[i : i + n]) in grams
        total += len(output)
    return copied / max(1, total)


SCENARIO = Scenario("spec", with_model(run), add_arguments)
