"""`inflight bench --scenario tenants`: fair queueing between tenants (a), batch jobs on
idle capacity (b) and refusal under overload (c), on two `inflight worker --fair-queue`
processes pinned to a core each (issue 38; the parts and their figures: docs/benchmarks.md,
"Tenants"; the fair queue: docs/protocol.md, "Tenants, batch jobs and admission").

Weighted tokens are the fair queue's own measure of service (prompt tokens charged when a
job is taken, output tokens as they are made, at the workers' default weights). (a)'s gap
is max |served_i - served_j| over the tenants backlogged at a sample, against VTC's bound:
2 x the weighted cost of one request. (b)'s idle capacity used: batch tokens charged during
the interactive run / (capacity x its duration - interactive tokens charged).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass

from bench.arrivals import poisson
from bench.fleet import BenchRun, Fleet, bench_run, model_flags
from bench.follow import Follower, Job, following, outcomes
from bench.metrics import latency_figures, metric_total, percentile_or_none
from bench.report import HostLoad, say
from bench.scenario import D, Scenario, add_flags, comma_list
from bench.servers import signals_as_exit
from service.config import FairQueueConfig
from workers.config import SchedulerConfig

PARTS = ("a", "b", "c")
WORKERS = (("w0", 0), ("w1", 1))  # consumer name, index of its core in --tenants-cores
SAMPLE_S = 0.5  # how often the fair queue's counters are read
CLAIM_IDLE_MS = 60_000  # a starved event loop must not hand a job to the other worker
SHUTDOWN_GRACE_S = 5
WARMUP_JOBS, WARMUP_TOKENS = 4, 4
BATCH_SETTLE_S = 2.0  # after the batch backlog is admitted and served, before the interactive load
WAIT_LIMIT_S = 900.0  # a wait this long fails the run instead of hanging it
DEFAULT_QUEUE_WAIT_S = 2.0  # (c)'s --max-queue-wait-s when (b) did not run to give one
TENANTS_DRAIN_S = 300.0  # (c): accepted jobs not finished this long after the last arrival are left
WEIGHTS = FairQueueConfig()  # the workers' charge weights (their defaults)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "tenants scenario (also --redis-url, --workload, --speculation)", {
        "--tenants-parts": (",".join(PARTS), "parts to run, comma-separated" + D),
        "--tenants-cores": ("0,1", "the two cores to pin the workers to" + D),
        "--tenants-max-running": (
            8, "each worker's --max-running-requests (with fair queueing it holds no more jobs)" + D),
        "--tenants-max-running-batch": (0, "each worker's --max-running-batch (0: up to --tenants-max-running)" + D),
        "--tenants-max-batch-prefill-tokens": (
            -1, "each worker's --max-batch-prefill-tokens (-1: the workers' default)" + D),
        "--tenants-light-jobs": (30, "(a) jobs each light tenant queues at t0" + D),
        "--tenants-flood": (10, "(a) the heavy tenant's jobs per light tenant's" + D),
        "--tenants-prompt-len": (128, "(a) prompt length in tokens (random ids)" + D),
        "--tenants-output-len": (64, "(a) output length in tokens (EOS ignored)" + D),
        "--tenants-capacity-rps": (0.0, "(b, c) capacity in requests/s of the workload; 0 measures it" + D),
        "--tenants-capacity-jobs": (64, "(b, c) jobs at t0 that measure capacity" + D),
        "--tenants-interactive-jobs": (60, "(b) interactive jobs, Poisson arrivals" + D),
        "--tenants-interactive-load": (0.6, "(b) their arrival rate as a share of capacity" + D),
        "--tenants-batch-jobs": (2000, "(b) batch jobs queued under the interactive load" + D),
        "--tenants-overload-jobs": (150, "(c) jobs, Poisson arrivals" + D),
        "--tenants-overload": (2.0, "(c) their arrival rate as a multiple of capacity" + D),
        "--tenants-max-queue-wait-s": (
            0.0, "(c) the workers' --max-queue-wait-s; 0: (b)'s TTFT p99 alone, else 2 s" + D),
        "--tenants-max-queued-jobs": (0, "(c) the workers' --max-queued-jobs (0: none)" + D),
    })  # fmt: skip


class Counters:
    """The fair queue's bookkeeping in Redis (docs/protocol.md, Keys): what each account
    (a tenant, or `batch:<tenant>`) was charged, in weighted tokens, and each tenant's jobs
    admitted and not yet taken (`*`: all of them)."""

    def __init__(self, client, requests_stream: str) -> None:
        tag = "{" + requests_stream + "}"
        self.client, self.served_key, self.queued_key = client, f"{tag}:served", f"{tag}:queued"

    async def read(self) -> tuple[dict[str, float], dict[str, int]]:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.served_key)
        pipe.hgetall(self.queued_key)
        served, queued = await pipe.execute()
        return {k.decode(): float(v) for k, v in served.items()}, {k.decode(): int(v) for k, v in queued.items()}

    @contextlib.asynccontextmanager
    async def sampling(self, t0: float):
        """Read every SAMPLE_S while inside: yields the list of (s after t0, served, queued)."""
        samples: list[tuple[float, dict, dict]] = []
        stop = asyncio.Event()

        async def sample() -> None:  # the last sample when told to stop
            while True:
                served, queued = await self.read()
                samples.append((time.perf_counter() - t0, served, queued))
                if stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SAMPLE_S)

        task = asyncio.create_task(sample(), name="tenants-sampler")
        try:
            yield samples
        finally:
            stop.set()
            await task


@dataclass
class Session:
    """Two workers on streams of their own, and this process's follower of them."""

    client: object
    fleet: Fleet
    follower: Follower
    counters: Counters

    def jobs(self, label: str, drawn: list[tuple[str, int]], tenant: str, **fields) -> list[Job]:
        """A job of `tenant` per (text, max_tokens), labelled `label-<index>`."""
        job = self.follower.job
        return [job(f"{label}-{i}", text, n, tenant=tenant, **fields) for i, (text, n) in enumerate(drawn)]

    async def until(self, condition, what: str, poll: list[Job] = (), required: bool = True) -> bool:
        """Wait for `condition()` (a coroutine function's too), looking up `poll`'s final
        events meanwhile. Fails when a worker died; after WAIT_LIMIT_S (or TENANTS_DRAIN_S
        when not `required`), fails, or returns False when not `required`."""
        limit_s = WAIT_LIMIT_S if required else TENANTS_DRAIN_S
        met = await self.follower.until(condition, f"tenants: {what}", limit_s=limit_s, poll=poll)
        if met or not required:
            return met
        tails = self.fleet.log_tails()
        raise RuntimeError(f"tenants: waiting for {what}: still waiting after {WAIT_LIMIT_S:.0f} s\n{tails}")

    async def all_final(self, jobs: list[Job], what: str, **wait) -> bool:
        return await self.until(lambda: all(j.final for j in jobs), what, **wait)

    def preemptions(self) -> float:
        return sum(metric_total(w.metrics(), "inflight_preemptions_total") for w in self.fleet.workers.values())


