"""The worker end to end in one process: jobs written to a real Redis stream, answered
on reply streams by the real engine, bad jobs rejected without disturbing the rest."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis

from service.config import RedisConfig
from service.worker import Worker
from tests.conftest import run_to_completion
from workers.request import SamplingParams

pytestmark = pytest.mark.slow


def stream_config(prefix: str, **overrides) -> RedisConfig:
    """Streams private to one test, and a short blocking read."""
    return RedisConfig(requests_stream=f"{prefix}:requests", dead_letter_stream=f"{prefix}:dead",
                       control_stream=f"{prefix}:control", consumer="w1", block_ms=200, **overrides)


async def read_replies(client, reply_to: str, timeout_s: float = 120) -> list[dict]:
    """Every entry of a reply stream up to its final event."""
    entries, last = [], "0"
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for _, chunk in await client.xread({reply_to: last}, block=500) or []:
            for entry_id, fields in chunk:
                last = entry_id
                entries.append({k.decode(): v for k, v in fields.items()})
                if fields[b"type"] in (b"done", b"error"):
                    return entries
    raise AssertionError(f"no final event on {reply_to}")


def test_jobs_in_replies_out_bad_jobs_dead_lettered(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()
    want = run_to_completion(make_engine(), {0: [("ref", "The capital of France is", SamplingParams(max_tokens=8))]})

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        worker = Worker(engine, client, config)
        serving = asyncio.create_task(worker.run(stop))
        stream = config.requests_stream
        await client.xadd(stream, {"id": f"{prefix}-good", "prompt": "The capital of France is", "max_tokens": "8"})
        await client.xadd(stream, {"payload": msgpack.packb({"id": f"{prefix}-chat", "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "Hi"}]})})
        await client.xadd(stream, {"id": f"{prefix}-bad", "prompt": "x", "max_tokens": "lots"})
        await client.xadd(stream, {"id": f"{prefix}-long", "prompt": "x", "max_tokens": "100000"})
        replies = {name: await read_replies(client, f"inflight:out:{{{prefix}-{name}}}")
                   for name in ("good", "chat", "bad", "long")}
        stop.set()
        await serving
        dead = await client.xrange(config.dead_letter_stream)
        pending = await client.xpending(stream, config.group)
        await client.delete(stream, config.dead_letter_stream,
                            *(f"inflight:out:{{{prefix}-{n}}}" for n in ("good", "chat", "bad", "long")))
        await client.aclose()
        return replies, dead, pending

    replies, dead, pending = asyncio.run(main())
    good = replies["good"]
    tokens = [e for e in good if e["type"] == b"token"]
    assert [int(e["seq"]) for e in tokens] == list(range(len(tokens)))
    assert [int(e["token_ids"]) for e in tokens] == want["ref"][0]
    assert b"".join(e["text"] for e in good).decode() == want["ref"][2]
    assert good[-1]["type"] == b"done" and good[-1]["finish_reason"] in (b"length", b"stop")
    assert replies["chat"][-1]["type"] == b"done"
    assert replies["bad"] == [replies["bad"][0]] and replies["bad"][0]["code"] == b"invalid_type"
    assert replies["long"][-1]["type"] == b"error" and replies["long"][-1]["code"] == b"invalid_request"
    assert sorted(record[b"code"] for _, record in dead) == [b"invalid_request", b"invalid_type"]
    assert pending["pending"] == 0  # everything acked: served, or parked as a dead letter


def test_a_cancel_on_the_control_stream_ends_the_request(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()
    reply_to = f"inflight:out:{{{prefix}-long}}"

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, client, config).run(stop))
        await asyncio.sleep(0.3)  # the control reader starts from new entries only
        await client.xadd(config.requests_stream, {"id": f"{prefix}-long", "prompt": "Count to a thousand:",
                                                   "max_tokens": "2000"})
        while not await client.xlen(reply_to):
            await asyncio.sleep(0.05)
        await client.xadd(config.control_stream, {"type": "cancel", "id": f"{prefix}-long"})
        replies = await read_replies(client, reply_to)
        stop.set()
        await serving
        await client.delete(config.requests_stream, config.dead_letter_stream, config.control_stream, reply_to)
        await client.aclose()
        return replies

    replies = asyncio.run(main())
    assert replies[-1]["type"] == b"done" and replies[-1]["finish_reason"] == b"cancelled"
    assert 0 < len(replies) - 1 < 2000


def test_shutdown_after_the_grace_period_leaves_unfinished_requests_pending(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix, shutdown_grace_s=0.3)
    engine = make_engine()
    reply_to = f"inflight:out:{{{prefix}-long}}"

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, client, config).run(stop))
        await client.xadd(config.requests_stream, {"id": f"{prefix}-long", "prompt": "Count to a thousand:",
                                                   "max_tokens": "2000"})
        while not await client.xlen(reply_to):
            await asyncio.sleep(0.05)
        stop.set()
        await serving
        replies = await client.xrange(reply_to)
        pending = await client.xpending(config.requests_stream, config.group)
        await client.delete(config.requests_stream, config.dead_letter_stream, reply_to)
        await client.aclose()
        return replies, pending

    replies, pending = asyncio.run(main())
    assert replies and all(fields[b"type"] == b"token" for _, fields in replies)  # no final event
    assert pending["pending"] == 1  # left for another worker to take over and continue


def test_the_worker_rides_out_dropped_connections_and_a_redis_restart(make_engine, tmp_path):
    """A private Redis (AOF on) whose connections are killed and which is restarted
    mid-stream: the request still completes with every seq exactly once."""
    import socket
    import subprocess
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = ["redis-server", "--port", str(port), "--dir", str(tmp_path), "--appendonly", "yes",
               "--save", "", "--bind", "127.0.0.1"]

    def start_server():
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                return server
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    server = start_server()
    config = RedisConfig(url=f"redis://127.0.0.1:{port}", consumer="w1", block_ms=200)
    engine = make_engine()
    reply_to = "inflight:out:{faults}"

    async def main():
        nonlocal server
        client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, client, config).run(stop))
        await client.xadd(config.requests_stream, {"id": "faults", "prompt": "Count to a thousand:",
                                                   "max_tokens": "160"})
        while await client.xlen(reply_to) < 10:
            await asyncio.sleep(0.05)
        await client.client_kill_filter(_type="normal", skipme=False)  # every connection dropped
        await asyncio.sleep(0.5)
        watcher = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
        while await watcher.xlen(reply_to) < 40:
            await asyncio.sleep(0.05)
        await watcher.aclose()
        server.terminate()  # a clean shutdown writes the AOF
        server.wait(timeout=30)
        await asyncio.sleep(1.0)  # generation goes on while Redis is away
        server = start_server()
        watcher = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
        replies = await read_replies(watcher, reply_to)
        stop.set()
        await serving
        pending = await watcher.xpending(config.requests_stream, config.group)
        await watcher.aclose()
        await client.aclose()
        return replies, pending

    try:
        replies, pending = asyncio.run(main())
    finally:
        server.terminate()
        server.wait(timeout=30)
    tokens = [e for e in replies if e["type"] == b"token"]
    assert [int(e["seq"]) for e in tokens] == list(range(len(tokens)))
    assert replies[-1]["type"] == b"done" and int(replies[-1]["completion_tokens"]) == len(tokens)
    assert pending["pending"] == 0


def test_the_sdk_submits_streams_and_cancels(make_engine):
    from service.sdk import Client

    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()

    async def main():
        redis_client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, redis_client, config).run(stop))
        await asyncio.sleep(0.3)
        async with Client(requests_stream=config.requests_stream, control_stream=config.control_stream,
                          block_ms=200) as client:
            answer = [e async for e in client.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                                       max_tokens=12, priority=2)]
            long_id = await client.submit("Count to a thousand:", max_tokens=2000)
            cancelled = []
            async for event in client.events(long_id):
                cancelled.append(event)
                if len(cancelled) == 3:
                    await client.cancel(long_id)
        stop.set()
        await serving
        await redis_client.delete(config.requests_stream, config.dead_letter_stream, config.control_stream,
                                  f"inflight:out:{{{long_id}}}")
        await redis_client.aclose()
        return answer, cancelled

    answer, cancelled = asyncio.run(main())
    assert [e["type"] for e in answer] == ["token"] * (len(answer) - 1) + ["done"]
    assert "Paris" in "".join(e["text"] for e in answer)
    assert cancelled[-1]["type"] == "done" and cancelled[-1]["finish_reason"] == "cancelled"
