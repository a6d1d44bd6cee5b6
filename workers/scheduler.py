"""Iteration-level scheduler: which tokens of which requests run in the next step.

Plain Python over token counts and block ids; it never touches a tensor, so it can be
driven by a simulated runner in tests.

Each step:
1. every running request that is decoding gets its one token (decodes go first, so a
   wave of new prompts cannot stall users already receiving tokens);
2. running requests still in prefill get their next chunk;
3. waiting requests are admitted first come, first served, while the token budget,
   the running cap and free KV blocks allow.

KV blocks are allocated as tokens are scheduled, never reserved for max_tokens up
front. When a decode cannot get a block, the most recently admitted request is
preempted: its blocks are freed and it goes back to the head of the queue to be
recomputed (prompt plus the tokens it already produced). Swapping to host memory
instead is a later step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from service.config import SchedulerConfig
from workers.block_manager import BlockAllocator, blocks_needed
from workers.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, from position `start`, run in this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.request.is_decoding


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    # -- queue changes -------------------------------------------------------------

    def add(self, request: Request) -> None:
        most = request.num_prompt_tokens + request.params.max_tokens
        if blocks_needed(most, self.block_size) > self.allocator.num_blocks:
            # It could never run alone, and preempting others would not help.
            raise ValueError(f"request {request.request_id} needs more KV blocks than the pool has")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Retire a request (finished, cancelled or failed) and free its blocks at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step plan -------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # 1. Decodes first; preempt from the back of the running list when blocks run out.
        for request in list(self.running):
            if len(plan.chunks) == self.config.max_batch_tokens:  # so far every chunk is one token
                break
            if request.status is RequestStatus.RUNNING and request.is_decoding:
                if self._grow_or_preempt(request, plan):
                    plan.chunks.append(ScheduledChunk(request, request.num_computed, 1))
        budget = self.config.max_batch_tokens - plan.num_tokens

        # 2. Running requests part-way through their prompt take their next chunk.
        for request in self.running:
            if budget == 0:
                break
            if not request.is_decoding:
                n = self._chunk_that_fits(request, budget)
                if n:
                    plan.chunks.append(ScheduledChunk(request, request.num_computed, n))
                    budget -= n

        # 3. Admit waiting requests, first come first served.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            n = self._chunk_that_fits(request, budget)
            if n == 0:
                break  # out of blocks: keep FCFS order, wait for blocks to free up
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.chunks.append(ScheduledChunk(request, request.num_computed, n))
            budget -= n

        if not plan.chunks and self.running:
            # Every running request is stuck mid-prompt with no free block: give the
            # newest one's blocks to the others and try again.
            self._preempt(self.running[-1], plan)
            retry = self.schedule()
            retry.preempted[:0] = plan.preempted
            return retry
        return plan

    # -- helpers -------------------------------------------------------------------

    def _chunk_that_fits(self, request: Request, budget: int) -> int:
        """Allocate blocks for the largest prefill chunk that fits; return its length."""
        remaining = request.num_tokens - request.num_computed
        n = min(remaining, budget, self.config.max_prefill_chunk)
        have = len(request.block_ids) * self.block_size - request.num_computed
        n = min(n, have + self.allocator.num_free * self.block_size)
        if n > 0:
            self._allocate(request, request.num_computed + n)
        return max(n, 0)

    def _grow_or_preempt(self, request: Request, plan: StepPlan) -> bool:
        """Make room for one more token of `request`, preempting later requests if needed.

        Returns False if `request` itself had to be preempted.
        """
        need = blocks_needed(request.num_computed + 1, self.block_size) - len(request.block_ids)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        self._allocate(request, request.num_computed + 1)
        return True

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        plan.chunks = [c for c in plan.chunks if c.request is not victim]
        self._release(victim)
        victim.num_computed = 0  # recompute prompt + outputs when readmitted
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)

    def _allocate(self, request: Request, num_tokens: int) -> None:
        for _ in range(blocks_needed(num_tokens, self.block_size) - len(request.block_ids)):
            request.block_ids.append(self.allocator.allocate())

    def _release(self, request: Request) -> None:
        if request.block_ids:
            self.allocator.free(request.block_ids)
            request.block_ids = []
