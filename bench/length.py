"""`inflight bench --scenario length`: the queue's order by predicted output length, through
the real worker on a real Redis, under Poisson arrivals of held-out ShareGPT prompts (odd
conversations, which training never sees) with their real lengths (EOS honoured, greedy,
capped at `--length-max-tokens`); the parts and their figures: docs/benchmarks.md,
"Output-length prediction" and "Deadlines". The capacity run's outputs are the true
lengths, written as the oracle's file, keyed by the ids the worker encodes the text to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from bench.arrivals import at_t0, poisson
from bench.fleet import BenchRun, Fleet, bench_run, model_flags
from bench.follow import Follower
from bench.length_training import held_out_prompt
from bench.metrics import metric_total
from bench.report import say
from bench.scenario import Scenario, add_flags, comma_list

QUIET_LIMIT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "length scenario (also --requests, --seed, --dtype)", {
        "--length-policies": ("fcfs,predicted,oracle", None),
        "--length-loads": ("0.5,0.8,0.95", "shares of the measured capacity"),
        "--length-max-tokens": (384, "the reply cap (EOS honoured)"),
        "--length-worker-args": ("", "more flags for every worker, e.g. a running cap"),
        "--length-deadline-policies": ("fcfs,predicted,oracle", "the deadlines part's"),
        "--length-deadline-load": (0.9, "the deadlines part's load (0: no deadlines part)"),
        "--length-deadline-slack": ("5,60", "MIN,MAX seconds from a job's send to its deadline (uniform)"),
    })  # fmt: skip


async def run(args: argparse.Namespace) -> dict:
    import shlex

    from bench.sharegpt import make_sharegpt_workload
    from workers.config import ModelConfig, SchedulerConfig
    from workers.length_predictor import kendall_tau, policy_predictor, prompt_key
    from workers.model_loader import encode_prompt, load_model

    model = ModelConfig(source=args.model, dtype=args.dtype)
    loaded = load_model(model)
    tokenizer = loaded.tokenizer
    held_out = make_sharegpt_workload(tokenizer, args.requests, args.length_max_tokens, args.seed, keep=held_out_prompt)
    texts = [tokenizer.decode(r.prompt_ids) for r in held_out.requests]
    worker_ids = [encode_prompt(tokenizer, text) for text in texts]
    embeddings = loaded.model.get_input_embeddings().weight.detach().float().numpy
    predictor = policy_predictor(SchedulerConfig(length_policy="predicted"), model, embeddings)
    del loaded, embeddings  # the workers load their own
    policies = comma_list(args.length_policies, "--length-policies", empty=True)
    loads = comma_list(args.length_loads, "--length-loads", cast=float)
    extra = shlex.split(args.length_worker_args)

    report: dict = {"workload": held_out.describe() | {"max_tokens": args.length_max_tokens}, "points": {}}
    async with bench_run(args.redis_url, "length") as bench:
        oracle_file = bench.logs / "oracle.json"

        def policy_flags(policy: str) -> list[str]:
            oracle = ["--length-oracle", str(oracle_file)] if policy == "oracle" else []
            return ["--length-policy", policy, *extra, *oracle]

        say("length: capacity (every request at t0, fcfs)")
        capacity_run = await _serve(bench, args, "capacity", policy_flags("fcfs"), texts, [at_t0(len(texts))])
        records, duration = capacity_run["points"][0]
        truth = [len(r["tokens"]) for r in records]
        # Requests finished per second while the running set was full (until the last one
        # started): the whole run's average would count its tail, where few still run.
        full_until = max(r["first"] for r in records)
        finished = sum(r["end"] <= full_until for r in records)
        capacity = finished / full_until if finished else len(texts) / duration
        oracle_file.write_text(json.dumps({"lengths": {prompt_key(ids): n for ids, n in zip(worker_ids, truth)}}))
        report["capacity"] = {
            "requests_per_s": round(capacity, 3),
            "output_tokens_per_s": round(sum(truth) / duration, 1),
        }
        report["true_lengths"] = {
            "mean": round(statistics.fmean(truth), 1),
            "capped": sum(n >= args.length_max_tokens for n in truth),
        }

        if predictor is not None:
            started = time.perf_counter()
            predicted = [predictor.predict(ids) for ids in worker_ids]
            cost_us = (time.perf_counter() - started) / len(worker_ids) * 1e6
            report["predictor"] = {
                "kendall_tau": round(kendall_tau(predicted, truth), 3),
                "mae_tokens": round(statistics.fmean(abs(p - t) for p, t in zip(predicted, truth)), 1),
                "cost_us_per_prediction": round(cost_us, 1),
            }

        arrivals = [poisson(len(texts), load * capacity, args.seed + i) for i, load in enumerate(loads)]
        for policy in policies:
            say(f"length: {policy} at loads {loads}")
            served = await _serve(bench, args, policy, policy_flags(policy), texts, arrivals)
            for load, (records, duration), preemptions in zip(loads, served["points"], served["preemptions"]):
                figures = _figures(records, duration)
                figures["preemptions"] = preemptions
                same = sum(r["tokens"] == c["tokens"] for r, c in zip(records, capacity_run["points"][0][0]))
                figures["same_tokens_as_capacity_run"] = round(same / len(records), 3)
                report["points"].setdefault(f"load {load}", {})[policy] = figures
        if args.length_deadline_load > 0:
            low, high = comma_list(args.length_deadline_slack, "--length-deadline-slack", cast=float, count=2)
            draw = random.Random(args.seed)
            slacks = [draw.uniform(low, high) for _ in texts]
            load = args.length_deadline_load
            deadline_arrivals = poisson(len(texts), load * capacity, args.seed + len(loads))
            report["deadlines"] = {"load": load, "slack_s": [low, high], "policies": {}}
            outcomes = {}
            for policy in comma_list(args.length_deadline_policies, "--length-deadline-policies", empty=True):
                say(f"length: deadlines, {policy} at load {load}")
                name, flags = f"deadlines-{policy}", policy_flags(policy)
                served = await _serve(bench, args, name, flags, texts, [deadline_arrivals], slacks)
                outcomes[policy], _ = served["points"][0]
                report["deadlines"]["policies"][policy] = _deadline_figures(outcomes[policy])
            if "fcfs" in outcomes:  # fcfs runs every job: which refusals it shows needless
                for policy, records in outcomes.items():
                    needless = sum(
                        r["refused"] and c["finish"] != "deadline" for r, c in zip(records, outcomes["fcfs"])
                    )
                    report["deadlines"]["policies"][policy]["refused_but_met_under_fcfs"] = needless
    for name, point in report["points"].items():
        if "fcfs" in point:
            for policy in point:
                point[policy]["e2e_mean_vs_fcfs"] = round(point["fcfs"]["e2e_mean_s"] / point[policy]["e2e_mean_s"], 2)
    return report


async def _serve(
    bench: BenchRun, args, name: str, flags: list[str], texts: list[str], points: list[list[float]], slacks=None
) -> dict:
    """A fresh worker with `flags`; the prompts sent at each point's arrival times in turn
    (with `slacks`, each with a deadline that many seconds after it is sent)."""
    with bench.fleet(name, [*model_flags(args), *flags]) as fleet:
        worker = fleet.start("bench")
        await asyncio.to_thread(worker.wait_ready)
        served: dict = {"points": [], "preemptions": []}
        for i, arrivals in enumerate(points):
            before = metric_total(worker.metrics(), "inflight_preemptions_total")
            tag = f"len-{bench.run_id}-{name}{i}"
            served["points"].append(await _send(bench.client, fleet, tag, texts, arrivals, args, slacks))
            served["preemptions"].append(metric_total(worker.metrics(), "inflight_preemptions_total") - before)
        return served


async def _send(
    client, fleet: Fleet, tag: str, texts: list[str], arrivals: list[float], args, slacks=None
) -> tuple[list, float]:
    """Each prompt queued at its arrival time (with `slacks`, a deadline that many seconds
    later); every reply followed to its end. Per request: its tokens, its send, first-token
    and end times after t0, its finish reason, and whether it was refused as unmeetable."""
    async with Follower(client, fleet, tag=tag).reading() as follower:
        jobs = [
            follower.job(str(i), text, args.length_max_tokens, ignore_eos=False,
                         slack_s=None if slacks is None else slacks[i])
            for i, text in enumerate(texts)
        ]  # fmt: skip
        order = sorted(range(len(jobs)), key=lambda i: arrivals[i])
        t0 = await follower.send_at([jobs[i] for i in order], [arrivals[i] for i in order])
        await follower.all_final(jobs, "length's replies", limit_s=QUIET_LIMIT_S, quiet=True)
    duration = time.perf_counter() - t0
    for job in jobs:
        if job.final["type"] == "error" and not (slacks and job.final.get("code") == "deadline_unmeetable"):
            raise RuntimeError(f"length: {job.request_id} failed: {job.final.get('message')}")
    records = [
        {"sent": j.sent - t0, "first": j.times[0] - t0 if j.times else None, "end": j.ended - t0, "tokens": j.tokens,
         "finish": j.final.get("finish_reason"), "refused": j.final["type"] == "error"}
        for j in jobs
    ]  # fmt: skip
    return records, duration


def _deadline_figures(records: list[dict]) -> dict:
    """Jobs refused as unmeetable (and how soon after their send), accepted, and of those
    accepted, how many finished by their deadline."""
    refused = sorted(r["end"] - r["sent"] for r in records if r["refused"])
    accepted = [r for r in records if not r["refused"]]
    met = sum(r["finish"] != "deadline" for r in accepted)
    return {
        "jobs": len(records),
        "refused": len(refused),
        "refused_after_s_p50_max": [round(statistics.median(refused), 3), round(refused[-1], 3)] if refused else None,
        "accepted": len(accepted),
        "met": met,
        "missed": len(accepted) - met,
        "met_share_of_accepted": round(met / len(accepted), 3) if accepted else None,
    }


def _figures(records: list[dict], duration: float) -> dict:
    e2e = sorted(r["end"] - r["sent"] for r in records)
    ttft = [r["first"] - r["sent"] for r in records]
    return {
        "e2e_mean_s": round(statistics.fmean(e2e), 2),
        "e2e_p99_s": round(e2e[min(len(e2e) - 1, int(0.99 * len(e2e)))], 2),
        "ttft_mean_s": round(statistics.fmean(ttft), 2),
        "longest_wait_s": round(max(ttft), 2),
        "duration_s": round(duration, 1),
    }


SCENARIO = Scenario("length", run, add_arguments)
