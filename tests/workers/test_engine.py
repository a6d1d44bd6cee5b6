"""The engine with the real SmolLM2 model: token-exact continuous batching, sampling,
stop conditions, cancellation and bad input."""

from __future__ import annotations

import pytest
import torch

from bench.drive import Driver, StepRecorder
from tests.conftest import run_to_completion
from tests.waiting import wait_until
from workers.api import ErrorCode, FinishReason, GenerationRequest, InvalidRequest, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three fruits:",
    "Once upon a time, in a land far away, there lived a",
    "def add(a, b):\n    return",
    "Translate to French: I would like a cup of coffee, please.",
    "Explain in one paragraph why the sky is blue. Mention Rayleigh scattering and the wavelength of light, "
    "and say why sunsets are red.",
    "Here is a long story. " * 12 + "The end of the story is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,",
]
MAX_TOKENS = 20


def generate_alone(reference, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = reference.model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            top_p=None,
            top_k=None,
            temperature=None,
            pad_token_id=reference.tokenizer.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def expected(smollm2_reference):
    tokenizer = smollm2_reference.tokenizer
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    return {f"p{i}": (ids, generate_alone(smollm2_reference, ids, MAX_TOKENS)) for i, ids in enumerate(prompts)}


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_batch_equals_generate_alone(make_engine, expected, chunk):
    """Prompts of different lengths arriving at staggered steps, prefilled in chunks,
    each produce exactly the tokens `generate` gives for that prompt alone."""
    engine = make_engine(max_batch_tokens=96, max_prefill_chunk=chunk)
    steps = StepRecorder(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    arrivals: dict[int, list[tuple]] = {}
    for i, (request_id, (prompt_ids, _)) in enumerate(expected.items()):
        arrivals.setdefault(3 * i, []).append((request_id, prompt_ids, params))
    results = run_to_completion(engine, arrivals)
    for request_id, (_, want) in expected.items():
        got, final, _ = results[request_id]
        assert got == want, f"{request_id} with chunk {chunk}"
        assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert max(r.num_tokens for r in steps) <= 96


BLOCK_BYTES = 16 * 46080  # one block of 16 tokens of SmolLM2's K/V in float32


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "recomputed"])
def test_preempted_requests_produce_the_same_tokens(make_engine, expected, swap):
    """A KV pool too small for everyone forces preemption: requests swapped out to the
    host pool and back in, or recomputed, still produce exactly their greedy tokens."""
    engine = make_engine(kv_memory_bytes=8 * BLOCK_BYTES, swap_memory_bytes=(64 << 20) if swap else 0)
    records = StepRecorder(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    chosen = ["p1", "p3", "p8", "p6"]
    arrivals = {0: [(rid, expected[rid][0], params) for rid in chosen]}
    results = run_to_completion(engine, arrivals)
    assert sum(r.num_preempted for r in records) > 0
    swapped_out = sum(r.num_blocks_swapped_out for r in records)
    swapped_in = sum(r.num_blocks_swapped_in for r in records)
    if swap:
        assert swapped_out > 0 and swapped_in == swapped_out
    else:
        assert swapped_out == swapped_in == 0
    for rid in chosen:
        assert results[rid][0] == expected[rid][1], rid


def test_higher_priority_runs_first(make_engine, expected):
    engine = make_engine(max_running_requests=1)
    params = SamplingParams(max_tokens=3)
    arrivals = {
        0: [
            ("low", expected["p1"][0], params, -5),
            ("mid", expected["p2"][0], params, 0),
            ("high", expected["p3"][0], params, 5),
        ]
    }
    results = run_to_completion(engine, arrivals)
    first_tokens = sorted(results, key=lambda rid: results[rid][1].timings.first_token_s)
    assert first_tokens == ["high", "mid", "low"]


def test_deadlines_end_waiting_and_running_requests(make_engine, expected):
    import time

    engine = make_engine(max_running_requests=1)
    deadline = time.time() + 1.0
    engine.add_request(GenerationRequest("late", expected["p1"][0], SamplingParams(max_tokens=5), 0, time.time() - 1))
    engine.add_request(
        GenerationRequest("runs", expected["p3"][0], SamplingParams(max_tokens=500, ignore_eos=True), 0, deadline)
    )
    engine.add_request(
        GenerationRequest("queued", expected["p2"][0], SamplingParams(max_tokens=500), 0, time.time() + 0.5)
    )
    engine.add_request(GenerationRequest("after", expected["p2"][0], SamplingParams(max_tokens=3), 0))
    drive = Driver(engine, raise_errors=False)
    drive.run_until(lambda: "runs" in drive.tokens, max_steps=100)  # running: its first token is out
    # No step until both deadlines have passed: "runs" cannot reach 500 tokens by then,
    # however fast the machine, and "queued" is still waiting behind it.
    wait_until(lambda: time.time() > deadline, 10, "the deadlines to pass")
    drive.drain()
    finals, tokens = drive.finals, drive.tokens
    assert finals["late"].finish_reason is FinishReason.DEADLINE and "late" not in tokens
    assert finals["queued"].finish_reason is FinishReason.DEADLINE and "queued" not in tokens
    assert finals["runs"].finish_reason is FinishReason.DEADLINE and 0 < len(tokens["runs"]) < 500
    assert finals["after"].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_text_events_concatenate_to_the_decoded_output(make_engine, smollm2):
    engine = make_engine()
    poem = [{"role": "user", "content": "Write a short poem about autumn."}]
    results = run_to_completion(engine, {0: [("a", poem, SamplingParams(max_tokens=30))]})
    token_ids, final, text = results["a"]
    assert final.usage.completion_tokens == len(token_ids) == 30
    assert text == smollm2.tokenizer.decode(token_ids, skip_special_tokens=True)
    timings = final.timings
    assert 0 <= timings.queue_s <= timings.first_token_s <= timings.total_s
    assert len(timings.token_times) == 30 and list(timings.token_times) == sorted(timings.token_times)


def test_chat_prompt_goes_through_the_chat_template(make_engine, smollm2):
    engine = make_engine()
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    results = run_to_completion(engine, {0: [("chat", messages, SamplingParams(max_tokens=12))]})
    templated = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert results["chat"][1].usage.prompt_tokens == len(smollm2.tokenizer(templated).input_ids)
    assert "4" in results["chat"][2]


def test_seeded_sampling_does_not_depend_on_the_batch(make_engine):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = run_to_completion(make_engine(), {0: [("s", "Tell me a joke.", params)]})["s"][0]
    crowd = {
        0: [("x", "Another prompt entirely", SamplingParams(max_tokens=16, temperature=1.0))],
        2: [("s", "Tell me a joke.", params), ("y", "And a third one", SamplingParams(max_tokens=8))],
    }
    assert run_to_completion(make_engine(), crowd)["s"][0] == alone


def test_stop_string_ends_the_request_and_is_not_returned(make_engine, expected, smollm2):
    prompt_ids, greedy = expected["p8"]  # counts 29, 30, 31, ...
    full_text = smollm2.tokenizer.decode(greedy, skip_special_tokens=True)
    stop = full_text.strip().split(",")[2].strip()  # a number a few tokens in
    engine = make_engine()
    results = run_to_completion(engine, {0: [("s", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,)))]})
    _, final, text = results["s"]
    assert final.finish_reason is FinishReason.STOP
    assert stop not in text and full_text.startswith(text)


