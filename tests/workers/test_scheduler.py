"""The scheduler, driven by a simulated model: no model, no tensors.

The simulated model stands in for the runner and the sampler only: it keeps a fake KV
cache and samples a fixed token. Every device and host block holds, at each offset, a
tag of the K/V written there: the position and every token up to it (a real K/V depends
on the whole prefix), and the plan's copies (swaps, the prefix cache's offloads and
fetches) copy those tags. Everything else is the scheduler's own code: `schedule` plans,
`update_from_output` moves requests on and retires them. So the tests see whether a
request's context survives preemption, swapping and prefix sharing, not only whether
the block counts add up.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from workers.api import PRIORITY_MAX, PRIORITY_MIN, FinishReason, SamplingParams
from workers.block_pool import BlockPool, block_hash, blocks_needed
from workers.config import SchedulerConfig
from workers.plan import StepPlan
from workers.request import Request, RequestStatus
from workers.scheduler import Scheduler

BLOCK = 4


SALT = b"fake model|float32"


def make(num_blocks=64, host_blocks=0, cache_salt=None, **config) -> Scheduler:
    host = BlockPool(host_blocks) if host_blocks else None
    return Scheduler(SchedulerConfig(**config), BlockPool(num_blocks), BLOCK, host, cache_salt)


SAMPLED = 7  # the token the simulated model always samples
EOS = 2


def request(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float = 0.0,
    deadline: float | None = None,
    stop_token_ids: frozenset[int] = frozenset({EOS}),
) -> Request:
    return Request(
        rid,
        list(range(10, prompt_len + 10)),
        SamplingParams(max_tokens=max_tokens),
        arrival,
        priority,
        deadline,
        stop_token_ids=stop_token_ids,
    )


def chain_address(tokens, salt: bytes = SALT) -> bytes:
    """The content address of the full block that ends `tokens`."""
    parent = b""
    for start in range(0, len(tokens), BLOCK):
        parent = block_hash(parent, list(tokens[start : start + BLOCK]), salt)
    return parent


class FakeRunner:
    """Runs plans against a fake KV cache of tags, samples SAMPLED for every chunk that
    samples, and hands the output to the scheduler, as the engine does. It checks what a
    real runner would get wrong silently: a chunk whose cached context is not its own
    tokens' K/V, a write into a block someone else holds or that is cached under an
    address, and copies that name a host block twice."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # block -> {offset: (position, tokens[0 : position + 1])}
        self.device: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}
        self.host: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}

    def step(self, plan: StepPlan) -> list[Request]:
        """Copy, check each chunk's cached context, write its tokens, sample; returns the
        requests the scheduler retired."""
        host_blocks = [h for _, h in plan.copies_out] + [h for h, _ in plan.copies_in]
        assert len(host_blocks) == len(set(host_blocks)), f"a host block copied twice in one plan: {plan}"
        targets = [d for _, d in plan.copies_in]
        assert len(targets) == len(set(targets)), f"a device block written twice by copies: {plan}"
        # Device to host first, then host to device, each from the state before it.
        outgoing = {d: dict(self.device.get(d, {})) for d, _ in plan.copies_out}
        for d, h in plan.copies_out:
            self.host[h] = dict(outgoing[d])
        # Then copies on write, device to device.
        assert len({d for _, d in plan.copies}) == len(plan.copies), f"a block written twice by copies: {plan}"
        originals = {src: dict(self.device.get(src, {})) for src, _ in plan.copies}
        for src, dst in plan.copies:
            self.device[dst] = dict(originals[src])
        incoming = {h: dict(self.host.get(h, {})) for h, _ in plan.copies_in}
        for h, d in plan.copies_in:
            self.device[d] = dict(incoming[h])
        self.check_registered_blocks()
        self.scheduler.swaps_done(plan)
        pool = self.scheduler.allocator
        for chunk in plan.chunks:
            request, blocks = chunk.request, chunk.block_tables[0]
            rid = request.request_id
            for pos in range(chunk.start):  # everything before the chunk must be cached, intact
                got = self.device.get(blocks[pos // BLOCK], {}).get(pos % BLOCK)
                assert got == (pos, tuple(request.token_slice(0, pos + 1))), f"{rid} lost position {pos}: {got}"
            end = chunk.start + chunk.num_tokens
            for index in range(chunk.start // BLOCK, blocks_needed(end, BLOCK)):
                block = blocks[index]
                assert pool.holders(block) == 1, f"{rid} writes block {block}, held by {pool.holders(block)}"
                assert pool.address(block) is None, f"{rid} writes block {block}, cached under an address"
            known = end - len(chunk.drafts)  # drafts are not the request's tokens (yet)
            assert (
                tuple(request.token_slice(chunk.start, known))
                == chunk.token_ids[: chunk.num_tokens - len(chunk.drafts)]
            )
            context = tuple(request.token_slice(0, known)) + chunk.drafts
            for pos in range(chunk.start, end):
                self.device.setdefault(blocks[pos // BLOCK], {})[pos % BLOCK] = (pos, context[: pos + 1])
        took = self.scheduler.update_from_output(plan, *self.sample(plan))
        self.check_registered_blocks()
        return [r for r in took if r.status is RequestStatus.FINISHED]

    def sample(self, plan: StepPlan) -> tuple[list[int], list[int]]:
        """Each sampling chunk's token (always SAMPLED) and its accepted drafts (none)."""
        num_sampling = sum(1 for chunk in plan.chunks if chunk.samples)
        return [SAMPLED] * num_sampling, [0] * num_sampling

    def check_registered_blocks(self) -> None:
        """Every block registered under an address (device or host tier) holds the K/V
        of exactly the tokens that address names."""
        kv_cache = self.scheduler.kv_cache
        salt = kv_cache.cache_salt
        if salt is None:
            return
        tiers = [(kv_cache.device_pool, self.device)]
        if kv_cache.host_pool is not None:
            tiers.append((kv_cache.host_pool, self.host))
        for pool, blocks in tiers:
            for block in range(pool.num_blocks):
                at = pool.address(block)
                if at is None:
                    continue
                tags = blocks.get(block, {})
                assert sorted(tags) == list(range(BLOCK)), f"block {block} registered but not full: {tags}"
                last_pos, tokens = tags[BLOCK - 1]
                assert len(tokens) == last_pos + 1 and last_pos % BLOCK == BLOCK - 1
                assert all(
                    tags[i] == (last_pos - BLOCK + 1 + i, tokens[: last_pos - BLOCK + 2 + i]) for i in range(BLOCK)
                )
                assert chain_address(tokens, salt) == at, f"block {block} holds other tokens than its address names"


def end_cancelled_and_expired(s: Scheduler, cancelled: list[Request], now: float, ended: dict[str, str]) -> None:
    """Retire what the engine would before a step: the cancelled requests that have
    arrived and those past their deadline, every choice of each."""
    for lead in cancelled:
        for r in [lead, *lead.forks]:
            if r.status is not RequestStatus.FINISHED and r.arrival_time <= now:
                s.finish(r, FinishReason.CANCELLED)
                ended[r.request_id] = "cancelled"
    for expired in s.expired(now):
        for r in [expired, *expired.forks]:
            if r.status is not RequestStatus.FINISHED:
                s.finish(r, FinishReason.DEADLINE)
                ended[r.request_id] = "deadline"


def run(s: Scheduler, requests: list[Request], max_steps: int = 10_000) -> list[StepPlan]:
    runner = FakeRunner(s)
    for r in requests:
        s.add(r)
    plans = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return plans
        plan = s.schedule()
        plans.append(plan)
        runner.step(plan)
    raise AssertionError("requests did not finish")


def test_scheduler_never_imports_torch():
    code = "import workers.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_long_prompt_is_chunked_while_decodes_ride_along():
    s = make(max_batch_tokens=8, max_prefill_chunk=8)
    runner = FakeRunner(s)
    short = request("short", 3, max_tokens=10)
    s.add(short)
    runner.step(s.schedule())  # short's prompt, first token sampled
    s.add(request("long", 20))
    plans = []
    for _ in range(3):
        plan = s.schedule()
        plans.append([(c.request.request_id, c.num_tokens) for c in plan.chunks])
        runner.step(plan)
    # The decode goes first every step; the long prompt takes what is left of the budget.
    assert plans == [[("short", 1), ("long", 7)], [("short", 1), ("long", 7)], [("short", 1), ("long", 6)]]


def test_prefill_sub_budget_bounds_prompt_tokens_per_step_but_not_decodes():
    s = make(max_batch_tokens=64, max_prefill_tokens=5)
    runner = FakeRunner(s)
    decoders = [request(f"d{i}", 2, max_tokens=50) for i in range(3)]
    for r in decoders:
        s.add(r)
    runner.step(s.schedule())  # 6 prompt tokens > 5: the third prompt is split
    runner.step(s.schedule())
    for i in range(4):
        s.add(request(f"new{i}", 30))
    for _ in range(5):  # new0's prompt takes 6 steps at 5 tokens per step
        plan = s.schedule()
        decodes = [c for c in plan.chunks if c.is_decode]
        prefill = plan.num_tokens - len(decodes)
        assert {c.request.request_id for c in decodes} == {"d0", "d1", "d2"}
        assert prefill == 5
        runner.step(plan)


def test_decode_sub_budget_serves_the_best_queue_keys_first():
    s = make(max_decode_tokens=2)
    runner = FakeRunner(s)
    for rid, priority in (("low", -5), ("high", 5), ("mid", 0)):
        s.add(request(rid, 1, max_tokens=3, priority=priority))
    runner.step(s.schedule())  # all three prompts (one token each), first tokens sampled
    plan = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["high", "mid"]


def test_prefill_chunk_caps_one_request_per_step():
    s = make(max_batch_tokens=100, max_prefill_chunk=5)
    s.add(request("a", 12))
    s.add(request("b", 3))
    plan = s.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("a", 0, 5), ("b", 0, 3)]


def test_running_cap_holds_admission_back():
    s = make(max_running_requests=2)
    for i in range(4):
        s.add(request(f"r{i}", 2))
    plan = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["r0", "r1"]
    assert s.num_waiting == 2


def test_blocks_are_allocated_as_tokens_arrive_not_for_max_tokens():
    s = make()
    runner = FakeRunner(s)
    r = request("a", 5, max_tokens=100)
    s.add(r)
    runner.step(s.schedule())
    assert len(r.block_tables[0]) == blocks_needed(5, BLOCK)  # not blocks for 105 tokens
    for _ in range(3):
        runner.step(s.schedule())
    assert len(r.block_tables[0]) == blocks_needed(r.num_computed, BLOCK)


def test_a_request_larger_than_the_pool_is_refused():
    s = make(num_blocks=4)
    with pytest.raises(ValueError, match="more KV blocks"):
        s.add(request("huge", 10, max_tokens=7))  # 17 tokens > 4 blocks of 4


# -- priority and aging ----------------------------------------------------------------


def test_without_contention_higher_priority_starts_first_and_equal_priority_is_fifo():
    s = make(max_running_requests=1)
    priorities = [0, 3, -2, 3, 10, -10, 0]
    requests = [request(f"r{i}", 2, max_tokens=1, priority=p) for i, p in enumerate(priorities)]
    started = []
    for plan in run(s, requests):
        started += [c.request.request_id for c in plan.chunks if c.start == 0]
    assert started == ["r4", "r1", "r3", "r0", "r6", "r2", "r5"]


@settings(max_examples=100, deadline=None)
@given(priorities=st.lists(st.integers(PRIORITY_MIN, PRIORITY_MAX), min_size=1, max_size=20))
def test_without_contention_start_order_is_priority_then_arrival(priorities):
    s = make(max_running_requests=1)
    requests = [request(f"r{i}", 2, max_tokens=1, priority=p) for i, p in enumerate(priorities)]
    started = [c.request.request_id for plan in run(s, requests) for c in plan.chunks if c.start == 0]
    want = sorted(range(len(priorities)), key=lambda i: (-priorities[i], i))
    assert started == [f"r{i}" for i in want]


def test_aging_a_request_is_never_overtaken_by_one_arriving_more_than_the_bound_later():
    bound = 30.0
    s = make(max_running_requests=1, priority_bound_s=bound)
    old = request("old", 2, max_tokens=1, priority=PRIORITY_MIN, arrival=0.0)
    within = request("within", 2, max_tokens=1, priority=PRIORITY_MAX, arrival=bound - 1)
    later = request("later", 2, max_tokens=1, priority=PRIORITY_MAX, arrival=bound + 1)
    plans = run(s, [later, old, within])
    assert [c.request.request_id for plan in plans for c in plan.chunks if c.start == 0] == ["within", "old", "later"]


def test_a_sustained_stream_of_urgent_work_cannot_starve_a_low_priority_request():
    # One request runs at a time, one step per time unit; a new urgent request arrives
    # every step, so urgent work alone would keep the engine busy forever.
    bound = 20.0
    s = make(max_running_requests=1, priority_bound_s=bound)
    runner = FakeRunner(s)
    low = request("low", 1, max_tokens=1, priority=PRIORITY_MIN, arrival=0.0)
    s.add(low)
    for step in range(200):
        s.add(request(f"urgent{step}", 1, max_tokens=1, priority=PRIORITY_MAX, arrival=float(step)))
        runner.step(s.schedule())
        if low.status is RequestStatus.FINISHED:
            break
    # It ran once everything ahead of it arrived within `bound` of it.
    assert low.status is RequestStatus.FINISHED and step <= bound + 1


def test_deadlines_expire_queued_and_running_requests():
    s = make(max_running_requests=1)
    running = request("running", 2, max_tokens=50, deadline=5.0)
    queued = request("queued", 2, deadline=3.0)
    forever = request("forever", 2)
    for r in (running, queued, forever):
        s.add(r)
    FakeRunner(s).step(s.schedule())
    assert s.expired(2.9) == []
    assert s.expired(3.0) == [queued]
    s.finish(queued, FinishReason.DEADLINE)
    assert s.expired(10.0) == [running]
    s.finish(running, FinishReason.DEADLINE)
    assert s.expired(100.0) == []
    assert s.allocator.num_free == s.allocator.num_blocks
    assert s.num_waiting == 1 and not s.running
    assert run(s, [])[0].chunks[0].request is forever


# -- preemption and swapping -------------------------------------------------------------


def test_out_of_blocks_without_a_host_pool_recomputes_the_victim():
    s = make(num_blocks=8, max_batch_tokens=64)
    old, new = request("old", 7, max_tokens=20), request("new", 7, max_tokens=20, arrival=1.0)
    plans = run(s, [old, new])
    preempted = [r.request_id for p in plans for r in p.preempted]
    # Both started in the same step with equal priority: the later arrival goes.
    assert preempted and preempted[0] == "new"
    assert not any(p.swap_out or p.swap_in for p in plans)
    assert len(old.output_token_ids) == len(new.output_token_ids) == 20
    assert s.allocator.num_free == 8


def test_out_of_blocks_swaps_to_host_and_back_and_the_context_survives():
    s = make(num_blocks=8, host_blocks=8, max_batch_tokens=64)
    old, new = request("old", 7, max_tokens=20), request("new", 7, max_tokens=20, arrival=1.0)
    plans = run(s, [old, new])  # FakeRunner checks every cached position at every step
    out = sum(len(p.swap_out) for p in plans)
    back = sum(len(p.swap_in) for p in plans)
    assert out > 0 and out == back
    assert all(r.num_computed > 0 for p in plans for r in p.resumed)  # resumed, not recomputed
    assert s.allocator.num_free == 8 and s.host_allocator.num_free == 8


def test_the_longest_running_equal_priority_request_is_the_victim():
    s = make(num_blocks=9, host_blocks=16, max_batch_tokens=64)
    runner = FakeRunner(s)
    long_runner = request("long", 4, max_tokens=30)
    s.add(long_runner)
    for _ in range(10):
        runner.step(s.schedule())
    short = request("short", 4, max_tokens=20, arrival=1.0)
    s.add(short)
    victims = []
    while short.status is not RequestStatus.FINISHED:
        plan = s.schedule()
        victims += [r.request_id for r in plan.preempted]
        runner.step(plan)
    assert victims and victims[0] == "long"


def test_lower_priority_is_preempted_before_longer_running():
    s = make(num_blocks=9, host_blocks=16, max_batch_tokens=64)
    runner = FakeRunner(s)
    vip = request("vip", 4, max_tokens=30, priority=5)
    s.add(vip)
    for _ in range(10):
        runner.step(s.schedule())
    low = request("low", 4, max_tokens=20, priority=-5, arrival=1.0)
    s.add(low)
    victims = []
    while low.status is not RequestStatus.FINISHED and vip.status is not RequestStatus.FINISHED:
        plan = s.schedule()
        victims += [r.request_id for r in plan.preempted]
        runner.step(plan)
    assert victims and set(victims) == {"low"}


def test_a_full_host_pool_falls_back_to_recompute():
    s = make(num_blocks=8, host_blocks=1, max_batch_tokens=64)
    old, new = request("old", 7, max_tokens=20), request("new", 7, max_tokens=20, arrival=1.0)
    plans = run(s, [old, new])
    assert sum(len(p.preempted) for p in plans) > 0
    assert not any(p.swap_out for p in plans)  # a victim holds 2+ blocks: never fits 1
    assert s.host_allocator.num_free == 1


def test_cancelling_a_swapped_request_frees_its_host_blocks():
    s = make(num_blocks=8, host_blocks=8, max_batch_tokens=64)
    runner = FakeRunner(s)
    a, b = request("a", 7, max_tokens=20), request("b", 7, max_tokens=20, arrival=1.0)
    s.add(a)
    s.add(b)
    while s.num_swapped == 0:
        runner.step(s.schedule())
    victim = next(r for r in (a, b) if r.status is RequestStatus.SWAPPED)
    s.finish(victim, FinishReason.CANCELLED)
    assert s.host_allocator.num_free == 8 and s.num_swapped == 0
    while s.has_unfinished():
        runner.step(s.schedule())
    assert s.allocator.num_free == 8


# -- properties ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max tokens
            st.integers(0, 6),  # arrival step
            st.integers(PRIORITY_MIN, PRIORITY_MAX),
            st.sampled_from([None, None, None, 2, 8, 30]),  # cancel at this step
            st.sampled_from([None, None, None, 3.0, 10.0]),  # deadline, time units after arrival
        ),
        min_size=1,
        max_size=14,
    ),
    num_blocks=st.integers(14, 40),
    host_blocks=st.integers(0, 24),
    max_batch_tokens=st.integers(1, 48),
    max_prefill_tokens=st.integers(1, 48),
    max_decode_tokens=st.integers(1, 8),
    max_prefill_chunk=st.integers(1, 48),
    max_running=st.integers(1, 8),
    bound=st.sampled_from([0.0, 2.0, 5.0, 1e9]),
)
def test_budgets_hold_no_block_leaks_every_request_ends_and_the_waiting_bound_holds(
    prompts,
    num_blocks,
    host_blocks,
    max_batch_tokens,
    max_prefill_tokens,
    max_decode_tokens,
    max_prefill_chunk,
    max_running,
    bound,
):
    s = make(
        num_blocks,
        host_blocks,
        max_batch_tokens=max_batch_tokens,
        max_prefill_tokens=max_prefill_tokens,
        max_decode_tokens=max_decode_tokens,
        max_prefill_chunk=max_prefill_chunk,
        max_running_requests=max_running,
        priority_bound_s=bound,
    )
    runner = FakeRunner(s)
    arrivals: dict[int, list[Request]] = {}
    cancels: dict[int, list[Request]] = {}
    for i, (prompt_len, max_tokens, arrive, priority, cancel_at, deadline_after) in enumerate(prompts):
        deadline = None if deadline_after is None else arrive + deadline_after
        r = request(f"r{i}", prompt_len, max_tokens, priority, float(arrive), deadline)
        arrivals.setdefault(arrive, []).append(r)
        if cancel_at is not None:
            cancels.setdefault(cancel_at, []).append(r)
    everyone = [r for batch in arrivals.values() for r in batch]
    first_start: dict[str, int] = {}
    ended: dict[str, str] = {}
    for step in range(5_000):
        now = float(step)
        for r in arrivals.pop(step, []):
            s.add(r)
        end_cancelled_and_expired(s, cancels.pop(step, []), now, ended)
        if not arrivals and not s.has_unfinished():
            break
        plan = s.schedule()
        decodes = [c for c in plan.chunks if c.is_decode]
        assert plan.num_tokens <= max_batch_tokens
        assert len(decodes) <= max_decode_tokens
        assert plan.num_tokens - len(decodes) <= max_prefill_tokens
        assert len(s.running) <= max_running
        assert len({id(c.request) for c in plan.chunks}) == len(plan.chunks)
        for c in plan.chunks:
            assert c.num_tokens <= max_prefill_chunk or c.is_decode
            assert c.start == c.request.num_computed
            assert c.request.status is RequestStatus.RUNNING
            assert len(c.request.block_tables[0]) * BLOCK >= c.start + c.num_tokens
            first_start.setdefault(c.request.request_id, step)
        # Blocks: every device block is free or held by exactly one running request,
        # every host block is free or held by exactly one swapped request.
        held = [b for r in s.running for b in r.block_tables[0]]
        assert len(held) == len(set(held)) and len(held) + s.allocator.num_free == num_blocks
        assert all(not r.block_tables[0] for r in everyone if r.status is not RequestStatus.RUNNING)
        for r in runner.step(plan):
            ended[r.request_id] = "finished"
        if host_blocks:
            parked = [b for r in everyone if r.status is RequestStatus.SWAPPED for b in r.host_block_tables[0]]
            assert len(parked) == len(set(parked)) and len(parked) + s.host_allocator.num_free == host_blocks
    else:
        raise AssertionError("requests did not finish")
    assert set(ended) == {r.request_id for r in everyone}
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in everyone if ended[r.request_id] == "finished")
    assert s.allocator.num_free == num_blocks
    assert s.host_allocator is None or s.host_allocator.num_free == host_blocks
    # The waiting bound: nobody started before a request that arrived more than
    # `bound` earlier and was still queued (not cancelled or expired) at that time.
    for a in everyone:
        for b in everyone:
            if b.arrival_time > a.arrival_time + bound and b.request_id in first_start:
                if ended[a.request_id] == "finished":
                    assert first_start[a.request_id] <= first_start[b.request_id], (a.request_id, b.request_id)


