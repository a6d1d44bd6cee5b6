"""Speculative decoding without a model: the prompt-lookup proposer, the per-request
gate, and the scheduler's drafts (budgets, rollback, leaks) driven by a simulated model
that copies, through the fake KV cache of `tests/workers/test_scheduler.py`."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.test_scheduler import BLOCK, SALT, FakeRunner, request
from workers.api import FinishReason
from workers.block_pool import BlockPool, blocks_needed
from workers.config import SchedulerConfig, SpeculativeConfig
from workers.plan import StepPlan
from workers.request import Request, RequestStatus
from workers.scheduler import Scheduler
from workers.speculative import MIN_JUDGED, MIN_STEPS, DraftGate, PromptLookup, StepCost, TokenHistory, drafts_worth

SPEC = SpeculativeConfig(max_draft_tokens=4, min_ngram=1, max_ngram=3, cooldown_steps=8)


def propose(tokens: list[int], k: int, lookup: PromptLookup | None = None, history: TokenHistory | None = None):
    history = history or TokenHistory()
    history.tokens.extend(tokens[len(history.tokens) :])
    return (lookup or PromptLookup(1, 3)).propose([history], [k])[0]


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    assert propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3) == [5, 6, 1]
    assert propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 9) == [5, 6, 1, 2]  # at most up to the end


def test_prompt_lookup_prefers_the_longest_matching_ngram():
    # (7, 1, 2) occurred once, followed by 9; (1, 2) occurred later, followed by 8.
    assert propose([7, 1, 2, 9, 3, 1, 2, 8, 7, 1, 2], 2) == [9, 3]
    assert propose([7, 1, 2, 9, 3, 1, 2, 8, 7, 1, 2], 2, PromptLookup(1, 2)) == [8, 7]


def test_prompt_lookup_proposes_nothing_without_an_earlier_occurrence():
    assert propose([1, 2, 3, 4, 5], 4) == []
    assert propose([5], 4) == []
    assert propose([1, 2, 3, 4, 1], 4, PromptLookup(2, 3)) == []  # a unigram is too short here


def test_prompt_lookup_indexes_new_tokens_as_the_history_grows():
    lookup, history = PromptLookup(1, 3), TokenHistory()
    assert propose([4, 5, 6], 2, lookup, history) == []
    assert propose([4, 5, 6, 9, 4, 5], 2, lookup, history) == [6, 9]
    assert propose([4, 5, 6, 9, 4, 5, 6, 9, 8, 4, 5, 6, 9], 3, lookup, history) == [8, 4, 5]


def test_the_gate_grows_k_while_drafts_are_accepted_and_cuts_it_after_a_rejection():
    gate = DraftGate(SPEC)
    lengths = []
    for step in range(5):
        k = gate.draft_length(step)
        lengths.append(k)
        gate.record(step, k, k)
    assert lengths == [1, 2, 3, 4, 4]  # up to max_draft_tokens
    gate.record(5, 4, 1)
    assert gate.draft_length(6) == 2  # one more than it accepted
    assert gate.total_drafted == 18 and gate.total_accepted == 15


def test_the_gate_pauses_a_request_below_the_threshold_then_retries_with_a_growing_cool_down():
    gate = DraftGate(SPEC)
    step = 0
    while gate.draft_length(step) > 0:  # every draft rejected
        gate.record(step, gate.draft_length(step), 0)
        step += 1
    assert step == MIN_JUDGED  # judged once it drafted MIN_JUDGED tokens, one a step
    assert [gate.draft_length(step + i) for i in range(SPEC.cooldown_steps)] == [0] * SPEC.cooldown_steps
    step += SPEC.cooldown_steps
    assert gate.draft_length(step) == 1
    for _ in range(MIN_JUDGED):
        gate.record(step, 1, 0)
        step += 1
    paused = 0
    while gate.draft_length(step + paused) == 0:
        paused += 1
    assert paused == 2 * SPEC.cooldown_steps


def test_the_gate_keeps_a_request_at_or_above_the_threshold_speculating():
    gate = DraftGate(SpeculativeConfig(max_draft_tokens=2, acceptance_threshold=0.5))
    gate.record(0, 1, 1)
    for step in range(1, 50):  # half of two, every step
        assert gate.draft_length(step) == 2
        gate.record(step, 2, 1)


# -- the scheduler, with a simulated model that copies ---------------------------------


def copying_model(context: tuple[int, ...]) -> int:
    """The next token: the one eight tokens back, except every thirteenth position (a
    mismatch no draft predicts), so drafts are accepted and rejected."""
    if len(context) % 13 == 0:
        return 100 + len(context) % 7
    return context[-8] if len(context) >= 8 else 10


class CopyingRunner(FakeRunner):
    """The fake KV runner with `copying_model` as its model: each sampling chunk's token,
    and its drafts accepted while they are what the model says (as the engine verifies)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.drafted = self.accepted = 0

    def sample(self, plan: StepPlan) -> tuple[list[int], list[int]]:
        tokens, accepted = [], []
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            context = tuple(chunk.request.token_slice(0, chunk.start + chunk.num_tokens - len(chunk.drafts)))
            n = 0
            token = copying_model(context)
            while n < len(chunk.drafts) and token == chunk.drafts[n]:
                context += (token,)
                n += 1
                token = copying_model(context)
            tokens.append(token)
            accepted.append(n)
            self.drafted += len(chunk.drafts)
            self.accepted += n
        return tokens, accepted


