"""Failover between worker processes on a real Redis: a worker that dies is taken over
on its lease, and a worker that only paused cannot write once it lost the job. Either
way each reply stream holds every seq once, the greedy tokens of one uninterrupted run,
and one final event."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import msgpack
import pytest
import redis

from tests.conftest import run_to_completion
from workers.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "List the numbers from 1 to 300, comma separated:"
MAX_TOKENS = 80


class Fleet:
    """Worker processes on private streams of the shared Redis."""

    def __init__(self, tmp_path) -> None:
        self.prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
        self.stream, self.dead = f"{self.prefix}:requests", f"{self.prefix}:dead"
        self.control = f"{self.prefix}:control"
        self.client = redis.Redis(host="127.0.0.1", port=6379)
        self.logs = tmp_path
        self.workers: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        self.workers[name] = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker", "--redis-url", "redis://127.0.0.1:6379",
             "--requests-stream", self.stream, "--dead-letter-stream", self.dead, "--control-stream", self.control,
             "--consumer", name, "--kv-memory-mb", "64", "--swap-memory-mb", "16", "--max-running-requests", "4",
             "--metrics-port", "0", "--log-format", "json"],
            stdout=open(self.logs / f"{name}.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return self.workers[name]

    def wait_until_serving(self, name: str, timeout_s: float = 120) -> None:
        deadline = time.time() + timeout_s
        while "worker_started" not in (self.logs / f"{name}.log").read_text():
            assert time.time() < deadline and self.workers[name].poll() is None, self.log(name)
            time.sleep(0.1)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def reply(self, request_id: str) -> str:
        return f"inflight:out:{{{request_id}}}"

    def owner(self, request_id: str) -> str | None:
        value = self.client.get(f"{self.reply(request_id)}:owner")
        return value.decode().split()[1] if value else None

    def events(self, request_id: str) -> list[dict]:
        return [msgpack.unpackb(fields[b"data"]) for _, fields in self.client.xrange(self.reply(request_id))]

    def close(self, request_ids) -> None:
        for worker in self.workers.values():
            if worker.poll() is None:
                worker.send_signal(signal.SIGCONT)
                worker.kill()
            worker.wait()
        self.client.delete(self.stream, self.dead, self.control, *(self.reply(r) for r in request_ids),
                           *(f"{self.reply(r)}:owner" for r in request_ids))
        self.client.close()


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    ids: list[str] = []
    fleet.request_ids = ids
    yield fleet
    fleet.close(ids)


@pytest.fixture(scope="module")
def greedy_tokens(smollm2):
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.engine import Engine

    engine = Engine(smollm2, EngineConfig(model=ModelConfig(), cache=CacheConfig(kv_memory_bytes=64 << 20)))
    results = run_to_completion(engine, {0: [("ref", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]})
    return results["ref"][0]


def submit(fleet: Fleet, count: int) -> list[str]:
    ids = [f"{fleet.prefix}-{i}" for i in range(count)]
    fleet.request_ids.extend(ids)
    for request_id in ids:
        fleet.client.xadd(fleet.stream, {"id": request_id, "prompt": PROMPT, "max_tokens": str(MAX_TOKENS),
                                         "ignore_eos": "true"})
    return ids


def wait_for(condition, timeout_s: float = 120, poll_s: float = 0.02):
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(poll_s)


def assert_well_formed(events: list[dict], greedy: list[int]) -> None:
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["seq"] for e in tokens] == list(range(len(tokens)))  # every seq once, in order
    assert [t for e in tokens for t in e["token_ids"]] == greedy  # as if never interrupted
    assert [e["type"] for e in events[len(tokens):]] == ["done"]
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_killed_workers_jobs_resume_on_the_live_worker_within_seconds(fleet, greedy_tokens):
    for name in ("a", "b"):
        fleet.start(name)
    for name in ("a", "b"):
        fleet.wait_until_serving(name)
    ids = submit(fleet, 4)
    wait_for(lambda: all(fleet.client.xlen(fleet.reply(r)) >= 3 for r in ids))
    victims = [r for r in ids if fleet.owner(r) == "a"]
    assert victims, "both workers should hold jobs"
    published = {r: fleet.client.xlen(fleet.reply(r)) for r in victims}
    fleet.workers["a"].send_signal(signal.SIGKILL)
    killed = time.time()
    resumed = {}
    while len(resumed) < len(victims):
        for r in victims:
            if r not in resumed and fleet.client.xlen(fleet.reply(r)) > published[r]:
                resumed[r] = time.time() - killed
        assert time.time() - killed < 60, "not taken over"
        time.sleep(0.02)
    wait_for(lambda: all(fleet.events(r) and fleet.events(r)[-1]["type"] == "done" for r in ids))
    for r in ids:
        assert_well_formed(fleet.events(r), greedy_tokens)
    assert all(fleet.events(r)[-1]["worker"] == "b" for r in victims)
    # The lease is claim_idle_ms (2 s); resuming also waits for b's next look and a prefill.
    # The soak benchmark reports the figures; this bound only catches a return to 30 s stalls.
    assert max(resumed.values()) < 10, resumed
    assert fleet.client.xlen(fleet.stream) == 0 and fleet.client.xlen(fleet.dead) == 0


def test_a_paused_worker_that_lost_its_job_stops_writing_when_it_wakes(fleet, greedy_tokens):
    fleet.start("a")
    fleet.wait_until_serving("a")
    [request_id] = submit(fleet, 1)
    wait_for(lambda: fleet.client.xlen(fleet.reply(request_id)) >= 3)
    fleet.workers["a"].send_signal(signal.SIGSTOP)  # paused mid-stream, not dead
    fleet.start("b")
    wait_for(lambda: fleet.owner(request_id) == "b", timeout_s=120)
    wait_for(lambda: fleet.client.xlen(fleet.reply(request_id)) >= 20)
    fleet.workers["a"].send_signal(signal.SIGCONT)  # it wakes up believing it still serves the job
    wait_for(lambda: fleet.events(request_id)[-1]["type"] == "done")
    time.sleep(1.0)  # anything a still wrote would be there by now
    assert_well_formed(fleet.events(request_id), greedy_tokens)
    assert fleet.events(request_id)[-1]["worker"] == "b"
    wait_for(lambda: "lease_lost" in fleet.log("a"), timeout_s=10)
    assert fleet.workers["a"].poll() is None  # it goes on serving other jobs
