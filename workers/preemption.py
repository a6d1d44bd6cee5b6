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

Fair preemption, a tenant below its share swapping out the most-served tenant's running
request, is `workers/fair_share.py`'s.
"""

from __future__ import annotations

from workers.request import Request


def swap_victim(running: list[Request], step: int, by_predicted_length: bool) -> Request:
    """The request to swap out to the host tier; `step` is the scheduler's step number."""
    if by_predicted_length:
        return max(running, key=lambda r: (r.batch, -r.priority, r.predicted_remaining, r.queue_key))
    return max(running, key=lambda r: (r.batch, -r.priority, step - r.running_since_step, r.queue_key))


def recompute_victim(running: list[Request]) -> Request:
    """The request to drop and compute again from its start."""
    return max(running, key=lambda r: (r.batch, -r.priority, r.queue_key))
