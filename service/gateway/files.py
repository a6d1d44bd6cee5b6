"""The Files API (`/v1/files`): the Batch API's input and output files.

A file lives in Redis, one hash holding its object and its content, so any gateway
answers for it and a restart loses nothing. It belongs to the tenant that uploaded it (or
whose batch wrote it): another tenant is told it does not exist. It expires `file_ttl_s`
after it was made, as OpenAI's batch files do, and a tenant's list forgets it then.
Uploads are JSONL for batches only (purpose `batch`), at most `max_file_bytes` and
`max_file_lines` non-blank lines, read through Starlette's multipart parser, which
spools a large file to disk rather than holding it in memory.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from service.config import GatewayConfig
from service.gateway.auth import TENANT_HEADER, APIKeys
from service.gateway.errors import APIError, bad_request
from service.text import text

FILE_PREFIX = "file-"
PURPOSES = ("batch", "batch_output")  # what a file may be: uploads are `batch` only
MAX_LIST_LIMIT = 10_000  # OpenAI's cap on one page of files
MULTIPART_SLACK_BYTES = 64 << 10  # the form's own bytes around the file


def not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="file_id")


class FileStore:
    """Files in Redis: `<requests stream>:file:{<id>}` (the object, its tenant, its content),
    and a sorted set of each tenant's file ids by creation time."""

    def __init__(self, redis, config: GatewayConfig) -> None:
        self.redis = redis
        self.config = config
        self.namespace = config.requests_stream

    def _key(self, file_id: str) -> str:
        return f"{self.namespace}:file:{{{file_id}}}"

    def _index(self, tenant: str) -> str:
        return f"{self.namespace}:files:by-tenant:{tenant}"

    async def put(self, tenant: str, filename: str, purpose: str, content: bytes, file_id: str | None = None) -> dict:
        """Store a file (a given id is overwritten: a batch's output written again after a
        takeover is the same file); returns its object."""
        file_id = file_id or FILE_PREFIX + uuid.uuid4().hex
        now = time.time()
        ttl_s = self.config.file_ttl_s
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(now),
            "expires_at": int(now) + ttl_s,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",  # deprecated by OpenAI, still read by its clients
            "status_details": None,
        }
        key = self._key(file_id)
        async with self.redis.pipeline(transaction=False) as pipe:  # two slots: no transaction
            pipe.hset(key, mapping={"object": json.dumps(obj), "tenant": tenant, "content": content})
            pipe.expire(key, ttl_s)
            pipe.zadd(self._index(tenant), {file_id: now})
            await pipe.execute()
        return obj

    async def get(self, tenant: str, file_id: str) -> dict:
        """The file's object; 404 when there is none, or it is another tenant's."""
        obj, owner = await self.redis.hmget(self._key(file_id), ["object", "tenant"])
        if obj is None or text(owner) != tenant:
            raise not_found(file_id)
        return json.loads(obj)

    async def content(self, tenant: str | None, file_id: str) -> bytes | None:
        """The file's bytes; None when there is none, or it is another tenant's (any
        tenant's when `tenant` is None: a batch reads its own input)."""
        content, owner = await self.redis.hmget(self._key(file_id), ["content", "tenant"])
        if content is None or (tenant is not None and text(owner) != tenant):
            return None
        return content

    async def delete(self, tenant: str, file_id: str) -> None:
        await self.get(tenant, file_id)  # 404 unless it is this tenant's
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self._key(file_id))
            pipe.zrem(self._index(tenant), file_id)
            await pipe.execute()

    async def page(
        self, tenant: str, limit: int, after: str | None, newest_first: bool, purpose: str | None
    ) -> tuple[list[dict], bool]:
        """A page of the tenant's files: up to `limit` objects after the file `after`, and
        whether more follow. Files that expired leave the index as the list meets them."""
        index = self._index(tenant)
        ids = [text(i) for i in await self.redis.zrange(index, 0, -1, desc=newest_first)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page: list[dict] = []
        for start in range(0, len(ids), 100):
            chunk = ids[start : start + 100]
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in chunk:
                    pipe.hget(self._key(file_id), "object")
                objects = await pipe.execute()
            gone = [file_id for file_id, obj in zip(chunk, objects, strict=True) if obj is None]
            if gone:
                await self.redis.zrem(index, *gone)
            for obj in objects:
                if obj is not None and (purpose is None or json.loads(obj)["purpose"] == purpose):
                    if len(page) == limit:
                        return page, True
                    page.append(json.loads(obj))
        return page, False


class FilesAPI:
    """The `/v1/files` routes."""

    def __init__(self, redis, config: GatewayConfig, keys: APIKeys) -> None:
        self.config = config
        self.keys = keys
        self.store = FileStore(redis, config)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.list, methods=["GET"]),
            Route("/v1/files/{file_id}", self.retrieve, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.content, methods=["GET"]),
        ]

    def _tenant(self, request: Request) -> str:
        return self.keys.tenant(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))

    async def upload(self, request: Request) -> Response:
        tenant = self._tenant(request)
        limit = self.config.max_file_bytes
        if int(request.headers.get("content-length") or 0) > limit + MULTIPART_SLACK_BYTES:
            raise _too_large(limit)
        capped = Request(request.scope, _capped(request.receive, limit + MULTIPART_SLACK_BYTES))
        async with capped.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise bad_request("purpose must be `batch`: this server keeps files for the Batch API only", "purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("file must be a file part of a multipart/form-data body", "file")
            content = await upload.read()
            filename = upload.filename or "upload.jsonl"
        if len(content) > limit:
            raise _too_large(limit)
        try:
            decoded = content.decode()
        except UnicodeDecodeError:
            raise bad_request("the file must be UTF-8 text (JSONL)", "file") from None
        lines = sum(1 for line in decoded.split("\n") if line.strip())
        if lines > self.config.max_file_lines:
            raise bad_request(f"the file has {lines} lines, over the limit of {self.config.max_file_lines}", "file")
        return JSONResponse(await self.store.put(tenant, filename, purpose, content))

    async def list(self, request: Request) -> Response:
        tenant = self._tenant(request)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be `asc` or `desc`", "order")
        limit = page_limit(query.get("limit"), default=MAX_LIST_LIMIT, most=MAX_LIST_LIMIT)
        files, more = await self.store.page(tenant, limit, query.get("after"), order == "desc", query.get("purpose"))
        return JSONResponse(page_of(files, more))

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self.store.get(self._tenant(request), request.path_params["file_id"]))

    async def content(self, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        content = await self.store.content(self._tenant(request), file_id)
        if content is None:
            raise not_found(file_id)
        return Response(content, media_type="application/octet-stream")

    async def delete(self, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        await self.store.delete(self._tenant(request), file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def page_of(objects: list[dict], has_more: bool) -> dict:
    """A list answer as OpenAI's cursor pages have it (`after` = `last_id` for the next)."""
    return {
        "object": "list",
        "data": objects,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": has_more,
    }


def page_limit(text: str | None, default: int, most: int) -> int:
    """A list's `limit` query parameter: `default` when absent, else 1..`most` (400 otherwise)."""
    if text is None:
        return default
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise bad_request(f"limit must be an integer from 1 to {most}", "limit")
    return limit


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the file is over {limit} bytes")


def _capped(receive, limit: int):
    """`receive`, refusing (413) a body that runs past `limit` bytes, whatever its
    content-length said: the form parser would otherwise spool all of it."""
    received = 0

    async def receiving():
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise _too_large(limit)
        return message

    return receiving
