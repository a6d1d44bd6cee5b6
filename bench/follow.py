"""Jobs queued straight on a fleet's request stream, and one follower that reads all their
reply streams (and any other stream watched, e.g. handoffs, dead letters) with one XREAD,
stamping each token as it arrives."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgpack

from bench.fleet import Fleet
from bench.metrics import RequestRecord
from service.protocol import reply_stream
from service.sdk import job_payload


@dataclass
class Job:
    label: str  # the same in every configuration
    request_id: str
    prompt: str
    max_tokens: int
    tenant: str | None = None
    batch: bool = False
    ignore_eos: bool = True
    slack_s: float | None = None  # its deadline: this long after it is sent
    sent: float | None = None  # perf_counter
    entry_id: str = ""  # the request entry's id: Redis's clock when it was added
    times: list[float] = field(default_factory=list)  # each token's arrival, perf_counter
    tokens: list[int] = field(default_factory=list)
    final: dict | None = None
    ended: float | None = None  # its final event's arrival, perf_counter
    last_id: str = "0"
    events: list[tuple[tuple[int, int], dict, float]] = field(default_factory=list)  # (entry, event, arrival)
    handoff_at: float | None = None  # its handoff entry's arrival
    staged_tokens: int | None = None  # prompt tokens its handoff carried K/V for

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.sent

    def payload(self) -> dict:
        deadline_ms = None if self.slack_s is None else int((time.time() + self.slack_s) * 1000)
        return job_payload(self.prompt, None, self.request_id, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                           tenant=self.tenant, batch=self.batch or None, deadline_ms=deadline_ms)  # fmt: skip

    def outcome(self) -> str:
        """finish_reason, the error's code, or `unfinished`."""
        if self.final is None:
            return "unfinished"
        return self.final.get("finish_reason") or self.final.get("code") or self.final["type"]

    def record(self) -> RequestRecord:
        """As a caller saw it; the end is the last token's arrival."""
        times = [t - self.sent for t in self.times]
        done = self.final is not None and self.final["type"] == "done" and bool(times)
        return RequestRecord(sent_s=0.0, chunk_times_s=times, end_s=times[-1] if times else None,
                             completion_tokens=len(times), error=None if done else self.outcome())  # fmt: skip