# -- after the step ----------------------------------------------------------------------


def test_update_from_output_moves_requests_on_and_retires_at_max_tokens():
    s = make(max_batch_tokens=64)
    a, b = request("a", 6, max_tokens=2), request("b", 3, max_tokens=1)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(c.request.request_id, c.token_ids, c.samples, c.is_decode) for c in plan.chunks] == [
        ("a", (10, 11, 12, 13, 14, 15), True, False),
        ("b", (10, 11, 12), True, False),
    ]
    took = s.update_from_output(plan, [40, 41])
    assert took == [a, b]
    assert (a.num_computed, a.output_token_ids, a.status) == (6, [40], RequestStatus.RUNNING)
    assert (b.output_token_ids, b.status, b.finish_reason) == ([41], RequestStatus.FINISHED, FinishReason.LENGTH)
    assert not b.block_tables[0] and s.running == [a]
    plan = s.schedule()
    assert [(c.token_ids, c.start, c.is_decode) for c in plan.chunks] == [((40,), 6, True)]
    s.update_from_output(plan, [42])
    assert a.finish_reason is FinishReason.LENGTH and not s.has_unfinished()
    assert s.allocator.num_free == s.allocator.num_blocks


def test_a_stop_token_retires_the_request_and_a_prompt_chunk_that_does_not_sample_takes_no_token():
    s = make(max_batch_tokens=64, max_prefill_chunk=4)
    r = request("r", 6, max_tokens=10)
    s.add(r)
    plan = s.schedule()
    assert [c.samples for c in plan.chunks] == [False]  # 4 of 6 prompt tokens
    assert s.update_from_output(plan, []) == [] and r.num_computed == 4 and not r.output_token_ids
    plan = s.schedule()
    s.update_from_output(plan, [EOS])
    assert (r.output_token_ids, r.finish_reason, r.status) == ([EOS], FinishReason.STOP, RequestStatus.FINISHED)


