"""Input validation: a `GenerationRequest` checked against the model and the engine's
limits, and made into the scheduler's `Request`s, one per choice.

It runs on the caller's thread (`Engine.add_request`), never in a step: the prompt is
tokenized here, and a constraint's grammar compiled (or found cached). Bad input raises
`InvalidRequest` (`InvalidGrammar` for a grammar that cannot be compiled, `UnknownAdapter`
for a LoRA adapter the engine has not loaded).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.api import GenerationRequest, InvalidRequest, Prompt, SamplingParams, validate_priority
from workers.model_loader import encode_prompt
from workers.request import Request
from workers.structured import Grammars

if TYPE_CHECKING:  # typing_extensions comes with torch; only the type checker reads it here
    from typing_extensions import TypeIs


class UnknownAdapter(InvalidRequest):
    """The request names a LoRA adapter the engine has not loaded (`unknown_adapter`)."""


@dataclass(frozen=True)
class Limits:
    """What a request must fit in."""

    vocab_size: int
    max_context: int  # prompt + max_tokens, in tokens
    max_running_requests: int  # the choices of one request run together
    kv_tokens: int  # the most tokens the KV cache holds for one request (`KVCacheManager.most_tokens`)


def arrival_time(arrived_at: float | None) -> float:
    """When a request arrived, on the engine's clock (`time.perf_counter`): now, or
    `arrived_at` (a `time.time()`) for one that waited elsewhere first."""
    arrival = time.perf_counter()
    if arrived_at is not None and math.isfinite(arrived_at):
        arrival -= max(0.0, time.time() - arrived_at)
    return arrival


class RequestValidator:
    def __init__(
        self,
        tokenizer,
        limits: Limits,
        grammars: Grammars,
        eos_token_ids: frozenset[int],
        adapters: Mapping[str, bytes] | None = None,
    ) -> None:
        """`adapters`: the loaded LoRA adapters' cache roots by name (`workers/adapters.py`),
        read as it changes (the engine's own mapping); None: none."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.adapters: Mapping[str, bytes] = adapters if adapters is not None else {}

    def requests(self, request: GenerationRequest, arrival: float) -> list[Request]:
        """`request`, checked, as one scheduler `Request` per choice (each holding the
        output tokens it resumes from); raises `InvalidRequest` for bad input."""
        params, deadline = request.params, request.deadline
        prompt_ids = self._prompt_ids(request.prompt, params)
        resumed = self._resumed(request.resumed_output_ids, params)
        validate_priority(request.priority)
        if not isinstance(request.batch, bool):
            raise InvalidRequest(f"batch must be true or false, got {request.batch!r}")
        cache_root = self._cache_root(request.adapter)
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline)
        ):
            raise InvalidRequest(f"deadline must be a unix time in seconds, got {deadline!r}")
        if params.constrained:
            self.grammars.compile(params)
        # The engine's clock is perf_counter: carry the deadline over to it.
        local_deadline = None if deadline is None else arrival + (deadline - time.time())
        stop_ids = frozenset(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
        min_handoff = request.handoff_min_prompt_tokens  # given whenever `hands_off`
        hands_off = request.hands_off and min_handoff is not None and len(prompt_ids) >= min_handoff
        return [
            Request(
                request.request_id,
                prompt_ids,
                params,
                arrival,
                request.priority,
                local_deadline,
                batch=request.batch,  # every choice of a batch job is one too
                takeover=any(resumed),
                tenant=request.tenant,
                adapter=request.adapter,  # every choice runs under it
                cache_root=cache_root,
                output_token_ids=output_ids,
                stop_token_ids=stop_ids,
                index=index,
                hands_off=hands_off,
            )
            for index, output_ids in enumerate(resumed)
        ]

    def _cache_root(self, adapter: object) -> bytes:
        """Where the content addresses of a request under `adapter` start (`Request.cache_root`)."""
        if adapter is None:
            return b""
        if not isinstance(adapter, str):
            raise InvalidRequest(f"adapter must be an adapter's name or null, got {adapter!r}")
        root = self.adapters.get(adapter)
        if root is None:
            raise UnknownAdapter(f"no LoRA adapter {adapter!r} is loaded on this worker")
        return root

    def _prompt_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        limits = self.limits
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be SamplingParams")
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty")
            prompt_ids = encode_prompt(self.tokenizer, prompt)
        elif not isinstance(prompt, list) or not prompt:
            raise InvalidRequest("prompt must be a non-empty string, chat message list or token id list")
        elif _is_token_ids(prompt):
            if not all(0 <= t < limits.vocab_size for t in prompt):
                raise InvalidRequest(f"prompt token ids must be in [0, {limits.vocab_size})")
            prompt_ids = list(prompt)
        else:
            prompt_ids = encode_prompt(self.tokenizer, prompt)
        if not prompt_ids:
            raise InvalidRequest("prompt is empty after tokenization")
        if len(prompt_ids) >= limits.max_context:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {limits.max_context} tokens"
            )
        if len(prompt_ids) + params.max_tokens > limits.max_context:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {limits.max_context} tokens"
            )
        if params.n > limits.max_running_requests:
            raise InvalidRequest(
                f"n ({params.n}) is above max_running_requests "
                f"({limits.max_running_requests}): its choices run together"
            )
        if len(prompt_ids) + params.max_tokens > limits.kv_tokens:
            raise InvalidRequest(
                f"prompt + max_tokens needs more KV cache than the whole pool ({limits.kv_tokens} tokens)"
            )
        return prompt_ids

    def _resumed(self, output_ids, params: SamplingParams) -> list[list[int]]:
        """The resumed output tokens, one list per choice."""
        vocab_size = self.limits.vocab_size
        if params.n == 1:
            per_choice = [output_ids]
        elif not output_ids:
            per_choice = [[] for _ in range(params.n)]
        elif len(output_ids) == params.n and all(isinstance(ids, (list, tuple)) for ids in output_ids):
            per_choice = output_ids
        else:
            raise InvalidRequest(f"resumed output must hold one token id list per choice ({params.n})")
        for ids in per_choice:
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
                raise InvalidRequest(f"resumed output token ids must be in [0, {vocab_size})")
            if len(ids) > params.max_tokens:
                raise InvalidRequest(f"{len(ids)} resumed output tokens leave none of max_tokens ({params.max_tokens})")
        return [list(ids) for ids in per_choice]


def _is_token_ids(prompt: list[dict] | list[int]) -> TypeIs[list[int]]:
    """A non-empty list of token ids (ints; a bool is none)."""
    return bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
