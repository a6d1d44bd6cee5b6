"""Fair preemption (issue 61): a tenant that arrives after a flood does not wait for the
flood's running requests to end. Once it has waited `fair_preempt_after_s` for room, its
request swaps out a request of the tenant served most lately, while that tenant was served
more than it. The real scheduler, driven by the simulated model of
tests/workers/test_scheduler.py, whose fake KV cache checks at every step that each swapped
request's context survived."""

from __future__ import annotations

import time

from tests.workers.test_scheduler import FakeRunner, make, request
from workers.plan import ScheduledChunk, StepPlan
from workers.request import Request, RequestStatus

FLOOD_TOKENS = 40


def of(tenant: str, rid: str, **options) -> Request:
    r = request(rid, 3, **options)
    r.tenant = tenant
    return r


def flood_running(s, runner: FakeRunner, count: int, **options) -> list[Request]:
    """`count` long requests of tenant "flood", every one running."""
    flood = [of("flood", f"f{k}", max_tokens=FLOOD_TOKENS, **options) for k in range(count)]
    for r in flood:
        s.add(r)
    runner.step(s.schedule())
    assert all(r.status is RequestStatus.RUNNING for r in flood)
    return flood


def running_by_tenant(s) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in s.running:
        counts[r.tenant] = counts.get(r.tenant, 0) + 1
    return counts


def test_a_light_tenant_past_the_bound_swaps_out_a_flood_request_and_starts_at_once():
    s = make(max_running_requests=4, host_blocks=64, fair_preempt_after_s=0.5)
    runner = FakeRunner(s)
    flood = flood_running(s, runner, 4)
    light = of("light", "light", max_tokens=3, arrival=time.perf_counter() - 1.0)  # waited 1 s already
    s.add(light)
    plan = s.schedule()
    assert light.fair and light.status is RequestStatus.RUNNING
    assert [r.tenant for r in plan.preempted] == ["flood"] and plan.preempted[0].status is RequestStatus.SWAPPED
    runner.step(plan)
    while s.has_unfinished():
        runner.step(s.schedule())
    # Everyone finished with every token, the victim after its swap (its context checked by the fake cache).
    assert len(light.output_token_ids) == 3
    assert all(len(r.output_token_ids) == FLOOD_TOKENS for r in flood)


def test_before_the_bound_the_light_request_waits_for_a_slot():
    s = make(max_running_requests=4, host_blocks=64, fair_preempt_after_s=1_000.0)
    runner = FakeRunner(s)
    flood_running(s, runner, 4)
    light = of("light", "light", arrival=time.perf_counter())
    s.add(light)
    for _ in range(5):
        plan = s.schedule()
        assert not plan.preempted and light.status is RequestStatus.WAITING
        runner.step(plan)


def test_off_by_default_a_late_tenant_waits_for_the_flood_to_end():
    s = make(max_running_requests=2, host_blocks=64)
    runner = FakeRunner(s)
    flood = flood_running(s, runner, 2)
    light = of("light", "light")
    s.add(light)
    while light.status is not RequestStatus.RUNNING:
        plan = s.schedule()
        assert not plan.preempted
        runner.step(plan)
    assert not light.fair and any(r.status is RequestStatus.FINISHED for r in flood)


def test_a_late_tenant_takes_as_many_slots_as_it_has_requests_while_it_was_served_less():
    s = make(max_running_requests=4, host_blocks=64, fair_preempt_after_s=0.5)
    runner = FakeRunner(s)
    flood_running(s, runner, 4)
    light = [of("light", f"l{k}", max_tokens=3, arrival=time.perf_counter() - 1.0) for k in range(3)]
    for r in light:
        s.add(r)
    plan = s.schedule()
    assert all(r.fair and r.status is RequestStatus.RUNNING for r in light)
    assert [r.tenant for r in plan.preempted] == ["flood"] * 3
    assert running_by_tenant(s) == {"flood": 1, "light": 3}


def test_a_tenant_served_more_lately_than_the_others_waits_its_turn():
    s = make(max_running_requests=2, host_blocks=64, fair_preempt_after_s=0.5)
    runner = FakeRunner(s)
    flood_running(s, runner, 2)
    assert s.fair_share is not None
    s.fair_share.charge(StepPlan([ScheduledChunk.prefill(of("light", "earlier", arrival=0.0), 3)] * 1000))
    late = of("light", "late", arrival=time.perf_counter() - 1.0)
    s.add(late)
    plan = s.schedule()
    assert not late.fair and not plan.preempted and late.status is RequestStatus.WAITING


def test_only_a_request_of_the_same_priority_is_swapped_out_and_never_for_a_batch_job():
    s = make(max_running_requests=2, host_blocks=64, fair_preempt_after_s=0.5)
    runner = FakeRunner(s)
    flood_running(s, runner, 2, priority=1)
    lower = of("light", "lower", arrival=time.perf_counter() - 1.0, priority=0)
    batch = of("other", "batch", arrival=time.perf_counter() - 1.0, priority=1)
    batch.batch = True
    s.add(lower)
    s.add(batch)
    plan = s.schedule()
    assert not plan.preempted and not batch.fair
    assert lower.status is RequestStatus.WAITING and batch.status is RequestStatus.WAITING


def test_without_a_host_tier_nothing_is_preempted_for_fairness():
    s = make(max_running_requests=2, fair_preempt_after_s=0.5)
    runner = FakeRunner(s)
    flood_running(s, runner, 2)
    light = of("light", "light", arrival=time.perf_counter() - 1.0)
    s.add(light)
    plan = s.schedule()
    assert not plan.preempted and light.status is RequestStatus.WAITING