def test_update_from_output_refuses_a_token_count_that_does_not_match_the_plan():
    s = make()
    s.add(request("r", 3))
    plan = s.schedule()
    with pytest.raises(ValueError):
        s.update_from_output(plan, [])


def test_a_resumed_request_recomputes_its_published_output_then_decodes_after_it():
    s = make(max_batch_tokens=64)
    r = request("r", 3, max_tokens=4)
    r.output_token_ids = [50, 51]  # published by a worker that died
    s.add(r)
    plan = s.schedule()
    assert [(c.token_ids, c.samples) for c in plan.chunks] == [((10, 11, 12, 50, 51), True)]
    s.update_from_output(plan, [52])
    plan = s.schedule()
    assert [(c.token_ids, c.start, c.is_decode) for c in plan.chunks] == [((52,), 5, True)]
    s.update_from_output(plan, [53])
    assert r.output_token_ids == [50, 51, 52, 53] and r.finish_reason is FinishReason.LENGTH


# -- the prefix cache ------------------------------------------------------------------


def prompt_request(
    rid: str,
    tokens: list[int],
    max_tokens: int = 4,
    arrival: float = 0.0,
    priority: int = 0,
    deadline: float | None = None,
    choices: int = 1,
) -> Request:
    """A request; with `choices` > 1, the lead of that many parallel choices (its `forks`)."""

    def choice(index: int) -> Request:
        return Request(
            rid if index == 0 else f"{rid}/{index}",
            list(tokens),
            SamplingParams(max_tokens=max_tokens, n=choices),
            arrival,
            priority,
            deadline,
            stop_token_ids=frozenset({EOS}),
            index=index,
            status=RequestStatus.FORKING if index else RequestStatus.WAITING,
        )

    lead = choice(0)
    lead.forks = [choice(index) for index in range(1, choices)]
    return lead


