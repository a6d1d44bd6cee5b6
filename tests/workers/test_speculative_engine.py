"""Speculative decoding through the engine with real models: greedy float32 tokens
identical with speculation on and off (golden prompts, copying prompts, chunked
prefill, preemption by swap and by recompute, a takeover), seeded sampling unchanged,
the sampled distribution kept (a chi-square test on a tiny random model), stop strings
inside accepted drafts, and no KV block left after cancels mid-speculation."""

from __future__ import annotations

import random

import pytest
import torch

from bench.drive import StepRecorder
from bench.spec import PARAGRAPHS as BENCH_PARAGRAPHS
from tests.conftest import run_to_completion
from tests.workers.test_engine import PROMPTS
from workers.api import FinishReason, GenerationRequest, SamplingParams, TokenEvent
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from workers.engine import Engine
from workers.model_loader import load_model
from workers.speculative import verify

pytestmark = pytest.mark.slow

PARAGRAPHS = BENCH_PARAGRAPHS[:2]  # the copy workload's first two
# Chat prompts whose greedy answers SmolLM2-135M copies from the prompt.
COPYING = [
    [{"role": "user", "content": "Quote this text:\n\n" + PARAGRAPHS[0]}],
    [{"role": "user", "content": "Copy this text exactly, word for word:\n\n" + PARAGRAPHS[1]}],
    [{"role": "user", "content": "Quote the first two sentences of this text:\n\n" + PARAGRAPHS[1]}],
]
MAX_TOKENS = 20
OFF = SpeculativeConfig(enabled=False)
BLOCK_BYTES = 16 * 46080  # one block of 16 tokens of SmolLM2's K/V in float32


def test_verify_keeps_the_drafts_the_drawn_tokens_agree_with_then_the_token_drawn_after_them():
    """One draw per position, only for the chunks still agreeing: chunk 0's second draft
    is rejected (the token drawn there replaces it), chunk 1 has no drafts, chunk 2's are
    all accepted and the token after its last draft is drawn too."""
    drawn_at = {0: [5, 6, 9, 9], 2: [7, 8, 4]}  # the token each position of a chunk draws
    drafts = [(5, 7, 3), (), (7, 8)]
    calls = []

    def draw(chunks, depth):
        calls.append((chunks, depth))
        return [drawn_at[i][depth] for i in chunks]

    token_ids = [drawn_at[0][0], 1, drawn_at[2][0]]
    assert verify(drafts, token_ids, draw) == [1, 0, 2]
    assert token_ids == [6, 1, 4]
    assert calls == [([0, 2], 1), ([2], 2)]


def prompts(smollm2) -> dict[str, list[int]]:
    tokenizer = smollm2.tokenizer
    from workers.model_loader import encode_prompt

    ids = {f"p{i}": tokenizer(p).input_ids for i, p in enumerate(PROMPTS)}
    ids.update({f"copy{i}": encode_prompt(tokenizer, chat) for i, chat in enumerate(COPYING)})
    return ids


@pytest.fixture(scope="module")
def baseline(smollm2):
    """Every prompt's greedy tokens with speculation off (one engine, all at once)."""
    config = EngineConfig(cache=CacheConfig(kv_memory_bytes=128 << 20, swap_memory_bytes=64 << 20), speculative=OFF)
    engine = Engine(smollm2, config)
    ids = prompts(smollm2)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    results = run_to_completion(engine, {0: [(rid, prompt, params) for rid, prompt in ids.items()]})
    assert engine.scheduler.drafts is None
    return {rid: (ids[rid], results[rid][0]) for rid in ids}


def drafted_and_accepted(records) -> tuple[int, int]:
    return sum(r.num_draft_tokens for r in records), sum(r.num_accepted_tokens for r in records)


