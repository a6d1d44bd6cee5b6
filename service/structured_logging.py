"""Logging through structlog: JSON lines for machines, console lines for people.

`configure_logging` picks the renderer: JSON when the output is not a terminal (a
container, a log shipper), coloured console output when it is (`LoggingConfig.format`
can force either). Context bound with `bind_request` (request id, priority) is carried
by contextvars, so every line logged while serving a request names it; each asyncio
task has its own copy, so concurrent requests never see each other's. Records from the
standard library's logging (transformers, redis, warnings) go through the same renderer,
so a JSON log holds nothing but JSON lines.

Named `structured_logging`, not `logging`, so it can never shadow the standard library.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
from structlog.typing import Processor

from service.config import LoggingConfig
from workers.api import FinalEvent


def configure_logging(config: LoggingConfig, stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    as_json = config.format == "json" or (config.format == "auto" and not _is_terminal(stream))
    renderer = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=_is_terminal(stream))
    )
    level = logging.getLevelNamesMapping()[config.level.upper()]
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,  # tests configure it more than once per process
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    logging.basicConfig(handlers=[handler], level=level, force=True)
    logging.captureWarnings(True)
    # transformers gives its loggers a handler of their own and stops propagation; hand
    # its records to ours (it is imported by then: the engine's modules import it).
    library = logging.getLogger("transformers")
    library.handlers.clear()
    library.propagate = True


def bind_request(request_id: str, priority: int) -> None:
    """Name the request in every line logged from the current task (or context) on."""
    structlog.contextvars.bind_contextvars(request_id=request_id, priority=priority)


def log_request_finished(log, event: FinalEvent, prompt=None, output: str | None = None) -> None:
    """The one summary line of a finished request. `prompt` and `output` are logged only
    when given, which the caller does only if the operator opted in (`log_prompts`)."""
    timings, usage = event.timings, event.usage
    gaps = [b - a for a, b in zip(timings.token_times, timings.token_times[1:])]
    fields = {
        "finish_reason": event.finish_reason.value,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "queue_s": round(timings.queue_s, 4),
        "first_token_s": None if timings.first_token_s is None else round(timings.first_token_s, 4),
        "inter_token_mean_s": round(sum(gaps) / len(gaps), 4) if gaps else None,
        "total_s": round(timings.total_s, 4),
    }
    if event.error:
        fields["error"] = event.error
    if prompt is not None:
        fields["prompt"] = prompt
    if output is not None:
        fields["output"] = output
    log.info("request_finished", **fields)


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