def test_stop_token_id_ends_the_request(make_engine, expected):
    prompt_ids, greedy = expected["p8"]
    engine = make_engine()
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(greedy[3],))
    token_ids, final, _ = run_to_completion(engine, {0: [("s", prompt_ids, params)]})["s"]
    assert final.finish_reason is FinishReason.STOP
    assert token_ids == greedy[: greedy.index(greedy[3]) + 1]


def test_eos_stops_unless_ignored(make_engine, smollm2):
    messages = [{"role": "user", "content": "Say just the word yes."}]
    engine = make_engine()
    results = run_to_completion(
        engine,
        {
            0: [
                ("eos", messages, SamplingParams(max_tokens=40)),
                ("ign", messages, SamplingParams(max_tokens=40, ignore_eos=True)),
            ]
        },
    )
    assert results["eos"][1].finish_reason is FinishReason.STOP
    assert results["eos"][0][-1] in engine.eos_token_ids
    assert results["ign"][1].finish_reason is FinishReason.LENGTH
    assert len(results["ign"][0]) == 40


def test_cancel_frees_the_request_at_once(make_engine):
    engine = make_engine()
    engine.add_request(GenerationRequest("long", "Count from one to a thousand:", SamplingParams(max_tokens=200)))
    engine.add_request(GenerationRequest("other", "Hello", SamplingParams(max_tokens=5)))
    drive = Driver(engine)
    drive.run_until(lambda: "long" in drive.tokens, max_steps=50)  # running: its first token is out
    assert any(r.request_id == "long" for r in engine.scheduler.running)
    engine.cancel("long")
    events = engine.step()
    finals = {e.request_id: e for e in events if hasattr(e, "finish_reason")}
    assert finals["long"].finish_reason is FinishReason.CANCELLED
    assert all(r.request_id != "long" for r in engine.scheduler.running)
    run_to_completion(engine)


