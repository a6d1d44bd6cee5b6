"""Six places the docs once left silent (issue 40), each held as README.md, docs/protocol.md,
docs/gateway.md and docs/operations.md now say, against the real thing: a real worker (the
bundled model) and real gateways on private streams of a real Redis, as tests/service/test_gateway.py
runs them.

- `locked`: in front of the worker, with a bearer key;
- `idle`: on a stream no worker serves, a backlog limit of 2 and a short reply timeout;
- `no_redis`: pointed at a port where no Redis listens.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
import uuid
from itertools import accumulate
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet import PROMPT, Fleet
from bench.processes import GatewayProcess
from service.config import DEFAULT_MODEL_NAME
from tests.fleet_jobs import gateways_in_front, queue_events
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

# The metrics table lives in docs/operations.md ("Observability"), which the README links to.
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
MODEL = DEFAULT_MODEL_NAME
KEY = "sk-contract"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# The same chat as a plain prompt: the bundled model's template, its default system prompt first.
CHAT_AS_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
# SmolLM2's added tokens, every one marked special: <|endoftext|>, <|im_start|>, <|im_end|>, ...
SPECIAL = range(17)
EOS, IM_START = 2, 1


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("contract")
    fleet = Fleet(logs)
    fleet.start("a")
    gateways = {
        "locked": GatewayProcess(
            "locked",
            ["--redis-url", fleet.url, "--requests-stream", fleet.stream, "--control-stream", fleet.control],
            logs,
            env={"INFLIGHT_API_KEYS": KEY},
        ),
    }
    with gateways_in_front(fleet, logs, gateways, "--max-queue-age-s", "0") as idle_stream:
        yield fleet, gateways, idle_stream


@pytest.fixture(scope="module")
def fleet(stack):
    return stack[0]


@pytest.fixture(scope="module")
def gateways(stack):
    return stack[1]


def client(gateway: GatewayProcess) -> openai.OpenAI:
    # No retries: the status is what the tests look at.
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def http(
    gateway: GatewayProcess, path: str, body=None, raw=None, method: str = "POST", key: str | None = KEY
) -> tuple[int, dict, dict]:
    """One plain HTTP call: status, headers (lower-case names) and the JSON body. `raw`
    bytes go as they are; an iterable of bytes goes chunked."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{gateway.url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, head, payload = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, head, payload = error.code, error.headers, error.read()
    return status, {name.lower(): value for name, value in head.items()}, json.loads(payload)


# -- 1. special tokens -----------------------------------------------------------------------


