"""Admission: each new request-stream entry moved into its tenant's queue, or refused
(service/lua/fair_queue_admit.lua judges it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from service.config import FairQueueConfig, RedisConfig
from service.fair_queue.keys import level_of
from service.fair_queue.scripts import ADMIT
from service.ingest import Entry, JobReader
from service.text import text


@dataclass(frozen=True)
class Refusal:
    code: str  # queue_full or quota_exceeded
    retry_after_s: float
    message: str


class Admission:
    """Moves each new request-stream entry into its tenant's queue, or refuses it.

    `check(entry)` decodes an entry and counts its prompt tokens, or raises what the
    worker turns into the entry's error (a `ProtocolError`, or an engine's refusal);
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
        job, prompt_tokens = checked
        fair = self.fair
        result = await self._admit(
            keys=[self.config.requests_stream],
            args=[
                self.config.group,
                entry.entry_id,
                job.tenant,
                level_of(job),
                prompt_tokens,
                int(time.time() * 1000),
                fair.max_queued_jobs,
                fair.max_queued_tokens,
                fair.tenant_max_queued_jobs,
                fair.tenant_max_queued_tokens,
                fair.tenant_tokens_per_s,
                fair.max_queue_wait_s,
            ],
        )
        outcome = text(result[0])
        if outcome in ("admitted", "gone"):
            return
        await self._refuse(entry, job, Refusal(outcome, float(result[1]), text(result[2])))
