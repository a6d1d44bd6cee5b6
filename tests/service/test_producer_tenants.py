"""The producer side of tenants and load shedding (docs/protocol.md, "Tenants, batch jobs
and admission"): the SDK and `inflight submit` send `tenant` and `batch`; the gateway
takes a request's tenant from its API key or its `X-Inflight-Tenant` header and answers a
worker's refusal for load (`queue_full`, `quota_exceeded`) with 429 and `Retry-After`.

Against a real Redis, with the real gateway app served in-process by uvicorn. No model:
a fake worker takes each job off the request stream and writes the reply events a real
one would (`service.protocol`'s own builders), so the tests see exactly what was queued.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import msgpack
import openai
import pytest
import redis
import uvicorn

from bench.processes import free_port
from service.cli import main
from service.config import DEFAULT_MODEL_NAME, GatewayConfig
from service.gateway.app import Gateway
from service.protocol import DEFAULT_TENANT, Job, decode_job, done_fields, error_fields, token_fields
from service.sdk import Client, SyncClient, job_payload
from tests.waiting import wait_until
from workers.api import FinalEvent, FinishReason, Timings, Usage

URL = "redis://127.0.0.1:6379"
MODEL = DEFAULT_MODEL_NAME
BOUND_KEY, UNBOUND_KEY = "sk-acme-key", "sk-any-tenant-key"


class FakeWorker:
    """Takes jobs off the request stream in order, as a worker would (and deletes them,
    so an empty stream means nothing was queued), and answers each with given events."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self.client, self.stream = client, stream
        self.last = "0"
        self.reply_streams: list[str] = []
        self._pool = ThreadPoolExecutor(1)

    def next_job(self, *replies: dict) -> Future[tuple[Job, dict]]:
        """The next job, decoded, with its raw payload; its reply stream then gets
        `replies` (reply entries' fields), each under the id a worker would give it."""
        return self._pool.submit(self._answer, replies)

    def _answer(self, replies: tuple[dict, ...]) -> tuple[Job, dict]:
        [(_, [(entry_id, fields)])] = self.client.xread({self.stream: self.last}, count=1, block=10_000)
        self.last = entry_id
        self.client.xdel(self.stream, entry_id)
        job = decode_job(entry_id, fields)
        self.reply_streams.append(job.reply_to)
        tokens = 0
        for reply in replies:  # token seq s is entry `<s + 1>-0`; the final event after n tokens `<n>-1`
            tokens += reply["type"] == "token"
            self.client.xadd(job.reply_to, reply, id=f"{tokens}-{0 if reply['type'] == 'token' else 1}")
        return job, msgpack.unpackb(fields[b"payload"])

    def close(self) -> None:
        self._pool.shutdown()
        if self.reply_streams:
            self.client.delete(*self.reply_streams)


def answered(text: str = "Paris") -> tuple[dict, dict]:
    """A one-token answer and its done event."""
    final = FinalEvent("x", FinishReason.STOP, Usage(5, 1), Timings(0.0, 0.01, 0.02, (0.01,)))
    return token_fields(0, text, [42]), done_fields(final, worker="fake")


class InProcessGateway:
    """The real app (`Gateway(config).app()`) served by uvicorn on a free port, on an
    event loop in a thread of its own (lifespan on: the reply reader runs)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        app = Gateway(self.config).app()  # its Redis client is made on this loop
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.config.port, lifespan="on", log_config=None, access_log=False
        )
        self.server = uvicorn.Server(config)
        await self.server.serve()

    def __enter__(self) -> InProcessGateway:
        self.thread.start()
        wait_until(lambda: self.server is not None and self.server.started, 30, "the gateway to listen")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "unused", tenant: str | None = None) -> openai.OpenAI:
        # No retries: a 429 is what the tests look at, not something to ride out.
        headers = {"X-Inflight-Tenant": tenant} if tenant is not None else None
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.config.port}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=30,
            default_headers=headers,
        )


@pytest.fixture(scope="module")
def queue():
    """Private request and control streams, and a blocking client of their Redis."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(URL, socket_timeout=30)
    yield client, f"{prefix}:requests", f"{prefix}:control"
    client.delete(f"{prefix}:requests", f"{prefix}:control")
    client.close()


@pytest.fixture(scope="module")
def gateways(queue):
    """`locked`: bearer keys, one bound to tenant acme, one bound to none; `open`: no auth."""
    _, stream, control = queue
    settings = dict(requests_stream=stream, control_stream=control, redis_url=URL, max_queue_depth=0)
    locked = GatewayConfig(port=free_port(), api_keys={BOUND_KEY: "acme", UNBOUND_KEY: None}, **settings)
    opened = GatewayConfig(port=free_port(), **settings)
    with InProcessGateway(locked) as locked_gateway, InProcessGateway(opened) as open_gateway:
        yield {"locked": locked_gateway, "open": open_gateway}


@pytest.fixture
def worker(queue):
    client, stream, _ = queue
    fake = FakeWorker(client, stream)
    yield fake
    fake.close()


def complete(api: openai.OpenAI, stream: bool = False):
    """One text completion, read to its end."""
    answer = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, stream=stream)
    return list(answer) if stream else answer


# -- the gateway: whose job it is ----------------------------------------------------------


