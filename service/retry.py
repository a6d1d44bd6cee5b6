"""The one retry policy for every Redis call the worker makes.

- Redis away (connection refused or dropped, a timeout, a server still loading its data
  after a restart, a replica promoted mid-failover, a Redis Cluster that is down or
  re-forming): waited out with backoff, logged once per outage, and once more when Redis
  is back.
- Wrong credentials and missing ACL permissions: never retried; time does not fix them.
- Any other error reply (WRONGTYPE, OOM, a script error): raised to the caller, which
  fails the one request it concerns.
- Cancellation always wins: a task that is being cancelled stops retrying, even when
  the cancellation reached redis-py as a connection error or a timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    ConnectionError,
    NoPermissionError,
    ReadOnlyError,
    RedisError,
    TimeoutError,
    TryAgainError,
)

log = structlog.get_logger("inflight.redis")

T = TypeVar("T")

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 2.0
# Errors that mean "Redis is away for now". AuthenticationError is a ConnectionError in
# redis-py, so it is excluded explicitly below.
TRANSIENT = (ConnectionError, TimeoutError, ReadOnlyError, TryAgainError, ClusterDownError)
FATAL = (AuthenticationError, NoPermissionError)


def is_transient(error: BaseException) -> bool:
    return isinstance(error, TRANSIENT) and not isinstance(error, FATAL)


async def retrying(
    call: Callable[[], Awaitable[T]], max_delay_s: float = MAX_DELAY_S, on_outage: Callable[[], None] | None = None
) -> T:
    """`await call()` until Redis answers; see the module docstring for what is retried.

    Waits between tries double from FIRST_DELAY_S up to `max_delay_s` (a caller racing
    a lease keeps it short). `on_outage` is called at every failed try."""
    delay = FIRST_DELAY_S
    failed = False
    while True:
        try:
            result = await call()
        except RedisError as error:
            if not is_transient(error):
                raise
            stop_if_cancelled()
            if on_outage is not None:
                on_outage()
            if not failed:  # once per outage, not once per retry
                log.warning("redis_unavailable", error=str(error) or type(error).__name__)
                failed = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
            continue
        if failed:
            log.info("redis_recovered")
        return result


def stop_if_cancelled() -> None:
    """A cancellation can surface from redis-py as a timeout or a connection error, or
    vanish (a cancel that arrives with the reply: the command returns it), and Python
    3.11's `wait_for` can swallow one outright; the task's own count of pending
    cancellation requests still tells the truth."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
