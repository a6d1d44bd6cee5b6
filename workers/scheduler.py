"""Iteration-level scheduler: which tokens of which requests run in the next step.

The policy: the step's budgets, who starts from the queue (`workers/request_queue.py`,
priority with aging), who is preempted and when parallel choices fork. How many draft
tokens a request may verify is the draft planner's (`workers/draft_planner.py`); which
blocks a request holds, the prefix cache and the copies between tiers are the KV-cache
manager's (`workers/kv_cache.py`), asked in tokens and blocks. Plain Python; it never
touches a tensor, so a simulated runner can drive it in tests.

**Each step** (`schedule`): decodes first (`_plan_decodes`), then prompt chunks and the
queue's head (`_plan_prefills`), then drafts with what is left (`DraftPlanner.plan`). KV
blocks are allocated as tokens are scheduled, never reserved for max_tokens up front;
when a decode finds none free, a running request is preempted (`_preempt_one`).

**Batch jobs** (`Request.batch`) run only on capacity interactive requests leave free:
they queue behind every interactive request, are the first victims of any preemption,
and are preempted as soon as an interactive request lacks a running slot or KV blocks
to start or to go on with its prompt (`_make_room_for`). A batch request never
preempts an interactive one. Under fair preemption a tenant below its share takes the
most-served tenant's running slot once it has waited long enough (`workers/fair_share.py`).

**After the step** the scheduler owns what changed: `update_from_output` moves each
chunk's request past the tokens it ran, appends the sampled tokens (after any accepted
drafts), and retires the requests that reached a stop token or max_tokens. The engine
retires the rest through `finish` (stop strings, cancels, deadlines, a failed step).
"""

from __future__ import annotations

import itertools
from collections import Counter

from workers.adapter_batching import adapter_fits, group_by_adapter
from workers.api import FinishReason
from workers.block_pool import BlockPool
from workers.config import SchedulerConfig, SpeculativeConfig
from workers.draft_planner import DraftPlanner
from workers.fair_share import FairShare
from workers.finish_forecast import steps_to_finish
from workers.kv_cache import KVCacheManager
from workers.length_predictor import LengthPredictor, OracleLengths, head_start_s
from workers.plan import CacheStats, Census, ScheduledChunk, StepPlan
from workers.preemption import recompute_victim, swap_victim
from workers.request import Request, RequestStatus
from workers.request_queue import QUEUED, RequestQueue
from workers.speculative import Proposer