@pytest.mark.parametrize(
    "gateway, api_key, header, tenant",
    [
        ("locked", BOUND_KEY, None, "acme"),  # the key's tenant
        ("locked", BOUND_KEY, "acme", "acme"),  # the header may repeat it
        ("locked", UNBOUND_KEY, "globex", "globex"),  # an unbound key: the header's
        ("locked", UNBOUND_KEY, None, DEFAULT_TENANT),
        ("open", "unused", "initech", "initech"),  # no auth: the header's
        ("open", "unused", None, DEFAULT_TENANT),
    ],
)
def test_a_requests_tenant_is_its_keys_else_its_headers_else_the_default(
    gateways, worker, gateway, api_key, header, tenant
):
    taken = worker.next_job(*answered())
    answer = complete(gateways[gateway].client(api_key, header))
    assert answer.choices[0].text == "Paris"
    job, payload = taken.result(10)
    assert job.tenant == tenant
    # The default stays implicit, so the job reads the same to a worker older than tenants.
    assert ("tenant" in payload) == (tenant != DEFAULT_TENANT)


def test_a_key_bound_to_a_tenant_cannot_name_another_and_a_bad_name_is_refused(gateways, queue):
    client, stream, _ = queue
    with pytest.raises(openai.PermissionDeniedError) as other:
        complete(gateways["locked"].client(BOUND_KEY, "globex"))
    assert other.value.status_code == 403
    assert other.value.body["code"] == "tenant_not_allowed" and "acme" in other.value.body["message"]
    assert other.value.body["type"] == "invalid_request_error"

    for gateway, api_key in (("locked", UNBOUND_KEY), ("locked", BOUND_KEY), ("open", "unused")):
        for bad in ("two words", "a" * 65, "slash/name", "semi;colon"):
            with pytest.raises(openai.BadRequestError) as refused:
                complete(gateways[gateway].client(api_key, bad), stream=True)
            assert refused.value.body["code"] == "invalid_tenant", (gateway, bad)
            assert "X-Inflight-Tenant" in refused.value.body["message"]
    with pytest.raises(openai.AuthenticationError):  # the key is checked first: no hint to a stranger
        complete(gateways["locked"].client("sk-wrong", "acme"))
    assert client.xlen(stream) == 0  # nothing was queued


# -- the gateway: refusals for load ---------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "code, retry_after_s, retry_after",
    [("queue_full", 2.3, "3"), ("quota_exceeded", 0.2, "1"), ("quota_exceeded", 7, "7")],
)
def test_a_refusal_for_load_is_a_429_with_retry_after_in_whole_seconds_rounded_up(
    gateways, worker, stream, code, retry_after_s, retry_after
):
    message = f"tenant acme: {code}"
    taken = worker.next_job(error_fields(code, message, retry_after_s))
    with pytest.raises(openai.RateLimitError) as refused:
        complete(gateways["locked"].client(BOUND_KEY), stream=stream)
    response = refused.value.response
    assert response.status_code == 429
    assert response.headers["retry-after"] == retry_after
    assert refused.value.body == {"message": message, "type": "rate_limit_error", "param": None, "code": code}
    job, _ = taken.result(10)
    assert response.headers["x-request-id"] == job.request_id  # queued, then refused by the worker
    assert job.tenant == "acme"


# -- the SDK and `inflight submit` ------------------------------------------------------------


def test_the_sdk_sends_tenant_and_batch(queue, worker):
    client, stream, control = queue
    with SyncClient(URL, requests_stream=stream, control_stream=control) as sync:
        sync.submit("Hi", tenant="acme", batch=True)
        sync.submit("Hi")
    job, _ = worker.next_job().result(10)
    assert (job.tenant, job.batch) == ("acme", True)
    job, payload = worker.next_job().result(10)
    assert (job.tenant, job.batch) == (DEFAULT_TENANT, False) and "tenant" not in payload

    async def submit_async() -> None:
        async with Client(URL, requests_stream=stream, control_stream=control) as sdk:
            await sdk.submit(messages=[{"role": "user", "content": "Hi"}], tenant="team.a@example-1", batch=False)

    asyncio.run(submit_async())
    job, _ = worker.next_job().result(10)
    assert (job.tenant, job.batch) == ("team.a@example-1", False)

    for bad in ("", "two words", "a" * 65, 7):
        with pytest.raises(ValueError, match="tenant"):
            job_payload("Hi", None, "id-1", tenant=bad)
    assert client.xlen(stream) == 0


def test_inflight_submit_sends_tenant_and_batch_and_shows_when_to_retry(queue, worker, capsys):
    _, stream, _ = queue
    taken = worker.next_job(error_fields("quota_exceeded", "tenant acme is over its quota", 4.5))
    argv = ["submit", "Hi", "--tenant", "acme", "--batch", "--redis-url", URL, "--requests-stream", stream]
    assert main([*argv, "--timeout-s", "10"]) == 1
    job, _ = taken.result(10)
    assert (job.tenant, job.batch) == ("acme", True)
    assert "error quota_exceeded: tenant acme is over its quota (retry after 4.5 s)" in capsys.readouterr().err

    with pytest.raises(SystemExit) as usage:
        main(["submit", "Hi", "--tenant", "not a name"])
    assert usage.value.code == 2
    assert "--tenant: must be 1-64 characters" in capsys.readouterr().err
