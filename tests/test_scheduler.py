"""The scheduler, driven by a simulated runner: no model, no tensors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.config import SchedulerConfig
from workers.block_manager import BlockAllocator, blocks_needed
from workers.request import Request, SamplingParams
from workers.scheduler import Scheduler, StepPlan

BLOCK = 4


def make(num_blocks=64, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockAllocator(num_blocks), BLOCK)


def request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0.0)


def simulate_step(scheduler: Scheduler, plan: StepPlan) -> list[Request]:
    """What the engine does after the forward: advance, sample a fake token, retire."""
    sampling = [c.request for c in plan.chunks if c.samples]
    for chunk in plan.chunks:
        chunk.request.num_computed += chunk.num_tokens
    finished = []
    for r in sampling:
        r.output_token_ids.append(7)
        if len(r.output_token_ids) >= r.params.max_tokens:
            scheduler.finish(r)
            finished.append(r)
    return finished


def test_scheduler_never_imports_torch():
    code = "import workers.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_long_prompt_is_chunked_while_decodes_ride_along():
    s = make(max_batch_tokens=8, max_prefill_chunk=8)
    short = request("short", 3, max_tokens=10)
    s.add(short)
    simulate_step(s, s.schedule())  # short's prompt, first token sampled
    s.add(request("long", 20))
    plans = []
    for _ in range(3):
        plan = s.schedule()
        plans.append([(c.request.request_id, c.num_tokens) for c in plan.chunks])
        simulate_step(s, plan)
    # The decode goes first every step; the long prompt takes what is left of the budget.
    assert plans == [[("short", 1), ("long", 7)], [("short", 1), ("long", 7)], [("short", 1), ("long", 6)]]


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
    assert len(s.waiting) == 2


def test_blocks_are_allocated_as_tokens_arrive_not_for_max_tokens():
    s = make()
    r = request("a", 5, max_tokens=100)
    s.add(r)
    simulate_step(s, s.schedule())
    assert len(r.block_ids) == blocks_needed(5, BLOCK)  # not blocks for 105 tokens
    for _ in range(3):
        simulate_step(s, s.schedule())
    assert len(r.block_ids) == blocks_needed(r.num_computed, BLOCK)


def test_a_request_larger_than_the_pool_is_refused():
    s = make(num_blocks=4)
    with pytest.raises(ValueError, match="more KV blocks"):
        s.add(request("huge", 10, max_tokens=7))  # 17 tokens > 4 blocks of 4


def test_out_of_blocks_preempts_the_newest_and_it_comes_back_first():
    s = make(num_blocks=8, max_batch_tokens=64)
    old, new = request("old", 7, max_tokens=20), request("new", 7, max_tokens=20)
    s.add(old)
    s.add(new)
    preempted = []
    while s.has_unfinished():
        plan = s.schedule()
        preempted += [r.request_id for r in plan.preempted]
        simulate_step(s, plan)
    assert preempted and preempted[0] == "new"
    assert len(old.output_token_ids) == len(new.output_token_ids) == 20
    assert s.allocator.num_free == 8


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 5)), min_size=1, max_size=12),
    num_blocks=st.integers(14, 40),
    max_batch_tokens=st.integers(1, 48),
    max_prefill_chunk=st.integers(1, 48),
    max_running=st.integers(1, 8),
)
def test_every_request_finishes_within_budgets_and_no_block_leaks(
    prompts, num_blocks, max_batch_tokens, max_prefill_chunk, max_running
):
    s = make(num_blocks, max_batch_tokens=max_batch_tokens, max_prefill_chunk=max_prefill_chunk,
             max_running_requests=max_running)
    arrivals: dict[int, list[Request]] = {}
    for i, (prompt_len, max_tokens, arrive) in enumerate(prompts):
        arrivals.setdefault(arrive, []).append(request(f"r{i}", prompt_len, max_tokens))
    everyone = [r for batch in arrivals.values() for r in batch]
    for step in range(5_000):
        for r in arrivals.pop(step, []):
            s.add(r)
        if not arrivals and not s.has_unfinished():
            break
        plan = s.schedule()
        assert plan.num_tokens <= max_batch_tokens
        assert len(s.running) <= max_running
        assert len({id(c.request) for c in plan.chunks}) == len(plan.chunks)
        for c in plan.chunks:
            assert c.num_tokens <= max(max_prefill_chunk, 1)
            assert c.start == c.request.num_computed
            assert len(c.request.block_ids) * BLOCK >= c.start + c.num_tokens
        held = [b for r in s.running for b in r.block_ids]
        assert len(held) == len(set(held)) and len(held) + s.allocator.num_free == num_blocks
        simulate_step(s, plan)
    else:
        raise AssertionError("requests did not finish")
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in everyone)
    assert s.allocator.num_free == num_blocks
