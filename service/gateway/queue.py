"""The gateway's side of the queue: submit a job, read its reply stream (through
`service.gateway.replies`), cancel it, and watch how deep and how old the backlog is.

Nothing waits without bound: a reply stream silent for `reply_timeout_s` ends the request
(ReplyTimeout), and a job is queued only while the backlog is under its limits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import msgpack
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from service.adapters import load_message, registry_key
from service.cancels import stream_id
from service.config import GatewayConfig
from service.gateway.replies import ReplyReader, ReplyTimeout, read_alone
from service.protocol import reply_stream
from service.retry import FIRST_DELAY_S, is_transient
from service.text import text

log = structlog.get_logger("inflight.gateway")

FINAL_TYPES = ("done", "error")


class QueueUnavailable(Exception):
    """Redis did not take the job (down, refusing): the request is answered 503."""


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
        # One reader for every reply stream, but on a cluster (streams in many slots).
        self.reader = None if isinstance(redis, RedisCluster) else ReplyReader(redis, config.requests_stream)

    async def submit(self, payload: bytes, pipe=None) -> None:
        """One XADD (sent with what `pipe` holds, if given); no retry, so a request never
        waits on an outage (clients retry 503s)."""
        try:
            if pipe is None:
                await self.redis.xadd(self.config.requests_stream, {"payload": payload})
            else:
                pipe.xadd(self.config.requests_stream, {"payload": payload})
                await pipe.execute()
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

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters the workers serve (service/adapters.py): name -> folder."""
        listed = await self.redis.hgetall(registry_key(self.config.requests_stream))
        return {text(name): text(path) for name, path in listed.items()}

    async def load_adapter(self, name: str, path: str) -> None:
        """Ask every worker to load an adapter (the control stream); QueueUnavailable when
        Redis does not take it."""
        message = load_message(name, path)
        try:
            await self.redis.xadd(self.config.control_stream, message)
        except RedisError as error:
            raise QueueUnavailable(f"{type(error).__name__}: {error}") from error

    async def replies(self, request_id: str, timeout_s: float | None = None) -> AsyncGenerator[list[dict], None]:
        """The job's events in order, in batches as they land; the last batch ends with
        its done or error event. Silent for `timeout_s` (default `reply_timeout_s`; a
        batch job may wait longer) -> ReplyTimeout."""
        key, timeout_s = reply_stream(request_id), timeout_s or self.config.reply_timeout_s
        reading = self.reader.entries(key, timeout_s) if self.reader else read_alone(self.redis, key, timeout_s)
        try:
            async for entries in reading:
                events = [msgpack.unpackb(fields[b"data"]) for _, fields in entries]
                for i, event in enumerate(events):
                    if event["type"] in FINAL_TYPES:
                        yield events[: i + 1]
                        return
                yield events
        except ReplyTimeout:
            raise ReplyTimeout(
                f"no reply within {timeout_s:g} s: no worker is serving {self.config.requests_stream}"
            ) from None
        finally:
            await reading.aclose()

    async def ping(self) -> str | None:
        """None when Redis answers within a second, else why not."""
        try:
            await asyncio.wait_for(self.redis.ping(), timeout=1.0)
            return None
        except (TimeoutError, RedisError, OSError) as error:
            return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

    # -- backpressure ----------------------------------------------------------------------

    def overloaded(self) -> str | None:
        """Why a new job should wait (429), or None."""
        config, backlog = self.config, self.backlog
        if config.max_queue_depth and backlog.depth > config.max_queue_depth:
            return f"the queue holds {backlog.depth} waiting jobs, over its limit of {config.max_queue_depth}"
        if config.max_queue_age_s and backlog.oldest_s > config.max_queue_age_s:
            return (
                f"the oldest waiting job has waited {backlog.oldest_s:.0f} s, over the limit of "
                f"{config.max_queue_age_s:g} s"
            )
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
        group = (
            next((g for g in groups if text(g["name"]) == self.config.group), None)
            if not isinstance(groups, Exception)
            else None
        )
        pending = group["pending"] if group else 0
        after = f"({text(group['last-delivered-id'])}" if group else "-"
        oldest = await self.redis.xrange(stream, min=after, count=1)
        if not oldest:
            return Backlog(0, 0.0, time.monotonic())
        age_s = max(0.0, seconds + micros / 1e6 - stream_id(text(oldest[0][0]))[0] / 1000)
        return Backlog(max(0, length - pending), age_s, time.monotonic())
