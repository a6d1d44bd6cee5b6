"""The worker end to end in one process: jobs written to a real Redis stream, answered
on reply streams by the real engine, bad jobs rejected without disturbing the rest."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bench.drive import StepRecorder
from bench.processes import RedisServer
from service.config import RedisConfig
from service.worker import Worker
from tests.conftest import run_to_completion
from tests.waiting import eventually, stream_reaches
from workers.api import SamplingParams

pytestmark = pytest.mark.slow


def stream_config(prefix: str, **overrides) -> RedisConfig:
    """Streams private to one test, and a short blocking read."""
    return RedisConfig(
        requests_stream=f"{prefix}:requests",
        dead_letter_stream=f"{prefix}:dead",
        control_stream=f"{prefix}:control",
        consumer="w1",
        block_ms=200,
        **overrides,
    )


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
        await client.xadd(
            stream,
            {
                "payload": msgpack.packb(
                    {"id": f"{prefix}-chat", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
                )
            },
        )
        await client.xadd(stream, {"id": f"{prefix}-bad", "prompt": "x", "max_tokens": "lots"})
        await client.xadd(stream, {"id": f"{prefix}-long", "prompt": "x", "max_tokens": "100000"})
        replies = {
            name: await read_replies(client, f"inflight:out:{{{prefix}-{name}}}")
            for name in ("good", "chat", "bad", "long")
        }
        stop.set()
        await serving
        dead = await client.xrange(config.dead_letter_stream)
        pending = await client.xpending(stream, config.group)
        await client.delete(
            stream,
            config.dead_letter_stream,
            *(f"inflight:out:{{{prefix}-{n}}}" for n in ("good", "chat", "bad", "long")),
        )
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


def test_n_choices_share_one_gapless_reply_stream_and_end_in_one_done_event(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()
    prompt = "The capital of France is"
    want = run_to_completion(make_engine(), {0: [("ref", prompt, SamplingParams(max_tokens=6))]})["ref"][0]
    reply_to = f"inflight:out:{{{prefix}-n}}"

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, client, config).run(stop))
        await client.xadd(config.requests_stream, {"id": f"{prefix}-n", "prompt": prompt, "max_tokens": "6", "n": "3"})
        replies = await read_replies(client, reply_to)
        stop.set()
        await serving
        await client.delete(config.requests_stream, config.dead_letter_stream, reply_to)
        await client.aclose()
        return replies

    replies = asyncio.run(main())
    tokens = [e for e in replies if e["type"] == b"token"]
    assert [int(e["seq"]) for e in tokens] == list(range(18))
    for index in range(3):
        assert [int(e["token_ids"]) for e in tokens if e["index"] == str(index).encode()] == want
    done = replies[-1]
    assert done["type"] == b"done" and done["completion_tokens"] == b"18"
    choices = msgpack.unpackb(done["data"])["choices"]
    assert [(c["index"], c["finish_reason"], c["completion_tokens"]) for c in choices] == [
        (i, "length", 6) for i in range(3)
    ]


def test_a_takeover_continues_every_choice_after_its_own_published_tokens(make_engine):
    """One worker stops (grace over) part-way through a job with n = 2; another takes the
    job over and finishes every choice, each exactly as one uninterrupted run would."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    first = stream_config(prefix, shutdown_grace_s=0.0, claim_idle_ms=300)
    second = RedisConfig(**{**first.__dict__, "consumer": "w2"})
    prompt = "Count to a thousand:"
    want = run_to_completion(make_engine(), {0: [("ref", prompt, SamplingParams(max_tokens=40, ignore_eos=True))]})
    reply_to = f"inflight:out:{{{prefix}-n}}"

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(make_engine(), client, first).run(stop))
        await client.xadd(
            first.requests_stream,
            {"id": f"{prefix}-n", "prompt": prompt, "max_tokens": "40", "ignore_eos": "true", "n": "2"},
        )
        await stream_reaches(client, reply_to, 5)
        stop.set()
        await serving
        published = await client.xlen(reply_to)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(make_engine(), client, second).run(stop))
        replies = await read_replies(client, reply_to)
        stop.set()
        await serving
        await client.delete(first.requests_stream, first.dead_letter_stream, reply_to)
        await client.aclose()
        return published, replies

    published, replies = asyncio.run(main())
    assert 5 <= published < 80
    tokens = [e for e in replies if e["type"] == b"token"]
    assert [int(e["seq"]) for e in tokens] == list(range(80))
    for index in (b"0", b"1"):
        assert [int(e["token_ids"]) for e in tokens if e["index"] == index] == want["ref"][0]
    assert replies[-1]["type"] == b"done" and replies[-1]["worker"] == b"w2"


