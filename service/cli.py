"""The `inflight` command line.

inflight demo    run the engine in-process on sample prompts and stream the answers
inflight worker  serve jobs from a Redis stream (docs/protocol.md)
inflight submit  send one prompt through Redis and stream the answer
inflight load-adapter  ask every worker of a stream to load a LoRA adapter
inflight bench   the throughput/latency benchmark against peers, in one run
inflight health  whether the worker beside it serves (a container's healthcheck)
inflight gateway an OpenAI-compatible HTTP API onto the queue (service/gateway/)
inflight train-length-predictor  fit the output-length predictor to the model's own replies
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace

from service.config import RedisConfig, WorkerConfig
from service.flags import (
    add_engine_arguments,
    add_gateway_arguments,
    add_worker_arguments,
    engine_config_from_args,
    gateway_config_from_args,
    worker_config_from_args,
)
from service.submit_command import add_load_adapter_arguments, add_submit_arguments, run_load_adapter, run_submit

# The worker's exit status: 0 when it drained everything it held.
EXIT_CREDENTIALS = 2  # Redis refused the credentials
EXIT_PENDING_LEFT = 3  # stopped with jobs left pending for another worker (grace period over, or Redis away)
EXIT_FORCED = 130  # a second SIGINT or SIGTERM: stopped at once
# 1: could not start (one line says why); 4: a tensor-parallel rank is gone (workers/tensor_parallel.py)

SAMPLE_PROMPTS: list[tuple[str, str | list[dict]]] = [
    ("chat", [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]),
    ("chat", [{"role": "user", "content": "Write a haiku about the sea."}]),
    ("text", "The three primary colors are"),
    ("text", "def fibonacci(n):"),
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(argv).parse_args(argv)
    if args.command == "demo":
        return asyncio.run(_demo(args))
    if args.command == "worker":
        import uvloop

        return uvloop.run(_worker(args))
    if args.command == "submit":
        return run_submit(args)
    if args.command == "load-adapter":
        return run_load_adapter(args)
    if args.command == "health":
        return _health(args)
    if args.command == "gateway":
        import uvloop

        from service.gateway.server import serve

        return uvloop.run(serve(gateway_config_from_args(args)))
    if args.command == "train-length-predictor":
        from bench.length_training import run as train_length_predictor

        train_length_predictor(args)
        return 0
    from bench.main import run as run_bench

    run_bench(args)
    return 0


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    """The command line: one subcommand each, the bench's and the trainer's flags only
    when `argv` names them."""
    parser = argparse.ArgumentParser(
        prog="inflight", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="stream answers to sample prompts from the in-process engine")
    demo.add_argument("--prompt", action="append", help="a chat message to answer instead of the samples (repeatable)")
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--temperature", type=float, default=0.0)
    add_engine_arguments(demo)

    worker = commands.add_parser("worker", help="serve jobs from a Redis stream until SIGTERM")
    add_worker_arguments(worker)

    add_submit_arguments(commands.add_parser("submit", help="send a prompt through Redis and stream the answer"))
    add_load_adapter_arguments(
        commands.add_parser("load-adapter", help="ask every worker of a stream to load a LoRA adapter")
    )

    bench = commands.add_parser("bench", help="benchmark the engine against peers in one run")
    # Only for `inflight bench`: the benchmarks import torch (seconds), which the other
    # commands, `inflight health` every few seconds above all, need not pay for.
    if argv[:1] == ["bench"]:
        from bench.main import add_arguments as add_bench_arguments

        add_bench_arguments(bench)

    from service.health import add_health_arguments

    health = commands.add_parser(
        "health",
        help="exit 0 when the worker beside it serves: its metrics answer, "
        "Redis answers, and its consumer read from the stream just now",
    )
    add_health_arguments(health)

    gateway = commands.add_parser("gateway", help="serve the OpenAI API (chat and text completions) onto the queue")
    add_gateway_arguments(gateway)

    trainer = commands.add_parser(
        "train-length-predictor", help="fit the output-length predictor to the model's own replies to ShareGPT"
    )
    if argv[:1] == ["train-length-predictor"]:
        from bench.length_training import add_arguments as add_training_arguments

        add_training_arguments(trainer)
    return parser


async def _demo(args: argparse.Namespace) -> int:
    import uvloop

    from workers.api import FinalEvent, GenerationRequest, SamplingParams
    from workers.async_engine import AsyncEngine

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    config = engine_config_from_args(args)
    started = time.perf_counter()
    engine = await _load_engine("demo", config)
    if engine is None:
        return 1
    print(
        f"loaded in {time.perf_counter() - started:.1f} s; KV cache: {engine.allocator.num_blocks} blocks; "
        f"context: {engine.max_context} tokens",
        file=sys.stderr,
    )

    prompts = [("chat", [{"role": "user", "content": p}]) for p in args.prompt] if args.prompt else SAMPLE_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    async with AsyncEngine(engine) as front:
        # Submit everything at once so the engine batches it; print one answer at a time.
        streams = [
            front.submit_streamed(GenerationRequest(f"demo-{i}", prompt, params))
            for i, (_, prompt) in enumerate(prompts)
        ]
        for (kind, prompt), stream in zip(prompts, streams):
            shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]  # text, or the chat's last message
            print(f"\n\033[1m[{kind}] {shown}\033[0m")
            async for event in stream:
                if isinstance(event, FinalEvent):
                    print(event.text, end="")
                    t = event.timings
                    ttft = f"{t.first_token_s * 1000:.0f} ms" if t.first_token_s is not None else "-"
                    print(
                        f"\n\033[2m({event.finish_reason.value}: {event.usage.completion_tokens} tokens, "
                        f"first token {ttft}, total {t.total_s:.2f} s){event.error or ''}\033[0m"
                    )
                else:
                    print(event.text, end="", flush=True)
    return 0


def _health(args: argparse.Namespace) -> int:
    from service.health import check, health_config_from_args, report

    config = health_config_from_args(args)
    health = check(config)
    print(report(config, health), file=sys.stdout if health.healthy else sys.stderr)
    return 0 if health.healthy else 1


def _missing_gpu(device: str) -> str | None:
    """Why `--device cuda[:N]` cannot be served here, or None. Said in one line at the
    start, rather than as a CUDA traceback once the model loads (e.g. the CUDA image in a
    container given no GPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    suffix = device.partition(":")[2]
    index = int(suffix) if suffix.isdigit() else 0
    found = torch.cuda.device_count()
    if index < found:
        return None
    return (
        f"--device {device}, but this process sees {found} CUDA GPU(s): no NVIDIA driver, or no GPU given to "
        "this container. Use --device cpu; with docker compose on a machine without an NVIDIA GPU, start the "
        "CPU worker instead: COMPOSE_PROFILES=cpu docker compose up -d"
    )


async def _worker(args: argparse.Namespace) -> int:
    import contextlib
    import os

    from service.embedded import EmbeddedServerError, embedded_valkey

    missing_gpu = _missing_gpu(args.device)
    if missing_gpu:
        print(f"inflight worker: {missing_gpu}", file=sys.stderr)
        return 1
    with contextlib.ExitStack() as stack:
        try:
            url = args.redis_url or stack.enter_context(embedded_valkey(args.embedded_port, args.embedded_data_dir))
        except EmbeddedServerError as error:
            print(f"inflight worker: {error}", file=sys.stderr)
            return 1
        try:
            worker_config = worker_config_from_args(args, url)
        except ValueError as error:  # settings that do not go together
            print(f"inflight worker: {error}", file=sys.stderr)
            return 1
        status = await _serve(worker_config, embedded=not args.redis_url)
    # Served, logged, and the embedded server stopped: exit now. The interpreter's own
    # teardown (torch's) would only lengthen a stop bounded by the grace period.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


async def _serve(worker_config: WorkerConfig, embedded: bool) -> int:
    import structlog
    from redis.exceptions import AuthenticationError

    from service.connect import connect
    from service.ingest import client_name
    from service.metrics import Metrics, start_metrics_server
    from service.structured_logging import configure_logging
    from service.worker import Worker

    config, log_config, metrics_config = worker_config.redis, worker_config.logging, worker_config.metrics
    engine_config = worker_config.engine
    if worker_config.disagg.role != "both":  # a handoff moves one block table (workers/kv_cache.py)
        engine_config = replace(engine_config, cache=replace(engine_config.cache, trim_windows=False))
    configure_logging(log_config)
    log = structlog.get_logger("inflight.worker")
    metrics = Metrics(engine_config.scheduler)
    try:  # before loading the model, so a port in use fails fast
        server = (
            start_metrics_server(metrics_config.port, metrics.registry, metrics_config.host)
            if metrics_config.port
            else None
        )
    except OSError as error:
        log.error("metrics_port_unavailable", port=metrics_config.port, error=str(error))
        return 1
    stop = _stop_on_signals(log, config.shutdown_grace_s)
    engine = await _load_engine("worker", engine_config)
    if engine is None:
        return 1
    if stop.is_set():  # told to stop while loading
        return 0
    # A cluster client for a redis+cluster:// URL. Its connections carry the consumer's
    # name, so other workers see at once when this process dies (service/ingest.py).
    client = connect(config.url, block_ms=config.block_ms, client_name=client_name(config.consumer))
    _log_started(log, worker_config, embedded, engine)
    left: list[str] = []
    try:
        worker = Worker(
            engine,
            client,
            config,
            metrics,
            metrics_config.ingest_poll_s,
            log_config.log_prompts,
            worker_config.disagg,
            worker_config.fair_queue,
        )
        left = await worker.run(stop)
    except AuthenticationError as error:
        log.error("redis_credentials_refused", redis=_redacted(config.url), error=str(error))
        return EXIT_CREDENTIALS
    finally:
        try:  # closing waits on the sockets: bounded, in case Redis is unreachable
            await asyncio.wait_for(client.aclose(), timeout=2)
        except (TimeoutError, OSError):
            pass
        if server is not None:
            server.shutdown()
        log.info("worker_stopped", consumer=config.consumer, drained=not left, pending=left)
    return EXIT_PENDING_LEFT if left else 0


async def _load_engine(command: str, config):
    """The engine on the thread it will step on, or None once the reason it cannot load
    is printed in one line (a model it cannot serve, a missing file, a bad setting)."""
    from workers.async_engine import on_torch_thread
    from workers.engine import Engine

    try:
        return await on_torch_thread(Engine.from_config, config)
    except Exception as error:  # whatever stops the load is reported in one line, not traced
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"inflight {command}: cannot serve {config.model.source or 'the bundled model'}: {reason}",
              file=sys.stderr)  # fmt: skip
        return None


