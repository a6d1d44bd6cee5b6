"""The preemption policy: which running request gives up its blocks when a step runs
short of them (`Scheduler._preempt_one` carries it out). Batch requests are always the
first victims.

- Swapped out, when the host tier has room (`swap_victim`): the request with the lowest
  priority, and among those the one that has run the most steps since it last started
  (so long generations take turns with memory and short requests keep flowing), then
  the latest in queue order; under a length policy, the one with the longest predicted
  remainder instead of the most steps. Its progress is kept.
- Else recomputed (`recompute_victim`: prompt plus the tokens it produced, when it runs
  again): the lowest priority, then the latest in queue order. Taking the last in queue
  order means the first always progresses, so recomputation cannot livelock.

Fair preemption (`SchedulerConfig.fair_preempt_after_s`): the fair queue orders tenants'
jobs fairly, but a tenant arriving after a flood still waits for the flood's running
requests to end. A request whose tenant runs at least two fewer requests here than
another tenant of its priority (`below_share`, judged on arrival) queues ahead of other
interactive requests; once it has waited the bound for room, it swaps out a request of
the tenant that runs the most (`fair_victim`). Two fewer, so a swap never just turns the
tables: the tenants' counts converge to equal shares and stop there.
"""

from __future__ import annotations

from collections import Counter

from workers.request import Request
from workers.request_queue import RequestQueue


def swap_victim(running: list[Request], step: int, by_predicted_length: bool) -> Request:
    """The request to swap out to the host tier; `step` is the scheduler's step number."""
    if by_predicted_length:
        return max(running, key=lambda r: (r.batch, -r.priority, r.predicted_remaining, r.queue_key))
    return max(running, key=lambda r: (r.batch, -r.priority, step - r.running_since_step, r.queue_key))


def recompute_victim(running: list[Request]) -> Request:
    """The request to drop and compute again from its start."""
    return max(running, key=lambda r: (r.batch, -r.priority, r.queue_key))


def below_share(request: Request, running: list[Request], queue: RequestQueue) -> bool:
    """Whether `request` (interactive, of a tenant) is of a tenant that runs or queues at
    least two fewer requests of its priority than another tenant does."""
    if request.batch or not request.tenant:
        return False
    counts = queue.tenants(request.priority)
    counts.update(r.tenant for r in running if not r.batch and r.priority == request.priority)
    return max(counts.values(), default=0) >= counts[request.tenant] + 2


def fair_victim(running: list[Request], request: Request, step: int, now: float, bound_s: float) -> Request | None:
    """The running request to swap out for `request` (a `fair` one, waiting for room at
    `now`, perf_counter), as `swap_victim` picks among the requests of the tenant that runs
    the most of `request`'s priority, if that is two more than `request`'s tenant runs;
    None before the bound, or when no tenant runs that many more."""
    if not request.fair or bound_s <= 0 or now - request.arrival_time < bound_s:
        return None
    peers = [r for r in running if not r.batch and r.priority == request.priority]
    counts = Counter(r.tenant for r in peers)
    top, most = max(counts.items(), key=lambda item: item[1], default=("", 0))
    if most < counts[request.tenant] + 2:
        return None
    return swap_victim([r for r in peers if r.tenant == top], step, by_predicted_length=False)
