"""The Redis edge's queue semantics against a real Redis server (127.0.0.1:6379; .ci/run
starts one if none answers): consumer groups, restart, reclaim, dead letters, replies."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis

from service.config import RedisConfig
from service.ingest import JobReader, client_name
from service.protocol import token_data, token_fields
from service.publish import Append, ReplyPublisher, owner_key, progress_key
from workers.api import FinalEvent, FinishReason, Timings, Usage


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
    names = {
        "stream": f"{prefix}:requests",
        "dead": f"{prefix}:dead",
        "reply": f"{prefix}:out:{{r}}",
        "owner": f"{prefix}:out:{{r}}:owner",
        "progress": f"{prefix}:out:{{r}}:progress",
    }
    yield names

    async def cleanup():
        client = await connect()
        await client.delete(*names.values())
        await client.aclose()

    run(cleanup())


def reader(client, keys, consumer="w1", claim_idle_ms=60_000, **config) -> JobReader:
    return JobReader(
        client,
        RedisConfig(
            requests_stream=keys["stream"],
            dead_letter_stream=keys["dead"],
            consumer=consumer,
            claim_idle_ms=claim_idle_ms,
            **config,
        ),
    )


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


def test_a_waiting_worker_takes_a_job_over_when_its_lease_runs_out_not_a_block_later(keys):
    """A worker blocked on an empty stream wakes when another consumer's lease ends: the
    takeover comes about claim_idle_ms after the holder's last delivery, well before the
    block would have ended."""

    async def main():
        client = await connect()
        dead = reader(client, keys, "dead-worker", claim_idle_ms=600)
        await dead.ensure_group()
        await client.xadd(keys["stream"], {"prompt": "p"})
        [taken] = await dead.read(1, block_ms=100)
        delivered = asyncio.get_running_loop().time()
        live = reader(client, keys, "live", claim_idle_ms=600)
        claimed = []
        while not claimed:  # each read blocks up to 5 s, or until the lease runs out
            claimed = await live.read(5, block_ms=5000)
        waited = asyncio.get_running_loop().time() - delivered
        await client.aclose()
        return taken, claimed, waited

    taken, claimed, waited = run(main())
    assert [c.entry_id for c in claimed] == [taken.entry_id]
    assert 0.6 <= waited < 1.5


async def connect_as(consumer: str):
    """A worker process's own connections, named as `inflight worker` names them."""
    client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30, client_name=client_name(consumer))
    await client.ping()
    return client


def test_a_worker_whose_connections_all_closed_is_taken_over_before_its_lease_runs_out(keys):
    """Its process died: the kernel closed its sockets. With a lease of 4 s (renewed every
    second), the takeover comes once a renewal is missed, not when the lease runs out."""

    async def main():
        client = await connect()
        dying_client = await connect_as("dying")
        dying = reader(dying_client, keys, "dying", claim_idle_ms=4000)
        await dying.ensure_group()
        await client.xadd(keys["stream"], {"prompt": "p"})
        [taken] = await dying.read(1, block_ms=100)
        delivered = asyncio.get_running_loop().time()
        live = reader(client, keys, "live", claim_idle_ms=4000)
        assert await live.read(5, block_ms=100) == []  # seen connected: not taken
        await dying_client.aclose()  # every connection of that process gone
        claimed = []
        while not claimed:
            claimed = await live.read(5, block_ms=5000)
        waited = asyncio.get_running_loop().time() - delivered
        await client.aclose()
        return taken, claimed, waited

    taken, claimed, waited = run(main())
    assert [c.entry_id for c in claimed] == [taken.entry_id] and claimed[0].deliveries == 2
    assert 1.1 <= waited < 3.0  # a missed renewal (1 s and a margin), not the 4 s lease


def test_a_hung_worker_and_one_never_seen_connected_wait_for_their_leases(keys):
    """Both miss their renewals. A stopped worker keeps its connections; a consumer this
    worker never saw connected (not naming its connections, or gone before it looked)
    may be alive: both keep their entries until their leases run out."""

    async def main():
        client = await connect()
        hung_client = await connect_as("hung")
        hung, unseen = reader(hung_client, keys, "hung"), reader(client, keys, "unseen")
        await hung.ensure_group()
        for _ in range(2):
            await client.xadd(keys["stream"], {"prompt": "p"})
        await hung.read(1, block_ms=100)
        await unseen.read(1, block_ms=100)
        loop = asyncio.get_running_loop()
        delivered = loop.time()
        live = reader(client, keys, "live", claim_idle_ms=2000)  # a renewal is missed after 0.6 s
        taken = []
        while loop.time() - delivered < 1.4:  # looks, until just before the leases run out
            taken += await live.read(5, block_ms=200)
        await hung_client.aclose()
        await client.aclose()
        return taken

    assert run(main()) == []