SHARED = list(range(100, 112))  # three full blocks


def step_until_finished(s: Scheduler, runner: FakeRunner, *requests: Request) -> list[StepPlan]:
    plans = []
    for r in requests:
        s.add(r)
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        plans.append(s.schedule())
        runner.step(plans[-1])
    return plans


def first_chunk(plans: list[StepPlan], r: Request):
    return next(c for p in plans for c in p.chunks if c.request is r)


def test_a_request_starts_after_the_longest_cached_prefix_and_shares_its_blocks():
    s = make(cache_salt=SALT)
    runner = FakeRunner(s)
    first = prompt_request("first", SHARED + [1, 2], max_tokens=20)
    s.add(first)
    runner.step(s.schedule())  # its prompt is computed and its three full blocks registered
    prefix_blocks = first.block_tables[0][:3]
    second = prompt_request("second", SHARED[:10] + [3, 4, 5])  # two full blocks in common
    s.add(second)
    plan = s.schedule()
    chunk = next(c for c in plan.chunks if c.request is second)
    assert (chunk.start, chunk.token_ids) == (8, (108, 109, 3, 4, 5))
    assert second.block_tables[0][:2] == prefix_blocks[:2]
    assert [s.allocator.holders(b) for b in prefix_blocks] == [2, 2, 1]
    stats = s.cache_stats()
    assert (stats.queried_tokens, stats.device_hit_tokens, stats.host_hit_tokens) == (13, 8, 0)
    runner.step(plan)  # the runner checks the shared blocks hold second's own tokens


