"""The asyncio front end: per-request event streams while the model steps in a thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.waiting import eventually
from workers.api import FinalEvent, FinishReason, GenerationRequest, SamplingParams, TokenEvent
from workers.async_engine import AsyncEngine

pytestmark = pytest.mark.slow


async def collect(stream):
    return [event async for event in stream]


def test_concurrent_requests_each_get_their_own_ordered_stream(make_engine):
    engine = make_engine()

    async def main():
        async with AsyncEngine(engine) as front:
            streams = [
                front.submit_streamed(GenerationRequest(f"r{n}", f"Count to {n}:", SamplingParams(max_tokens=6 + n)))
                for n in range(4)
            ]
            return await asyncio.gather(*(collect(s) for s in streams))

    for n, events in enumerate(asyncio.run(main())):
        assert all(isinstance(e, TokenEvent) for e in events[:-1])
        final = events[-1]
        assert isinstance(final, FinalEvent) and final.usage.completion_tokens == len(events) - 1
        assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_the_event_loop_stays_free_while_the_model_steps(make_engine):
    """The step runs off the loop: in the middle of a step (its observer, which runs in
    the stepping thread) the loop still runs a callback the step waits for. Were the step
    on the loop, the loop could not run it and the wait could only time out."""
    engine = make_engine()
    answered = threading.Event()
    waits: list[bool] = []

    async def main():
        loop = asyncio.get_running_loop()

        def observer(stats):
            if stats.step is not None and not waits:
                loop.call_soon_threadsafe(answered.set)
                waits.append(answered.wait(timeout=10))

        engine.observer = observer
        async with AsyncEngine(engine) as front:
            request = GenerationRequest("moon", "Tell me about the moon.", SamplingParams(max_tokens=24))
            return await collect(front.submit_streamed(request))

    events = asyncio.run(main())
    assert isinstance(events[-1], FinalEvent)
    assert waits == [True]


def test_leaving_the_stream_early_cancels_the_request(make_engine):
    engine = make_engine()

    async def main():
        async with AsyncEngine(engine) as front:
            request = GenerationRequest("essay", "Write a long essay about rivers.", SamplingParams(max_tokens=200))
            async for event in front.generate(request):
                break
            await eventually(lambda: not engine.has_unfinished(), 30, "the cancel to land at the next step")

    asyncio.run(main())
    assert not engine.has_unfinished()


def test_bad_input_arrives_as_a_final_error_event(make_engine):
    engine = make_engine()

    async def main():
        async with AsyncEngine(engine) as front:
            return await collect(front.submit_streamed(GenerationRequest("empty", "", SamplingParams())))

    (event,) = asyncio.run(main())
    assert event.finish_reason is FinishReason.ERROR and "empty" in event.error


def test_streamed_and_batched_requests_differ_only_in_where_their_events_go(make_engine):
    """A streamed request's events come in its stream and never reach `on_events`; a
    batched one's reach `on_events` alone. Both make the same tokens."""
    engine = make_engine()
    handed_on: list = []
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main():
        async with AsyncEngine(engine, handed_on.extend) as front:
            stream = front.submit_streamed(GenerationRequest("streamed", "Count to ten:", params))
            front.submit_batched(GenerationRequest("batched", "Count to ten:", params))
            streamed = await collect(stream)
            await eventually(lambda: not front.holds("batched"), 60, "the batched final event")
            return streamed

    streamed = asyncio.run(main())
    assert {e.request_id for e in streamed} == {"streamed"}
    assert {e.request_id for e in handed_on} == {"batched"}
    tokens = [[t for e in events if isinstance(e, TokenEvent) for t in e.token_ids] for events in (streamed, handed_on)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_a_batched_request_is_held_until_its_final_event_is_handed_on(make_engine):
    """A worker that lost a job and claims it back waits for `released` (`holds` says the
    same): the old request's id is taken, and its events would reach the new stream, until
    its final event is out."""
    engine = make_engine()
    handed_on: list = []

    async def main():
        async with AsyncEngine(engine, handed_on.extend) as front:
            front.submit_batched(
                GenerationRequest("job-1", "Tell me about the moon.", SamplingParams(max_tokens=200, ignore_eos=True))
            )
            await eventually(lambda: any(isinstance(e, TokenEvent) for e in handed_on), 60, "a token")
            front.cancel("job-1")
            assert front.holds("job-1")  # the cancel ends it at the next step, not now
            await eventually(lambda: not front.holds("job-1"), 60, "the cancelled final event")
            final = handed_on[-1]
            assert isinstance(final, FinalEvent) and final.finish_reason is FinishReason.CANCELLED
            front.submit_batched(  # the id is free
                GenerationRequest("job-1", "Tell me about the moon.", SamplingParams(max_tokens=2, ignore_eos=True))
            )
            await eventually(lambda: not front.holds("job-1"), 60, "the second final event")

    asyncio.run(main())
    assert [e.finish_reason for e in handed_on if isinstance(e, FinalEvent)] == [
        FinishReason.CANCELLED,
        FinishReason.LENGTH,
    ]


def test_released_resolves_once_the_final_event_is_handed_on_and_idle_once_nothing_is_left(make_engine):
    """The edge waits on `released` rather than polling `holds`: at once for an id held by
    no request, else once the request's final event has reached `on_events`. `idle` comes
    once the engine has nothing unfinished (a cancel too ends at the next step)."""
    engine = make_engine()
    handed_on: list = []

    async def main():
        async with AsyncEngine(engine, handed_on.extend) as front:
            assert front.released("job-1").done()
            front.submit_batched(
                GenerationRequest("job-1", "Tell me about the moon.", SamplingParams(max_tokens=200, ignore_eos=True))
            )
            released = front.released("job-1")
            await eventually(lambda: any(isinstance(e, TokenEvent) for e in handed_on), 60, "a token")
            assert not released.done()
            front.cancel("job-1")
            await asyncio.wait_for(released, 60)
            assert isinstance(handed_on[-1], FinalEvent) and not front.holds("job-1")
            await asyncio.wait_for(front.idle(), 60)
            assert not engine.has_unfinished()

    asyncio.run(main())
    assert [e.finish_reason for e in handed_on if isinstance(e, FinalEvent)] == [FinishReason.CANCELLED]
