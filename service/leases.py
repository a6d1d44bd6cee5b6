"""Keeping the leases of the entries a worker holds (service/ingest.py says why they
are leased), and stopping the jobs another worker took over meanwhile."""

from __future__ import annotations

import asyncio

import structlog
from redis.exceptions import RedisError

from service.config import RedisConfig
from service.fair_queue import FairQueueReader
from service.held import HeldEntries
from service.ingest import JobReader
from service.retry import retrying

log = structlog.get_logger("inflight.worker")

# How often a lease renewal is tried while Redis is away.
RENEW_RETRY_S = 0.05


async def renew_leases(reader: JobReader | FairQueueReader, held: HeldEntries, config: RedisConfig) -> None:
    """Every `renew_interval_s`, keep every held entry's lease; cancel the task of each
    one this worker no longer owns (another worker took it over: it serves it now)."""
    loop = asyncio.get_running_loop()
    renewed_at = loop.time()
    while True:
        await asyncio.sleep(config.renew_interval_s)
        if not held:
            renewed_at = loop.time()
            continue
        try:  # Redis away: try again soon, the lease is running out
            lost = await retrying(
                lambda: reader.renew(list(held)), max_delay_s=RENEW_RETRY_S, on_outage=reader.outage_seen
            )
        except RedisError as error:  # e.g. an ACL without XCLAIM: say so, try again next round
            log.error("lease_renewal_failed", error=f"{type(error).__name__}: {error}")
            continue
        late = loop.time() - renewed_at
        renewed_at = loop.time()
        if late > config.claim_idle_ms / 2000:  # other workers may have taken jobs over
            log.warning("lease_renewal_late", seconds=round(late, 2), held=len(held))
        for entry_id in lost:
            entry = held.get(entry_id)
            if entry is not None and not entry.settling:  # not lost: acked while the renewal ran
                log.warning("lease_lost", entry_id=entry_id, request_id=entry.request_id)
                entry.task.cancel()