def test_without_a_cache_salt_nothing_is_shared():
    s = make()
    runner = FakeRunner(s)
    plans = step_until_finished(s, runner, prompt_request("a", SHARED))
    plans += step_until_finished(s, runner, b := prompt_request("b", SHARED))
    assert first_chunk(plans, b).start == 0 and s.allocator.num_cached == 0


def test_a_prompt_of_cached_blocks_recomputes_its_last_block_into_a_block_of_its_own():
    s = make(cache_salt=SALT)
    runner = FakeRunner(s)
    plans = step_until_finished(s, runner, a := prompt_request("a", SHARED, max_tokens=1))
    a_blocks = first_chunk(plans, a).block_tables[0][:3]
    plans = step_until_finished(s, runner, b := prompt_request("b", SHARED, max_tokens=1))
    chunk = first_chunk(plans, b)
    # Two blocks shared; the last one is computed again (there must be logits to sample),
    # into a new block, not into the cached one.
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (8, 4, True)
    assert chunk.block_tables[0][:2] == a_blocks[:2] and chunk.block_tables[0][2] != a_blocks[2]


def test_a_preempted_request_that_recomputes_takes_its_prompt_from_the_cache():
    # Two requests that cannot both finish in 8 blocks and no host pool: the later one is
    # preempted to recompute. Its prompt's full blocks are cached when it is preempted,
    # so it comes back after them (and may share them with the other one).
    s = make(num_blocks=8, cache_salt=SALT, max_batch_tokens=64)
    runner = FakeRunner(s)
    old = prompt_request("old", SHARED[:7], max_tokens=20)
    new = prompt_request("new", SHARED[:7], max_tokens=20, arrival=1.0)
    plans = step_until_finished(s, runner, old, new)
    preempted = [r for p in plans for r in p.preempted]
    assert preempted and not any(p.swap_out for p in plans)
    restarts = [c for p in plans for c in p.chunks if c.request is preempted[0] and not c.is_decode][1:]
    assert restarts and restarts[0].start > 0
    assert len(old.output_token_ids) == len(new.output_token_ids) == 20
    assert s.allocator.num_free == 8


