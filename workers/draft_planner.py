"""The scheduler's side of speculative decoding: which decoding requests verify draft tokens
in a step, how many, and what a verified step keeps.

The proposer, the per-request gate and the step-cost fit are `workers/speculative.py`'s.

**Budget.** Drafts are planned last in each step, once decodes and prompt chunks are: a
decoding request whose gate allows it (best queue key first) may extend its one-token
chunk with draft tokens from the proposer, as many as are likely enough to be accepted
to pay for the time they add to the step (the measured step cost), within the room the
scheduler's budgets leave (`max_decode_tokens` and `max_batch_tokens`, after everyone
else), and taking blocks only while more stay free than there are running requests
(each may need one next step). So under load speculation yields first: it never takes
another request's tokens or forces a preemption. The drafts' K/V slots are written by
the step; `settle` keeps the accepted ones and frees every block that held only
rejected ones.
"""

from __future__ import annotations

from workers.config import SpeculativeConfig
from workers.kv_cache import KVCacheManager
from workers.plan import ScheduledChunk, StepPlan
from workers.request import Request
from workers.speculative import (
    AcceptanceRecord,
    DraftGate,
    PromptLookup,
    Proposer,
    StepCost,
    TokenHistory,
    drafts_worth,
)


class DraftPlanner:
    def __init__(self, config: SpeculativeConfig, kv_cache: KVCacheManager, proposer: Proposer | None = None) -> None:
        """Drafts come from `proposer` (default: prompt lookup)."""
        self.config = config
        self.kv_cache = kv_cache
        self.proposer = proposer if proposer is not None else PromptLookup(config.min_ngram, config.max_ngram)
        self.step_cost = StepCost()  # what a step's tokens cost, as measured (drafts pay or not)
        self.acceptance = AcceptanceRecord()  # every request's drafts together

    def enroll(self, request: Request) -> None:
        """A new request speculates, unless a constraint or log probabilities would need
        every draft checked by the grammar or given its own."""
        params = request.params
        if not params.constrained and not params.wants_logprobs:
            request.draft_gate = DraftGate(self.config)
            request.history = TokenHistory()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` tokens took `seconds`: what decides whether drafts pay."""
        self.step_cost.observe(num_tokens, seconds)

    def plan(self, plan: StepPlan, room: int, num_running: int, step: int) -> None:
        """Extend the plan's decode chunks with drafts: `room` tokens at most, leaving a
        free block for each of the `num_running` requests."""
        if room <= 0:
            return
        # What a token adds to this step's time, against what each of its tokens is worth:
        # drafts less likely than that to be accepted cost more than they bring.
        share = self.step_cost.token_share(plan.num_tokens)
        overall = self.acceptance.estimate(prior=0.5)
        wanted = []  # (chunk's place in the plan, request, most drafts)
        for place, chunk in enumerate(plan.chunks):
            request = chunk.request
            gate, history = request.draft_gate, request.history  # both set by `enroll`
            if chunk.is_decode and gate is not None and history is not None:
                # The drafts and the token after them must fit in max_tokens.
                k = min(gate.draft_length(step), request.params.max_tokens - len(request.output_token_ids) - 1)
                if share is not None:
                    k = drafts_worth(gate.per_token.estimate(overall), share, k)
                if k > 0:
                    wanted.append((place, request, history, k))
        if not wanted:
            return
        wanted.sort(key=lambda entry: entry[1].queue_key)
        del wanted[room:]  # each takes a token at least
        histories = []
        for _, request, history, _ in wanted:
            if len(history.tokens) < request.num_tokens:
                history.tokens.extend(request.token_slice(len(history.tokens), request.num_tokens))
            histories.append(history)
        proposals = self.proposer.propose(histories, [k for *_, k in wanted])
        for (place, request, _, k), proposal in zip(wanted, proposals):
            fits = self.kv_cache.room(request, keep_free=num_running) - 1  # after the decode token
            draft = tuple(proposal[: min(k, room, fits)])
            if not draft:
                continue
            self.kv_cache.allocate(request, request.num_computed + 1 + len(draft), plan)
            chunk = plan.chunks[place]
            plan.chunks[place] = chunk._replace(
                token_ids=chunk.token_ids + draft, drafts=draft, block_tables=request.block_tables
            )
            room -= len(draft)
            if room == 0:
                break

    def settle(self, chunk: ScheduledChunk, accepted: int, step: int) -> bool:
        """Keep the first `accepted` drafts of a verified chunk as output, move the request
        past them and free the blocks that only rejected drafts were written to. False
        when a kept draft is a stop token: the output ends there, and the caller retires
        the request."""
        request = chunk.request
        kept = list(chunk.drafts[:accepted])
        stop = next((i for i, token in enumerate(kept) if token in request.stop_token_ids), None)
        if stop is not None:
            kept = kept[: stop + 1]
        request.output_token_ids.extend(kept)
        end = chunk.start + 1 + len(kept)
        self.kv_cache.register_full_blocks(request, chunk.start, end)
        request.num_computed = end
        if request.draft_gate is not None:  # it drafted, so it is enrolled
            request.draft_gate.record(step, len(chunk.drafts), accepted)
        self.acceptance.record(len(chunk.drafts), accepted)
        if stop is not None:
            return False
        self.kv_cache.truncate(request, end)
        return True
