"""`inflight gateway` as OpenAI's own Python client sees it, end to end: real gateway
processes in front of a real worker (the bundled model) on private streams of a real
Redis. Two workers serve the whole module (the second from the first test on; the
failover test kills one); each gateway is started once.

- `open`: no auth, in front of the worker;
- `locked`: the same, with bearer keys from a file and from the environment;
- `idle`: on a stream no worker serves, with a small backlog limit and a short reply
  timeout (429s and 504s);
- `no_redis`: pointed at a port where no Redis listens.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import jsonschema
import msgpack
import openai
import pytest

from bench.fleet import PROMPT, Fleet
from bench.processes import GatewayProcess
from service.config import DEFAULT_MODEL_NAME
from tests.fleet_jobs import gateways_in_front, queue_events
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = DEFAULT_MODEL_NAME
KEYS = ("sk-file-key", "sk-env-key")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("gateway")
    fleet = Fleet(logs)
    fleet.start("a")
    streams = ["--redis-url", fleet.url, "--requests-stream", fleet.stream, "--control-stream", fleet.control]
    (logs / "keys").write_text(f"# one key a line\n{KEYS[0]}\n\n")
    gateways = {
        "open": GatewayProcess("open", streams, logs),
        "locked": GatewayProcess(
            "locked", [*streams, "--api-keys-file", str(logs / "keys")], logs, env={"INFLIGHT_API_KEYS": KEYS[1]}
        ),
    }
    idle_flags = ("--max-queue-age-s", "1", "--retry-after-s", "3")
    with gateways_in_front(fleet, logs, gateways, *idle_flags) as idle_stream:
        fleet.start("b")  # for the failover test; it loads while the first tests run
        yield fleet, gateways, idle_stream


@pytest.fixture(scope="module")
def fleet(stack):
    return stack[0]


@pytest.fixture(scope="module")
def gateways(stack):
    return stack[1]


def client(gateway: GatewayProcess, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a 429 or a 5xx is what the test looks at, not something to ride out.
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=120)


def straight_to_the_queue(fleet: Fleet, **job) -> tuple[str, dict]:
    """The same job sent to the queue without the gateway: its text and done event."""
    events = queue_events(fleet, **job)
    return "".join(e["text"] for e in events if e["type"] == "token") + events[-1]["text"], events[-1]


def metric(gateway: GatewayProcess, name: str) -> float:
    """An unlabelled sample of the gateway's /metrics."""
    with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(f"{name} ")))


def reply_events(fleet: Fleet, request_id: str) -> list[dict]:
    fleet.request_ids.append(request_id)
    return [msgpack.unpackb(fields[b"data"]) for _, fields in fleet.client.xrange(fleet.reply(request_id))]


# -- answers ---------------------------------------------------------------------------------


def test_a_chat_completion_whole_and_streamed_is_the_greedy_answer_the_queue_gives(fleet, gateways):
    want, done = straight_to_the_queue(fleet, messages=CHAT, max_tokens=12)

    whole = client(gateways["open"]).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.model == MODEL
    [choice] = whole.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        want,
        done["finish_reason"],
    )
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        done["usage"]["prompt_tokens"],
        done["usage"]["completion_tokens"],
    )

    chunks = list(
        client(gateways["open"]).chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done["usage"]["completion_tokens"]
    assert len({c.id for c in chunks}) == 1


def test_a_text_completion_whole_and_streamed_is_the_greedy_answer_the_queue_gives(fleet, gateways):
    prompt = "The capital of France is"
    want, done = straight_to_the_queue(fleet, prompt=prompt, max_tokens=10, ignore_eos=True)
    api = client(gateways["open"])

    whole = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.object == "text_completion"
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want, "length")
    assert whole.usage.completion_tokens == 10

    streamed = list(
        api.completions.create(
            model=MODEL,
            prompt=[prompt],
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "priority": 5},
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"


def test_n_choices_come_back_each_under_its_index(gateways):
    answer = client(gateways["open"]).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, n=2, temperature=0
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].text == answer.choices[1].text  # greedy: the same text twice
    assert answer.usage.completion_tokens == 10