def evict_with(s: Scheduler, runner: FakeRunner, rid: str, num_tokens: int) -> list[StepPlan]:
    """Run a request of unrelated tokens that takes `num_tokens` slots of the pool."""
    return step_until_finished(s, runner, prompt_request(rid, list(range(500, 500 + num_tokens)), max_tokens=1))


def test_cached_blocks_evicted_from_the_device_are_offloaded_and_a_later_hit_fetches_them():
    s = make(num_blocks=5, host_blocks=8, cache_salt=SALT, max_batch_tokens=64)
    runner = FakeRunner(s)
    step_until_finished(s, runner, prompt_request("a", SHARED + [1], max_tokens=1))
    assert s.allocator.num_cached >= 3
    plans = evict_with(s, runner, "other", 19)  # needs all 5 blocks: every cached block goes
    offloaded = [pair for p in plans for pair in p.offload]
    assert len(offloaded) >= 3 and s.host_allocator.num_cached >= 3
    plans = step_until_finished(s, runner, b := prompt_request("b", SHARED + [2], max_tokens=2))
    fetched = [pair for p in plans for pair in p.fetch]
    assert len(fetched) == 3  # the three blocks of SHARED, copied back, not recomputed
    assert first_chunk(plans, b).start == 12
    assert s.allocator.num_free == 5 and s.host_allocator.num_free == 8


