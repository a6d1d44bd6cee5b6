"""LoRA adapters end to end (issue 60): one real worker process on private streams of a
real Redis, serving a tiny random llama checkpoint with two random PEFT adapters in its
`--lora-dir`, and a gateway in front of it. Jobs name an adapter (the SDK), the control
stream registers more while the worker serves (the SDK, `inflight load-adapter`, the
gateway's admin route), and the gateway reads `model` as an adapter's name.

The adapters are made as tests/workers/test_lora_engine.py makes them; that the tokens are
exactly PEFT's merged model's is that file's to check.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from bench.fleet import Fleet
from bench.processes import GatewayProcess
from service.adapters import registry_key
from service.cli import main as cli
from service.sdk import SyncClient
from tests.gpu.test_lora import ATTENTION, MLP, save_adapter
from tests.waiting import wait_until
from tests.workers.test_architectures import VOCAB, save_tiny_model
from workers.random_models import build_tokenizer

pytestmark = pytest.mark.slow

BASE = "tiny-llama"
PROMPT = "hello world"
JOB = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The worker (adapters `a` and `b` from its --lora-dir), its gateway, and a third
    adapter's folder (`c`) for registering while it runs."""
    folder = tmp_path_factory.mktemp("lora")
    model_dir = save_tiny_model("llama", folder / "model", build_tokenizer(VOCAB))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    save_adapter(base, folder / "adapters" / "a", 8, ["q_proj", "v_proj"], seed=0)
    save_adapter(base, folder / "adapters" / "b", 16, ATTENTION + MLP, seed=1)
    save_adapter(base, folder / "more" / "c", 8, MLP, seed=2)
    fleet = Fleet(tmp_path_factory.mktemp("logs"))
    fleet.start("w", "--model", str(model_dir), "--lora-dir", str(folder / "adapters"), "--max-context", "64")
    gateway = fleet.gateway("gw", "--served-model-name", BASE)
    try:
        fleet.wait_all()
        answer(fleet)  # answered: the worker follows the control stream (a load sent before is not read)
        yield fleet, gateway, folder / "more" / "c"
    finally:
        gateway.stop()
        fleet.client.delete(registry_key(fleet.stream))
        fleet.close()


def answer(fleet: Fleet, **job) -> dict:
    """The job's final event (its tokens in `token_ids`), sent with the SDK."""
    with SyncClient(fleet.url, requests_stream=fleet.stream, control_stream=fleet.control) as sdk:
        request_id = sdk.submit(request_id=f"{fleet.prefix}-{uuid.uuid4().hex[:8]}", **JOB, **job)
        fleet.request_ids.append(request_id)
        events = list(sdk.events(request_id))
    tokens = [t for e in events if e["type"] == "token" for t in e["token_ids"]]
    return {**events[-1], "token_ids": tokens}


def registry(fleet: Fleet) -> set[str]:
    return {name.decode() for name in fleet.client.hkeys(registry_key(fleet.stream))}