def test_greedy_tokens_are_identical_with_speculation_on_and_off(make_engine, baseline):
    """Staggered arrivals, prompts prefilled in chunks of 16 tokens."""
    engine = make_engine(max_batch_tokens=96, max_prefill_chunk=16)
    records = StepRecorder(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    arrivals: dict[int, list[tuple]] = {}
    for i, (rid, (prompt_ids, _)) in enumerate(baseline.items()):
        arrivals.setdefault(2 * i, []).append((rid, prompt_ids, params))
    results = run_to_completion(engine, arrivals)
    for rid, (_, want) in baseline.items():
        assert results[rid][0] == want, rid
    drafted, accepted = drafted_and_accepted(records)
    assert 0 < accepted < drafted  # drafts were accepted, and some rejected
    assert max(r.num_tokens for r in records) <= 96
    # Speculation made fewer steps than one per token.
    assert sum(r.num_sampled for r in records) < sum(len(want) for _, want in baseline.values())


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "recomputed"])
def test_preempted_speculating_requests_keep_their_greedy_tokens(make_engine, baseline, swap):
    engine = make_engine(kv_memory_bytes=10 * BLOCK_BYTES, swap_memory_bytes=(64 << 20) if swap else 0)
    records = StepRecorder(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    chosen = ["copy0", "copy1", "p7", "p8"]
    results = run_to_completion(engine, {0: [(rid, baseline[rid][0], params) for rid in chosen]})
    assert sum(r.num_preempted for r in records) > 0
    assert (sum(r.num_blocks_swapped_out for r in records) > 0) == swap
    assert drafted_and_accepted(records)[1] > 0
    for rid in chosen:
        assert results[rid][0] == baseline[rid][1], rid


def test_a_takeover_continues_exactly_with_speculation(make_engine, baseline):
    engine = make_engine()
    records = StepRecorder(engine)
    prompt_ids, want = baseline["copy1"]
    engine.add_request(
        GenerationRequest("resumed", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), resumed_output_ids=want[:7])
    )
    token_ids, final, _ = run_to_completion(engine)["resumed"]
    assert token_ids == want[7:]
    assert final.usage.completion_tokens == len(want)
    assert drafted_and_accepted(records)[1] > 0


def test_seeded_sampling_draws_the_same_tokens_with_speculation_on_and_off(make_engine, baseline):
    """Verification draws one number per position from the request's own generator, as
    sampling without speculation does: a seeded request's tokens do not change."""
    outputs = {}
    for speculative in (OFF, SpeculativeConfig()):
        engine = make_engine(speculative=speculative)
        records = StepRecorder(engine)
        arrivals = {
            0: [
                (
                    f"{rid}-{seed}",
                    baseline[rid][0],
                    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.95, seed=seed),
                )
                for rid in ("copy0", "copy1")
                for seed in (1, 2)
            ]
        }
        outputs[speculative.enabled] = {rid: r[0] for rid, r in run_to_completion(engine, arrivals).items()}
        if speculative.enabled:
            assert drafted_and_accepted(records)[1] > 0
    assert outputs[True] == outputs[False]


def test_a_stop_string_inside_accepted_drafts_ends_the_request_as_without_speculation(make_engine, baseline):
    finals = {}
    for speculative in (OFF, SpeculativeConfig()):
        engine = make_engine(speculative=speculative)
        params = SamplingParams(max_tokens=MAX_TOKENS, stop=("holiday",))
        tokens, final, text = run_to_completion(engine, {0: [("stop", baseline["copy1"][0], params)]})["stop"]
        finals[speculative.enabled] = (tokens, final.finish_reason, final.usage, text)
    assert finals[True] == finals[False]
    assert finals[True][1] is FinishReason.STOP and "holiday" not in finals[True][3]