@dataclass(frozen=True)
class Prompts:
    warmup: list[str]
    flood: list[str]  # (a), fixed lengths
    light: list[list[str]]  # (a), one list per light tenant
    probe: list[tuple[str, int]]  # (b, c): (text, max_tokens)
    interactive: list[tuple[str, int]]
    batch: list[tuple[str, int]]
    overload: list[tuple[str, int]]
    source: str  # of (b, c)'s
    ignore_eos: bool  # for (b, c)'s: a random workload's fixed lengths


async def run(args: argparse.Namespace) -> dict:
    parts = comma_list(args.tenants_parts, "--tenants-parts", PARTS)
    cores = comma_list(args.tenants_cores, "--tenants-cores", count=2)
    prompts = _prompts(args, parts)
    with signals_as_exit():  # SIGTERM stops the workers on the way out too
        return await _run(args, parts, cores, prompts)


def _prompts(args: argparse.Namespace, parts: list[str]) -> Prompts:
    from bench.workload import draw_workload, make_workload, prompt_vocabulary
    from workers.config import ModelConfig
    from workers.model_loader import load_model

    loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))  # for its tokenizer and context
    tokenizer, context, vocab_size = loaded.tokenizer, loaded.max_context, loaded.model.config.vocab_size
    vocab_ids = prompt_vocabulary(tokenizer, vocab_size)
    del loaded

    def texts(count: int, prompt_len: int, output_len: int, seed: int) -> list[str]:
        if count < 1:
            return []
        workload = make_workload(count, (prompt_len, prompt_len), (output_len, output_len), vocab_ids, seed)
        return [tokenizer.decode(r.prompt_ids) for r in workload.requests]

    light_jobs = args.tenants_light_jobs if "a" in parts else 0
    fixed = (args.tenants_prompt_len, args.tenants_output_len)
    if "a" in parts and sum(fixed) > context:
        raise SystemExit(f"(a)'s prompt and output do not fit the model's context ({context})")

    probing = ("b" in parts or "c" in parts) and not args.tenants_capacity_rps > 0
    counts = {
        "probe": args.tenants_capacity_jobs if probing else 0,
        "interactive": args.tenants_interactive_jobs if "b" in parts else 0,
        "batch": args.tenants_batch_jobs if "b" in parts else 0,
        "overload": args.tenants_overload_jobs if "c" in parts else 0,
    }
    drawn: list[tuple[str, int]] = []
    if sum(counts.values()):
        workload = draw_workload(
            tokenizer, vocab_size, args.workload, sum(counts.values()), args.prompt_len, args.output_len,
            args.sharegpt_max_output, args.seed,
        )  # fmt: skip
        longest = max(len(r.prompt_ids) + r.output_len for r in workload.requests)
        if longest > context:
            raise SystemExit(f"a request of {longest} tokens does not fit the model's context ({context})")
        drawn = [(tokenizer.decode(r.prompt_ids), r.output_len) for r in workload.requests]
    slices, start = {}, 0
    for name, count in counts.items():
        slices[name], start = drawn[start : start + count], start + count
    return Prompts(
        warmup=texts(WARMUP_JOBS, 32, WARMUP_TOKENS, args.seed + 3),
        flood=texts(light_jobs * args.tenants_flood, *fixed, args.seed),
        light=[texts(light_jobs, *fixed, args.seed + k) for k in (1, 2)],
        source="sharegpt first turns" if args.workload == "sharegpt" else "random token ids",
        ignore_eos=args.workload != "sharegpt",
        **slices,
    )


