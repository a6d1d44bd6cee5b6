"""Output-length prediction and the scheduling it drives (`workers/length_predictor.py`,
`SchedulerConfig.length_policy`): within a priority the shortest predicted output goes
first, a long job still starts within the aging bound, the swap victim is the longest
predicted remainder, and the order changes no token."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.workers.test_scheduler import BLOCK, FakeRunner, request
from workers.api import FinalEvent, GenerationRequest, SamplingParams, TokenEvent
from workers.block_pool import BlockPool
from workers.config import EngineConfig, ModelConfig, SchedulerConfig
from workers.length_predictor import (
    LONGEST_PREDICTION,
    LengthRegression,
    OracleLengths,
    fit,
    head_start_s,
    kendall_tau,
    prompt_features,
    prompt_key,
)
from workers.request import RequestStatus
from workers.scheduler import Scheduler


def oracle_for(requests_and_lengths) -> OracleLengths:
    return OracleLengths({prompt_key(r.prompt_token_ids): n for r, n in requests_and_lengths})


def make(predictor, num_blocks=64, host_blocks=0, **config) -> Scheduler:
    host = BlockPool(host_blocks) if host_blocks else None
    return Scheduler(SchedulerConfig(**config), BlockPool(num_blocks), BLOCK, host, length_predictor=predictor)


def distinct(rid: str, seed: int, **kwargs):
    """A request whose prompt differs from every other seed's."""
    r = request(rid, 3, **kwargs)
    r.prompt_token_ids = [100 + seed, 101 + seed, 102 + seed]
    return r


def start_order(s: Scheduler, requests) -> list[str]:
    runner = FakeRunner(s)
    for r in requests:
        s.add(r)
    started = []
    while s.has_unfinished():
        plan = s.schedule()
        started += [c.request.request_id for c in plan.chunks if c.start == 0]
        runner.step(plan)
    return started


# -- the queue's order -----------------------------------------------------------------


def test_within_a_priority_the_shortest_predicted_output_starts_first():
    lengths = {"a": 30, "b": 5, "c": 12, "d": 1}
    requests = [distinct(rid, i, max_tokens=n) for i, (rid, n) in enumerate(lengths.items())]
    s = make(oracle_for(zip(requests, lengths.values())), max_running_requests=1)
    assert start_order(s, requests) == ["d", "b", "c", "a"]


def test_without_a_predictor_the_order_stays_first_come_first_served():
    requests = [distinct(rid, i, max_tokens=1) for i, rid in enumerate("abcd")]
    assert start_order(make(None, max_running_requests=1), requests) == list("abcd")


def test_priority_still_comes_before_a_short_prediction():
    short_low = distinct("short_low", 0, max_tokens=1, priority=-10)
    long_high = distinct("long_high", 1, max_tokens=40, priority=10)
    s = make(oracle_for([(short_low, 1), (long_high, 40)]), max_running_requests=1, priority_bound_s=30.0)
    assert start_order(s, [short_low, long_high]) == ["long_high", "short_low"]


def test_a_long_job_behind_a_stream_of_short_ones_starts_within_the_bound():
    # One request at a time, one step per time unit, a new predicted-short job every step:
    # shortest-first alone would hold the long job back forever.
    length_bound = 12.0
    long_job = distinct("long", 0, max_tokens=LONGEST_PREDICTION, arrival=0.0)
    shorts = [distinct(f"short{i}", i + 1, max_tokens=1, arrival=float(i)) for i in range(200)]
    s = make(
        oracle_for([(long_job, LONGEST_PREDICTION)] + [(r, 1) for r in shorts]),
        num_blocks=LONGEST_PREDICTION,
        max_running_requests=1,
        length_bound_s=length_bound,
    )
    runner = FakeRunner(s)
    s.add(long_job)
    for step, short in enumerate(shorts):
        s.add(short)
        runner.step(s.schedule())
        if long_job.status is RequestStatus.RUNNING:
            break
    assert long_job.status is RequestStatus.RUNNING
    assert step <= length_bound + 1


def test_the_head_start_falls_with_the_predicted_length_and_is_bounded():
    starts = [head_start_s(n, 20.0) for n in (1, 10, 100, 1000, LONGEST_PREDICTION, 10 * LONGEST_PREDICTION)]
    assert starts[0] == 20.0 and starts[-2] == starts[-1] == 0.0
    assert all(a > b for a, b in zip(starts[:-2], starts[1:-1]))


