"""Admission: each new request-stream entry moved into its tenant's queue, or refused
(service/lua/fair_queue_admit.lua judges it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from service.config import FairQueueConfig, RedisConfig
from service.fair_queue.keys import level_of
from service.fair_queue.scripts import ADMIT
from service.ingest import Entry, JobReader
from service.protocol import Job
from service.text import text


@dataclass(frozen=True)
class Admissible:
    """A job admission may queue: its prompt's tokens as counted, and their ids when it
    was tokenized (they travel with the job, so it is tokenized once)."""

    job: Job
    prompt_tokens: int
    prompt_ids: list[int] | None = None


@dataclass(frozen=True)
class Refusal:
    code: str  # queue_full or quota_exceeded
    retry_after_s: float
    message: str


class Admission:
    """Moves each new request-stream entry into its tenant's queue, or refuses it.

    `check(entry)` decodes an entry and tokenizes its prompt (an `Admissible`), or
    returns None when the worker refused it for what it is (its producer told);
    `refuse(entry, job, refusal)` tells the producer and dead-letters the entry.
    """

    def __init__(
        self,
        redis,
        config: RedisConfig,
        fair: FairQueueConfig,
        check: Callable,
        refuse: Callable,
    ) -> None:
        self.redis = redis
        self.config = config
        self.fair = fair
        self.reader = JobReader(redis, config)  # the request stream, this worker's consumer
        self._check = check
        self._refuse = refuse
        self._admit = redis.register_script(ADMIT)

    async def run(self) -> None:
        """Admit until cancelled."""
        while True:
            entries = await self.reader.read(64, self.config.block_ms)
            for entry in entries:
                await self.admit(entry)

    async def admit(self, entry: Entry) -> None:
        checked = await self._check(entry)
        if checked is None:
            return  # refused for what it is: the worker has told the producer
        job = checked.job
        prompt_ids = msgpack.packb(checked.prompt_ids) if checked.prompt_ids else b""
        fair = self.fair
        result = await self._admit(
            keys=[self.config.requests_stream],
            args=[
                self.config.group,
                entry.entry_id,
                job.tenant,
                level_of(job),
                checked.prompt_tokens,
                int(time.time() * 1000),
                fair.max_queued_jobs,
                fair.max_queued_tokens,
                fair.tenant_max_queued_jobs,
                fair.tenant_max_queued_tokens,
                fair.tenant_tokens_per_s,
                fair.max_queue_wait_s,
                prompt_ids,
            ],
        )
        outcome = text(result[0])
        if outcome in ("admitted", "gone"):
            return
        await self._refuse(entry, job, Refusal(outcome, float(result[1]), text(result[2])))
