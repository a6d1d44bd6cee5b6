"""Tenants charged for the output tokens they are served (service/lua/fair_queue_charge.lua),
so every worker orders by the same account."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import structlog

from service.config import FairQueueConfig
from service.fair_queue.keys import account_of
from service.fair_queue.scripts import CHARGE
from service.protocol import Job

log = structlog.get_logger("inflight.fair_queue")


class Charges:
    """The output tokens each tenant was served since the last flush, charged in one round
    trip (a prompt is charged when its job is taken: the TAKE script)."""

    def __init__(self, redis, stream: str, fair: FairQueueConfig) -> None:
        self.redis = redis
        self.stream = stream
        self.fair = fair
        self._charge = redis.register_script(CHARGE)
        self._weighted: dict[str, float] = defaultdict(float)  # by account
        self._raw: dict[str, int] = defaultdict(int)  # by tenant, for the tokens-per-second quota

    def output(self, job: Job, num_tokens: int) -> None:
        self._weighted[account_of(job)] += self.fair.charge_output_weight * num_tokens
        self._raw[job.tenant] += num_tokens

    async def flush(self) -> None:
        if not (self._weighted or self._raw):
            return
        weighted, raw = self._weighted, self._raw
        self._weighted, self._raw = defaultdict(float), defaultdict(int)
        args: list = [int(time.time() * 1000)]
        for account, amount in weighted.items():
            args += [account, amount]
        args.append("--")
        for tenant, amount in raw.items():
            args += [tenant, amount]
        try:
            await self._charge(keys=[self.stream], args=args)
        except Exception:
            for account, amount in weighted.items():  # charged next time
                self._weighted[account] += amount
            for tenant, amount in raw.items():
                self._raw[tenant] += amount
            raise

    async def run(self, interval_s: float = 0.2) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.flush()
            except Exception as error:  # Redis away: kept for the next flush
                log.debug("charge_failed", error=str(error))
