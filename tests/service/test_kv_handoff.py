"""Disaggregated serving inside the engine, with the real SmolLM2 model in float32: a
prefill engine computes a prompt, stops after its first token (`handoff`) and stages the
prompt's full KV blocks in its handoff arena; a decode engine given those K/V and the
first token continues with exactly the tokens one engine makes alone, computing only
that token (the prompt's partial last block moves too).

The K/V go from one engine to the other as the tensor the arena holds; moving them
between processes is `gpu/kv_transfer.py`'s (tests/gpu/test_kv_transfer.py), and the
worker's roles are tests/service/test_disagg.py's.
"""

from __future__ import annotations

import pytest

from bench.drive import Driver
from gpu.kv_transfer import HandoffArena
from workers.api import FinishReason, SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 4
PROMPTS = {
    "long": "Explain, in a few careful sentences, why the sky looks blue during the day and red at dusk.",
    "odd": "Name three rivers in Europe and one in Africa, please.",
    "blockish": "Count: one two three four",
}
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


_colocated: dict[str, list[int]] = {}


def colocated_tokens(make_engine) -> dict[str, list[int]]:
    """Every prompt's tokens from one engine alone (computed once for the module)."""
    if not _colocated:
        driver = Driver(make_engine(block_size=BLOCK))
        for request_id, prompt in PROMPTS.items():
            driver.submit(request_id, prompt, PARAMS)
        driver.drain()
        _colocated.update(driver.tokens)
    return _colocated


def hand_off(make_engine, params=PARAMS, min_prompt_tokens: int = 1):
    """Run every prompt on a prefill engine; returns (its driver, its arena)."""
    engine = make_engine(block_size=BLOCK)
    arena = HandoffArena(None, 64 << 20, hold_s=60.0)
    engine.handoff_arena = arena
    driver = Driver(engine)
    for request_id, prompt in PROMPTS.items():
        driver.submit(request_id, prompt, params, handoff_min_prompt_tokens=min_prompt_tokens)
    driver.drain()
    return driver, arena


def test_a_handed_off_prompt_decodes_to_the_tokens_of_one_engine(make_engine):
    expected = colocated_tokens(make_engine)
    prefill, arena = hand_off(make_engine)
    decode_engine = make_engine(block_size=BLOCK)
    prefix_hits = []
    decode_engine.observer = lambda stats: prefix_hits.append(
        stats.cache.device_hit_tokens + stats.cache.host_hit_tokens
    )
    decode = Driver(decode_engine)
    staged = {}
    for request_id, prompt in PROMPTS.items():
        final = prefill.finals[request_id]
        assert final.finish_reason is FinishReason.HANDOFF
        assert prefill.tokens[request_id] == expected[request_id][:1]
        staged[request_id] = prefill.engine.take_staged(request_id)
        num_prompt = final.usage.prompt_tokens
        assert staged[request_id] == num_prompt  # every block of the prompt, its partial tail too
        kv = arena.view(request_id)
        assert kv.shape[2] == -(-num_prompt // BLOCK)
        decode.submit(request_id, prompt, PARAMS, resumed_output_ids=prefill.tokens[request_id], prompt_kv=kv.clone())
        arena.release(request_id)
    decode.drain()
    for request_id in PROMPTS:
        assert decode.finals[request_id].finish_reason is FinishReason.LENGTH
        assert prefill.tokens[request_id] + decode.tokens[request_id] == expected[request_id], request_id
    # The decode engine found every staged prompt block in its prefix cache: none recomputed.
    assert sum(prefix_hits) == sum(staged.values())
    assert arena.num_held == 0


def test_a_prompt_shorter_than_the_threshold_runs_whole_on_the_prefill_engine(make_engine):
    expected = colocated_tokens(make_engine)
    prefill, arena = hand_off(make_engine, min_prompt_tokens=10_000)
    for request_id in PROMPTS:
        assert prefill.finals[request_id].finish_reason is FinishReason.LENGTH
        assert prefill.tokens[request_id] == expected[request_id]
        assert prefill.engine.take_staged(request_id) == 0
    assert arena.num_held == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, ignore_eos=True, stop=("zzz",)),
        SamplingParams(max_tokens=3, ignore_eos=True, n=2, temperature=0.8, seed=1),
        SamplingParams(max_tokens=12, regex="[a-z ]+"),
    ],
    ids=["stop-string", "two-choices", "constrained"],
)
def test_requests_the_decode_side_could_not_resume_exactly_are_never_handed_off(make_engine, params):
    prefill, arena = hand_off(make_engine, params=params)
    for request_id in PROMPTS:
        assert prefill.finals[request_id].finish_reason is not FinishReason.HANDOFF
    assert arena.num_held == 0


def test_a_first_token_that_ends_the_request_ends_it_there(make_engine):
    """A stop token as the first token: the request is over, nothing is handed off."""
    first = colocated_tokens(make_engine)["long"][0]
    engine = make_engine(block_size=BLOCK)
    engine.handoff_arena = arena = HandoffArena(None, 64 << 20, hold_s=60.0)
    driver = Driver(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(first,))
    driver.submit("long", PROMPTS["long"], params, handoff_min_prompt_tokens=1)
    driver.drain()
    assert driver.finals["long"].finish_reason is FinishReason.STOP
    assert engine.take_staged("long") == 0 and arena.num_held == 0


def test_a_full_arena_stages_nothing_and_the_decode_side_computes_the_prompt(make_engine):
    expected = colocated_tokens(make_engine)
    engine = make_engine(block_size=BLOCK)
    engine.handoff_arena = HandoffArena(None, 1024, hold_s=60.0)  # smaller than one prompt's K/V
    driver = Driver(engine)
    driver.submit("long", PROMPTS["long"], PARAMS, handoff_min_prompt_tokens=1)
    driver.drain()
    assert driver.finals["long"].finish_reason is FinishReason.HANDOFF
    assert engine.take_staged("long") == 0
    decode = Driver(make_engine(block_size=BLOCK))
    decode.submit("long", PROMPTS["long"], PARAMS, resumed_output_ids=driver.tokens["long"])
    decode.drain()
    assert driver.tokens["long"] + decode.tokens["long"] == expected["long"]
