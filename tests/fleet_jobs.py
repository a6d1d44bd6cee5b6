"""What the tests check of a fleet (bench/fleet.py): the fleet job's greedy tokens from
one uninterrupted in-process run, a reply stream well formed against them, gateways in
front of a fleet, and a job sent straight to its queue."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

from bench.fleet import MAX_TOKENS, PROMPT, Fleet
from bench.processes import GatewayProcess, free_port
from service.sdk import SyncClient


def greedy_reference(loaded) -> list[int]:
    """The fleet job's greedy tokens from one uninterrupted in-process run."""
    from bench.drive import Driver
    from workers.api import SamplingParams
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.engine import Engine

    engine = Engine(loaded, EngineConfig(model=ModelConfig(), cache=CacheConfig(kv_memory_bytes=64 << 20)))
    driver = Driver(engine, raise_errors=False)
    driver.drain({0: [("ref", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]})
    return driver.tokens.get("ref", [])


def assert_well_formed(events: list[dict], greedy: list[int]) -> None:
    """Every seq once, in order; the greedy tokens as if never interrupted; one done."""
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["seq"] for e in tokens] == list(range(len(tokens)))
    assert [t for e in tokens for t in e["token_ids"]] == greedy
    assert [e["type"] for e in events[len(tokens) :]] == ["done"]
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS


@contextlib.contextmanager
def gateways_in_front(fleet: Fleet, logs: Path, gateways: dict[str, GatewayProcess], *idle_flags: str) -> Iterator[str]:
    """`gateways` (on the fleet's streams), plus `idle`, on a stream no worker serves, with
    a backlog limit of 2, a 1.5 s reply timeout and `idle_flags`, and `no_redis`, pointed
    at a port where no Redis listens; all started and ready, worker `a` serving. Yields
    the idle stream; stops the gateways and closes the fleet after."""
    idle_stream = f"{fleet.prefix}:idle"
    idle = ["--redis-url", fleet.url, "--requests-stream", idle_stream, "--control-stream", fleet.control]
    idle += ["--max-queue-depth", "2", "--queue-poll-s", "0.05", "--reply-timeout-s", "1.5"]
    gateways["idle"] = GatewayProcess("idle", [*idle, *idle_flags], logs)
    gateways["no_redis"] = GatewayProcess("no_redis", ["--redis-url", f"redis://127.0.0.1:{free_port()}"], logs)
    for gateway in gateways.values():
        gateway.start()
    try:
        for gateway in gateways.values():
            gateway.wait_ready()
        fleet.wait_until_serving("a")
        yield idle_stream
    finally:
        for gateway in gateways.values():
            gateway.stop()
        fleet.client.delete(idle_stream)
        fleet.close()


def queue_events(fleet: Fleet, **job) -> list[dict]:
    """A job sent straight to the fleet's queue, without a gateway: its reply events, up
    to the final one (which must be `done`)."""
    with SyncClient(fleet.url, requests_stream=fleet.stream, control_stream=fleet.control) as sdk:
        request_id = sdk.submit(request_id=f"{fleet.prefix}-direct-{uuid.uuid4().hex[:8]}", **job)
        fleet.request_ids.append(request_id)
        events = list(sdk.events(request_id))
    assert events[-1]["type"] == "done", events[-1]
    return events