BAD_INPUTS = [
    ("empty prompt", "", SamplingParams()),
    ("empty token list", [], SamplingParams()),
    ("token id out of vocabulary", [1, 10**9], SamplingParams()),
    ("prompt longer than the context", [42] * 9000, SamplingParams()),
    ("max_tokens zero", "Hi", SamplingParams(max_tokens=0)),
    ("max_tokens negative", "Hi", SamplingParams(max_tokens=-3)),
    ("max_tokens past the context", "Hi", SamplingParams(max_tokens=10**6)),
    ("negative temperature", "Hi", SamplingParams(temperature=-1.0)),
    ("nan temperature", "Hi", SamplingParams(temperature=float("nan"))),
    ("top_p zero", "Hi", SamplingParams(top_p=0.0)),
    ("top_k negative", "Hi", SamplingParams(top_k=-1)),
    ("stop not a list of strings", "Hi", SamplingParams(stop=("ok", 3))),
    ("empty stop string", "Hi", SamplingParams(stop=("",))),
    ("stop token ids not ints", "Hi", SamplingParams(stop_token_ids=("a",))),
    ("malformed chat", [{"role": "user"}], SamplingParams()),
    ("prompt of the wrong type", 42, SamplingParams()),
    ("priority above the range", "Hi", SamplingParams(), 11),
    ("priority not an integer", "Hi", SamplingParams(), 1.5),
    ("deadline not a number", "Hi", SamplingParams(), 0, "soon"),
    ("deadline not finite", "Hi", SamplingParams(), 0, float("inf")),
]


def test_bad_input_fails_only_that_request(make_engine, expected):
    engine = make_engine()
    prompt_ids, want = expected["p1"]
    engine.add_request(GenerationRequest("good", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS)))
    for name, *arguments in BAD_INPUTS:
        engine.add_request(GenerationRequest(name, *arguments))
    results = run_to_completion(engine)
    for name, *_ in BAD_INPUTS:
        token_ids, final, _ = results[name]
        assert final.finish_reason is FinishReason.ERROR, name
        assert final.error_code is ErrorCode.INVALID_REQUEST, name
        assert final.error and token_ids == [], name
    assert results["good"][0] == want


def test_a_live_request_id_cannot_be_reused(make_engine):
    engine = make_engine()
    engine.add_request(GenerationRequest("same", "Hello", SamplingParams(max_tokens=3)))
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request(GenerationRequest("same", "Hello again", SamplingParams(max_tokens=3)))
    run_to_completion(engine)
    engine.add_request(GenerationRequest("same", "Once finished, the id is free", SamplingParams(max_tokens=2)))
    run_to_completion(engine)


def test_bfloat16_engine_serves_with_a_bfloat16_cache(make_engine):
    from gpu.cpu.attention import CpuAttentionBackend, cpu_kernel
    from gpu.cpu.fusions import FusedRMSNorm, fused_ops
    from workers.config import ModelConfig
    from workers.model_loader import load_model

    engine = make_engine(load_model(ModelConfig(dtype="bfloat16")))
    assert engine.runner.kv_cache.key_pools[0].dtype == torch.bfloat16
    # The fast CPU paths cover bfloat16: the decode kernel and the fused norms.
    if cpu_kernel() is not None and fused_ops() is not None:
        assert type(engine.runner.backend) is CpuAttentionBackend
        assert any(isinstance(m, FusedRMSNorm) for m in engine.runner.model.modules())
    # A completion whose answer leads by over two logits: the chat's first token is a
    # near-tie in bfloat16 ("The" against "L'" on the Xeon), which a CPU's rounding flips.
    prompt = "The capital of France is Paris. The capital of Italy is"
    token_ids, final, text = run_to_completion(engine, {0: [("bf16", prompt, SamplingParams(max_tokens=4))]})["bf16"]
    assert final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and "Rome" in text