def outcomes(jobs: list[Job]) -> dict[str, int]:
    return dict(Counter(j.outcome() for j in jobs))


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a tuple that orders as the stream does."""
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


class Follower:
    """Queues jobs on `fleet`'s request stream and follows their replies (and the handoff
    stream) with one XREAD; a job sent with `follow=False` (a backlog) is looked up by `poll`.
    With `linger_s`, a stream is read that long after its final event (a second writer would
    show there); `retry` wraps each read."""

    def __init__(self, client, fleet: Fleet, handoff_stream: str | None = None, tag: str = "",
                 linger_s: float = 0.0, retry=None) -> None:  # fmt: skip
        self.client = client
        self.fleet = fleet
        self.tag = tag  # before each job's label in its request id
        self.linger_s = linger_s
        self.retry = retry or (lambda read: read())
        self.watched: dict[str, Callable] = {}  # stream: what reads its entries
        self.watched_last: dict[str, str] = {}  # stream: the last entry id read
        if handoff_stream:
            self.watch(handoff_stream, self._handoffs)
        self.jobs: dict[str, Job] = {}  # by request id
        self.open: dict[str, Job] = {}  # by reply stream
        self.kv_layouts: list[tuple[int, int]] = []  # (K/V bytes, tokens) of each handoff that carried them
        self.changed = asyncio.Condition()
        self.last_event = time.perf_counter()
        self._reading = True

    def job(self, label: str, prompt: str, max_tokens: int, **fields) -> Job:
        return Job(label, f"{self.tag}-{label}", prompt, max_tokens, **fields)

    def follow(self, job: Job) -> Job:
        self.jobs[job.request_id] = job
        self.open[reply_stream(job.request_id)] = job
        return job

    def watch(self, stream: str, read) -> None:
        """`read(entries, arrival)` gets every entry of `stream`, from its start."""
        self.watched[stream], self.watched_last[stream] = read, "0"

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[Follower]:
        """`read` in a task while inside."""
        self._reading = True
        reader = asyncio.create_task(self.read(), name=f"follower-{self.tag}")
        try:
            yield self
        finally:
            self._reading = False
            await asyncio.gather(reader, return_exceptions=True)

    async def send(self, jobs: list[Job], follow: bool = True) -> float:
        """Queue the jobs in one round trip; returns when they were sent."""
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            self.jobs[job.request_id] = job
            if follow:
                self.open[reply_stream(job.request_id)] = job
            pipe.xadd(self.fleet.stream, job.payload())
        sent = time.perf_counter()
        entry_ids = await pipe.execute()
        self.fleet.request_ids += [job.request_id for job in jobs]  # their replies go at the end
        for job, entry_id in zip(jobs, entry_ids):
            job.sent, job.entry_id = sent, entry_id.decode()
        return sent

    async def send_at(self, jobs: list[Job], arrivals: list[float]) -> float:
        """Each job at its arrival time (s after the first); returns when the first went."""
        start = time.perf_counter()
        for job, at in zip(jobs, arrivals):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            await self.send([job])
        return start

    async def cancel(self, jobs: list[Job]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.fleet.control, {"type": "cancel", "id": job.request_id})
        await pipe.execute()

    async def read(self) -> None:
        """Until `reading` ends (each XREAD blocks 50 ms at most: cancelling a blocked one can
        leave redis-py's connection hanging)."""
        while self._reading:
            now = time.perf_counter()
            for key, job in list(self.open.items()):
                if job.ended is not None and now - job.ended >= self.linger_s:
                    del self.open[key]
            streams = {key: job.last_id for key, job in self.open.items()}
            streams |= self.watched_last
            if not streams:  # nothing in flight (a job sent now is followed from the next round)
                await asyncio.sleep(0.01)
                continue
            reply = await self.retry(lambda: self.client.xread(streams, block=50))
            now = time.perf_counter()
            for key, entries in reply or []:
                key = key.decode()
                if key in self.watched:
                    self.watched_last[key] = entries[-1][0].decode()
                    self.watched[key](entries, now)
                else:
                    self._replies(self.open[key], entries, now)
            if reply:
                self.last_event = now
                async with self.changed:
                    self.changed.notify_all()

    def _replies(self, job: Job, entries, now: float) -> None:
        for entry_id, fields in entries:
            job.last_id = entry_id.decode()
            event = msgpack.unpackb(fields[b"data"])
            job.events.append((entry_key(job.last_id), event, now))
            if event["type"] == "token":
                job.times.extend([now] * len(event["token_ids"]))
                job.tokens.extend(event["token_ids"])
            elif job.final is None:
                job.final, job.ended = event, now

    def _handoffs(self, entries, now: float) -> None:
        from service.handoff import Handoff

        for _, fields in entries:
            handoff = Handoff.of_entry(fields)
            payload = handoff.job_fields.get(b"payload")
            job = self.jobs.get(msgpack.unpackb(payload)["id"]) if payload else None
            if job is not None and job.handoff_at is None:
                job.handoff_at = now
                job.staged_tokens = handoff.kv.num_tokens if handoff.kv else 0
            if handoff.kv is not None and handoff.kv.num_tokens:
                import torch

                itemsize = getattr(torch, handoff.kv.dtype).itemsize
                self.kv_layouts.append((math.prod(handoff.kv.shape) * itemsize, handoff.kv.num_tokens))

    async def poll(self, jobs: list[Job]) -> None:
        """Each job's final event, if it came, read from its reply stream's last entry."""
        missing = [job for job in jobs if job.final is None]
        if not missing:
            return
        pipe = self.client.pipeline(transaction=False)
        for job in missing:
            pipe.xrevrange(reply_stream(job.request_id), count=1)
        for job, rows in zip(missing, await pipe.execute()):
            if rows:
                event = msgpack.unpackb(rows[0][1][b"data"])
                if event["type"] != "token":
                    job.final = event

    async def until(self, condition, what: str, *, limit_s: float, quiet: bool = False, poll: list[Job] = (),
                    errors_fail: bool = False) -> bool:  # fmt: skip
        """Wait for `condition()` (sync or async), polling `poll`'s jobs meanwhile. Fails when a
        worker died, a job failed (with `errors_fail`) or, with `quiet`, no event came for
        `limit_s`; else returns False after `limit_s`."""
        deadline = time.perf_counter() + limit_s

        async def met() -> bool:
            result = condition()
            return await result if inspect.isawaitable(result) else result

        while not await met():
            failed = [j for j in self.jobs.values() if errors_fail and j.final and j.final["type"] == "error"]
            if failed:
                raise RuntimeError(f"{failed[0].request_id} failed: {failed[0].final.get('message')}")
            dead = self.fleet.dead_workers()
            now = time.perf_counter()
            if dead or (quiet and now - self.last_event > limit_s):
                why = f"worker {dead[0]} died" if dead else f"no event for {limit_s:.0f} s"
                raise RuntimeError(f"waiting for {what}: {why}\n{self.fleet.log_tails()}")
            if not quiet and now > deadline:
                return False
            if poll:
                await self.poll(poll)
            async with self.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), 0.5)
        return True

    async def all_final(self, jobs: list[Job], what: str, **wait) -> bool:
        return await self.until(lambda: all(j.final for j in jobs), what, **wait)


@contextlib.asynccontextmanager
async def following(client, fleet: Fleet, handoff_stream: str | None = None, tag: str = "") -> AsyncIterator[Follower]:
    """A follower reading `fleet`'s replies, once its workers and gateways are ready."""
    await asyncio.to_thread(fleet.wait_all)
    async with Follower(client, fleet, handoff_stream, tag).reading() as follower:
        yield follower
