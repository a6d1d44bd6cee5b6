"""Per-token timestamps turned into the benchmark's figures, the same way for every system:
`summarize` takes each request's token times after t0 (every request sent then);
`latency_figures` takes `RequestRecord`s, timed from each one's send. `in_turns` times the
tools' cases (`python -m bench.NAME`)."""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), numpy's default ("linear"): rank (n - 1) * q / 100."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def percentile_or_none(values: list[float], q: float, digits: int | None = None) -> float | None:
    """`percentile`, None when there are no values; rounded to `digits` if given."""
    if not values:
        return None
    value = percentile(values, q)
    return value if digits is None else round(value, digits)


def metric_total(metrics: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, in a process's
    /metrics as `{(name, sorted labels): value}` (`WorkerProcess.metrics`)."""
    return sum(v for (metric, has), v in metrics.items() if metric == name and labels.items() <= dict(has).items())


def inter_token_latencies(token_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


def summarize(token_times: dict[str, list[float]], peak_rss_mb: float) -> dict:
    """The per-system figures from each request's token times (seconds after t0). Throughput
    is output tokens over t0 to the last token; ITL pools every request's gaps."""
    if not token_times or any(not times for times in token_times.values()):
        raise ValueError("every request needs at least one token time")
    wall = max(times[-1] for times in token_times.values())
    ttfts = [times[0] for times in token_times.values()]
    itls = [gap for times in token_times.values() for gap in inter_token_latencies(times)]
    output_tokens = sum(len(times) for times in token_times.values())
    return {
        "output_tokens_per_s": output_tokens / wall,
        "requests_per_s": len(token_times) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "peak_rss_mb": peak_rss_mb,
        "wall_s": wall,
        "output_tokens": output_tokens,
    }


@dataclass
class RequestRecord:
    """One request as its caller saw it; times in seconds."""

    sent_s: float  # after t0
    chunk_times_s: list[float] = field(default_factory=list)  # each token or text chunk's arrival, after sent
    end_s: float | None = None  # the stream's end, after sent
    completion_tokens: int = 0  # the system's count
    prompt_tokens: int | None = None  # the system's count
    error: str | None = None
    request_id: str | None = None  # the system's id for it, where it gives one

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0]

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (tokens - 1); None for a one-token answer."""
        if self.completion_tokens < 2 or self.end_s is None:
            return None
        return (self.end_s - self.ttft_s) / (self.completion_tokens - 1)


def latency_figures(records: list[RequestRecord]) -> dict:
    """TTFT, TPOT, ITL and E2E of the records that did not fail, in ms (None where there is no value)."""
    done = [r for r in records if r.error is None]
    tpots = [tpot for r in done if (tpot := r.tpot_s) is not None]
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft_s for r in done],
        "tpot": tpots,
        "itl": [gap for r in done for gap in inter_token_latencies(r.chunk_times_s)],
        "e2e": [r.end_s for r in done if r.end_s is not None],
    }
    figures: dict[str, float | None] = {}
    for name, values in samples.items():
        if name == "tpot":
            figures["tpot_mean_ms"] = sum(tpots) / len(tpots) * 1e3 if tpots else None
        for q in (50, 99):
            figures[f"{name}_p{q}_ms"] = percentile(values, q) * 1e3 if values else None
    return figures


def timed(call) -> tuple[float, float]:
    """Wall and CPU milliseconds of one `call()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return 1e3 * (time.perf_counter() - wall), 1e3 * (time.process_time() - cpu)


def in_turns(cases: dict, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Each case's wall and CPU ms in every round, the cases called in turns, so that load on
    a shared machine disturbs them alike."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, call in cases.items():
            samples[name].append(timed(call))
    return samples


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