def copy_request(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0) -> Request:
    r = request(rid, prompt_len, max_tokens=max_tokens, arrival=arrival, stop_token_ids=frozenset({2}))
    r.prompt_token_ids = [10 + (i * 5) % 11 for i in range(prompt_len)]
    return r


def drive(
    s: Scheduler, requests: list[Request], check=None, max_steps: int = 5_000, step_seconds=None
) -> CopyingRunner:
    """Run to the end; `step_seconds(tokens)`, if given, is what each step is timed at (the
    engine's part)."""
    runner = CopyingRunner(s)
    for r in requests:
        s.add(r)
    for _ in range(max_steps):
        if not s.has_unfinished():
            return runner
        plan = s.schedule()
        if check:
            check(plan)
        runner.step(plan)
        if step_seconds:
            s.observe_step(plan.num_tokens, step_seconds(plan.num_tokens))
        for r in s.running:  # no block is held for a rejected draft's slot
            assert len(r.block_tables[0]) == blocks_needed(r.num_computed, BLOCK), r.request_id
    raise AssertionError("requests did not finish")


def test_speculation_gives_the_same_tokens_in_fewer_steps_and_frees_rejected_blocks():
    outputs, steps = {}, {}
    for spec in (None, SPEC):
        s = make(speculative=spec)
        requests = [copy_request(f"r{i}", 9 + 5 * i, 40) for i in range(3)]
        plans = []
        runner = drive(s, requests, check=plans.append)
        outputs[spec is not None] = [r.output_token_ids for r in requests]
        steps[spec is not None] = len(plans)
        assert s.allocator.num_free == s.allocator.num_blocks
    assert outputs[True] == outputs[False]
    assert runner.accepted > 0 and runner.drafted > runner.accepted  # both verdicts happened
    assert steps[True] < steps[False]


def test_the_step_cost_fit_finds_the_share_of_a_step_that_grows_with_its_tokens():
    cost = StepCost()
    assert cost.token_share(10) is None  # nothing measured yet
    for _ in range(int(MIN_STEPS) + 2):
        cost.observe(10, 0.03)
    assert cost.token_share(10) is None  # every step the same size: no slope to read
    for n in [1, 4, 9, 16, 30, 7, 12, 2] * 3:
        cost.observe(n, 0.010 + 0.002 * n)  # 10 ms a step, 2 ms a token
    assert cost.token_share(10) == pytest.approx(0.020 / 0.030, abs=0.01)
    assert cost.token_share(1) == pytest.approx(0.002 / 0.012, abs=0.01)