def test_a_job_whose_workers_die_without_progress_is_dead_lettered_and_one_that_moves_on_is_served(make_engine):
    """The poison-job guard counts deliveries that ended with no new token: a job delivered
    three times without one goes to the dead letters (`too_many_deliveries`) when taken
    over again; one delivered as often whose stream gained tokens is continued."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    first = stream_config(prefix, shutdown_grace_s=0.0, claim_idle_ms=300)
    second = RedisConfig(**{**first.__dict__, "consumer": "w2"})
    job = {"prompt": "Count to a thousand:", "max_tokens": "24", "ignore_eos": "true"}
    moving, stuck = f"{prefix}-moving", f"{prefix}-stuck"

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(make_engine(), client, first).run(stop))
        moving_entry = await client.xadd(first.requests_stream, {"id": moving, **job})
        await stream_reaches(client, f"inflight:out:{{{moving}}}", 3)
        stop.set()
        await serving  # the grace is over: `moving` is left pending, some tokens out
        stuck_entry = await client.xadd(first.requests_stream, {"id": stuck, **job})
        await client.xreadgroup(first.group, "gone", {first.requests_stream: ">"}, count=1)  # never ran
        # As if each had been taken over before, by workers that died: the next delivery is
        # `moving`'s seventh (tokens on its stream) and `stuck`'s fourth (none).
        await client.xclaim(first.requests_stream, first.group, "gone", 0, [moving_entry], retrycount=6)
        await client.xclaim(first.requests_stream, first.group, "gone", 0, [stuck_entry], retrycount=3)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(make_engine(), client, second).run(stop))
        replies = {
            request_id: await read_replies(client, f"inflight:out:{{{request_id}}}") for request_id in (moving, stuck)
        }
        stop.set()
        await serving
        dead = [fields for _, fields in await client.xrange(first.dead_letter_stream)]
        await client.delete(*[key async for key in client.scan_iter(match=f"*{prefix}*")])
        await client.aclose()
        return replies, dead

    replies, dead = asyncio.run(main())
    tokens = [e for e in replies[moving] if e["type"] == b"token"]
    assert [int(e["seq"]) for e in tokens] == list(range(24)) and replies[moving][-1]["type"] == b"done"
    assert [e["type"] for e in replies[stuck]] == [b"error"] and replies[stuck][0]["code"] == b"too_many_deliveries"
    assert [(f[b"field:id"], f[b"code"]) for f in dead] == [(stuck.encode(), b"too_many_deliveries")]


def test_a_cancel_on_the_control_stream_ends_the_request(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()
    reply_to = f"inflight:out:{{{prefix}-long}}"

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, client, config).run(stop))
        await client.xadd(
            config.requests_stream, {"id": f"{prefix}-long", "prompt": "Count to a thousand:", "max_tokens": "2000"}
        )
        await stream_reaches(client, reply_to, 1)  # running: its first token is out
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
        await client.xadd(
            config.requests_stream, {"id": f"{prefix}-long", "prompt": "Count to a thousand:", "max_tokens": "2000"}
        )
        await stream_reaches(client, reply_to, 1)  # running: its first token is out
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
    server = RedisServer(tmp_path)  # append-only file on: a restart finds the streams again
    server.start()
    config = RedisConfig(url=server.url, consumer="w1", block_ms=200)
    engine = make_engine()
    reply_to = "inflight:out:{faults}"

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, client, config).run(stop))
        steps = StepRecorder(engine)  # after the worker's metrics, which it chains to

        def sampled() -> int:
            return sum(record.num_sampled for record in steps)

        await client.xadd(
            config.requests_stream, {"id": "faults", "prompt": "Count to a thousand:", "max_tokens": "160"}
        )
        await stream_reaches(client, reply_to, 10)
        await client.client_kill_filter(_type="normal", skipme=False)  # every connection dropped
        watcher = aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        await stream_reaches(watcher, reply_to, 40)  # the worker reconnected and goes on publishing
        await watcher.aclose()
        await asyncio.to_thread(server.stop)  # a clean shutdown writes the AOF
        before = sampled()
        assert before < 160
        await eventually(lambda: sampled() >= min(before + 5, 160), 60, "generation to go on while Redis is away")
        await asyncio.to_thread(server.start)
        watcher = aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
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
        server.kill()
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
        async with Client(
            requests_stream=config.requests_stream, control_stream=config.control_stream, block_ms=200
        ) as client:
            answer = [
                e
                async for e in client.generate(
                    messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12, priority=2
                )
            ]
            long_id = await client.submit("Count to a thousand:", max_tokens=2000)
            cancelled = []
            async for event in client.events(long_id):
                cancelled.append(event)
                if len(cancelled) == 3:
                    await client.cancel(long_id)
        stop.set()
        await serving
        await redis_client.delete(
            config.requests_stream, config.dead_letter_stream, config.control_stream, f"inflight:out:{{{long_id}}}"
        )
        await redis_client.aclose()
        return answer, cancelled

    answer, cancelled = asyncio.run(main())
    assert [e["type"] for e in answer] == ["token"] * (len(answer) - 1) + ["done"]
    assert "Paris" in "".join(e["text"] for e in answer)
    assert cancelled[-1]["type"] == "done" and cancelled[-1]["finish_reason"] == "cancelled"


async def requests_drained(client, config: RedisConfig) -> bool:
    """Every job on the request stream settled (acked and deleted, or dead-lettered)."""
    return await client.xlen(config.requests_stream) == 0


def run_worker(engine, config, scenario, before=None):
    """Run a worker on `config` while `scenario(client)` plays (after `before(client)`,
    if given, ran with no worker up); returns the scenario's result, the dead-letter
    codes, the request stream's length and the ids the worker left, then deletes the
    test's keys."""

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        if before is not None:
            await before(client)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(engine, client, config).run(stop))
        try:
            result = await scenario(client)
        finally:
            stop.set()
            left = await serving
        dead = [fields[b"code"].decode() for _, fields in await client.xrange(config.dead_letter_stream)]
        length = await client.xlen(config.requests_stream)
        prefix = config.requests_stream.rsplit(":", 1)[0]
        keys = [key async for key in client.scan_iter(match=f"*{prefix}*")]  # its streams, replies, owner keys
        await client.delete(*keys)
        await client.aclose()
        return result, dead, length, left

    return asyncio.run(main())