def test_a_worker_names_its_connections_after_its_consumer_as_redis_allows():
    assert client_name("gpu-7.pod-3") == "inflight-worker:gpu-7.pod-3"
    assert client_name("my worker\n") == "inflight-worker:my_worker_"


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


def test_held_entries_keep_their_lease_and_a_stopped_worker_loses_its_own(keys):
    async def main():
        client = await connect()
        a = reader(client, keys, "a", claim_idle_ms=300)
        await a.ensure_group()
        for i in range(2):
            await client.xadd(keys["stream"], {"prompt": f"p{i}"})
        renewed, abandoned = await a.read(2, block_ms=100)
        b = reader(client, keys, "b", claim_idle_ms=300)
        for _ in range(6):  # 600 ms: twice the lease, renewing one entry every 100 ms
            await asyncio.sleep(0.1)
            assert await a.renew([renewed.entry_id]) == []
        claimed = await b.read(5, block_ms=100)
        lost = await a.renew([renewed.entry_id, abandoned.entry_id])
        own = await a.read(5, block_ms=100, held={renewed.entry_id})  # its own renewed entry is not new work
        await client.aclose()
        return renewed, abandoned, claimed, lost, own

    renewed, abandoned, claimed, lost, own = run(main())
    assert [e.entry_id for e in claimed] == [abandoned.entry_id]  # only the one nobody renewed
    assert lost == [abandoned.entry_id]  # a learns it lost that one
    assert own == []


def test_an_acked_entry_is_deleted_and_dead_letters_are_capped(keys):
    async def main():
        client = await connect()
        r = reader(client, keys, dead_letter_max_len=10)
        await r.ensure_group()
        for i in range(301):
            await client.xadd(keys["stream"], {"prompt": f"p{i}"})
        entries = await r.read(301, block_ms=100)
        await r.ack(entries[0].entry_id)
        for entry in entries[1:]:
            await r.dead_letter(entry, "invalid_field", "bad")
        left, dead = await client.xlen(keys["stream"]), await client.xlen(keys["dead"])
        await client.aclose()
        return left, dead

    left, dead = run(main())
    assert left == 0  # no finished prompt stays in Redis
    assert dead < 300  # trimmed (approximately: whole nodes of about 100 entries at a time)


def tokens(reply: str, seqs_and_texts) -> Append:
    """Token events of the job in entry 1-1, as the outbox sends them."""
    return Append(reply, "1-1", [token_data(seq, text, [seq]) for seq, text in seqs_and_texts], None, refresh_ttl=True)


def test_replies_are_numbered_idempotent_fenced_and_expire(keys):
    async def main():
        client = await connect()
        first, second = ReplyPublisher(client, ttl_s=120, worker="a"), ReplyPublisher(client, ttl_s=120, worker="b")
        reply = keys["reply"]
        claim = await first.claim(reply, "1-1")
        assert await first.append([tokens(reply, [(0, "Hel"), (1, "lo")])]) == [True]
        # A retried write that had landed, with one more token: no duplicate.
        assert await first.append([tokens(reply, [(1, "lo"), (2, "!")])]) == [True]
        duplicate = await second.claim(reply, "2-2")  # another job with the same reply stream
        takeover = await second.claim(reply, "1-1")  # the same job, taken over
        fenced = await first.append([tokens(reply, [(3, "?")])]) == [False]
        final = FinalEvent("r", FinishReason.STOP, Usage(2, 2), Timings(0.0, 0.1, 0.2, (0.1, 0.2)))
        await second.done(reply, "1-1", final, num_tokens=3)
        again = await ReplyPublisher(client, ttl_s=120, worker="c").claim(reply, "1-1")
        entries = await client.xrange(reply)
        ttls = await client.ttl(reply), await client.ttl(owner_key(reply))
        await client.aclose()
        return claim, duplicate, takeover, fenced, again, entries, ttls

    claim, duplicate, takeover, fenced, again, entries, ttls = run(main())
    assert claim.owned and claim.token_ids == [] and not claim.finished
    assert not duplicate.owned
    assert takeover.owned and takeover.token_ids == [0, 1, 2] and not takeover.finished
    assert fenced  # the first worker lost the stream and cannot write to it
    assert again.owned and again.finished
    assert [f[b"type"] for _, f in entries] == [b"token", b"token", b"token", b"done"]
    assert [msgpack.unpackb(f[b"data"]).get("seq") for _, f in entries[:3]] == [0, 1, 2]
    assert entries[-1][1][b"worker"] == b"b"
    assert all(0 < ttl <= 120 for ttl in ttls)


def test_a_reply_stream_that_is_not_a_stream_is_a_redis_error(keys):
    from redis.exceptions import ResponseError

    async def main():
        client = await connect()
        await client.set(keys["reply"], "not a stream")
        try:
            await ReplyPublisher(client, ttl_s=120).claim(keys["reply"], "1-1")
        except ResponseError as error:
            return str(error)
        finally:
            await client.aclose()

    assert "WRONGTYPE" in run(main())


