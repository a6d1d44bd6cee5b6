"""The Batch API (`/v1/batches`): batch objects, their state in Redis, and the routes.

A batch is a hash in Redis, with its requests, results and jobs in flight beside it
under the same hash tag (one slot on a Redis Cluster, so each step below is one atomic
script): any gateway answers for it, and the gateway driving it
(`service/gateway/batch_driver.py`) can die at any point without a line lost or counted
twice. Its status moves as OpenAI's does:

    validating -> in_progress -> finalizing -> completed
    validating -> failed                     (a bad input file: `errors` names the lines)
    in_progress -> expired                   (the window ended; what finished is kept)
    validating | in_progress -> cancelling -> cancelled

`request_counts` are counted as results are recorded: `completed` the output file's
lines, `failed` the error file's; at the end they add up to `total`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from service.config import GatewayConfig
from service.gateway.auth import TENANT_HEADER, APIKeys
from service.gateway.batch_lines import ENDPOINTS
from service.gateway.errors import APIError, bad_request
from service.gateway.files import FileStore, page_limit, page_of
from service.lua_scripts import lua
from service.text import text

BATCH_PREFIX = "batch_"
COMPLETION_WINDOWS = ("24h",)  # OpenAI's only one
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
CANCELLABLE = ("validating", "in_progress")
TIMESTAMPS = tuple(
    f"{status}_at"
    for status in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_BATCH_LIST = 100
CHUNK = 500  # lines per Redis command when a batch moves many at once

# The scripts, each described at the top of its file in service/lua/.
TRANSITION = lua("batches_transition")
START = lua("batches_start")
CLAIM = lua("batches_claim")
CLAIM_REST = lua("batches_claim_rest")
RETRY = lua("batches_retry")
RECORD = lua("batches_record")
RENEW = lua("batches_renew")
RELEASE = lua("batches_release")


def not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", param="batch_id")


class BatchStore:
    """Batches in Redis. `<requests stream>:batch:{<id>}` is the batch (its object, status,
    times, counts, the next line to run), with `:requests` (the input's lines, copied when
    validated, so deleting the input file disturbs nothing), `:results` (line -> its output
    or error line), `:inflight` (line -> attempt of the job now queued) and `:lease` (the
    gateway driving it). `...:batches:active` lists the batches a driver must take up."""

    def __init__(self, redis, config: GatewayConfig) -> None:
        self.redis = redis
        self.namespace = config.requests_stream
        self.window_s = config.batch_window_s
        self.active_key = f"{self.namespace}:batches:active"
        self._transition = redis.register_script(TRANSITION)
        self._start = redis.register_script(START)
        self._claim = redis.register_script(CLAIM)
        self._claim_rest = redis.register_script(CLAIM_REST)
        self._retry = redis.register_script(RETRY)
        self._record = redis.register_script(RECORD)
        self._renew = redis.register_script(RENEW)
        self._release = redis.register_script(RELEASE)

    def key(self, batch_id: str, part: str = "") -> str:
        return f"{self.namespace}:batch:{{{batch_id}}}" + (f":{part}" if part else "")

    def _index(self, tenant: str) -> str:
        return f"{self.namespace}:batches:by-tenant:{tenant}"

    # -- the API's side ----------------------------------------------------------------------

    async def create(self, tenant: str, endpoint: str, input_file_id: str, window: str, metadata) -> dict:
        batch_id = BATCH_PREFIX + uuid.uuid4().hex
        now = time.time()
        obj = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": window,
            "created_at": int(now),
            "expires_at": int(now + self.window_s),
            "metadata": metadata,
        }
        fields = {"object": json.dumps(obj), "tenant": tenant, "status": "validating", "deadline": now + self.window_s}
        async with self.redis.pipeline(transaction=False) as pipe:  # three slots: the batch is written first
            pipe.hset(self.key(batch_id), mapping=fields)
            pipe.zadd(self._index(tenant), {batch_id: now})
            pipe.sadd(self.active_key, batch_id)
            await pipe.execute()
        return batch_object({k.encode(): str(v).encode() for k, v in fields.items()})

    async def get(self, tenant: str, batch_id: str) -> dict:
        fields = await self.fields(batch_id)
        if fields is None or fields[b"tenant"].decode() != tenant:
            raise not_found(batch_id)
        return batch_object(fields)

    async def page(self, tenant: str, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """Newest first, as OpenAI lists batches."""
        ids = [text(i) for i in await self.redis.zrange(self._index(tenant), 0, -1, desc=True)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = []
        for batch_id in ids[: limit + 1]:
            fields = await self.fields(batch_id)
            if fields is not None:
                page.append(batch_object(fields))
        return page[:limit], len(page) > limit

    async def cancel(self, tenant: str, batch_id: str) -> dict:
        """Ask for the batch to be cancelled: the driver winds it down."""
        await self.get(tenant, batch_id)  # 404 unless it is this tenant's
        moved, status = await self.transition(batch_id, CANCELLABLE, "cancelling", cancelling_at=int(time.time()))
        if not moved and status not in ("cancelling", "cancelled"):
            raise APIError(409, f"a batch that is {status} cannot be cancelled", param="batch_id")
        return await self.get(tenant, batch_id)

    # -- the driver's side -------------------------------------------------------------------

    async def fields(self, batch_id: str) -> dict[bytes, bytes] | None:
        return await self.redis.hgetall(self.key(batch_id)) or None

    async def active(self) -> list[str]:
        return [text(i) for i in await self.redis.smembers(self.active_key)]

    async def transition(self, batch_id: str, from_: tuple[str, ...], to: str, **fields) -> tuple[bool, str]:
        pairs = [item for name_value in fields.items() for item in name_value]
        moved, status = await self._transition(keys=[self.key(batch_id)], args=[",".join(from_), to, *pairs])
        return bool(moved), text(status)

    async def start(self, batch_id: str, requests: list[str]) -> str:
        """Put the validated requests in place, then start the batch. A driver dying
        before the start leaves it validating, to be validated again from scratch."""
        key = self.key(batch_id, "requests")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            for start in range(0, len(requests), CHUNK):
                pipe.rpush(key, *requests[start : start + CHUNK])
            await pipe.execute()
        return text(await self._start(keys=[self.key(batch_id)], args=[len(requests), int(time.time())]))

    async def request(self, batch_id: str, line: int) -> dict:
        return json.loads(await self.redis.lindex(self.key(batch_id, "requests"), line))

    async def requests(self, batch_id: str, first: int, last: int) -> list[dict]:
        """Lines first..last (inclusive)."""
        return [json.loads(line) for line in await self.redis.lrange(self.key(batch_id, "requests"), first, last)]

    async def claim(self, batch_id: str) -> int | None:
        line = await self._claim(keys=[self.key(batch_id), self.key(batch_id, "inflight")])
        return None if line < 0 else line

    async def claim_rest(self, batch_id: str) -> int:
        return await self._claim_rest(keys=[self.key(batch_id)])

    async def in_flight(self, batch_id: str) -> dict[int, int]:
        """Line -> attempt of every job queued and not yet recorded."""
        return {
            int(line): int(attempt)
            for line, attempt in (await self.redis.hgetall(self.key(batch_id, "inflight"))).items()
        }

    async def retry(self, batch_id: str, line: int, attempt: int) -> None:
        await self._retry(keys=[self.key(batch_id), self.key(batch_id, "inflight")], args=[line, attempt])

    async def record(self, batch_id: str, results: dict[int, str]) -> None:
        """Results by line: `o<output line>` or `e<error file line>`."""
        keys = [self.key(batch_id), self.key(batch_id, "results"), self.key(batch_id, "inflight")]
        items = list(results.items())
        for start in range(0, len(items), CHUNK):
            await self._record(keys=keys, args=[item for pair in items[start : start + CHUNK] for item in pair])

    async def results(self, batch_id: str) -> dict[int, bytes]:
        return {int(line): record async for line, record in self.redis.hscan_iter(self.key(batch_id, "results"))}

    async def retire(self, batch_id: str) -> None:
        """An ended batch: no driver takes it up again, and its working keys go (its
        results are in its files by now)."""
        await self.redis.srem(self.active_key, batch_id)
        await self.redis.delete(*(self.key(batch_id, part) for part in ("requests", "results", "inflight")))

    async def lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        return bool(await self.redis.set(self.key(batch_id, "lease"), owner, nx=True, px=int(lease_s * 1000)))

    async def renew(self, batch_id: str, owner: str, lease_s: float) -> bool:
        return bool(await self._renew(keys=[self.key(batch_id, "lease")], args=[owner, int(lease_s * 1000)]))

    async def release(self, batch_id: str, owner: str) -> None:
        await self._release(keys=[self.key(batch_id, "lease")], args=[owner])


def batch_object(fields: dict[bytes, bytes]) -> dict:
    """The batch as OpenAI's Batch object, from its hash."""
    values = {k.decode(): v.decode() for k, v in fields.items() if k != b"errors"}
    obj = json.loads(values["object"])
    errors = fields.get(b"errors")
    obj.update(
        status=values["status"],
        errors={"object": "list", "data": json.loads(errors)} if errors else None,
        output_file_id=values.get("output_file_id"),
        error_file_id=values.get("error_file_id"),
        request_counts={name: int(values.get(name, 0)) for name in ("total", "completed", "failed")},
        **{name: int(values[name]) if name in values else None for name in TIMESTAMPS},
    )
    return obj