def test_special_tokens_such_as_eos_read_as_empty_text_wherever_text_appears(fleet, gateways):
    ended = queue_events(fleet, messages=CHAT, max_tokens=32, logprobs=True)
    *_, last, done = ended
    # The end-of-sequence token that ends the request is a token event like any other.
    assert (last["token_ids"], last["text"], last["token"], done["finish_reason"]) == ([EOS], "", "", "stop")
    assert done["usage"]["completion_tokens"] == len(ended) - 1

    # Past it (ignore_eos), the model writes the chat template's markers: empty, everywhere.
    events = queue_events(fleet, messages=CHAT, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
    tokens = events[:-1]
    special = [e for e in tokens if e["token_ids"][0] in SPECIAL]
    assert {EOS, IM_START} <= {e["token_ids"][0] for e in special}
    assert all(e["text"] == e["token"] == "" for e in special)
    assert all(top["token"] == "" for e in tokens for top in e["top_logprobs"] if top["token_id"] in SPECIAL)
    assert any(top["token_id"] in SPECIAL for e in tokens for top in e["top_logprobs"])
    text = "".join(e["text"] for e in tokens) + events[-1]["text"]
    assert text == "".join(e["token"] for e in tokens) and "<|" not in text  # whole characters: text = tokens' texts

    api = client(gateways["locked"])
    chat = api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == text
    assert [(t.token, t.bytes) for t in chat.choices[0].logprobs.content] == [
        (e["token"], list(e["token"].encode())) for e in tokens
    ]
    completion = api.completions.create(
        model=MODEL, prompt=CHAT_AS_PROMPT, max_tokens=12, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == text
    assert completion.choices[0].logprobs.tokens == [e["token"] for e in tokens]


# -- 2. X-Request-Id --------------------------------------------------------------------------


def test_x_request_id_is_the_job_id_so_its_reply_stream_can_be_read_and_cancelled_directly(fleet, gateways):
    api = client(gateways["locked"])
    raw = api.completions.with_raw_response.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    request_id, answer = raw.headers["x-request-id"], raw.parse()
    fleet.request_ids.append(request_id)
    assert answer.id == f"cmpl-{request_id}"
    events = fleet.events(request_id)  # inflight:out:{<X-Request-Id>}
    assert "".join(e["text"] for e in events) == answer.choices[0].text
    assert events[-1]["usage"]["completion_tokens"] == answer.usage.completion_tokens == 6

    raw = api.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    fleet.request_ids.append(raw.headers["x-request-id"])
    assert raw.parse().id == f"chatcmpl-{raw.headers['x-request-id']}"

    # A cancel on the control stream with that id ends the job, and the answer with it.
    chunks = []
    with api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        request_id = stream.response.headers["x-request-id"]
        fleet.request_ids.append(request_id)
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 2:
                fleet.client.xadd(fleet.control, {"type": "cancel", "id": request_id})
    assert chunks[-1].choices[0].finish_reason == "cancelled"
    done = fleet.events(request_id)[-1]
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < 400

    # Nothing queued, no id.
    status, headers, _ = http(gateways["locked"], "/v1/completions", {"model": "gpt-4o", "prompt": "x"})
    assert status == 404 and "x-request-id" not in headers


# -- 3. metric names ---------------------------------------------------------------------------


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """The docs' Observability table (docs/operations.md): metric name -> (type, labels)."""
    section = OPERATIONS.read_text().split("## Observability", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(inflight_\w+)` \| (\w+) \|([^|]*)\|", section, re.M)
    assert len(rows) == len({name for name, _, _ in rows}), "a metric listed twice"
    return {name: (kind, frozenset(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def exported_metrics(url: str) -> dict[str, tuple[str, frozenset[str]]]:
    """A real /metrics, named as the docs name them: counters with `_total`; the
    `_created` series prometheus_client adds to counters and histograms left out."""
    with urllib.request.urlopen(url, timeout=10) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    kinds = {family.name: family.type for family in families}
    exported = {}
    for family in families:
        base = family.name.removesuffix("_created")
        if family.name != base and kinds.get(base) in ("counter", "histogram"):
            continue
        # Every family has samples by now: labels are read from them.
        assert family.samples, f"{family.name}: no samples, so its labels cannot be compared"
        name = f"{family.name}_total" if family.type == "counter" else family.name
        exported[name] = (family.type, frozenset(k for s in family.samples for k in s.labels) - {"le"})
    return exported


def test_the_docs_list_every_metric_the_worker_and_the_gateway_export_and_no_other(fleet, gateways):
    # Traffic first, so that every labelled metric has a series to read its labels from.
    answer = client(gateways["locked"]).completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2
    bad = f"{fleet.prefix}-bad-{uuid.uuid4().hex[:6]}"
    fleet.request_ids.append(bad)
    fleet.client.xadd(fleet.stream, {"id": bad, "prompt": "x", "max_tokens": "lots"})  # a dead letter
    wait_until(lambda: fleet.finished(bad), 30, "the bad job's error event")

    worker = exported_metrics(f"http://127.0.0.1:{fleet.workers['a'].metrics_port}/metrics")
    gateway = exported_metrics(f"{gateways['locked'].url}/metrics")
    assert not any(name.startswith("inflight_gateway_") for name in worker)
    assert all(name.startswith("inflight_gateway_") for name in gateway)
    documented = documented_metrics()
    exported = {**worker, **gateway}
    assert {n: m for n, m in exported.items() if documented.get(n) != m} == {}, "exported, not as documented"
    assert {n: m for n, m in documented.items() if exported.get(n) != m} == {}, "documented, not exported"


# -- 4. completions logprobs -------------------------------------------------------------------


def test_completions_top_logprobs_is_null_as_a_whole_at_k_0_and_text_offset_counts_from_the_completion(gateways):
    api = client(gateways["locked"])
    job = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    raw = api.completions.with_raw_response.create(**job, logprobs=0)
    choice = json.loads(raw.http_response.text)["choices"][0]
    assert "top_logprobs" in choice["logprobs"] and choice["logprobs"]["top_logprobs"] is None

    answer = api.completions.create(**job, logprobs=2)
    text, logprobs = answer.choices[0].text, answer.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 6 and all(len(top) == 2 for top in logprobs.top_logprobs)
    # From 0 at the completion's first character, the prompt not counted; each token's
    # text sits at its offset (whole characters here, so each token's text is its own).
    assert logprobs.text_offset == list(accumulate((len(t) for t in logprobs.tokens[:-1]), initial=0))
    assert all(
        text[offset : offset + len(token)] == token for offset, token in zip(logprobs.text_offset, logprobs.tokens)
    )

    chunks = list(api.completions.create(**job, logprobs=0, stream=True))
    streamed = [offset for c in chunks if c.choices[0].logprobs for offset in c.choices[0].logprobs.text_offset]
    assert streamed == logprobs.text_offset  # runs on across chunks


# -- 5. error codes on HTTP --------------------------------------------------------------------


def test_each_http_error_carries_the_code_the_gateway_docs_give_it(fleet, gateways):
    locked, idle = gateways["locked"], gateways["idle"]
    floats = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [0.5] * 200_000}}}
    cases = [  # (route, body, key) -> (status, code, param)
        (("/v1/models", None, None), (401, "invalid_api_key", None)),
        (("/v1/completions", {"model": MODEL, "prompt": "x"}, "sk-wrong"), (401, "invalid_api_key", None)),
        (("/v1/completions", {"model": "gpt-4o", "prompt": "x"}, KEY), (404, "model_not_found", "model")),
        (("/v1/completions", {"model": MODEL, "prompt": "x", "foo": 1}, KEY), (400, None, "foo")),
        (("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, KEY), (400, None, "echo")),
        (
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, KEY),
            (400, None, "messages[0]"),
        ),
        (("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, KEY), (400, "invalid_field", None)),
        (("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, KEY), (400, "invalid_field", None)),
        (("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, KEY), (400, "invalid_type", None)),
        (
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100_000}, KEY),
            (400, "invalid_request", None),
        ),
        (
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "regex": "(unclosed"}, KEY),
            (400, "invalid_grammar", None),
        ),
        # Under 1 MiB as JSON, over it as msgpack (each 0.5 takes 9 bytes there).
        (
            ("/v1/completions", {"model": MODEL, "prompt": "x", "response_format": floats}, KEY),
            (413, "too_large", None),
        ),
    ]
    for (path, body, key), want in cases:
        status, _, answer = http(locked, path, body, method="GET" if body is None else "POST", key=key)
        error = answer["error"]
        assert (status, error["code"], error["param"]) == want, (path, body, answer)
        assert error["type"] == "invalid_request_error"

    for call, want in (
        (dict(raw=b"{"), 400),  # not JSON
        # The body itself over 1 MiB. Chunked, so the gateway reads it all before answering:
        # with a Content-Length it answers at once, and the upload may meet a closed socket.
        (dict(raw=iter([b" " * ((1 << 20) + 1)])), 413),
        (dict(body={}, path="/v1/nowhere"), 404),
        (dict(method="GET"), 405),
    ):
        status, _, answer = http(locked, call.pop("path", "/v1/completions"), **call)
        assert (status, answer["error"]["code"]) == (want, None)

    # The idle gateway: no worker takes its jobs.
    status, headers, answer = http(idle, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert (status, answer["error"]["code"], answer["error"]["type"]) == (504, "reply_timeout", "server_error")
    assert "x-request-id" in headers
    idle_stream = f"{fleet.prefix}:idle"
    for _ in range(2):  # with the timed-out job, 3 wait: over the limit of 2
        fleet.client.xadd(idle_stream, {"prompt": "x"})
    wait_until(
        lambda: (
            b"inflight_gateway_queue_depth_entries 3.0"
            in urllib.request.urlopen(f"{idle.url}/metrics", timeout=10).read()
        ),
        10,
        "the gateway to see the backlog",
    )
    status, headers, answer = http(idle, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert (status, answer["error"]["code"], answer["error"]["type"]) == (429, "queue_full", "rate_limit_error")
    assert "retry-after" in headers and "x-request-id" not in headers
    fleet.client.delete(idle_stream)

    status, _, answer = http(gateways["no_redis"], "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert (status, answer["error"]["code"], answer["error"]["type"]) == (503, "queue_unavailable", "server_error")


def test_a_developer_message_is_rendered_as_a_system_message(fleet, gateways):
    said = "Answer in French."
    want = queue_events(
        fleet, messages=[{"role": "system", "content": said}, {"role": "user", "content": "Hi"}], max_tokens=8
    )
    answer = client(gateways["locked"]).chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": said, "name": "ops"}, {"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
    )
    assert answer.usage.prompt_tokens == want[-1]["usage"]["prompt_tokens"]
    assert answer.choices[0].message.content == "".join(e["text"] for e in want)


# -- 6. tokens per event with n > 1 -----------------------------------------------------------


def test_with_n_above_1_every_token_event_still_carries_one_token_in_one_gapless_seq(fleet):
    # A prompt that prompt lookup drafts well, so a step may take several tokens of a
    # choice (whether drafts pay depends on measured step times: not asserted).
    events = queue_events(fleet, prompt=PROMPT, max_tokens=40, ignore_eos=True, n=3)
    tokens, done = events[:-1], events[-1]
    assert all(e["type"] == "token" and len(e["token_ids"]) == 1 for e in tokens)
    assert [e["seq"] for e in tokens] == list(range(120))
    assert sorted(e["index"] for e in tokens) == [i for i in range(3) for _ in range(40)]
    assert [c["completion_tokens"] for c in done["choices"]] == [40] * 3
    assert done["usage"]["completion_tokens"] == len(tokens)
