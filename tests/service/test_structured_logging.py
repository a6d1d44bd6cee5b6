"""Logging: JSON lines when the output is not a terminal, console lines when it is; the
request id and priority ride along through contextvars; the per-request summary line
carries prompts and outputs only when the operator opts in."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import structlog

from service.config import LoggingConfig
from service.structured_logging import bind_request, configure_logging, log_request_finished
from workers.api import FinalEvent, FinishReason, Timings, Usage


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_logging():
    import logging

    root, library = logging.getLogger(), logging.getLogger("transformers")
    saved = root.handlers[:], root.level, library.handlers[:], library.propagate
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root.handlers[:], root.level, library.handlers[:], library.propagate = saved
    logging.captureWarnings(False)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_when_the_output_is_not_a_terminal():
    out = io.StringIO()
    configure_logging(LoggingConfig(), out)
    structlog.get_logger().info("worker_started", consumer="w1")
    [line] = lines(out)
    assert line["event"] == "worker_started" and line["consumer"] == "w1" and line["level"] == "info"
    assert line["timestamp"].endswith("Z")


def test_standard_library_records_become_json_lines_too():
    import logging
    import warnings

    from transformers.utils import logging as transformers_logging

    library_logger = transformers_logging.get_logger("transformers.modeling_utils")  # with its own handler
    out = io.StringIO()
    configure_logging(LoggingConfig(), out)
    bind_request("r1", 2)
    library_logger.warning("weights not tied")
    logging.getLogger("redis.connection").debug("below the level")
    logging.getLogger("redis.connection").warning("reconnecting")
    warnings.warn("deprecated flag", stacklevel=1)
    first, second, third = lines(out)
    assert (first["event"], first["level"], first["logger"]) == (
        "weights not tied",
        "warning",
        "transformers.modeling_utils",
    )
    assert (first["request_id"], first["priority"]) == ("r1", 2)
    assert (second["event"], second["logger"]) == ("reconnecting", "redis.connection")
    assert third["logger"] == "py.warnings" and "deprecated flag" in third["event"]


def test_console_output_on_a_terminal_and_json_when_forced():
    terminal = Terminal()
    configure_logging(LoggingConfig(), terminal)
    structlog.get_logger().info("worker_started", consumer="w1")
    text = terminal.getvalue()
    assert "worker_started" in text and "consumer" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)

    terminal = Terminal()
    configure_logging(LoggingConfig(format="json"), terminal)
    structlog.get_logger().info("worker_started")
    assert lines(terminal)[0]["event"] == "worker_started"


def test_the_level_filters_lines():
    out = io.StringIO()
    configure_logging(LoggingConfig(level="warning"), out)
    structlog.get_logger().info("quiet")
    structlog.get_logger().warning("loud")
    assert [line["event"] for line in lines(out)] == ["loud"]


def test_each_task_logs_its_own_request_id_and_priority():
    out = io.StringIO()
    configure_logging(LoggingConfig(), out)
    log = structlog.get_logger()

    async def serve(request_id: str, priority: int):
        bind_request(request_id, priority)
        await asyncio.sleep(0)  # let the other task bind its own in between
        log.info("token")

    async def main():
        await asyncio.gather(serve("a", 5), serve("b", -3))
        log.info("outside")

    asyncio.run(main())
    by_event = [(line["event"], line.get("request_id"), line.get("priority")) for line in lines(out)]
    assert sorted(by_event) == [("outside", None, None), ("token", "a", 5), ("token", "b", -3)]


def finished() -> FinalEvent:
    return FinalEvent("r1", FinishReason.STOP, Usage(9, 3), Timings(0.01, 0.2, 0.5, (0.2, 0.35, 0.5)), text="!")


def test_one_summary_line_per_request_without_prompt_or_output_by_default():
    out = io.StringIO()
    configure_logging(LoggingConfig(), out)
    log_request_finished(structlog.get_logger(), finished())
    [line] = lines(out)
    assert line["event"] == "request_finished" and line["finish_reason"] == "stop"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (9, 3)
    assert (line["queue_s"], line["first_token_s"], line["inter_token_mean_s"], line["total_s"]) == (
        0.01,
        0.2,
        0.15,
        0.5,
    )
    assert "prompt" not in line and "output" not in line


def test_the_summary_line_carries_prompt_and_output_when_given():
    out = io.StringIO()
    configure_logging(LoggingConfig(), out)
    log_request_finished(structlog.get_logger(), finished(), prompt="Say hi", output="Hi!")
    [line] = lines(out)
    assert (line["prompt"], line["output"]) == ("Say hi", "Hi!")


@pytest.mark.slow
@pytest.mark.parametrize("log_prompts", [False, True])
def test_a_worker_logs_prompts_and_outputs_only_when_the_operator_opts_in(make_engine, log_prompts):
    import uuid

    import redis.asyncio as aioredis

    from service.worker import Worker
    from tests.service.test_worker import read_replies, stream_config

    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    config = stream_config(prefix)
    out = io.StringIO()
    configure_logging(LoggingConfig(log_prompts=log_prompts), out)

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        stop = asyncio.Event()
        serving = asyncio.create_task(Worker(make_engine(), client, config, log_prompts=log_prompts).run(stop))
        await client.xadd(
            config.requests_stream,
            {"id": f"{prefix}-job", "prompt": "The capital of France is", "max_tokens": "4", "priority": "4"},
        )
        replies = await read_replies(client, f"inflight:out:{{{prefix}-job}}")
        stop.set()
        await serving
        await client.delete(config.requests_stream, f"inflight:out:{{{prefix}-job}}")
        await client.aclose()
        return replies

    replies = asyncio.run(main())
    output = b"".join(r["text"] for r in replies).decode()
    [summary] = [line for line in lines(out) if line["event"] == "request_finished"]
    assert (summary["request_id"], summary["priority"], summary["completion_tokens"]) == (f"{prefix}-job", 4, 4)
    if log_prompts:
        assert (summary["prompt"], summary["output"]) == ("The capital of France is", output)
    else:
        assert "The capital of France" not in out.getvalue() and output not in out.getvalue()