async def _run(args: argparse.Namespace, parts: list[str], cores: list[str], prompts: Prompts) -> dict:
    report: dict = {"parts": parts}
    async with bench_run(args.redis_url, "tenants") as run:
        capacity = None
        if args.tenants_capacity_rps > 0:  # weighted tokens/s: from (b)'s jobs, if it runs
            capacity = {"requests_per_s": args.tenants_capacity_rps, "weighted_tokens_per_s": None, "source": "flag"}
        if "a" in parts or "b" in parts or ("c" in parts and capacity is None):
            async with _session(run, "main", args, cores, prompts) as session:
                if "a" in parts:
                    report["a"] = await _timed(_part_a(session, prompts, args))
                if capacity is None and ("b" in parts or "c" in parts):
                    capacity = await _capacity(session, prompts)
                if "b" in parts:
                    report["b"] = await _timed(_part_b(session, prompts, capacity, args))
        if capacity is not None:
            report["capacity"] = capacity
        if "c" in parts:
            base = report.get("b", {}).get("alone", {}).get("ttft_p99_ms")
            wait_s = args.tenants_max_queue_wait_s or (round(base / 1000, 2) if base else DEFAULT_QUEUE_WAIT_S)
            caps = {"max_queue_wait_s": wait_s, "max_queued_jobs": args.tenants_max_queued_jobs}
            flags = [f"--{name.replace('_', '-')}={value}" for name, value in caps.items() if value]
            async with _session(run, "capped", args, cores, prompts, flags) as session:
                report["c"] = {"caps": caps} | await _timed(_part_c(session, prompts, capacity, base, args))
    batch_prefill = args.tenants_max_batch_prefill_tokens
    report["workload"] = {
        "a": f"{args.tenants_prompt_len} prompt tokens (random ids), {args.tenants_output_len} out, EOS ignored",
        "b_c": prompts.source + (", EOS ignored" if prompts.ignore_eos else ", EOS honoured"),
        "seed": args.seed,
    }
    report["settings"] = {
        "model": args.model or "bundled SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "cores": cores,
        "threads_per_worker": 1,
        "max_running_requests": args.tenants_max_running,
        "max_running_batch": args.tenants_max_running_batch,
        "max_batch_prefill_tokens": batch_prefill if batch_prefill >= 0 else SchedulerConfig().max_batch_prefill_tokens,
        "jobs_held_per_worker": args.tenants_max_running,  # as a fair-queue worker holds
        "charge_prompt_weight": WEIGHTS.charge_prompt_weight,
        "charge_output_weight": WEIGHTS.charge_output_weight,
        "speculative": args.speculation,
        "prefix_caching": "off",
        "claim_idle_ms": CLAIM_IDLE_MS,
        "cpu_count": os.cpu_count(),
    }
    return report