def test_a_failing_step_observer_does_not_stop_generation(make_engine, expected, caplog):
    engine = make_engine()

    def broken_metrics(stats):
        raise RuntimeError("metrics backend down")

    engine.observer = broken_metrics
    prompt_ids, want = expected["p1"]
    engine.add_request(GenerationRequest("r", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS)))
    assert run_to_completion(engine)["r"][0] == want
    assert "the step observer failed" in caplog.text


def test_a_request_that_arrived_earlier_elsewhere_keeps_its_place_in_the_queue(make_engine):
    """A job taken over from a worker that died arrived long ago: it goes ahead of the
    requests that arrived after it, even when it reaches this engine last."""
    import time

    engine = make_engine(max_running_requests=1)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    results = run_to_completion(
        engine,
        {
            0: [
                ("new-1", "Hello", params),
                ("new-2", "Hello", params),
                ("taken-over", "Hello", params, 0, None, time.time() - 60),
            ]
        },
    )
    assert list(results) == ["taken-over", "new-1", "new-2"]  # finished in the order they started
    assert results["taken-over"][1].timings.queue_s >= 60  # its timings count from its first arrival


def test_a_resumed_request_continues_exactly_where_the_published_tokens_stop(make_engine, expected):
    """A takeover: another worker published the first tokens, this engine recomputes
    them with the prompt and produces exactly the rest; usage counts the whole request."""
    engine = make_engine()
    prompt_ids, want = expected["p3"]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    engine.add_request(GenerationRequest("resumed", prompt_ids, params, resumed_output_ids=want[:7]))
    token_ids, final, _ = run_to_completion(engine)["resumed"]
    assert token_ids == want[7:]
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt_ids), len(want))


@pytest.mark.parametrize(
    "resumed", [[-1], [10**9], list(range(MAX_TOKENS + 1))], ids=["negative", "beyond vocab", "more than max_tokens"]
)
def test_resumed_output_that_cannot_be_continued_is_an_invalid_request(make_engine, resumed):
    engine = make_engine()
    engine.add_request(
        GenerationRequest("r", "Hello", SamplingParams(max_tokens=MAX_TOKENS), resumed_output_ids=resumed)
    )
    _, final, _ = run_to_completion(engine)["r"]
    assert final.error_code is ErrorCode.INVALID_REQUEST


def test_a_resumed_request_whose_published_tokens_already_end_it_ends_at_once(make_engine):
    """A worker died after publishing the last token but before the final event: the
    takeover writes only the final event, with the whole request's usage."""
    engine = make_engine()
    engine.add_request(
        GenerationRequest(
            "full", "Hello", SamplingParams(max_tokens=MAX_TOKENS), resumed_output_ids=list(range(MAX_TOKENS))
        )
    )
    token_ids, final, _ = run_to_completion(engine)["full"]
    assert token_ids == [] and final.finish_reason is FinishReason.LENGTH and final.error is None
    assert final.usage.completion_tokens == MAX_TOKENS


def test_a_failed_model_step_fails_the_requests_it_ran_with_internal_error_and_the_engine_goes_on(
    make_engine, expected
):
    engine = make_engine()
    execute = engine.runner.execute

    def failing_once(plan):
        engine.runner.execute = execute  # the next step runs normally
        raise RuntimeError("device lost")

    engine.add_request(GenerationRequest("hit", "Hello", SamplingParams(max_tokens=5)))
    engine.runner.execute = failing_once
    _, final, _ = run_to_completion(engine)["hit"]
    assert final.finish_reason is FinishReason.ERROR and final.error_code is ErrorCode.INTERNAL_ERROR
    assert "device lost" in final.error
    prompt_ids, want = expected["p1"]
    engine.add_request(GenerationRequest("after", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS)))
    assert run_to_completion(engine)["after"][0] == want


# -- parallel sampling ---------------------------------------------------------------


