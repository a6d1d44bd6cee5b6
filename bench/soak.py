"""`inflight bench --scenario soak`: mixed traffic on two worker processes for minutes, through
a Redis that restarts and past a worker that is SIGKILLed (with `--soak-chaos`, the faults of
bench/chaos.py at random), checked for loss and leaks; `checks` holds each figure against its
target. docs/benchmarks.md, "Soak". Requests are added with entry ids of our own, so a retried
XADD that had landed is refused, not doubled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from redis.exceptions import ResponseError

from bench.chaos import FAULTS, REDIS_STALL_S, STOP_S, Gateways, completion_body, pause
from bench.fleet import Fleet, model_flags
from bench.follow import Follower, Job, entry_key
from bench.metrics import metric_total, percentile_or_none
from bench.processes import RedisServer, WorkerProcess
from bench.scenario import D, Scenario, add_flags
from service.config import RedisConfig
from service.connect import connect
from service.protocol import reply_stream
from service.retry import retrying
from service.sdk import job_payload

CONFIG = RedisConfig()  # the default streams (inflight:requests, ...), as a deployment's
CANCEL_FRACTION = 0.05
MALFORMED_FRACTION = 0.01
HTTP_FRACTION = 0.3  # with chaos: good jobs streamed through a gateway
# When in the run the chaos strikes, as fractions of the traffic's duration.
REDIS_RESTART_AT, WORKER_KILL_AT = 0.35, 0.6
# A stream's events are still read this long after its final event: a second writer
# would show up there.
LINGER_S = 10.0
TARGET_RESUME_S = 3.0
TARGET_RSS_GROWTH = 0.05
# What Redis may keep for good after the run: the request stream and the capped
# dead-letter and control streams, no key of any one request.
FLAT_REDIS_BYTES = 256 << 10
WORDS = (
    "the sea river stone light a quiet city at night wind over old roads and we remember how numbers "
    "count from one to ten while birds sing in green fields under summer rain python code runs fast"
).split()
# Redis away (restarting, loading its file): the worker's own retry policy, waits capped at 1 s.
_retrying = functools.partial(retrying, max_delay_s=1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # A worker's RSS grows fastest in its first minutes of this traffic, hence the long warm-up.
    group = add_flags(parser, "soak scenario", {
        "--soak-minutes": (10.0, "minutes of traffic" + D),
        "--soak-warmup-s": (180.0, "RSS baseline taken this long into the traffic" + D),
        "--soak-concurrency": (40, "good jobs outstanding at once" + D),
        "--soak-max-tokens": (48, "max_tokens drawn in 1..this" + D),
        "--soak-reply-ttl-s": (60, "the workers' reply (and cancel) TTL; waited out before Redis memory is read" + D),
        "--soak-drain-s": (180.0, "after the traffic, how long jobs may take to end before they count as lost" + D),
        "--soak-kv-memory-mb": (64, "each worker's KV cache" + D),
    })  # fmt: skip
    group.add_argument("--soak-logs", type=Path, default=None, help="keep the workers' and Redis's logs in this folder")
    group.add_argument(
        "--soak-chaos", action="store_true", help="faults at random moments, and HTTP traffic through two gateways"
    )
    group.add_argument("--soak-chaos-gap-s", type=float, default=60.0, help="mean seconds between faults" + D)


async def run(args: argparse.Namespace) -> dict:
    duration = args.soak_minutes * 60
    if not 0 < args.soak_warmup_s < REDIS_RESTART_AT * duration:
        raise SystemExit(f"--soak-warmup-s must end before the Redis restart, {REDIS_RESTART_AT * duration:.0f} s in")
    with tempfile.TemporaryDirectory(prefix="inflight-soak-") as tmp:
        try:
            report = await _run(args, Path(tmp), duration)
        finally:
            if args.soak_logs is not None:  # before the temporary folder goes
                args.soak_logs.mkdir(parents=True, exist_ok=True)
                for log in Path(tmp).rglob("*.log"):
                    shutil.copy(log, args.soak_logs / log.name)
    print(format_table(report))
    return report


async def _run(args: argparse.Namespace, tmp: Path, duration: float) -> dict:
    with (
        RedisServer(tmp / "redis") as server,
        Fleet(tmp, server.url, "inflight", _worker_flags(args), graceful=True) as fleet,
    ):
        for name in ("w1", "w2"):
            fleet.start(name)
        gateways = Gateways(fleet, random.Random(args.seed), args.soak_reply_ttl_s) if args.soak_chaos else None
        client = connect(server.url, socket_timeout=10)
        try:
            await asyncio.to_thread(fleet.wait_all)  # the workers loading side by side
            return await _Soak(client, server, fleet, args, gateways).run(duration)
        finally:
            await client.aclose()


def _worker_flags(args: argparse.Namespace) -> list[str]:
    threads = max(1, (os.cpu_count() or 2) // 2)  # two workers share the machine
    # Reply streams and remembered cancels expire within the run, so Redis's memory can be read after.
    ttl = str(args.soak_reply_ttl_s)
    return [
        *model_flags(args),
        "--kv-memory-mb", str(args.soak_kv_memory_mb), "--swap-memory-mb", "64", "--max-running-requests", "8",
        "--threads", str(threads), "--ingest-poll-s", "1", "--reply-ttl-s", ttl, "--cancel-ttl-s", ttl,
    ]  # fmt: skip


class _Soak:
    def __init__(self, client, server: RedisServer, fleet: Fleet, args: argparse.Namespace, gateways=None) -> None:
        self.client = client
        self.server = server
        self.args = args
        self.gateways: Gateways | None = gateways
        self.workers = list(fleet.workers.values())
        self.killed_worker, self.survivor = self.workers
        self.http_tasks: set[asyncio.Task] = set()
        self.rng = random.Random(args.seed)
        self.counter = itertools.count()
        # Every good job's reply stream, and the dead letters, read by one XREAD through Redis's restarts.
        self.follower = Follower(client, fleet, linger_s=LINGER_S, retry=_retrying)
        self.follower.watch(CONFIG.dead_letter_stream, self._dead_letters)
        self.by_entry: dict[str, Job] = {}
        self.cancelled: dict[str, str] = {}  # request id -> queued, running or finished: when the cancel went
        self.malformed: dict[str, str] = {}  # entry id -> the code it should be dead-lettered with
        self.dead: dict[str, str] = {}  # entry id -> code, from the dead-letter stream
        self.last_entry = (0, 0)
        self.chaos: dict = {}
        self.interruptions: list[dict] = []  # each worker SIGKILL or SIGSTOP: when, and where its streams stood
        self.faults: list[dict] = []  # with chaos: each fault, its kind and when
        self.rss_samples: list[list[int]] = []  # [s after the warm-up, kB]

    async def run(self, duration: float) -> dict:
        async with self.follower.reading():
            return await self._traffic(duration)

    async def _traffic(self, duration: float) -> dict:
        memory_before = await self._used_memory()
        started = time.monotonic()
        chaos = asyncio.create_task(self._chaos(started, duration))
        async with self.gateways or contextlib.nullcontext():
            await self._produce(started + duration)
            await chaos
            await asyncio.gather(*self.http_tasks)
        traffic_s = time.monotonic() - started
        drain_deadline = time.monotonic() + self.args.soak_drain_s
        while self._outstanding() and time.monotonic() < drain_deadline:
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)  # the workers' last steps and acks
        idle = {worker.name: _engine_state(worker.metrics()) for worker in self.workers}
        rss_end = self.survivor.rss_kb()
        alive = {worker.name: worker.alive() for worker in self.workers}
        await self._until_request_keys_expire(self.args.soak_reply_ttl_s + 10)
        memory_after = await self._used_memory()
        keys_left = await self._keys_left()
        return self._report(traffic_s, idle, rss_end, alive, memory_before, memory_after, keys_left)

    def _outstanding(self) -> int:
        return sum(job.final is None for job in self.follower.open.values()) + len(self.http_tasks)

    # -- traffic -------------------------------------------------------------------------

    async def _produce(self, until: float) -> None:
        cancels = []
        while time.monotonic() < until:
            if self._outstanding() >= self.args.soak_concurrency:
                await asyncio.sleep(0.02)
                continue
            if self.rng.random() < MALFORMED_FRACTION:
                await self._send_malformed()
                continue
            if self.gateways is not None and self.rng.random() < HTTP_FRACTION:
                task = asyncio.create_task(self._send_http())
                self.http_tasks.add(task)
                task.add_done_callback(self.http_tasks.discard)
                continue
            job = await self._send_job()
            if self.rng.random() < CANCEL_FRACTION:
                running = self.rng.random() < 0.5  # else at once, most likely while it waits
                cancels.append(asyncio.create_task(self._cancel_later(job, running, self.rng.uniform(0, 1))))
        await asyncio.gather(*cancels)

    def _draw(self) -> tuple[str, dict]:
        """A prompt and its options: lengths, sampling, priority as users vary them."""
        rng = self.rng
        low, high = rng.choice(((3, 20),) * 6 + ((20, 120),) * 3 + ((120, 300),))
        text = " ".join(rng.choices(WORDS, k=rng.randint(low, high)))
        options = {
            "max_tokens": rng.randint(1, self.args.soak_max_tokens),
            "priority": rng.choice((0, 0, 0, 0, -10, -3, 3, 10)),
        }
        if rng.random() < 0.5:  # seeded sampling; greedy otherwise
            options.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
        if rng.random() < 0.5:
            options["ignore_eos"] = True
        return text, options

    def _follow(self, request_id: str) -> Job:
        return self.follower.follow(Job(request_id, request_id, "", 0))

    async def _send_http(self) -> None:
        """A streamed completion through a gateway; its reply stream is checked as the queue's are."""
        text, options = self._draw()
        await self.gateways.stream(completion_body(text, options), self._follow)

    async def _send_job(self) -> Job:
        rng = self.rng
        request_id = f"soak-{next(self.counter)}"
        text, options = self._draw()
        chat = rng.random() < 0.25
        prompt, messages = (None, [{"role": "user", "content": text}]) if chat else (text, None)
        if rng.random() < 0.5:
            fields = job_payload(prompt, messages, request_id, **options)
        else:  # a flat entry: every field a string
            fields = {
                "id": request_id,
                **({"messages": json.dumps(messages)} if chat else {"prompt": prompt}),
                **{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items()},
            }
        job = self._follow(request_id)
        job.entry_id = await self._add(fields)
        self.by_entry[job.entry_id] = job
        return job

    async def _send_malformed(self) -> None:
        request_id = f"soak-bad-{next(self.counter)}"
        good = {"id": request_id, "prompt": "The sea is", "max_tokens": "4"}
        fields, code = self.rng.choice(
            (
                ({**good, "max_tokens": "many"}, "invalid_type"),
                ({**good, "colour": "blue"}, "unknown_field"),
                ({"id": request_id, "max_tokens": "4"}, "missing_field"),
                # 0xc1 is never valid msgpack.
                ({"payload": b"\xc1" + self.rng.randbytes(self.rng.randint(0, 64))}, "malformed_payload"),
                ({**good, "reply_to": f"elsewhere:{request_id}"}, "invalid_field"),
            )
        )
        self.malformed[await self._add(fields)] = code

    async def _add(self, fields: dict) -> str:
        """XADD with an id of our own, so that a retry of a write that had landed is refused.
        An id refused as "equal or smaller" is ours only if the entry there is: the gateways
        add to the same stream, and one may have taken a later id first."""
        while True:
            ms = max(int(time.time() * 1000), self.last_entry[0])
            self.last_entry = (ms, self.last_entry[1] + 1 if ms == self.last_entry[0] else 0)
            entry_id = f"{ms}-{self.last_entry[1]}"

            async def add() -> bool:
                try:
                    await self.client.xadd(CONFIG.requests_stream, fields, id=entry_id)
                    return True
                except ResponseError as error:
                    if "equal or smaller" not in str(error):
                        raise
                there = await self.client.xrange(CONFIG.requests_stream, entry_id, entry_id)
                return bool(there) and there[0][1] == {_bytes(k): _bytes(v) for k, v in fields.items()}

            if await _retrying(add):
                return entry_id
            last = await _retrying(lambda: self.client.xrevrange(CONFIG.requests_stream, count=1))
            if last:  # after the stream's last entry
                self.last_entry = max(self.last_entry, entry_key(last[0][0].decode()))

    async def _cancel_later(self, job: Job, running: bool, delay: float) -> None:
        while running and not job.tokens and not job.final:
            await asyncio.sleep(0.05)
        await asyncio.sleep(delay)
        self.cancelled[job.request_id] = "finished" if job.final else "running" if job.tokens else "queued"
        await _retrying(lambda: self.client.xadd(CONFIG.control_stream, {"type": "cancel", "id": job.request_id}))

    def _dead_letters(self, entries, _) -> None:
        self.dead.update((fields[b"entry_id"].decode(), fields[b"code"].decode()) for _, fields in entries)

    # -- chaos ---------------------------------------------------------------------------

    async def _chaos(self, started: float, duration: float) -> None:
        await _sleep_until(started + self.args.soak_warmup_s)
        self.chaos["rss_warm_kb"] = self.survivor.rss_kb()
        sampler = asyncio.create_task(self._sample_rss(started + duration))
        if self.args.soak_chaos:
            await self._random_faults(started, started + duration)
        else:
            await _sleep_until(started + REDIS_RESTART_AT * duration)
            down = time.monotonic()
            await self._fault("redis_restart")
            self.chaos["redis_restart_at_s"] = down - started
            self.chaos["redis_down_s"] = time.monotonic() - down
            await _sleep_until(started + WORKER_KILL_AT * duration)
            self.chaos["worker_kill_at_s"] = time.monotonic() - started
            await self._fault("worker_kill")
        await sampler

    async def _random_faults(self, started: float, until: float) -> None:
        """One fault at a time, each kind in turn at first (so a short run sees all five),
        then drawn; exponential gaps around --soak-chaos-gap-s."""
        kinds = list(FAULTS)
        self.rng.shuffle(kinds)
        while True:
            await asyncio.sleep(self.rng.expovariate(1 / self.args.soak_chaos_gap_s))
            if time.monotonic() >= until:
                return
            kind = kinds.pop() if kinds else self.rng.choice(FAULTS)
            at = time.monotonic()
            detail = await self._fault(kind)
            self.faults.append(
                {"kind": kind, "at_s": round(at - started, 1), "took_s": round(time.monotonic() - at, 1)}
            )
            if detail:
                self.faults[-1]["detail"] = detail

    async def _fault(self, kind: str):
        worker = self.killed_worker
        if kind == "worker_kill":  # while it streams, then started again under its name
            streaming = await self._streaming(worker)
            worker.kill()
            killed_at = time.monotonic()
            await self._mark(streaming, "kill")  # it is dead: what its streams hold now is all it published
            worker.start()
            await asyncio.to_thread(worker.wait_ready)
            self.chaos["worker_restart_s"] = time.monotonic() - killed_at
        elif kind == "worker_stop":
            streaming = await self._streaming(worker)
            paused = pause(worker.process.pid, self.rng.uniform(*STOP_S))
            await self._mark(streaming, "stop")
            await paused
        elif kind == "gateway_kill":
            return await self.gateways.kill_one()
        elif kind == "redis_restart":
            await asyncio.to_thread(self.server.stop)
            await asyncio.to_thread(self.server.start)
        elif kind == "redis_stall":
            await pause(self.server.process.pid, REDIS_STALL_S)

    async def _sample_rss(self, until: float) -> None:
        """The survivor's RSS through the run: does it level off or keep growing?"""
        start = time.monotonic()
        while time.monotonic() < until:
            self.rss_samples.append([round(time.monotonic() - start), self.survivor.rss_kb()])
            await asyncio.sleep(max(1.0, (until - start) / 20))

    async def _streaming(self, worker: WorkerProcess) -> list[Job]:
        """The jobs the worker holds that have tokens and no end yet (waits up to 30 s for one)."""
        deadline = time.monotonic() + 30
        while True:
            pending = await _retrying(
                lambda: self.client.xpending_range(
                    CONFIG.requests_stream, CONFIG.group, "-", "+", 1000, consumername=worker.name
                )
            )
            held = [self.by_entry.get(row["message_id"].decode()) for row in pending]
            streaming = [job for job in held if job is not None and job.tokens and job.final is None]
            if streaming or time.monotonic() > deadline:
                return streaming
            await asyncio.sleep(0.1)

    async def _mark(self, streaming: list[Job], kind: str) -> None:
        """Where each stream stood when its worker was interrupted (now, on the follower's clock)."""
        at = time.perf_counter()
        async with self.client.pipeline(transaction=False) as pipe:
            for job in streaming:
                pipe.xrevrange(reply_stream(job.request_id), count=1)
            last = await _retrying(pipe.execute)
        streams = {
            job.request_id: entry_key(rows[0][0].decode())
            for job, rows in zip(streaming, last)
            if rows and rows[0][1][b"type"] == b"token"
        }
        self.interruptions.append({"kind": kind, "at": at, "streams": streams})

    # -- the figures ---------------------------------------------------------------------

    async def _used_memory(self) -> dict:
        info = await _retrying(lambda: self.client.info("memory"))
        keys = await _retrying(self.client.dbsize)  # expired keys not yet reclaimed count here
        return {"keys": keys} | {
            k: info[k] for k in ("used_memory", "used_memory_dataset", "used_memory_overhead", "used_memory_scripts")
        }

    async def _until_request_keys_expire(self, at_most_s: float) -> None:
        """Until every reply stream has been read for its linger past its final event and no
        key of any one request (its `{...}` hash tag: reply streams, cancels) is left, their
        TTLs run out (SCAN reclaims the expired keys it meets); or for `at_most_s`."""
        deadline = time.monotonic() + at_most_s
        while time.monotonic() < deadline:
            if not self.follower.open and not [k async for k in self.client.scan_iter(match="*{*", count=1000)]:
                return
            await asyncio.sleep(0.5)

    async def _keys_left(self) -> dict:
        """What Redis still holds, by key pattern (a request id's hash tag as `{*}`)."""
        keys: dict[str, dict] = {}
        async for key in self.client.scan_iter(count=1000):
            pattern = re.sub(r"\{[^}]*\}", "{*}", key.decode(errors="replace"))
            kind = keys.setdefault(pattern, {"keys": 0, "bytes": 0, "longest_ttl_s": -1})
            kind["keys"] += 1
            kind["bytes"] += await self.client.memory_usage(key) or 0
            kind["longest_ttl_s"] = max(kind["longest_ttl_s"], await self.client.ttl(key))
        return keys

    def _kill_figures(self) -> dict:
        """From each SIGKILL (or SIGSTOP) to the next token of each stream the worker was serving."""
        waits, per_stream = [], {}
        for interruption in self.interruptions:
            for request_id, mark in interruption["streams"].items():
                job = self.follower.jobs[request_id]
                later = [at for entry, _, at in job.events if entry > mark]
                waits.append(later[0] - interruption["at"] if later else None)
                per_stream[job.request_id] = {
                    "after": interruption["kind"],
                    "next_token_s": waits[-1],
                    "finished_by": (job.final or {}).get("worker"),
                }
        resumed = [s for s in waits if s is not None]
        return {
            "streams": len(waits),
            "not_resumed": len(waits) - len(resumed),
            "next_token_p50_s": percentile_or_none(resumed, 50),
            "next_token_p99_s": percentile_or_none(resumed, 99),
            "next_token_max_s": max(resumed) if resumed else None,
            "per_stream": per_stream,
            "worker_restart_s": self.chaos.get("worker_restart_s"),
            "at_s": self.chaos.get("worker_kill_at_s"),
        }

    def _report(self, traffic_s, idle, rss_end, alive, memory_before, memory_after, keys_left) -> dict:
        jobs = list(self.follower.jobs.values())
        finals = [job.final for job in jobs if job.final]
        reasons = Counter(final["finish_reason"] for final in finals if final["type"] == "done")
        ended = {job.request_id: (job.final or {}).get("finish_reason") for job in jobs}
        ended_by_cancel = [request_id for request_id in self.cancelled if ended[request_id] == "cancelled"]
        dead_codes = {entry: self.dead.get(entry) for entry in self.malformed}  # None: not dead-lettered
        kv_in_use = {name: state["kv_blocks_used"] for name, state in idle.items()}
        rss_warm = self.chaos["rss_warm_kb"]
        figures = {
            "traffic_s": traffic_s,
            "jobs": {
                "sent": len(jobs),
                "completed": reasons["stop"] + reasons["length"],
                "cancelled": reasons["cancelled"],
                "finish_reasons": dict(reasons),
                "errors": dict(Counter(final["code"] for final in finals if final["type"] == "error")),
                "lost": sum(job.final is None for job in jobs),
                "lost_samples": [job.request_id for job in jobs if job.final is None][:10],
            },
            # By where the job was when the cancel went out.
            "cancels_sent": dict(Counter(self.cancelled.values())),
            "cancels_that_ended_the_job": dict(Counter(self.cancelled[r] for r in ended_by_cancel)),
            "malformed": {
                "sent": len(self.malformed),
                "without_dead_letter": sum(code is None for code in dead_codes.values()),
                "wrong_code": sum(code not in (None, self.malformed[entry]) for entry, code in dead_codes.items()),
            },
            "dead_letters_by_code": dict(Counter(self.dead.values())),
            "good_jobs_dead_lettered": len({job.entry_id for job in jobs} & self.dead.keys()),
            "seqs": _seq_faults(jobs),
            "kill": self._kill_figures(),
            "redis_restart": {"at_s": self.chaos.get("redis_restart_at_s"), "down_s": self.chaos.get("redis_down_s")},
            "faults": self.faults,
            "faults_by_kind": dict(Counter(fault["kind"] for fault in self.faults)),
            "http": self.gateways.figures() if self.gateways is not None else None,
            "idle_at_end": idle,
            "kv_blocks_in_use_at_end": kv_in_use,
            "workers_alive_at_end": alive,
            "rss_kb": {
                "worker": self.survivor.name,
                "after_warmup": rss_warm,
                "end": rss_end,
                "growth": rss_end / rss_warm - 1,
                "samples_after_warmup_s_kb": self.rss_samples,
            },
            # The keys' share (dataset) apart from the server's own (clients, scripts, buffers).
            "redis_used_memory": {
                "before": memory_before["used_memory"],
                "after": memory_after["used_memory"],
                "growth_bytes": memory_after["used_memory"] - memory_before["used_memory"],
                "dataset_growth_bytes": memory_after["used_memory_dataset"] - memory_before["used_memory_dataset"],
                "info_before": memory_before,
                "info_after": memory_after,
                "keys_left": keys_left,
            },
        }
        seqs, kill = figures["seqs"], figures["kill"]
        resumed_in_time = (
            kill["streams"] > 0 and kill["not_resumed"] == 0 and kill["next_token_max_s"] <= TARGET_RESUME_S
        )
        figures["checks"] = {
            "no_job_lost": figures["jobs"]["lost"] == 0,
            "seqs_exact": seqs["duplicate"] == seqs["missing"] == seqs["events_after_final"] == 0,
            "resumed_within_3s": resumed_in_time,
            "no_kv_block_leaked": all(v == 0 for v in kv_in_use.values()),
            "rss_growth_under_5pct": figures["rss_kb"]["growth"] < TARGET_RSS_GROWTH,
            # used_memory itself also moves with the server's own buffers and scripts.
            "redis_memory_flat": sum(k["bytes"] for k in keys_left.values()) < FLAT_REDIS_BYTES
            and not any("{" in pattern for pattern in keys_left),
            "malformed_all_dead_lettered": figures["malformed"]["without_dead_letter"] == 0,
            "workers_up": all(alive.values()),
        }
        if self.gateways is not None:
            http = figures["http"]
            figures["checks"]["http_streams_resumed_exactly"] = (
                http["broken_without_resumption"] == http["duplicate_events"] == http["out_of_order"] == 0
            )
        return figures


