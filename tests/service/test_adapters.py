"""LoRA adapters at the edge, without a model: the job's `adapter` field decoded (flat and
typed) and refused when malformed, the SDK's and the CLI's checks, the control message,
the gateway reading `model` as the base model or an adapter (service/adapters.py), and
the worker's loader taking each control entry up once (on a real Redis)."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
import redis.asyncio as aioredis

from service.adapter_loader import AdapterLoader
from service.adapters import load_message, registry_key
from service.config import GatewayConfig
from service.gateway.errors import QUEUE_ERRORS, APIError
from service.gateway.openai_api import CHAT, names_another_model, read_request
from service.metrics import Metrics
from service.protocol import ProtocolError, decode_job
from service.sdk import job_payload
from service.submit_command import _adapter_name


def flat(**fields) -> dict[bytes, bytes]:
    return {k.encode(): str(v).encode() for k, v in fields.items()}


def test_a_job_names_its_adapter_flat_or_typed_and_none_is_the_base_model():
    assert decode_job("1-0", flat(prompt="a", adapter="sql-v2/ft@7:b_c.d")).adapter == "sql-v2/ft@7:b_c.d"
    typed = decode_job("2-0", {b"payload": msgpack.packb({"prompt": "a", "adapter": "x" * 128})})
    assert typed.adapter == "x" * 128
    assert decode_job("3-0", flat(prompt="a")).adapter is None


@pytest.mark.parametrize(
    "fields",
    [
        flat(prompt="a", adapter=""),
        flat(prompt="a", adapter="two words"),
        flat(prompt="a", adapter="x" * 129),
        {b"payload": msgpack.packb({"prompt": "a", "adapter": 7})},
        {b"payload": msgpack.packb({"prompt": "a", "adapter": None})},
    ],
)
def test_a_malformed_adapter_is_invalid_field_with_its_reply_stream_known(fields):
    with pytest.raises(ProtocolError) as raised:
        decode_job("9-0", fields)
    assert raised.value.code == "invalid_field"
    assert "adapter must be 1-128 characters" in raised.value.message
    assert raised.value.reply_to == "inflight:out:{9-0}"


def test_the_sdk_and_the_cli_refuse_a_malformed_adapter_before_sending():
    payload = msgpack.unpackb(job_payload("a", None, "r1", adapter="sql")["payload"])
    assert payload == {"id": "r1", "prompt": "a", "adapter": "sql"}
    with pytest.raises(ValueError, match="adapter must be"):
        job_payload("a", None, "r1", adapter="no spaces")
    assert _adapter_name("sql") == "sql"
    with pytest.raises(Exception, match="adapter must be"):
        _adapter_name("no spaces")


def test_the_control_message_and_the_registry_key():
    assert load_message("sql", "/adapters/sql") == {"type": "load_adapter", "name": "sql", "path": "/adapters/sql"}
    with pytest.raises(ValueError, match="adapter must be"):
        load_message("", "/adapters/sql")
    with pytest.raises(ValueError, match="path"):
        load_message("sql", "")
    # One Redis Cluster slot with the stream's other keys (the fair queue's `{stream}:...`).
    assert registry_key("inflight:requests") == "{inflight:requests}:adapters"


def test_the_gateway_reads_model_as_the_base_model_or_a_listed_adapter_else_a_404():
    config = GatewayConfig(model_name="base")
    body = {"model": "sql", "messages": [{"role": "user", "content": "hi"}]}
    assert names_another_model(body, config) and not names_another_model({**body, "model": "base"}, config)
    assert "adapter" not in read_request(CHAT, {**body, "model": "base"}, config, {"sql"}).job
    parsed = read_request(CHAT, body, config, {"sql": "/a/sql"})
    assert (parsed.model, parsed.job["adapter"]) == ("sql", "sql")
    decode_job("0-0", {"payload": parsed.payload("r1")})  # a job a worker takes
    with pytest.raises(APIError) as raised:
        read_request(CHAT, {**body, "model": "other"}, config, {"sql"})
    assert (raised.value.status, raised.value.code) == (404, "model_not_found")
    assert "`sql`" in raised.value.message
    assert QUEUE_ERRORS["unknown_adapter"][0] == 404


def test_a_load_read_twice_by_the_control_loop_and_a_catch_up_loads_once():
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"

    class Engine:  # what the loader needs of one: loads counted, no model
        adapters: list[str] = []

        def load_adapter(self, name: str, path: str) -> None:
            self.adapters.append(name)

    async def main() -> list[str]:
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        engine = Engine()
        loader = AdapterLoader(client, stream, engine, Metrics())  # type: ignore[arg-type]
        fields = {k.encode(): v.encode() for k, v in load_message("sql", "/adapters/sql").items()}
        for entry_id in (b"5-0", b"5-0", b"4-0", b"6-0"):  # 5-0 twice; 4-0 older than one taken up
            loader.request(entry_id, fields)
        await asyncio.wait(loader._loading)
        listed = await client.hgetall(registry_key(stream))
        await client.delete(registry_key(stream))
        await client.aclose()
        assert listed == {b"sql": b"/adapters/sql"}
        return engine.adapters

    assert asyncio.run(main()) == ["sql", "sql"]  # 5-0 and 6-0
