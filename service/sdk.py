"""The Python producer SDK: submit jobs, read their events, cancel them (docs/protocol.md).

    client = Client("redis://127.0.0.1:6379")                 # asyncio
    async for event in client.generate("Hello", max_tokens=16):
        print(event["text"], end="")

    with SyncClient() as client:                              # blocking
        for event in client.generate(messages=[{"role": "user", "content": "Hi"}]):
            ...

Events are the reply entries' msgpack `data` maps: `{"type": "token", "seq", "text",
"token_ids"}`, then one `{"type": "done", ...}` or `{"type": "error", "code", "message"}`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import msgpack
import redis
import redis.asyncio as aioredis

from service.protocol import CONTROL_STREAM, REQUESTS_STREAM, reply_stream

FINAL_TYPES = ("done", "error")


def job_payload(prompt: str | None, messages: list[dict] | None, request_id: str, **options) -> dict:
    """The request entry's fields: one msgpack `payload` (options left at None are omitted)."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    job = {"id": request_id, **({"prompt": prompt} if prompt is not None else {"messages": messages})}
    job.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items() if v is not None})
    return {"payload": msgpack.packb(job)}


def _replies(reply) -> Iterator[tuple[bytes, dict]]:
    """(entry id, event) for each entry of an XREAD reply."""
    for _, entries in reply or []:
        for entry_id, fields in entries:
            yield entry_id, msgpack.unpackb(fields[b"data"])


class _Settings:
    def __init__(self, redis_class, url: str, requests_stream: str, control_stream: str, block_ms: int) -> None:
        # The socket timeout must outlast a blocking read.
        self.redis = redis_class.from_url(url, socket_timeout=block_ms / 1000 + 30)
        self.requests_stream = requests_stream
        self.control_stream = control_stream
        self.block_ms = block_ms


class Client(_Settings):
    def __init__(self, url: str = "redis://127.0.0.1:6379", requests_stream: str = REQUESTS_STREAM,
                 control_stream: str = CONTROL_STREAM, block_ms: int = 1000) -> None:
        super().__init__(aioredis.Redis, url, requests_stream, control_stream, block_ms)

    async def submit(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     request_id: str | None = None, **options) -> str:
        """Queue a job; returns its request id. Options: max_tokens, temperature, top_p,
        top_k, seed, stop, ignore_eos, priority, deadline_ms, reply_to."""
        request_id = request_id or uuid.uuid4().hex
        await self.redis.xadd(self.requests_stream, job_payload(prompt, messages, request_id, **options))
        return request_id

    async def events(self, request_id: str, reply_to: str | None = None) -> AsyncIterator[dict]:
        """The request's events in order, ending with its done or error event."""
        key, last = reply_to or reply_stream(request_id), "0"
        while True:
            for last, event in _replies(await self.redis.xread({key: last}, block=self.block_ms)):
                yield event
                if event["type"] in FINAL_TYPES:
                    return

    async def generate(self, prompt: str | None = None, **kwargs) -> AsyncIterator[dict]:
        request_id = await self.submit(prompt, **kwargs)
        async for event in self.events(request_id, kwargs.get("reply_to")):
            yield event

    async def cancel(self, request_id: str) -> None:
        await self.redis.xadd(self.control_stream, {"type": "cancel", "id": request_id})

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class SyncClient(_Settings):
    """The same, blocking."""

    def __init__(self, url: str = "redis://127.0.0.1:6379", requests_stream: str = REQUESTS_STREAM,
                 control_stream: str = CONTROL_STREAM, block_ms: int = 1000) -> None:
        super().__init__(redis.Redis, url, requests_stream, control_stream, block_ms)

    def submit(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               request_id: str | None = None, **options) -> str:
        request_id = request_id or uuid.uuid4().hex
        self.redis.xadd(self.requests_stream, job_payload(prompt, messages, request_id, **options))
        return request_id

    def events(self, request_id: str, reply_to: str | None = None) -> Iterator[dict]:
        key, last = reply_to or reply_stream(request_id), "0"
        while True:
            for last, event in _replies(self.redis.xread({key: last}, block=self.block_ms)):
                yield event
                if event["type"] in FINAL_TYPES:
                    return

    def generate(self, prompt: str | None = None, **kwargs) -> Iterator[dict]:
        request_id = self.submit(prompt, **kwargs)
        yield from self.events(request_id, kwargs.get("reply_to"))

    def cancel(self, request_id: str) -> None:
        self.redis.xadd(self.control_stream, {"type": "cancel", "id": request_id})

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