def test_an_owner_key_shares_its_reply_streams_hash_slot():
    from redis.crc import key_slot

    for reply_to in ("inflight:out:{job-1}", "inflight:out:plain", "inflight:out:{a}{b}", "inflight:out:}{x}"):
        assert key_slot(owner_key(reply_to).encode()) == key_slot(reply_to.encode()), reply_to
    assert owner_key("inflight:out:{job-1}") == "inflight:out:{job-1}:owner"
    assert owner_key("inflight:out:plain") == "{inflight:out:plain}:owner"


def test_takeovers_count_the_deliveries_in_a_row_that_left_the_reply_stream_where_it_was(keys):
    """The poison-job guard's count: a takeover that finds no new token since the last one
    adds a stall, one that finds the stream moved on starts again from none."""
    assert progress_key(keys["reply"]) == keys["progress"]

    async def main():
        client = await connect()
        publisher = ReplyPublisher(client, ttl_s=120)
        # (token events on the stream, deliveries) at each takeover, in turn
        counts = [await publisher.stalled_deliveries(keys["reply"], events, deliveries)
                  for events, deliveries in [(0, 2), (0, 3), (4, 4), (4, 5), (4, 6), (9, 7)]]  # fmt: skip
        await client.delete(keys["progress"])
        # no takeover recorded: the first delivery moved the stream on if it holds a token
        fresh = [await publisher.stalled_deliveries(keys["reply"], 3, 5)]
        await client.delete(keys["progress"])
        fresh.append(await publisher.stalled_deliveries(keys["reply"], 0, 4))
        ttl = await client.ttl(keys["progress"])
        await client.aclose()
        return counts, fresh, ttl

    counts, fresh, ttl = run(main())
    assert counts == [1, 2, 0, 1, 2, 0]
    assert fresh == [0, 3]
    assert 0 < ttl <= 120


def test_the_write_script_gives_token_entries_exactly_the_fields_the_protocol_defines(keys):
    """The worker sends a token as its msgpack `data` alone; the script derives the
    readable fields. They must be byte for byte what `token_fields` says."""
    cases = [
        (0, "Hello", [15496], None),
        (1, "", [220], None),
        (2, " é 🙂\n", [1, 2, 3], None),
        (3, "a b", [], None),
        (123456, "x", [0], None),
        (123457, "y", [5], 0),
        (123458, "z", [6], 15),
    ]  # the last two: n > 1

    async def main():
        client = await connect()
        publisher = ReplyPublisher(client, ttl_s=120, worker="a")
        reply = keys["reply"]
        await publisher.claim(reply, "1-1")
        data = [token_data(*case) for case in cases]
        assert await publisher.append([Append(reply, "1-1", data, None, refresh_ttl=True)]) == [True]
        entries = await client.xrange(reply)
        await client.aclose()
        return entries

    entries = run(main())
    for (entry_id, fields), (seq, text, token_ids, index) in zip(entries, cases, strict=True):
        want = {
            k.encode(): v if isinstance(v, bytes) else v.encode()
            for k, v in token_fields(seq, text, token_ids, index).items()
        }
        assert entry_id == f"{seq + 1}-0".encode() and fields == want
        assert list(fields) == list(want)  # in the same order too


def test_a_dead_letter_is_written_before_its_entry_is_acked(tmp_path):
    """On a Redis Cluster the dead-letter stream and the request stream may be on two
    shards, so dead-lettering is two steps: if the second (XACK and XDEL) fails, here for
    want of the XACK permission, the dead letter is already written and the entry is
    still pending, to be dead-lettered again: a duplicate at worst, never a loss."""
    from redis.exceptions import NoPermissionError

    from bench.processes import RedisServer

    names = {"stream": "inflight:test:requests", "dead": "inflight:test:dead"}
    with RedisServer(
        tmp_path,
        appendonly=False,
        username="w",
        password="pw",
        args=("--user", "default", "off", "--user", "w", "on", ">pw", "~*", "&*", "+@all", "-xack"),
    ) as server:

        async def main():
            client = aioredis.Redis(port=server.port, username="w", password="pw", socket_timeout=30)
            jobs = reader(client, names)
            await jobs.ensure_group()
            await client.xadd(names["stream"], {"prompt": "p", "colour": "blue"})
            [entry] = await jobs.read(1, block_ms=100)
            with pytest.raises(NoPermissionError):
                await jobs.dead_letter(entry, "unknown_field", "colour")
            [(_, letter)] = await client.xrange(names["dead"])
            assert letter[b"entry_id"] == entry.entry_id.encode() and letter[b"code"] == b"unknown_field"
            assert (await client.xpending(names["stream"], "inflight"))["pending"] == 1
            await client.aclose()

        run(main())
