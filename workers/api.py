"""The engine's public types: what a caller asks for (`GenerationRequest`, its `SamplingParams`)
and the events it gets back (`TokenEvent`, `FinalEvent`). The scheduler's own request state is
`workers/request.py`."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class InvalidRequest(ValueError):
    """Raised for bad input; the message is shown to the client of that request only."""


# Most choices one request may ask for (`SamplingParams.n`).
MAX_CHOICES = 16
# Most alternatives a token's event may list (`SamplingParams.top_logprobs`).
MAX_TOP_LOGPROBS = 20
# Most strings a `choice` constraint may hold.
MAX_CHOICE_STRINGS = 1024

# Request priority: an integer in [PRIORITY_MIN, PRIORITY_MAX]; higher runs first.
PRIORITY_MIN, PRIORITY_MAX, DEFAULT_PRIORITY = -10, 10, 0


def validate_priority(priority) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidRequest(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r}")


# Temperatures this small are argmax in all but name, and dividing by them overflows float32.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    # 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    temperature: float = 0.0
    # 0 disables top-k; 1.0 disables top-p.
    top_k: int = 0
    top_p: float = 1.0
    # With a seed, a request draws from its own generator: the same seed gives the
    # same tokens whatever else shares the batch.
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    # Keep generating past EOS (benchmarks need fixed output lengths).
    ignore_eos: bool = False
    # Parallel sampling: this many choices from one prompt, computed once and shared
    # (choice i draws from seed + i when seeded).
    n: int = 1
    # Structured output: at most one constraint, checked by a grammar (workers/structured.py).
    json_schema: dict | bool | None = None  # the output is JSON valid under this schema
    json_object: bool = False  # the output is any JSON object
    regex: str | None = None  # the output fully matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    # Log probabilities of the model's own distribution (before any constraint's mask):
    # the chosen token's, and the `top_logprobs` best alternatives (which imply `logprobs`).
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.json_object or self.regex is not None or self.choice is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @cached_property  # read for every request every step; the fields never change
    def argmax_only(self) -> bool:
        """Its token is the argmax of the model's logits, with nothing else to compute."""
        return self.greedy and not self.constrained and not self.wants_logprobs

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequest(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise InvalidRequest(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequest(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequest(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if len(self.stop) > 16:
            raise InvalidRequest(f"at most 16 stop strings, got {len(self.stop)}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        self._validate_structured()

    def _validate_structured(self) -> None:
        given = [
            name
            for name, value in (("json_schema", self.json_schema), ("regex", self.regex), ("choice", self.choice))
            if value is not None
        ]
        if self.json_object is not False:
            if not isinstance(self.json_object, bool):
                raise InvalidRequest(f"json_object must be true or false, got {self.json_object!r}")
            given.append("json_object")
        if len(given) > 1:
            raise InvalidRequest(f"give at most one of json_schema, json_object, regex and choice, got {given}")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise InvalidRequest("json_schema must be a JSON schema: an object (or true/false)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequest("regex must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (tuple, list))
            or not self.choice
            or len(self.choice) > MAX_CHOICE_STRINGS
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequest(f"choice must be a list of 1 to {MAX_CHOICE_STRINGS} non-empty strings")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequest(f"logprobs must be true or false, got {self.logprobs!r}")
        if (
            isinstance(self.top_logprobs, bool)
            or not isinstance(self.top_logprobs, int)
            or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequest(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )


Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


@dataclass(frozen=True)
class GenerationRequest:
    """One request, as the edge hands it to the engine (`Engine.add_request`).

    `priority` is an integer in [PRIORITY_MIN, PRIORITY_MAX], higher first.
    `deadline` is a wall-clock time (`time.time()` seconds): a request not finished
    by then ends with finish_reason `deadline`, keeping the tokens it produced.
    `arrived_at` (a `time.time()` in the past) is when a request that waited
    elsewhere first arrived, e.g. a job taken over from a worker that died: it keeps
    its place in the queue's order, and its timings count from then.
    `resumed_output_ids` are output tokens another worker already produced for this
    request: they count towards `max_tokens` and `usage.completion_tokens`, are
    recomputed with the prompt, and generation goes on after them (their text is
    not emitted again; stop strings are matched in the new text only). With
    `params.n` > 1 it holds one such list per choice (or is empty). A choice whose
    tokens already end in a stop token or reach max_tokens has ended; a request
    whose every choice has ended has only its final event.
    `handoff_min_prompt_tokens` (disaggregated serving, on a prefill worker): a request
    whose prompt has at least that many tokens stops after its first token with
    finish_reason `handoff`, and its prompt's full KV blocks are staged in the engine's
    handoff arena under its request id, for a decode worker to read (`hands_off` says
    which requests may: one choice, no stop strings, no constraint).
    `prompt_kv` (on a decode worker): the K/V of the prompt's first full blocks, read
    from the prefill worker, shaped like the KV pool's blocks (`[layers, 2, blocks,
    block_size, kv_heads, head_dim]`): they enter the prefix cache (empty device blocks,
    then the host tier), so the request computes only the rest.
    `batch` (a batch job) makes it run only on capacity interactive requests leave
    free: it queues behind every interactive request, whatever their priorities and
    however long it waited, and while running it is preempted (swapped out, else
    recomputed later) the step an interactive request needs its running slot or its KV
    blocks. Among batch requests, priority and aging order them as usual.
    `tenant` (with `SchedulerConfig.fair_preempt_after_s`): a request of a tenant served
    fewer tokens here lately than another tenant of its priority queues ahead of other
    interactive requests, and once it has waited that long for room, swaps out a
    running request of the tenant served most lately (`workers/fair_share.py`).
    `adapter` names the LoRA adapter (multi-LoRA, `workers.config.LoRAConfig`) the
    request runs under, None for the base model: one the engine loaded, else the request's
    only event is an error with code `unknown_adapter`. Requests of different adapters,
    and of none, share steps; a prompt prefix computed under one adapter is reused only
    under that adapter. Every choice of a request with `params.n` > 1 runs under it.
    With `params.n` > 1 the prompt is computed once and the choices share its KV
    blocks; every token event names its choice (`index`), and the one final event
    comes when the last choice ends, with each choice's end in `choices`.
    Nothing is checked here: the engine validates a request as it takes it, and bad
    input becomes the request's error event.
    """

    request_id: str
    prompt: Prompt
    params: SamplingParams = SamplingParams()
    priority: int = DEFAULT_PRIORITY
    deadline: float | None = None
    arrived_at: float | None = None
    resumed_output_ids: Sequence[int] | Sequence[Sequence[int]] = ()
    handoff_min_prompt_tokens: int | None = None
    prompt_kv: torch.Tensor | None = None
    batch: bool = False
    tenant: str = ""
    adapter: str | None = None

    @property
    def hands_off(self) -> bool:
        """It may be handed to a decode worker after its first token: the decode side
        resumes it from the published token, which a stop string held back, a grammar
        or a second choice would not survive."""
        params = self.params
        return (
            self.handoff_min_prompt_tokens is not None and params.n == 1 and not params.stop and not params.constrained
        )


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    DEADLINE = "deadline"  # its deadline passed before it finished
    # Its constraint's grammar allows no token that continues the output (nor its end).
    GRAMMAR_DEAD_END = "grammar_dead_end"
    ERROR = "error"
    # Its first token is out and its decode goes to another worker (disaggregated
    # serving): an end for this engine only, never published.
    HANDOFF = "handoff"


class ErrorCode(str, enum.Enum):
    """Why a request ended in error; the values are the protocol's error codes."""

    INVALID_REQUEST = "invalid_request"  # bad input: this request only
    INTERNAL_ERROR = "internal_error"  # the model step that ran it failed
    INVALID_GRAMMAR = "invalid_grammar"  # its json_schema or regex cannot be compiled
    # Its predicted finish misses its deadline (under a length policy): refused when read.
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    UNKNOWN_ADAPTER = "unknown_adapter"  # it names a LoRA adapter the engine has not loaded


class TopLogprob(NamedTuple):
    """One of the most likely tokens at a position."""

    token_id: int
    token: str  # its text, decoded alone
    logprob: float


@dataclass(slots=True)  # not frozen: a frozen dataclass builds several times slower, and one is built per token
class TokenEvent:
    """New tokens of one request's choice: their ids and the text they complete."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    index: int = 0  # the choice (parallel sampling); always 0 when n is 1
    # With `logprobs`: the token's log probability and its own text (decoded alone); with
    # `top_logprobs`, the most likely tokens, best first.
    logprob: float | None = None
    token: str | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ChoiceEnd:
    """How one choice of a request with n > 1 ended."""

    index: int
    finish_reason: FinishReason
    completion_tokens: int
    text: str = ""  # text held back until the end (a partial stop-string match), now final


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timings:
    """Seconds. `token_times` are each output token's offsets from arrival."""

    queue_s: float
    first_token_s: float | None
    total_s: float
    token_times: tuple[float, ...]


@dataclass(frozen=True)
class FinalEvent:
    """The last event of a request: why it ended, what it used, how long it took."""

    request_id: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    text: str = ""  # any text held back (e.g. a partial stop-string match) that is now final
    error: str | None = None  # with finish_reason ERROR: what went wrong, for the client
    error_code: ErrorCode | None = None  # with finish_reason ERROR
    # With n > 1: every choice's end, by index. Then `finish_reason` is the reason the
    # last choice ended, `text` is empty, and usage counts the tokens of all choices.
    choices: tuple[ChoiceEnd, ...] = ()


Event = TokenEvent | FinalEvent
