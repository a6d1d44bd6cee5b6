"""Writes a request's events to its reply stream (docs/protocol.md, "Replies").

Each event is one XADD; the stream's TTL is refreshed in the same round trip, so a
reply stream nobody reads expires `ttl_s` after its last event. Token events carry a
`seq` that counts from 0 without gaps; `next_seq` reads where a stream left off, so a
worker that takes over a request continues the numbering instead of repeating it.

Entry ids are derived from the event, not the clock: token `seq` is `<seq + 1>-0`, and
the final event after n tokens is `<n>-1`. So writing an event is idempotent: when the
connection drops, the write is retried (with backoff) until Redis answers, and a retry
of a write that had in fact landed is refused by Redis as "equal or smaller" and taken
as done. No event is lost or written twice.
"""

from __future__ import annotations

import asyncio

import msgpack
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from service.protocol import done_fields, error_fields, token_fields
from workers.request import FinalEvent


class ReplyPublisher:
    def __init__(self, redis, ttl_s: int, worker: str = "") -> None:
        self.redis = redis  # a redis.asyncio.Redis
        self.ttl_s = ttl_s
        self.worker = worker  # named on done events: which consumer finished the request

    async def token(self, reply_to: str, seq: int, text: str, token_ids) -> None:
        await self._add(reply_to, f"{seq + 1}-0", token_fields(seq, text, token_ids))

    async def done(self, reply_to: str, event: FinalEvent, num_tokens: int) -> None:
        """The final event, after `num_tokens` token events."""
        await self._add(reply_to, f"{num_tokens}-1", done_fields(event, self.worker))

    async def error(self, reply_to: str, code: str, message: str, num_tokens: int = 0) -> None:
        await self._add(reply_to, f"{num_tokens}-1", error_fields(code, message))

    async def published(self, reply_to: str) -> tuple[list[int], bool]:
        """What `reply_to` already holds: the token ids in seq order, and whether a final
        (done or error) event ended it."""
        token_ids: list[int] = []
        finished = False
        for _, fields in await self.redis.xrange(reply_to):
            data = msgpack.unpackb(fields[b"data"])
            if data["type"] == "token":
                token_ids.extend(data["token_ids"])
            else:
                finished = True
        return token_ids, finished

    async def next_seq(self, reply_to: str) -> int:
        """The seq the next token event on `reply_to` should carry (0 for a new stream)."""
        for _, fields in await self.redis.xrevrange(reply_to, count=16):
            if fields.get(b"type") == b"token":
                return msgpack.unpackb(fields[b"data"])["seq"] + 1
        return 0

    async def _add(self, reply_to: str, entry_id: str, fields: dict) -> None:
        delay = 0.05
        while True:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xadd(reply_to, fields, id=entry_id)
                    pipe.expire(reply_to, self.ttl_s)
                    await pipe.execute()
                return
            except ResponseError as error:
                if "equal or smaller" in str(error):
                    return  # an earlier try landed
                raise
            except (ConnectionError, TimeoutError):
                await asyncio.sleep(delay)  # Redis is away: keep the event, try again
                delay = min(delay * 2, 2.0)
