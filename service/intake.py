"""Where a worker's jobs come from, chosen once at start (`intake_for`):

- `StreamIntake`: straight from the request stream (on a decode worker, the handoff
  stream), holding up to twice what runs: enough queued work to keep the batcher full,
  no more (backpressure: idle workers get the rest);
- `FairQueueIntake` (`--fair-queue`; not on a decode worker: handoffs are internal):
  every worker admits new jobs from the request stream into tenant queues
  (`Admission`), and takes them from there in fair order (`FairQueueReader`), charging
  each tenant the tokens it is served (`Charges`). The order is decided in Redis, so a
  worker holds no more than runs: a job held beyond that would wait for a running one to
  end, in this worker's order, not the fleet's; taken when a slot frees, it misses at
  most one step. Interactive jobs never wait behind batch jobs. Under fair preemption
  (`fair_preempt_after_s`) a full worker also takes the jobs of tenants that hold two or
  more fewer than the tenant it holds most (up to its slots again), for its engine to
  swap that tenant's running jobs out for them. With a wait cap
  (`max_queue_wait_s`) the worker publishes when its slots free (`SlotOutlook`), for
  admission to judge waits by.

The claim loop asks the intake what to read next and reads through it; the job runner
and the step events tell it when a job starts, produces tokens and ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from service import queue_gauges
from service.config import DisaggConfig, FairQueueConfig, RedisConfig
from service.fair_queue import Admissible, Admission, Charges, FairQueueReader, Refusal
from service.held import HeldEntries
from service.ingest import Entry, JobReader
from service.metrics import Metrics
from service.protocol import Job, ProtocolError, decode_job
from service.publish import ReplyPublisher
from service.settling import Rejection, Settling
from service.slot_outlook import SlotOutlook
from service.stopping import unless_stopped
from workers.api import PRIORITY_MAX, PRIORITY_MIN, InvalidRequest
from workers.async_engine import AsyncEngine
from workers.config import SchedulerConfig
from workers.model_loader import encode_prompt

# How long a worker holding its most batch jobs waits for an interactive one before it
# looks again (a batch job may have ended meanwhile).
BATCH_POLL_MS = 100

Background = dict[str, Coroutine[Any, Any, None]]  # by task name


@dataclass(frozen=True)
class Read:
    """One read: at most `count` entries, waiting up to `block_ms` for them, of which at
    most `max_batch` batch jobs (None: no cap of its own)."""

    count: int
    block_ms: int
    max_batch: int | None = None
    # Tenants whose jobs stay queued (a full worker reading for fair preemption).
    exclude_tenants: frozenset[str] = frozenset()


def intake_for(
    redis,
    config: RedisConfig,
    scheduler: SchedulerConfig,
    fair_queue: FairQueueConfig,
    disagg: DisaggConfig,
    metrics: Metrics,
    publisher: ReplyPublisher,
    front: AsyncEngine,
) -> StreamIntake:
    if fair_queue.enabled and disagg.role != "decode":
        return FairQueueIntake(redis, config, scheduler, fair_queue, metrics, publisher, front)
    return StreamIntake(redis, config, scheduler, metrics)


class StreamIntake:
    """Jobs read from one stream through the consumer group (`JobReader`)."""

    reader: JobReader | FairQueueReader

    def __init__(self, redis, config: RedisConfig, scheduler: SchedulerConfig, metrics: Metrics) -> None:
        self.redis = redis
        self.config = config
        self.metrics = metrics
        self.reader = JobReader(redis, config)
        self.capacity = config.max_held_jobs or 2 * scheduler.max_running_requests

    def next_read(self, held: HeldEntries) -> Read | None:
        """What to read next; None when full (the claim loop then waits for room, and
        looks for takeovers)."""
        room = self.capacity - len(held)
        return Read(room, self.config.block_ms) if room > 0 else None

    async def read(self, read: Read, held: HeldEntries) -> list[Entry]:
        return await self.reader.read(read.count, read.block_ms, held)

    def is_batch(self, entry_id: str) -> bool:
        """Whether an entry just read is a batch job, before it is decoded."""
        return False

    def background(self, held: HeldEntries, stop: asyncio.Event) -> Background:
        """Tasks that run beside the jobs while the worker serves."""
        return {}

    async def poll_gauges(self) -> None:
        """The queue gauges (ingest lag, pending entries, dead letters) from Redis."""
        config = self.config
        await queue_gauges.poll_ingest(
            self.redis, self.metrics, config.requests_stream, config.group, config.dead_letter_stream
        )

    def started(self, entry_id: str, job: Job) -> None:
        """`job` is in the engine."""

    def produced(self, entry_id: str, job: Job, num_tokens: int, now: float) -> None:
        """A step made `num_tokens` output tokens of `job`."""

    def ended(self, entry_id: str) -> None:
        """The entry is let go."""

    async def close(self) -> None:
        """The worker stops serving."""


class FairQueueIntake(StreamIntake):
    """Jobs admitted into tenant queues, taken in fair order."""

    reader: FairQueueReader

    def __init__(
        self,
        redis,
        config: RedisConfig,
        scheduler: SchedulerConfig,
        fair: FairQueueConfig,
        metrics: Metrics,
        publisher: ReplyPublisher,
        front: AsyncEngine,
    ) -> None:
        super().__init__(redis, config, scheduler, metrics)
        self.front = front
        priority_step_s = scheduler.priority_bound_s / (PRIORITY_MAX - PRIORITY_MIN)
        self.reader = FairQueueReader(redis, config, fair, priority_step_s)
        self.admission = Admission(redis, config, fair, self._admissible, self._refuse)
        self.refusals = Settling(publisher, metrics, self.admission.reader)  # from the request stream
        self.charges = Charges(redis, config.requests_stream, fair)
        self.capacity = config.max_held_jobs or scheduler.max_running_requests
        self.max_running_batch = scheduler.max_running_batch
        # Fair preemption: how many jobs beyond its slots a full worker may take for it.
        self.fair_extra = self.capacity if scheduler.fair_preempt_after_s > 0 else 0
        self._tenants: dict[str, str] = {}  # the tenant of each job in the engine, by entry id
        self.outlook: SlotOutlook | None = None
        if fair.max_queue_wait_s > 0:  # admission judges waits by it
            self.outlook = SlotOutlook(redis, config.requests_stream, config.consumer, self.capacity)

    def next_read(self, held: HeldEntries) -> Read | None:
        room = self.capacity - len(held)
        held_batch = sum(entry.batch for entry in held.values())
        interactive_room = self.capacity - (len(held) - held_batch)
        cap = self.max_running_batch
        batch_full = 0 < cap <= held_batch
        if interactive_room > 0 and (room <= 0 < held_batch or batch_full):
            # Full, but partly of batch jobs (interactive jobs never wait behind them),
            # or holding as many batch jobs as may run: then one may end any moment.
            block_ms = min(self.config.block_ms, BATCH_POLL_MS) if batch_full else self.config.block_ms
            return Read(interactive_room, block_ms, max_batch=0)
        if room <= 0:
            return self._fair_read(held)
        return Read(room, self.config.block_ms, max_batch=cap - held_batch if cap else None)

    def _fair_read(self, held: HeldEntries) -> Read | None:
        """Full: under fair preemption, one interactive job of a tenant that holds at least
        two fewer jobs here than the tenant held most (those stay queued)."""
        if len(held) >= self.capacity + self.fair_extra:
            return None
        counts: dict[str, int] = {}
        for entry_id in held:
            if (tenant := self._tenants.get(entry_id)) is not None:
                counts[tenant] = counts.get(tenant, 0) + 1
        most = max(counts.values(), default=0)
        crowded = frozenset(tenant for tenant, count in counts.items() if count >= most - 1)
        return Read(1, self.config.block_ms, max_batch=0, exclude_tenants=crowded) if most >= 2 else None

    async def read(self, read: Read, held: HeldEntries) -> list[Entry]:
        return await self.reader.read(
            read.count, read.block_ms, held, max_batch=read.max_batch, exclude_tenants=read.exclude_tenants
        )

    def is_batch(self, entry_id: str) -> bool:
        # A batch job counts as one from the start: the fair queue says which queue it came from.
        return self.reader.took_batch(entry_id)

    def background(self, held: HeldEntries, stop: asyncio.Event) -> Background:
        tasks: Background = {"admission": self._admit(stop), "charges": self.charges.run()}
        if self.outlook is not None:
            tasks["outlook"] = self.outlook.run(held, stop)
        return tasks

    async def _admit(self, stop: asyncio.Event) -> None:
        """Admit new jobs from the request stream until told to stop."""
        await unless_stopped(stop, self.admission.run)

    async def poll_gauges(self) -> None:
        await super().poll_gauges()
        await queue_gauges.poll_fair_queue(self.redis, self.metrics, self.config.requests_stream)

    def started(self, entry_id: str, job: Job) -> None:
        if self.fair_extra:
            self._tenants[entry_id] = job.tenant
        if self.outlook is not None:
            self.outlook.started(entry_id, job.params.max_tokens * job.params.n, job.batch)

    def produced(self, entry_id: str, job: Job, num_tokens: int, now: float) -> None:
        self.charges.output(job, num_tokens)
        if self.outlook is not None:
            self.outlook.produced(entry_id, num_tokens, now)

    def ended(self, entry_id: str) -> None:
        self._tenants.pop(entry_id, None)
        if self.outlook is not None:  # together with the held entry: one the outlook does not know reads as not started
            self.outlook.ended(entry_id)

    async def close(self) -> None:
        await asyncio.wait([asyncio.create_task(self.charges.flush())], timeout=1.0)

    async def _admissible(self, entry: Entry) -> Admissible | None:
        """The entry's job and its prompt's token ids; or None, when it was refused for
        what it is (its producer told, the entry dead-lettered), as any worker would on
        reading it."""
        try:
            job = decode_job(entry.entry_id, entry.fields, self.config.reply_prefixes)
        except ProtocolError as error:
            self.metrics.observe_outcome("rejected")
            rejection = Rejection(error.code, error.message, error.reply_to, request_id=error.request_id)
            await self.refusals.reject(entry, rejection)
            return None
        try:  # off the event loop: a long prompt takes a while
            prompt_ids = await asyncio.to_thread(encode_prompt, self.front.tokenizer, job.prompt)
        except InvalidRequest:  # the engine refuses it when it is served, with this request's error
            return Admissible(job, 0)
        # None when empty: the engine then says why of the prompt itself.
        return Admissible(job, len(prompt_ids), prompt_ids or None)

    async def _refuse(self, entry: Entry, job: Job, refusal: Refusal) -> None:
        self.metrics.observe_outcome("rejected")
        self.metrics.observe_refused(job.tenant, refusal.code)
        rejection = Rejection(
            refusal.code, refusal.message, job.reply_to, request_id=job.request_id, retry_after_s=refusal.retry_after_s
        )
        await self.refusals.reject(entry, rejection)
