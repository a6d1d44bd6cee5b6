"""The engine's output side: what it keeps of each live request besides the scheduler's
state, and the events its tokens make.

A request the engine has taken is a `RequestState`: its choices (one unless n > 1), each
a `ChoiceState` around the scheduler's `Request` with what the scheduler does not need:
the detokenizer, the choice's random generator, its grammar state and its last sampled
token's log probabilities. After each step `token_events` turns a choice's new tokens
into events, one token event per token: their text, detokenized incrementally, and the
choice's end if the scheduler retired it, its text reached a stop string (the tokens
after that one are dropped) or its grammar ended it. A request's one final event comes
when its last choice ends, with its usage and timings; then it is forgotten.

It also notes each step's latencies for the engine's observer: the queue time of the
requests first scheduled, the time to first token and the time since the previous token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.api import ChoiceEnd, ErrorCode, Event, FinalEvent, FinishReason, Timings, TokenEvent, Usage
from workers.detokenizer import IncrementalDetokenizer
from workers.request import Request, RequestStatus
from workers.sampler import make_generator
from workers.scheduler import Scheduler
from workers.structured import Grammars, GrammarState

_NO_LOGPROBS = (None, None, ())  # a token event's logprob, token and top_logprobs, unasked


@dataclass
class ChoiceState:
    """One choice of a live request, with the state the scheduler does not need."""

    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    end: ChoiceEnd | None = None
    grammar: GrammarState | None = None  # with a constraint: where its output stands in the grammar
    logprobs: tuple | None = None  # with logprobs: its last sampled token's (logprob, token, top_logprobs)


@dataclass
class RequestState:
    """A request the engine has taken: its choices (one unless n > 1), each a `Request`
    to the scheduler. Its final event is made when the last choice ends."""

    choices: list[ChoiceState]
    # The choice that computes the prompt, the others fork from it: set as the engine queues it.
    lead: Request = field(init=False, repr=False)


# The ends that say how long an output really is (not cut short by a cancel or a deadline).
_NATURAL_ENDS = (FinishReason.STOP, FinishReason.LENGTH)


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, grammars: Grammars, release_id: Callable[[str], None]) -> None:
        """`release_id` is called with a request's id once its final event is made."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.grammars = grammars
        self.release_id = release_id
        self.live: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}  # single tokens' text, shared by the detokenizers
        # This step's latencies, for the observer.
        self.queue_s: list[float] = []
        self.first_token_s: list[float] = []
        self.inter_token_s: list[float] = []
        # (predicted, actual) output lengths of the choices that ended this step by a stop
        # or max_tokens, where a length policy predicted them.
        self.length_outcomes: list[tuple[float, int]] = []

    def new_request(self, requests: list[Request]) -> RequestState:
        """The state of a request whose choices are `requests`. A choice resumed with
        tokens that already end it (or leave its grammar nowhere to go) has ended."""
        choices = []
        for request in requests:
            params = request.params
            seed = None if params.seed is None else (params.seed + request.index) % 2**63
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids + request.output_token_ids, params.stop, self._token_texts
            )
            # Each choice's own grammar state, past the tokens a takeover resumes from.
            grammar = self.grammars.start(params, request.output_token_ids) if params.constrained else None
            end = _ended_already(request) or _grammar_ended(request, grammar)
            choices.append(ChoiceState(request, detokenizer, make_generator(seed), end, grammar))
        return RequestState(choices)

    def choice(self, request: Request) -> ChoiceState:
        return self.live[request.request_id].choices[request.index]

    def new_step(self) -> None:
        self.queue_s, self.first_token_s, self.inter_token_s = [], [], []
        self.length_outcomes = []

    def scheduled(self, requests: list[Request], started: float) -> None:
        """`requests` ran in the step that started at `started`: note when each first did."""
        for request in requests:
            if request.scheduled_time is None:
                request.scheduled_time = started
                self.queue_s.append(started - request.arrival_time)

    def token_events(self, request: Request, now: float, num_tokens: int) -> list[Event]:
        """The events of the `num_tokens` tokens `request` just took, one each: its text,
        and its end if the scheduler retired it or its text reached a stop string (the
        tokens after that one are dropped). Runs for every request every step: kept lean."""
        choice = self.live[request.request_id].choices[request.index]
        detokenizer = choice.detokenizer
        logprobs = choice.logprobs or _NO_LOGPROBS
        output, times = request.output_token_ids, request.token_times
        if times:
            self.inter_token_s.append(now - times[-1])
        else:
            request.first_token_time = now
            self.first_token_s.append(now - request.arrival_time)
        events: list[Event] = []
        first = len(output) - num_tokens
        for position in range(first, first + num_tokens):
            if position > first:
                self.inter_token_s.append(0.0)  # accepted drafts: taken with the token before
            times.append(now)
            token_id = output[position]
            text = "" if token_id in request.stop_token_ids else detokenizer.push((token_id,))
            events.append(TokenEvent(request.request_id, (token_id,), text, request.index, *logprobs))
            if detokenizer.stopped:
                if request.status is not RequestStatus.FINISHED:
                    self.scheduler.finish(request, FinishReason.STOP, position + 1)
                elif position + 1 < len(output):
                    # Retired at a later token of this step (max_tokens, a stop token):
                    # the stop string came first.
                    del output[position + 1 :]
                    request.finish_reason = FinishReason.STOP
                break
        if choice.grammar is not None and request.status is not RequestStatus.FINISHED:
            self._end_by_grammar(request, choice.grammar)
        if request.status is RequestStatus.FINISHED:
            events.extend(self._choice_ended(request))
        return events

    def retire(
        self, request: Request, reason: FinishReason, error: str | None = None, error_code: ErrorCode | None = None
    ) -> list[Event]:
        """End `request`'s whole request (cancelled, expired, failed): every choice still
        going ends for `reason`. Returns its final event."""
        state = self.live[request.request_id]
        for choice in state.choices:
            if choice.end is None:
                if choice.request.status is not RequestStatus.FINISHED:
                    self.scheduler.finish(choice.request, reason)
                _end_choice(choice, reason, error)
        return [self.request_final(state, reason, error, error_code)]

    def request_final(
        self, state: RequestState, reason: FinishReason, error: str | None = None, error_code: ErrorCode | None = None
    ) -> FinalEvent:
        """The final event of a request whose choices have all ended (`reason`: why the
        last one did); the request is forgotten."""
        requests = [choice.request for choice in state.choices]
        ends = tuple(choice.end for choice in state.choices if choice.end is not None)
        if len(ends) != len(state.choices):
            raise ValueError(f"request {requests[0].request_id} has a choice that has not ended")
        self.forget(requests[0].request_id)
        if len(ends) == 1:
            return final_event(requests, reason, ends[0].text, error, error_code)
        return final_event(requests, reason, "", error, error_code, ends)

    def forget(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        self.release_id(request_id)

    def _end_by_grammar(self, request: Request, grammar: GrammarState) -> None:
        """End a choice at a dead end of its grammar, or past its end (EOS ignored)."""
        if grammar.dead_end:
            self.scheduler.finish(request, FinishReason.GRAMMAR_DEAD_END)
        elif grammar.complete:
            self.scheduler.finish(request, FinishReason.STOP)

    def _choice_ended(self, request: Request) -> list[Event]:
        """A choice the scheduler has retired; its request's final event if it was the last."""
        state = self.live[request.request_id]
        reason = request.finish_reason
        if reason is None:
            raise ValueError(f"choice {request.index} of {request.request_id} is not finished")
        _end_choice(state.choices[request.index], reason)
        if request.predicted_output_len is not None and request.finish_reason in _NATURAL_ENDS:
            self.length_outcomes.append((request.predicted_output_len, len(request.output_token_ids)))
        if any(choice.end is None for choice in state.choices):
            return []
        return [self.request_final(state, reason)]


def final_event(
    requests: list[Request],
    reason: FinishReason,
    text: str = "",
    error: str | None = None,
    error_code: ErrorCode | None = None,
    choices: tuple[ChoiceEnd, ...] = (),
) -> FinalEvent:
    """A request's final event; its choices' tokens and times taken together."""
    now = time.perf_counter()
    first = requests[0]
    arrival = first.arrival_time
    scheduled = [r.scheduled_time for r in requests if r.scheduled_time is not None]
    first_tokens = [r.first_token_time for r in requests if r.first_token_time is not None]
    token_times = sorted(t for r in requests for t in r.token_times) if len(requests) > 1 else first.token_times
    return FinalEvent(
        first.request_id,
        reason,
        Usage(first.num_prompt_tokens, sum(len(r.output_token_ids) for r in requests)),
        Timings(
            queue_s=min(scheduled, default=now) - arrival,
            first_token_s=min(first_tokens) - arrival if first_tokens else None,
            total_s=now - arrival,
            token_times=tuple(t - arrival for t in token_times),
        ),
        text=text,
        error=error,
        error_code=error_code,
        choices=choices,
    )


def _end_choice(choice: ChoiceState, reason: FinishReason, error: str | None = None) -> None:
    detokenizer = choice.detokenizer
    tail = "" if detokenizer.stopped or error else detokenizer.flush()
    choice.end = ChoiceEnd(choice.request.index, reason, len(choice.request.output_token_ids), tail)


def _ended_already(request: Request) -> ChoiceEnd | None:
    """A resumed choice whose published tokens already end it."""
    output = request.output_token_ids
    if len(output) >= request.params.max_tokens:
        reason = FinishReason.LENGTH
    elif output and output[-1] in request.stop_token_ids:
        reason = FinishReason.STOP
    else:
        return None
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    return ChoiceEnd(request.index, reason, len(output))


def _grammar_ended(request: Request, grammar: GrammarState | None) -> ChoiceEnd | None:
    """A choice whose grammar left it nowhere to go, or whose output is whole."""
    if grammar is None or not (grammar.dead_end or grammar.complete):
        return None
    reason = FinishReason.GRAMMAR_DEAD_END if grammar.dead_end else FinishReason.STOP
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    return ChoiceEnd(request.index, reason, len(request.output_token_ids))