async def _timed(part) -> dict:
    load = HostLoad()
    return await part | load.figures()


@contextlib.asynccontextmanager
async def _session(run: BenchRun, name: str, args, cores: list[str], prompts: Prompts, extra: list[str] = ()):
    """Two fair-queue workers on `name`'s own streams (prefix caching off: the same prompts
    go twice, alone and under load), warmed up; stopped, and every key of theirs deleted,
    on the way out."""
    say(f"tenants: starting the workers ({name})")
    with run.fleet(name, _worker_flags(args, extra)) as fleet:
        for consumer, core in WORKERS:
            fleet.start(consumer, cores=cores[core])
        async with following(run.client, fleet, tag=f"{run.run_id}-{name}") as follower:
            session = Session(run.client, fleet, follower, Counters(run.client, fleet.stream))
            for i, text in enumerate(prompts.warmup):  # one at a time: a cap on queued jobs refuses none
                warm = follower.job(f"warmup-{i}", text, WARMUP_TOKENS, tenant="warmup")
                await follower.send([warm])
                await session.until(lambda: warm.final is not None, "the warm-up")
            yield session


def _worker_flags(args, extra) -> list[str]:
    flags = [*model_flags(args), "--threads", "1", "--fair-queue", "--no-prefix-caching"]
    flags += ["--max-running-requests", str(args.tenants_max_running)]
    if args.tenants_max_running_batch:
        flags += ["--max-running-batch", str(args.tenants_max_running_batch)]
    if args.tenants_max_batch_prefill_tokens >= 0:
        flags += ["--max-batch-prefill-tokens", str(args.tenants_max_batch_prefill_tokens)]
    flags += ["--claim-idle-ms", str(CLAIM_IDLE_MS), "--shutdown-grace-s", str(SHUTDOWN_GRACE_S)]
    return [*flags, "--log-format", "json", *(["--no-speculative"] if args.speculation == "off" else []), *extra]


# -- (a) fair share ------------------------------------------------------------------------


async def _part_a(s: Session, prompts: Prompts, args) -> dict:
    """A flood ahead of two light tenants, all backlogged from t0; the flood's rest is
    cancelled once the light tenants are done; then their jobs again, alone."""
    say("tenants: (a) a flood and two light tenants")
    out = args.tenants_output_len
    heavy = s.jobs("a-heavy", [(text, out) for text in prompts.flood], "heavy")
    light = [
        job
        for k, texts in enumerate(prompts.light, 1)
        for job in s.jobs(f"a-light{k}", [(text, out) for text in texts], f"light-{k}")
    ]
    tenants = ["heavy", "light-1", "light-2"]
    async with s.counters.sampling(time.perf_counter()) as samples:
        await s.follower.send(heavy, follow=False)  # the flood first, then the light tenants' jobs
        await s.follower.send(light)
        await s.all_final(light, "(a)'s light tenants")
    await s.follower.cancel(heavy)
    await s.all_final(heavy, "(a)'s flood to end", poll=heavy)

    alone = s.jobs("a-alone", [(j.prompt, out) for j in light], "alone")
    await s.follower.send(alone)
    await s.all_final(alone, "(a)'s light jobs alone")

    served = [j for j in heavy + light if j.outcome() == "length"]
    longest_prompt = max(j.final["usage"]["prompt_tokens"] for j in served)
    bound = 2 * (WEIGHTS.charge_prompt_weight * longest_prompt + WEIGHTS.charge_output_weight * out)
    flooded, by_itself = latency_figures([j.record() for j in light]), latency_figures([j.record() for j in alone])
    return {
        "gap": _gap(samples, tenants, bound),
        "share_while_all_backlogged": _shares(samples, tenants),
        "tenants": {name: _tenant(name, heavy + light) for name in tenants},
        "light_ttft_ms": {"p50": flooded["ttft_p50_ms"], "p99": flooded["ttft_p99_ms"]},
        "alone_ttft_ms": {"p50": by_itself["ttft_p50_ms"], "p99": by_itself["ttft_p99_ms"]},
        "ttft_p50_over_alone": _ratio(flooded["ttft_p50_ms"], by_itself["ttft_p50_ms"]),
        "ttft_p99_over_alone": _ratio(flooded["ttft_p99_ms"], by_itself["ttft_p99_ms"]),
        "jobs": _accounting(heavy + light + alone),
        "longest_prompt_tokens": longest_prompt,
    }


