"""A Redis call given up as soon as the worker is told to stop, so that an outage never
holds a stop up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from service.retry import retrying

T = TypeVar("T")

# How long cancelled tasks and the engine get, in all, to wind down once the grace
# period is over (cancelled tasks end at their next await; the engine drops their
# requests on its next step).
WIND_DOWN_S = 1.0


async def unless_stopped(stop: asyncio.Event, call: Callable[[], Awaitable[T]]) -> T | None:
    """`retrying(call)`, given up as soon as `stop` is set (then None; callers check
    `stop`), so an outage never holds a stop up."""
    attempt = asyncio.create_task(retrying(call))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([attempt, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if attempt.done():
        return attempt.result()
    attempt.cancel()
    await asyncio.wait([attempt], timeout=WIND_DOWN_S)
    return None
