"""When a scenario's requests arrive: open loop (send times in seconds after t0: all at t0,
Poisson, bursts) or closed loop (n in flight, the next sent as one ends)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

BURST = "burst"


def at_t0(count: int) -> list[float]:
    return [0.0] * count


def poisson(count: int, rate_per_s: float, seed: int) -> list[float]:
    """The first at t0, then exponential gaps of mean 1/rate, from a generator seeded by
    `seed` and the rate (so each rate has its own)."""
    if count < 1 or not rate_per_s > 0:
        raise ValueError(f"need count >= 1 and a positive rate, got {count}, {rate_per_s}")
    rng = random.Random(f"serve-arrivals-{seed}-{rate_per_s!r}")  # the serve scenario's seeds, kept
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate_per_s)
    return times


def bursts(count: int, size: int, every_s: float, first_s: float = 0.0) -> list[float]:
    """`size` requests at once, every `every_s`, the first burst at `first_s`."""
    if size < 1:
        raise ValueError(f"a burst needs at least one request, got {size}")
    return [first_s + (i // size) * every_s for i in range(count)]


def rate_points(count: int, rates: Sequence[float], burst: bool, seed: int) -> dict[str, list[float]]:
    """A load sweep: Poisson at each rate (`rate_2`, ...), then every request at t0 (`burst`)."""
    points = {f"rate_{rate:g}": poisson(count, rate, seed) for rate in rates}
    if burst:
        points[BURST] = at_t0(count)
    return points


class ArrivalQueue:
    """A scenario's pending requests, released in order: each at its send time (open loop),
    or while fewer than `concurrency` are in flight (closed loop)."""

    def __init__(self, items: Sequence, times: Sequence[float] | None = None, concurrency: int | None = None) -> None:
        if (times is None) == (concurrency is None):
            raise ValueError("an arrival queue releases by send times or by concurrency, one of the two")
        if times is not None and len(times) != len(items):
            raise ValueError(f"{len(items)} requests and {len(times)} send times")
        self.pending = list(items)
        self.times = list(times or [])  # empty in a closed loop
        self.concurrency = concurrency

    def __len__(self) -> int:
        return len(self.pending)

    def due(self, now_s: float = 0.0, in_flight: int = 0) -> list:
        """The requests to send now, taken off the queue."""
        if self.concurrency is not None:
            count = max(0, self.concurrency - in_flight)
        else:
            count = sum(1 for _ in itertools.takewhile(lambda t: t <= now_s, self.times))
            del self.times[:count]
        released, self.pending[:count] = self.pending[:count], []
        return released

    def next_s(self) -> float | None:
        """The next send time (open loop), or None."""
        return self.times[0] if self.times else None
