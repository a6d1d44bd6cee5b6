"""The gateway's side of the queue: submit a job, read its reply stream, cancel it, and
watch how deep and how old the backlog is.

Reading is resumable: the reader remembers the last entry id it saw and asks for what
follows it, so a dropped connection or a Redis restart costs a retry, not an event, and a
worker's failover (another worker continues the same reply stream, docs/protocol.md) is
just a longer pause. Nothing waits without bound: a reply stream silent for
`reply_timeout_s` ends the request (ReplyTimeout), and a job is queued only while the
backlog is under its limits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgpack
import structlog
from redis.exceptions import RedisError

from service.cancels import stream_id
from service.config import GatewayConfig
from service.protocol import reply_stream
from service.retry import FIRST_DELAY_S, is_transient

log = structlog.get_logger("inflight.gateway")

FINAL_TYPES = ("done", "error")
# One blocking read's wait: how often a silent stream checks its time limit.
BLOCK_MS = 1000
# The most a retried read waits between tries while Redis is away.
MAX_RETRY_DELAY_S = 0.5


class QueueUnavailable(Exception):
    """Redis did not take the job (down, refusing): the request is answered 503."""


class ReplyTimeout(Exception):
    """The reply stream stayed silent for `reply_timeout_s`."""


@dataclass(frozen=True)
class Backlog:
    """The request stream as last looked up: entries no worker has taken yet, and how long
    the oldest of them has waited (0 when none waits)."""

    depth: int = 0
    oldest_s: float = 0.0
    at: float = 0.0  # time.monotonic() of the lookup; 0 = never


class Queue:
    def __init__(self, redis, config: GatewayConfig) -> None:
        self.redis = redis
        self.config = config
        self.backlog = Backlog()

    async def submit(self, payload: bytes) -> None:
        """One XADD; no retry, so a request never waits on an outage (clients retry 503s)."""
        try:
            await self.redis.xadd(self.config.requests_stream, {"payload": payload})
        except RedisError as error:
            raise QueueUnavailable(f"{type(error).__name__}: {error}") from error

    async def cancel(self, request_id: str) -> None:
        """Ask the workers to end the job (the control stream); a few tries while Redis is away."""
        delay = FIRST_DELAY_S
        for _ in range(5):
            try:
                await self.redis.xadd(self.config.control_stream, {"type": "cancel", "id": request_id})
                return
            except RedisError as error:
                if not is_transient(error):
                    break
                await asyncio.sleep(delay)
                delay *= 2
        log.warning("cancel_not_sent", request_id=request_id)

    async def replies(self, request_id: str) -> AsyncIterator[dict]:
        """The job's events in order, as they land, ending with its done or error event."""
        key, last = reply_stream(request_id), "0"
        heard = time.monotonic()
        delay = FIRST_DELAY_S
        while True:
            left_ms = (heard + self.config.reply_timeout_s - time.monotonic()) * 1000
            if left_ms <= 0:
                raise ReplyTimeout(f"no reply within {self.config.reply_timeout_s:g} s: no worker is serving "
                                   f"{self.config.requests_stream}")
            try:
                reply = await self.redis.xread({key: last}, block=max(1, min(BLOCK_MS, int(left_ms))))
            except RedisError as error:
                if not is_transient(error):
                    raise
                await asyncio.sleep(delay)  # Redis away: read on from `last` once it is back
                delay = min(delay * 2, MAX_RETRY_DELAY_S)
                continue
            delay = FIRST_DELAY_S
            for _, entries in reply or ():
                heard = time.monotonic()
                for entry_id, fields in entries:
                    last = entry_id
                    event = msgpack.unpackb(fields[b"data"])
                    yield event
                    if event["type"] in FINAL_TYPES:
                        return

    async def ping(self) -> str | None:
        """None when Redis answers within a second, else why not."""
        try:
            await asyncio.wait_for(self.redis.ping(), timeout=1.0)
            return None
        except (RedisError, OSError, asyncio.TimeoutError) as error:
            return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

    # -- backpressure ----------------------------------------------------------------------

    def overloaded(self) -> str | None:
        """Why a new job should wait (429), or None."""
        config, backlog = self.config, self.backlog
        if config.max_queue_depth and backlog.depth > config.max_queue_depth:
            return f"the queue holds {backlog.depth} waiting jobs, over its limit of {config.max_queue_depth}"
        if config.max_queue_age_s and backlog.oldest_s > config.max_queue_age_s:
            return (f"the oldest waiting job has waited {backlog.oldest_s:.0f} s, over the limit of "
                    f"{config.max_queue_age_s:g} s")
        return None

    async def watch_backlog(self) -> None:
        """Look the backlog up every `queue_poll_s`, for as long as the gateway runs."""
        while True:
            try:
                self.backlog = await self.look_up_backlog()
            except RedisError as error:  # the last figures stand; /health reports the outage
                log.debug("backlog_lookup_failed", error=str(error))
            await asyncio.sleep(self.config.queue_poll_s)

    async def look_up_backlog(self) -> Backlog:
        """Workers delete what they finish, so the stream holds what waits plus what they
        hold (the group's pending entries); what waits starts after the group's
        last-delivered id."""
        stream = self.config.requests_stream
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.time()  # ages on Redis' clock, the one entry ids are stamped with
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            (seconds, micros), length, groups = await pipe.execute(raise_on_error=False)
        if isinstance(length, Exception) or not length:
            return Backlog(0, 0.0, time.monotonic())
        group = next((g for g in groups if _text(g["name"]) == self.config.group), None) \
            if not isinstance(groups, Exception) else None
        pending = group["pending"] if group else 0
        after = f"({_text(group['last-delivered-id'])}" if group else "-"
        oldest = await self.redis.xrange(stream, min=after, count=1)
        if not oldest:
            return Backlog(0, 0.0, time.monotonic())
        age_s = max(0.0, seconds + micros / 1e6 - stream_id(_text(oldest[0][0]))[0] / 1000)
        return Backlog(max(0, length - pending), age_s, time.monotonic())


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
