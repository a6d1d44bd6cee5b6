"""The HTTP answer to one queued job (`JobResponse`): its reply stream, streamed as
server-sent events or sent whole once it ends, with the client's disconnects and the
queue's errors turned into HTTP ones."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import structlog

from service.gateway.errors import APIError, from_queue
from service.gateway.openai_api import (
    Parsed,
    Renderer,
    error_event,
    response_id,
)
from service.gateway.replies import ReplyTimeout
from service.gateway.resume import Position, event_id

if TYPE_CHECKING:
    from service.gateway.app import Gateway

log = structlog.get_logger("inflight.gateway")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]  # no proxy buffering of the stream


class JobResponse:
    """The answer to one queued job, streamed (SSE) or whole, as its reply stream lands.
    A streamed answer's events carry ids when `event_ids`; one resumed sends only what
    comes `after` the client's last event id."""

    def __init__(
        self,
        gateway: Gateway,
        request_id: str,
        parsed: Parsed,
        started: float,
        tenant: str,
        event_ids: bool = False,
        after: Position | None = None,
    ) -> None:
        self.gateway, self.queue, self.metrics = gateway, gateway.queue, gateway.metrics
        self.request_id, self.parsed, self.started, self.tenant = request_id, parsed, started, tenant
        self.renderer = Renderer(parsed, response_id(parsed.kind, request_id))
        self.event_ids, self.after = event_ids, after
        self.taken: int | None = None  # which taking of a resumable stream this is (None: not resumable)
        self.finished = False  # the job ended (its final event read, or cancelled here)
        self.summary: dict = {"resumed": True} if after is not None else {}

    async def __call__(self, scope, receive, send) -> None:
        self.metrics.in_progress.inc()
        answering = asyncio.ensure_future(self._answer(send))
        leaving = asyncio.ensure_future(_client_leaves(receive))
        try:
            await asyncio.wait((answering, leaving), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping: the job goes too
            answering.cancel()
            leaving.cancel()
            if not self.finished:
                asyncio.get_running_loop().create_task(self.queue.cancel(self.request_id))
            raise
        finally:
            self.metrics.in_progress.dec()
        if answering.done():
            leaving.cancel()
            answering.result()  # an error of the gateway's own propagates (a 500)
        else:
            answering.cancel()
            await asyncio.wait((answering,))
            if not self.finished:
                self.summary["client_left"] = True
                self.gateway.cancel_abandoned(self.request_id, self.taken)
        log.info(
            "request_finished",
            request_id=self.request_id,
            kind=self.parsed.kind,
            stream=self.parsed.stream,
            tenant=self.tenant,
            total_s=round(time.perf_counter() - self.started, 4),
            **self.summary,
        )

    async def _answer(self, send) -> None:
        batches = self.queue.replies(self.request_id)
        try:
            batch = await anext(batches)
            if batch[0]["type"] == "error":
                # Before any status line, so a refusal (a 429 for load, too) gets its own status.
                self._ended(batch[0])
                await self._error(send, _queue_error(batch[0]))
            elif self.parsed.stream:
                await self._stream(send, batch, batches)
            else:
                await self._whole(send, batch, batches)
        except ReplyTimeout as error:
            await self._timed_out(send, str(error))
        finally:
            await batches.aclose()

    async def _stream(self, send, batch: list[dict], batches) -> None:
        """Each batch of events read together goes out as one body write."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*SSE_HEADERS, (b"x-request-id", self.request_id.encode())],
            }
        )
        self.summary["status"] = 200
        if batch[0]["type"] == "token" and self.after is None:
            self.metrics.time_to_first_token.observe(time.perf_counter() - self.started)
            self.summary["first_token_s"] = round(time.perf_counter() - self.started, 4)
        while True:
            body = []
            for event in batch:
                if event["type"] != "token":
                    self._ended(event)
                    ending = (
                        self.renderer.ending(event) if event["type"] == "done" else [error_event(_queue_error(event))]
                    )
                    body += [self._sse(chunk, (1, k)) for k, chunk in enumerate(ending) if self._unsent((1, k))]
                    await send({"type": "http.response.body", "body": b"".join(body), "more_body": False})
                    return
                chunk = self.renderer.chunk(event.get("index", 0), event["text"], tokens=[event])
                if chunk is not None and self._unsent((0, event["seq"])):
                    body.append(self._sse(chunk, (0, event["seq"])))
            if body:
                await send({"type": "http.response.body", "body": b"".join(body), "more_body": True})
            batch = await anext(batches)

    def _unsent(self, position: Position) -> bool:
        return self.after is None or position > self.after

    def _sse(self, chunk: bytes, position: Position) -> bytes:
        """The chunk as one SSE event, with its id when ids are on."""
        return b"id: " + event_id(self.request_id, position) + b"\n" + chunk if self.event_ids else chunk

    async def _whole(self, send, batch: list[dict], batches) -> None:
        tokens: list[dict] = []
        while batch[-1]["type"] == "token":
            tokens.extend(batch)
            batch = await anext(batches)
        tokens.extend(batch[:-1])
        event = batch[-1]
        self._ended(event)
        if event["type"] == "error":
            await self._error(send, _queue_error(event))
            return
        await self._json(send, 200, json.dumps(self.renderer.whole(tokens, event)).encode())

    def _ended(self, event: dict) -> None:
        self.finished = True
        if event["type"] == "done":
            usage = event["usage"]
            self.metrics.tokens.inc(usage["completion_tokens"])
            self.summary.update(
                finish_reason=event["finish_reason"],
                prompt_tokens=usage["prompt_tokens"],
                completion_tokens=usage["completion_tokens"],
                worker=event.get("worker"),
            )
        else:
            self.summary.update(error_code=event["code"])

    async def _timed_out(self, send, why: str) -> None:
        """No reply in time: cancel the job (so it does not run for nobody later) and say so."""
        self.finished = True
        self.metrics.cancels.labels("timeout").inc()
        await self.queue.cancel(self.request_id)
        error = APIError(504, f"{why}; the job was cancelled", "server_error", code="reply_timeout")
        if self.summary.get("status") == 200:  # mid-stream
            await send({"type": "http.response.body", "body": error_event(error), "more_body": False})
        else:
            await self._error(send, error)

    async def _error(self, send, error: APIError) -> None:
        self.finished = True
        await self._json(send, error.status, error.json(), error.headers)

    async def _json(self, send, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.summary["status"] = status
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", self.request_id.encode()),
                    *((name.lower().encode(), value.encode()) for name, value in (headers or {}).items()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _queue_error(event: dict) -> APIError:
    """A job's error event as its HTTP error (with Retry-After for a refusal for load)."""
    return from_queue(event["code"], event["message"], event.get("retry_after_s"))


async def _client_leaves(receive) -> None:
    """Returns once the client has disconnected (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
