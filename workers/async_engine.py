"""An asyncio front end for the engine: submit a request, get its events.

The model step runs in a single worker thread, so the event loop (Redis I/O,
/metrics) never waits for a forward pass. A request's events go where its submit
says: `submit_streamed` gives it a stream (a queue the stepping task fills) to
iterate; `submit_batched` hands them to `on_events` with the rest of their step's.

The edge knows the engine through this class only: it submits and cancels, learns when a
request is released (`released`) and when nothing is left unfinished (`idle`), and asks
for the few things of the engine it needs (the tokenizer, a grammar compiled ahead, the
prompt tokens a handed-off request staged, where to stage them, a step observer).

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
from typing import TYPE_CHECKING, Any, TypeVar

from workers.api import Event, FinalEvent, GenerationRequest, InvalidRequest, SamplingParams
from workers.engine import Engine, EngineStats

if TYPE_CHECKING:
    from gpu.kv_transfer import HandoffArena

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
        self._release_waiters: dict[str, list[asyncio.Future[None]]] = {}  # by batched request id
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # set by the step loop when the engine has nothing unfinished
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

    def released(self, request_id: str) -> asyncio.Future[None]:
        """Resolved once a request queued with `submit_batched` under `request_id` has
        handed its final event to `on_events` (its id free again, none of its events
        still to come); resolved already when none is held. Each call gets a future of
        its own, so a waiter that gives up cancels only its own."""
        released = asyncio.get_running_loop().create_future()
        if request_id in self._batched:
            self._release_waiters.setdefault(request_id, []).append(released)
        else:
            released.set_result(None)
        return released

    async def idle(self) -> None:
        """Returns once the engine has nothing unfinished (what was cancelled ends at its
        next step). Only while the step loop runs (inside `async with`)."""
        await self._idle.wait()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (to count a prompt's tokens)."""
        return self.engine.tokenizer

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a constrained request's grammar ahead (or find it cached), off the event
        loop, so that `submit_batched` does not; a bad one is cached too, and comes as that
        request's error event."""
        await asyncio.to_thread(self._compile_quietly, params)

    def _compile_quietly(self, params: SamplingParams) -> None:
        try:
            self.engine.grammars.compile(params)
        except InvalidRequest:
            pass  # cached: `add_request` reports it as the request's error

    def stage_handoffs_in(self, arena: HandoffArena) -> None:
        """Disaggregated serving, prefill side: stage the prompt K/V of requests that end
        with `handoff` in `arena`."""
        self.engine.handoff_arena = arena

    def take_staged(self, request_id: str) -> int:
        """How many prompt tokens a request that ended with `handoff` staged (0: none)."""
        return self.engine.take_staged(request_id)

    def observe_steps(self, observer: Callable[[EngineStats], None]) -> None:
        """Call `observer` after every step, on the stepping thread (it must be quick)."""
        self.engine.observer = observer

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
        self._wake()

    def _add(self, request: GenerationRequest) -> None:
        self.engine.add_request(request)
        self._wake()

    def _wake(self) -> None:
        """New work (a request, a cancel) for the step loop: not idle until it has looked."""
        self._idle.clear()
        self._wakeup.set()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            if not self.engine.has_unfinished():
                self._idle.set()
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
        released = []
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
            else:
                unrouted.append(event)
                if isinstance(event, FinalEvent):
                    self._batched.discard(event.request_id)
                    released.append(event.request_id)
        if unrouted and self.on_events is not None:
            self.on_events(unrouted)
        for request_id in released:
            for waiter in self._release_waiters.pop(request_id, ()):
                if not waiter.done():  # its waiter may have given up
                    waiter.set_result(None)


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
