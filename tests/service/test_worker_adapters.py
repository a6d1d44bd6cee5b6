"""A worker without multi-LoRA (no `--lora-dir`), in process on the shared model: asked to
load an adapter through the control stream, it logs that multi-LoRA is off, counts the
failed load, lists nothing in the registry, and serves on; a job naming an adapter gets
`unknown_adapter` on its reply stream, the others their answers."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis
from structlog.testing import capture_logs

from service.adapters import load_message, registry_key
from service.worker import Worker
from tests.service.test_worker import read_replies, stream_config
from tests.waiting import eventually


async def answer(client, config, request_id: str, **fields: str) -> list[dict]:
    await client.xadd(config.requests_stream, {"id": request_id, "prompt": "Hi", "max_tokens": "2", **fields})
    return await read_replies(client, f"inflight:out:{{{request_id}}}")


def test_a_worker_without_multi_lora_logs_a_load_and_serves_on(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        worker = Worker(engine, client, config)
        serving = asyncio.create_task(worker.run(stop))
        registry = worker.metrics.registry
        try:
            replies = {"base": await answer(client, config, f"{prefix}-base")}  # serving: the control stream followed
            await client.xadd(config.control_stream, load_message("sql", "/nowhere/sql"))
            await eventually(
                lambda: registry.get_sample_value("inflight_adapter_load_requests_total", {"outcome": "failed"}) == 1,
                30,
                "the failed load to be counted",
            )
            replies["lora"] = await answer(client, config, f"{prefix}-lora", adapter="sql")
            replies["after"] = await answer(client, config, f"{prefix}-after")
            listed = await client.exists(registry_key(config.requests_stream))
        finally:
            stop.set()
            await serving
            keys = [key async for key in client.scan_iter(match=f"*{prefix}*")]
            await client.delete(*keys)
            await client.aclose()
        return replies, listed

    with capture_logs() as logs:
        replies, listed = asyncio.run(main())
    assert replies["lora"][-1]["type"] == b"error" and replies["lora"][-1]["code"] == b"unknown_adapter"
    assert replies["base"][-1]["type"] == replies["after"][-1]["type"] == b"done"
    assert not listed
    failures = [line for line in logs if line["event"] == "adapter_not_loaded"]
    assert len(failures) == 1 and "multi-LoRA is off" in failures[0]["error"], logs
