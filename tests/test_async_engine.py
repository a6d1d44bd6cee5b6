"""The asyncio front end: per-request event streams while the model steps in a thread."""

from __future__ import annotations

import asyncio

import pytest

from workers.async_engine import AsyncEngine
from workers.request import FinalEvent, FinishReason, SamplingParams, TokenEvent

pytestmark = pytest.mark.slow


async def collect(stream):
    return [event async for event in stream]


def test_concurrent_requests_each_get_their_own_ordered_stream(make_engine):
    engine = make_engine()

    async def main():
        async with AsyncEngine(engine) as front:
            streams = [front.submit(f"Count to {n}:", SamplingParams(max_tokens=6 + n)) for n in range(4)]
            return await asyncio.gather(*(collect(s) for s in streams))

    for n, events in enumerate(asyncio.run(main())):
        assert all(isinstance(e, TokenEvent) for e in events[:-1])
        final = events[-1]
        assert isinstance(final, FinalEvent) and final.usage.completion_tokens == len(events) - 1
        assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_the_event_loop_stays_free_while_the_model_steps(make_engine):
    """A 5 ms timer ticks many times per model step: the forward runs off the loop.
    (Were the step on the loop, the timer could fire at most once per step.)"""
    engine = make_engine()

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        async with AsyncEngine(engine) as front:
            task = asyncio.create_task(ticker())
            events = await collect(front.submit("Tell me about the moon.", SamplingParams(max_tokens=24)))
            task.cancel()
        return ticks, events

    ticks, events = asyncio.run(main())
    assert isinstance(events[-1], FinalEvent)
    assert ticks > 3 * len(engine.step_records)


def test_leaving_the_stream_early_cancels_the_request(make_engine):
    engine = make_engine()

    async def main():
        async with AsyncEngine(engine) as front:
            async for event in front.generate("Write a long essay about rivers.", SamplingParams(max_tokens=200)):
                break
            for _ in range(100):  # the cancel lands at the next step
                if not engine.has_unfinished():
                    break
                await asyncio.sleep(0.02)

    asyncio.run(main())
    assert not engine.has_unfinished()


def test_bad_input_arrives_as_a_final_error_event(make_engine):
    engine = make_engine()

    async def main():
        async with AsyncEngine(engine) as front:
            return await collect(front.submit("", SamplingParams()))

    (event,) = asyncio.run(main())
    assert event.finish_reason is FinishReason.ERROR and "empty" in event.error