def test_a_prediction_never_exceeds_max_tokens():
    r = distinct("r", 0, max_tokens=8)
    s = make(oracle_for([(r, 500)]))
    s.add(r)
    assert r.predicted_output_len == 8


# -- preemption ------------------------------------------------------------------------


def test_the_swap_victim_is_the_longest_predicted_remainder():
    # Two equal-priority requests run; blocks run out; the one predicted to go on longer
    # is swapped out, though it has run fewer steps (first come, first served would
    # swap the one that ran longest).
    short = distinct("short", 0, max_tokens=30, arrival=0.0)  # predicted short, runs 30
    long_job = distinct("long", 1, max_tokens=30, arrival=1.0)
    s = make(oracle_for([(short, 3), (long_job, 30)]), num_blocks=12, host_blocks=32, max_batch_tokens=64)
    runner = FakeRunner(s)
    s.add(short)
    for _ in range(10):
        runner.step(s.schedule())
    s.add(long_job)
    victims = []
    while s.has_unfinished():
        plan = s.schedule()
        victims += [r.request_id for r in plan.preempted]
        runner.step(plan)
    assert victims and victims[0] == "long"


# -- the predictor ---------------------------------------------------------------------


def test_the_fitted_regression_ranks_lengths_it_was_trained_on():
    rng = np.random.default_rng(0)
    vocab, hidden = 50, 8
    embeddings = rng.normal(size=(vocab, hidden)).astype(np.float32)
    # Tokens below 25 make long replies, the others short: a signal in the embeddings.
    prompts = [list(rng.integers(0, 25 if i % 2 else 50, size=rng.integers(5, 40))) for i in range(200)]
    lengths = np.array([1 + 10 * sum(t < 25 for t in p) for p in prompts])
    features = np.stack([prompt_features(embeddings, p) for p in prompts])
    predictor = fit(features, lengths, ridge=1e-3).fold(embeddings)
    assert kendall_tau([predictor.predict(p) for p in prompts], lengths) > 0.5


def test_a_regression_survives_its_file(tmp_path):
    rng = np.random.default_rng(1)
    embeddings = rng.normal(size=(30, 4)).astype(np.float32)
    regression = LengthRegression(rng.normal(size=4), rng.normal(size=4), 0.3, 2.0)
    regression.save(tmp_path / "p.npz")
    again = LengthRegression.load(tmp_path / "p.npz")
    prompt = [3, 1, 4, 1, 5]
    assert again.fold(embeddings).predict(prompt) == pytest.approx(regression.fold(embeddings).predict(prompt))


def test_a_regression_for_another_hidden_size_is_refused():
    with pytest.raises(ValueError, match="hidden size"):
        LengthRegression(np.zeros(4), np.zeros(4), 0.0, 0.0).fold(np.zeros((10, 8), np.float32))


def test_kendall_tau_counts_concordant_pairs():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert math.isclose(kendall_tau([1, 1, 2], [1, 2, 3]), 2 / math.sqrt(2 * 3))


# -- configuration ---------------------------------------------------------------------


def test_the_policies_and_their_flags_are_checked():
    with pytest.raises(ValueError, match="length_policy"):
        SchedulerConfig(length_policy="sjf")
    with pytest.raises(ValueError, match="oracle"):
        SchedulerConfig(length_policy="oracle")
    with pytest.raises(ValueError, match="length_bound_s"):
        SchedulerConfig(length_bound_s=-1)


# -- the engine ------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_tokens_are_the_same_under_every_policy(tmp_path):
    from workers.engine import Engine
    from workers.model_loader import load_model

    model = ModelConfig(source="random:tiny-llama", dtype="float32", device="cpu")
    loaded = load_model(model)
    prompts = [[5 + i, 7, 9 + i, 11] * (1 + i % 3) for i in range(8)]
    max_tokens = [3, 12, 5, 9, 2, 7, 11, 4]
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"lengths": {prompt_key(p): n for p, n in zip(prompts, max_tokens)}}))
    outputs = {}
    for policy in ("fcfs", "predicted", "oracle"):
        scheduler = SchedulerConfig(
            max_running_requests=2, length_policy=policy, length_oracle=oracle if policy == "oracle" else None
        )
        engine = Engine(loaded, EngineConfig(model=model, scheduler=scheduler))
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
            engine.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
        tokens, finished = {}, []
        while engine.has_unfinished():
            for event in engine.step():
                if isinstance(event, TokenEvent):
                    tokens.setdefault(event.request_id, []).extend(event.token_ids)
                elif isinstance(event, FinalEvent):
                    finished.append(event.request_id)
        outputs[policy] = (tokens, finished)
    assert outputs["fcfs"][0] == outputs["predicted"][0] == outputs["oracle"][0]
    # The oracle really reordered: with two running at a time, the shortest finish first.
    assert outputs["oracle"][1][:2] == ["r4", "r0"] != outputs["fcfs"][1][:2]


