"""What a step did and where the engine stands after it: the figures the engine hands
its observer (metrics) and the benchmarks, made once a step (`Engine.step`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from workers.model_runner import StepOutput
from workers.plan import CacheStats, Census, ScheduledChunk, StepPlan


@dataclass(frozen=True)
class StepRecord:
    """What one step did and what it cost (for benchmarks and metrics). Decode tokens
    include the draft tokens verified; `num_sampled` counts requests that sampled."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled: int
    num_preempted: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    forward_s: float
    swap_s: float
    step_s: float
    num_swapped_out: int = 0  # requests among `num_preempted` swapped to host; the rest recompute
    num_swapped_in: int = 0  # requests swapped back in
    # (drafted, accepted) of each request that verified drafts (speculative decoding).
    verified: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens verified (among the decode tokens)."""
        return sum(drafted for drafted, _ in self.verified)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(accepted for _, accepted in self.verified)

    @property
    def acceptance(self) -> tuple[float, ...]:
        """Accepted / drafted of each request that verified drafts."""
        return tuple(accepted / drafted for drafted, accepted in self.verified)


@dataclass(frozen=True)
class EngineStats:
    """The engine after a step, for an observer (metrics): what the step did (None when
    it ran nothing) and where requests and KV blocks stand."""

    step: StepRecord | None
    census: Census
    oldest_waiting_s: float  # how long the longest-waiting queued request has waited; 0 if none
    device_blocks_used: int
    device_blocks_total: int
    host_blocks_used: int
    host_blocks_total: int  # 0 without a host pool
    cache: CacheStats = CacheStats()  # the prefix cache
    # Latencies as this step made them, reported now rather than when their requests
    # finish: queue time of the requests it first scheduled, time to first token (from
    # arrival) and time since the previous token of the tokens it produced.
    queue_s: tuple[float, ...] = ()
    first_token_s: tuple[float, ...] = ()
    inter_token_s: tuple[float, ...] = ()
    # (predicted, actual) output lengths of the requests that ended this step, under a length policy.
    length_outcomes: tuple[tuple[float, int], ...] = ()


def step_record(
    plan: StepPlan,
    output: StepOutput,
    sampling: list[ScheduledChunk],
    num_accepted: list[int],
    num_swapped_out: int,
    started: float,
) -> StepRecord:
    """What the step that ran `plan` did, from its plan, its output and its samples."""
    num_decode = plan.num_decode_tokens
    return StepRecord(
        plan.num_tokens - num_decode,
        num_decode,
        len(sampling),
        len(plan.preempted),
        len(plan.swap_out),
        len(plan.swap_in),
        output.forward_s,
        output.swap_s,
        time.perf_counter() - started,
        num_swapped_out=num_swapped_out,
        num_swapped_in=len(plan.resumed),
        verified=tuple((len(c.drafts), accepted) for c, accepted in zip(sampling, num_accepted) if c.drafts),
    )
