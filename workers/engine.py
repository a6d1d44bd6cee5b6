"""The engine: add requests, cancel them, and step.

One `step()` reads as schedule → run → sample → update:
the scheduler picks this step's tokens, the model runner runs one forward over them,
the sampler draws a token for every request that reached the end of its known
tokens, and the scheduler moves each request on and retires the finished ones, their
blocks freed at once. The engine turns what changed into events (detokenized text,
stop strings, timings), one token event per token.

**Verifying drafts** (speculative decoding, `workers/speculative.py`). A speculating
request's chunk is its last token and K drafts, and the step returns logits at each of
them. The sampler draws at the first position as for any request; while the drawn token
equals the draft at that position, the draft is accepted and the next position is drawn
(with the request's own generator, one draw per position, as without speculation), up
to the position after the last draft. The last token drawn is the model's own next
token. Greedy, this keeps the longest prefix of drafts that the argmax agrees with.
Sampled, it is rejection sampling against a point-mass draft: a draft x is accepted
with probability p(x), and on rejection the token drawn is distributed as p with x
removed, renormalized (the residual max(p - q, 0)); so the output keeps the model's
distribution, and a seeded request draws the very tokens it draws without speculation.

`add_request` and `cancel` may be called from another thread than `step` (the async
front end steps in a worker thread): they only validate and post a command
(`AddRequest`, `CancelRequest`, `FailRequest`) to an inbox that the next step drains.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.api import (
    ChoiceEnd,
    ErrorCode,
    Event,
    FinalEvent,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    Prompt,
    SamplingParams,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
    validate_priority,
)
from workers.block_pool import BlockPool, blocks_needed
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.logprobs import log_probs, token_logprobs
from workers.model_loader import LoadedModel, encode_prompt, load_model
from workers.model_runner import ModelRunner
from workers.plan import CacheStats, Census, ScheduledChunk
from workers.request import Request, RequestStatus
from workers.sampler import Sampler, make_generator
from workers.scheduler import Scheduler
from workers.structured import Grammars, GrammarState, InvalidGrammar

_log = logging.getLogger("inflight.engine")
_NO_LOGPROBS = (None, None, ())  # a token event's logprob, token and top_logprobs, unasked


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


@dataclass
class _Choice:
    """One choice of a live request, with the state the scheduler does not need."""

    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    end: ChoiceEnd | None = None
    grammar: GrammarState | None = None  # with a constraint: where its output stands in the grammar
    logprobs: tuple | None = None  # with logprobs: its last sampled token's (logprob, token, top_logprobs)


@dataclass
class _Live:
    """A request the engine has taken: its choices (one unless n > 1), each a `Request`
    to the scheduler. Its final event is made when the last choice ends."""

    choices: list[_Choice]
    lead: Request | None = None  # the choice that computes the prompt; the others fork from it


# The commands `add_request` and `cancel` post for the stepping thread.
@dataclass(frozen=True)
class AddRequest:
    live: _Live


@dataclass(frozen=True)
class CancelRequest:
    request_id: str


@dataclass(frozen=True)
class FailRequest:
    """A request that ends at `add_request` (refused, or resumed with nothing left to
    make): its only event is this one."""

    event: FinalEvent


Command = AddRequest | CancelRequest | FailRequest


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = loaded.tokenizer
        # The paged attention is full attention; it agrees with a sliding-window model
        # only within the window, so requests are held to it.
        window = getattr(loaded.model.config, "sliding_window", None)
        self.max_context = min(loaded.max_context, window) if window else loaded.max_context
        self.vocab_size = loaded.model.config.vocab_size
        self.runner = ModelRunner(loaded.model, config.cache, model_config=config.model)
        self.block_size = config.cache.block_size
        self.allocator = BlockPool(self.runner.kv_cache.num_blocks)
        self.host_allocator = BlockPool(self.runner.num_host_blocks) if self.runner.num_host_blocks else None
        # Cached blocks are only valid for the K/V of this model in this dtype with these weights.
        salt = hashlib.blake2b(
            f"{config.model.source}|{config.model.dtype}|{config.model.weights}".encode(), digest_size=16
        ).digest()
        self.scheduler = Scheduler(
            config.scheduler,
            self.allocator,
            self.block_size,
            self.host_allocator,
            salt if config.cache.prefix_caching else None,
            config.speculative,
        )
        self.sampler = Sampler()
        self.eos_token_ids = _eos_token_ids(loaded)
        self._token_texts: dict[int, str] = {}  # single tokens' text, shared by the detokenizers
        self.grammars = Grammars(
            self.tokenizer, self.vocab_size, self.eos_token_ids, config.structured.grammar_cache_size
        )
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()  # guards the inbox and the set of known ids
        self._inbox: list[Command] = []
        self._known_ids: set[str] = set()
        # Called at the end of every step, in the stepping thread; must be quick.
        self.observer: Callable[[EngineStats], None] | None = None
        self._queue_s: list[float] = []  # this step's latencies, for the observer
        self._first_token_s: list[float] = []
        self._inter_token_s: list[float] = []

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        return cls(load_model(config.model), config)

    # -- the API -------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request (see `GenerationRequest`). Bad input does not raise: the
        request's only event is an error. A request id that is already live raises
        `InvalidRequest`, since an error event under that id would end the other
        request's stream.
        """
        request_id, prompt, params = request.request_id, request.prompt, request.params
        priority, deadline, arrived_at = request.priority, request.deadline, request.arrived_at
        resumed_output_ids = request.resumed_output_ids
        arrival = time.perf_counter()
        if arrived_at is not None and math.isfinite(arrived_at):
            arrival -= max(0.0, time.time() - arrived_at)
        with self._lock:
            if request_id in self._known_ids:
                raise InvalidRequest(f"request id {request_id!r} is already in use")
            self._known_ids.add(request_id)
        try:
            prompt_ids = self._validate(prompt, params)
            resumed = self._validate_resumed(resumed_output_ids, params)
            validate_priority(priority)
            if deadline is not None and (
                isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline)
            ):
                raise InvalidRequest(f"deadline must be a unix time in seconds, got {deadline!r}")
            if params.constrained:
                self.grammars.compile(params)  # here, on the caller's thread: never in a step
        except InvalidRequest as error:
            empty = Request(request_id, [], params, arrival)
            code = ErrorCode.INVALID_GRAMMAR if isinstance(error, InvalidGrammar) else ErrorCode.INVALID_REQUEST
            self._post(FailRequest(self._final([empty], FinishReason.ERROR, error=str(error), error_code=code)))
            return
        # The engine's clock is perf_counter: carry the deadline over to it.
        local_deadline = None if deadline is None else arrival + (deadline - time.time())
        stop_ids = frozenset(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
        choices = []
        for index, output_ids in enumerate(resumed):
            request = Request(
                request_id,
                prompt_ids,
                params,
                arrival,
                priority,
                local_deadline,
                output_token_ids=list(output_ids),
                stop_token_ids=stop_ids,
                index=index,
            )
            seed = None if params.seed is None else (params.seed + index) % 2**63
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_ids + request.output_token_ids, params.stop, self._token_texts
            )
            # Each choice's own grammar state, past the tokens a takeover resumes from.
            grammar = self.grammars.start(params, request.output_token_ids) if params.constrained else None
            end = self._ended_already(request) or self._grammar_ended(request, grammar)
            choices.append(_Choice(request, detokenizer, make_generator(seed), end, grammar))
        going = [choice.request for choice in choices if choice.end is None]
        if not going:  # a takeover of a request whose every choice had ended
            self._post(FailRequest(self._request_final(_Live(choices), choices[-1].end.finish_reason)))
            return
        lead, *forks = going
        lead.forks = forks
        for fork in forks:
            fork.status = RequestStatus.FORKING
        self._post(AddRequest(_Live(choices, lead)))

    def cancel(self, request_id: str) -> None:
        self._post(CancelRequest(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_unfinished()

    def step(self) -> list[Event]:
        self._queue_s, self._first_token_s, self._inter_token_s = [], [], []
        events, record = self._step()
        if self.observer is not None:
            try:
                self.observer(self.stats(record))
            except Exception:  # metrics must never stop generation
                _log.exception("the step observer failed")
        return events

    def stats(self, record: StepRecord | None = None) -> EngineStats:
        """Where requests and blocks stand now; call from the stepping thread."""
        census = self.scheduler.census()
        oldest = census.oldest_queued_arrival
        host = self.host_allocator
        return EngineStats(
            record,
            census,
            0.0 if oldest is None else time.perf_counter() - oldest,
            self.allocator.num_used,
            self.allocator.num_blocks,
            host.num_used if host else 0,
            host.num_blocks if host else 0,
            self.scheduler.cache_stats(),
            tuple(self._queue_s),
            tuple(self._first_token_s),
            tuple(self._inter_token_s),
        )

    def _step(self) -> tuple[list[Event], StepRecord | None]:
        started = time.perf_counter()
        events = self._drain_inbox()
        for request in self.scheduler.expired(started):
            if request.request_id in self._live:
                events.extend(self._retire(request, FinishReason.DEADLINE))
        plan = self.scheduler.schedule()
        if not plan.has_work:
            return events, None
        num_swapped_out = sum(1 for r in plan.preempted if r.status is RequestStatus.SWAPPED)
        num_decode = plan.num_decode_tokens
        sampling = [c for c in plan.chunks if c.samples]
        first_scheduled = [c.request for c in plan.chunks if c.request.scheduled_time is None]
        try:
            copied = False
            try:
                output = self.runner.execute(plan)
                copied = True
            finally:
                self.scheduler.swaps_done(plan, copied)
            token_ids, num_accepted = self._sample(output.logits, sampling) if sampling else ([], [])
        except Exception as error:  # a failed step fails its requests, not the engine
            message = f"model step failed: {type(error).__name__}: {error}"
            # The requests it ran, and those whose blocks it was moving (their K/V may be lost).
            swapping = [r for r in plan.preempted if r.status is RequestStatus.SWAPPED] + plan.resumed
            failed = {id(r): r for r in [c.request for c in plan.chunks] + swapping}
            for request in failed.values():
                if request.request_id in self._live:
                    events.extend(self._retire(request, FinishReason.ERROR, message, ErrorCode.INTERNAL_ERROR))
            return events, None
        now = time.perf_counter()
        for request in first_scheduled:
            request.scheduled_time = started
            self._queue_s.append(started - request.arrival_time)
        num_outputs = [len(c.request.output_token_ids) for c in sampling]
        took = self.scheduler.update_from_output(plan, token_ids, num_accepted)
        for request, before in zip(took, num_outputs):
            events.extend(self._token_events(request, now, len(request.output_token_ids) - before))
        verified = [(len(c.drafts), accepted) for c, accepted in zip(sampling, num_accepted) if c.drafts]
        self.scheduler.observe_step(plan.num_tokens, time.perf_counter() - started)
        record = StepRecord(
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
            verified=tuple(verified),
        )
        return events, record

    # -- internals -----------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
        """A token for each sampling chunk, and how many of its drafts were accepted (the
        token follows them). `logits` has a row for each chunk and for each of its drafts."""
        if not any(chunk.drafts for chunk in chunks):
            return self._sample_rows(logits, [c.request for c in chunks]), [0] * len(chunks)
        firsts, row = [], 0
        for chunk in chunks:
            firsts.append(row)
            row += 1 + len(chunk.drafts)
        token_ids = self._sample_rows(logits[firsts], [c.request for c in chunks])
        return token_ids, self._verify(logits, chunks, firsts, token_ids)

    def _verify(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk], firsts: list[int], token_ids: list[int]
    ) -> list[int]:
        """Accept each chunk's drafts while the token drawn at a draft's position is that
        draft, drawing the next position's token in its place (see the module doc);
        `token_ids` ends holding each chunk's last token drawn. Returns the accepted counts."""
        accepted = [0] * len(chunks)
        going = [i for i, chunk in enumerate(chunks) if chunk.drafts]
        depth = 0
        while going:
            going = [i for i in going if token_ids[i] == chunks[i].drafts[depth]]
            depth += 1
            if not going:
                break
            requests = [chunks[i].request for i in going]
            drawn = self.sampler.sample(
                logits[[firsts[i] + depth for i in going]],
                [r.params for r in requests],
                [self._choice(r).generator for r in requests],
            )
            for i, token_id in zip(going, drawn):
                token_ids[i] = token_id
                accepted[i] = depth
            going = [i for i in going if depth < len(chunks[i].drafts)]
        return accepted

    def _sample_rows(self, logits: torch.Tensor, sampling: list[Request]) -> list[int]:
        """A token for each sampling row: log probabilities taken first (the model's own),
        then the constrained rows masked, then sampled; grammars take their tokens."""
        if all(r.params.argmax_only for r in sampling):
            return self.sampler.argmax(logits)  # most steps, at every size
        choices = [self._choice(r) for r in sampling]
        wanting = [row for row, r in enumerate(sampling) if r.params.wants_logprobs]
        logprobs = log_probs(logits, wanting) if wanting else None
        constrained = [row for row, choice in enumerate(choices) if choice.grammar is not None]
        if constrained:
            self.grammars.apply(logits, constrained, [choices[row].grammar for row in constrained])
        token_ids = self.sampler.sample(logits, [r.params for r in sampling], [c.generator for c in choices])
        if constrained:
            self.grammars.advance(
                [choices[row].grammar for row in constrained], [token_ids[row] for row in constrained]
            )
        if wanting:
            values = token_logprobs(
                logprobs, [token_ids[row] for row in wanting], [sampling[row].params.top_logprobs for row in wanting]
            )
            for row, (logprob, tops) in zip(wanting, values):
                text_of = choices[row].detokenizer.token_text
                choices[row].logprobs = (
                    logprob,
                    text_of(token_ids[row]),
                    tuple(TopLogprob(i, text_of(i), value) for i, value in tops),
                )
        return token_ids

    @staticmethod
    def _grammar_ended(request: Request, grammar: GrammarState | None) -> ChoiceEnd | None:
        """A choice whose grammar left it nowhere to go, or whose output is whole."""
        if grammar is None or not (grammar.dead_end or grammar.complete):
            return None
        reason = FinishReason.GRAMMAR_DEAD_END if grammar.dead_end else FinishReason.STOP
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return ChoiceEnd(request.index, reason, len(request.output_token_ids))

    def _validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be SamplingParams")
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty")
            prompt_ids = encode_prompt(self.tokenizer, prompt)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            if not all(0 <= t < self.vocab_size for t in prompt):
                raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})")
            prompt_ids = list(prompt)
        elif isinstance(prompt, list) and prompt:
            prompt_ids = encode_prompt(self.tokenizer, prompt)
        else:
            raise InvalidRequest("prompt must be a non-empty string, chat message list or token id list")
        if not prompt_ids:
            raise InvalidRequest("prompt is empty after tokenization")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context} tokens"
            )
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {self.max_context} tokens"
            )
        if params.n > self.config.scheduler.max_running_requests:
            raise InvalidRequest(
                f"n ({params.n}) is above max_running_requests "
                f"({self.config.scheduler.max_running_requests}): its choices run together"
            )
        if blocks_needed(len(prompt_ids) + params.max_tokens, self.block_size) > self.allocator.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens needs more KV cache than the whole pool "
                f"({self.allocator.num_blocks * self.block_size} tokens)"
            )
        return prompt_ids

    def _validate_resumed(self, output_ids, params: SamplingParams) -> list[list[int]]:
        """The resumed output tokens, one list per choice."""
        if params.n == 1:
            per_choice = [output_ids]
        elif not output_ids:
            per_choice = [[] for _ in range(params.n)]
        elif len(output_ids) == params.n and all(isinstance(ids, (list, tuple)) for ids in output_ids):
            per_choice = output_ids
        else:
            raise InvalidRequest(f"resumed output must hold one token id list per choice ({params.n})")
        for ids in per_choice:
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequest(f"resumed output token ids must be in [0, {self.vocab_size})")
            if len(ids) > params.max_tokens:
                raise InvalidRequest(f"{len(ids)} resumed output tokens leave none of max_tokens ({params.max_tokens})")
        return [list(ids) for ids in per_choice]

    @staticmethod
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

    def _post(self, command: Command) -> None:
        with self._lock:
            self._inbox.append(command)

    def _drain_inbox(self) -> list[Event]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        events: list[Event] = []
        for command in inbox:
            match command:
                case AddRequest(live):
                    self._live[live.lead.request_id] = live
                    self.scheduler.add(live.lead)
                case FailRequest(event):
                    self._forget(event.request_id)
                    events.append(event)
                case CancelRequest(request_id) if request_id in self._live:
                    events.extend(self._retire(self._live[request_id].lead, FinishReason.CANCELLED))
        return events

    def _choice(self, request: Request) -> _Choice:
        return self._live[request.request_id].choices[request.index]

    def _token_events(self, request: Request, now: float, num_tokens: int) -> list[Event]:
        """The events of the `num_tokens` tokens `request` just took, one each: its text,
        and its end if the scheduler retired it or its text reached a stop string (the
        tokens after that one are dropped). Runs for every request every step: kept lean."""
        choice = self._live[request.request_id].choices[request.index]
        detokenizer = choice.detokenizer
        logprobs = choice.logprobs or _NO_LOGPROBS
        output, times = request.output_token_ids, request.token_times
        if times:
            self._inter_token_s.append(now - times[-1])
        else:
            request.first_token_time = now
            self._first_token_s.append(now - request.arrival_time)
        events: list[Event] = []
        first = len(output) - num_tokens
        for position in range(first, first + num_tokens):
            if position > first:
                self._inter_token_s.append(0.0)  # accepted drafts: taken with the token before
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

    def _end_by_grammar(self, request: Request, grammar: GrammarState) -> None:
        """End a choice at a dead end of its grammar, or past its end (EOS ignored)."""
        if grammar.dead_end:
            self.scheduler.finish(request, FinishReason.GRAMMAR_DEAD_END)
        elif grammar.complete:
            self.scheduler.finish(request, FinishReason.STOP)

    def _choice_ended(self, request: Request) -> list[Event]:
        """A choice the scheduler has retired; its request's final event if it was the last."""
        live = self._live[request.request_id]
        self._end_choice(live.choices[request.index], request.finish_reason)
        if any(choice.end is None for choice in live.choices):
            return []
        return [self._request_final(live, request.finish_reason)]

    def _retire(
        self, request: Request, reason: FinishReason, error: str | None = None, error_code: ErrorCode | None = None
    ) -> list[Event]:
        """End `request`'s whole request (cancelled, expired, failed): every choice still
        going ends for `reason`. Returns its final event."""
        live = self._live[request.request_id]
        for choice in live.choices:
            if choice.end is None:
                if choice.request.status is not RequestStatus.FINISHED:
                    self.scheduler.finish(choice.request, reason)
                self._end_choice(choice, reason, error)
        return [self._request_final(live, reason, error, error_code)]

    @staticmethod
    def _end_choice(choice: _Choice, reason: FinishReason, error: str | None = None) -> None:
        detokenizer = choice.detokenizer
        tail = "" if detokenizer.stopped or error else detokenizer.flush()
        choice.end = ChoiceEnd(choice.request.index, reason, len(choice.request.output_token_ids), tail)

    def _request_final(
        self, live: _Live, reason: FinishReason, error: str | None = None, error_code: ErrorCode | None = None
    ) -> FinalEvent:
        """The final event of a request whose choices have all ended (`reason`: why the
        last one did); the engine forgets it."""
        requests = [choice.request for choice in live.choices]
        self._forget(requests[0].request_id)
        if len(live.choices) == 1:
            return self._final(requests, reason, live.choices[0].end.text, error, error_code)
        return self._final(requests, reason, "", error, error_code, tuple(choice.end for choice in live.choices))

    def _forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        with self._lock:
            self._known_ids.discard(request_id)

    @staticmethod
    def _final(
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


def _eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (loaded.model.generation_config.eos_token_id, loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)
