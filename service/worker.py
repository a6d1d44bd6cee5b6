"""The worker: jobs from the request stream into the engine, events out to reply streams.

The event loop (asyncio, uvloop in production) does the Redis I/O; the engine steps in
its own thread (`AsyncEngine`), so reads and publishes never wait for a forward pass.
The claim loop here only reads, holds and leases entries: it holds at most `capacity`
jobs at a time (backpressure: idle workers get the rest), each in a task of its own
that serves it top to bottom (`JobRunner`, service/job_runner.py), and keeps their
leases alive while it holds them (service/leases.py). Beside them run the outbox, the
control stream's cancels (service/control.py) and the housekeeping
(service/housekeeping.py).

Two strategies are chosen once, here, from the config: where jobs come from (the
request stream, or the fair queue's tenant queues: service/intake.py), and the role
(whole jobs, prefill or decode: service/roles.py).

Stopping: when `stop` is set the worker claims nothing more, finishes what it holds
within `shutdown_grace_s`, and leaves the rest pending (unacked) for another worker;
`run` returns the request ids it left. Redis being away does not stretch the stop
(service/stopping.py).

Observability: the engine's observer feeds `Metrics` after every step; the worker adds
each request's outcome and timings as it ends, the tokens it serves each tenant and the
jobs it refuses at admission, and polls Redis for the ingest lag (with fair queueing,
also for the tenant queues). Each served request logs one summary line, with its id and
priority bound as context.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any

import structlog

from service.adapter_loader import AdapterLoader
from service.cancels import CancelRegistry
from service.config import DisaggConfig, FairQueueConfig, RedisConfig
from service.control import Control
from service.held import Held, HeldEntries
from service.housekeeping import keep_house
from service.ingest import Entry
from service.intake import intake_for
from service.job_runner import JobRunner
from service.leases import renew_leases
from service.metrics import Metrics
from service.outbox import ReplyOutbox
from service.protocol import Job
from service.publish import ReplyPublisher
from service.roles import reads_from, role_for
from service.settling import Settling
from service.stopping import WIND_DOWN_S, unless_stopped
from workers.api import Event, FinalEvent
from workers.async_engine import AsyncEngine
from workers.engine import Engine

log = structlog.get_logger("inflight.worker")


class Worker:
    def __init__(
        self,
        engine: Engine,
        redis,
        config: RedisConfig,
        metrics: Metrics | None = None,
        ingest_poll_s: float = 5.0,
        log_prompts: bool = False,
        disagg: DisaggConfig = DisaggConfig(),
        fair_queue: FairQueueConfig = FairQueueConfig(),
    ) -> None:
        scheduler = engine.config.scheduler
        # The adapters' registry sits beside the request stream, whichever stream this role reads.
        requests_stream = config.requests_stream
        self.config = config = reads_from(config, disagg)
        self.redis = redis
        self.metrics = metrics or Metrics(scheduler)
        self.ingest_poll_s = ingest_poll_s
        self.log_prompts = log_prompts  # prompts and outputs in the summary line: opt-in
        self.publisher = ReplyPublisher(redis, config.reply_ttl_s, config.consumer)
        self.outbox = ReplyOutbox(self.publisher, self.metrics.observe_publish_lag)
        self.front = AsyncEngine(engine, self._on_events)
        self.front.observe_steps(self.metrics.observe_step)
        self.held: HeldEntries = {}  # by entry id
        self.jobs: dict[str, Job] = {}  # by entry id, while their events flow (for charges and metrics)
        self.cancels = CancelRegistry(config.cancel_ttl_s)
        self.adapters = AdapterLoader(redis, requests_stream, engine, self.metrics)
        self.control = Control(redis, config, self.cancels, self.held, self.front, self.adapters)
        self.intake = intake_for(redis, config, scheduler, fair_queue, disagg, self.metrics, self.publisher, self.front)
        self.reader = self.intake.reader
        self.capacity = self.intake.capacity
        self.takeover_allowance = scheduler.takeover_allowance
        self.settling = Settling(self.publisher, self.metrics, self.reader, self.held)
        self.role = role_for(disagg, self.settling, self.front, redis, config, self.metrics)
        self.handoffs = self.role.handoffs  # None unless prefill or decode
        self._wind_down_until = 0.0  # set when the grace period ends

    async def run(self, stop: asyncio.Event) -> list[str]:
        """Serve until `stop` is set; then finish what is in hand within the grace period.
        Returns the ids of the requests left pending, for another worker to continue."""
        await unless_stopped(stop, self._prepare)
        if stop.is_set():
            return []
        # What exists by now (modules, the model) lives as long as the process. Frozen out
        # of the garbage collector's passes, a full pass no longer walks it all, holding
        # the GIL for a long pause that the stepping thread and the publishing both wait on.
        gc.freeze()
        runner = self._job_runner()
        async with self.front:
            background = [asyncio.create_task(work, name=name) for name, work in self._background(stop).items()]
            try:
                await self._claim_until(stop, runner)
                return await self._drain()
            finally:
                for task in background:
                    task.cancel()
                await asyncio.wait(background, timeout=max(self._wind_down_left(), 0.1))
                await self.intake.close()

    async def _prepare(self) -> None:
        await self.reader.ensure_group()
        await self.control.load()
        await self.adapters.publish_loaded()

    def _job_runner(self) -> JobRunner:
        # Made when the worker starts, with the parts it has then (a benchmark may swap
        # the outbox in between).
        return JobRunner(
            config=self.config,
            role=self.role,
            intake=self.intake,
            settling=self.settling,
            publisher=self.publisher,
            outbox=self.outbox,
            front=self.front,
            cancels=self.cancels,
            metrics=self.metrics,
            held=self.held,
            jobs=self.jobs,
            log_prompts=self.log_prompts,
        )

    def _background(self, stop: asyncio.Event) -> dict[str, Coroutine[Any, Any, None]]:
        """The tasks beside the jobs, by name."""
        return {
            "outbox": self.outbox.run(),
            "control": self.control.follow(),
            "leases": renew_leases(self.reader, self.held, self.config),
            "housekeeping": keep_house(self.redis, self.config, self.intake, self.cancels, self.ingest_poll_s),
            **self.intake.background(self.held, stop),
            **self.role.background(),
        }

    # -- the claim loop ----------------------------------------------------------------

    async def _claim_until(self, stop: asyncio.Event, runner: JobRunner) -> None:
        while not stop.is_set():
            wanted = self.intake.next_read(self.held)
            if wanted is None:
                entries = await self._take_over_when_full(stop)
            else:
                entries = await unless_stopped(stop, lambda: self.intake.read(wanted, self.held)) or []
            if entries:
                await unless_stopped(stop, self.control.catch_up)
            if stop.is_set():
                return  # anything read but not started stays pending, for a restart or another worker
            for entry in entries:
                self._hold(entry, runner)

    async def _take_over_when_full(self, stop: asyncio.Event) -> list[Entry]:
        """Full: wait for a job to end, and meanwhile look for jobs a dead worker left,
        up to the takeover allowance beyond `capacity` (their streams stalled mid-answer:
        they must not wait for room here)."""
        wait_ms = self.config.block_ms
        if self.capacity + self.takeover_allowance > len(self.held):  # a takeover could follow the wait
            wait_ms = await unless_stopped(stop, lambda: self.reader.lease_wait_ms(wait_ms)) or wait_ms
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait(
            [stopping, *(held.task for held in self.held.values())],
            timeout=wait_ms / 1000,
            return_when=asyncio.FIRST_COMPLETED,
        )
        stopping.cancel()
        extra = self.capacity + self.takeover_allowance - len(self.held)
        if stop.is_set() or extra <= 0 or len(self.held) < self.capacity:
            return []
        return await unless_stopped(stop, lambda: self.reader.takeovers(extra, self.held)) or []

    def _hold(self, entry: Entry, runner: JobRunner) -> None:
        task = asyncio.create_task(runner.run(entry), name=f"job-{entry.entry_id}")
        self.held[entry.entry_id] = Held(task, batch=self.intake.is_batch(entry.entry_id))
        task.add_done_callback(lambda done: self._unhold(entry.entry_id, done))

    def _unhold(self, entry_id: str, task: asyncio.Task) -> None:
        self.held.pop(entry_id, None)
        self.intake.ended(entry_id)
        if not task.cancelled() and task.exception() is not None:  # never silently
            log.error("job_task_failed", entry_id=entry_id, exc_info=task.exception())

    # -- stopping ----------------------------------------------------------------------

    async def _drain(self) -> list[str]:
        """Give what is held `shutdown_grace_s` to finish; cancel the rest (no final event,
        no ack: it stays pending) and return the request ids left. Winding down after
        the grace period takes at most `WIND_DOWN_S` in all."""
        tasks = [held.task for held in self.held.values()]
        unfinished: set[asyncio.Task] = set()
        if tasks:
            _, unfinished = await asyncio.wait(tasks, timeout=self.config.shutdown_grace_s)
        left = sorted(held.request_id or entry_id for entry_id, held in self.held.items() if held.task in unfinished)
        for task in unfinished:
            task.cancel()
        self._wind_down_until = asyncio.get_running_loop().time() + WIND_DOWN_S
        if unfinished:
            await asyncio.wait(unfinished, timeout=self._wind_down_left())
        idle = asyncio.create_task(self.front.idle())  # the engine drops what was cancelled on its next step
        await asyncio.wait([idle], timeout=self._wind_down_left())
        idle.cancel()
        return left

    def _wind_down_left(self) -> float:
        return max(0.0, self._wind_down_until - asyncio.get_running_loop().time())

    # -- the step's events -------------------------------------------------------------

    def _on_events(self, events: list[Event]) -> None:
        """A step's events: to the outbox, and each output token counted as served to its
        tenant (and, with fair queueing, charged to it)."""
        self.outbox.on_events(events)
        output_tokens: dict[tuple[str, bool], int] = defaultdict(int)  # by tenant and class
        now = time.monotonic()
        for event in events:
            job = self.jobs.get(event.request_id)
            if job is not None and not isinstance(event, FinalEvent):
                output_tokens[job.tenant, job.batch] += len(event.token_ids)
                self.intake.produced(event.request_id, job, len(event.token_ids), now)
        # Once per tenant and class a step, not per event: a step at GPU rates has hundreds.
        for (tenant, batch), num_tokens in output_tokens.items():
            self.metrics.observe_tenant_tokens(tenant, batch, "output", num_tokens)
