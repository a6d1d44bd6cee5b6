"""How a held entry leaves this worker: acked once its final event is out, or
dead-lettered with its error, its producer told first on its reply stream where this job
may write there. Either way the entry is marked as settling, so a lease renewal that no
longer finds it does not take it for lost."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from service.fair_queue import FairQueueReader
from service.held import HeldEntries
from service.ingest import Entry, JobReader
from service.metrics import Metrics
from service.protocol import Job
from service.publish import LeaseLost, ReplyPublisher
from service.retry import is_transient, retrying
from workers.api import FinalEvent, FinishReason, Timings, Usage

log = structlog.get_logger("inflight.worker")


@dataclass(frozen=True)
class Rejection:
    """Why an entry is dead-lettered, and what its producer is told."""

    code: str
    message: str
    reply_to: str | None = None  # where its producer hears of it; None: nowhere can be named
    num_tokens: int = 0  # token events already on the reply stream
    request_id: str | None = None  # for the log line, when known
    retry_after_s: float | None = None


class Settling:
    """Acks and dead letters through `reader` (the stream its entries came from)."""

    def __init__(
        self,
        publisher: ReplyPublisher,
        metrics: Metrics,
        reader: JobReader | FairQueueReader,
        held: HeldEntries | None = None,
    ) -> None:
        self.publisher = publisher
        self.metrics = metrics
        self.reader = reader
        self.held: HeldEntries = held if held is not None else {}

    async def ack(self, entry: Entry) -> None:
        self.mark(entry)
        await retrying(lambda: self.reader.ack(entry.entry_id))

    async def reject(self, entry: Entry, rejection: Rejection, claimed: bool = False, owner: str | None = None) -> None:
        """Dead-letter the entry; first tell its producer on `rejection.reply_to`, if this
        job may write there (`claimed`, or it can claim the stream now, as `owner`: the
        job's request entry, which a handoff entry names)."""
        owner = owner or entry.entry_id
        log.warning(
            "job_dead_lettered",
            code=rejection.code,
            message=rejection.message,
            entry_id=entry.entry_id,
            deliveries=entry.deliveries,
            **({"request_id": rejection.request_id} if rejection.request_id else {}),
        )
        self.metrics.observe_dead_letter(rejection.code)
        if rejection.reply_to:
            await self._tell_producer(entry, rejection, rejection.reply_to, claimed, owner)
        self.mark(entry)
        await retrying(lambda: self.reader.dead_letter(entry, rejection.code, rejection.message))

    async def _tell_producer(
        self, entry: Entry, rejection: Rejection, reply_to: str, claimed: bool, owner: str
    ) -> None:
        try:
            if claimed or (await retrying(lambda: self.publisher.claim(reply_to, owner))).owned:
                await retrying(
                    lambda: self.publisher.error(
                        reply_to,
                        owner,
                        rejection.code,
                        rejection.message,
                        rejection.num_tokens,
                        rejection.retry_after_s,
                    )
                )
        except (LeaseLost, RedisError) as error:  # the dead letter still records it
            if isinstance(error, RedisError) and is_transient(error):
                raise
            log.warning("error_reply_failed", entry_id=entry.entry_id, error=str(error) or type(error).__name__)

    async def finish_unrun(self, entry: Entry, job: Job, reason: FinishReason, num_tokens: int, owner: str) -> None:
        """The final event of a job that needs no model step: cancelled before it ran, or
        taken over with every token already published."""
        event = FinalEvent(job.request_id, reason, Usage(0, num_tokens), Timings(0.0, None, 0.0, ()))
        self.metrics.observe_outcome(reason.value)
        log.info("request_finished", finish_reason=reason.value, completion_tokens=num_tokens, ran=False)
        await retrying(lambda: self.publisher.done(job.reply_to, owner, event, num_tokens))
        await self.ack(entry)

    def mark(self, entry: Entry) -> None:
        """Being acked or dead-lettered: a renewal that no longer finds it has not lost it."""
        held = self.held.get(entry.entry_id)
        if held is not None:
            held.settling = True
