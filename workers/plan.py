"""What the scheduler hands the runner for one step (`StepPlan` of `ScheduledChunk`s), and the
figures it reports about its queues and the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from workers.request import Request


class ScheduledChunk(NamedTuple):
    """Tokens [start, start + len(token_ids)) of `request`, run in this step.

    Facts fixed when the step was planned, for the runner and the sampler: the request
    itself moves on only in `Scheduler.update_from_output`. (A named tuple: one is
    built per request per step, and it builds several times faster than a dataclass.)
    """

    request: Request
    start: int
    token_ids: tuple[int, ...]
    # The request's device KV blocks, in token order, one table per group of layers: its
    # own lists, not copies (planning appends to them only in a later step, so they hold
    # still while this one runs).
    block_tables: tuple[list[int], ...]
    samples: bool  # reaches the request's last known token: a new token is sampled
    is_decode: bool  # the one token a decoding request runs (and its drafts)
    # Draft tokens run after the decode token, to be verified (the last of `token_ids`);
    # the step samples a token at each of them as well.
    drafts: tuple[int, ...] = ()
    adapter: str | None = None  # the request's LoRA adapter (None: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def decode(cls, request: Request) -> ScheduledChunk:
        """The one token a decoding request runs: the one it sampled last."""
        token = (request.output_token_ids[-1],)
        return cls(request, request.num_computed, token, request.block_tables, True, True, (), request.adapter)

    @classmethod
    def prefill(cls, request: Request, num_tokens: int) -> ScheduledChunk:
        """The request's next `num_tokens` prompt tokens; its blocks must already hold them."""
        start = request.num_computed
        end = start + num_tokens
        tokens = tuple(request.token_slice(start, end))
        samples = end == request.num_tokens
        return cls(request, start, tokens, request.block_tables, samples, False, (), request.adapter)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # swapped out or sent back to recompute
    resumed: list[Request] = field(default_factory=list)  # swapped back in
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # The prefix cache's copies: cached device blocks evicted to the host tier, and
    # host-tier hits brought back.
    offload: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    fetch: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Copy on write: shared blocks copied before a request writes into its own copy.
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, device block)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        """Decode tokens, drafts included: they spend the decode budget."""
        return sum(len(c.token_ids) for c in self.chunks if c.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.drafts) for c in self.chunks)

    @property
    def has_work(self) -> bool:
        """Anything for the runner to do: tokens to run or blocks to copy."""
        return bool(self.chunks or self.swap_out or self.swap_in or self.offload or self.fetch or self.copies)

    @property
    def copies_out(self) -> list[tuple[int, int]]:
        """Every (device block, host block) copy, made before `copies_in`."""
        return self.swap_out + self.offload

    @property
    def copies_in(self) -> list[tuple[int, int]]:
        """Every (host block, device block) copy."""
        return self.swap_in + self.fetch


@dataclass(frozen=True)
class Census:
    """How many requests are in each state, by priority (for metrics)."""

    running: dict[int, int]
    waiting: dict[int, int]  # queued, holding no blocks (new, or preempted to recompute)
    swapped: dict[int, int]  # queued, their blocks in the host pool
    oldest_queued_arrival: float | None  # arrival time of the longest-waiting queued request


@dataclass(frozen=True)
class CacheStats:
    """The prefix cache: what one step's admissions found, and where the pools stand."""

    queried_tokens: int = 0  # tokens of the requests admitted this step
    device_hit_tokens: int = 0  # of those, found cached in the device pool
    host_hit_tokens: int = 0  # found in the host tier (copied back)
    offloaded_blocks: int = 0  # cached blocks copied to the host tier this step
    device_evictions: int = 0  # cached blocks dropped, in all so far
    host_evictions: int = 0
    device_cached_blocks: int = 0  # blocks registered now, held or free
    host_cached_blocks: int = 0