def _seq_faults(jobs: list[Job]) -> dict:
    """What exactly-once delivery rules out, counted over every job's reply stream."""
    faults = dict.fromkeys(("duplicate", "missing", "events_after_final", "usage_mismatch"), 0)
    for job in jobs:
        seqs = [event["seq"] for _, event, _ in job.events if event["type"] == "token"]
        faults["duplicate"] += len(seqs) - len(set(seqs))
        faults["missing"] += (max(seqs) + 1 - len(set(seqs))) if seqs else 0
        ends = [i for i, (_, event, _) in enumerate(job.events) if event["type"] != "token"]
        faults["events_after_final"] += len(job.events) - 1 - ends[0] if ends else 0
        if job.final and job.final["type"] == "done":
            faults["usage_mismatch"] += job.final["usage"]["completion_tokens"] != len(set(seqs))
    return faults


# The table's rows: (check, what, what was measured as a format of the figures, the target).
TABLE = (
    ("no_job_lost", "jobs lost", "{jobs[lost]} of {jobs[sent]}", "0"),
    ("seqs_exact", "duplicate / missing seqs",
     "{seqs[duplicate]} / {seqs[missing]} ({seqs[events_after_final]} after final)", "0 / 0"),
    ("resumed_within_3s", "kill to next token p50 / max",
     "{p50} / {max} ({kill[streams]} streams, {kill[not_resumed]} not resumed)", "<= 3 s"),
    ("no_kv_block_leaked", "KV blocks in use when idle", "{kv_blocks_in_use_at_end}", "0"),
    ("rss_growth_under_5pct", "RSS growth after warm-up",
     "{rss_kb[growth]:+.1%} ({rss_kb[after_warmup]} -> {rss_kb[end]} kB)", "< 5%"),
    ("redis_memory_flat", "Redis used_memory",
     "{redis_used_memory[before]} -> {redis_used_memory[after]} B ({redis_used_memory[growth_bytes]:+d}); "
     "keys left {keys_left}", "flat: no request's key left"),
    ("malformed_all_dead_lettered", "malformed without dead letter",
     "{malformed[without_dead_letter]} of {malformed[sent]}", "0"),
    ("http_streams_resumed_exactly", "HTTP streams broken / events twice",
     "{http[broken_without_resumption]} / {http[duplicate_events]} of {http[sent]} "
     "({http[resumed]} resumed after a gateway died, {http[errors]} error answers)", "0 / 0"),
)  # fmt: skip