async def add_counting_jobs(client, stream: str, prefix: str, count: int, max_tokens: int) -> list[str]:
    """`count` jobs of `max_tokens` tokens each (EOS ignored) under ids from `prefix`."""
    ids = [f"{prefix}-{i}" for i in range(count)]
    for request_id in ids:
        await client.xadd(
            stream, {"id": request_id, "prompt": "Count: 1, 2,", "max_tokens": str(max_tokens), "ignore_eos": "true"}
        )
    return ids


def test_a_backlog_longer_than_the_lease_is_served_once_and_leaves_nothing_in_redis(make_engine):
    """More jobs than the worker holds at once, for longer than `claim_idle_ms`: none is
    mistaken for a dead worker's, every one completes once, and Redis keeps no prompt."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix, claim_idle_ms=300)
    engine = make_engine(max_running_requests=2)  # holds 4 at a time

    async def scenario(client):
        ids = await add_counting_jobs(client, config.requests_stream, prefix, 16, max_tokens=6)
        return [await read_replies(client, f"inflight:out:{{{request_id}}}") for request_id in ids]

    replies, dead, length, left = run_worker(engine, config, scenario)
    for reply in replies:
        assert [e["type"] for e in reply] == [b"token"] * 6 + [b"done"]
        assert [int(e["seq"]) for e in reply[:-1]] == list(range(6))
    assert dead == [] and length == 0 and left == []


@pytest.mark.parametrize("max_held_jobs, held", [(0, 4), (7, 7)])
def test_a_worker_holds_twice_its_running_cap_or_max_held_jobs(make_engine, max_held_jobs, held):
    """The rest of a backlog waits in the stream, for any worker: counted in the group's
    pending entries while the worker serves ten jobs two at a time."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix, max_held_jobs=max_held_jobs)
    engine = make_engine(max_running_requests=2)

    async def scenario(client):
        ids = await add_counting_jobs(client, config.requests_stream, prefix, 10, max_tokens=12)
        most_pending = 0
        while await client.exists(*(f"inflight:out:{{{r}}}" for r in ids)) < len(ids) or await client.xlen(
            config.requests_stream
        ):
            with contextlib.suppress(ResponseError):  # the worker creates the group
                pending = await client.xpending(config.requests_stream, config.group)
                most_pending = max(most_pending, pending["pending"])
            await asyncio.sleep(0.01)
        return most_pending

    most_pending, dead, length, left = run_worker(engine, config, scenario)
    assert most_pending == held
    assert dead == [] and length == 0 and left == []


