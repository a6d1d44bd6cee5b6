"""One held entry, top to bottom, in a task of its own (`JobRunner.run`):

1. decode: the entry becomes a `Job` (its role says how: a decode worker's entries are
   handoffs). A bad one gets an `error` reply when its reply stream can be named, and
   always a dead letter;
2. claim the reply stream (`ReplyPublisher.claim`): what it already holds decides a
   takeover's start;
3. check, in order: a stream that belongs to another job makes this one a
   `duplicate_id` dead letter; a final event already there (a worker died between
   writing it and acking) is acked; `max_deliveries` takeovers in a row with no new
   token make a `too_many_deliveries` dead letter; a remembered cancel ends the job
   `cancelled`, and a stream with every token already ends it `length`, without a
   model step;
4. submit: the engine resumes a taken-over request from the published tokens
   (`resumed_output_ids`), and `seq` goes on from the last one;
5. await the final event: the outbox (`service/outbox.py`) writes every step's events
   in one pipelined round trip, each stream's writes fenced;
6. settle, as the role says: ack (and delete), dead-letter with the engine's error, or
   hand off to the decode pool.
A worker that lost the job (its lease ran out and another worker took it over) is
refused on its next write, or told by its next lease renewal, and stops generating it.
A Redis error that concerns one job (WRONGTYPE, NOPERM, OOM) fails that job only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from service.cancels import CancelRegistry, stream_id
from service.config import RedisConfig
from service.held import HeldEntries
from service.ingest import Entry
from service.intake import StreamIntake
from service.metrics import Metrics
from service.outbox import Published, ReplyOutbox
from service.protocol import Job, ProtocolError
from service.publish import Claim, LeaseLost, ReplyPublisher
from service.retry import is_transient, retrying
from service.roles import Assignment, Role
from service.settling import Rejection, Settling
from service.structured_logging import bind_request, log_request_finished
from workers.api import FinishReason, GenerationRequest
from workers.async_engine import AsyncEngine

log = structlog.get_logger("inflight.worker")


@dataclass(frozen=True)
class AlreadyFinished:
    """The final event is out already (a worker wrote it, then died before acking)."""


@dataclass(frozen=True)
class Unrun:
    """The job ends with no model step, with this final event."""

    reason: FinishReason
    num_tokens: int


# Why a claimed job does not run: the runner settles it so.
Verdict = Rejection | AlreadyFinished | Unrun


@dataclass
class JobRunner:
    """Serves held entries: what each job needs of the worker."""

    config: RedisConfig
    role: Role
    intake: StreamIntake
    settling: Settling
    publisher: ReplyPublisher
    outbox: ReplyOutbox
    front: AsyncEngine
    cancels: CancelRegistry
    metrics: Metrics
    held: HeldEntries
    jobs: dict[str, Job]  # by entry id, while their events flow (for charges and metrics)
    log_prompts: bool  # prompts and outputs in the summary line

    async def run(self, entry: Entry) -> None:
        """Serve one held entry, from its fields to its settling."""
        assignment = await self._decode(entry)
        if assignment is None:
            return  # dead-lettered
        job = assignment.job
        held = self.held[entry.entry_id]
        held.request_id, held.batch = job.request_id, job.batch
        bind_request(job.request_id, job.priority)  # this task's context only
        try:
            await self._serve(entry, assignment)
            await self.role.ended(assignment)
        except LeaseLost:
            log.warning("lease_lost", entry_id=entry.entry_id)  # another worker serves it now
        except RedisError as error:
            if is_transient(error):
                raise
            await self._fail(entry, assignment, error)
        finally:
            self._let_go(entry)

    async def _decode(self, entry: Entry) -> Assignment | None:
        """The entry's job; None when it has none (the entry is dead-lettered, its
        producer told where its reply stream can be named)."""
        try:
            return self.role.decode(entry)
        except ProtocolError as error:
            rejection = Rejection(error.code, error.message, error.reply_to, request_id=error.request_id)
        except ValueError as error:  # not a handoff entry: nothing on it names a reply stream
            rejection = Rejection("invalid_field", str(error))
        except Exception as error:  # a decoder bug must not leave an entry redelivered forever
            log.exception("job_undecodable", entry_id=entry.entry_id)
            rejection = Rejection("internal_error", f"could not decode the entry: {type(error).__name__}")
        self.metrics.observe_outcome("rejected")
        await self.settling.reject(entry, rejection)
        return None

    async def _serve(self, entry: Entry, assignment: Assignment) -> None:
        """Claim the reply stream, check, submit, await the final event, settle."""
        job, owner = assignment.job, assignment.owner
        claim = await retrying(lambda: self.publisher.claim(job.reply_to, owner))
        verdict = await self._check(entry, job, claim, owner)
        if verdict is not None:
            await self._settle_unrun(entry, job, owner, verdict)
            return
        published = await self._submit(entry, assignment, claim)
        outcome = await published  # its final event has landed
        self._observe(job, outcome)
        await self.role.settle(entry, assignment, outcome)

    async def _check(self, entry: Entry, job: Job, claim: Claim, owner: str) -> Verdict | None:
        """Why the job must not run, in this order; None: run it."""
        if not claim.owned:
            message = (
                f"{job.reply_to} already holds another job's replies "
                "(request ids are unique while their reply stream lives)"
            )
            return Rejection("duplicate_id", message, request_id=job.request_id)
        if claim.finished:
            return AlreadyFinished()
        seq = claim.num_events
        stalls = 0
        if entry.deliveries > 1:  # a takeover: did the job move on since the last one?
            stalls = await retrying(lambda: self.publisher.stalled_deliveries(job.reply_to, seq, entry.deliveries))
        if stalls >= self.config.max_deliveries:
            message = f"delivered {entry.deliveries} times, the last {stalls} ending with no new token"
            return Rejection("too_many_deliveries", message, job.reply_to, seq)
        if self.cancels.cancels(job.request_id, owner):
            return Unrun(FinishReason.CANCELLED, seq)
        if job.params.n == 1 and seq >= job.params.max_tokens:  # every token was published before the takeover
            return Unrun(FinishReason.LENGTH, seq)
        return None

    async def _settle_unrun(self, entry: Entry, job: Job, owner: str, verdict: Verdict) -> None:
        match verdict:
            case Rejection():
                self.metrics.observe_outcome("rejected")
                await self.settling.reject(entry, verdict, claimed=True, owner=owner)
            case Unrun(reason=reason, num_tokens=num_tokens):
                await self.settling.finish_unrun(entry, job, reason, num_tokens, owner)
            case AlreadyFinished():
                await self.settling.ack(entry)

    async def _submit(self, entry: Entry, assignment: Assignment, claim: Claim) -> asyncio.Future[Published]:
        """Into the engine, its events routed to the reply stream; the future resolves
        once its final event has landed."""
        job, seq = assignment.job, claim.num_events
        deadline = None if job.deadline_ms is None else job.deadline_ms / 1000
        # A taken-over stream keeps its submission time, so it goes ahead of newer jobs.
        arrived_at = stream_id(assignment.owner)[0] / 1000 if seq else None
        # A job this worker lost and has claimed back: its old request ends at the engine's
        # next step (it was cancelled), and none of its events may reach the new stream.
        await self.front.released(entry.entry_id)
        published = self.outbox.open(
            entry.entry_id, job.reply_to, assignment.owner, seq, keep_text=self.log_prompts, choices=job.params.n
        )
        resumed = claim.token_ids if job.params.n == 1 else [claim.choices.get(i, []) for i in range(job.params.n)]
        if job.params.constrained:  # compiled (or found cached) off the event loop; its error comes as an event
            await self.front.compile_grammar(job.params)
        request = GenerationRequest(
            entry.entry_id,
            entry.prompt_ids or job.prompt,  # tokenized at admission, with the fair queue
            job.params,
            job.priority,
            deadline,
            arrived_at,
            resumed,
            handoff_min_prompt_tokens=self.role.handoff_min_prompt_tokens,
            prompt_kv=await self.role.prompt_kv(entry, assignment),
            batch=job.batch,
            tenant=job.tenant,
            adapter=job.adapter,
        )
        self.front.submit_batched(request)
        self.held[entry.entry_id].submitted = True
        self.jobs[entry.entry_id] = job
        self.intake.started(entry.entry_id, job)
        return published

    def _observe(self, job: Job, published: Published) -> None:
        """The request's outcome and timings, and its summary line."""
        event = published.final
        self.metrics.observe_finished(event)
        self.metrics.observe_adapter(job.adapter, event)
        self.metrics.observe_tenant_tokens(job.tenant, job.batch, "prompt", event.usage.prompt_tokens)
        if published.text is not None:
            log_request_finished(log, event, prompt=job.prompt, output=published.text)
        else:
            log_request_finished(log, event)

    async def _fail(self, entry: Entry, assignment: Assignment, error: RedisError) -> None:
        """A Redis error that concerns this job only: it is dead-lettered."""
        message = f"{type(error).__name__}: {error}"  # redis-py keeps the error's code in its class
        log.error("job_redis_error", entry_id=entry.entry_id, error=message)
        self.metrics.observe_outcome("rejected")
        rejection = Rejection("redis_error", message, request_id=assignment.job.request_id)
        await self.settling.reject(entry, rejection, owner=assignment.owner)

    def _let_go(self, entry: Entry) -> None:
        """The job's task ends, whichever way: nothing of it stays in the outbox or the engine."""
        self.outbox.close(entry.entry_id)
        self.jobs.pop(entry.entry_id, None)
        if self.held[entry.entry_id].submitted:
            self.front.cancel(entry.entry_id)  # a no-op once it has finished
        self.role.let_go(entry)
