"""Waiting on a real condition, never on a guess of how long something takes.

Each wait ends as soon as its condition holds and fails the test, naming what it waited
for, if the condition does not hold by the deadline. Where Redis can tell us (new entries
on a stream) the wait blocks on Redis itself; where nothing signals (a stream emptied by
acks, a process gone) it polls, always under a deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.02


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `condition()` until it is true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(POLL_S)


async def eventually(condition: Callable[[], object | Awaitable[object]], timeout_s: float, what: str) -> None:
    """`wait_until` on the event loop; `condition` may be a coroutine function (a Redis read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(POLL_S)


async def stream_reaches(client, stream: str, count: int, timeout_s: float = 120) -> None:
    """Until `stream` holds at least `count` entries, blocking on XREAD for each new one."""
    deadline = time.monotonic() + timeout_s
    last = "0"
    seen = 0
    while seen < count:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0, f"timed out after {timeout_s} s waiting for {count} entries on {stream} (saw {seen})"
        for _, entries in await client.xread({stream: last}, block=min(left_ms, 1000)) or []:
            seen += len(entries)
            last = entries[-1][0]
