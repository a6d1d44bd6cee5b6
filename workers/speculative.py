"""Speculative decoding: who drafts tokens, how many, and whether a request still may.

Plain Python over token ids, like the scheduler that calls it.

**Drafts** come from a `Proposer`. The one built in is `PromptLookup`: the request's own
prompt and output are its draft model. It finds the latest earlier occurrence of the
last n tokens (n from `max_ngram` down to `min_ngram`) and proposes the tokens that
followed it, so a request that copies from its input (extraction, quotes, code edits,
templates) gets its next tokens for the price of verifying them. A draft model would be
another `Proposer`: `propose` gets every request that may speculate this step at once,
so it can run one batched forward of a small model (on the runner's device, from its
own KV cache, which it rolls back itself) and return its greedy tokens; the scheduler
keeps deciding how many tokens each request may verify. A draft model's tokens are also
point masses (its greedy choice), so verification stays as it is; a sampled draft
distribution would need its probabilities passed to the verifier.

**Verification** (`verify`, called by the engine's step). A speculating request runs
its last token and its K drafts as one chunk, and the step returns logits at each of
them. The sampler draws at the first position as for any request; while the drawn token
equals the draft at that position, the draft is accepted and the next position is drawn
(with the request's own generator, one draw per position, as without speculation), up
to the position after the last draft. The last token drawn is the model's own next
token. Greedy, this keeps the longest prefix of drafts that the argmax agrees with.
Sampled, it is rejection sampling against a point-mass draft: a draft x is accepted
with probability p(x), and on rejection the token drawn is distributed as p with x
removed, renormalized (the residual max(p - q, 0)); so the output keeps the model's
distribution, and a seeded request draws the very tokens it draws without speculation.

**Gating** has two parts. The first is economic (`StepCost`, one per scheduler): a
draft token pays when the output it is expected to add is worth more than the time it
adds to the step. A step's time is fitted as `fixed + per_token * tokens` over recent
steps, so a step of N tokens gives each token `T(N) / N` of time, and one more token
costs `per_token`. A request's i-th draft is kept while it is accepted with probability
`p ** i` > `per_token * N / T(N)` (the share of the step's time that grows with its
tokens), `p` being the request's per-token acceptance (accepted drafts against the
rejections that ended them, decayed, lent the scheduler's overall figure while the
request has drafted little). Where one step's weights are read for many tokens, as in a
large batch, that share is near one and only sure drafts run; with a few requests it is
small and drafting pays even at modest acceptance.

The second part (`DraftGate`, one per request) keeps a request's K and pauses it. K
adapts to the request's recent acceptance: it grows by one after a step whose drafts
were all accepted, and falls to one more than
the accepted count after one that was not. Acceptance is the accepted share of drafted
tokens, decayed by `DECAY` each verified step; once `MIN_JUDGED` tokens have been
drafted since it (re)started and it is below the threshold, the request stops
speculating for a cool-down of
`cooldown_steps` steps, doubled after each pause that follows another (at most
`MAX_BACKOFF` times), and starts again from K = 1. A step whose whole draft (of two or
more tokens) is accepted forgets earlier pauses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from workers.config import SpeculativeConfig

# How much of a request's acceptance record a verified step keeps.
DECAY = 0.75
# Tokens a request must have drafted since it (re)started before it can be paused.
MIN_JUDGED = 4
# The longest cool-down is cooldown_steps * 2 ** MAX_BACKOFF.
MAX_BACKOFF = 3
# How much of the step-time fit a step keeps: about the last 50 steps count.
STEP_MEMORY = 0.98
# Steps' worth of evidence the fit needs, and the spread of their sizes (tokens, as a
# standard deviation), before it judges drafts; until then drafts run as the gate allows.
MIN_STEPS = 8.0
MIN_SPREAD = 1.0
# Verified drafts' worth of weight the scheduler's overall acceptance carries in a
# request's own estimate.
PRIOR_WEIGHT = 2.0


class Proposer(Protocol):
    """Drafts tokens for requests that may speculate this step."""

    def propose(self, histories: Sequence[TokenHistory], lengths: Sequence[int]) -> list[list[int]]:
        """Up to `lengths[i]` tokens to follow each history (fewer, or none, when it has no guess)."""
        ...


@dataclass(eq=False)
class TokenHistory:
    """A request's tokens so far (prompt, then output), as a proposer sees them, with an
    index of where each n-gram last occurred. The scheduler appends new tokens."""

    tokens: list[int] = field(default_factory=list)
    # n-gram -> the position just past its latest occurrence that is not the history's suffix.
    last_seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # positions whose n-grams ending there are in `last_seen`


class PromptLookup:
    """Prompt lookup (n-gram) drafts: the continuation of the suffix's latest earlier occurrence."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # longest match first

    def propose(self, histories: Sequence[TokenHistory], lengths: Sequence[int]) -> list[list[int]]:
        return [self._propose(history, k) for history, k in zip(histories, lengths)]

    def _propose(self, history: TokenHistory, k: int) -> list[int]:
        tokens, last_seen = history.tokens, history.last_seen
        end = len(tokens)
        # Index every n-gram that ends before the last token: the suffix itself never
        # matches, so a match always has at least one token after it.
        for stop in range(max(history.indexed, 1), end):
            for n in self.sizes:
                if stop >= n:
                    last_seen[tuple(tokens[stop - n : stop])] = stop
        history.indexed = max(history.indexed, end)
        for n in self.sizes:
            if end >= n:
                after = last_seen.get(tuple(tokens[end - n :]))
                if after is not None:
                    return tokens[after : after + k]
        return []


