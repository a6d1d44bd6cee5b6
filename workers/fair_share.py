"""Fair preemption (`SchedulerConfig.fair_preempt_after_s`): tenants share a worker by
the tokens it served them lately.

The fair queue orders tenants' jobs fairly, but a tenant that arrives after a flood still
waits for the flood's running requests to end: nothing frees a slot sooner. Here each
tenant's service is counted in tokens computed for it (prompt and output), decaying by e
every `SERVICE_TAU_S` seconds, so its share is judged on the last half minute or so, not
on all time. A request whose tenant was served less lately than another tenant of its
priority with work here (`below_share`, judged on arrival) queues ahead of other
interactive requests (`Request.fair`); once it has waited the bound for a running slot
or KV blocks, it swaps out a running request of the most-served such tenant (`victim`).
The swapped request keeps its progress and never preempts in turn (it was not `fair`).
A tenant keeps taking slots while it has been served less lately, so a late tenant's few
jobs all run at once, while the flood that was served for many seconds waits.
"""

from __future__ import annotations

import math
import time

from workers.plan import StepPlan
from workers.preemption import swap_victim
from workers.request import Request
from workers.request_queue import RequestQueue

# Service decays by e in this many seconds.
SERVICE_TAU_S = 10.0


class FairShare:
    def __init__(self, bound_s: float, tau_s: float = SERVICE_TAU_S, clock=time.perf_counter) -> None:
        self.bound_s = bound_s
        self.tau_s = tau_s
        self.clock = clock
        self._service: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when counted)

    def served(self, tenant: str) -> float:
        """The tokens computed for `tenant` lately (decayed to now)."""
        tokens, at = self._service.get(tenant, (0.0, 0.0))
        return tokens * math.exp(-(self.clock() - at) / self.tau_s) if tokens else 0.0

    def charge(self, plan: StepPlan) -> None:
        """Count the tokens a planned step computes, to each request's tenant."""
        now, tokens = self.clock(), dict[str, int]()
        for chunk in plan.chunks:
            tenant = chunk.request.tenant
            tokens[tenant] = tokens.get(tenant, 0) + len(chunk.token_ids)
        for tenant, count in tokens.items():
            self._service[tenant] = (self.served(tenant) + count, now)

    def below_share(self, request: Request, running: list[Request], queue: RequestQueue) -> bool:
        """Whether `request` (interactive, of a tenant) was served less lately than another
        tenant with requests of its priority here, running or queued."""
        if request.batch or not request.tenant:
            return False
        others = set(queue.tenants(request.priority)) | {r.tenant for r in _peers(running, request)}
        others.discard(request.tenant)
        mine = self.served(request.tenant)
        return any(self.served(tenant) > mine for tenant in others)

    def victim(self, running: list[Request], request: Request, step: int) -> Request | None:
        """The running request to swap out for `request`, a `fair` one waiting for room:
        past the bound, one of the tenant served most lately among those running requests
        of its priority (as `swap_victim` picks it), if that tenant was served more than
        `request`'s; else None."""
        if not request.fair or self.clock() - request.arrival_time < self.bound_s:
            return None
        peers = [r for r in _peers(running, request) if r.tenant != request.tenant]
        if not peers:
            return None
        top = max({r.tenant for r in peers}, key=self.served)
        if self.served(top) <= self.served(request.tenant):
            return None
        return swap_victim([r for r in peers if r.tenant == top], step, by_predicted_length=False)


def _peers(running: list[Request], request: Request) -> list[Request]:
    """The running interactive requests of `request`'s priority."""
    return [r for r in running if not r.batch and r.priority == request.priority]
