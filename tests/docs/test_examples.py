"""The producer examples in docs/examples (redis-cli, Node.js) run against a real worker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import pytest
import redis

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture(scope="module")
def worker_env():
    """A worker process on private streams; the environment that points the examples at it."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    requests, dead = f"{prefix}:requests", f"{prefix}:dead"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "worker",
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--requests-stream",
            requests,
            "--dead-letter-stream",
            dead,
            "--control-stream",
            f"{prefix}:control",
            "--consumer",
            "examples-test",
            "--kv-memory-mb",
            "128",
            "--swap-memory-mb",
            "16",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379", "INFLIGHT_REQUESTS": requests}
    worker.kill()
    worker.wait()
    client = redis.Redis(host="127.0.0.1", port=6379)
    client.delete(
        requests, dead, f"{prefix}:control", *client.keys("inflight:out:{shell-*"), *client.keys("inflight:out:{node-*")
    )
    client.close()


def test_the_redis_cli_example_streams_an_answer(worker_env):
    result = subprocess.run(
        ["bash", str(EXAMPLES / "redis-cli.sh"), "The capital of France is"],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "(length: 16 tokens)" in result.stdout


def test_the_node_example_streams_an_answer(worker_env):
    node = EXAMPLES / "node"
    assert (node / "node_modules").is_dir(), "`make test` installs the example's packages (npm ci)"
    result = subprocess.run(
        [shutil.which("node") or "node", "generate.mjs", "What is the capital of France?"],
        cwd=node,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens)" in result.stdout


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def _answer(stdout: str) -> dict:
    """The JSON answer printed before the example's closing `(stop: N tokens)` line."""
    text, _, status = stdout.rpartition("\n(")
    assert status.startswith("stop:"), stdout
    return json.loads(text)


def test_the_redis_cli_example_sends_a_constrained_job(worker_env):
    result = subprocess.run(
        ["bash", str(EXAMPLES / "redis-cli.sh"), "Name a city and its country as JSON.", "", json.dumps(CITY_SCHEMA)],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    jsonschema.validate(_answer(result.stdout), CITY_SCHEMA)


def test_the_node_example_sends_a_constrained_job(worker_env, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(CITY_SCHEMA))
    result = subprocess.run(
        [
            shutil.which("node") or "node",
            "generate.mjs",
            "Name a city and its country as JSON.",
            "--json-schema",
            str(schema),
        ],
        cwd=EXAMPLES / "node",
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    jsonschema.validate(_answer(result.stdout), CITY_SCHEMA)