def test_a_draft_pays_while_its_chance_of_acceptance_beats_the_tokens_share_of_the_step():
    assert drafts_worth(0.9, 0.5, 5) == 5  # 0.9 ... 0.59, all above one half
    assert drafts_worth(0.9, 0.75, 5) == 2  # 0.9, 0.81; not 0.729
    assert drafts_worth(0.4, 0.5, 5) == 0
    assert drafts_worth(0.95, 0.0, 3) == 3  # a step whose time tokens do not move: the gate's K
    assert drafts_worth(0.99, 1.0, 3) == 0  # every token costs its full share: only a sure draft would pay


def test_drafts_stop_where_a_steps_time_is_all_per_token_and_go_on_where_it_is_fixed():
    outputs, drafted_late = {}, {}
    for profile, seconds in (("off", None), ("compute", lambda n: 0.002 * n), ("memory", lambda n: 0.05 + 1e-5 * n)):
        s = make(speculative=None if profile == "off" else SPEC)
        requests = [copy_request(f"r{i}", 9 + 5 * i, 60) for i in range(3)]
        plans = []
        drive(s, requests, check=plans.append, step_seconds=seconds or (lambda n: 0.01))
        outputs[profile] = [r.output_token_ids for r in requests]
        drafted_late[profile] = sum(plan.num_draft_tokens for plan in plans[20:])
        if profile == "memory":
            assert s.drafts.step_cost.token_share(3) < 0.01
    assert outputs["compute"] == outputs["memory"] == outputs["off"]
    assert drafted_late["compute"] == 0  # once the fit knows a token's price, no draft is worth it
    assert drafted_late["memory"] > 0


def make(
    speculative: SpeculativeConfig | None = None,
    num_blocks: int = 64,
    host_blocks: int = 0,
    cache_salt: bytes | None = None,
    **config,
) -> Scheduler:
    host = BlockPool(host_blocks) if host_blocks else None
    return Scheduler(SchedulerConfig(**config), BlockPool(num_blocks), BLOCK, host, cache_salt, speculative)


def test_drafts_take_only_what_decodes_left_of_the_decode_budget():
    s = make(SPEC, max_decode_tokens=5)
    requests = [copy_request(f"r{i}", 12, 60) for i in range(3)]

    def check(plan: StepPlan) -> None:
        assert plan.num_decode_tokens <= 5
        decodes = [c for c in plan.chunks if c.is_decode]
        assert plan.num_draft_tokens <= 5 - len(decodes)

    runner = drive(s, requests, check)
    assert runner.accepted > 0


def test_drafts_yield_to_prompt_chunks_under_the_batch_budget():
    """A long prompt arriving beside a speculating request gets exactly the tokens it
    would without speculation: drafts take only what is left after it."""
    chunks = {}
    for spec in (None, SPEC):
        s = make(spec, max_batch_tokens=8, max_prefill_chunk=8)
        runner = CopyingRunner(s)
        s.add(copy_request("copier", 12, 60))
        for _ in range(6):  # its prompt, then decodes (with drafts, when speculating)
            runner.step(s.schedule())
        s.add(copy_request("long", 40, 4))
        seen = []
        for _ in range(6):
            plan = s.schedule()
            assert plan.num_tokens <= 8
            seen.append([c.num_tokens for c in plan.chunks if c.request.request_id == "long"])
            runner.step(plan)
        chunks[spec is not None] = seen
        for r in list(s.running):
            s.finish(r, FinishReason.CANCELLED)
    assert chunks[True] == chunks[False] == [[7]] * 5 + [[5]]


def test_drafts_never_take_the_last_free_blocks():
    """Drafts take a new block only while more stay free than there are running requests."""
    s = make(SPEC, num_blocks=6)
    requests = [copy_request(f"r{i}", 7, 14) for i in range(2)]

    grew = []

    def check(plan: StepPlan) -> None:
        for chunk in plan.chunks:
            if chunk.drafts and len(chunk.block_tables[0]) > blocks_needed(chunk.start + 1, BLOCK):
                grew.append(chunk.request.request_id)
                assert s.allocator.num_free >= len(s.running)

    drive(s, requests, check)
    assert grew  # the check was exercised
    assert s.allocator.num_free == s.allocator.num_blocks