def _tenant(name: str, jobs: list[Job]) -> dict:
    mine = [j for j in jobs if j.tenant == name]
    figures = latency_figures([j.record() for j in mine])
    return {"jobs": len(mine), "outcomes": outcomes(mine)} | (
        {} if name == "heavy" else {"ttft_p50_ms": figures["ttft_p50_ms"], "ttft_p99_ms": figures["ttft_p99_ms"]}
    )


def _gap(samples: list, tenants: list[str], bound: float) -> dict:
    """max |served_i - served_j| over the tenants backlogged at each sample with two or more."""
    series = []
    for t, served, queued in samples:
        backlogged = [served.get(name, 0.0) for name in tenants if queued.get(name, 0) > 0]
        if len(backlogged) >= 2:
            series.append([round(t, 2), round(max(backlogged) - min(backlogged), 1)])
    worst = max((gap for _, gap in series), default=None)
    return {
        "max_weighted_tokens": worst,
        "vtc_bound_weighted_tokens": bound,
        "max_over_bound": _ratio(worst, bound),
        "samples": len(series),
        "series": series,  # [s after t0, the gap]
    }


def _shares(samples: list, tenants: list[str]) -> dict | None:
    """Each tenant's share of the tokens charged between the first and last samples at
    which all of them were backlogged."""
    all_in = [served for _, served, queued in samples if all(queued.get(name, 0) > 0 for name in tenants)]
    if len(all_in) < 2:
        return None
    deltas = {name: all_in[-1].get(name, 0.0) - all_in[0].get(name, 0.0) for name in tenants}
    total = sum(deltas.values())
    return {name: round(delta / total, 3) for name, delta in deltas.items()} if total > 0 else None


# -- (b) capacity, and batch jobs on idle capacity -----------------------------------------


async def _capacity(s: Session, prompts: Prompts) -> dict:
    """Requests finished per second while the workers were full (until the last job
    started), and weighted tokens charged per second over the same time."""
    say("tenants: capacity")
    jobs = s.jobs("probe", prompts.probe, "probe", ignore_eos=prompts.ignore_eos)
    before, _ = await s.counters.read()
    t0 = time.perf_counter()
    async with s.counters.sampling(t0) as samples:
        await s.follower.send(jobs)
        await s.until(lambda: all(j.times or j.final for j in jobs), "the probe's first tokens")
        full_s = max(j.times[0] for j in jobs if j.times) - t0
        finished = sum(j.final is not None for j in jobs)
        if finished == 0:  # too few jobs to fill the workers: the whole run instead
            await s.all_final(jobs, "the probe")
            full_s, finished = time.perf_counter() - t0, len(jobs)
    charged = [(t, served.get("probe", 0.0) - before.get("probe", 0.0)) for t, served, _ in samples]
    within = [(t, tokens) for t, tokens in charged if t <= full_s and tokens > 0]
    t_charged, weighted = within[-1] if within else charged[-1]  # else: the last sample, after
    await s.follower.cancel(jobs)
    await s.all_final(jobs, "the probe's cancels")
    return {
        "requests_per_s": round(finished / full_s, 3),
        "weighted_tokens_per_s": round(weighted / t_charged, 1) if t_charged > 0 else None,
        "source": "measured",
        "jobs": len(jobs),
        "finished_while_full": finished,
        "full_s": round(full_s, 2),
    }


