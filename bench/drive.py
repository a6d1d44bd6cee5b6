"""The one "step until done" loop of the scenario benches and the tests, and a recorder of
what each step did. Times are seconds after the driver's t0, taken when the `step()` that
produced an event returns, as a caller of the engine would see it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

from bench.arrivals import ArrivalQueue
from workers.api import FinalEvent, GenerationRequest, SamplingParams, TokenEvent


class StepRecorder:
    """The `StepRecord` of every step that ran something, from the engine's one observer slot
    (chained to the observer already there). Iterating takes a snapshot: another thread may
    read while the engine steps."""

    def __init__(self, engine=None) -> None:
        self._records: list = []
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> StepRecorder:
        previous = engine.observer

        def observe(stats) -> None:
            if stats.step is not None:
                self._records.append(stats.step)
            if previous is not None:
                previous(stats)

        engine.observer = observe
        return self

    def clear(self) -> None:
        self._records = []

    def __iter__(self) -> Iterator:
        return iter(list(self._records))

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index):
        return self._records[index]


class Driver:
    """Steps an engine, keeping each request's token ids, token times, text and final event.
    With `raise_errors` (the benches), a request that ends in an error stops the run."""

    def __init__(self, engine, t0: float | None = None, raise_errors: bool = True) -> None:
        self.engine = engine
        self.t0 = time.perf_counter() if t0 is None else t0
        self.raise_errors = raise_errors
        self.arrivals: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}
        self.tokens: dict[str, list[int]] = {}  # every choice's, in the order they came
        self.choice_tokens: dict[str, dict[int, list[int]]] = {}  # by choice (parallel sampling)
        self.texts: dict[str, str] = {}
        self.finals: dict[str, FinalEvent] = {}  # in the order the requests finished
        self.num_steps = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def submit(self, request_id: str, *arguments, **options) -> None:
        self.arrivals[request_id] = self.now()
        self.token_times[request_id] = []
        self.engine.add_request(GenerationRequest(request_id, *arguments, **options))

    def add(
        self, request_id: str, prompt_ids: list[int], output_len: int, priority: int = 0, ignore_eos: bool = True
    ) -> None:
        """A greedy request for exactly `output_len` tokens (unless `ignore_eos` is off)."""
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=ignore_eos)
        self.submit(request_id, prompt_ids, params, priority=priority)

    def step(self) -> list:
        events = self.engine.step()
        self.num_steps += 1
        now = self.now()
        for event in events:
            request_id = event.request_id
            self.texts[request_id] = self.texts.get(request_id, "") + event.text
            if isinstance(event, TokenEvent):
                self.token_times.setdefault(request_id, []).extend([now] * len(event.token_ids))
                self.tokens.setdefault(request_id, []).extend(event.token_ids)
                self.choice_tokens.setdefault(request_id, {}).setdefault(event.index, []).extend(event.token_ids)
            elif isinstance(event, FinalEvent):
                if event.error and self.raise_errors:
                    raise RuntimeError(f"request {request_id} failed: {event.error}")
                self.finals[request_id] = event
        return events

    def admit(self, queue: ArrivalQueue) -> None:
        """Add what `queue` releases now (each item `add`'s keywords)."""
        for request in queue.due(self.now(), in_flight=len(self.arrivals) - len(self.finals)):
            self.add(**request)

    def run_arrivals(self, queue: ArrivalQueue) -> None:
        """Step until every request of `queue` has arrived and finished, idle in between."""
        while queue or self.engine.has_unfinished():
            self.admit(queue)
            if self.engine.has_unfinished():
                self.step()
            elif (next_s := queue.next_s()) is not None:
                time.sleep(max(0.0, next_s - self.now()))

    def run_until(self, done: Callable[[], bool], max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise RuntimeError(f"the run did not reach its end within {max_steps} steps")

    def drain(self, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 1_000_000) -> None:
        """Step until no request is left; `arrivals[n]` lists `submit` arguments to add
        just before the n-th step of this drain (so requests can arrive mid-run)."""
        pending = dict(arrivals or {})
        first_step = self.num_steps

        def done() -> bool:
            for arguments in pending.pop(self.num_steps - first_step, []):
                self.submit(*arguments)
            return not pending and not self.engine.has_unfinished()

        self.run_until(done, max_steps)

    def throughput(self) -> dict:
        """Output tokens made (as counted) over the time from t0 to now (the end once drained)."""
        wall = self.now()
        produced = sum(len(times) for times in self.token_times.values())
        return {"output_tokens": produced, "output_tokens_per_s": produced / wall, "wall_s": wall}

    def first_token_s(self, request_id: str) -> float | None:
        times = self.token_times[request_id]
        return times[0] - self.arrivals[request_id] if times else None


def random_prompts(rng: random.Random, count: int, length: tuple[int, int], vocab_ids: list[int]) -> list[list[int]]:
    return [[rng.choice(vocab_ids) for _ in range(rng.randint(*length))] for _ in range(count)]


def bench_engine(loaded, args, **config):
    """An engine over the bench's model with these `EngineConfig` fields, the rest default."""
    from workers.config import EngineConfig, ModelConfig
    from workers.engine import Engine

    return Engine(loaded, EngineConfig(model=ModelConfig(source=args.model, dtype=args.dtype), **config))


def kv_bytes(model, tokens: int) -> int:
    """The K and V of `tokens` tokens across the model's layers, in its dtype: a KV pool's size."""
    from gpu.kv_cache import KVShape

    return KVShape.of(model.config).bytes_per_token(model.dtype) * tokens


def on_fresh_engines(loaded, args, configs: dict[str, dict], measure: Callable) -> dict[str, dict]:
    """`measure(name, engine)` on a fresh engine of each named set of `bench_engine` fields."""
    import gc

    figures = {}
    for name, config in configs.items():
        figures[name] = measure(name, bench_engine(loaded, args, **config))
        gc.collect()  # the engine's pools, before the next one allocates its own
    return figures