# The weight of each new step in the recent mean step time (an exponential average).
STEP_TIME_WEIGHT = 0.1


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockPool,
        block_size: int,
        host_allocator: BlockPool | None = None,
        cache_salt: bytes | None = None,
        speculative: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
        length_predictor: LengthPredictor | OracleLengths | None = None,
        windows: tuple[int | None, ...] = (None,),
        max_loras: int | None = None,  # adapters running at once (None: multi-LoRA off; workers/adapter_batching.py)
    ) -> None:
        """The device pool `allocator` and `host_allocator` (None: preemption recomputes) and the KV groups'
        `windows` (`gpu.kv_layout`) are the KV-cache manager's; `cache_salt` (None: no prefix caching) names what
        else changes K/V; `speculative` (enabled) drafts with `proposer` (default: prompt lookup); `length_predictor`
        (None: FIFO within a priority) orders the queue by predicted length and swaps the longest remainder."""
        self.config, self.max_loras = config, max_loras
        self.length_predictor = length_predictor
        self.kv_cache = KVCacheManager(allocator, block_size, host_allocator, cache_salt, windows)
        self.drafts = None  # speculation off
        if speculative is not None and speculative.enabled:
            self.drafts = DraftPlanner(speculative, self.kv_cache, proposer)
        self.running: list[Request] = []  # in the order they (re)started
        self.queue = RequestQueue(config.priority_bound_s)
        self.fair_share = FairShare(config.fair_preempt_after_s) if config.fair_preempt_after_s > 0 else None
        self._step = 0
        self._step_s: float | None = None  # recent mean step time

    @property
    def allocator(self) -> BlockPool:
        """The device block pool (to observe: the KV-cache manager changes it)."""
        return self.kv_cache.device_pool

    @property
    def host_allocator(self) -> BlockPool | None:
        return self.kv_cache.host_pool

    # -- requests in and out ---------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request (with its `forks`, the other choices of a request with n > 1)."""
        if not self.kv_cache.fits(request.num_prompt_tokens + request.params.max_tokens):
            # It could never run alone, and preempting others would not help.
            raise ValueError(f"request {request.request_id} needs more KV blocks than the pool has")
        if 1 + len(request.forks) > self.config.max_running_requests:
            raise ValueError(f"request {request.request_id} has more choices than max_running_requests")
        if self.drafts is not None:
            for choice in (request, *request.forks):
                self.drafts.enroll(choice)
        head_start = 0.0
        if self.length_predictor is not None:
            predicted = min(self.length_predictor.predict(request.prompt_token_ids), request.params.max_tokens)
            for choice in (request, *request.forks):
                choice.predicted_output_len = predicted
            head_start = head_start_s(max(1.0, predicted - len(request.output_token_ids)), self.config.length_bound_s)
        request.fair = self.fair_share is not None and self.fair_share.below_share(request, self.running, self.queue)
        self.queue.place(request, head_start_s=head_start)
        self.queue.push(request, RequestStatus.WAITING)

    def finish(self, request: Request, reason: FinishReason, num_output_tokens: int | None = None) -> None:
        """Retire a request (finished, cancelled, expired or failed); free all its blocks at once.
        `num_output_tokens`: it ends after that many output tokens (a stop string found
        among the tokens one verified step took); the later ones are dropped."""
        if num_output_tokens is not None:
            del request.output_token_ids[num_output_tokens:]
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.FORKING:
            pass  # holds nothing yet; its lead skips it
        elif request.status in QUEUED:
            self.queue.discard(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def expired(self, now: float) -> list[Request]:
        """Unfinished requests whose deadline is at or before `now` (the caller retires them)."""
        return self.queue.expired(now)

    def swaps_done(self, plan: StepPlan, copied: bool = True) -> None:
        """The runner has made the plan's copies (or failed to: `copied` False)."""
        self.kv_cache.copies_done(plan, copied)

    def cache_stats(self) -> CacheStats:
        """The prefix cache's figures for the last step planned."""
        return self.kv_cache.stats()

    def update_from_output(
        self, plan: StepPlan, sampled_token_ids: list[int], num_accepted: list[int] | None = None
    ) -> list[Request]:
        """The step ran `plan`: its chunks' K/V are cached now, and `sampled_token_ids`
        holds one token per sampling chunk, in plan order; `num_accepted` (same order) how
        many of each chunk's drafts were accepted: the sampled token follows those.
        Moves each request on and retires those that reached a stop token or max_tokens
        (`finish_reason` set). Returns the requests that took tokens, in plan order."""
        chunks = plan.chunks
        if sum(chunk.samples for chunk in chunks) != len(sampled_token_ids):
            raise ValueError(f"{sum(c.samples for c in chunks)} chunks sample, got {len(sampled_token_ids)} tokens")
        kv_cache = self.kv_cache
        caching, block_size = kv_cache.cache_salt is not None, kv_cache.block_size
        sampled = iter(zip(sampled_token_ids, num_accepted or itertools.repeat(0)))
        took = []
        for chunk in chunks:  # one pass: this runs for every request every step
            request = chunk.request
            if not chunk.drafts:  # a verified chunk moves on by what was accepted, below
                start = request.num_computed
                end = start + len(chunk.token_ids)
                if caching and end // block_size > start // block_size:  # it filled a block
                    kv_cache.register_full_blocks(request, start, end)
                request.num_computed = end
            if not chunk.samples:
                continue
            token_id, accepted = next(sampled)
            took.append(request)
            if chunk.drafts and self.drafts is not None and not self.drafts.settle(chunk, accepted, self._step):
                self.finish(request, FinishReason.STOP)  # an accepted draft was a stop token
                continue
            if request.forks:
                self._fork(request)
            request.output_token_ids.append(token_id)
            if token_id in request.stop_token_ids:
                self.finish(request, FinishReason.STOP)
            elif len(request.output_token_ids) >= request.params.max_tokens:
                self.finish(request, FinishReason.LENGTH)
            elif request.hands_off:
                kv_cache.register_prompt_tail(request)  # staged with the full blocks
                self.finish(request, FinishReason.HANDOFF)
        return took

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` tokens took `seconds`: what decides whether drafts pay,
        and the step time deadlines are estimated with."""
        if self.drafts is not None:
            self.drafts.observe_step(num_tokens, seconds)
        self._step_s = seconds if self._step_s is None else self._step_s + STEP_TIME_WEIGHT * (seconds - self._step_s)

    def predicted_finish_s(self, request: Request) -> float | None:
        """Seconds until queued `request` is predicted to finish (`workers/finish_forecast.py`),
        at the recent mean step time; None without a length predictor or a measured step."""
        if self.length_predictor is None or self._step_s is None or request.predicted_output_len is None:
            return None
        free_slots = self.config.max_running_requests - self._occupied()
        steps = steps_to_finish(request, self.config, self.queue.num_ahead(request), free_slots, self.running)
        return steps * self._step_s

    def has_unfinished(self) -> bool:
        return bool(self.queue.num_queued or self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, swapped-out ones included."""
        return self.queue.num_queued

    @property
    def num_swapped(self) -> int:
        return self.queue.num_swapped

    def census(self) -> Census:
        """Counts by state and priority; O(running + queued), so call it once a step at most."""
        running = Counter(r.priority for r in self.running)
        waiting, swapped, oldest = self.queue.census()
        return Census(dict(running), dict(waiting), dict(swapped), oldest)

    # -- the step plan -------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._step += 1
        self.kv_cache.start_step()
        plan = StepPlan()
        while True:
            self._plan_decodes(plan)
            self._plan_prefills(plan)
            if plan.chunks or not self.running:
                break
            # Every running request is stuck mid-prompt with no free block: preempt a
            # victim so the others can go on, and plan again.
            self._preempt_one(plan)
        if self.drafts is not None:
            room = min(self._decode_cap - plan.num_decode_tokens, self.config.max_batch_tokens - plan.num_tokens)
            self.drafts.plan(plan, room, len(self.running), self._step)
        self.kv_cache.plan_offloads(plan)
        if self.fair_share is not None:  # what each tenant is served, for fair preemption
            self.fair_share.charge(plan)
        group_by_adapter(plan, self.max_loras)
        return plan

    def _plan_decodes(self, plan: StepPlan) -> None:
        """1. Every decoding request gets one token, up to `max_decode_tokens` (best queue
        key first), preempting victims when blocks run out."""
        decoding = [r for r in self.running if r.is_decoding]
        cap = self._decode_cap
        if len(decoding) > cap:
            decoding = sorted(decoding, key=lambda r: r.queue_key)[:cap]
        kv_cache = self.kv_cache
        for request in decoding:
            if request.status is not RequestStatus.RUNNING:
                continue
            if kv_cache.writes_in_place(request) or self._grow(request, request.num_computed + 1, plan):
                plan.chunks.append(ScheduledChunk.decode(request))

    def _plan_prefills(self, plan: StepPlan) -> None:
        """2. Prompt chunks, under `min(max_prefill_tokens, what the decodes left of
        max_batch_tokens)`, at most `max_prefill_chunk` per request: running requests
        part-way through their prompt, then the queue's head (swapped back in, all its
        blocks at once, or admitted after its cached prefix) while the running limit and
        free blocks allow. The queue is strict: if its head cannot start, nothing behind
        it does, so a large request is never starved by small ones; nor is one swapped
        back in during the step that swapped it out. Interactive prompts first, then
        batch ones with what is left (at most `max_batch_prefill_tokens` beside
        interactive requests); `_make_room_for` preempts for a request short of room.
        """
        config = self.config
        budget = min(config.max_prefill_tokens, config.max_batch_tokens - len(plan.chunks))
        budget = self._continue_prompts(plan, budget, batch=False)
        budget = self._start_queued(plan, budget, batch=False)
        if config.max_batch_prefill_tokens and any(not chunk.request.batch for chunk in plan.chunks):
            budget = min(budget, config.max_batch_prefill_tokens)
        budget = self._continue_prompts(plan, budget, batch=True)
        self._start_queued(plan, budget, batch=True)

    def _continue_prompts(self, plan: StepPlan, budget: int, batch: bool) -> int:
        """Running requests of the class part-way through their prompt take their next
        chunk; returns the budget left."""
        for request in list(self.running):  # a copy: batch requests may be preempted meanwhile
            if budget == 0:
                break
            if request.batch == batch and request.status is RequestStatus.RUNNING and not request.is_decoding:
                while self.kv_cache.room(request) == 0 and self._make_room_for(request, plan):
                    pass  # no block to write into: an interactive prompt takes batch requests' blocks
                budget -= self._add_prefill_chunk(request, budget, plan)
        return budget

    def _start_queued(self, plan: StepPlan, budget: int, batch: bool) -> int:
        """The queue's head starts while it fits (interactive heads only, unless `batch`);
        returns the budget left."""
        config = self.config
        num_decodes = sum(chunk.is_decode for chunk in plan.chunks)
        while self.queue.num_queued:
            request = self.queue.head()
            if request.batch and (not batch or self._batch_full()):
                break  # batch jobs queue behind every interactive one, and within their own cap
            if request in plan.preempted or not adapter_fits(request, self.running, self.max_loras):
                break  # never back in the step that preempted it; an adapter waits for a slot in its place
            if self._occupied() + 1 + self._num_forking(request) > self._running_limit(request):
                if self._make_room_for(request, plan):
                    continue
                break  # a lead starts only with room for the choices that will fork from it
            if request.status is RequestStatus.SWAPPED:
                # Back in only with room for its next token, so it runs this step.
                if not self.kv_cache.can_resume(request):
                    if self._make_room_for(request, plan):
                        continue
                    break
                if request.is_decoding:
                    if num_decodes == self._decode_cap or plan.num_tokens == config.max_batch_tokens:
                        break
                    self.queue.pop()
                    self._swap_in(request, plan)
                    self._grow(request, request.num_computed + 1, plan, may_preempt=False)
                    plan.chunks.append(ScheduledChunk.decode(request))
                    num_decodes += 1
                    budget = min(budget, config.max_batch_tokens - plan.num_tokens)
                    continue
                if budget == 0:
                    break
                self.queue.pop()
                self._swap_in(request, plan)
                budget -= self._add_prefill_chunk(request, budget, plan)
                continue
            if budget == 0:
                break  # keep the queue's order, wait
            if not self._admit(request, budget, plan):
                if self._make_room_for(request, plan):
                    continue
                break  # no blocks: keep the queue's order, wait
            budget -= self._add_prefill_chunk(request, budget, plan)
        return budget

    def _admit(self, request: Request, budget: int, plan: StepPlan) -> bool:
        """Start the queue's head (a waiting request) after its longest cached prefix, if
        its first chunk then fits in the free blocks; else change nothing and say False."""
        prefix = self.kv_cache.find_prefix(request)
        remaining = request.num_tokens - prefix.num_tokens
        if min(remaining, budget, self.config.max_prefill_chunk, prefix.free_tokens) == 0:
            return False
        self.queue.pop()
        self.kv_cache.take_prefix(request, prefix, plan)
        request.num_computed = prefix.num_tokens
        self._start_running(request)
        return True

    # -- parallel sampling -----------------------------------------------------------

    def _fork(self, lead: Request) -> None:
        """Parallel sampling: a request with n choices is one `Request` per choice. The
        first (the lead) is queued and computes the prompt, admitted only when the running
        set has room for all its choices; the others wait (FORKING) until it samples its
        first token, here. Then they start running beside it holding the prompt's blocks,
        each with the prompt's last token (and any output of its own, after a takeover)
        left to compute, for logits of its own (in a copy of the block that token lies in:
        copy on write)."""
        for fork in lead.forks:
            if fork.status is not RequestStatus.FORKING:
                continue  # ended already
            self.kv_cache.share_prompt(lead, fork)
            fork.num_computed = lead.num_prompt_tokens - 1
            self.queue.place(fork, beside=lead)
            fork.scheduled_time = lead.scheduled_time
            self._start_running(fork)
        lead.forks = []

    @staticmethod
    def _num_forking(lead: Request) -> int:
        return sum(1 for fork in lead.forks if fork.status is RequestStatus.FORKING)

    def _occupied(self) -> int:
        """Running requests, and the choices still to fork from them: their room is taken."""
        return len(self.running) + sum(self._num_forking(r) for r in self.running if r.forks)

    # -- helpers -------------------------------------------------------------------

    def _running_limit(self, request: Request) -> int:
        """Most requests running once `request` starts (a taken-over one: the allowance too)."""
        allowance = self.config.takeover_allowance if request.takeover and not request.batch else 0
        return self.config.max_running_requests + allowance

    def _batch_full(self) -> bool:
        return 0 < self.config.max_running_batch <= sum(r.batch for r in self.running)

    @property
    def _decode_cap(self) -> int:
        return min(self.config.max_decode_tokens, self.config.max_batch_tokens)

    def _largest_chunk(self, request: Request, budget: int) -> int:
        """The longest prompt chunk of `request` that the budget and the free blocks allow."""
        remaining = request.num_tokens - request.num_computed
        return min(remaining, budget, self.config.max_prefill_chunk, self.kv_cache.room(request))

    def _add_prefill_chunk(self, request: Request, budget: int, plan: StepPlan) -> int:
        """Plan (and allocate blocks for) the largest chunk that fits; return its length."""
        n = self._largest_chunk(request, budget)
        if n:
            self.kv_cache.allocate(request, request.num_computed + n, plan)
            plan.chunks.append(ScheduledChunk.prefill(request, n))
        return n

    def _grow(self, request: Request, num_tokens: int, plan: StepPlan, may_preempt: bool = True) -> bool:
        """Give `request` blocks for `num_tokens` tokens, preempting victims if allowed;
        False if it could not (not allowed, or `request` was itself the victim)."""
        while not self.kv_cache.allocate(request, num_tokens, plan):
            if not may_preempt or self._preempt_one(plan) is request:
                return False
        return True

    def _make_room_for(self, request: Request, plan: StepPlan) -> bool:
        """Preempt a running request to give `request` its slot or blocks, and say whether one went: a
        batch one for an interactive `request`, else, under fair preemption, the most-served tenant's."""
        if not request.batch and any(r.batch for r in self.running):
            self._preempt_one(plan)  # batch requests go first
            return True
        victim = None if self.fair_share is None else self.fair_share.victim(self.running, request, self._step)
        if victim is None or not self.kv_cache.swap_out(victim, plan):
            return False
        self._remove_running(victim, plan)
        self.queue.push(victim, RequestStatus.SWAPPED)  # behind `request`: its class comes first
        return True

    def _preempt_one(self, plan: StepPlan) -> Request:
        """Preempt a running request (the victim `workers/preemption.py` picks) and return
        it; it goes back to the queue under its original key, keeping its place: swapped
        out when the host tier has room, else to be recomputed."""
        victim = swap_victim(self.running, self._step, by_predicted_length=self.length_predictor is not None)
        if self.kv_cache.swap_out(victim, plan):
            self._remove_running(victim, plan)
            self.queue.push(victim, RequestStatus.SWAPPED)
            return victim
        victim = recompute_victim(self.running)
        self._remove_running(victim, plan)
        victim.num_computed = 0  # recompute prompt + outputs when it runs again
        self.queue.push(victim, RequestStatus.WAITING)
        return victim

    def _remove_running(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        plan.chunks = [c for c in plan.chunks if c.request is not victim]
        plan.preempted.append(victim)
        self.kv_cache.release(victim, plan)

    def _swap_in(self, request: Request, plan: StepPlan) -> None:
        self.kv_cache.swap_in(request, plan)
        plan.resumed.append(request)
        self._start_running(request)

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.running_since_step = self._step
        self.running.append(request)