def test_cache_stats_report_the_admissions_hits_by_tier():
    s = make(num_blocks=5, host_blocks=8, cache_salt=SALT, max_batch_tokens=64)
    runner = FakeRunner(s)
    step_until_finished(s, runner, prompt_request("a", SHARED + [1], max_tokens=1))
    evict_with(s, runner, "other", 19)
    s.add(prompt_request("b", SHARED + [2], max_tokens=2))
    plan = s.schedule()
    stats = s.cache_stats()
    assert (stats.queried_tokens, stats.device_hit_tokens, stats.host_hit_tokens) == (13, 0, 12)
    assert stats.device_evictions >= 3 and stats.host_cached_blocks >= 3
    runner.step(plan)
    while s.has_unfinished():
        runner.step(s.schedule())


def test_evicting_part_of_a_finished_prompt_keeps_the_head_of_its_prefix_reachable():
    # A finished prompt's blocks are freed together. Lookups follow the chain from its
    # first block and stop at the first miss, so eviction must take a chain's tail
    # before its head: evicting the head would strand every other block of the chain.
    s = make(num_blocks=5, cache_salt=SALT, max_batch_tokens=64)
    runner = FakeRunner(s)
    step_until_finished(s, runner, prompt_request("a", SHARED + [1], max_tokens=1))  # 3 cached, 2 empty
    evict_with(s, runner, "other", 12)  # three blocks: the two empty ones and one cached block
    assert s.allocator.num_evictions == 1
    plans = step_until_finished(s, runner, b := prompt_request("b", SHARED + [2], max_tokens=1))
    assert first_chunk(plans, b).start == 8  # SHARED's first two blocks were still cached


