"""The Python producer SDK: submit jobs, read their events, cancel them (docs/protocol.md).

    client = Client("redis://127.0.0.1:6379")                 # asyncio; redis+cluster://host:port for a cluster
    async for event in client.generate("Hello", max_tokens=16):
        print(event["text"], end="")

    with SyncClient() as client:                              # blocking
        for event in client.generate(messages=[{"role": "user", "content": "Hi"}]):
            ...

Events are the reply entries' msgpack `data` maps: `{"type": "token", "seq", "text",
"token_ids"}` (with `logprob` and `top_logprobs` when asked for), then one
`{"type": "done", ...}` or `{"type": "error", "code", "message"}`.

Structured output: `client.generate("...", json_schema={"type": "object", ...})` (or
`json_object=True`, `regex="..."`, `choice=["yes", "no"]`): the answer's text parses
and validates, unless it ends for `length` (max_tokens) or `grammar_dead_end`.

Tenants and batch jobs: `client.submit("...", tenant="acme", batch=True)`. With fair
queueing a job may be refused for load: an `error` event whose code is `queue_full` or
`quota_exceeded` carries `retry_after_s`, when to send it again.

LoRA adapters: `client.submit("...", adapter="sql")` runs the job under the adapter its
workers loaded as `sql` (else an `unknown_adapter` error event); `client.load_adapter(
"sql", "/adapters/sql")` asks every worker of the stream to load one (docs/protocol.md,
"LoRA adapters").

Errors: every method (and, for a Redis Cluster, SyncClient's constructor, which finds
the cluster's nodes at once) raises only the SDK's own exceptions, each with a one-line
message fit to show a user (the redis-py error stays as its `__cause__`):

    InflightError          the base; also any other error Redis answers with
    ├─ ServerUnavailable   Redis cannot be reached, refused the credentials, stopped
    │                      answering, or the connection was lost
    └─ ReplyTimeout        no event for the request within `reply_timeout_s` (default
                           60; None waits forever): no worker serves the stream, or it
                           stopped; the job stays queued for the next worker
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import msgpack
import redis
from redis.exceptions import RedisClusterException

from service.adapters import check_name, load_message
from service.connect import as_redis_error, connect, connect_sync
from service.protocol import CONTROL_STREAM, REQUESTS_STREAM, TENANT_PATTERN, reply_stream

FINAL_TYPES = ("done", "error")
REPLY_TIMEOUT_S = 60.0


class InflightError(Exception):
    """The base of the SDK's errors."""


class ServerUnavailable(InflightError):
    """Redis cannot be reached, or the connection to it was lost."""


class ReplyTimeout(InflightError):
    """No event arrived for the request within `reply_timeout_s`; the job stays queued."""


@contextlib.contextmanager
def _translated(address: str) -> Iterator[None]:
    """redis-py's errors as the SDK's, with a message that names the server."""
    try:
        try:
            yield
        except RedisClusterException as error:  # a cluster client's own; the redis-py error behind it
            raise as_redis_error(error) from error
    except redis.AuthenticationError as error:
        raise ServerUnavailable(f"Redis at {address} refused the credentials: {error}") from error
    except (redis.ConnectionError, redis.TimeoutError) as error:
        raise ServerUnavailable(f"Redis at {address} is unavailable: {error}") from error
    except redis.RedisError as error:
        raise InflightError(f"Redis at {address}: {error}") from error


def job_payload(prompt: str | None, messages: list[dict] | None, request_id: str, **options) -> dict:
    """The request entry's fields: one msgpack `payload` (options left at None are omitted).
    A malformed `tenant` or `adapter` is refused here, with the one-line reason a worker
    would give, rather than as a dead letter later."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    tenant = options.get("tenant")
    if tenant is not None and not (isinstance(tenant, str) and TENANT_PATTERN.fullmatch(tenant)):
        raise ValueError("tenant must be 1-64 characters of letters, digits and _ . @ -")
    if options.get("adapter") is not None:
        check_name(options["adapter"])
    job = {"id": request_id, **({"prompt": prompt} if prompt is not None else {"messages": messages})}
    job.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items() if v is not None})
    return {"payload": msgpack.packb(job)}


def _replies(reply) -> Iterator[tuple[bytes, dict]]:
    """(entry id, event) for each entry of an XREAD reply."""
    for _, entries in reply or []:
        for entry_id, fields in entries:
            yield entry_id, msgpack.unpackb(fields[b"data"])


class _Settings:
    def __init__(
        self,
        make_client,
        url: str,
        requests_stream: str,
        control_stream: str,
        block_ms: int,
        reply_timeout_s: float | None,
    ) -> None:
        self.address = urlsplit(url)._replace(netloc=urlsplit(url).netloc.rpartition("@")[2]).geturl()  # no password
        with _translated(self.address):  # a blocking cluster client reaches a node as it is built
            self.redis = make_client(url, block_ms=block_ms, socket_connect_timeout=5)
        self.requests_stream = requests_stream
        self.control_stream = control_stream
        self.block_ms = block_ms
        self.reply_timeout_s = reply_timeout_s

    def _quiet_limit(self, request_id: str) -> _QuietLimit:
        return _QuietLimit(self.reply_timeout_s, self.block_ms, request_id, f"{self.requests_stream} on {self.address}")


class _QuietLimit:
    """How long the next read may block, so that a wait with no event ends after `limit_s`."""

    def __init__(self, limit_s: float | None, block_ms: int, request_id: str, served: str) -> None:
        self.limit_s, self.block_ms, self.request_id, self.served = limit_s, block_ms, request_id, served
        self.heard()

    def heard(self) -> None:
        self.since = time.monotonic()

    def next_block_ms(self) -> int:
        """The next read's BLOCK; raises ReplyTimeout once the wait is over."""
        if self.limit_s is None:
            return self.block_ms
        left_ms = (self.since + self.limit_s - time.monotonic()) * 1000
        if left_ms <= 0:
            raise ReplyTimeout(
                f"no reply to request {self.request_id} within {self.limit_s:g} s: no worker is "
                f"serving {self.served}, or it stopped (the job stays queued)"
            )
        return max(1, min(self.block_ms, int(left_ms)))


