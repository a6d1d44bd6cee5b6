"""Worker processes on private streams of a real Redis, one server or a cluster: the
fleet that `tests/service/test_failover.py` and `tests/service/test_cluster.py` drive, the job they
send, and what its reply stream must hold; and the gateways that `tests/service/test_gateway.py`
and `tests/service/test_contract_silences.py` put in front of it."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack

from bench.processes import GatewayProcess, WorkerProcess, free_port
from service.connect import connect_sync
from service.sdk import SyncClient

PROMPT = "List the numbers from 1 to 300, comma separated:"
MAX_TOKENS = 80


class Fleet:
    """`inflight worker` processes sharing private request, control and dead-letter
    streams on the Redis at `url` (`redis+cluster://` for a cluster); `client` is a
    blocking client of the same kind."""

    def __init__(self, log_dir: Path, url: str = "redis://127.0.0.1:6379") -> None:
        self.url = url
        self.prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
        self.stream, self.dead = f"{self.prefix}:requests", f"{self.prefix}:dead"
        self.control = f"{self.prefix}:control"
        self.client = connect_sync(url, socket_timeout=30)
        self.logs = Path(log_dir)
        self.workers: dict[str, WorkerProcess] = {}
        self.request_ids: list[str] = []  # submitted: deleted at the end
        self._issued = 0

    def start(self, name: str) -> WorkerProcess:
        worker = self.workers.get(name) or WorkerProcess(
            name,
            [
                "--redis-url",
                self.url,
                "--requests-stream",
                self.stream,
                "--dead-letter-stream",
                self.dead,
                "--control-stream",
                self.control,
                "--kv-memory-mb",
                "64",
                "--swap-memory-mb",
                "16",
                "--max-running-requests",
                "4",
                "--log-format",
                "json",
                # Workers share the machine's cores: one torch thread each, or their OpenMP
                # teams outnumber the cores and every step slows down many times over.
                "--threads",
                "1",
            ],
            self.logs,
        )
        self.workers[name] = worker
        worker.start()
        return worker

    def wait_until_serving(self, name: str, timeout_s: float = 120) -> None:
        self.workers[name].wait_ready(timeout_s)

    def log(self, name: str) -> str:
        return self.workers[name].log_path.read_text(errors="replace")

    @staticmethod
    def reply(request_id: str) -> str:
        return f"inflight:out:{{{request_id}}}"

    def owner(self, request_id: str) -> str | None:
        """The consumer name in the reply stream's owner key: who writes it now."""
        value = self.client.get(f"{self.reply(request_id)}:owner")
        return value.decode().split()[1] if value else None

    def events(self, request_id: str) -> list[dict]:
        return [msgpack.unpackb(fields[b"data"]) for _, fields in self.client.xrange(self.reply(request_id))]

    def finished(self, request_id: str) -> bool:
        events = self.events(request_id)
        return bool(events) and events[-1]["type"] in ("done", "error")

    def submit(self, ids: list[str], **fields: str) -> list[str]:
        """The fleet's job (PROMPT, MAX_TOKENS greedy tokens) under each id; `fields`
        override or add to it."""
        self.request_ids.extend(ids)
        for request_id in ids:
            self.client.xadd(
                self.stream,
                {"id": request_id, "prompt": PROMPT, "max_tokens": str(MAX_TOKENS), "ignore_eos": "true", **fields},
            )
        return ids

    def new_ids(self, count: int) -> list[str]:
        """Request ids never handed out before by this fleet."""
        self._issued += count
        return [f"{self.prefix}-{i}" for i in range(self._issued - count, self._issued)]

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.alive():
                worker.process.send_signal(signal.SIGCONT)  # a paused one too
                worker.kill()
        replies = [self.reply(r) for r in self.request_ids]
        for key in [self.stream, self.dead, self.control, *replies, *(f"{reply}:owner" for reply in replies)]:
            self.client.delete(key)  # one key at a time: on a cluster they live in many slots
        self.client.close()


def greedy_reference(loaded) -> list[int]:
    """The fleet job's greedy tokens from one uninterrupted in-process run."""
    from tests.conftest import run_to_completion
    from workers.api import SamplingParams
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.engine import Engine

    engine = Engine(loaded, EngineConfig(model=ModelConfig(), cache=CacheConfig(kv_memory_bytes=64 << 20)))
    results = run_to_completion(engine, {0: [("ref", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]})
    return results["ref"][0]


def assert_well_formed(events: list[dict], greedy: list[int]) -> None:
    """Every seq once, in order; the greedy tokens as if never interrupted; one done."""
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["seq"] for e in tokens] == list(range(len(tokens)))
    assert [t for e in tokens for t in e["token_ids"]] == greedy
    assert [e["type"] for e in events[len(tokens) :]] == ["done"]
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS


@contextmanager
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