def _log_started(log, worker_config: WorkerConfig, embedded: bool, engine) -> None:
    """The `worker_started` line; with the embedded server, how to submit to it too."""
    config, disagg = worker_config.redis, worker_config.disagg
    log.info(
        "worker_started",
        consumer=config.consumer,
        role=disagg.role,
        stream=config.requests_stream if disagg.role != "decode" else disagg.handoff_stream,
        redis=_redacted(config.url),
        embedded=embedded,
        metrics_port=worker_config.metrics.port or None,
        kv_blocks=engine.allocator.num_blocks,
        max_context=engine.max_context,
    )
    if embedded:
        print(_how_to_submit(config), file=sys.stderr, flush=True)


def _stop_on_signals(log, grace_s: float) -> asyncio.Event:
    """The first SIGINT or SIGTERM sets the returned event (stop claiming, finish what is
    in hand); a second one exits at once."""
    import os
    import signal

    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("worker_forced_exit", signal=name)
            sys.stderr.flush()
            os._exit(EXIT_FORCED)
        stop.set()
        log.info("worker_stopping", signal=name, grace_s=grace_s)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop


def _redacted(url: str) -> str:
    """The URL without its password, for logs."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def _how_to_submit(config: RedisConfig) -> str:
    port = config.embedded_port
    url = "" if port == RedisConfig().embedded_port else f" --redis-url {config.url}"
    return f"""
inflight worker {config.consumer} is serving {config.requests_stream} on {config.url} (embedded Valkey).
Submit from another terminal:
  .venv/bin/inflight submit{url} "What is the capital of France?"
or with redis-cli:
  redis-cli -p {port} XADD {config.requests_stream} '*' id hello prompt "The sea is" max_tokens 32
  redis-cli -p {port} XREAD BLOCK 0 STREAMS 'inflight:out:{{hello}}' 0
Stop with Ctrl-C (in-flight requests finish first).
"""


if __name__ == "__main__":
    sys.exit(main())
