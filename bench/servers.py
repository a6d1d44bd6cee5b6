"""The systems as servers, each a context that starts it, yields its URL and settings, and
stops it on the way out (on an error, and on SIGTERM/SIGHUP inside `signals_as_exit`)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench import peer_vllm
from bench.fleet import BACKPRESSURE_OFF, Fleet, model_flags
from bench.processes import RedisServer, answers_http, free_port, start_reaper, stop_reaper, wait_for
from bench.report import say
from service.config import DEFAULT_MODEL_NAME

VLLM_STOP_WAIT_S = 30.0


@contextlib.contextmanager
def inflight_server(args: argparse.Namespace, log_dir: Path, start_timeout_s: float = 600.0) -> Iterator[dict]:
    """A private redis-server, one worker and one gateway (backpressure off): the gateway's URL."""
    with RedisServer(log_dir / "redis", appendonly=False) as redis:
        worker_argv = ["--redis-url", redis.url, *model_flags(args), "--weights", args.weights, "--no-prefix-caching"]
        worker_argv += ["--no-speculative"] if args.speculation == "off" else []
        worker_argv += shlex.split(args.serve_worker_args)
        reaper = start_reaper([str(redis.process.pid)])
        # The default streams (inflight:requests, ...), as a deployment's.
        with Fleet(log_dir, redis.url, "inflight", worker_argv[2:], graceful=True, reap=True) as fleet:
            try:
                worker = fleet.start("serve")
                timeout = ("--reply-timeout-s", str(args.serve_request_timeout_s))
                gateway = fleet.gateway("serve", *timeout, *BACKPRESSURE_OFF)
                worker.wait_ready(start_timeout_s)
                gateway.wait_ready()
                yield {"url": gateway.url, "worker_argv": worker_argv}
            finally:
                stop_reaper(reaper)


def vllm_command(python: Path, folder: str, dtype: str, port: int, max_model_len: int) -> list[str]:
    options = {"--model": folder, "--served-model-name": DEFAULT_MODEL_NAME, "--dtype": dtype, "--host": "127.0.0.1",
               "--port": str(port), "--max-model-len": str(max_model_len), "--seed": "0"}  # fmt: skip
    server = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    return [*server, *(word for option in options.items() for word in option), "--no-enable-prefix-caching"]


@contextlib.contextmanager
def vllm_server(
    python: Path, folder: str, dtype: str, max_model_len: int, log_dir: Path, start_timeout_s: float
) -> Iterator[dict]:
    """vLLM's OpenAI server in a session of its own, so that its whole process group (API
    server, EngineCore) gets SIGTERM, then SIGKILL, at the end (and is reaped on SIGKILL)."""
    port = free_port()
    command = vllm_command(python, folder, dtype, port, max_model_len)
    environment = peer_vllm.environment("both-cores")
    log_path = log_dir / "vllm.log"
    with open(log_path, "w") as log:
        # Its own cwd: the repository's top-level packages must not shadow anything vLLM imports.
        process = subprocess.Popen(
            command, cwd=log_dir, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    reaper = start_reaper([f"-{process.pid}"])
    say(f"serve vllm: process group {process.pid}, log {log_path}")
    try:
        url = f"http://127.0.0.1:{port}"
        late = f"was not healthy in {start_timeout_s:.0f} s"

        def failed() -> str:
            why = late if process.poll() is None else f"exited with {process.returncode}"
            return f"vLLM's server {why}:\n{log_path.read_text(errors='replace')[-4000:]}"

        healthy = functools.partial(answers_http, f"{url}/health", timeout_s=5, healthy=True)
        wait_for(healthy, process, start_timeout_s, failed, interval_s=1.0)
        with urllib.request.urlopen(f"{url}/version", timeout=10) as response:
            version = json.loads(response.read()).get("version")
        yield {"url": url, "command": command, "vllm": version, "environment": peer_vllm.reported(environment)}
    finally:
        _kill_group(process)
        stop_reaper(reaper)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left of it, even once the leader is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=VLLM_STOP_WAIT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=VLLM_STOP_WAIT_S)


@contextlib.contextmanager
def signals_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit, so the servers' `finally` blocks still run."""

    def leave(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    previous = {number: signal.signal(number, leave) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
