"""Structured outputs and logprobs with the real SmolLM2 model: every output that ends
with `stop` is valid under its constraint, constraints leave outputs that already fit
untouched, bad constraints and dead ends end only their own request, grammar state
survives preemption and is rebuilt on a takeover, and logprobs are the model's own.

`make test` runs 10 of the 300 generated schemas, greedy; the benchmark scenario
(`inflight bench --scenario structured`) decodes all 300, greedy and at temperature 1.0.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from bench.drive import Driver, StepRecorder
from bench.schemas import generate_schemas
from tests.conftest import run_to_completion
from workers.api import ErrorCode, FinishReason, GenerationRequest, SamplingParams, TokenEvent

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
# SmolLM2's greedy answer to CAPITAL, unconstrained.
CAPITAL_ANSWER = "The capital of France is Paris."


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def schema_prompt(schema: dict) -> list[dict]:
    return chat(f"Reply with a JSON object that follows this JSON schema, and nothing else.\n{json.dumps(schema)}")


def assert_valid(schema: dict, text: str) -> None:
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(json.loads(text))


def test_generated_schemas_greedy_outputs_parse_and_validate(make_engine):
    """10 of the generated schemas (nested objects, bounded arrays, enums, bounded numbers,
    formats, patterns, anyOf, optional keys), in one batch: every output that stops is
    valid JSON under its schema."""
    schemas = generate_schemas(300, seed=0)[::30]
    engine = make_engine()
    results = run_to_completion(
        engine,
        {
            0: [
                (f"s{i}", chat("Reply with a JSON object."), SamplingParams(max_tokens=64, json_schema=schema))
                for i, schema in enumerate(schemas)
            ]
        },
    )
    stopped = 0
    for i, schema in enumerate(schemas):
        _, final, text = results[f"s{i}"]
        assert final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), final
        if final.finish_reason is FinishReason.STOP:
            assert_valid(schema, text)
            stopped += 1
    assert stopped >= len(schemas) // 3  # the rest ran out of max_tokens (the model repeats itself in a string)
    assert engine.grammars.num_compiled == len(schemas)


def test_regex_choice_and_json_object_at_temperature_one(make_engine):
    """Sampled at temperature 1.0 (seeded), with n > 1 giving each choice its own grammar
    state: regexes and choices match in full, JSON objects parse."""
    engine = make_engine()
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
    colors = ("red", "green", "blue", "light yellow")
    sampled = dict(temperature=1.0, seed=7, max_tokens=32)
    driver = Driver(engine, raise_errors=False)
    driver.drain(
        {
            0: [
                ("date", chat("Give today's date."), SamplingParams(regex=date, n=3, **sampled)),
                ("color", chat("Pick a color."), SamplingParams(choice=colors, n=3, **sampled)),
                ("object", chat("Describe a cat as JSON."), SamplingParams(json_object=True, **sampled)),
            ]
        }
    )
    for request_id, pattern in (("date", date), ("color", "|".join(map(re.escape, colors)))):
        assert [c.finish_reason for c in driver.finals[request_id].choices] == [FinishReason.STOP] * 3
        for tokens in driver.choice_tokens[request_id].values():
            text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
            assert re.fullmatch(pattern, text), (request_id, text)
    if driver.finals["object"].finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(driver.texts["object"]), dict)


def test_constraint_keeps_an_output_that_already_fits(make_engine):
    """Fidelity: the unconstrained greedy answer satisfies the regex and the choice, so
    both constrained requests give exactly its tokens (its end token included)."""
    engine = make_engine()
    results = run_to_completion(
        engine,
        {
            0: [
                ("free", CAPITAL, SamplingParams(max_tokens=24)),
                ("regex", CAPITAL, SamplingParams(max_tokens=24, regex=r"The capital of [A-Z][a-z]+ is [A-Z][a-z]+\.")),
                ("choice", CAPITAL, SamplingParams(max_tokens=24, choice=(CAPITAL_ANSWER, "Lyon"))),
            ]
        },
    )
    free, final, text = results["free"]
    assert text == CAPITAL_ANSWER and final.finish_reason is FinishReason.STOP
    assert results["regex"][0] == free
    assert results["choice"][0] == free


def test_bad_constraints_and_dead_ends_end_only_their_request(make_engine):
    """A schema or regex that cannot compile is an `invalid_grammar` error, a grammar with
    nowhere to go ends `grammar_dead_end`; the request beside them is untouched."""
    engine = make_engine()
    alone = run_to_completion(engine, {0: [("alone", CAPITAL, SamplingParams(max_tokens=24))]})["alone"][0]
    results = run_to_completion(
        engine,
        {
            0: [
                (
                    "schema",
                    CAPITAL,
                    SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "strin"}}}),
                ),
                ("regex", CAPITAL, SamplingParams(regex="(")),
                ("nothing", CAPITAL, SamplingParams(regex=r"[^\s\S]")),  # matches no string at all
                ("ok", CAPITAL, SamplingParams(max_tokens=24)),
            ]
        },
    )
    for request_id in ("schema", "regex"):
        final = results[request_id][1]
        assert final.finish_reason is FinishReason.ERROR and final.error_code is ErrorCode.INVALID_GRAMMAR
        assert "cannot compile" in final.error
    assert results["nothing"][1].finish_reason is FinishReason.GRAMMAR_DEAD_END
    assert results["ok"][0] == alone


def test_ignore_eos_past_the_grammars_end_stops(make_engine):
    """With EOS ignored, a choice whose grammar has ended stops there: nothing may follow."""
    engine = make_engine()
    tokens, final, text = run_to_completion(
        engine, {0: [("c", CAPITAL, SamplingParams(max_tokens=24, choice=("Paris", "Lyon"), ignore_eos=True))]}
    )["c"]
    assert final.finish_reason is FinishReason.STOP
    assert text in ("Paris", "Lyon") and tokens[-1] in engine.eos_token_ids


BLOCK_BYTES = 16 * 46080  # one block of 16 tokens of SmolLM2's K/V in float32


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "recomputed"])
def test_grammar_state_survives_preemption(make_engine, swap):
    """A KV pool too small for everyone preempts constrained requests (swapped or
    recomputed): they give exactly the tokens they give with room to spare."""
    arrivals = {
        0: [
            (f"r{i}", schema_prompt(PERSON), SamplingParams(max_tokens=48, json_schema=PERSON, temperature=1.0, seed=i))
            for i in range(6)
        ]
    }
    roomy = run_to_completion(make_engine(), arrivals)
    engine = make_engine(kv_memory_bytes=12 * BLOCK_BYTES, swap_memory_bytes=(64 << 20) if swap else 0)
    records = StepRecorder(engine)
    tight = run_to_completion(engine, arrivals)
    assert sum(r.num_preempted for r in records) > 0
    for request_id, (tokens, final, text) in roomy.items():
        assert tight[request_id][0] == tokens
        if final.finish_reason is FinishReason.STOP:
            assert_valid(PERSON, text)


def test_takeover_rebuilds_grammar_state_from_published_tokens(make_engine):
    """A request resumed from another worker's published tokens continues inside its
    grammar: greedy, it ends exactly as the uninterrupted request did. Published tokens
    that do not fit the grammar leave it at a dead end."""
    engine = make_engine()
    params = SamplingParams(max_tokens=48, json_schema=PERSON)
    whole = run_to_completion(engine, {0: [("whole", schema_prompt(PERSON), params)]})["whole"]
    tokens, final, text = whole
    assert final.finish_reason is FinishReason.STOP
    assert_valid(PERSON, text)
    cut = len(tokens) // 2
    engine.add_request(GenerationRequest("resumed", schema_prompt(PERSON), params, resumed_output_ids=tokens[:cut]))
    engine.add_request(
        GenerationRequest("misfit", schema_prompt(PERSON), params, resumed_output_ids=engine.tokenizer.encode("hello"))
    )
    results = run_to_completion(engine)
    assert results["resumed"][0] == tokens[cut:]
    assert results["resumed"][1].finish_reason is FinishReason.STOP
    assert results["misfit"][1].finish_reason is FinishReason.GRAMMAR_DEAD_END


def test_one_schema_compiles_once(make_engine):
    engine = make_engine()
    run_to_completion(
        engine, {0: [(f"r{i}", chat("Hi"), SamplingParams(max_tokens=4, json_schema=PERSON)) for i in range(8)]}
    )
    assert engine.grammars.num_compiled == 1


def test_logprobs_equal_log_softmax_of_plain_transformers(make_engine, smollm2_reference):
    """Each token's `logprob` and `top_logprobs` are log_softmax of transformers' own
    float32 logits at that position, to 1e-4; with a constraint they are taken before
    the mask (the model's distribution), so they are the same numbers."""
    engine = make_engine()
    prompt_ids = engine.tokenizer("The three primary colors are").input_ids
    engine.add_request(
        GenerationRequest("free", prompt_ids, SamplingParams(max_tokens=8, logprobs=True, top_logprobs=5))
    )
    engine.add_request(
        GenerationRequest("shaped", prompt_ids, SamplingParams(max_tokens=8, top_logprobs=3, regex=r"[a-z ,]+"))
    )
    token_events = {"free": [], "shaped": []}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenEvent):
                token_events[event.request_id].append(event)
    for request_id, top in (("free", 5), ("shaped", 3)):
        output = [e.token_ids[0] for e in token_events[request_id]]
        with torch.inference_mode():
            logits = smollm2_reference.model(torch.tensor([prompt_ids + output])).logits[0].float()
        want = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
        for position, event in enumerate(token_events[request_id]):
            assert abs(event.logprob - want[position, output[position]].item()) < 1e-4
            values, ids = want[position].topk(top)
            assert [t.token_id for t in event.top_logprobs] == ids.tolist()
            assert all(abs(t.logprob - w) < 1e-4 for t, w in zip(event.top_logprobs, values.tolist()))
            assert event.token == engine.tokenizer.decode([output[position]])
            assert [t.token for t in event.top_logprobs] == [engine.tokenizer.decode([i]) for i in ids.tolist()]


def test_a_date_format_admits_exactly_the_dates_that_exist():
    """`"format": "date"` compiles to `FULL_DATE`: the dates Python's `date` (and so the
    `jsonschema` format checker) reads, no more (llguidance's own date format lets
    year 0000 and February 29 of any year through)."""
    import datetime

    from workers.structured import FULL_DATE, grammar_source

    pattern = re.compile(FULL_DATE)
    for year in [*range(0, 2101), *range(2396, 2405), 9996, 9999]:
        for month in range(1, 13):
            for day in range(1, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date.fromisoformat(text)
                    exists = True
                except ValueError:
                    exists = False
                assert (pattern.fullmatch(text) is not None) == exists, text
    nested = {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}, "kind": {"enum": [{"format": "date"}]}},
    }
    _, text = grammar_source(SamplingParams(max_tokens=1, json_schema=nested))
    assert json.loads(text)["properties"]["when"] == {"type": "string", "pattern": FULL_DATE}
    assert json.loads(text)["properties"]["kind"] == {"enum": [{"format": "date"}]}  # data stays data
