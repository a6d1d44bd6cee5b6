"""Batch jobs (issue 38): they run only on capacity interactive requests leave free.

The real scheduler, driven by the simulated model of tests/workers/test_scheduler.py (whose fake
KV cache checks at every step that each request's context survived preemption), then
one engine run with a tiny random model for the tokens themselves."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.drive import Driver, StepRecorder
from tests.workers.test_scheduler import FakeRunner, make, request, run
from workers.api import PRIORITY_MAX, PRIORITY_MIN, FinishReason, GenerationRequest, SamplingParams
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.model_loader import load_model
from workers.plan import ScheduledChunk, StepPlan
from workers.request import Request, RequestStatus
from workers.request_queue import BATCH, RequestQueue


def batch_job(rid: str, prompt_len: int, **options) -> Request:
    job = request(rid, prompt_len, **options)
    job.batch = True
    return job


def start_order(plans) -> list[str]:
    return [c.request.request_id for plan in plans for c in plan.chunks if c.start == 0]


def step_until(s, runner: FakeRunner, condition, max_steps: int = 1_000) -> None:
    for _ in range(max_steps):
        if condition():
            return
        runner.step(s.schedule())
    raise AssertionError("the condition never held")


def finish_all(s, runner: FakeRunner) -> list[StepPlan]:
    """Step until every request ended, with the runner (and fake KV cache) so far."""
    plans = []
    while s.has_unfinished():
        plans.append(s.schedule())
        runner.step(plans[-1])
    return plans


def first_run(plans: list[StepPlan], r: Request) -> tuple[StepPlan, ScheduledChunk]:
    """The first plan that runs `r`, and its chunk of `r`."""
    plan = next(p for p in plans if any(c.request is r for c in p.chunks))
    return plan, next(c for c in plan.chunks if c.request is r)


# -- the queue's order -------------------------------------------------------------------


def test_a_batch_job_waits_behind_interactive_jobs_of_any_priority_and_arrival():
    s = make(max_running_requests=1, priority_bound_s=30.0)
    batch = batch_job("batch", 2, max_tokens=1, priority=PRIORITY_MAX, arrival=0.0)
    late_and_low = [request(f"i{k}", 2, max_tokens=1, priority=PRIORITY_MIN, arrival=1_000.0 + k) for k in range(3)]
    assert start_order(run(s, [batch, *late_and_low])) == ["i0", "i1", "i2", "batch"]


def test_with_free_capacity_a_batch_job_runs_beside_interactive_ones():
    s = make(max_running_requests=4)
    batch, interactive = batch_job("batch", 3, max_tokens=5), request("interactive", 3, max_tokens=5)
    plans = run(s, [batch, interactive])
    assert set(start_order(plans[:1])) == {"batch", "interactive"}
    assert not any(p.preempted for p in plans)
    assert len(batch.output_token_ids) == 5


def test_no_more_batch_jobs_run_at_once_than_their_cap_and_interactive_ones_fill_the_rest():
    s = make(max_running_requests=4, max_running_batch=1)
    batch = [batch_job(f"b{k}", 3, max_tokens=5) for k in range(3)]
    interactive = [request(f"i{k}", 3, max_tokens=5) for k in range(2)]
    plans = run(s, [*batch, *interactive])
    assert max(sum(r.batch for r in {c.request for c in p.chunks}) for p in plans) == 1
    assert set(start_order(plans[:1])) == {"b0", "i0", "i1"}
    assert all(len(job.output_token_ids) == 5 for job in batch)  # one after another, all served


def test_beside_interactive_requests_a_batch_prompt_takes_small_chunks_and_whole_ones_once_alone():
    s = make(num_blocks=128, max_running_requests=4, max_batch_prefill_tokens=32)
    interactive = request("interactive", 3, max_tokens=6)
    batch = batch_job("batch", 400, max_tokens=2)
    plans = run(s, [interactive, batch])

    def batch_prompt_tokens(plan) -> int:
        return sum(c.num_tokens for c in plan.chunks if c.request is batch and c.start < batch.num_prompt_tokens)

    beside = [batch_prompt_tokens(p) for p in plans if any(c.request is interactive for c in p.chunks)]
    alone = [batch_prompt_tokens(p) for p in plans if all(c.request is batch for c in p.chunks)]
    assert beside[1:] == [32] * 5  # the first step took the interactive prompt and batch's first 32
    assert max(alone) == 400 - 32 * 6  # the rest in one chunk, up to max_prefill_chunk
    assert len(batch.output_token_ids) == 2


def test_among_batch_jobs_priority_then_arrival_orders_them():
    s = make(max_running_requests=1)
    priorities = [0, 3, -2, 3, 10, -10, 0]
    jobs = [batch_job(f"b{i}", 2, max_tokens=1, priority=p) for i, p in enumerate(priorities)]
    assert start_order(run(s, jobs)) == ["b4", "b1", "b3", "b0", "b6", "b2", "b5"]


def test_among_batch_jobs_aging_holds_the_starvation_bound():
    bound = 30.0
    s = make(max_running_requests=1, priority_bound_s=bound)
    old = batch_job("old", 2, max_tokens=1, priority=PRIORITY_MIN, arrival=0.0)
    within = batch_job("within", 2, max_tokens=1, priority=PRIORITY_MAX, arrival=bound - 1)
    later = batch_job("later", 2, max_tokens=1, priority=PRIORITY_MAX, arrival=bound + 1)
    assert start_order(run(s, [later, old, within])) == ["within", "old", "later"]


@given(st.lists(st.tuples(st.floats(0, 100), st.integers(PRIORITY_MIN, PRIORITY_MAX), st.booleans()), max_size=30))
def test_the_queue_puts_every_interactive_job_first_and_ages_each_class(jobs):
    bound = 10.0
    queue = RequestQueue(bound)
    requests = []
    for i, (arrival, priority, batch) in enumerate(jobs):
        r = Request(str(i), [1], SamplingParams(), arrival, priority, batch=batch)
        queue.place(r)
        queue.push(r, RequestStatus.WAITING)
        requests.append(r)
    order = []
    while queue.num_queued:
        order.append(queue.head())
        queue.pop()
    assert [r.batch for r in order] == sorted(r.batch for r in requests)  # interactive ones first
    position = {id(r): i for i, r in enumerate(order)}
    for early in requests:
        for late in requests:
            if late.batch == early.batch and late.arrival_time > early.arrival_time + bound:
                assert position[id(early)] < position[id(late)]


def test_a_parallel_choice_of_a_batch_job_is_placed_as_a_batch_job():
    queue = RequestQueue(10.0)
    lead, fork = batch_job("lead", 2), batch_job("lead/1", 2)
    queue.place(lead)
    queue.place(fork, beside=lead)
    assert fork.queue_key[:-1] == lead.queue_key[:-1] == (BATCH, lead.queue_key[1])


# -- preemption for interactive work -----------------------------------------------------


def fill_with_batch_jobs(s, runner: FakeRunner, count: int, prompt_len: int, max_tokens: int) -> list[Request]:
    """`count` batch jobs, arriving in that order, running until each has produced a token."""
    jobs = [batch_job(f"b{k}", prompt_len, max_tokens=max_tokens, arrival=float(k)) for k in range(count)]
    for job in jobs:
        s.add(job)
    step_until(s, runner, lambda: all(job.output_token_ids for job in jobs))
    return jobs


@pytest.mark.parametrize("host_blocks", [16, 0], ids=["swapped", "recomputed"])
def test_an_interactive_job_takes_a_batch_jobs_running_slot_the_next_step(host_blocks):
    s = make(max_running_requests=2, host_blocks=host_blocks)
    runner = FakeRunner(s)
    jobs = fill_with_batch_jobs(s, runner, 2, prompt_len=5, max_tokens=12)
    computed = {job.request_id: job.num_computed for job in jobs}
    interactive = request("interactive", 3, max_tokens=4, arrival=100.0)
    s.add(interactive)
    plan = s.schedule()
    victim = jobs[1]  # what any preemption would pick: equal priority and steps, the later in queue order
    assert plan.preempted == [victim]
    assert [(c.request.request_id, c.start) for c in plan.chunks if not c.is_decode] == [("interactive", 0)]
    if host_blocks:  # swapped out: its progress is kept
        assert victim.status is RequestStatus.SWAPPED and victim.num_computed == computed["b1"]
        assert plan.swap_out and victim.host_block_tables[0]
    else:  # recomputed from its prompt when it runs again
        assert victim.status is RequestStatus.WAITING and victim.num_computed == 0 and not plan.swap_out
    runner.step(plan)
    back_plan, back = first_run(finish_all(s, runner), victim)
    assert back.start == (computed["b1"] if host_blocks else 0)
    assert (victim in back_plan.resumed) == bool(host_blocks)
    assert all(len(job.output_token_ids) == 12 for job in jobs) and len(interactive.output_token_ids) == 4
    assert s.allocator.num_free == s.allocator.num_blocks


def test_an_interactive_job_takes_the_kv_blocks_batch_jobs_hold_the_next_step():
    s = make(num_blocks=8, host_blocks=16)
    runner = FakeRunner(s)
    (job,) = fill_with_batch_jobs(s, runner, 1, prompt_len=28, max_tokens=4)
    runner.step(s.schedule())  # its second token: all 8 blocks held now
    assert s.allocator.num_free == 0 and len(s.running) < s.config.max_running_requests
    computed = job.num_computed
    interactive = request("interactive", 3, max_tokens=4, arrival=100.0)
    s.add(interactive)
    plan = s.schedule()
    assert plan.preempted == [job] and job.status is RequestStatus.SWAPPED and job.num_computed == computed
    assert [(c.request.request_id, c.start) for c in plan.chunks] == [("interactive", 0)]
    runner.step(plan)
    back_plan, back = first_run(finish_all(s, runner), job)
    assert job in back_plan.resumed and back.start == computed
    assert len(job.output_token_ids) == 4 and interactive.status is RequestStatus.FINISHED


def test_an_interactive_prompt_part_way_through_takes_blocks_back_from_a_batch_job():
    s = make(num_blocks=8, host_blocks=16, max_prefill_chunk=4)
    runner = FakeRunner(s)
    (job,) = fill_with_batch_jobs(s, runner, 1, prompt_len=15, max_tokens=12)
    interactive = request("interactive", 16, max_tokens=2, arrival=100.0)
    s.add(interactive)
    prompt_chunks = []
    while interactive.num_computed < interactive.num_prompt_tokens:
        plan = s.schedule()
        prompt_chunks.append([c.start for c in plan.chunks if c.request is interactive])
        runner.step(plan)
    # One chunk every step: the batch job's blocks are taken, not waited for.
    assert prompt_chunks == [[0], [4], [8], [12]]
    assert job.status is RequestStatus.SWAPPED
    finish_all(s, runner)
    assert len(job.output_token_ids) == 12


def test_an_interactive_prompt_takes_the_prefill_budget_before_a_batch_prompt_part_way_through():
    s = make(max_prefill_tokens=8, max_prefill_chunk=8)
    runner = FakeRunner(s)
    job = batch_job("b0", 40, max_tokens=4)
    s.add(job)
    runner.step(s.schedule())  # its first 8 prompt tokens
    interactive = request("interactive", 6, max_tokens=2, arrival=100.0)
    s.add(interactive)
    plan = s.schedule()
    # The interactive prompt whole, the batch prompt only what the budget has left.
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("interactive", 0, 6),
        ("b0", 8, 2),
    ]
    runner.step(plan)
    finish_all(s, runner)
    assert len(job.output_token_ids) == 4 and len(interactive.output_token_ids) == 2


def test_a_batch_job_is_the_victim_whatever_the_priorities():
    s = make(num_blocks=9, host_blocks=16, max_batch_tokens=64)
    runner = FakeRunner(s)
    low = request("low", 4, max_tokens=30, priority=PRIORITY_MIN)
    s.add(low)
    for _ in range(10):
        runner.step(s.schedule())
    urgent_batch = batch_job("urgent batch", 4, max_tokens=20, priority=PRIORITY_MAX, arrival=1.0)
    s.add(urgent_batch)
    victims = []
    while s.has_unfinished():
        plan = s.schedule()
        victims += [r.request_id for r in plan.preempted]
        runner.step(plan)
    # Without `batch`, the lowest priority would be the victim (test_scheduler).
    assert victims and set(victims) == {"urgent batch"}


@settings(max_examples=100, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.integers(1, 30),  # prompt length
            st.integers(1, 10),  # max tokens
            st.integers(0, 8),  # arrival step
            st.integers(PRIORITY_MIN, PRIORITY_MAX),
            st.booleans(),  # batch
        ),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(12, 32),
    host_blocks=st.integers(0, 16),
    max_running=st.integers(1, 6),
    max_prefill_chunk=st.integers(1, 32),
)
def test_batch_jobs_never_preempt_interactive_ones_nor_start_ahead_of_them(
    jobs, num_blocks, host_blocks, max_running, max_prefill_chunk
):
    s = make(num_blocks, host_blocks, max_running_requests=max_running, max_prefill_chunk=max_prefill_chunk)
    runner = FakeRunner(s)
    arrivals: dict[int, list[Request]] = {}
    for i, (prompt_len, max_tokens, arrive, priority, batch) in enumerate(jobs):
        r = request(f"r{i}", prompt_len, max_tokens, priority, float(arrive))
        r.batch = batch
        arrivals.setdefault(arrive, []).append(r)
    everyone = [r for group in arrivals.values() for r in group]
    first_start: dict[str, int] = {}
    for step in range(5_000):
        for r in arrivals.pop(step, []):
            s.add(r)
        if not arrivals and not s.has_unfinished():
            break
        plan = s.schedule()
        # Batch victims first; an interactive one only when no batch job is left running.
        victims_batch = [r.batch for r in plan.preempted]
        assert victims_batch == sorted(victims_batch, reverse=True)
        if not all(victims_batch):
            assert not any(r.batch for r in s.running)
        for c in plan.chunks:
            first_start.setdefault(c.request.request_id, step)
        runner.step(plan)
    else:
        raise AssertionError("requests did not finish")
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in everyone)
    # No batch job started while an interactive one that had arrived was yet to start.
    for b in (r for r in everyone if r.batch):
        for a in (r for r in everyone if not r.batch):
            if a.arrival_time <= first_start[b.request_id]:
                assert first_start[a.request_id] <= first_start[b.request_id], (a.request_id, b.request_id)
    assert s.allocator.num_free == num_blocks


# -- the engine: a batch job's tokens survive preemption -----------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    return load_model(ModelConfig(source="random:tiny-llama", dtype="float32", device="cpu"))


def one_slot_engine(loaded) -> Engine:
    return Engine(loaded, EngineConfig(
        model=ModelConfig(source="random:tiny-llama", dtype="float32", device="cpu"),
        cache=CacheConfig(kv_memory_bytes=8 << 20, swap_memory_bytes=8 << 20),
        scheduler=SchedulerConfig(max_running_requests=1),
    ))  # fmt: skip


def test_a_preempted_batch_job_produces_the_tokens_it_produces_alone(tiny_llama):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = Driver(one_slot_engine(tiny_llama))
    alone.submit("batch", "Once upon a time", params, batch=True)
    alone.drain()

    engine = one_slot_engine(tiny_llama)
    steps = StepRecorder(engine)
    driver = Driver(engine)
    driver.submit("batch", "Once upon a time", params, batch=True)
    for _ in range(4):
        driver.step()
    driver.submit("interactive", "The capital of France is", SamplingParams(max_tokens=4, ignore_eos=True))
    driver.drain()

    assert sum(r.num_swapped_out for r in steps) == 1  # the one running slot was the batch job's
    assert list(driver.finals) == ["interactive", "batch"]
    assert driver.tokens["batch"] == alone.tokens["batch"] and len(alone.tokens["batch"]) == 16
    assert driver.finals["batch"].finish_reason == FinishReason.LENGTH


def test_batch_must_be_a_boolean(tiny_llama):
    engine = one_slot_engine(tiny_llama)
    engine.add_request(GenerationRequest("bad", "Hi", batch="yes"))
    (final,) = engine.step()
    assert final.finish_reason == FinishReason.ERROR and "batch" in final.error
