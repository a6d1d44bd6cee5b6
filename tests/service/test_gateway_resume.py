"""Resumable streams (docs/gateway.md, "Resuming a stream"), end to end: real gateway
processes in front of a real worker on private streams of a real Redis, read as raw
server-sent events. A stream cut by a gateway's SIGKILL continues at another gateway
from the client's `Last-Event-ID`, every chunk once; `GET /v1/streams/{id}` replays an
answer; a gateway with a grace keeps a job whose client comes back."""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench.fleet import PROMPT, Fleet
from bench.http_client import ServerSentEvents
from bench.processes import GatewayProcess
from service.config import DEFAULT_MODEL_NAME
from service.gateway.errors import APIError
from service.gateway.resume import event_id, read_event_id
from tests.fleet_jobs import queue_events
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

IDS = {"X-Inflight-Event-Ids": "1"}
TEXT = {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
TEXT |= {"stream": True, "stream_options": {"include_usage": True}}
CHAT = {**TEXT, "messages": [{"role": "user", "content": PROMPT}]}
del CHAT["prompt"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("resume")
    fleet = Fleet(logs)
    fleet.start("a")
    streams = ["--redis-url", fleet.url, "--requests-stream", fleet.stream, "--control-stream", fleet.control]
    gateways = {
        "doomed": GatewayProcess("doomed", streams, logs),
        "other": GatewayProcess("other", streams, logs),
        "patient": GatewayProcess("patient", [*streams, "--resume-grace-s", "3"], logs),
    }
    for gateway in gateways.values():
        gateway.start()
    try:
        for gateway in gateways.values():
            gateway.wait_ready()
        fleet.wait_until_serving("a")
        yield fleet, gateways
    finally:
        for gateway in gateways.values():
            gateway.stop()
        for card in fleet.client.scan_iter(f"{fleet.stream}:gateway:stream:*"):
            fleet.client.delete(card)
        fleet.close()


@pytest.fixture(scope="module")
def fleet(stack):
    return stack[0]


@pytest.fixture(scope="module")
def gateways(stack):
    return stack[1]


@contextmanager
def request(method: str, gateway: GatewayProcess, path: str, body: dict | None = None, headers: dict | None = None):
    """One HTTP request, its response read as it comes; leaving closes the connection."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port)
    try:
        data = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        yield connection.getresponse()
    finally:
        connection.close()


def status(method: str, gateway: GatewayProcess, path: str, body: dict | None = None, headers: dict | None = None):
    with request(method, gateway, path, body, headers) as response:
        return response.status, json.loads(response.read() or b"null"), response.getheader("x-request-id")


def events_of(response: http.client.HTTPResponse) -> Iterator[tuple[str | None, str]]:
    """A server-sent event stream as (id, data) pairs, as an SSE client parses it."""
    assert response.status == 200, response.read()
    parser = ServerSentEvents()
    for raw in response:
        if (event := parser.feed(raw)) is not None:
            yield event


def text_of(events: list[tuple[str | None, str]]) -> str:
    chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
    return "".join(
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
        for c in chunks
        if c["choices"]
    )


def test_event_ids_name_the_request_and_order_the_answer():
    positions = [(0, 0), (0, 9), (0, 10), (1, 0), (1, 2)]
    ids = [event_id("3f2a", p).decode() for p in positions]
    assert ids == ["3f2a-0", "3f2a-9", "3f2a-10", "3f2a-end0", "3f2a-end2"]
    assert [read_event_id(i) for i in ids] == [("3f2a", p) for p in positions]
    assert positions == sorted(positions)
    for bad in ("", "3f2a", "3f2a-", "-7", "3f2a-endx", "3f2a-1.5"):
        with pytest.raises(APIError) as raised:
            read_event_id(bad)
        assert raised.value.status == 400


def test_a_stream_cut_by_a_dead_gateway_goes_on_at_another_exactly(fleet, gateways):
    events = queue_events(fleet, prompt=PROMPT, max_tokens=24, ignore_eos=True)
    want = "".join(e["text"] for e in events if e["type"] == "token") + events[-1]["text"]

    first: list[tuple[str | None, str]] = []
    with request("POST", gateways["doomed"], "/v1/completions", TEXT, IDS) as cut:
        request_id = cut.getheader("x-request-id")
        for event in events_of(cut):
            first.append(event)
            if len(first) == 5:
                gateways["doomed"].process.kill()  # SIGKILL: it cancels nothing
                break
    fleet.request_ids.append(request_id)

    resumed = {**IDS, "Last-Event-ID": first[-1][0]}
    with request("POST", gateways["other"], "/v1/completions", TEXT, resumed) as rest:
        assert rest.getheader("x-request-id") == request_id
        second = list(events_of(rest))

    whole = first + second
    positions = [read_event_id(i)[1] for i, _ in whole]
    assert positions == sorted(set(positions))  # every event once, in order
    assert text_of(whole) == want
    assert whole[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in whole if d != "[DONE]"]
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [24]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1  # as if one gateway sent it all
    assert fleet.events(request_id)[-1]["finish_reason"] == "length"  # nothing cancelled it


def test_an_answer_is_replayed_whole_or_after_an_id_and_ids_are_sent_only_when_asked(fleet, gateways):
    other = gateways["other"]
    with request("POST", other, "/v1/chat/completions", CHAT) as plain:
        assert all(i is None for i, _ in events_of(plain))  # no ids unless asked
    with request("POST", other, "/v1/chat/completions", CHAT, IDS) as original:
        request_id = original.getheader("x-request-id")
        answer = list(events_of(original))
    fleet.request_ids.append(request_id)
    assert json.loads(answer[0][1])["choices"][0]["delta"]["role"] == "assistant"

    # From the start, by the request id or by the answer's id, at any gateway: the same events.
    for name in (request_id, f"chatcmpl-{request_id}"):
        with request("GET", gateways["patient"], f"/v1/streams/{name}") as again:
            assert list(events_of(again)) == answer
    # After the third event: the rest (the first of them with no role: it came before).
    with request("GET", other, f"/v1/streams/{request_id}", headers={"Last-Event-ID": answer[2][0]}) as rest:
        assert list(events_of(rest)) == answer[3:]
    # After the last token, by the same POST again: only the ending.
    ending = [event for event in answer if "-end" in event[0]]
    last_token = answer[-len(ending) - 1][0]
    with request("POST", other, "/v1/chat/completions", CHAT, {"Last-Event-ID": last_token}) as rest:
        assert list(events_of(rest)) == ending


def test_streams_unknown_foreign_or_unstreamed_are_404s_and_a_bad_event_id_a_400(fleet, gateways):
    other = gateways["other"]
    assert status("GET", other, "/v1/streams/no-such-request")[0] == 404
    code, body, _ = status("POST", other, "/v1/completions", TEXT, {"Last-Event-ID": "whatever"})
    assert code == 400 and body["error"]["param"] == "Last-Event-ID"

    acme = {**IDS, "X-Inflight-Tenant": "acme"}
    with request("POST", other, "/v1/completions", TEXT, acme) as owned:
        request_id = owned.getheader("x-request-id")
        assert list(events_of(owned))[-1][1] == "[DONE]"
    fleet.request_ids.append(request_id)
    with request("GET", other, f"/v1/streams/{request_id}", headers=acme) as again:
        assert list(events_of(again))[-1][1] == "[DONE]"
    assert status("GET", other, f"/v1/streams/{request_id}", headers={"X-Inflight-Tenant": "globex"})[0] == 404
    elsewhere = {"Last-Event-ID": f"{uuid.uuid4().hex}-3", **acme}
    assert status("GET", other, f"/v1/streams/{request_id}", headers=elsewhere)[0] == 400

    unstreamed = {k: v for k, v in TEXT.items() if k not in ("stream", "stream_options")}
    code, _, whole_id = status("POST", other, "/v1/completions", unstreamed)
    fleet.request_ids.append(whole_id)
    assert code == 200 and status("GET", other, f"/v1/streams/{whole_id}")[0] == 404


def test_with_a_grace_a_client_that_comes_back_keeps_its_job_and_one_that_does_not_is_cancelled(fleet, gateways):
    patient = gateways["patient"]
    long = {**TEXT, "max_tokens": 200}  # longer than the grace
    request_ids = []
    for comes_back in (True, False):
        with request("POST", patient, "/v1/completions", long, IDS) as cut:
            request_id = cut.getheader("x-request-id")
            first = [event for event, _ in zip(events_of(cut), range(3))]
        request_ids.append(request_id)
        fleet.request_ids.append(request_id)
        if comes_back:
            with request("POST", patient, "/v1/completions", long, {"Last-Event-ID": first[-1][0]}) as rest:
                assert list(events_of(rest))[-1][1] == "[DONE]"
    kept, left = request_ids
    assert fleet.events(kept)[-1]["finish_reason"] == "length"
    assert fleet.events(kept)[-1]["usage"]["completion_tokens"] == 200
    wait_until(lambda: fleet.finished(left), 30, "the abandoned job's end")
    assert fleet.events(left)[-1]["finish_reason"] == "cancelled"
