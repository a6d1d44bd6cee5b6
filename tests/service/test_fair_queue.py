"""Fair queueing in Redis (`service/fair_queue/`; docs/protocol.md, "Tenants, batch jobs
and admission"), on a real Redis: admission moves each job into its tenant's queue or
refuses it over a cap or quota, at once; workers take jobs by level (priority with aging),
then by the tenant served least, and batch jobs only when no interactive job waits;
leases, takeovers and acks work by the job's request entry id.

Here admission's check is a small stand-in for the worker's (which decodes the job and
counts its prompt tokens with the model's tokenizer): one token per word.
tests/service/test_worker_fair_queue.py drives the whole worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest
import redis.asyncio as aioredis

from service import slot_outlook
from service.config import FairQueueConfig, RedisConfig
from service.fair_queue import Admissible, Admission, Charges, FairQueueReader, Refusal
from service.protocol import Job, decode_job
from service.slot_outlook import OUTLOOK_TTL_MS, UNKNOWN_END_S, SlotOutlook

# A priority step's head start, in seconds (a worker's: its aging bound / 20).
PRIORITY_STEP_S = 0.2


class Queue:
    """One private request stream with an admitting worker and a taking one."""

    def __init__(self, client, fair: FairQueueConfig, consumer: str = "w1") -> None:
        prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
        self.client = client
        self.config = RedisConfig(
            requests_stream=f"{prefix}:requests",
            dead_letter_stream=f"{prefix}:dead",
            control_stream=f"{prefix}:control",
            consumer=consumer,
            block_ms=50,
            claim_idle_ms=300,
        )
        self.fair = fair
        self.refusals: list[tuple[Job, Refusal]] = []
        self.admission = Admission(client, self.config, fair, self._check, self._refuse)
        self.reader = self.reader_for(consumer)

    def reader_for(self, consumer: str) -> FairQueueReader:
        config = RedisConfig(**{**self.config.__dict__, "consumer": consumer})
        return FairQueueReader(self.client, config, self.fair, PRIORITY_STEP_S)

    async def _check(self, entry):
        job = decode_job(entry.entry_id, entry.fields)
        words = job.prompt.split()  # a word a token, its length the token's id
        return Admissible(job, len(words), [len(word) for word in words])

    async def _refuse(self, entry, job, refusal) -> None:
        self.refusals.append((job, refusal))
        await self.admission.reader.dead_letter(entry, refusal.code, refusal.message)

    async def submit(self, prompt: str = "four words of prompt", **fields) -> str:
        """Add a job to the request stream and admit it; returns its entry id."""
        await self.admission.reader.ensure_group()
        entry_id = await self.client.xadd(self.config.requests_stream, {"prompt": prompt, **fields})
        for entry in await self.admission.reader.read(64, 50):
            await self.admission.admit(entry)
        return entry_id.decode()

    async def take(self, count: int = 1, reader: FairQueueReader | None = None) -> list[tuple[str, Job]]:
        entries = await (reader or self.reader).read(count, 50)
        return [(entry.entry_id, decode_job(entry.entry_id, entry.fields)) for entry in entries]

    async def tenants_taken(self, count: int) -> list[str]:
        """Take jobs one at a time (so each sees the charges before it) and name their tenants."""
        tenants = []
        for _ in range(count):
            ((entry_id, job),) = await self.take()
            tenants.append(job.tenant)
            await self.reader.ack(entry_id)
        return tenants

    async def charge(self, tenant: str, output_tokens: int) -> None:
        charges = Charges(self.client, self.config.requests_stream, self.fair)
        charges.output(Job(tenant, "x", None, 0, None, "", tenant), output_tokens)
        await charges.flush()


@pytest.fixture
def client():
    return aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=10)


def run(coroutine):
    return asyncio.run(coroutine)


def test_an_admitted_job_leaves_the_request_stream_and_keeps_its_entry_id(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        entry_id = await queue.submit(id="job-1", tenant="acme")
        assert await client.xlen(queue.config.requests_stream) == 0
        ((taken_id, job),) = await queue.take()
        assert (taken_id, job.request_id, job.tenant) == (entry_id, "job-1", "acme")
        await queue.reader.ack(taken_id)

    run(main())


def test_a_taken_job_brings_the_token_ids_its_admission_made_so_its_prompt_is_tokenized_once(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        await queue.submit("a prompt of six short words", id="job-ids")
        (entry,) = await queue.reader.read(1, 50)
        assert entry.prompt_ids == [1, 6, 2, 3, 5, 5]
        assert not any(name.startswith(b"inflight:") for name in entry.fields)  # the job's own fields only
        await queue.reader.ack(entry.entry_id)

    run(main())


def test_within_a_level_the_tenant_served_least_goes_first(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        for _ in range(6):
            await queue.submit(tenant="flood")
        for _ in range(2):
            await queue.submit(tenant="light")
        # Each take charges the prompt (4 tokens): the two tenants alternate while both
        # have jobs queued, although the flooder's six came first.
        assert await queue.tenants_taken(6) == ["flood", "light", "flood", "light", "flood", "flood"]

    run(main())


def test_output_tokens_served_count_against_a_tenant(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        await queue.submit(tenant="a")
        await queue.submit(tenant="b")
        await queue.submit(tenant="a")
        await queue.charge("a", output_tokens=100)  # a's long outputs: b goes first now
        assert await queue.tenants_taken(3) == ["b", "a", "a"]

    run(main())


def test_a_tenant_back_from_idle_is_lifted_to_the_least_served_and_earns_no_credit(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        await queue.submit(tenant="busy")
        await queue.submit(tenant="busy")
        await queue.charge("busy", output_tokens=500)
        await queue.submit(tenant="returning")  # never served: it would win 1,000 to 0
        served = await client.hgetall("{" + queue.config.requests_stream + "}:served")
        assert float(served[b"returning"]) == float(served[b"busy"]) == 1000.0
        # Lifted to equal, the two take turns (ties go to either).
        assert sorted(await queue.tenants_taken(2)) == ["busy", "returning"]

    run(main())


def test_a_higher_priority_goes_first_and_a_lower_one_ages_past_it(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        await queue.submit(tenant="a", priority="0")
        await queue.submit(tenant="b", priority="2")  # two steps ahead of it
        taken = await queue.take(2)
        assert [job.priority for _, job in taken] == [2, 0]
        for entry_id, _ in taken:
            await queue.reader.ack(entry_id)  # else their leases run out while this test waits

        old = await queue.submit(tenant="a", priority="0")
        await asyncio.sleep(2.5 * PRIORITY_STEP_S)  # it waits longer than two steps' head start
        await queue.submit(tenant="b", priority="2")
        assert [entry_id for entry_id, _ in await queue.take(2)][0] == old

    run(main())


def test_batch_jobs_wait_until_no_interactive_job_is_queued(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        await queue.submit(tenant="a", batch="true")
        await queue.submit(tenant="b", priority="-10")
        await queue.submit(tenant="b", priority="-10")
        taken = await queue.take(3)
        assert [job.batch for _, job in taken] == [False, False, True]

    run(main())


def test_over_a_cap_a_job_is_refused_at_once_with_a_time_to_retry(client):
    async def main():
        queue = Queue(client, FairQueueConfig(max_queued_jobs=3, tenant_max_queued_jobs=2))
        for tenant in ("a", "a", "a", "b", "c"):
            await queue.submit(tenant=tenant)
        refused = [(job.tenant, refusal.code) for job, refusal in queue.refusals]
        assert refused == [("a", "queue_full"), ("c", "queue_full")]  # a over its own cap; then the stream's
        assert all(1 <= refusal.retry_after_s <= 60 for _, refusal in queue.refusals)
        dead = await client.xrange(queue.config.dead_letter_stream)
        assert [fields[b"code"] for _, fields in dead] == [b"queue_full", b"queue_full"]
        assert await client.xlen(queue.config.requests_stream) == 0  # nothing left behind
        # Taking a job makes room again.
        await queue.take(1)
        await queue.submit(tenant="c")
        assert len(queue.refusals) == 2

    run(main())


def test_a_job_that_would_wait_longer_than_the_cap_is_refused_at_once(client):
    async def main():
        queue = Queue(client, FairQueueConfig(max_queue_wait_s=1.1))
        for _ in range(3):  # no job has waited yet: no pace to judge a wait by, none refused
            await queue.submit(tenant="a")
        for _ in range(3):  # taken one every 0.3 s: the 2nd waited 0.6 s for two slots (one
            await asyncio.sleep(0.3)  # job ahead, its own), the 3rd 0.9 s for three: 0.3 s a slot
            await queue.tenants_taken(1)
        for _ in range(5):
            await queue.submit(tenant="b")
        await queue.submit(tenant="b", batch="true")  # batch jobs wait by design: not capped
        # Behind none, one (0.6 s for two slots) and two (0.9 s) queued; behind three, refused.
        queued = await client.hget("{" + queue.config.requests_stream + "}:queued", "b")
        assert int(queued) == 3 + 1
        refused = [(job.tenant, job.batch, refusal.code) for job, refusal in queue.refusals]
        assert refused == [("b", False, "queue_full")] * 2
        assert all(1 <= refusal.retry_after_s <= 60 for _, refusal in queue.refusals)
        assert "s for a slot, with 3 jobs queued ahead, over at most 1.1 s" in queue.refusals[0][1].message

    run(main())


def test_until_a_job_is_taken_the_oldest_queued_job_s_wait_sets_the_pace(client):
    async def main():
        queue = Queue(client, FairQueueConfig(max_queue_wait_s=1.0))
        for _ in range(2):  # all workers busy: nothing is taken
            await queue.submit(tenant="a")
        await asyncio.sleep(0.6)  # the oldest waited 0.6 s for one slot: a third needs three, 1.8 s
        await queue.submit(tenant="a")
        assert [refusal.code for _, refusal in queue.refusals] == ["queue_full"]

    run(main())


def test_the_slots_workers_publish_decide_the_wait_of_a_job_with_nothing_queued_ahead(client):
    async def main():
        queue = Queue(client, FairQueueConfig(max_queue_wait_s=1.0))
        # Worker w1: one slot free, the others' jobs end in 0.59 and 3.95 s at the latest.
        outlook = SlotOutlook(client, queue.config.requests_stream, "w1", slots=3)
        outlook.started("long", max_tokens=100, batch=False)
        outlook.started("longer", max_tokens=100, batch=False)
        now = time.monotonic()
        outlook.produced("long", 1, now - 0.4)
        outlook.produced("long", 40, now)  # 10 ms a token since its first: 59 more take 0.59 s
        outlook.produced("longer", 1, now - 1.0)
        outlook.produced("longer", 20, now)  # 50 ms a token: 79 more take 3.95 s
        assert outlook.ends_s(["long", "longer"], now) == pytest.approx([0.59, 3.95, 0.0])
        await outlook.publish(["long", "longer"])
        await queue.submit(tenant="a")  # the free slot: admitted
        await queue.submit(tenant="a")  # one queued ahead, the 0.59 s slot: admitted
        await queue.submit(tenant="a")  # two ahead: the 3.95 s slot, refused
        assert [refusal.code for _, refusal in queue.refusals] == ["queue_full"]
        assert "s for a slot, with 2 jobs queued ahead, over at most 1 s" in queue.refusals[0][1].message
        # w1 takes both queued jobs: they fill its free and 0.59 s slots until it publishes again.
        await queue.take(2)
        await queue.submit(tenant="a")  # nothing queued ahead, but the next slot frees in 3.95 s
        assert len(queue.refusals) == 2
        # A worker that stops publishing drops out: with no slot known, the pace judges as before.
        await client.delete("{" + queue.config.requests_stream + "}:outlook:w1")
        await queue.submit(tenant="a")
        assert len(queue.refusals) == 2

    run(main())


def test_a_worker_publishes_a_slot_for_each_held_job_and_each_free_one(client):
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    outlook = SlotOutlook(client, stream, "w1", slots=4)
    outlook.started("batch", max_tokens=50, batch=True)  # an interactive job preempts it: free
    outlook.started("new", max_tokens=50, batch=False)  # no token yet, and no pace on the worker
    outlook.started("taken-not-started", max_tokens=50, batch=False)
    outlook.ended("taken-not-started")  # held, its job ended: not known any more
    assert outlook.ends_s(["batch", "new", "gone"], time.monotonic()) == [0.0, UNKNOWN_END_S, UNKNOWN_END_S, 0.0]

    async def main():
        await outlook.publish(["batch", "new"])
        value = (await client.get("{" + stream + "}:outlook:w1")).decode()
        ends_ms = [int(end) for end in value.split(",")]
        assert len(ends_ms) == 4 and ends_ms == sorted(ends_ms)
        assert ends_ms[-1] - ends_ms[0] == int(UNKNOWN_END_S * 1000)
        assert 0 < await client.pttl("{" + stream + "}:outlook:w1") <= OUTLOOK_TTL_MS

    run(main())


def test_a_job_with_no_pace_yet_takes_the_workers_and_a_job_all_made_frees_its_slot(client):
    outlook = SlotOutlook(client, f"inflight:test:{uuid.uuid4().hex[:8]}:requests", "w1", slots=2)
    now = time.monotonic()
    outlook.started("done", max_tokens=10, batch=False)
    outlook.produced("done", 1, now - 1.0)
    outlook.produced("done", 8, now - 0.2)  # 0.1 s a token
    outlook.ended("done")
    outlook.started("new", max_tokens=50, batch=False)  # its prompt still computing
    outlook.started("burst", max_tokens=4, batch=False)
    outlook.produced("burst", 4, now)  # every token in one step (accepted drafts): no pace, none left
    assert outlook.ends_s(["new", "burst"], now) == pytest.approx([5.0, 0.0])


def test_a_worker_publishes_at_once_when_a_job_ends(client, monkeypatch):
    monkeypatch.setattr(slot_outlook, "PUBLISH_INTERVAL_S", 30.0)  # no tick would come in time
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    outlook, held = SlotOutlook(client, stream, "w1", slots=1), {"job": None}

    async def main():
        publishing = asyncio.create_task(outlook.run(held, asyncio.Event()))
        key = "{" + stream + "}:outlook:w1"
        while await client.get(key) is None:
            await asyncio.sleep(0.01)
        assert int(await client.get(key)) > int((await client.time())[0]) * 1000 + 1000  # held, not started
        del held["job"]
        outlook.ended("job")
        for _ in range(500):
            now_ms = int((await client.time())[0]) * 1000
            if int(await client.get(key)) <= now_ms + 1000:  # free now
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the freed slot was not published")
        # `stop` does not end the wait for a change, only the next tick would (30 s here):
        # cancel the publisher rather than wait for it.
        publishing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publishing

    run(main())


def test_a_cap_on_queued_prompt_tokens_counts_the_prompts(client):
    async def main():
        queue = Queue(client, FairQueueConfig(tenant_max_queued_tokens=10))
        await queue.submit("one two three four five six", tenant="a")
        await queue.submit("one two three four five six", tenant="a")  # 12 > 10
        await queue.submit("one two three four", tenant="a")  # 10: fits
        assert [refusal.code for _, refusal in queue.refusals] == ["queue_full"]
        assert "prompt tokens" in queue.refusals[0][1].message

    run(main())


def test_a_tenant_over_its_tokens_per_second_is_refused_until_its_bucket_refills(client):
    async def main():
        queue = Queue(client, FairQueueConfig(tenant_tokens_per_s=10))  # a bucket of 100 tokens
        await queue.submit(tenant="a")
        await queue.charge("a", output_tokens=150)
        await queue.submit(tenant="a")
        await queue.submit(tenant="b")  # another tenant is not affected
        assert [(job.tenant, refusal.code) for job, refusal in queue.refusals] == [("a", "quota_exceeded")]
        assert 4 <= queue.refusals[0][1].retry_after_s <= 6  # about 50 tokens short, at 10 a second

    run(main())


def test_a_job_whose_lease_runs_out_is_taken_over_under_its_entry_id(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        entry_id = await queue.submit(tenant="a")
        ((taken_id, _),) = await queue.take()
        survivor = queue.reader_for("w2")
        assert await queue.reader.renew([taken_id]) == []  # still w1's
        await asyncio.sleep(0.4)  # w1 stops renewing: it died
        ((again_id, job),) = await queue.take(reader=survivor)
        assert again_id == entry_id == taken_id
        assert await queue.reader.renew([taken_id]) == [taken_id]  # w1 learns it lost it
        await survivor.ack(again_id)
        assert (
            await client.xlen(next(iter(await client.smembers("{" + queue.config.requests_stream + "}:queues")))) == 0
        )

    run(main())


def test_a_restarted_worker_finds_its_own_jobs_first(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        entry_id = await queue.submit(tenant="a")
        await queue.take()
        restarted = queue.reader_for("w1")
        entries = await restarted.read(4, 50)
        assert [(entry.entry_id, entry.deliveries) for entry in entries] == [(entry_id, 2)]
        await restarted.dead_letter(entries[0], "internal_error", "test")
        dead = await client.xrange(queue.config.dead_letter_stream)
        assert dead[0][1][b"entry_id"] == entry_id.encode()
        assert dead[0][1][b"stream"] == queue.config.requests_stream.encode()

    run(main())


def test_a_job_admitted_by_two_workers_at_once_is_queued_once(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        await queue.admission.reader.ensure_group()
        await client.xadd(queue.config.requests_stream, {"prompt": "x", "tenant": "a"})
        (entry,) = await queue.admission.reader.read(1, 50)
        await asyncio.gather(queue.admission.admit(entry), queue.admission.admit(entry))
        assert len(await queue.take(4)) == 1

    run(main())


def test_a_worker_may_take_interactive_jobs_only_leaving_batch_jobs_queued(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True))
        await queue.submit(tenant="a", batch="true")
        assert await queue.reader.read(4, 50, max_batch=0) == []
        await queue.submit(tenant="b")
        entries = await queue.reader.read(4, 50, max_batch=0)
        assert [decode_job(e.entry_id, e.fields).tenant for e in entries] == ["b"]
        assert [job.batch for _, job in await queue.take(4)] == [True]

    run(main())


def test_a_take_waits_for_a_burst_to_be_admitted_and_orders_it_as_a_whole(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True, admission_wait_ms=2000))
        await queue.admission.reader.ensure_group()
        for tenant in ["flood"] * 6 + ["light"] * 2:  # one burst, the flood's jobs first
            await client.xadd(queue.config.requests_stream, {"prompt": "four words of prompt", "tenant": tenant})

        async def admit_slowly():  # one entry at a time, as a busy worker admits
            for entry in await queue.admission.reader.read(64, 50):
                await asyncio.sleep(0.02)
                await queue.admission.admit(entry)

        admitting = asyncio.create_task(admit_slowly())
        await asyncio.sleep(0.03)  # the first of the flood is admitted: a take could start
        taken = await queue.take(4)
        await admitting
        # Taken after the whole burst was admitted: the light tenant alternates with the
        # flood rather than waiting behind the jobs that happened to be admitted first.
        assert [job.tenant for _, job in taken] == ["flood", "light", "flood", "light"]

    run(main())


def test_the_wait_for_admission_is_bounded(client):
    async def main():
        queue = Queue(client, FairQueueConfig(enabled=True, admission_wait_ms=100))
        await queue.submit(tenant="a")
        await queue.admission.reader.ensure_group()
        # An arrival that no worker admits (its admitting worker stalled) holds a take
        # back for the wait's length only.
        await client.xadd(queue.config.requests_stream, {"prompt": "x", "tenant": "b"})
        taken = await asyncio.wait_for(queue.take(4), timeout=5)
        assert [job.tenant for _, job in taken] == ["a"]

    run(main())