async def _part_b(s: Session, prompts: Prompts, capacity: dict, args) -> dict:
    """The interactive jobs at Poisson arrivals alone, then the same arrivals over a batch
    backlog queued at once (cancelled after)."""
    rate = args.tenants_interactive_load * capacity["requests_per_s"]
    arrivals = poisson(len(prompts.interactive), rate, args.seed)
    say(f"tenants: (b) interactive at {rate:.3g}/s alone")
    alone = await _interactive(s, "b-alone", prompts, arrivals)
    if capacity["weighted_tokens_per_s"] is None:  # the flag's: at the interactive jobs' mean cost
        costs = [_cost(j.final["usage"]) for j in alone["jobs"] if j.outcome() in ("stop", "length")]
        capacity["weighted_tokens_per_s"] = round(capacity["requests_per_s"] * sum(costs) / len(costs), 1)

    say(f"tenants: (b) {len(prompts.batch)} batch jobs, then the same arrivals")
    batch = s.jobs("b-batch", prompts.batch, "bulk", batch=True, ignore_eos=prompts.ignore_eos)
    await s.follower.send(batch, follow=False)

    async def admitted_and_served() -> bool:
        served, _ = await s.counters.read()
        return await s.client.xlen(s.fleet.stream) == 0 and served.get("batch:bulk", 0.0) > 0

    await s.until(admitted_and_served, "the batch backlog to be admitted and served")
    await asyncio.sleep(BATCH_SETTLE_S)
    preemptions = s.preemptions()
    loaded = await _interactive(s, "b-loaded", prompts, arrivals)
    preemptions = s.preemptions() - preemptions
    await s.follower.poll(batch)
    batch_done_in_run = sum(j.final is not None for j in batch)
    await s.follower.cancel(batch)
    await s.all_final(batch, "the batch backlog's cancels", poll=batch)

    batch_tokens = loaded["after"].get("batch:bulk", 0.0) - loaded["before"].get("batch:bulk", 0.0)
    idle = capacity["weighted_tokens_per_s"] * loaded["window_s"] - loaded["interactive_tokens"]
    return {
        "rate_per_s": round(rate, 3),
        "alone": alone["figures"],
        "with_batch": loaded["figures"]
        | {
            "batch_weighted_tokens": round(batch_tokens, 1),
            "idle_weighted_tokens": round(idle, 1),
            "idle_capacity_used": round(batch_tokens / idle, 3) if idle > 0 else None,
            "batch_jobs_finished": batch_done_in_run,
            "preemptions": preemptions,
        },
        "ttft_p99_over_alone": _ratio(loaded["figures"]["ttft_p99_ms"], alone["figures"]["ttft_p99_ms"]),
        "tpot_p99_over_alone": _ratio(loaded["figures"]["tpot_p99_ms"], alone["figures"]["tpot_p99_ms"]),
        "jobs": {"interactive": _accounting(alone["jobs"] + loaded["jobs"]), "batch": _accounting(batch)},
    }


async def _interactive(s: Session, label: str, prompts: Prompts, arrivals: list[float]) -> dict:
    """The interactive jobs at their arrival times, followed to their ends; the weighted
    tokens charged from the first arrival to the last end."""
    jobs = s.jobs(label, prompts.interactive, "interactive", ignore_eos=prompts.ignore_eos)
    before, _ = await s.counters.read()
    start = await s.follower.send_at(jobs, arrivals)
    await s.all_final(jobs, f"({label}) the interactive jobs")
    window = time.perf_counter() - start
    after, _ = await s.counters.read()
    tokens = after.get("interactive", 0.0) - before.get("interactive", 0.0)
    figures = latency_figures([j.record() for j in jobs])
    figures |= {"window_s": round(window, 2), "interactive_weighted_tokens": round(tokens, 1)}
    figures["outcomes"] = outcomes(jobs)
    return {"jobs": jobs, "figures": figures, "window_s": window, "before": before, "after": after,
            "interactive_tokens": tokens}  # fmt: skip


