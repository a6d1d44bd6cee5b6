"""What a perfect length prediction could give at most, by simulation: the mean end-to-end
latency of first come, first served against strictly shortest first with the true
lengths, on a batch of `slots` requests that each make one token a step (a fixed cost, as
a decode step's nearly is), under Poisson arrivals at `load` x the batch's capacity.

    python -m bench.sjf_bound [--capped-share 0.59] [--cap 384] [--requests 150]

The default lengths are the `length` scenario's: a share at the cap, the rest 4-300 tokens.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics


def mean_latency(lengths: list[int], arrivals: list[float], shortest_first: bool, slots: int) -> float:
    """Mean steps from arrival to the last token, each request run to its end once started."""
    queue: list[tuple[int, float, int]] = []
    running: dict[int, int] = {}  # request -> tokens left
    latency: dict[int, float] = {}
    now, arrived = 0.0, 0
    while len(latency) < len(lengths):
        while arrived < len(lengths) and arrivals[arrived] <= now:
            heapq.heappush(queue, (lengths[arrived] if shortest_first else 0, arrivals[arrived], arrived))
            arrived += 1
        while queue and len(running) < slots:
            _, _, request = heapq.heappop(queue)
            running[request] = lengths[request]
        if not running:
            now = arrivals[arrived]
            continue
        now += 1
        for request in list(running):
            running[request] -= 1
            if running[request] == 0:
                del running[request]
                latency[request] = now - arrivals[request]
    return statistics.mean(latency.values())


def fcfs_over_shortest_first(slots: int, load: float, requests: int, capped_share: float, cap: int, seed: int) -> float:
    """fcfs's mean latency over shortest-first's, on one seeded draw of lengths and arrivals."""
    rng = random.Random(seed)
    lengths = [cap if rng.random() < capped_share else rng.randint(4, min(300, cap)) for _ in range(requests)]
    rate = load * slots / statistics.mean(lengths)
    arrivals, now = [], 0.0
    for _ in lengths:
        arrivals.append(now)
        now += rng.expovariate(rate)
    return mean_latency(lengths, arrivals, False, slots) / mean_latency(lengths, arrivals, True, slots)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sjf_bound", description=__doc__.splitlines()[0])
    parser.add_argument("--capped-share", type=float, default=0.59, help="share of replies at the cap")
    parser.add_argument("--cap", type=int, default=384, help="the reply cap in tokens")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=20, help="draws per point")
    args = parser.parse_args()
    for slots in (16, 64):
        for load in (0.5, 0.8, 0.95, 1.5):
            ratios = [
                fcfs_over_shortest_first(slots, load, args.requests, args.capped_share, args.cap, seed)
                for seed in range(args.seeds)
            ]
            print(
                f"{slots} running, load {load}: fcfs / shortest-first mean latency "
                f"{statistics.mean(ratios):.2f} (draws {min(ratios):.2f}-{max(ratios):.2f})"
            )


if __name__ == "__main__":
    main()
