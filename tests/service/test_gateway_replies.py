"""How the gateway follows reply streams, against a real Redis: one blocking XREAD for
every stream, which a newly followed stream joins at once (the doorbell) rather than
after the read's wait; resumable reads that survive a Redis restart; an error retrying
cannot cure ends the requests, not the reader; on a cluster, a read per stream."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from bench.processes import RedisServer
from service.gateway.replies import ReplyReader, ReplyTimeout, read_alone

# Far longer than any wait below: a stream that arrives in time joined a waiting read.
LONG_BLOCK_MS = 60_000


async def take(batches, count: int) -> list[bytes]:
    """The next `count` entries' `n` fields, in order."""
    got: list[bytes] = []
    while len(got) < count:
        got += [fields[b"n"] for _, fields in await anext(batches)]
    return got


def test_a_stream_followed_while_the_read_waits_joins_it_at_once():
    async def main(prefix):
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=120)
        reader = ReplyReader(client, prefix, block_ms=LONG_BLOCK_MS)
        running = asyncio.create_task(reader.run())
        try:
            first = reader.entries(f"{prefix}:a", timeout_s=30)
            await client.xadd(f"{prefix}:a", {"n": 0})
            assert await take(first, 1) == [b"0"]  # the reader is blocked on `a` alone now

            started = time.monotonic()
            second = reader.entries(f"{prefix}:b", timeout_s=30)
            await client.xadd(f"{prefix}:b", {"n": 1})
            assert await take(second, 1) == [b"1"]
            assert time.monotonic() - started < 10  # not after the 60 s the read waits

            # Many entries on both land in order, each on its own stream.
            for n in range(2, 40):
                await client.xadd(f"{prefix}:{'ab'[n % 2]}", {"n": n})
            assert await take(first, 19) == [str(n).encode() for n in range(2, 40, 2)]
            assert await take(second, 19) == [str(n).encode() for n in range(3, 40, 2)]
            await first.aclose()
            await second.aclose()
            assert not reader._following
        finally:
            await reader.close(running)
            assert not await client.exists(reader.doorbell)  # the reader's doorbell goes with it
            await client.delete(f"{prefix}:a", f"{prefix}:b")
            await client.aclose()

    asyncio.run(main(f"inflight:test-replies-{uuid.uuid4().hex[:8]}"))


def test_a_silent_stream_times_out_and_a_bad_key_fails_only_those_following():
    async def main(prefix):
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=10)
        reader = ReplyReader(client, prefix, block_ms=200)
        running = asyncio.create_task(reader.run())
        try:
            with pytest.raises(ReplyTimeout):
                await anext(reader.entries(f"{prefix}:silent", timeout_s=0.3))

            await client.set(f"{prefix}:not-a-stream", "x")  # XREAD on it: WRONGTYPE, every time
            with pytest.raises(Exception, match="WRONGTYPE"):
                await anext(reader.entries(f"{prefix}:not-a-stream", timeout_s=10))
            later = reader.entries(f"{prefix}:fine", timeout_s=10)  # the reader still serves
            await client.xadd(f"{prefix}:fine", {"n": 7})
            assert await take(later, 1) == [b"7"]
            await later.aclose()
        finally:
            await reader.close(running)
            await client.delete(f"{prefix}:not-a-stream", f"{prefix}:fine")
            await client.aclose()

    asyncio.run(main(f"inflight:test-replies-{uuid.uuid4().hex[:8]}"))


def test_reads_resume_from_the_last_entry_across_a_redis_restart(tmp_path):
    async def main(server):
        client = aioredis.Redis.from_url(server.url, socket_timeout=5)
        reader = ReplyReader(client, "t", block_ms=200)
        running = asyncio.create_task(reader.run())

        async def add(key: str, n: int) -> None:  # on a connection of its own: the restart drops the others
            async with aioredis.Redis.from_url(server.url) as writer:
                await writer.xadd(key, {"n": n})

        try:
            for follow in (lambda key: reader.entries(key, timeout_s=30), lambda key: read_alone(client, key, 30)):
                key = f"t:{uuid.uuid4().hex[:6]}"
                batches = follow(key)
                await add(key, 1)
                assert await take(batches, 1) == [b"1"]
                server.stop()  # its append-only file keeps the stream; the connections go
                server.start()
                await add(key, 2)
                await add(key, 3)
                assert await take(batches, 2) == [b"2", b"3"]  # nothing lost, nothing repeated
                await batches.aclose()
        finally:
            await reader.close(running)
            await client.aclose()

    with RedisServer(tmp_path) as server:
        asyncio.run(main(server))
