"""A worker's housekeeping, every `ingest_poll_s`: the queue gauges read from Redis, the
control stream trimmed to the cancels remembered, and expired cancels forgotten."""

from __future__ import annotations

import asyncio

import structlog
from redis.exceptions import RedisError

from service.cancels import CancelRegistry
from service.config import RedisConfig
from service.intake import StreamIntake

log = structlog.get_logger("inflight.worker")


async def keep_house(redis, config: RedisConfig, intake: StreamIntake, cancels: CancelRegistry, every_s: float) -> None:
    """Until cancelled: the intake's gauges (the ingest lag; with fair queueing also the
    tenant queues'), and the control stream trimmed to what is remembered."""
    while True:
        try:
            await intake.poll_gauges()
            async with redis.pipeline(transaction=False) as pipe:
                pipe.xtrim(config.control_stream, minid=cancels.window_start(), approximate=True)
                pipe.xtrim(config.control_stream, maxlen=config.control_max_len, approximate=True)
                await pipe.execute()
        except RedisError as error:  # the gauges keep their last values; the serving path logs outages
            log.debug("housekeeping_failed", error=str(error))
        cancels.forget_expired()
        await asyncio.sleep(every_s)
