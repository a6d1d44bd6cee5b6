"""The reply outbox against a real Redis: a step's events for many streams go out in one
pipelined round trip, in order within each stream, fenced per stream; TTLs are set at
the first and final writes and refreshed at a bounded rate; a slow Redis gets bigger
round trips, never lost or repeated events."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bench.processes import RedisServer
from service.outbox import ReplyOutbox
from service.publish import LeaseLost, ReplyPublisher, owner_key
from tests.waiting import stream_reaches
from workers.api import FinalEvent, FinishReason, Timings, TokenEvent, Usage


class CountingPublisher(ReplyPublisher):
    """The real publisher, counting its round trips."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.appends: list[int] = []  # streams written per call

    async def append(self, appends):
        self.appends.append(len(appends))
        return await super().append(appends)


def token(request_id: str, token_id: int) -> TokenEvent:
    return TokenEvent(request_id, (token_id,), f"<{token_id}>")


def done(request_id: str, num_tokens: int) -> FinalEvent:
    return FinalEvent(request_id, FinishReason.LENGTH, Usage(3, num_tokens), Timings(0.0, 0.1, 0.2, ()))


async def events_of(client, reply_to: str) -> list[dict]:
    return [msgpack.unpackb(fields[b"data"]) for _, fields in await client.xrange(reply_to)]


@pytest.fixture
def prefix():
    return f"inflight:out:test-{uuid.uuid4().hex[:8]}"


async def opened(client, publisher, outbox, prefix, count):
    """`count` jobs with claimed reply streams, open in the outbox: {request id: (reply_to, future)}."""
    jobs = {}
    for i in range(count):
        request_id, reply_to = f"{i}-0", f"{prefix}:{{{i}}}"
        assert (await publisher.claim(reply_to, request_id)).owned
        jobs[request_id] = (reply_to, outbox.open(request_id, reply_to, request_id, 0))
    return jobs


async def cleanup(client, jobs):
    await client.delete(*[key for reply_to, _ in jobs.values() for key in (reply_to, owner_key(reply_to))])
    await client.aclose()


def test_one_round_trip_per_step_carries_every_stream_in_order():
    async def main(prefix):
        client = aioredis.Redis(host="127.0.0.1", port=6379)
        publisher = CountingPublisher(client, ttl_s=3600, worker="w")
        outbox = ReplyOutbox(publisher)
        jobs = await opened(client, publisher, outbox, prefix, 64)
        flusher = asyncio.create_task(outbox.run())
        for step in range(3):
            outbox.on_events([token(request_id, step) for request_id in jobs])
            await asyncio.sleep(0)  # the flusher takes this step alone
            while publisher.appends[-1:] != [64] or len(publisher.appends) < step + 1:
                await asyncio.sleep(0.001)
        outbox.on_events([done(request_id, 3) for request_id in jobs])
        results = await asyncio.gather(*(future for _, future in jobs.values()))
        flusher.cancel()
        assert publisher.appends == [64, 64, 64, 64]  # one call per step, each for every stream
        assert all(result.num_tokens == 3 for result in results)
        for request_id, (reply_to, _) in jobs.items():
            events = await events_of(client, reply_to)
            assert [e["seq"] for e in events[:-1]] == [0, 1, 2]
            assert [e["token_ids"] for e in events[:-1]] == [[0], [1], [2]]
            assert events[-1]["type"] == "done"
        await cleanup(client, jobs)

    asyncio.run(main(f"inflight:out:test-{uuid.uuid4().hex[:8]}"))


def test_ttl_is_set_at_the_first_and_final_writes_and_not_on_every_token(prefix):
    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379)
        publisher = ReplyPublisher(client, ttl_s=1000, worker="w")
        outbox = ReplyOutbox(publisher)
        jobs = await opened(client, publisher, outbox, prefix, 1)
        ((request_id, (reply_to, future)),) = jobs.items()
        flusher = asyncio.create_task(outbox.run())
        outbox.on_events([token(request_id, 0)])
        await stream_reaches(client, reply_to, 1)
        assert 990 < await client.ttl(reply_to) <= 1000  # the first write set it
        await client.expire(reply_to, 500)
        outbox.on_events([token(request_id, 1)])
        await stream_reaches(client, reply_to, 2)
        assert await client.ttl(reply_to) <= 500  # a token within the refresh interval leaves it
        outbox.on_events([done(request_id, 2)])
        await future
        assert 990 < await client.ttl(reply_to) <= 1000  # the final event sets it again
        assert 990 < await client.ttl(owner_key(reply_to)) <= 1000
        flusher.cancel()
        await cleanup(client, jobs)

    asyncio.run(main())


def test_a_lost_lease_or_a_wrong_type_fails_that_stream_only(prefix):
    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379)
        publisher = ReplyPublisher(client, ttl_s=3600, worker="w")
        outbox = ReplyOutbox(publisher)
        jobs = await opened(client, publisher, outbox, prefix, 3)
        (stolen, (stolen_to, stolen_future)), (broken, (broken_to, broken_future)), (fine, (fine_to, fine_future)) = (
            jobs.items()
        )
        await ReplyPublisher(client, 3600, "another worker").claim(stolen_to, stolen)  # a takeover
        await client.delete(broken_to)
        await client.set(broken_to, "not a stream")
        flusher = asyncio.create_task(outbox.run())
        outbox.on_events([token(r, 0) for r in jobs] + [done(r, 1) for r in jobs])
        with pytest.raises(LeaseLost):
            await stolen_future
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await broken_future
        assert (await fine_future).num_tokens == 1
        assert [e["type"] for e in await events_of(client, fine_to)] == ["token", "done"]
        assert await client.xlen(stolen_to) == 0  # the other worker's stream, untouched
        flusher.cancel()
        await cleanup(client, jobs)

    asyncio.run(main())