def test_random_cancels_mid_speculation_leave_no_block_behind(make_engine, baseline):
    """The fixture checks every device and host block is free at the end."""
    engine = make_engine(kv_memory_bytes=24 * BLOCK_BYTES)
    records = StepRecorder(engine)
    rng = random.Random(7)
    ids = list(baseline)
    for i in range(12):
        rid = rng.choice(ids)
        engine.add_request(GenerationRequest(f"r{i}", baseline[rid][0], SamplingParams(max_tokens=MAX_TOKENS)))
    live = {f"r{i}" for i in range(12)}
    cancelled_while_drafting = 0
    while engine.has_unfinished():
        drafting = {r.request_id for r in engine.scheduler.running if r.draft_gate and r.draft_gate.total_drafted}
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            cancelled_while_drafting += victim in drafting
            engine.cancel(victim)
        for event in engine.step():
            if not isinstance(event, TokenEvent):
                live.discard(event.request_id)
    assert cancelled_while_drafting > 0
    assert drafted_and_accepted(records)[0] > 0


def test_constrained_and_logprobs_requests_do_not_speculate_and_keep_their_tokens(make_engine, baseline):
    engine = make_engine()
    records = StepRecorder(engine)
    prompt_ids, want = baseline["copy1"]
    results = run_to_completion(
        engine,
        {
            0: [
                ("logprobs", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, logprobs=True)),
                ("regex", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, regex=r"[\s\S]*")),
            ]
        },
    )
    assert results["logprobs"][0] == results["regex"][0] == want
    assert drafted_and_accepted(records) == (0, 0)


# -- the sampled distribution, on a tiny random model -------------------------------------


class ModelDrafts:
    """A draft-model proposer (the `Proposer` interface) over the tiny model itself: it
    drafts the most likely token, which at this temperature is drawn about a third of
    the time, so drafts are accepted and rejected often."""

    def __init__(self, model, temperature: float) -> None:
        self.model, self.temperature = model, temperature
        self._seen: dict[tuple[int, ...], torch.Tensor] = {}  # few contexts recur across seeds

    def next_probabilities(self, tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self._seen:
            with torch.inference_mode():
                logits = self.model(torch.tensor([tokens])).logits[0, -1].float()
            self._seen[key] = torch.softmax(logits / self.temperature, dim=-1)
        return self._seen[key]

    def propose(self, histories, lengths):
        return [[int(self.next_probabilities(h.tokens).argmax())] for h in histories]


def test_sampled_tokens_keep_the_model_distribution():
    """Seeds 0..N, each a request whose second token is verified against a drafted one:
    each verified token's randomized probability integral transform under the model's
    own distribution (at its context, from a plain forward) is uniform, by a
    chi-square test over 10 bins."""
    tiny = load_model(ModelConfig(source="random:tiny-llama"))
    reference = load_model(ModelConfig(source="random:tiny-llama"))  # transformers' own attention
    temperature, n = 0.1, 500
    # Every seed in one batch: a few steps in all.
    batch = SchedulerConfig(
        max_running_requests=n, max_batch_tokens=8192, max_prefill_tokens=8192, max_decode_tokens=2 * n
    )
    engine = Engine(tiny, EngineConfig(scheduler=batch, speculative=SpeculativeConfig(max_draft_tokens=1)))
    drafts = ModelDrafts(reference.model, temperature)
    engine.scheduler.drafts.proposer = drafts
    records = StepRecorder(engine)
    prompt = tiny.tokenizer("The tiny model").input_ids
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=seed, ignore_eos=True) for seed in range(n)]
    results = run_to_completion(engine, {0: [(f"s{seed}", prompt, p) for seed, p in enumerate(params)]})
    drafted, accepted = drafted_and_accepted(records)
    assert drafted >= n and 0.1 < accepted / drafted < 0.9  # both verdicts, often
    rng = random.Random(0)
    bins = [0] * 10
    for tokens, _, _ in results.values():
        p = drafts.next_probabilities(prompt + tokens[:1]).double()
        token = tokens[1]
        below = float(p[:token].sum())
        u = below + rng.random() * float(p[token])
        bins[min(9, int(u * 10))] += 1
    expected = n / 10
    chi_square = sum((count - expected) ** 2 / expected for count in bins)
    assert chi_square < 27.9, bins  # 9 degrees of freedom, p = 0.001