class BatchesAPI:
    """The `/v1/batches` routes."""

    def __init__(
        self, redis, config: GatewayConfig, keys: APIKeys, files: FileStore, read_json: Callable[..., Awaitable]
    ) -> None:
        self.keys = keys
        self.files = files
        self.read_json = read_json  # the gateway's body reader (size cap, 400 on bad JSON)
        self.store = BatchStore(redis, config)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.list, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    def _tenant(self, request: Request) -> str:
        return self.keys.tenant(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))

    async def create(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if window not in COMPLETION_WINDOWS:
            raise bad_request("completion_window must be `24h`", "completion_window")
        metadata = _metadata(body.get("metadata"))
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise bad_request("input_file_id must be a file id", "input_file_id")
        try:
            purpose = (await self.files.get(tenant, input_file_id))["purpose"]
        except APIError:
            raise bad_request(f"No such File object: {input_file_id}", "input_file_id") from None
        if purpose != "batch":
            raise bad_request("the input file's purpose must be `batch`", "input_file_id")
        return JSONResponse(await self.store.create(tenant, endpoint, input_file_id, window, metadata))

    async def list(self, request: Request) -> Response:
        limit = page_limit(request.query_params.get("limit"), default=20, most=MAX_BATCH_LIST)
        batches, more = await self.store.page(self._tenant(request), limit, request.query_params.get("after"))
        return JSONResponse(page_of(batches, more))

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self.store.get(self._tenant(request), request.path_params["batch_id"]))

    async def cancel(self, request: Request) -> Response:
        return JSONResponse(await self.store.cancel(self._tenant(request), request.path_params["batch_id"]))


def _metadata(metadata) -> dict | None:
    """OpenAI's metadata: up to 16 string pairs, keys to 64 characters, values to 512."""
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY for k in metadata)
        or not all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE for v in metadata.values())
    ):
        raise bad_request(
            f"metadata must map at most {MAX_METADATA_PAIRS} keys of up to {MAX_METADATA_KEY} characters "
            f"to strings of up to {MAX_METADATA_VALUE}",
            "metadata",
        )
    return metadata
