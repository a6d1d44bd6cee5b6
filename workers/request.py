"""A request as the scheduler tracks it: its tokens, progress, KV blocks and status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.api import DEFAULT_PRIORITY, FinishReason, SamplingParams

if TYPE_CHECKING:
    from workers.speculative import DraftGate, TokenHistory


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holding no KV blocks (new, or preempted to recompute)
    FORKING = "forking"  # a parallel choice waiting for its prompt to be computed once
    RUNNING = "running"  # holding device KV blocks
    SWAPPED = "swapped"  # preempted, its KV blocks parked in the host pool
    FINISHED = "finished"


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    """A request as the engine tracks it: tokens, progress and KV blocks.

    The scheduler owns its state: `num_computed` counts tokens whose K/V are in the
    cache, and `Scheduler.update_from_output` moves it forward and appends each sampled
    token, so prefill is `num_computed < len(prompt_token_ids)`. Output tokens may be
    there from the start: a request resumed from another worker's published tokens
    recomputes them with its prompt. Times are `time.perf_counter()` seconds.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = DEFAULT_PRIORITY
    deadline: float | None = None  # finish by then (perf_counter clock), or end with DEADLINE
    # A batch job: it queues behind every interactive request and is preempted first.
    batch: bool = False
    # Resumed from another worker's published tokens (its stream stalled mid-answer): it
    # queues ahead of the rest of its class and may use the takeover allowance.
    takeover: bool = False
    # Whose it is, and whether its tenant was served less lately than another tenant of
    # its priority when it arrived: it then queues ahead of other interactive requests
    # and may swap out the other tenant's (fair preemption, `workers/fair_share.py`).
    tenant: str = ""
    fair: bool = False
    # Its LoRA adapter (None: the base model), and where its blocks' content addresses start:
    # b"" for the base model, the adapter's identity for an adapter's (`workers/adapters.py`),
    # so a prefix computed under one is never reused under another.
    adapter: str | None = None
    cache_root: bytes = b""
    output_token_ids: list[int] = field(default_factory=list)
    # The sampled tokens that end it: its stop_token_ids, and EOS unless ignore_eos.
    stop_token_ids: frozenset[int] = frozenset()
    num_computed: int = 0
    # Device KV blocks in token order, one table per group of layers (`workers/kv_cache.py`).
    block_tables: tuple[list[int], ...] = field(default_factory=lambda: ([],))
    host_block_tables: tuple[list[int], ...] = ()  # the blocks its groups held, in the host tier while SWAPPED
    # Content addresses of its first full blocks, computed as the prefix cache needs them.
    block_addresses: list[bytes] = field(default_factory=list)
    # Parallel sampling: which choice of its request this is, and (on choice 0) the other
    # choices, forked from it once its prompt is computed (`Scheduler.update_from_output`).
    index: int = 0
    forks: list[Request] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # The scheduler's bookkeeping: queue order (class, virtual arrival, tie-breaker;
    # `workers/request_queue.py`), and the step it last started running.
    queue_key: tuple[int, float, int] = (1, 0.0, 0)
    running_since_step: int = 0
    # Output tokens it is predicted to produce in all (`workers/length_predictor.py`),
    # at most max_tokens; None without a length policy.
    predicted_output_len: float | None = None
    finish_reason: FinishReason | None = None
    # It stops after its first token, its decode handed to another worker (disaggregated serving).
    hands_off: bool = False
    # Speculative decoding (`workers/speculative.py`): how many tokens it may draft, and
    # its tokens as the proposer indexes them. None for a request that never speculates.
    draft_gate: DraftGate | None = None
    history: TokenHistory | None = None
    # Timestamps (time.perf_counter) for the final event's timings.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Past its prompt with exactly the last sampled token left to run."""
        output = self.output_token_ids  # read for every running request every step: no nested property
        return bool(output) and len(self.prompt_token_ids) + len(output) - self.num_computed == 1

    @property
    def predicted_remaining(self) -> float:
        """Output tokens it is predicted still to produce (0 without a prediction)."""
        if self.predicted_output_len is None:
            return 0.0
        return max(1.0, self.predicted_output_len - len(self.output_token_ids))

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