# -- structured outputs and logprobs ---------------------------------------------------------

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_response_format_and_inflight_constraints_shape_the_answer(gateways):
    api = client(gateways["open"])
    shaped = api.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": CITY, "strict": True}},
    )
    assert shaped.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(shaped.choices[0].message.content), CITY)

    any_json = api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=48, temperature=0, response_format={"type": "json_object"}
    )
    if any_json.choices[0].finish_reason == "stop":
        json.loads(any_json.choices[0].message.content)

    chosen = api.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer yes or no:",
        max_tokens=8,
        temperature=0,
        extra_body={"choice": ["yes", "no"]},
    )
    assert chosen.choices[0].text in ("yes", "no") and chosen.choices[0].finish_reason == "stop"
    digits = api.completions.create(
        model=MODEL, prompt="Two plus two is", max_tokens=8, temperature=0, extra_body={"regex": "[0-9]{1,2}"}
    )
    assert digits.choices[0].text.isdigit()

    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"regex": "(unclosed"})
    assert bad.value.body["code"] == "invalid_grammar"


def test_logprobs_come_back_in_openai_shapes_as_the_worker_computed_them(fleet, gateways):
    api = client(gateways["open"])
    events = [
        e
        for e in queue_events(
            fleet, messages=CHAT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
        )
        if e["type"] == "token"
    ]
    want = [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]]) for e in events]

    whole = api.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = whole.choices[0].logprobs.content
    assert [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs]) for t in content] == want
    assert all(bytes(t.bytes) == t.token.encode() for t in content)

    chunks = list(
        api.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(token, logprob) for token, logprob, _ in want]

    text = api.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(
        len(top) == 3 and max(top.values()) >= chosen
        for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


# -- errors ----------------------------------------------------------------------------------


def test_bad_parameters_are_400s_an_unknown_model_a_404_each_saying_why(gateways):
    api = client(gateways["open"])
    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert unknown.value.body["code"] == "model_not_found"

    for params, words in (
        ({"temperature": -1}, "temperature"),  # the queue's own check, before anything is queued
        ({"top_p": 0}, "top_p"),
        ({"top_logprobs": 2}, "top_logprobs is only allowed when logprobs is true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"max_tokens": 100_000}, "context"),  # the engine's check, in the worker
        ({"extra_body": {"priority": 11}}, "priority"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            api.chat.completions.create(model=MODEL, messages=CHAT, **params)
        assert words in bad.value.body["message"], (params, bad.value.body)
        assert bad.value.body["type"] == "invalid_request_error"

    with pytest.raises(openai.BadRequestError):  # streamed: still a status, before any event
        list(api.completions.create(model=MODEL, prompt="x", max_tokens=100_000, stream=True))


def test_health_says_whether_redis_answers(gateways):
    with urllib.request.urlopen(f"{gateways['open'].url}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok", "redis": "ok"}
    with pytest.raises(urllib.error.HTTPError) as down:
        urllib.request.urlopen(f"{gateways['no_redis'].url}/health", timeout=10)
    assert down.value.code == 503 and json.loads(down.value.read())["status"] == "unavailable"
    with pytest.raises(openai.InternalServerError) as refused:  # 503: nothing was queued
        client(gateways["no_redis"]).completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert refused.value.status_code == 503


# -- disconnects, backpressure, timeouts -----------------------------------------------------


def test_a_client_that_disconnects_mid_stream_cancels_its_job_within_a_step(fleet, gateways):
    with client(gateways["open"]).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        request_id = stream.response.headers["x-request-id"]
        for _, _ in zip(range(3), stream):
            pass
        worker = fleet.workers[fleet.owner(request_id)]
    published_at_disconnect = fleet.client.xlen(fleet.reply(request_id))
    wait_until(lambda: fleet.finished(request_id), 30, "the cancelled job's final event")
    done = reply_events(fleet, request_id)[-1]
    assert done["finish_reason"] == "cancelled"
    # The step running at the disconnect ends; the cancel lands before the one after.
    assert done["usage"]["completion_tokens"] <= published_at_disconnect + 2
    wait_until(
        lambda: worker.metrics()[("inflight_kv_cache_blocks", (("pool", "device"), ("state", "used")))] == 0,
        10,
        "the job's KV blocks freed",
    )


def test_a_full_or_stale_queue_answers_429_with_retry_after_and_queues_nothing(fleet, gateways):
    idle, stream = gateways["idle"], f"{fleet.prefix}:idle"
    api = client(idle)
    for _ in range(3):  # over the depth limit of 2: jobs no worker takes
        fleet.client.xadd(stream, {"prompt": "x"})
    wait_until(lambda: metric(idle, "inflight_gateway_queue_depth_entries") == 3, 10, "a backlog lookup")
    with pytest.raises(openai.RateLimitError) as full:
        api.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert full.value.response.headers["retry-after"] == "3"
    assert "3 waiting jobs" in full.value.body["message"]
    assert fleet.client.xlen(stream) == 3

    fleet.client.xtrim(stream, maxlen=1, approximate=False)  # one job, soon older than the age limit of 1 s
    wait_until(
        lambda: (
            metric(idle, "inflight_gateway_queue_depth_entries") == 1
            and metric(idle, "inflight_gateway_queue_age_seconds") > 1
        ),
        10,
        "the job to age",
    )
    with pytest.raises(openai.RateLimitError) as stale:
        api.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert "oldest waiting job" in stale.value.body["message"]
    fleet.client.delete(stream)
    wait_until(lambda: metric(idle, "inflight_gateway_queue_depth_entries") == 0, 10, "the backlog to clear")


def test_a_job_no_worker_takes_is_answered_504_after_the_reply_timeout_and_cancelled(fleet, gateways):
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as timed_out:
        client(gateways["idle"]).completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert timed_out.value.status_code == 504 and timed_out.value.body["code"] == "reply_timeout"
    assert 1.5 <= time.monotonic() - started < 10
    request_id = timed_out.value.response.headers["x-request-id"].encode()
    # Cancelled, so no worker that comes up later runs it for nobody.
    assert {b"type": b"cancel", b"id": request_id} in [fields for _, fields in fleet.client.xrange(fleet.control)]
    fleet.client.delete(f"{fleet.prefix}:idle")


# -- auth --------------------------------------------------------------------------------------


def test_with_keys_only_a_known_bearer_key_gets_in_and_no_key_is_logged(gateways):
    locked = gateways["locked"]
    for bad_key in ("unused", "sk-file-keyX"):
        with pytest.raises(openai.AuthenticationError) as refused:
            client(locked, bad_key).models.list()
        assert refused.value.body["code"] == "invalid_api_key"
    for key in KEYS:  # one from the file, one from the environment
        assert [m.id for m in client(locked, key).models.list()] == [MODEL]
    answer = client(locked, KEYS[0]).completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2
    with urllib.request.urlopen(f"{locked.url}/health", timeout=10) as response:  # probes need no key
        assert response.status == 200
    log = locked.log_path.read_text()
    assert '"gateway_started"' in log and '"auth": "2 key(s)"' in log
    assert not any(key in log for key in KEYS)
    # Without keys, anyone gets in.
    assert [m.id for m in client(gateways["open"], "anything").models.list()] == [MODEL]


def test_the_gateway_counts_requests_by_route_and_status(gateways):
    with urllib.request.urlopen(f"{gateways['open'].url}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'inflight_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'inflight_gateway_requests_total{route="/v1/chat/completions",status="404"}' in text
    assert 'inflight_gateway_cancels_total{reason="disconnect"} 1.0' in text
    assert "inflight_gateway_time_to_first_token_seconds_count" in text


# -- failover ----------------------------------------------------------------------------------


def test_a_worker_dying_mid_stream_is_only_a_pause_to_the_client(fleet, gateways):
    """Last: it kills one of the module's two workers."""
    fleet.wait_until_serving("b")
    want, _ = straight_to_the_queue(fleet, prompt=PROMPT, max_tokens=24, ignore_eos=True)
    texts, killed = [], None
    with client(gateways["open"]).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        request_id = stream.response.headers["x-request-id"]
        for chunk in stream:
            texts.append(chunk.choices[0].text)
            if len(texts) == 5:
                killed = fleet.owner(request_id)
                fleet.workers[killed].kill()
    events = reply_events(fleet, request_id)
    assert killed is not None and events[-1]["worker"] not in ("", killed)  # the survivor finished it
    assert "".join(texts) == want
    assert events[-1]["usage"]["completion_tokens"] == 24
