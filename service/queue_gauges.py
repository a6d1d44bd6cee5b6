"""The queue gauges read from Redis: the worker's housekeeping calls these every
`ingest_poll_s` from its event loop (a round trip each, never in the model thread), and
they hand what Redis says to `Metrics`' plain setters.

- `poll_ingest`: how far behind the consumer group is (lag, pending entries) and the
  dead-letter stream's length;
- `poll_fair_queue`, with fair queueing: jobs and prompt tokens queued by tenant, and the
  batch backlog, from the counts service/fair_queue.py keeps beside the request stream.
  They are the same for every worker of a stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.fair_queue import CountKeys
from service.text import text

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    from service.metrics import Metrics


async def poll_ingest(
    redis: Redis | RedisCluster, metrics: Metrics, stream: str, group: str, dead_letter_stream: str
) -> None:
    """Ask Redis how far behind the consumer group is (one pipelined round trip)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xinfo_groups(stream)
        pipe.xpending(stream, group)
        pipe.xlen(dead_letter_stream)
        groups, pending, dead = await pipe.execute()
    # None when Redis cannot tell (entries deleted), or when the group is not there
    lag = next((info.get("lag") for info in groups if text(info["name"]) == group), None)
    metrics.observe_ingest(lag, pending["pending"], dead)


async def poll_fair_queue(redis: Redis | RedisCluster, metrics: Metrics, stream: str) -> None:
    """Read the fair queue's counts (service/fair_queue.py keeps them, next to `stream`)
    in one round trip: jobs and prompt tokens queued by tenant, and the backlog of each
    tenant queue, whose batch queues' add up to the batch backlog."""
    keys = CountKeys.of(stream)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.queued)
        pipe.hgetall(keys.queued_tokens)
        pipe.hgetall(keys.backlog)
        queued, queued_tokens, backlog = await pipe.execute()
    metrics.observe_fair_queue(
        _tenant_counts(queued),
        _tenant_counts(queued_tokens),
        sum(int(count) for queue, count in backlog.items() if text(queue).startswith(keys.batch_queues)),
    )


def _tenant_counts(counts: dict[bytes | str, bytes | str]) -> dict[str, int]:
    """A fair-queue hash by tenant, less its '*' field (the total)."""
    return {text(tenant): int(count) for tenant, count in counts.items() if text(tenant) != "*"}
