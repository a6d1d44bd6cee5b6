"""The wire protocol's decoder and reply encoders (docs/protocol.md), fuzzed, and an
entry written the way `redis-cli XADD` writes it to a real Redis server."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.protocol import (
    DEFAULT_TENANT,
    FIELDS,
    MAX_ENTRY_BYTES,
    Job,
    ProtocolError,
    decode_job,
    done_fields,
    error_fields,
    reply_stream,
    token_fields,
)
from workers.api import FinalEvent, FinishReason, Timings, Usage


def flat(**fields) -> dict[bytes, bytes]:
    """Fields as Redis returns them: bytes."""
    return {k.encode(): str(v).encode() for k, v in fields.items()}


def test_flat_fields_as_redis_cli_writes_them():
    job = decode_job(
        b"1700000000000-0",
        flat(
            prompt="Hello",
            max_tokens=32,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            seed=7,
            priority=3,
            deadline_ms=1800000000000,
        ),
    )
    assert job == Job("1700000000000-0", "Hello", job.params, 3, 1800000000000, "inflight:out:{1700000000000-0}")
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (32, 0.5, 0.9, 40, 7)


def test_flat_messages_and_stop_are_json_or_a_single_stop_string():
    messages = [{"role": "user", "content": "Hi"}]
    job = decode_job(
        "1-0", flat(id="a", messages=json.dumps(messages), stop='["\\n", "END"]', reply_to="inflight:out:mine")
    )
    assert (job.request_id, job.prompt, job.params.stop, job.reply_to) == (
        "a",
        messages,
        ("\n", "END"),
        "inflight:out:mine",
    )
    assert decode_job("1-0", flat(prompt="x", stop="END")).params.stop == ("END",)


def test_ignore_eos_is_a_boolean_in_either_form():
    assert decode_job("1-0", flat(prompt="x", ignore_eos="true")).params.ignore_eos is True
    assert decode_job("1-0", flat(prompt="x", ignore_eos="0")).params.ignore_eos is False
    assert decode_job("1-0", {b"payload": msgpack.packb({"prompt": "x", "ignore_eos": True})}).params.ignore_eos
    assert decode_job("1-0", flat(prompt="x")).params.ignore_eos is False


def test_msgpack_payload_carries_typed_fields():
    payload = msgpack.packb(
        {
            "id": "b",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "temperature": 1,
            "stop": ["x"],
            "priority": -2,
        }
    )
    job = decode_job(b"2-0", {b"payload": payload})
    assert (job.request_id, job.params.max_tokens, job.params.temperature, job.priority) == ("b", 5, 1.0, -2)
    assert job.reply_to == reply_stream("b") == "inflight:out:{b}"


def test_a_job_names_its_tenant_and_may_be_a_batch_job():
    job = decode_job("4-0", flat(prompt="a", tenant="team-a@example.org", batch="true"))
    assert (job.tenant, job.batch) == ("team-a@example.org", True)
    typed = decode_job("5-0", {b"payload": msgpack.packb({"prompt": "a", "tenant": "b.2", "batch": False})})
    assert (typed.tenant, typed.batch) == ("b.2", False)
    assert decode_job("6-0", flat(prompt="a")).tenant == DEFAULT_TENANT == "default"
    assert not decode_job("6-0", flat(prompt="a")).batch


@pytest.mark.parametrize(
    "fields, code",
    [
        (flat(max_tokens=3), "missing_field"),
        (flat(prompt="a", messages="[]"), "invalid_field"),
        (flat(prompt="a", colour="red"), "unknown_field"),
        (flat(prompt="a", max_tokens="many"), "invalid_type"),
        (flat(prompt="a", max_tokens=1.5), "invalid_type"),
        (flat(prompt="a", max_tokens=0), "invalid_field"),
        (flat(prompt="a", temperature="nan"), "invalid_field"),
        (flat(prompt="a", top_p=2), "invalid_field"),
        (flat(prompt="a", priority=11), "invalid_field"),
        (flat(prompt="a", deadline_ms=-1), "invalid_field"),
        (flat(prompt="a", n=0), "invalid_field"),
        (flat(prompt="a", n=17), "invalid_field"),
        (flat(prompt="a", n="two"), "invalid_type"),
        (flat(prompt="a", ignore_eos="yes please"), "invalid_type"),
        ({b"payload": msgpack.packb({"prompt": "a", "ignore_eos": 1})}, "invalid_type"),
        (flat(messages="not json"), "invalid_type"),
        (flat(messages='[{"role": "user"}]'), "invalid_field"),
        (flat(prompt=""), "invalid_field"),
        ({b"payload": b"\xc1not msgpack"}, "malformed_payload"),
        ({b"payload": msgpack.packb([1, 2])}, "malformed_payload"),
        ({b"payload": msgpack.packb({"prompt": "a", "max_tokens": True})}, "invalid_type"),
        ({b"payload": msgpack.packb({"prompt": "a"}), b"prompt": b"b"}, "invalid_field"),
        ({b"prompt": b"\xff\xfe"}, "invalid_type"),
        (flat(prompt="x" * (MAX_ENTRY_BYTES + 1)), "too_large"),
        (flat(prompt="a", tenant=""), "invalid_field"),
        (flat(prompt="a", tenant="two words"), "invalid_field"),
        (flat(prompt="a", tenant="x" * 65), "invalid_field"),
        ({b"payload": msgpack.packb({"prompt": "a", "tenant": 7})}, "invalid_field"),
        (flat(prompt="a", batch="later"), "invalid_type"),
    ],
)
def test_bad_entries_get_a_stable_code(fields, code):
    with pytest.raises(ProtocolError) as caught:
        decode_job("3-0", fields)
    assert caught.value.code == code and caught.value.message


def test_errors_name_the_request_and_its_reply_stream_when_they_can():
    with pytest.raises(ProtocolError) as caught:
        decode_job("4-0", flat(id="c", prompt="a", top_k=-1))
    assert (caught.value.request_id, caught.value.reply_to) == ("c", "inflight:out:{c}")


def test_json_nested_deeper_than_the_parser_can_go_is_an_invalid_type():
    with pytest.raises(ProtocolError) as caught:
        decode_job("6-0", flat(id="e", messages="[" * 100_000))
    assert caught.value.code == "invalid_type" and caught.value.reply_to == "inflight:out:{e}"


@pytest.mark.parametrize("reply_to", ["inflight:requests", "inflight:control", "other:out:{d}", ""])
def test_reply_to_is_confined_to_the_allowed_prefixes_and_the_error_is_not_sent_there(reply_to):
    with pytest.raises(ProtocolError) as caught:
        decode_job("5-0", flat(id="d", prompt="a", reply_to=reply_to))
    assert caught.value.code == "invalid_field" and caught.value.reply_to is None
    assert (
        decode_job(
            "5-0", flat(id="d", prompt="a", reply_to="other:out:{d}"), reply_prefixes=("inflight:out:", "other:out:")
        ).reply_to
        == "other:out:{d}"
    )


_values = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40).map(str.encode),
    st.integers().map(lambda i: str(i).encode()),
    st.floats().map(lambda f: str(f).encode()),
)


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(
        st.one_of(st.sampled_from(sorted(FIELDS | {"payload"})).map(str.encode), st.binary(max_size=8)),
        _values,
        max_size=8,
    )
)
def test_fuzzed_flat_entries_decode_or_raise_protocol_error(fields):
    try:
        job = decode_job("5-0", fields)
    except ProtocolError as error:
        assert error.code in {
            "missing_field",
            "invalid_field",
            "unknown_field",
            "invalid_type",
            "malformed_payload",
            "too_large",
        }
    else:
        job.params.validate()


_msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=20),
    ),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.dictionaries(st.sampled_from(sorted(FIELDS)), _msgpack_values, max_size=6).map(msgpack.packb),
    )
)
def test_fuzzed_payloads_decode_or_raise_protocol_error(payload):
    try:
        decode_job("6-0", {b"payload": payload})
    except ProtocolError:
        pass


def test_reply_fields_are_readable_and_carry_msgpack():
    token = token_fields(0, "Hel", [12, 34])
    assert (token["type"], token["seq"], token["text"], token["token_ids"]) == ("token", "0", "Hel", "12 34")
    assert msgpack.unpackb(token["data"]) == {"type": "token", "seq": 0, "text": "Hel", "token_ids": [12, 34]}
    final = FinalEvent("r", FinishReason.LENGTH, Usage(3, 2), Timings(0.01, 0.2, 0.5, (0.2, 0.5)), text="!")
    done = done_fields(final, worker="gpu-3")
    assert (done["finish_reason"], done["completion_tokens"], done["total_s"], done["worker"]) == (
        "length",
        "2",
        "0.500000",
        "gpu-3",
    )
    assert msgpack.unpackb(done["data"])["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
    assert msgpack.unpackb(done["data"])["worker"] == "gpu-3"
    error = error_fields("invalid_field", "top_k must be >= 0")
    assert msgpack.unpackb(error["data"]) == {"type": "error", "code": "invalid_field", "message": "top_k must be >= 0"}


def test_an_entry_written_like_redis_cli_decodes(redis_client):
    key = "inflight:test:protocol"
    redis_client.delete(key)
    # What `redis-cli XADD inflight:test:protocol '*' prompt "Hello" max_tokens 32` writes.
    entry_id = redis_client.execute_command("XADD", key, "*", "prompt", "Hello", "max_tokens", "32")
    [(read_id, fields)] = redis_client.xrange(key)
    job = decode_job(read_id, fields)
    assert (job.request_id, job.prompt, job.params.max_tokens) == (entry_id.decode(), "Hello", 32)
    redis_client.xadd(job.reply_to, token_fields(0, "Hi", [1]))
    [(_, reply)] = redis_client.xrange(job.reply_to)
    assert reply[b"text"] == b"Hi" and reply[b"seq"] == b"0"
    redis_client.delete(key, job.reply_to)


@pytest.fixture
def redis_client():
    import redis

    client = redis.Redis(host="127.0.0.1", port=6379)
    client.ping()  # a real server: .ci/run starts one if none answers
    yield client
    client.close()


@pytest.mark.parametrize(
    "fields",
    [flat(prompt="a", reply_to="inflight:out:{}x"), {b"id": b"}", b"prompt": b"a"}],
    ids=["reply_to with empty braces", "an id of a lone brace"],
)
def test_braces_in_reply_to_must_enclose_a_hash_tag_so_its_owner_key_shares_the_slot(fields):
    with pytest.raises(ProtocolError) as caught:
        decode_job("3-0", fields)
    assert caught.value.code == "invalid_field" and "hash tag" in caught.value.message


def test_reply_streams_with_or_without_a_hash_tag_are_accepted():
    assert decode_job("3-0", flat(prompt="a", reply_to="inflight:out:plain")).reply_to == "inflight:out:plain"
    assert decode_job("3-0", {b"id": b"a{b}c", b"prompt": b"a"}).reply_to == "inflight:out:{a{b}c}"


# -- structured output and logprobs ----------------------------------------------------

PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_constraints_and_logprobs_in_either_form():
    """`json_schema` and `choice` are JSON text in the flat form and native in a payload;
    `regex` is a string; `json_object` and `logprobs` are booleans."""
    flat_job = decode_job(
        b"1-0", flat(prompt="x", json_schema=json.dumps(PERSON_SCHEMA), logprobs="true", top_logprobs=5)
    )
    assert flat_job.params.json_schema == PERSON_SCHEMA
    assert (flat_job.params.logprobs, flat_job.params.top_logprobs) == (True, 5)
    packed = decode_job(b"1-0", {b"payload": msgpack.packb({"prompt": "x", "choice": ["yes", "no"]})})
    assert packed.params.choice == ("yes", "no")
    assert decode_job(b"1-0", flat(prompt="x", choice='["a", "b"]')).params.choice == ("a", "b")
    assert decode_job(b"1-0", flat(prompt="x", regex="[0-9]+")).params.regex == "[0-9]+"
    assert decode_job(b"1-0", flat(prompt="x", json_object="1")).params.json_object is True
    assert not decode_job(b"1-0", flat(prompt="x")).params.constrained


@pytest.mark.parametrize(
    "fields, code",
    [
        (flat(prompt="x", json_schema="{not json"), "invalid_type"),
        (flat(prompt="x", json_schema="[1, 2]"), "invalid_type"),
        (flat(prompt="x", choice='"yes"'), "invalid_type"),
        (flat(prompt="x", choice="[]"), "invalid_field"),
        (flat(prompt="x", choice='["a", ""]'), "invalid_field"),
        (flat(prompt="x", regex=""), "invalid_field"),
        (flat(prompt="x", regex="a", choice='["a"]'), "invalid_field"),  # at most one constraint
        (flat(prompt="x", json_object="true", json_schema="{}"), "invalid_field"),
        (flat(prompt="x", json_object="maybe"), "invalid_type"),
        (flat(prompt="x", top_logprobs=21), "invalid_field"),
        (flat(prompt="x", top_logprobs=-1), "invalid_field"),
        (flat(prompt="x", logprobs="2"), "invalid_type"),
    ],
)
def test_bad_constraints_and_logprobs_get_a_stable_code(fields, code):
    with pytest.raises(ProtocolError) as raised:
        decode_job(b"1-0", fields)
    assert raised.value.code == code


def test_token_data_carries_logprobs_only_when_asked():
    from service.protocol import token_data

    assert "logprob" not in msgpack.unpackb(token_data(0, "a", (5,)))
    data = msgpack.unpackb(
        token_data(0, "a", (5,), logprob=-0.25, token="a", top_logprobs=((5, "a", -0.25), (9, "b", -2.0)))
    )
    assert (data["logprob"], data["token"]) == (-0.25, "a")
    assert data["top_logprobs"] == [
        {"token_id": 5, "token": "a", "logprob": -0.25},
        {"token_id": 9, "token": "b", "logprob": -2.0},
    ]
