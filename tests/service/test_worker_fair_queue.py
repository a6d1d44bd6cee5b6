"""A worker with fair queueing (`--fair-queue`), end to end on a real Redis and the real
model: jobs of several tenants are admitted, taken and served as always; a job over a cap
is refused at once with `queue_full` and `retry_after_s`, and dead-lettered under its
request entry id; a bad entry fails at admission as it would anywhere; a queued job can
be cancelled; and the tenants are charged for what they were served."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis

from service.config import FairQueueConfig
from service.worker import Worker
from tests.service.test_worker import read_replies, stream_config
from tests.waiting import stream_reaches

pytestmark = pytest.mark.slow


async def serving(engine, config, fair: FairQueueConfig):
    client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(engine, client, config, fair_queue=fair).run(stop))
    return client, stop, task


def test_tenants_jobs_are_served_and_charged(make_engine):
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")

    async def main():
        client, stop, task = await serving(make_engine(), config, FairQueueConfig(enabled=True))
        ids = []
        for i, tenant in enumerate(["a", "a", "b", "default", "batch-b"]):
            fields = {"id": f"{run}-{i}", "prompt": "Count to ten:", "max_tokens": "6"}
            if tenant == "batch-b":
                fields.update(tenant="b", batch="true")
            elif tenant != "default":
                fields["tenant"] = tenant
            await client.xadd(config.requests_stream, fields)
            ids.append(f"{run}-{i}")
        finals = [(await read_replies(client, f"inflight:out:{{{request_id}}}"))[-1] for request_id in ids]
        assert [final["type"] for final in finals] == [b"done"] * 5
        await asyncio.sleep(0.5)  # charges are flushed every 0.2 s
        served = await client.hgetall("{" + config.requests_stream + "}:served")
        # Each charged its prompt (weight 1) and 6 output tokens (weight 2).
        assert {tenant: float(value) > 12 for tenant, value in served.items()} == {
            b"a": True,
            b"b": True,
            b"default": True,
            b"batch:b": True,  # batch jobs have an account of their own
        }
        assert float(served[b"a"]) > float(served[b"b"])  # two jobs to one
        stop.set()
        assert await task == []
        await client.aclose()

    asyncio.run(main())


def test_over_a_cap_jobs_are_refused_at_once_and_the_rest_served(make_engine):
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    # The worker holds two jobs at most; one more may wait in the queues.
    engine = make_engine(max_running_requests=1)

    async def main():
        client, stop, task = await serving(engine, config, FairQueueConfig(max_queued_jobs=1))
        ids = [f"{run}-{i}" for i in range(6)]
        for request_id in ids:
            await client.xadd(config.requests_stream, {"id": request_id, "prompt": "Hello", "max_tokens": "24"})
        finals = {request_id: (await read_replies(client, f"inflight:out:{{{request_id}}}"))[-1] for request_id in ids}
        refused = [request_id for request_id, final in finals.items() if final["type"] == b"error"]
        assert refused and len(refused) < len(ids)
        for request_id in refused:
            final = finals[request_id]
            assert final["code"] == b"queue_full" and 1 <= float(final["retry_after_s"]) <= 60
            assert msgpack.unpackb(final["data"])["retry_after_s"] == float(final["retry_after_s"])
        assert all(finals[request_id]["type"] == b"done" for request_id in set(ids) - set(refused))
        await stream_reaches(client, config.dead_letter_stream, len(refused))  # written after the error event
        dead = await client.xrange(config.dead_letter_stream)
        assert sorted(fields[b"field:id"].decode() for _, fields in dead) == sorted(refused)
        assert all(fields[b"stream"] == config.requests_stream.encode() for _, fields in dead)
        stop.set()
        await task
        await client.aclose()

    asyncio.run(main())


def test_with_every_slot_busy_for_longer_than_the_wait_cap_a_new_job_is_refused_at_once(make_engine):
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    engine = make_engine(max_running_requests=1)

    async def main():
        client, stop, task = await serving(engine, config, FairQueueConfig(max_queue_wait_s=0.5))
        long = {"id": f"{run}-long", "prompt": "Hello", "max_tokens": "1500", "ignore_eos": "1"}
        await client.xadd(config.requests_stream, long)
        reply_to = f"inflight:out:{{{run}-long}}"
        while await client.xlen(reply_to) < 3:  # running, at a pace the worker has measured
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # published
        # Nothing is queued, but the one slot frees only when the long job ends, seconds away.
        await client.xadd(config.requests_stream, {"id": f"{run}-next", "prompt": "Hi", "max_tokens": "4"})
        refused = (await read_replies(client, f"inflight:out:{{{run}-next}}", timeout_s=5))[-1]
        assert (refused["type"], refused["code"]) == (b"error", b"queue_full")
        assert b"for a slot, with 0 jobs queued ahead" in refused["message"]
        # Once the slot is free, a job is admitted and served.
        await client.xadd(config.control_stream, {"type": "cancel", "id": f"{run}-long"})
        assert (await read_replies(client, reply_to))[-1]["finish_reason"] == b"cancelled"
        await asyncio.sleep(0.3)
        await client.xadd(config.requests_stream, {"id": f"{run}-after", "prompt": "Hi", "max_tokens": "4"})
        assert (await read_replies(client, f"inflight:out:{{{run}-after}}"))[-1]["type"] == b"done"
        stop.set()
        await task
        await client.aclose()

    asyncio.run(main())


def test_a_bad_entry_fails_at_admission_and_a_queued_job_can_be_cancelled(make_engine):
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    engine = make_engine(max_running_requests=1)

    async def main():
        client, stop, task = await serving(engine, config, FairQueueConfig(enabled=True))
        await client.xadd(config.requests_stream, {"id": f"{run}-bad", "prompt": "x", "tenant": "no spaces allowed"})
        bad = await read_replies(client, f"inflight:out:{{{run}-bad}}")
        assert (bad[-1]["type"], bad[-1]["code"]) == (b"error", b"invalid_field")

        # One long job runs, one waits in the worker, the third in the tenant queue: cancel it.
        for name in ("long-1", "long-2", "queued"):
            await client.xadd(
                config.requests_stream,
                {"id": f"{run}-{name}", "prompt": "Hello", "max_tokens": "64", "ignore_eos": "1"},
            )
        await client.xadd(config.control_stream, {"type": "cancel", "id": f"{run}-queued"})
        cancelled = await read_replies(client, f"inflight:out:{{{run}-queued}}")
        assert (cancelled[-1]["type"], cancelled[-1]["finish_reason"]) == (b"done", b"cancelled")
        for request_id in (f"{run}-long-1", f"{run}-long-2"):
            assert (await read_replies(client, f"inflight:out:{{{request_id}}}"))[-1]["finish_reason"] == b"length"
        stop.set()
        await task
        await client.aclose()

    asyncio.run(main())


def test_a_worker_full_of_batch_jobs_still_takes_an_interactive_job_and_serves_it_first(make_engine):
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    engine = make_engine(max_running_requests=1)  # holds two jobs

    async def main():
        client, stop, task = await serving(engine, config, FairQueueConfig(enabled=True))
        for i in range(3):
            await client.xadd(
                config.requests_stream,
                {"id": f"{run}-batch-{i}", "prompt": "Hello", "max_tokens": "48", "ignore_eos": "1", "batch": "1"},
            )
        # The worker is busy with batch work (it took two at once: either may run first).
        while max([await client.xlen(f"inflight:out:{{{run}-batch-{i}}}") for i in range(2)]) < 2:
            await asyncio.sleep(0.01)
        await client.xadd(config.requests_stream, {"id": f"{run}-chat", "prompt": "Hi", "max_tokens": "4"})
        chat = await read_replies(client, f"inflight:out:{{{run}-chat}}")
        assert chat[-1]["type"] == b"done"
        # It ran while the batch jobs waited: none of them had finished.
        for i in range(3):
            last = await client.xrevrange(f"inflight:out:{{{run}-batch-{i}}}", count=1)
            assert not last or last[0][1][b"type"] == b"token"
        for i in range(3):
            assert (await read_replies(client, f"inflight:out:{{{run}-batch-{i}}}"))[-1]["type"] == b"done"
        stop.set()
        await task
        await client.aclose()

    asyncio.run(main())


def test_a_worker_holds_no_more_batch_jobs_than_may_run_and_leaves_the_rest_queued(make_engine):
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    engine = make_engine(max_running_requests=4, max_running_batch=1)

    async def main():
        client, stop, task = await serving(engine, config, FairQueueConfig(enabled=True))
        ids = [f"{run}-batch-{i}" for i in range(3)]
        for request_id in ids:
            await client.xadd(
                config.requests_stream,
                {"id": request_id, "prompt": "Hello", "max_tokens": "32", "ignore_eos": "1", "batch": "1"},
            )
        queued_key = "{" + config.requests_stream + "}:queued"
        while max([await client.xlen(f"inflight:out:{{{request_id}}}") for request_id in ids]) < 2:
            await asyncio.sleep(0.01)
        # One runs; the other two wait in the fair queue, for this worker or any other.
        assert int(await client.hget(queued_key, "*")) == 2
        for request_id in ids:
            assert (await read_replies(client, f"inflight:out:{{{request_id}}}"))[-1]["type"] == b"done"
        stop.set()
        await task
        await client.aclose()

    asyncio.run(main())


def test_a_worker_full_of_interactive_jobs_beside_preempted_batch_ones_waits_without_spinning(make_engine):
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    engine = make_engine(max_running_requests=1)  # holds one job, and interactive ones beyond batch ones

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        worker = Worker(engine, client, config, fair_queue=FairQueueConfig(enabled=True))
        reads = 0
        read = worker.reader.read

        async def counted_read(*args, **kwargs):
            nonlocal reads
            reads += 1
            return await read(*args, **kwargs)

        worker.reader.read = counted_read
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        batch = {"id": f"{run}-batch", "prompt": "Hello", "max_tokens": "64", "ignore_eos": "1", "batch": "1"}
        await client.xadd(config.requests_stream, batch)
        await stream_reaches(client, f"inflight:out:{{{run}-batch}}", 2)
        chat = {"id": f"{run}-chat", "prompt": "Hi", "max_tokens": "64", "ignore_eos": "1"}
        await client.xadd(config.requests_stream, chat)
        await stream_reaches(client, f"inflight:out:{{{run}-chat}}", 2)
        # Now it holds its one interactive job and the batch job that gave up its slot:
        # no room for another job of either class, so it waits for one to end.
        before = reads
        await asyncio.sleep(0.5)
        assert reads - before <= 2
        for request_id in (f"{run}-chat", f"{run}-batch"):
            assert (await read_replies(client, f"inflight:out:{{{request_id}}}"))[-1]["type"] == b"done"
        stop.set()
        await task
        await client.aclose()

    asyncio.run(main())


def test_a_fair_queue_worker_serves_the_prompt_admission_tokenized_token_for_token(make_engine):
    """Admission tokenizes each prompt, and the token ids travel with the job to the
    worker that takes it: the answer is the one a worker without fair queueing gives from
    the text (greedy), for a raw prompt and a chat job alike."""
    run = uuid.uuid4().hex[:8]
    jobs = {
        "raw": {"prompt": "The capital of France is", "max_tokens": "8", "temperature": "0"},
        "chat": {
            "messages": '[{"role": "user", "content": "Name three colours."}]',
            "max_tokens": "8",
            "temperature": "0",
        },
    }

    async def answers(fair: FairQueueConfig, name: str) -> dict[str, list[bytes]]:
        config = stream_config(f"inflight:test:{run}:{name}")
        client, stop, task = await serving(make_engine(), config, fair)
        for kind, fields in jobs.items():
            await client.xadd(config.requests_stream, {"id": f"{run}-{name}-{kind}", **fields})
        replies = {kind: await read_replies(client, f"inflight:out:{{{run}-{name}-{kind}}}") for kind in jobs}
        stop.set()
        assert await task == []
        await client.aclose()
        return {kind: [e["token_ids"] for e in events if e["type"] == b"token"] for kind, events in replies.items()}

    async def main():
        plain = await answers(FairQueueConfig(), "plain")
        fair = await answers(FairQueueConfig(enabled=True), "fair")
        assert all(len(tokens) == 8 for tokens in plain.values())
        assert fair == plain

    asyncio.run(main())


def test_with_fair_preemption_a_late_tenant_is_served_before_the_flood_ends_and_the_flood_stays_exact(make_engine):
    """Two long flood jobs fill the worker's slots; a light tenant's job, taken beyond them,
    swaps one out once it has waited the bound, and ends while both flood jobs still run.
    The swapped flood job resumes token-exact: it answers as its twin that kept running."""
    run = uuid.uuid4().hex[:8]
    config = stream_config(f"inflight:test:{run}")
    engine = make_engine(max_running_requests=2, fair_preempt_after_s=0.2)

    async def main():
        client, stop, task = await serving(engine, config, FairQueueConfig(enabled=True))
        flood = [f"{run}-flood-{i}" for i in range(2)]
        for request_id in flood:
            await client.xadd(
                config.requests_stream,
                {"id": request_id, "tenant": "flood", "prompt": "Once upon a time", "max_tokens": "160",
                 "ignore_eos": "1", "temperature": "0"},
            )  # fmt: skip
        while min([await client.xlen(f"inflight:out:{{{request_id}}}") for request_id in flood]) < 2:
            await asyncio.sleep(0.01)
        await client.xadd(
            config.requests_stream, {"id": f"{run}-light", "tenant": "light", "prompt": "Hi", "max_tokens": "4"}
        )
        assert (await read_replies(client, f"inflight:out:{{{run}-light}}"))[-1]["type"] == b"done"
        for request_id in flood:  # neither flood job had ended
            last = await client.xrevrange(f"inflight:out:{{{request_id}}}", count=1)
            assert last[0][1][b"type"] == b"token"
        answers = []
        for request_id in flood:
            replies = await read_replies(client, f"inflight:out:{{{request_id}}}")
            assert replies[-1]["type"] == b"done"
            answers.append(b"".join(r.get("text", b"") for r in replies if r["type"] == b"token"))
        assert answers[0] == answers[1] and len(answers[0]) > 100
        stop.set()
        await task
        await client.aclose()

    asyncio.run(main())