def worker_metric(fleet: Fleet, name: str, **labels: str) -> float:
    """One sample of the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.workers['w'].metrics_port}/metrics", timeout=10) as answer:
        families = text_string_to_metric_families(answer.read().decode())
    return next(s.value for f in families for s in f.samples if s.name == name and s.labels == labels)


def http(gateway: GatewayProcess, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{gateway.url}{path}", data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_jobs_name_an_adapter_or_none_and_an_unknown_one_is_refused_alone(stack):
    fleet, _, _ = stack
    base, a, b = answer(fleet), answer(fleet, adapter="a"), answer(fleet, adapter="b")
    assert [e["type"] for e in (base, a, b)] == ["done"] * 3
    assert all(len(e["token_ids"]) == JOB["max_tokens"] for e in (base, a, b))
    assert base["token_ids"] != a["token_ids"] or base["token_ids"] != b["token_ids"]  # the adapters change it
    unknown = answer(fleet, adapter="nope")
    assert (unknown["type"], unknown["code"]) == ("error", "unknown_adapter")
    assert answer(fleet)["token_ids"] == base["token_ids"]  # the worker serves on, as before
    assert registry(fleet) == {"a", "b"}


def test_the_control_stream_registers_an_adapter_and_a_bad_one_is_logged_only(stack, capsys):
    fleet, _, c_folder = stack
    assert cli(["load-adapter", "c", str(c_folder), "--redis-url", fleet.url, "--control-stream", fleet.control]) == 0
    wait_until(lambda: "c" in registry(fleet), 60, "the worker to list adapter c")
    assert answer(fleet, adapter="c")["type"] == "done"
    submit = ["submit", PROMPT, "--raw", "--max-tokens", "2", "--adapter", "c", "--redis-url", fleet.url]
    assert cli([*submit, "--requests-stream", fleet.stream]) == 0
    assert "(length: 2 tokens" in capsys.readouterr().err
    with SyncClient(fleet.url, requests_stream=fleet.stream, control_stream=fleet.control) as sdk:
        sdk.load_adapter("bad", str(c_folder.parent / "missing"))
    wait_until(lambda: "adapter_not_loaded" in fleet.log("w"), 60, "the worker to log the bad adapter")
    assert "bad" not in registry(fleet)
    assert answer(fleet, adapter="bad")["code"] == "unknown_adapter"
    assert answer(fleet)["type"] == "done"
    assert not fleet.dead_workers()
    assert worker_metric(fleet, "inflight_adapter_load_requests_total", outcome="loaded") == 1
    assert worker_metric(fleet, "inflight_adapter_load_requests_total", outcome="failed") == 1
    assert worker_metric(fleet, "inflight_adapter_load_seconds_count") == 1
    assert worker_metric(fleet, "inflight_loaded_adapters") == 3
    assert worker_metric(fleet, "inflight_adapter_requests_total", adapter="c") == 2
    assert worker_metric(fleet, "inflight_adapter_requests_total", adapter="(unknown)") >= 1
    assert worker_metric(fleet, "inflight_adapter_tokens_total", adapter="c", kind="output") == JOB["max_tokens"] + 2


def test_the_gateway_lists_adapters_and_serves_a_model_that_names_one(stack):
    fleet, gateway, c_folder = stack
    status, ack = http(gateway, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(c_folder)})
    assert (status, ack["status"]) == (200, "requested")
    wait_until(lambda: "d" in registry(fleet), 60, "the worker to list adapter d")
    status, models = http(gateway, "/v1/models")
    listed = {m["id"]: m.get("parent") for m in models["data"]}
    assert status == 200 and listed[BASE] is None and listed["a"] == listed["b"] == listed["d"] == BASE
    completion = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    base_status, base = http(gateway, "/v1/completions", {**completion, "model": BASE})
    status, via_a = http(gateway, "/v1/completions", {**completion, "model": "a"})
    assert (base_status, status, via_a["model"]) == (200, 200, "a")
    assert via_a["choices"][0]["text"] == answer_text(fleet, "a")
    status, error = http(gateway, "/v1/completions", {**completion, "model": "nope"})
    assert (status, error["error"]["code"]) == (404, "model_not_found")
    status, error = http(gateway, "/v1/load_lora_adapter", {"lora_name": "two words", "lora_path": "/x"})
    assert (status, error["error"]["param"]) == (400, "lora_name")
    status, error = http(gateway, "/v1/load_lora_adapter", {"lora_name": "e"})
    assert (status, error["error"]["param"]) == (400, "lora_path")


def answer_text(fleet: Fleet, adapter: str) -> str:
    """The same job's text straight from the queue."""
    with SyncClient(fleet.url, requests_stream=fleet.stream, control_stream=fleet.control) as sdk:
        request_id = sdk.submit(request_id=f"{fleet.prefix}-{uuid.uuid4().hex[:8]}", adapter=adapter, **JOB)
        fleet.request_ids.append(request_id)
        events = list(sdk.events(request_id))
    return "".join(e["text"] for e in events if e["type"] == "token") + events[-1]["text"]
