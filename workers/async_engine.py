"""An asyncio front end for the engine: submit a request, get its events.

The model step runs in a single worker thread, so the event loop (Redis I/O,
/metrics) never waits for a forward pass. A request's events go where its submit
says: `submit_streamed` gives it a stream (a queue the stepping task fills) to
iterate; `submit_batched` hands them to `on_events` with the rest of their step's.

That thread is the process's one torch thread: build the engine there too
(`await on_torch_thread(Engine.from_config, config)`). libgomp keeps an OpenMP team
for each thread that starts parallel work; once two threads own one, there are more
OpenMP threads than cores (on a 2-core machine) and libgomp stops spinning between
parallel regions, so an engine loaded on one thread and stepped on another runs every
step slower than one loaded and stepped on one thread (see docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from workers.api import Event, FinalEvent, GenerationRequest
from workers.engine import Engine

T = TypeVar("T")

_TORCH_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-torch")


async def on_torch_thread(fn: Callable[..., T], *args) -> T:
    """Run `fn(*args)` on the thread that steps every engine of this process."""
    return await asyncio.get_running_loop().run_in_executor(_TORCH_THREAD, fn, *args)


class AsyncEngine:
    def __init__(self, engine: Engine, on_events: Callable[[list[Event]], None] | None = None) -> None:
        """`on_events`, when given, receives each step's events of the requests queued with
        `submit_batched`, all at once, on the event loop (a publisher that batches per step)."""
        self.engine = engine
        self.on_events = on_events
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        self._batched: set[str] = set()  # ids queued with `submit_batched` whose final event is not yet handed on
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._closing = False

    async def __aenter__(self) -> AsyncEngine:
        self._loop_task = asyncio.create_task(self._step_loop(), name="inflight-step-loop")
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing = True  # the torch thread stops after its current step
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            await on_torch_thread(lambda: None)  # a step still running finishes first

    def submit_streamed(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; its events come in the returned stream, to iterate.

        Raises `InvalidRequest` only for an id that is already live; any other bad
        input arrives as the stream's single, final error event.
        """
        self._add(request)
        stream = RequestStream(self, request.request_id)
        self._queues[request.request_id] = stream.queue
        return stream

    def submit_batched(self, request: GenerationRequest) -> None:
        """Queue a request; its events go to `on_events`, with the rest of their step's."""
        self._add(request)
        self._batched.add(request.request_id)

    def holds(self, request_id: str) -> bool:
        """Whether a request queued with `submit_batched` under `request_id` has yet to hand
        its final event to `on_events` (a cancelled one ends at the engine's next step)."""
        return request_id in self._batched

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Submit and yield the events. Leaving early (break, task cancelled) cancels the request."""
        stream = self.submit_streamed(request)
        try:
            async for event in stream:
                yield event
        finally:
            if not stream.finished:
                stream.cancel()
                self._queues.pop(stream.request_id, None)  # nobody reads the cancelled event

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._wakeup.set()

    def _add(self, request: GenerationRequest) -> None:
        self.engine.add_request(request)
        self._wakeup.set()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            if not self.engine.has_unfinished():
                await self._wakeup.wait()
                continue
            await loop.run_in_executor(_TORCH_THREAD, self._step_while_busy, loop)

    def _step_while_busy(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the torch thread: steps back to back while there is work, each step's events
        sent to the event loop as they are made. The next step never waits for the loop
        to hand the last one's events on (or for anything else the loop is doing)."""
        while not self._closing and self.engine.has_unfinished():
            events = self.engine.step()
            if events:
                loop.call_soon_threadsafe(self._hand_on, events)

    def _hand_on(self, events: list[Event]) -> None:
        unrouted = []
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
            else:
                unrouted.append(event)
                if isinstance(event, FinalEvent):
                    self._batched.discard(event.request_id)
        if unrouted and self.on_events is not None:
            self.on_events(unrouted)


class RequestStream:
    """The events of one request, in order; the last is a `FinalEvent`."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False
        self._engine = engine

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        event = await self.queue.get()
        if isinstance(event, FinalEvent):
            self.finished = True
            self._engine._queues.pop(self.request_id, None)
        return event

    def cancel(self) -> None:
        """Ask the engine to stop this request; its final event says `cancelled`."""
        self._engine.cancel(self.request_id)