def run_choices(engine, request_id, prompt, params, **options):
    """Run one request to its end: ({index: token ids}, final event)."""
    driver = Driver(engine, raise_errors=False)
    driver.submit(request_id, prompt, params, **options)
    driver.drain()
    return driver.choice_tokens.get(request_id, {}), driver.finals[request_id]


def test_n_greedy_choices_each_equal_generate_and_end_in_one_final_event(make_engine, expected):
    engine = make_engine()
    prompt_ids, want = expected["p3"]
    choices, final = run_choices(engine, "n4", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, n=4))
    assert choices == {index: want for index in range(4)}
    assert [(c.index, c.finish_reason) for c in final.choices] == [(i, FinishReason.LENGTH) for i in range(4)]
    assert final.usage.completion_tokens == 4 * MAX_TOKENS and final.usage.prompt_tokens == len(prompt_ids)
    assert len(final.timings.token_times) == 4 * MAX_TOKENS


def test_seeded_choice_i_draws_what_a_single_request_with_seed_plus_i_draws(make_engine, expected):
    engine = make_engine()
    prompt_ids, _ = expected["p1"]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1234, n=3)
    choices, _ = run_choices(engine, "n3", prompt_ids, params)
    for index in range(3):
        alone, _ = run_choices(
            engine, f"alone-{index}", prompt_ids, SamplingParams(max_tokens=12, temperature=0.8, seed=1234 + index)
        )
        assert choices[index] == alone[0]
    assert len({tuple(tokens) for tokens in choices.values()}) > 1  # they did sample apart


@pytest.mark.parametrize("prompt_length", [47, 48, 49])  # the last prompt token mid-block, last in, first in a block
def test_choices_share_the_prompt_blocks_and_copy_the_partly_filled_one_on_write(make_engine, prompt_length):
    """n choices hold the prompt's KV once: the peak of blocks in use is the prompt's
    plus each choice's own, far below n separate requests'."""
    engine = make_engine(max_prefill_tokens=512)
    prompt = [(7 * i) % 1000 + 10 for i in range(prompt_length)]
    peaks = []
    previous = engine.observer
    engine.observer = lambda stats: peaks.append(stats.device_blocks_used)
    choices, _ = run_choices(engine, "shared", prompt, SamplingParams(max_tokens=8, n=8, ignore_eos=True))
    engine.observer = previous
    block = engine.block_size
    own = -(-(prompt_length + 8) // block) - (prompt_length - 1) // block  # blocks past the shared ones
    assert max(peaks) <= -(-prompt_length // block) + 8 * own
    alone, _ = run_choices(engine, "alone", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert choices == {index: alone[0] for index in range(8)}


def test_cancelling_a_request_ends_every_choice_in_one_cancelled_final_event(make_engine):
    engine = make_engine()
    driver = Driver(engine, raise_errors=False)
    driver.submit("n", "Tell me a story", SamplingParams(max_tokens=200, n=3, ignore_eos=True))
    driver.run_until(lambda: sum(len(t) for t in driver.choice_tokens.get("n", {}).values()) >= 9)
    engine.cancel("n")
    driver.drain()
    final = driver.finals["n"]
    assert final.finish_reason is FinishReason.CANCELLED
    assert {c.finish_reason for c in final.choices} == {FinishReason.CANCELLED}


def test_a_takeover_continues_every_choice_after_its_published_tokens(make_engine, expected):
    engine = make_engine()
    prompt_ids, want = expected["p2"]
    published = [want[:3], want[:MAX_TOKENS], [], want[:11]]  # choice 1 had already ended
    choices, final = run_choices(
        engine, "resumed", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, n=4), resumed_output_ids=published
    )
    assert choices == {0: want[3:], 2: want, 3: want[11:]}
    assert final.usage.completion_tokens == 4 * MAX_TOKENS
    assert [c.completion_tokens for c in final.choices] == [MAX_TOKENS] * 4


@pytest.mark.parametrize("n", [0, 17, True])
def test_n_outside_1_to_16_is_an_invalid_request(make_engine, n):
    engine = make_engine()
    engine.add_request(GenerationRequest("r", "Hello", SamplingParams(max_tokens=4, n=n)))
    _, final, _ = run_to_completion(engine)["r"]
    assert final.error_code is ErrorCode.INVALID_REQUEST and "n must be" in final.error