# -- (c) overload --------------------------------------------------------------------------


async def _part_c(s: Session, prompts: Prompts, capacity: dict, base_ttft_p99_ms: float | None, args) -> dict:
    """The overload at Poisson arrivals on workers with caps: how many were refused, how
    fast (request entry's id to its dead letter's, both Redis's clock, in ms), and the
    accepted jobs left unfinished TENANTS_DRAIN_S after the last arrival."""
    rate = args.tenants_overload * capacity["requests_per_s"]
    say(f"tenants: (c) {len(prompts.overload)} jobs at {rate:.3g}/s")
    jobs = s.jobs("c", prompts.overload, "overload", ignore_eos=prompts.ignore_eos)
    arrivals = poisson(len(jobs), rate, args.seed + 1)
    async with s.counters.sampling(time.perf_counter()) as samples:
        await s.follower.send_at(jobs, arrivals)
        await s.all_final(jobs, "(c)'s jobs", required=False)
    _, queued = await s.counters.read()

    sent = {j.entry_id for j in jobs}
    dead = {
        fields[b"entry_id"].decode(): _ms(entry_id)
        for entry_id, fields in await s.client.xrange(s.fleet.dead)
        if fields.get(b"code") == b"queue_full" and fields[b"entry_id"].decode() in sent
    }
    refused = [j for j in jobs if j.outcome() == "queue_full"]
    refusal_ms = [dead[j.entry_id] - _ms(j.entry_id) for j in refused if j.entry_id in dead]
    retry = [j.final["retry_after_s"] for j in refused if "retry_after_s" in j.final]
    accepted = [j for j in jobs if j.outcome() != "queue_full"]
    figures = latency_figures([j.record() for j in accepted])
    return {
        "rate_per_s": round(rate, 3),
        "jobs": _accounting(jobs),
        "refused_share": round(len(refused) / len(jobs), 3),
        "refusal_ms": {
            "p50": percentile_or_none(refusal_ms, 50, 3),
            "p99": percentile_or_none(refusal_ms, 99, 3),
            "max": max(refusal_ms, default=None),
        },
        "retry_after_s": {"p50": percentile_or_none(retry, 50, 3), "max": max(retry, default=None)},
        "dead_letters_queue_full": len(dead),
        "max_queued_seen": max((q.get("*", 0) for _, _, q in samples), default=0),
        "queued_at_end": queued.get("*", 0),
        "accepted": {
            "jobs": len(accepted),
            "unfinished": sum(j.final is None for j in accepted),
            "ttft_p50_ms": figures["ttft_p50_ms"],
            "ttft_p99_ms": figures["ttft_p99_ms"],
            "tpot_p99_ms": figures["tpot_p99_ms"],
        },
        "accepted_ttft_p99_over_b_alone": _ratio(figures["ttft_p99_ms"], base_ttft_p99_ms),
    }


# -- helpers -------------------------------------------------------------------------------


def _cost(usage: dict) -> float:
    return (
        WEIGHTS.charge_prompt_weight * usage["prompt_tokens"]
        + WEIGHTS.charge_output_weight * usage["completion_tokens"]
    )


def _accounting(jobs: list[Job]) -> dict:
    """Every job sent, by how it ended: completed (stop, length), cancelled, refused
    (queue_full, quota_exceeded), another error, or unfinished."""
    ended = Counter(j.outcome() for j in jobs)
    completed = ended["stop"] + ended["length"]
    refused = ended["queue_full"] + ended["quota_exceeded"]
    cancelled, unfinished = ended["cancelled"], ended["unfinished"]
    return {
        "sent": len(jobs),
        "completed": completed,
        "cancelled": cancelled,
        "refused": refused,
        "unfinished": unfinished,
        "other": len(jobs) - completed - cancelled - refused - unfinished,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _ms(entry_id: str | bytes) -> int:
    """A stream entry id's time part: Redis's clock when it was added, in ms."""
    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(entry_id.partition("-")[0])


SCENARIO = Scenario("tenants", run, add_arguments)
