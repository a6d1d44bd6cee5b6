"""Taken-over requests go first (issue 39): a request resumed from another worker's
published tokens has a reader waiting mid-answer, so it queues ahead of the rest of its
class and may use `takeover_allowance` running slots beyond `max_running_requests` on a
saturated worker, rather than wait for one of them to end.

The real scheduler, driven by the simulated model of tests/workers/test_scheduler.py."""

from __future__ import annotations

from tests.workers.test_scheduler import FakeRunner, make, request
from workers.request import Request, RequestStatus


def taken_over(rid: str, prompt_len: int, published: int = 3, **options) -> Request:
    """A request another worker had started: `published` tokens already on its stream."""
    r = request(rid, prompt_len, max_tokens=published + 4, **options)
    r.output_token_ids = [7] * published
    r.takeover = True
    return r


def saturate(s, runner: FakeRunner, count: int) -> list[Request]:
    """`count` long requests running, one step in."""
    running = [request(f"run-{i}", 8, max_tokens=200) for i in range(count)]
    for r in running:
        s.add(r)
    runner.step(s.schedule())
    assert all(r.status is RequestStatus.RUNNING for r in running)
    return running


def test_on_a_saturated_worker_a_takeover_starts_at_once_beyond_the_running_limit():
    s = make(max_running_requests=2, takeover_allowance=1)
    runner = FakeRunner(s)
    saturate(s, runner, 2)
    waiting = request("new", 8, arrival=-10.0)  # new work that came first
    resumed = taken_over("resumed", 8)
    s.add(waiting)
    s.add(resumed)
    plan = s.schedule()
    assert resumed in [c.request for c in plan.chunks]
    assert waiting.status is RequestStatus.WAITING
    assert len(s.running) == 3
    runner.step(plan)


def test_the_allowance_bounds_how_many_takeovers_run_beyond_the_limit():
    s = make(max_running_requests=2, takeover_allowance=1)
    runner = FakeRunner(s)
    saturate(s, runner, 2)
    first, second = taken_over("first", 8, arrival=-2.0), taken_over("second", 8, arrival=-1.0)
    s.add(first)
    s.add(second)
    runner.step(s.schedule())
    assert (first.status, second.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)


def test_without_an_allowance_a_takeover_still_goes_first_when_a_slot_frees():
    s = make(max_running_requests=1, takeover_allowance=0)
    runner = FakeRunner(s)
    (running,) = saturate(s, runner, 1)
    important = request("important", 8, priority=10, arrival=-100.0)
    resumed = taken_over("resumed", 8, priority=-10)
    s.add(important)
    s.add(resumed)
    while running.status is not RequestStatus.FINISHED:
        runner.step(s.schedule())
        assert resumed.status is RequestStatus.WAITING or running.status is RequestStatus.FINISHED
    runner.step(s.schedule())
    assert resumed.status is RequestStatus.RUNNING and important.status is RequestStatus.WAITING


def test_a_taken_over_batch_job_stays_a_batch_job():
    s = make(max_running_requests=1, takeover_allowance=2)
    runner = FakeRunner(s)
    saturate(s, runner, 1)
    resumed = taken_over("resumed", 8)
    resumed.batch = True
    s.add(resumed)
    runner.step(s.schedule())
    assert resumed.status is RequestStatus.WAITING  # batch jobs use only free capacity
