"""Resumable streams: what a reconnecting client needs to continue a streamed answer,
at this gateway or another.

Every token of a job is on its reply stream in Redis until the stream expires, so a
stream's answer can be rendered again from the start by anyone: what is missing is how
to render it (the request's kind, model and options) and where the client left off.
The first is a small card written with the job (`inflight:requests:gateway:stream:{<id>}`,
no prompt or text in it); the second is the SSE event's `id`, `<request id>-<position>`,
which the client sends back as `Last-Event-ID`. A resumed answer replays the stream
from its start through the same renderer and sends only what comes after the position,
so the client sees every chunk once, byte for byte as the first gateway would have.

Positions: a token's chunk is the token's `seq`; the chunks the final event makes (each
choice's finish, the usage, `[DONE]`, or an error) are `end0`, `end1`, ...

A card also counts the connections that took the stream: a gateway whose client left
cancels the job after `resume_grace_s` only if no one has taken the stream since.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack

from service.gateway.errors import APIError
from service.gateway.openai_api import Parsed

# Where a resumed answer continues: (0, seq) after a token's chunk, (1, k) after the k-th
# chunk of the ending; None = from the start.
Position = tuple[int, int]
_END = "end"
# A request asks for event ids with this header (any of 1, true, yes, on); a gateway run
# with `event_ids` sends them always, and a resumed stream always has them.
EVENT_IDS_HEADER = "x-inflight-event-ids"


def event_id(request_id: str, position: Position) -> bytes:
    phase, n = position
    return f"{request_id}-{_END if phase else ''}{n}".encode()


def read_event_id(text: str) -> tuple[str, Position]:
    """A `Last-Event-ID` -> (request id, position); a 400 if it is not one of ours."""
    request_id, _, tail = text.strip().rpartition("-")
    phase = 1 if tail.startswith(_END) else 0
    number = tail[len(_END) :] if phase else tail
    if not request_id or not number.isdigit():
        raise APIError(400, f"Last-Event-ID {text[:80]!r} is not an event id of this gateway", param="Last-Event-ID")
    return request_id, (phase, int(number))


@dataclass(frozen=True)
class Card:
    """How to render a job's answer again: the parts of the request the answer shows."""

    parsed: Parsed
    tenant: str
    created: int

    def pack(self) -> bytes:
        p = self.parsed
        options = {name: p.job[name] for name in ("logprobs", "top_logprobs") if name in p.job}
        return msgpack.packb(
            {"kind": p.kind, "model": p.model, "include_usage": p.include_usage, "n": p.n, "options": options}
            | {"tenant": self.tenant, "created": self.created}
        )

    @staticmethod
    def unpack(data: bytes) -> Card:
        fields = msgpack.unpackb(data)
        parsed = Parsed(fields["kind"], fields["model"], fields["options"], True, fields["include_usage"], fields["n"])
        return Card(parsed, fields["tenant"], fields["created"])


class StreamCards:
    """The cards of streamed jobs, in Redis for `ttl_s` after their request."""

    def __init__(self, redis, namespace: str, ttl_s: int) -> None:
        self.redis, self.namespace, self.ttl_s = redis, namespace, ttl_s

    def key(self, request_id: str) -> str:
        return f"{self.namespace}:gateway:stream:{{{request_id}}}"  # in the job's reply stream's slot

    def remember(self, pipe, request_id: str, parsed: Parsed, tenant: str) -> Card:
        """Queues the card's writes on `pipe` (sent with the job), taken once."""
        card = Card(parsed, tenant, int(time.time()))
        key = self.key(request_id)
        pipe.hset(key, mapping={"card": card.pack(), "taken": 1})
        pipe.expire(key, self.ttl_s)
        return card

    async def take(self, request_id: str, tenant: str) -> tuple[Card, int]:
        """The card of a job this tenant streamed, and the how-manieth taking this is; a
        404 for a job unknown, expired, not streamed or another tenant's (which are not
        told apart, so ids of other tenants' jobs cannot be probed)."""
        key = self.key(request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(key, "card")
            pipe.hincrby(key, "taken", 1)
            data, taken = await pipe.execute()
        card = Card.unpack(data) if data else None
        if card is None or card.tenant != tenant:
            if data is None:
                await self.redis.delete(key)  # the count alone, made by HINCRBY
            raise APIError(404, f"no streamed request {request_id!r} to resume (unknown or expired)")
        return card, taken

    async def taken_since(self, request_id: str, taken: int) -> bool:
        """Whether another connection took the stream after the `taken`-th."""
        count = await self.redis.hget(self.key(request_id), "taken")
        return count is not None and int(count) > taken