def verify(
    drafts: Sequence[Sequence[int]], token_ids: list[int], draw: Callable[[list[int], int], list[int]]
) -> list[int]:
    """Accept each chunk's drafts while the token drawn at a draft's position is that
    draft, drawing the next position's token in its place (see the module doc).

    `drafts[i]` are chunk i's drafts and `token_ids[i]` the token drawn at its first
    position; `draw(chunks, depth)` draws the token at position `depth` (0 is the first)
    of each of `chunks` (indices). `token_ids` ends holding each chunk's last token
    drawn. Returns how many of each chunk's drafts were accepted.
    """
    accepted = [0] * len(drafts)
    going = [i for i, chunk_drafts in enumerate(drafts) if chunk_drafts]
    depth = 0
    while going:
        going = [i for i in going if token_ids[i] == drafts[i][depth]]
        depth += 1
        if not going:
            break
        for i, token_id in zip(going, draw(going, depth)):
            token_ids[i] = token_id
            accepted[i] = depth
        going = [i for i in going if depth < len(drafts[i])]
    return accepted


class StepCost:
    """A step's time against its token count: a least-squares line over recent steps,
    each step weighing `STEP_MEMORY` times less than the next."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        m = STEP_MEMORY
        self._w = self._w * m + 1.0
        self._x = self._x * m + num_tokens
        self._y = self._y * m + seconds
        self._xx = self._xx * m + num_tokens * num_tokens
        self._xy = self._xy * m + num_tokens * seconds

    def token_share(self, num_tokens: int) -> float | None:
        """The share of a step of `num_tokens` tokens' time that grows with its tokens
        (`per_token * N / T(N)`, in [0, 1]); None while the fit has too little to go on."""
        w = self._w
        if w < MIN_STEPS or num_tokens < 1:
            return None
        mean_x = self._x / w
        variance = self._xx / w - mean_x * mean_x
        if variance < MIN_SPREAD * MIN_SPREAD:
            return None
        per_token = (self._xy / w - mean_x * self._y / w) / variance
        fixed = self._y / w - per_token * mean_x
        per_token, fixed = max(per_token, 0.0), max(fixed, 0.0)
        variable = per_token * num_tokens
        return variable / (fixed + variable) if variable > 0 else 0.0


def drafts_worth(acceptance: float, share: float, most: int) -> int:
    """How many leading drafts (at most `most`) each pay: the i-th while `acceptance ** i`
    exceeds `share`, the time a token adds against what a token of the step is worth."""
    count, reach = 0, acceptance
    while count < most and reach > share:
        count += 1
        reach *= acceptance
    return count


@dataclass(eq=False)
class AcceptanceRecord:
    """Per-token acceptance: drafts accepted against the rejections that ended a
    verification, decayed by `DECAY` each record."""

    accepted: float = 0.0
    rejected: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (accepted < drafted)

    def estimate(self, prior: float, prior_weight: float = PRIOR_WEIGHT) -> float:
        """The chance a draft is accepted, given the one before it was, leaning on `prior`
        while this record is thin."""
        return (self.accepted + prior * prior_weight) / (self.accepted + self.rejected + prior_weight)


@dataclass(eq=False)
class DraftGate:
    """One request's speculation state: how many tokens it drafts next, and whether it is
    paused for low acceptance (see the module doc)."""

    config: SpeculativeConfig
    k: int = 1
    drafted: float = 0.0  # decayed totals
    accepted: float = 0.0
    since_start: int = 0  # tokens drafted since it last (re)started
    paused_until: int = 0  # the first step it may speculate again
    backoff: int = 0  # pauses in a row
    # Totals over the request's life, for its acceptance figures.
    total_drafted: int = 0
    total_accepted: int = 0
    per_token: AcceptanceRecord = field(default_factory=AcceptanceRecord)

    def draft_length(self, step: int) -> int:
        """Tokens it may draft in `step`: 0 while paused."""
        return 0 if step < self.paused_until else self.k

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 1.0

    def record(self, step: int, drafted: int, accepted: int) -> None:
        """`drafted` tokens were verified in `step` and the first `accepted` of them kept."""
        self.total_drafted += drafted
        self.total_accepted += accepted
        self.per_token.record(drafted, accepted)
        self.drafted = self.drafted * DECAY + drafted
        self.accepted = self.accepted * DECAY + accepted
        self.since_start += drafted
        config = self.config
        if accepted == drafted:
            self.k = min(config.max_draft_tokens, drafted + 1)
            if drafted >= 2:
                self.backoff = 0
        else:
            self.k = accepted + 1
        if self.since_start >= MIN_JUDGED and self.acceptance < config.acceptance_threshold:
            self.paused_until = step + 1 + config.cooldown_steps * 2**self.backoff
            self.backoff = min(self.backoff + 1, MAX_BACKOFF)
            self.k, self.drafted, self.accepted, self.since_start = 1, 0.0, 0.0, 0
