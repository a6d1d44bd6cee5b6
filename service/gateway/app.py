"""The gateway's HTTP app (Starlette): the OpenAI routes, health and metrics.

LoRA adapters (service/adapters.py): a request's `model` names the base model or an
adapter the workers list in the registry (looked up only for a name other than the
base's); `/v1/models` lists both; `POST /v1/load_lora_adapter` (vLLM's route and names)
asks the workers to load one, through the control stream.

A completion is checked (auth, body, model, backlog) and queued as one job in the
handler; its answer (`JobResponse`) then follows the job's reply stream. The answer
waits for the job's first event before it sends a status line, so a job the worker
refuses gets its error status rather than a 200 with an error inside. While it waits and
streams it also listens for the client leaving (ASGI's `http.disconnect`, which arrives
at once, between tokens or while the job still waits in the queue) and then cancels the
job on the control stream, so its worker drops it within a step (or, with
`resume_grace_s`, once that long has passed with no one resuming the stream).

A streamed answer can be resumed (`service.gateway.resume`): a request with
`Last-Event-ID`, or `GET /v1/streams/{id}`, continues the job's answer where the client
left off, from its reply stream in Redis, at any gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from service.adapters import check_name
from service.config import GatewayConfig
from service.connect import connect
from service.gateway.auth import TENANT_HEADER, APIKeys
from service.gateway.batch_driver import BatchDriver
from service.gateway.batches import BatchesAPI
from service.gateway.errors import APIError
from service.gateway.files import FilesAPI
from service.gateway.job_response import JobResponse
from service.gateway.metrics import CLIENT_LEFT, GatewayMetrics
from service.gateway.openai_api import (
    CHAT,
    TEXT,
    names_another_model,
    read_request,
)
from service.gateway.queue import Queue, QueueUnavailable
from service.gateway.replies import BLOCK_MS
from service.gateway.resume import EVENT_IDS_HEADER, Position, StreamCards, read_event_id

log = structlog.get_logger("inflight.gateway")


class Gateway:
    def __init__(self, config: GatewayConfig, redis=None) -> None:
        self.config = config
        self.redis = redis if redis is not None else connect(config.redis_url, block_ms=BLOCK_MS)
        self.queue = Queue(self.redis, config)
        self.keys = APIKeys(config.api_keys)
        self.metrics = GatewayMetrics()
        self.metrics.backlog_depth.set_function(lambda: self.queue.backlog.depth)
        self.metrics.backlog_age.set_function(lambda: self.queue.backlog.oldest_s)
        self.started = int(time.time())
        self.cards = StreamCards(self.redis, config.requests_stream, config.stream_ttl_s)
        self._cancelling: set[asyncio.Task] = set()  # cancels waiting out resume_grace_s
        # The Batch API: files and batches in Redis, and the driver that runs batches.
        self.files = FilesAPI(self.redis, config, self.keys)
        self.batches = BatchesAPI(self.redis, config, self.keys, self.files.store, self._json)
        self.batch_driver = BatchDriver(config, self.queue, self.batches.store, self.files.store)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/streams/{request_id}", self.stream_again, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            *self.files.routes(),
            *self.batches.routes(),
        ]
        handlers = {APIError: _api_error, HTTPException: _http_error}
        return Starlette(
            routes=routes,
            # Starlette types a handler as taking any Exception; each of ours takes the class it is keyed by.
            exception_handlers=handlers,  # type: ignore[arg-type]
            lifespan=self._lifespan,
            middleware=[Middleware(_Measured, metrics=self.metrics)],
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        watching = asyncio.create_task(self.queue.watch_backlog(), name="backlog")
        reader = self.queue.reader
        reading = asyncio.create_task(reader.run(), name="replies") if reader is not None else None
        driving = asyncio.create_task(self.batch_driver.run(), name="batches")
        try:
            yield
        finally:
            await self.batch_driver.close(driving)
            watching.cancel()
            for cancelling in list(self._cancelling):  # stopping: jobs in their grace run on, to be resumed elsewhere
                cancelling.cancel()
                await asyncio.wait((cancelling,))
            if reader is not None and reading is not None:
                await reader.close(reading)
            with contextlib.suppress(asyncio.TimeoutError, OSError):
                await asyncio.wait_for(self.redis.aclose(), timeout=2)

    # -- routes ----------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> JobResponse:
        return await self._complete(request, CHAT)

    async def completions(self, request: Request) -> JobResponse:
        return await self._complete(request, TEXT)

    async def _complete(self, request: Request, kind: str) -> JobResponse:
        started = time.perf_counter()
        tenant = self.keys.tenant(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))
        if "last-event-id" in request.headers:  # a client reconnecting: no new job
            request_id, after = read_event_id(request.headers["last-event-id"])
            return await self._resume(request_id, after, tenant, started)
        body = await self._json(request)
        adapters = await self.adapters() if names_another_model(body, self.config) else {}
        parsed = read_request(kind, body, self.config, adapters)
        request_id = uuid.uuid4().hex
        payload = parsed.payload(request_id, tenant)
        why = self.queue.overloaded()
        if why:
            raise APIError(
                429,
                f"{why}; retry later",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        card = None
        try:
            if parsed.stream:
                async with self.redis.pipeline(transaction=False) as pipe:
                    card = self.cards.remember(pipe, request_id, parsed, tenant)
                    await self.queue.submit(payload, pipe)
            else:
                await self.queue.submit(payload)
        except QueueUnavailable as error:
            log.warning("queue_unavailable", error=str(error))
            raise APIError(
                503, "the queue (Redis) is unavailable; retry later", "server_error", code="queue_unavailable"
            ) from None
        event_ids = self.config.event_ids or _asked_for(request.headers.get(EVENT_IDS_HEADER))
        response = JobResponse(self, request_id, parsed, started, tenant, event_ids=event_ids)
        if card is not None:
            response.renderer.created, response.taken = card.created, 1
        return response

    async def stream_again(self, request: Request) -> JobResponse:
        """GET /v1/streams/{id}: a streamed job's answer again, from its start or after
        the request's `Last-Event-ID`."""
        started = time.perf_counter()
        tenant = self.keys.tenant(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))
        request_id, after = request.path_params["request_id"].removeprefix("chatcmpl-").removeprefix("cmpl-"), None
        if "last-event-id" in request.headers:
            named, after = read_event_id(request.headers["last-event-id"])
            if named != request_id:
                raise APIError(400, "Last-Event-ID is an event of another request", param="Last-Event-ID")
        return await self._resume(request_id, after, tenant, started)

    async def _resume(self, request_id: str, after: Position | None, tenant: str, started: float) -> JobResponse:
        try:
            card, taken = await self.cards.take(request_id, tenant)
        except RedisError:
            raise APIError(
                503, "the queue (Redis) is unavailable; retry later", "server_error", code="queue_unavailable"
            ) from None
        self.metrics.resumed.inc()
        response = JobResponse(self, request_id, card.parsed, started, tenant, event_ids=True, after=after)
        response.renderer.created, response.taken = card.created, taken
        return response

    def cancel_abandoned(self, request_id: str, taken: int | None) -> None:
        """The client of a job left: cancel it, at once or, where the answer can be resumed
        and `resume_grace_s` allows, once the grace has passed with no one taking it up."""
        grace_s = self.config.resume_grace_s if taken is not None else 0

        async def cancel() -> None:
            if grace_s and taken is not None:  # a grace only for a stream that can be taken up
                await asyncio.sleep(grace_s)
                with contextlib.suppress(RedisError):
                    if await self.cards.taken_since(request_id, taken):
                        return
            self.metrics.cancels.labels("disconnect").inc()
            await self.queue.cancel(request_id)

        cancelling = asyncio.get_running_loop().create_task(cancel())
        self._cancelling.add(cancelling)
        cancelling.add_done_callback(self._cancelling.discard)

    async def models(self, request: Request) -> Response:
        """The base model, then each LoRA adapter the workers serve, its `parent` the base (as
        vLLM lists them); without Redis, the base model alone."""
        self.keys.check(request.headers.get("authorization"))
        base = self.config.model_name
        model = {"id": base, "object": "model", "created": self.started, "owned_by": "inflight"}
        try:
            listed = await self.queue.adapters()
        except (RedisError, OSError):  # the base model is still served here; the adapters show again with Redis
            listed = {}
        adapters = [
            {**model, "id": name, "root": path, "parent": base}
            for name, path in sorted(listed.items())
            if name != base  # `model` naming it means the base model
        ]
        return JSONResponse({"object": "list", "data": [model, *adapters]})

    async def load_lora_adapter(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter `{"lora_name", "lora_path"}`: ask every worker to load
        the adapter. Asynchronous: the answer says the message is sent; the adapter is
        served once `/v1/models` lists it (a worker that cannot load it logs why)."""
        self.keys.check(request.headers.get("authorization"))
        body = await self._json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        path = body.get("lora_path")
        try:
            name = check_name(body.get("lora_name"))
        except ValueError as error:
            raise APIError(400, f"lora_name: {error}", param="lora_name") from None
        if not isinstance(path, str) or not path:
            raise APIError(400, "lora_path must be a folder on the workers' filesystem", param="lora_path")
        try:
            await self.queue.load_adapter(name, path)
        except QueueUnavailable:
            raise _unavailable() from None
        log.info("adapter_load_requested", adapter=name, path=path)
        return JSONResponse(
            {"object": "lora_adapter_load", "lora_name": name, "lora_path": path, "status": "requested"}
        )

    async def adapters(self) -> dict[str, str]:
        """The registry's adapters (name -> folder); a 503 while Redis does not answer."""
        try:
            return await self.queue.adapters()
        except (RedisError, OSError):
            raise _unavailable() from None

    async def health(self, request: Request) -> Response:
        why = await self.queue.ping()
        if why is None:
            return JSONResponse({"status": "ok", "redis": "ok"})
        return JSONResponse({"status": "unavailable", "redis": why}, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _json(self, request: Request):
        limit = self.config.max_body_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise APIError(413, f"the request body is over {limit} bytes")
        body = await request.body()
        if len(body) > limit:
            raise APIError(413, f"the request body is over {limit} bytes")
        try:
            return json.loads(body)
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None


def _unavailable() -> APIError:
    return APIError(503, "the queue (Redis) is unavailable; retry later", "server_error", code="queue_unavailable")


def _asked_for(header: str | None) -> bool:
    return (header or "").strip().lower() in ("1", "true", "yes", "on")


async def _api_error(request: Request, error: APIError) -> Response:
    return Response(error.json(), status_code=error.status, headers=error.headers, media_type="application/json")


async def _http_error(request: Request, error: HTTPException) -> Response:
    return await _api_error(request, APIError(error.status_code, str(error.detail), code=None))


class _Measured:
    """Counts every answer by route and status, and times it (pure ASGI, so streaming
    and disconnects pass through untouched)."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = CLIENT_LEFT

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status = 500 if status == CLIENT_LEFT else status
            raise
        finally:
            self.metrics.observe_request(scope["path"], status, time.perf_counter() - started)
