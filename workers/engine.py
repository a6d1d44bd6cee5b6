"""The engine: add requests, cancel them, and step.

`step()` runs one phase after another, as vLLM's `EngineCore.step` does: drain the
inbox (new requests, cancels) and end the requests past their deadline; schedule (the
scheduler picks this step's tokens); execute (the model runner runs one forward over
them); sample a token for every request that reached the end of its known tokens, or
verify its drafts (`workers/speculative.py`); update (the scheduler moves each request
on and retires the finished ones, their blocks freed at once); and make the outputs
(`workers/outputs.py`: detokenized text, stop strings, timings), one token event per
token.

`add_request` and `cancel` may be called from another thread than `step` (the async
front end steps in a worker thread): they only validate (`workers/validation.py`) and
post a command (`AddRequest`, `CancelRequest`, `FailRequest`) to an inbox that the next
step drains.

Multi-LoRA (`LoRAConfig`): the adapters of `lora_dir` are loaded at start (a bad one stops
the start, `gpu.lora.BadAdapter`); `load_adapter` registers one more from any thread: it
reads and checks the adapter on the caller's thread and posts it (`AddAdapter`), so the
model's slots change only between steps, before any request that names it runs.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu.lora import LoRASlots
from workers import kv_handoff
from workers.adapters import adapter_folders, cache_root
from workers.api import ErrorCode, Event, FinishReason, GenerationRequest, InvalidRequest, TopLogprob
from workers.block_pool import BlockPool
from workers.config import EngineConfig
from workers.engine_commands import AddAdapter, AddRequest, CancelRequest, Command, FailRequest
from workers.length_predictor import policy_predictor
from workers.logprobs import log_probs, token_logprobs
from workers.model_loader import LoadedModel, load_model
from workers.model_runner import ModelRunner, StepOutput
from workers.outputs import OutputProcessor, final_event
from workers.plan import ScheduledChunk, StepPlan
from workers.request import Request, RequestStatus
from workers.sampler import Sampler
from workers.scheduler import Scheduler
from workers.speculative import verify
from workers.step_stats import EngineStats, StepRecord, step_record
from workers.structured import Grammars, InvalidGrammar
from workers.thread_budget import ThreadBudget, adapts
from workers.validation import Limits, RequestValidator, UnknownAdapter, arrival_time

if TYPE_CHECKING:
    from gpu.kv_transfer import HandoffArena

_log = logging.getLogger("inflight.engine")


def effective_context(model_context: int, configured: int) -> int:
    """The longest request served: the model's own context, or `configured` below it."""
    if configured > model_context:
        raise ValueError(f"max_context {configured} exceeds the model's context of {model_context} tokens")
    return configured or model_context


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_context = effective_context(loaded.max_context, config.model.max_context)
        self.vocab_size = loaded.model.config.vocab_size
        self.runner = ModelRunner(loaded.model, config.cache, model_config=config.model, lora=config.lora)
        model = config.model
        # With --threads 0, one torch thread per core that other processes leave free.
        adapting = adapts(model.threads, model.tensor_parallel, self.runner.device.type)
        self.thread_budget = ThreadBudget() if adapting else None
        self.block_size = config.cache.block_size
        windows = self.runner.kv_cache.layout.windows
        # A sliding window's table names the null block where blocks left the window.
        self.allocator = BlockPool(self.runner.kv_cache.num_blocks, keep_null=any(w is not None for w in windows))
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
            length_predictor=policy_predictor(config.scheduler, config.model, lambda: _embeddings(loaded)),
            windows=windows,
            max_loras=config.lora.max_loras if self.runner.lora is not None else None,
        )
        self.sampler = Sampler()
        self.eos_token_ids = _eos_token_ids(loaded)
        self.grammars = Grammars(
            self.tokenizer, self.vocab_size, self.eos_token_ids, config.structured.grammar_cache_size
        )
        limits = Limits(
            self.vocab_size,
            self.max_context,
            config.scheduler.max_running_requests,
            self.scheduler.kv_cache.most_tokens(),
        )
        # The loaded LoRA adapters' cache roots by name (`workers/adapters.py`); changed under the lock.
        self._adapter_roots: dict[str, bytes] = {}
        self.validator = RequestValidator(
            self.tokenizer, limits, self.grammars, self.eos_token_ids, self._adapter_roots
        )
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.grammars, self._release_id)
        self._lock = threading.Lock()  # guards the inbox, the set of known ids and the adapters' names
        self._inbox: list[Command] = []
        self._known_ids: set[str] = set()
        # Called at the end of every step, in the stepping thread; must be quick.
        self.observer: Callable[[EngineStats], None] | None = None
        # Disaggregated serving, prefill side: where the prompts of requests that end with
        # `handoff` are staged (`gpu/kv_transfer.py:HandoffArena`); None stages nothing.
        self.handoff_arena: HandoffArena | None = None
        # Prompt tokens staged per handed-off request id, until the caller `take_staged`s it.
        self._staged: dict[str, int] = {}
        if self.runner.lora is not None and config.lora.lora_dir is not None:
            for name, folder in adapter_folders(config.lora.lora_dir).items():
                adapter = self.runner.lora.read(name, folder)  # BadAdapter: the engine does not start
                self.runner.lora.add(name, folder, adapter)
                self._adapter_roots[name] = cache_root(adapter)

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
        arrival = arrival_time(request.arrived_at)
        with self._lock:
            if request.request_id in self._known_ids:
                raise InvalidRequest(f"request id {request.request_id!r} is already in use")
            self._known_ids.add(request.request_id)
        try:
            choices = self.validator.requests(request, arrival)
        except InvalidRequest as error:
            empty = Request(request.request_id, [], request.params, arrival)
            code = ErrorCode.INVALID_REQUEST
            if isinstance(error, InvalidGrammar):
                code = ErrorCode.INVALID_GRAMMAR
            elif isinstance(error, UnknownAdapter):
                code = ErrorCode.UNKNOWN_ADAPTER
            self._post(FailRequest(final_event([empty], FinishReason.ERROR, error=str(error), error_code=code)))
            return
        state = self.outputs.new_request(choices)
        going = [choice.request for choice in state.choices if choice.end is None]
        last_end = state.choices[-1].end
        if not going and last_end is not None:  # a takeover of a request whose every choice had ended
            self._post(FailRequest(self.outputs.request_final(state, last_end.finish_reason)))
            return
        state.lead, *forks = going
        state.lead.forks = forks
        for fork in forks:
            fork.status = RequestStatus.FORKING
        self._post(AddRequest(state, request.prompt_kv))

    def load_adapter(self, name: str, folder: str | Path) -> None:
        """Register the PEFT LoRA adapter in `folder` as `name` (replacing an adapter of
        that name), for requests that name it from now on; callable from any thread. It is
        read and checked here; the slots take it between steps. Raises `BadAdapter` (one
        line) for an adapter this model cannot serve, ValueError without multi-LoRA."""
        slots = self._lora_slots()
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        adapter = slots.read(name, folder)
        root = cache_root(adapter)
        with self._lock:  # named and posted together: a request naming it is posted after it
            self._adapter_roots[name] = root
            self._inbox.append(AddAdapter(name, Path(folder), adapter))

    @property
    def adapters(self) -> list[str]:
        """The names of the LoRA adapters requests may name, sorted."""
        with self._lock:
            return sorted(self._adapter_roots)

    def take_staged(self, request_id: str) -> int:
        """How many prompt tokens of a request that ended with `handoff` were staged in
        the handoff arena under its id (0: none; the decode side computes the prompt)."""
        with self._lock:
            return self._staged.pop(request_id, 0)

    def cancel(self, request_id: str) -> None:
        self._post(CancelRequest(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_unfinished()

    def step(self) -> list[Event]:
        """One step, a call per phase; returns the events it made."""
        if self.thread_budget is not None:
            self.thread_budget.adjust()  # fewer threads while other processes keep cores busy
        started = time.perf_counter()
        self.outputs.new_step()
        events = self._drain_inbox() + self._expire(started)
        plan = self.scheduler.schedule()
        record = None
        if plan.has_work:
            num_swapped_out = sum(1 for r in plan.preempted if r.status is RequestStatus.SWAPPED)  # as planned
            sampling = [c for c in plan.chunks if c.samples]
            try:
                output = self._execute(plan)
                token_ids, num_accepted = self._sample(output.logits, sampling) if sampling else ([], [])
            except Exception as error:  # a failed step fails its requests, not the engine
                events += self._fail(plan, error)
            else:
                events += self._update(plan, sampling, token_ids, num_accepted, started)
                record = step_record(plan, output, sampling, num_accepted, num_swapped_out, started)
        self._observe(record)
        return events

    def stats(self, record: StepRecord | None = None) -> EngineStats:
        """Where requests and blocks stand now; call from the stepping thread."""
        census = self.scheduler.census()
        oldest = census.oldest_queued_arrival
        host = self.host_allocator
        outputs = self.outputs
        return EngineStats(
            record,
            census,
            0.0 if oldest is None else time.perf_counter() - oldest,
            self.allocator.num_used,
            self.allocator.num_blocks,
            host.num_used if host else 0,
            host.num_blocks if host else 0,
            self.scheduler.cache_stats(),
            tuple(outputs.queue_s),
            tuple(outputs.first_token_s),
            tuple(outputs.inter_token_s),
            tuple(outputs.length_outcomes),
        )

    # -- the phases of a step --------------------------------------------------------

    def _drain_inbox(self) -> list[Event]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        events: list[Event] = []
        for command in inbox:
            match command:
                case AddRequest(state, prompt_kv):
                    self.outputs.live[state.lead.request_id] = state
                    if prompt_kv is not None:
                        self._place_prompt_kv(state.lead, prompt_kv)
                    self.scheduler.add(state.lead)
                    events.extend(self._refuse_unmeetable(state.lead))
                case FailRequest(event):
                    self.outputs.forget(event.request_id)
                    events.append(event)
                case CancelRequest(request_id) if request_id in self.outputs.live:
                    events.extend(self.outputs.retire(self.outputs.live[request_id].lead, FinishReason.CANCELLED))
                case AddAdapter(name, folder, adapter):
                    self._lora_slots().add(name, folder, adapter)
        return events

    def _lora_slots(self) -> LoRASlots:
        if self.runner.lora is None:
            raise ValueError("multi-LoRA is off: start the engine with a lora_dir (--lora-dir)")
        return self.runner.lora

    def _place_prompt_kv(self, request: Request, prompt_kv: torch.Tensor) -> None:
        try:
            host = self.runner.host_pool
            kv_handoff.place(
                self.scheduler.kv_cache, self.runner.kv_cache.blocks, host.blocks if host else None, request, prompt_kv
            )
        except ValueError:  # another model's or dtype's K/V: compute the prompt instead
            _log.warning("prompt K/V of %s does not fit this pool; computing it", request.request_id)

    def _stage_handoffs(self, finished: list[Request]) -> None:
        """Stage the prompts of the requests that just ended with `handoff`, before the
        next step reuses their blocks."""
        for request in finished:
            if request.finish_reason is FinishReason.HANDOFF and self.handoff_arena is not None:
                staged = kv_handoff.stage(
                    self.scheduler.kv_cache, self.runner.kv_cache.blocks, request, self.handoff_arena
                )
                with self._lock:
                    self._staged[request.request_id] = staged

    def _refuse_unmeetable(self, request: Request) -> list[Event]:
        """End a request just queued whose deadline its predicted finish misses: at once,
        with `deadline_unmeetable`, rather than after running until it expires."""
        if request.deadline is None:
            return []
        now = time.perf_counter()
        wait_s = self.scheduler.predicted_finish_s(request)
        if wait_s is None or now + wait_s <= request.deadline:
            return []
        message = (
            f"its deadline is {request.deadline - now:.1f} s away and its predicted finish "
            f"{wait_s:.1f} s (queue ahead and predicted length at the measured step time)"
        )
        return self.outputs.retire(request, FinishReason.ERROR, message, ErrorCode.DEADLINE_UNMEETABLE)

    def _expire(self, now: float) -> list[Event]:
        """End the requests whose deadline has passed."""
        events: list[Event] = []
        for request in self.scheduler.expired(now):
            if request.request_id in self.outputs.live:
                events.extend(self.outputs.retire(request, FinishReason.DEADLINE))
        return events

    def _execute(self, plan: StepPlan) -> StepOutput:
        """Run the plan's block copies and forward; the scheduler learns whether the copies were made."""
        copied = False
        try:
            output = self.runner.execute(plan)
            copied = True
        finally:
            self.scheduler.swaps_done(plan, copied)
        return output

    def _sample(self, logits: torch.Tensor | None, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
        """A token for each sampling chunk, and how many of its drafts were accepted (the
        token follows them). `logits` has a row for each chunk and for each of its drafts."""
        if logits is None:  # the runner returns none only for a plan without chunks
            raise RuntimeError("a step with sampling chunks returned no logits")
        if not any(chunk.drafts for chunk in chunks):
            return self._sample_rows(logits, [c.request for c in chunks]), [0] * len(chunks)
        firsts, row = [], 0
        for chunk in chunks:
            firsts.append(row)
            row += 1 + len(chunk.drafts)
        token_ids = self._sample_rows(logits[firsts], [c.request for c in chunks])

        def draw(going: list[int], depth: int) -> list[int]:
            requests = [chunks[i].request for i in going]
            return self.sampler.sample(
                logits[[firsts[i] + depth for i in going]],
                [r.params for r in requests],
                [self.outputs.choice(r).generator for r in requests],
            )

        return token_ids, verify([c.drafts for c in chunks], token_ids, draw)

    def _sample_rows(self, logits: torch.Tensor, sampling: list[Request]) -> list[int]:
        """A token for each sampling row: log probabilities taken first (the model's own),
        then the constrained rows masked, then sampled; grammars take their tokens."""
        if all(r.params.argmax_only for r in sampling):
            return self.sampler.argmax(logits)  # most steps, at every size
        choices = [self.outputs.choice(r) for r in sampling]
        wanting = [row for row, r in enumerate(sampling) if r.params.wants_logprobs]
        logprobs = log_probs(logits, wanting) if wanting else None
        row_grammars = {row: choice.grammar for row, choice in enumerate(choices) if choice.grammar is not None}
        constrained = list(row_grammars)
        if constrained:
            self.grammars.apply(logits, constrained, list(row_grammars.values()))
        token_ids = self.sampler.sample(logits, [r.params for r in sampling], [c.generator for c in choices])
        if constrained:
            self.grammars.advance(list(row_grammars.values()), [token_ids[row] for row in constrained])
        if logprobs is not None:  # some rows want them
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

    def _fail(self, plan: StepPlan, error: Exception) -> list[Event]:
        """A step that failed ends the requests it ran, and those whose blocks it was
        moving (their K/V may be lost)."""
        message = f"model step failed: {type(error).__name__}: {error}"
        swapping = [r for r in plan.preempted if r.status is RequestStatus.SWAPPED] + plan.resumed
        failed = {id(r): r for r in [c.request for c in plan.chunks] + swapping}
        events: list[Event] = []
        for request in failed.values():
            if request.request_id in self.outputs.live:
                events.extend(self.outputs.retire(request, FinishReason.ERROR, message, ErrorCode.INTERNAL_ERROR))
        return events

    def _update(
        self,
        plan: StepPlan,
        sampling: list[ScheduledChunk],
        token_ids: list[int],
        num_accepted: list[int],
        started: float,
    ) -> list[Event]:
        """Move the requests on by the tokens they took, and make those tokens' events."""
        now = time.perf_counter()
        self.outputs.scheduled([c.request for c in plan.chunks], started)
        num_outputs = [len(c.request.output_token_ids) for c in sampling]
        took = self.scheduler.update_from_output(plan, token_ids, num_accepted)
        self._stage_handoffs(took)
        events: list[Event] = []
        for request, before in zip(took, num_outputs):
            events.extend(self.outputs.token_events(request, now, len(request.output_token_ids) - before))
        self.scheduler.observe_step(plan.num_tokens, time.perf_counter() - started)
        return events

    def _observe(self, record: StepRecord | None) -> None:
        if self.observer is not None:
            try:
                self.observer(self.stats(record))
            except Exception:  # metrics must never stop generation
                _log.exception("the step observer failed")

    # -- internals -----------------------------------------------------------------

    def _post(self, command: Command) -> None:
        with self._lock:
            self._inbox.append(command)

    def _release_id(self, request_id: str) -> None:
        with self._lock:
            self._known_ids.discard(request_id)


def _embeddings(loaded: LoadedModel) -> np.ndarray:
    weight = loaded.model.get_input_embeddings().weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{loaded.name}: the input embeddings hold no weight tensor")
    return weight.detach().float().cpu().numpy()


def _eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (loaded.model.generation_config.eos_token_id, loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)
