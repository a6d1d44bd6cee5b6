"""The scheduler's queue on its own: priority with aging, the starvation bound, lazy removal
and deadlines."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.api import PRIORITY_MAX, PRIORITY_MIN, SamplingParams
from workers.request import Request, RequestStatus
from workers.request_queue import RequestQueue

BOUND = 10.0


def request(rid: str, arrival: float, priority: int = 0, deadline: float | None = None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), arrival, priority, deadline)


def drain(queue: RequestQueue) -> list[str]:
    order = []
    while queue.num_queued:
        order.append(queue.head().request_id)
        queue.pop()
    return order


def test_equal_priority_is_first_come_first_served_and_a_higher_one_is_a_head_start():
    queue = RequestQueue(BOUND)
    step = BOUND / (PRIORITY_MAX - PRIORITY_MIN)
    for r in (request("a", 0.0), request("b", 0.0), request("urgent", 1.5 * step, priority=1)):
        queue.place(r)
        queue.push(r, RequestStatus.WAITING)
    assert drain(queue) == ["a", "b", "urgent"]  # its head start is less than it came late
    queue = RequestQueue(BOUND)
    for r in (request("a", 0.0), request("urgent", 0.5 * step, priority=1), request("b", 0.0)):
        queue.place(r)
        queue.push(r, RequestStatus.WAITING)
    assert drain(queue) == ["urgent", "a", "b"]


@given(
    st.lists(
        st.tuples(st.floats(0, 100), st.integers(PRIORITY_MIN, PRIORITY_MAX)),
        min_size=2,
        max_size=30,
    )
)
def test_no_request_is_overtaken_by_one_that_arrived_more_than_the_bound_after_it(arrivals):
    queue = RequestQueue(BOUND)
    requests = [request(str(i), arrival, priority) for i, (arrival, priority) in enumerate(arrivals)]
    for r in requests:
        queue.place(r)
        queue.push(r, RequestStatus.WAITING)
    position = {rid: i for i, rid in enumerate(drain(queue))}
    for early in requests:
        for late in requests:
            if late.arrival_time > early.arrival_time + BOUND:
                assert position[early.request_id] < position[late.request_id]


def test_a_finished_request_stops_counting_and_is_skipped_when_it_surfaces():
    queue = RequestQueue(BOUND)
    first, swapped, last = request("first", 0.0), request("swapped", 1.0), request("last", 2.0)
    for r, status in ((first, RequestStatus.WAITING), (swapped, RequestStatus.SWAPPED), (last, RequestStatus.WAITING)):
        queue.place(r)
        queue.push(r, status)
    assert (queue.num_queued, queue.num_swapped) == (3, 1)
    waiting, swapped_counts, oldest = queue.census()
    assert (waiting, swapped_counts, oldest) == ({0: 2}, {0: 1}, 0.0)
    for r in (first, swapped):
        queue.discard(r)
        r.status = RequestStatus.FINISHED
    assert (queue.num_queued, queue.num_swapped) == (1, 0)
    assert queue.census() == ({0: 1}, {}, 2.0)
    assert drain(queue) == ["last"]


def test_a_parallel_choice_is_placed_beside_its_lead_with_a_key_of_its_own():
    queue = RequestQueue(BOUND)
    lead, fork = request("lead", 0.0, priority=2), request("fork", 0.0, priority=2)
    queue.place(lead)
    queue.place(fork, beside=lead)
    assert fork.queue_key[:-1] == lead.queue_key[:-1] and fork.queue_key > lead.queue_key


def test_deadlines_come_due_in_order_and_finished_requests_are_left_out():
    queue = RequestQueue(BOUND)
    late, soon, done = (request(rid, 0.0, deadline=at) for rid, at in (("late", 5.0), ("soon", 1.0), ("done", 2.0)))
    for r in (late, soon, done, request("none", 0.0)):
        queue.place(r)
    done.status = RequestStatus.FINISHED
    assert queue.expired(0.5) == []
    assert queue.expired(2.0) == [soon]
    assert queue.expired(10.0) == [late]