class Client(_Settings):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379",
        requests_stream: str = REQUESTS_STREAM,
        control_stream: str = CONTROL_STREAM,
        block_ms: int = 1000,
        reply_timeout_s: float | None = REPLY_TIMEOUT_S,
    ) -> None:
        super().__init__(connect, url, requests_stream, control_stream, block_ms, reply_timeout_s)

    async def submit(
        self, prompt: str | None = None, *, messages: list[dict] | None = None, request_id: str | None = None, **options
    ) -> str:
        """Queue a job; returns its request id. Options: max_tokens, temperature, top_p,
        top_k, seed, stop, ignore_eos, n, priority, deadline_ms, reply_to; structured
        output: json_schema (a dict), json_object, regex or choice (a list of strings);
        logprobs and top_logprobs; tenant (a name, default "default") and batch (True: run
        only on capacity interactive jobs leave free); adapter (a LoRA adapter's name, 1-128
        letters, digits and _ . @ : / -; default: the base model) (docs/protocol.md)."""
        request_id = request_id or uuid.uuid4().hex
        with _translated(self.address):
            await self.redis.xadd(self.requests_stream, job_payload(prompt, messages, request_id, **options))
        return request_id

    async def events(self, request_id: str, reply_to: str | None = None) -> AsyncIterator[dict]:
        """The request's events in order, ending with its done or error event."""
        key, quiet = reply_to or reply_stream(request_id), self._quiet_limit(request_id)
        last: str | bytes = "0"  # from the stream's start, then after the last entry read
        while True:
            with _translated(self.address):
                reply = await self.redis.xread({key: last}, block=quiet.next_block_ms())
            for last, event in _replies(reply):
                quiet.heard()
                yield event
                if event["type"] in FINAL_TYPES:
                    return

    async def generate(self, prompt: str | None = None, **kwargs) -> AsyncIterator[dict]:
        request_id = await self.submit(prompt, **kwargs)
        async for event in self.events(request_id, kwargs.get("reply_to")):
            yield event

    async def cancel(self, request_id: str) -> None:
        with _translated(self.address):
            await self.redis.xadd(self.control_stream, {"type": "cancel", "id": request_id})

    async def load_adapter(self, name: str, path: str) -> None:
        """Ask every worker of the stream to load the PEFT LoRA adapter in `path` (a folder
        on the workers' filesystem) as `name`. Asynchronous: each worker logs how it went
        and lists it in the registry once loaded (docs/protocol.md, "LoRA adapters")."""
        message = load_message(name, path)
        with _translated(self.address):
            await self.redis.xadd(self.control_stream, message)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class SyncClient(_Settings):
    """The same, blocking."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379",
        requests_stream: str = REQUESTS_STREAM,
        control_stream: str = CONTROL_STREAM,
        block_ms: int = 1000,
        reply_timeout_s: float | None = REPLY_TIMEOUT_S,
    ) -> None:
        super().__init__(connect_sync, url, requests_stream, control_stream, block_ms, reply_timeout_s)

    def submit(
        self, prompt: str | None = None, *, messages: list[dict] | None = None, request_id: str | None = None, **options
    ) -> str:
        request_id = request_id or uuid.uuid4().hex
        with _translated(self.address):
            self.redis.xadd(self.requests_stream, job_payload(prompt, messages, request_id, **options))
        return request_id

    def events(self, request_id: str, reply_to: str | None = None) -> Iterator[dict]:
        key, quiet = reply_to or reply_stream(request_id), self._quiet_limit(request_id)
        last: str | bytes = "0"  # from the stream's start, then after the last entry read
        while True:
            with _translated(self.address):
                reply = self.redis.xread({key: last}, block=quiet.next_block_ms())
            for last, event in _replies(reply):
                quiet.heard()
                yield event
                if event["type"] in FINAL_TYPES:
                    return

    def generate(self, prompt: str | None = None, **kwargs) -> Iterator[dict]:
        request_id = self.submit(prompt, **kwargs)
        yield from self.events(request_id, kwargs.get("reply_to"))

    def cancel(self, request_id: str) -> None:
        with _translated(self.address):
            self.redis.xadd(self.control_stream, {"type": "cancel", "id": request_id})

    def load_adapter(self, name: str, path: str) -> None:
        message = load_message(name, path)
        with _translated(self.address):
            self.redis.xadd(self.control_stream, message)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
