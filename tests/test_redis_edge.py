"""The Redis edge's queue semantics against a real Redis server (127.0.0.1:6379; .ci/run
starts one if none answers): consumer groups, restart, reclaim, dead letters, replies."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis

from service.ingest import JobReader
from service.publish import ReplyPublisher
from workers.request import FinalEvent, FinishReason, Timings, Usage


def run(coro):
    return asyncio.run(coro)


async def connect():
    # The socket timeout must exceed any BLOCK, or redis-py's default (5 s) cuts reads short.
    client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
    await client.ping()
    return client


@pytest.fixture
def keys():
    """Fresh stream names for one test; deleted afterwards."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    names = {"stream": f"{prefix}:requests", "dead": f"{prefix}:dead", "reply": f"{prefix}:out:{{r}}"}
    yield names

    async def cleanup():
        client = await connect()
        await client.delete(*names.values())
        await client.aclose()

    run(cleanup())


def reader(client, keys, consumer="w1", claim_idle_ms=60_000, max_deliveries=3) -> JobReader:
    return JobReader(client, keys["stream"], "inflight", consumer, keys["dead"], claim_idle_ms, max_deliveries)


def test_two_consumers_split_entries_without_duplicates(keys):
    async def main():
        client = await connect()
        a, b = reader(client, keys, "a"), reader(client, keys, "b")
        await a.ensure_group()
        await b.ensure_group()  # a second call is harmless
        for i in range(10):
            await client.xadd(keys["stream"], {"prompt": f"p{i}"})
        got_a = await a.read(4, block_ms=100)
        got_b = await b.read(100, block_ms=100)
        await client.aclose()
        return got_a, got_b

    got_a, got_b = run(main())
    assert len(got_a) == 4 and len(got_b) == 6  # a asked for 4 only: backpressure
    ids = [e.entry_id for e in got_a + got_b]
    assert len(set(ids)) == 10
    assert all(e.deliveries == 1 for e in got_a + got_b)


def test_a_restarted_consumer_rereads_its_own_pending_entries_first(keys):
    async def main():
        client = await connect()
        first = reader(client, keys, "w1")
        await first.ensure_group()
        for i in range(3):
            await client.xadd(keys["stream"], {"prompt": f"p{i}"})
        before = await first.read(2, block_ms=100)
        await first.ack(before[0].entry_id)
        restarted = reader(client, keys, "w1")  # same name, fresh process state
        again = await restarted.read(10, block_ms=100)
        then = await restarted.read(10, block_ms=100)
        await client.aclose()
        return before, again, then

    before, again, then = run(main())
    assert [e.entry_id for e in again] == [before[1].entry_id]  # unacked, re-delivered to itself
    assert again[0].deliveries == 2
    assert len(then) == 1 and then[0].entry_id not in {e.entry_id for e in before}


def test_entries_idle_past_the_claim_time_move_to_a_live_worker(keys):
    async def main():
        client = await connect()
        dead = reader(client, keys, "dead-worker")
        await dead.ensure_group()
        await client.xadd(keys["stream"], {"prompt": "p"})
        [taken] = await dead.read(1, block_ms=100)
        live = reader(client, keys, "live", claim_idle_ms=50)
        await asyncio.sleep(0.1)
        [claimed] = await live.read(5, block_ms=100)
        await client.aclose()
        return taken, claimed

    taken, claimed = run(main())
    assert claimed.entry_id == taken.entry_id and claimed.deliveries == 2


def test_dead_letter_keeps_the_entry_and_why_and_acks_it(keys):
    async def main():
        client = await connect()
        r = reader(client, keys)
        await r.ensure_group()
        await client.xadd(keys["stream"], {"prompt": "p", "colour": "red"})
        [entry] = await r.read(1, block_ms=100)
        await r.dead_letter(entry, "unknown_field", "unknown field(s): colour")
        dead = await client.xrange(keys["dead"])
        pending = await client.xpending(keys["stream"], "inflight")
        await client.aclose()
        return entry, dead, pending

    entry, dead, pending = run(main())
    [(_, record)] = dead
    assert record[b"entry_id"] == entry.entry_id.encode() and record[b"code"] == b"unknown_field"
    assert record[b"field:colour"] == b"red"
    assert pending["pending"] == 0


def test_replies_are_numbered_idempotent_expire_and_a_successor_continues_the_numbering(keys):
    async def main():
        client = await connect()
        publisher = ReplyPublisher(client, ttl_s=120)
        reply = keys["reply"]
        assert await publisher.next_seq(reply) == 0
        for seq, text in enumerate(["Hel", "lo"]):
            await publisher.token(reply, seq, text, [seq])
        successor_seq = await ReplyPublisher(client, ttl_s=120).next_seq(reply)
        await publisher.token(reply, 1, "lo", [1])  # a retried write that had landed: no duplicate
        final = FinalEvent("r", FinishReason.STOP, Usage(2, 2), Timings(0.0, 0.1, 0.2, (0.1, 0.2)))
        await publisher.done(reply, final, num_tokens=2)
        entries = await client.xrange(reply)
        ttl = await client.ttl(reply)
        await client.aclose()
        return successor_seq, entries, ttl

    successor_seq, entries, ttl = run(main())
    assert successor_seq == 2
    assert [f[b"type"] for _, f in entries] == [b"token", b"token", b"done"]
    assert [msgpack.unpackb(f[b"data"]).get("seq") for _, f in entries[:2]] == [0, 1]
    assert 0 < ttl <= 120
