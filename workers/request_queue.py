"""The scheduler's queue: waiting and swapped-out requests in one order, and every request's deadline.

**Queue order (priority with aging).** Waiting and swapped-out requests share one
queue ordered by a key fixed at arrival, `(class, virtual arrival, tie-breaker)`, with
virtual arrival `arrival - (priority - PRIORITY_MIN) * w` and
`w = priority_bound_s / (PRIORITY_MAX - PRIORITY_MIN)`. The classes, in order: interactive
requests taken over from a worker that died (their streams stalled mid-answer), those of
a tenant below its share here under fair preemption (`Request.fair`), other interactive
requests, batch jobs. Batch jobs come after every interactive request,
whatever the priorities and however long they waited. Within
each class, read the virtual arrival as "every priority step is a head start of w
seconds": a request's effective priority grows with the time it waits, at the same
rate for everyone, so the order never has to be recomputed. Consequence (the
starvation bound): no interactive request is ever overtaken by one that arrived more
than `priority_bound_s` after it, and no batch request by a batch request that did;
a batch request may wait behind interactive work indefinitely, by design. Equal
priority is first come, first served. A preempted request returns under its original
key, keeping its place.

**Shortest predicted first.** Under a length policy (`SchedulerConfig.length_policy`) the
key also subtracts a head start of up to `length_bound_s` seconds, more the shorter the
request's predicted output (`workers.length_predictor.head_start_s`), so within a
priority short jobs go first and a long one still ages: it is never overtaken by one of
its class (interactive or batch) that arrived more than `priority_bound_s + length_bound_s`
after it.

Requests that finish while queued are dropped lazily, when they surface.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

from workers.api import PRIORITY_MAX, PRIORITY_MIN
from workers.request import Request, RequestStatus

QUEUED = (RequestStatus.WAITING, RequestStatus.SWAPPED)
TAKEN_OVER, FAIR, INTERACTIVE, BATCH = 0, 1, 2, 3


def queue_class(request: Request) -> int:
    """Which class of the queue's order a request is in (the key's first part)."""
    if request.batch:
        return BATCH
    if request.takeover:
        return TAKEN_OVER
    return FAIR if request.fair else INTERACTIVE


class RequestQueue:
    def __init__(self, priority_bound_s: float) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self._deadlines: list[tuple[float, int, Request]] = []
        self._order = itertools.count()  # tie-breakers: first come, first served
        self._priority_weight = priority_bound_s / (PRIORITY_MAX - PRIORITY_MIN)
        self.num_queued = 0  # swapped-out requests included
        self.num_swapped = 0

    def place(self, request: Request, beside: Request | None = None, head_start_s: float = 0.0) -> None:
        """Fix `request`'s queue key from whether it is a batch job, its arrival, priority
        and `head_start_s` (or, for a parallel choice, `beside` its lead's, with a
        tie-breaker of its own: keys are unique), and watch its deadline."""
        if beside is None:
            rank = queue_class(request)
            priority_credit = (request.priority - PRIORITY_MIN) * self._priority_weight
            virtual_arrival = request.arrival_time - priority_credit - head_start_s
        else:
            rank, virtual_arrival, _ = beside.queue_key
        request.queue_key = (rank, virtual_arrival, next(self._order))
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._order), request))

    def push(self, request: Request, status: RequestStatus) -> None:
        """Queue `request` (placed already) as WAITING or SWAPPED."""
        request.status = status
        heapq.heappush(self._heap, (request.queue_key, request))
        self.num_queued += 1
        self.num_swapped += status is RequestStatus.SWAPPED

    def head(self) -> Request:
        """The first queued request (the queue must not be empty)."""
        while self._heap[0][1].status not in QUEUED:
            heapq.heappop(self._heap)  # finished while queued
        return self._heap[0][1]

    def pop(self) -> None:
        """Take the head (as `head` left it) off the queue."""
        request = heapq.heappop(self._heap)[1]
        self.num_queued -= 1
        self.num_swapped -= request.status is RequestStatus.SWAPPED

    def discard(self, request: Request) -> None:
        """A queued request finishes: it stops counting, its entry is skipped when it surfaces."""
        self.num_queued -= 1
        self.num_swapped -= request.status is RequestStatus.SWAPPED

    def expired(self, now: float) -> list[Request]:
        """Unfinished requests whose deadline is at or before `now`."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]
            if request.status is not RequestStatus.FINISHED:
                due.append(request)
        return due

    def num_ahead(self, request: Request) -> int:
        """Queued requests ahead of `request` in the queue's order (O(queued))."""
        return sum(1 for key, r in self._heap if r.status in QUEUED and key < request.queue_key)

    def tenants(self, priority: int) -> Counter[str]:
        """Queued interactive requests of `priority` by tenant."""
        return Counter(r.tenant for _, r in self._heap if r.status in QUEUED and not r.batch and r.priority == priority)

    def census(self) -> tuple[Counter[int], Counter[int], float | None]:
        """Waiting and swapped-out requests by priority, and the oldest arrival among them."""
        waiting: Counter[int] = Counter()
        swapped: Counter[int] = Counter()
        oldest = None
        for _, request in self._heap:
            if request.status not in QUEUED:
                continue  # finished while queued, dropped lazily
            (swapped if request.status is RequestStatus.SWAPPED else waiting)[request.priority] += 1
            if oldest is None or request.arrival_time < oldest:
                oldest = request.arrival_time
        return waiting, swapped, oldest