def format_table(figures: dict) -> str:
    """The checks, one line each: measured against the target."""
    jobs, kill = figures["jobs"], figures["kill"]

    def seconds(value) -> str:
        return "-" if value is None else f"{value:.2f} s"

    values = figures | {
        "p50": seconds(kill["next_token_p50_s"]),
        "max": seconds(kill["next_token_max_s"]),
        "keys_left": {k: v["bytes"] for k, v in figures["redis_used_memory"]["keys_left"].items()},
    }
    shown = [row for row in TABLE if row[0] in figures["checks"]]
    rows = [(check, what, measured.format(**values), target) for check, what, measured, target in shown]
    width = max(len(what) for _, what, _, _ in rows)
    lines = [
        f"soak: {figures['traffic_s']:.0f} s of traffic; {jobs['completed']} completed, {jobs['cancelled']} cancelled, "
        f"errors {jobs['errors']}, dead letters {figures['dead_letters_by_code']}"
    ]
    for check, what, measured, target in rows:
        mark = "ok " if figures["checks"][check] else "FAIL"
        lines.append(f"  {mark} {what:<{width}}  {measured}  (target {target})")
    return "\n".join(lines)


def _engine_state(metrics: dict) -> dict:
    """KV blocks in use (both pools) and requests in the engine, from a worker's /metrics."""
    return {
        "kv_blocks_used": int(metric_total(metrics, "inflight_kv_cache_blocks", state="used")),
        "requests_in_engine": int(metric_total(metrics, "inflight_scheduler_requests")),
    }


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


async def _sleep_until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.monotonic()))


SCENARIO = Scenario("soak", run, add_arguments)