STEMS = [list(range(100, 124)), list(range(200, 224)), [100, 101, 102, 103] + list(range(300, 320))]


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.integers(0, len(STEMS) - 1),  # which shared stem
            st.integers(0, 24),  # how much of it
            st.lists(st.integers(0, 3), max_size=10),  # then a suffix (few distinct tokens: repeats)
            st.integers(1, 10),  # max tokens
            st.integers(0, 8),  # arrival step
            st.integers(-1, 1),  # priority
            st.sampled_from([None, None, None, None, 2, 8, 20]),  # cancel at this step
            st.sampled_from([None, None, None, None, 3.0, 10.0]),  # deadline, time units after arrival
            st.sampled_from([1, 1, 1, 2, 3]),  # parallel choices
        ),
        min_size=1,
        max_size=14,
    ),
    num_blocks=st.integers(11, 24),  # the longest request (34 + 10 tokens) fits alone
    host_blocks=st.sampled_from([0, 2, 6, 16, 40]),
    max_batch_tokens=st.integers(1, 48),
    max_prefill_chunk=st.integers(1, 48),
    max_running=st.integers(1, 8),
)
def test_prefix_sharing_never_writes_a_shared_block_reads_only_its_own_tokens_and_leaks_nothing(
    prompts,
    num_blocks,
    host_blocks,
    max_batch_tokens,
    max_prefill_chunk,
    max_running,
):
    """Random arrivals with shared prefixes, under preemption (swap and recompute), cancels
    and deadlines. The fake runner checks every chunk (reads only K/V of its own tokens,
    writes only blocks it alone holds and that are not cached) and every plan's copies."""
    s = make(
        num_blocks,
        host_blocks,
        cache_salt=SALT,
        max_batch_tokens=max_batch_tokens,
        max_prefill_chunk=max_prefill_chunk,
        max_running_requests=max_running,
    )
    runner = FakeRunner(s)
    arrivals: dict[int, list[Request]] = {}
    cancels: dict[int, list[Request]] = {}
    for i, (stem, shared, suffix, max_tokens, arrive, priority, cancel_at, deadline_after, choices) in enumerate(
        prompts
    ):
        tokens = STEMS[stem][:shared] + suffix or [1]
        deadline = None if deadline_after is None else arrive + deadline_after
        r = prompt_request(f"r{i}", tokens, max_tokens, float(arrive), priority, deadline, min(choices, max_running))
        arrivals.setdefault(arrive, []).append(r)
        if cancel_at is not None:
            cancels.setdefault(cancel_at, []).append(r)
    everyone = [c for batch in arrivals.values() for r in batch for c in [r, *r.forks]]
    ended: dict[str, str] = {}
    seen: Counter[str] = Counter()
    for step in range(5_000):
        now = float(step)
        for r in arrivals.pop(step, []):
            s.add(r)
        end_cancelled_and_expired(s, cancels.pop(step, []), now, ended)
        if not arrivals and not s.has_unfinished():
            break
        was_running = set(map(id, s.running))
        plan = s.schedule()
        stats = s.cache_stats()
        seen.update(
            device_hit=stats.device_hit_tokens,
            host_hit=stats.host_hit_tokens,
            offload=len(plan.offload),
            swap_out=len(plan.swap_out),
            preempted=len(plan.preempted),
            copy_on_write=len(plan.copies),
        )
        assert stats.device_hit_tokens + stats.host_hit_tokens < stats.queried_tokens or not stats.queried_tokens
        chunked = {id(c.request) for c in plan.chunks}
        for r in s.running:
            if id(r) not in was_running:  # started this step: it computes at least one token now
                assert id(r) in chunked, f"{r.request_id} admitted without a chunk"
        for c in plan.chunks:
            assert c.num_tokens >= 1 and c.start + c.num_tokens <= c.request.num_tokens
            assert len(c.request.block_tables[0]) * BLOCK >= c.start + c.num_tokens
        assert len(s.running) <= max_running  # forks included
        # Device blocks: the refcount of each is the number of running requests listing it.
        held = Counter(b for r in s.running for b in r.block_tables[0])
        assert all(s.allocator.holders(b) == n for b, n in held.items())
        assert len(held) + s.allocator.num_free == num_blocks, "device blocks leaked"
        for r in runner.step(plan):
            ended[r.request_id] = "finished"
    else:
        raise AssertionError("requests did not finish")
    assert set(ended) == {r.request_id for r in everyone}
    assert all(
        len(r.output_token_ids) == r.params.max_tokens or r.output_token_ids[-1] == EOS
        for r in everyone
        if ended[r.request_id] == "finished"
    )
    assert s.allocator.num_free == num_blocks and s.allocator.num_used == 0
    assert s.host_allocator is None or s.host_allocator.num_free == host_blocks
    for what, n in sorted(seen.items()):  # what the examples exercised (--hypothesis-show-statistics)
        event(f"{what}: {'yes' if n else 'no'}")


def test_a_chain_fetched_from_the_host_tier_is_evicted_from_it_tail_first():
    # After a fetch the host blocks it read are free (cached) again. The host tier, like
    # the device pool, must then lose the chain's tail before its head.
    s = make(num_blocks=5, host_blocks=3, cache_salt=SALT, max_batch_tokens=64)
    runner = FakeRunner(s)
    step_until_finished(s, runner, prompt_request("a", SHARED + [1], max_tokens=1))
    evict_with(s, runner, "other", 19)  # the chain's three blocks go to the host tier
    plans = step_until_finished(s, runner, prompt_request("b", SHARED + [2], max_tokens=1))
    assert len([pair for p in plans for pair in p.fetch]) == 3
    host = s.host_allocator
    host.take_evicted()
    for _ in range(3):
        host.allocate()
    chain = [chain_address(SHARED[: 4 * (i + 1)]) for i in range(3)]
    assert [at for at, _ in host.take_evicted()] == chain[::-1]


def test_a_chain_offloaded_to_the_host_tier_is_evicted_from_it_tail_first():
    s = make(num_blocks=5, host_blocks=3, cache_salt=SALT, max_batch_tokens=64)
    runner = FakeRunner(s)
    step_until_finished(s, runner, prompt_request("a", SHARED + [1], max_tokens=1))
    evict_with(s, runner, "other", 19)
    host = s.host_allocator
    host.take_evicted()
    for _ in range(3):
        host.allocate()
    chain = [chain_address(SHARED[: 4 * (i + 1)]) for i in range(3)]
    assert [at for at, _ in host.take_evicted()] == chain[::-1]