def test_a_cancel_sent_before_the_job_is_read_ends_it_without_running_it(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine(max_running_requests=1)  # holds 2 at a time: the rest wait in the stream

    early, queued = f"{prefix}-early", f"{prefix}-queued"

    async def before(client):
        await client.xadd(config.requests_stream, {"id": early, "prompt": "Count to a thousand:", "max_tokens": "500"})
        await client.xadd(config.control_stream, {"type": "cancel", "id": early})  # before any worker started

    async def scenario(client):
        blockers = [f"{prefix}-busy{i}" for i in range(2)]
        for request_id in blockers:
            await client.xadd(
                config.requests_stream, {"id": request_id, "prompt": "Count:", "max_tokens": "40", "ignore_eos": "true"}
            )
        await client.xadd(config.requests_stream, {"id": queued, "prompt": "Count to a thousand:", "max_tokens": "500"})
        await client.xadd(config.control_stream, {"type": "cancel", "id": queued})  # waiting in the backlog
        await client.xadd(config.control_stream, {"type": "cancel", "id": f"{prefix}-unknown"})
        return [await read_replies(client, f"inflight:out:{{{rid}}}") for rid in (early, queued, *blockers)]

    (early, queued, *blockers), dead, length, _ = run_worker(engine, config, scenario, before)
    for reply in (early, queued):
        assert [e["type"] for e in reply] == [b"done"] and reply[0]["finish_reason"] == b"cancelled"
    assert all(reply[-1]["finish_reason"] == b"length" for reply in blockers)  # cancels of other ids do nothing
    assert dead == [] and length == 0


def test_a_reused_id_is_a_duplicate_and_never_mixes_into_the_first_reply_stream(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()
    job = {"id": f"{prefix}-same", "prompt": "The capital of France is", "max_tokens": "4", "ignore_eos": "true"}
    reply_to = f"inflight:out:{{{prefix}-same}}"

    async def scenario(client):
        await client.xadd(config.requests_stream, job)
        first = await read_replies(client, reply_to)
        await client.xadd(config.requests_stream, job)  # sequentially, after the first finished
        await client.xadd(config.requests_stream, {**job, "id": f"{prefix}-twin"})  # concurrently:
        await client.xadd(config.requests_stream, {**job, "id": f"{prefix}-twin"})  # two at once
        twin = await read_replies(client, f"inflight:out:{{{prefix}-twin}}")
        await eventually(lambda: requests_drained(client, config), 60, "every job to be settled")
        return first, await client.xrange(reply_to), twin, await client.xrange(f"inflight:out:{{{prefix}-twin}}")

    (first, after, twin, twin_after), dead, _, _ = run_worker(engine, config, scenario)
    assert [e["type"] for e in first] == [b"token"] * 4 + [b"done"]
    assert [fields for _, fields in after] == [{k.encode(): v for k, v in e.items()} for e in first]  # untouched
    assert [fields[b"type"] for _, fields in twin_after] == [b"token"] * 4 + [b"done"]  # one job's, once
    assert dead == ["duplicate_id", "duplicate_id"]


def test_reply_to_outside_the_reply_prefix_is_refused_and_a_redis_error_fails_one_job(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    engine = make_engine()

    async def scenario(client):
        wrong_type = f"inflight:out:{{{prefix}-str}}"
        await client.set(wrong_type, "a string, not a stream")
        await client.xadd(
            config.requests_stream, {"id": f"{prefix}-loop", "prompt": "x", "reply_to": config.requests_stream}
        )
        await client.xadd(config.requests_stream, {"id": f"{prefix}-str", "prompt": "x", "reply_to": wrong_type})
        await client.xadd(config.requests_stream, {"id": f"{prefix}-ok", "prompt": "Hi", "max_tokens": "3"})
        ok = await read_replies(client, f"inflight:out:{{{prefix}-ok}}")
        await eventually(lambda: requests_drained(client, config), 60, "every job to be settled")
        return ok, await client.get(wrong_type)

    (ok, untouched), dead, length, _ = run_worker(engine, config, scenario)
    assert ok[-1]["type"] == b"done"  # the worker kept serving
    assert sorted(dead) == ["invalid_field", "redis_error"]
    assert untouched == b"a string, not a stream" and length == 0


def test_a_job_whose_reply_stream_is_forbidden_by_the_acl_fails_alone(make_engine, tmp_path):
    """An ACL user that may not write one job's reply stream (NOPERM): that job is
    dead-lettered as `redis_error`; the job beside it is served."""
    server = RedisServer(
        tmp_path,
        appendonly=False,
        username="worker",
        password="pw",
        args=(
            "--user",
            "default",
            "off",
            "--user",
            "worker",
            "on",
            ">pw",
            "~inflight:requests",
            "~inflight:dead",
            "~inflight:control",
            "~inflight:out:{ok-*",
            "&*",
            "+@all",
        ),
    )
    server.start()
    port = server.port
    config = RedisConfig(url=server.url, consumer="w1", block_ms=200)

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=port, username="worker", password="pw", socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(make_engine(), client, config).run(stop))
        await client.xadd(config.requests_stream, {"id": "no-1", "prompt": "Hi", "max_tokens": "3"})
        await client.xadd(config.requests_stream, {"id": "ok-1", "prompt": "Hi", "max_tokens": "3"})
        ok = await read_replies(client, "inflight:out:{ok-1}")
        await eventually(lambda: requests_drained(client, config), 60, "every job to be settled")
        dead = await client.xrange(config.dead_letter_stream)
        stop.set()
        await serving
        await client.aclose()
        return ok, dead

    try:
        ok, dead = asyncio.run(main())
    finally:
        server.kill()
    assert ok[-1]["type"] == b"done"
    [(_, record)] = dead
    assert record[b"code"] == b"redis_error" and record[b"message"].startswith(b"NoPermissionError")
