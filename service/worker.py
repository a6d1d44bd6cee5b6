"""The worker: jobs from the request stream into the engine, events out to reply streams.

The event loop (asyncio, uvloop in production) does the Redis I/O; the engine steps in
its own thread (`AsyncEngine`), so reads and publishes never wait for a forward pass.
It holds at most `capacity` jobs at a time (backpressure: idle workers get the rest),
each in a task of its own, and keeps their leases alive while it holds them. Each job:
1. is decoded (a bad one gets an `error` reply when its reply stream can be named, and
   always a dead letter);
2. claims its reply stream (`ReplyPublisher.claim`): a stream that belongs to another
   job makes this one a `duplicate_id` dead letter;
3. is cancelled without running if the control stream asked for it, or continues where
   a reply stream already stops (a takeover): the engine resumes the request from the
   published tokens (`resumed_output_ids`), and `seq` goes on from the last one;
4. has its events written by the outbox (`service/outbox.py`: every step's events in
   one pipelined round trip, each stream's writes fenced), and is acked and deleted once
   its final event has landed. A worker that lost the job (its lease ran out and another worker
   took it over) is refused on its next write, or told by its next lease renewal, and
   stops generating it.
A Redis error that concerns one job (WRONGTYPE, NOPERM, OOM) fails that job only.

Stopping: when `stop` is set the worker claims nothing more, finishes what it holds
within `shutdown_grace_s`, and leaves the rest pending (unacked) for another worker;
`run` returns the request ids it left. Redis being away does not stretch the stop.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import structlog
from redis.exceptions import RedisError

from service.cancels import CancelRegistry, stream_id
from service.config import DisaggConfig, FairQueueConfig, RedisConfig
from service.fair_queue import Admission, Charges, FairQueueReader, Refusal
from service.handoff import Handoff, Handoffs
from service.ingest import Entry, JobReader
from service.metrics import Metrics
from service.outbox import ReplyOutbox
from service.protocol import Job, ProtocolError, decode_job
from service.publish import LeaseLost, ReplyPublisher
from service.retry import is_transient, retrying
from service.slot_outlook import SlotOutlook
from service.structured_logging import bind_request, log_request_finished
from workers.api import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    FinalEvent,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    Timings,
    Usage,
)
from workers.async_engine import AsyncEngine
from workers.engine import Engine
from workers.model_loader import encode_prompt

log = structlog.get_logger("inflight.worker")

T = TypeVar("T")
# How long cancelled tasks and the engine get, in all, to wind down once the grace
# period is over (cancelled tasks end at their next await; the engine drops their
# requests on its next step).
WIND_DOWN_S = 1.0
# How often a lease renewal is tried while Redis is away.
RENEW_RETRY_S = 0.05
# How long a worker holding its most batch jobs waits for an interactive one before it
# looks again (a batch job may have ended meanwhile).
BATCH_POLL_MS = 100


@dataclass
class Held:
    """A request-stream entry this worker holds, and the task serving it."""

    task: asyncio.Task
    request_id: str | None = None  # known once the entry is decoded
    submitted: bool = False  # in the engine, under the entry id
    settling: bool = False  # being acked or dead-lettered: renewals no longer find it
    batch: bool = False  # a batch job (known once decoded)


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
        self.role = disagg.role
        if self.role == "decode":  # it serves what prefill workers hand off
            config = replace(config, requests_stream=disagg.handoff_stream)
        self.config = config
        self.disagg = disagg
        self.metrics = metrics or Metrics(engine.config.scheduler)
        engine.observer = self.metrics.observe_step
        self.ingest_poll_s = ingest_poll_s
        self.log_prompts = log_prompts  # prompts and outputs in the summary line: opt-in
        self.publisher = ReplyPublisher(redis, config.reply_ttl_s, config.consumer)
        self.outbox = ReplyOutbox(self.publisher, self.metrics.observe_publish_lag)
        self.front = AsyncEngine(engine, self._on_events)
        # With fair queueing (not on a decode worker: handoffs are internal) jobs are
        # admitted from the request stream into tenant queues and taken from there.
        self.admission = self.charges = self.outlook = None
        if fair_queue.enabled and self.role != "decode":
            scheduler = engine.config.scheduler
            priority_step_s = scheduler.priority_bound_s / (PRIORITY_MAX - PRIORITY_MIN)
            self.reader = FairQueueReader(redis, config, fair_queue, priority_step_s)
            self.admission = Admission(redis, config, fair_queue, self._admissible, self._refuse)
            self.charges = Charges(redis, config.requests_stream, fair_queue)
        else:
            self.reader = JobReader(redis, config)
        self.jobs: dict[str, Job] = {}  # by entry id, while their events flow (for charges and metrics)
        self.cancels = CancelRegistry(config.cancel_ttl_s)
        self.redis = redis
        # By default enough queued work to keep the batcher full, no more. With fair
        # queueing the order is decided in Redis, so hold no more than runs: a job held
        # beyond that waits for a running one to end, in this worker's order, not the
        # fleet's; taken when a slot frees, it misses at most one step.
        max_running = engine.config.scheduler.max_running_requests
        default_capacity = max_running if self.admission is not None else 2 * max_running
        self.capacity = config.max_held_jobs or default_capacity
        if self.admission is not None and fair_queue.max_queue_wait_s > 0:  # admission judges waits by it
            self.outlook = SlotOutlook(redis, config.requests_stream, config.consumer, self.capacity)
        self.takeover_allowance = engine.config.scheduler.takeover_allowance
        self.max_running_batch = engine.config.scheduler.max_running_batch
        self.held: dict[str, Held] = {}  # by entry id
        self.handoffs = Handoffs(redis, disagg, config.consumer, self.metrics) if self.role != "both" else None
        self._wind_down_until = 0.0  # set when the grace period ends

    async def run(self, stop: asyncio.Event) -> list[str]:
        """Serve until `stop` is set; then finish what is in hand within the grace period.
        Returns the ids of the requests left pending, for another worker to continue."""
        await _unless_stopped(stop, self._prepare)
        if stop.is_set():
            return []
        # What exists by now (modules, the model) lives as long as the process. Frozen out
        # of the garbage collector's passes, a full pass no longer walks it all, holding
        # the GIL for a long pause that the stepping thread and the publishing both wait on.
        gc.freeze()
        async with self.front:
            background = [
                asyncio.create_task(self.outbox.run(), name="outbox"),
                asyncio.create_task(self._follow_control(), name="control"),
                asyncio.create_task(self._renew_leases(), name="leases"),
                asyncio.create_task(self._housekeeping(), name="housekeeping"),
            ]
            if self.admission is not None:
                background.append(asyncio.create_task(self._admit(stop), name="admission"))
                background.append(asyncio.create_task(self.charges.run(), name="charges"))
            if self.outlook is not None:
                background.append(asyncio.create_task(self.outlook.run(self.held, stop), name="outlook"))
            if self.handoffs is not None:
                self.front.engine.handoff_arena = self.handoffs.arena
                background.append(asyncio.create_task(self._keep_handoffs(), name="handoffs"))
            try:
                await self._claim_until(stop)
                return await self._drain()
            finally:
                for task in background:
                    task.cancel()
                await asyncio.wait(background, timeout=max(self._wind_down_left(), 0.1))
                if self.charges is not None:
                    await asyncio.wait([asyncio.create_task(self.charges.flush())], timeout=1.0)

    async def _prepare(self) -> None:
        await self.reader.ensure_group()
        await self._load_cancels()

    async def _claim_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            room = self.capacity - len(self.held)
            held_batch = sum(held.batch for held in self.held.values())
            interactive_room = self.capacity - (len(self.held) - held_batch)
            fair, cap = self.admission is not None, self.max_running_batch
            batch_full = 0 < cap <= held_batch
            if fair and interactive_room > 0 and (room <= 0 < held_batch or batch_full):
                # Full, but partly of batch jobs (interactive jobs never wait behind them),
                # or holding as many batch jobs as may run: then one may end any moment.
                block_ms = min(self.config.block_ms, BATCH_POLL_MS) if batch_full else self.config.block_ms
                entries = await _unless_stopped(
                    stop, lambda: self.reader.read(interactive_room, block_ms, self.held, max_batch=0)
                )
            elif room <= 0:
                entries = await self._take_over_when_full(stop)
            else:
                batch_room = {"max_batch": cap - held_batch} if fair and cap else {}
                entries = await _unless_stopped(
                    stop, lambda: self.reader.read(room, self.config.block_ms, self.held, **batch_room)
                )
            if entries:
                await _unless_stopped(stop, self._catch_up_cancels)
            if stop.is_set():
                return  # anything read but not started stays pending, for a restart or another worker
            for entry in entries:
                self._hold(entry)

    async def _take_over_when_full(self, stop: asyncio.Event) -> list[Entry]:
        """Full: wait for a job to end, and meanwhile look for jobs a dead worker left,
        up to the takeover allowance beyond `capacity` (their streams stalled mid-answer:
        they must not wait for room here)."""
        wait_ms = self.config.block_ms
        if self.capacity + self.takeover_allowance > len(self.held):  # a takeover could follow the wait
            wait_ms = await _unless_stopped(stop, lambda: self.reader.lease_wait_ms(wait_ms)) or wait_ms
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait(
            [stopping, *(h.task for h in self.held.values())],
            timeout=wait_ms / 1000,
            return_when=asyncio.FIRST_COMPLETED,
        )
        stopping.cancel()
        extra = self.capacity + self.takeover_allowance - len(self.held)
        if stop.is_set() or extra <= 0 or len(self.held) < self.capacity:
            return []
        return await _unless_stopped(stop, lambda: self.reader.takeovers(extra, self.held)) or []

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
        while self.front.engine.has_unfinished() and self._wind_down_left() > 0:
            await asyncio.sleep(0.01)  # the engine drops what was cancelled on its next step
        return left

    def _wind_down_left(self) -> float:
        return max(0.0, self._wind_down_until - asyncio.get_running_loop().time())

    # -- one job -----------------------------------------------------------------------

    def _hold(self, entry: Entry) -> None:
        task = asyncio.create_task(self._handle(entry), name=f"job-{entry.entry_id}")
        # A batch job counts as one from the start: the fair queue says which queue it came from.
        batch = self.admission is not None and self.reader.took_batch(entry.entry_id)
        self.held[entry.entry_id] = Held(task, batch=batch)
        task.add_done_callback(lambda done: self._release(entry.entry_id, done))

    def _release(self, entry_id: str, task: asyncio.Task) -> None:
        self.held.pop(entry_id, None)
        if self.outlook is not None:  # together: a held job the outlook does not know reads as not started
            self.outlook.ended(entry_id)
        if not task.cancelled() and task.exception() is not None:  # never silently
            log.error("job_task_failed", entry_id=entry_id, exc_info=task.exception())

    async def _handle(self, entry: Entry) -> None:
        handoff = None
        try:
            if self.role == "decode":
                handoff = Handoff.of_entry(entry.fields)
                job = decode_job(handoff.origin, handoff.job_fields, self.config.reply_prefixes)
            else:
                job = decode_job(entry.entry_id, entry.fields, self.config.reply_prefixes)
        except ProtocolError as error:
            self.metrics.observe_outcome("rejected")
            await self._reject(entry, error.code, error.message, error.reply_to, request_id=error.request_id)
            return
        except ValueError as error:  # not a handoff entry: nothing on it names a reply stream
            self.metrics.observe_outcome("rejected")
            await self._reject(entry, "invalid_field", str(error), None)
            return
        except Exception as error:  # a decoder bug must not leave an entry redelivered forever
            log.exception("job_undecodable", entry_id=entry.entry_id)
            self.metrics.observe_outcome("rejected")
            await self._reject(entry, "internal_error", f"could not decode the entry: {type(error).__name__}", None)
            return
        self.held[entry.entry_id].request_id = job.request_id
        self.held[entry.entry_id].batch = job.batch
        bind_request(job.request_id, job.priority)  # this task's context only
        try:
            await self._serve(entry, job, handoff)
            if handoff is not None:  # it ended here, whichever way: the prefill worker may free its K/V
                await retrying(lambda: self.handoffs.confirm(handoff))
        except LeaseLost:
            log.warning("lease_lost", entry_id=entry.entry_id)  # another worker serves it now
        except RedisError as error:
            if is_transient(error):
                raise
            message = f"{type(error).__name__}: {error}"  # redis-py keeps the error's code in its class
            log.error("job_redis_error", entry_id=entry.entry_id, error=message)
            self.metrics.observe_outcome("rejected")
            await self._reject(
                entry, "redis_error", message, None, request_id=job.request_id, owner=_owner(entry, handoff)
            )
        finally:
            self.outbox.close(entry.entry_id)
            self.jobs.pop(entry.entry_id, None)
            if self.held[entry.entry_id].submitted:
                self.front.cancel(entry.entry_id)  # a no-op once it has finished
            if handoff is not None:
                self._release_prompt_kv(entry)

    async def _serve(self, entry: Entry, job: Job, handoff: Handoff | None = None) -> None:
        owner = _owner(entry, handoff)
        claim = await retrying(lambda: self.publisher.claim(job.reply_to, owner))
        if not claim.owned:
            self.metrics.observe_outcome("rejected")
            await self._reject(
                entry,
                "duplicate_id",
                f"{job.reply_to} already holds another job's replies "
                "(request ids are unique while their reply stream lives)",
                None,
                request_id=job.request_id,
                owner=owner,
            )
            return
        if claim.finished:  # a worker wrote the final event, then died before acking
            await self._ack(entry)
            return
        seq = claim.num_events
        stalls = 0
        if entry.deliveries > 1:  # a takeover: did the job move on since the last one?
            stalls = await retrying(lambda: self.publisher.stalled_deliveries(job.reply_to, seq, entry.deliveries))
        if stalls >= self.config.max_deliveries:
            self.metrics.observe_outcome("rejected")
            await self._reject(
                entry,
                "too_many_deliveries",
                f"delivered {entry.deliveries} times, the last {stalls} ending with no new token",
                job.reply_to,
                seq,
                claimed=True,
                owner=owner,
            )
            return
        if self.cancels.cancels(job.request_id, owner):
            await self._finish_unrun(entry, job, FinishReason.CANCELLED, seq, owner)
            return
        if job.params.n == 1 and seq >= job.params.max_tokens:  # every token was published before the takeover
            await self._finish_unrun(entry, job, FinishReason.LENGTH, seq, owner)
            return
        deadline = None if job.deadline_ms is None else job.deadline_ms / 1000
        # A taken-over stream keeps its submission time, so it goes ahead of newer jobs.
        arrived_at = stream_id(owner)[0] / 1000 if seq else None
        # A job this worker lost and has claimed back: its old request ends at the engine's
        # next step (it was cancelled), and none of its events may reach the new stream.
        while self.front.holds(entry.entry_id):
            await asyncio.sleep(0.02)
        published = self.outbox.open(
            entry.entry_id, job.reply_to, owner, seq, keep_text=self.log_prompts, choices=job.params.n
        )
        resumed = claim.token_ids if job.params.n == 1 else [claim.choices.get(i, []) for i in range(job.params.n)]
        if job.params.constrained:  # compiled (or found cached) off the event loop; its error comes as an event
            await asyncio.to_thread(_compile_quietly, self.front.engine, job.params)
        prompt_kv = await self.handoffs.read(handoff, _kv_slot(entry)) if handoff is not None else None
        self.front.submit_batched(
            GenerationRequest(
                entry.entry_id,
                job.prompt,
                job.params,
                job.priority,
                deadline,
                arrived_at,
                resumed,
                handoff_min_prompt_tokens=self.disagg.handoff_min_prompt_tokens if self.role == "prefill" else None,
                prompt_kv=prompt_kv,
                batch=job.batch,
            )
        )
        self.held[entry.entry_id].submitted = True
        self.jobs[entry.entry_id] = job
        if self.outlook is not None:
            self.outlook.started(entry.entry_id, job.params.max_tokens * job.params.n, job.batch)
        outcome = await published
        event = outcome.final
        self.metrics.observe_finished(event)
        self.metrics.observe_tenant_tokens(job.tenant, job.batch, "prompt", event.usage.prompt_tokens)
        if outcome.text is not None:
            log_request_finished(log, event, prompt=job.prompt, output=outcome.text)
        else:
            log_request_finished(log, event)
        if event.error_code is not None:
            await self._reject(
                entry, event.error_code.value, event.error, job.reply_to, outcome.num_tokens, claimed=True, owner=owner
            )
        elif event.finish_reason is FinishReason.HANDOFF:
            self._settling(entry)
            staged_tokens = self.front.engine.take_staged(entry.entry_id)
            await retrying(lambda: self.handoffs.hand_off(self.reader, entry, staged_tokens))
            return
        else:
            await self._ack(entry)

    def _release_prompt_kv(self, entry: Entry) -> None:
        """Free the K/V read for `entry` once the engine is done with the request (it
        places them in its prefix cache when it takes the request in: never before)."""

        async def release_when_gone() -> None:
            while self.front.holds(entry.entry_id):
                await asyncio.sleep(0.02)
            self.handoffs.release(_kv_slot(entry))

        if self.front.holds(entry.entry_id):
            asyncio.create_task(release_when_gone(), name=f"kv-release-{entry.entry_id}")
        else:
            self.handoffs.release(_kv_slot(entry))

    async def _finish_unrun(self, entry: Entry, job: Job, reason: FinishReason, num_tokens: int, owner: str) -> None:
        """The final event of a job that needs no model step: cancelled before it ran, or
        taken over with every token already published."""
        event = FinalEvent(job.request_id, reason, Usage(0, num_tokens), Timings(0.0, None, 0.0, ()))
        self.metrics.observe_outcome(reason.value)
        log.info("request_finished", finish_reason=reason.value, completion_tokens=num_tokens, ran=False)
        await retrying(lambda: self.publisher.done(job.reply_to, owner, event, num_tokens))
        await self._ack(entry)

    async def _reject(
        self,
        entry: Entry,
        code: str,
        message: str,
        reply_to: str | None,
        num_tokens: int = 0,
        request_id: str | None = None,
        claimed: bool = False,
        owner: str | None = None,
        reader: JobReader | FairQueueReader | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        """Dead-letter the entry (from `reader`'s stream: by default the one jobs are read
        from); first tell its producer on `reply_to`, if this job may write there
        (`claimed`, or it can claim the stream now, as `owner`: the job's request entry,
        which a handoff entry names)."""
        owner = owner or entry.entry_id
        reader = reader or self.reader
        log.warning(
            "job_dead_lettered",
            code=code,
            message=message,
            entry_id=entry.entry_id,
            deliveries=entry.deliveries,
            **({"request_id": request_id} if request_id else {}),
        )
        self.metrics.observe_dead_letter(code)
        if reply_to:
            try:
                if claimed or (await retrying(lambda: self.publisher.claim(reply_to, owner))).owned:
                    await retrying(
                        lambda: self.publisher.error(reply_to, owner, code, message, num_tokens, retry_after_s)
                    )
            except (LeaseLost, RedisError) as error:  # the dead letter still records it
                if isinstance(error, RedisError) and is_transient(error):
                    raise
                log.warning("error_reply_failed", entry_id=entry.entry_id, error=str(error) or type(error).__name__)
        self._settling(entry)
        await retrying(lambda: reader.dead_letter(entry, code, message))

    async def _ack(self, entry: Entry) -> None:
        self._settling(entry)
        await retrying(lambda: self.reader.ack(entry.entry_id))

    def _settling(self, entry: Entry) -> None:
        held = self.held.get(entry.entry_id)
        if held is not None:
            held.settling = True

    # -- fair queueing -----------------------------------------------------------------

    def _on_events(self, events: list) -> None:
        """A step's events: to the outbox, and each output token counted as served to its
        tenant (and, with fair queueing, charged to it)."""
        self.outbox.on_events(events)
        output_tokens: dict[tuple[str, bool], int] = defaultdict(int)  # by tenant and class
        now = time.monotonic()
        for event in events:
            job = self.jobs.get(event.request_id)
            if job is not None and not isinstance(event, FinalEvent):
                output_tokens[job.tenant, job.batch] += len(event.token_ids)
                if self.charges is not None:
                    self.charges.output(job, len(event.token_ids))
                if self.outlook is not None:
                    self.outlook.produced(event.request_id, len(event.token_ids), now)
        # Once per tenant and class a step, not per event: a step at GPU rates has hundreds.
        for (tenant, batch), num_tokens in output_tokens.items():
            self.metrics.observe_tenant_tokens(tenant, batch, "output", num_tokens)

    async def _admit(self, stop: asyncio.Event) -> None:
        """Admit new jobs from the request stream until told to stop."""
        await _unless_stopped(stop, self.admission.run)

    async def _admissible(self, entry: Entry) -> tuple[Job, int] | None:
        """The entry's job and its prompt tokens; or None, when it was refused for what it
        is (its producer told, the entry dead-lettered), as any worker would on reading it."""
        try:
            job = decode_job(entry.entry_id, entry.fields, self.config.reply_prefixes)
        except ProtocolError as error:
            self.metrics.observe_outcome("rejected")
            await self._reject(
                entry,
                error.code,
                error.message,
                error.reply_to,
                request_id=error.request_id,
                reader=self.admission.reader,
            )
            return None
        tokenizer = self.front.engine.tokenizer
        try:  # off the event loop: a long prompt takes a while
            prompt_tokens = len(await asyncio.to_thread(encode_prompt, tokenizer, job.prompt))
        except InvalidRequest:
            prompt_tokens = 0  # the engine refuses it when it is served, with this request's error
        return job, prompt_tokens

    async def _refuse(self, entry: Entry, job: Job, refusal: Refusal) -> None:
        self.metrics.observe_outcome("rejected")
        self.metrics.observe_refused(job.tenant, refusal.code)
        await self._reject(
            entry,
            refusal.code,
            refusal.message,
            job.reply_to,
            request_id=job.request_id,
            reader=self.admission.reader,
            retry_after_s=refusal.retry_after_s,
        )

    # -- alongside the jobs ------------------------------------------------------------

    async def _renew_leases(self) -> None:
        """Keep every held entry's lease; stop serving those another worker took over."""
        loop = asyncio.get_running_loop()
        renewed_at = loop.time()
        while True:
            await asyncio.sleep(self.config.renew_interval_s)
            if not self.held:
                renewed_at = loop.time()
                continue
            try:  # Redis away: try again soon, the lease is running out
                lost = await retrying(
                    lambda: self.reader.renew(list(self.held)),
                    max_delay_s=RENEW_RETRY_S,
                    on_outage=self.reader.outage_seen,
                )
            except RedisError as error:  # e.g. an ACL without XCLAIM: say so, try again next round
                log.error("lease_renewal_failed", error=f"{type(error).__name__}: {error}")
                continue
            late = loop.time() - renewed_at
            renewed_at = loop.time()
            if late > self.config.claim_idle_ms / 2000:  # other workers may have taken jobs over
                log.warning("lease_renewal_late", seconds=round(late, 2), held=len(self.held))
            for entry_id in lost:
                held = self.held.get(entry_id)
                if held is not None and not held.settling:  # not lost: acked while the renewal ran
                    log.warning("lease_lost", entry_id=entry_id, request_id=held.request_id)
                    held.task.cancel()

    async def _keep_handoffs(self) -> None:
        try:
            await retrying(self.handoffs.run)
        finally:
            await asyncio.shield(self.handoffs.close())

    async def _load_cancels(self) -> None:
        """The cancels of the last `cancel_ttl_s`, from the control stream."""
        start = self.cancels.window_start()
        while entries := await self.redis.xrange(self.config.control_stream, min=start, count=1000):
            self.cancels.add_entries(entries)
            start = f"({self.cancels.last_id}"
        self.cancels.last_id = max(self.cancels.last_id, self.cancels.window_start(), key=stream_id)

    async def _catch_up_cancels(self) -> None:
        """Take in cancels sent up to now, before starting jobs just read."""
        entries = await self.redis.xrange(self.config.control_stream, min=f"({self.cancels.last_id}")
        self._apply_cancels(entries)

    async def _follow_control(self) -> None:
        while True:
            reply = await retrying(
                lambda: self.redis.xread(
                    {self.config.control_stream: self.cancels.last_id}, block=self.config.block_ms, count=1000
                )
            )
            for _, entries in reply or []:
                self._apply_cancels(entries)

    def _apply_cancels(self, entries) -> None:
        for request_id in self.cancels.add_entries(entries):
            for entry_id, held in self.held.items():
                if held.request_id == request_id and held.submitted and self.cancels.cancels(request_id, entry_id):
                    self.front.cancel(entry_id)

    async def _housekeeping(self) -> None:
        """Every `ingest_poll_s`: the ingest-lag gauges (and the tenant queues' with fair
        queueing), and the control stream trimmed to what is remembered."""
        while True:
            try:
                await self.metrics.poll_ingest(
                    self.redis, self.config.requests_stream, self.config.group, self.config.dead_letter_stream
                )
                if self.admission is not None:
                    await self.metrics.poll_fair_queue(self.redis, self.config.requests_stream)
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xtrim(self.config.control_stream, minid=self.cancels.window_start(), approximate=True)
                    pipe.xtrim(self.config.control_stream, maxlen=self.config.control_max_len, approximate=True)
                    await pipe.execute()
            except RedisError as error:  # the gauges keep their last values; the serving path logs outages
                log.debug("housekeeping_failed", error=str(error))
            self.cancels.forget_expired()
            await asyncio.sleep(self.ingest_poll_s)


def _owner(entry: Entry, handoff: Handoff | None) -> str:
    """The request entry a job's reply stream belongs to: a handoff entry names it."""
    return handoff.origin if handoff is not None else entry.entry_id


def _kv_slot(entry: Entry) -> str:
    """The arena slot a decode worker reads a handed-off prompt into: one per delivery, so a
    job taken back reads afresh while the old slot waits for the engine to let it go."""
    return f"{entry.entry_id}#{entry.deliveries}"


def _compile_quietly(engine: Engine, params) -> None:
    try:
        engine.grammars.compile(params)
    except InvalidRequest:
        pass  # cached: `add_request` reports it as this request's error


async def _unless_stopped(stop: asyncio.Event, call: Callable[[], Awaitable[T]]) -> T | None:
    """`retrying(call)`, given up as soon as `stop` is set (then None; callers check
    `stop`), so an outage never holds a stop up."""
    attempt = asyncio.create_task(retrying(call))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([attempt, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if attempt.done():
        return attempt.result()
    attempt.cancel()
    await asyncio.wait([attempt], timeout=WIND_DOWN_S)
    return None
