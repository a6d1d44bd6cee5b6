"""Drives an engine step by step and timestamps what comes out, for the scenario benches.

Times are seconds after the driver's t0 (`time.perf_counter()`), taken when the `step()`
that produced an event returns, as a caller of the engine would see it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from workers.request import FinalEvent, SamplingParams, TokenEvent


class Driver:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.t0 = time.perf_counter()
        self.arrivals: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}
        self.finals: dict[str, FinalEvent] = {}
        self.num_steps = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, request_id: str, prompt_ids: list[int], output_len: int, priority: int = 0,
            ignore_eos: bool = True) -> None:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=ignore_eos)
        self.arrivals[request_id] = self.now()
        self.token_times[request_id] = []
        self.engine.add_request(request_id, prompt_ids, params, priority=priority)

    def step(self) -> None:
        events = self.engine.step()
        self.num_steps += 1
        now = self.now()
        for event in events:
            if isinstance(event, TokenEvent):
                self.token_times[event.request_id].extend([now] * len(event.token_ids))
            elif isinstance(event, FinalEvent):
                if event.error:
                    raise RuntimeError(f"request {event.request_id} failed: {event.error}")
                self.finals[event.request_id] = event

    def run_until(self, done: Callable[[], bool], max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise RuntimeError("the scenario did not reach its end")

    def drain(self) -> None:
        self.run_until(lambda: not self.engine.has_unfinished())

    def first_token_s(self, request_id: str) -> float | None:
        """Time to first token, from the request's arrival."""
        times = self.token_times[request_id]
        return times[0] - self.arrivals[request_id] if times else None


def random_prompts(rng: random.Random, count: int, length: tuple[int, int], vocab_ids: list[int]) -> list[list[int]]:
    return [[rng.choice(vocab_ids) for _ in range(rng.randint(*length))] for _ in range(count)]