def test_a_slow_redis_gets_bigger_round_trips_and_every_event_exactly_once(tmp_path):
    """While Redis is busy (DEBUG SLEEP), steps go on; their events gather and go out
    together when it answers."""

    async def main(server):
        client = aioredis.Redis.from_url(server.url)
        publisher = CountingPublisher(client, ttl_s=3600, worker="w")
        outbox = ReplyOutbox(publisher)
        jobs = await opened(client, publisher, outbox, "inflight:out:slow", 8)
        flusher = asyncio.create_task(outbox.run())
        sleeper = aioredis.Redis.from_url(server.url)
        stall = asyncio.create_task(sleeper.execute_command("DEBUG", "SLEEP", "0.3"))
        await asyncio.sleep(0.05)  # the server is asleep now
        for step in range(20):
            outbox.on_events([token(request_id, step) for request_id in jobs])
            await asyncio.sleep(0.005)  # an engine step
        outbox.on_events([done(request_id, 20) for request_id in jobs])
        results = await asyncio.gather(*(future for _, future in jobs.values()))
        await stall
        flusher.cancel()
        assert len(publisher.appends) < 21  # fewer round trips than steps
        assert all(result.num_tokens == 20 for result in results)
        for reply_to, _ in jobs.values():
            events = await events_of(client, reply_to)
            assert [e["seq"] for e in events[:-1]] == list(range(20)) and events[-1]["type"] == "done"
        await sleeper.aclose()
        await client.aclose()

    with RedisServer(tmp_path, appendonly=False, args=("--enable-debug-command", "local")) as server:
        asyncio.run(main(server))


def test_a_redis_restart_mid_stream_loses_and_repeats_nothing(tmp_path):
    """The pipeline in flight when Redis went away is sent again whole; what had landed is
    recognised by its entry id."""

    async def main():
        with RedisServer(tmp_path, args=("--appendfsync", "always")) as server:  # a kill loses nothing acknowledged
            client = aioredis.Redis.from_url(server.url, socket_timeout=5)
            publisher = ReplyPublisher(client, ttl_s=3600, worker="w")
            outbox = ReplyOutbox(publisher)
            jobs = await opened(client, publisher, outbox, "inflight:out:restart", 16)
            flusher = asyncio.create_task(outbox.run())
            for step in range(30):
                outbox.on_events([token(request_id, step) for request_id in jobs])
                if step == 10:
                    server.kill()  # mid-stream, maybe mid-pipeline
                if step == 20:
                    server.start()
                await asyncio.sleep(0.01)
            outbox.on_events([done(request_id, 30) for request_id in jobs])
            results = await asyncio.wait_for(asyncio.gather(*(future for _, future in jobs.values())), 60)
            flusher.cancel()
            assert all(result.num_tokens == 30 for result in results)
            for reply_to, _ in jobs.values():
                events = await events_of(client, reply_to)
                assert [e["seq"] for e in events[:-1]] == list(range(30)) and events[-1]["type"] == "done"
            await client.aclose()

    asyncio.run(main())


def test_events_a_failover_lost_are_written_again_before_the_next_ones(prefix):
    """Asynchronous replication: the new primary may lack the last events the old one took,
    and their owner key. Simulated here by deleting them: the next write finds the gap and
    what was lost goes again, in order, each seq once."""

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379)
        publisher = ReplyPublisher(client, ttl_s=3600, worker="w")
        outbox = ReplyOutbox(publisher)
        jobs = await opened(client, publisher, outbox, prefix, 3)
        (tail, (tail_to, tail_future)), (whole, (whole_to, whole_future)), (kept, (kept_to, kept_future)) = jobs.items()
        flusher = asyncio.create_task(outbox.run())
        for step in range(5):
            outbox.on_events([token(r, step) for r in jobs])
        for reply_to, _ in jobs.values():
            await stream_reaches(client, reply_to, 5)
        kept_entries = (await client.xrange(tail_to))[:-2]  # the last two events lost, as on a replica
        await client.delete(tail_to, owner_key(tail_to))
        for entry_id, fields in kept_entries:
            await client.xadd(tail_to, fields, id=entry_id)
        await client.delete(owner_key(tail_to), whole_to, owner_key(whole_to))  # everything lost
        outbox.on_events([token(r, 5) for r in jobs] + [done(r, 6) for r in jobs])
        results = await asyncio.gather(tail_future, whole_future, kept_future)
        flusher.cancel()
        assert [result.num_tokens for result in results] == [6, 6, 6]
        for reply_to in (tail_to, whole_to, kept_to):
            events = await events_of(client, reply_to)
            assert [e.get("seq") for e in events] == [0, 1, 2, 3, 4, 5, None]
            assert [e["token_ids"] for e in events[:-1]] == [[0], [1], [2], [3], [4], [5]]
            assert events[-1]["type"] == "done"
        assert await client.get(owner_key(whole_to)) == publisher.owner(whole).encode()
        await cleanup(client, jobs)

    asyncio.run(main())