def test_a_drafted_stop_token_ends_the_request_there():
    s = make(SPEC)
    r = copy_request("stops", 16, 60)
    r.prompt_token_ids = [10, 11, 12, 13, 14, 15, 16, 2] * 2  # the model goes on copying it
    drive(s, [r])
    # Drafts of 1, 2 and 3 tokens, all accepted by the model: the last step's were 16,
    # the stop token 2 and 10, and the output ends at the stop token.
    assert r.output_token_ids == [10, 11, 12, 13, 14, 15, 16, 2] and r.finish_reason is FinishReason.STOP
    assert (r.draft_gate.total_drafted, r.draft_gate.total_accepted) == (6, 6)


def test_constrained_and_logprobs_requests_never_speculate():
    from workers.api import SamplingParams

    s = make(SPEC)
    plain = copy_request("plain", 12, 30)
    constrained = copy_request("regex", 12, 30)
    constrained.params = SamplingParams(max_tokens=30, regex="a+")
    logprobs = copy_request("logprobs", 12, 30)
    logprobs.params = SamplingParams(max_tokens=30, logprobs=True)
    drafting = set()
    drive(
        s,
        [plain, constrained, logprobs],
        check=lambda plan: drafting.update(c.request.request_id for c in plan.chunks if c.drafts),
    )
    assert drafting == {"plain"}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(18, 40),  # the largest request (70 tokens) fits alone
    host_blocks=st.sampled_from([0, 12]),
    caching=st.booleans(),
    max_batch_tokens=st.integers(4, 24),
)
def test_random_cancels_mid_speculation_leave_every_context_intact_and_no_block_held(
    seed, num_blocks, host_blocks, caching, max_batch_tokens
):
    """Requests that copy, arriving and cancelled at random, under preemption (swap or
    recompute) and prefix caching: the fake KV cache shows every context intact, the
    budgets hold, no block stays with a rejected draft, and every block comes back."""
    rng = random.Random(seed)
    s = make(
        SPEC,
        num_blocks=num_blocks,
        host_blocks=host_blocks,
        cache_salt=SALT if caching else None,
        max_batch_tokens=max_batch_tokens,
        max_decode_tokens=max(1, max_batch_tokens // 2),
    )
    runner = CopyingRunner(s)
    pending = [copy_request(f"r{i}", rng.randint(3, 30), rng.randint(1, 40)) for i in range(rng.randint(1, 8))]
    live: list[Request] = []
    for _ in range(3_000):
        if pending and rng.random() < 0.3:
            live.append(pending.pop())
            s.add(live[-1])
        going = [r for r in live if r.status is not RequestStatus.FINISHED]
        if going and rng.random() < 0.05:
            s.finish(rng.choice(going), FinishReason.CANCELLED)
        if not s.has_unfinished():
            if not pending:
                break
            continue
        plan = s.schedule()
        assert plan.num_tokens <= max_batch_tokens
        assert plan.num_decode_tokens <= max(1, max_batch_tokens // 2)
        runner.step(plan)
        for r in s.running:
            assert len(r.block_tables[0]) == blocks_needed(r.num_computed, BLOCK), r.request_id
    else:
        raise AssertionError("requests did not finish")
    assert all(r.status is RequestStatus.FINISHED for r in live)
    assert s.allocator.num_free == s.allocator.num_blocks
    assert s.host_allocator is None or s.host_allocator.num_free == s.host_allocator.num_blocks


def test_speculative_config_is_validated():
    for bad in (
        {"max_draft_tokens": 0},
        {"min_ngram": 0},
        {"min_ngram": 3, "max_ngram": 2},
        {"acceptance_threshold": 1.5},
        {"cooldown_steps": 0},
    ):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)


def test_the_worker_flags_map_onto_the_speculative_config():
    import argparse

    from service.flags import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).speculative == SpeculativeConfig()
    config = engine_config_from_args(
        parser.parse_args(
            [
                "--no-speculative",
                "--max-draft-tokens",
                "3",
                "--spec-acceptance-threshold",
                "0.6",
                "--spec-cooldown-steps",
                "10",
            ]
        )
    ).speculative
    assert config == SpeculativeConfig(enabled=False, max_draft_tokens=3, acceptance_threshold=0.6, cooldown_steps=10)
