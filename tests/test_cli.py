"""`make run`'s command: the demo streams answers from the in-process engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_streams_an_answer_to_a_chat_prompt():
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "demo", "--prompt", "What is the capital of France?", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "[chat] What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout
    assert "tokens, first token" in result.stdout


def test_worker_process_serves_a_job_and_exits_cleanly_on_sigterm():
    import signal
    import time
    import uuid

    import redis

    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    stream, dead, reply = f"{prefix}:requests", f"{prefix}:dead", f"inflight:out:{{{prefix}-job}}"
    client = redis.Redis(host="127.0.0.1", port=6379)
    client.xadd(stream, {"id": f"{prefix}-job", "prompt": "The capital of France is", "max_tokens": "6"})
    worker = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "worker", "--requests-stream", stream, "--dead-letter-stream", dead,
         "--consumer", "cli-test", "--kv-memory-mb", "128", "--swap-memory-mb", "16", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not any(f[b"type"] == b"done" for _, f in client.xrange(reply)):
            time.sleep(0.2)
        replies = client.xrange(reply)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
        client.delete(stream, dead, reply)
        client.close()
    types = [f[b"type"] for _, f in replies]
    assert types == [b"token"] * 6 + [b"done"], worker.stdout.read()
    assert "Paris" in "".join(f[b"text"].decode() for _, f in replies)


def test_a_killed_workers_request_is_finished_by_another_with_every_seq_once():
    import os
    import signal
    import time
    import uuid

    import msgpack
    import redis

    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    stream, dead, reply = f"{prefix}:requests", f"{prefix}:dead", f"inflight:out:{{{prefix}-job}}"
    client = redis.Redis(host="127.0.0.1", port=6379)

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker", "--requests-stream", stream, "--dead-letter-stream",
             dead, "--consumer", name, "--claim-idle-ms", "1500", "--kv-memory-mb", "128", "--swap-memory-mb", "16", "--metrics-port", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    first = start("first")
    second = None
    try:
        client.xadd(stream, {"id": f"{prefix}-job", "prompt": "List the numbers from 1 to 300, comma separated:",
                             "max_tokens": "120"})
        deadline = time.time() + 240
        while time.time() < deadline and client.xlen(reply) < 5:
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # mid-stream, its entry still pending
        first.wait(timeout=30)
        killed_at = client.xlen(reply)
        second = start("second")
        while time.time() < deadline and not any(f[b"type"] == b"done" for _, f in client.xrange(reply)):
            time.sleep(0.2)
        replies = [msgpack.unpackb(f[b"data"]) for _, f in client.xrange(reply)]
        pending = client.xpending(stream, "inflight")["pending"]
    finally:
        for worker in (first, second):
            if worker is not None:
                worker.kill()
                worker.wait()
        client.delete(stream, dead, reply)
        client.close()
    tokens = [r for r in replies if r["type"] == "token"]
    assert 5 <= killed_at < len(tokens)  # the second worker published the rest
    assert [t["seq"] for t in tokens] == list(range(len(tokens)))  # every seq once, in order
    assert replies[-1]["type"] == "done" and replies[-1]["usage"]["completion_tokens"] == len(tokens) <= 120
    assert pending == 0


def test_submit_streams_the_answer_from_a_worker_process():
    import uuid

    import redis

    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    worker = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "worker", "--requests-stream", stream, "--consumer", "submit-test",
         "--kv-memory-mb", "128", "--swap-memory-mb", "16", "--metrics-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        result = subprocess.run(
            [sys.executable, "-m", "service.cli", "submit", "What is the capital of France?", "--max-tokens", "12",
             "--priority", "3", "--requests-stream", stream],
            capture_output=True, text=True, timeout=300, check=True,
        )
    finally:
        worker.kill()
        worker.wait()
        client = redis.Redis(host="127.0.0.1", port=6379)
        client.delete(stream)
        client.close()
    assert "Paris" in result.stdout
    assert "tokens, first token" in result.stderr