def test_a_deadline_check_takes_the_predicted_length_times_its_margin_at_most_max_tokens():
    """Under the predicted policy the estimate counts the job's own output as the margin
    times its prediction, capped at its max_tokens; true lengths (oracle) take no margin."""
    job = distinct("job", 0, max_tokens=100)
    predictor = oracle_for([(job, 10)])

    def finish_s(**config) -> float:
        s = make(predictor, **config)
        s.observe_step(16, 0.1)  # the step time the estimate runs at
        s.add(job)
        return s.predicted_finish_s(job)

    # One step for the 3-token prompt, then one a token.
    assert finish_s(length_policy="predicted", deadline_length_margin=1) == pytest.approx((1 + 10) * 0.1)
    assert finish_s(length_policy="predicted") == pytest.approx((1 + 20) * 0.1)  # the default margin, 2
    assert finish_s(length_policy="predicted", deadline_length_margin=3) == pytest.approx((1 + 30) * 0.1)
    assert finish_s(length_policy="predicted", deadline_length_margin=50) == pytest.approx((1 + 100) * 0.1)
    assert finish_s(length_policy="oracle", length_oracle="unused.json", deadline_length_margin=3) == pytest.approx(
        (1 + 10) * 0.1
    )
    with pytest.raises(ValueError, match="deadline_length_margin"):
        SchedulerConfig(deadline_length_margin=0.5)


@pytest.mark.slow
def test_a_deadline_its_predicted_finish_misses_is_refused_at_once_and_others_run(tmp_path):
    import time

    from workers.api import ErrorCode, FinishReason
    from workers.engine import Engine
    from workers.model_loader import load_model

    model = ModelConfig(source="random:tiny-llama", dtype="float32", device="cpu")
    prompt = [5, 7, 9, 11]
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"lengths": {prompt_key(prompt): 200}}))
    scheduler = SchedulerConfig(length_policy="oracle", length_oracle=oracle)
    engine = Engine(load_model(model), EngineConfig(model=model, scheduler=scheduler))
    seen = []
    engine.observer = seen.append
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    def run_all():
        finals = {}
        while engine.has_unfinished():
            for event in engine.step():
                if isinstance(event, FinalEvent):
                    finals[event.request_id] = event
        return finals

    # Nothing is refused before a step time has been measured.
    engine.add_request(GenerationRequest("first", prompt, params, deadline=time.time() + 1e-3))
    assert run_all()["first"].finish_reason is not FinishReason.ERROR
    # 200 predicted tokens cannot be made in a millisecond; in an hour they can.
    engine.add_request(GenerationRequest("hopeless", prompt, params, deadline=time.time() + 1e-3))
    engine.add_request(GenerationRequest("roomy", prompt, params, deadline=time.time() + 3600))
    finals = run_all()
    assert finals["hopeless"].error_code is ErrorCode.DEADLINE_UNMEETABLE
    assert finals["hopeless"].usage.completion_tokens == 0
    assert finals["roomy"].finish_reason is FinishReason.LENGTH
    # The observer hears (predicted, actual) of the requests that ran to their end.
    assert (200.0, 200) in [outcome for stats in seen for outcome in stats.length_outcomes]


def test_the_shortest_first_bound_simulates_a_batch_of_slots_one_token_a_step():
    from bench.sjf_bound import fcfs_over_shortest_first, mean_latency

    # One slot, a 10-token and a 1-token request at t0: fcfs ends them at steps 10 and 11,
    # shortest first at 1 and 11.
    assert mean_latency([10, 1], [0.0, 0.0], shortest_first=False, slots=1) == 10.5
    assert mean_latency([10, 1], [0.0, 0.0], shortest_first=True, slots=1) == 6.0
    # Two slots run both at once, in either order.
    assert mean_latency([10, 1], [0.0, 0.0], shortest_first=False, slots=2) == 5.5
    # Shortest first never loses on the mean, and gains more the longer the queue.
    light = fcfs_over_shortest_first(16, 0.5, 150, 0.59, 384, seed=0)
    heavy = fcfs_over_shortest_first(16, 1.5, 150, 0.59, 384, seed=0)
    assert 1.0 <= light < heavy
